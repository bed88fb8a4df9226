"""``aio-keuss worker --repeat ...`` (and ``[[repeat]]`` tables), run as a subprocess against
real servers.

Each test writes a handler module into its own directory and runs the command there with
its own Redis key prefix or PostgreSQL schema. Occurrences come every 0.5 s. Nothing here
asserts a time or a duration: the tests wait, with generous bounds, for what the workers
handled, what their /healthz says and how they exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from backends import (
    POSTGRES_URL,
    REDIS_URL,
    _drop_postgres_schema,
    _drop_redis_prefix,
    new_token,
)
from black_hole import Silent
from own_servers import free_port

import aio_keuss

pytestmark = pytest.mark.timeout(180)

WAIT = 60.0

JOBS = textwrap.dedent(
    """
    import asyncio, json, os, pathlib

    LOG = pathlib.Path(os.environ["JOBS_LOG"])

    async def note(message):
        with LOG.open("a") as log:
            row = {"id": message.id, "payload": message.payload, "headers": message.headers}
            log.write(json.dumps(row) + "\\n")
        if isinstance(message.payload, dict) and message.payload.get("hang"):
            await asyncio.sleep(3600)
    """
)


class Worker:
    """One ``aio-keuss worker`` process, its output (read as it comes) and the log of the
    messages its handler was given."""

    def __init__(self, directory: Path, *args: str, env: dict[str, str] | None = None) -> None:
        directory.mkdir(exist_ok=True)
        (directory / "jobs.py").write_text(JOBS)
        self.log = directory / "handled.jsonl"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "aio_keuss", "worker", *args],
            cwd=directory,
            env={**os.environ, "JOBS_LOG": str(self.log), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def handled(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def ids(self) -> list[str]:
        return [row["id"] for row in self.handled()]

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not condition():
            if self.process.poll() is not None:
                self.finish()
                pytest.fail(f"the worker exited early, before {what}:\n{self.output}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} in {WAIT} s:\n{self.output}")
            await asyncio.sleep(0.05)

    def finish(self, seconds: float = WAIT) -> int:
        self.process.wait(timeout=seconds)
        self._reader.join(timeout=seconds)
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.finish()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.kill()


BACKENDS = ["memory", "redis-oq", "postgres"]


@pytest.fixture
async def where(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(backend, connect options) of one test: its own prefix or schema, dropped after."""
    backend: str = request.param
    token = new_token()
    options: dict[str, Any] = {}
    if backend.startswith("redis"):
        options = {"url": REDIS_URL, "prefix": f"akr-{token}"}
    elif backend == "postgres":
        options = {"url": POSTGRES_URL, "schema": f"akr_{token}"}
    yield backend, options
    if backend.startswith("redis"):
        await _drop_redis_prefix(options)
    elif backend == "postgres":
        await _drop_postgres_schema(options)


def _args(backend: str, options: dict[str, Any]) -> list[str]:
    args = ["--backend", backend]
    for name, value in options.items():
        args += ["--url", value] if name == "url" else ["--option", f"{name}={value}"]
    return args


def _ticks(ids: list[str]) -> set[str]:
    return {i for i in ids if i.startswith("tick@")}


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


async def _healthz(port: int) -> dict[str, Any]:
    status, body = await asyncio.to_thread(_get, port, "/healthz")
    return json.loads(body) if status else {}


@pytest.mark.parametrize("where", BACKENDS, indirect=True)
async def test_a_worker_consumes_the_occurrences_of_its_own_repeat(
    tmp_path: Path, where: tuple[str, dict[str, Any]], workers: list[Worker]
) -> None:
    backend, options = where
    worker = Worker(
        tmp_path,
        "jobs:note",
        *_args(backend, options),
        "--queue", "jobs",
        "--repeat", 'jobs tick every=0.5 {"n": 1}',
    )  # fmt: skip
    workers.append(worker)
    await worker.until(lambda: len(_ticks(worker.ids())) >= 3, "3 occurrences handled")
    worker.process.send_signal(signal.SIGTERM)
    assert worker.finish() == 0, worker.output
    assert f"repeating 'tick' on jobs (every 0.5 s) on {backend}" in worker.output
    rows = worker.handled()
    assert len({row["id"] for row in rows}) == len(rows)  # none handled twice
    for row in rows:
        assert row["payload"] == {"n": 1} and row["headers"]["repeat"] == "tick"


