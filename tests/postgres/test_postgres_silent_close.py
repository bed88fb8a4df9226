"""A close cancelled once (a shutdown timeout) while the PostgreSQL server has gone silent:
it must end within its documented bound, and lose nothing that was acknowledged."""

from __future__ import annotations

import asyncio

import pytest
from backends import POSTGRES_URL, _drop_postgres_schema, new_token
from black_hole import BlackHole

import aio_keuss
from aio_keuss import stats

GUARD = 40.0  # generous: a cancelled close's grace, then the pool's close (10 s each)


async def test_a_cancelled_close_ends_when_the_server_goes_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the counters stay buffered until the close, whose last write then meets the silence
    monkeypatch.setattr(stats.StatsStore, "flush_interval", 3600.0)
    options = {"schema": f"akt_{new_token()}"}
    hole = BlackHole("127.0.0.1", 5432, b"")  # every connection that sent anything
    await hole.start()
    url = POSTGRES_URL.replace("127.0.0.1:5432", f"127.0.0.1:{hole.port}")
    factory = await aio_keuss.connect("postgres", url=url, signal_debounce=59.0, **options)
    closing: asyncio.Task[None] | None = None
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
        ended, _ = await asyncio.wait({closing}, timeout=GUARD)
        assert ended, "a close cancelled once never ended"
    finally:
        if closing is not None and not closing.done():
            closing.cancel()
            await asyncio.wait({closing}, timeout=GUARD)
        hole.close()
    after = await aio_keuss.connect("postgres", url=POSTGRES_URL, **options)
    try:
        q = await after.queue("silent", reserve_delay=1.0)
        left = []
        while (message := await q.pop(timeout=5)) is not None:
            left.append(message.payload)
        # the popped and ok-ed ones stay gone; the one held comes back on expiry
        assert sorted(left) == sorted({0, 1, 2, 3} - {popped.payload, done.payload})
    finally:
        await after.close()
        await _drop_postgres_schema({"url": POSTGRES_URL, **options})
