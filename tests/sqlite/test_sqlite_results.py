"""The SQLite result store (``aio_keuss.sqlite.results``), through a real factory's backend:
rows of ``results`` by (queue, id), expiring on SQLite's clock, read by every factory on
the file, one call on the database thread per put or get, expired rows deleted in bounded
batches in the background. Each test on a database file of its own in pytest's
``tmp_path``."""

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
from aio_keuss.results import ResultStore
from aio_keuss.sqlite.results import RECLAIM_BATCH, SqliteResults
from aio_keuss.sqlite.sql import migrations, queries

pytestmark = pytest.mark.timeout(120)

HANG_GUARD = 60.0
"""Seconds after which a wait for something that should happen is taken for a hang."""

Open = Callable[..., Awaitable[aio_keuss.Factory]]


@pytest.fixture
def database(tmp_path: Path) -> str:
    return str(tmp_path / "queues.db")


@pytest.fixture
async def open_factory(database: str) -> AsyncIterator[Open]:
    """Factories on the test's file, closed after the test."""
    opened: list[aio_keuss.Factory] = []

    async def _open(**options: Any) -> aio_keuss.Factory:
        options.setdefault("path", database)
        factory = await aio_keuss.connect("sqlite", **options)
        opened.append(factory)
        return factory

    yield _open
    for factory in reversed(opened):
        await factory.close()


@contextlib.asynccontextmanager
async def _store(factory: aio_keuss.Factory) -> AsyncIterator[ResultStore]:
    store = factory.backend.result_store()
    await store.open()
    try:
        yield store
    finally:
        await store.close()


