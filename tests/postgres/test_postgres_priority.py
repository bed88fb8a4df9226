"""postgres priorities beyond the conformance file: a schema of the previous release upgraded
in place (its rows read priority 0), and the plans of the take: a queue without priorities
walks the range it always did, and the rows taken are found by primary key.

Each test works in its own schema, dropped afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from backends import POSTGRES_URL

import aio_keuss
from aio_keuss.contract import Entry
from aio_keuss.postgres.sql import migrations, queries

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.timeout(120)


async def _migrated_to(schema: str, last: int) -> None:
    """The schema as the release whose last step was ``last`` left it."""
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        async with connection.transaction():
            await connection.execute(
                f'CREATE SCHEMA "{schema}"; CREATE TABLE "{schema}".schema_versions'
                " (version integer PRIMARY KEY, applied timestamptz NOT NULL DEFAULT now())"
            )
            for version, step in migrations():
                if version <= last:
                    await connection.execute(step.replace("{s}", f'"{schema}"'))
                    await connection.execute(
                        f'INSERT INTO "{schema}".schema_versions (version) VALUES ($1)', version
                    )
    finally:
        await connection.close()


async def test_a_schema_of_the_release_before_priorities_is_upgraded_in_place(
    schema: str,
) -> None:
    """Rows written before step 11 (no priority column) read priority 0, and go after a
    prioritized message pushed since, before a negative one; a message reserved before
    the upgrade is still held by its holder."""
    before = max(v for v, _ in migrations() if v < 11)
    await _migrated_to(schema, before)
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        await connection.execute(
            f'INSERT INTO "{schema}".messages (queue, id, mature, payload, headers, reserved)'
            " VALUES ('jobs', 'old-1', 0, 'J\"old 1\"', '{}', false),"
            " ('jobs', 'old-2', 1, 'J\"old 2\"', '{}', false),"
            " ('jobs', 'held', 4e9, 'J\"held\"', '{}', true)"
        )
    finally:
        await connection.close()
    async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema) as factory:
        q = await factory.queue("jobs")
        found = await q.find("old-1")
        assert found is not None and found.message.priority == 0
        await q.push("low", priority=-1)
        await q.push("high", priority=2)
        got = await q.pop_many(10, timeout=0)
        assert [(m.payload, m.priority) for m in got] == [
            ("high", 2),
            ("old 1", 0),
            ("old 2", 0),
            ("low", -1),
        ]
        assert await q.resv_size() == 1
    check = await asyncpg.connect(POSTGRES_URL)
    try:
        versions = await check.fetch(f'SELECT version FROM "{schema}".schema_versions')
        assert sorted(r[0] for r in versions) == [v for v, _ in migrations()]
        index = await check.fetchval(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = $1"
            " AND indexname = 'messages_by_priority'",
            schema,
        )
        assert "WHERE (priority <> 0)" in index
    finally:
        await check.close()


async def test_the_step_finds_the_column_and_the_index_made_beforehand(schema: str) -> None:
    """What README says to run on a big table before upgrading (the index built
    CONCURRENTLY, outside any transaction): the step then does nothing more."""
    before = max(v for v, _ in migrations() if v < 11)
    await _migrated_to(schema, before)
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        await connection.execute(
            f'ALTER TABLE "{schema}".messages'
            " ADD COLUMN IF NOT EXISTS priority smallint NOT NULL DEFAULT 0"
        )
        await connection.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS messages_by_priority"
            f' ON "{schema}".messages (queue, priority DESC, mature, seq) WHERE priority <> 0'
        )
    finally:
        await connection.close()
    async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema) as factory:
        q = await factory.queue("jobs")
        await q.push("plain")
        await q.push("high", priority=1)
        got = await q.pop_many(5, timeout=0)
        assert [m.payload for m in got] == ["high", "plain"]


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


async def _take_plan(schema: str, name: str, *args: Any) -> list[dict[str, Any]]:
    """The nodes of the take ``name`` as it runs (EXPLAIN ANALYZE, rolled back), both as a
    first execution plans it and as a prepared statement's generic plan would."""
    statement = queries(f'"{schema}"')[name]
    connection = await asyncpg.connect(POSTGRES_URL)
    nodes: list[dict[str, Any]] = []
    try:
        for mode in ("force_custom_plan", "force_generic_plan"):
            transaction = connection.transaction()
            await transaction.start()
            try:
                await connection.execute(f"SET LOCAL plan_cache_mode = {mode}")
                explained = await connection.fetchval(
                    "EXPLAIN (ANALYZE, FORMAT JSON) " + statement, *args
                )
            finally:
                await transaction.rollback()
            [root] = json.loads(explained) if isinstance(explained, str) else explained
            nodes += _nodes(root["Plan"])
    finally:
        await connection.close()
    return nodes