@pytest.mark.parametrize("where", ["redis-oq", "postgres"], indirect=True)
async def test_two_workers_with_the_same_repeat_deliver_each_occurrence_once(
    tmp_path: Path, where: tuple[str, dict[str, Any]], workers: list[Worker]
) -> None:
    backend, options = where
    args = [
        "jobs:note",
        *_args(backend, options),
        "--queue", "jobs",
        "--repeat", "jobs tick every=0.5",
    ]  # fmt: skip
    first, second = Worker(tmp_path / "a", *args), Worker(tmp_path / "b", *args)
    workers += [first, second]
    for worker in (first, second):
        await worker.until(lambda w=worker: "repeating 'tick'" in w.output, "repeat started")
    both = len(_ticks(first.ids() + second.ids()))  # from here on both push every occurrence
    await first.until(
        lambda: len(_ticks(first.ids() + second.ids())) >= both + 6, "6 more occurrences"
    )
    for worker in (first, second):
        worker.process.send_signal(signal.SIGTERM)
    assert first.finish() == 0, first.output
    assert second.finish() == 0, second.output
    # each occurrence by its time, not its id: ids that differed between the processes
    # would defeat the dedup, and be unique all the same
    times = [row["headers"]["scheduled"] for row in first.handled() + second.handled()]
    async with aio_keuss.connect(backend, **options) as factory:  # and what is left queued
        q = await factory.queue("jobs")
        deadline = time.monotonic() + WAIT
        while await q.total_size():
            assert time.monotonic() < deadline
            message = await q.pop(timeout=1.0)
            if message is not None:
                times.append(message.headers["scheduled"])
    assert len(times) == len(set(times)), f"an occurrence came twice: {sorted(times)}"


@pytest.mark.parametrize("where", ["redis-oq"], indirect=True)
async def test_sigterm_stops_the_repeat_at_once_and_the_worker_exits_0(
    tmp_path: Path, where: tuple[str, dict[str, Any]], workers: list[Worker]
) -> None:
    """The repeat stops when the stop begins, not when the grace ends: a handler holds the
    worker in a long grace meanwhile, and /healthz shows the repeat stopped."""
    backend, options = where
    port = free_port()
    worker = Worker(
        tmp_path,
        "jobs:note",
        *_args(backend, options),
        "--queue", "jobs",
        "--repeat", 'jobs tick every=0.5 {"hang": true}',
        "--grace", "600",
        "--health-port", str(port),
    )  # fmt: skip
    workers.append(worker)
    await worker.until(lambda: len(worker.ids()) >= 1, "an occurrence handled")
    body = await _healthz(port)
    assert body["repeats"][0]["state"] == "running" and body["consumers"][0]["in_flight"] == 1
    worker.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + WAIT
    while (await _healthz(port))["repeats"][0]["state"] != "stopped":
        assert time.monotonic() < deadline, worker.output
        await asyncio.sleep(0.05)
    body = await _healthz(port)
    assert worker.process.poll() is None and body["consumers"][0]["in_flight"] == 1
    worker.process.send_signal(signal.SIGTERM)  # skip the rest of the grace
    assert worker.finish() == 0, worker.output
    assert "Traceback" not in worker.output


