"""Conformance: looking into queues without disturbing consumers, and repairing them: peek,
browse, find, purge, requeue, history, replay.

Every backend runs it; a backend that does not claim a capability must refuse it with
NotSupportedError before anything is written. Time bounds are generous functional limits,
never performance assertions.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from conftest import Connect, needs, sizes_of

import aio_keuss
from aio_keuss import KoResult, State
from aio_keuss.message import decode_headers

pytestmark = pytest.mark.timeout(120)


async def _deadletter_one(q: aio_keuss.Queue, payload: object) -> str:
    """Push a message and ko it once (max_ko 0): it goes to the deadletter queue."""
    mid = await q.push(payload)
    held = await q.reserve(timeout=5)
    assert held is not None and held.id == mid
    assert await q.ko(held) == KoResult.DEADLETTERED
    return mid


# refusals -------------------------------------------------------------------------------


async def test_a_backend_without_peek_refuses_before_writing(factory: aio_keuss.Factory) -> None:
    caps = factory.capabilities
    q = await factory.queue("plain")
    await q.push(1)
    if not caps.peek:
        for call in (q.peek(), q.find("x"), q.purge(), q.page()):
            with pytest.raises(aio_keuss.NotSupportedError):
                await call
        with pytest.raises(aio_keuss.NotSupportedError):
            async for _ in q.browse():
                pass
    if not caps.hold or not caps.move or not caps.peek:
        with pytest.raises(aio_keuss.NotSupportedError):
            await q.requeue(["x"])
    if not caps.history:
        with pytest.raises(aio_keuss.NotSupportedError):
            await q.history()
        with pytest.raises(aio_keuss.NotSupportedError):
            await q.replay(since=0)
    assert await q.total_size() == 1


async def test_bad_arguments_are_refused_first(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("args")
    for call in (
        q.peek(0),
        q.peek(state="gone"),
        q.page(after="nonsense"),
        q.requeue(),
        q.requeue("abc"),
        q.replay(),
        q.history(since=datetime(2020, 1, 1)),  # naive
    ):
        with pytest.raises(aio_keuss.InvalidInputError):
            await call


async def test_a_replay_refused_for_its_ids_records_no_target_queue(
    factory: aio_keuss.Factory,
) -> None:
    # The ids were checked once the target queue was opened, which recorded it.
    needs(factory, "history")
    q = await factory.queue("args")
    for ids in ([5], ["bad\x00id"], ["x" * 1001]):
        with pytest.raises(aio_keuss.InvalidIdError):
            await q.replay(ids, to="replayed")  # type: ignore[list-item]
    assert "replayed" not in await factory.list()


async def test_made_up_cursors_and_bounds_out_of_range_are_refused(
    factory: aio_keuss.Factory,
) -> None:
    """A cursor no page returned, a limit no database takes, a time no datetime holds: an
    InvalidInputError, never a driver's error or a script that runs forever on the server
    (redis-reliable looped over a negative offset of -1e17 until SCRIPT KILL)."""
    q = await factory.queue("made-up")
    await q.push({"a": 1})
    refused = [
        q.page(after="-1e17|r"),
        q.page(after="-1|p"),
        q.page(after="nan|x"),
        q.page(after="1e300|x"),
        q.page(after="1.0|a\ud800b"),
        q.page(after="1.0|" + "x" * 100_000),
        q.page(limit=2**63),
        q.peek(2**70),
        q.history(limit=2**63),
        q.history(since=-1e12),
        q.history(until=1e300),
        q.history(since=datetime(1, 1, 1, tzinfo=UTC)),
        q.replay(since=-1e12),
        # ints too big for a float: an OverflowError of float(), not a refusal
        q.history(since=10**400),
        q.history(until=-(10**5000)),
        q.replay(until=10**400),
        # an int past 4,300 digits, whose repr raises: a plain ValueError of the message
        q.peek(10**5000),
        q.peek(state=10**5000),  # type: ignore[arg-type]
        q.page(limit=10**5000),
        q.page(after=10**5000),  # type: ignore[arg-type]
        q.history(limit=-(10**5000)),
        q.requeue(origin=10**5000),  # type: ignore[arg-type]
        q.replay(["a"], to=10**5000),  # type: ignore[arg-type]
    ]
    for call in refused:
        with pytest.raises(aio_keuss.InvalidInputError):
            await call
    if factory.capabilities.history:  # the usual way to say "no end" is the end
        assert (await q.history(until=datetime.max.replace(tzinfo=UTC))).items == []
    # Well-formed for some store, made up for others: a page, or refused, nothing else.
    for cursor in ("1e17|r", "0.5|p", "1.0|abc", "1.0|", "3|p", "3|r", "3|", "1.5|12"):
        if factory.capabilities.peek:
            try:
                page = await q.page(after=cursor)
            except aio_keuss.InvalidInputError:
                continue
            assert len(page.items) <= 1
    assert await q.total_size() == 1


# peek and browse ------------------------------------------------------------------------


async def test_peek_shows_each_state_and_takes_nothing(factory: aio_keuss.Factory) -> None:
    needs(factory, "peek")
    q = await factory.queue("peeked")
    ready = await q.push_many([{"n": 0}, {"n": 1}, {"n": 2}], headers={"h": "v"})
    later = []
    if factory.capabilities.delay:
        later = await q.push_many([{"n": 3}, {"n": 4}], delay=600)
    reserved_id = None
    if factory.capabilities.reserve:
        held = await q.reserve(timeout=5)
        assert held is not None
        reserved_id = held.id
    before = await sizes_of(q)

    seen = await q.peek(10)
    expected_ready = [i for i in ready if i != reserved_id]
    assert [v.message.id for v in seen] == expected_ready
    assert all(v.state is State.READY and v.queue == "peeked" for v in seen)
    assert seen[0].message.headers == {"h": "v"} and seen[0].message.payload is not None
    assert [v.message.id for v in await q.peek(1)] == expected_ready[:1]

    scheduled = await q.peek(10, state="scheduled")
    assert [v.message.id for v in scheduled] == later
    assert all(v.at > datetime.now(UTC) + timedelta(seconds=300) for v in scheduled)

    reserved = await q.peek(10, state="reserved")
    assert [v.message.id for v in reserved] == ([reserved_id] if reserved_id else [])
    if reserved and factory.capabilities.reservation_expiry:
        assert reserved[0].at > datetime.now(UTC)  # its deadline

    everything = await q.peek(100, state="all")
    assert sorted(v.message.id for v in everything) == sorted([*ready, *later])
    assert await sizes_of(q) == before


async def test_browse_pages_behind_a_cursor(factory: aio_keuss.Factory) -> None:
    needs(factory, "peek")
    q = await factory.queue("paged")
    ids: list[str] = []
    for start in range(0, 2500, 500):
        ids += await q.push_many(list(range(start, start + 500)))
    walked = [v.message.id async for v in q.browse(page_size=300)]
    assert walked == ids  # pushed in order, mature in order
    # the same by hand, cursor after cursor
    got: list[str] = []
    cursor = None
    while True:
        page = await q.page(after=cursor, limit=700)
        got += [v.message.id for v in page.items]
        if page.cursor is None:
            break
        cursor = page.cursor
    assert got == ids
    # a page larger than a store reads at once comes in several, each with its cursor
    got, cursor = [], None
    while True:
        page = await q.page(after=cursor, limit=10_000)
        got += [v.message.id for v in page.items]
        if page.cursor is None:
            break
        cursor = page.cursor
    assert got == ids
    # a walk can start after any cursor
    page = await q.page(limit=10)
    rest = [v.message.id async for v in q.browse(after=page.cursor, state="ready")]
    assert rest == ids[10:]
    assert await q.total_size() == 2500


async def test_a_walk_lists_messages_due_together_in_the_order_they_are_delivered(
    factory: aio_keuss.Factory,
) -> None:
    """Messages of one push are due at the same time; a peek shows them as they will be
    delivered (push order), not sorted by id. The memory store walked (mature, id) while
    its heap delivers (mature, push sequence): with ids chosen out of order, peek(1) named
    "job-1" while the next pop took "job-9", and a browse listed them sorted by id."""
    needs(factory, "peek", "idempotent")
    q = await factory.queue("ties")
    ids = ["job-9", "job-10", "job-11", "job-1", "job-8", "job-2"]
    assert await q.push_many(list(range(len(ids))), ids=ids) == ids
    assert [v.message.id for v in await q.peek(len(ids))] == ids
    assert [v.message.id for v in await q.peek(1)] == ids[:1]
    assert [v.message.id async for v in q.browse(page_size=2)] == ids
    assert [v.message.id async for v in q.browse(state="ready", page_size=1)] == ids
    first = await q.pop(timeout=5)
    assert first is not None and first.id == ids[0]
    assert [v.message.id for v in await q.peek(len(ids))] == ids[1:]


async def test_a_lapsed_reservation_shows_the_tries_of_the_next_delivery(
    factory: aio_keuss.Factory,
) -> None:
    """docs/visibility.md: a view's ``tries`` is "what the next delivery would be given, or
    what its holder was given". A reservation that lapsed (its consumer died) was a try: the
    message is ready again and its next delivery is given 1. peek, browse and find showed
    0, the count from before that delivery, so a message that kept killing its consumers
    looked one failure younger than it was."""
    needs(factory, "peek", "reserve", "reservation_expiry")
    q = await factory.queue("lapsed", reserve_delay=0.2)
    mid = await q.push({"n": 1})
    asked = time.monotonic()  # before the reserve: its reservation cannot lapse sooner
    held = await q.reserve(timeout=5)
    assert held is not None and held.tries == 0
    shown = await q.peek(1, state="reserved")
    # what its holder was given, while its 0.2 s run: a busy machine may look only after
    assert [v.message.tries for v in shown] == [0] or (
        not shown and time.monotonic() - asked >= 0.15
    )
    deadline = time.monotonic() + 30
    while not await q.peek(1, state="ready"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    (ready,) = await q.peek(1, state="ready")
    (walked,) = [v async for v in q.browse(state="all")]
    found = await q.find(mid)
    assert found is not None and found.state is State.READY
    shown_tries = [ready.message.tries, walked.message.tries, found.message.tries]
    again = await q.reserve(timeout=5)
    assert again is not None and again.id == mid and again.tries == 1
    assert shown_tries == [1, 1, 1]


@pytest.mark.slow
async def test_browse_of_20000_messages_in_constant_memory(factory: aio_keuss.Factory) -> None:
    """Forty pages: a walk that held every view would keep 20,000 of them (about 13 MB on
    the memory backend); paging keeps one page of 500 (a fraction of 1 MB), whatever the
    total, so the bound separates the two by a wide margin on every backend."""
    needs(factory, "peek")
    q = await factory.queue("big", max_batch=5000)
    total = 20_000
    payload = {"body": "x" * 100}
    for _ in range(0, total, 5000):
        await q.push_many([payload] * 5000)
    tracemalloc.start()
    try:
        count, last = 0, None
        async for v in q.browse(page_size=500):
            count += 1
            key = (v.message.mature, v.message.id)
            assert last is None or key >= last
            last = key
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == total
    assert peak < 5_000_000, peak


# find -----------------------------------------------------------------------------------


async def test_find_says_where_a_message_is(connect: Connect) -> None:
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "peek")
    q = await factory.queue("finding")
    assert await q.find("nowhere") is None
    mid = await q.push({"a": 1})
    found = await q.find(mid)
    assert found is not None
    assert (found.queue, found.state, found.message.payload) == ("finding", State.READY, {"a": 1})
    if factory.capabilities.delay:
        later = await q.push(2, delay=600)
        found = await q.find(later)
        assert found is not None and found.state is State.SCHEDULED
        assert found.at > datetime.now(UTC) + timedelta(seconds=300)
        assert await q.remove(later)
    if not factory.capabilities.reserve:
        return
    held = await q.reserve(timeout=5)
    assert held is not None and held.id == mid
    found = await q.find(held)
    assert found is not None and found.state is State.RESERVED
    if factory.capabilities.reservation_expiry:
        assert found.at > datetime.now(UTC)  # its deadline
    assert await q.ko(held) == KoResult.DEADLETTERED
    found = await q.find(mid)
    if found is not None:  # in the deadletter queue under its own id
        assert found.queue == "__deadletter__" and found.state is State.READY
        assert found.message.headers["x-dl-from-queue"] == "finding"
    if factory.capabilities.history:
        dl = await factory.queue("__deadletter__")
        other = await q.push(3)
        got = await q.pop(timeout=5)
        assert got is not None and got.id == other
        found = await q.find(other)
        assert found is not None and found.state is State.PROCESSED
        assert found.at <= datetime.now(UTC) + timedelta(seconds=5)
        assert await dl.total_size() == 1


# purge ----------------------------------------------------------------------------------


async def test_purge_removes_all_but_active_reservations(factory: aio_keuss.Factory) -> None:
    needs(factory, "peek", "remove")
    q = await factory.queue("purged")
    await q.push_many(list(range(1200)))
    if factory.capabilities.delay:
        await q.push_many([1, 2], delay=600)
    held = await q.reserve(timeout=5) if factory.capabilities.reserve else None
    expected = 1202 if factory.capabilities.delay else 1200
    if held is not None:
        expected -= 1
    assert await q.purge() == expected
    assert await q.total_size() == (1 if held is not None else 0)
    if held is not None:
        assert await q.ok(held)
    assert await q.purge() == 0


# requeue --------------------------------------------------------------------------------


async def test_requeue_by_id_moves_back_with_tries_reset(connect: Connect) -> None:
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "reserve", "peek", "hold", "move")
    q = await factory.queue("jobs")
    dl = await factory.queue("__deadletter__")
    first = await _deadletter_one(q, {"n": 1})
    second = await _deadletter_one(q, {"n": 2})
    assert await dl.total_size() == 2
    moved = await dl.requeue([first, "not-there"])
    assert moved == {first: first}
    assert await dl.total_size() == 1 and await q.total_size() == 1
    back = await q.reserve(timeout=5)
    assert back is not None and (back.id, back.payload, back.tries) == (first, {"n": 1}, 0)
    assert back.headers["x-dl-from-queue"] == "jobs"
    assert await q.ok(back)
    found = await q.find(second)
    assert found is not None and found.queue == "__deadletter__"


async def test_requeue_leaves_a_message_whose_origin_is_no_queue_name(connect: Connect) -> None:
    """Anyone may push into a deadletter queue, headers and all: a message whose
    x-dl-from-queue names no queue a factory can open stays where it is (it was moved under
    that name, where nobody could reach it)."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "peek", "hold", "move")
    dl = await factory.queue("__deadletter__")
    ids = [
        await dl.push({"n": n}, headers={"x-dl-from-queue": origin})
        for n, origin in enumerate(["bad name!", "", "{x}", "jobs"])
    ]
    moved = await dl.requeue(ids)
    assert moved == {ids[3]: ids[3]}
    assert await dl.total_size() == 3
    assert await (await factory.queue("jobs")).total_size() == 1


