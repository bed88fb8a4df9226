"""redis-py's own command retries: a command whose reply was lost after the server ran it is
sent again, and a give-back replayed after another consumer reserved the message releases
that consumer's reservation (the guard, "held with the holder's tries", passes again). The
clients the library builds never retry; a client the user passes that does is warned about.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from backends import REDIS_URL, _drop_redis_prefix, new_token
from fault_proxy import AFTER, FaultProxy
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis_cluster import CLUSTER_URL, _drop_redis_cluster_prefix, start_redis_cluster

import aio_keuss
from aio_keuss.redis import oq

REDIS_PY_PATH = "socket_timeout=30"
"""A query option only redis-py honours: the URL then takes the redis-py path, not the
library's own connection."""

BACKENDS = ["redis-oq", "redis-sharded", "redis-reliable", "redis-list", "bucket-redis"]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"akrt-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


def _url(base: str, query: str) -> str:
    return base + ("&" if "?" in base else "?") + query


async def _connection_retries(client: aioredis.Redis) -> int:
    """The retries of a connection the client's pool hands out: what a command gets."""
    pool = client.connection_pool
    connection = await pool.get_connection()
    try:
        return int(connection.retry.get_retries())
    finally:
        await pool.release(connection)


@pytest.mark.parametrize(
    "query", [REDIS_PY_PATH, REDIS_PY_PATH + "&retry_on_timeout=true"], ids=["plain", "on-timeout"]
)
async def test_a_built_standalone_client_sends_no_command_twice(prefix: str, query: str) -> None:
    """Even when the URL asks redis-py to retry (``retry_on_timeout``): a replayed script
    may take a reservation from the consumer that holds it."""
    async with aio_keuss.connect("redis-oq", url=_url(REDIS_URL, query), prefix=prefix) as f:
        backend = f.backend
        assert not backend.has_fast_lane  # type: ignore[attr-defined]
        client = backend.client  # type: ignore[attr-defined]
        assert isinstance(client, aioredis.Redis)
        assert await _connection_retries(client) == 0


async def test_a_built_cluster_client_sends_no_command_twice() -> None:
    """RedisCluster sends a command again by default (10 times in redis-py 8.1, reloading
    the topology in between);
    the one the library builds does not, and still follows MOVED redirections (which are
    not a retry of a command that ran: the node refused it)."""

    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    prefix = f"akrt-{new_token()}"
    try:
        await _moved_is_followed(prefix)
    finally:
        await _drop_redis_cluster_prefix({"prefix": prefix})


