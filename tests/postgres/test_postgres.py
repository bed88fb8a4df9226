"""PostgreSQL-specific behaviour: several OS processes, a server restart, LISTEN/NOTIFY
wake-ups across processes, schema creation races, and the single-statement deadletter move.

Each test works in its own schema, dropped afterwards. Runs against the server of
``AK_POSTGRES_URL`` (default: 127.0.0.1:5432, database ``test``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from backends import POSTGRES_URL, new_token
from black_hole import BlackHole, assert_a_silent_drop_is_survived
from own_servers import OwnPostgres

import aio_keuss
from aio_keuss import KoResult, keepalive
from aio_keuss.postgres import connection as pg_connection
from aio_keuss.postgres import signal as pg_signal

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]

Open = Callable[..., Awaitable[aio_keuss.Factory]]


@pytest.fixture
async def open_factory(schema: str) -> AsyncIterator[Open]:
    """Factories on the test's schema, closed after the test."""
    opened: list[aio_keuss.Factory] = []

    async def _open(**options: Any) -> aio_keuss.Factory:
        factory = await aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema, **options)
        opened.append(factory)
        return factory

    yield _open
    for factory in opened:
        with contextlib.suppress(aio_keuss.KeussError):
            await factory.close()


# a worker in another OS process ---------------------------------------------------------

_WORKER = r"""
import asyncio, json, sys, time
import aio_keuss

async def main(url, schema, mode, queue, quiet):
    async with aio_keuss.connect("postgres", url=url, schema=schema, poll_interval=30.0) as f:
        q = await f.queue(queue)
        if mode == "wake":
            print("ready", flush=True)
            message = await q.pop(timeout=20)
            print(json.dumps({"latency": time.time() - message.payload}), flush=True)
            return
        ids = []
        print("ready", flush=True)
        while True:
            if mode == "pop":
                batch = await q.pop_many(50, timeout=quiet)
            else:
                batch = await q.reserve_many(50, timeout=quiet)
                oks = await asyncio.gather(*(q.ok(m) for m in batch))
                assert all(oks), "an ok failed"
            if not batch:
                break
            ids.extend(m.id for m in batch)
        print(json.dumps({"ids": ids}), flush=True)

asyncio.run(main(*sys.argv[1:5], float(sys.argv[5])))
"""


async def _spawn(schema: str, mode: str, queue: str, quiet: float = 1.0) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _WORKER,
        POSTGRES_URL,
        schema,
        mode,
        queue,
        str(quiet),
        stdout=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    assert line.strip() == b"ready", line
    return process


async def _result(process: Any) -> dict[str, Any]:
    out, _ = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


# tests ----------------------------------------------------------------------------------


@pytest.mark.slow
async def test_two_processes_share_10000_messages_exactly_once(
    open_factory: Open, schema: str
) -> None:
    factory = await open_factory()
    q = await factory.queue("shared")
    pushed = set(await q.push_many(list(range(10_000))))
    reserving = await _spawn(schema, "reserve", "shared")
    popping = await _spawn(schema, "pop", "shared")
    one, two = await _result(reserving), await _result(popping)
    got_one, got_two = one["ids"], two["ids"]
    assert len(got_one) + len(got_two) == 10_000
    assert set(got_one) | set(got_two) == pushed
    assert not set(got_one) & set(got_two)
    assert got_one and got_two  # both really competed
    assert await q.total_size() == 0


async def test_consumer_in_another_process_wakes_on_push(open_factory: Open, schema: str) -> None:
    factory = await open_factory(poll_interval=30.0)
    q = await factory.queue("wake")
    waiter = await _spawn(schema, "wake", "wake")
    await asyncio.sleep(0.3)  # the worker is waiting in pop
    await q.push(time.time())
    result = await _result(waiter)
    # poll_interval is 30 s: only the NOTIFY explains a fast wake (typically a few ms).
    assert result["latency"] < 15.0


async def test_stats_and_list_from_a_second_factory(open_factory: Open) -> None:
    one = await open_factory()
    q = await one.queue("counted", reserve_delay=7.0)
    await q.push_many(["a", "b", "c"])
    message = await q.reserve()
    assert message is not None and await q.ok(message)
    await q.pop()
    await one.stats_store.flush()
    two = await open_factory()
    listed = await two.list()
    assert listed["counted"]["reserve_delay"] == 7.0
    stats = await (await two.queue("counted")).stats()
    assert stats["put"] == 3 and stats["reserve"] == 1 and stats["commit"] == 1
    assert stats["get"] == 1
    await two.stats_store.reset("counted")
    assert (await q.stats())["put"] == 0


async def test_concurrent_schema_creation(open_factory: Open) -> None:
    factories = await asyncio.gather(*(open_factory() for _ in range(6)))
    queues = [await f.queue("race") for f in factories]
    await queues[0].push("x")
    assert await queues[-1].size() == 1


async def test_idempotent_push_refused_after_consumption(open_factory: Open) -> None:
    factory = await open_factory(dedup_window=60.0)
    q = await factory.queue("dedup")
    await q.push("first", id="order-1")
    await q.push("again", id="order-1")
    assert await q.total_size() == 1
    message = await q.pop()
    assert message is not None and message.payload == "first"
    await q.push("after", id="order-1")  # consumed, but within the window
    assert await q.total_size() == 0
    # duplicates inside one batch: the first wins
    await q.push_many(["x", "y"], ids=["twin", "twin"])
    assert [m.payload for m in await q.pop_many(10)] == ["x"]


async def test_dedup_window_expiry_and_purge(open_factory: Open, schema: str) -> None:
    factory = await open_factory(dedup_window=0.2)
    q = await factory.queue("dedup")
    await q.push_many(list(range(5)), ids=[f"k{i}" for i in range(5)])
    assert len(await q.pop_many(10)) == 5
    await asyncio.sleep(0.3)
    await q.push("back", id="k0")  # window over: accepted; the expired rows get purged
    assert await q.total_size() == 1
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        left = await connection.fetchval(f'SELECT count(*) FROM "{schema}".dedup')
    finally:
        await connection.close()
    assert left == 1


async def test_deadletter_is_one_atomic_move(open_factory: Open, schema: str) -> None:
    factory = await open_factory(deadletter={"max_ko": 1, "queue": "dead"})
    q = await factory.queue("work")
    dead = await factory.queue("dead")
    await dead.push("squatter", id="m1")  # the same id is already in the deadletter queue
    await q.push({"n": 1}, id="m1", headers={"k": "v"})
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        seq = await connection.fetchval(
            f"""SELECT seq FROM "{schema}".messages WHERE queue = 'work' AND id = 'm1'"""
        )
        for expected in (KoResult.ROLLED_BACK, KoResult.DEADLETTERED):
            message = await q.reserve(timeout=5)
            assert message is not None
            assert await q.ko(message) == expected
        row = await connection.fetchrow(
            f'SELECT queue, id, tries, reserved FROM "{schema}".messages WHERE seq = $1', seq
        )
    finally:
        await connection.close()
    # the very same row changed queue (one UPDATE), renamed since "m1" was taken there
    assert dict(row) == {"queue": "dead", "id": "m1.dl2", "tries": 0, "reserved": False}
    assert await q.total_size() == 0
    moved = {m.id: m for m in await dead.pop_many(10)}
    assert set(moved) == {"m1", "m1.dl2"}
    headers = moved["m1.dl2"].headers
    assert headers["k"] == "v" and headers["x-dl-from-queue"] == "work"
    assert headers["x-dl-tries"] == 2 and headers["x-dl-t"].endswith("+00:00")
    assert moved["m1.dl2"].payload == {"n": 1}