@pytest.mark.parametrize("where", ["postgres"], indirect=True)
async def test_a_worker_that_only_schedules_from_a_config_file(
    tmp_path: Path, where: tuple[str, dict[str, Any]], workers: list[Worker]
) -> None:
    """No handler and no queue: ``[[repeat]]`` tables (after ``[worker]``, where TOML puts
    them at the top) push for consumers elsewhere, here the test itself."""
    backend, options = where
    config = tmp_path / "worker.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [worker]
            backend = "{backend}"
            url = "{options["url"]}"
            [worker.options]
            schema = "{options["schema"]}"

            [[repeat]]
            queue = "reports"
            key = "nightly"
            cron = "30 2 * * mon-fri"
            tz = "Europe/Madrid"
            payload = {{kind = "report"}}
            headers = {{team = "ops"}}

            [[repeat]]
            queue = "ticks"
            key = "tick"
            every = 0.5
            """
        )
    )
    worker = Worker(tmp_path, "--config", str(config))
    workers.append(worker)
    async with aio_keuss.connect(backend, **options) as factory:
        ticks, reports = await factory.queue("ticks"), await factory.queue("reports")
        got: set[str] = set()
        deadline = time.monotonic() + WAIT
        while len(got) < 2:
            assert time.monotonic() < deadline and worker.process.poll() is None, worker.output
            message = await ticks.pop(timeout=1.0)
            if message is not None:
                got.add(message.id)
        (queued,) = await reports.peek(10, state="scheduled")  # the next one, waiting
        message = queued.message
        assert message.payload == {"kind": "report"}
        assert message.headers["team"] == "ops" and message.headers["repeat"] == "nightly"
        at = datetime.fromisoformat(str(message.headers["scheduled"]))
        assert message.id == f"nightly@{round(at.timestamp() * 1000)}"
        local = at.astimezone(ZoneInfo("Europe/Madrid"))
        assert (local.hour, local.minute, local.second) == (2, 30, 0) and local.weekday() < 5
    worker.process.send_signal(signal.SIGTERM)
    assert worker.finish() == 0, worker.output
    assert "consuming" not in worker.output and "repeating 'nightly' on reports" in worker.output


BAD_FLAGS = [
    (["--repeat", "jobs k 61 * * * *"], "minute field '61'"),
    (["--repeat", "jobs k 0 3 * *"], "a cron schedule has five fields, not 4"),
    (["--repeat", "jobs k @daily tz=Nowhere/Town"], "not a known IANA time zone"),
    (["--repeat", 'jobs k every=1 {"x": NaN}'], "NaN"),
    (["--repeat", "jobs k every=1 {x: 1}"], "is not JSON"),
    (["--repeat", "jobs k every=0"], "every must be a number of seconds in"),
    (["--repeat", "jobs"], "a queue, a key and a schedule are needed"),
    (["--repeat", "jobs k every=1", "--repeat", "jobs k @daily"], "given twice"),
]


@pytest.mark.parametrize(("flags", "says"), BAD_FLAGS)
@pytest.mark.parametrize("handler", [True, False], ids=["consuming", "only-scheduling"])
def test_a_bad_repeat_flag_exits_2_before_connecting(
    tmp_path: Path, flags: list[str], says: str, handler: bool
) -> None:
    """Against a port where nothing listens: a check made after connecting would exit 3."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    consume = ["jobs:note", "--queue", "jobs"] if handler else []
    worker = Worker(tmp_path, *consume, "--backend", "redis-oq", "--url", url, *flags)
    assert worker.finish() == 2, worker.output
    assert says in worker.output, worker.output
    assert "Traceback" not in worker.output and "cannot reach" not in worker.output


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ('queue = "jobs"\nkey = "k"\n', "exactly one of every= (seconds) and cron="),
        ('queue = "jobs"\nkey = "k"\nevery = 1\ncron = "@daily"\n', "exactly one of every="),
        ('queue = "jobs"\nkey = "k"\ncron = "* * * * * *"\n', "cron expression"),
        ('queue = "jobs"\nkey = "k"\nevery = 1\nwhen = "now"\n', "unknown setting(s) ['when']"),
        ('queue = "jobs"\nkey = "k"\nevery = 1\npayload = 1979-05-27\n', "payload"),
    ],
)
def test_a_bad_repeat_table_exits_2_before_connecting(
    tmp_path: Path, table: str, says: str
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    config = tmp_path / "worker.toml"
    config.write_text(f'[worker]\nbackend = "redis-oq"\nurl = "{url}"\n[[repeat]]\n{table}')
    worker = Worker(tmp_path, "--config", str(config))
    assert worker.finish() == 2, worker.output
    assert says in worker.output, worker.output
    assert "Traceback" not in worker.output and "cannot reach" not in worker.output
    bad_env = Worker(  # and one line of AIO_KEUSS_REPEAT
        tmp_path,
        env={"AIO_KEUSS_BACKEND": "redis-oq", "AIO_KEUSS_URL": url,
             "AIO_KEUSS_REPEAT": "jobs k1 every=1\njobs k2 every=soon"},
    )  # fmt: skip
    assert bad_env.finish() == 2, bad_env.output
    assert "'every=soon' is not a number of seconds" in bad_env.output


@pytest.mark.parametrize("where", ["redis-list"], indirect=True)
async def test_a_backend_that_cannot_repeat_exits_2_having_consumed_nothing(
    tmp_path: Path, where: tuple[str, dict[str, Any]]
) -> None:
    backend, options = where
    async with aio_keuss.connect(backend, **options) as factory:
        await (await factory.queue("jobs")).push({"n": 0})
    worker = Worker(
        tmp_path,
        "jobs:note",
        *_args(backend, options),
        "--queue", "jobs",
        "--repeat", "jobs tick every=0.5",
    )  # fmt: skip
    assert worker.finish() == 2, worker.output
    assert "repeat 'tick' on queue 'jobs': backend 'redis-list' cannot repeat" in worker.output
    assert "Traceback" not in worker.output
    async with aio_keuss.connect(backend, **options) as factory:
        q = await factory.queue("jobs")
        assert await q.total_size() == 1 and worker.ids() == []


async def test_a_sigterm_while_connecting_with_repeats_stops_cleanly(tmp_path: Path) -> None:
    silent = Silent()
    await silent.start()
    url = f"redis://127.0.0.1:{silent.port}/0"
    worker = Worker(tmp_path, "--backend", "redis-oq", "--url", url, "--repeat", "q t every=1")
    try:
        await asyncio.wait_for(silent.accepted.wait(), WAIT)
        worker.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.finish) == 0, worker.output
        assert "stopped while connecting" in worker.output
    finally:
        await asyncio.to_thread(worker.kill)
        silent.close()