async def test_requeue_every_message_of_one_origin(connect: Connect) -> None:
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "reserve", "peek", "hold", "move")
    a = await factory.queue("origin-a")
    b = await factory.queue("origin-b")
    dl = await factory.queue("__deadletter__")
    from_a = [await _deadletter_one(a, i) for i in range(3)]
    from_b = await _deadletter_one(b, "b")
    moved = await dl.requeue(origin="origin-a")
    assert sorted(moved) == sorted(from_a)
    assert await a.total_size() == 3 and await b.total_size() == 0
    assert [v.message.id for v in await dl.peek(10)] == [from_b]
    # a held deadlettered message is left alone
    held = await dl.reserve(timeout=5)
    assert held is not None
    assert await dl.requeue(origin="origin-b") == {}
    assert await dl.ok(held)


async def test_requeue_of_an_origin_does_not_move_again_what_failed_again_meanwhile(
    connect: Connect,
) -> None:
    # The origin's worker fails each batch right after requeue moved it: deadlettered again,
    # it lands past the walk's cursor. Moved again, a requeue beside a failing consumer went
    # round for as long as that consumer kept up (here: for ever).
    factory = await connect(deadletter={"max_ko": 0}, max_batch=2, poll_interval=5.0)
    needs(factory, "reserve", "peek", "hold", "move")
    jobs = await factory.queue("jobs")
    dl = await factory.queue("__deadletter__")
    ids = [await _deadletter_one(jobs, n) for n in range(4)]
    moving = dl._move_batch
    moves = 0

    async def move_then_fail(plans: list[Any]) -> list[str | None]:
        nonlocal moves
        results = await moving(plans)
        moves += sum(r is not None for r in results)
        assert moves <= 20, "requeue moves again what it moved"
        for message in await jobs.reserve_many(len(plans), timeout=5):
            assert await jobs.ko(message) == KoResult.DEADLETTERED
        return results

    dl._move_batch = move_then_fail  # type: ignore[method-assign]
    moved = await dl.requeue(origin="jobs")
    assert sorted(moved) == sorted(ids) and moves == 4
    assert await dl.total_size() == 4 and await jobs.total_size() == 0