async def test_concurrent_moves_of_one_id_into_one_queue_rename(open_factory: Open) -> None:
    # Two queues deadletter (and move) messages of the same ids at once, from two factories:
    # each statement's renaming cannot see the name the other just took and has not yet
    # committed. A ko or move must still rename (README), not fail on the key.
    fa = await open_factory(deadletter={"max_ko": 0})
    fb = await open_factory(deadletter={"max_ko": 0})
    qa, qb = await fa.queue("qa"), await fb.queue("qb")
    n, rounds = 200, 6
    for r in range(rounds):
        ids = [f"order-{r}-{i}" for i in range(n)]
        await qa.push_many(list(range(n)), ids=ids)
        await qb.push_many(list(range(n)), ids=ids)
        ma, mb = await qa.reserve_many(n), await qb.reserve_many(n)
        calls: list[Awaitable[object]]
        if r % 2:
            calls = [qa.move(m, "target") for m in ma] + [qb.move(m, "target") for m in mb]
        else:
            calls = [qa.ko(m) for m in ma] + [qb.ko(m) for m in mb]
        outcome = await asyncio.gather(*calls, return_exceptions=True)
        errors = [o for o in outcome if isinstance(o, BaseException)]
        assert not errors, f"round {r}: {len(errors)} failed, e.g. {errors[0]!r}"
        assert all(outcome)
    dlq, target = await fa.queue("__deadletter__"), await fa.queue("target")
    assert (await dlq.sizes()).total == 2 * n * (rounds // 2)
    assert (await target.sizes()).total == 2 * n * (rounds // 2)
    assert (await qa.sizes()).total == (await qb.sizes()).total == 0


async def test_an_insert_past_the_statement_budget_goes_in_as_several_in_order(
    open_factory: Open, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL drops the connection on a protocol message of 1 GB or more, so a batch of
    large messages each fine alone (60 concurrent 20 MB pushes failed every caller with
    KeussConnectionError) goes in as several statements. Here with a 1 kB budget: in order,
    and a repeated id in a later statement still refused."""
    from aio_keuss.postgres import store as postgres_store

    monkeypatch.setattr(postgres_store, "STATEMENT_BYTES", 1000)
    factory = await open_factory()
    q = await factory.queue("split")
    ids = [f"m{i}" for i in range(9)] + ["m0"]
    assert await q.push_many(["x" * 300] * 10, ids=ids) == ids
    got = await q.pop_many(20, timeout=2)
    assert [m.id for m in got] == ids[:9]
    assert await q.push_many(["y" * 300] * 6) and await q.size() == 6


async def test_concurrent_pushes_past_the_budget_fail_only_the_callers_not_stored(
    open_factory: Open, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrent pushes coalesced past one statement's budget were split by the store into
    several statements; when a later one failed, every caller got the error, those already
    stored included, so their retry stored them twice. The queue now splits such a batch
    between callers, each call on its own. The second statement is made to fail."""
    from aio_keuss.postgres import store as postgres_store

    monkeypatch.setattr(postgres_store, "STATEMENT_BYTES", 1000)
    factory = await open_factory()
    q = await factory.queue("split")
    store = q._store  # type: ignore[attr-defined]
    real_insert = store._insert
    calls = 0

    async def second_fails(entries: Any) -> list[bool]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise aio_keuss.KeussConnectionError("the connection broke")
        result: list[bool] = await real_insert(entries)
        return result

    monkeypatch.setattr(store, "_insert", second_fails)
    pushes = [q.push("x" * 300, id=f"m{i}") for i in range(4)]
    results = await asyncio.gather(*pushes, return_exceptions=True)
    stored = [r for r in results if isinstance(r, str)]
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(stored) == 3 and len(failed) == 1, results  # three fit one statement
    assert isinstance(failed[0], aio_keuss.KeussConnectionError)
    got = await q.pop_many(10, timeout=2)
    assert sorted(m.id for m in got) == sorted(stored)  # every reported success is in


async def test_concurrent_moves_with_new_payloads_keep_to_the_budget(
    open_factory: Open, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Moves carrying new payloads were batched by count only: a thousand concurrent moves
    of 2 MB each made one 2 GB statement, which PostgreSQL refuses by dropping the
    connection. They are now split at the statement budget (here 1 kB) between callers."""
    from aio_keuss.postgres import store as postgres_store

    monkeypatch.setattr(postgres_store, "STATEMENT_BYTES", 1000)
    factory = await open_factory()
    q = await factory.queue("from")
    await factory.queue("to")
    await q.push_many(list(range(8)))
    held = await q.reserve_many(8, timeout=2)
    store = q._store  # type: ignore[attr-defined]
    real_move = store.move
    batches: list[int] = []

    async def counted(moves: Any) -> Any:
        batches.append(len(moves))
        return await real_move(moves)

    monkeypatch.setattr(store, "move", counted)
    moved = await asyncio.gather(*(q.move(m, "to", payload="p" * 300) for m in held))
    assert None not in moved and sum(batches) == 8
    assert max(batches) <= 3  # three 300-byte payloads fit one statement's budget
    got = await (await factory.queue("to")).pop_many(10, timeout=2)
    assert [m.payload for m in got] == ["p" * 300] * 8


async def test_bad_options_and_unreachable_server() -> None:
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect("postgres", url=POSTGRES_URL, schema='bad"; drop')
    for backend in ("postgres", "bucket-postgres"):  # the server reserves pg_ for itself
        with pytest.raises(aio_keuss.ConfigError, match="pg_"):
            await aio_keuss.connect(backend, url=POSTGRES_URL, schema="pg_jobs")
    with pytest.raises(aio_keuss.KeussConnectionError):
        await aio_keuss.connect("postgres", url="postgresql://postgres@127.0.0.1:1/test")


def _with_query(url: str, query: str, *, host: bool = True) -> str:
    """``url`` with ``query``; with ``host`` False, its host and port go in the query."""
    parts = urlsplit(url)
    if host:
        return urlunsplit(parts._replace(query=query))
    netloc = parts.netloc.rpartition("@")
    where = f"host={parts.hostname}&port={parts.port or 5432}"
    return urlunsplit(
        parts._replace(netloc=netloc[0] + netloc[1], query=f"{where}&{query}" if query else where)
    )


@pytest.mark.parametrize(
    ("query", "host", "said"),
    [
        ("port=abc", False, "port"),  # asyncpg: a bare ValueError at connect
        ("port=0", False, "port"),
        ("port=abc", True, "port"),  # asyncpg ignores it when the URL names a host
        ("port=5433", True, "port"),  # ... even a good one: it connected to 5432
        ("host=elsewhere", True, "host"),
        ("dbname=other", True, "dbname"),  # the path names the database already
        ("user=other", True, "user"),
        ("bogus", True, "query"),  # asyncpg: a bare ValueError "bad query field"
        ("jit=on", True, "jit"),  # a setting of ours: silently overridden before
        ("default_transaction_isolation=serializable", True, "default_transaction_isolation"),
    ],
)
def test_a_bad_url_query_is_a_config_error_before_connecting(
    query: str, host: bool, said: str
) -> None:
    """Refused when the options are made, before any connection, its password not shown."""
    url = _with_query(POSTGRES_URL, query, host=host).replace("@", ":s3cret@", 1)
    with pytest.raises(aio_keuss.ConfigError, match=said) as caught:
        pg_connection.PostgresConnectionOptions(url=url)
    assert "s3cret" not in str(caught.value)
    in_query = _with_query(POSTGRES_URL, f"password=s3cret&{query}", host=host)
    with pytest.raises(aio_keuss.ConfigError, match=said) as caught:
        pg_connection.PostgresConnectionOptions(url=in_query)
    assert "s3cret" not in str(caught.value)


def test_url_queries_asyncpg_takes_are_accepted() -> None:
    for url in [
        "postgresql:///test?host=/var/run/postgresql",
        "postgresql://u@/test?host=db.example&port=5433",
        "postgres://db.example?dbname=test&user=u&password=p",
        "postgresql://u:p@h1:5432,h2:5433/db?sslmode=require&target_session_attrs=read-write",
        "postgresql://h/db?application_name=x&options=-c%20search_path%3Dx&app.custom=1",
        "postgresql://h/db?passfile=/tmp/pgpass&sslrootcert=/tmp/ca.pem&service=s",
    ]:
        assert pg_connection.check_postgres_url(url) == url


async def test_url_query_parameters_asyncpg_takes_are_kept(schema: str) -> None:
    """Host and port in the query (no host in the URL), and what asyncpg passes on as
    server settings: application_name, options."""
    url = _with_query(
        POSTGRES_URL, "application_name=akt-url&options=-c%20work_mem%3D8MB", host=False
    )
    async with aio_keuss.connect("postgres", url=url, schema=schema) as factory:
        q = await factory.queue("jobs")
        await q.push(1)
        assert (await q.pop(timeout=5)) is not None


async def test_a_setting_the_server_refuses_is_a_config_error(schema: str) -> None:
    """asyncpg sends the URL's query parameters it does not know as server settings (its
    docs, ``connect``): a typo is refused by the server at connect, a ConfigError."""
    for query, said in (("bogus=1", "bogus"), ("work_mem=lots", "work_mem")):
        url = _with_query(POSTGRES_URL, query).replace("@", ":s3cret@", 1)
        with pytest.raises(aio_keuss.ConfigError, match=said) as caught:
            await aio_keuss.connect("postgres", url=url, schema=schema)
        assert "s3cret" not in str(caught.value)


async def test_user_pool_is_used_and_left_open(schema: str) -> None:
    pool = await asyncpg.create_pool(POSTGRES_URL, min_size=1, max_size=3)
    try:
        async with aio_keuss.connect("postgres", pool=pool, schema=schema) as factory:
            q = await factory.queue("p")
            await q.push("via pool")
            assert (await q.pop()).payload == "via pool"  # type: ignore[union-attr]
            busy = [await pool.acquire() for _ in range(pool.get_size() - 1)]
            # The pool's other connections serve the user as before: our settings are
            # SET only on what the factory holds, and reset when it gives them back.
            assert {await c.fetchval("SHOW plan_cache_mode") for c in busy} == {"auto"}
            for c in busy:
                await pool.release(c)
        assert await pool.fetchval("SELECT 1") == 1
        held = [await pool.acquire() for _ in range(pool.get_size())]
        assert {await c.fetchval("SHOW plan_cache_mode") for c in held} == {"auto"}
        for c in held:
            await pool.release(c)
    finally:
        await pool.close()


@pytest.mark.slow
async def test_server_restart_loses_no_acknowledged_push() -> None:
    """A restart of a private server (never the shared one) under three pushers."""
    try:
        server = OwnPostgres()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    opened: list[aio_keuss.Factory] = []

    async def open_factory(**options: Any) -> aio_keuss.Factory:
        factory = await aio_keuss.connect("postgres", url=server.url, schema="restart", **options)
        opened.append(factory)
        return factory

    try:
        server.start()
        await _restart_under_pushers(server, open_factory)
    finally:
        for factory in opened:
            with contextlib.suppress(aio_keuss.KeussError):
                await factory.close()
        server.cleanup()


async def _restart_under_pushers(server: OwnPostgres, open_factory: Open) -> None:
    producer = await open_factory(poll_interval=30.0)
    consumer = await open_factory(poll_interval=30.0)
    qp, qc = await producer.queue("durable"), await consumer.queue("durable")
    acked: list[int] = []
    errors = 0
    stop = asyncio.Event()

    async def push_forever(worker: int) -> None:
        nonlocal errors
        i = 0
        while not stop.is_set():
            payload = worker * 1_000_000 + i
            i += 1  # a failed push may still have committed: never reuse its payload
            try:
                await qp.push(payload)
            except aio_keuss.KeussConnectionError:
                errors += 1
                await asyncio.sleep(0.05)
                continue
            acked.append(payload)

    pushers = [asyncio.create_task(push_forever(w)) for w in range(3)]
    await asyncio.sleep(0.5)
    before = len(acked)
    await asyncio.to_thread(server.stop)
    await asyncio.to_thread(server.start)
    deadline = time.monotonic() + 30
    while len(acked) < before + 200 and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)  # the pushers recover by themselves
    stop.set()
    await asyncio.gather(*pushers)
    assert len(acked) >= before + 200, "pushes did not recover after the restart"

    # the other factory's listener reconnected: a push wakes it without the 30 s poll
    wp, wc = await producer.queue("after-restart"), await consumer.queue("after-restart")
    await asyncio.sleep(1.0)
    while True:
        try:
            await wc.size()  # the consumer's pool may still hold dead connections
            await wp.size()
            break
        except aio_keuss.KeussConnectionError:
            await asyncio.sleep(0.1)
    waiter = asyncio.create_task(wc.pop(timeout=20))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    await wp.push("woken")
    got = await asyncio.wait_for(waiter, 25)
    assert got is not None and got.payload == "woken"
    assert time.monotonic() - started < 15.0  # woken, not polled: the poll interval is 30 s

    consumed: list[int] = []
    while True:
        try:
            batch = await qc.pop_many(1000, timeout=0)
        except aio_keuss.KeussConnectionError:
            continue
        if not batch:
            break
        consumed.extend(m.payload for m in batch)
    assert set(acked) <= set(consumed)  # nothing acknowledged was lost
    assert len(consumed) == len(set(consumed))
    assert errors > 0  # the restart was really felt


async def test_relaxed_acks_behave_the_same(open_factory: Open) -> None:
    factory = await open_factory(durable_acks=False)
    q = await factory.queue("relaxed")
    await q.push_many(["a", "b"])
    first = await q.reserve()
    assert first is not None and await q.ko(first) == KoResult.ROLLED_BACK
    again = await q.reserve_many(2)
    assert sorted(m.payload for m in again) == ["a", "b"]
    assert await q.extend_many(again, 60) == [True, True]
    assert all([await q.ok(m) for m in again])
    assert await q.total_size() == 0
    with pytest.raises(aio_keuss.ConfigError):
        await open_factory(durable_acks="no")


# statements take exactly what they return, whatever plan is chosen ---------------------

# Planner settings that steer the join between the locking pick and the DELETE / UPDATE
# into each shape; "fresh statistics" is the default plan right after ANALYZE of an idle
# queue, which is what autovacuum does by itself.
_PLANS: dict[str, dict[str, str]] = {
    "fresh-statistics": {},
    "nested-loop": {"enable_hashjoin": "off", "enable_mergejoin": "off"},
    "hash-join": {"enable_nestloop": "off", "enable_mergejoin": "off"},
    "merge-join": {"enable_nestloop": "off", "enable_hashjoin": "off"},
    "no-index": {"enable_indexscan": "off", "enable_bitmapscan": "off"},
    "no-material": {"enable_material": "off", "enable_hashjoin": "off"},
}


@pytest.mark.parametrize("plan", sorted(_PLANS))
@pytest.mark.parametrize("backend", ["postgres", "bucket-postgres"])
async def test_pop_and_reserve_take_exactly_what_they_return(
    schema: str, plan: str, backend: str
) -> None:
    pool = await asyncpg.create_pool(
        POSTGRES_URL, min_size=1, max_size=4, server_settings=_PLANS[plan]
    )
    extra: dict[str, Any] = {}
    if backend == "bucket-postgres":  # one small bucket per push_many chunk: many to lease
        extra = {"bucket_max_wait": 0.02, "state_flush_period": 0.05, "bucket_max_size": 5}
    try:
        factory = await aio_keuss.connect(backend, pool=pool, schema=schema, **extra)
        try:
            q = await factory.queue("exact")
            await pool.execute(f'ANALYZE "{schema}".messages' if backend == "postgres" else
                               f'ANALYZE "{schema}".buckets')  # fmt: skip
            await q.push_many(list(range(50)))
            popped = await q.pop()
            assert popped is not None
            assert await q.total_size() == 49
            taken = await q.pop_many(5)
            assert len(taken) == 5 and await q.total_size() == 44
            reserved = await q.reserve_many(3)
            assert len(reserved) == 3
            sizes = await q.sizes()
            assert (sizes.size, sizes.reserved, sizes.total) == (41, 3, 44)
            rest = await q.pop_many(100, timeout=0)
            seen = [popped.payload, *(m.payload for m in taken + reserved + rest)]
            assert sorted(seen) == list(range(50))  # every message accounted for, once
        finally:
            await factory.close()
    finally:
        await pool.close()


# schema migrations ----------------------------------------------------------------------

# The schema exactly as the first release created it (no versions table): upgraded in place.
RELEASE_0_1_DDL = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.messages (
    queue    text NOT NULL,
    id       text NOT NULL,
    seq      bigint GENERATED ALWAYS AS IDENTITY,
    mature   double precision NOT NULL,
    tries    integer NOT NULL DEFAULT 0,
    reserved boolean NOT NULL DEFAULT false,
    payload  bytea NOT NULL,
    headers  bytea NOT NULL,
    PRIMARY KEY (queue, id)
);
CREATE INDEX IF NOT EXISTS messages_by_mature ON {s}.messages (queue, mature, seq);
CREATE TABLE IF NOT EXISTS {s}.dedup (
    queue   text NOT NULL,
    id      text NOT NULL,
    expires double precision NOT NULL,
    PRIMARY KEY (queue, id)
);
CREATE TABLE IF NOT EXISTS {s}.stats (
    queue   text NOT NULL,
    counter text NOT NULL,
    value   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (queue, counter)
);
CREATE TABLE IF NOT EXISTS {s}.queues (
    queue   text PRIMARY KEY,
    options jsonb NOT NULL DEFAULT '{}',
    paused  boolean NOT NULL DEFAULT false
);
"""


# ... and the bucket table as bucket-postgres of that release created it on connect.
RELEASE_0_1_BUCKETS_DDL = """
DO $$ BEGIN
IF to_regclass('{s}.buckets') IS NULL THEN
CREATE TABLE {s}.buckets (
    queue     text NOT NULL,
    id        text NOT NULL,
    score     double precision NOT NULL,
    owner     text NOT NULL DEFAULT '',
    count     integer NOT NULL,
    remaining integer NOT NULL,
    blob      bytea NOT NULL,
    state     bytea NOT NULL,
    PRIMARY KEY (queue, id)
);
ALTER TABLE {s}.buckets ALTER COLUMN blob SET STORAGE EXTERNAL;
ALTER TABLE {s}.buckets ALTER COLUMN state SET STORAGE EXTERNAL;
CREATE INDEX buckets_by_score ON {s}.buckets (queue, score, id);
END IF;
END $$;
"""


async def _versions(schema: str) -> list[int]:
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        rows = await connection.fetch(
            f'SELECT version FROM "{schema}".schema_versions ORDER BY version'
        )
    finally:
        await connection.close()
    return [r[0] for r in rows]


async def test_a_schema_of_the_first_release_is_upgraded_in_place(
    schema: str, open_factory: Open
) -> None:
    from aio_keuss.postgres.sql import migrations

    latest = [v for v, _ in migrations()]
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        await connection.execute(RELEASE_0_1_DDL.replace("{s}", f'"{schema}"'))
        await connection.execute(  # messages and a counter written by that release
            f'INSERT INTO "{schema}".messages (queue, id, mature, payload, headers)'
            " VALUES ('jobs', 'old-1', 0, 'J\"kept\"', '{}'),"
            " ('jobs', 'old-2', 0, 'J\"second\"', '{\"k\":\"v\"}')"
        )
        await connection.execute(
            f"INSERT INTO \"{schema}\".stats (queue, counter, value) VALUES ('jobs', 'put', 2)"
        )
    finally:
        await connection.close()
    # several processes opening it at once take turns under the advisory lock
    factories = await asyncio.gather(*(open_factory() for _ in range(4)))
    assert await _versions(schema) == latest  # each step applied once
    q = await factories[0].queue("jobs")
    assert (await q.stats())["put"] == 2
    old = await q.reserve(timeout=5)
    assert old is not None and (old.id, old.payload) == ("old-1", "kept")
    assert await q.move(old, "next") == "old-1"  # a step the first release did not have
    # opened again once upgraded: nothing to do, nothing lost
    again = await (await open_factory()).queue("jobs")
    second = await again.pop()
    assert second is not None and (second.payload, second.headers) == ("second", {"k": "v"})
    assert (await (await factories[1].queue("next")).pop()).payload == "kept"  # type: ignore[union-attr]
    assert await _versions(schema) == latest


async def test_a_schema_a_newer_release_migrated_is_refused(
    schema: str, open_factory: Open
) -> None:
    """A schema past the steps this release knows (a later release's step recorded) is
    refused with a clear ConfigError, not served with statements for the older layout."""
    from aio_keuss.postgres.sql import migrations

    known = [v for v, _ in migrations()]
    latest = known[-1]
    await (await open_factory()).close()
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        await connection.execute(
            f'INSERT INTO "{schema}".schema_versions (version) VALUES ($1)', latest + 1
        )
    finally:
        await connection.close()
    for backend in ("postgres", "bucket-postgres"):
        with pytest.raises(aio_keuss.ConfigError, match=f"version {latest + 1}.*newer"):
            await aio_keuss.connect(backend, url=POSTGRES_URL, schema=schema)
    assert await _versions(schema) == [*known, latest + 1]  # nothing written


async def test_a_step_missing_below_the_last_one_recorded_is_applied(
    schema: str, open_factory: Open
) -> None:
    """Steps are numbered on branches that merge in any order: a schema a build had taken to
    step n + 1 lacks a step n merged later. That step is applied on the next open, not
    skipped for being below the last one recorded (here: step 9, its row and table gone)."""
    from aio_keuss.postgres.sql import migrations

    await (await open_factory()).close()
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        await connection.execute(f'DELETE FROM "{schema}".schema_versions WHERE version = 9')
        await connection.execute(f'DROP TABLE "{schema}".stats_flushes')
    finally:
        await connection.close()
    q = await (await open_factory()).queue("jobs")
    await q.push("x")
    assert await q.pop(timeout=5) is not None
    assert await _versions(schema) == [v for v, _ in migrations()]
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        assert await connection.fetchval(f"SELECT to_regclass('\"{schema}\".stats_flushes')")
    finally:
        await connection.close()


async def test_a_bucket_schema_of_the_first_release_is_upgraded_in_place(schema: str) -> None:
    """bucket-postgres of the first release made its table on connect, outside any versions
    table: the bucket migration step finds it and leaves it, and the buckets in it (written
    here by today's engine in a scratch schema and copied over: the bucket format did not
    change) are served."""
    from aio_keuss.postgres.sql import migrations

    scratch = f"{schema}_w"
    fast = {"bucket_max_wait": 0.02, "state_flush_period": 0.05}
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        for name in (schema, scratch):
            await connection.execute(RELEASE_0_1_DDL.replace("{s}", f'"{name}"'))
            await connection.execute(RELEASE_0_1_BUCKETS_DDL.replace("{s}", f'"{name}"'))
        writer = await aio_keuss.connect("bucket-postgres", url=POSTGRES_URL, schema=scratch)
        try:
            await (await writer.queue("jobs")).push_many([{"n": n} for n in range(20)])
        finally:
            await writer.close()
        columns = "queue, id, score, owner, count, remaining, blob, state"  # the first's
        await connection.execute(
            f'INSERT INTO "{schema}".buckets ({columns}) SELECT {columns} FROM "{scratch}".buckets'
        )
        await connection.execute(f'DROP SCHEMA "{scratch}" CASCADE')
    finally:
        await connection.close()

    async def open_one() -> aio_keuss.Factory:
        return await aio_keuss.connect("bucket-postgres", url=POSTGRES_URL, schema=schema, **fast)

    factories = await asyncio.gather(*(open_one() for _ in range(3)))
    try:
        assert await _versions(schema) == [v for v, _ in migrations()]
        q = await factories[0].queue("jobs")
        taken = await q.pop_many(100, timeout=5)
        assert sorted(m.payload["n"] for m in taken) == list(range(20))
    finally:
        for factory in factories:
            await factory.close()


# one statement moves many: each gets its own name --------------------------------------


async def test_one_statement_moving_an_id_and_its_renamed_twin_names_both(schema: str) -> None:
    """A batch of ko's can deadletter both ``x`` and ``x.dl2`` in one statement while the
    deadletter queue already holds ``x``: the rename rule must see the rows the statement
    has already moved (else both would become ``x.dl2``). The same for a batch of moves."""
    from aio_keuss.contract import DeadletterPlan, Entry, Move, Nack
    from aio_keuss.options import QueueOptions
    from aio_keuss.postgres.store import PostgresQueueBackend

    backend = PostgresQueueBackend({"url": POSTGRES_URL, "schema": schema})
    await backend.open()
    try:
        work = await backend.store("work", QueueOptions())
        dead = await backend.store("dead", QueueOptions())
        assert await dead.insert([Entry("x", b'"squatter"', b"{}")]) == [True]
        twins = [Entry(i, b'"' + i.encode() + b'"', b"{}", tries=1) for i in ("x", "x.dl2")]
        assert await work.insert(twins) == [True, True]
        assert len((await work.reserve(10, 60.0)).messages) == 2
        plan = DeadletterPlan(max_ko=1, queue="dead", from_queue="work")
        outcome = await work.rollback([Nack("x", 1, 0.0), Nack("x.dl2", 1, 0.0)], plan)
        assert outcome == [KoResult.DEADLETTERED, KoResult.DEADLETTERED]
        names = {m.id: m.payload for m in (await dead.get(10)).messages}
        assert names in (  # whichever row the statement moved first
            {"x": b'"squatter"', "x.dl2": b'"x"', "x.dl2.dl2": b'"x.dl2"'},
            {"x": b'"squatter"', "x.dl2": b'"x.dl2"', "x.dl2.2": b'"x"'},
        )

        assert await dead.insert([Entry("y", b"1", b"{}")]) == [True]
        assert await work.insert([Entry("y", b"2", b"{}"), Entry("y.mv", b"3", b"{}")]) == [
            True,
            True,
        ]
        assert len((await work.reserve(10, 60.0)).messages) == 2
        moved = await work.move([Move("y", 0, "dead"), Move("y.mv", 0, "dead")])
        assert sorted(moved) in (["y.mv", "y.mv.mv"], ["y.mv", "y.mv.2"])  # type: ignore[type-var]
        assert len((await dead.get(10)).messages) == 3
    finally:
        await backend.close()


# each kind of insert has its statement -----------------------------------------------


async def _recording_backend(schema: str) -> tuple[Any, list[str]]:
    """An open backend on ``schema`` whose inserts write the name of each statement they
    send into the list; ``backend.sql_fetch`` runs SQL unrecorded."""
    from aio_keuss.postgres.store import PostgresQueueBackend

    backend = PostgresQueueBackend({"url": POSTGRES_URL, "schema": schema})
    await backend.open()
    names = {sql: name for name, sql in backend.sql.items()}
    sent: list[str] = []
    fetch, execute_unless_duplicate = backend.fetch, backend.execute_unless_duplicate

    async def recording_fetch(query: str, *args: Any) -> list[Any]:
        sent.append(names.get(query, "?"))
        return await fetch(query, *args)

    async def recording_execute(query: str, *args: Any) -> bool:
        sent.append(names[query])
        return await execute_unless_duplicate(query, *args)

    backend.sql_fetch = fetch  # type: ignore[attr-defined]
    backend.fetch = recording_fetch  # type: ignore[method-assign]
    backend.execute_unless_duplicate = recording_execute  # type: ignore[method-assign]
    return backend, sent


async def test_new_messages_put_backs_and_user_ids_each_take_their_insert(schema: str) -> None:
    """New messages (every push without an id) go in by the four-column ``insert_new``,
    each with its own delay and headers, tries 0, in order. When one's id is taken (or twice
    in the batch) that statement inserts nothing and the batch goes again by ``insert``,
    which refuses just that one. A put-back keeps its tries and mature time (``insert``); a
    batch with a user id goes through the dedup table."""
    from aio_keuss.contract import Entry
    from aio_keuss.options import QueueOptions

    backend, sent = await _recording_backend(schema)
    fetch = backend.sql_fetch
    try:
        store = await backend.store("q", QueueOptions())
        new = [
            Entry("a", b"1", b"{}"),
            Entry("b", b"2", b'{"k":1}', delay=30.0),
            Entry("c", b"3", b"{}", delay=0.5),
        ]
        assert await store.insert(new) == [True, True, True]
        assert sent == ["insert_new"]
        taken = [Entry("d", b"4", b"{}"), Entry("a", b"9", b"{}")]
        assert await store.insert(taken) == [True, False]
        twice = [Entry("e", b"5", b"{}"), Entry("e", b"6", b"{}")]
        assert await store.insert(twice) == [True, False]  # the first one wins
        assert sent == ["insert_new"] + ["insert_new", "insert"] * 2
        sent.clear()
        assert await store.insert([Entry("f", b"7", b"{}", tries=2, mature=1000.0)]) == [True]
        user = [Entry("g", b"8", b"{}", dedup=True), Entry("h", b"9", b"{}")]
        assert await store.insert(user) == [True, True]
        assert sent == ["insert", "insert_dedup"]
        rows = await fetch(
            f'SELECT id, tries, mature, payload, headers FROM "{schema}".messages'
            " WHERE queue = 'q' ORDER BY seq"
        )
    finally:
        await backend.close()
    found = {r["id"]: r for r in rows}
    assert [r["id"] for r in rows] == list("abcdefgh")  # each once, seq in insert order
    assert [found[i]["tries"] for i in "abcdefgh"] == [0, 0, 0, 0, 0, 2, 0, 0]
    assert [found[i]["payload"] for i in "ade"] == [b"1", b"4", b"5"]
    assert found["b"]["headers"] == b'{"k":1}'
    # one statement, one now(): the delays are exactly what separates the mature times
    assert found["b"]["mature"] - found["a"]["mature"] == pytest.approx(30.0)
    assert found["c"]["mature"] - found["a"]["mature"] == pytest.approx(0.5)
    assert found["f"]["mature"] == 1000.0


async def test_a_bulk_load_of_new_ids_takes_one_plain_insert(schema: str) -> None:
    """A batch of user ids with one payload column (a Spark write) first goes in by plain
    INSERTs with no dedup look-up; an id queued, remembered within the window, remembered
    but expired (not yet purged) or repeated makes that statement fail whole, and the batch
    goes again by the statement that refuses just the live ones."""
    from aio_keuss.contract import Entry
    from aio_keuss.options import QueueOptions

    def load(*ids: str) -> list[Entry]:
        return [Entry(i, i.encode(), b"{}", dedup=True) for i in ids]

    backend, sent = await _recording_backend(schema)
    try:
        store = await backend.store("q", QueueOptions(dedup_window=60.0))
        assert await store.insert(load("a", "b", "c")) == [True, True, True]
        assert sent == ["insert_dedup_bulk_new"]
        assert await store.get(1) is not None  # "a" consumed, remembered for the window

        async def expire(message_id: str) -> None:  # as if the window were over, not purged
            await backend.sql_fetch(
                f'UPDATE "{schema}".dedup SET expires = 0 WHERE queue = $1 AND id = $2',
                "q",
                message_id,
            )

        for batch, flags, expired in (
            (load("d", "a"), [True, False], ""),  # remembered within the window
            (load("e", "b"), [True, False], ""),  # queued
            (load("f", "f"), [True, False], ""),  # repeated: the first one wins
            (load("g", "c"), [True, False], "c"),  # queued, its dedup row expired
        ):
            if expired:
                await expire(expired)
            sent.clear()
            assert await store.insert(batch) == flags
            assert sent == ["insert_dedup_bulk_new", "insert_dedup_bulk"]
        assert await store.get(10) is not None  # everything consumed
        await expire("a")
        sent.clear()
        assert await store.insert(load("h", "a")) == [True, True]  # expired: accepted again
        assert sent == ["insert_dedup_bulk_new", "insert_dedup_bulk"]
        rows = await backend.sql_fetch(
            f"""SELECT id, payload FROM "{schema}".messages WHERE queue = 'q' ORDER BY seq"""
        )
        remembered = await backend.sql_fetch(
            f"""SELECT id FROM "{schema}".dedup WHERE queue = 'q' AND expires > 1 ORDER BY id"""
        )
    finally:
        await backend.close()
    assert [(r["id"], r["payload"]) for r in rows] == [("h", b"h"), ("a", b"a")]
    assert [r["id"] for r in remembered] == list("abdefgh")  # "c": refused, row purged


async def test_one_extend_statement_serves_a_batch_naming_an_id_more_than_once(
    schema: str,
) -> None:
    """Concurrent extends coalesce into one batch that may name an id several times: each
    request whose guard holds is true (an extension leaves the guard as it found it), a
    stale holder's is false, and the last one that holds sets the end, as if they had run
    one after another; the whole batch is one statement, and tries stay as they were."""
    from aio_keuss.contract import Entry, Extend
    from aio_keuss.options import QueueOptions

    backend, sent = await _recording_backend(schema)
    try:
        store = await backend.store("q", QueueOptions())
        await store.insert([Entry(i, i.encode(), b"{}") for i in "abc"])
        assert len((await store.reserve(2, 30.0)).messages) == 2  # a and b, tries 0
        sent.clear()
        flags = await store.extend(
            [
                Extend("a", 0, 600.0),
                Extend("a", 1, 5000.0),  # a holder it never had
                Extend("a", None, 1200.0),
                Extend("b", 0, 60.0),
                Extend("c", None, 60.0),  # never reserved
                Extend("x", None, 60.0),  # unknown
                Extend("b", None, 120.0),
            ]
        )
        assert sent == ["extend"]
        rows = await backend.sql_fetch(
            f"""SELECT id, tries, reserved, mature - extract(epoch from now())::float8 AS left_
                FROM "{schema}".messages WHERE queue = 'q' ORDER BY id"""
        )
    finally:
        await backend.close()
    assert flags == [True, False, True, True, False, False, True]
    found = {r["id"]: r for r in rows}
    assert [(found[i]["tries"], found[i]["reserved"]) for i in "abc"] == [
        (0, True),
        (0, True),
        (0, False),
    ]
    assert 900 < found["a"]["left_"] <= 1200
    assert 60 < found["b"]["left_"] <= 120
    assert found["c"]["left_"] <= 0


async def test_a_lapsed_reservation_nobody_took_is_extended_with_its_tries(
    open_factory: Open, schema: str
) -> None:
    """The row of a lapsed reservation still says reserved with the tries its holder was
    given (the next reserve counts the lapse): the holder's extend finds it there, and the
    message stays reserved with those tries, so the holder's ok still goes through."""
    factory = await open_factory(reserve_delay=60.0, poll_interval=5.0)
    q = await factory.queue("lapsed")
    await q.push("x")
    held = await q.reserve(timeout=5)
    assert held is not None and held.tries == 0
    connection = await asyncpg.connect(POSTGRES_URL)
    try:  # the reservation lapses: its deadline an hour ago
        await connection.execute(f'UPDATE "{schema}".messages SET mature = mature - 3600')
    finally:
        await connection.close()
    seen = await q.find(held.id)
    assert seen is not None and seen.state == "ready" and seen.message.tries == 1
    assert await q.extend(held, 60) is True
    seen = await q.find(held.id)
    assert seen is not None and seen.state == "reserved" and seen.message.tries == 0
    assert await q.reserve(timeout=0) is None
    assert await q.ok(held) is True
    assert await q.total_size() == 0


# errors are translated where the package meets the driver ------------------------------


async def test_a_server_error_reaches_the_caller_as_ours(open_factory: Open, schema: str) -> None:
    factory = await open_factory()
    q = await factory.queue("q")
    await q.push("x")
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        await connection.execute(f'DROP TABLE "{schema}".messages')
    finally:
        await connection.close()
    with pytest.raises(aio_keuss.BackendError) as raised:
        await q.push("y")
    assert isinstance(raised.value.__cause__, asyncpg.UndefinedTableError)
    with pytest.raises(aio_keuss.BackendError):
        await q.size()


def test_only_the_connection_module_talks_to_the_driver() -> None:
    """Every statement goes through the translating methods of the connection: no other
    module of the package imports asyncpg or reaches into the pool."""
    package = ROOT / "aio_keuss" / "postgres"
    for path in package.rglob("*.py"):
        if path.name == "connection.py":
            continue
        text = path.read_text()
        assert "import asyncpg" not in text, path
        assert ".pool." not in text and "errors_translated" not in text, path


async def test_a_connection_the_driver_cannot_use_is_not_handed_out_again(schema: str) -> None:
    """A held connection whose protocol is still busy with something else (here a statement
    run on it behind our back, as a call interrupted mid-statement can leave it) makes the
    next statement fail with the driver's "another operation is in progress". That
    connection must not come back: put back in the pool as if healthy, every later call
    would take it again and fail the same way for as long as it stays stuck."""
    factory = await aio_keuss.connect(
        "postgres", url=POSTGRES_URL, schema=schema, min_pool_size=0, max_pool_size=3
    )  # at most one connection held: the next call must reuse or replace it
    db = factory.backend
    try:
        assert await db.fetchval("SELECT 1") == 1
        stuck = db._held._idle[0]  # type: ignore[union-attr]
        behind_our_back = asyncio.ensure_future(stuck.fetchval("SELECT pg_sleep(30)"))
        await asyncio.sleep(0)
        with pytest.raises(aio_keuss.KeussConnectionError, match="in progress"):
            await db.fetchval("SELECT 2")
        await asyncio.sleep(0.2)  # let it be handed back
        for attempt in range(3):  # three at once: one on the held connection, two via the pool
            calls = [db.fetchval("SELECT $1::int", n) for n in range(3)]
            assert await asyncio.wait_for(asyncio.gather(*calls), 10) == [0, 1, 2], attempt
        behind_our_back.cancel()
        with contextlib.suppress(BaseException):
            await behind_our_back
    finally:
        await factory.close()


async def test_a_silently_dropped_listener_connection_is_replaced(
    open_factory: Open, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg_signal, "_CHECK_EVERY", 0.5)
    monkeypatch.setattr(pg_signal, "_PING_WAIT", 0.5, raising=False)
    url = urlsplit(POSTGRES_URL)
    hole = BlackHole(url.hostname or "127.0.0.1", url.port or 5432, b"LISTEN")
    await hole.start()
    try:
        proxied = urlunsplit(url._replace(netloc=f"{url.username}@127.0.0.1:{hole.port}"))
        consumer_factory = await aio_keuss.connect(
            "postgres", url=proxied, schema=schema, poll_interval=30.0
        )
        producer = await open_factory(signal_debounce=0.0)
        await assert_a_silent_drop_is_survived(hole, consumer_factory, producer)
    finally:
        hole.close()


async def test_schemas_differing_only_in_case_do_not_share_signals(
    open_factory: Open, schema: str
) -> None:
    """Schema names are quoted, so "Jobs" and "jobs" are two schemas: a resume of a queue in
    one must not resume the queue of the same name in the other (it was a shared NOTIFY
    channel, so the other schema's paused queue delivered in every other process)."""
    other = schema.upper()
    try:
        lower_a = await open_factory()
        lower_b = await open_factory(poll_interval=30.0)
        upper_a = await aio_keuss.connect("postgres", url=POSTGRES_URL, schema=other)
        upper_b = await aio_keuss.connect("postgres", url=POSTGRES_URL, schema=other)
        try:
            qa, qb = await lower_a.queue("jobs"), await lower_b.queue("jobs")
            await qa.pause()
            await qa.push("held")
            assert await qb.is_paused()
            ua, ub = await upper_a.queue("jobs"), await upper_b.queue("jobs", poll_interval=30.0)
            waiter = asyncio.create_task(ub.pop(timeout=20))
            await ua.pause()
            await ua.resume()
            await ua.push("woken")  # the mixed-case schema's own signals still travel
            got = await asyncio.wait_for(waiter, 25)
            assert got is not None and got.payload == "woken"
            assert await qb.reserve(timeout=1.0) is None  # still paused in its schema
        finally:
            await upper_a.close()
            await upper_b.close()
    finally:
        connection = await asyncpg.connect(POSTGRES_URL)
        try:
            await connection.execute(f'DROP SCHEMA IF EXISTS "{other}" CASCADE')
        finally:
            await connection.close()


async def test_a_user_pool_with_a_connect_hook_gets_its_listener_from_the_hook(
    open_factory: Open, schema: str
) -> None:
    """asyncpg >= 0.30 pools can make their connections with a ``connect=`` function (e.g.
    rotating credentials) and then hold no connection arguments: the LISTEN connection must
    come from the same function, not from the driver's defaults (another server or database,
    where the NOTIFYs never arrive)."""
    if "connect" not in asyncpg.create_pool.__code__.co_varnames:
        pytest.skip("this asyncpg has no connect= hook")
    made = 0

    async def connect(*args: Any, **kwargs: Any) -> Any:
        nonlocal made
        made += 1
        return await asyncpg.connect(POSTGRES_URL, **kwargs)

    pool = await asyncpg.create_pool(connect=connect, min_size=1, max_size=4)
    try:
        consumer = await aio_keuss.connect("postgres", pool=pool, schema=schema, poll_interval=30.0)
        try:
            producer = await open_factory()
            waiter = asyncio.create_task((await consumer.queue("hooked")).pop(timeout=20))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await (await producer.queue("hooked")).push("woken")
            got = await asyncio.wait_for(waiter, 25)
            assert got is not None and got.payload == "woken"
            assert time.monotonic() - started < 10.0  # woken (poll 30 s, timeout 20 s)
            assert made > pool.get_size()  # the listener's connection came from the hook too
        finally:
            await consumer.close()
    finally:
        await pool.close()


@pytest.mark.parametrize("backend", ["postgres", "bucket-postgres"])
async def test_a_serializable_default_isolation_does_not_fail_concurrent_consumers(
    schema: str, backend: str
) -> None:
    """The statements are written for READ COMMITTED; a role (or database) whose
    default_transaction_isolation is serializable made concurrent reserves and oks fail with
    "could not serialize access" (40001). The backend's sessions run READ COMMITTED."""
    role = f"{schema}_serial"
    admin = await asyncpg.connect(POSTGRES_URL)
    await admin.execute(f'CREATE ROLE "{role}" LOGIN SUPERUSER')
    await admin.execute(f"ALTER ROLE \"{role}\" SET default_transaction_isolation = 'serializable'")
    url = urlsplit(POSTGRES_URL)
    as_role = urlunsplit(url._replace(netloc=f"{role}@{url.hostname}:{url.port or 5432}"))
    factories: list[aio_keuss.Factory] = []
    try:
        for _ in range(3):
            factories.append(await aio_keuss.connect(backend, url=as_role, schema=schema))
        db = factories[0].backend
        assert await db.fetchval("SHOW transaction_isolation") == "read committed"
        queues = [await f.queue("iso") for f in factories]
        await queues[0].push_many(list(range(300)))
        got: list[int] = []

        async def work(q: aio_keuss.Queue) -> None:
            while (message := await q.reserve(timeout=0.3)) is not None:
                got.append(message.payload)
                assert await q.ok(message)

        await asyncio.gather(*(work(q) for q in queues for _ in range(3)))
        assert sorted(got) == list(range(300))
    finally:
        for factory in factories:
            await factory.close()
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.execute(f'DROP ROLE "{role}"')
        await admin.close()


async def test_a_server_without_autovacuum_is_named_on_connect(
    schema: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Consumed rows stay until VACUUM: with autovacuum off (as on the test machines' server)
    pops slowed five times over after a million messages, and nothing said why. The open
    warns when the server's autovacuum is off, and only then."""
    admin = await asyncpg.connect(POSTGRES_URL)
    try:
        autovacuum = await admin.fetchval("SHOW autovacuum")
    finally:
        await admin.close()
    caplog.set_level(logging.WARNING, logger="aio_keuss.postgres")
    monkeypatch.setattr(pg_connection, "warned_no_autovacuum", False)  # the suite's: said
    for _ in range(2):  # once a process
        async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema):
            pass
    warned = [r for r in caplog.records if "autovacuum is off" in r.getMessage()]
    assert len(warned) == (autovacuum != "on"), caplog.text
    if warned:
        assert f"{schema}.messages" in warned[0].getMessage()


async def test_the_listener_outlives_a_short_idle_session_timeout(schema: str) -> None:
    """A role whose idle_session_timeout (1 s here) is shorter than the signal bus's liveness
    check: the server ended the LISTENing session each time it had been idle that long, and
    the bus reconnected again and again (a warning each time, wake-ups lost meanwhile). The
    listener's session now turns the timeout off for itself, and so do the sessions of our
    own pool: one ended while idle failed the next statement sent on it, the pop waiting here
    included (asyncpg: "another operation is in progress"), one run in several."""
    role = f"{schema}_idle"
    admin = await asyncpg.connect(POSTGRES_URL)
    if admin.get_server_version().major < 14:
        await admin.close()
        pytest.skip("idle_session_timeout is PostgreSQL 14 and later")
    await admin.execute(f'CREATE ROLE "{role}" LOGIN SUPERUSER')
    await admin.execute(f"ALTER ROLE \"{role}\" SET idle_session_timeout = '1s'")
    url = urlsplit(POSTGRES_URL)
    as_role = urlunsplit(url._replace(netloc=f"{role}@{url.hostname}:{url.port or 5432}"))
    listening = "SELECT pid FROM pg_stat_activity WHERE usename = $1 AND query LIKE 'LISTEN %'"
    try:
        async with aio_keuss.connect("postgres", url=as_role, schema=schema) as factory:
            q = await factory.queue("idle")
            waiting = asyncio.create_task(q.pop(timeout=60))
            deadline = time.monotonic() + 30
            while (first := await admin.fetchval(listening, role)) is None:
                assert time.monotonic() < deadline, "no listener"
                await asyncio.sleep(0.05)
            sessions = "SELECT array_agg(pid ORDER BY pid) FROM pg_stat_activity WHERE usename = $1"
            before = await admin.fetchval(sessions, role)
            await asyncio.sleep(3)  # three times the timeout, idle
            assert await admin.fetchval(listening, role) == first
            assert await admin.fetchval(sessions, role) == before  # none ended
            await q.push("after a while")
            got = await waiting
            assert got is not None and got.payload == "after a while"
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.execute(f'DROP ROLE "{role}"')
        await admin.close()


async def _held_and_idle(factory: aio_keuss.Factory, q: aio_keuss.Queue) -> list[Any]:
    """The connections ``factory`` holds for its statements, once some are held and back
    from the calls in flight (pushes and pops on ``q``, which is left empty)."""
    await asyncio.gather(*(q.push(n) for n in range(4)))
    idle: list[Any] = factory.backend._held._idle  # type: ignore[attr-defined]
    async with asyncio.timeout(30):
        while not idle:
            assert (await q.pop(timeout=0)) is not None
    return idle


async def test_the_connections_held_from_a_users_pool_outlive_its_idle_session_timeout(
    schema: str,
) -> None:
    """A user's pool whose sessions have a short idle_session_timeout (1 s here): the
    connections the factory held from it for its statements were ended by the server while
    idle between calls, and a statement sent as the server's notice came in failed with a
    connection error. What the factory holds turns the timeout off for itself, as the
    sessions of our own pool do; the pool's reset (RESET ALL) restores it on release."""
    admin = await asyncpg.connect(POSTGRES_URL)
    if admin.get_server_version().major < 14:
        await admin.close()
        pytest.skip("idle_session_timeout is PostgreSQL 14 and later")
    pool = await asyncpg.create_pool(
        POSTGRES_URL, min_size=0, max_size=4, server_settings={"idle_session_timeout": "1000"}
    )
    alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])"
    try:
        async with aio_keuss.connect("postgres", pool=pool, schema=schema) as factory:
            q = await factory.queue("idle")
            idle = await _held_and_idle(factory, q)
            await q.push("x")
            held = [c.get_server_pid() for c in idle]
            await asyncio.sleep(3)  # three times the timeout, idle
            assert await admin.fetchval(alive, held) == len(held)  # none ended
            assert await q.size() >= 1 and (await q.pop(timeout=5)) is not None
        async with pool.acquire() as connection:  # the user's sessions keep their setting
            assert await connection.fetchval("SHOW idle_session_timeout") == "1s"
    finally:
        await pool.close()
        await admin.close()


@pytest.mark.parametrize("own_pool", [True, False])
async def test_a_pool_of_one_connection_serves_concurrent_calls(
    schema: str, own_pool: bool
) -> None:
    """With a pool of one connection, the connection the factory holds for its one-statement
    calls was the pool's only one: a second call at the same time fell back on the pool and
    waited there forever, since a held connection never goes back to the pool."""
    pool = None if own_pool else await asyncpg.create_pool(POSTGRES_URL, min_size=0, max_size=1)
    options: dict[str, Any] = (
        {"min_pool_size": 0, "max_pool_size": 1} if own_pool else {"pool": pool}
    )
    try:
        async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema, **options) as f:
            q = await f.queue("tiny")
            async with asyncio.timeout(30):  # a hang is forever: any bound shows it
                await asyncio.gather(*(q.push(n) for n in range(5)), q.size(), q.stats())
                got = await asyncio.gather(*(q.pop(timeout=0) for _ in range(5)))
            assert sorted(m.payload for m in got if m is not None) == [0, 1, 2, 3, 4]
    finally:
        if pool is not None:
            await pool.close()


async def test_a_role_without_ddl_rights_opens_a_schema_already_up_to_date(
    schema: str, open_factory: Open
) -> None:
    """The schema is made and upgraded by a role that may (here the first factory's); an
    application's role with only the rights to use its tables must still open it. Every
    open ran CREATE SCHEMA / CREATE TABLE IF NOT EXISTS, which PostgreSQL checks the CREATE
    privilege for before it sees the object exists: "permission denied for database"."""
    from aio_keuss.postgres.sql import migrations

    await (await open_factory()).close()
    async with _app_role(schema) as url:
        async with aio_keuss.connect("postgres", url=url, schema=schema) as factory:
            q = await factory.queue("limited")
            await q.push("by the app's role")
            got = await q.pop(timeout=5)
            assert got is not None and got.payload == "by the app's role"
        assert await _versions(schema) == [v for v, _ in migrations()]


@contextlib.asynccontextmanager
async def _app_role(schema: str, before: str | None = None) -> AsyncIterator[str]:
    """The URL of a new role with only the rights to use the schema's tables and functions
    (an application's role, no CREATE); ``before``: a statement run first as the admin.
    The schema and the role are dropped after."""
    role = f"akt_role_{new_token()}"
    admin = await asyncpg.connect(POSTGRES_URL)
    try:
        if before is not None:
            await admin.execute(before)
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        await admin.execute(
            f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}";'
            f' GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}"'
            f' TO "{role}"; GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA "{schema}" TO "{role}"'
        )
        parts = urlsplit(POSTGRES_URL)
        yield urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port or 5432}"))
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.execute(f'DROP OWNED BY "{role}"; DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def test_a_stats_flush_whose_reply_is_lost_is_not_counted_twice(schema: str) -> None:
    """The server applied a flush of the counters and its reply was lost with the
    connection: the batch went back into the buffer and the next flush added it again."""
    from reply_gate import ReplyGate

    host, port = urlsplit(POSTGRES_URL).hostname, urlsplit(POSTGRES_URL).port or 5432
    gate = ReplyGate(host or "127.0.0.1", port)
    parts = urlsplit(POSTGRES_URL)
    url = urlunsplit(
        parts._replace(netloc=parts.netloc.rsplit("@", 1)[0] + f"@127.0.0.1:{gate.port}")
    )
    direct = await asyncpg.connect(POSTGRES_URL)

    async def stored_puts() -> int:
        value = await direct.fetchval(
            f"SELECT value FROM \"{schema}\".stats WHERE queue = 'counted' AND counter = 'put'"
        )
        return int(value or 0)

    try:
        factory = await aio_keuss.connect(  # one connection held: the flush's is prepared
            "postgres", url=url, schema=schema, signal="local", max_pool_size=3
        )
        try:
            q = await factory.queue("counted")
            await q.push("first")
            async with asyncio.timeout(30):
                while await stored_puts() != 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            await q.push_many([1, 2])
            gate.shut()  # the flush runs and commits on the server; its reply is held
            async with asyncio.timeout(30):
                while await stored_puts() != 3:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            gate.cut()  # ... and never delivered: the connection is lost
            gate.open()
            async with asyncio.timeout(30):
                while True:  # the flusher sees the loss and writes again
                    try:
                        assert (await q.stats())["put"] == 3
                        break
                    except aio_keuss.KeussConnectionError:
                        await asyncio.sleep(0.05)
        finally:
            await factory.close()
        assert await stored_puts() == 3
    finally:
        gate.cut()
        await direct.close()


async def test_a_role_statement_timeout_does_not_fail_an_open_waiting_its_turn(
    schema: str,
) -> None:
    """Processes starting at once wait for the one migrating (the schema's advisory lock).
    Under a role's or database's statement_timeout / lock_timeout shorter than that wait
    (or than a step, such as an index built over a big table), the open failed with
    "canceling statement due to statement timeout", on every start while the wait lasted."""
    key = f"aio_keuss:{schema}"
    holder = await asyncpg.connect(POSTGRES_URL)
    try:
        async with holder.transaction():  # as another process migrating would hold it
            await holder.execute("SELECT pg_advisory_xact_lock(hashtext($1))", key)
            opening = asyncio.ensure_future(
                aio_keuss.connect(
                    "postgres",
                    url=f"{POSTGRES_URL}?statement_timeout=100&lock_timeout=100",
                    schema=schema,
                )
            )
            async with asyncio.timeout(30):
                while not await holder.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                    " AND NOT granted AND objid = hashtext($1)::oid",
                    key,
                ):
                    assert not opening.done(), opening
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # the wait outlasts those timeouts
        factory = await asyncio.wait_for(opening, 30)
        try:
            q = await factory.queue("after-waiting")
            await q.push("in")
            assert (await q.pop(timeout=5)).payload == "in"  # type: ignore[union-attr]
        finally:
            await factory.close()
    finally:
        await holder.close()


