"""The MongoDB result store (``aio_keuss.mongo.results``): one document per (queue, id) in
``<prefix>_results``, written by one bulk of upserts, read by one find, expiring on read
at once and reclaimed by a TTL index and by the store's own bounded sweeps. Runs on the
server of ``tests/mongo_server.py``, each test in a database of its own."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from backends import new_token
from mongo_server import MONGO_URL, start_mongo
from polling import until

import aio_keuss
from aio_keuss.mongo import results as results_module
from aio_keuss.mongo.results import MAX_BODY_BYTES, MongoResults, result_key

pymongo = pytest.importorskip("pymongo")

pytestmark = pytest.mark.timeout(180)

BACKENDS = ["mongo", "mongo-history", "bucket-mongo"]

POLL_GUARD = 120.0
"""Hang guard of a wait for what a store does in its own time (an expiry)."""


@pytest.fixture
def database() -> str:
    reason = start_mongo()
    if reason:
        pytest.skip(reason)
    return f"akt_{new_token()}"


class Commands(pymongo.monitoring.CommandListener):
    """The commands sent on the results collection, by name."""

    def __init__(self) -> None:
        self.collection = ""
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def started(self, event: Any) -> None:
        command = event.command
        name = event.command_name
        target = command.get("collection") if name == "getMore" else command.get(name)
        if target == self.collection:
            self.sent.append((name, dict(command)))

    def succeeded(self, event: Any) -> None:
        pass

    def failed(self, event: Any) -> None:
        pass

    def names(self) -> list[str]:
        return [name for name, _ in self.sent]


@pytest.fixture
def commands() -> Commands:
    return Commands()


@pytest.fixture
async def client(database: str, commands: Commands) -> AsyncIterator[Any]:
    client = pymongo.AsyncMongoClient(MONGO_URL, tz_aware=True, event_listeners=[commands])
    yield client
    await client.drop_database(database)
    await client.close()


Open = Callable[..., Awaitable[MongoResults]]


@pytest.fixture
async def open_store(database: str, client: Any, commands: Commands) -> AsyncIterator[Open]:
    """A factory's backend's result store, opened; the backend on the monitored client."""
    opened: list[tuple[aio_keuss.Factory, MongoResults]] = []

    async def _open(backend: str = "mongo") -> MongoResults:
        factory = await aio_keuss.connect(backend, client=client, database=database)
        store = factory.backend.result_store()
        assert isinstance(store, MongoResults)
        commands.collection = factory.backend.collection("results").name
        await store.open()
        opened.append((factory, store))
        return store

    yield _open
    for factory, store in opened:
        await store.close()
        await factory.close()


async def swept(store: MongoResults) -> None:
    """Wait for the background sweep a put started, so its commands are not counted."""
    if store._sweeping is not None:
        await store._sweeping


@pytest.mark.parametrize("backend", BACKENDS)
async def test_every_mongo_backend_keeps_results_in_its_results_collection(
    database: str, client: Any, open_store: Open, backend: str
) -> None:
    async with aio_keuss.connect(backend, client=client, database=database) as factory:
        assert factory.capabilities.results
    store = await open_store(backend)
    await store.put("jobs", [("a", b"\x00body\xff")], 60.0)
    assert await store.get("jobs", ["a", "b"]) == [b"\x00body\xff", None]
    (doc,) = await client[database][store._coll.name].find({}).to_list()
    assert doc["_id"] == "jobs/a" and doc["body"] == b"\x00body\xff"
    assert doc["expires"].timestamp() == pytest.approx(time.time() + 60, abs=30)
    indexes = await client[database][store._coll.name].index_information()
    assert any(
        ix.get("expireAfterSeconds") == 0 and [k for k, _ in ix["key"]] == ["expires"]
        for ix in indexes.values()
    )


async def test_many_ids_go_in_one_command_and_come_back_in_one(
    open_store: Open, commands: Commands
) -> None:
    store = await open_store()
    ids = [f"id-{n}" for n in range(500)]
    commands.sent.clear()
    await store.put("many", [(i, i.encode()) for i in ids], 60.0)
    assert commands.names() == ["update"]
    assert commands.sent[0][1]["ordered"] is False
    await swept(store)
    commands.sent.clear()
    wanted = [*ids, "missing", ids[0]]
    assert await store.get("many", wanted) == [*(i.encode() for i in ids), None, b"id-0"]
    assert commands.names() == ["find"]


async def test_the_index_is_made_once_per_backend(
    database: str, client: Any, commands: Commands
) -> None:
    async with aio_keuss.connect("mongo", client=client, database=database) as factory:
        commands.collection = factory.backend.collection("results").name
        stores = [factory.backend.result_store() for _ in range(3)]
        try:
            await asyncio.gather(*(store.open() for store in stores))
            await asyncio.gather(*(store.put("q", [("a", b"x")], 60.0) for store in stores))
            assert commands.names().count("createIndexes") == 1
        finally:
            for store in stores:
                await store.close()


async def test_a_second_put_replaces_the_first_and_its_expiry(open_store: Open) -> None:
    store = await open_store()
    await store.put("q", [("a", b"first"), ("b", b"kept")], 0.05)
    await store.put("q", [("a", b"second")], 600.0)
    await store.put("q", [("c", b"one"), ("c", b"two")], 600.0)  # the last of an id wins
    await asyncio.sleep(0.2)
    assert await store.get("q", ["a", "c"]) == [b"second", b"two"]
    await store.put("q", [("a", b"third")], 0.05)  # a shorter ttl than the one replaced

    async def gone() -> bool:
        return await store.get("q", ["a", "b"]) == [None, None]

    await until(gone, POLL_GUARD)
    assert await store.get("q", ["c"]) == [b"two"]


async def test_queues_and_ids_that_a_plain_join_would_mix_stay_apart(open_store: Open) -> None:
    store = await open_store()
    await store.put("q1", [("a:b", b"1"), ("a/b", b"2")], 60.0)
    await store.put("q1:a", [("b", b"3")], 60.0)
    await store.put("q1.a", [("b", b"4")], 60.0)
    assert await store.get("q1", ["a:b", "a/b", "b"]) == [b"1", b"2", None]
    assert await store.get("q1:a", ["b", "a:b"]) == [b"3", None]
    assert await store.get("q1.a", ["b"]) == [b"4"]
    assert await store.get("q2", ["a:b"]) == [None]
    assert result_key("q1", "a:b") != result_key("q1:a", "b")


async def without_ttl_index(client: Any, database: str, store: MongoResults) -> None:
    """Drop the TTL index, as on a server whose TTL monitor never runs (the test server's
    deletes expired documents within a fraction of a second): only sweeps reclaim."""
    coll = client[database][store._coll.name]
    for name, index in (await coll.index_information()).items():
        if "expireAfterSeconds" in index:
            await coll.drop_index(name)


async def test_expired_results_are_never_read_and_the_sweep_deletes_them(
    database: str, client: Any, open_store: Open
) -> None:
    store = await open_store()
    await without_ttl_index(client, database, store)
    store._next_sweep = math.inf  # only the sweep below
    await store.put("short", [(f"s{n}", b"x") for n in range(3)], 0.05)
    await store.put("long", [("l", b"y")], 600.0)

    async def expired() -> bool:
        return await store.get("short", ["s0", "s1", "s2"]) == [None, None, None]

    await until(expired, POLL_GUARD)
    coll = client[database][store._coll.name]
    assert await coll.count_documents({}) == 4  # expired, not read, still there
    assert await store.sweep() == 3
    remaining = await coll.find({}).to_list()
    assert [doc["_id"] for doc in remaining] == ["long/l"]
    assert await store.get("long", ["l"]) == [b"y"]


async def test_a_sweep_deletes_in_bounded_batches(
    database: str,
    client: Any,
    open_store: Open,
    commands: Commands,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(results_module, "SWEEP_BATCH", 40)
    store = await open_store()
    await without_ttl_index(client, database, store)
    store._next_sweep = math.inf  # only the sweep below
    await store.put("many", [(f"id-{n}", b"x") for n in range(100)], 0.05)

    async def expired() -> bool:
        return await store.get("many", ["id-0", "id-99"]) == [None, None]

    await until(expired, POLL_GUARD)
    commands.sent.clear()
    assert await store.sweep() == 100
    finds = [command for name, command in commands.sent if name == "find"]
    deletes = [command for name, command in commands.sent if name == "delete"]
    assert [find["limit"] for find in finds] == [40, 40, 40]
    assert [len(d["deletes"][0]["q"]["_id"]["$in"]) for d in deletes] == [40, 40, 20]


async def test_puts_sweep_in_the_background_at_most_once_per_interval(
    database: str, client: Any, open_store: Open
) -> None:
    store = await open_store()
    await without_ttl_index(client, database, store)
    await store.put("kept", [("x", b"x")], 600.0)  # a store's first put sweeps
    first = store._sweeping
    assert first is not None
    await swept(store)
    await store.put("old", [("a", b"x"), ("b", b"x")], 0.05)

    async def expired() -> bool:
        return await store.get("old", ["a", "b"]) == [None, None]

    await until(expired, POLL_GUARD)
    await store.put("kept", [("c", b"x")], 600.0)  # within the interval: no sweep
    assert store._sweeping is first
    coll = client[database][store._coll.name]
    assert await coll.count_documents({}) == 4
    store._next_sweep = 0.0  # due
    await store.put("kept", [("d", b"x")], 600.0)  # one sweep, that the put does not await
    assert store._sweeping is not first

    async def reclaimed() -> bool:
        return await coll.count_documents({}) == 3

    await until(reclaimed, POLL_GUARD)


async def test_a_body_another_program_stored_is_read_as_bytes(
    database: str, client: Any, open_store: Open
) -> None:
    store = await open_store()
    coll = client[database][store._coll.name]
    await coll.insert_one({"_id": "q/text", "body": "not bytes", "expires": _far()})
    await coll.insert_one({"_id": "q/none", "expires": _far()})
    assert await store.get("q", ["text", "none"]) == [b'"not bytes"', b"null"]


async def test_a_body_past_a_document_s_size_is_refused_before_anything_is_written(
    open_store: Open, commands: Commands
) -> None:
    store = await open_store()
    await swept(store)
    commands.sent.clear()
    too_long = b"x" * (MAX_BODY_BYTES + 1)
    with pytest.raises(aio_keuss.InvalidPayloadError):
        await store.put("big", [("small", b"x"), ("big", too_long)], 60.0)
    assert commands.sent == []
    await store.put("big", [("most", b"x" * MAX_BODY_BYTES)], 60.0)
    assert await store.get("big", ["small", "most"]) == [None, b"x" * MAX_BODY_BYTES]


async def test_errors_leave_as_the_library_s(database: str) -> None:
    """An unreachable server: the driver's ServerSelectionTimeoutError leaves as ours."""
    own = pymongo.AsyncMongoClient(MONGO_URL, tz_aware=True, serverSelectionTimeoutMS=300)
    factory = await aio_keuss.connect("mongo", client=own, database=database)
    store = factory.backend.result_store()
    try:
        await own.close()
        with pytest.raises(aio_keuss.KeussError) as raised:
            await store.put("q", [("a", b"x")], 60.0)
        assert not isinstance(raised.value, pymongo.errors.PyMongoError)
        with pytest.raises(aio_keuss.KeussError):
            await store.get("q", ["a"])
    finally:
        await store.close()
        await factory.close()


