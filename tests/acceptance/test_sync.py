"""The blocking shim: one loop thread per process shared by threads, gone after close,
fork-safe, same results, timeouts and errors as the async API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from backends import CASES, REDIS_URL, BackendCase, _drop_redis_prefix, new_token

import aio_keuss
from aio_keuss import sync
from aio_keuss.factory import Factory
from aio_keuss.memory import MemoryStore
from aio_keuss.message import Message
from aio_keuss.pipeline import Forward
from aio_keuss.queue import Queue

SYNC_IDS = ("memory", "redis-oq", "postgres", "sqlite")

# Indirect parametrization of conftest's ``case`` fixture: only these three are set up
# (the cluster case would otherwise start a Redis Cluster just to be skipped).
on_backends = pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in SYNC_IDS], indirect=True, ids=lambda c: c.id
)


@pytest.fixture
def options(case: BackendCase) -> Iterator[tuple[str, dict[str, Any]]]:
    """(backend, connect options) for one test, its keys / schema dropped afterwards."""
    if case.id not in SYNC_IDS:
        pytest.skip(f"sync tests run on {', '.join(SYNC_IDS)} only")
    opts = case.options(new_token())
    yield case.name, opts
    if case.cleanup is not None:
        asyncio.run(case.cleanup(opts))


def portal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "portal" in t.name]


@on_backends
def test_threads_share_one_loop_and_every_message_arrives_once(
    options: tuple[str, dict[str, Any]],
) -> None:
    """16 producer and 4 consumer threads through the one portal loop. The races this
    looks for are the portal's (calls handed between threads and its loop), the same code
    whatever the backend: 4,000 messages run them on the memory backend, where a message
    costs the portal's hops alone; a database backend (a round trip or a transaction per
    call: postgres took 20 s of a loaded run) shows its calls through the portal with
    1,000."""
    backend, opts = options
    producers, per_producer, consumers = 16, (250 if backend == "memory" else 64), 4
    total = producers * per_producer
    baseline = threading.active_count()
    seen: list[str] = []
    pushed: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    produced = threading.Event()

    with sync.connect(backend, **opts) as factory:
        q = factory.queue("jobs")
        assert len(portal_threads()) == 1

        def produce(p: int) -> None:
            try:
                ids = [q.push({"p": p, "i": i}) for i in range(per_producer)]
                with lock:
                    pushed.extend(ids)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        def consume() -> None:
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    msg = q.reserve(timeout=0.5)
                    if msg is None:
                        with lock:
                            if produced.is_set() and len(seen) >= total:
                                return
                        continue
                    assert q.ok(msg) is True
                    with lock:
                        seen.append(msg.id)
            except BaseException as exc:
                errors.append(exc)

        consumer_threads = [threading.Thread(target=consume) for _ in range(consumers)]
        producer_threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
        for t in consumer_threads + producer_threads:
            t.start()
        for t in producer_threads:
            t.join()
        produced.set()
        for t in consumer_threads:
            t.join()
        assert not errors, errors
        assert len(pushed) == total
        assert len(seen) == total  # nothing twice ...
        assert set(seen) == set(pushed)  # ... and nothing missing
        assert q.total_size() == 0
        assert len(portal_threads()) == 1  # every thread went through the one loop
    assert threading.active_count() == baseline
    assert portal_threads() == []


@on_backends
def test_mirror_of_the_queue_api(options: tuple[str, dict[str, Any]]) -> None:
    backend, opts = options
    with sync.connect(backend, **opts) as factory:
        caps = factory.capabilities
        q = factory.queue("mirror", reserve_delay=30.0)
        mid = q.push({"a": 1}, headers={"k": "v"})
        assert isinstance(mid, str)
        assert q.size() == 1
        msg = q.pop(timeout=1)
        assert msg is not None
        assert (msg.id, msg.payload, msg.headers, msg.tries) == (mid, {"a": 1}, {"k": "v"}, 0)

        ids = q.push_many([b"x", [1, 2], None])
        assert len(ids) == 3
        popped = q.pop_many(10, timeout=1)
        assert [m.payload for m in popped] == [b"x", [1, 2], None]
        each = q.push_each([aio_keuss.NewMessage(i, headers={"n": i}) for i in range(2)])
        assert len(each) == 2
        assert [(m.payload, m.headers) for m in q.pop_many(10, timeout=1)] == [
            (0, {"n": 0}),
            (1, {"n": 1}),
        ]

        q.push("r")
        got = q.reserve(timeout=1)
        assert got is not None
        assert q.resv_size() == 1
        assert q.ko(got, 0.0)
        again = q.reserve(timeout=1)
        assert again is not None and again.id == got.id and again.tries == 1
        assert q.ok(again) is True
        assert q.ok(again) is False

        q.push_many([1, 2])
        both = q.reserve_many(5, timeout=1)
        assert [m.payload for m in both] == [1, 2]
        assert q.ok_many([*both, "no-such-id"]) == [True, True, False]

        if caps.delay:
            q.push("later", delay=30.0)
            assert q.sched_size() == 1
            assert q.next_mature_t() is not None
        if caps.remove:
            rid = q.push("gone")
            assert q.remove(rid) is True
            assert q.remove(rid) is False

        q.pause()
        assert q.is_paused() is True
        q.resume()
        assert q.is_paused() is False
        assert q.stats()["put"] >= 1
        assert q.sizes().total == q.total_size()
        assert "mirror" in factory.list()

        # iteration: reserved messages until a timeout with nothing
        it = factory.queue("iter")
        it.push_many(["a", "b", "c"])
        received = []
        for m in it.messages(timeout=0.3):
            received.append(m.payload)
            it.ok(m)
        assert received == ["a", "b", "c"]

        # drain from another thread ends a blocked ``for msg in q``
        timer = threading.Timer(0.3, it.drain)
        timer.start()
        started = time.monotonic()
        assert list(it) == []
        assert time.monotonic() - started < 10
        timer.join()


@on_backends
def test_mirror_of_move_and_stored_pipelines(options: tuple[str, dict[str, Any]]) -> None:
    backend, opts = options
    with sync.connect(backend, **opts) as factory:
        if not factory.capabilities.move:
            pytest.skip("this backend does not move")
        src, dst = factory.queue("src"), factory.queue("dst")
        src.push_many([1, 2, 3])
        held = src.reserve_many(3, timeout=1)
        assert src.move(held[0], "dst", payload=10) == held[0].id
        assert src.move_many(held, "dst") == [None, held[1].id, held[2].id]
        assert sorted(m.payload for m in dst.pop_many(5, timeout=1)) == [2, 3, 10]
        pipeline = factory.factory.pipeline("mirrored").link("src", "dst", _forward)
        factory.call(pipeline.save)
        assert factory.pipelines()["mirrored"]["queues"] == ["src", "dst"]
        assert factory.remove_pipeline("mirrored") is True
        assert factory.pipelines() == {}


async def _forward(message: Any) -> Any:
    return Forward()


@on_backends
def test_timeouts_return_none_on_time(options: tuple[str, dict[str, Any]]) -> None:
    backend, opts = options
    with sync.connect(backend, **opts) as factory:
        q = factory.queue("empty")
        for call in (q.pop, q.reserve):
            started = time.monotonic()
            assert call(0.3) is None
            assert 0.25 <= time.monotonic() - started < 15
        started = time.monotonic()
        assert q.pop_many(5, timeout=0.3) == []
        assert q.reserve_many(5, timeout=0) == []
        assert time.monotonic() - started < 15


@on_backends
def test_bad_input_raises_the_library_errors(options: tuple[str, dict[str, Any]]) -> None:
    backend, opts = options
    with sync.connect(backend, **opts) as factory:
        q = factory.queue("bad")
        with pytest.raises(aio_keuss.InvalidDelayError):
            q.push(1, delay=-1)
        with pytest.raises(aio_keuss.InvalidInputError):
            q.pop_many(0)
        with pytest.raises(aio_keuss.InvalidPayloadError):
            q.push(object())  # type: ignore[arg-type]
        with pytest.raises(aio_keuss.InvalidIdError):
            q.ok(42)  # type: ignore[arg-type]
        with pytest.raises(aio_keuss.InvalidQueueNameError):
            factory.queue("")
        assert q.push("still fine")  # an error leaves the loop thread usable
    with pytest.raises(aio_keuss.ClosedError):
        q.push(1)
    with pytest.raises(aio_keuss.ClosedError):
        factory.queue("x")
    with pytest.raises(aio_keuss.ConfigError):
        sync.connect("memory", no_such_option=1)
    assert portal_threads() == []  # a failed connect gives its loop back


@on_backends
def test_repeat_pushes_occurrences_until_stopped(options: tuple[str, dict[str, Any]]) -> None:
    """``SyncQueue.repeat`` runs the repeater on the loop thread while this thread takes
    its occurrences; leaving ``with`` stops it, and so does closing the factory."""
    backend, opts = options
    with sync.connect(backend, **opts) as factory:
        q = factory.queue("ticks")
        with q.repeat("tick", {"n": 1}, every=0.5, headers={"kind": "tick"}) as repeater:
            assert repeater.key == "tick"
            assert repeater.state in ("running", "reconnecting")
            seen = []
            while len(seen) < 2:
                message = q.pop(timeout=30)
                assert message is not None, "no occurrence within 30 s"
                seen.append(message)
        assert repeater.state == "stopped"
        repeater.stop()  # again: nothing happens
        assert [m.payload for m in seen] == [{"n": 1}, {"n": 1}]
        assert all(m.id.startswith("tick@") and m.headers["kind"] == "tick" for m in seen)
        assert all(m.headers["repeat"] == "tick" for m in seen)
        assert seen[0].id != seen[1].id
        kept = q.repeat("kept", 1, cron="* * * * *")
    assert kept.state == "stopped"  # the factory's close stopped it
    kept.stop()  # after the close: nothing to do, no error


@on_backends
def test_repeat_refuses_bad_input_before_pushing(options: tuple[str, dict[str, Any]]) -> None:
    backend, opts = options
    with sync.connect(backend, **opts) as factory:
        q = factory.queue("bad-repeats")
        with pytest.raises(aio_keuss.InvalidInputError):
            q.repeat("r", 1, every=1.0, cron="* * * * *")
        with pytest.raises(aio_keuss.InvalidInputError):
            q.repeat("r", 1, cron="61 * * * *")
        with pytest.raises(aio_keuss.InvalidPayloadError):
            q.repeat("r", object(), every=1.0)  # type: ignore[arg-type]
        assert q.total_size() == 0


def test_repeat_on_a_backend_without_ids_is_not_supported() -> None:
    options = {"url": REDIS_URL, "prefix": f"aks-{new_token()}"}
    try:
        with (
            sync.connect("redis-list", **options) as factory,
            pytest.raises(aio_keuss.NotSupportedError),
        ):
            factory.queue("plain").repeat("r", 1, every=1.0)
    finally:
        asyncio.run(_drop_redis_prefix(options))


def test_a_blocking_call_on_the_loop_thread_is_a_library_error() -> None:
    """A blocking call made on the shim's own loop thread (from a coroutine given to
    ``call``) would wait for itself: a LoopThreadError (it was anyio's bare RuntimeError)."""
    with sync.connect("memory") as factory:
        q = factory.queue("jobs")

        async def nested() -> str:
            return q.push({"a": 1})

        with pytest.raises(aio_keuss.LoopThreadError):
            factory.call(nested)
        assert q.size() == 0


def test_call_soon_on_the_loop_thread_is_a_library_error() -> None:
    """``call_soon`` from a coroutine given to ``call`` raised anyio's bare RuntimeError
    (``call`` and every blocking method raise LoopThreadError there)."""
    with sync.connect("memory") as factory:
        q = factory.queue("jobs")

        async def nested() -> None:
            q.call_soon(Queue.push, {"a": 1})

        async def nested_factory() -> None:
            factory.call_soon(q.queue.push, {"a": 1})

        for coroutine in (nested, nested_factory):
            with pytest.raises(aio_keuss.LoopThreadError):
                factory.call(coroutine)
        assert q.size() == 0


def test_connect_or_close_on_the_loop_thread_is_a_library_error() -> None:
    """``sync.connect`` and ``close`` from a coroutine given to ``call``: anyio's bare
    RuntimeError, and a close marked the factory closed without closing it, and left the
    loop thread running once every factory was closed."""
    factory = sync.connect("memory")
    q = factory.queue("jobs")
    q.push({"a": 1})

    async def nested_connect() -> None:
        sync.connect("memory")

    async def nested_close() -> None:
        factory.close()

    for nested in (nested_connect, nested_close):
        with pytest.raises(aio_keuss.LoopThreadError):
            factory.call(nested)
    assert not factory.closed
    assert q.size() == 1  # still open and usable
    factory.close()
    assert portal_threads() == []


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()])
def test_a_base_exception_from_a_called_coroutine_leaves_the_loop_thread_running(
    raised: BaseException,
) -> None:
    """A coroutine given to ``call`` (or ``call_soon``) that raises SystemExit (a script's
    ``sys.exit()`` in it) or another BaseException: its caller gets it, as before, but
    anyio's portal also re-raised it into the loop thread's task group, which ended the
    loop thread: another thread's waiting reserve got concurrent.futures.CancelledError,
    every later call anyio's RuntimeError ("This portal is not running"), and the close a
    LoopThreadError, for the life of the process."""
    with sync.connect("memory") as factory:
        q = factory.queue("jobs")
        waited: list[Message | None] = []
        waiter = threading.Thread(target=lambda: waited.append(q.reserve(timeout=30)))
        waiter.start()

        async def boom() -> None:
            raise raised

        with pytest.raises(type(raised)):
            factory.call(boom)
        with pytest.raises(type(raised)):
            factory.call_soon(boom).result()
        q.push({"a": 1})  # the loop thread still runs: the waiting reserve gets it
        waiter.join()
        assert [m.payload for m in waited if m is not None] == [{"a": 1}]
        assert waited[0] is not None and q.ok(waited[0])
    assert portal_threads() == []


