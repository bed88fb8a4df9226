"""redis-oq ``Store.amend`` (promote, reschedule, change of priority), on the store itself:
what is amendable (remove's rule, a lapsed reservation included), the mature time on the
server's clock, a change of level keeping the level keys and the mark in ``msg`` as a
prioritized push and a take do, one script per call, and no message handed out twice
while amends race consumers. The queue layer's promote / reschedule / change_priority are
tested over every backend in the conformance suite.

Runs against the real server at AK_REDIS_URL, under a key prefix of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from backends import REDIS_URL, _drop_redis_prefix, new_token
from own_servers import own_redis
from redis_cluster import _drop_redis_cluster_prefix, _redis_cluster, start_redis_cluster

import aio_keuss
from aio_keuss.contract import Amend, Peeked, Store


@pytest.fixture
async def factory() -> AsyncIterator[aio_keuss.Factory]:
    token = f"aka-{new_token()}"
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=token) as made:
        yield made
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


async def _layout(factory: aio_keuss.Factory, queue: str) -> tuple[set[str], bool]:
    """The queue's message keys (prefix and hash tag cut off, its stats keys left out), and
    whether its msg hash has the mark of levels in use (field '')."""
    head = factory.backend.key(queue, "")  # type: ignore[attr-defined]
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        found = [k.decode() async for k in client.scan_iter(match=head + "*")]
        marked = await client.hexists(head + "msg", "")  # type: ignore[misc]
    finally:
        await client.aclose()
    names = {k[len(head) :] for k in found if not k[len(head) :].startswith("stats")}
    return names, bool(marked)


async def _at(store: Store, message_id: str) -> Peeked:
    [row] = await store.locate([message_id])
    assert row is not None
    return row


def test_the_backend_says_it_can_reschedule() -> None:
    from aio_keuss.redis.oq import RedisOQBackend

    assert RedisOQBackend.capabilities.reschedule


async def test_a_promote_makes_a_scheduled_message_ready_now(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("q")
    later = await q.push({"k": 1}, delay=3600, headers={"h": "v"})
    first = await q.push("first")
    store = q._store
    assert await store.amend([Amend(later, delay=0, scheduled_only=True)]) == [True]
    row = await _at(store, later)
    assert row.state == "ready"
    assert row.at <= time.time() + 60  # the server's now, whatever a skew (hang guard)
    got = await q.pop_many(5, timeout=1)
    assert [m.id for m in got] == [first, later]  # ready now: after the one ready before
    assert (got[1].payload, got[1].headers, got[1].tries) == ({"k": 1}, {"h": "v"}, 0)
    assert await q.total_size() == 0


async def test_a_promote_of_a_ready_message_changes_nothing(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("q")
    ready = await q.push("ready")
    store = q._store
    before = await _at(store, ready)
    assert await store.amend([Amend(ready, delay=0, scheduled_only=True)]) == [False]
    assert (await _at(store, ready)).at == before.at


async def test_a_reschedule_hides_a_ready_message_until_then(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("q")
    m_id = await q.push("x")
    store = q._store
    assert await store.amend([Amend(m_id, delay=3600)]) == [True]
    row = await _at(store, m_id)
    assert row.state == "scheduled" and row.at > time.time() + 1800
    assert await q.pop(timeout=0) is None
    assert await store.amend([Amend(m_id, delay=0)]) == [True]
    got = await q.pop(timeout=1)
    assert got is not None and (got.id, got.payload, got.tries) == (m_id, "x", 0)


async def test_a_reserved_or_missing_message_is_not_amended(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("q", reserve_delay=3600)
    await q.push("held", priority=2)
    held = await q.reserve(timeout=1)
    assert held is not None
    store = q._store
    before = await _at(store, held.id)
    amends = [
        Amend(held.id, delay=0),
        Amend(held.id, priority=5),
        Amend(held.id, delay=0, scheduled_only=True),
        Amend("nobody", delay=0),
        Amend("nobody", priority=1),
    ]
    assert await store.amend(amends) == [False] * 5
    after = await _at(store, held.id)
    assert (after.state, after.at, after.message.priority) == ("reserved", before.at, 2)
    assert await q.ok(held)
    assert await _layout(factory, "q") == (set(), False)


async def test_a_lapsed_reservation_is_waiting_and_the_amend_ends_it(
    factory: aio_keuss.Factory,
) -> None:
    """As remove treats it: a message whose reservation lapsed is waiting. The amend ends
    that reservation (its holder's ok no longer passes) and counts its delivery as a try,
    as a take would: the tries a look shows stay what they were."""
    q = await factory.queue("q", reserve_delay=0.05)
    m_id = await q.push("x")
    first = await q.reserve(timeout=1)
    assert first is not None and first.tries == 0
    store = q._store
    for _ in range(200):  # hang guard: until its reservation has lapsed on the server
        if (await _at(store, m_id)).state == "ready":
            break
        await asyncio.sleep(0.05)
    assert (await _at(store, m_id)).message.tries == 1
    assert await store.amend([Amend(m_id, delay=0, scheduled_only=True)]) == [False]
    assert await store.amend([Amend(m_id, priority=3)]) == [True]
    row = await _at(store, m_id)
    assert (row.state, row.message.tries, row.message.priority) == ("ready", 1, 3)
    assert not await q.ok(first)
    [again] = (await store.reserve(1, 3600)).messages
    assert (again.id, again.tries, again.priority) == (m_id, 1, 3)


async def test_a_change_of_priority_moves_a_message_between_levels(
    factory: aio_keuss.Factory,
) -> None:
    """Its level's ZSET, the levels list and the mark in msg are there as after a push of
    that priority, and go once the last message leaves a level; its mature time stays."""
    q = await factory.queue("q")
    a = await q.push("a")
    b = await q.push("b")
    store = q._store
    mature = (await _at(store, b)).at
    assert await _layout(factory, "q") == ({"due", "msg"}, False)
    assert await store.amend([Amend(b, priority=5)]) == [True]
    assert await _layout(factory, "q") == ({"due", "msg", "due:5", "levels"}, True)
    row = await _at(store, b)
    assert (row.at, row.message.priority, row.message.payload) == (mature, 5, b'J"b"')
    assert await store.amend([Amend(b, priority=-2)]) == [True]
    assert await _layout(factory, "q") == ({"due", "msg", "due:-2", "levels"}, True)
    assert await store.amend([Amend(a, priority=-2), Amend(b, priority=0)]) == [True, True]
    assert await _layout(factory, "q") == ({"due", "msg", "due:-2", "levels"}, True)
    got = await q.pop_many(5, timeout=1)
    assert [(m.id, m.priority) for m in got] == [(b, 0), (a, -2)]
    assert await _layout(factory, "q") == (set(), False)


async def test_within_its_new_priority_a_message_keeps_its_place_by_mature_time(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("q")
    early = await q.push("early")
    later = await q.push_many(["p1", "p2"], priority=4)
    store = q._store
    assert await store.amend([Amend(early, priority=4)]) == [True]
    got = await q.pop_many(5, timeout=1)
    assert [m.id for m in got] == [early, *later]


async def test_priority_and_delay_together(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("q")
    m_id = await q.push("x", priority=2, delay=3600)
    store = q._store
    assert await store.amend([Amend(m_id, delay=0, priority=7, scheduled_only=True)]) == [True]
    row = await _at(store, m_id)
    assert (row.state, row.message.priority) == ("ready", 7)
    assert await _layout(factory, "q") == ({"due:7", "levels", "msg"}, True)


async def test_an_id_amended_twice_in_one_call_sees_the_first_change(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("q")
    m_id = await q.push("x", delay=3600)
    store = q._store
    twice = [Amend(m_id, delay=0, scheduled_only=True)] * 2
    assert await store.amend(twice) == [True, False]  # ready after the first
    assert await store.amend([]) == []


async def test_a_record_of_an_earlier_release_takes_a_priority(
    factory: aio_keuss.Factory,
) -> None:
    """A record without a priority (earlier releases) is of priority 0; given one, its tries,
    headers and payload stay."""
    key = factory.backend.key  # type: ignore[attr-defined]
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.zadd(key("q", "due"), {"old": time.time() - 10})
        await client.hset(key("q", "msg"), "old", b'1:9:{"k":"v"}J"old"')  # type: ignore[misc]
    finally:
        await client.aclose()
    q = await factory.queue("q")
    assert await q._store.amend([Amend("old", priority=3)]) == [True]
    got = await q.pop(timeout=1)
    assert got is not None
    assert (got.payload, got.headers, got.tries, got.priority) == ("old", {"k": "v"}, 1, 3)


async def test_one_call_is_one_script_whatever_its_amends() -> None:
    """All the amends of a call in one round trip: one script run, counted on a server of
    the test's own (whose command counters no other client moves)."""
    with own_redis() as server:
        async with aio_keuss.connect("redis-oq", url=server.url, poll_interval=30) as factory:
            q = await factory.queue("q")
            ids = await q.push_many(list(range(20)), delay=3600)
            amends = [
                Amend(m_id, delay=0, priority=n % 3, scheduled_only=True)
                for n, m_id in enumerate(ids)
            ]
            # the script loaded first (a server's first call of it is an EVALSHA refused
            # NOSCRIPT, then the EVAL)
            assert await q._store.amend([Amend("nobody", delay=0)]) == [False]
            client = aioredis.Redis.from_url(server.url)
            try:
                await client.config_resetstat()
                assert await q._store.amend(amends) == [True] * 20
                stats = await client.info("commandstats")
            finally:
                await client.aclose()
            scripts = sum(
                stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval")
            )
            assert scripts == 1
            assert len(await q.pop_many(30, timeout=1)) == 20


async def test_amends_racing_consumers_never_hand_a_message_out_twice(
    factory: aio_keuss.Factory,
) -> None:
    """Promotes, reschedules and priority changes while many reserves run: each message is
    handed out once (an amend finds a reserved one not waiting)."""
    q = await factory.queue("q", reserve_delay=3600)
    ids = await q.push_many(list(range(60)), delay=3600)
    store = q._store
    got: list[str] = []

    async def consume() -> None:
        while len(got) < len(ids):  # the last amend of each makes it ready
            taken = await store.reserve(3, 3600)
            got.extend(m.id for m in taken.messages)
            await asyncio.sleep(0 if taken.messages else 0.01)

    async def amend() -> None:
        for round_ in range(3):
            for n, m_id in enumerate(ids):
                await store.amend(
                    [
                        Amend(m_id, delay=0, scheduled_only=True),
                        Amend(m_id, priority=(n + round_) % 4),
                        Amend(m_id, delay=0),
                    ]
                )

    # hang guard only
    await asyncio.wait_for(asyncio.gather(amend(), *(consume() for _ in range(6))), 120)
    assert sorted(got) == sorted(ids)  # every one, none twice
    assert (await q.sizes()).reserved == len(ids)


async def test_amend_on_a_cluster() -> None:
    """A queue's keys, its levels too, share one hash slot: the script runs on its node."""
    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    options = _redis_cluster(new_token())
    try:
        async with aio_keuss.connect("redis-oq", **options) as factory:
            q = await factory.queue("q")
            later = await q.push("later", delay=3600)
            now = await q.push("now")
            store = q._store
            flags = await store.amend(
                [Amend(later, delay=0, scheduled_only=True, priority=2), Amend(now, delay=3600)]
            )
            assert flags == [True, True]
            got = await q.pop_many(5, timeout=1)
            assert [(m.id, m.priority) for m in got] == [(later, 2)]
            assert await store.amend([Amend(now, delay=0, scheduled_only=True)]) == [True]
            assert [m.id for m in await q.pop_many(5, timeout=1)] == [now]
    finally:
        await _drop_redis_cluster_prefix(options)


async def test_a_message_set_aside_by_a_cluster_deadletter_is_not_amended_nor_held() -> None:
    """On a cluster a deadletter is three steps: the ko sets the message aside (not held,
    due a minute later, so nothing takes it meanwhile), copies it into the deadletter queue,
    then drops it here. Between them it is no waiting message: a promote that made it ready
    let a consumer take it while its copy went to the deadletter queue (handed out and
    deadlettered both), where a remove's delete only leaves the copy."""
    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    options = _redis_cluster(new_token())
    try:
        async with aio_keuss.connect("redis-oq", deadletter={"max_ko": 0}, **options) as factory:
            q = await factory.queue("work")
            mid = await q.push("poison")
            held = await q.reserve(timeout=5)
            assert held is not None
            store = q._store
            copying, go_on = asyncio.Event(), asyncio.Event()
            move_deferred = store._move_deferred

            async def paused(rows: list[object], queue: str) -> None:
                copying.set()
                await go_on.wait()
                await move_deferred(rows, queue)

            store._move_deferred = paused
            ko = asyncio.ensure_future(q.ko(held))
            async with asyncio.timeout(60):
                await copying.wait()
            flags = await store.amend([Amend(mid, delay=0, scheduled_only=True)])
            # nor held for a requeue's move: it would be in both queues
            holds = await store.hold([mid], 60)
            taken = await q.pop(timeout=0)
            go_on.set()
            assert await ko == aio_keuss.KoResult.DEADLETTERED
            dead = await factory.queue("__deadletter__")
            assert (flags, holds, taken) == ([False], [None], None)
            assert (await q.total_size(), await dead.total_size()) == (0, 1)
    finally:
        await _drop_redis_cluster_prefix(options)
