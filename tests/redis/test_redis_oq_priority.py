"""redis-oq priorities, where the conformance file does not look: records written by earlier
releases (no priority in them) read as priority 0, a level's keys go once its last message
leaves whichever way it leaves, a queue without priorities writes no key of them, and the
by-id scripts (extend, requeue, remove, find) and peek's paging reach every level.

Runs against the real server at AK_REDIS_URL, under a key prefix of its own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from backends import REDIS_URL, _drop_redis_prefix, new_token
from own_servers import own_redis
from redis_cluster import _drop_redis_cluster_prefix, _redis_cluster, start_redis_cluster

import aio_keuss
from aio_keuss.redis.oq import PEEK


@pytest.fixture
async def factory() -> AsyncIterator[aio_keuss.Factory]:
    token = f"akp-{new_token()}"
    async with aio_keuss.connect(
        "redis-oq", url=REDIS_URL, prefix=token, deadletter={"max_ko": 1}
    ) as made:
        yield made
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


async def _keys(factory: aio_keuss.Factory, queue: str) -> set[str]:
    """The names of the queue's message keys, its prefix and hash tag cut off (not its
    counters, stats and stats-flushed:..., which a flush writes whenever it runs)."""
    head = factory.backend.key(queue, "")  # type: ignore[attr-defined]
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        found = [k.decode() async for k in client.scan_iter(match=head + "*")]
    finally:
        await client.aclose()
    return {k[len(head) :] for k in found if not k[len(head) :].startswith("stats")}


async def _marked(factory: aio_keuss.Factory, queue: str) -> bool:
    """Whether the queue's msg hash has the mark of levels in use (field '')."""
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        key = factory.backend.key(queue, "msg")  # type: ignore[attr-defined]
        return bool(await client.hexists(key, ""))  # type: ignore[misc]
    finally:
        await client.aclose()


async def test_a_record_of_an_earlier_release_is_of_priority_0(
    factory: aio_keuss.Factory,
) -> None:
    key = factory.backend.key  # type: ignore[attr-defined]
    client = aioredis.Redis.from_url(REDIS_URL)
    try:  # what the release before priorities wrote: '<tries>:<headers length>:' and the rest
        await client.zadd(key("q", "due"), {"old": time.time() - 10})
        await client.hset(key("q", "msg"), "old", b'1:9:{"k":"v"}J"old"')  # type: ignore[misc]
    finally:
        await client.aclose()
    q = await factory.queue("q")
    await q.push("low", priority=-1)
    await q.push("high", priority=1)
    [view] = [v for v in await q.peek(5) if v.message.id == "old"]
    assert (view.message.priority, view.message.tries) == (0, 1)
    got = [await q.reserve(timeout=1) for _ in range(3)]
    assert [(m.payload, m.priority) for m in got if m] == [("high", 1), ("old", 0), ("low", -1)]
    assert got[1] is not None and (got[1].headers, got[1].tries) == ({"k": "v"}, 1)
    assert await q.ok_many([m for m in got if m]) == [True] * 3
    assert await _keys(factory, "q") == set()