_EXIT_WITH_A_SILENT_SERVER = """
import asyncio, sys, threading, time
import aio_keuss.queue
from aio_keuss import sync

sync.EXIT_CLOSE_WAIT = 0.5  # the test's own bounds, not the defaults' 10 s each
sync.EXIT_GRACE_WAIT = 0.5
aio_keuss.queue.CANCELLED_CLOSE_GRACE = 0.5
silent = threading.Event()
ports = []

async def handle(reader, writer):
    to_reader, to_writer = await asyncio.open_connection("127.0.0.1", 6379)

    async def pipe(src, dst):
        while data := await src.read(65536):
            if not silent.is_set():  # then a server that hangs: nothing more, either way
                dst.write(data)
                await dst.drain()

    await asyncio.gather(pipe(reader, to_writer), pipe(to_reader, writer))

async def proxy():
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    ports.append(server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()

threading.Thread(target=asyncio.run, args=(proxy(),), daemon=True).start()
while not ports:
    time.sleep(0.01)
factory = sync.connect("redis-oq", url=f"redis://127.0.0.1:{ports[0]}/0", prefix=sys.argv[1])
q = factory.queue("jobs")
q.push(1)
first = q.reserve(timeout=5)
assert first is not None and q.ok(first)
waiting = threading.Thread(target=q.reserve, daemon=True)  # a consumer, never closed
waiting.start()
silent.set()
time.sleep(0.2)
print("exiting", flush=True)
"""