# history and replay ---------------------------------------------------------------------


async def test_history_lists_processed_messages_and_replay_copies_them(
    factory: aio_keuss.Factory,
) -> None:
    needs(factory, "history")
    q = await factory.queue("done")
    target = await factory.queue("again")
    start = time.time() - 1
    ids = await q.push_many([{"n": i} for i in range(5)], headers={"k": "v"})
    popped = await q.pop_many(2, timeout=5)
    reserved = await q.reserve_many(3, timeout=5)
    for message in reserved:
        assert await q.ok(message)
    assert len(popped) == 2 and len(reserved) == 3
    page = await q.history(since=start, limit=10)
    assert sorted(v.message.id for v in page.items) == sorted(ids)
    assert all(v.state is State.PROCESSED for v in page.items)
    assert page.items[0].message.headers == {"k": "v"}
    first = await q.history(since=start, limit=2)
    assert len(first.items) == 2 and first.cursor is not None
    rest = await q.history(since=start, limit=10, after=first.cursor)
    assert [v.message.id for v in first.items + rest.items] == [v.message.id for v in page.items]
    assert (await q.history(until=start)).items == []

    copies = await q.replay(ids[:2], to="again")
    assert len(copies) == 2 and set(copies).isdisjoint(ids)
    again = await target.pop_many(10, timeout=5)
    assert sorted(m.headers["x-replay-of"] for m in again) == sorted(ids[:2])
    assert all(m.headers["k"] == "v" for m in again)
    everything = await q.replay(since=start)
    assert len(everything) == 5 and await q.size() == 5


