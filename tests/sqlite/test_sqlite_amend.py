"""The sqlite store's ``amend`` (what ``Queue.promote``, ``reschedule`` and
``change_priority`` stand on), called on a queue's store directly: which messages it
changes (the rule of ``remove``), what it changes and what it keeps, one transaction per
call, and factories on one file racing it.

Each test works on a database file of its own in pytest's ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import aio_keuss
from aio_keuss.contract import Amend, Store

pytestmark = pytest.mark.timeout(120)

Open = Callable[..., Awaitable[aio_keuss.Factory]]
Row = tuple[Any, ...]


@pytest.fixture
def database(tmp_path: Path) -> str:
    return str(tmp_path / "queues.db")


@pytest.fixture
async def open_factory(database: str) -> AsyncIterator[Open]:
    """Factories on the test's file (no signals across them: the tests wait on nothing),
    closed after the test."""
    opened: list[aio_keuss.Factory] = []

    async def _open(**options: Any) -> aio_keuss.Factory:
        options.setdefault("path", database)
        options.setdefault("reserve_delay", 600.0)
        factory = await aio_keuss.connect("sqlite", **options)
        opened.append(factory)
        return factory

    yield _open
    for factory in opened:
        with contextlib.suppress(aio_keuss.KeussError):
            await factory.close()


def _store(q: aio_keuss.Queue) -> Store:
    store: Store = q._store
    return store


def _row(database: str, message_id: str, queue: str = "jobs") -> Row | None:
    """(mature, priority, tries, reserved, payload, headers, seq) as the file holds them."""
    with contextlib.closing(sqlite3.connect(database)) as connection:
        found: Row | None = connection.execute(
            "SELECT mature, priority, tries, reserved, payload, headers, seq FROM messages"
            " WHERE queue = ? AND id = ?",
            (queue, message_id),
        ).fetchone()
        return found


def _lapse(database: str) -> None:
    """Every reservation of the file ends, as if its deadline had passed an hour ago."""
    with contextlib.closing(sqlite3.connect(database)) as connection, connection:
        connection.execute("UPDATE messages SET mature = mature - 7200 WHERE reserved = 1")


async def test_the_backend_says_it_can_reschedule(open_factory: Open) -> None:
    assert (await open_factory()).backend.capabilities.reschedule is True
    memory = await aio_keuss.connect("sqlite", path=":memory:")
    try:
        assert memory.backend.capabilities.reschedule is True
    finally:
        await memory.close()


async def test_a_promote_makes_a_scheduled_message_ready_and_keeps_the_rest(
    open_factory: Open, database: str
) -> None:
    q = await (await open_factory()).queue("jobs")
    mid = await q.push({"n": 1}, delay=3600, headers={"h": "v"}, priority=3)
    before = _row(database, mid)
    assert before is not None
    assert await q.reserve(timeout=0) is None
    asked = time.time()
    assert await _store(q).amend([Amend(mid, delay=0.0, scheduled_only=True)]) == [True]
    after = _row(database, mid)
    assert after is not None
    assert asked <= after[0] <= time.time()
    assert after[1:] == before[1:]  # priority, tries, reserved, payload, headers, seq
    message = await q.reserve(timeout=0)
    assert message is not None and message.id == mid and message.payload == {"n": 1}
    assert message.headers["h"] == "v" and message.tries == 0
    assert await q.ok(message) is True
    assert await q.total_size() == 0


async def test_a_promote_of_a_ready_message_changes_nothing(
    open_factory: Open, database: str
) -> None:
    q = await (await open_factory()).queue("jobs")
    mid = await q.push("x")
    before = _row(database, mid)
    assert await _store(q).amend([Amend(mid, delay=0.0, scheduled_only=True)]) == [False]
    assert _row(database, mid) == before


async def test_a_reschedule_hides_a_ready_message_until_its_new_time(
    open_factory: Open, database: str
) -> None:
    q = await (await open_factory()).queue("jobs")
    mid = await q.push("x")
    asked = time.time()
    assert await _store(q).amend([Amend(mid, delay=3600.0)]) == [True]
    after = _row(database, mid)
    assert after is not None
    assert asked + 3600 <= after[0] <= time.time() + 3600
    assert await q.reserve(timeout=0) is None
    sizes = await q.sizes()
    assert (sizes.size, sizes.scheduled, sizes.total) == (0, 1, 1)
    assert await _store(q).amend([Amend(mid, delay=0.0)]) == [True]  # and back
    message = await q.reserve(timeout=0)
    assert message is not None and message.id == mid and message.tries == 0


async def test_an_active_reservation_is_not_amended(open_factory: Open, database: str) -> None:
    q = await (await open_factory()).queue("jobs")
    mid = await q.push("x")
    held = await q.reserve(timeout=0)
    assert held is not None
    before = _row(database, mid)
    store = _store(q)
    amends = [
        Amend(mid, delay=0.0),
        Amend(mid, delay=0.0, scheduled_only=True),  # its deadline is ahead, yet reserved
        Amend(mid, priority=5),
    ]
    assert await store.amend(amends) == [False, False, False]
    assert _row(database, mid) == before
    assert await q.ok(held) is True


async def test_a_lapsed_reservation_is_amended_as_remove_would_delete_it(
    open_factory: Open, database: str
) -> None:
    """Remove deletes a lapsed reservation: amend changes it, and it is waiting from then
    on, the lapse counted as the try its next delivery is given (as reserve counts it), its
    old holder's ok finding nothing."""
    q = await (await open_factory()).queue("jobs")
    mid = await q.push("x")
    held = await q.reserve(timeout=0)
    assert held is not None and held.tries == 0
    _lapse(database)
    assert await _store(q).amend([Amend(mid, delay=3600.0)]) == [True]
    seen = await q.find(mid)
    assert seen is not None and seen.state == "scheduled" and seen.message.tries == 1
    assert await q.ok(held) is False
    assert await _store(q).amend([Amend(mid, delay=0.0, scheduled_only=True)]) == [True]
    again = await q.reserve(timeout=0)
    assert again is not None and again.id == mid and again.tries == 1
    assert await q.ok(again) is True


