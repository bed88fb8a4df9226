"""Priorities on ``mongo`` and ``mongo-history``, beyond the conformance file: documents of an
earlier release (no priority field), the index a queue gets only with its first priority,
a factory that opened the queue before that learning of it, reserved messages of a higher
priority not keeping the others back, and foreign priority fields.

Runs on the server of ``tests/mongo_server.py``. No timed assertions: waits are conditions.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from backends import new_token
from mongo_server import MONGO_URL, start_mongo

import aio_keuss
from aio_keuss.message import EMPTY_HEADERS, encode_payload
from aio_keuss.mongo import connection
from aio_keuss.mongo.store import _priority

pymongo = pytest.importorskip("pymongo")

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.parametrize("backend", ["mongo", "mongo-history"]),
]

Open = Callable[[], Awaitable[aio_keuss.Factory]]
PRIORITY_KEYS = ["raised", "lowered", "mature"]


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    reason = start_mongo()
    if reason:
        pytest.skip(reason)
    client = pymongo.AsyncMongoClient(MONGO_URL, tz_aware=True)
    yield client
    await client.close()


@pytest.fixture
async def database(client: Any) -> AsyncIterator[str]:
    name = f"akt_{new_token()}"
    yield name
    await client.drop_database(name)


@pytest.fixture
async def open_factory(backend: str, database: str) -> AsyncIterator[Open]:
    opened: list[aio_keuss.Factory] = []

    async def _open() -> aio_keuss.Factory:
        factory = await aio_keuss.connect(
            backend, url=MONGO_URL, database=database, poll_interval=30.0, reserve_delay=600
        )
        opened.append(factory)
        return factory

    yield _open
    for factory in opened:
        await factory.close()


def _collection(client: Any, database: str, backend: str, queue: str) -> Any:
    prefix = "keuss_history" if backend == "mongo-history" else "keuss"
    return client[database][f"{prefix}_q_{queue}"]


async def _has_priority_index(coll: Any) -> bool:
    indexes = await coll.index_information()
    return any([k for k, _ in ix["key"]] == PRIORITY_KEYS for ix in indexes.values())


async def test_documents_of_an_earlier_release_read_as_priority_0(
    open_factory: Open, client: Any, database: str, backend: str
) -> None:
    q = await (await open_factory()).queue("old")
    coll = _collection(client, database, backend, "old")
    past = time.time() - 60
    old = [
        {
            "_id": f"old-{n}",
            "payload": encode_payload(f"old {n}"),
            "headers": EMPTY_HEADERS,
            "mature": past + n,
            "tries": 0,
            "reserved": False,
        }
        for n in range(3)
    ]
    await coll.insert_many(old)
    await q.push("low", priority=-1)
    await q.push("high", priority=1)
    got = [await q.reserve(timeout=5) for _ in range(5)]
    assert [(m.payload, m.priority) for m in got if m is not None] == [
        ("high", 1),
        ("old 0", 0),
        ("old 1", 0),
        ("old 2", 0),
        ("low", -1),
    ]
    # they stay as they were written: no priority field added to them
    assert await coll.count_documents({"_id": {"$in": ["old-0", "old-1", "old-2"]}}) == 3
    assert await coll.count_documents({"raised": {"$exists": True}}) == 1
    assert await coll.count_documents({"lowered": {"$exists": True}}) == 1


async def test_a_queue_gets_the_priority_index_with_its_first_priority_only(
    open_factory: Open, client: Any, database: str, backend: str
) -> None:
    factory = await open_factory()
    q = await factory.queue("plain")
    coll = _collection(client, database, backend, "plain")
    await q.push_many(["a", "b"])
    assert [m.payload for m in await q.pop_many(2, timeout=5)] == ["a", "b"]
    assert not await _has_priority_index(coll)
    await q.push("c", priority=2)
    assert await _has_priority_index(coll)
    # a move carries it to its destination, and the index with it
    first = await factory.queue("first")
    await first.push("moved", priority=-4)
    held = await first.reserve(timeout=5)
    assert held is not None and await first.move(held, "second") is not None
    assert await _has_priority_index(_collection(client, database, backend, "second"))
    arrived = await (await factory.queue("second")).pop(timeout=5)
    assert arrived is not None and (arrived.payload, arrived.priority) == ("moved", -4)


async def test_a_factory_that_opened_the_queue_before_its_first_priority_learns_of_it(
    open_factory: Open, monkeypatch: pytest.MonkeyPatch
) -> None:
    # its looks: at most one per PRIORITY_LOOK, here one per take
    monkeypatch.setattr(connection, "PRIORITY_LOOK", 0.0)
    consumer = await (await open_factory()).queue("late")
    assert await consumer.pop(timeout=0) is None  # it looked: no priorities then
    producer = await (await open_factory()).queue("late")
    await producer.push("plain")
    await producer.push("urgent", priority=3)
    first = await consumer.pop(timeout=5)
    assert first is not None and (first.payload, first.priority) == ("urgent", 3)


async def test_reserved_messages_of_a_higher_priority_do_not_keep_the_others_back(
    open_factory: Open,
) -> None:
    q = await (await open_factory()).queue("walk")
    await q.push_many(list(range(40)), priority=9)
    await q.push_many(list(range(40)), priority=5, delay=600)
    held = await q.reserve_many(40, timeout=5)
    assert len(held) == 40 and {m.priority for m in held} == {9}
    await q.push("plain")
    await q.push("lower", priority=-2)
    got = await q.reserve_many(5, timeout=5)
    assert [(m.payload, m.priority) for m in got] == [("plain", 0), ("lower", -2)]
    for m in held[:3]:  # a ko puts one back ahead of the plain ones again
        assert await q.ko(m)
    again = await q.reserve_many(2, timeout=5)
    assert [m.priority for m in again] == [9, 9]


async def test_a_foreign_priority_field_reads_as_a_sane_priority(backend: str) -> None:
    assert _priority({}) == 0
    assert _priority({"raised": 7}) == 7 and _priority({"lowered": 7}) == -7
    assert _priority({"raised": 2**40}) == 2**15 - 1
    assert _priority({"lowered": 2**40}) == -(2**15)
    for odd in ("7", 7.5, True, None, -3, 0, [1]):
        assert _priority({"raised": odd}) == 0
        assert _priority({"lowered": odd}) == 0