class _Calls:
    """Calls handed to the database thread, counted by kind (the backend's ``read`` and
    ``write`` wrapped on the instance: the database itself is the real one)."""

    def __init__(self, backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads = 0
        self.writes: list[Any] = []  # what each write answered
        read, write = backend.read, backend.write

        async def counted_read(work: Any) -> Any:
            self.reads += 1
            return await read(work)

        async def counted_write(work: Any) -> Any:
            answer = await write(work)
            self.writes.append(answer)
            return answer

        monkeypatch.setattr(backend, "read", counted_read)
        monkeypatch.setattr(backend, "write", counted_write)


def _raw(database: str) -> contextlib.closing[sqlite3.Connection]:
    return contextlib.closing(sqlite3.connect(database))


def _expired_rows(database: str, queue: str, count: int) -> None:
    """``count`` results of ``queue`` that expired long ago, written by another connection."""
    with _raw(database) as raw:
        raw.executemany(
            "INSERT INTO results (queue, id, body, expires) VALUES (?, ?, ?, ?)",
            [(queue, f"old-{n}", b"x", 1000.0 + n) for n in range(count)],
        )
        raw.commit()


def _row_count(database: str) -> int:
    with _raw(database) as raw:
        count: int = raw.execute("SELECT count(*) FROM results").fetchone()[0]
    return count


async def _gone(store: ResultStore, queue: str, message_id: str) -> None:
    """Until ``message_id``'s result reads as none (a hang guard, not a timing claim)."""
    deadline = time.monotonic() + HANG_GUARD
    while (await store.get(queue, [message_id])) != [None]:
        assert time.monotonic() < deadline, "the result never expired"
        await asyncio.sleep(0.02)


async def _swept(store: ResultStore) -> None:
    """Until the background sweep the last put started (if any) has ended."""
    assert isinstance(store, SqliteResults)
    task = store._reclaiming
    if task is not None:
        await asyncio.wait_for(task, HANG_GUARD)


@pytest.mark.parametrize("where", ["file", "memory"])
async def test_every_sqlite_backend_offers_results(open_factory: Open, where: str) -> None:
    factory = await (open_factory() if where == "file" else open_factory(path=":memory:"))
    assert factory.capabilities.results
    async with _store(factory) as store:
        await store.put("q", [("a", b"kept")], 60)
        assert await store.get("q", ["a"]) == [b"kept"]


async def test_a_put_is_read_back_by_id_in_the_order_asked(open_factory: Open) -> None:
    async with _store(await open_factory()) as store:
        await store.put("q", [("a", b"first"), ("b", b""), ("c", b"\x00\xff\x00")], 60)
        found = await store.get("q", ["c", "missing", "a", "b", "a"])
        assert found == [b"\x00\xff\x00", None, b"first", b"", b"first"]
        assert await store.get("q", []) == []


async def test_many_ids_are_one_call_each_way(
    open_factory: Open, monkeypatch: pytest.MonkeyPatch
) -> None:
    factory = await open_factory()
    async with _store(factory) as store:
        await store.put("q", [("warm", b"w")], 60)
        await _swept(store)  # the first put's sweep: not what is counted
        calls = _Calls(factory.backend, monkeypatch)
        results = [(f"id-{n}", f"body-{n}".encode()) for n in range(5000)]
        await store.put("q", results, 60)
        assert len(calls.writes) == 1 and calls.reads == 0
        found = await store.get("q", [message_id for message_id, _ in results])
        assert found == [body for _, body in results]
        assert calls.reads == 1 and len(calls.writes) == 1
        await store.put("q", [], 60)
        assert len(calls.writes) == 1  # nothing to write, no call


async def test_a_result_put_again_replaces_the_first_and_its_expiry(
    open_factory: Open, database: str
) -> None:
    async with _store(await open_factory()) as store:
        await store.put("q", [("a", b"first")], 0.05)
        await store.put("q", [("a", b"second")], 3600)
        assert await store.get("q", ["a"]) == [b"second"]
        with _raw(database) as raw:
            rows = raw.execute("SELECT body, expires FROM results").fetchall()
        assert len(rows) == 1 and rows[0][0] == b"second"
        assert rows[0][1] > time.time() + 3000  # the second ttl's, not the first's
        await store.put("q", [("b", b"once"), ("b", b"twice")], 60)  # one put: the last
        assert await store.get("q", ["b"]) == [b"twice"]


async def test_a_result_expires_on_sqlites_clock(open_factory: Open, database: str) -> None:
    async with _store(await open_factory()) as store:
        before = time.time()
        await store.put("q", [("short", b"s"), ("long", b"l")], 0.05)
        await store.put("q", [("kept", b"k")], 3600)
        after = time.time()
        with _raw(database) as raw:
            (expires,) = raw.execute("SELECT expires FROM results WHERE id = 'short'").fetchone()
        # julianday('now') holds whole milliseconds: its reading within the wall-clock
        # times taken around the put
        assert before - 0.002 <= expires - 0.05 <= after + 0.002
        await _gone(store, "q", "short")
        assert await store.get("q", ["long", "kept"]) == [None, b"k"]


async def test_queues_and_ids_that_a_joined_key_would_confuse_are_apart(
    open_factory: Open,
) -> None:
    async with _store(await open_factory()) as store:
        await store.put("q1", [("a:b", b"q1 / a:b")], 60)
        await store.put("q1:a", [("b", b"q1:a / b")], 60)
        await store.put("q2", [("a:b", b"q2 / a:b")], 60)
        await store.put("q1", [("a\x00b", b"nul"), ("é", b"accent")], 60)
        assert await store.get("q1", ["a:b", "b", "a\x00b", "é", "e"]) == [
            b"q1 / a:b",
            None,
            b"nul",
            b"accent",
            None,
        ]
        assert await store.get("q1:a", ["b", "a:b"]) == [b"q1:a / b", None]
        assert await store.get("q2", ["a:b"]) == [b"q2 / a:b"]


async def test_two_factories_on_one_file_see_each_others_results(open_factory: Open) -> None:
    first, second = await open_factory(), await open_factory()
    async with _store(first) as one, _store(second) as other:
        await one.put("q", [("a", b"from the first")], 60)
        assert await other.get("q", ["a", "b"]) == [b"from the first", None]
        await other.put("q", [("a", b"again, from the second"), ("b", b"b")], 60)
        assert await one.get("q", ["a", "b"]) == [b"again, from the second", b"b"]


async def test_a_sweep_deletes_expired_rows_in_bounded_batches(
    open_factory: Open, database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch is a write of its own deleting at most RECLAIM_BATCH rows, so a put queued
    meanwhile waits for one batch at most; batches go on until one finds fewer."""
    factory = await open_factory()
    async with _store(factory) as store:
        assert isinstance(store, SqliteResults)
        await store.put("live", [("a", b"live")], 3600)
        await _swept(store)
        _expired_rows(database, "old", 2 * RECLAIM_BATCH + 17)
        calls = _Calls(factory.backend, monkeypatch)
        assert await store.reclaim() == 2 * RECLAIM_BATCH + 17
        assert calls.writes == [RECLAIM_BATCH, RECLAIM_BATCH, 17]
        assert _row_count(database) == 1
        assert await store.get("live", ["a"]) == [b"live"]
        with _raw(database) as raw:
            plan = raw.execute("EXPLAIN QUERY PLAN " + queries()["result_reclaim"], (1,)).fetchall()
        assert any("results_by_expires" in step[-1] for step in plan)


async def test_puts_start_a_sweep_at_most_once_a_period(open_factory: Open, database: str) -> None:
    async with _store(await open_factory()) as store:
        assert isinstance(store, SqliteResults)
        _expired_rows(database, "old", 5)
        await store.put("q", [("a", b"a")], 3600)  # the first put sweeps
        await _swept(store)
        assert _row_count(database) == 1
        _expired_rows(database, "old", 5)
        store.reclaim_every = 3600.0  # the next put comes well within it
        await store.put("q", [("b", b"b")], 3600)
        await _swept(store)
        assert _row_count(database) == 7
        store._next_reclaim = 0.0  # as if the period had passed
        await store.put("q", [("c", b"c")], 3600)
        await _swept(store)
        assert _row_count(database) == 3


async def test_close_stops_a_sweep_and_a_failed_sweep_is_housekeeping(
    open_factory: Open, caplog: pytest.LogCaptureFixture
) -> None:
    factory = await open_factory()
    store = factory.backend.result_store()
    assert isinstance(store, SqliteResults)
    await store.open()
    await store.put("q", [("a", b"a")], 3600)
    await store.close()
    assert store._reclaiming is None
    await store.close()  # again: nothing to do
    await factory.close()
    assert await store._sweep() == 0  # the backend closed under it: logged, not raised
    assert "deleting expired results failed" in caplog.text


async def test_a_body_another_program_stored_as_text_reads_as_bytes(
    open_factory: Open, database: str
) -> None:
    async with _store(await open_factory()) as store:
        with _raw(database) as raw:
            raw.execute(
                "INSERT INTO results (queue, id, body, expires) VALUES ('q', 't', 'text', ?)",
                (time.time() + 3600,),
            )
            raw.commit()
        assert await store.get("q", ["t"]) == [b"text"]


async def test_a_file_of_the_previous_schema_gets_the_results_table(
    open_factory: Open, database: str
) -> None:
    factory = await open_factory()
    await (await factory.queue("jobs")).push("kept")
    await factory.close()
    with _raw(database) as old:  # as step 004 left it
        old.execute("DROP TABLE results")
        old.execute("ALTER TABLE rates DROP COLUMN refused")  # a later step's
        old.execute("PRAGMA user_version = 4")
        old.commit()
    factory = await open_factory()
    async with _store(factory) as store:
        await store.put("jobs", [("a", b"a")], 60)
        assert await store.get("jobs", ["a"]) == [b"a"]
    message = await (await factory.queue("jobs")).pop(timeout=30)
    assert message is not None and message.payload == "kept"
    with _raw(database) as migrated:
        assert migrated.execute("PRAGMA user_version").fetchone()[0] == migrations()[-1][0]