def test_the_exit_with_a_consumer_waiting_on_a_silent_server_ends(tmp_path: Path) -> None:
    """A script (a Spark executor, a cron job) ends with a sync consumer still waiting and
    its server silent (a network partition, a host that hangs): the factories nobody
    closed are closed at exit, and that close waited for the round trip in flight without
    end, so the process never exited. Past its wait the close is cancelled, which bounds
    the rest (the async close's cancelled grace), and the process exits."""
    script = tmp_path / "exit_silent.py"
    script.write_text(_EXIT_WITH_A_SILENT_SERVER)
    prefix = f"akt-{new_token()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        done = subprocess.run(
            [sys.executable, str(script), prefix],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,  # hung for good without the bound (minutes here)
        )
    finally:
        asyncio.run(_drop_redis_prefix({"url": REDIS_URL, "prefix": prefix}))
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout
    assert "close at exit given up" in done.stderr


def test_loop_thread_lives_while_any_factory_is_open() -> None:
    baseline = threading.active_count()
    assert portal_threads() == []
    first = sync.connect("memory")
    second = sync.connect("memory")
    assert len(portal_threads()) == 1
    first.queue("a").push(1)
    first.close()
    first.close()  # idempotent
    assert len(portal_threads()) == 1
    assert second.queue("b").push(2)
    second.close()
    assert portal_threads() == []
    assert threading.active_count() == baseline
    with sync.connect("memory") as third:  # and a new one starts again on demand
        assert third.queue("c").push(3)
        assert len(portal_threads()) == 1
    assert threading.active_count() == baseline


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_starts_its_own_loop() -> None:
    with sync.connect("memory") as parent:
        pq = parent.queue("parent")
        pq.push("before")
        assert len(portal_threads()) == 1  # the fork happens with a running portal
        pid = os.fork()
        if pid == 0:  # child: never returns into pytest
            ok = False
            try:
                inherited_refused = False
                try:
                    pq.push("from child")
                except aio_keuss.ClosedError:
                    inherited_refused = True
                with sync.connect("memory") as child:
                    q = child.queue("child")
                    q.push({"child": os.getpid()})
                    msg = q.pop(timeout=5)
                    ok = (
                        inherited_refused
                        and msg is not None
                        and msg.payload == {"child": os.getpid()}
                    )
                ok = ok and portal_threads() == []
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        msg = pq.pop(timeout=1)  # the parent's loop is untouched
        assert msg is not None and msg.payload == "before"
    assert portal_threads() == []


def test_a_close_while_another_is_under_way_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the async close: a second close (another thread) returns once the first is done.
    It returned at once, while the first was still draining and closing the connection."""
    real = Factory.close
    entered, release, finished = threading.Event(), threading.Event(), threading.Event()

    async def gated(self: Factory) -> None:
        entered.set()
        await asyncio.to_thread(release.wait, 120)
        await real(self)
        finished.set()

    monkeypatch.setattr(Factory, "close", gated)
    factory = sync.connect("memory")
    factory.queue("jobs").push(1)
    first = threading.Thread(target=factory.close)
    first.start()
    assert entered.wait(60)
    seen: list[bool] = []

    def close_again() -> None:
        factory.close()
        seen.append(finished.is_set())

    second = threading.Thread(target=close_again)
    second.start()
    second.join(timeout=1)  # not an assertion: gives a wrong close the time to return early
    release.set()
    first.join(60)
    second.join(60)
    assert seen == [True]
    assert portal_threads() == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_during_a_close_closes_its_inherited_factory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fork while another thread of the parent closed a factory: the child inherits the
    close lock held by a thread that does not exist there, and its close() of that factory
    (a no-op for an inherited factory) waited for it forever."""
    real = Factory.close
    entered, release = threading.Event(), threading.Event()

    async def gated(self: Factory) -> None:
        entered.set()
        await asyncio.to_thread(release.wait, 120)
        await real(self)

    monkeypatch.setattr(Factory, "close", gated)
    factory = sync.connect("memory")
    closer = threading.Thread(target=factory.close)
    closer.start()
    try:
        assert entered.wait(60)
        pid = os.fork()
        if pid == 0:  # child: never returns into pytest
            ok = False
            try:
                factory.close()
                with factory:  # and the with block's close
                    pass
                ok = factory.closed
            finally:
                os._exit(0 if ok else 1)
        status = None
        deadline = time.monotonic() + 60
        while status is None and time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
            else:
                time.sleep(0.05)
        if status is None:  # hung: do not leave it behind
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert status is not None, "the child's close() hung"
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        release.set()
        closer.join(60)
    assert portal_threads() == []


