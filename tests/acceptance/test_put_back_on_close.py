"""A close under way while a cancelled caller's put-back is still a round trip in flight, on
a store whose calls can be interrupted (PostgreSQL): the put-back runs in a task of its own
(``Coalescer.hand_back``), which the close must wait for before the connection closes, as it
waits for every other call in flight.

The put-back is held at a point the test controls: a connection of the test's own locks the
messages table once the pop has taken its messages, so the put-back's INSERT waits for the
lock; the close is started meanwhile, and the lock released once it has had time to run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import CASES, new_token, until_closed

import aio_keuss

pytestmark = pytest.mark.timeout(120)

_CASES = {case.id: case for case in CASES}


@contextlib.asynccontextmanager
async def _a_put_back_held_by_a_lock(
    put_back: bool,
) -> AsyncIterator[tuple[Any, Any, asyncio.Task[Any], Any]]:
    """A PostgreSQL factory whose pop of two messages is cancelled once its batch answered,
    its put-back's INSERT waiting for a table lock a connection of the test's own holds:
    yields (factory, queue, the popping task, that connection), once the put-back waits.
    With ``put_back``, both messages must be ready again afterwards."""
    asyncpg = pytest.importorskip("asyncpg")
    case = _CASES["postgres"]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    options: dict[str, Any] = {**case.options(new_token()), "stats": "memory", "signal": "local"}
    blocker = None
    try:
        factory = await aio_keuss.connect(case.name, **options)
        q = await factory.queue("jobs")
        await q.push_many([{"n": 1}, {"n": 2}])
        blocker = await asyncpg.connect(options["url"])
        store: Any = q._store
        primitive = store.get
        loop = asyncio.get_running_loop()
        locked = asyncio.Event()

        async def get(n: int) -> Any:
            fetched = await primitive(n)
            # the put-back's INSERT will wait for this lock
            await blocker.execute(
                f'BEGIN; LOCK TABLE "{options["schema"]}".messages IN EXCLUSIVE MODE'
            )
            locked.set()
            # the caller is cancelled after its result is set, before it resumes
            loop.call_soon(popping.cancel)
            return fetched

        store.get = get
        popping = asyncio.create_task(q.pop_many(2, max_wait=0))
        await asyncio.wait_for(locked.wait(), 10)
        await asyncio.sleep(0.05)  # the caller is cancelled, its put-back waits for the lock
        yield factory, q, popping, blocker
        if not put_back:
            return
        other = await aio_keuss.connect(case.name, **options)
        try:
            o = await other.queue("jobs")
            ready = await o.pop_many(10, timeout=0)
        finally:
            await other.close()
        assert len(ready) == 2  # put back, none lost
    finally:
        if blocker is not None:
            await blocker.close()
        if case.cleanup is not None:
            await case.cleanup(options)


async def test_a_close_waits_for_a_cancelled_pop_s_put_back() -> None:
    """A pop cancelled once its batch had answered puts its messages back; a close begun
    meanwhile waits for that put-back before it closes the pool. It did not: the pool's
    close then waited for ever for the put-back's connection, which went back to a set of
    held connections already closed (and a put-back starting later found no pool, and the
    popped messages were lost)."""
    async with _a_put_back_held_by_a_lock(put_back=True) as (factory, _, popping, blocker):
        assert not popping.done()
        closing = asyncio.create_task(factory.close())
        await asyncio.sleep(0.3)
        await blocker.execute("ROLLBACK")
        done, _ = await asyncio.wait({closing}, timeout=10)
        assert closing in done, "the close hangs"
        closing.result()
        with pytest.raises(asyncio.CancelledError):
            await popping


async def test_a_cancelled_close_past_its_grace_ends_with_a_put_back_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same put-back, whose INSERT never ends (a lock held through the test), and the
    close cancelled: past ``CANCELLED_CLOSE_GRACE`` the close gives the put-back up (it is
    cancelled, as the batches are) and ends, rather than wait for ever in the pool's close."""
    import aio_keuss.queue

    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.2)
    async with _a_put_back_held_by_a_lock(put_back=False) as (factory, q, popping, _):
        closing = asyncio.create_task(factory.close())
        await until_closed(q)  # the close waits for what is in flight
        closing.cancel()
        done, _ = await asyncio.wait({closing}, timeout=10)
        assert closing in done, "the close hangs"
        assert closing.cancelled()
        await asyncio.gather(popping, return_exceptions=True)
