"""The PostgreSQL result store (``PostgresResults``), through a real backend's
``result_store()``: one row of the schema's ``results`` table per (queue, id), put in one
upsert, read in one SELECT, expiring on the server's clock, reclaimed in bounded batches.
Against the server of AK_POSTGRES_URL, each test in its own schema, dropped afterwards.

What a queue does with results (``push_and_wait`` and the rest) is the conformance suite's.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from backends import POSTGRES_URL

import aio_keuss
from aio_keuss.postgres.results import PostgresResults
from aio_keuss.postgres.sql import migrations

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.timeout(120)

BACKENDS = ["postgres", "bucket-postgres"]

HANG_GUARD = 60.0
"""Seconds a wait for something that must happen eventually may take before the test fails
(a guard against hanging, not a bound on how long it should take)."""


Opened = tuple[aio_keuss.Factory, PostgresResults]


@pytest.fixture
async def open_store(schema: str) -> AsyncIterator[Callable[..., Awaitable[Opened]]]:
    """A factory of the given backend on the test's schema, and its backend's result
    store, opened; both closed after the test."""
    opened: list[Opened] = []

    async def _open(backend: str = "postgres", **options: Any) -> Opened:
        factory = await aio_keuss.connect(backend, url=POSTGRES_URL, schema=schema, **options)
        store = factory.backend.result_store()
        assert isinstance(store, PostgresResults)
        await store.open()
        opened.append((factory, store))
        return factory, store

    yield _open
    for factory, store in opened:
        await store.close()
        await factory.close()


async def _sql(query: str, *args: Any) -> Any:
    """One value read on a connection of the test's own (not the backend's)."""
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        return await connection.fetchval(query, *args)
    finally:
        await connection.close()


async def _rows(schema: str) -> int:
    return int(await _sql(f'SELECT count(*) FROM "{schema}".results'))


async def _eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` until it holds; fail only past the hang guard."""
    async with asyncio.timeout(HANG_GUARD):
        while True:
            if await check():
                return
            await asyncio.sleep(0.02)