def wait_for(condition: Callable[[], bool], seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class _HeldTakes:
    """Queue._consume and Queue._consume_one held on the loop thread once they took a
    message (``taken``) until ``resume``, so that the caller is interrupted while its result
    is on its way; ``interrupt``, a thread's target, then sends the main thread a SIGINT."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken, self.resume = threading.Event(), threading.Event()
        self._main = threading.get_ident()
        self._patch = monkeypatch
        self._real = Queue._consume, Queue._consume_one

    def hold(self) -> None:
        real_consume, real_consume_one = self._real
        taken, resume = self.taken, self.resume

        async def consume_then_hang(self: Queue, *args: Any, **kwargs: Any) -> list[Message]:
            stored = await real_consume(self, *args, **kwargs)
            if stored:
                taken.set()
                resume.wait(60)  # holds the loop thread: the result is not handed over yet
            return stored

        async def consume_one_then_hang(self: Queue, *args: Any, **kwargs: Any) -> Message | None:
            # pop and reserve take their one message here, not through _consume
            stored = await real_consume_one(self, *args, **kwargs)
            if stored is not None:
                taken.set()
                resume.wait(60)
            return stored

        self._patch.setattr(Queue, "_consume", consume_then_hang)
        self._patch.setattr(Queue, "_consume_one", consume_one_then_hang)

    def release(self) -> None:
        self._patch.setattr(Queue, "_consume", self._real[0])
        self._patch.setattr(Queue, "_consume_one", self._real[1])

    def interrupt(self) -> None:
        if self.taken.wait(60):
            signal.pthread_kill(self._main, signal.SIGINT)


@on_backends
@pytest.mark.parametrize("taking", ["pop", "reserve", "messages"])
def test_an_interrupted_pop_or_reserve_gives_back_what_it_took(
    options: tuple[str, dict[str, Any]], taking: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in a thread waiting on a pop or reserve whose result is already on its way
    (taken from the store, not yet handed over): the shim cancelled the portal's future,
    which drops that result, so a popped message was lost and a reserved one stayed
    invisible for reserve_delay. It now comes back at once, and counts in its stats as
    taken once, by the pop after (the take given back counted as well)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal interrupts the main thread only")
    backend, opts = options
    held = _HeldTakes(monkeypatch)
    with sync.connect(backend, **opts) as factory:
        q = factory.queue("interrupted", reserve_delay=600.0)
        q.push({"a": 1})
        held.hold()
        # The loop thread goes on once the interrupted thread has reacted (messages() then
        # closes its iterator, which waits for the loop thread).
        monkeypatch.setattr(
            factory, "_loop", _Relay(getattr(factory, "_loop", None), held.resume), raising=False
        )
        interrupter = threading.Thread(target=held.interrupt)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                if taking == "messages":
                    for _ in q.messages():
                        pass
                else:
                    getattr(q, taking)(timeout=60)
        finally:
            held.resume.set()
            interrupter.join(60)
        held.release()
        assert wait_for(lambda: q.size() == 1), q.sizes()
        msg = q.pop(timeout=60)
        assert msg is not None and msg.payload == {"a": 1}
        # delivered once, by this pop: the take given back unseen is not counted
        stats = q.stats()
        assert (stats["get"], stats["reserve"]) == (1, 0), stats


def test_messages_interrupted_as_the_reply_comes_in_raises_the_interruption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C in a messages() loop whose reserve's reply came in on the loop thread's turn
    that cancelled it: the cancelled reserve goes on to hand back what it took, and the
    iterator's close, run meanwhile, failed with RuntimeError ("asynchronous generator is
    already running") raised in place of the KeyboardInterrupt. It now waits for it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal interrupts the main thread only")
    real_reserve = MemoryStore.reserve
    asked = threading.Event()
    replies: list[asyncio.Future[None]] = []

    async def reply_held(self: MemoryStore, *args: Any) -> Any:
        if not replies:  # the first reserve's reply waits for the interruption
            replies.append(asyncio.get_running_loop().create_future())
            asked.set()
            await replies[0]
        return await real_reserve(self, *args)

    class ReplyWithAbandon:
        """The shim's loop, seen by the shim: its callback for the interrupted thread runs
        on the turn the reply comes in."""

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = loop

        def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> Any:
            def both() -> None:
                replies[0].set_result(None)
                callback(*args)

            return self.loop.call_soon_threadsafe(both)

    main = threading.get_ident()

    def interrupt() -> None:
        if asked.wait(60):
            signal.pthread_kill(main, signal.SIGINT)

    with sync.connect("memory") as factory:
        q = factory.queue("interrupted", reserve_delay=600.0)
        q.push({"a": 1})
        monkeypatch.setattr(MemoryStore, "reserve", reply_held)
        monkeypatch.setattr(factory, "_loop", ReplyWithAbandon(factory._loop))
        interrupter = threading.Thread(target=interrupt)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                for _ in q.messages():
                    pass
        finally:
            interrupter.join(60)
        monkeypatch.setattr(MemoryStore, "reserve", real_reserve)
        assert wait_for(lambda: q.size() == 1), q.sizes()
        msg = q.pop(timeout=60)
        assert msg is not None and msg.payload == {"a": 1}


def test_an_interrupted_pop_on_a_sharded_queue_keeps_the_end_of_life(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The put-back of an interrupted pop was built from the Message, which carries no end
    of life: on a sharded queue with message_ttl the message got a whole new TTL from the
    put-back. It keeps the one it had (what the store handed out is noted as it is taken),
    and its place ahead of its key's later message."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal interrupts the main thread only")
    held = _HeldTakes(monkeypatch)
    with sync.connect("memory-sharded", shards=1, message_ttl=3600.0, sweeper=False) as factory:
        q = factory.queue("interrupted")
        ids = [q.push(n, headers={"x-shard-key": "k"}) for n in range(2)]
        pushed = time.time()
        while time.time() <= pushed + 0.01:  # the put-back comes later than the push
            time.sleep(0.01)
        held.hold()
        monkeypatch.setattr(
            factory, "_loop", _Relay(getattr(factory, "_loop", None), held.resume), raising=False
        )
        interrupter = threading.Thread(target=held.interrupt)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                q.pop(timeout=60)
        finally:
            held.resume.set()
            interrupter.join(60)
        held.release()
        assert wait_for(lambda: q.size() == 2), q.sizes()
        storage = factory.factory.backend.storage  # type: ignore[attr-defined]
        fired = factory.call(storage.fire, "interrupted", 0, 10, None).messages
        assert [m.id for m in fired] == ids
        ends = [m.expires for m in fired]
        assert all(end is not None and end <= pushed + 3600.0 for end in ends), (pushed, ends)


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.id in ("redis-oq", "postgres", "sqlite")],
    indirect=True,
    ids=lambda c: c.id,
)
@pytest.mark.parametrize("taking", ["pop", "reserve"])
@pytest.mark.parametrize("loop", ["running", "stopped"])
def test_a_give_back_after_another_threads_close_loses_nothing(
    options: tuple[str, dict[str, Any]], taking: str, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in a thread whose pop or reserve had its message (taken from the store, not
    yet handed over), and another thread's close of the factory run to its end before the
    interrupted thread sent the loop thread its give-back: the give-back met a closed store
    (or, that close the last, a stopped loop thread) and a popped message was lost. The
    close now gives back what was taken for a caller that has not got it in hand, before it
    closes the store."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal interrupts the main thread only")
    backend, opts = options
    held = _HeldTakes(monkeypatch)
    closed = threading.Event()

    class CloseFirst:
        """The shim's loop, seen by the interrupted thread: its give-back is sent once
        another thread's close of the factory has ended."""

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = loop

        def call_soon_threadsafe(self, *args: Any) -> asyncio.Handle:
            held.resume.set()
            closer = threading.Thread(target=lambda: (factory.close(), closed.set()))
            closer.start()
            closer.join(60)
            return self.loop.call_soon_threadsafe(*args)

    with contextlib.ExitStack() as stack:
        if loop == "running":  # another factory keeps the loop thread running
            stack.enter_context(sync.connect(backend, **opts))
        factory = sync.connect(backend, **opts)
        q = factory.queue("closed-under", reserve_delay=600.0)
        q.push({"a": 1})
        held.hold()
        monkeypatch.setattr(factory, "_loop", CloseFirst(factory._loop))
        interrupter = threading.Thread(target=held.interrupt)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                getattr(q, taking)(timeout=60)
        finally:
            held.resume.set()
            interrupter.join(60)
        held.release()
        assert closed.is_set()
    with sync.connect(backend, **opts) as again:
        # no wait: the close that ended had given it back
        assert again.queue("closed-under").size() == 1


class _Relay:
    """The shim's loop, seen by the shim: lets the test know when a callback was sent."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, sent: threading.Event) -> None:
        self.loop, self.sent = loop, sent

    def call_soon_threadsafe(self, *args: Any) -> asyncio.Handle:
        assert self.loop is not None
        try:
            return self.loop.call_soon_threadsafe(*args)
        finally:
            self.sent.set()


def test_an_interrupted_connect_closes_the_factory_it_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while a connect was under way: the factory went on opening, and stayed open
    (its connections too) once the loop thread had stopped under it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal interrupts the main thread only")
    real_open = sync._open_factory
    opened: list[Factory] = []
    interrupted = threading.Event()

    async def open_slowly(state: Any, backend: str, options: dict[str, Any]) -> Factory:
        factory = await real_open(state, backend, options)
        opened.append(factory)
        await asyncio.to_thread(interrupted.wait, 60)  # the caller is interrupted meanwhile
        return factory

    def on_sigint(*_: Any) -> None:
        interrupted.set()
        raise KeyboardInterrupt

    main = threading.get_ident()

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while not opened and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    monkeypatch.setattr(sync, "_open_factory", open_slowly)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        interrupter = threading.Thread(target=interrupt)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            sync.connect("memory")
        interrupter.join(60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(opened) == 1
    assert opened[0]._closed
    assert portal_threads() == []


# A connect interrupted by a real Ctrl-C (SIGINT sent to the process) at one point:
# ``python -c INTERRUPTED <point> <backend> <options json>``. It prints what was left.
INTERRUPTED = r"""
import json, os, signal, sys, threading, time
import anyio.from_thread
from anyio.from_thread import BlockingPortal
from aio_keuss import sync

signal.signal(signal.SIGINT, signal.default_int_handler)  # as the test process passed it on
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

point, backend, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
opened = []
real_connect = sync._async_connect

async def recording_connect(backend, **options):
    factory = await real_connect(backend, **options)
    opened.append(factory)
    return factory

sync._async_connect = recording_connect
armed = [True]

def interrupt():
    if armed.pop() if armed else False:
        # to the main thread, which runs the handler at its next bytecode...
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(2)  # ...in this sleep (retried, as PEP 475 says, when the handler returns)

if point == "loop-thread-start":  # anyio's portal start: its thread running, not yet waited for
    class Started(threading.Thread):
        def start(self):
            super().start()
            interrupt()
    anyio.from_thread.Thread = Started
elif point == "loop-thread-ident":  # the new loop thread asked who it is
    real_call = BlockingPortal.call
    def call(self, func, *args):
        result = real_call(self, func, *args)
        if func is threading.get_ident:
            interrupt()
        return result
    BlockingPortal.call = call
elif point == "spawn":  # start_task_soon: the opening task spawned, not yet returned
    real_spawn = BlockingPortal._spawn_task_from_thread
    def spawn(self, func, *args):
        real_spawn(self, func, *args)
        if func is sync._open_factory:  # portal.call spawns through here too
            interrupt()
    BlockingPortal._spawn_task_from_thread = spawn
elif point == "made":  # the sync factory made, not yet returned
    real_init = sync.SyncFactory.__init__
    def init(self, *args):
        real_init(self, *args)
        interrupt()
    sync.SyncFactory.__init__ = init

def others():
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())

