"""A queue's close that failed (its server down) is called again once the server is back:
it must finish the close, not return at once with the store still open."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token
from black_hole import BlackHole

import aio_keuss
from aio_keuss.errors import ClosedError, KeussConnectionError


@contextlib.asynccontextmanager
async def _bucket_redis_behind_a_hole() -> AsyncIterator[
    tuple[aio_keuss.Factory, BlackHole, dict[str, Any]]
]:
    """A bucket-redis factory reaching the server through a proxy the test can cut, its
    state written only at close (an ok or a reservation stays unwritten until then) and
    its reservations kept for an hour (what a failed close forgets stays out of reach).
    On the way out the server comes back and the factory closes: what is still open, a
    failed close's queue too."""
    options: dict[str, Any] = {
        "prefix": f"akr-{new_token()}",
        "state_flush_period": 3600.0,
        "reserve_delay": 3600.0,
    }
    hole = BlackHole("127.0.0.1", 6379, b"")
    await hole.start()
    url = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{hole.port}")
    factory = await aio_keuss.connect("bucket-redis", url=url, **options)
    try:
        yield factory, hole, options
    finally:
        hole.restore()
        await factory.close()
        hole.close()


async def _hold_one_of_three(q: aio_keuss.Queue) -> None:
    """Three messages pushed, one reserved, and that reservation written: the close's own
    drain then has no round trip, and the queue counts as closed before its store's close."""
    for n in range(3):
        await q.push(n)
    assert await q.reserve() is not None
    await q.drain()


async def _left_after(options: dict[str, Any]) -> list[Any]:
    """The payloads a new factory (straight to the server) can pop from queue "retry",
    sorted; the test's keys dropped."""
    after = await aio_keuss.connect("bucket-redis", url=REDIS_URL, **options)
    try:
        q = await after.queue("retry")
        left = []
        while (message := await q.pop(timeout=1)) is not None:
            left.append(message.payload)
        return sorted(left)
    finally:
        await after.close()
        await _drop_redis_prefix({"url": REDIS_URL, **options})


async def test_a_close_that_failed_is_finished_by_the_next_one() -> None:
    """The drain of a bucket store's close writes the state of its leased buckets (an ok
    not written yet); the server down, that write fails and the close raises before the
    queue counts as closed. Called again once the server is back, the close returned at
    once (the first one was over) and the store was never closed: the ok was never
    written, the reservation never given back, and the leased bucket stayed out of reach
    of every other process until its lease lapsed (``reserve_delay`` here)."""
    async with _bucket_redis_behind_a_hole() as (factory, hole, options):
        q = await factory.queue("retry")
        for n in range(3):
            await q.push(n)
        done = await q.reserve()
        held = await q.reserve()
        assert done is not None and held is not None
        assert await q.ok(done)
        hole.cut()
        with pytest.raises(KeussConnectionError):
            await q.close()
        hole.restore()
        await q.close()  # finishes the close: the ok written, the reservation given back
    assert await _left_after(options) == sorted({0, 1, 2} - {done.payload})


@pytest.mark.parametrize("asked_again", ["server back", "server away"])
async def test_a_close_that_failed_after_the_queue_counted_as_closed_is_not_forgotten(
    asked_again: str,
) -> None:
    """The drain has nothing left to write (the leased bucket's state is written), so the
    queue counts as closed; the bucket store's close under it then fails to give the bucket
    back (the server down). The next ``factory.queue(name)`` dropped that queue and opened
    the name afresh: nothing closed its store again, not even ``factory.close()``, and the
    reservation held and the leased bucket stayed out of reach of every process until the
    lease lapsed (``reserve_delay`` here). The ask now closes it first; the server still
    down, the ask fails as that close does, and ``factory.close()`` closes it once the
    server is back."""
    async with _bucket_redis_behind_a_hole() as (factory, hole, options):
        q = await factory.queue("retry")
        await _hold_one_of_three(q)
        hole.cut()
        with pytest.raises(KeussConnectionError):
            await q.close()
        with pytest.raises(ClosedError):  # it counted as closed
            await q.size()
        if asked_again == "server back":
            hole.restore()
            again = await factory.queue("retry")  # closes the one that failed first
            assert again is not q
        else:
            with pytest.raises(KeussConnectionError):
                await factory.queue("retry")
            hole.restore()
    assert await _left_after(options) == [0, 1, 2]  # the reservation given back, the bucket too


