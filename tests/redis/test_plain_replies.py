"""The one-message calls' plain reply futures on the fast lane (real Redis).

A one-message call (a pop's, a reserve's, an ok's, a push's) is sent with a plain asyncio
future for its reply, which its awaiting task handles on asyncio's fast path. A plain future
is cancelled with its caller; the command still runs, so its reply must reach the future
``late_reply`` swaps in, whether the reply comes before the caller asks for it (parked) or
after (swapped), an error reply, a NOSCRIPT answered by the EVAL sent again, and a lost
connection alike.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from backends import REDIS_URL, _drop_redis_prefix
from polling import until
from reply_gate import ReplyGate

import aio_keuss
from aio_keuss import coalesce
from aio_keuss.errors import KeussConnectionError
from aio_keuss.redis import connection as redis_connection

pytestmark = pytest.mark.timeout(60)

ECHO = redis_connection.Script("return ARGV[1]")


@pytest.fixture
async def lane() -> AsyncIterator[redis_connection._FastLane]:
    lane = redis_connection._FastLane({"host": "127.0.0.1", "port": 6379}, "first")
    await lane.call(("PING",))
    try:
        yield lane
    finally:
        lane.close()


def _bound(lane: redis_connection._FastLane, script: bool) -> redis_connection._Bound:
    if script:
        return redis_connection._Bound(lane, ("EVALSHA", ECHO.sha, 0), ECHO)
    return redis_connection._Bound(lane, ("ECHO",), None)


async def _parked(lane: redis_connection._FastLane) -> None:
    """Until the reply of a cancelled plain future came in (and was parked)."""
    protocol = lane._protocol
    assert protocol is not None

    async def parked() -> bool:
        return bool(protocol._parked)

    await until(parked, guard=20)


@pytest.mark.parametrize("script", [False, True], ids=["command", "script"])
@pytest.mark.parametrize("when", ["swapped", "parked"])
async def test_a_cancelled_plain_reply_goes_to_its_late_future(
    lane: redis_connection._FastLane, script: bool, when: str
) -> None:
    reply = _bound(lane, script).send_now("hello")
    assert reply is not None and type(reply) is asyncio.Future
    assert reply.cancel()  # plain: cancelled at once, as with its caller
    if when == "parked":
        await _parked(lane)
    late = redis_connection.late_reply(reply)
    assert late is not None and late is not reply
    assert await late == b"hello"
    assert redis_connection.late_reply(reply) is None  # handed over once
    assert lane._protocol is not None and not lane._protocol._parked


@pytest.mark.parametrize("when", ["swapped", "parked"])
async def test_a_cancelled_script_the_server_lost_runs_again_for_its_late_future(
    lane: redis_connection._FastLane, when: str
) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.script_flush()
    finally:
        await client.aclose()
    reply = _bound(lane, True).send_now("again")
    assert reply is not None and reply.cancel()
    if when == "parked":
        await _parked(lane)  # the EVAL's reply, sent again on the NOSCRIPT
    late = redis_connection.late_reply(reply)
    assert late is not None
    assert await late == b"again"


@pytest.mark.parametrize("when", ["swapped", "parked"])
async def test_an_error_reply_goes_to_the_late_future(
    lane: redis_connection._FastLane, when: str
) -> None:
    bound = redis_connection._Bound(lane, ("INCR",), None)
    key = "akplain:not-a-number"
    await lane.call(("SET", key, "x"))
    try:
        reply = bound.send_now(key)
        assert reply is not None and reply.cancel()
        if when == "parked":
            await _parked(lane)
        late = redis_connection.late_reply(reply)
        assert late is not None
        with pytest.raises(aio_keuss.BackendError):
            await late
    finally:
        await lane.call(("DEL", key))


async def test_a_lost_connection_fails_the_late_future() -> None:
    gate = ReplyGate("127.0.0.1", 6379)
    lane = redis_connection._FastLane({"host": "127.0.0.1", "port": gate.port}, "first")
    try:
        await lane.call(("PING",))
        gate.shut()
        reply = _bound(lane, False).send_now("lost")
        assert reply is not None and reply.cancel()
        late = redis_connection.late_reply(reply)
        assert late is not None and not late.done()
        gate.cut()
        with pytest.raises(KeussConnectionError):
            await late
    finally:
        gate.open()
        lane.close()


async def test_settled_awaits_the_late_future_and_leaves_others_alone(
    lane: redis_connection._FastLane,
) -> None:
    reply = _bound(lane, False).send_now("settled")
    assert reply is not None and reply.cancel()
    settled = await coalesce.settled(reply)
    assert coalesce.replied(settled) and settled.result() == b"settled"
    other = asyncio.get_running_loop().create_future()
    other.cancel()
    assert await coalesce.settled(other) is other  # no store knows it: as it stands


@asynccontextmanager
async def _a_pop_whose_reply_is_held(
    prefix: str,
) -> AsyncIterator[tuple[ReplyGate, aio_keuss.Queue, asyncio.Future[aio_keuss.Message | None]]]:
    """A redis-oq queue (keys under ``prefix``) reached through a gate, one message pushed,
    then a pop sent whose reply the gate holds back. Yields the gate, the queue and the
    pop's task; on the way out the gate opens and the keys go, after the factory's close,
    which writes the queue's counters."""
    gate = ReplyGate("127.0.0.1", 6379)
    url = f"redis://127.0.0.1:{gate.port}/0"
    try:
        async with aio_keuss.connect("redis-oq", url=url, prefix=prefix) as factory:
            q = await factory.queue("q")
            await q.push("kept")
            gate.shut()
            task = asyncio.ensure_future(q.pop(timeout=5))
            protocol = factory.backend._lane._protocol  # type: ignore[attr-defined]

            async def sent() -> bool:
                return bool(protocol._waiting)

            await until(sent, guard=20)  # its reply is held
            yield gate, q, task
    finally:
        gate.open()
        await _drop_redis_prefix({"url": REDIS_URL, "prefix": prefix})


