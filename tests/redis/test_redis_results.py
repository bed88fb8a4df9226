"""The Redis result store (``aio_keuss.redis.results``): one key per result under the
queue's hash tag, expired by Redis, put and got in one round trip each, on every Redis
backend, through the fast lane and redis-py, on a single Redis and on a cluster. Against
the real servers, each test under its own key prefix."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from backends import REDIS_URL, _drop_redis_prefix, new_token
from own_servers import own_redis
from polling import until
from redis_cluster import _drop_redis_cluster_prefix, _redis_cluster, start_redis_cluster

import aio_keuss
from aio_keuss.errors import BackendError, InvalidQueueNameError, KeussConnectionError
from aio_keuss.factory import Factory
from aio_keuss.redis.results import RedisResults
from aio_keuss.results import ResultStore

pytestmark = pytest.mark.timeout(120)

REDIS_BACKENDS = ["redis-list", "redis-oq", "redis-reliable", "redis-sharded", "bucket-redis"]
QUIET = {"stats": "memory", "signal": "local"}
"""Options that keep a factory to what a test looks at: no stats flushes, no subscription."""

POLL_GUARD = 60.0
"""Hang guard of a wait for what a store does in its own time (an expiry)."""


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"akres-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


@pytest.fixture
async def admin() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()


@asynccontextmanager
async def results_of(
    backend: str = "redis-oq", **options: Any
) -> AsyncIterator[tuple[Factory, ResultStore]]:
    """A factory's backend's result store, opened and closed as the factory would."""
    async with aio_keuss.connect(backend, **{**QUIET, **options}) as factory:
        store = factory.backend.result_store()
        await store.open()
        try:
            yield factory, store
        finally:
            await store.close()


def count_round_trips(factory: Factory) -> list[str]:
    """Every command the backend sends through its choke point, named, as it goes: the
    real methods still run, against the real server. A script is counted once ("script"),
    not again as the EVALSHA that redis-py's path sends for it."""
    backend: Any = factory.backend
    sent: list[str] = []
    execute, run_script = backend.execute, backend.run_script

    def counted_execute(*args: Any) -> Any:
        if args[0] not in ("EVALSHA", "EVAL"):
            sent.append(str(args[0]))
        return execute(*args)

    def counted_script(script: Any, keys: Any, args: Any) -> Any:
        sent.append("script")
        return run_script(script, keys, args)

    backend.execute, backend.run_script = counted_execute, counted_script
    return sent


@pytest.mark.parametrize("backend", REDIS_BACKENDS)
async def test_every_redis_backend_keeps_results_in_redis(prefix: str, backend: str) -> None:
    async with results_of(backend, url=REDIS_URL, prefix=prefix) as (factory, store):
        assert factory.backend.capabilities.results
        assert isinstance(store, RedisResults)
        await store.put("jobs", [("m1", b"one"), ("m2", b"two")], 60)
        assert await store.get("jobs", ["m2", "m1"]) == [b"two", b"one"]


@pytest.mark.parametrize("via", ["fast lane", "redis-py"])
async def test_a_put_of_many_ids_is_one_round_trip_and_a_get_too(prefix: str, via: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL) if via == "redis-py" else None
    try:
        async with results_of(url=REDIS_URL, prefix=prefix, client=client) as (factory, store):
            assert factory.backend.has_fast_lane is (via == "fast lane")
            sent = count_round_trips(factory)
            bodies = [(f"id-{n}", b"\x00\xff" + bytes([n]) * n) for n in range(200)]
            await store.put("jobs", bodies, 60)
            assert sent == ["script"]
            found = await store.get("jobs", ["nope", *(i for i, _ in bodies), "nope"])
            assert sent == ["script", "MGET"]
            assert found == [None, *(b for _, b in bodies), None]
            await store.put("jobs", [("one", b"1")], 60)  # one result: a plain SET
            assert sent[2:] == ["SET"]
            assert await store.get("jobs", ["one"]) == [b"1"]
    finally:
        if client is not None:
            await client.aclose()


async def test_nothing_to_put_or_get_sends_nothing(prefix: str) -> None:
    async with results_of(url=REDIS_URL, prefix=prefix) as (factory, store):
        sent = count_round_trips(factory)
        await store.put("jobs", [], 60)
        assert await store.get("jobs", []) == []
        assert sent == []


