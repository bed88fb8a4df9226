"""Conformance: the one-message calls a store sends itself (pop, reserve, ok, push).

Where a store has them (the Redis backends on their pipelined connection), a pop, a
reserve, an ok or a push that finds a free slot sends the store's own call and awaits its
reply with no coroutine between. These tests cancel the caller right after the call is on
the wire, so the cancellation lands while the reply is awaited, and check that what the
store did is kept: a message taken goes back, a commit or an insert is recorded. Backends
without such calls skip (their paths are tested by the batching and cancellation tests).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from conftest import Connect, drain_all, needs

import aio_keuss

pytestmark = pytest.mark.timeout(60)


def _cancel_once_sent(
    queue: aio_keuss.Queue, attribute: str, armed: Callable[[], bool] = lambda: True
) -> Callable[[], None]:
    """Make the queue's one-message call of ``attribute`` cancel its caller's task right
    after sending, from when ``armed()``; returns what undoes it."""
    one = getattr(queue, attribute)
    if one is None:
        pytest.skip("no one-message call of the store's own here")
    send, read = one

    def send_then_cancel(*args: Any) -> Any:
        reply = send(*args)
        task = asyncio.current_task()
        assert task is not None and reply is not None
        if armed():
            task.cancel()  # lands while the reply is awaited: it refuses cancellation
        return reply

    setattr(queue, attribute, (send_then_cancel, read))
    return lambda: setattr(queue, attribute, one)


async def _cancelled(call: Any) -> None:
    task = asyncio.ensure_future(call)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()


@pytest.mark.parametrize("op", ["pop", "reserve"])
@pytest.mark.parametrize("when", ["first try", "after a wait"])
async def test_a_take_cancelled_once_sent_gives_its_message_back(
    queue: aio_keuss.Queue, op: str, when: str
) -> None:
    if op == "reserve":
        needs(queue, "reserve")
    pushed = False
    undo = _cancel_once_sent(queue, "_one_get" if op == "pop" else "_one_reserve", lambda: pushed)
    if when == "first try":
        await queue.push("only")
        pushed = True
        await _cancelled(getattr(queue, op)(timeout=5))
    else:  # the first try finds nothing; the one made when the push wakes it is cancelled
        task = asyncio.ensure_future(getattr(queue, op)(timeout=20))
        while not len(queue._wakeups):  # type: ignore[attr-defined]  # it waits
            assert not task.done(), task
            await asyncio.sleep(0.01)
        pushed = True
        await queue.push("only")
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled()
    undo()
    again = await getattr(queue, op)(timeout=5)
    assert again is not None and again.payload == "only"
    assert again.tries == 0  # given back unseen
    if op == "reserve":
        assert await queue.ok(again)
    assert await queue.size() == 0


async def test_an_ok_cancelled_once_sent_is_committed_and_recorded(
    queue: aio_keuss.Queue,
) -> None:
    needs(queue, "reserve")
    await queue.push("done")
    message = await queue.reserve(timeout=5)
    assert message is not None
    undo = _cancel_once_sent(queue, "_one_commit")
    await _cancelled(queue.ok(message))
    undo()
    assert message.id not in queue._held  # type: ignore[attr-defined]  # nothing to give back
    assert (await queue.stats())["commit"] == 1
    assert await queue.total_size() == 0
    assert not await queue.ok(message)  # already gone


async def test_a_push_cancelled_once_sent_is_stored_counted_and_signalled(
    connect: Connect, case: Any
) -> None:
    producer = await connect(poll_interval=60.0)
    qp = await producer.queue("shared")
    if case.shared:  # a consumer of another process learns of it only from the signal
        consumer = await connect(poll_interval=60.0)
        qc = await consumer.queue("shared")
    else:
        qc = qp
    waiter = asyncio.ensure_future(qc.pop(timeout=50))
    while not len(qc._wakeups):  # type: ignore[attr-defined]  # it looked, and waits
        assert not waiter.done(), waiter
        await asyncio.sleep(0.01)
    undo = _cancel_once_sent(qp, "_one_insert")
    await _cancelled(qp.push("kept"))
    undo()
    message = await asyncio.wait_for(waiter, 20)  # the poll interval is 60 s
    assert message is not None and message.payload == "kept"
    assert (await qp.stats())["put"] == 1


async def test_the_one_message_calls_leave_nothing_behind(queue: aio_keuss.Queue) -> None:
    """Pushes, pops, reserves and oks from a few tasks at once, some of them cancelled at
    random: every message is received once or still queued, and nothing stays reserved."""
    total = 200
    received: list[Any] = []
    await queue.push_many(list(range(total)))

    async def consumer(op: str) -> None:
        while (message := await getattr(queue, op)(timeout=0.5)) is not None:
            received.append(message.payload)
            if op == "reserve":
                await queue.ok(message)

    ops = ["pop", "reserve"] if queue.capabilities.reserve else ["pop"]
    tasks = [asyncio.ensure_future(consumer(ops[i % len(ops)])) for i in range(6)]
    for _ in range(10):
        await asyncio.sleep(0)
        victim = tasks.pop(0)
        victim.cancel()
        tasks.append(asyncio.ensure_future(consumer(ops[len(tasks) % len(ops)])))
    await asyncio.gather(*tasks, return_exceptions=True)
    left = [m.payload for m in await drain_all(queue)]
    assert sorted(received + left) == list(range(total))