async def _moved_is_followed(prefix: str) -> None:
    from redis.asyncio.cluster import RedisCluster

    async with aio_keuss.connect("redis-oq", url=CLUSTER_URL, cluster=True, prefix=prefix) as f:
        client = f.backend.client  # type: ignore[attr-defined]
        assert isinstance(client, RedisCluster)
        assert client.retry.get_retries() == 0
        assert client.reinitialize_steps == 0  # no MOVED closes its connections
        # queues spread over the three masters, reached from a client that has never seen
        # their slots moved to: each queue works, wherever its slot is
        queues = [await f.queue(f"q{n}") for n in range(12)]
        for q in queues:
            await q.push("x")
        # one slot's owner forgotten: the next command goes to a wrong node, gets MOVED
        slot = client.keyslot(f.backend.key("q0", "due"))  # type: ignore[attr-defined]
        owner = client.nodes_manager.slots_cache[slot][0]
        other = next(n for n in client.get_primaries() if n.name != owner.name)
        client.nodes_manager.slots_cache[slot] = [other]
        message = await queues[0].reserve(timeout=1)
        assert message is not None and await queues[0].ok(message)
        assert client.nodes_manager.slots_cache[slot][0].name == owner.name  # learnt again
        for q in queues[1:]:
            assert (m := await q.reserve(timeout=1)) is not None and await q.ok(m)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_users_client_that_retries_is_warned_about(
    prefix: str, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """redis-py's default client retries; the library never changes a client it was given,
    so it says what that risks and how to turn it off."""
    parts = urlsplit(REDIS_URL)
    client = aioredis.Redis(host=parts.hostname or "127.0.0.1", port=parts.port or 6379)
    try:
        with caplog.at_level(logging.WARNING, logger="aio_keuss"):
            async with aio_keuss.connect(backend, client=client, prefix=prefix):
                pass
        warnings = [r for r in caplog.records if "Retry(NoBackoff(), 0)" in r.getMessage()]
        assert len(warnings) == 1, caplog.text
        assert warnings[0].levelno == logging.WARNING
        assert client.get_retry() is not None and client.get_retry().get_retries() > 0  # untouched
    finally:
        await client.aclose()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_users_client_without_retries_is_not_warned_about(
    prefix: str, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    parts = urlsplit(REDIS_URL)
    client = aioredis.Redis(
        host=parts.hostname or "127.0.0.1", port=parts.port or 6379, retry=Retry(NoBackoff(), 0)
    )
    try:
        with caplog.at_level(logging.WARNING, logger="aio_keuss"):
            async with aio_keuss.connect(backend, client=client, prefix=prefix):
                pass
        assert "Retry(NoBackoff(), 0)" not in caplog.text
    finally:
        await client.aclose()


async def test_a_users_cluster_client_that_retries_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from redis.asyncio.cluster import RedisCluster

    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    prefix = f"akrt-{new_token()}"  # nothing is written: no keys to drop
    for retry, warned in ((None, True), (Retry(NoBackoff(), 0), False)):
        client = RedisCluster.from_url(CLUSTER_URL, retry=retry)
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="aio_keuss"):
                async with aio_keuss.connect("redis-oq", client=client, prefix=prefix):
                    pass
            assert ("Retry(NoBackoff(), 0)" in caplog.text) is warned, caplog.text
        finally:
            await client.aclose()


async def test_a_users_cluster_client_that_reloads_on_moved_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """redis-py's cluster client closes every connection on every fifth MOVED reply by
    default, cutting what other tasks have in flight while a slot migrates; the library
    builds its own with ``reinitialize_steps=0`` and says so of a client it was given."""
    from redis.asyncio.cluster import RedisCluster

    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    prefix = f"akrt-{new_token()}"  # nothing is written: no keys to drop
    for steps, warned in ((None, True), (0, False)):
        extra = {} if steps is None else {"reinitialize_steps": steps}
        client = RedisCluster.from_url(CLUSTER_URL, retry=Retry(NoBackoff(), 0), **extra)
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="aio_keuss"):
                async with aio_keuss.connect("redis-sharded", client=client, prefix=prefix):
                    pass
            assert ("reinitialize_steps=0" in caplog.text) is warned, caplog.text
            assert client.reinitialize_steps == (5 if steps is None else steps)  # untouched
        finally:
            await client.aclose()


async def test_a_give_back_whose_reply_was_lost_is_not_replayed_over_another_holder(
    prefix: str,
) -> None:
    """The hazard itself, end to end. A gives a reservation back; Redis runs it, and the
    connection drops before the reply reaches A. Meanwhile B reserves the message (the same
    tries: a give-back costs none). Had A's client sent the give-back again, it would pass
    the guard and release B's reservation, and C would take the message while B works on
    it. A sees a connection error instead, and B keeps the message."""
    parts = urlsplit(REDIS_URL)
    proxy = FaultProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.script_load(oq.ROLLBACK.text)  # so that the give-back is one EVALSHA
    finally:
        await client.aclose()
    # retry_on_timeout: a URL asking redis-py for a retry, which the library must overrule
    url = f"redis://127.0.0.1:{proxy.port}/0?{REDIS_PY_PATH}&retry_on_timeout=true"
    common = {"prefix": prefix, "stats": "memory", "signal": "local"}
    try:
        async with (
            aio_keuss.connect("redis-oq", url=url, **common) as fa,
            aio_keuss.connect("redis-oq", url=REDIS_URL, **common) as fb,
        ):
            qa, qb = await fa.queue("q", reserve_delay=60), await fb.queue("q", reserve_delay=60)
            await qa.push("only")
            held = await qa.reserve(timeout=5)
            assert held is not None
            proxy.hold_connections()  # a reconnect (to send it again) waits for B's reserve
            proxy.arm(AFTER, oq.ROLLBACK.sha.encode())
            give_back = asyncio.ensure_future(qa._release_all([held]))
            for _ in range(1000):
                if proxy.replies_cut or give_back.done():
                    break
                await asyncio.sleep(0.01)
            assert proxy.replies_cut == 1
            taken = await qb.reserve(timeout=5)  # B holds it now, with A's tries
            assert taken is not None and taken.tries == held.tries
            proxy.admit()
            (outcome,) = await asyncio.gather(give_back, return_exceptions=True)
            async with aio_keuss.connect("redis-oq", url=REDIS_URL, **common) as fc:
                qc = await fc.queue("q", reserve_delay=60)
                second = await qc.reserve(timeout=0.5)
                assert second is None, "the give-back ran again: B and C both hold the message"
            assert isinstance(outcome, aio_keuss.KeussConnectionError), outcome
            assert await qb.ok(taken)
    finally:
        proxy.close()