@pytest.mark.parametrize("closed_again_by", ["queue.close", "factory.queue", "factory.close"])
async def test_a_cancelled_close_whose_store_close_failed_is_not_forgotten(
    closed_again_by: str,
) -> None:
    """A close cancelled (a shutdown timeout) once the queue counted as closed finishes in
    its grace, closing the store; the server down, that close fails too, and was only
    logged: the close ended cancelled, so neither ``queue.close()`` nor the next
    ``factory.queue(name)`` nor ``factory.close()`` ran it again. The name was opened
    afresh beside it, and the reservation held and the leased bucket stayed out of reach
    of every process until the lease lapsed (``reserve_delay`` here). The failure in the
    grace now counts as a failed close: closed again as one that raised."""
    async with _bucket_redis_behind_a_hole() as (factory, hole, options):
        q = await factory.queue("retry")
        await _hold_one_of_three(q)
        hole.cut()
        closing = asyncio.ensure_future(q.close())
        while not q._closed and not closing.done():  # noqa: ASYNC110 - nothing tells of it
            await asyncio.sleep(0)
        assert not closing.done()  # counts as closed, its store's close retrying its writes
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing  # its grace over: the store's close failed there too
        hole.restore()
        if closed_again_by == "queue.close":
            await q.close()  # runs again, as after a close that raised
        elif closed_again_by == "factory.queue":
            again = await factory.queue("retry")  # closes the one that failed first
            assert again is not q
    assert await _left_after(options) == [0, 1, 2]  # the reservation given back, the bucket too


async def test_a_close_again_whose_asker_was_cancelled_reports_its_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``factory.queue(name)`` closes again, shielded, a queue whose close failed after it
    counted as closed; cancelled meanwhile, the ask leaves that close running, and nobody
    waits for it any more. The server still down, its failure went to asyncio's "Task
    exception was never retrieved" (an ERROR with a traceback, whenever the task was
    collected), not to the WARNING a close nobody waits for logs; still closed again by
    ``factory.close()`` once the server is back."""
    async with _bucket_redis_behind_a_hole() as (factory, hole, options):
        q = await factory.queue("retry")
        await _hold_one_of_three(q)
        hole.cut()
        with pytest.raises(KeussConnectionError):
            await q.close()
        first = q._closing.task
        asking = asyncio.ensure_future(factory.queue("retry"))
        while q._closing.task is first:  # noqa: ASYNC110 - nothing tells of it
            await asyncio.sleep(0)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        again = q._closing.task
        assert again is not None
        await asyncio.wait({again})  # the close the ask began fails, the server down
        assert again.exception() is not None
        del again, first
        gc.collect()
        assert "never retrieved" not in caplog.text
        assert "'retry': close failed" in caplog.text
        hole.restore()
    assert await _left_after(options) == [0, 1, 2]


@pytest.mark.parametrize("asked_again", [True, False], ids=["asked-again", "factory-close"])
async def test_a_tool_s_queue_whose_close_failed_as_the_user_claimed_it_is_not_forgotten(
    asked_again: bool,
) -> None:
    """A queue the factory opened by itself (here a tool's, as the admin commands open one;
    a move's target, the deadletter queue) is closed when the user first asks for it with
    other options, and the name reopened with them. That close failing once the queue
    counted as closed (the bucket store's give-back, the server down), the ask failed and
    the queue, already out of the factory's map, was forgotten: nothing closed it again,
    not even ``factory.close()``, and the reservation it held and its leased bucket stayed
    out of every process's reach until the lease lapsed. It is now kept, closed again by
    the next ask or by the factory's close, as a queue whose own close failed is."""
    async with _bucket_redis_behind_a_hole() as (factory, hole, options):
        q = await factory._recorded("retry", {})  # opened by a tool, not asked for
        await _hold_one_of_three(q)
        hole.cut()
        with pytest.raises(KeussConnectionError):
            await factory.queue("retry", reserve_delay=1800.0)  # closes the tool's first
        hole.restore()
        if asked_again:  # closes the tool's again, then opens the user's
            again = await factory.queue("retry", reserve_delay=1800.0)
            assert again is not q and again.options.reserve_delay == 1800.0
    assert await _left_after(options) == [0, 1, 2]  # the reservation given back, the bucket too


@pytest.mark.parametrize("begun", [True, False], ids=["begun", "before-its-task-ran"])
async def test_a_cancelled_factory_close_ends_cancelled_when_the_server_is_away(
    begun: bool,
) -> None:
    """A ``factory.close()`` cancelled (a shutdown timeout, ``asyncio.timeout`` around it)
    on a server that went away ended with the connection's failure, KeussConnectionError,
    raised in place of the cancellation: the caller's cancel was swallowed (a TaskGroup, a
    timeout saw a failure where it cancelled), as a queue's cancelled close did before its
    store's failure was logged instead. Cancelled once its task ran a step (the closes of
    the stats store and connection failed then), or before (the close then runs in the
    caller's task, and failed there). It now ends cancelled, the failure logged."""
    options = {"prefix": f"akr-{new_token()}", "state_flush_period": 3600.0}
    hole = BlackHole("127.0.0.1", 6379, b"")
    await hole.start()
    url = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{hole.port}")
    factory = await aio_keuss.connect("bucket-redis", url=url, **options)
    try:
        q = await factory.queue("away")
        await q.push(1)
        await q.drain()
        hole.cut()
        closing = asyncio.create_task(factory.close())
        await asyncio.sleep(0)  # in close; its task has not run a step
        if begun:
            for _ in range(10_000):  # its first step, then it waits: cancelled there
                if factory._close_begun:
                    break
                await asyncio.sleep(0)
        closing.cancel()
        (outcome,) = await asyncio.gather(closing, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError), repr(outcome)
    finally:
        hole.restore()
        hole.close()
        await _drop_redis_prefix({"url": REDIS_URL, **options})