try:
    sync.connect(backend, **options)
    outcome = "connected"
except KeyboardInterrupt:
    outcome = "interrupted"
report = {
    "outcome": outcome,
    "threads": others(),
    "unclosed": sum(not factory._closed for factory in opened),
    "users": sync._runtime.users,
    "open": len(sync._runtime.open),
}
with sync.connect(backend, **options) as factory:  # the shim still works
    report["pushed"] = bool(factory.queue("after").push(1))
report["threads after"] = others()
print(json.dumps(report), flush=True)
"""


def _program(source: str, *args: str, limit: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as a Python program of its own (``args`` its arguments); it must end
    within ``limit`` seconds (a bound against hangs, not a timing) and exit 0."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    try:
        done = subprocess.run(
            [sys.executable, "-c", source, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=limit,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the program hung: {exc.stdout!r} {exc.stderr!r}")
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize("point", ["loop-thread-start", "loop-thread-ident", "spawn", "made"])
def test_a_ctrl_c_anywhere_in_connect_leaves_no_thread_nor_factory(point: str) -> None:
    """A real SIGINT at each step of a connect that the previous fix did not cover: inside
    anyio's portal start (its loop thread went on running for nobody), while the shim
    asked the new loop thread for its ident (the loop kept, counted by nobody), inside
    start_task_soon (the factory opened and nobody closed it), and once the sync factory
    was made (returned to nobody, its loop and factory open). Now each step is done whole
    and the Ctrl-C raised after it, with everything undone."""
    options = {"url": REDIS_URL, "prefix": f"aks-{new_token()}"}
    try:
        done = _program(INTERRUPTED, point, "redis-oq", json.dumps(options))
    finally:
        asyncio.run(_drop_redis_prefix(options))
    assert json.loads(done.stdout) == {
        "outcome": "interrupted",
        "threads": [],
        "unclosed": 0,
        "users": 0,
        "open": 0,
        "pushed": True,
        "threads after": [],
    }


# A close interrupted by a real Ctrl-C while it marks itself closed:
# ``python -c CLOSE_INTERRUPTED <options json>``. It prints what was left.
CLOSE_INTERRUPTED = r"""
import json, os, signal, sys, threading, time
from aio_keuss import sync

