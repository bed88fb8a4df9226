"""``Queue.cancel`` of a message an ``aio-keuss worker`` subprocess is handling (redis-oq):
its handler is stopped in the other process, cleans up, and the message is done for good;
the worker counts it in /healthz and /metrics, and the admin command asks the same."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token
from own_servers import free_port

import aio_keuss
from aio_keuss import CancelResult

pytestmark = pytest.mark.timeout(180)

JOBS = textwrap.dedent(
    """
    import asyncio, os, pathlib

    LOG = pathlib.Path(os.environ["JOBS_LOG"])

    def note(kind, message):
        with LOG.open("a") as log:
            log.write(kind + " " + message.id + "\\n")

    async def hang(message):
        note("start", message)
        try:
            await asyncio.sleep(3600)
        finally:
            note("cleaned", message)
    """
)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"akc-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


def _events(log: Path, kind: str) -> list[str]:
    if not log.exists():
        return []
    return [line.split()[1] for line in log.read_text().splitlines() if line.split()[0] == kind]


async def _until_noted(process: subprocess.Popen[bytes], log: Path, kind: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(_events(log, kind)) < count:
        assert process.poll() is None, "the worker exited early"
        assert time.monotonic() < deadline, f"fewer than {count} {kind!r} in 60 s"
        await asyncio.sleep(0.05)


def _get(port: int, path: str) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return str(answer.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())
    except OSError:
        return ""


async def _health_says_cancelled(port: int, count: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        body = await asyncio.to_thread(_get, port, "/healthz")
        if body and json.loads(body)["consumers"][0]["cancelled"] >= count:
            break
        assert time.monotonic() < deadline, f"/healthz: {body}"
        await asyncio.sleep(0.1)
    metrics = await asyncio.to_thread(_get, port, "/metrics")
    assert f'aio_keuss_cancelled_total{{queue="jobs"}} {count}' in metrics


def _start_worker(directory: Path, log: Path, prefix: str, port: int) -> subprocess.Popen[bytes]:
    """The worker, running ``jobs:hang`` on the jobs queue with results kept."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "aio_keuss", "worker", "jobs:hang",
            "--backend", "redis-oq", "--url", REDIS_URL, "--option", f"prefix={prefix}",
            "--queue", "jobs", "--result-ttl", "60", "--health-port", str(port),
        ],
        cwd=directory,
        env={**os.environ, "JOBS_LOG": str(log)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


async def test_a_running_handler_in_a_worker_process_is_stopped(
    tmp_path: Path, prefix: str
) -> None:
    (tmp_path / "jobs.py").write_text(JOBS)
    log = tmp_path / "handled.log"
    port = free_port()
    process = _start_worker(tmp_path, log, prefix, port)
    try:
        async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
            q = await factory.queue("jobs", result_ttl=60)
            first, second = await q.push_many([{"n": 1}, {"n": 2}])
            await _until_noted(process, log, "start", 1)
            assert await q.cancel(first, reason="from afar") is CancelResult.REQUESTED
            await _until_noted(process, log, "cleaned", 1)
            found = await q.result(first, timeout=60)
            assert found is not None and found.error == "cancelled: from afar"
            await _until_noted(process, log, "start", 2)
            admin = await asyncio.to_thread(
                subprocess.run,
                [
                    sys.executable, "-m", "aio_keuss", "cancel", "jobs", second,
                    "--backend", "redis-oq", "--url", REDIS_URL, "--option", f"prefix={prefix}",
                ],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert admin.returncode == 0, admin.stdout + admin.stderr
            assert "requested" in admin.stdout
            await _until_noted(process, log, "cleaned", 2)
            await _health_says_cancelled(port, 2)
            assert await q.total_size() == 0
        assert _events(log, "start") == [first, second]  # neither ran again
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0, out.decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
