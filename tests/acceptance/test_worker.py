"""The ``aio-keuss worker`` command, run as a subprocess against real servers.

Each test writes a small handler module into its own directory, runs the command there with
its own key prefix, and signals it as an orchestrator would. The only time bound asserted is
the one the command promises: a stop ends within ``grace`` + 1 s (with a grace long enough
that a busy machine cannot miss it by accident).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token
from black_hole import Silent
from own_servers import free_port, own_redis

import aio_keuss
from aio_keuss.registry import load_backend
from aio_keuss.worker import cli
from aio_keuss.worker import run as worker_run

pytestmark = pytest.mark.timeout(180)

JOBS = textwrap.dedent(
    """
    import asyncio, atexit, json, logging, os, pathlib, threading, time

    LOG = pathlib.Path(os.environ["JOBS_LOG"])

    for name in ("ATEXIT_WAIT", "LEFT_WAIT"):  # a test's own bounds on the worker's exit
        if f"JOBS_{name}" in os.environ:
            import aio_keuss.worker.loop
            setattr(aio_keuss.worker.loop, name, float(os.environ[f"JOBS_{name}"]))

    def note(kind, message):
        with LOG.open("a") as log:
            log.write(json.dumps({"kind": kind, "n": message.payload["n"]}) + "\\n")

    if "JOBS_HOLD_HEALTH_CLOSE" in os.environ:
        # the worker's end, once its signal handlers are removed, held open: the health
        # server's close notes that it began, then waits
        from aio_keuss.worker import health

        async def held_close(self, close=health.HealthServer.close):
            with LOG.open("a") as log:
                log.write(json.dumps({"kind": "health-closing", "n": 0}) + "\\n")
            await asyncio.sleep(3600)
            await close(self)

        health.HealthServer.close = held_close

    async def slow(message):
        note("start", message)
        await asyncio.sleep(message.payload["sleep"])
        note("done", message)

    async def hang(message):
        note("start", message)
        await asyncio.sleep(3600)

    async def stubborn(message):
        # swallows every cancellation: never ends
        # atexit runs hooks last registered first: one that never returns, then one that
        # notes it ran (an exporter's flush)
        atexit.register(threading.Event().wait)
        atexit.register(note, "atexit", message)
        note("start", message)
        with LOG.open("a") as log:
            log.write(json.dumps({"kind": "id", "n": message.id}) + "\\n")
        while True:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                note("cancelled", message)

    async def relents(message):
        # swallows the stop's cancellation and the one after ACK_WAIT, then ends as soon as
        # its consumer abandoned it
        abandoned = asyncio.Event()

        class Seen(logging.Handler):
            def emit(self, record):
                if "abandoned running" in record.getMessage():
                    abandoned.set()

        logging.getLogger("aio_keuss.consumer").addHandler(Seen())
        note("start", message)
        while not abandoned.is_set():
            try:
                await abandoned.wait()
            except asyncio.CancelledError:
                note("cancelled", message)
        note("ended", message)

    lingering = set()

    async def linger(message):
        # swallows every cancellation: never ends
        while True:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                note("cancelled", message)

    async def spawns(message):
        # returns at once, leaving a task of its own that never ends (found only as the
        # loop ends), and atexit hooks as stubborn's
        atexit.register(threading.Event().wait)
        atexit.register(note, "atexit", message)
        task = asyncio.get_running_loop().create_task(linger(message))
        lingering.add(task)
        note("done", message)

    async def blocked(message):
        # cancelled, its await ends but not the thread, which sleeps on
        note("start", message)
        await asyncio.to_thread(time.sleep, 3600)

    def triple(message):
        return message.payload["n"] * 3

    class nested:
        @staticmethod
        async def handle(message):
            note("done", message)
    """
)


class Worker:
    """One ``aio-keuss worker`` process and the log its handlers write."""

    def __init__(
        self,
        directory: Path,
        *args: str,
        env: dict[str, str] | None = None,
        command: tuple[str, ...] = ("-m", "aio_keuss", "worker"),
    ) -> None:
        self.log = directory / "handled.jsonl"
        self.process = subprocess.Popen(
            [sys.executable, *command, *args],
            cwd=directory,
            env={**os.environ, "JOBS_LOG": str(self.log), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.output = ""

    def events(self, kind: str) -> list[int]:
        if not self.log.exists():
            return []
        rows = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [row["n"] for row in rows if row["kind"] == kind]

    def wait_for(self, kind: str, count: int, seconds: float = 60.0) -> None:
        deadline = time.monotonic() + seconds
        while len(self.events(kind)) < count:
            if self.process.poll() is not None:
                self.finish()
                pytest.fail(f"the worker exited early:\n{self.output}")
            if time.monotonic() > deadline:
                pytest.fail(f"fewer than {count} {kind!r} events in {seconds} s")
            time.sleep(0.02)

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    def finish(self, seconds: float = 60.0) -> int:
        out, _ = self.process.communicate(timeout=seconds)
        self.output += out.decode(errors="replace")
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.finish()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "jobs.py").write_text(JOBS)
    return tmp_path


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"akw-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.kill()


async def _push(prefix: str, payloads: list[dict[str, Any]], url: str = REDIS_URL) -> None:
    async with aio_keuss.connect("redis-oq", url=url, prefix=prefix) as factory:
        await (await factory.queue("jobs")).push_many(payloads)


async def _left(prefix: str) -> tuple[int, int, list[int]]:
    """(messages left, reserved, tries of each) in the jobs queue."""
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        q = await factory.queue("jobs")
        reserved = await q.resv_size()
        left = await q.pop_many(1000, timeout=0)
        return len(left), reserved, [m.tries for m in left]


def _redis_args(
    prefix: str, *more: str, url: str = REDIS_URL, handler: str = "jobs:slow"
) -> list[str]:
    return [
        handler,
        "--backend", "redis-oq",
        "--url", url,
        "--option", f"prefix={prefix}",
        "--queue", "jobs",
        *more,
    ]  # fmt: skip


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _metric(text: str, name: str, queue: str = "jobs") -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{queue="{queue}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in {text}")


async def _metric_reaches(port: int, name: str, least: float, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        text = (await asyncio.to_thread(_get, port, "/metrics"))[1].decode()
        if text and _metric(text, name) >= least:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{name} stayed below {least} for {seconds} s:\n{text}")
        await asyncio.sleep(0.1)


async def _status_becomes(port: int, wanted: int, seconds: float = 60.0) -> bytes:
    deadline = time.monotonic() + seconds
    while True:
        status, body = await asyncio.to_thread(_get, port, "/healthz")
        if status == wanted:
            return body
        if time.monotonic() > deadline:
            pytest.fail(f"/healthz stayed {status}, not {wanted}, for {seconds} s: {body!r}")
        await asyncio.sleep(0.1)


async def test_sigterm_lets_running_handlers_finish_and_takes_no_more(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    await _push(prefix, [{"n": n, "sleep": 1.0} for n in range(20)])
    worker = Worker(workdir, *_redis_args(prefix, "--concurrency", "4", "--grace", "20"))
    workers.append(worker)
    worker.wait_for("start", 4)
    worker.signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert worker.finish() == 0, worker.output
    assert time.monotonic() - signalled < 20 + 1
    started, done = worker.events("start"), worker.events("done")
    assert sorted(started) == sorted(done)  # every handler that began was let finish
    left, reserved, tries = await _left(prefix)
    assert reserved == 0
    assert left + len(done) == 20  # nothing lost, nothing handled twice
    assert set(tries) == {0}


async def test_handlers_past_the_grace_are_cancelled_and_their_messages_given_back(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    await _push(prefix, [{"n": n} for n in range(6)])
    worker = Worker(
        workdir, *_redis_args(prefix, "--concurrency", "3", "--grace", "3", handler="jobs:hang")
    )
    workers.append(worker)
    worker.wait_for("start", 3)
    worker.signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert worker.finish() == 0, worker.output
    # cut at its 3 s grace, not waited for: exited well before twice the grace (the rest
    # is slack for a busy machine's cancel, give-back and interpreter exit)
    assert time.monotonic() - signalled < 2 * 3
    left, reserved, tries = await _left(prefix)
    assert (left, reserved) == (6, 0)  # back at once, not after reserve_delay
    assert tries == [0] * 6  # and at no cost of a try


async def test_a_second_sigint_stops_at_once(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    await _push(prefix, [{"n": n} for n in range(2)])
    worker = Worker(
        workdir, *_redis_args(prefix, "--concurrency", "2", "--grace", "600", handler="jobs:hang")
    )
    workers.append(worker)
    worker.wait_for("start", 2)
    worker.signal(signal.SIGINT)
    await asyncio.sleep(0.5)
    worker.signal(signal.SIGINT)
    assert worker.finish(seconds=60) == 0, worker.output
    assert "stopping now" in worker.output
    left, reserved, tries = await _left(prefix)
    assert (left, reserved, tries) == (2, 0, [0, 0])


async def test_a_handler_that_swallows_cancellation_is_abandoned_not_given_back(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    """A handler that catches every ``CancelledError`` and goes on kept the worker alive
    past the second signal, for ever. It is abandoned now: logged, its message left reserved
    (given back while its handler may still run, two consumers would hold it at once), and
    the process exits 70 (EX_SOFTWARE), not 0 as it did (a supervisor could not tell), once
    the atexit hooks ran (an exporter's last flush; os._exit skipped them), a hook that
    never returns cut short."""
    await _push(prefix, [{"n": n} for n in range(3)])
    port = free_port()
    args = ["--grace", "600", "--health-port", str(port), "--option", "reserve_delay=40"]
    worker = Worker(workdir, *_redis_args(prefix, *args, handler="jobs:stubborn"))
    workers.append(worker)
    worker.wait_for("id", 1)
    [taken] = worker.events("id")
    worker.signal(signal.SIGTERM)
    await _status_becomes(port, 503)  # the first signal was heard: the consumer stops
    worker.signal(signal.SIGTERM)
    worker.wait_for("cancelled", 1)  # and swallowed by the handler
    assert worker.finish(seconds=120) == 70, worker.output
    assert worker.events("atexit") == [0], worker.output
    [line] = [line for line in worker.output.splitlines() if taken in line]
    assert " ERROR " in line and "'jobs'" in line, worker.output
    left, reserved, tries = await _left(prefix)
    # the others untouched, it still reserved: it comes back once that expires, as any
    # reservation nobody renews (the lifecycle conformance tests)
    assert (left, reserved, tries) == (2, 1, [0, 0])


async def test_an_abandoned_handler_s_message_goes_to_nobody_else_while_its_process_lives(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    """The abandoned handler runs on until the process exits, so its message must stay
    reserved until then. Its extensions went through the connection the worker closed as it
    returned, and the process lived up to 20 s more (leftover tasks, the loop's shutdown,
    the atexit hooks): with a short ``reserve_delay`` another consumer reserved the message
    while the first still ran it. Here a consumer of another connection tries all along, and
    must get it only once the worker's process is gone (and then get it: not lost)."""
    await _push(prefix, [{"n": 0}])
    port = free_port()
    args = ["--grace", "600", "--health-port", str(port), "--option", "reserve_delay=2"]
    worker = Worker(workdir, *_redis_args(prefix, *args, handler="jobs:stubborn"))
    workers.append(worker)
    worker.wait_for("id", 1)
    [taken] = worker.events("id")
    worker.signal(signal.SIGTERM)
    await _status_becomes(port, 503)
    worker.signal(signal.SIGTERM)
    worker.wait_for("cancelled", 1)
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        other = await factory.queue("jobs", reserve_delay=60)
        while True:
            got = await other.reserve_many(1, timeout=0)
            # read after the reserve: its reservation lapses reserve_delay after its last
            # extension, which its process sent before it exited (it is a zombie by then)
            alive = worker.process.poll() is None
            if got:
                assert not alive, "reserved while the worker still ran"
                break
            if not alive:  # gone: its reservation lapses within reserve_delay
                got = await other.reserve_many(1, timeout=30)
                assert got, "the abandoned message was lost"
                break
            await asyncio.sleep(0.05)
        assert [m.id for m in got] == [taken]
    assert worker.finish(seconds=120) == 70, worker.output
    assert worker.events("atexit") == [0], worker.output


async def test_a_signal_while_the_atexit_hooks_run_still_exits_70_and_runs_them_once(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    """One more SIGINT (a third Ctrl-C) while the process that abandoned a handler waits for
    its atexit hooks raised KeyboardInterrupt out of the loop: its end then cancelled that
    wait, gave the leftover tasks their seconds and went on to the command's other exit,
    which ran the hooks again (each of those that had run, twice) and waited for the one
    that never returns for ever, instead of exiting 70. The hooks get 600 s here, so the
    signal comes while they run."""
    await _push(prefix, [{"n": 0}])
    port = free_port()
    args = ["--grace", "600", "--health-port", str(port), "--option", "reserve_delay=40"]
    worker = Worker(
        workdir,
        *_redis_args(prefix, *args, handler="jobs:stubborn"),
        env={"JOBS_ATEXIT_WAIT": "600"},
    )
    workers.append(worker)
    worker.wait_for("id", 1)
    worker.signal(signal.SIGTERM)
    await _status_becomes(port, 503)  # the first signal was heard: the consumer stops
    worker.signal(signal.SIGTERM)
    worker.wait_for("atexit", 1, seconds=120)  # the hooks run; the next never returns
    worker.signal(signal.SIGINT)
    assert worker.finish() == 70, worker.output
    assert worker.events("atexit") == [0], worker.output
    assert "exiting without waiting longer for the atexit hooks" in worker.output
    assert await _left(prefix) == (0, 1, [])  # still reserved, not given back


async def test_a_signal_while_a_task_left_gets_its_last_seconds_still_exits_70(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    """A task a handler left, which swallows its cancellation, is found only as the loop
    ends, and gets ``LEFT_WAIT`` seconds once cancelled. It was recorded as outliving the
    loop only after that wait: one more SIGINT during it raised KeyboardInterrupt out of
    the loop with nothing recorded, the command took it for a SIGINT before the worker
    started, and exited 0 through the interpreter's exit, which waited for an atexit hook
    that never returns for ever. ``LEFT_WAIT`` is 600 s here, so the signal comes during
    that wait: 70, the hooks bounded and run once."""
    await _push(prefix, [{"n": 0}])
    worker = Worker(
        workdir,
        *_redis_args(prefix, "--grace", "600", handler="jobs:spawns"),
        env={"JOBS_LEFT_WAIT": "600"},
    )
    workers.append(worker)
    worker.wait_for("done", 1)
    worker.signal(signal.SIGTERM)  # a clean stop: the handler has returned
    worker.wait_for("cancelled", 1, seconds=120)  # the loop's end cancelled the task left
    worker.signal(signal.SIGINT)
    assert worker.finish() == 70, worker.output
    assert worker.events("atexit") == [0], worker.output


async def test_a_sigint_after_the_workers_handlers_are_removed_still_exits_70(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    """The worker removes its SIGTERM / SIGINT handlers as it returns, before the health
    server's and the connection's close, and the command's exit installs its own only
    after: a SIGINT in between is Python's KeyboardInterrupt out of the loop, which the
    command took for a SIGINT before the worker started (exit 0) even after a stop that
    abandoned a handler (which has ended since: nothing is left running to make it 70).
    The gap is held open here (the health server's close waits), so the signal lands in
    it."""
    await _push(prefix, [{"n": 0}])
    port = free_port()
    args = ["--grace", "600", "--health-port", str(port), "--option", "reserve_delay=40"]
    worker = Worker(
        workdir,
        *_redis_args(prefix, *args, handler="jobs:relents"),
        env={"JOBS_HOLD_HEALTH_CLOSE": "1"},
    )
    workers.append(worker)
    worker.wait_for("start", 1)
    worker.signal(signal.SIGTERM)
    await _status_becomes(port, 503)  # the first signal was heard: the consumer stops
    worker.signal(signal.SIGTERM)
    worker.wait_for("health-closing", 1, seconds=120)  # the handler was abandoned, ended
    worker.signal(signal.SIGINT)
    assert worker.finish(seconds=120) == 70, worker.output
    assert worker.events("ended") == [0], worker.output


async def test_a_handler_that_ends_as_it_is_abandoned_still_exits_70(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    """A handler the stop abandoned (logged at ERROR) that ends at once after all left
    nothing running once the worker returned: the command exited 0, as after a clean stop.
    A stop that abandoned handlers is 70 (EX_SOFTWARE) whether they end later or not."""
    await _push(prefix, [{"n": 0}])
    port = free_port()
    args = ["--grace", "600", "--health-port", str(port), "--option", "reserve_delay=40"]
    worker = Worker(workdir, *_redis_args(prefix, *args, handler="jobs:relents"))
    workers.append(worker)
    worker.wait_for("start", 1)
    worker.signal(signal.SIGTERM)
    await _status_becomes(port, 503)  # the first signal was heard: the consumer stops
    worker.signal(signal.SIGTERM)
    assert worker.finish(seconds=120) == 70, worker.output
    assert worker.events("cancelled") == [0, 0], worker.output
    assert worker.events("ended") == [0], worker.output
    assert " ERROR aio_keuss.consumer: queue 'jobs'" in worker.output


async def test_a_handler_s_thread_that_goes_on_does_not_hold_the_exit(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    """A handler blocked in ``asyncio.to_thread`` ends once cancelled, but its thread (one
    of the loop's default executor, not a daemon) goes on: the loop's shutdown gave up on it
    after its bound, and the command then exited through the interpreter's exit, which
    joins every such thread, for ever. The command exits 70 now without it, saying so."""
    await _push(prefix, [{"n": 0}])
    port = free_port()
    args = ["--grace", "600", "--health-port", str(port)]
    worker = Worker(workdir, *_redis_args(prefix, *args, handler="jobs:blocked"))
    workers.append(worker)
    worker.wait_for("start", 1)
    worker.signal(signal.SIGTERM)
    await _status_becomes(port, 503)  # the first signal was heard: the consumer stops
    worker.signal(signal.SIGTERM)  # cancels the handler: its message goes back
    assert worker.finish(seconds=120) == 70, worker.output
    assert "threads of the loop's default executor" in worker.output
    left, reserved, _ = await _left(prefix)
    assert (left, reserved) == (1, 0)


CANCELLED_EXIT = textwrap.dedent(
    """
    import asyncio, atexit, threading
    from aio_keuss.worker import loop

    loop.ATEXIT_WAIT = 600.0
    atexit.register(threading.Event().wait)  # never returns
    atexit.register(print, "atexit", flush=True)

    async def main():
        exiting = asyncio.ensure_future(loop.exit_running(70))
        await asyncio.sleep(0.5)
        exiting.cancel()  # as the loop's end cancels it after a KeyboardInterrupt
        await asyncio.sleep(3600)

    loop.run(main())
    """
)


def test_exit_running_cancelled_while_the_hooks_run_still_exits_with_its_code(
    tmp_path: Path,
) -> None:
    """``exit_running`` cancelled during its wait for the atexit hooks (the loop's end
    cancels every task after a KeyboardInterrupt) let the cancellation through: the process
    went on to the interpreter's exit, ran the hooks again and waited for the one that never
    returns for ever. It ends in ``os._exit`` with its code whatever ends the wait."""
    script = tmp_path / "cancelled_exit.py"
    script.write_text(CANCELLED_EXIT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 70, done.stdout + done.stderr
    assert done.stdout.count("atexit") == 1, done.stdout
    assert "interrupted: exiting without waiting longer" in done.stderr


async def test_run_worker_closes_the_connection_it_kept_for_abandoned_handlers_once_they_end(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that abandoned a handler leaves its own connection open while that handler
    runs on (its reservation is extended through it), and closes it once that handler ends
    after all: its ok goes through it first, so the message is not handled again."""
    monkeypatch.setattr(aio_keuss.consumer, "ACK_WAIT", 0.2)
    monkeypatch.setattr(aio_keuss.consumer, "ABANDON_WAIT", 0.2)
    await _push(prefix, [{"n": 0}])
    started, finish = asyncio.Event(), asyncio.Event()

    async def stubborn(message: aio_keuss.Message) -> None:
        started.set()
        while not finish.is_set():
            with contextlib.suppress(asyncio.CancelledError):  # goes on
                await asyncio.sleep(0.05)

    stop = asyncio.Event()
    worker = asyncio.ensure_future(
        aio_keuss.run_worker(
            stubborn, "jobs", backend="redis-oq", url=REDIS_URL, prefix=prefix, grace=0, stop=stop
        )
    )
    try:
        await asyncio.wait_for(started.wait(), 30)
        stop.set()
        await asyncio.wait_for(worker, 60)  # returns, the handler abandoned
        assert worker_run.left_open()
        [closing] = worker_run._left_open
    finally:
        finish.set()
    await asyncio.wait_for(asyncio.shield(closing), 60)
    assert not worker_run.left_open()
    assert await _left(prefix) == (0, 0, [])  # acknowledged, not left to come back


async def test_a_stop_whose_abandoned_handler_ended_before_the_worker_returned_exits_70(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exit code says whether a stop abandoned handlers, not whether they still run as
    the worker returns: a handler that ends in the gap between its abandonment (the ERROR
    log) and run_worker's end got exit 0 after a stop that did abandon it. Here it ends at
    that log, and the stop is followed by a wait for it (the gap, made certain); the
    connection it kept is then closed at once, as before, and the command exits 70."""
    monkeypatch.setattr(aio_keuss.consumer, "ACK_WAIT", 0.2)
    monkeypatch.setattr(aio_keuss.consumer, "ABANDON_WAIT", 0.2)
    await _push(prefix, [{"n": 0}])
    started, abandoned = asyncio.Event(), asyncio.Event()

    class _Abandoned(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "abandoned running" in record.getMessage():
                abandoned.set()

    async def stubborn(message: aio_keuss.Message) -> None:
        started.set()
        while not abandoned.is_set():
            with contextlib.suppress(asyncio.CancelledError):  # goes on once cancelled
                await asyncio.sleep(0.05)

    stop_consumers = worker_run._stop

    async def stop_then_outlived(consumers: Any, *args: Any) -> None:
        await stop_consumers(consumers, *args)
        for consumer in consumers:  # the abandoned handler ends before the worker returns
            await asyncio.wait_for(consumer.outlived(), 30)

    monkeypatch.setattr(worker_run, "_stop", stop_then_outlived)
    watching = _Abandoned()
    logging.getLogger("aio_keuss.consumer").addHandler(watching)
    stop = asyncio.Event()
    options: dict[str, Any] = {"url": REDIS_URL, "prefix": prefix}
    try:
        worker = asyncio.ensure_future(
            aio_keuss.run_worker(
                stubborn, "jobs", backend="redis-oq", grace=0, stop=stop, **options
            )
        )
        await asyncio.wait_for(started.wait(), 30)
        stop.set()
        await asyncio.wait_for(worker, 60)
    finally:
        logging.getLogger("aio_keuss.consumer").removeHandler(watching)
    assert abandoned.is_set()
    assert not worker_run.left_open()  # closed at once: nothing ran on it
    assert cli._exit_code(cli.EXIT_OK) == cli.EXIT_ABANDONED
    assert cli._exit_code(cli.EXIT_FAILED) == cli.EXIT_FAILED
    assert await _left(prefix) == (0, 0, [])  # its ok went through before the close


LOOP_ENDS = textwrap.dedent(
    """
    import asyncio, sys
    import aio_keuss
    import aio_keuss.consumer

    aio_keuss.consumer.ACK_WAIT = aio_keuss.consumer.ABANDON_WAIT = 0.2

    async def main(url, prefix):
        started, returned = asyncio.Event(), asyncio.Event()

        async def stubborn(message):
            # swallows the stop's cancellation; returns on the one asyncio.run sends at
            # its end, the message then acknowledged
            started.set()
            while True:
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    if returned.is_set():
                        return

        stop = asyncio.Event()
        worker = asyncio.ensure_future(
            aio_keuss.run_worker(
                stubborn, "jobs", backend="redis-oq", url=url, prefix=prefix, grace=0, stop=stop
            )
        )
        await started.wait()
        stop.set()
        await worker  # returns, the handler abandoned
        returned.set()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_run_worker_closes_the_connection_it_kept_when_the_loop_ends_first(
    workdir: Path, prefix: str
) -> None:
    """``asyncio.run`` returning while a handler run_worker abandoned still runs cancels
    every task left, the close it put off too, and waits for them: the handler then ends,
    and its message is acknowledged through the connection kept open. That close was
    cancelled for good, so the connection was never closed: the last counters (its commit)
    were lost, its socket left unclosed (a ResourceWarning), a signal's publish at times
    destroyed pending. It must close once the handler has ended."""
    await _push(prefix, [{"n": 0}])
    script = workdir / "loop_ends.py"
    script.write_text(LOOP_ENDS)
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-W", "always::ResourceWarning", str(script), REDIS_URL, prefix],
        cwd=workdir,
        capture_output=True,
        timeout=120,
    )
    errors = done.stderr.decode(errors="replace")
    assert done.returncode == 0, errors
    assert "Task was destroyed but it is pending" not in errors, errors
    assert "unclosed" not in errors, errors
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        stats = await (await factory.queue("jobs")).stats()
    assert await _left(prefix) == (0, 0, [])  # acknowledged as its handler returned
    assert (stats["reserve"], stats["commit"]) == (1, 1), stats


TWO_WORKERS = textwrap.dedent(
    """
    import asyncio, sys
    import aio_keuss
    from jobs import hang

    async def main(url, prefix):
        async with aio_keuss.connect("redis-oq", url=url, prefix=prefix) as factory:
            await asyncio.gather(
                aio_keuss.run_worker(hang, "jobs", factory=factory, grace=1),
                aio_keuss.run_worker(hang, "emails", factory=factory, grace=1),
            )

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_one_sigterm_stops_every_run_worker_of_the_process(
    workdir: Path, prefix: str
) -> None:
    """Two ``run_worker`` side by side in one script (a handler each): each installed the
    loop's SIGTERM handler over the other's, so a SIGTERM stopped only the last one, and
    the first, its handler removed with the other's, was killed by the next (status 143)
    with its messages held."""
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        for name in ("jobs", "emails"):
            await (await factory.queue(name)).push_many([{"n": 1}, {"n": 2}])
    (workdir / "two.py").write_text(TWO_WORKERS)
    worker = Worker(workdir, REDIS_URL, prefix, command=("two.py",))
    try:
        worker.wait_for("start", 2)  # one handler of each worker runs
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.finish) == 0, worker.output
    finally:
        await asyncio.to_thread(worker.kill)
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        for name in ("jobs", "emails"):
            q = await factory.queue(name)
            assert (await q.size(), await q.resv_size()) == (2, 0), name  # given back


async def test_a_handler_past_its_timeout_is_cancelled_and_ko_ed(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    port = free_port()
    await _push(prefix, [{"n": 1}])
    args = _redis_args(prefix, "--timeout", "0.5", "--health-port", str(port), handler="jobs:hang")
    worker = Worker(workdir, *args)
    workers.append(worker)
    worker.wait_for("start", 1)
    await _metric_reaches(port, "aio_keuss_timed_out_total", 1)
    await _metric_reaches(port, "aio_keuss_retried_total", 1)  # ko-ed with the backoff
    worker.signal(signal.SIGTERM)
    assert worker.finish() == 0
    assert "HandlerTimeoutError" in worker.output
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        q = await factory.queue("jobs")
        assert await q.total_size() == 1 and await q.resv_size() == 0
        again = await q.reserve(timeout=30)  # back after the ko's backoff, one try spent
        assert again is not None and again.tries >= 1


@pytest.mark.parametrize(
    ("handler", "says"),
    [
        ("nosuch.module:handle", "no module named 'nosuch'"),
        ("jobs:missing", "has no attribute 'missing'"),
        ("jobs:nested.absent", "has no attribute 'absent'"),
        ("jobs", "module:function"),
    ],
)
def test_a_handler_that_cannot_be_imported_is_named(workdir: Path, handler: str, says: str) -> None:
    worker = Worker(workdir, handler, "--queue", "jobs")
    assert worker.finish() == 2
    assert says in worker.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--queue", "a/b"), "invalid queue name 'a/b'"),
        (("--queue", "jobs", "--prefetch", "5000"), "prefetch must be at most max_batch"),
        (
            ("--queue", "jobs", "--health-host", "999.1.1.1", "--health-port", "0"),
            "cannot serve the health endpoint on 999.1.1.1:0",
        ),
    ],
)
def test_bad_settings_exit_2_with_a_message(
    workdir: Path, args: tuple[str, ...], says: str
) -> None:
    """Exit code 2 for bad settings, as the README says: a queue name (refused before
    connecting), a prefetch the queue refuses, a health address that cannot be served
    (they exited 1, the last with a bare socket.gaierror traceback)."""
    worker = Worker(workdir, "jobs:slow", *args, env={"AIO_KEUSS_BACKEND": "memory"})
    assert worker.finish() == 2, worker.output
    assert says in worker.output and "Traceback" not in worker.output


@pytest.mark.parametrize(
    ("health", "code", "says"),
    [
        (("--health-host", "192.0.2.1"), 2, "cannot serve the health endpoint on 192.0.2.1"),
        ((), 1, "address already in use"),
    ],
)
async def test_a_health_endpoint_that_cannot_be_served_stops_the_worker_before_it_takes_a_message(
    workdir: Path, prefix: str, health: tuple[str, ...], code: int, says: str
) -> None:
    """A health address that is not this machine's (exit 2) or a port still in use (exit
    1) stops the worker before any handler starts: it was bound once the consumers ran,
    and on a backend that pops (redis-list) the messages their handlers had begun were cut
    by the exit, and lost."""
    async with aio_keuss.connect("redis-list", url=REDIS_URL, prefix=prefix) as factory:
        await (await factory.queue("jobs")).push_many([{"n": n} for n in range(6)])
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = [*_redis_args(prefix, "--concurrency", "3", handler="jobs:hang"), *health]
        args[args.index("redis-oq")] = "redis-list"
        worker = Worker(workdir, *args, "--health-port", port)
        assert await asyncio.to_thread(worker.finish) == code, worker.output
    finally:
        taken.close()
    assert says in worker.output and "Traceback" not in worker.output
    assert worker.events("start") == []
    async with aio_keuss.connect("redis-list", url=REDIS_URL, prefix=prefix) as factory:
        assert await (await factory.queue("jobs")).size() == 6


def test_a_pipeline_that_cannot_be_built_is_named(workdir: Path) -> None:
    worker = Worker(workdir, "--pipeline", "jobs:no_pipeline")
    assert worker.finish() == 2
    assert "pipeline 'jobs:no_pipeline'" in worker.output and "no_pipeline" in worker.output
    (workdir / "etl.toml").write_text(
        'name = "etl"\n[[stations]]\nname = "check"\nfrom = "in"\nhandler = "jobs:gone"\n'
    )
    worker = Worker(workdir, "--pipeline", "etl.toml")
    assert worker.finish() == 2
    assert "station 'check'" in worker.output and "no attribute 'gone'" in worker.output


STEPS = textwrap.dedent(
    """
    from aio_keuss.pipeline import Forward
    from jobs import note

    async def check(message):
        return Forward(to="out" if message.payload.get("ok") else "rejected")

    async def forward(message):
        return Forward()

    async def store(message):
        note("done", message)
    """
)

OLD_ETL = """
name = "etl"
[[stations]]
from = "in"
to = "out"
handler = "jobs_v1:forward"
[[stations]]
from = "out"
handler = "jobs_v1:store"
"""

NEW_ETL = """
name = "etl"
[[stations]]
from = "in"
to = ["out", "rejected"]
handler = "steps:check"
[[stations]]
from = "out"
handler = "steps:store"
[[stations]]
from = "rejected"
handler = "steps:store"
"""


def _until_logged(worker: Worker, text: str) -> None:
    """Read the worker's output until ``text`` shows (the pytest timeout bounds the wait)."""
    while text not in worker.output:
        line = worker.process.stdout.readline() if worker.process.stdout else b""
        if not line:
            worker.finish()
            pytest.fail(f"the worker exited before logging {text!r}:\n{worker.output}")
        worker.output += line.decode(errors="replace")


async def _stored_etl(prefix: str) -> list[tuple[str, str]]:
    """(input queue, handler) of each station of the topology stored as 'etl'."""
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        stored = (await factory.pipelines())["etl"]
    return [(station["from"], station["handler"]) for station in stored["stations"]]


async def test_a_changed_pipeline_starts_over_the_stored_one_only_with_replace_pipeline(
    workdir: Path, prefix: str, workers: list[Worker]
) -> None:
    """A rolling deploy changing a pipeline (its handlers moved to another module, a station
    added): the new release's worker was refused (exit 2) for as long as the old topology
    was stored, with no way to start it but a remove-pipeline by hand. With
    ``--replace-pipeline`` it starts and stores its own, beside an old worker still running;
    an old worker restarted (without the flag) is refused in turn and stores nothing."""
    (workdir / "jobs_v1.py").write_text(STEPS)
    (workdir / "steps.py").write_text(STEPS)
    (workdir / "old.toml").write_text(OLD_ETL)
    (workdir / "new.toml").write_text(NEW_ETL)
    connection = ["--backend", "redis-oq", "--url", REDIS_URL, "--option", f"prefix={prefix}"]
    old_stations = [("in", "jobs_v1:forward"), ("out", "jobs_v1:store")]
    new_stations = [("in", "steps:check"), ("out", "steps:store"), ("rejected", "steps:store")]

    old = Worker(workdir, "--pipeline", "old.toml", *connection)
    workers.append(old)
    _until_logged(old, "consuming pipeline 'etl' (in, out)")
    assert await _stored_etl(prefix) == old_stations

    refused = Worker(workdir, "--pipeline", "new.toml", *connection)
    assert refused.finish() == 2, refused.output
    assert "'etl' is stored with another topology" in refused.output
    for way in ("replace=True", "--replace-pipeline", "aio-keuss remove-pipeline etl"):
        assert way in refused.output
    assert "Traceback" not in refused.output
    assert await _stored_etl(prefix) == old_stations  # refused: nothing written

    new = Worker(workdir, "--pipeline", "new.toml", "--replace-pipeline", *connection)
    workers.append(new)
    _until_logged(new, "consuming pipeline 'etl' (in, out, rejected)")
    assert await _stored_etl(prefix) == new_stations
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        await (await factory.queue("rejected")).push({"n": 1})  # only the new station's input
    new.wait_for("done", 1)  # the added station runs

    again = Worker(workdir, "--pipeline", "old.toml", *connection)  # an old one restarted
    assert again.finish() == 2, again.output
    assert "'etl' is stored with another topology" in again.output
    assert await _stored_etl(prefix) == new_stations

    for running in (old, new):
        running.signal(signal.SIGTERM)
        assert running.finish() == 0, running.output


def test_a_dotted_handler_and_settings_from_the_environment_and_a_file(
    workdir: Path, workers: list[Worker]
) -> None:
    """``nested.handle`` is found; the queue comes from the file, the backend from the
    environment; an unknown setting in the file is refused by name."""
    (workdir / "worker.toml").write_text('[worker]\nqueues = ["jobs"]\nconcurrency = 2\n')
    env = {"AIO_KEUSS_BACKEND": "memory", "AIO_KEUSS_CONFIG": str(workdir / "worker.toml")}
    worker = Worker(workdir, "jobs:nested.handle", env=env)
    workers.append(worker)
    deadline = time.monotonic() + 60
    while "consuming jobs (2 per queue) on memory" not in worker.output:
        line = worker.process.stdout.readline() if worker.process.stdout else b""  # type: ignore[union-attr]
        worker.output += line.decode()
        assert line and time.monotonic() < deadline, worker.output
    worker.signal(signal.SIGTERM)
    assert worker.finish() == 0
    (workdir / "bad.toml").write_text('concurency = 2\nqueues = ["jobs"]\n')
    bad = Worker(workdir, "jobs:slow", "--config", str(workdir / "bad.toml"))
    assert bad.finish() == 2 and "unknown worker setting 'concurency'" in bad.output


@pytest.mark.parametrize("backend", ["redis-oq", "postgres"])
def test_a_backend_out_of_reach_at_start_exits_3(workdir: Path, backend: str) -> None:
    port = free_port()  # nothing listens there
    url = (
        f"redis://127.0.0.1:{port}/0"
        if backend == "redis-oq"
        else f"postgresql://postgres@127.0.0.1:{port}/test"
    )
    worker = Worker(workdir, "jobs:slow", "--backend", backend, "--url", url, "--queue", "q")
    assert worker.finish() == 3, worker.output
    assert "cannot reach the backend" in worker.output


@pytest.mark.parametrize("backend", ["redis-oq", "postgres"])
async def test_a_sigterm_while_connecting_stops_cleanly(workdir: Path, backend: str) -> None:
    """The signal handlers were installed only once connected: a SIGTERM during a connect
    to a server that never answers killed the process (status 143) instead of stopping it."""
    silent = Silent()
    await silent.start()
    url = (
        f"redis://127.0.0.1:{silent.port}/0"
        if backend == "redis-oq"
        else f"postgresql://postgres@127.0.0.1:{silent.port}/test"
    )
    worker = Worker(workdir, "jobs:slow", "--backend", backend, "--url", url, "--queue", "q")
    try:
        await asyncio.wait_for(silent.accepted.wait(), 60)
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.finish) == 0, worker.output
        assert "stopped while connecting" in worker.output
    finally:
        await asyncio.to_thread(worker.kill)
        silent.close()


async def test_health_is_503_while_the_server_restarts_and_200_again(
    workdir: Path, workers: list[Worker]
) -> None:
    port = free_port()
    with own_redis() as server:
        args = _redis_args("hc", "--health-port", str(port), url=server.url)
        worker = Worker(workdir, *args)
        workers.append(worker)
        body = json.loads(await _status_becomes(port, 200))
        assert body["status"] == "ok" and body["consumers"][0]["state"] == "running"
        await asyncio.to_thread(server.stop)
        body = json.loads(await _status_becomes(port, 503))
        assert body["consumers"][0]["state"] == "reconnecting"
        await asyncio.to_thread(server.start)
        await _status_becomes(port, 200)
        await _push("hc", [{"n": 7, "sleep": 0}], url=server.url)
        worker.wait_for("done", 1)  # and it works again
        await _metric_reaches(port, "aio_keuss_handled_total", 1)
        metrics = (await asyncio.to_thread(_get, port, "/metrics"))[1].decode()
        assert _metric(metrics, "aio_keuss_handler_duration_seconds_count") == 1
        assert 'aio_keuss_handler_duration_seconds_bucket{queue="jobs",le="+Inf"} 1' in metrics
        assert (await asyncio.to_thread(_get, port, "/nothing"))[0] == 404
        worker.signal(signal.SIGTERM)
        assert worker.finish() == 0


async def test_the_example_worker_runs_until_stopped(prefix: str) -> None:
    example = Path(__file__).parents[2] / "examples" / "consume_queue.py"
    process = subprocess.Popen(  # noqa: ASYNC220 - started once, then polled
        [sys.executable, str(example), "--prefix", prefix, "--queue", "jobs", "--grace", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        await _push(prefix, [{"tier": "gold", "amount": 2.5}] * 5)
        async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
            q = await factory.queue("jobs")
            deadline = time.monotonic() + 60
            while await q.total_size() or await q.resv_size():
                assert time.monotonic() < deadline and process.poll() is None
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert process.poll() is None  # an empty queue does not end it
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, out
    assert b"processed 5 orders: {'gold': 5}, total 12.50" in out


def test_the_console_script_is_installed() -> None:
    command = Path(sys.executable).parent / "aio-keuss"
    shown = subprocess.run([command, "worker", "--help"], capture_output=True, check=True)
    assert b"--health-port" in shown.stdout


def test_the_priorities_and_rate_limit_example_runs() -> None:
    """examples/urgent_first.py on the embedded backend: the resets first, every one sent."""
    example = Path(__file__).parents[2] / "examples" / "urgent_first.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "35 delivered" in done.stdout


@pytest.mark.parametrize("how", ["flag", "environment"])
async def test_a_worker_with_a_result_ttl_answers_push_and_wait(
    workdir: Path, prefix: str, workers: list[Worker], how: str
) -> None:
    if not load_backend("redis-oq").capabilities.results:
        pytest.skip("redis-oq keeps no results in this build")
    flag = ["--result-ttl", "60"] if how == "flag" else []
    env = {"AIO_KEUSS_RESULT_TTL": "60"} if how == "environment" else None
    worker = Worker(workdir, *_redis_args(prefix, *flag, handler="jobs:triple"), env=env)
    workers.append(worker)
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        q = await factory.queue("jobs", result_ttl=60)
        assert await q.push_and_wait({"n": 4}, timeout=60) == 12
    worker.signal(signal.SIGTERM)
    assert worker.finish() == 0, worker.output
