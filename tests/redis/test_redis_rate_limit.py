"""The Redis rate limiter (``aio_keuss.redis.limiter``): one HASH per queue, named with the
queue's hash tag, its times on the server's clock, gone once idle. Against the real server
at AK_REDIS_URL, each test under its own key prefix."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from backends import REDIS_URL, _drop_redis_prefix, new_token

import aio_keuss
from aio_keuss.contract import RateRule

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"akr-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


@pytest.mark.parametrize("backend", ["redis-list", "redis-oq", "bucket-redis"])
async def test_the_limiter_is_one_key_of_the_queue_that_expires_once_idle(
    prefix: str, backend: str
) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    async with aio_keuss.connect(backend, url=REDIS_URL, prefix=prefix) as factory:
        q = await factory.queue("jobs", rate_limit=5, rate_period=3600)
        await q.push("x")
        assert (await q.pop(timeout=30)) is not None
        key = f"{prefix}:{{jobs}}:rate"
        try:
            state = await client.hgetall(key)
            assert set(state) == {b"t", b"u", b"r"}
            # one grant of five an hour: the state matters for 720 s, and lives that long
            assert 0 < await client.pttl(key) <= 721_000
            # a time on the server's clock, in microseconds
            (seconds, micros) = await client.time()
            assert int(state[b"t"]) == pytest.approx(
                (seconds + 720) * 1_000_000 + micros, abs=60_000_000
            )
            # given back, the state is that of an idle limiter: none, the key gone
            await factory.backend.rate_take("jobs", RateRule(5, 3600.0, 5), -1, 0.0)
            assert await client.exists(key) == 0
        finally:
            await client.aclose()


async def test_a_hold_is_kept_on_the_key_until_it_ends(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        rule = RateRule(100, 1.0, 100)
        grant = await factory.backend.rate_take("held", rule, 0, 120.0)
        assert grant.granted == 0 and grant.wait == pytest.approx(120.0, abs=0.01)
        again = await factory.backend.rate_take("held", rule, 10, 0.0)
        assert again.granted == 0 and 119.0 < again.wait <= 120.0
        try:
            assert 119_000 < await client.pttl(f"{prefix}:{{held}}:rate") <= 121_000
        finally:
            await client.aclose()


async def test_the_hash_tag_is_the_factorys_when_it_has_one(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    async with aio_keuss.connect(
        "redis-oq", url=REDIS_URL, prefix=prefix, hash_tag="app"
    ) as factory:
        await factory.backend.rate_take("jobs", RateRule(1, 60.0, 1), 1, 0.0)
        try:
            assert await client.exists(f"{prefix}:{{app}}:{{jobs}}:rate") == 1
        finally:
            await client.aclose()


async def test_a_rate_limited_queue_keeps_its_one_message_push_and_ok(prefix: str) -> None:
    """Only a take asks the limiter: a rate-limited queue's pushes and oks still go by the
    store's one-message calls (a quarter of a call's client work), its takes do not."""
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        plain = await factory.queue("plain")
        limited = await factory.queue("limited", rate_limit=5, rate_period=3600)
        assert plain._one_insert is not None and plain._one_commit is not None
        assert limited._one_insert is not None and limited._one_commit is not None
        assert limited._one_get is None and limited._one_reserve is None
        await limited.push("x")
        message = await limited.reserve(timeout=30)
        assert message is not None and await limited.ok(message)
