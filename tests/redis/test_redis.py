"""Redis-specific behaviour of redis-oq, redis-list, the Redis signal bus and stats store.

Runs against the real server at AK_REDIS_URL; every test uses its own key prefix and deletes
its keys afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from backends import (
    REDIS_URL,
    _drop_redis_prefix,
    a_poison_reserved,
    ko_through_a_cut_close,
    new_token,
    sizes_after,
)
from black_hole import BlackHole, assert_a_silent_drop_is_survived
from own_servers import collating_locale, own_redis
from redis_cluster import _drop_redis_cluster_prefix, _redis_cluster, start_redis_cluster

import aio_keuss
from aio_keuss import keepalive
from aio_keuss.redis import connection as redis_connection

Open = Callable[..., Awaitable[aio_keuss.Factory]]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"akr-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


@pytest.fixture
async def open_factory(prefix: str) -> AsyncIterator[Open]:
    opened: list[aio_keuss.Factory] = []

    async def _open(backend: str = "redis-oq", **options: Any) -> aio_keuss.Factory:
        options.setdefault("url", REDIS_URL)
        factory = await aio_keuss.connect(backend, prefix=prefix, **options)
        opened.append(factory)
        return factory

    yield _open
    for factory in opened:
        await factory.close()


async def test_old_message_is_not_reserved_twice(open_factory: Open) -> None:
    """Keuss set the deadline to old score + delay: a message older than reserve_delay was
    mature again at once. The deadline must be now + reserve_delay."""
    factory = await open_factory()
    q = await factory.queue("old", reserve_delay=5.0)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await q.push("x")
        zset = factory.backend.key("old", "due")  # type: ignore[attr-defined]
        (member,) = await client.zrange(zset, 0, -1)
        await client.zadd(zset, {member: time.time() - 3600})  # pushed an hour ago
    finally:
        await client.aclose()
    first = await q.reserve(timeout=1)
    assert first is not None
    assert await q.reserve(timeout=0.3) is None
    assert await q.resv_size() == 1
    assert await q.ok(first)


async def test_reserve_delay_counts_from_now(open_factory: Open) -> None:
    factory = await open_factory()
    q = await factory.queue("deadline", reserve_delay=0.4)
    await q.push("x")
    before = time.time()
    assert await q.reserve(timeout=1) is not None
    nmt = await q.next_mature_t()
    assert nmt is not None and before + 0.3 < nmt.timestamp() < time.time() + 0.5
    again = await q.reserve(timeout=3)
    assert again is not None and again.tries == 1


_CONSUMER = textwrap.dedent(
    """
    import asyncio, sys, time
    import aio_keuss

    async def main() -> None:
        async with aio_keuss.connect(
            "redis-oq", url=sys.argv[1], prefix=sys.argv[2], poll_interval=30.0
        ) as factory:
            q = await factory.queue("xproc")
            print("ready", flush=True)
            message = await q.pop(timeout=20)
            print("got", time.time() - message.payload, flush=True)

    asyncio.run(main())
    """
)


async def test_consumer_in_another_process_wakes_on_push(open_factory: Open, prefix: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CONSUMER, REDIS_URL, prefix, stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    try:
        ready = await asyncio.wait_for(process.stdout.readline(), 20)
        assert ready.strip() == b"ready"
        await asyncio.sleep(0.3)  # the consumer is now asleep for up to poll_interval=30
        factory = await open_factory()
        q = await factory.queue("xproc")
        await q.push(time.time())
        line = await asyncio.wait_for(process.stdout.readline(), 10)
        word, latency = line.split()
        # only the signal explains this (the poll interval is 30 s); a busy machine may
        # take seconds to push, deliver and fetch, so the bound is generous
        assert word == b"got" and float(latency) < 15.0
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_signal_listener_survives_connection_kill() -> None:
    with own_redis() as server:  # killing every pub/sub client must not hit other runs
        producer = await aio_keuss.connect("redis-oq", url=server.url, signal_debounce=0.0)
        consumer_factory = await aio_keuss.connect("redis-oq", url=server.url, poll_interval=30)
        try:
            await _signal_listener_survives_connection_kill(producer, consumer_factory, server.url)
        finally:
            await producer.close()
            await consumer_factory.close()


async def _signal_listener_survives_connection_kill(
    producer: aio_keuss.Factory, consumer_factory: aio_keuss.Factory, url: str
) -> None:
    consumer = await consumer_factory.queue("revive")
    q = await producer.queue("revive")
    killer = aioredis.Redis.from_url(url)
    try:
        await killer.client_kill_filter(_type="pubsub")
        await asyncio.sleep(3.0)  # the listener backs off (cap 2 s) and subscribes again
        waiting = asyncio.ensure_future(consumer.pop(timeout=25))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        await q.push("after")
        message = await waiting
        assert message is not None and message.payload == "after"
        assert time.monotonic() - start < 15.0  # woken by the new subscription, not polled
    finally:
        await killer.aclose()


async def test_stats_and_list_seen_from_a_second_factory(open_factory: Open) -> None:
    first = await open_factory()
    q = await first.queue("counted", reserve_delay=7.0)
    await q.push_many([1, 2, 3])
    assert await q.pop() is not None
    await asyncio.sleep(0.3)  # flushed every 0.1 s
    second = await open_factory()
    stats = await second.stats_store.counters("counted")
    assert stats["put"] == 3 and stats["get"] == 1
    queues = await second.list()
    assert queues["counted"]["reserve_delay"] == 7.0
    await second.stats_store.reset("counted")
    assert (await second.stats_store.counters("counted"))["put"] == 0


async def test_redis_list_refuses_delay_and_reserve_before_writing(open_factory: Open) -> None:
    factory = await open_factory("redis-list")
    q = await factory.queue("plain")
    with pytest.raises(aio_keuss.NotSupportedError):
        await q.push(1, delay=1.0)
    with pytest.raises(aio_keuss.NotSupportedError):
        await q.reserve(timeout=0)
    with pytest.raises(aio_keuss.NotSupportedError):
        await q.push(1, id="mine")
    assert await q.total_size() == 0


@pytest.mark.parametrize("backend", ["redis-oq", "redis-list"])
async def test_binary_payloads_round_trip(open_factory: Open, backend: str) -> None:
    factory = await open_factory(backend)
    q = await factory.queue("bin")
    blobs = [bytes(range(256)), b"", b"\x00\r\n{}\xff" * 100, "é\u2028".encode()]
    await q.push_many(blobs, headers={"k": "\u00e9"})
    got = await q.pop_many(10, timeout=1)
    assert [m.payload for m in got] == blobs
    assert all(m.headers == {"k": "\u00e9"} for m in got)


@pytest.mark.parametrize("backend", ["redis-oq", "redis-list"])
async def test_large_push_many(open_factory: Open, backend: str) -> None:
    factory = await open_factory(backend, max_batch=10_000)
    q = await factory.queue("big")
    ids = await q.push_many([{"n": i} for i in range(10_000)])
    assert len(set(ids)) == 10_000
    assert await q.size() == 10_000
    got = await q.pop_many(10_000, timeout=1)
    assert [m.payload["n"] for m in got] == list(range(10_000))


@pytest.mark.parametrize("width", [5, 0], ids=["rising-ids", "ranked-ids"])
async def test_a_bulk_load_larger_than_a_script_chunk(open_factory: Open, width: int) -> None:
    """The scripts read and write in chunks of 4,000 arguments (Lua's unpack limit): a
    bulk load of 9,000 user ids, then the same ids again, is checked across chunks, and
    comes out in push order whether the ids rise (k00000, k00001...) or not (k9, k10)."""
    factory = await open_factory("redis-oq", max_batch=10_000)
    q = await factory.queue("big-ids")
    keys = [f"k{i:0{width}d}" for i in range(9_000)]
    assert await q.push_many(list(range(9_000)), ids=keys) == keys
    assert await q.push_many(list(range(9_000)), ids=keys[::-1]) == keys[::-1]  # all refused
    assert await q.size() == 9_000
    got = await q.pop_many(10_000, timeout=1)
    assert [(m.id, m.payload) for m in got] == list(zip(keys, range(9_000), strict=True))
    assert await q.push_many([0], ids=keys[-1:]) == keys[-1:]  # consumed, still refused
    assert await q.size() == 0


@pytest.mark.parametrize("width", [5, 0], ids=["rising-ids", "ranked-ids"])
async def test_a_bulk_load_with_some_ids_refused_stores_the_rest_in_order(
    open_factory: Open, width: int
) -> None:
    """A bulk load all of whose ids are new writes its records straight from the
    arguments; one with some refused (queued already, or repeated in the batch) builds
    them from those accepted: across script chunks, the right payload under each id, in
    push order."""
    factory = await open_factory("redis-oq", max_batch=10_000)
    q = await factory.queue("some-refused")
    keys = [f"k{i:0{width}d}" for i in range(9_000)]
    queued = keys[::3]
    await q.push_many(["old"] * len(queued), ids=queued)
    batch_ids = [*keys, keys[7]]  # the last repeats one of the batch: refused
    await q.push_many([*range(9_000), -1], ids=batch_ids)
    got = await q.pop_many(10_000, timeout=1)
    expected = [(k, "old") for k in queued] + [(k, i) for i, k in enumerate(keys) if i % 3 != 0]
    assert [(m.id, m.payload) for m in got] == expected


async def test_one_insert_of_several_kinds_keeps_push_order(open_factory: Open) -> None:
    """A coalesced batch of pushes that differ in headers and delay goes by the per-entry
    insert script; with falling ids (and a refused one among them) it keeps push order."""
    from aio_keuss.contract import Entry
    from aio_keuss.options import QueueOptions

    factory = await open_factory("redis-oq")
    backend = factory.backend
    store = await backend.store("kinds", QueueOptions())
    assert await store.insert([Entry("m", b"0", b"{}", dedup=True)]) == [True]
    batch = [
        Entry("x", b"1", b'{"k":1}', dedup=True),
        Entry("m", b"9", b"{}", dedup=True),  # queued: refused
        Entry("b", b"2", b"{}", dedup=True),
        Entry("a", b"3", b'{"k":2}'),
        Entry("c", b"4", b"{}", dedup=True),
    ]
    assert await store.insert(batch) == [True, False, True, True, True]
    fetched = await store.get(10)
    assert [s.id for s in fetched.messages] == ["m", "x", "b", "a", "c"]


async def test_paging_past_a_removed_cursor_follows_byte_order_whatever_the_locale(
    tmp_path: Path,
) -> None:
    """Messages of one score lie in the sorted set in the byte order of their ids (Redis
    manual, "Sorted sets"), the order Python gives str. A page after a cursor whose message
    left finds its place among those ties in that order, not by Lua's string comparison,
    which follows the server's LC_COLLATE (Redis sets it from its environment at start):
    under en_US.UTF-8, where "aa" < "B" < "b", the walk skipped every id after it."""
    env = collating_locale(str(tmp_path))
    if isinstance(env, str):
        pytest.skip(env)
    ids = sorted(["Ab", "B", "a-z", "a_b", "aa", "b", "bA"])  # rising bytes: one score
    with own_redis(env=env) as server:
        client = aioredis.Redis.from_url(server.url)
        try:
            collates = await client.eval("return tostring('a' < 'B')", 0)
        finally:
            await client.aclose()
        if collates != b"true":
            pytest.skip(f"Lua does not compare by the locale {env['LC_ALL']} on this server")
        async with aio_keuss.connect("redis-oq", url=server.url, prefix="collate") as factory:
            q = await factory.queue("ties")
            await q.push_many(list(range(len(ids))), ids=ids)
            seen: list[str] = []
            cursor = None
            for _ in range(len(ids) + 1):
                page = await q.page(after=cursor, limit=1)
                seen += [view.message.id for view in page.items]
                if page.cursor is None:
                    break
                cursor = page.cursor
                assert await q.remove(page.items[0].message)  # the next page has no cursor row
            assert seen == ids


async def test_deadletter_moves_atomically_with_headers(open_factory: Open) -> None:
    factory = await open_factory(deadletter={"max_ko": 1, "queue": "dl"})
    q = await factory.queue("work")
    dl = await factory.queue("dl")
    await q.push("p", headers={"a": 1})
    for _ in range(2):
        message = await q.reserve(timeout=1)
        assert message is not None
        await q.ko(message)
    assert await q.total_size() == 0
    moved = await dl.pop(timeout=1)
    assert moved is not None and moved.payload == "p" and moved.tries == 0
    assert moved.headers["a"] == 1 and moved.headers["x-dl-from-queue"] == "work"
    assert moved.headers["x-dl-tries"] == 2 and "x-dl-t" in moved.headers


async def test_user_client_uses_redis_py_path(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        async with aio_keuss.connect("redis-oq", client=client, prefix=prefix) as factory:
            q = await factory.queue("mine")
            await q.push({"a": 1}, delay=0.1)
            message = await q.reserve(timeout=2)
            assert message is not None and await q.ok(message)
            assert await q.next_mature_t() is None
        assert await client.ping()  # not closed: the user owns it
    finally:
        await client.aclose()


async def test_connection_refused_is_typed() -> None:
    with pytest.raises(aio_keuss.KeussConnectionError):
        await aio_keuss.connect("redis-oq", url="redis://127.0.0.1:1/0")


# errors are translated where the package meets the driver ------------------------------


@pytest.mark.parametrize("backend", ["redis-list", "redis-oq", "redis-reliable", "bucket-redis"])
@pytest.mark.parametrize("path", ["lane", "redispy"])
async def test_a_server_error_reaches_the_caller_as_ours(
    open_factory: Open, prefix: str, backend: str, path: str
) -> None:
    """A key of the queue clobbered with another type (WRONGTYPE) and the stats hash too:
    every call raises BackendError caused by redis-py's error, on the fast lane and through
    redis-py alike."""
    from redis.exceptions import ResponseError

    url = REDIS_URL if path == "lane" else REDIS_URL + "?socket_timeout=30"
    factory = await open_factory(backend, url=url)
    assert factory.backend.has_fast_lane is (path == "lane")  # type: ignore[attr-defined]
    q = await factory.queue("q")
    await q.push("first")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = await client.keys(f"{prefix}:*{{q}}*")
        keys.append(factory.backend.key("q", "stats"))  # type: ignore[attr-defined]
        for key in keys:
            await client.set(key, b"not what it was")
    finally:
        await client.aclose()
    for call in (lambda: q.push_many(["x"]), q.size, q.stats):
        with pytest.raises(aio_keuss.BackendError) as raised:
            await call()
        assert isinstance(raised.value.__cause__, ResponseError), raised.value
        assert "WRONGTYPE" in str(raised.value)
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": prefix})  # so that close can flush


@pytest.mark.parametrize("backend", ["redis-oq", "redis-reliable", "redis-sharded", "bucket-redis"])
@pytest.mark.parametrize("path", ["lane", "redispy"])
async def test_scripts_the_server_lost_are_loaded_again(
    open_factory: Open, backend: str, path: str
) -> None:
    """After SCRIPT FLUSH (what a restart does to the script cache) every call, many of
    them in flight at once on the pipelined lane, gets NOSCRIPT once: the script is loaded
    and the call runs again, so callers see only their results."""
    url = REDIS_URL if path == "lane" else REDIS_URL + "?socket_timeout=30"
    factory = await open_factory(backend, url=url)
    q = await factory.queue("q")
    await q.push("before")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for _ in range(2):
            await client.script_flush()
            await asyncio.gather(*(q.push(n) for n in range(20)))
            await client.script_flush()
            taken = await asyncio.gather(*(q.reserve(timeout=5) for _ in range(21)))
            assert all(m is not None for m in taken)
            await client.script_flush()
            assert all(await asyncio.gather(*(q.ok(m) for m in taken if m is not None)))
            assert await q.size() == 0
            await q.push("before")
    finally:
        await client.aclose()


@pytest.mark.parametrize("backend", ["redis-oq", "redis-reliable", "redis-sharded"])
@pytest.mark.parametrize("path", ["lane", "redispy"])
async def test_a_lost_script_runs_again_without_the_script_command(backend: str, path: str) -> None:
    """A script the server lacks is sent again as an EVAL, which runs and caches it in one
    command: a user whose ACL denies SCRIPT (but allows EVALSHA and EVAL) gets its
    results, where a SCRIPT LOAD was refused and the caller saw NOSCRIPT."""
    with own_redis() as server:
        admin = aioredis.Redis.from_url(server.url)
        try:
            await admin.acl_setuser(
                "noscript", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                commands=["+@all", "-script"],
            )  # fmt: skip
            url = f"redis://noscript:pw@127.0.0.1:{server.port}/0"
            url += "" if path == "lane" else "?socket_timeout=30"
            async with aio_keuss.connect(backend, url=url, prefix="acl") as factory:
                assert factory.backend.has_fast_lane is (path == "lane")  # type: ignore[attr-defined]
                q = await factory.queue("q")
                await q.push("kept")
                await admin.script_flush()
                message = await q.reserve(timeout=5)
                assert message is not None and message.payload == "kept"
                await admin.script_flush()
                assert await q.ok(message)
                assert await q.size() == 0
        finally:
            await admin.aclose()


def test_only_the_connection_module_talks_to_the_driver() -> None:
    """Every command goes through the translating methods of the connection: no other module
    of the package imports redis-py or reaches for its client."""
    package = Path(aio_keuss.__file__).parent / "redis"
    for path in package.rglob("*.py"):
        if path.name == "connection.py":
            continue
        text = path.read_text()
        assert "import redis" not in text and "from redis" not in text, path
        assert ".client" not in text and "errors_translated" not in text, path


async def test_a_silently_dropped_subscription_is_replaced(
    open_factory: Open, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_connection, "SUBSCRIBE_PING_EVERY", 0.5, raising=False)
    hole = BlackHole("127.0.0.1", 6379, b"SUBSCRIBE")
    await hole.start()
    try:
        consumer_factory = await aio_keuss.connect(
            "redis-oq", url=f"redis://127.0.0.1:{hole.port}/0", prefix=prefix, poll_interval=30.0
        )
        producer = await open_factory(signal_debounce=0.0)
        await assert_a_silent_drop_is_survived(hole, consumer_factory, producer)
    finally:
        hole.close()


# a full Redis (maxmemory, noeviction) ------------------------------------------------------


@pytest.mark.parametrize("backend", ["redis-oq", "redis-reliable", "redis-sharded"])
async def test_consumers_drain_a_redis_at_maxmemory(backend: str) -> None:
    """At maxmemory with noeviction a push is refused (OOM, a BackendError), but reserve, ko
    and ok still work, so consumers drain the full Redis: Redis refuses a script whose first
    write may grow memory, and the consuming scripts' first write cannot."""
    with own_redis("--maxmemory-policy", "noeviction") as server:
        admin = aioredis.Redis.from_url(server.url)
        factory = await aio_keuss.connect(backend, url=server.url, prefix="full")
        try:
            q = await factory.queue("full", reserve_delay=30.0)
            used = (await admin.info("memory"))["used_memory"]
            await admin.config_set("maxmemory", used + 500_000)
            pushed = 0
            with pytest.raises(aio_keuss.BackendError, match="OOM"):
                for pushed in range(100):  # 500 kB is full at 20 kB each
                    await q.push({"n": pushed, "pad": "x" * 20_000})
            assert 10 < pushed < 100
            first = await q.reserve(timeout=0)
            assert first is not None
            assert await q.ko(first) == aio_keuss.KoResult.ROLLED_BACK
            taken = []
            while (message := await q.reserve(timeout=0)) is not None:
                taken.append(message.payload["n"])
                assert await q.ok(message)
            assert sorted(taken) == list(range(pushed))
            await q.push("room again")  # the oks freed the memory
        finally:
            await admin.config_set("maxmemory", 0)
            await factory.close()
            await admin.aclose()


async def test_a_dead_consumers_messages_come_back_at_maxmemory() -> None:
    """redis-reliable: recovery's first write was LMOVE, which Redis refuses at maxmemory
    (noeviction): a dead consumer's reservations stayed stuck while Redis was full."""
    with own_redis("--maxmemory-policy", "noeviction") as server:
        admin = aioredis.Redis.from_url(server.url)
        dead = await aio_keuss.connect("redis-reliable", url=server.url, prefix="full")
        alive = await aio_keuss.connect("redis-reliable", url=server.url, prefix="full")
        try:
            q = await dead.queue("full", reserve_delay=30.0)
            other = await alive.queue("full", reserve_delay=30.0)
            await q.push_many(list(range(3)))
            assert len(await q.reserve_many(3, timeout=5)) == 3
            await admin.delete(q._store._heartbeat)  # type: ignore[attr-defined]
            used = (await admin.info("memory"))["used_memory"]
            await admin.config_set("maxmemory", used)
            assert await other._store.recover() == 3  # type: ignore[attr-defined]
        finally:
            await admin.config_set("maxmemory", 0)
            await dead.close()
            await alive.close()
            await admin.aclose()


async def test_redis_sharded_at_maxmemory_brings_lapsed_reservations_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """redis-sharded at maxmemory (noeviction, full of other data): the leader's lease is
    taken again (its holder died), the sweeper and the shovel bring back reservations whose
    deadline passed, a ko with a delay is scheduled, and consumers renew the queue's metadata
    record and their place (every lease_ttl): each script's first write cannot grow memory."""
    options = {"shards": 2, "sweep_interval": 0.1, "shovel_interval": 0.1, "lease_ttl": 1.0}
    with own_redis("--maxmemory-policy", "noeviction") as server:
        admin = aioredis.Redis.from_url(server.url)
        factory = await aio_keuss.connect("redis-sharded", url=server.url, prefix="full", **options)
        try:
            # the reservations lapse after the first renewal is due (lease_ttl): it runs
            # while the Redis is full
            q = await factory.queue("full", reserve_delay=1.5)
            await q.push_many(list(range(6)))
            await admin.config_set("maxmemory", 1)  # full, whatever the oks free
            with pytest.raises(aio_keuss.BackendError, match="OOM"):
                await q.push(6)
            await admin.delete("full:sharded:leader")  # the leader died: another takes over
            held = []  # every message reserved; two acknowledged, the others left to lapse
            while (message := await q.reserve(timeout=0)) is not None:
                held.append(message.payload)
                if len(held) <= 2:
                    assert await q.ok(message)
            assert sorted(held) == list(range(6))
            first = await q.reserve(timeout=30)  # swept, shoveled: back with one more try
            assert first is not None and first.tries == 1
            assert await q.ko(first, delay=0.2) == aio_keuss.KoResult.ROLLED_BACK
            taken = []  # the four lapsed ones (the ko-ed one among them, once its delay ends)
            while len(taken) < 4 and (message := await q.reserve(timeout=30)) is not None:
                assert message.tries >= 1
                taken.append(message.payload)
                assert await q.ok(message)
            assert sorted(taken + held[:2]) == list(range(6))
            assert (await q.sizes()).total == 0
            failed = [
                r.message
                for r in caplog.records
                if r.name == "aio_keuss.sharded" and r.levelno >= logging.WARNING
            ]
            assert not failed  # nor did a pass, or a queue's sweep, fail (over oked records)
        finally:
            await admin.config_set("maxmemory", 0)
            await factory.close()
            await admin.aclose()


@pytest.mark.parametrize("backend", ["redis-oq", "redis-reliable", "redis-sharded", "bucket-redis"])
async def test_a_consumer_drains_a_full_redis_and_closes_cleanly(backend: str) -> None:
    """A consumer process started at maxmemory (noeviction) opens its queue (the options
    were recorded by a plain HSET, refused), drains it (bucket-redis's lease and state write
    began with an HSET) and closes (the stats flush's HINCRBYs were refused, so every Redis
    factory's close raised a BackendError there)."""
    with own_redis("--maxmemory-policy", "noeviction") as server:
        admin = aioredis.Redis.from_url(server.url)
        async with aio_keuss.connect(backend, url=server.url, prefix="full") as producer:
            await (await producer.queue("full")).push_many(list(range(3)))
        consumer = await aio_keuss.connect(backend, url=server.url, prefix="full")
        try:
            await admin.config_set("maxmemory", 1)  # full, whatever the oks free
            q = await consumer.queue("full")
            taken = []
            while (message := await q.reserve(timeout=0.5)) is not None:
                taken.append(message.payload)
                assert await q.ok(message)
            assert sorted(taken) == [0, 1, 2]
            await consumer.close()  # its stats flush is not refused
            await admin.config_set("maxmemory", 0)
            key = consumer.stats_store._counters_key("full")  # type: ignore[attr-defined]
            assert await admin.hget(key, "commit") == b"3"
        finally:
            await admin.config_set("maxmemory", 0)
            await consumer.close()
            await admin.aclose()


async def test_a_full_redis_still_requeues_from_the_deadletter_queue() -> None:
    """At maxmemory (noeviction) Redis refuses a script whose first write may grow memory:
    requeue's hold of a deadlettered message began with a ZADD, so a full Redis could not
    send its failed messages back to be consumed (and freed) again."""
    with own_redis("--maxmemory-policy", "noeviction") as server:
        admin = aioredis.Redis.from_url(server.url)
        factory = await aio_keuss.connect(
            "redis-oq", url=server.url, prefix="full", deadletter={"max_ko": 0}
        )
        try:
            q = await factory.queue("work")
            await q.push("failed")
            held = await q.reserve(timeout=1)
            assert held is not None and await q.ko(held) == aio_keuss.KoResult.DEADLETTERED
            dl = await factory.queue("__deadletter__")
            await admin.config_set("maxmemory", 1)  # full, whatever the moves free
            assert await dl.requeue(origin="work") == {held.id: held.id}
            back = await q.reserve(timeout=1)
            assert back is not None and back.payload == "failed"
            assert await q.ok(back)
        finally:
            await admin.config_set("maxmemory", 0)
            await factory.close()
            await admin.aclose()


async def test_a_cluster_deadletter_a_close_gives_up_on_still_ends_in_one_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a Redis Cluster without hash_tag a deadletter is done in steps: set aside here, a
    copy there, then a drop here. A close past its grace gave up the ko's round trips and
    closed the store between the copy and the drop: the message was in the deadletter queue
    and, once set aside no more (60 s), delivered again here. The close now lets it end."""
    import aio_keuss.queue
    from aio_keuss.redis.oq import RedisOQStore

    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.0)  # gives up at once
    options = {**_redis_cluster(new_token()), "stats": "memory", "signal": "local"}
    copied, store_closing = asyncio.Event(), asyncio.Event()
    insert = RedisOQStore._insert

    async def insert_then_wait(store: Any, *args: Any, **kwargs: Any) -> Any:
        done = await insert(store, *args, **kwargs)
        if store.name == "__deadletter__":  # the copy is there: the drop here waits
            copied.set()
            await store_closing.wait()
        return done

    monkeypatch.setattr(RedisOQStore, "_insert", insert_then_wait)
    try:
        factory, q, message = await a_poison_reserved("redis-oq", **options)
        await ko_through_a_cut_close(factory, q, message, copied, store_closing)
        assert await sizes_after("redis-oq", **options) == (0, 1)
    finally:
        await _drop_redis_cluster_prefix(options)


# extending a reservation (redis-oq) --------------------------------------------------------


async def test_a_lapsed_reservation_nobody_took_is_extended_without_a_try(
    open_factory: Open,
) -> None:
    """redis-oq keeps a reservation's end as its message's score in the due set, and counts
    a lapsed reservation's try when the message is taken again: extended after it lapsed
    (nobody took it since), the message is reserved again until the new end, its tries
    untouched, and its holder's guarded ok goes through."""
    factory = await open_factory(reserve_delay=0.2, poll_interval=5.0)
    q = await factory.queue("q1")
    await q.push("slow")
    held = await q.reserve(timeout=5)
    assert held is not None and held.tries == 0
    seen = await q.find(held.id)
    deadline = time.monotonic() + 30
    while seen is not None and seen.state == "reserved" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # until the store tells it lapsed, however long that takes
        seen = await q.find(held.id)
    assert seen is not None and seen.state == "ready" and seen.message.tries == 1  # a try to count
    asked = time.time()
    assert await q.extend(held, 60) is True
    seen = await q.find(held.id)
    assert seen is not None and seen.state == "reserved" and seen.message.tries == 0, seen
    assert seen.at.timestamp() >= asked + 59
    assert await q.reserve(timeout=0) is None
    assert await q.sizes() == aio_keuss.Sizes(0, 1, 0, 1)
    assert await q.ok(held) is True


async def test_extend_works_on_a_redis_at_maxmemory() -> None:
    """At maxmemory (noeviction) Redis refuses a script whose first write may grow memory
    (Redis manual, "Scripting with Lua", maxmemory): a long handler's renewals must still
    go through while consumers drain a full Redis, or its message is delivered twice."""
    with own_redis("--maxmemory-policy", "noeviction") as server:
        admin = aioredis.Redis.from_url(server.url)
        factory = await aio_keuss.connect("redis-oq", url=server.url, prefix="full")
        try:
            q = await factory.queue("full", reserve_delay=30.0)
            await q.push_many(["a", "b"])
            held = await q.reserve_many(2, timeout=5)
            assert len(held) == 2
            await admin.config_set("maxmemory", 1)  # full, whatever the oks free
            with pytest.raises(aio_keuss.BackendError, match="OOM"):
                await q.push("c")
            assert await q.extend_many(held, 120) == [True, True]
            assert await q.extend(held[0], 60) is True
            assert await q.ok_many(held) == [True, True]
        finally:
            await admin.config_set("maxmemory", 0)
            await factory.close()
            await admin.aclose()


async def test_the_fast_lane_keeps_its_tcp_connection_alive(open_factory: Open) -> None:
    """A connection a NAT or load balancer forgot while idle hung the next command for as
    long as the kernel retransmits (about 15 minutes), and a reply from a dead host was
    awaited for ever: the fast lane turned no keepalive on (redis-py's connections do)."""
    factory = await open_factory("redis-oq")
    q = await factory.queue("keepalive")
    await q.push(1)  # the lane connects on first use
    backend = factory.backend
    assert backend.has_fast_lane  # type: ignore[attr-defined]
    sock = backend._lane._protocol.transport.get_extra_info("socket")  # type: ignore[attr-defined]
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    for option, value in keepalive.socket_options().items():
        assert sock.getsockopt(socket.IPPROTO_TCP, option) == value
    assert await q.pop(timeout=0) is not None


async def test_a_url_giving_the_default_encoding_still_works(open_factory: Open) -> None:
    """``?encoding=utf-8`` (and ``encoding_errors=strict``), redis-py's defaults, are what
    the library relies on: a URL written for another client that spells them out is taken,
    while another encoding is refused (the input conformance tests)."""
    url = f"{REDIS_URL}?encoding=UTF-8&encoding_errors=strict"
    factory = await open_factory(url=url)
    q = await factory.queue("jobs")
    await q.push({"é": 1})
    message = await q.pop(timeout=0)
    assert message is not None and message.payload == {"é": 1}