async def test_a_role_without_ddl_rights_is_told_a_newer_release_migrated_the_schema(
    schema: str, open_factory: Open
) -> None:
    """The up-to-date check read the version first but went on to the DDL for anything but
    this release's version: a schema a newer release had migrated, opened by an application
    role without the CREATE privilege, failed with "permission denied" rather than the
    ConfigError that says to upgrade aio-keuss."""
    from aio_keuss.postgres.sql import migrations

    latest = migrations()[-1][0]
    await (await open_factory()).close()
    newer = f'INSERT INTO "{schema}".schema_versions (version) VALUES ({latest + 1})'
    async with _app_role(schema, before=newer) as url:
        with pytest.raises(aio_keuss.ConfigError, match=f"version {latest + 1}.*newer"):
            await aio_keuss.connect("postgres", url=url, schema=schema)


async def test_a_pop_on_a_borrowed_connection_whose_release_fails_hands_its_messages_back(
    schema: str,
) -> None:
    """When every held connection is busy, a statement borrows one from the pool and gives it
    back at once; a user's pool resets it on release (a round trip). The connection breaking
    during that reset made the pop raise KeussConnectionError after its DELETE had committed
    and its rows had come back: the messages were gone from the queue and handed to no one."""
    breaking: list[Any] = []

    async def reset(connection: Any) -> None:
        if breaking and connection is not breaking[0]:
            breaking.clear()  # the connection breaks during its reset, after the pop's reply
            await connection.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    pool = await asyncpg.create_pool(POSTGRES_URL, min_size=2, max_size=2, reset=reset)
    try:
        async with aio_keuss.connect("postgres", pool=pool, schema=schema) as factory:
            q = await factory.queue("q")
            await q.push("kept")
            held = factory.backend._held  # type: ignore[attr-defined]
            for _ in range(1000):  # the push's notify may still be using it
                if held._idle:
                    break
                await asyncio.sleep(0.01)
            busy = held._idle.pop()  # the one held connection, busy: the pop borrows
            breaking.append(busy)
            try:
                got = await q.pop(timeout=0)
            finally:
                held._idle.append(busy)
            for _ in range(1000):  # given back in the background, after the pop's reply
                if not held._handing_back:
                    break
                await asyncio.sleep(0.01)
            assert not breaking  # the borrowed connection did break on its way back
            assert got is not None and got.payload == "kept"
    finally:
        await pool.close()


