"""Documents another program inserted into a queue's collection (``insert_one`` of whatever
it likes): delivered as they can be read, marked ``x-undecodable``, or left where they are,
but never failing the batch a pop or reserve has already taken.

Runs on the server of ``tests/mongo_server.py``. Time bounds are generous functional
limits, never performance assertions.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import new_token
from mongo_server import MONGO_URL, start_mongo

import aio_keuss
from aio_keuss import KoResult, Message
from aio_keuss.message import MAX_TRIES

pymongo = pytest.importorskip("pymongo")
bson = pytest.importorskip("bson")

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.parametrize("backend", ["mongo", "mongo-history"]),
]

UNDECODABLE = "x-undecodable"
RAW_HEADERS = "x-raw-headers"


@pytest.fixture
async def factory(backend: str) -> AsyncIterator[aio_keuss.Factory]:
    reason = start_mongo()
    if reason:
        pytest.skip(reason)
    database = f"akt_{new_token()}"
    factory = await aio_keuss.connect(
        backend,
        url=MONGO_URL,
        database=database,
        poll_interval=30.0,
        reserve_delay=600,
        deadletter={"max_ko": 0},
    )
    yield factory
    await factory.close()
    client: Any = pymongo.AsyncMongoClient(MONGO_URL)
    await client.drop_database(database)
    await client.close()


def delivered() -> dict[str, dict[str, Any]]:
    """Foreign documents that can be delivered, by id: the document, and what to expect."""
    past = time.time() - 60
    return {
        "text": {
            "doc": {"payload": "hello", "headers": "not JSON", "mature": past, "tries": 0},
            "payload": b'"hello"',
            "headers": {RAW_HEADERS: "not JSON"},
        },
        "sub-documents": {
            "doc": {"payload": {"a": 1}, "headers": {"k": "v"}, "mature": past, "tries": 0},
            "payload": b'{"a": 1}',
            "headers": {"k": "v"},
        },
        "bare": {  # no payload, headers or reserved flag
            "doc": {"mature": int(past), "tries": 0},
            "payload": b"",
            "headers": {},
        },
        "list-headers": {
            "doc": {"payload": 42, "headers": [1, 2], "mature": past, "tries": 0},
            "payload": b"42",
            "headers": {RAW_HEADERS: "[1, 2]"},
        },
    }


def left() -> list[dict[str, Any]]:
    """Foreign documents never handed out: no mature time. (Documents without a str id or
    a number of tries are not supported: see the store's module documentation.)"""
    doc = {"payload": b"x", "headers": b"{}", "tries": 0, "reserved": False}
    return [{**doc, "_id": "no-mature"}]


async def planted(queue: aio_keuss.Queue) -> tuple[list[str], Any, list[Any]]:
    """Pushed messages around the foreign documents: (pushed ids, the collection, the ids
    of the documents to be left alone)."""
    store: Any = queue._store  # type: ignore[attr-defined]
    client: Any = pymongo.AsyncMongoClient(MONGO_URL)
    coll = client[store._coll.database.name][store._coll.name]
    good = [await queue.push({"n": 0})]
    for message_id, case in delivered().items():
        await coll.insert_one({"_id": message_id, **case["doc"]})
    alone = left()
    for doc in alone:
        await coll.insert_one(doc)
    good.append(await queue.push({"n": 1}, headers={"h": 1}))
    return good, coll, [d["_id"] for d in alone]


def check(got: dict[str, Message], good: list[str]) -> None:
    assert set(got) == {*good, *delivered()}
    assert [got[i].payload for i in good] == [{"n": 0}, {"n": 1}]
    assert got[good[1]].headers == {"h": 1}
    for message_id, case in delivered().items():
        message = got[message_id]
        assert message.payload == case["payload"] and type(message.payload) is bytes
        headers = dict(message.headers)
        assert "payload: " in str(headers.pop(UNDECODABLE)), message
        assert headers == case["headers"], message


async def still_there(coll: Any, alone: list[Any]) -> None:
    """The documents left alone are still in the collection, unchanged, and nothing else."""
    docs = await coll.find({}).to_list()
    live = [d for d in docs if "processed" not in d]
    assert sorted(map(str, (d["_id"] for d in live))) == sorted(map(str, alone))
    assert all("owner" not in d and d["tries"] == 0 for d in live)


async def take(queue: aio_keuss.Queue, how: str, wanted: int) -> dict[str, Message]:
    got: dict[str, Message] = {}
    deadline = time.monotonic() + 30
    while len(got) < wanted and time.monotonic() < deadline:
        if how == "pop_many":
            batch = await queue.pop_many(10, timeout=1)
        elif how == "reserve_many":
            batch = await queue.reserve_many(10, timeout=1)
        else:
            one = await (queue.pop(timeout=1) if how == "pop" else queue.reserve(timeout=1))
            batch = [] if one is None else [one]
        for message in batch:
            assert message.id not in got
            got[message.id] = message
    return got


@pytest.mark.parametrize("how", ["pop_many", "pop"])
async def test_pop_delivers_foreign_documents_and_leaves_what_it_cannot(
    factory: aio_keuss.Factory, how: str
) -> None:
    """``bytes(doc["payload"])`` of a str raised once the batch was claimed and deleted:
    every message of the pop was lost."""
    queue = await factory.queue("q")
    good, coll, alone = await planted(queue)
    got = await take(queue, how, 2 + len(delivered()))
    check(got, good)
    assert await queue.pop(timeout=0) is None
    assert await queue.total_size() == 0
    await still_there(coll, alone)


@pytest.mark.parametrize("how", ["reserve_many", "reserve"])
async def test_reserve_delivers_foreign_documents_which_can_be_ok_ed(
    factory: aio_keuss.Factory, how: str
) -> None:
    """The same read failed a reserve's batch, left reserved to nobody until it lapsed."""
    queue = await factory.queue("q")
    good, coll, alone = await planted(queue)
    got = await take(queue, how, 2 + len(delivered()))
    check(got, good)
    assert await queue.reserve(timeout=0) is None
    dl = await factory.queue("__deadletter__")
    for message_id, message in got.items():
        if message_id == "sub-documents":  # its headers get the deadletter's
            assert await queue.ko(message) is KoResult.DEADLETTERED
        else:
            assert await queue.ok(message), message_id
    dead = await dl.pop(timeout=30)
    assert dead is not None and dead.payload == b'{"a": 1}'
    assert dead.headers["k"] == "v" and dead.headers["x-dl-from-queue"] == "q"
    assert await queue.total_size() == 0
    await still_there(coll, alone)


async def test_peek_and_browse_show_foreign_documents(factory: aio_keuss.Factory) -> None:
    queue = await factory.queue("q")
    good, _, _ = await planted(queue)
    seen = {v.message.id: v.message for v in await queue.peek(20, state="all")}
    check(seen, good)
    ready = {v.message.id: v.message for v in await queue.peek(20, state="ready")}
    check(ready, good)
    walked = [v.message.id async for v in queue.browse(page_size=2)]
    assert sorted(walked) == sorted(seen)
    for message_id in delivered():
        view = await queue.find(message_id)
        assert view is not None and view.message == seen[message_id]
    assert await queue.find("no-mature") is None


ODD_TRIES = {
    "a fraction": (2.5, 2),
    "a whole float": (3.0, 3),
    "past an int32": (2**40, MAX_TRIES),
    "the largest int64": (bson.int64.Int64(2**63 - 1), MAX_TRIES),
    "negative": (-4, 0),
    "NaN": (math.nan, 0),
    "infinite": (math.inf, MAX_TRIES),
    "a Decimal128": (bson.decimal128.Decimal128("3"), 3),
    "a Decimal128 NaN": (bson.decimal128.Decimal128("NaN"), 0),
}
"""Counts another program (or an older version) may have written, and the count each is
delivered with."""


async def plant_odd_tries(queue: aio_keuss.Queue, tries: Any) -> Any:
    """A document whose ``tries`` is ``tries``; skipped where the server cannot store it
    (nx-27017 keeps documents as JSON: no NaN, no infinity, no Decimal128)."""
    store: Any = queue._store  # type: ignore[attr-defined]
    client: Any = pymongo.AsyncMongoClient(MONGO_URL)
    coll = client[store._coll.database.name][store._coll.name]
    doc = {"_id": "odd", "payload": b"x", "headers": b"{}", "mature": time.time() - 60}
    try:
        await coll.insert_one({**doc, "tries": tries, "reserved": False})
    except pymongo.errors.WriteError as exc:
        await client.close()
        pytest.skip(f"the server cannot store {tries!r}: {exc}")
    return client, coll


@pytest.mark.parametrize("odd", ODD_TRIES, ids=list(ODD_TRIES))
async def test_a_count_of_tries_no_int_is_read_sanely_and_can_be_ok_ed(
    factory: aio_keuss.Factory, odd: str
) -> None:
    """A reserve handed ``int(tries)`` and the ok's guard then looked for that + 1: a
    fraction was never ok-ed (delivered again at every lapse), a count past 2**31 - 1
    failed the ok as invalid input, NaN or a Decimal128 failed the reserve itself. A count
    is now read as the nearest sane one (NaN as 0) and stored so once reserved."""
    stored, expected = ODD_TRIES[odd]
    queue = await factory.queue("q")
    client, _ = await plant_odd_tries(queue, stored)
    try:
        seen = await queue.peek(5, state="all")
        assert [v.message.tries for v in seen] == [expected]
        message = await queue.reserve(timeout=1)
        assert message is not None and message.id == "odd" and message.tries == expected
        assert await queue.ok(message)
        assert await queue.total_size() == 0
    finally:
        await client.close()


@pytest.mark.parametrize("odd", ODD_TRIES, ids=list(ODD_TRIES))
async def test_a_count_of_tries_no_int_is_ko_ed_and_popped(
    factory: aio_keuss.Factory, odd: str
) -> None:
    """A ko of such a message counts on from the sane count (here past ``max_ko`` 0: to the
    deadletter queue), and a pop hands it over with that count."""
    stored, expected = ODD_TRIES[odd]
    queue = await factory.queue("q")
    client, coll = await plant_odd_tries(queue, stored)
    try:
        message = await queue.reserve(timeout=1)
        assert message is not None and message.tries == expected
        assert await queue.ko(message) is KoResult.DEADLETTERED
        dead = await (await factory.queue("__deadletter__")).pop(timeout=1)
        assert dead is not None and dead.payload == b"x"
        await coll.delete_many({})
        await coll.insert_one(
            {"_id": "odd", "payload": b"x", "mature": time.time() - 60, "tries": stored}
        )
        popped = await queue.pop(timeout=1)
        assert popped is not None and popped.tries == expected
        assert await queue.total_size() == 0
    finally:
        await client.close()
