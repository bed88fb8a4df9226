"""The consumer's handler time limits, one timer for every handler: each handler still gets
its own deadline, and an expiry behaves as ``asyncio.timeout`` does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aio_keuss
from aio_keuss import Message
from aio_keuss.deadlines import Deadlines


async def _limited(deadlines: Deadlines, work: Any) -> Any:
    """Run ``work`` under a deadline as the consumer does."""
    task = asyncio.current_task()
    assert task is not None
    return await deadlines.watch(deadlines.start(task), work)


async def test_a_handler_past_its_deadline_gets_a_timeout_error() -> None:
    deadlines = Deadlines(asyncio.get_running_loop(), 0.05)
    forever = asyncio.Event()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(_limited(deadlines, forever.wait()), 30)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the expiry's cancel was taken back


async def test_only_the_handlers_past_their_deadline_are_cancelled() -> None:
    # Handlers started one after another share the timer: the quick ones finish, the one
    # that hangs times out, and one started after it, still within its own time, finishes.
    deadlines = Deadlines(asyncio.get_running_loop(), 0.2)
    hang, late_may_end = asyncio.Event(), asyncio.Event()

    async def quick(n: int) -> int:
        await asyncio.sleep(0)
        return n

    async def late() -> str:
        await late_may_end.wait()
        return "late"

    assert await _limited(deadlines, quick(1)) == 1
    hanging = asyncio.ensure_future(_limited(deadlines, hang.wait()))
    await asyncio.sleep(0)
    assert await _limited(deadlines, quick(2)) == 2
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(hanging, 30)
    late_one = asyncio.ensure_future(_limited(deadlines, late()))
    await asyncio.sleep(0)
    late_may_end.set()
    assert await asyncio.wait_for(late_one, 30) == "late"


async def test_a_cancellation_from_outside_wins_over_the_expiry() -> None:
    # Expired and cancelled by a stop at once: the stop's CancelledError goes on, as with
    # asyncio.timeout (whichever of the two the loop runs first).
    deadlines = Deadlines(asyncio.get_running_loop(), 0.0)
    forever = asyncio.Event()
    handler = asyncio.ensure_future(_limited(deadlines, forever.wait()))
    await asyncio.sleep(0)  # it started: its deadline is now
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    assert handler.cancelled()


async def test_a_handler_that_swallows_the_expiry_returns_normally() -> None:
    deadlines = Deadlines(asyncio.get_running_loop(), 0.05)

    async def stubborn() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "kept going"
        return "never"

    assert await asyncio.wait_for(_limited(deadlines, stubborn()), 30) == "kept going"
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_batch_handler_past_its_timeout_is_ko_ed() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push_many(["a", "b"])
        calls: list[int] = []

        async def hang_once(batch: list[Message]) -> None:
            calls.append(len(batch))
            if len(calls) == 1:
                await asyncio.Event().wait()

        consumer = q.consume(hang_once, batch=2, timeout=0.05, retry_delay=0.0)
        for _ in range(3000):
            if consumer.handled == 2:
                break
            await asyncio.sleep(0.01)
        await consumer.stop()
        status = consumer.status()
        assert calls[0] == 2
        assert (status.timed_out, status.failed, status.handled) == (1, 2, 2)
