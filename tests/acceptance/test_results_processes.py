"""Results across real processes: a worker subprocess keeps what its handler returns, and
``push_and_wait`` in this process gets it, on Redis (redis-oq) and PostgreSQL; long queue
names and ids (PostgreSQL's NOTIFY bound), a final failure, prefetch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from backends import POSTGRES_URL, REDIS_URL, _drop_redis_prefix, new_token

import aio_keuss

pytestmark = pytest.mark.timeout(180)

GUARD = 60.0

JOBS = textwrap.dedent(
    """
    def triple(message):
        if message.payload.get("fail"):
            raise ValueError("no " + str(message.payload["n"]))
        return {"n": message.payload["n"] * 3, "id": message.id}
    """
)

LONG_QUEUE = "q" * 128


@pytest.fixture(params=["redis-oq", "postgres"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, dict[str, str]]]:
    token = new_token()
    if request.param == "redis-oq":
        options = {"url": REDIS_URL, "prefix": f"akr-{token}"}
        yield request.param, options
        await _drop_redis_prefix(options)
    else:
        options = {"url": POSTGRES_URL, "schema": f"akr_{token}"}
        yield request.param, options
        connection = await asyncpg.connect(POSTGRES_URL)
        try:
            await connection.execute(f'drop schema if exists "{options["schema"]}" cascade')
        finally:
            await connection.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    (tmp_path / "jobs.py").write_text(JOBS)
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, options: dict[str, str], queue: str, *more: str) -> None:
        args = ["jobs:triple", "--backend", name, "--queue", queue, "--result-ttl", "60"]
        for key, value in options.items():
            args += ["--url", value] if key == "url" else ["--option", f"{key}={value}"]
        started.append(
            subprocess.Popen(
                [sys.executable, "-m", "aio_keuss", "worker", *args, *more],
                cwd=tmp_path,
                stdout=(tmp_path / "out.txt").open("ab"),
                stderr=subprocess.STDOUT,
            )
        )

    yield start
    print((tmp_path / "out.txt").read_text() if (tmp_path / "out.txt").exists() else "")
    for process in started:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize("queue", ["jobs", LONG_QUEUE])
async def test_push_and_wait_gets_a_worker_process_value(
    backend: tuple[str, dict[str, str]], spawn: Any, queue: str
) -> None:
    name, options = backend
    dead = ["--option", 'deadletter={"max_ko": 0}']
    spawn(name, options, queue, "--concurrency", "8", "--prefetch", "4", *dead)
    async with aio_keuss.connect(
        name, **options, poll_interval=600.0, deadletter={"max_ko": 0}
    ) as factory:
        q = await factory.queue(queue, result_ttl=60)
        # 780 bytes each in UTF-8: ten announced at once pass PostgreSQL's NOTIFY bound
        ids = [f"{chr(0x1D11E) * 190}{n:05d}" for n in range(40)]
        # waits with a poll_interval no test outlives: only the result signals end them
        got = await asyncio.gather(
            *(asyncio.wait_for(q.push_and_wait({"n": n}, id=ids[n]), GUARD) for n in range(40))
        )
        assert [g["n"] for g in got] == [3 * n for n in range(40)]
        assert [g["id"] for g in got] == ids
        with pytest.raises(aio_keuss.JobFailedError, match="ValueError: no 7"):
            await asyncio.wait_for(q.push_and_wait({"n": 7, "fail": True}), GUARD)
