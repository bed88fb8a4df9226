"""postgres with ``history=True``: consumed messages are kept, then expired after
``history_ttl`` by the clients' periodic, bounded delete."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from backends import POSTGRES_URL, new_token

import aio_keuss
from aio_keuss import State

pytestmark = pytest.mark.timeout(120)


async def _history_rows(schema: str) -> list[str]:
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        rows = await connection.fetch(f'SELECT id FROM "{schema}".history ORDER BY id')
    finally:
        await connection.close()
    return [r[0] for r in rows]


async def test_without_the_option_nothing_is_kept(schema: str) -> None:
    async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema) as factory:
        assert not factory.capabilities.history
        q = await factory.queue("q")
        await q.push(1)
        assert await q.pop(timeout=5) is not None
        with pytest.raises(aio_keuss.NotSupportedError):
            await q.history()
    assert await _history_rows(schema) == []


async def test_pop_ok_and_remove_are_kept_and_a_move_is_not(schema: str) -> None:
    options = {"url": POSTGRES_URL, "schema": schema, "history": True}
    async with aio_keuss.connect("postgres", **options) as factory:
        q = await factory.queue("q")
        popped, acked, removed, moved = await q.push_many(["p", "a", "r", "m"])
        got = await q.pop(timeout=5)
        assert got is not None and got.id == popped
        held = await q.reserve(timeout=5)
        assert held is not None and held.id == acked and await q.ok(held)
        assert await q.remove(removed)
        held = await q.reserve(timeout=5)
        assert held is not None and await q.move(held, "other") == moved
        page = await q.history()
        assert [v.message.id for v in page.items] == [popped, acked, removed]
        assert {v.state for v in page.items} == {State.PROCESSED}
    assert await _history_rows(schema) == sorted([popped, acked, removed])


async def test_old_records_expire_in_bounded_batches(schema: str) -> None:
    options = {"url": POSTGRES_URL, "schema": schema, "history": True}
    async with aio_keuss.connect("postgres", **options) as factory:  # makes the schema
        q = await factory.queue("q")
        await q.push("recent")
        assert await q.pop(timeout=5) is not None
    connection = await asyncpg.connect(POSTGRES_URL)
    try:  # 25,000 records from long ago: more than one expiry batch
        await connection.execute(
            f'INSERT INTO "{schema}".history (queue, id, processed, tries, payload, headers) '
            "SELECT 'q', 'old' || g, $1, 0, 'J1'::bytea, '{}'::bytea "
            "FROM generate_series(1, 25000) g",
            time.time() - 86400,
        )
    finally:
        await connection.close()
    async with aio_keuss.connect("postgres", **options, history_ttl=3600):
        for _ in range(600):  # the expiry runs at open, then every few minutes at most
            if len(await _history_rows(schema)) == 1:
                break
            await asyncio.sleep(0.1)
    assert len(await _history_rows(schema)) == 1


async def test_a_role_lock_timeout_does_not_fail_an_open_waiting_to_install_the_trigger(
    schema: str,
) -> None:
    """The first open with ``history`` creates the schema's trigger, which waits for the
    transactions writing to the messages table. Under a role's or database's
    lock_timeout shorter than that wait, the open failed ("canceling statement due to lock
    timeout"), and so did every start while the writes went on: the trigger is created,
    like the schema's migrations, with no timeout for its transaction."""
    async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema) as factory:
        await (await factory.queue("q")).push("before")
    writer = await asyncpg.connect(POSTGRES_URL)
    try:
        async with writer.transaction():  # a write in progress, as another client's would be
            await writer.execute(f'LOCK TABLE "{schema}".messages IN ROW EXCLUSIVE MODE')
            opening = asyncio.ensure_future(
                aio_keuss.connect(
                    "postgres",
                    url=f"{POSTGRES_URL}?statement_timeout=100&lock_timeout=100",
                    schema=schema,
                    history=True,
                )
            )
            async with asyncio.timeout(30):
                while not await writer.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass",
                    f'"{schema}".messages',
                ):
                    assert not opening.done(), opening
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # the wait outlasts those timeouts
        factory = await asyncio.wait_for(opening, 30)
        try:
            q = await factory.queue("q")
            got = await q.pop(timeout=5)
            assert got is not None and got.payload == "before"
            assert [v.message.id for v in (await q.history()).items] == [got.id]
        finally:
            await factory.close()
    finally:
        await writer.close()


async def test_an_open_that_cannot_install_the_trigger_closes_its_pool(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role that may use the schema's tables but does not own them cannot create the
    trigger: the open fails, and the pool it had made for the migrations must not stay
    open (each retried connect left its connections to the server)."""
    async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema):
        pass  # the schema, made without the trigger
    role = f"akt_role_{new_token()}"
    admin = await asyncpg.connect(POSTGRES_URL)
    pools: list[asyncpg.Pool] = []
    create_pool = asyncpg.create_pool

    async def recording(*args: object, **kwargs: object) -> asyncpg.Pool:
        pool = await create_pool(*args, **kwargs)
        pools.append(pool)
        return pool

    monkeypatch.setattr(asyncpg, "create_pool", recording)
    try:
        await admin.execute(
            f'CREATE ROLE "{role}" LOGIN; GRANT USAGE ON SCHEMA "{schema}" TO "{role}";'
            f' GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}"'
            f' TO "{role}"'
        )
        host, port = urlsplit(POSTGRES_URL).hostname, urlsplit(POSTGRES_URL).port or 5432
        url = urlunsplit(urlsplit(POSTGRES_URL)._replace(netloc=f"{role}@{host}:{port}"))
        with pytest.raises(aio_keuss.BackendError, match=r"permission denied|owner"):
            await aio_keuss.connect("postgres", url=url, schema=schema, history=True)
        assert len(pools) == 1 and pools[0].is_closing()
    finally:
        for pool in pools:
            pool.terminate()
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.execute(f'DROP OWNED BY "{role}"; DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def test_the_history_keeps_the_priority_and_a_replay_pushes_at_it(schema: str) -> None:
    """A record kept the payload and headers but not the priority, so a replay pushed its
    copy at 0 (mongo-history keeps it; so does the memory backend's history)."""
    options = {"url": POSTGRES_URL, "schema": schema, "history": True}
    async with aio_keuss.connect("postgres", **options) as factory:
        q = await factory.queue("q")
        mid = await q.push("urgent", priority=5)
        got = await q.pop(timeout=5)
        assert got is not None and (got.id, got.priority) == (mid, 5)
        [record] = (await q.history()).items
        assert (record.message.id, record.message.priority) == (mid, 5)
        found = await q.find(mid)
        assert found is not None and found.message.priority == 5
        [copy] = await q.replay([mid])
        again = await q.pop(timeout=5)
        assert again is not None and (again.id, again.priority) == (copy, 5)
