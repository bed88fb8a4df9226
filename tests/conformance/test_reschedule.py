"""Conformance: changing a waiting message where it stands (``promote``, ``reschedule``,
``change_priority``, BullMQ's ``job.promote()``, ``job.changeDelay`` and
``job.changePriority``). A message is waiting when it is in its queue and not under an active
reservation; a change keeps its id, payload, headers and tries, and never makes it come out
twice.

Every backend runs it: those without ``capabilities.reschedule`` refuse (bad input first,
then NotSupportedError, before anything is written). Time bounds are hang guards only.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import Connect, drain_all, needs, sizes_of

import aio_keuss

pytestmark = pytest.mark.timeout(120)

LATER = 3600.0
"""A delay no test waits for: a message pushed with it stays scheduled."""


# input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, -0.5, 1e10, float("nan"), float("inf"), "1", None, True])
async def test_a_bad_delay_is_refused_before_anything_is_written(
    queue: aio_keuss.Queue, bad: object
) -> None:
    message_id = await queue.push("x")
    with pytest.raises(aio_keuss.InvalidDelayError, match="delay"):
        await queue.reschedule(message_id, bad)  # type: ignore[arg-type]
    assert await sizes_of(queue) == (1, 1, 0, 0)


@pytest.mark.parametrize("bad", [True, 1.0, "1", None, 2**15, -(2**15) - 1])
async def test_a_bad_priority_is_refused_before_anything_is_written(
    queue: aio_keuss.Queue, bad: object
) -> None:
    message_id = await queue.push("x")
    with pytest.raises(aio_keuss.InvalidInputError, match="priority"):
        await queue.change_priority(message_id, bad)  # type: ignore[arg-type]
    assert await sizes_of(queue) == (1, 1, 0, 0)


@pytest.mark.parametrize("bad", ["", "a\x00b", 7, None])
async def test_a_bad_id_is_refused(queue: aio_keuss.Queue, bad: object) -> None:
    with pytest.raises(aio_keuss.InvalidIdError):
        await queue.promote(bad)  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.InvalidIdError):
        await queue.reschedule(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.InvalidIdError):
        await queue.change_priority(bad, 0)  # type: ignore[arg-type]


async def test_a_backend_without_it_refuses(queue: aio_keuss.Queue) -> None:
    if queue.capabilities.reschedule:
        pytest.skip("this backend has reschedule")
    message_id = await queue.push("x")
    with pytest.raises(aio_keuss.NotSupportedError, match="reschedule"):
        await queue.promote(message_id)
    with pytest.raises(aio_keuss.NotSupportedError, match="reschedule"):
        await queue.reschedule(message_id, LATER)
    with pytest.raises(aio_keuss.NotSupportedError):
        await queue.change_priority(message_id, 1)
    assert await sizes_of(queue) == (1, 1, 0, 0)


async def test_change_priority_needs_priorities(queue: aio_keuss.Queue) -> None:
    needs(queue, "reschedule")
    if queue.capabilities.priority:
        pytest.skip("this backend has priorities")
    message_id = await queue.push("x")
    with pytest.raises(aio_keuss.NotSupportedError, match="priority"):
        await queue.change_priority(message_id, 1)


async def test_a_closed_queue_refuses(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("closing")
    message_id = await q.push("x")
    await q.close()
    with pytest.raises(aio_keuss.ClosedError):
        await q.promote(message_id)
    with pytest.raises(aio_keuss.ClosedError):
        await q.reschedule(message_id, 1)
    with pytest.raises(aio_keuss.ClosedError):
        await q.change_priority(message_id, 1)


# promote and reschedule -------------------------------------------------------------------


async def test_a_promoted_message_comes_out_among_the_ready_by_its_new_mature_time(
    queue: aio_keuss.Queue,
) -> None:
    needs(queue, "reschedule")
    await queue.push("a")
    later = await queue.push("later", delay=LATER)
    await queue.push("b")
    assert await queue.promote(later)
    assert not await queue.promote(later)  # ready now: nothing left to promote
    got = await drain_all(queue)
    assert [m.payload for m in got] == ["a", "b", "later"]
    assert got[-1].id == later


async def test_promote_of_a_ready_or_unknown_message_is_false(queue: aio_keuss.Queue) -> None:
    needs(queue, "reschedule")
    ready = await queue.push("ready")
    assert not await queue.promote(ready)
    assert not await queue.promote("no-such-message")
    assert not await queue.reschedule("no-such-message", 1)
    assert await sizes_of(queue) == (1, 1, 0, 0)


async def test_reschedule_into_the_future_hides_it_and_back_shows_it(
    queue: aio_keuss.Queue,
) -> None:
    needs(queue, "reschedule")
    message_id = await queue.push("x", headers={"h": "v"})
    assert await queue.reschedule(message_id, LATER)
    assert await sizes_of(queue) == (0, 1, 1, 0)
    assert await queue.pop(timeout=0) is None
    assert await queue.reschedule(message_id, 0)
    got = await queue.pop(timeout=10)
    assert got is not None and got.id == message_id
    assert got.payload == "x" and got.headers.get("h") == "v"
    assert await queue.total_size() == 0


async def test_a_reserved_message_is_left_alone(queue: aio_keuss.Queue) -> None:
    needs(queue, "reschedule", "reserve")
    message_id = await queue.push("x")
    held = await queue.reserve(timeout=10)
    assert held is not None and held.id == message_id
    assert not await queue.promote(message_id)
    assert not await queue.reschedule(message_id, 0)
    assert not await queue.reschedule(message_id, LATER)
    if queue.capabilities.priority:
        assert not await queue.change_priority(message_id, 5)
    assert await queue.ok(held)
    assert not await queue.reschedule(message_id, 0)  # gone


async def test_tries_payload_and_headers_stay(queue: aio_keuss.Queue) -> None:
    needs(queue, "reschedule", "reserve")
    amended = await queue.push({"k": 1}, headers={"h": "1"})
    first = await queue.reserve(timeout=10)
    assert first is not None and first.id == amended
    assert await queue.ko(first, delay=LATER)
    assert await queue.promote(amended)
    again = await queue.reserve(timeout=10)
    assert again is not None and again.id == amended
    assert again.payload == {"k": 1} and again.headers.get("h") == "1"
    assert again.tries == first.tries + 1  # the ko counted, the promote did not
    assert await queue.ok(again)


# priorities -------------------------------------------------------------------------------


async def test_change_priority_reorders(queue: aio_keuss.Queue) -> None:
    needs(queue, "reschedule", "priority")
    ids = [await queue.push(name) for name in ("a", "b", "c", "d")]
    assert await queue.change_priority(ids[2], 5)
    assert await queue.change_priority(ids[3], -1)
    assert await queue.change_priority(ids[1], 3)
    assert await queue.change_priority(ids[1], 0)  # back: its place by push order again
    got = await drain_all(queue)
    assert [(m.payload, m.priority) for m in got] == [("c", 5), ("a", 0), ("b", 0), ("d", -1)]


async def test_change_priority_of_a_scheduled_message_keeps_its_mature_time(
    queue: aio_keuss.Queue,
) -> None:
    needs(queue, "reschedule", "priority")
    scheduled = await queue.push("later", delay=LATER)
    await queue.push("now")
    assert await queue.change_priority(scheduled, 9)
    assert await sizes_of(queue) == (1, 2, 1, 0)
    got = await drain_all(queue)
    assert [m.payload for m in got] == ["now"]
    assert await queue.promote(scheduled)
    promoted = await queue.pop(timeout=10)
    assert promoted is not None and promoted.priority == 9


async def test_a_first_priority_given_by_a_change_orders_the_queue(
    factory: aio_keuss.Factory,
) -> None:
    """A queue that never had a prioritized push: the change must set up what such a push
    would (an index, a mark) so the order holds."""
    q = await factory.queue("fresh")
    needs(q, "reschedule", "priority")
    ids = [await q.push(n) for n in range(5)]
    assert await q.change_priority(ids[4], 1)
    got = await drain_all(q)
    assert [m.payload for m in got] == [4, 0, 1, 2, 3]


# races and wakeups ------------------------------------------------------------------------


async def test_promotes_racing_consumers_never_deliver_twice(queue: aio_keuss.Queue) -> None:
    needs(queue, "reschedule", "reserve")
    count = 40
    ids = await queue.push_many(list(range(count)), delay=LATER)
    delivered: list[str] = []

    async def consumer() -> None:
        while len(delivered) < count:
            message = await queue.reserve(timeout=0.5)
            if message is not None:
                delivered.append(message.id)
                await queue.ok(message)

    async def promoter() -> list[bool]:
        return [await queue.promote(message_id) for message_id in ids]

    async with asyncio.timeout(90):  # a hang guard
        consumers = [asyncio.create_task(consumer()) for _ in range(6)]
        promoted = await promoter()
        await asyncio.gather(*consumers)
    assert all(promoted)
    assert sorted(delivered) == sorted(ids)
    assert await queue.total_size() == 0


async def test_a_promote_wakes_a_waiting_consumer(connect: Connect) -> None:
    """The poll interval is longer than the wait: only the wakeup can deliver."""
    factory = await connect(poll_interval=300.0)
    q = await factory.queue("woken")
    needs(q, "reschedule")
    message_id = await q.push("x", delay=LATER)
    waiter = asyncio.create_task(q.pop(timeout=60))
    await asyncio.sleep(0.2)
    assert await q.promote(message_id)
    message = await asyncio.wait_for(waiter, 90)
    assert message is not None and message.id == message_id


async def test_a_promote_wakes_a_consumer_of_another_factory(connect: Connect, case: Any) -> None:
    if not case.shared:
        pytest.skip("queues are per factory")
    producer, consumer = await connect(poll_interval=300.0), await connect(poll_interval=300.0)
    qp, qc = await producer.queue("shared"), await consumer.queue("shared")
    needs(qp, "reschedule")
    message_id = await qp.push("x", delay=LATER)
    waiter = asyncio.create_task(qc.pop(timeout=60))
    await asyncio.sleep(0.2)
    assert await qp.reschedule(message_id, 0)
    message = await asyncio.wait_for(waiter, 90)
    assert message is not None and message.id == message_id
