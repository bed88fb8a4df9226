"""redis-oq queues written in the layout before 2026-11-29 (a message's mature time, payload,
headers, tries and reservation in five keys ``z``, ``p``, ``h``, ``t``, ``r``) are taken over
into one record per message when opened, and messages an older process pushes into them
later when a take finds nothing ready.

Runs against the real server at AK_REDIS_URL, under a key prefix of its own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from backends import REDIS_URL, _drop_redis_prefix, new_token
from own_servers import own_redis

import aio_keuss

PLAIN = 2_500  # more than one upgrade call converts (its budget is 2,000)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"akl-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


async def _write_old_layout(factory: aio_keuss.Factory, queue: str, plain: int = PLAIN) -> None:
    """The keys the earlier redis-oq wrote: z (mature or deadline), p (payload with its
    encoding tag), h (headers, when any), t (tries, when > 0), r (reserved ids)."""
    key = factory.backend.key  # type: ignore[attr-defined]
    now = time.time()
    scores: dict[str, float] = {f"m{i:05}": now - 100 + i / 1000 for i in range(plain)}
    payloads = {m_id: b"J%d" % i for i, m_id in enumerate(scores)}
    scores |= {"hd": now - 200, "lapsed": now - 180, "tr": now - 150}
    scores |= {"held": now + 3600, "later": now + 3600}
    payloads |= {m_id: b'J"' + m_id.encode() + b'"' for m_id in scores if m_id[0] != "m"}
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.zadd(key(queue, "z"), scores)
        await client.hset(key(queue, "p"), mapping=payloads)  # type: ignore[misc]
        await client.hset(key(queue, "h"), "hd", b'{"k":"v"}')  # type: ignore[misc]
        await client.hset(key(queue, "t"), mapping={"tr": 2, "lapsed": 1})  # type: ignore[misc]
        await client.sadd(key(queue, "r"), "lapsed", "held")  # type: ignore[misc]
    finally:
        await client.aclose()


async def test_a_queue_of_the_old_layout_is_converted_when_opened(prefix: str) -> None:
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        await _write_old_layout(factory, "old")
        q = await factory.queue("old", reserve_delay=30)
        key = factory.backend.key  # type: ignore[attr-defined]
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            assert await client.exists(*(key("old", part) for part in "zphtr")) == 0
            assert await client.hlen(key("old", "msg")) == PLAIN + 5  # type: ignore[misc]
        finally:
            await client.aclose()
        sizes = await q.sizes()
        assert (sizes.size, sizes.scheduled, sizes.reserved) == (PLAIN + 3, 1, 1)
        (held,) = await q.peek(state="reserved")
        assert (held.message.id, held.message.payload) == ("held", "held")

        first = await q.reserve(timeout=1)
        assert first is not None
        assert (first.id, first.payload, first.headers, first.tries) == ("hd", "hd", {"k": "v"}, 0)
        lapsed = await q.reserve(timeout=1)  # its reservation had expired: a try more
        assert lapsed is not None and (lapsed.id, lapsed.tries) == ("lapsed", 2)
        assert await q.ko(lapsed, delay=3600)
        (scheduled,) = [v for v in await q.peek(state="scheduled") if v.message.id == "lapsed"]
        assert scheduled.message.tries == 3
        tried = await q.pop(timeout=1)
        assert tried is not None and (tried.id, tried.payload, tried.tries) == ("tr", "tr", 2)
        assert await q.ok(first)

        popped: list[object] = []
        while len(popped) < PLAIN:
            batch = await q.pop_many(500, timeout=1)
            assert batch
            popped.extend(m.payload for m in batch)
        assert popped == list(range(PLAIN))
        assert await q.pop(timeout=0) is None


async def test_a_queue_opened_twice_is_converted_once(prefix: str) -> None:
    """A second open (another process, or a factory reopened) finds nothing left to do;
    messages pushed after the first open are kept as they are."""
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        await _write_old_layout(factory, "twice")
        q = await factory.queue("twice")
        await q.push({"new": 1}, headers={"h": 1})
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        q = await factory.queue("twice")
        assert (await q.sizes()).total == PLAIN + 6
        views = await q.peek(PLAIN + 10, state="all")
        new = [v.message for v in views if v.message.payload == {"new": 1}]
        assert len(new) == 1 and new[0].headers == {"h": 1}


@pytest.mark.parametrize("take", ["pop", "reserve", "pop_many", "reserve_many"])
async def test_what_an_older_process_pushes_later_is_taken_over(prefix: str, take: str) -> None:
    """A rolling upgrade: the queue is open already when an older release's producer
    pushes into the earlier layout; a take that finds nothing ready takes it over, by the
    one-message scripts and by the batch ones alike."""
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        q = await factory.queue("late")
        await q.push("new")
        await _write_old_layout(factory, "late")
        got: list[object] = []
        while len(got) < PLAIN + 4:  # all but the one reserved with time to run
            if take in ("pop", "reserve"):
                one = await getattr(q, take)(timeout=1)
                assert one is not None
                got.append(one.payload)
            else:
                many = await getattr(q, take)(1000, timeout=1)
                assert many
                got.extend(m.payload for m in many)
        assert sorted(map(str, got)) == sorted(
            ["new", "hd", "lapsed", "tr", *map(str, range(PLAIN))]
        ), got[:10]


async def test_an_id_in_both_layouts_keeps_both_messages(prefix: str) -> None:
    """An id the user chose can be in both layouts at once: its dedup window ran out while
    the first message waited, and an older process, which looks only at the earlier keys,
    pushed it again (or this one did, while the earlier keys still held it). Taking the
    older one over must neither overwrite the newer one (a message acknowledged, lost) nor
    cut short its reservation (handed out twice)."""
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        q = await factory.queue("clash", reserve_delay=3600)
        await q.push("new", id="job")
        held = await q.reserve(timeout=1)
        assert held is not None and held.id == "job"
        key = factory.backend.key  # type: ignore[attr-defined]
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            await client.zadd(key("clash", "z"), {"job": time.time() - 10})
            await client.hset(key("clash", "p"), "job", b'J"old"')  # type: ignore[misc]
        finally:
            await client.aclose()
        old = await q.pop(timeout=1)  # nothing ready here: the take takes the old one over
        assert old is not None and old.payload == "old" and old.id != "job"
        assert await q.pop(timeout=0) is None  # the reserved one is not handed out again
        assert await q.ok(held)  # and its holder still holds it
        assert (await q.sizes()).total == 0


async def test_a_compact_hash_of_the_old_layout_is_taken_over() -> None:
    """A hash at most ``hash-max-listpack-entries`` long is one compact block, and HSCAN
    hands it out whole whatever its COUNT (Redis manual, "SCAN": "COUNT"). Servers tuned to
    keep hashes of thousands compact gave a page past what Lua's unpack() takes (about
    8,000 values), and the queue could not be opened."""
    with own_redis("--hash-max-listpack-entries", "20000") as server:
        client = aioredis.Redis.from_url(server.url)
        try:
            async with aio_keuss.connect("redis-oq", url=server.url, prefix="c") as factory:
                key = factory.backend.key  # type: ignore[attr-defined]
                now = time.time()
                ids = [f"m{i:05}" for i in range(9_000)]
                scores = {m: now - 100 + i / 1e4 for i, m in enumerate(ids)}
                payloads = {m: b"J%d" % i for i, m in enumerate(ids)}
                await client.zadd(key("big", "z"), scores)
                await client.hset(key("big", "p"), mapping=payloads)  # type: ignore[misc]
                assert await client.object("encoding", key("big", "p")) == b"listpack"
                q = await factory.queue("big")
                assert (await q.sizes()).total == 9_000
                assert [m.payload for m in await q.pop_many(3, timeout=0)] == [0, 1, 2]
        finally:
            await client.aclose()


async def test_a_take_that_takes_over_hands_out_at_once(prefix: str) -> None:
    """A pop or reserve with no time to wait, that finds only what an older process pushed
    since the open, takes it over and hands it out in the same call."""
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        q = await factory.queue("now")
        await _write_old_layout(factory, "now", plain=10)  # taken over in one call
        first = await q.pop(timeout=0)
        assert first is not None and first.id == "hd"
        second = await q.reserve(timeout=0)
        assert second is not None and (second.id, second.tries) == ("lapsed", 2)