# Python's own Ctrl-C handling, whatever the test process passed on: an ignored SIGINT is
# inherited across exec (and Python then installs no handler), a blocked one too
inherited = [
    str(signal.getsignal(signal.SIGINT)),
    sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
]
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
options = json.loads(sys.argv[1])

class Interrupting(set):
    def discard(self, item):
        super().discard(item)
        # to the main thread, which runs the handler at its next bytecode...
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(2)  # ...in this sleep (retried, as PEP 475 says, when the handler returns)

factory = sync.connect("redis-oq", **options)
factory.queue("held", reserve_delay=600.0).push(1)
held = factory.queue("held").reserve(timeout=5)
sync._runtime.open = Interrupting(sync._runtime.open)
try:
    factory.close()
    outcome = "closed"
except KeyboardInterrupt:
    outcome = "interrupted"
sync._runtime.open = set(sync._runtime.open)
report = {
    "outcome": outcome,
    "held": held is not None,
    "async closed": factory.factory._closed,
    "users": sync._runtime.users,
    "threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
    "inherited": inherited,
}
with sync.connect("redis-oq", **options) as again:  # the reservation was given back
    report["ready"] = again.queue("held").size()
print(json.dumps(report), flush=True)
"""


def test_a_ctrl_c_while_close_marks_itself_closed_still_closes() -> None:
    """A real SIGINT in the close's bookkeeping (the factory marked closed, not yet closing):
    the async factory was never closed (its reservations held until reserve_delay, its
    connections open) and, being marked closed, no later close or exit closed it; the
    loop thread stayed counted for it. The bookkeeping and the start of the close are now
    done whole, the Ctrl-C raised after them."""
    options = {"url": REDIS_URL, "prefix": f"aks-{new_token()}"}
    try:
        done = _program(CLOSE_INTERRUPTED, json.dumps(options))
    finally:
        asyncio.run(_drop_redis_prefix(options))
    report = json.loads(done.stdout)
    inherited = report.pop("inherited")  # the SIGINT state the program was started with
    assert report == {
        "outcome": "interrupted",
        "held": True,
        "async closed": True,
        "users": 0,
        "threads": [],
        "ready": 1,
    }, inherited


# A close called from a signal handler that runs in the middle of the same thread's close:
# ``python -c CLOSE_IN_HANDLER``. It prints what each close saw.
CLOSE_IN_HANDLER = r"""
import asyncio, json, signal, threading
from aio_keuss import sync
from aio_keuss.factory import Factory

real_close = Factory.close
entered, in_handler, go = threading.Event(), threading.Event(), threading.Event()
seen = {}

async def gated(self):
    entered.set()
    await asyncio.to_thread(go.wait, 120)
    await real_close(self)
    seen["async closed"] = True

Factory.close = gated
factory = sync.connect("memory")
factory.queue("jobs").push(1)

def on_sigterm(signum, frame):  # a script's "stop on SIGTERM"
    in_handler.set()
    factory.close()
    seen["handler's close saw it closed"] = seen.get("async closed", False)

signal.signal(signal.SIGTERM, on_sigterm)

def terminate():
    if entered.wait(60):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        in_handler.wait(60)
    go.set()

threading.Thread(target=terminate).start()
factory.close()  # the end of a with block
seen["threads"] = [t.name for t in threading.enumerate() if "portal" in t.name]
seen["users"] = sync._runtime.users
print(json.dumps(seen), flush=True)
"""


def test_a_close_from_a_signal_handler_during_the_same_threads_close_returns() -> None:
    """A signal handler that closes the factory (stop on SIGTERM), run by the main thread
    while that thread was itself closing it: the handler's close waited for the close lock
    held by the close it interrupted, which could not go on until the handler returned, and
    the process hung. It now waits for the close under way, as another thread's would."""
    done = _program(CLOSE_IN_HANDLER, limit=120)
    assert json.loads(done.stdout) == {
        "async closed": True,
        "handler's close saw it closed": True,
        "threads": [],
        "users": 0,
    }


# A signal handler that calls connect() or close() while the main thread does the shim's
# bookkeeping (under its runtime lock): ``python -c HANDLER_IN_BOOKKEEPING <point>``. The
# signal is sent from inside that bookkeeping; the program prints what the handler did.
HANDLER_IN_BOOKKEEPING = r"""
import json, signal, sys, threading
from aio_keuss import sync

point = sys.argv[1]
started = threading.Event()
seen = {}
first = []

def on_sigusr1(signum, frame):  # a script's "report on SIGUSR1" / "stop on SIGTERM"
    seen["lock held"] = sync._runtime.lock.locked()
    started.set()
    if point == "connect":
        with sync.connect("memory") as factory:
            seen["pushed"] = bool(factory.queue("from-handler").push(1))
    else:
        first[0].close()
        seen["closed"] = first[0].closed

signal.signal(signal.SIGUSR1, on_sigusr1)
armed = [True]

def signal_main():
    # run under the runtime lock, by whichever thread does the bookkeeping
    if armed.pop() if armed else False:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        started.wait(30)  # the handler runs while the lock is still held

if point == "connect":  # the first connect starts the loop thread
    real_start = sync.start_blocking_portal
    def start_blocking_portal(*args, **kwargs):
        signal_main()
        return real_start(*args, **kwargs)
    sync.start_blocking_portal = start_blocking_portal
else:  # a second connect notes its factory as open while the first is closed
    first.append(sync.connect("memory"))
    class Noting(set):
        def add(self, item):
            super().add(item)
            signal_main()
    sync._runtime.open = Noting(sync._runtime.open)

with sync.connect("memory") as factory:
    seen["main pushed"] = bool(factory.queue("main").push(1))
seen["users"] = sync._runtime.users
seen["threads"] = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
print(json.dumps(seen), flush=True)
"""