async def test_a_copy_replayed_round_and_round_keeps_its_headers_bounded(
    factory: aio_keuss.Factory,
) -> None:
    """A replay appended x-replay-of to the stored headers: a copy consumed and replayed
    again (a replay of the replays) carried one more x-replay-of with every round, the
    stored text growing though it decoded right. The replay merges it, each key once."""
    needs(factory, "history")
    q = await factory.queue("loop")
    mid = await q.push("x", headers={"k": "v"})
    previous = mid
    for _ in range(50):
        popped = await q.pop(timeout=5)
        assert popped is not None and popped.id == mid
        previous = mid
        (mid,) = await q.replay([mid])
    (row,) = await q._store.locate([mid])
    assert row is not None
    stored = row.message.headers  # as the store keeps them, encoded
    assert stored.count(b'"x-replay-of"') == 1, stored
    assert decode_headers(stored) == {"k": "v", "x-replay-of": previous}
    again = await q.pop(timeout=5)
    assert again is not None and again.headers == {"k": "v", "x-replay-of": previous}


async def test_replay_of_an_id_named_twice_makes_one_copy(factory: aio_keuss.Factory) -> None:
    """Each id named was located and copied, so a repeated one (a list pasted twice, an id
    given once per failure) pushed as many copies as it was named: ids name messages, and
    a replay copies each message it names once, in the order first named."""
    needs(factory, "history")
    q = await factory.queue("twice", max_batch=2)  # the repeats fall in different batches
    first, second = await q.push_many(["a", "b"])
    assert len(await q.pop_many(2, timeout=5)) == 2
    copies = await q.replay([second, second, first, second, first], to="twice-again")
    again = await (await factory.queue("twice-again")).pop_many(10, timeout=5)
    assert [m.id for m in again] == copies
    assert [m.headers["x-replay-of"] for m in again] == [second, first]


