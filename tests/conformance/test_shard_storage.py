"""Conformance of the sharded model's storage contract (``aio_keuss.sharded.storage``): the
same suite on every storage (in memory, Redis, Redis Cluster), calling its operations
directly, as the generic store and sweeper do. Waits are bounded conditions, never timings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from backends import SHARDED_CASES, BackendCase
from conftest import Connect, usable_case

from aio_keuss.contract import Ack, Entry, Extend, Nack, Stored
from aio_keuss.redis.sharded import RedisShardStorage
from aio_keuss.sharded.backend import ShardedBackend
from aio_keuss.sharded.memory import MemoryShardStorage
from aio_keuss.sharded.storage import DEADLETTER_HOLD, Deadlines, ReadyMark, ShardStorage
from aio_keuss.types import KoResult

pytestmark = pytest.mark.timeout(90)

FAR = 3600.0


@pytest.fixture(params=SHARDED_CASES, ids=lambda case: case.id)
def case(request: pytest.FixtureRequest) -> BackendCase:
    """Only the sharded cases (this overrides the suite-wide fixture)."""
    return usable_case(request)


@pytest.fixture
async def st(connect: Connect) -> ShardStorage:
    """The storage of a factory of the case (its sweeper off: the tests drive every step)."""
    factory = await connect(sweeper=False)
    backend = factory.backend
    assert isinstance(backend, ShardedBackend)
    return backend.storage


def entry(mid: str, **fields: Any) -> Entry:
    return Entry(mid, f"p-{mid}".encode(), b'{"h":1}', **fields)


def renewed(mid: str, **fields: Any) -> Entry:
    """A later message of id ``mid``, told apart by its payload."""
    return Entry(mid, b"new", b'{"h":1}', **fields)


async def fire_ids(st: ShardStorage, shard: int, n: int, delay: float | None = None) -> list[str]:
    return [m.id for m in (await st.fire("q", shard, n, delay)).messages]


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 30.0) -> None:
    """Wait for something time brings about (a bound against hangs, not a timing)."""
    deadline = time.monotonic() + seconds
    while not await condition():
        assert time.monotonic() < deadline, "condition never met"
        await asyncio.sleep(0.02)


# load / fire ------------------------------------------------------------------------------


async def test_load_then_fire_in_order_and_announce_an_empty_magazine(st: ShardStorage) -> None:
    first = await st.load("q", 0, [entry("a"), entry("b")], 60.0, None)
    assert first.flags == [True, True] and first.announce and first.scheduled is None
    second = await st.load("q", 0, [entry("c")], 60.0, None)
    assert second.flags == [True] and not second.announce  # not empty: announced already
    assert second.version > first.version
    fired = await st.fire("q", 0, 2, None)
    assert [m.id for m in fired.messages] == ["a", "b"]
    message = fired.messages[0]
    assert (message.payload, message.headers, message.tries) == (b"p-a", b'{"h":1}', 0)
    assert fired.left == 1 and fired.next_scheduled is None
    rest = await st.fire("q", 0, 5, None)
    assert [m.id for m in rest.messages] == ["c"] and rest.left <= 0
    assert (await st.load("q", 0, [entry("d")], 60.0, None)).announce  # empty again
    assert await fire_ids(st, 1, 5) == []  # shards are apart


async def test_an_explicit_id_is_refused_while_queued_and_within_its_window(
    st: ShardStorage,
) -> None:
    assert (await st.load("q", 0, [entry("x", dedup=True)], FAR, None)).flags == [True]
    assert (await st.load("q", 0, [entry("x", dedup=True)], FAR, None)).flags == [False]
    assert await fire_ids(st, 0, 5) == ["x"]
    assert (await st.load("q", 0, [entry("x", dedup=True)], FAR, None)).flags == [False]
    # a window of 0 ends at once: the id is free again once its message left
    assert (await st.load("q", 0, [entry("y", dedup=True)], 0.0, None)).flags == [True]
    assert (await st.load("q", 0, [entry("y", dedup=True)], 0.0, None)).flags == [False]
    assert await fire_ids(st, 0, 5) == ["y"]
    assert (await st.load("q", 0, [entry("y", dedup=True)], 0.0, None)).flags == [True]


async def test_queued_says_which_ids_have_a_record_in_the_shard(st: ShardStorage) -> None:
    """What a duplicate ``push_and_wait`` asks (is the earlier message finished?): an id
    has a record while it waits, is scheduled, is fired and not committed, is sidelined, or
    is set aside for its deadletter copy; not once committed, popped or dropped."""
    ids = ["a", "b", "c", "d", "e"]
    loads = [entry("a", dedup=True), entry("b", delay=FAR), *map(entry, "cde")]
    await st.load("q", 0, loads, 60.0, None)
    assert await st.queued("q", 0, [*ids, "z"]) == [True] * 5 + [False]
    a, c = (await st.fire("q", 0, 2, FAR)).messages
    d, e = (await st.fire("q", 0, 2, 0.0)).messages  # deadline: now
    assert [m.id for m in (a, c, d, e)] == ["a", "c", "d", "e"]
    assert await st.queued("q", 0, ids) == [True] * 5  # fired, not committed
    assert await st.commit("q", 0, [Ack("a", a.tries)]) == [True]
    assert (await st.sweep("q", 0, 1000)).sidelined == 2  # d and e lapsed
    done = await st.rollback("q", 0, [Nack("c", c.tries, 0.0)], 0)
    assert done.results == [KoResult.DEADLETTERED]  # set aside for its copy
    assert await st.queued("q", 0, ids) == [False, True, True, True, True]
    assert await st.drop_doomed("q", 0, done.doomed) == [True]
    assert (await st.shovel("q", 0, 1000)).moved == 2
    assert await fire_ids(st, 0, 5) == ["d", "e"]  # popped
    assert await st.queued("q", 0, ids) == [False, True, False, False, False]


async def test_queued_counts_no_record_past_its_end_of_life_but_a_held_one(
    st: ShardStorage,
) -> None:
    """A record past its end of life that no one holds will never be delivered (the first
    step to meet it deletes it), so no result can come for it: not queued, though its id
    still has its entry. One fired by a reserve before its end still is: its holder's ok
    commits it, and keeps its result first."""
    await st.load("q", 0, [entry("held")], 60.0, 2.0)
    (held,) = (await st.fire("q", 0, 1, FAR)).messages
    assert held.id == "held" and held.expires is not None
    dead = [entry("waiting", dedup=True), entry("later", delay=FAR)]
    await st.load("q", 0, dead, 60.0, 0.0)  # their life ends as they are stored
    assert await st.queued("q", 0, ["held", "waiting", "later"]) == [True, False, False]
    await asyncio.sleep(max(0.0, held.expires - time.time()) + 0.1)  # past its end too
    assert await st.queued("q", 0, ["held", "waiting", "later"]) == [True, False, False]
    assert await st.commit("q", 0, [Ack("held", held.tries)]) == [True]
    assert await st.queued("q", 0, ["held"]) == [False]


async def test_a_record_past_its_end_of_life_no_one_holds_refuses_no_push_of_its_id(
    st: ShardStorage,
) -> None:
    """A record past its end of life that no one holds is never delivered and, as
    :meth:`queued` says, no result can come for it: a push of its id is not refused for it
    (it was, until a step met and deleted the record: whether a push went in hung on the
    sweep's timing). The push deletes it in the same step, wherever it waits: the index
    then names the new record, the dead one is counted expired once, and nothing of it is
    left to fire or to count as ready or scheduled. The dedup window still refuses, as it
    does once the record is gone, and so does a put-back's check only while queued."""
    # waiting at the head of the magazine (its window 0: over at once)
    await st.load("q", 0, [entry("x", dedup=True)], 0.0, 0.0)  # dead as it is stored
    assert await st.queued("q", 0, ["x"]) == [False]
    assert (await st.load("q", 0, [renewed("x", dedup=True)], 0.0, FAR)).flags == [True]
    assert await st.queued("q", 0, ["x"]) == [True]  # the new record
    sizes = await st.sizes("q", 0)
    assert (sizes.ready, sizes.scheduled, sizes.expired) == (1, 0, 1)
    assert [(m.id, m.payload) for m in (await st.fire("q", 0, 5, None)).messages] == [("x", b"new")]
    assert await st.queued("q", 0, ["x"]) == [False]
    # behind a live record
    await st.load("q", 1, [entry("alive")], 0.0, FAR)
    await st.load("q", 1, [entry("y", dedup=True)], 0.0, 0.0)
    assert (await st.load("q", 1, [renewed("y", dedup=True)], 0.0, FAR)).flags == [True]
    fired = (await st.fire("q", 1, 5, None)).messages
    assert [(m.id, m.payload) for m in fired] == [("alive", b"p-alive"), ("y", b"new")]
    assert await fire_ids(st, 1, 5) == []
    assert (await st.sizes("q", 1)).expired == 1
    # scheduled, replaced by a scheduled one, then by one loaded now
    await st.load("q", 2, [entry("s", dedup=True, delay=FAR)], 0.0, 0.0)
    assert await st.queued("q", 2, ["s"]) == [False]
    later = renewed("s", dedup=True, delay=FAR)
    assert (await st.load("q", 2, [later], 0.0, FAR)).flags == [True]
    sizes = await st.sizes("q", 2)
    assert (sizes.ready, sizes.scheduled, sizes.expired) == (0, 1, 1)
    assert (await st.load("q", 2, [entry("s", dedup=True)], 0.0, FAR)).flags == [False]
    await st.load("q", 3, [entry("t", dedup=True, delay=FAR)], 0.0, 0.0)
    assert (await st.load("q", 3, [renewed("t", dedup=True)], 0.0, FAR)).flags == [True]
    sizes = await st.sizes("q", 3)
    assert (sizes.ready, sizes.scheduled, sizes.expired) == (1, 0, 1)
    assert sizes.next_scheduled is None
    fired = (await st.fire("q", 3, 5, None)).messages
    assert [(m.id, m.payload) for m in fired] == [("t", b"new")]
    # within its window: refused, before and after a step deleted the dead record
    await st.load("q", 4, [entry("w", dedup=True)], FAR, 0.0)
    assert await st.queued("q", 4, ["w"]) == [False]
    assert (await st.load("q", 4, [entry("w", dedup=True)], FAR, FAR)).flags == [False]
    assert (await st.sizes("q", 4)).expired == 1  # the purge deleted it
    assert (await st.load("q", 4, [entry("w", dedup=True)], FAR, FAR)).flags == [False]
    # a put-back (checked while queued only) of an id whose record is dead
    await st.load("q", 5, [entry("p")], 0.0, 0.0)
    back = renewed("p", mature=1234.5, tries=2)
    assert (await st.load("q", 5, [back], 0.0, FAR)).flags == [True]
    (message,) = (await st.fire("q", 5, 5, None)).messages
    assert (message.id, message.payload, message.tries) == ("p", b"new", 2)
    assert (await st.sizes("q", 5)).expired == 1


async def _reserved_with_an_end(st: ShardStorage, shard: int, mid: str, sweep: bool) -> Stored:
    """``mid`` loaded with a message TTL (its window 0) and reserved with a deadline passed
    at once, then swept into the sideline (``sweep``), all before its end of life: where
    the machine was slower than that (it expired first, and was deleted), again with a
    longer TTL. The message as fired."""
    ttl = 0.5
    while True:
        await st.load("q", shard, [entry(mid, dedup=True)], 0.0, ttl)
        fired = (await st.fire("q", shard, 1, 0.0)).messages
        if fired and (not sweep or (await st.sweep("q", shard, 1000)).moved == 1):
            return fired[0]
        ttl *= 2
        assert ttl < 1000, "never reserved before its end of life"


async def test_a_sidelined_record_past_its_end_of_life_is_replaced_by_a_push_of_its_id(
    st: ShardStorage,
) -> None:
    """Swept into the sideline (held by no one), then past its end of life: a push of its
    id goes in and deletes it in the same step, so the shovel brings back nothing of it
    (the new message is fired once, with its own tries) and it is counted expired once."""
    await _reserved_with_an_end(st, 0, "d", sweep=True)

    async def dead() -> bool:
        return await st.queued("q", 0, ["d"]) == [False]

    await until(dead)
    assert (await st.load("q", 0, [entry("d", dedup=True)], 0.0, FAR)).flags == [True]
    assert await st.queued("q", 0, ["d"]) == [True]
    assert (await st.sizes("q", 0)).expired == 1
    await st.shovel("q", 0, 1000)
    sizes = await st.sizes("q", 0)
    assert (sizes.ready, sizes.sidelined, sizes.shoveled, sizes.expired) == (1, 0, 0, 1)
    (message,) = (await st.fire("q", 0, 5, None)).messages
    assert (message.id, message.tries) == ("d", 0)
    await st.sweep("q", 0, 1000)
    await st.shovel("q", 0, 1000)
    assert await fire_ids(st, 0, 5) == []
    assert await st.queued("q", 0, ["d"]) == [False]


async def test_a_held_record_past_its_end_of_life_refuses_a_push_of_its_id(
    st: ShardStorage,
) -> None:
    """Its holder may still ok it (the guard of commit asks nothing of its life), past its
    reservation deadline too while the sweep has not met it: the record is queued, and
    refuses its id until the ok; then the id goes in."""
    held = await _reserved_with_an_end(st, 0, "h", sweep=False)
    assert held.expires is not None
    end = held.expires

    async def dead() -> bool:
        return time.time() > end + 0.05

    await until(dead)
    assert await st.queued("q", 0, ["h"]) == [True]
    assert (await st.load("q", 0, [entry("h", dedup=True)], 0.0, FAR)).flags == [False]
    assert await st.commit("q", 0, [Ack("h", held.tries)]) == [True]
    assert (await st.load("q", 0, [entry("h", dedup=True)], 0.0, FAR)).flags == [True]
    assert await st.queued("q", 0, ["h"]) == [True]
    assert (await st.sizes("q", 0)).expired == 0


async def test_a_put_back_keeps_its_mature_time_and_tries_and_is_refused_while_queued(
    st: ShardStorage,
) -> None:
    back = entry("p", mature=1234.5, tries=3, delay=FAR)  # a put-back ignores delay
    assert (await st.load("q", 0, [back], 60.0, None)).flags == [True]
    assert (await st.load("q", 0, [back], 60.0, None)).flags == [False]
    (message,) = (await st.fire("q", 0, 5, None)).messages
    assert (message.id, message.mature, message.tries) == ("p", 1234.5, 3)
    assert (await st.load("q", 0, [back], 60.0, None)).flags == [True]


async def test_a_put_back_keeps_the_end_of_life_it_was_fired_with(st: ShardStorage) -> None:
    before = time.time()
    await st.load("q", 0, [entry("p")], 60.0, FAR)
    (fired,) = (await st.fire("q", 0, 5, None)).messages
    assert fired.expires is not None and before + FAR - 60 <= fired.expires <= time.time() + FAR
    back = entry("p", mature=fired.mature, expires=fired.expires)
    assert (await st.load("q", 0, [back], 60.0, 2 * FAR)).flags == [True]  # TTL from the push
    (again,) = (await st.fire("q", 0, 5, None)).messages
    assert again.expires == fired.expires
    # past its end of life when put back: never delivered
    await st.load("q", 0, [entry("gone", mature=before, expires=before)], 60.0, FAR)
    assert await fire_ids(st, 0, 5) == []
    assert (await st.sizes("q", 0)).expired == 1
    # without a TTL a message has no end of life, and a put-back without one is given one
    await st.load("q", 1, [entry("n")], 60.0, None)
    (forever,) = (await st.fire("q", 1, 5, None)).messages
    assert forever.expires is None
    await st.load("q", 1, [entry("n", mature=forever.mature)], 60.0, FAR)
    (given,) = (await st.fire("q", 1, 5, None)).messages
    assert given.expires is not None and given.expires >= before + FAR - 60


async def test_put_backs_go_back_before_the_fire_pointer_where_there_is_room(
    st: ShardStorage,
) -> None:
    await st.load("q", 0, [entry(m) for m in "abcde"], 60.0, None)
    popped = (await st.fire("q", 0, 2, None)).messages
    backs = [entry(m.id, mature=m.mature) for m in popped]
    loaded = await st.load("q", 0, backs, 60.0, None, front=True)
    assert loaded.flags == [True, True] and loaded.version == 7  # raised as by a load
    assert await fire_ids(st, 0, 10) == list("abcde")
    # no room: a reservation still held just behind the fire pointer
    await st.load("q", 0, [entry(m) for m in "pqr"], 60.0, None)
    (p,) = (await st.fire("q", 0, 1, None)).messages
    assert await fire_ids(st, 0, 1, FAR) == ["q"]
    await st.load("q", 0, [entry("p", mature=p.mature)], 60.0, None, front=True)
    await st.load("q", 0, [entry("s")], 60.0, None)
    assert await fire_ids(st, 0, 10) == ["r", "p", "s"]
    # put back behind the sweep pointer: a reservation of it that lapses is still swept
    await st.load("q", 1, [entry("u")], 60.0, None)
    (u,) = (await st.fire("q", 1, 1, None)).messages
    await st.sweep("q", 1, 1000)
    await st.load("q", 1, [entry("u", mature=u.mature)], 60.0, None, front=True)
    assert await fire_ids(st, 1, 1, 0.0) == ["u"]
    assert (await st.sweep("q", 1, 1000)).moved == 1
    # without front (a deadletter copy) an entry with a mature time goes to the back
    await st.load("q", 2, [entry("v"), entry("w")], 60.0, None)
    (v,) = (await st.fire("q", 2, 1, None)).messages
    await st.load("q", 2, [entry("v", mature=v.mature)], 60.0, None)
    assert await fire_ids(st, 2, 10) == ["w", "v"]


async def test_put_backs_given_back_one_by_one_keep_the_order_they_were_fired_in(
    st: ShardStorage,
) -> None:
    """Each cancelled caller gives back its own: the put-backs of one shard arrive one by one,
    in any order, and still come out in the order they were fired (their places)."""

    def back(m: Stored) -> Entry:
        return entry(m.id, mature=m.mature, expires=m.expires, place=m.place)

    await st.load("q", 0, [entry(m) for m in "abcdef"], 60.0, None)
    fired = (await st.fire("q", 0, 3, None)).messages
    for m in fired:  # in the order they were fired
        await st.load("q", 0, [back(m)], 60.0, None, front=True)
    assert await fire_ids(st, 0, 10) == list("abcdef")  # before: c, b, a, d, e, f
    # in any order, one fired again and put back again keeping its first place, and a
    # put-back of several given out of order
    await st.load("q", 1, [entry(m) for m in "abcdef"], 60.0, None)
    a, b, c, d = (await st.fire("q", 1, 4, None)).messages
    await st.load("q", 1, [back(c)], 60.0, None, front=True)
    await st.load("q", 1, [back(a)], 60.0, None, front=True)
    (again,) = (await st.fire("q", 1, 1, None)).messages
    assert again.id == "a" and again.place == a.place
    await st.load("q", 1, [back(d), back(b)], 60.0, None, front=True)
    await st.load("q", 1, [back(again)], 60.0, None, front=True)
    assert await fire_ids(st, 1, 10) == list("abcdef")
    # a record reloaded at the back (a ko) takes a new place there
    await st.load("q", 2, [entry(m) for m in "xy"], 60.0, None)
    (x,) = (await st.fire("q", 2, 1, FAR)).messages
    await st.rollback("q", 2, [Nack("x", x.tries, 0.0)], None)
    y, x2 = (await st.fire("q", 2, 2, None)).messages
    assert (y.id, x2.id) == ("y", "x")
    await st.load("q", 2, [back(x2)], 60.0, None, front=True)
    await st.load("q", 2, [back(y)], 60.0, None, front=True)
    assert await fire_ids(st, 2, 10) == ["y", "x"]


async def test_a_put_back_of_unknown_place_stays_before_any_other(st: ShardStorage) -> None:
    """A put-back without a place (rebuilt from a Message) goes before the put-backs with
    one, now and when others come back after it, and is handed out again with that place:
    every storage alike."""
    await st.load("q", 0, [entry(m) for m in "abcd"], 60.0, None)
    a, _, c = (await st.fire("q", 0, 3, None)).messages
    await st.load("q", 0, [entry("c", mature=c.mature)], 60.0, None, front=True)
    await st.load("q", 0, [entry("a", mature=a.mature, place=a.place)], 60.0, None, front=True)
    fired = (await st.fire("q", 0, 10, None)).messages
    assert [m.id for m in fired] == ["c", "a", "d"]  # before, on Redis: a, c, d
    assert fired[0].place is not None and fired[0].place < a.place  # before, on Redis: 2


async def test_a_delayed_load_waits_in_the_schedule_until_it_matures(st: ShardStorage) -> None:
    before = time.time()
    later = await st.load("q", 0, [entry("late", delay=FAR)], 60.0, None)
    assert later.flags == [True] and not later.announce
    assert later.scheduled is not None and later.scheduled >= before + FAR - 60
    assert later.version > 0  # a scheduled record raises the version too
    fired = await st.fire("q", 0, 5, None)
    assert fired.messages == [] and fired.next_scheduled == pytest.approx(later.scheduled)
    sizes = await st.sizes("q", 0)
    assert (sizes.ready, sizes.scheduled, sizes.next_scheduled) == (0, 1, fired.next_scheduled)
    soon = await st.load("q", 1, [entry("soon", delay=0.05)], 60.0, None)
    assert soon.scheduled is not None
    got: list[str] = []

    async def fired_soon() -> bool:
        got.extend(await fire_ids(st, 1, 5))
        return bool(got)

    await until(fired_soon)
    assert got == ["soon"]


async def test_expired_messages_are_deleted_where_they_are_met(st: ShardStorage) -> None:
    await st.load("q", 0, [entry("dead")], 60.0, 0.0)  # its life ends as it is stored
    await st.load("q", 0, [entry("alive")], 60.0, FAR)
    assert await fire_ids(st, 0, 1) == ["alive"]  # the dead one passed over
    assert (await st.sizes("q", 0)).expired == 1
    await st.load("q", 1, [entry("gone")], 60.0, 0.0)
    sizes = await st.sizes("q", 1)  # purges the expired head first
    assert (sizes.ready, sizes.expired) == (0, 1)


# reserve / commit / rollback -----------------------------------------------------------


async def test_a_reservation_is_committed_once_by_its_holder(st: ShardStorage) -> None:
    await st.load("q", 0, [entry("a")], 60.0, None)
    (held,) = (await st.fire("q", 0, 1, FAR)).messages
    sizes = await st.sizes("q", 0)
    assert (sizes.ready, sizes.fired) == (0, 1)
    assert await st.commit("q", 0, [Ack("a", held.tries + 1)]) == [False]  # not its holder
    assert await st.commit("q", 0, [Ack("a", held.tries), Ack("nothing")]) == [True, False]
    assert await st.commit("q", 0, [Ack("a")]) == [False]
    assert (await st.sizes("q", 0)).fired == 0


async def test_a_popped_record_is_not_held(st: ShardStorage) -> None:
    await st.load("q", 0, [entry("a")], 60.0, None)
    assert await fire_ids(st, 0, 1) == ["a"]
    assert await st.commit("q", 0, [Ack("a")]) == [False]
    assert (await st.rollback("q", 0, [Nack("a", None, 0.0)], None)).results == [KoResult.MISSING]


async def test_a_rollback_counting_a_try_reloads_at_the_back_and_a_release_at_its_place(
    st: ShardStorage,
) -> None:
    await st.load("q", 0, [entry("a"), entry("b"), entry("c")], 60.0, None)
    (a, b) = (await st.fire("q", 0, 2, FAR)).messages
    done = await st.rollback(
        "q", 0, [Nack("a", a.tries, 0.0), Nack("b", b.tries, 0.0, count_try=False)], None
    )
    assert done.results == [KoResult.ROLLED_BACK, KoResult.ROLLED_BACK]
    assert done.reloaded and done.scheduled is None and done.doomed == []
    again = (await st.fire("q", 0, 5, None)).messages
    assert [(m.id, m.tries) for m in again] == [("b", 0), ("c", 0), ("a", 1)]
    assert (await st.sizes("q", 0)).fired == 0


def release(m: Stored) -> Nack:
    """What the queue layer gives back for a reservation its holder never saw."""
    return Nack(m.id, m.tries, 0.0, count_try=False)


async def test_a_reservation_released_at_no_try_goes_back_to_its_place(
    st: ShardStorage,
) -> None:
    """A release costing no try (a cancelled reserve, a close's give-back, a consumer's
    prefetched reservations) goes back where it was fired from, before the fire pointer,
    as a cancelled pop's put-back does: released one by one, the latest first (the room
    before the fire pointer ends at a reservation still held), or several at once in any
    order, the shard's records still come out in the order they were loaded."""
    await st.load("q", 0, [entry(m, tries=2) for m in "abcdef"], 60.0, None)
    a, b, c = (await st.fire("q", 0, 3, FAR)).messages
    version = (await st.sizes("q", 0)).load
    done = await st.rollback("q", 0, [release(c)], None)
    assert done.results == [KoResult.ROLLED_BACK] and done.reloaded
    assert done.version > version  # raised, as by a load: the shard is announced again
    for m in (b, a):
        assert (await st.rollback("q", 0, [release(m)], None)).results == [KoResult.ROLLED_BACK]
    sizes = await st.sizes("q", 0)
    assert (sizes.ready, sizes.fired, sizes.load) == (6, 0, 6)  # not reloaded at the back
    again = (await st.fire("q", 0, 2, FAR)).messages
    assert [(m.id, m.tries, m.place) for m in again] == [("a", 2, a.place), ("b", 2, b.place)]
    assert await st.commit("q", 0, [Ack(m.id, m.tries) for m in again]) == [True, True]
    assert await fire_ids(st, 0, 10) == list("cdef")
    # several in one call, given out of order: in the order they were fired
    await st.load("q", 1, [entry(m) for m in "abcd"], 60.0, None)
    a, b, c = (await st.fire("q", 1, 3, FAR)).messages
    done = await st.rollback("q", 1, [release(c), release(a), release(b)], None)
    assert done.results == [KoResult.ROLLED_BACK] * 3 and done.reloaded
    assert await fire_ids(st, 1, 10) == list("abcd")  # before: d, c, a, b
    # released with a delay it is scheduled, as a ko with a delay
    await st.load("q", 2, [entry("x"), entry("y")], 60.0, None)
    (x,) = (await st.fire("q", 2, 1, FAR)).messages
    done = await st.rollback("q", 2, [Nack("x", x.tries, FAR, count_try=False)], None)
    assert not done.reloaded and done.scheduled is not None
    assert await fire_ids(st, 2, 10) == ["y"]


async def test_releases_and_put_backs_of_one_shard_keep_the_order_they_were_fired_in(
    st: ShardStorage,
) -> None:
    """Releases and a cancelled pop's put-backs share the room before the fire pointer and
    its ordering by place; one with no room (a reservation still held just behind it) is
    reloaded at the back, with a new place, as a put-back with no room is."""

    def back(m: Stored) -> Entry:
        return entry(m.id, mature=m.mature, expires=m.expires, place=m.place)

    await st.load("q", 0, [entry(m) for m in "abcdef"], 60.0, None)
    a, b = (await st.fire("q", 0, 2, None)).messages  # popped
    c, d = (await st.fire("q", 0, 2, FAR)).messages  # reserved
    await st.rollback("q", 0, [release(d), release(c)], None)
    await st.load("q", 0, [back(a)], 60.0, None, front=True)
    await st.load("q", 0, [back(b)], 60.0, None, front=True)
    assert await fire_ids(st, 0, 10) == list("abcdef")  # before: a, b, e, f, d, c
    # put back before the release: the release goes in front of it, by place
    await st.load("q", 1, [entry(m) for m in "abcd"], 60.0, None)
    (a,) = (await st.fire("q", 1, 1, FAR)).messages
    (b,) = (await st.fire("q", 1, 1, None)).messages
    await st.load("q", 1, [back(b)], 60.0, None, front=True)
    await st.rollback("q", 1, [release(a)], None)
    assert await fire_ids(st, 1, 10) == list("abcd")  # before: b, c, d, a
    # no room: b still held just behind a's slot, so a goes to the back with a new place;
    # then b's release finds its slot free
    await st.load("q", 2, [entry(m) for m in "abc"], 60.0, None)
    (a,) = (await st.fire("q", 2, 1, FAR)).messages
    (b,) = (await st.fire("q", 2, 1, FAR)).messages
    await st.rollback("q", 2, [release(a)], None)
    await st.rollback("q", 2, [release(b)], None)
    fired = (await st.fire("q", 2, 10, None)).messages
    assert [m.id for m in fired] == ["b", "c", "a"]
    assert fired[2].place != a.place


async def test_a_released_reservation_stepped_over_by_the_sweep_is_still_swept(
    st: ShardStorage,
) -> None:
    """Released behind the sweep pointer (the sweep stepped over it while it was held):
    fired again, a reservation of it that lapses is swept."""
    await st.load("q", 0, [entry("u"), entry("v")], 60.0, None)
    (u,) = (await st.fire("q", 0, 1, FAR)).messages
    assert (await st.sweep("q", 0, 1000)).moved == 0  # stepped over, noted
    await st.rollback("q", 0, [release(u)], None)
    assert await fire_ids(st, 0, 1, 0.0) == ["u"]
    assert (await st.sweep("q", 0, 1000)).moved == 1
    assert await fire_ids(st, 0, 10) == ["v"]


async def test_a_rollback_with_a_delay_schedules_the_record(st: ShardStorage) -> None:
    await st.load("q", 0, [entry("a")], 60.0, None)
    (a,) = (await st.fire("q", 0, 1, FAR)).messages
    before = time.time()
    done = await st.rollback("q", 0, [Nack("a", a.tries, FAR)], None)
    assert done.results == [KoResult.ROLLED_BACK] and not done.reloaded
    assert done.scheduled is not None and done.scheduled >= before + FAR - 60
    sizes = await st.sizes("q", 0)
    assert (sizes.ready, sizes.fired, sizes.scheduled) == (0, 0, 1)
    assert await st.commit("q", 0, [Ack("a")]) == [False]  # scheduled: held by no one
    assert await fire_ids(st, 0, 5) == []


async def test_past_max_ko_the_record_is_set_aside_for_the_deadletter_copy(
    st: ShardStorage,
) -> None:
    """A ko past max_ko sets the record aside for the caller's copy into the deadletter
    queue: no longer held, so a second ko or an ok of the same reservation (in the same call
    or racing it) finds nothing, where before it stayed held and both kos deadlettered it;
    its try counted, scheduled for the hold's end; the last step deletes it once."""
    await st.load("q", 0, [entry("a", tries=2), entry("b")], 60.0, None)
    (a, b) = (await st.fire("q", 0, 2, FAR)).messages
    before = time.time()
    nacks = [Nack("a", a.tries, 0.0), Nack("a", a.tries, 0.0), Nack("b", b.tries, 0.0)]
    done = await st.rollback("q", 0, nacks, 2)
    assert done.results == [KoResult.DEADLETTERED, KoResult.MISSING, KoResult.ROLLED_BACK]
    (doomed,) = done.doomed
    assert (doomed.id, doomed.payload, doomed.headers, doomed.tries) == (
        "a", b"p-a", b'{"h":1}', 3
    )  # fmt: skip
    assert done.scheduled is not None
    assert before + DEADLETTER_HOLD - 5 <= done.scheduled <= time.time() + DEADLETTER_HOLD + 5
    sizes = await st.sizes("q", 0)
    assert (sizes.fired, sizes.ready, sizes.scheduled) == (0, 1, 1)
    assert await st.commit("q", 0, [Ack("a", 2), Ack("a", 3), Ack("a")]) == [False] * 3
    again = await st.rollback("q", 0, [Nack("a", 2, 0.0), Nack("a", None, 0.0)], 2)
    assert again.results == [KoResult.MISSING] * 2 and again.doomed == []
    assert await st.drop_doomed("q", 0, [doomed]) == [True]
    assert await st.drop_doomed("q", 0, [doomed]) == [False]  # dropped once
    sizes = await st.sizes("q", 0)
    assert (sizes.fired, sizes.scheduled, sizes.next_scheduled) == (0, 0, None)
    assert await fire_ids(st, 0, 10) == ["b"]


async def _mature_now(st: ShardStorage, queue: str, shard: int) -> None:
    """Make every scheduled record of the shard mature now (from inside each storage:
    Redis's ``z``, memory's heap), as if its time had come."""
    if isinstance(st, MemoryShardStorage):
        s = st._shard(queue, shard)
        s.schedule = [(0.0, seq) for _, seq in s.schedule]
        return
    assert isinstance(st, RedisShardStorage)
    _, keys = st._shard(queue, shard)
    for name in await st._backend.execute("ZRANGE", keys[3], 0, -1):
        await st._backend.execute("ZADD", keys[3], "0", name)


async def test_a_record_set_aside_comes_back_once_if_its_copier_dies(st: ShardStorage) -> None:
    """The caller of a ko past max_ko dies before the last step: the record set aside comes
    back when the hold ends (README: after 60 s), its try counted once, and is never swept
    meanwhile, whatever the sweep noted of its reservation (an hour's, stepped over); the
    dead caller's late drop then deletes nothing."""
    await st.load("q", 0, [entry("a")], 60.0, None)
    (a,) = (await st.fire("q", 0, 1, FAR)).messages
    assert (await st.sweep("q", 0, 1000)).stopped  # stepped over, noted: due in an hour
    done = await st.rollback("q", 0, [Nack("a", a.tries, 0.0)], 0)
    assert done.results == [KoResult.DEADLETTERED]  # set aside; the copier dies here
    (doomed,) = done.doomed
    assert done.scheduled is not None and done.scheduled <= time.time() + DEADLETTER_HOLD + 5
    assert (await st.sweep("q", 0, 1000)).moved == 0
    await _mature_now(st, "q", 0)  # the hold is over
    (back,) = (await st.fire("q", 0, 5, FAR)).messages
    assert (back.id, back.tries) == ("a", 1)  # its try counted once
    assert await st.drop_doomed("q", 0, [doomed]) == [False]  # back: the late drop misses
    assert (await st.sweep("q", 0, 1000)).moved == 0  # held again: not swept
    sizes = await st.sizes("q", 0)
    assert (sizes.fired, sizes.sidelined, sizes.scheduled) == (1, 0, 0)
    assert await st.commit("q", 0, [Ack("a", 1)]) == [True]


# sweep / shovel -------------------------------------------------------------------------


async def test_expired_reservations_are_swept_to_the_sideline_and_shoveled_back(
    st: ShardStorage,
) -> None:
    await st.load("q", 0, [entry("a"), entry("b")], 60.0, None)
    held = (await st.fire("q", 0, 2, 0.0)).messages  # deadline: now
    step = await st.sweep("q", 0, 1000)
    assert (step.moved, step.left, step.stopped, step.sidelined) == (2, 0, False, 2)
    assert step.in_magazine <= 0
    assert await st.commit("q", 0, [Ack(m.id, m.tries) for m in held]) == [False, False]
    sizes = await st.sizes("q", 0)
    assert (sizes.fired, sizes.sidelined, sizes.swept, sizes.sweep) == (0, 2, 2, 2)
    shovel = await st.shovel("q", 0, 1000)
    assert (shovel.moved, shovel.left) == (2, 0)
    assert shovel.version > step.version  # reloads raise the version
    again = (await st.fire("q", 0, 5, None)).messages
    assert [(m.id, m.tries) for m in again] == [("a", 1), ("b", 1)]
    sizes = await st.sizes("q", 0)
    assert (sizes.sidelined, sizes.swept, sizes.shoveled) == (0, 2, 2)


async def test_the_sweep_passes_over_gone_records_and_steps_over_a_live_reservation(
    st: ShardStorage,
) -> None:
    await st.load("q", 0, [entry(k) for k in "abcd"], 60.0, None)
    assert await fire_ids(st, 0, 1) == ["a"]  # popped: gone
    (b,) = (await st.fire("q", 0, 1, 0.0)).messages
    assert await st.commit("q", 0, [Ack("b", b.tries)]) == [True]  # acknowledged: gone
    await st.fire("q", 0, 1, 0.0)  # c: past its deadline
    await st.fire("q", 0, 1, FAR)  # d: within it
    step = await st.sweep("q", 0, 1000)
    # d is noted and stepped over: the pointer passes it, stopped says it is held
    assert (step.moved, step.stopped, step.left) == (1, True, 0)
    assert (await st.sweep("q", 0, 1000)).moved == 0  # nothing moves twice
    sizes = await st.sizes("q", 0)
    assert (sizes.fired, sizes.sweep) == (1, 4)
    assert await st.commit("q", 0, [Ack("d", 0)]) == [True]


async def test_sweep_and_shovel_steps_are_bounded(st: ShardStorage) -> None:
    await st.load("q", 0, [entry(str(k)) for k in range(5)], 60.0, None)
    await st.fire("q", 0, 5, 0.0)
    steps = [await st.sweep("q", 0, 2) for _ in range(3)]
    assert [(s.moved, s.left) for s in steps] == [(2, 3), (2, 1), (1, 0)]
    shovels = [await st.shovel("q", 0, 2) for _ in range(3)]
    assert [(s.moved, s.left) for s in shovels] == [(2, 3), (2, 1), (1, 0)]
    assert await fire_ids(st, 0, 10) == [str(k) for k in range(5)]


async def test_the_sweep_deletes_expired_reservations_and_reports_the_magazine(
    st: ShardStorage,
) -> None:
    await st.load("q", 0, [entry("short")], 60.0, 0.3)
    await st.load("q", 0, [entry("waiting")], 60.0, None)
    await st.load("q", 0, [entry("later", delay=FAR)], 60.0, None)
    # its reservation ends after its life (both counted from about now): swept, it is dead
    assert await fire_ids(st, 0, 1, 0.3) == ["short"]

    async def expired() -> bool:
        await st.sweep("q", 0, 1000)
        return (await st.sizes("q", 0)).expired == 1

    await until(expired)
    sizes = await st.sizes("q", 0)
    assert (sizes.fired, sizes.sidelined, sizes.swept, sizes.ready) == (0, 0, 0, 1)
    step = await st.sweep("q", 0, 1000)
    assert step.in_magazine == 1 and step.next_scheduled is not None


# extend ----------------------------------------------------------------------------------


async def test_extend_holds_to_the_guard_of_commit_and_changes_no_count(st: ShardStorage) -> None:
    await st.load("q", 0, [entry(k) for k in "abcde"], 60.0, None)
    (a,) = (await st.fire("q", 0, 1, FAR)).messages
    assert await fire_ids(st, 0, 1) == ["b"]  # popped: never held
    (c,) = (await st.fire("q", 0, 1, FAR)).messages
    assert await st.commit("q", 0, [Ack("c", c.tries)]) == [True]
    (d,) = (await st.fire("q", 0, 1, 0.0)).messages
    assert (await st.sweep("q", 0, 1000)).moved == 1  # d lapsed: sidelined, held no more
    before = await st.sizes("q", 0)
    flags = await st.extend(
        "q",
        0,
        [
            Extend("a", a.tries + 1, 60.0),  # not its holder
            Extend("a", a.tries, 60.0),
            Extend("a", None, 60.0),
            Extend("b", None, 60.0),
            Extend("c", None, 60.0),
            Extend("d", d.tries, 60.0),
            Extend("e", None, 60.0),  # ready, never fired
            Extend("nothing", None, 60.0),
        ],
    )
    assert flags == [False, True, True, False, False, False, False, False]
    after = await st.sizes("q", 0)
    assert (after.ready, after.fired, after.sidelined) == (before.ready, 1, 1)
    assert await st.commit("q", 0, [Ack("a", a.tries)]) == [True]  # its tries as they were


async def test_a_lapsed_reservation_extended_before_the_sweep_met_it_is_not_swept(
    st: ShardStorage,
) -> None:
    """Past its deadline but not swept yet: still its holder's (as for commit), and once
    extended, the sweep steps over it."""
    await st.load("q", 0, [entry("a")], 60.0, None)
    (a,) = (await st.fire("q", 0, 1, 0.0)).messages  # deadline: now
    assert await st.extend("q", 0, [Extend("a", a.tries, FAR)]) == [True]
    step = await st.sweep("q", 0, 1000)
    assert (step.moved, step.stopped) == (0, True)
    assert await st.commit("q", 0, [Ack("a", a.tries)]) == [True]


async def test_an_extend_moves_the_end_the_sweep_noted(st: ShardStorage) -> None:
    """The sweep stepped over two reservations and noted their ends. One is made to end
    soon: its note must move too, as the walk never comes back to it (found only at the
    end noted first, an hour on, it would be held that long). The other, made to end soon
    and then far again, stays held."""
    await st.load("q", 0, [entry("a"), entry("b")], 60.0, None)
    a, b = (await st.fire("q", 0, 2, FAR)).messages
    assert (await st.sweep("q", 0, 1000)).stopped  # both stepped over, noted
    assert await st.extend("q", 0, [Extend("a", a.tries, 0.05), Extend("b", None, 0.05)]) == [
        True,
        True,
    ]
    assert await st.extend("q", 0, [Extend("b", b.tries, FAR)]) == [True]
    moved = 0

    async def a_swept() -> bool:
        nonlocal moved
        moved += (await st.sweep("q", 0, 1000)).moved
        return moved > 0

    await until(a_swept)
    assert moved == 1
    assert await st.commit("q", 0, [Ack("a", a.tries), Ack("b", b.tries)]) == [False, True]
    assert (await st.sizes("q", 0)).sidelined == 1


async def test_next_deadline_reads_the_ends_extensions_gave(st: ShardStorage) -> None:
    """The earliest end of a shard's reservations: read past the sweep pointer, and from
    the note of those the sweep stepped over, which an extension moves. Past ``most``
    records (or notes) not all were read, and it says so."""
    assert await st.next_deadline("q", 0, 10) == Deadlines(None, True)
    await st.load("q", 0, [entry(k) for k in "abc"], 60.0, None)
    asked = time.time()
    a, b, c = (await st.fire("q", 0, 3, 60.0)).messages
    assert await st.extend("q", 0, [Extend("a", a.tries, FAR), Extend("c", c.tries, FAR)]) == [
        True,
        True,
    ]
    found = await st.next_deadline("q", 0, 10)
    assert found.whole and found.earliest is not None
    assert asked + 59 <= found.earliest < asked + FAR - 60  # b's, not extended
    assert not (await st.next_deadline("q", 0, 1)).whole  # a's alone read
    assert await st.commit("q", 0, [Ack("b", b.tries)]) == [True]
    found = await st.next_deadline("q", 0, 10)
    assert found.whole and found.earliest is not None and found.earliest >= asked + FAR - 1
    assert (await st.sweep("q", 0, 1000)).stopped  # a and c stepped over, noted
    assert await st.extend("q", 0, [Extend("c", c.tries, 2 * FAR)]) == [True]
    assert await st.commit("q", 0, [Ack("a", a.tries)]) == [True]  # its note is left behind
    found = await st.next_deadline("q", 0, 10)
    assert found.whole and found.earliest is not None and found.earliest >= asked + 2 * FAR - 1
    assert not (await st.next_deadline("q", 0, 1)).whole  # a's note, no longer held
    assert await st.commit("q", 0, [Ack("c", c.tries)]) == [True]
    assert (await st.next_deadline("q", 0, 10)).earliest is None


# the ready index -----------------------------------------------------------------------


async def test_the_ready_index_keeps_the_latest_announcement(st: ShardStorage) -> None:
    assert (await st.ready_head("q")).earliest is None
    before = time.time()
    await st.ready_add("q", [ReadyMark(1, 5), ReadyMark(2, 3, before + FAR)])
    head = await st.ready_head("q")
    assert head.due == [1]
    assert head.earliest is not None and head.earliest < before + FAR
    await st.ready_drop("q", [ReadyMark(1, 4)])  # a consumer's stale view: ignored
    assert (await st.ready_head("q")).due == [1]
    await st.ready_drop("q", [ReadyMark(1, 5)])
    head = await st.ready_head("q")
    assert head.due == [] and head.earliest == pytest.approx(before + FAR)
    await st.ready_add("q", [ReadyMark(2, 3, before + 2 * FAR)])  # a later due: kept earlier
    assert (await st.ready_head("q")).earliest == pytest.approx(before + FAR)
    await st.ready_drop("q", [ReadyMark(2, 3, before + 2 * FAR)])  # empty, next one later
    assert (await st.ready_head("q")).earliest == pytest.approx(before + 2 * FAR)
    await st.ready_add("q", [ReadyMark(0, 1), ReadyMark(2, 4)])
    assert sorted((await st.ready_head("q")).due) == [0, 2]


async def test_stamps_keep_each_shards_highest_announced_version(st: ShardStorage) -> None:
    assert await st.stamps("q") == {}
    await st.ready_add("q", [ReadyMark(1, 5), ReadyMark(3, 2, time.time() + FAR)])
    await st.ready_add("q", [ReadyMark(1, 4)])  # older: the stamp stays
    await st.ready_drop("q", [ReadyMark(1, 9)])  # a drop leaves the stamps as they are
    assert await st.stamps("q") == {1: 5, 3: 2}


# consumers, metadata, lease --------------------------------------------------------------


async def test_consumers_enrol_within_the_cap(st: ShardStorage) -> None:
    assert await st.enrol("q", "a", FAR, 2)
    assert await st.enrol("q", "b", FAR, 2)
    assert not await st.enrol("q", "c", FAR, 2)
    assert await st.enrol("q", "a", FAR, 2)  # a renewal needs no place
    await st.leave("q", "b")
    assert await st.enrol("q", "c", FAR, 2)
    assert await st.enrol("other", "d", FAR, 1)  # per queue
    assert await st.enrol("brief", "x", 0.05, 1)

    async def place_freed() -> bool:
        return await st.enrol("brief", "y", FAR, 1)

    await until(place_freed)  # x's lease ended


async def test_the_metadata_record_is_written_once_and_lists_the_queue(
    st: ShardStorage,
) -> None:
    first = {"shards": "4", "message_ttl": "", "max_consumers": "7", "created": "1.5"}
    assert await st.touch("q", first, None) == {
        "shards": "4",
        "message_ttl": "",
        "max_consumers": "7",
    }
    other = {"shards": "8", "message_ttl": "9.0", "max_consumers": "1", "created": "2.5"}
    assert (await st.touch("q", other, None))["shards"] == "4"  # the first writer's
    stored = await st.read_meta("q")
    assert stored is not None
    assert stored["created"] == "1.5" and stored["active"] == "true"
    assert abs(int(stored["seen"]) - time.time()) < 60
    assert (await st.listed()).get("q") == 4
    await st.unlist("q")
    assert "q" not in await st.listed()
    assert await st.read_meta("q") is not None  # the record stays
    assert await st.read_meta("never") is None
    await st.touch("brief", first, 0.05)

    async def ended() -> bool:
        return await st.read_meta("brief") is None

    await until(ended)
    assert (await st.touch("brief", other, None))["shards"] == "8"  # written anew


async def test_a_record_written_again_keeps_the_shard_count_its_data_routes_by(
    st: ShardStorage,
) -> None:
    """A queue whose record expired keeps its messages in its shards, and an explicit id's
    shard is crc32(id) % count: the record written again keeps the count the queue had (a
    larger one, or a smaller one above every stamped shard, would route ok / ko and the
    dedup check of those ids to another shard)."""
    eight = {"shards": "8", "message_ttl": "", "max_consumers": "7", "created": "1.5"}
    for queue, other in (("grown", "16"), ("shrunk", "2")):
        await st.touch(queue, eight, 0.05)
        loaded = await st.load(queue, 1, [entry("a")], 60.0, None)  # shard 1 of 8
        await st.ready_add(queue, [ReadyMark(1, loaded.version)])

        async def ended(queue: str = queue) -> bool:
            return await st.read_meta(queue) is None

        await until(ended)
        again = {**eight, "shards": other}
        assert (await st.touch(queue, again, None))["shards"] == "8"
        assert (await st.listed())[queue] == 8


async def test_one_lease_holder_at_a_time(st: ShardStorage) -> None:
    assert await st.lease("a", FAR)
    assert not await st.lease("b", FAR)
    assert await st.lease("a", FAR)  # renewed
    await st.release("b")  # not the holder: nothing
    assert not await st.lease("b", FAR)
    await st.release("a")
    assert await st.lease("b", 0.05)

    async def taken_over() -> bool:
        return await st.lease("c", FAR)

    await until(taken_over)  # b's lease ended
    assert not await st.lease("b", FAR)


async def test_an_untouched_shard_is_empty(st: ShardStorage) -> None:
    sizes = await st.sizes("q", 3)
    assert (sizes.ready, sizes.fired, sizes.sidelined, sizes.load, sizes.expired) == (
        0,
        0,
        0,
        0,
        0,
    )
    assert sizes.next_scheduled is None
    assert (await st.fire("q", 3, 10, None)).messages == []
    assert await st.commit("q", 3, [Ack("x")]) == [False]
