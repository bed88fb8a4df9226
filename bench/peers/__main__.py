"""`make bench-peers`: aio-keuss beside Keuss 2.0.6 (Node), saq, arq and procrastinate, and the
servers' own limits (redis-benchmark, pgbench), in one sitting on this machine.

Each repetition runs every system once, one after another, in an order rotated from one
repetition to the next (A B C, B C A, C A B, ...), so no system always runs first or last on a
machine whose load drifts. Rows: push, pop and reserve+ok (Keuss: pop with reserve, then ok)
with 3 and with 32 concurrent clients, as in Keuss's published benchmark; for the Python job
queues, enqueue N no-op jobs and process them with their own worker at the same concurrency.
The load average is read before and after every repetition; read the figures with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

from bench.peers.report import print_tables
from bench.peers.systems import PEERS_PYTHON, SYSTEMS, Row, SystemFailed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__)
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument(
        "--messages",
        type=int,
        default=10_000,
        help="messages per row for aio-keuss, Keuss and the server limits (default 10,000)",
    )
    parser.add_argument(
        "--peer-messages",
        type=int,
        help="jobs per row for saq, arq and procrastinate, whose PostgreSQL workers run a few "
        "hundred jobs/s (default: --messages / 5)",
    )
    parser.add_argument("--clients", default="3,32", help="client counts, comma-separated")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"systems to run, comma-separated (default: all of {', '.join(SYSTEMS)})",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every raw row to FILE")
    args = parser.parse_args()
    if args.peer_messages is None:
        args.peer_messages = max(args.messages // 5, 100)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    return args


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def versions() -> dict[str, str]:
    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    pinned = {"keuss": "2.0.6", "node": node, "python": platform.python_version()}
    if PEERS_PYTHON.exists():
        freeze = subprocess.run(
            [str(PEERS_PYTHON), "-m", "pip", "freeze"], capture_output=True, text=True
        ).stdout
        for line in freeze.splitlines():
            name, _, version = line.partition("==")
            if name.lower() in ("saq", "arq", "procrastinate"):
                pinned[name.lower()] = version
    return pinned


def main() -> None:
    args = parse_args()
    systems = args.systems.split(",")
    clients = [int(c) for c in args.clients.split(",")]
    started = datetime.now(UTC)
    meta: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "host": platform.node(),
        "cores": os.cpu_count(),
        "reps": args.reps,
        "messages": args.messages,
        "peer_messages": args.peer_messages,
        "clients": clients,
        "versions": versions(),
    }
    progress(f"bench-peers {meta['date']}: {args.reps} reps, {args.messages:,} messages "
             f"({args.peer_messages:,} for the job queues), clients {args.clients}")  # fmt: skip
    rows: list[Row] = []
    reps: list[dict[str, Any]] = []
    failures: list[str] = []
    for rep in range(args.reps):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        record: dict[str, Any] = {"rep": rep + 1, "order": order, "load_before": load()}
        began = time.monotonic()
        progress(f"rep {rep + 1}/{args.reps}: {' '.join(order)}; load {record['load_before']}")
        for system in order:
            t0 = time.monotonic()
            try:
                got = SYSTEMS[system](args.clients, args.messages, args.peer_messages)
            except (SystemFailed, subprocess.TimeoutExpired) as failed:
                failures.append(f"rep {rep + 1} {system}: {failed}")
                progress(f"  {system}: FAILED\n{failed}")
                continue
            rows += [{**row, "rep": rep + 1} for row in got]
            progress(f"  {system}: {len(got)} rows in {time.monotonic() - t0:.1f} s")
        record["load_after"] = load()
        record["seconds"] = round(time.monotonic() - began, 1)
        reps.append(record)
    elapsed = (datetime.now(UTC) - started).total_seconds()

    print(
        f"\nbench-peers — {meta['date']} ({elapsed / 60:.1f} min), {meta['host']}, "
        f"{meta['cores']} cores; {args.messages:,} messages per row "
        f"({args.peer_messages:,} for saq / arq / procrastinate), {args.reps} reps"
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    for record in reps:
        print(
            f"rep {record['rep']}: load {record['load_before']} -> {record['load_after']} "
            f"(1/5/15 min), {record['seconds']} s, order {' '.join(record['order'])}"
        )
    print_tables(rows, clients)
    for failure in failures:
        print(f"\nFAILED {failure}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**meta, "repetitions": reps, "failures": failures, "rows": rows}, out,
                      indent=1)  # fmt: skip
        progress(f"raw rows written to {args.json}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