def _count_round_trips(factory: aio_keuss.Factory, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements the backend sends from now on (every one passes through ``_run``,
    the connection's choke point), recorded by their method."""
    backend: Any = factory.backend
    real = backend._run
    sent: list[str] = []

    def counting(method: str, query: str, args: tuple[Any, ...]) -> Any:
        sent.append(method)
        return real(method, query, args)

    monkeypatch.setattr(backend, "_run", counting)
    return sent


@pytest.mark.parametrize("backend", BACKENDS)
async def test_every_postgres_backend_keeps_results(
    open_store: Callable[..., Awaitable[Opened]], backend: str
) -> None:
    factory, store = await open_store(backend)
    assert type(factory.backend).capabilities.results
    assert factory.backend.capabilities.results
    await store.put("jobs", [("a", b"\x00body\xff")], 60)
    assert await store.get("jobs", ["a", "missing"]) == [b"\x00body\xff", None]


async def test_history_keeps_the_capability(
    open_store: Callable[..., Awaitable[Opened]],
) -> None:
    """``history=True`` replaces the instance's capabilities: results stay among them."""
    factory, _ = await open_store("postgres", history=True)
    assert factory.backend.capabilities.results and factory.backend.capabilities.history


async def test_many_ids_are_one_round_trip_each_way(
    open_store: Callable[..., Awaitable[Opened]], monkeypatch: pytest.MonkeyPatch
) -> None:
    factory, store = await open_store()
    store.cleanup_period = math.inf  # a first put's cleanup is not the put's: none here
    sent = _count_round_trips(factory, monkeypatch)
    results = [(f"id-{n}", f"body {n}".encode()) for n in range(500)]
    await store.put("jobs", results, 60)
    assert sent == ["execute"]
    wanted = ["id-499", "nope", "id-0", "id-0", *(f"id-{n}" for n in range(1, 400))]
    got = await store.get("jobs", wanted)
    assert sent == ["execute", "fetch"]
    expected = dict(results)
    assert got == [expected.get(message_id) for message_id in wanted]
    assert got[1] is None and got[2] == got[3] == b"body 0"


async def test_nothing_to_put_or_get_sends_nothing(
    open_store: Callable[..., Awaitable[Opened]], monkeypatch: pytest.MonkeyPatch
) -> None:
    factory, store = await open_store()
    sent = _count_round_trips(factory, monkeypatch)
    await store.put("jobs", [], 60)
    assert await store.get("jobs", []) == []
    assert sent == []


async def test_a_result_put_again_replaces_the_first_and_its_expiry(
    open_store: Callable[..., Awaitable[Opened]], schema: str
) -> None:
    _, store = await open_store()
    await store.put("jobs", [("a", b"first"), ("b", b"kept")], 0.05)
    await store.put("jobs", [("a", b"second")], 3600)
    # past the first expiry, by the server's clock: the second one's is what counts
    first_expired = f"SELECT expires < clock_timestamp() FROM \"{schema}\".results WHERE id = 'b'"

    async def b_expired() -> bool:
        return bool(await _sql(first_expired))

    await _eventually(b_expired)
    assert await store.get("jobs", ["a", "b"]) == [b"second", None]


async def test_an_id_given_twice_in_one_put_keeps_its_last_body(
    open_store: Callable[..., Awaitable[Opened]], schema: str
) -> None:
    """One upsert cannot write a row twice (PostgreSQL refuses the statement): the store
    sends each id once, with its last body."""
    _, store = await open_store()
    await store.put("jobs", [("a", b"1"), ("b", b"only"), ("a", b"2")], 60)
    assert await store.get("jobs", ["a", "b"]) == [b"2", b"only"]
    assert await _rows(schema) == 2


async def test_a_result_expires(
    open_store: Callable[..., Awaitable[Opened]],
) -> None:
    _, store = await open_store()
    await store.put("jobs", [("short", b"x")], 0.05)
    await store.put("jobs", [("long", b"y")], 3600)

    async def short_gone() -> bool:
        return await store.get("jobs", ["short"]) == [None]

    await _eventually(short_gone)
    assert await store.get("jobs", ["long"]) == [b"y"]


async def test_queues_and_ids_are_kept_apart(
    open_store: Callable[..., Awaitable[Opened]],
) -> None:
    """The key is the pair (queue, id), not a string joining them: no two pairs collide,
    whatever characters either holds."""
    _, store = await open_store()
    pairs = [
        ("q1", "a:b"),
        ("q1:a", "b"),
        ("q1a", ":b"),
        ("q1", "a"),
        ("q2", "a"),
        ("", "q1a"),
        ("q1a", ""),
        ("ключ", "ид 🙂"),
        ("q\x01", "x"),
    ]
    for n, (queue, message_id) in enumerate(pairs):
        await store.put(queue, [(message_id, str(n).encode())], 60)
    for n, (queue, message_id) in enumerate(pairs):
        assert await store.get(queue, [message_id]) == [str(n).encode()], (queue, message_id)
    assert await store.get("q3", ["a"]) == [None]


async def test_results_are_shared_by_the_backends_of_a_schema_and_kept_in_it(
    open_store: Callable[..., Awaitable[Opened]], schema: str
) -> None:
    """Another factory (another process, as far as the server knows), of the other
    backend, reads what the first put; the rows are in the test's own schema."""
    _, writer = await open_store("postgres")
    _, reader = await open_store("bucket-postgres")
    await writer.put("jobs", [("a", b"done")], 60)
    assert await reader.get("jobs", ["a"]) == [b"done"]
    assert await _sql(f"SELECT body FROM \"{schema}\".results WHERE queue = 'jobs'") == b"done"


async def test_a_cleanup_deletes_a_bounded_batch_of_expired_results(
    open_store: Callable[..., Awaitable[Opened]], schema: str
) -> None:
    _, store = await open_store()
    store.cleanup_period = math.inf  # no cleanup in the background: counted here
    store.cleanup_batch = 10
    await store.put("jobs", [(f"old-{n}", b"x") for n in range(25)], 0.05)
    await store.put("jobs", [("live", b"y")], 3600)
    all_expired = f"SELECT bool_and(expires < now()) FROM \"{schema}\".results WHERE id <> 'live'"

    async def expired() -> bool:
        return bool(await _sql(all_expired))

    await _eventually(expired)
    assert await _rows(schema) == 26  # expired, not deleted: reads skip them
    assert [await store.clean_up_once() for _ in range(4)] == [10, 10, 5, 0]
    assert await _rows(schema) == 1
    assert await store.get("jobs", ["live"]) == [b"y"]


async def test_a_put_starts_a_cleanup_in_the_background(
    open_store: Callable[..., Awaitable[Opened]], schema: str
) -> None:
    """A store's first put starts a cleanup (expired rows another process left, here one
    that never cleaned), and returns without waiting for it; the cleanup goes on past a
    full batch until every expired row is gone. The puts after it, within the period,
    start none."""
    _, left_behind = await open_store()
    left_behind.cleanup_period = math.inf
    await left_behind.put("old", [(f"{n}", b"x") for n in range(30)], 0.05)

    async def old_gone() -> bool:
        return await left_behind.get("old", ["0", "29"]) == [None, None]

    await _eventually(old_gone)
    assert await _rows(schema) == 30
    _, store = await open_store()
    store.cleanup_batch = 7
    await store.put("new", [("a", b"y")], 3600)
    cleanup = store._cleanup
    assert cleanup is not None

    async def one_left() -> bool:
        return await _rows(schema) == 1

    await _eventually(one_left)
    assert await store.get("new", ["a"]) == [b"y"]
    await store.put("new", [("b", b"z")], 3600)
    assert store._cleanup is cleanup and cleanup.done()


async def test_a_failed_cleanup_is_logged_not_raised(
    open_store: Callable[..., Awaitable[Opened]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, store = await open_store()
    done = asyncio.Event()

    async def failing() -> int:
        done.set()
        raise aio_keuss.KeussConnectionError("the server is away")

    monkeypatch.setattr(store, "clean_up_once", failing)
    store.cleanup_period = 0.0
    await store.put("jobs", [("a", b"x")], 60)
    async with asyncio.timeout(HANG_GUARD):
        await done.wait()

    async def logged() -> bool:
        return "results cleanup failed" in caplog.text

    await _eventually(logged)
    assert await store.get("jobs", ["a"]) == [b"x"]


async def test_driver_errors_leave_as_the_librarys(
    open_store: Callable[..., Awaitable[Opened]], schema: str
) -> None:
    """The store talks to the server only through the connection, which translates."""
    _, store = await open_store()
    await _sql(f'DROP TABLE "{schema}".results')
    with pytest.raises(aio_keuss.BackendError):
        await store.put("jobs", [("a", b"x")], 60)
    with pytest.raises(aio_keuss.BackendError):
        await store.get("jobs", ["a"])


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


async def test_a_schema_of_the_release_before_results_is_upgraded_in_place(
    open_store: Callable[..., Awaitable[Opened]], schema: str
) -> None:
    """A schema the release before step 13 left (its messages kept) gains the table."""
    before = max(v for v, _ in migrations() if v < 13)
    await _migrated_to(schema, before)
    assert await _sql(f"SELECT to_regclass('\"{schema}\".results')") is None
    factory, store = await open_store()
    q = await factory.queue("jobs")
    await q.push("kept through the upgrade")
    await store.put("jobs", [("a", b"x")], 60)
    assert await store.get("jobs", ["a"]) == [b"x"]
    found = await _sql(
        f'SELECT array_agg(version ORDER BY version) FROM "{schema}".schema_versions'
    )
    assert found == [v for v, _ in migrations()]
    index = await _sql(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = $2",
        schema,
        "results_by_expires",
    )
    assert index is not None and "(expires)" in index


async def test_concurrent_puts_of_the_same_ids_in_any_order_never_deadlock(
    open_store: Callable[..., Awaitable[Opened]],
) -> None:
    """Two processes putting the same ids (a message delivered twice, ok-ed by both in
    batches of their own) lock the rows in one order, whatever the order they were given:
    in opposite orders, each waited for a row the other held (40P01, deadlock detected)."""
    _, first = await open_store()
    _, second = await open_store()
    ids = [f"id-{n:03}" for n in range(200)]
    for round_ in range(10):
        body = str(round_).encode()
        await asyncio.gather(
            first.put("jobs", [(i, body) for i in ids], 60),
            second.put("jobs", [(i, body) for i in reversed(ids)], 60),
        )
    assert await first.get("jobs", ids) == [b"9"] * len(ids)
