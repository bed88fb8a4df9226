"""A close nobody cancels, on a server that went silent (it accepts, never answers): past its
``timeout`` it goes on as a cancelled close does, so it ends, and loses nothing acknowledged."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token
from black_hole import BlackHole
from test_silent_close import CASES, Silent, check_left

import aio_keuss
from aio_keuss import stats, sync
from aio_keuss.errors import InvalidDelayError


@pytest.mark.parametrize("held", [True, False], ids=["reservations-held", "counters-only"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.backend)
async def test_a_plain_close_ends_when_the_server_goes_silent(
    case: Silent, held: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # With reservations held the queue's give-back meets the silence first; with only
    # counters buffered the queues close without a round trip and the stats store's last
    # write meets it (then the signals still on their way out).
    case.started()
    monkeypatch.setattr(stats.StatsStore, "flush_interval", 3600.0)
    options = case.options()
    hole = BlackHole("127.0.0.1", case.port, b"")
    await hole.start()
    url = case.url.replace(f"127.0.0.1:{case.port}", f"127.0.0.1:{hole.port}")
    factory = await aio_keuss.connect(case.backend, url=url, signal_debounce=59.0, **options)
    closing: asyncio.Task[None] | None = None
    try:
        q = await factory.queue("silent", reserve_delay=1.0)
        for n in range(4):
            await q.push(n)
        popped = await q.pop()
        assert popped is not None
        done = None
        if held:
            done = await q.reserve()
            assert done is not None and await q.reserve() is not None
            await q.ok(done)
        hole.swallow()
        with caplog.at_level(logging.WARNING, logger="aio_keuss"):
            closing = asyncio.ensure_future(factory.close(timeout=1.0))
            ended, _ = await asyncio.wait({closing}, timeout=case.guard + 1.0)
            assert ended, "a close with a timeout never ended on a silent server"
            assert closing.result() is None  # it ends, it does not raise
        assert any("timeout" in r.getMessage() for r in caplog.records)
    finally:
        if closing is not None and not closing.done():
            closing.cancel()
            await asyncio.wait({closing}, timeout=case.guard)
        hole.close()
    after = await aio_keuss.connect(case.backend, url=case.url, **options)
    try:
        q = await after.queue("silent", reserve_delay=1.0)
        left = []
        while (message := await q.pop(timeout=5)) is not None:
            left.append(message.payload)
        # an ok a bucket store never wrote comes back (README, Buckets and outages)
        check_left(case, left, popped.payload, None if done is None else done.payload)
    finally:
        await after.close()
        await case.drop({"url": case.url, **options})


async def test_a_close_timeout_is_checked_before_anything_closes() -> None:
    options = {"prefix": f"akr-{new_token()}"}
    factory = await aio_keuss.connect("redis-oq", url=REDIS_URL, **options)
    try:
        q = await factory.queue("checked")
        for bad in (-1.0, float("nan"), "5", True):
            with pytest.raises(InvalidDelayError):
                await factory.close(timeout=bad)  # type: ignore[arg-type]
        await q.push("still open")
        assert (await q.pop()) is not None
    finally:
        await factory.close(timeout=None)
        await _drop_redis_prefix({"url": REDIS_URL, **options})


def test_a_sync_close_with_a_timeout_ends_when_the_server_goes_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sync shim's close takes the same ``timeout`` to the async close it runs."""
    monkeypatch.setattr(stats.StatsStore, "flush_interval", 3600.0)
    loop = asyncio.new_event_loop()  # the proxy's, beside the shim's own loop thread
    proxying = threading.Thread(target=loop.run_forever, daemon=True)
    proxying.start()
    hole = BlackHole("127.0.0.1", 6379, b"")
    asyncio.run_coroutine_threadsafe(hole.start(), loop).result(10)
    options = {"prefix": f"akr-{new_token()}"}
    url = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{hole.port}")
    try:
        factory = sync.connect("redis-oq", url=url, signal_debounce=59.0, **options)
        q = factory.queue("silent", reserve_delay=1.0)
        q.push("held")
        assert q.reserve() is not None
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)
        loop.call_soon_threadsafe(hole.swallow)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)
        closer = threading.Thread(target=factory.close, kwargs={"timeout": 1.0}, daemon=True)
        closer.start()
        closer.join(31.0)  # generous: 1 s, then a cancelled close's 10 s grace
        assert not closer.is_alive(), "a sync close with a timeout never ended"
    finally:
        loop.call_soon_threadsafe(hole.close)
        loop.call_soon_threadsafe(loop.stop)
        proxying.join(10)
        loop.close()

    async def left() -> object:
        after = await aio_keuss.connect("redis-oq", url=REDIS_URL, **options)
        try:
            q = await after.queue("silent", reserve_delay=1.0)
            message = await q.pop(timeout=5)  # back once its reservation expired
            return None if message is None else message.payload
        finally:
            await after.close()
            await _drop_redis_prefix({"url": REDIS_URL, **options})

    assert asyncio.run(left()) == "held"
