"""A local 3-master Redis Cluster for the conformance suite, started from ``redis-server``.

Reused when already running (the setup is idempotent); left running after the tests, since
starting it costs seconds and other runs may share it. Ports: AK_CLUSTER_PORTS or 7101-7103.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

PORTS = [int(p) for p in os.environ.get("AK_CLUSTER_PORTS", "7101,7102,7103").split(",")]
HOST = "127.0.0.1"
CLUSTER_URL = f"redis://{HOST}:{PORTS[0]}/0"
DATA_DIR = os.path.join(tempfile.gettempdir(), "aio-keuss-redis-cluster")


def _cli(port: int, *args: str, timeout: float = 10.0) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", HOST, "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.stdout + done.stderr


def _cluster_ok() -> bool:
    return all("cluster_state:ok" in _cli(port, "cluster", "info") for port in PORTS)


def _wait(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def start_redis_cluster() -> str | None:
    """Start (or reuse) the cluster; returns a skip reason or None."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        return "redis-server / redis-cli not installed"
    if _cluster_ok():
        return None
    os.makedirs(DATA_DIR, exist_ok=True)
    for port in PORTS:
        if "PONG" in _cli(port, "ping"):
            continue  # already started by an earlier run, maybe not joined yet
        subprocess.run(
            [
                "redis-server",
                "--port", str(port),
                "--bind", HOST,
                "--cluster-enabled", "yes",
                "--cluster-config-file", os.path.join(DATA_DIR, f"nodes-{port}.conf"),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "yes",
                "--dir", DATA_DIR,
                "--logfile", os.path.join(DATA_DIR, f"redis-{port}.log"),
            ],
            check=True,
            timeout=10,
        )  # fmt: skip
    if not _wait(lambda: all("PONG" in _cli(p, "ping") for p in PORTS), 10):
        return "cluster nodes did not start"
    if "cluster_known_nodes:1\r" in _cli(PORTS[0], "cluster", "info").replace("\n", "\r"):
        _cli(
            PORTS[0],
            "--cluster", "create", *(f"{HOST}:{p}" for p in PORTS),
            "--cluster-replicas", "0", "--cluster-yes",
            timeout=30,
        )  # fmt: skip
    if not _wait(_cluster_ok, 20):
        return "redis cluster did not reach cluster_state:ok"
    return None


def _redis_cluster(token: str) -> dict[str, Any]:
    return {"url": CLUSTER_URL, "prefix": f"akt-{token}", "cluster": True}


async def _drop_redis_cluster_prefix(options: dict[str, Any]) -> None:
    """Delete the test's keys on every master (SCAN only sees one node's keys)."""
    redis = importlib.import_module("redis.asyncio")
    for port in PORTS:
        client = redis.Redis(host=HOST, port=port)
        try:
            keys = [k async for k in client.scan_iter(match=options["prefix"] + ":*", count=1000)]
            for key in keys:  # one by one: keys of other slots cannot share a DEL
                await client.delete(key)
        finally:
            await client.aclose()