async def test_history_shows_the_tries_its_last_holder_was_given(connect: Connect) -> None:
    """A processed record's ``tries`` is what its holder was given (docs/visibility.md), as
    postgres keeps it. mongo-history counts a reservation's try up front and kept that
    count when an ok (or a move, or a deadletter) ended the message: every acknowledged
    message showed one try more than its consumer was handed (here 1 instead of 0)."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "history", "reserve")
    q = await factory.queue("counted")
    first = await q.push("ok at once")
    held = await q.reserve(timeout=5)
    assert held is not None and held.id == first and held.tries == 0
    assert await q.ok(held)
    second = await q.push("popped")
    popped = await q.pop(timeout=5)
    assert popped is not None and popped.id == second and popped.tries == 0
    third = await q.push("deadlettered")
    held = await q.reserve(timeout=5)
    assert held is not None and held.id == third and held.tries == 0
    assert await q.ko(held) == KoResult.DEADLETTERED
    records = {v.message.id: v.message.tries for v in (await q.history(limit=10)).items}
    shown = {i: records.get(i) for i in (first, second)}
    assert shown == {first: 0, second: 0}
    if third in records:  # mongo-history keeps a deadlettered message as processed
        assert records[third] == 0
    found = await q.find(first)
    assert found is not None and found.state is State.PROCESSED and found.message.tries == 0


async def test_history_counts_the_try_of_a_lapsed_reservation(
    factory: aio_keuss.Factory,
) -> None:
    """A message whose reservation lapsed was tried once (peek shows 1, the next delivery
    is given 1): popped or removed then, its record shows 1, as on mongo-history, where
    postgres's showed the count from before that delivery (0). An ok its holder sends
    late (lapsed, not delivered again) is still its holder's: its record shows 0."""
    needs(factory, "history", "reserve", "reservation_expiry")
    q = await factory.queue("lapsing", reserve_delay=0.2)
    # All pushed first, then reserved in turn, so they lapse in turn: a message waiting
    # since its push comes before any whose reservation lapsed (a later mature time), so
    # each reserve takes the next one even on a machine slow enough to let one lapse.
    ids = [await q.push(name) for name in ("popped", "removed", "ok late")]
    held = []
    for message_id in ids:
        message = await q.reserve(timeout=5)
        assert message is not None and message.id == message_id and message.tries == 0
        held.append(message)
    deadline = time.monotonic() + 30
    while len(await q.peek(3, state="ready")) < 3:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert [v.message.tries for v in await q.peek(3, state="ready")] == [1, 1, 1]
    popped = await q.pop(timeout=5)
    assert popped is not None and popped.id == ids[0] and popped.tries == 1
    assert await q.remove(ids[1])
    assert await q.ok(held[2])
    records = {v.message.id: v.message.tries for v in (await q.history(limit=10)).items}
    assert [records.get(i) for i in ids] == [1, 1, 0]


