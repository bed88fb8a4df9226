"""postgres behind a lock on the messages table that another session holds (a migration's
``ALTER TABLE``, ``VACUUM FULL``, ``CLUSTER``, a ``LOCK TABLE`` left open: ACCESS EXCLUSIVE,
PostgreSQL manual, "Explicit Locking"): a pop or reserve keeps its caller's timeout and
answers "nothing" (``None`` / ``[]``) while the lock is held, taking nothing; once the lock
goes, the messages are all there, each delivered once. Pushes, oks and kos have no timeout:
they wait for the lock, and land once it goes.

Each test works in its own schema, dropped afterwards. The lock is released only after the
call under test returned (or a guard far past its timeout passed), so no assertion times
the machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from backends import POSTGRES_URL

import aio_keuss

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.timeout(120)

GUARD = 20.0
"""How long a call with a timeout of a second at most may take before the test calls it
hung (and releases the lock)."""
HELD_A_WHILE = 1.0
"""How long calls that must wait are left behind the lock before it is released."""


@pytest.fixture
async def factory(schema: str) -> AsyncIterator[aio_keuss.Factory]:
    opened = await aio_keuss.connect(
        "postgres", url=POSTGRES_URL, schema=schema, stats="memory", signal="local"
    )
    try:
        yield opened
    finally:
        await opened.close()


@asynccontextmanager
async def locked(schema: str) -> AsyncIterator[None]:
    """The messages table under ACCESS EXCLUSIVE, held by a session of the test's own until
    the block ends (a migration's lock, as ``ALTER TABLE`` or ``VACUUM FULL`` take it)."""
    holder = await asyncpg.connect(POSTGRES_URL)
    try:
        await holder.execute(f'BEGIN; LOCK TABLE "{schema}".messages IN ACCESS EXCLUSIVE MODE')
        yield
        await holder.execute("ROLLBACK")
    finally:
        await holder.close()  # ends the lock, should the block have raised


Take = Callable[[Any, float], Awaitable[Any]]
TAKES: dict[str, Take] = {
    "reserve": lambda q, timeout: q.reserve(timeout=timeout),
    "pop": lambda q, timeout: q.pop(timeout=timeout),
    "reserve_many": lambda q, timeout: q.reserve_many(5, timeout=timeout),
    "pop_many": lambda q, timeout: q.pop_many(5, timeout=timeout),
}


@pytest.mark.parametrize("timeout", [0.0, 0.5])
@pytest.mark.parametrize("take", sorted(TAKES))
async def test_a_take_behind_a_table_lock_keeps_its_timeout(
    factory: aio_keuss.Factory, schema: str, take: str, timeout: float
) -> None:
    """It waited for the lock, past its timeout, for as long as the lock was held. It now
    answers nothing while the lock is held, and took nothing: the message is there, on its
    first delivery, once the lock goes."""
    q = await factory.queue("jobs")
    await q.push({"n": 1})
    async with locked(schema):
        call = asyncio.create_task(TAKES[take](q, timeout))
        done, _ = await asyncio.wait([call], timeout=GUARD)
        assert done, f"{take}(timeout={timeout}) still waiting {GUARD} s behind the lock"
        assert not call.result(), call.result()  # None or []
    sizes = await q.sizes()
    assert (sizes.total, sizes.reserved) == (1, 0), sizes
    message = await q.reserve(timeout=GUARD)
    assert message is not None and message.payload == {"n": 1}
    assert message.tries == 0  # the take behind the lock reserved nothing
    assert await q.ok(message)


@pytest.mark.parametrize("take", ["reserve", "pop"])
async def test_a_take_without_a_timeout_waits_out_the_lock(
    factory: aio_keuss.Factory, schema: str, take: str
) -> None:
    """No timeout: the take waits while the lock is held (looking again now and then), and
    gets the message once it goes."""
    q = await factory.queue("jobs")
    await q.push({"n": 1})
    async with locked(schema):
        call = asyncio.create_task(getattr(q, take)())
        await asyncio.sleep(HELD_A_WHILE)
        assert not call.done(), call  # neither failed nor answered nothing
    message = await asyncio.wait_for(call, GUARD)
    assert message is not None and message.payload == {"n": 1}
    if take == "reserve":
        assert message.tries == 0
        assert await q.ok(message)
    assert (await q.sizes()).total == 0


async def test_push_ok_and_ko_wait_for_the_lock_and_land(
    factory: aio_keuss.Factory, schema: str
) -> None:
    """They have no timeout: behind the lock they wait (no error), and once it goes each
    has done its work."""
    q = await factory.queue("jobs")
    await q.push_many([{"n": 1}, {"n": 2}])
    first, second = await q.reserve_many(2, timeout=GUARD)
    async with locked(schema):
        calls = [
            asyncio.create_task(q.push({"n": 3})),
            asyncio.create_task(q.ok(first)),
            asyncio.create_task(q.ko(second, delay=0)),
        ]
        await asyncio.sleep(HELD_A_WHILE)
        assert not any(call.done() for call in calls), calls
    pushed, oked, koed = await asyncio.wait_for(asyncio.gather(*calls), GUARD)
    assert isinstance(pushed, str) and oked is True and koed, (pushed, oked, koed)
    left = sorted(m.payload["n"] for m in await q.pop_many(10, timeout=0))
    assert left == [2, 3]


@pytest.mark.parametrize("own_pool", [True, False])
async def test_a_borrowed_connection_is_bounded_for_a_take_and_reset_on_its_way_back(
    schema: str, own_pool: bool
) -> None:
    """A take that finds every held connection busy borrows one from the pool: set for the
    take (each time: the pool's reset, ours or a user's ``RESET ALL``, undid it), and given
    back with the session's own ``lock_timeout``, so the pool's other users (a user's
    statements, a migration) keep waiting for locks as they did."""
    pool = None if own_pool else await asyncpg.create_pool(POSTGRES_URL, min_size=0, max_size=2)
    options: dict[str, Any] = (
        {"url": POSTGRES_URL, "min_pool_size": 0, "max_pool_size": 2}
        if pool is None
        else {"pool": pool}
    )
    fresh = await asyncpg.connect(POSTGRES_URL)
    try:
        default = await fresh.fetchval("SHOW lock_timeout")
    finally:
        await fresh.close()
    try:
        async with aio_keuss.connect(
            "postgres", schema=schema, stats="memory", signal="local", **options
        ) as factory:
            q = await factory.queue("jobs")
            await q.push({"n": 1})
            held = factory.backend._held  # type: ignore[attr-defined]
            for _ in range(1000):  # the push's connection may still be on its way back
                if held._idle:
                    break
                await asyncio.sleep(0.01)
            busy = held._idle.pop()  # the one connection held, busy: a take borrows
            try:
                for _ in range(2):
                    async with locked(schema):
                        assert await asyncio.wait_for(q.reserve(timeout=0), GUARD) is None
                    for _ in range(1000):
                        if not held._handing_back:
                            break
                        await asyncio.sleep(0.01)
                    async with factory.backend.pool.acquire() as connection:  # type: ignore[attr-defined]
                        assert await connection.fetchval("SHOW lock_timeout") == default
            finally:
                held._idle.append(busy)
            assert (await q.reserve(timeout=GUARD)) is not None
    finally:
        if pool is not None:
            await pool.close()


async def test_a_pool_of_yours_with_its_own_reset_gets_its_sessions_back_as_they_were(
    schema: str,
) -> None:
    """A pool passed with a ``reset=`` of its own (asyncpg's, run in place of ``RESET ALL``)
    got back the sessions the backend had held with the takes' ``lock_timeout`` of 0.1 s
    still set: the user's own statements on them then failed on any lock held that long
    ("canceling statement due to lock timeout"), where they had waited."""

    async def keep_settings(connection: Any) -> None:
        """A reset that leaves the session's settings as they are."""

    size = 4
    pool = await asyncpg.create_pool(POSTGRES_URL, min_size=0, max_size=size, reset=keep_settings)
    try:
        async with pool.acquire() as connection:
            default = await connection.fetchval("SHOW lock_timeout")
        async with aio_keuss.connect(
            "postgres", pool=pool, schema=schema, stats="memory", signal="local"
        ) as factory:
            q = await factory.queue("jobs")
            await q.push({"n": 1})
            message = await q.reserve(timeout=GUARD)
            assert message is not None and await q.ok(message)
        sessions = [await pool.acquire() for _ in range(size)]  # every one the pool has
        try:
            shown = [await session.fetchval("SHOW lock_timeout") for session in sessions]
        finally:
            for session in sessions:
                await pool.release(session)
        assert shown == [default] * size
    finally:
        await pool.close()


def _small_pool(schema: str, size: int) -> Any:
    """Connect (``async with``) a factory over a pool of at most ``size`` connections,
    none opened ahead."""
    return aio_keuss.connect(
        "postgres",
        url=POSTGRES_URL,
        schema=schema,
        stats="memory",
        signal="local",
        min_pool_size=0,
        max_pool_size=size,
    )


async def _a_job_and_others(
    factory: aio_keuss.Factory, size: int
) -> tuple[aio_keuss.Queue, list[aio_keuss.Queue]]:
    """Queue ``jobs`` with one message in it, and ``size`` other queues, empty."""
    q = await factory.queue("jobs")
    await q.push({"n": 1})
    others = [await factory.queue(f"other{i}") for i in range(size)]
    return q, others


async def _pushes_behind_the_lock(
    schema: str, others: list[aio_keuss.Queue]
) -> list[asyncio.Task[Any]]:
    """Push once to each of ``others`` (queues of their own, so that none is batched with
    another) while the table is locked, and return once every push waits for the lock,
    each on a connection of the pool (seen from a connection of its own)."""
    pushes = [asyncio.create_task(other.push({"n": 2})) for other in others]
    waiting = (
        "SELECT count(*) FROM pg_locks WHERE NOT granted"
        f" AND relation = '\"{schema}\".messages'::regclass"
    )
    watcher = await asyncpg.connect(POSTGRES_URL)
    try:
        for _ in range(2000):  # every connection of the pool waits for the lock
            if await watcher.fetchval(waiting) >= len(others):
                break
            await asyncio.sleep(0.01)
    finally:
        await watcher.close()
    return pushes


async def test_a_take_keeps_its_timeout_when_waiting_statements_hold_every_connection(
    schema: str,
) -> None:
    """Pushes (and oks, kos) behind the lock wait for it, each on a connection of the pool:
    as many of them as the pool has connections (here 3, pushes to queues of their own, so
    that none is batched with another) leave a take none to run on, and its wait for one is
    the client's, which ``lock_timeout`` does not bound: it waited, past its timeout, until
    the lock went. It now waits a while for a connection at each look, then answers
    nothing, having taken nothing; the pushes land once the lock goes, each once."""
    size = 3
    async with _small_pool(schema, size) as factory:
        q, others = await _a_job_and_others(factory, size)
        async with locked(schema):
            pushes = await _pushes_behind_the_lock(schema, others)
            call = asyncio.create_task(q.pop(timeout=0.5))
            done, _ = await asyncio.wait([call], timeout=GUARD)
        assert done, f"pop(timeout=0.5) still waiting {GUARD} s behind the lock"
        assert call.result() is None
        await asyncio.wait_for(asyncio.gather(*pushes), GUARD)
        # each push landed once, and the pop took nothing
        assert [(await other.sizes()).total for other in others] == [1] * size
        message = await q.pop(timeout=GUARD)
        assert message is not None and message.payload == {"n": 1}
        await _every_connection_back(factory)


async def _every_connection_back(factory: aio_keuss.Factory) -> None:
    """Wait until the pool has back every connection the backend does not hold: none was
    kept by a take that stopped waiting for it."""
    held = factory.backend._held  # type: ignore[attr-defined]
    pool = factory.backend.pool  # type: ignore[attr-defined]
    for _ in range(2000):
        if not held._late and not held._handing_back:
            break
        await asyncio.sleep(0.01)
    assert not held._late and not held._handing_back
    assert pool.get_size() - pool.get_idle_size() == held._held


async def test_a_take_without_a_timeout_waits_for_a_connection_and_gives_it_back_cancelled(
    schema: str,
) -> None:
    """With every connection taken by pushes waiting for the lock, a pop without a timeout
    looks again and again (each look's wait for a connection bounded), then, cancelled,
    leaves no connection out of the pool once the lock goes, and has lost nothing; so does
    a take's statement cancelled while it waits for a connection."""
    size = 3
    async with _small_pool(schema, size) as factory:
        q, others = await _a_job_and_others(factory, size)
        async with locked(schema):
            pushes = await _pushes_behind_the_lock(schema, others)
            call = asyncio.create_task(q.pop())
            await asyncio.sleep(HELD_A_WHILE)
            assert not call.done(), call  # neither failed nor answered nothing
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(call, GUARD)
            # a take's statement cancelled itself while it waits for a connection (a
            # close past its grace cancels so): what comes later goes back to the pool
            take = asyncio.create_task(factory.backend.fetch_take("SELECT 1"))  # type: ignore[attr-defined]
            await asyncio.sleep(0)  # waiting for a connection
            take.cancel()
            with pytest.raises(asyncio.CancelledError):
                await take
        await asyncio.wait_for(asyncio.gather(*pushes), GUARD)
        # the pop's last look may have got a connection once the lock went, and taken the
        # message after its caller was cancelled: it then puts it back
        message = await q.pop(timeout=GUARD)
        assert message is not None and message.payload == {"n": 1}
        assert await q.pop(timeout=0) is None
        assert [(await other.sizes()).total for other in others] == [1] * size
        await _every_connection_back(factory)