@pytest.mark.parametrize("own_pool", [True, False])
async def test_held_connections_are_kept_alive_over_tcp(schema: str, own_pool: bool) -> None:
    """asyncpg turns no TCP keepalive on: a held connection a NAT or load balancer forgot
    while idle hung its next statement for as long as the kernel retransmits. Our own
    connections probe from both ends; a user's pool's sockets are the user's, and only the
    server's probes (a session setting, reset on release) are asked for there."""
    pool = None if own_pool else await asyncpg.create_pool(POSTGRES_URL, min_size=0, max_size=4)
    options: dict[str, Any] = {"url": POSTGRES_URL} if pool is None else {"pool": pool}
    try:
        async with aio_keuss.connect("postgres", schema=schema, **options) as factory:
            q = await factory.queue("keepalive")
            idle = await _held_and_idle(factory, q)
            for connection in list(idle):
                sock = connection._transport.get_extra_info("socket")
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == int(own_pool)
                if own_pool:
                    for option, value in keepalive.socket_options().items():
                        assert sock.getsockopt(socket.IPPROTO_TCP, option) == value
                shown = await connection.fetchval("SHOW tcp_keepalives_idle")
                assert shown in (str(keepalive.IDLE), f"{keepalive.IDLE}s")
    finally:
        if pool is not None:
            await pool.close()


