"""How each system of the sitting is run: one function per system, each a subprocess (so no
system shares an event loop, a process or an interpreter with another) that returns rows.

A row is a dict: system, backend, scenario, clients, messages, seconds, rate (msgs/s).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PEERS_PYTHON = HERE / ".venv" / "bin" / "python"
Row = dict[str, Any]

OUR_BACKENDS = ("redis-list", "redis-oq", "redis-reliable", "postgres")
# Keuss has no reliable-list backend: aio-keuss's redis-reliable is set against Keuss's redis-oq,
# its closest (a reserve/commit queue on Redis).
KEUSS_FOR = {
    "redis-list": "redis-list",
    "redis-oq": "redis-oq",
    "redis-reliable": "redis-oq",
    "postgres": "postgres",
}
PEER_BACKENDS = {"saq": ("redis", "postgres"), "arq": ("redis",), "procrastinate": ("postgres",)}
# The same ~200-byte JSON document every system pushes (aio-keuss's bench payload).
PAYLOAD = {"id": 0, "user": "someone@example.com", "items": [1, 2, 3], "note": "x" * 120}
PG = ["-h", "127.0.0.1", "-p", "5432", "-U", "postgres"]
PG_DB = "test"


class SystemFailed(RuntimeError):
    """A system's subprocess exited non-zero; the sitting goes on without its rows."""


def _run(command: list[str], timeout: float = 900) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise SystemFailed(f"{' '.join(command[:4])} ... exited {done.returncode}:\n{tail}")
    return done.stdout


def _json_rows(text: str) -> list[Row]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run_ours(clients: str, messages: int, peer_messages: int) -> list[Row]:
    """aio-keuss's own bench, throughput rows only, on the interpreter running this sitting."""
    command = [sys.executable, "-m", "bench", "--backend", ",".join(OUR_BACKENDS)]
    command += ["--clients", clients, "--messages", str(messages), "--json", "--only"]
    rows = _json_rows(_run([*command, "throughput"]))
    keep = ("backend", "scenario", "clients", "messages", "seconds", "rate")
    return [{"system": "aio-keuss", **{k: r[k] for k in keep}} for r in rows]


def run_keuss(clients: str, messages: int, peer_messages: int) -> list[Row]:
    rows: list[Row] = []
    for backend in sorted(set(KEUSS_FOR.values())):
        command = ["node", str(HERE / "keuss_bench.js"), "--backend", backend]
        rows += _json_rows(_run([*command, "--clients", clients, "--messages", str(messages)]))
    return rows


def python_peer(peer: str) -> Callable[[str, int, int], list[Row]]:
    def run(clients: str, messages: int, peer_messages: int) -> list[Row]:
        rows: list[Row] = []
        for backend in PEER_BACKENDS[peer]:
            command = [str(PEERS_PYTHON), str(HERE / "python_peers.py"), "--peer", peer]
            command += ["--backend", backend, "--clients", clients]
            rows += _json_rows(_run([*command, "--messages", str(peer_messages)]))
        return rows

    return run


def _server_row(backend: str, scenario: str, messages: int, rate: float) -> Row:
    return {
        "system": "server",
        "backend": backend,
        "scenario": scenario,
        "clients": 3,
        "messages": messages,
        "seconds": round(messages / rate, 3),
        "rate": round(rate),
    }


def run_server_limits(clients: str, messages: int, peer_messages: int) -> list[Row]:
    """What the servers give 3 clients without pipelining, the ceiling a queue's push and pop
    approach: redis-benchmark LPUSH / RPOP on a key of ours, and pgbench INSERT and
    DELETE ... RETURNING (the oldest row, skipping locked ones) on a table in a schema of ours.
    Only ever 3 clients, whatever --clients says."""
    return _redis_limits(messages) + _postgres_limits(messages)


def _redis_limits(messages: int) -> list[Row]:
    """At least 50,000 requests each: at ~40,000 a second a shorter run is mostly noise."""
    messages = max(messages, 50_000)
    key = f"akpeers:redis-benchmark:{os.getpid()}"
    value = json.dumps(PAYLOAD, separators=(",", ":"))
    base = ["redis-benchmark", "-h", "127.0.0.1", "-p", "6379", "-c", "3", "-P", "1"]
    base += ["-n", str(messages), "-q"]
    rows = []
    try:
        for command in (["LPUSH", key, value], ["RPOP", key]):
            out = _run([*base, *command])
            rates = re.findall(r"([\d.]+) requests per second", out)
            if not rates:
                raise SystemFailed(f"redis-benchmark said: {out[-300:]!r}")
            rows.append(_server_row("redis", command[0], messages, float(rates[-1])))
    finally:
        subprocess.run(["redis-cli", "-h", "127.0.0.1", "DEL", key], capture_output=True)
    return rows


def _postgres_limits(messages: int) -> list[Row]:
    schema = "akpeers_pgbench"
    per_client = math.ceil(messages / 3)
    value = json.dumps(PAYLOAD).replace("'", "''")
    scripts = {
        "INSERT": f"INSERT INTO {schema}.q (payload) VALUES ('{value}');\n",
        "DELETE…RETURNING": (
            f"DELETE FROM {schema}.q WHERE id = (SELECT id FROM {schema}.q ORDER BY id LIMIT 1 "
            "FOR UPDATE SKIP LOCKED) RETURNING payload;\n"
        ),
    }
    psql = ["psql", *PG, "-d", PG_DB, "-q", "-v", "ON_ERROR_STOP=1", "-c"]
    table = f"CREATE TABLE {schema}.q (id bigserial PRIMARY KEY, payload jsonb NOT NULL)"
    _run([*psql, f"DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; {table}"])
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for scenario, script in scripts.items():
                path = Path(tmp) / "script.sql"
                path.write_text(script)
                command = ["pgbench", *PG, "-n", "-c", "3", "-t", str(per_client), "-f", str(path)]
                out = _run([*command, PG_DB])
                tps = re.search(r"tps = ([\d.]+)", out)
                if tps is None:
                    raise SystemFailed(f"pgbench said: {out[-300:]!r}")
                rows.append(_server_row("postgres", scenario, 3 * per_client, float(tps[1])))
    finally:
        subprocess.run([*psql, f"DROP SCHEMA IF EXISTS {schema} CASCADE"], capture_output=True)
    return rows


SYSTEMS: dict[str, Callable[[str, int, int], list[Row]]] = {
    "aio-keuss": run_ours,
    "keuss": run_keuss,
    "saq": python_peer("saq"),
    "arq": python_peer("arq"),
    "procrastinate": python_peer("procrastinate"),
    "server": run_server_limits,
}