async def test_a_promote_of_a_lapsed_reservation_is_false(
    open_factory: Open, database: str
) -> None:
    """A lapsed reservation is mature again: ready, not scheduled."""
    q = await (await open_factory()).queue("jobs")
    mid = await q.push("x")
    held = await q.reserve(timeout=0)
    assert held is not None
    _lapse(database)
    before = _row(database, mid)
    assert await _store(q).amend([Amend(mid, delay=0.0, scheduled_only=True)]) == [False]
    assert _row(database, mid) == before
    assert await q.ok(held) is True  # still its holder's


async def test_a_change_of_priority_reorders_and_keeps_the_mature_time(
    open_factory: Open, database: str
) -> None:
    q = await (await open_factory()).queue("jobs")
    first = await q.push("first")
    second = await q.push("second")
    later = await q.push("later", delay=3600)
    before = _row(database, second)
    scheduled = _row(database, later)
    assert before is not None and scheduled is not None
    assert await _store(q).amend([Amend(second, priority=5), Amend(later, priority=9)]) == [
        True,
        True,
    ]
    after = _row(database, second)
    assert after is not None and after[1] == 5 and after[0] == before[0]
    moved = _row(database, later)
    assert moved is not None and moved[1] == 9 and moved[0] == scheduled[0]  # still later
    taken = await q.reserve_many(3, timeout=0)
    assert [m.payload for m in taken] == ["second", "first"]
    assert [m.priority for m in taken] == [5, 0]
    assert await _store(q).amend([Amend(first, priority=-2)]) == [False]  # reserved
    view = await q.find(later)
    assert view is not None and view.state == "scheduled" and view.message.priority == 9


async def test_a_priority_and_a_delay_change_together(open_factory: Open, database: str) -> None:
    q = await (await open_factory()).queue("jobs")
    await q.push("ready")
    mid = await q.push("x", delay=3600)
    assert await _store(q).amend([Amend(mid, delay=0.0, priority=2, scheduled_only=True)]) == [True]
    message = await q.reserve(timeout=0)
    assert message is not None and message.id == mid and message.priority == 2


async def test_an_unknown_id_or_another_queues_message_is_not_amended(
    open_factory: Open, database: str
) -> None:
    factory = await open_factory()
    q, other = await factory.queue("jobs"), await factory.queue("other")
    mid = await other.push("x", delay=3600, id="same")
    before = _row(database, mid, "other")
    assert await _store(q).amend([Amend("same", delay=0.0), Amend("nothing", priority=1)]) == [
        False,
        False,
    ]
    assert _row(database, mid, "other") == before