async def test_a_result_is_one_key_of_the_queue_expired_by_redis(
    prefix: str, admin: aioredis.Redis
) -> None:
    """The key carries the queue's hash tag and an expiry: Redis reclaims every result
    whatever happens to the process that put it (nothing to sweep)."""
    async with results_of(url=REDIS_URL, prefix=prefix) as (_, store):
        await store.put("jobs", [("m1", b"x"), ("m2", b"y")], 30)
        await store.put("jobs", [("m3", b"z")], 30.0001)
        keys = sorted([k async for k in admin.scan_iter(match=f"{prefix}:*")])
        assert keys == [f"{prefix}:{{jobs}}:result:m{n}".encode() for n in (1, 2, 3)]
        for key in keys:
            assert 0 < await admin.pttl(key) <= 30_001


async def test_the_hash_tag_is_the_factorys_when_it_has_one(
    prefix: str, admin: aioredis.Redis
) -> None:
    async with results_of(url=REDIS_URL, prefix=prefix, hash_tag="app") as (_, store):
        await store.put("jobs", [("m1", b"x")], 30)
        assert await admin.exists(f"{prefix}:{{app}}:{{jobs}}:result:m1") == 1
        assert await store.get("jobs", ["m1"]) == [b"x"]


async def test_a_result_put_again_replaces_the_first_and_its_ttl(
    prefix: str, admin: aioredis.Redis
) -> None:
    async with results_of(url=REDIS_URL, prefix=prefix) as (_, store):
        await store.put("jobs", [("m1", b"first"), ("m2", b"kept")], 5)
        await store.put("jobs", [("m1", b"second"), ("m3", b"new")], 3600)
        assert await store.get("jobs", ["m1", "m2", "m3"]) == [b"second", b"kept", b"new"]
        assert await admin.pttl(f"{prefix}:{{jobs}}:result:m1") > 5_000
        await store.put("jobs", [("m1", b"third")], 3600)
        assert await store.get("jobs", ["m1"]) == [b"third"]


@pytest.mark.parametrize("count", [1, 3])
async def test_a_result_is_gone_once_its_ttl_passes(prefix: str, count: int) -> None:
    async with results_of(url=REDIS_URL, prefix=prefix) as (_, store):
        ids = [f"m{n}" for n in range(count)]
        await store.put("jobs", [(i, b"x") for i in ids], 0.05)
        await store.put("jobs", [("long", b"kept")], 3600)

        async def gone() -> bool:
            return await store.get("jobs", ids) == [None] * count

        await until(gone, POLL_GUARD)
        assert await store.get("jobs", ["long"]) == [b"kept"]


async def test_a_ttl_of_years_is_whole_milliseconds(prefix: str, admin: aioredis.Redis) -> None:
    """1e9 s is 1e12 ms: sent as an int, never ``1e+12`` (which Redis refuses)."""
    async with results_of(url=REDIS_URL, prefix=prefix) as (_, store):
        await store.put("jobs", [("m1", b"x")], 1e9)
        await store.put("jobs", [("m2", b"y"), ("m3", b"z")], 1e9)
        for n in (1, 2, 3):
            assert await admin.pttl(f"{prefix}:{{jobs}}:result:m{n}") > 999_000_000_000


async def test_queues_and_ids_that_would_make_one_naive_key_stay_apart(prefix: str) -> None:
    """``q1`` + ``a:b`` and ``q1:a`` + ``b`` joined with ``:`` are one string; the queue's
    braces keep them apart. So do ids that look like key parts and the same id in two
    queues."""
    async with results_of(url=REDIS_URL, prefix=prefix) as (_, store):
        pairs = [
            ("q1", "a:b", b"1"),
            ("q1:a", "b", b"2"),
            ("q1", "result:x", b"3"),
            ("q1:result", "x", b"4"),
            ("q2", "a:b", b"5"),
            ("q1", "{q2}:a:b", b"6"),
            ("q1", "é✓", b"7"),
        ]
        for queue, message_id, body in pairs:
            await store.put(queue, [(message_id, body)], 60)
        for queue, message_id, body in pairs:
            assert await store.get(queue, [message_id]) == [body]
        assert await store.get("q1", ["a", "b", "x"]) == [None, None, None]


