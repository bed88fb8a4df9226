"""Conformance: Reserve, ok, ko, expired reservations and remove.

Every backend runs it, skipping what it does not claim. Time bounds are generous
functional limits, never performance assertions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from backends import BackendCase
from conftest import Connect, needs, needs_reserve

import aio_keuss
from aio_keuss import KoResult

pytestmark = pytest.mark.timeout(90)


# reserve / ok / ko ----------------------------------------------------------------------


async def test_reserve_then_ok(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    mid = await queue.push({"job": 1}, headers={"k": "v"})
    message = await queue.reserve(timeout=1)
    assert message is not None
    assert (message.id, message.payload, message.headers, message.tries) == (
        mid,
        {"job": 1},
        {"k": "v"},
        0,
    )
    assert await queue.resv_size() == 1 or not queue.capabilities.reservation_expiry
    assert await queue.size() == 0
    assert await queue.ok(message) is True
    assert await queue.ok(message) is False
    assert await queue.total_size() == 0


async def test_reserve_then_ko_counts_tries_and_honours_delay(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    await queue.push("x")
    first = await queue.reserve(timeout=1)
    assert first is not None and first.tries == 0
    if queue.capabilities.delay:
        kod = time.monotonic()  # before the ko: its message cannot mature sooner than 0.4 s on
        assert await queue.ko(first, delay=0.4) == KoResult.ROLLED_BACK
        # Held back and scheduled while its 0.4 s run; a busy machine may get to ask only
        # after them (it failed so, in a loaded suite), so each answer is checked against
        # the time it came back by: a message handed out or not scheduled before then is
        # one whose delay was not honoured.
        early = await queue.reserve(timeout=0.1)
        assert early is None or time.monotonic() - kod >= 0.3, "reserved before its delay"
        scheduled = await queue.sched_size()
        assert scheduled == 1 or time.monotonic() - kod >= 0.3, "not scheduled in its delay"
        second = early or await queue.reserve(timeout=5)
        assert time.monotonic() - kod >= 0.3  # a slow machine only makes this longer
    else:
        assert await queue.ko(first) == KoResult.ROLLED_BACK
        second = await queue.reserve(timeout=5)
    assert second is not None and second.id == first.id and second.tries == 1
    assert await queue.ko(second)
    third = await queue.reserve(timeout=5)
    assert third is not None and third.tries == 2
    assert await queue.ok(third)


async def test_ok_ko_of_unknown_id_is_false(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    assert await queue.ok("no-such-id") is False
    assert await queue.ko("no-such-id") == KoResult.MISSING
    assert not await queue.ko("no-such-id")


async def test_ok_of_a_popped_message_is_false(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    await queue.push(1)
    message = await queue.pop(timeout=1)
    assert message is not None
    assert await queue.ok(message) is False


async def test_ok_by_id_string(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    mid = await queue.push(1)
    assert await queue.reserve(timeout=1) is not None
    assert await queue.ok(mid) is True


async def test_expired_reservation_is_redelivered(connect: Connect) -> None:
    factory = await connect(reserve_delay=0.3, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry")
    q = await factory.queue("q1")
    await q.push("again")
    asked = time.monotonic()  # before the reserve: its reservation cannot lapse sooner
    first = await q.reserve(timeout=1)
    assert first is not None and first.tries == 0
    # held while its 0.3 s run; a busy machine may get to ask only after them
    early = await q.reserve(timeout=0.05)
    assert early is None or time.monotonic() - asked >= 0.25, "handed out while reserved"
    second = early or await q.reserve(timeout=5)
    assert second is not None and second.id == first.id and second.tries == 1
    # the first holder's reservation is stale now: its ok must not delete the message
    assert await q.ok(first) is False
    assert await q.ok(second) is True
    assert await q.total_size() == 0


async def test_a_stale_holders_call_beside_the_holders_own_does_not_stand_for_it(
    connect: Connect,
) -> None:
    """ok / ko / move of a stale holder and of the holder sent together (one batch on the
    backends that batch every call): only the holder's acts, and it does. PostgreSQL and
    MongoDB kept the first request naming an id, so the stale ko hid the holder's (both
    MISSING, the message stuck reserved), and PostgreSQL's ok flags came back swapped."""
    factory = await connect(reserve_delay=1.0, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry")
    q = await factory.queue("q1")
    await q.push_many(["ok", "ko", "move"])
    stale = {m.payload: m for m in await _take(q, 3)}
    fresh = {m.payload: m for m in await _take(q, 3)}  # once the first reservations lapsed
    assert {m.tries for m in fresh.values()} == {1}
    assert await asyncio.gather(q.ok(stale["ok"]), q.ok(fresh["ok"])) == [False, True]
    assert await asyncio.gather(q.ko(stale["ko"]), q.ko(fresh["ko"])) == [
        KoResult.MISSING,
        KoResult.ROLLED_BACK,
    ]
    if factory.capabilities.move:
        moved = await asyncio.gather(q.move(stale["move"], "q2"), q.move(fresh["move"], "q2"))
        assert moved[0] is None and moved[1] is not None
        assert await (await factory.queue("q2")).total_size() == 1
    else:
        assert await q.ok(fresh["move"])
    sizes = await q.sizes()
    assert (sizes.total, sizes.reserved) == (1, 0)  # the ko-ed one, ready again


async def _take(q: aio_keuss.Queue, n: int) -> list[aio_keuss.Message]:
    """Reserve ``n`` messages, waiting for them as long as a busy machine needs."""
    taken: list[aio_keuss.Message] = []
    while len(taken) < n:
        more = await q.reserve_many(n - len(taken), timeout=60)
        assert more, "nothing came back"
        taken += more
    return taken


async def test_sizes_stay_coherent(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    delay = queue.capabilities.delay

    async def check(size: int, scheduled: int, reserved: int) -> None:
        s = await queue.sizes()
        assert (s.size, s.scheduled, s.reserved) == (size, scheduled, reserved)
        assert s.total == s.size + s.scheduled + s.reserved

    await queue.push_many(["a", "b", "c"])
    if delay:
        await queue.push("d", delay=30)
    sched = 1 if delay else 0
    await check(3, sched, 0)
    a = await queue.reserve(timeout=1)
    assert a is not None
    await check(2, sched, 1)
    if delay:  # ko'd with a delay: scheduled again
        await queue.ko(a, delay=30)
        await check(2, sched + 1, 0)
    else:
        await queue.ko(a)
        await check(3, 0, 0)
    b = await queue.reserve(timeout=1)
    assert b is not None
    await check(1 if delay else 2, sched + (1 if delay else 0), 1)
    assert await queue.ok(b)
    await check(1 if delay else 2, sched + (1 if delay else 0), 0)


async def test_reserve_many_and_ok_many(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    await queue.push_many(list(range(100)))
    got = await queue.reserve_many(60, timeout=1)
    got += await queue.reserve_many(60, timeout=1)
    assert sorted(m.payload for m in got) == list(range(100))
    results = await asyncio.gather(*(queue.ok(m) for m in got))
    assert all(results)
    assert await queue.total_size() == 0


async def test_ok_many_commits_in_order_with_one_flag_each(queue: aio_keuss.Queue) -> None:
    """More than ``max_batch`` (several round trips), a stale message and an unknown id
    among them: one flag per item, in the order given."""
    needs_reserve(queue)
    count = queue.options.max_batch + 7
    await queue.push_many(list(range(count)))
    got: list[aio_keuss.Message] = []
    while len(got) < count:
        got += await queue.reserve_many(count - len(got), timeout=1)
    assert await queue.ok(got[5]) is True  # acknowledged already: stale in the batch
    flags = await queue.ok_many([*got[:5], "no-such-id", *got[5:]])
    assert flags == [True] * 5 + [False, False] + [True] * (count - 6)
    assert await queue.total_size() == 0
    assert await queue.ok_many([]) == []
    with pytest.raises(aio_keuss.InvalidInputError):
        await queue.ok_many(got[0])  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.InvalidIdError):
        await queue.ok_many(["fine", 3])  # type: ignore[list-item]


# remove ---------------------------------------------------------------------------------


async def test_remove(queue: aio_keuss.Queue) -> None:
    needs(queue, "remove", "reserve")
    assert await queue.remove("unknown") is False
    plain = await queue.push("plain")
    assert await queue.remove(plain) is True
    assert await queue.remove(plain) is False
    held = await queue.push("held")
    message = await queue.reserve(timeout=1)
    assert message is not None and message.id == held
    assert await queue.remove(held) is False
    assert await queue.ko(message)
    assert await queue.remove(held) is True
    assert await queue.remove(held) is False
    assert await queue.total_size() == 0


async def test_remove_takes_only_the_message_named(queue: aio_keuss.Queue) -> None:
    needs(queue, "remove")
    first = await queue.push("first")
    second = await queue.push("second")
    third = await queue.push("third")
    assert await queue.remove(second) is True
    await queue.drain()  # bucket stores: serve what is held in memory, write the rest
    left = await queue.pop_many(10, timeout=1)
    assert [(m.id, m.payload) for m in left] == [(first, "first"), (third, "third")]


async def test_a_release_whose_reply_was_lost_is_not_given_back_again_on_close(
    case: BackendCase, connect: Connect
) -> None:
    """A give-back costs no try, so the next reservation of the message, by another
    process, has the count the first holder had. A consumer's release that reached the
    store but lost its reply (a dropped connection) stayed noted as held, and the close
    gave it back once more: that second release passed the new holder's guard and took
    its reservation from it (the message then free for a third consumer while held)."""
    if not case.shared or case.name.startswith("bucket-"):
        # (a bucket's messages are reserved by the process leasing it, no other)
        pytest.skip("no other process reserves the message meanwhile")
    first = await connect(poll_interval=5.0)
    needs(first, "reserve")
    a = await first.queue("q1")
    b = await (await connect(poll_interval=5.0)).queue("q1")
    await b.push("job")
    store: Any = a._store  # type: ignore[attr-defined]
    rollback = store.rollback

    async def applied_then_cut(nacks: Any, deadletter: Any) -> Any:
        await rollback(nacks, deadletter)
        raise aio_keuss.KeussConnectionError("connection lost before the reply")

    mine = await a.reserve(timeout=5)
    assert mine is not None
    store.rollback = applied_then_cut
    with pytest.raises(aio_keuss.KeussConnectionError):
        await a._release_all([mine], unseen=True)  # type: ignore[attr-defined]  # a consumer's
    store.rollback = rollback
    theirs = await b.reserve(timeout=5)
    assert theirs is not None and theirs.id == mine.id and theirs.tries == mine.tries
    await a.close()
    assert await b.ok(theirs)
    assert await b.total_size() == 0


async def test_a_release_after_the_close_gave_the_reservation_back_sends_nothing(
    case: BackendCase, connect: Connect
) -> None:
    """A consumer whose stop was cut short (cancelled twice, or past its wait for the
    acknowledgements) gives back its prefetched messages on its own, alongside the queue's
    close, which gives back every reservation still noted as held here. The close first,
    then another process reserving the message (the same count: a give-back takes no try),
    then the consumer's release: that second give-back of one reservation passed the new
    holder's guard and took its reservation from it."""
    if not case.shared or case.name.startswith("bucket-"):
        # (a bucket's messages are reserved by the process leasing it, no other)
        pytest.skip("no other process reserves the message meanwhile")
    first = await connect(poll_interval=5.0)
    needs(first, "reserve")
    a = await first.queue("q1")
    b = await (await connect(poll_interval=5.0)).queue("q1")
    await b.push("job")
    mine = await a.reserve(timeout=5)
    assert mine is not None
    await a._give_back(set())  # type: ignore[attr-defined]  # the close's
    theirs = await b.reserve(timeout=5)
    assert theirs is not None and theirs.id == mine.id and theirs.tries == mine.tries
    await a._release_all([mine], unseen=True)  # type: ignore[attr-defined]  # the consumer's
    assert await b.ok(theirs)
    assert await b.total_size() == 0