async def test_amends_run_in_order_in_one_write(
    open_factory: Open, database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole call is one write (one transaction on the database thread), whatever its
    size; an id named twice finds what the amend before it left."""
    factory = await open_factory()
    q = await factory.queue("jobs")
    a = await q.push("a", delay=3600)
    b = await q.push("b")
    backend: Any = factory.backend
    writes = 0
    write = backend.write

    async def counted(work: Any) -> Any:
        nonlocal writes
        writes += 1
        return await write(work)

    monkeypatch.setattr(backend, "write", counted)
    flags = await _store(q).amend(
        [
            Amend(a, delay=0.0, scheduled_only=True),
            Amend(a, delay=0.0, scheduled_only=True),  # ready now: the first made it so
            Amend(b, delay=3600.0),
            Amend(b, delay=0.0, scheduled_only=True),  # scheduled now: promoted back
            Amend("missing", delay=1.0),
        ]
    )
    assert flags == [True, False, True, True, False]
    assert writes == 1
    assert await _store(q).amend([]) == []
    assert writes == 1
    taken = await q.reserve_many(2, timeout=0)
    assert sorted(m.payload for m in taken) == ["a", "b"]


async def test_an_amend_in_one_factory_is_what_another_factory_takes(
    open_factory: Open,
) -> None:
    mine = await (await open_factory()).queue("jobs")
    theirs = await (await open_factory()).queue("jobs")
    mid = await mine.push("x", delay=3600)
    assert await theirs.reserve(timeout=0) is None
    assert await _store(theirs).amend([Amend(mid, delay=0.0, scheduled_only=True)]) == [True]
    message = await mine.reserve(timeout=0)
    assert message is not None and message.id == mid
    assert await _store(theirs).amend([Amend(mid, delay=3600.0)]) == [False]  # reserved
    assert await mine.ok(message) is True


async def test_an_amend_racing_reserves_of_another_factory_never_double_delivers(
    open_factory: Open,
) -> None:
    """Promotes in one factory while consumers of another reserve: each message is taken
    once; one that a consumer held first is not amended (False), and everything promoted
    is taken."""
    mine = await (await open_factory()).queue("jobs")
    theirs = await (await open_factory()).queue("jobs")
    count = 60
    ids = [await mine.push(i, delay=3600) for i in range(count)]
    taken: list[str] = []

    async def consume() -> None:
        for _ in range(200):
            found = await theirs.reserve_many(5, timeout=0)
            taken.extend(m.id for m in found)
            if len(taken) >= count:
                return
            await asyncio.sleep(0)

    async def promote() -> list[bool]:
        flags: list[bool] = []
        for start in range(0, count, 4):
            chunk = ids[start : start + 4]
            amends = [Amend(i, delay=0.0, scheduled_only=True) for i in chunk]
            flags.extend(await _store(mine).amend(amends))
            await asyncio.sleep(0)
        return flags

    results = await asyncio.gather(promote(), *(consume() for _ in range(4)))
    flags = results[0]
    assert flags == [True] * count  # scheduled, so nobody held them before the promote
    for _ in range(50):
        if len(taken) >= count:
            break
        taken.extend(m.id for m in await theirs.reserve_many(count, timeout=0))
    assert len(taken) == len(set(taken)) == count
    assert sorted(taken) == sorted(ids)


async def test_an_amend_and_a_reserve_racing_for_one_message_one_wins(
    open_factory: Open,
) -> None:
    """A reschedule into the future against a reserve of another factory, over and over:
    either the reserve took it (the amend is False) or the amend moved it away first (the
    reserve finds nothing), never both."""
    mine = await (await open_factory()).queue("jobs")
    theirs = await (await open_factory()).queue("jobs")
    for n in range(30):
        mid = await mine.push(n)
        amended, message = await asyncio.gather(
            _store(mine).amend([Amend(mid, delay=3600.0)]), theirs.reserve(timeout=0)
        )
        outcome = (amended == [True], message is not None)
        assert outcome in {(True, False), (False, True)}, outcome
        assert await mine.remove(mid) is (message is None)
        if message is not None:
            assert await theirs.ok(message) is True
    assert await mine.total_size() == 0


def test_the_amend_finds_its_row_by_the_queue_and_id_key() -> None:
    """What SQLite plans for it (EXPLAIN QUERY PLAN): one search of the unique (queue, id)
    index, never a scan of the table, whatever the queue holds."""
    from aio_keuss.sqlite.sql import migrations, queries

    with contextlib.closing(sqlite3.connect(":memory:")) as c:
        for _, statements in migrations():
            for statement in statements:
                c.execute(statement)
        plan = [r[3] for r in c.execute("EXPLAIN QUERY PLAN " + queries()["amend"], [None] * 6)]
    assert plan == ["SEARCH messages USING INDEX sqlite_autoindex_messages_1 (queue=? AND id=?)"]