async def test_replay_of_a_range_does_not_copy_its_own_copies_consumed_meanwhile(
    factory: aio_keuss.Factory,
) -> None:
    # A worker consumes each chunk of copies as soon as it is pushed, before the walk reads
    # its next page: those copies are processed records past the cursor, in the open range.
    # Copied again, a replay on a live queue fed on itself (here: for ever).
    needs(factory, "history")
    q = await factory.queue("live", max_batch=2)
    await q.push_many(list(range(4)))
    for _ in range(2):  # consumed: four records in the history
        assert len(await q.pop_many(2, timeout=5)) == 2
    pushed = q._insert_entries
    rounds = 0

    async def push_then_consume(entries: list[Any]) -> None:
        nonlocal rounds
        rounds += 1
        assert rounds <= 10, "replay copies its own copies"
        await pushed(entries)
        assert len(await q.pop_many(len(entries), timeout=5)) == len(entries)

    q._insert_entries = push_then_consume  # type: ignore[method-assign]
    copies = await q.replay(since=0)
    assert len(copies) == 4 and rounds == 2


# the blocking mirror --------------------------------------------------------------------


def test_the_sync_mirror_peeks_browses_finds_and_purges() -> None:
    from aio_keuss import sync

    with sync.connect("memory") as factory:
        q = factory.queue("mirrored")
        ids = q.push_many(list(range(25)))
        assert [v.message.id for v in q.peek(3)] == ids[:3]
        assert [v.message.id for v in q.browse(page_size=10)] == ids
        page = q.page(limit=20)
        assert len(page.items) == 20 and page.cursor is not None
        found = q.find(ids[4])
        assert found is not None and found.message.payload == 4
        assert q.purge() == 25 and q.find(ids[4]) is None