async def test_a_queue_name_that_could_break_the_key_is_refused(prefix: str) -> None:
    async with results_of(url=REDIS_URL, prefix=prefix) as (_, store):
        for queue in ("a}:result:b", "{a}", ""):
            with pytest.raises(InvalidQueueNameError):
                await store.put(queue, [("c", b"x")], 60)
            with pytest.raises(InvalidQueueNameError):
                await store.get(queue, ["c"])


async def test_errors_leave_as_the_librarys() -> None:
    """A full Redis refuses the write (BackendError: someone must act); a server gone is a
    connection error (the caller may retry). Never redis-py's exceptions."""
    with own_redis() as server:
        async with results_of(url=server.url) as (_, store):
            await store.put("jobs", [("m0", b"x")], 60)
            admin = aioredis.Redis.from_url(server.url)
            try:
                await admin.config_set("maxmemory", 1)
                await admin.config_set("maxmemory-policy", "noeviction")
                for many in ([("m1", b"x")], [("m1", b"x"), ("m2", b"y")]):
                    with pytest.raises(BackendError, match="OOM"):
                        await store.put("jobs", many, 60)
                assert await store.get("jobs", ["m0", "m1"]) == [b"x", None]  # reads go on
            finally:
                await admin.aclose()
            server.stop()
            with pytest.raises(KeussConnectionError):
                await store.put("jobs", [("m3", b"x"), ("m4", b"y")], 60)
            with pytest.raises(KeussConnectionError):
                await store.get("jobs", ["m0"])


@pytest.mark.parametrize("via", ["fast lane", "redis-py"])
async def test_a_put_after_the_servers_scripts_were_flushed_loads_its_script_again(
    via: str,
) -> None:
    """A restart or SCRIPT FLUSH empties the script cache: the put runs anyway (on a
    server of the test's own, whose scripts nobody else needs)."""
    with own_redis() as server:
        client = aioredis.Redis.from_url(server.url) if via == "redis-py" else None
        try:
            async with results_of(url=server.url, client=client) as (_, store):
                await store.put("jobs", [("m1", b"1"), ("m2", b"2")], 60)
                admin = aioredis.Redis.from_url(server.url)
                try:
                    await admin.script_flush()
                finally:
                    await admin.aclose()
                await store.put("jobs", [("m2", b"two"), ("m3", b"3")], 60)
                assert await store.get("jobs", ["m1", "m2", "m3"]) == [b"1", b"two", b"3"]
        finally:
            if client is not None:
                await client.aclose()


@pytest.mark.parametrize("hash_tag", [None, "app"])
async def test_on_a_cluster_each_queues_results_are_one_round_trip_on_its_node(
    hash_tag: str | None,
) -> None:
    """Queues land on different nodes; each queue's results share its slot, so a put of
    many is one script and a get one MGET there (a cross-slot call would be refused)."""
    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    options = {**_redis_cluster(new_token()), "hash_tag": hash_tag}
    try:
        async with results_of("redis-oq", **options) as (factory, store):
            sent = count_round_trips(factory)
            queues = [f"queue-{n}" for n in range(8)]
            for queue in queues:
                await store.put(queue, [(f"{queue}/{n}", queue.encode()) for n in range(20)], 60)
            for queue in queues:
                ids = [f"{queue}/{n}" for n in range(20)]
                assert await store.get(queue, [*ids, "nope"]) == [queue.encode()] * 20 + [None]
            assert sent == ["script"] * 8 + ["MGET"] * 8
            await store.put("one", [("m", b"x")], 60)
            assert await store.get("one", ["m"]) == [b"x"]
    finally:
        await _drop_redis_cluster_prefix(options)


@pytest.mark.parametrize("backend", ["redis-sharded", "bucket-redis"])
async def test_sharded_and_bucket_backends_keep_them_on_a_cluster_too(backend: str) -> None:
    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    options = _redis_cluster(new_token())
    try:
        async with results_of(backend, **options) as (factory, store):
            assert factory.backend.capabilities.results
            await store.put("jobs", [("a", b"1"), ("b", b"2")], 60)
            assert await store.get("jobs", ["b", "a", "c"]) == [b"2", b"1", None]
    finally:
        await _drop_redis_cluster_prefix(options)