@pytest.mark.parametrize("point", ["connect", "close"])
def test_a_connect_or_close_from_a_signal_handler_during_the_bookkeeping_returns(
    point: str,
) -> None:
    """A real signal whose handler calls connect() (while the main thread's connect starts
    the loop thread) or close() (while it notes a new factory as open): the main thread held
    the shim's runtime lock (a threading.Lock), the handler waited for it, and the process
    hung. The main thread now has that bookkeeping done by a thread of its own."""
    done = _program(HANDLER_IN_BOOKKEEPING, point, limit=60)
    expected: dict[str, Any] = {"lock held": True, "main pushed": True, "users": 0, "threads": []}
    expected |= {"pushed": True} if point == "connect" else {"closed": True}
    assert json.loads(done.stdout) == expected


# A close from a signal handler that runs as the same thread's close enters start_task_soon,
# before the loop thread got its task: ``python -c CLOSE_FROM_HANDLER_AT_SPAWN``.
CLOSE_FROM_HANDLER_AT_SPAWN = r"""
import json, signal, threading
from aio_keuss import sync

seen = {}
factory = sync.connect("memory")
factory.queue("jobs").push(1)

def on_sigusr1(signum, frame):  # a script's "stop on SIGTERM": close the factory
    factory.close()
    seen["closed in handler"] = factory.closed

signal.signal(signal.SIGUSR1, on_sigusr1)
portal = factory._portal
real_start = portal.start_task_soon
armed = [True]

def start_task_soon(*args, **kwargs):
    # the signal arrives as the close enters start_task_soon, before the task is spawned
    if armed and armed.pop() and args and getattr(args[0], "__name__", "") == "_settling":
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
    return real_start(*args, **kwargs)

portal.start_task_soon = start_task_soon
factory.close()
seen["closed"] = factory.closed
print(json.dumps(seen), flush=True)
"""


def test_a_close_from_a_signal_handler_as_the_close_enters_start_task_soon_returns() -> None:
    """A handler's close waited for the future the interrupted close made just before it
    called start_task_soon; interrupted before that call submitted the task, nothing ever
    settled the future: the handler waited for ever, the close it interrupted with it. The
    handler's close now runs the async close itself (a second one waits for the first)."""
    done = _program(CLOSE_FROM_HANDLER_AT_SPAWN)
    assert json.loads(done.stdout) == {"closed in handler": True, "closed": True}


@pytest.mark.parametrize("taking", ["pop", "reserve"])
def test_a_ctrl_c_just_after_the_caller_settled_its_result_loses_nothing(
    taking: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGINT that lands as the blocking caller takes its result in hand (its claim
    won): the caller raises KeyboardInterrupt instead of returning the message, and its
    give-back found the result claimed already, so gave nothing back: the popped message
    was lost (a reservation held to its end). The claims are kept, and the give-back sees
    that the caller claimed the result but never returned it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal interrupts the main thread only")
    real = sync._settle_once
    armed = [True]

    def settle_then_interrupted(taking_: Any, *args: Any) -> bool:
        won = real(taking_, *args)
        if won and armed and armed.pop():
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        return won

    options = {"url": REDIS_URL, "prefix": f"aks-{new_token()}"}
    try:
        with sync.connect("redis-oq", **options) as factory:
            q = factory.queue("jobs", reserve_delay=600.0)
            q.push({"a": 1})
            monkeypatch.setattr(sync, "_settle_once", settle_then_interrupted)
            with pytest.raises(KeyboardInterrupt):
                getattr(q, taking)(timeout=60)
            monkeypatch.setattr(sync, "_settle_once", real)
        # the close waited for every give-back sent before it
        with sync.connect("redis-oq", **options) as again:
            sizes = again.queue("jobs").sizes()
            assert (sizes.total, sizes.reserved) == (1, 0), sizes
    finally:
        asyncio.run(_drop_redis_prefix(options))


class _Handovers(set[Any]):
    """A queue's handovers, seen by the test: ``caller_dropped`` runs when the caller's
    thread drops its entry, as it does once it has its result in hand."""

    caller_dropped: Callable[[], None] = staticmethod(lambda: None)

    def discard(self, item: Any) -> None:
        super().discard(item)
        if threading.current_thread() is threading.main_thread():
            self.caller_dropped()


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.id in ("redis-oq", "postgres", "sqlite")],
    indirect=True,
    ids=lambda c: c.id,
)
@pytest.mark.parametrize("point", ["claim", "entry-dropped"])
@pytest.mark.parametrize("taking", ["pop", "reserve"])
@pytest.mark.parametrize("loop", ["running", "stopped"])
def test_a_ctrl_c_after_the_claim_with_another_threads_close_between_loses_nothing(
    options: tuple[str, dict[str, Any]],
    point: str,
    taking: str,
    loop: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's claim won (so the close, run by another thread, gave nothing back for
    it), the close ran to its end, and only then a SIGINT landed before the caller
    returned: the caller's give-back met a closed store (postgres: the popped message was
    lost), or a stopped loop thread (the last close: lost on every backend). At the
    claim, the close still ran the caller's handover entry (and left the result to the
    caller); once the caller had dropped it, the close did not see it at all. A popped
    message now goes back through a connection of its own; a reservation the close gave
    back."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal interrupts the main thread only")
    backend, opts = options
    real = sync._settle_once
    armed = [True]
    factory: Any = None

    def close_then_interrupted() -> None:
        if armed and armed.pop():
            closer = threading.Thread(target=factory.close)
            closer.start()
            closer.join(60)
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    def settle_close_then_interrupted(taking_: Any, *args: Any) -> bool:
        won = real(taking_, *args)
        if won and not args:
            close_then_interrupted()
        return won

    with contextlib.ExitStack() as stack:
        if loop == "running":  # another factory keeps the loop thread running
            stack.enter_context(sync.connect(backend, **opts))
        factory = sync.connect(backend, **opts)
        q = factory.queue("jobs", reserve_delay=600.0)
        q.push({"a": 1})
        if point == "claim":
            monkeypatch.setattr(sync, "_settle_once", settle_close_then_interrupted)
        else:
            handovers = _Handovers()
            handovers.caller_dropped = close_then_interrupted
            q.queue._handovers = handovers
        with pytest.raises(KeyboardInterrupt):
            getattr(q, taking)(timeout=60)
        monkeypatch.setattr(sync, "_settle_once", real)
        assert not armed  # the close ran where the test meant it to
        factory.close()
    with sync.connect(backend, **opts) as again:
        sizes = again.queue("jobs").sizes()
        assert (sizes.total, sizes.reserved) == (1, 0), sizes


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.id in ("redis-oq", "postgres", "mongo")],
    indirect=True,
    ids=lambda c: c.id,
)
def test_a_pool_or_client_of_another_event_loop_is_refused(case: BackendCase) -> None:
    """A ``pool=`` / ``client=`` made on the application's own event loop and given to the
    shim (whose loop is its own thread's) can never be used there: asyncpg, redis-py and
    PyMongo bind their connections to the loop they were made on. It was used all the
    same: the PostgreSQL backend raised a misleading connection error ("another operation
    is in progress") after driving the user's pool from two loops at once, the Redis and
    MongoDB backends a raw ``RuntimeError``. Now a ``ConfigError`` saying so, before
    anything is written, the user's pool or client still working on its own loop."""
    backend, opts = case.name, case.options(new_token())
    own = asyncio.new_event_loop()
    runner = threading.Thread(target=own.run_forever, name="the application's loop")
    runner.start()

    def on_own(work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, own).result(timeout=30)

    async def make() -> Any:
        if backend == "postgres":
            import asyncpg

            pool = await asyncpg.create_pool(opts["url"], min_size=1, max_size=2)
            await pool.fetchval("SELECT 1")
            return pool
        if backend == "mongo":
            from pymongo import AsyncMongoClient

            mongo: Any = AsyncMongoClient(opts["url"])
            await mongo.admin.command("ping")
            return mongo
        import redis.asyncio as aioredis
        from redis.maint_notifications import MaintNotificationsConfig

        client = aioredis.Redis.from_url(
            opts["url"], maint_notifications_config=MaintNotificationsConfig(enabled=False)
        )
        await client.ping()
        return client

    given = on_own(make())
    try:
        extra = {"pool": given} if backend == "postgres" else {"client": given}
        rest = {k: v for k, v in opts.items() if k != "url"}
        with pytest.raises(aio_keuss.ConfigError, match="event loop"):
            sync.connect(backend, **rest, **extra)
        assert portal_threads() == []
        if backend == "postgres":
            assert on_own(given.fetchval("SELECT to_regnamespace($1) IS NULL", opts["schema"]))
        elif backend == "mongo":
            assert on_own(given.admin.command("ping"))["ok"]
            assert opts["database"] not in on_own(given.list_database_names())
        else:
            assert on_own(given.ping())
            assert on_own(given.keys(opts["prefix"] + "*")) == []
    finally:
        on_own(given.close() if backend != "redis-oq" else given.aclose())
        own.call_soon_threadsafe(own.stop)
        runner.join()
        own.close()
        if case.cleanup is not None:
            asyncio.run(case.cleanup(opts))


