"""A close cancelled once (a shutdown timeout) while the server has gone silent: it must end
within its documented bound, and lose nothing that was acknowledged."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from backends import (
    POSTGRES_URL,
    REDIS_URL,
    _drop_mongo_database,
    _drop_postgres_schema,
    _drop_redis_prefix,
    new_token,
)
from black_hole import BlackHole
from mongo_server import MONGO_URL, start_mongo
from mongo_server import PORT as MONGO_PORT

import aio_keuss
import aio_keuss.buckets.store
import aio_keuss.queue
import aio_keuss.redis.connection
from aio_keuss import stats


@dataclass(frozen=True)
class Silent:
    backend: str
    port: int
    url: str
    options: Callable[[], dict[str, Any]]
    drop: Callable[[dict[str, Any]], Awaitable[None]]
    guard: float
    """A hang guard, not a timing assertion: twice the documented bound, which is a
    cancelled close's grace (10 s), and on PostgreSQL the pool's close after it (10 s
    more)."""
    oks_written: bool = True
    """Whether an ok that returned is stored: a bucket store's oks are written by its state
    flusher, and one the silent server never took is undone with the lease (README,
    "Buckets and outages")."""
    start: Callable[[], str | None] = lambda: None
    """Starts the server the tests start themselves; a reason to skip, or None."""

    def started(self) -> None:
        reason = self.start()
        if reason is not None:
            pytest.skip(reason)


CASES = [
    Silent(
        "redis-oq",
        6379,
        REDIS_URL,
        lambda: {"prefix": f"akr-{new_token()}"},
        _drop_redis_prefix,
        20.0,
    ),
    Silent(
        "postgres",
        5432,
        POSTGRES_URL,
        lambda: {"schema": f"akt_{new_token()}"},
        _drop_postgres_schema,
        40.0,
    ),
    Silent(
        "bucket-redis",
        6379,
        REDIS_URL,
        lambda: {
            "prefix": f"akr-{new_token()}",
            "bucket_max_wait": 0.02,
            "state_flush_period": 0.05,
        },
        _drop_redis_prefix,
        # the replies still awaited once the grace is spent are given up with the
        # connection, not each after its own cancel grace (50 to 65 s in all before)
        20.0,
        oks_written=False,
    ),
    Silent(
        "bucket-postgres",
        5432,
        POSTGRES_URL,
        lambda: {
            "schema": f"akt_{new_token()}",
            "bucket_max_wait": 0.02,
            "state_flush_period": 0.05,
        },
        _drop_postgres_schema,
        40.0,
        oks_written=False,
    ),
    Silent(
        "bucket-mongo",
        MONGO_PORT,
        MONGO_URL,
        lambda: {
            "database": f"akt_{new_token()}",
            "bucket_max_wait": 0.02,
            "state_flush_period": 0.05,
        },
        _drop_mongo_database,
        20.0,
        oks_written=False,
        start=start_mongo,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.backend)
async def test_a_cancelled_close_ends_when_the_server_goes_silent(
    case: Silent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the counters stay buffered until the close, whose last write then meets the silence
    case.started()
    monkeypatch.setattr(stats.StatsStore, "flush_interval", 3600.0)
    options = case.options()
    hole = BlackHole("127.0.0.1", case.port, b"")  # every connection that sent anything
    await hole.start()
    url = case.url.replace(f"127.0.0.1:{case.port}", f"127.0.0.1:{hole.port}")
    # signal_debounce: the pushes' trailing signal goes out at close
    factory = await aio_keuss.connect(case.backend, url=url, signal_debounce=59.0, **options)
    closing: asyncio.Task[None] | None = None
    ended: set[asyncio.Task[None]] = set()
    try:
        q = await factory.queue("silent", reserve_delay=1.0)
        for n in range(4):
            await q.push(n)
        popped = await q.pop()
        done = await q.reserve()
        held = await q.reserve()
        assert popped is not None and done is not None and held is not None
        await q.ok(done)
        hole.swallow()  # the server answers nothing more, the connections stay open
        closing = asyncio.ensure_future(factory.close())
        await asyncio.sleep(0.5)
        closing.cancel()  # once, as asyncio.wait_for(factory.close(), 5) does
        ended, _ = await asyncio.wait({closing}, timeout=case.guard)
        assert ended, "a close cancelled once never ended"
    finally:
        hole.close()
        if closing is not None and not closing.done():  # its connections dropped: it ends
            closing.cancel()
            await asyncio.wait({closing}, timeout=case.guard)
        if not ended:  # what the hung close left; else the check below drops it
            await case.drop({"url": case.url, **options})
    after = await aio_keuss.connect(case.backend, url=case.url, **options)
    try:
        q = await after.queue("silent", reserve_delay=1.0)
        left = []
        while (message := await q.pop(timeout=5)) is not None:
            left.append(message.payload)
        # the popped and ok-ed ones stay gone (an ok a bucket store never wrote comes
        # back); the one held comes back on expiry
        check_left(case, left, popped.payload, done.payload)
    finally:
        await after.close()
        await case.drop({"url": case.url, **options})


def check_left(case: Silent, left: list[Any], popped: Any, done: Any | None) -> None:
    """What the silent close left: the popped one stays gone, the ones held come back; the
    ok-ed one (``done``) stays gone where an ok is written as it returns, and on a bucket
    store either (it comes back unless a state write reached the server before the
    silence): never an acknowledged message lost."""
    everything = {0, 1, 2, 3}
    exact = everything - {popped} - ({done} if done is not None else set())
    if case.oks_written or done is None:
        assert sorted(left) == sorted(exact)
    else:
        assert sorted(left) in (sorted(exact), sorted(everything - {popped}))


async def test_a_queue_close_cancelled_on_a_silent_bucket_server_ends_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A queue's close cancelled once ends as cancelled, even when the bucket store's close
    under it gives up its writes (KeussConnectionError past its bound): raised in place of
    the cancellation, the caller's cancel was swallowed (a TaskGroup or a shutdown then saw
    a connection failure where it cancelled). The bounds are shortened: what is checked is
    how the close ends, not how long it takes (a queue's own close cannot give up the
    connection its factory shares, so each bound is waited out in turn)."""
    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 1.0)
    monkeypatch.setattr(aio_keuss.buckets.store, "CLOSE_BOUND", 1.0)
    monkeypatch.setattr(aio_keuss.redis.connection, "CANCEL_GRACE", 1.0)
    options = {"prefix": f"akr-{new_token()}", "bucket_max_wait": 0.02, "state_flush_period": 0.05}
    hole = BlackHole("127.0.0.1", 6379, b"")
    await hole.start()
    url = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{hole.port}")
    factory = await aio_keuss.connect("bucket-redis", url=url, signal_debounce=59.0, **options)
    closing: asyncio.Task[None] | None = None
    try:
        q = await factory.queue("silent", reserve_delay=1.0)
        for n in range(4):
            await q.push(n)
        done = await q.reserve()
        assert done is not None and await q.reserve() is not None
        await q.ok(done)
        hole.swallow()
        closing = asyncio.ensure_future(q.close())
        await asyncio.sleep(0.5)
        closing.cancel()
        ended, _ = await asyncio.wait({closing}, timeout=90.0)
        assert ended, "a close cancelled once never ended"
        assert closing.cancelled(), f"ended with {closing.exception()!r}, not cancelled"
    finally:
        hole.close()
        if closing is not None and not closing.done():
            closing.cancel()
            await asyncio.wait({closing}, timeout=90.0)
        await factory.close(timeout=2.0)
        await _drop_redis_prefix({"url": REDIS_URL, **options})
