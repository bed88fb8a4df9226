"""postgres ``Store.amend`` (promote, reschedule, change_priority), on the store itself: each
semantic of the contract's ``Amend``, the rule of ``remove`` for what is waiting (a lapsed
reservation included), requests naming one id applied in order, history untouched, one
statement per call, and an amend racing reserves never handing a message out twice.

Each test works in its own schema, dropped afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import POSTGRES_URL, new_token

import aio_keuss
from aio_keuss.contract import Ack, Amend, Entry, Peeked, Store
from aio_keuss.registry import load_backend

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.timeout(120)

HANG_GUARD = 60.0
FAR = 1000.0
"""A delay no test outlives: a message scheduled by it stays scheduled."""


@pytest.fixture
async def factory() -> AsyncIterator[aio_keuss.Factory]:
    try:
        connection = await asyncpg.connect(POSTGRES_URL, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        pytest.skip(f"no PostgreSQL at {POSTGRES_URL}")
    await connection.close()
    schema = f"akt_{new_token()}"
    opened = await aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema, history=True)
    try:
        yield opened
    finally:
        await opened.close()
        connection = await asyncpg.connect(POSTGRES_URL)
        try:
            await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await connection.close()


async def _store(factory: aio_keuss.Factory, name: str = "jobs") -> Store:
    queue: Any = await factory.queue(name)
    store: Store = queue._store
    return store


async def _push(store: Store, *entries: tuple[str, float, int]) -> None:
    """(id, delay, priority) each, as a push would write them."""
    done = await store.insert(
        [
            Entry(id, b'J"' + id.encode() + b'"', b'{"h":1}', delay, priority=priority)
            for id, delay, priority in entries
        ]
    )
    assert all(done)


async def _one(store: Store, message_id: str) -> Peeked:
    (found,) = await store.locate([message_id])
    assert found is not None
    return found


async def _server_now(factory: aio_keuss.Factory) -> float:
    backend: Any = factory.backend
    now: float = await backend.fetchval("SELECT extract(epoch from clock_timestamp())::float8")
    return now


def test_the_postgres_backend_has_the_capability_and_bucket_postgres_not() -> None:
    assert load_backend("postgres").capabilities.reschedule
    assert not load_backend("bucket-postgres").capabilities.reschedule


async def test_a_promote_makes_a_scheduled_message_ready_and_keeps_the_rest(
    factory: aio_keuss.Factory,
) -> None:
    store = await _store(factory)
    await _push(store, ("late", FAR, 3))
    before = await _one(store, "late")
    assert before.state == "scheduled"
    start = await _server_now(factory)
    assert await store.amend([Amend("late", delay=0.0, scheduled_only=True)]) == [True]
    after = await _one(store, "late")
    assert after.state == "ready" and after.at >= start
    kept = after.message
    assert (kept.id, kept.payload, kept.headers, kept.tries, kept.priority) == (
        "late",
        before.message.payload,
        before.message.headers,
        0,
        3,
    )
    fetched = await store.reserve(5, 60)
    assert [m.id for m in fetched.messages] == ["late"]


async def test_a_promote_of_a_ready_message_changes_nothing(factory: aio_keuss.Factory) -> None:
    store = await _store(factory)
    await _push(store, ("ready", 0.0, 0))
    before = await _one(store, "ready")
    assert await store.amend([Amend("ready", delay=0.0, scheduled_only=True)]) == [False]
    assert await _one(store, "ready") == before


async def test_a_reschedule_moves_the_mature_time_on_the_server_clock(
    factory: aio_keuss.Factory,
) -> None:
    store = await _store(factory)
    await _push(store, ("ready", 0.0, 0), ("late", FAR, 0))
    start = await _server_now(factory)
    assert await store.amend([Amend("ready", delay=FAR), Amend("late", delay=5.0)]) == [
        True,
        True,
    ]
    end = await _server_now(factory)
    ready, late = await _one(store, "ready"), await _one(store, "late")
    assert ready.state == late.state == "scheduled"
    assert start + FAR <= ready.at <= end + FAR
    assert start + 5.0 <= late.at <= end + 5.0
    assert (await store.reserve(5, 60)).messages == []


async def test_a_reserved_message_is_not_amended(factory: aio_keuss.Factory) -> None:
    store = await _store(factory)
    await _push(store, ("held", 0.0, 0))
    (held,) = (await store.reserve(1, 60)).messages
    before = await _one(store, "held")
    amends = [
        Amend("held", delay=0.0),
        Amend("held", delay=FAR),
        Amend("held", priority=5),
        Amend("held", delay=0.0, scheduled_only=True),
    ]
    assert await store.amend(amends) == [False] * 4
    assert await _one(store, "held") == before
    assert await store.commit([Ack("held", held.tries)]) == [True]


async def test_a_lapsed_reservation_is_waiting_as_remove_has_it(
    factory: aio_keuss.Factory,
) -> None:
    """The change releases it: the lapsed delivery counts as a try (as the next reserve
    would count it), and its late holder can no longer ok it."""
    store = await _store(factory)
    await _push(store, ("lapsed", 0.0, 0))
    (held,) = (await store.reserve(1, 0.0)).messages
    shown = await _one(store, "lapsed")
    assert shown.state == "ready" and shown.message.tries == held.tries + 1
    assert await store.amend([Amend("lapsed", delay=0.0, scheduled_only=True)]) == [False]
    assert await store.amend([Amend("lapsed", delay=FAR)]) == [True]
    after = await _one(store, "lapsed")
    assert after.state == "scheduled" and after.message.tries == held.tries + 1
    assert await store.commit([Ack("lapsed", held.tries)]) == [False]
    assert await store.amend([Amend("lapsed", delay=0.0, scheduled_only=True)]) == [True]
    (again,) = (await store.reserve(1, 60)).messages
    assert again.id == "lapsed" and again.tries == held.tries + 1


async def test_a_new_priority_reorders_and_keeps_the_mature_time(
    factory: aio_keuss.Factory,
) -> None:
    store = await _store(factory)
    await _push(store, ("a", 0.0, 0), ("b", 0.0, 0), ("c", 0.0, 0), ("d", 0.0, 2))
    before = await _one(store, "c")
    assert await store.amend([Amend("c", priority=5), Amend("a", priority=-1)]) == [True, True]
    after = await _one(store, "c")
    assert after.at == before.at and after.message.priority == 5
    assert after.message.tries == 0
    # back to 0: it leaves the priority index and goes among the plain ones by push order
    assert await store.amend([Amend("d", priority=0)]) == [True]
    fetched = await store.reserve(10, 60)
    assert [m.id for m in fetched.messages] == ["c", "b", "d", "a"]
    assert [m.priority for m in fetched.messages] == [5, 0, 0, -1]


async def test_a_priority_and_a_delay_together(factory: aio_keuss.Factory) -> None:
    store = await _store(factory)
    await _push(store, ("x", FAR, 0), ("y", 0.0, 0))
    assert await store.amend([Amend("x", delay=0.0, priority=1, scheduled_only=True)]) == [True]
    fetched = await store.reserve(10, 60)
    assert [m.id for m in fetched.messages] == ["x", "y"]


async def test_not_found_and_other_queues_are_false(factory: aio_keuss.Factory) -> None:
    store, other = await _store(factory), await _store(factory, "other")
    await _push(other, ("theirs", FAR, 0))
    assert await store.amend([Amend("nope", delay=0.0), Amend("theirs", delay=0.0)]) == [
        False,
        False,
    ]
    assert (await _one(other, "theirs")).state == "scheduled"
    assert await store.amend([]) == []


async def test_requests_naming_one_id_apply_in_order(factory: aio_keuss.Factory) -> None:
    store = await _store(factory)
    await _push(store, ("a", FAR, 0), ("b", FAR, 0), ("c", 0.0, 0))
    promote = Amend("a", delay=0.0, scheduled_only=True)
    assert await store.amend([promote, promote]) == [True, False]
    assert await store.amend(
        [
            Amend("b", priority=4),
            Amend("b", delay=0.0, scheduled_only=True),
            Amend("c", delay=FAR),
            Amend("c", delay=0.0, scheduled_only=True),
            Amend("b", priority=7),
        ]
    ) == [True, True, True, True, True]
    b, c = await _one(store, "b"), await _one(store, "c")
    assert b.state == "ready" and b.message.priority == 7
    assert c.state == "ready"


async def test_an_amend_is_not_history(factory: aio_keuss.Factory) -> None:
    store = await _store(factory)
    await _push(store, ("a", FAR, 0))
    assert await store.amend([Amend("a", delay=0.0, priority=2)]) == [True]
    assert (await store.history(0.0, 2e10, None, 10)).rows == []
    assert (await _one(store, "a")).state == "ready"
    (held,) = (await store.reserve(1, 60)).messages
    assert await store.commit([Ack("a", held.tries)]) == [True]
    assert [p.message.id for p in (await store.history(0.0, 2e10, None, 10)).rows] == ["a"]


async def test_a_batch_is_one_statement(
    factory: aio_keuss.Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await _store(factory)
    await _push(store, *((f"m{n}", FAR, 0) for n in range(50)))
    backend: Any = factory.backend
    real = backend._run
    sent: list[str] = []

    def counting(method: str, query: str, args: tuple[Any, ...]) -> Any:
        sent.append(method)
        return real(method, query, args)

    monkeypatch.setattr(backend, "_run", counting)
    amends = [Amend(f"m{n}", delay=0.0, scheduled_only=True) for n in range(25)]
    amends += [Amend(f"m{n}", priority=n) for n in range(25, 50)] + [Amend("nope", delay=1.0)]
    assert await store.amend(amends) == [True] * 50 + [False]
    assert sent == ["fetch"]
    assert await store.amend([]) == []
    assert sent == ["fetch"]


async def test_amends_racing_reserves_never_hand_a_message_out_twice(
    factory: aio_keuss.Factory,
) -> None:
    """Consumers reserve while promotes and reschedules go on over the same messages: every
    message is handed out exactly once, and an amend that moved one into the future had it
    waiting (a reserved one is refused, so it is never both held and scheduled)."""
    store = await _store(factory)
    count = 300
    ids = [f"m{n}" for n in range(count)]
    await _push(store, *((i, FAR, 0) for i in ids))
    delivered: list[str] = []
    promoted = asyncio.Event()

    async def consume() -> None:
        while len(delivered) < count:
            fetched = await store.reserve(7, 600)
            delivered.extend(m.id for m in fetched.messages)
            if not fetched.messages:
                await asyncio.sleep(0.005 if promoted.is_set() else 0.001)

    async def amend() -> None:
        for round_ in range(6):
            part = ids[round_::3]
            await store.amend([Amend(i, delay=0.0, scheduled_only=True) for i in part])
            # some just promoted are reserved by now: those are refused here
            back = await store.amend([Amend(i, delay=FAR) for i in part[::2]])
            found = await store.locate([i for i, done in zip(part[::2], back, strict=True) if done])
            assert all(p is not None and p.state == "scheduled" for p in found)
        promoted.set()
        await store.amend([Amend(i, delay=0.0, scheduled_only=True) for i in ids])

    async with asyncio.timeout(HANG_GUARD):
        await asyncio.gather(amend(), *(consume() for _ in range(6)))
    assert sorted(delivered) == sorted(ids)
    sizes = await store.sizes()
    assert (sizes.reserved, sizes.scheduled, sizes.size) == (count, 0, 0)


async def test_amends_sharing_ids_in_any_order_take_turns(factory: aio_keuss.Factory) -> None:
    """Batches naming the same messages in opposite orders lock them in one order (by id),
    so the server finds no deadlock to break by failing one of them."""
    store = await _store(factory)
    ids = [f"m{n:03}" for n in range(200)]
    await _push(store, *((i, FAR, 0) for i in ids))

    async def amend(order: list[str], priority: int) -> list[bool]:
        return await store.amend([Amend(i, priority=priority) for i in order])

    async with asyncio.timeout(HANG_GUARD):
        done = await asyncio.gather(*(amend(ids if n % 2 else ids[::-1], n) for n in range(1, 9)))
    assert all(all(flags) for flags in done)