async def test_a_pop_given_back_on_cancellation_is_not_in_the_history(
    factory: aio_keuss.Factory,
) -> None:
    # A pop whose caller was cancelled puts its messages back: they were never consumed, so
    # the history lists them once, when they are, and replay copies them once.
    needs(factory, "history")
    q = await factory.queue("given-back")
    ids = await q.push_many(["x", "y"])
    gathering = asyncio.ensure_future(q.pop_many(5, timeout=10, max_wait=60.0))
    for _ in range(3000):  # until both are taken into the gathering batch
        if await q.size() == 0:
            break
        await asyncio.sleep(0.02)
    gathering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gathering
    back: list[aio_keuss.Message] = []
    for _ in range(200):
        back += await q.pop_many(5, timeout=0.2)
        if len(back) == 2:
            break
    assert sorted(m.id for m in back) == sorted(ids)
    listed = [v.message.id for v in (await q.history(limit=100)).items]
    assert sorted(listed) == sorted(ids)
    assert len(await q.replay(since=0, to="given-back-again")) == 2


async def test_browse_of_scheduled_and_reserved_goes_past_the_first_page(
    factory: aio_keuss.Factory,
) -> None:
    # redis-oq answered the first page of a scheduled / reserved walk with cursor None
    # whenever fewer than its scan budget (2,000) lay past it: the walk ended after page 1.
    needs(factory, "peek")
    q = await factory.queue("paged-states", reserve_delay=600)
    caps = factory.capabilities
    if caps.delay:
        scheduled = await q.push_many(list(range(20)), delay=300)
        page = await q.page(state="scheduled", limit=5)
        assert len(page.items) == 5 and page.cursor is not None
        walked = [v.message.id async for v in q.browse(state="scheduled", page_size=5)]
        assert sorted(walked) == sorted(scheduled)
    if caps.reserve and caps.reservation_expiry:
        await q.push_many(list(range(20)))
        held = await q.reserve_many(20)
        assert len(held) == 20
        walked = [v.message.id async for v in q.browse(state="reserved", page_size=5)]
        assert sorted(walked) == sorted(m.id for m in held)


async def test_a_walk_of_one_state_lists_that_state_only_whatever_the_cursor(
    factory: aio_keuss.Factory,
) -> None:
    # mongo replaced the lower bound of a scheduled / reserved walk ("past now") by the
    # cursor's time: from a cursor among ready messages (a page of another state, or one of
    # this state older than the messages that matured since) it listed ready messages too.
    needs(factory, "peek")
    q = await factory.queue("states-past-cursor", reserve_delay=600)
    caps = factory.capabilities
    ready = await q.push_many(["a", "b", "c"])
    first = await q.page(state="all", limit=1)
    assert [v.message.id for v in first.items] == ready[:1] and first.cursor is not None
    for state in ("scheduled", "reserved"):
        page = await q.page(state=state, after=first.cursor, limit=10)
        assert page.items == [], (state, page.items)
        walked = [v async for v in q.browse(state=state, after=first.cursor)]
        assert walked == [], (state, walked)
    if caps.delay:
        later = await q.push("d", delay=300)
        page = await q.page(state="scheduled", after=first.cursor, limit=10)
        assert [(v.message.id, v.state) for v in page.items] == [(later, State.SCHEDULED)]
    if caps.reserve:
        assert await q.reserve(timeout=5) is not None
        held = await q.page(state="reserved", limit=1)
        if held.cursor is not None:  # and from a cursor among reserved messages, ready ones
            page = await q.page(state="ready", after=held.cursor, limit=10)
            assert all(v.state is State.READY for v in page.items), page.items
    assert await q.total_size() == 3 + caps.delay


async def test_requeue_keeps_a_scheduled_message_scheduled(connect: Connect) -> None:
    """The admin command ``move`` goes through ``requeue``: a message pushed with a delay
    and not yet due was moved ready at once, its delay lost. It stays scheduled, due when it
    was (the hold that moves it changes its due time, not what the move gives it)."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "peek", "hold", "move", "delay")
    q = await factory.queue("jobs")
    later = await q.push({"n": 1}, delay=3600)
    now = await q.push({"n": 2})
    moved = await q.requeue([later, now], origin="elsewhere")
    assert moved == {later: later, now: now}
    other = await factory.queue("elsewhere")
    found = await other.find(later)
    assert found is not None and found.state == "scheduled", found
    assert found.at is not None and found.at.timestamp() > time.time() + 3000
    ready = await other.find(now)
    assert ready is not None and ready.state == "ready", ready
    assert (await other.sched_size(), await other.size()) == (1, 1)