def _far() -> datetime:
    return datetime.now(UTC) + timedelta(hours=1)


async def test_a_close_cancelled_while_it_stops_a_sweep_stays_cancelled(
    open_store: Open, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's cancellation (a factory close past its grace) is not taken for the
    sweep's own: it leaves the close as a cancellation, not as a normal return."""
    store = await open_store()
    started = asyncio.Event()

    async def slow_sweep() -> int:
        started.set()
        await asyncio.Event().wait()  # a sweep under way, until cancelled
        return 0

    monkeypatch.setattr(store, "sweep", slow_sweep)
    await store.put("q1", [("a", b"x")], 600.0)  # a store's first put sweeps
    await started.wait()
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)  # the close cancelled the sweep and waits for its end
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    assert closing.cancelled()


async def test_a_replace_uses_up_a_body_an_older_release_wrote_without_a_digest(
    database: str, client: Any, open_store: Open
) -> None:
    """A rolling upgrade: a cancel request written by a release that kept no digest (a
    bare reason, ``$set`` of body and expiry only) is used up by this release's replace,
    as that release used its requests up itself; one this release wrote is still matched
    by its digest only."""
    store = await open_store()
    coll = client[database][store._coll.name]
    await coll.update_one(
        {"_id": result_key(":q", "a")},
        {"$set": {"body": b'"why"', "expires": _far()}},
        upsert=True,
    )
    await store.put(":q", [("b", b"mine")], 600.0)
    await store.replace(":q", [("a", b'"why"', b"false"), ("b", b"other", b"false")], 600.0)
    assert await store.get(":q", ["a", "b"]) == [b"false", b"mine"]
    await store.replace(":q", [("a", b"false", b"again")], 600.0)  # now a digest of its own
    assert await store.get(":q", ["a"]) == [b"again"]