async def _ends_cancelled_and_gives_back(
    gate: ReplyGate, q: aio_keuss.Queue, task: asyncio.Future[aio_keuss.Message | None]
) -> None:
    """The reply let through, the cancelled pop ends cancelled and the message it took is
    back in the queue (not lost)."""
    gate.open()
    with pytest.raises(asyncio.CancelledError):
        await task
    again = await q.pop(timeout=5)
    assert again is not None and again.payload == "kept"


async def test_a_pop_cancelled_while_its_reply_is_held_gives_its_message_back() -> None:
    """The pop's task is cancelled while the server's reply is held back: its plain future
    is cancelled with it, the caller waits for the reply on the late future, and puts the
    message it took back (not lost), then ends cancelled."""
    async with _a_pop_whose_reply_is_held("akplain") as (gate, q, task):
        task.cancel()
        await asyncio.sleep(0.1)
        assert not task.done()  # waiting for the reply, as one that refuses would
        await _ends_cancelled_and_gives_back(gate, q, task)


async def test_another_threads_loop_busy_on_its_connections_leaves_late_reply_alone() -> None:
    """A process may run loops in several threads (the sync shim's, the application's):
    finding the future a cancelled reply goes to looks at this loop's connections only.
    Reading another loop's, which its thread changes meanwhile (a command sent, a reply
    in, a connection made), raised RuntimeError (deque mutated during iteration) into the
    cancelled caller, whose reply was then parked for nobody (a pop's message lost).
    Thread switches made frequent for the while, so that one lands mid-look."""
    stop = threading.Event()
    ready = threading.Event()

    def busy() -> None:
        async def main() -> None:
            lanes = []
            for _ in range(32):
                lanes.append(redis_connection._FastLane({"host": "127.0.0.1", "port": 6379}))
                await lanes[-1].call(("PING",))
            ready.set()
            try:
                while not stop.is_set():
                    await asyncio.gather(*(la.call(("PING",)) for la in lanes for _ in range(100)))
            finally:
                for la in lanes:
                    la.close()

        asyncio.run(main())

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    lane = redis_connection._FastLane({"host": "127.0.0.1", "port": 6379}, "first")
    interval = sys.getswitchinterval()
    try:
        await lane.call(("PING",))
        await asyncio.get_running_loop().run_in_executor(None, ready.wait)
        sys.setswitchinterval(1e-6)
        bound = _bound(lane, False)
        for _ in range(2000):
            reply = bound.send_now("x")
            assert reply is not None and reply.cancel()
            late = redis_connection.late_reply(reply)
            assert late is not None
            assert await late == b"x"
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        lane.close()


class _OwnFuture(asyncio.Future[Any]):
    """A loop's own class of future, as an instrumented loop may make."""


class _OwnFutureLoop(asyncio.SelectorEventLoop):
    def create_future(self) -> asyncio.Future[Any]:
        return _OwnFuture(loop=self)


def test_a_pop_cancelled_on_a_loop_with_futures_of_its_own_gives_its_message_back() -> None:
    """A loop whose ``create_future`` makes a class of its own: the reply future of a
    one-message call is still one ``late_reply`` knows, so a pop cancelled while its reply
    is held waits for it and puts the message back. Made by the loop, it was a future the
    connection did not recognise once cancelled: its reply was dropped, the message lost."""

    async def main() -> None:
        async with _a_pop_whose_reply_is_held("akownloop") as (gate, q, task):
            task.cancel()
            await asyncio.sleep(0)
            await _ends_cancelled_and_gives_back(gate, q, task)

    with asyncio.Runner(loop_factory=_OwnFutureLoop) as runner:
        runner.run(main())
