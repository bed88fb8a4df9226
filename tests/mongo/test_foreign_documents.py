"""Documents another program inserted into a queue's collection (``insert_one`` of whatever
it likes): delivered as they can be read, marked ``x-undecodable``, or left where they are,
but never failing the batch a pop or reserve has already taken.

Runs on the server of ``tests/mongo_server.py``. Time bounds are generous functional
limits, never performance assertions.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import new_token
from mongo_server import MONGO_URL, start_mongo

import aio_keuss
from aio_keuss import KoResult, Message

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