@pytest.mark.parametrize("mixed", [True, False], ids=["delayed-and-others", "ready-only"])
@pytest.mark.parametrize("analyzed", [True, False], ids=["analyzed", "no-statistics"])
@pytest.mark.parametrize("take", ["get", "reserve"])
async def test_a_queue_without_priorities_takes_from_its_usual_range(
    schema: str, take: str, analyzed: bool, mixed: bool
) -> None:
    """Thousands of ready and of delayed plain messages: the take reads one entry of
    messages_by_mature per message taken, probes the (empty) partial index once, and
    finds the rows it takes by primary key, never by reading the queue; also before the
    table has statistics (new, just upgraded, or autovacuum off), when a filter on
    priority estimated as selective made the planner sort the whole ready range."""
    async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema) as factory:
        q = await factory.queue("plain")
        for _ in range(4 if mixed else 3):
            await q.push_many(list(range(1000)))
            if mixed:
                await q.push_many(list(range(1000)), delay=3600)
        if mixed:
            await (await factory.queue("other")).push_many(list(range(2000)))
    if analyzed:
        connection = await asyncpg.connect(POSTGRES_URL)
        try:
            await connection.execute(f'ANALYZE "{schema}".messages')
        finally:
            await connection.close()
    args: tuple[Any, ...] = ("plain", 3) if take == "get" else ("plain", 3, 30.0)
    nodes = await _take_plan(schema, take, *args)
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"]
    scans = [n for n in nodes if n["Node Type"] in ("Index Scan", "Bitmap Index Scan")]
    by_mature = [n for n in scans if n["Index Name"] == "messages_by_mature"]
    assert [n["Actual Rows"] for n in by_mature if n["Actual Loops"]] == [3, 3]
    assert all(n["Node Type"] == "Index Scan" for n in by_mature)  # in order, no sort
    by_priority = [n for n in scans if n["Index Name"] == "messages_by_priority"]
    assert {n["Actual Rows"] for n in by_priority} == {0}
    assert sum(n["Actual Loops"] for n in by_priority) == 2  # hi, once per plan; lo never
    taken = [n for n in scans if n["Index Name"] == "messages_pkey"]
    assert sum(n["Actual Rows"] * n["Actual Loops"] for n in taken) == 6


async def test_a_priority_stays_through_a_put_back_and_an_idempotent_push(
    schema: str,
) -> None:
    """The general insert (a popped message put back, an id taken) and the idempotent one
    carry the priority; a batch of plain pushes beside them keeps 0."""
    async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema) as factory:
        q = await factory.queue("jobs")
        await q.push("plain")
        await q.push("mine", id="m-1", priority=3)
        await q.push_many(["a", "b"], ids=["m-2", "m-3"], priority=-2)
        # a popped message put back, as the queue does for a cancelled caller
        assert await q._store.insert(
            [Entry("back", b'J"back"', b"{}", 0.0, mature=0.0, priority=9)]
        )
        got = await q.pop_many(10, timeout=0)
        assert [(m.payload, m.priority) for m in got] == [
            ("back", 9),
            ("mine", 3),
            ("plain", 0),
            ("a", -2),
            ("b", -2),
        ]


async def test_the_walks_the_take_leaves_are_the_ones_readme_names(schema: str) -> None:
    """Delayed messages of a higher priority cost the take index entries only (mature is
    in the key: no row is read to skip them); ready negative-priority messages older than
    the plain ones it takes are read and skipped by the plain range, as many as there are."""
    async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema) as factory:
        q = await factory.queue("mixed")
        await q.push_many(list(range(300)), priority=-1)  # older, ready
        await q.push_many(list(range(500)), delay=3600, priority=5)  # above, not ready
        await q.push_many(list(range(200)), priority=0)
    nodes = await _take_plan(schema, "get", "mixed", 2)
    hi = [n for n in nodes if "priority > 0" in n.get("Index Cond", "")]
    assert hi and all(n["Actual Rows"] == 0 and not n.get("Rows Removed by Filter") for n in hi)
    plain = [n for n in nodes if "priority = 0" in n.get("Filter", "")]
    assert [(n["Actual Rows"], n["Rows Removed by Filter"]) for n in plain] == [(2, 300)] * 2
    lo = [n for n in nodes if "priority < 0" in n.get("Index Cond", "")]
    assert lo and not any(n["Actual Loops"] for n in lo)  # the batch was full: not run


async def test_priorities_with_durable_acks_off(schema: str) -> None:
    """reserve's relaxed commit sits on its update rather than on the take: it still
    reserves by priority, and the ok and ko that follow keep it."""
    async with aio_keuss.connect(
        "postgres", url=POSTGRES_URL, schema=schema, durable_acks=False
    ) as factory:
        q = await factory.queue("relaxed")
        await q.push("plain")
        await q.push("high", priority=1)
        first = await q.reserve(timeout=5)
        assert first is not None and (first.payload, first.priority) == ("high", 1)
        assert await q.ko(first)
        again = await q.reserve_many(5, timeout=5)
        assert [(m.payload, m.priority, m.tries) for m in again] == [
            ("high", 1, 1),
            ("plain", 0, 0),
        ]
        assert all([await q.ok(m) for m in again])
        assert await q.total_size() == 0
