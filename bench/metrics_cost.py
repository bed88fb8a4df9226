"""`python -m bench.metrics_cost`: what metrics cost, in CPU time of the client per message.

Wall-clock rates swing by a factor of two or more on a shared machine; the CPU time this
process spends per message moves much less, and is what metrics add to. Each variant runs
in its own process (metrics are process-wide), rounds interleave the variants so that a
busy minute hurts them all alike, and the table shows the median and the spread per
variant: ``off`` (nothing enabled), ``on`` (``aio_keuss.enable_metrics()``) and ``otel``
(``aio_keuss.enable_opentelemetry`` with the SDK and an in-memory reader, nothing exported).
Operations: push, pop and reserve+ok by 3 concurrent clients, as in the main bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import aio_keuss

from .__main__ import DEFAULT_OPTIONS, PAYLOAD

VARIANTS = ("off", "on", "otel")
OPERATIONS = ("push", "pop", "reserve+ok")


def enable(variant: str) -> None:
    if variant == "on":
        aio_keuss.enable_metrics()
    elif variant == "otel":
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        aio_keuss.enable_opentelemetry(MeterProvider(metric_readers=[InMemoryMetricReader()]))


async def measure(backend: str, variant: str, messages: int, clients: int = 3) -> dict[str, float]:
    """CPU microseconds per message of each operation, in this process."""
    enable(variant)
    share = messages // clients
    found: dict[str, float] = {}
    async with aio_keuss.connect(backend, **DEFAULT_OPTIONS.get(backend, {})) as factory:
        q = await factory.queue(f"cost-{os.getpid()}-{time.time_ns()}")

        async def push() -> None:
            for _ in range(share):
                await q.push(PAYLOAD)

        async def pop() -> None:
            for _ in range(share):
                if await q.pop(timeout=10) is None:
                    raise RuntimeError("pop timed out")

        async def reserve_ok() -> None:
            for _ in range(share):
                message = await q.reserve(timeout=10)
                if message is None or not await q.ok(message):
                    raise RuntimeError("reserve timed out or ok failed")

        steps = (("push", push), ("pop", pop), (None, push), ("reserve+ok", reserve_ok))
        for name, work in steps:
            started = time.process_time()
            await asyncio.gather(*(work() for _ in range(clients)))
            if name is not None:
                found[name] = (time.process_time() - started) / (share * clients) * 1e6
    return found


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_cost", description=__doc__)
    parser.add_argument("--backend", default="memory")
    parser.add_argument("--messages", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one variant
    args = parser.parse_args()
    if args.one:
        print(json.dumps(asyncio.run(measure(args.backend, args.one, args.messages))))
        return
    results: dict[str, list[dict[str, float]]] = {}
    loads: list[float] = []
    variants = args.variants.split(",")
    for round_no in range(args.rounds):
        order = variants if round_no % 2 == 0 else variants[::-1]
        for variant in order:
            loads.append(os.getloadavg()[0])
            command = [sys.executable, "-m", "bench.metrics_cost", "--one", variant]
            command += ["--backend", args.backend, "--messages", str(args.messages)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results.setdefault(variant, []).append(json.loads(out))
            print(f"round {round_no + 1} {variant}: {out.strip()}", file=sys.stderr, flush=True)
    print(f"\n{args.backend}, {args.messages:,} messages, {args.rounds} rounds, CPU us/message")
    print(f"load average (1 min) during the runs: {min(loads):.2f} to {max(loads):.2f}")
    print(f"| variant | {' | '.join(OPERATIONS)} |")
    print("|---|" + "---|" * len(OPERATIONS))
    for variant, runs in results.items():
        cells: list[Any] = []
        for operation in OPERATIONS:
            values = sorted(run[operation] for run in runs)
            cells.append(f"{statistics.median(values):.1f} ({values[0]:.1f}-{values[-1]:.1f})")
        print(f"| {variant} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