async def test_a_queue_without_priorities_writes_no_key_of_them(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("q")
    await q.push_many(["a", "b"])
    await q.push("c", delay=3600)
    m = await q.reserve(timeout=1)
    assert m is not None
    assert await _keys(factory, "q") == {"due", "msg", "held"}
    assert not await _marked(factory, "q")


async def _deadletter(q: aio_keuss.Queue, n: int) -> list[aio_keuss.Message]:
    """Reserve and ko the queue's n messages until they go to the deadletter queue (max_ko
    1)."""
    for result in (aio_keuss.KoResult.ROLLED_BACK, aio_keuss.KoResult.DEADLETTERED):
        got = await q.reserve_many(n, timeout=1)
        assert len(got) == n
        assert [await q.ko(m, delay=0) for m in got] == [result] * n
    return got


@pytest.mark.parametrize(
    "way", ["pop", "pop_many", "ok", "ok_many", "remove", "purge", "deadletter"]
)
async def test_a_level_goes_once_its_last_message_leaves(
    factory: aio_keuss.Factory, way: str
) -> None:
    q = await factory.queue("q")
    await q.push("plain", delay=3600)
    await q.push_many(["x", "y"], priority=4)
    assert {"due:4", "levels"} <= await _keys(factory, "q")
    assert await _marked(factory, "q")
    for _ in range(2):
        if way == "pop":
            assert await q.pop(timeout=1) is not None
        elif way == "pop_many":
            assert len(await q.pop_many(5, timeout=1)) == 2
            break
        elif way == "ok":
            m = await q.reserve(timeout=1)
            assert m is not None and await q.ok(m)
        elif way == "ok_many":
            got = await q.reserve_many(5, timeout=1)
            assert await q.ok_many(got) == [True, True]
            break
        elif way == "purge":
            assert await q.purge() == 3  # "plain" too
            break
        elif way == "remove":
            (view, *_) = await q.peek(5)
            assert await q.remove(view.message.id)
        else:
            await _deadletter(q, 2)
            break
    left = set() if way == "purge" else {"due", "msg"}  # "plain" is left
    assert await _keys(factory, "q") == left
    assert not await _marked(factory, "q")
    if way == "deadletter":
        dead = await factory.queue("__deadletter__")
        got = await dead.pop_many(5, timeout=1)
        assert sorted((m.payload, m.priority) for m in got) == [("x", 4), ("y", 4)]


async def test_reserved_and_delayed_levels_do_not_hold_back_the_others(
    factory: aio_keuss.Factory,
) -> None:
    """A take reads each level in turn: one whose messages are all reserved or delayed is
    passed over, and what it holds counts in the sizes and the next mature time."""
    q = await factory.queue("q", reserve_delay=3600)
    await q.push("held", priority=9)
    held = await q.reserve(timeout=1)
    assert held is not None and held.priority == 9
    await q.push("later", priority=5, delay=3600)
    await q.push("plain")
    await q.push("low", priority=-3)
    got = await q.reserve_many(5, timeout=1)
    assert [m.payload for m in got] == ["plain", "low"]
    sizes = await q.sizes()
    assert (sizes.size, sizes.scheduled, sizes.reserved) == (0, 1, 3)
    assert await q.pop(timeout=0) is None
    nxt = await q.next_mature_t()
    assert nxt is not None and nxt.timestamp() > time.time() + 3000


async def test_extend_ko_and_requeue_keep_a_message_in_its_level(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("q", reserve_delay=3600)
    await q.push("plain")
    await q.push("p", priority=2)
    m = await q.reserve(timeout=1)
    assert m is not None and m.payload == "p"
    assert await q.extend(m, 7200)
    view = await q.find(m)
    assert view is not None and (view.state, view.message.priority) == ("reserved", 2)
    assert await q.ko(m, delay=0) == aio_keuss.KoResult.ROLLED_BACK
    again = await q.reserve(timeout=1)
    assert again is not None and (again.payload, again.tries) == ("p", 1)
    assert await q.ok(again)
    assert await _keys(factory, "q") == {"due", "msg"}  # "plain" is left
    assert not await _marked(factory, "q")


async def test_requeue_from_the_deadletter_queue_keeps_the_priority(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("q")
    await q.push("p", priority=3)
    [m] = await _deadletter(q, 1)
    dead = await factory.queue("__deadletter__")
    assert list(await dead.requeue([m.id])) == [m.id]
    back = await q.pop(timeout=1)
    assert back is not None and (back.payload, back.priority) == ("p", 3)
    assert await _keys(factory, "__deadletter__") == set()


async def test_peek_pages_through_every_level_in_order(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("q")
    pushed = []
    for n in range(25):
        pushed.append(await q.push(n, priority=(n % 5) - 2))
    seen: list[str] = []
    async for view in q.browse(state="all", page_size=4):
        seen.append(view.message.id)
    assert seen == pushed  # mature time, then push order, whatever the level


async def test_a_peek_over_many_levels_reads_one_budget_in_all(
    factory: aio_keuss.Factory,
) -> None:
    """A peek's script reads at most its budget of members (PEEK_BUDGET, a bounded run),
    however many levels it merges: the budget is shared among them, not read at each
    (60 levels of 2000 delayed messages made one peek for 'scheduled' read 120,000
    members and sort them in Lua, Redis blocked for over a second). Seen here as how far
    one call's cursor gets over messages none of which it shows."""
    q = await factory.queue("q")
    levels, budget = 10, 20
    ids = await q.push_each(
        [aio_keuss.NewMessage(n, priority=1 + n % levels, delay=3600) for n in range(300)]
    )
    store = q._store
    reply = await store._run(PEEK, store._keys, ["reserved", "", "", 5, budget])
    assert reply[2:] == []  # none is reserved
    assert reply[1] is not None  # more to walk: a cursor
    passed = sorted(ids).index(reply[1].decode()) + 1  # one mature time: id order
    assert passed <= budget
    views = [view.message.payload async for view in q.browse(state="scheduled", page_size=7)]
    assert sorted(views) == list(range(300))


async def test_sizes_read_each_reserved_message_in_its_own_level_only() -> None:
    """The count of reserved messages reads each held id's deadline in its own level (its
    record names it), not in every level: with many levels and many reservations that
    was levels x reservations look-ups in one script, Redis blocked meanwhile (3000
    levels and 2000 reserved messages: half a second a call). Counted here as the ZMSCORE
    calls of one sizes, on a server of the test's own (whose command counters no other
    client moves)."""
    with own_redis() as server:
        async with aio_keuss.connect("redis-oq", url=server.url, poll_interval=30) as factory:
            q = await factory.queue("q")
            await q.push_each(
                [aio_keuss.NewMessage(p, priority=p, delay=3600) for p in range(1, 41)]
            )
            await q.push_many(["a", "b"], priority=-3)
            await q.push("plain")
            held = await q.reserve_many(2, timeout=1)
            assert [m.payload for m in held] == ["plain", "a"]
            client = aioredis.Redis.from_url(server.url)
            try:
                await client.config_resetstat()
                sizes = await q._store.sizes()
                stats = await client.info("commandstats")
            finally:
                await client.aclose()
    assert (sizes.size, sizes.total, sizes.reserved, sizes.scheduled) == (1, 43, 2, 40)
    assert stats["cmdstat_zmscore"]["calls"] <= 2  # one per level holding a reservation


@pytest.mark.parametrize("way", ["push_each", "push_many"])
async def test_an_idempotent_push_looks_its_ids_up_once_whatever_the_levels(way: str) -> None:
    """Whether an id is queued, at any priority, is one look-up in msg (every queued
    message has its record there), not one in each level: a bulk load of user ids into a
    queue of many levels cost ids x levels look-ups in one script. Counted as the ZMSCORE
    calls of one push (due's and the dedup window's), on a server of the test's own."""
    with own_redis() as server:
        async with aio_keuss.connect("redis-oq", url=server.url, poll_interval=30) as factory:
            q = await factory.queue("q")
            await q.push_each(
                [aio_keuss.NewMessage(p, priority=p, delay=3600) for p in range(1, 41)]
            )
            await q.push("taken", id="k1", priority=7)
            client = aioredis.Redis.from_url(server.url)
            try:
                await client.config_resetstat()
                if way == "push_each":
                    await q.push_each(
                        [
                            aio_keuss.NewMessage("again", id="k1"),
                            aio_keuss.NewMessage("new", id="k2"),
                        ]
                    )
                else:
                    await q.push_many(["again", "new"], ids=["k1", "k2"])
                stats = await client.info("commandstats")
            finally:
                await client.aclose()
            assert stats["cmdstat_zmscore"]["calls"] <= 2
            found = await q.find("k1")
            assert found is not None and (found.message.payload, found.message.priority) == (
                "taken",
                7,
            )
            assert await q.total_size() == 42


async def test_by_id_scripts_ask_whether_there_are_levels_without_reading_them() -> None:
    """extend, remove and an idempotent push only need to know whether the queue has
    priority levels: an EXISTS, not a read of the whole levels ZSET (up to 65,536 members)
    on every call. Counted as the ZRANGE calls they make, on a server of the test's own."""
    with own_redis() as server:
        async with aio_keuss.connect("redis-oq", url=server.url, poll_interval=30) as factory:
            q = await factory.queue("q")
            await q.push_each(
                [aio_keuss.NewMessage(p, priority=p, delay=3600) for p in range(1, 41)]
            )
            await q.push("plain")
            await q.push("gone", priority=3)
            held = await q.reserve_many(2, timeout=1)
            client = aioredis.Redis.from_url(server.url)
            try:
                await client.config_resetstat()
                assert await q.extend_many(held, 60) == [True, True]
                assert await q.remove(held[0].id) is False  # under an active reservation
                await q.push("again", id="k1")
                stats = await client.info("commandstats")
            finally:
                await client.aclose()
            assert "cmdstat_zrange" not in stats
            assert await q.total_size() == 43


async def test_a_cluster_deadletter_in_steps_keeps_the_priority() -> None:
    """On a Redis Cluster without hash_tag the deadletter is three steps (set aside here,
    copy there, drop here): the copy has the priority, and the level here goes."""
    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    options = {**_redis_cluster(new_token()), "deadletter": {"max_ko": 0}}
    try:
        async with aio_keuss.connect("redis-oq", **options) as factory:
            q = await factory.queue("q")
            await q.push_many(["a", "b"], priority=-7)
            got = await q.reserve_many(2, timeout=1)
            assert [await q.ko(m) for m in got] == [aio_keuss.KoResult.DEADLETTERED] * 2
            assert await q.total_size() == 0
            dead = await factory.queue("__deadletter__")
            moved = await dead.pop_many(5, timeout=1)
            assert sorted((m.payload, m.priority) for m in moved) == [("a", -7), ("b", -7)]
    finally:
        await _drop_redis_cluster_prefix(options)


async def test_a_take_over_renames_an_old_message_whose_id_is_queued_at_a_level(
    factory: aio_keuss.Factory,
) -> None:
    """What an older process pushes is taken over when a take finds nothing ready; an id
    already queued here at a priority counts as taken (renamed ``<id>.up``), as one in due
    does."""
    q = await factory.queue("q")
    await q.push("new", id="dup", priority=5, delay=3600)
    key = factory.backend.key  # type: ignore[attr-defined]
    client = aioredis.Redis.from_url(REDIS_URL)
    try:  # the earlier layout: z (mature time) and p (payload) of one message
        await client.zadd(key("q", "z"), {"dup": time.time() - 10})
        await client.hset(key("q", "p"), "dup", b'J"old"')  # type: ignore[misc]
    finally:
        await client.aclose()
    old = await q.pop(timeout=1)
    assert old is not None and (old.id, old.payload, old.priority) == ("dup.up", "old", 0)
    view = await q.find("dup")
    assert view is not None and (view.message.payload, view.message.priority) == ("new", 5)