@pytest.mark.parametrize("own_pool", [True, False])
async def test_a_statement_still_running_when_the_backend_closes_gives_its_connection_back(
    schema: str, own_pool: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pop outlives its caller's cancellation (it runs to its end, so that what its DELETE
    took is handed back), and so may outlive a close given up past its grace. Its held
    connection, once the statement ended, went back among the idle ones of the closed
    backend, never to the pool: a user's pool lost it for good, and our own pool's close
    waited for it until the grace ran out."""
    from aio_keuss.postgres.store import PostgresQueueBackend

    monkeypatch.setattr(pg_connection, "CLOSE_GRACE", 3600.0)  # not what ends the close
    pool = await asyncpg.create_pool(POSTGRES_URL, min_size=0, max_size=4)
    options: dict[str, Any] = {"url": POSTGRES_URL, "schema": schema}
    backend = PostgresQueueBackend(options if own_pool else {**options, "pool": pool})
    await backend.open()
    blocker = await asyncpg.connect(POSTGRES_URL)
    try:
        blocking = blocker.transaction()
        await blocking.start()
        key = int.from_bytes(os.urandom(3))  # this test's own lock on a shared server
        await blocker.execute("SELECT pg_advisory_xact_lock($1)", key)
        running = asyncio.ensure_future(backend.fetchval("SELECT pg_advisory_xact_lock($1)", key))
        async with asyncio.timeout(30):  # waiting on the lock: in flight on a held connection
            while not await blocker.fetchval(
                "SELECT count(*) FROM pg_locks"
                " WHERE locktype = 'advisory' AND objid = $1 AND NOT granted",
                key,
            ):
                assert not running.done(), running
                await asyncio.sleep(0.01)
        own = backend._pool if own_pool else None
        closing = asyncio.ensure_future(backend.close())
        await asyncio.sleep(0)  # the close has begun
        await blocking.commit()
        await running
        async with asyncio.timeout(30):  # a leaked connection is never given back: any bound
            await closing
            await pool.close()
        assert own is None or own.is_closing()
    finally:
        await blocker.close()
        pool.terminate()
        await backend.close()


async def test_user_pools_of_serializable_sessions_open_a_new_schema_at_once(schema: str) -> None:
    """The migrations run on a connection of the user's pool, in the user's default
    isolation. Under REPEATABLE READ or SERIALIZABLE the transaction's snapshot is taken by
    its first statement, before it waits its turn on the schema's advisory lock: the
    process that waited then read no applied step (another process's commit came after
    its snapshot), applied them all again and failed on the versions already recorded."""
    settings = {"default_transaction_isolation": "serializable"}
    pools = [
        await asyncpg.create_pool(POSTGRES_URL, min_size=0, max_size=4, server_settings=settings)
        for _ in range(2)
    ]
    blocker = await asyncpg.connect(POSTGRES_URL)
    opening: list[asyncio.Future[aio_keuss.Factory]] = []
    try:
        async with blocker.transaction():  # the schema's lock, held while both take their turn
            await blocker.execute(
                "SELECT pg_advisory_xact_lock(hashtext('aio_keuss:' || $1))", schema
            )
            opening = [
                asyncio.ensure_future(aio_keuss.connect("postgres", pool=pool, schema=schema))
                for pool in pools
            ]
            async with asyncio.timeout(30):
                while await blocker.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                    " AND objid = hashtext('aio_keuss:' || $1)::oid",
                    schema,
                ) < len(pools):
                    assert not any(o.done() for o in opening), opening
                    await asyncio.sleep(0.01)
        opened = await asyncio.gather(*opening, return_exceptions=True)
        for factory in opened:
            assert isinstance(factory, aio_keuss.Factory), factory
            q = await factory.queue("q")
            await q.push("in")
            got = await q.pop(timeout=5)
            assert got is not None and got.payload == "in"
    finally:
        for future in opening:
            if not future.done():
                future.cancel()
            with contextlib.suppress(BaseException):
                await (await future).close()
        await blocker.close()
        for pool in pools:
            await pool.close()


async def _batches_through_every_form(q: aio_keuss.Queue, moved_to: str) -> list[Any]:
    """Push, reserve, ok, ko and move batches of one to five messages (each size below
    ``SPELLED_OUT_ROWS`` has a written-out form of its own, five the statement as written),
    with results kept; the payloads of what was ok-ed or moved, in order."""
    done: list[Any] = []
    for size in range(1, 6):
        await q.push_many([{"size": size, "k": k} for k in range(size)])
        held = await q.reserve_many(size, timeout=5)
        assert len(held) == size
        assert await q.ok_many(held[:1], results=[{"r": size}]) == [True]
        for message in held[1:2]:
            assert await q.ko(message) == KoResult.ROLLED_BACK
        assert all(await q.move_many(held[2:], moved_to))
        done += [m.payload for m in held[:1]] + [m.payload for m in held[2:]]
        again = await q.reserve_many(size, timeout=5) if size > 1 else []  # the ko-ed one
        assert [m.payload for m in again] == [m.payload for m in held[1:2]]
        assert await q.ok_many(again) == [True] * len(again)
        done += [m.payload for m in again]
    return done


async def test_every_statement_form_works_after_our_sessions_are_terminated_and_a_column_added(
    schema: str,
) -> None:
    """Another session ends every connection of ours (``pg_terminate_backend``, as an
    administrator or a failover tool does; the LISTEN connection included) and alters the
    messages table (another release's migration adds a column): the prepared statements of
    every form, written-out small batches included, are prepared afresh on the new
    connections, whose result rows changed shape; calls fail only with
    ``KeussConnectionError`` while the dead connections are found, and a waiting consumer
    is woken by a push again, not by its 30 s poll."""
    app = f"akt_app_{new_token()}"
    url = f"{POSTGRES_URL}{'&' if '?' in POSTGRES_URL else '?'}application_name={app}"
    factory = await aio_keuss.connect("postgres", url=url, schema=schema, poll_interval=30.0)
    producer = await aio_keuss.connect(
        "postgres", url=POSTGRES_URL, schema=schema, signal_debounce=0.0
    )
    admin = await asyncpg.connect(POSTGRES_URL)
    try:
        q = await factory.queue("q", result_ttl=60, reserve_delay=60)
        first = await _batches_through_every_form(q, "moved")
        ours = "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
        pids = [row["pid"] for row in await admin.fetch(ours, app)]
        assert len(pids) >= 2  # the pool's and the listener's
        await admin.execute(f'ALTER TABLE "{schema}".messages ADD COLUMN from_a_migration int')
        await admin.execute("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", pids)
        alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)"
        while await admin.fetchval(alive, pids):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        failures: list[BaseException] = []
        for _ in range(100):  # until every dead connection is found and replaced
            probes = await asyncio.gather(*(q.size() for _ in range(12)), return_exceptions=True)
            failures += [p for p in probes if isinstance(p, BaseException)]
            if not any(isinstance(p, BaseException) for p in probes):
                break
        assert all(isinstance(f, aio_keuss.KeussConnectionError) for f in failures), failures
        second = await _batches_through_every_form(q, "moved")
        assert sorted(map(json.dumps, second)) == sorted(map(json.dumps, first))
        moved = await factory.queue("moved")
        assert await moved.total_size() == 2 * sum(max(0, s - 2) for s in range(1, 6))

        listening = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
        # its last statement: the LISTEN, or the liveness check after it
        listening += " AND (query LIKE 'LISTEN%' OR query = 'SELECT 1') AND NOT pid = ANY($2)"
        while not await admin.fetchval(listening, app, pids):  # noqa: ASYNC110 (listener back)
            await asyncio.sleep(0.05)
        waiting = asyncio.create_task(q.pop(timeout=25))
        await asyncio.sleep(0.3)  # waiting
        await (await producer.queue("q")).push("wake")
        started = time.monotonic()
        got = await asyncio.wait_for(waiting, 25)
        assert got is not None and got.payload == "wake"
        assert time.monotonic() - started < 15.0  # woken, not polled
    finally:
        await admin.close()
        await producer.close()
        await factory.close()


async def test_stats_flushes_of_two_factories_never_deadlock(schema: str) -> None:
    """Two factories flushing the same counters, each listing them in its own order (the
    order they were first counted in): one upsert each, and two upserts that take the same
    rows' locks in opposite orders deadlock (PostgreSQL manual, "Deadlocks": the server
    then aborts one). A flush writes its rows in one order, whoever sends it."""
    names = [f"c{n}" for n in range(40)]
    one = await aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema)
    two = await aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema)
    try:
        for q in ("a", "b"):
            await one.queue(q)
        for _ in range(30):
            for name in names:
                for q in ("a", "b"):
                    one.stats_store.incr(q, name)
            for name in reversed(names):
                for q in ("b", "a"):
                    two.stats_store.incr(q, name)
            await asyncio.gather(one.stats_store.flush(), two.stats_store.flush())
        counters = await one.stats_store.counters("a")
        assert all(counters[name] == 60 for name in names)
    finally:
        await one.close()
        await two.close()
