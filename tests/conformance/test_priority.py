"""Conformance: priorities. Of the messages ready, the highest priority comes out first; among
one priority the queue's own order (mature time, then push order) holds. A priority stays
with its message through reservations, ko's, lapses, moves and the deadletter queue.

Every backend runs it: those without ``capabilities.priority`` refuse any priority but 0
(before anything is written); bad input is refused everywhere the same way. Time bounds are
generous functional limits, never performance assertions.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest
from conftest import Connect, drain_all, needs

import aio_keuss
from aio_keuss import NewMessage

pytestmark = pytest.mark.timeout(90)


async def _until(
    reading: Callable[[], Awaitable[int]], value: int, *, at_least: bool = False
) -> None:
    """Wait for a size to reach ``value``: a condition, not a guess at how long it takes."""
    while True:
        now = await reading()
        if now == value or (at_least and now > value):
            return
        await asyncio.sleep(0.05)


def _needs_priority(holder: aio_keuss.Factory | aio_keuss.Queue) -> None:
    needs(holder, "priority")
    assert holder.capabilities.fifo  # the order among one priority is checked too


# input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [True, 1.0, "1", None, 2**15, -(2**15) - 1, 2**70])
async def test_a_bad_priority_is_refused_before_anything_is_written(
    queue: aio_keuss.Queue, bad: object
) -> None:
    with pytest.raises(aio_keuss.InvalidInputError, match="priority"):
        await queue.push("x", priority=bad)  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.InvalidInputError, match="priority"):
        await queue.push_many(["x", "y"], priority=bad)  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.InvalidInputError, match="priority"):
        await queue.push_each([NewMessage("x"), NewMessage("y", priority=bad)])  # type: ignore[arg-type]
    if queue.capabilities.delay and queue.capabilities.idempotent:
        with pytest.raises(aio_keuss.InvalidInputError, match="priority"):
            queue.repeat("r", "x", every=60, priority=bad)  # type: ignore[arg-type]
    assert await queue.total_size() == 0


async def test_a_priority_where_the_backend_has_none_is_refused(queue: aio_keuss.Queue) -> None:
    if queue.capabilities.priority:
        pytest.skip("this backend has priorities")
    with pytest.raises(aio_keuss.NotSupportedError, match="priority"):
        await queue.push("x", priority=1)
    with pytest.raises(aio_keuss.NotSupportedError, match="priority"):
        await queue.push_many(["x"], priority=-1)
    with pytest.raises(aio_keuss.NotSupportedError, match="priority"):
        await queue.push_each([NewMessage("x"), NewMessage("y", priority=3)])
    assert await queue.total_size() == 0
    # 0 is every message's priority, asked for or not
    await queue.push("a", priority=0)
    await queue.push_many(["b"], priority=0)
    got = await drain_all(queue)
    assert sorted(m.payload for m in got) == ["a", "b"]
    assert {m.priority for m in got} == {0}


# order ------------------------------------------------------------------------------------


async def test_higher_priorities_come_out_first(queue: aio_keuss.Queue) -> None:
    _needs_priority(queue)
    await queue.push("plain 1")
    await queue.push("low", priority=-5)
    await queue.push("high 1", priority=7)
    await queue.push("mid", priority=1)
    await queue.push("plain 2", priority=0)
    await queue.push("high 2", priority=7)
    await queue.push("top", priority=2**15 - 1)
    await queue.push("bottom", priority=-(2**15))
    first = await queue.pop(timeout=5)
    assert first is not None and first.payload == "top" and first.priority == 2**15 - 1
    rest = await drain_all(queue)
    assert [(m.payload, m.priority) for m in rest] == [
        ("high 1", 7),
        ("high 2", 7),
        ("mid", 1),
        ("plain 1", 0),
        ("plain 2", 0),
        ("low", -5),
        ("bottom", -(2**15)),
    ]


async def test_batches_of_many_priorities_come_out_in_order(queue: aio_keuss.Queue) -> None:
    """Many messages over a few levels, pushed one by one, by push_many and by push_each,
    then taken in batches: by priority, and in push order within one."""
    _needs_priority(queue)
    rng = random.Random(17)
    pushed: list[tuple[int, int]] = []  # (priority, n) in push order
    for n in range(30):
        level = rng.choice((-2, 0, 0, 3, 9))
        await queue.push(n, priority=level)
        pushed.append((level, n))
    await queue.push_many([30, 31, 32], priority=3)
    pushed += [(3, 30), (3, 31), (3, 32)]
    levels = [rng.choice((-2, 0, 3, 9)) for _ in range(20)]
    await queue.push_each([NewMessage(33 + i, priority=p) for i, p in enumerate(levels)])
    pushed += [(p, 33 + i) for i, p in enumerate(levels)]
    expected = [n for _, n in sorted(pushed, key=lambda pair: -pair[0])]  # a stable sort
    taker = queue.reserve_many if queue.capabilities.reserve else queue.pop_many
    got: list[aio_keuss.Message] = []
    while batch := await taker(7, timeout=0):
        got.extend(batch)
    assert [m.payload for m in got] == expected
    assert [m.priority for m in got] == sorted((p for p, _ in pushed), reverse=True)


async def test_a_delayed_message_waits_for_its_time_whatever_its_priority(
    queue: aio_keuss.Queue,
) -> None:
    _needs_priority(queue)
    await queue.push("urgent, later", delay=1.0, priority=100)
    await queue.push("plain")
    first = await queue.pop(timeout=0)
    assert first is not None and first.payload == "plain"
    await queue.push("plain, after")
    await _until(queue.sched_size, 0)
    # once due, it goes before the plain message waiting beside it
    late = await queue.pop(timeout=5)
    assert late is not None and late.payload == "urgent, later" and late.priority == 100
    last = await queue.pop(timeout=5)
    assert last is not None and last.payload == "plain, after"


# a priority stays with its message --------------------------------------------------------


async def test_a_priority_outlives_a_ko(queue: aio_keuss.Queue) -> None:
    _needs_priority(queue)
    needs(queue, "reserve")
    await queue.push("high", priority=3)
    held = await queue.reserve(timeout=5)
    assert held is not None and held.priority == 3
    await queue.push("plain")
    assert await queue.ko(held)
    again = await queue.reserve(timeout=5)
    assert again is not None and (again.payload, again.priority, again.tries) == ("high", 3, 1)
    assert await queue.ok(again)


async def test_a_priority_outlives_a_lapsed_reservation(connect: Connect) -> None:
    factory = await connect(poll_interval=0.2)
    q = await factory.queue("lapses", reserve_delay=1.0)
    _needs_priority(q)
    needs(q, "reserve", "reservation_expiry")
    await q.push("high", priority=4)
    held = await q.reserve(timeout=5)
    assert held is not None
    await q.push("plain")
    plain = await q.reserve(timeout=5)
    assert plain is not None and plain.payload == "plain"
    assert await q.ko(plain)  # ready again at once, beside the lapsing one
    await _until(q.resv_size, 0)
    again = await q.reserve(timeout=5)
    assert again is not None and (again.payload, again.priority, again.tries) == ("high", 4, 1)


async def test_a_priority_outlives_a_move_and_the_deadletter_queue(connect: Connect) -> None:
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    q = await factory.queue("first")
    _needs_priority(q)
    needs(q, "reserve", "move")
    nxt = await factory.queue("second")
    await q.push("moved", priority=6)
    held = await q.reserve(timeout=5)
    assert held is not None and await q.move(held, "second") is not None
    await nxt.push("plain")
    arrived = await nxt.reserve(timeout=5)
    assert arrived is not None and (arrived.payload, arrived.priority) == ("moved", 6)
    assert await nxt.ko(arrived) == aio_keuss.KoResult.DEADLETTERED
    dead = await factory.queue("__deadletter__")
    found = await dead.pop(timeout=5)
    assert found is not None and (found.payload, found.priority) == ("moved", 6)


async def test_a_priority_outlives_a_requeue_from_the_deadletter_queue(
    connect: Connect,
) -> None:
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    q = await factory.queue("origin")
    _needs_priority(q)
    needs(q, "reserve", "peek", "hold", "move")
    dl = await factory.queue("__deadletter__")
    await q.push("urgent", priority=8)
    held = await q.reserve(timeout=5)
    assert held is not None and await q.ko(held) == aio_keuss.KoResult.DEADLETTERED
    assert await dl.requeue(origin="origin") == {held.id: held.id}
    await q.push("plain")
    back = await q.reserve(timeout=5)
    assert back is not None and (back.payload, back.priority, back.tries) == ("urgent", 8, 0)


async def test_a_replay_copies_the_priority(factory: aio_keuss.Factory) -> None:
    _needs_priority(factory)
    needs(factory, "history")
    q = await factory.queue("done")
    await q.push("urgent", priority=-4)
    popped = await q.pop(timeout=5)
    assert popped is not None
    [copy] = await q.replay([popped.id], to="again")
    again = await factory.queue("again")
    found = await again.pop(timeout=5)
    assert found is not None and (found.id, found.priority) == (copy, -4)


async def test_peek_and_find_show_the_priority(queue: aio_keuss.Queue) -> None:
    _needs_priority(queue)
    needs(queue, "peek")
    mid = await queue.push("x", priority=-3)
    [view] = await queue.peek(5)
    assert view.message.priority == -3
    found = await queue.find(mid)
    assert found is not None and found.message.priority == -3


async def test_repeat_pushes_with_its_priority(queue: aio_keuss.Queue) -> None:
    _needs_priority(queue)
    needs(queue, "delay", "idempotent")
    await queue.push("plain")
    async with queue.repeat("tick", "tock", every=0.2, priority=2):
        await _until(queue.size, 2, at_least=True)
    first = await queue.pop(timeout=5)
    assert first is not None and (first.payload, first.priority) == ("tock", 2)


async def test_a_put_back_rebuilt_from_the_message_keeps_its_priority(
    queue: aio_keuss.Queue,
) -> None:
    """A popped message given back with no note of what the store handed out (``kept``) is
    rebuilt from the Message: its priority goes back with it, as its tries and mature do.
    (mongo-history revives its record in place, the priority with it.)"""
    _needs_priority(queue)
    await queue.push("high", priority=3)
    popped = await queue.pop(timeout=5)
    assert popped is not None and popped.priority == 3
    await queue._put_back_unhandled([popped])
    again = await queue.pop(timeout=5)
    assert again is not None and (again.payload, again.priority) == ("high", 3)