# A fork while another thread waits in a blocking reserve; the child ends normally:
# ``python -c FORKED_DURING_RESERVE <backend> <options json>``. It prints how the child ended
# (0: exited, having been refused the parent's factory with an error saying to connect again).
FORKED_DURING_RESERVE = r"""
import faulthandler, json, os, sys, threading
import aio_keuss
from aio_keuss import sync

backend, options = sys.argv[1], json.loads(sys.argv[2])
factory = sync.connect(backend, **options)
queue = factory.queue("jobs")
got = []
waiter = threading.Thread(target=lambda: got.append(queue.reserve(timeout=120)))
waiter.start()


def waiting(frame):  # the waiter is in reserve, waiting for the loop thread's answer
    while frame is not None and frame.f_code.co_name != "_outcome":
        frame = frame.f_back
    return frame is not None


while waiter.ident is None or not waiting(sys._current_frames().get(waiter.ident)):
    threading.Event().wait(0.01)
pid = os.fork()
if pid == 0:  # the child: refuses the parent's factory, then exits as a program does
    faulthandler.dump_traceback_later(30, exit=True)  # a hang ends with status 1
    try:
        queue.push("from the child")
    except aio_keuss.ClosedError as exc:  # saying why, and what to do
        sys.exit(0 if "fork" in str(exc) and "connect again" in str(exc) else 3)
    sys.exit(2)
_, status = os.waitpid(pid, 0)
queue.push("for the waiter")
waiter.join()
factory.close()
print(json.dumps({"child": os.waitstatus_to_exitcode(status), "reserved": got[0].payload}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("backend", ["memory", "redis-oq"])
def test_a_child_forked_while_a_thread_waits_in_reserve_exits(backend: str) -> None:
    """A child forked while another thread of the parent waited in ``reserve`` hung in its
    normal exit (``sys.exit``, the end of the program): at the interpreter's finalization
    the parent's portal, kept referenced by the shim, was freed with the module, and its
    ``start_blocking_portal`` generator, closed, asked the parent's loop thread (which does
    not exist in a child) to stop and waited for ever. Now the child exits, status 0."""
    options = {"url": REDIS_URL, "prefix": f"aks-{new_token()}"} if backend != "memory" else {}
    try:
        done = _program(FORKED_DURING_RESERVE, backend, json.dumps(options), limit=90)
    finally:
        if options:
            asyncio.run(_drop_redis_prefix(options))
    assert json.loads(done.stdout) == {"child": 0, "reserved": "for the waiter"}


class _SlottedPortal:
    """A portal of an anyio that keeps no ``_event_loop_thread_id`` (slots, or another
    name for it): the fork hook cannot mark it stopped."""

    __slots__ = ("stopped",)


def test_the_fork_hook_forgets_the_parent_whatever_anyio_s_portal_holds() -> None:
    """The child's fork hook marks the parent's portal stopped through an attribute private
    to anyio (``BlockingPortal._event_loop_thread_id``, present from anyio 4.0 on). Where a
    portal could not take it (a later anyio with slots), the hook raised AttributeError
    before forgetting the parent: the child kept its lock (maybe held by a thread that
    does not exist there) and its portal, and hung at its first call. Now the parent is
    forgotten first and the mark is only tried. (A runtime of its own, no fork: the hook is
    a method, called here as ``os.register_at_fork`` calls it.)"""
    runtime = sync._Runtime()
    held = runtime.lock
    held.acquire()  # a parent thread's, at the fork
    runtime.portal = _SlottedPortal()  # type: ignore[assignment]
    runtime.users, before = 1, runtime.generation
    runtime.forget()
    assert runtime.portal is None
    assert runtime.users == 0
    assert runtime.generation == before + 1
    assert runtime.lock is not held and runtime.lock.acquire(blocking=False)
