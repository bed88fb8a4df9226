"""MongoDB-specific behaviour of ``mongo`` and ``mongo-history``: wake-ups across OS processes
through the signal bus, history records and their TTL index, stats from a second factory,
dedup after consumption, the deadletter move, claims shared by two factories, errors.

Runs on the server of ``tests/mongo_server.py`` (nx-27017 started on demand, or AK_MONGO_URL).
Tests needing what nx-27017 lacks (capped collections, real transactions) run only when
``AK_MONGO_URL`` points at a real mongod.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from backends import ko_through_a_cut_close, new_token
from mongo_copies import copies_refused
from mongo_server import MONGO_URL, REAL_MONGO_URL, start_mongo
from polling import until

import aio_keuss
from aio_keuss import KoResult
from aio_keuss.contract import Ack, Entry, Held
from aio_keuss.message import EMPTY_HEADERS, encode_payload
from aio_keuss.mongo import store as store_module

pymongo = pytest.importorskip("pymongo")

pytestmark = pytest.mark.timeout(120)

Open = Callable[..., Awaitable[aio_keuss.Factory]]
needs_real_mongod = pytest.mark.skipif(
    REAL_MONGO_URL is None, reason="needs a real mongod (set AK_MONGO_URL)"
)


@pytest.fixture
def database() -> str:
    reason = start_mongo()
    if reason:
        pytest.skip(reason)
    return f"akt_{new_token()}"


@pytest.fixture
async def client(database: str) -> AsyncIterator[Any]:
    client = pymongo.AsyncMongoClient(MONGO_URL, tz_aware=True)
    yield client
    await client.drop_database(database)
    await client.close()


@pytest.fixture
async def open_factory(database: str, client: Any) -> AsyncIterator[Open]:
    opened: list[aio_keuss.Factory] = []

    async def _open(backend: str = "mongo", **options: Any) -> aio_keuss.Factory:
        factory = await aio_keuss.connect(
            backend, url=MONGO_URL, database=database, **{"poll_interval": 30.0, **options}
        )
        opened.append(factory)
        return factory

    yield _open
    for factory in opened:
        await factory.close()


_CONSUMER = r"""
import asyncio, json, sys, time
import aio_keuss

async def main(url, database):
    async with aio_keuss.connect("mongo", url=url, database=database, poll_interval=30.0) as f:
        q = await f.queue("wake")
        print("ready", flush=True)
        message = await q.pop(timeout=20)
        print(json.dumps({"latency": time.time() - message.payload}), flush=True)

asyncio.run(main(*sys.argv[1:]))
"""


async def test_consumer_in_another_process_wakes_on_push(open_factory: Open, database: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CONSUMER, MONGO_URL, database, stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    try:
        assert (await asyncio.wait_for(process.stdout.readline(), 30)).strip() == b"ready"
        await asyncio.sleep(0.3)  # it is waiting now (poll_interval 30 s: only a signal wakes it)
        q = await (await open_factory()).queue("wake")
        await q.push(time.time())
        line = await asyncio.wait_for(process.stdout.readline(), 10)
        latency = json.loads(line)["latency"]
        # woken, not polled (the poll interval is 30 s): typically a few ms, but a busy
        # machine may take seconds to push, deliver and fetch, so the bound is generous
        assert latency < 15.0, latency
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_history_keeps_processed_records_with_a_ttl_index(
    open_factory: Open, client: Any, database: str
) -> None:
    factory = await open_factory("mongo-history", history_ttl=3600)
    q = await factory.queue("hist")
    popped_id = await q.push("popped")
    committed_id = await q.push("committed")
    await q.push("waiting", delay=60)
    assert (await q.pop(timeout=1)).id == popped_id  # type: ignore[union-attr]
    message = await q.reserve(timeout=1)
    assert message is not None and message.id == committed_id
    assert await q.ok(message) is True
    assert (await q.sizes()).total == 1 and await q.size() == 0
    nmt = await q.next_mature_t()
    assert nmt is not None and nmt.year < 9999  # processed records do not count
    coll = client[database]["keuss_history_q_hist"]
    records = {d["_id"]: d async for d in coll.find({"processed": {"$exists": True}})}
    assert set(records) == {popped_id, committed_id}
    assert all(not r["reserved"] for r in records.values())
    ttl = [i async for i in await coll.list_indexes() if "expireAfterSeconds" in i]
    assert [(dict(i["key"]), i["expireAfterSeconds"]) for i in ttl] == [({"processed": 1}, 3600)]
    # an id coming back after the dedup window moves the old record aside, keeping both
    q2 = await factory.queue("hist2", dedup_window=0.01)
    await q2.push("first", id="order-1")
    assert (await q2.pop(timeout=1)).payload == "first"  # type: ignore[union-attr]
    await asyncio.sleep(0.05)
    await q2.push("second", id="order-1")
    assert (await q2.pop(timeout=1)).payload == "second"  # type: ignore[union-attr]
    kept = [d async for d in client[database]["keuss_history_q_hist2"].find({})]
    assert len(kept) == 2 and all("processed" in d for d in kept)


async def test_stats_and_list_from_a_second_factory(open_factory: Open) -> None:
    first = await open_factory()
    q = await first.queue("counted", reserve_delay=42.0)
    await q.push_many([1, 2, 3])
    message = await q.reserve(timeout=1)
    assert message is not None and await q.ok(message)
    await q.pause()
    second = await open_factory()
    listed = await second.list()  # the options are stored when the queue is opened
    assert listed["counted"]["reserve_delay"] == 42.0
    other = await second.queue("counted", reserve_delay=42.0)

    async def flushed() -> bool:
        stats = await other.stats()
        return stats["put"] + stats["reserve"] + stats["commit"] >= 5

    # The first factory's counts reach the database at its stats flushes (every 0.1 s),
    # which a busy machine can hold up; the guard only keeps a flush that never comes from
    # hanging the suite.
    await until(flushed, guard=30.0)
    stats = await other.stats()
    assert (stats["put"], stats["reserve"], stats["commit"]) == (3, 1, 1)
    assert await other.is_paused() is True


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_dedup_after_consumption(open_factory: Open, backend: str) -> None:
    q = await (await open_factory(backend)).queue("dedup")
    await q.push("once", id="k")
    message = await q.reserve(timeout=1)
    assert message is not None and await q.ok(message)
    await q.push("twice", id="k")  # consumed, but within the dedup window
    assert await q.total_size() == 0
    # another factory (another client) is refused too: the window lives in the database
    other = await (await open_factory(backend)).queue("dedup")
    await other.push("thrice", id="k")
    assert await other.total_size() == 0


def fail_next_insert(
    q: aio_keuss.Queue,
    stored: int = 0,
    meanwhile: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """The queue's next insert_many stores its first ``stored`` documents, then fails as a
    lost connection does (after ``meanwhile``: what others do before the reply would have
    come); the ones after it work."""
    messages = q._store._coll  # type: ignore[attr-defined]
    real_insert = messages.insert_many

    async def lost(docs: list[Any], *args: Any, **kwargs: Any) -> Any:
        messages.insert_many = real_insert
        if stored:
            await real_insert(docs[:stored], *args, **kwargs)
        if meanwhile is not None:
            await meanwhile()
        raise pymongo.errors.AutoReconnect("injected: connection closed")

    messages.insert_many = lost


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_failed_push_with_an_id_can_be_retried(open_factory: Open, backend: str) -> None:
    """The id is claimed in the dedup collection before the message is inserted: when the
    insert fails (the connection lost between the two), the push raises and its claim is
    given back, so retrying the same idempotent push stores the message (not a silent
    no-op that loses it)."""
    q = await (await open_factory(backend)).queue("retry")
    fail_next_insert(q)
    with pytest.raises(aio_keuss.KeussConnectionError):
        await q.push({"order": 17}, id="order-17")
    assert await q.push({"order": 17}, id="order-17") == "order-17"
    message = await q.reserve(timeout=1)
    assert message is not None and message.payload == {"order": 17}
    assert await q.ok(message)
    await q.push({"order": 17}, id="order-17")  # and the window holds again
    assert await q.total_size() == 0


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_partly_failed_push_keeps_the_claims_of_what_went_in(
    open_factory: Open, backend: str
) -> None:
    """A batch goes in as several server messages; when a later one failed, every claim of
    the call was given back, those of the messages stored included: once such a message
    was consumed, the retry of the push stored it a second time."""
    q = await (await open_factory(backend)).queue("partial")
    fail_next_insert(q, stored=1)
    with pytest.raises(aio_keuss.KeussConnectionError):
        await q.push_many(["a", "b"], ids=["a", "b"])
    first = await q.pop(timeout=1)
    assert first is not None and first.id == "a"  # went in, and is consumed
    await q.push_many(["a", "b"], ids=["a", "b"])  # the retry: "a" is refused
    second = await q.pop(timeout=1)
    assert second is not None and second.id == "b"
    assert await q.total_size() == 0


async def test_a_stored_message_consumed_before_the_give_back_looked_stays_refused(
    open_factory: Open,
) -> None:
    """mongo-history: a batch's insert stored its first message, then failed, and another
    consumer took that message before the push gave its claims back. The give-back looked
    for live records only, took the consumed one for a message never stored and gave its
    claim back: the retry stored it a second time. The record it keeps tells."""
    q = await (await open_factory("mongo-history")).queue("eaten")
    other = await (await open_factory("mongo-history")).queue("eaten")
    taken: list[aio_keuss.Message | None] = []

    async def another_consumer() -> None:
        taken.append(await other.pop(timeout=1))

    fail_next_insert(q, stored=1, meanwhile=another_consumer)
    with pytest.raises(aio_keuss.KeussConnectionError):
        await q.push_many(["a", "b"], ids=["a", "b"])
    assert taken[0] is not None and taken[0].id == "a"
    await q.push_many(["a", "b"], ids=["a", "b"])  # the retry: "a" is refused
    second = await q.pop(timeout=1)
    assert second is not None and second.id == "b"
    assert await q.total_size() == 0


async def test_a_message_consumed_in_the_millisecond_its_push_began_stays_refused(
    open_factory: Open, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mongo-history: as above, the consumer taking the message in the millisecond the push
    began, after it. The give-back compared the record's processed time, which MongoDB
    keeps to the millisecond (truncated), with the push's start to the microsecond: the
    record looked older than the push, its claim was given back and the retry stored the
    message a second time. The clock is set by hand: the push begins 0.2 ms into a
    millisecond, the consumer takes the message 0.7 ms into it."""
    q = await (await open_factory("mongo-history")).queue("eaten")
    other = await (await open_factory("mongo-history")).queue("eaten")
    start = float(math.floor(time.time()))  # a whole second: its milliseconds are exact
    clock = SimpleNamespace(now=start + 0.0002)
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time=lambda: clock.now))
    taken: list[aio_keuss.Message | None] = []

    async def another_consumer() -> None:
        clock.now = start + 0.0007
        taken.append(await other.pop(timeout=1))

    fail_next_insert(q, stored=1, meanwhile=another_consumer)
    with pytest.raises(aio_keuss.KeussConnectionError):
        await q.push_many(["a", "b"], ids=["a", "b"])
    assert taken[0] is not None and taken[0].id == "a"
    monkeypatch.setattr(store_module, "time", time)  # the clock runs again: "b" matures
    await q.push_many(["a", "b"], ids=["a", "b"])  # the retry: "a" is refused
    second = await q.pop(timeout=1)
    assert second is not None and second.id == "b"
    assert await q.total_size() == 0


async def test_a_failed_push_of_an_id_whose_consumed_record_is_kept_can_be_retried(
    open_factory: Open,
) -> None:
    """mongo-history keeps a consumed message's record under its id. When the push of that id
    again (past its dedup window) failed before anything went in, the give-back found the
    consumed record, took it for the new message and kept the claim: the retry was refused
    as a duplicate and the message was never stored."""
    q = await (await open_factory("mongo-history")).queue("again", dedup_window=0.5)
    await q.push("first", id="order-1")
    first = await q.pop(timeout=1)
    assert first is not None and first.payload == "first"  # its record stays, processed
    await asyncio.sleep(0.6)  # the dedup window ends
    fail_next_insert(q)
    with pytest.raises(aio_keuss.KeussConnectionError):
        await q.push("second", id="order-1")
    await q.push("second", id="order-1")  # the retry
    second = await q.pop(timeout=1)
    assert second is not None and second.payload == "second"


async def plant_claim(q: aio_keuss.Queue, message_id: str, *, pending: float | None) -> None:
    """An id claim as another process's push writes it: ``pending`` seconds from now to the
    end of its lease (negative: past it), None = settled (its message was stored)."""
    now = time.time()
    claim: dict[str, Any] = {
        "_id": message_id,
        "expires": store_module._date(now + 3600),
        "by": "another-process",
        "since": store_module._date(now - 60),
    }
    if pending is not None:
        claim["pending"] = store_module._date(now + pending)
    await q._store._dedup.insert_one(claim)  # type: ignore[attr-defined]


async def plant_message(q: aio_keuss.Queue, message_id: str, payload: str) -> None:
    """A message stored by that other process's insert, without going through a claim."""
    entry = Entry(message_id, encode_payload(payload), EMPTY_HEADERS)
    assert await q._store.insert([entry]) == [True]  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_claim_whose_pusher_died_before_its_insert_does_not_refuse_the_retry(
    open_factory: Open, backend: str
) -> None:
    """Without transactions a push of an id of its own claims the id, then inserts. A process
    that died between the two (a Spark executor lost mid-task) left its claim for the whole
    dedup window: the retry of the same rows was refused as duplicates, and the messages
    were never stored. Past its lease such a claim is taken over when its message is not in
    the queue."""
    q = await (await open_factory(backend)).queue("died")
    await plant_claim(q, "order-1", pending=-1.0)
    await plant_claim(q, "order-2", pending=-1.0)
    assert await q.push_many(["one", "two"], ids=["order-1", "order-2"]) == ["order-1", "order-2"]
    got = await q.pop_many(10, timeout=1)
    assert sorted(m.payload for m in got) == ["one", "two"]
    await q.push("again", id="order-1")  # now settled: the window holds again
    assert await q.total_size() == 0


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_lapsed_claim_whose_message_went_in_still_refuses(
    open_factory: Open, backend: str
) -> None:
    """The pusher died after its insert but before settling its claim: the message is in the
    queue (or, kept as history, was consumed since the claim), so the id stays refused."""
    q = await (await open_factory(backend)).queue("landed")
    await plant_claim(q, "live", pending=-1.0)
    await plant_message(q, "live", "first")
    await q.push("second", id="live")
    assert await q.total_size() == 1
    if backend == "mongo-history":
        consumed = await q.pop(timeout=1)
        assert consumed is not None and consumed.payload == "first"
        await q._store._dedup.delete_one({"_id": "live"})  # type: ignore[attr-defined]
        await plant_claim(q, "live", pending=-1.0)  # made a minute before that pop
        await q.push("third", id="live")
        assert await q.total_size() == 0


@pytest.mark.parametrize("outcome", ["stored", "given back"])
async def test_a_push_waits_for_a_claim_still_pending_and_follows_its_outcome(
    open_factory: Open, outcome: str
) -> None:
    """A claim within its lease belongs to a push still under way, whose insert may yet fail
    or never come (its process dying): refusing the id then would lose the message if the
    other push does not store it (a Spark task and its speculative twin). The push waits:
    refused once the other settles its claim, stored once it gives the claim back."""
    q = await (await open_factory("mongo")).queue("pending")
    await plant_claim(q, "job", pending=60.0)
    pushing = asyncio.ensure_future(q.push("mine", id="job"))
    await asyncio.sleep(0.1)
    assert not pushing.done()  # held while the other push is under way
    dedup = q._store._dedup  # type: ignore[attr-defined]
    if outcome == "stored":
        await plant_message(q, "job", "theirs")
        await dedup.update_one({"_id": "job"}, {"$unset": {"pending": ""}})
    else:
        await dedup.delete_one({"_id": "job"})
    assert await asyncio.wait_for(pushing, 30) == "job"
    message = await q.pop(timeout=1)
    assert message is not None and message.payload == ("theirs" if outcome == "stored" else "mine")
    assert await q.total_size() == 0


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_pending_claim_from_a_clock_ahead_holds_a_push_no_longer_than_the_lease(
    open_factory: Open, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim's lease end is written from its pusher's clock: a pusher a day ahead that
    stalled (or died) between claim and insert held every push of that id for a day and
    the lease. A push now waits for a pending claim at most the lease from when it first
    met it (its own monotonic clock), then takes it over as it does a lapsed one. The
    lease is shortened to keep the test short; the claim is written under the usual one."""
    ahead = await (await open_factory(backend)).queue("skew")
    q = await (await open_factory(backend)).queue("skew")
    store = ahead._store  # type: ignore[attr-defined]
    claimed, never = asyncio.Event(), asyncio.Event()

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        claimed.set()
        await never.wait()

    store._coll.insert_many = stalled
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time=lambda: time.time() + 86400))
    stuck = asyncio.ensure_future(ahead.push("theirs", id="job"))
    await asyncio.wait_for(claimed.wait(), 30)
    monkeypatch.setattr(store_module, "time", time)
    monkeypatch.setattr(store_module, "DEDUP_LEASE", 1.0)
    try:
        assert await asyncio.wait_for(q.push("mine", id="job"), 60) == "job"
        message = await q.pop(timeout=1)
        assert message is not None and message.payload == "mine"
    finally:
        never.set()  # the stalled pusher goes on: its claim is not its own any more
        await asyncio.wait_for(stuck, 30)


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_reservation_given_back_by_a_consumer_whose_clock_is_ahead_is_ready_at_once(
    open_factory: Open, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reservation nobody saw (the consumer closing, its caller cancelled) goes back with
    no try counted, due at once: at the giver's clock, which a day ahead kept the message
    from every other consumer for a day. It is now due at the server's time when the
    giver's clock is ahead of it."""
    closing = await open_factory(backend)
    ahead = await closing.queue("given")
    other = await (await open_factory(backend)).queue("given")
    await other.push("job")
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time=lambda: time.time() + 86400))
    held = await ahead.reserve(timeout=0)
    assert held is not None and held.tries == 0
    await closing.close()  # gives back what it holds
    monkeypatch.setattr(store_module, "time", time)
    again = await other.reserve(timeout=0)
    assert again is not None and again.id == held.id and again.tries == 0
    assert await other.ok(again)


async def test_two_pushes_of_the_same_ids_each_holding_some_do_not_wait_out_the_lease(
    open_factory: Open,
) -> None:
    """A server runs the inserts of two ``insert_many`` side by side (a Spark task and its
    speculative twin pushing the same rows): each push can claim some of the ids and meet
    the other's pending claims on the rest. Each waited for the other's outcome before
    inserting anything of its own: both waited out the 30 s lease, then took the other for
    dead. Each now stores what it holds before waiting for the rest."""
    q = await (await open_factory("mongo")).queue("twins")
    twin = await (await open_factory("mongo")).queue("twins")
    dedup, twin_dedup = q._store._dedup, twin._store._dedup  # type: ignore[attr-defined]
    real, twin_real = dedup.insert_many, twin_dedup.insert_many
    twin_push: asyncio.Future[asyncio.Future[list[str]]] = asyncio.Future()
    twin_claimed = asyncio.Event()

    async def twin_claims(*args: Any, **kwargs: Any) -> Any:
        twin_dedup.insert_many = twin_real
        try:
            return await twin_real(*args, **kwargs)
        finally:
            twin_claimed.set()

    async def side_by_side(docs: list[Any], **kwargs: Any) -> Any:
        dedup.insert_many = real
        refused = []
        for k, doc in enumerate(docs):
            try:
                await dedup.insert_one(doc)
            except pymongo.errors.DuplicateKeyError:
                refused.append({"index": k, "code": 11000, "errmsg": "duplicate key"})
            if k == 0:  # the twin's insert goes in between: it claims "b"
                twin_push.set_result(asyncio.ensure_future(twin.push_many(["A2", "B2"], ids=ids)))
                await twin_claimed.wait()
        if refused:
            raise pymongo.errors.BulkWriteError({"writeErrors": refused, "nInserted": 1})

    ids = ["a", "b"]
    dedup.insert_many, twin_dedup.insert_many = side_by_side, twin_claims
    mine = asyncio.ensure_future(q.push_many(["A1", "B1"], ids=ids))
    twins = await asyncio.wait_for(twin_push, 5)
    assert await asyncio.wait_for(asyncio.gather(mine, twins), 10) == [ids, ids]
    got = await q.pop_many(10, timeout=1)
    assert sorted(m.payload for m in got) == ["A1", "B2"]


async def test_two_pushes_settling_the_claims_left_unsettled_do_not_fail(
    open_factory: Open,
) -> None:
    """Claims whose settling failed are settled by the next inserts with ids; two such
    inserts side by side (two batches in flight) each took the list, and the first to go
    on deleted an entry the other had already taken: the push failed with a KeyError."""
    q = await (await open_factory("mongo")).queue("unsettled")
    store = q._store  # type: ignore[attr-defined]
    store._unsettled.update({"earlier-1": ["x1"], "earlier-2": ["x2"]})
    dedup = store._dedup
    real = dedup.update_many

    async def slow(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.2)
        return await real(*args, **kwargs)

    dedup.update_many = slow
    first = asyncio.ensure_future(q.push("a", id="a"))
    await asyncio.sleep(0.1)  # settling the first of the two
    second = asyncio.ensure_future(q.push("b", id="b"))
    assert await asyncio.wait_for(asyncio.gather(first, second), 10) == ["a", "b"]
    assert store._unsettled == {}
    assert await q.total_size() == 2


@pytest.mark.parametrize("how", ["lone", "batch"])
async def test_a_late_reserve_hands_over_the_whole_reserve_delay(
    open_factory: Open, how: str
) -> None:
    """A reservation's end is the client's time at the call's start plus ``reserve_delay``:
    a reserve slowed on its way (a reconnect, a busy pool; here 3 s before its command
    goes out) handed its holder what was left, and another consumer could take the message
    while the first still worked on it. Its reservations now start from the reply."""
    q = await (await open_factory("mongo")).queue("late", reserve_delay=4.0)
    await q.push_many(["a", "b"])
    coll = q._store._coll  # type: ignore[attr-defined]
    name = "find_one_and_update" if how == "lone" else "update_many"
    real = getattr(coll, name)

    async def slowed(*args: Any, **kwargs: Any) -> Any:
        setattr(coll, name, real)
        await asyncio.sleep(3.0)
        return await real(*args, **kwargs)

    setattr(coll, name, slowed)
    if how == "lone":
        got = await q.reserve(timeout=1)
        held = [got] if got is not None else []
    else:
        held = await q.reserve_many(2, timeout=1)
    handed_over = time.time()
    assert held
    for message in held:
        doc = await coll.find_one({"_id": message.id})
        assert doc["mature"] >= handed_over + 4.0 - 1.5  # not 3 s short
        assert await q.ok(message)


async def reserved_late(
    q: aio_keuss.Queue, meanwhile: Callable[[], Awaitable[None]]
) -> aio_keuss.Message | None:
    """A lone reserve of ``q`` whose command is held 1.5 s on its way, longer than the queue's
    ``reserve_delay`` of 1 s, so that its reservation ends before it is made; ``meanwhile``
    runs once the reservation is made, before the reserve renews it."""
    coll = q._store._coll  # type: ignore[attr-defined]
    real_take, real_renew = coll.find_one_and_update, coll.update_many

    async def slowed(*args: Any, **kwargs: Any) -> Any:
        coll.find_one_and_update = real_take
        await asyncio.sleep(1.5)
        return await real_take(*args, **kwargs)

    async def renewed(*args: Any, **kwargs: Any) -> Any:
        coll.update_many = real_renew
        await meanwhile()
        return await real_renew(*args, **kwargs)

    coll.find_one_and_update, coll.update_many = slowed, renewed
    return await q.reserve(timeout=0)


async def test_a_reserve_so_late_that_another_took_its_message_hands_nothing_over(
    open_factory: Open,
) -> None:
    """Its reservation had lapsed by the time the reply came and another consumer holds the
    message: handing it over too would give it to two consumers at once."""
    q = await (await open_factory("mongo")).queue("later", reserve_delay=1.0)
    other = await (await open_factory("mongo")).queue("later", reserve_delay=30.0)
    await q.push("only")
    taken: list[aio_keuss.Message | None] = []

    async def another_first() -> None:
        taken.append(await other.reserve(timeout=5))  # the lapsed reservation, taken

    assert await reserved_late(q, another_first) is None
    assert taken and taken[0] is not None and taken[0].payload == "only"
    assert await other.ok(taken[0])


async def test_a_reserve_later_than_a_short_reserve_delay_hands_over_nothing_taken(
    open_factory: Open,
) -> None:
    """A reserve is late once it took more than half a second, or more than half of a
    shorter ``reserve_delay``: with 0.3 s, one that took 0.4 s handed over a message whose
    reservation had lapsed before the reply came, and which another consumer had taken."""
    q = await (await open_factory("mongo")).queue("short", reserve_delay=0.3)
    other = await (await open_factory("mongo")).queue("short", reserve_delay=30.0)
    await q.push("only")
    coll = q._store._coll  # type: ignore[attr-defined]
    real_take = coll.find_one_and_update
    taken: list[aio_keuss.Message | None] = []

    async def slowed(*args: Any, **kwargs: Any) -> Any:
        coll.find_one_and_update = real_take
        await asyncio.sleep(0.4)  # the reservation ends before it is made
        found = await real_take(*args, **kwargs)
        taken.append(await other.reserve(timeout=0))  # before the reply reaches the first
        return found

    coll.find_one_and_update = slowed
    assert await q.reserve(timeout=0) is None
    assert taken and taken[0] is not None and taken[0].payload == "only"
    assert await other.ok(taken[0])


@pytest.mark.parametrize("how", ["lone", "batch"])
async def test_a_pop_so_late_that_another_took_its_message_hands_nothing_over(
    open_factory: Open, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pop claims its messages for a lease, then deletes them. A claim slowed past its
    lease (here 1 s, its command held 1.5 s) let another consumer take the message before
    the delete, and both handed it over."""
    monkeypatch.setattr(store_module, "CLAIM_LEASE", 1.0)
    monkeypatch.setattr(store_module, "LATE_POP", 0.5)
    q = await (await open_factory("mongo")).queue("late-pop")
    other = await (await open_factory("mongo")).queue("late-pop", reserve_delay=30.0)
    await q.push("only")
    coll = q._store._coll  # type: ignore[attr-defined]
    claim_name = "find_one_and_update" if how == "lone" else "update_many"
    real_claim, real_update = getattr(coll, claim_name), coll.update_many
    taken: list[aio_keuss.Message | None] = []

    async def slowed(*args: Any, **kwargs: Any) -> Any:
        setattr(coll, claim_name, real_claim)
        coll.update_many = another_first
        await asyncio.sleep(1.5)  # the claim's lease ends before it is made
        return await real_claim(*args, **kwargs)

    async def another_first(*args: Any, **kwargs: Any) -> Any:
        coll.update_many = real_update
        taken.append(await other.reserve(timeout=5))  # the lapsed claim, taken
        return await real_update(*args, **kwargs)

    setattr(coll, claim_name, slowed)
    if how == "lone":
        assert await q.pop(timeout=0) is None
    else:
        assert await q.pop_many(2, timeout=0) == []
    assert taken and taken[0] is not None and taken[0].payload == "only"
    assert await other.ok(taken[0])
    assert await q.total_size() == 0


@pytest.mark.parametrize("how", ["lone", "batch"])
@pytest.mark.parametrize("taker", ["reserve", "ok-by-id"])
async def test_a_pop_whose_delete_removed_nothing_does_not_hand_the_message_over(
    open_factory: Open, how: str, taker: str
) -> None:
    """A pop of mongo claims its messages (reserved, under its own token, no try counted),
    then deletes what still carries its token. Between the two, another consumer may take a
    claimed message: one whose clock runs a lease ahead sees the claim as lapsed and
    reserves it (here the lapse is written directly), or a stale holder's ok by id (which
    guards by ``reserved`` alone) deletes it. The pop's delete then removed nothing, and the
    pop handed the message over all the same: a second delivery. Only what the pop's own
    delete removed is handed over: of the batch, "b" when "a" is still live under its new
    holder; none when "a" is gone too (two gone, one deleted by the pop: which one is
    unknown, and at most once, a pop then hands over neither)."""
    q = await (await open_factory("mongo")).queue("pop-raced")
    other = await (await open_factory("mongo")).queue("pop-raced", reserve_delay=30.0)
    await q.push_many(["a", "b"], ids=["a", "b"])
    stale: aio_keuss.Message | None = None
    if taker == "ok-by-id":  # a reservation of "a" that lapsed before the pop claimed it
        stale = await other.reserve(timeout=0)
        assert stale is not None and stale.id == "a"
        await other._store._coll.update_one(  # type: ignore[attr-defined]
            {"_id": "a"}, {"$set": {"mature": time.time() - 60}}
        )
    coll = q._store._coll  # type: ignore[attr-defined]
    name = "delete_one" if how == "lone" else "delete_many"
    real_delete = getattr(coll, name)
    taken: list[aio_keuss.Message | None] = []

    async def taken_first(*args: Any, **kwargs: Any) -> Any:  # between claim and delete
        setattr(coll, name, real_delete)
        if taker == "reserve":
            await coll.update_one({"_id": "a"}, {"$set": {"mature": time.time() - 60}})
            taken.append(await other.reserve(timeout=0))
        else:
            assert await other.ok("a") is True
        return await real_delete(*args, **kwargs)

    setattr(coll, name, taken_first)
    if how == "lone":
        got = await q.pop(timeout=0)
        popped = [] if got is None else [got]
    else:
        popped = await q.pop_many(2, timeout=0)
    setattr(coll, name, real_delete)
    handed = ["b"] if (how, taker) == ("batch", "reserve") else []
    assert [m.id for m in popped] == handed
    if taker == "reserve":
        (theirs,) = taken
        assert theirs is not None and theirs.id == "a"
        assert await other.ok(theirs) is True
    left = sorted(m.id for m in await q.pop_many(2, timeout=0))
    assert left == (["b"] if how == "lone" else [])
    assert await q.total_size() == 0


async def test_a_pop_does_not_delete_a_message_a_move_by_id_claimed_from_under_it(
    open_factory: Open,
) -> None:
    """Without transactions a move claims the message (as ``mover``, the ``owner`` left as
    it was), copies it, then deletes it; a move by id guards by ``reserved`` alone, so it
    claims a message under a pop's claim too. The pop's delete landing between the move's
    copy and its delete still matched the pop's token: the pop handed the message over
    while its copy stood in the other queue, two deliveries. A message under a running
    move claim is now the move's: the pop's delete leaves it, and the pop hands nothing."""
    q = await (await open_factory("mongo")).queue("pop-moved")
    other = await (await open_factory("mongo", transactions=False)).queue("pop-moved")
    elsewhere = await (await open_factory("mongo")).queue("elsewhere")
    await q.push("job", id="a")
    coll = q._store._coll  # type: ignore[attr-defined]
    mover: Any = other._store  # type: ignore[attr-defined]
    real_delete, real_finish = coll.delete_one, mover._finish
    moved: list[str | None] = []

    async def moved_around(*args: Any, **kwargs: Any) -> Any:  # the pop's delete
        coll.delete_one = real_delete
        landed: list[Any] = []

        async def pop_deletes_first(*finish_args: Any, **finish_kwargs: Any) -> Any:
            mover._finish = real_finish  # the move copied "a"; the pop's delete lands now
            landed.append(await real_delete(*args, **kwargs))
            return await real_finish(*finish_args, **finish_kwargs)

        mover._finish = pop_deletes_first
        moved.append(await other.move("a", "elsewhere"))
        return landed[0]

    coll.delete_one = moved_around
    got = await q.pop(timeout=0)
    coll.delete_one = real_delete
    assert moved == ["a"]
    assert got is None
    assert await q.total_size() == 0
    assert [m.id for m in await elsewhere.pop_many(2, timeout=0)] == ["a"]


async def test_a_reserve_so_late_that_its_message_was_held_by_id_hands_nothing_over(
    open_factory: Open,
) -> None:
    """``hold`` (a redrive by id) reserves a message without a token of its own: it kept the
    ``owner`` of the reservation before. A reserve so late that its reservation lapsed and
    the message was held meanwhile renewed that holder's reservation as its own, and
    handed the message over while the redrive moved it: two consumers at once."""
    q = await (await open_factory("mongo")).queue("late-held", reserve_delay=1.0)
    other = await (await open_factory("mongo")).queue("late-held")
    await q.push("only")
    held: list[Held | None] = []

    async def held_first() -> None:
        message_id = (await q._store._coll.find_one({}))["_id"]  # type: ignore[attr-defined]
        held.extend(await other._store.hold([message_id], 30.0))  # type: ignore[attr-defined]

    assert await reserved_late(q, held_first) is None
    assert [h and h.tries for h in held] == [1]  # the lapsed reservation, held by id


async def test_a_coalesced_batch_within_the_insert_bound_goes_in_one_server_message(
    database: str,
) -> None:
    """max_insert_bytes exists so that concurrent pushes are never split by PyMongo into
    several server messages (one failing after another went in fails every caller, those
    stored included). It was 48 MiB, above the server's maxMessageSizeBytes (48,000,000)
    before the documents' own bytes are counted: three concurrent 16 MB pushes went in as
    one insert_many that PyMongo sent as two insert commands."""

    class Inserts(pymongo.monitoring.CommandListener):
        def __init__(self) -> None:
            self.commands = 0
            self.name = ""

        def started(self, event: Any) -> None:
            if event.command_name == "insert" and event.command.get("insert") == self.name:
                self.commands += 1

        def succeeded(self, event: Any) -> None:
            pass

        def failed(self, event: Any) -> None:
            pass

    inserts = Inserts()
    own = pymongo.AsyncMongoClient(MONGO_URL, tz_aware=True, event_listeners=[inserts])
    factory = await aio_keuss.connect("mongo", client=own, database=database, poll_interval=30.0)
    try:
        q = await factory.queue("bound")
        store: Any = q._store  # type: ignore[attr-defined]
        inserts.name = store._coll.name
        real_insert = store._coll.insert_many
        calls = 0

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return await real_insert(*args, **kwargs)

        store._coll.insert_many = counted
        blob = b"x" * 16_000_000
        await asyncio.gather(*(q.push(blob) for _ in range(3)))
        assert calls >= 1 and inserts.commands == calls
        assert await q.size() == 3
    finally:
        await factory.close()
        await own.close()


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_message_past_a_document_s_size_is_refused_before_anything_is_written(
    open_factory: Open, backend: str
) -> None:
    """A message is one document, at most 16 MiB of BSON: a larger push, or a move whose new
    payload is larger, gets InvalidPayloadError before anything is written (on a real
    mongod PyMongo raised DocumentTooLarge as it sent it; a move had claimed the message by
    then, held for its lease)."""
    factory = await open_factory(backend)
    q = await factory.queue("big")
    most = q._store.max_message_bytes  # type: ignore[attr-defined]
    assert most is not None and most < 16 * 2**20
    with pytest.raises(aio_keuss.InvalidPayloadError):
        await q.push(b"x" * (most + 1))
    with pytest.raises(aio_keuss.InvalidPayloadError):
        await q.push_many([b"small", b"x" * (most + 1)])
    assert await q.size() == 0
    await q.push(b"x" * (most - 64))  # within the bound: a document MongoDB holds
    await q.push("small")
    held = await q.reserve_many(2)
    small = next(m for m in held if m.payload == "small")
    with pytest.raises(aio_keuss.InvalidPayloadError):
        await q.move(small, "next", payload=b"x" * (most + 1))
    assert await q.ok(small)  # still held by its reserver: the move wrote nothing


async def test_deadletter_move(open_factory: Open, client: Any, database: str) -> None:
    factory = await open_factory(deadletter={"max_ko": 1})
    q = await factory.queue("work")
    dl = await factory.queue("__deadletter__")
    mid = await q.push({"poison": 1}, headers={"h": "v"})
    for expected in (KoResult.ROLLED_BACK, KoResult.DEADLETTERED):
        message = await q.reserve(timeout=1)
        assert message is not None
        assert await q.ko(message) == expected
    assert await q.total_size() == 0
    dead = await dl.pop(timeout=1)
    assert dead is not None and dead.id == mid and dead.tries == 0
    assert dead.headers["h"] == "v" and dead.headers["x-dl-tries"] == 2
    leftovers = await client[database]["keuss_q_work"].count_documents({})
    assert leftovers == 0


async def test_a_deadletter_move_a_close_gives_up_on_still_ends_in_one_queue(
    open_factory: Open, client: Any, database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without transactions a deadletter move is a claim here, a copy there, then a delete
    here. A close past its grace gave up the ko's round trips and closed the store between
    the copy and the delete: the message was in the deadletter queue and, once the claim
    lapsed, delivered again here. The store's close now lets a claimed move end first."""
    import aio_keuss.queue

    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.0)  # gives up at once
    factory = await open_factory(
        deadletter={"max_ko": 0}, transactions=False, stats="memory", signal="local"
    )
    q = await factory.queue("work")
    await q.push("poison")
    message = await q.reserve(timeout=5)
    assert message is not None
    store: Any = q._store
    copied, store_closing = asyncio.Event(), asyncio.Event()
    finish = store._finish

    async def finish_once_the_store_closes(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("held"):  # the move's delete here: its copy is in the other queue
            copied.set()
            await store_closing.wait()
        return await finish(*args, **kwargs)

    store._finish = finish_once_the_store_closes
    await ko_through_a_cut_close(factory, q, message, copied, store_closing)
    db = client[database]
    assert await db["keuss_q_work"].count_documents({}) == 0
    dead = [name for name in await db.list_collection_names() if name.startswith("keuss_q_")]
    assert sorted(dead) == ["keuss_q_____deadletter____", "keuss_q_work"]
    assert await db["keuss_q_____deadletter____"].count_documents({}) == 1


async def test_two_factories_share_batches_exactly_once(open_factory: Open) -> None:
    producer = await (await open_factory()).queue("shared")
    ids = await producer.push_many(list(range(300)))
    consumers = [await (await open_factory()).queue("shared") for _ in range(2)]
    got: list[str] = []

    async def take(q: aio_keuss.Queue, reserve: bool) -> None:
        while True:
            batch = await (q.reserve_many(25, timeout=0) if reserve else q.pop_many(25, timeout=0))
            if not batch:
                return
            if reserve:
                assert all(await asyncio.gather(*(q.ok(m) for m in batch)))
            got.extend(m.id for m in batch)

    await asyncio.gather(take(consumers[0], True), take(consumers[1], False))
    assert sorted(got) == sorted(ids)


async def test_bad_options_and_unreachable_server(database: str) -> None:
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect("mongo", database="bad name")
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect("mongo", signal_transport="carrier-pigeon")
    with pytest.raises(aio_keuss.KeussConnectionError):
        await aio_keuss.connect("mongo", url="mongodb://127.0.0.1:1", server_selection_timeout=0.3)


async def test_user_client_is_used_and_left_open(client: Any, database: str) -> None:
    async with aio_keuss.connect("mongo", client=client, database=database) as factory:
        q = await factory.queue("mine")
        await q.push("x")
    assert await client[database]["keuss_q_mine"].count_documents({}) == 1  # still open


@needs_real_mongod
async def test_capped_signal_transport_wakes_another_factory(open_factory: Open) -> None:
    waiter = await (await open_factory(signal_transport="capped")).queue("capped")
    pusher = await (await open_factory(signal_transport="capped")).queue("capped")
    task = asyncio.create_task(waiter.pop(timeout=10))
    await asyncio.sleep(0.2)
    start = time.monotonic()
    await pusher.push("wake")
    message = await task
    assert message is not None and time.monotonic() - start < 15.0


@needs_real_mongod
async def test_history_ttl_expires_processed_records(
    open_factory: Open, client: Any, database: str
) -> None:
    q = await (await open_factory("mongo-history", history_ttl=1)).queue("ttl")
    await q.push("gone soon")
    assert await q.pop(timeout=1) is not None
    coll = client[database]["keuss_history_q_ttl"]
    for _ in range(150):  # the TTL monitor runs every 60 s
        if await coll.count_documents({}) == 0:
            return
        await asyncio.sleep(1)
    pytest.fail("the processed record was not expired")


# errors are translated where the package meets the driver ------------------------------


def test_every_method_that_reaches_the_server_translates_its_errors() -> None:
    """The decorator is the choke point on MongoDB: each primitive a store, the stats store,
    the signal bus or the bucket storage overrides is wrapped by it (the server here answers
    every odd request, so this is pinned on the code; the outage tests pin the behaviour)."""
    import inspect

    from aio_keuss.buckets.storage import BucketStorage
    from aio_keuss.contract import Store
    from aio_keuss.mongo.buckets import MongoBucketStorage
    from aio_keuss.mongo.connection import MongoConnection
    from aio_keuss.mongo.signal import MongoSignalBus
    from aio_keuss.mongo.stats import MongoStats
    from aio_keuss.mongo.store import MongoHistoryStore, MongoStore
    from aio_keuss.signal import SignalBus
    from aio_keuss.stats import StatsStore

    helpers = {"prepare"}  # shares one decorated index creation between first callers
    pairs = [
        (MongoStore, Store),
        (MongoHistoryStore, Store),
        (MongoStats, StatsStore),
        (MongoSignalBus, SignalBus),
        (MongoBucketStorage, BucketStorage),
    ]
    checked = 0
    for cls, base in pairs:
        for name, method in vars(base).items():
            overridden = getattr(cls, name, None)
            if name in helpers or not inspect.iscoroutinefunction(method):
                continue
            if overridden is None or overridden is method:
                continue  # the base's own, talking to no server
            assert hasattr(overridden, "__wrapped__"), f"{cls.__name__}.{name}"
            checked += 1
    for name in ("open", "close", "_create_indexes"):
        assert hasattr(getattr(MongoConnection, name), "__wrapped__"), name
    assert checked >= 20


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_claim_run_again_after_its_reply_was_cut_changes_nothing_twice(
    database: str, client: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's claim whose reply PyMongo's task lost (``asyncio.run`` cancelling it as the
    loop ends) is run again: with ``reserve_delay`` 0 the messages it had reserved still
    matched it (mature = now), and the second run counted a second try, so the holder's
    ok was refused as a stale holder's."""
    from reply_gate import ReplyGate

    gate = ReplyGate(*MONGO_URL.rsplit("/", 1)[-1].split(":"))
    factory = await aio_keuss.connect(
        backend,
        url=f"mongodb://127.0.0.1:{gate.port}/?directConnection=true",
        database=database,
        poll_interval=30.0,
    )
    try:
        q = await factory.queue("jobs", reserve_delay=0.0)
        await q.push_many(["a", "b", "c"])
        coll = q._store._coll  # type: ignore[attr-defined]
        update_many = coll.update_many
        cuts: list[asyncio.Task[None]] = []

        async def cut() -> None:
            """What ``asyncio.run`` does to PyMongo's tasks of the read in flight."""
            stored = client[database][coll.name]
            for _ in range(500):  # the claim runs on the server; its reply is held
                if await stored.count_documents({"owner": {"$exists": True}}) == 3:
                    break
                await asyncio.sleep(0.01)
            pymongo_reads = ("PyMongoProtocol.read", "_poll_cancellation")
            for task in asyncio.all_tasks():
                if task.get_coro().__qualname__ in pymongo_reads:  # type: ignore[union-attr]
                    task.cancel()
            await asyncio.sleep(0.05)
            gate.open()

        def held(*args: Any, **kwargs: Any) -> Any:
            if not cuts:
                gate.shut()
                cuts.append(asyncio.create_task(cut()))
            return update_many(*args, **kwargs)

        coll.update_many = held
        # nx-27017 rounds the doubles an update sets to 15 digits: a time of fewer keeps the
        # reservation's mature time (now + 0) exactly now, as a real mongod stores it
        clock = time.time
        monkeypatch.setattr(store_module, "time", SimpleNamespace(time=lambda: round(clock(), 2)))
        messages = await q.reserve_many(3, timeout=5)
        await cuts[0]
        assert sorted(m.payload for m in messages) == ["a", "b", "c"]
        assert [m.tries for m in messages] == [0, 0, 0]
        docs = await client[database][coll.name].find({}, {"tries": 1}).to_list()
        assert sorted(d["tries"] for d in docs) == [1, 1, 1]
        assert [await q.ok(m) for m in messages] == [True, True, True]
    finally:
        gate.open()
        await factory.close()


def test_a_stored_count_of_tries_reads_as_a_sane_int() -> None:
    """What the server of this suite cannot store (NaN, infinities, Decimal128: it keeps
    JSON) is read here as a real mongod hands it over; the reserve-and-ok path of each runs
    in the foreign documents tests against a real mongod."""
    decimal = pytest.importorskip("bson.decimal128").Decimal128
    readings = [
        (math.nan, 0),
        (-math.inf, 0),
        (math.inf, store_module.MAX_TRIES),
        (decimal("NaN"), 0),
        (decimal("sNaN"), 0),
        (decimal("4.9"), 4),
        (decimal("1E+6000"), store_module.MAX_TRIES),
        (2**63, store_module.MAX_TRIES),
        (7.99, 7),
        (True, 0),
        ("3", 0),
        (None, 0),
        (5, 5),
    ]
    assert [(repr(v), store_module._tries(v)) for v, _ in readings] == [
        (repr(v), n) for v, n in readings
    ]


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_give_back_replayed_after_another_reserved_the_message_leaves_it_held(
    open_factory: Open, backend: str
) -> None:
    """A give-back (a close's, a cancelled caller's) takes its try back, so the next
    reservation of the message, by another consumer, has the very count the first holder
    had. That holder's give-back landing again (retried after its reply was lost), or its
    ok, ko or move, matched the new reservation by that count: the message was released
    (then delivered to two consumers at once) or deleted under its new holder. Each
    reservation is now known by its own token."""
    first = await open_factory(backend)
    a = await first.queue("given")
    b = await (await open_factory(backend)).queue("given")
    await b.push("job")
    sent: list[Any] = []
    rollback = a._store.rollback  # type: ignore[attr-defined]

    async def recorded(nacks: Any, deadletter: Any) -> Any:
        sent.extend(nacks)
        return await rollback(nacks, deadletter)

    a._store.rollback = recorded  # type: ignore[attr-defined]
    mine = await a.reserve(timeout=0)
    assert mine is not None and mine.tries == 0
    await a._release_all([mine], unseen=True)  # type: ignore[attr-defined]  # as a consumer's
    assert len(sent) == 1
    theirs = await b.reserve(timeout=0)
    assert theirs is not None and theirs.id == mine.id and theirs.tries == mine.tries
    # the first holder's give-back, sent again; then its ok, ko and move
    assert await b._store.rollback(sent, None) == [KoResult.MISSING]  # type: ignore[attr-defined]
    assert not await a.ok(mine)
    assert await a.ko(mine) is KoResult.MISSING
    assert await a.move(mine, "elsewhere") is None
    assert await a.ok_many([mine, mine]) == [False, False]  # (the batch commit)
    assert await a.extend_many([mine, theirs], 3600) == [False, True]
    assert await a.extend(mine) is False
    (row,) = await b.peek(state="reserved")
    assert row.message.id == theirs.id
    assert await b.ok(theirs)
    assert await b.total_size() == 0


async def _held_without_transactions(
    open_factory: Open, backend: str, **push: Any
) -> tuple[aio_keuss.Queue, aio_keuss.Message, Any]:
    """One message (``push``: its options) pushed to queue ``from`` of a factory without
    transactions, and reserved: the queue, the message and the queue's store."""
    q = await (await open_factory(backend, transactions=False)).queue("from")
    await q.push("job", **push)
    message = await q.reserve(timeout=0)
    assert message is not None
    store: Any = q._store  # type: ignore[attr-defined]
    return q, message, store


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_holder_s_ok_after_its_move_failed_past_the_claim_still_commits(
    open_factory: Open, backend: str
) -> None:
    """Without transactions a move claims the held message, copies it, then deletes it. A
    copy that fails leaves the claim, the message still reserved to its holder: the
    holder's ok (its reservation's own guard) still commits it."""
    q, message, store = await _held_without_transactions(open_factory, backend)
    with copies_refused(store), pytest.raises(aio_keuss.KeussError):
        await q.move(message, "to")
    assert await q.ok(message)
    assert await q.total_size() == 0


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_holder_s_ok_after_its_move_failed_before_the_copy_still_commits(
    open_factory: Open, backend: str
) -> None:
    """Without transactions a move claims the held message with its read, then (for a
    message with a priority) makes the other queue's priority index, copies, and deletes.
    Making the index failed (an outage, a refusal) with nothing copied, and the claim was
    kept: the holder's ok, refused while a move claim runs, was refused for the claim's
    whole lease, and the message came back then, delivered again though handled. A move
    that failed before its copy gives its claim back, as one whose copy the server refused
    does."""
    q, message, store = await _held_without_transactions(open_factory, backend, priority=3)
    backend_: Any = store._backend
    ensure_priority = backend_.ensure_priority

    async def refused(queue: str) -> None:
        if queue == "to":
            raise pymongo.errors.AutoReconnect("createIndexes cut (test)")
        await ensure_priority(queue)

    backend_.ensure_priority = refused
    try:
        with pytest.raises(aio_keuss.KeussError):
            await q.move(message, "to")
    finally:
        backend_.ensure_priority = ensure_priority
    assert await q.ok(message)
    assert await q.total_size() == 0


async def test_a_move_whose_copy_may_have_landed_keeps_its_claim(open_factory: Open) -> None:
    """A copy whose reply was lost may stand in the other queue: the move keeps its claim
    (a running claim refuses the holder's ok, which would end a message copied on), and
    the message comes back here once it lapses (a duplicate, never a loss)."""
    q, message, store = await _held_without_transactions(open_factory, "mongo")
    insert_docs = store._insert_docs

    async def landed_unanswered(coll: Any, *args: Any, **kwargs: Any) -> Any:
        if coll.name != store._coll.name:
            await insert_docs(coll, *args, **kwargs)
            raise pymongo.errors.AutoReconnect("reply lost (test)")
        return await insert_docs(coll, *args, **kwargs)

    store._insert_docs = landed_unanswered
    with pytest.raises(aio_keuss.KeussError):
        await q.move(message, "to")
    store._insert_docs = insert_docs
    assert await q.ok(message) is False
    await store._coll.update_one({}, {"$set": {"moving": 0.0, "mature": 0.0}})  # it lapses
    again = await q.reserve(timeout=0)
    assert again is not None and again.id == message.id
    assert await q.ok(again)


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
@pytest.mark.parametrize("call", ["ok", "ok_many", "ko", "bare ok"])
async def test_a_holder_s_own_ok_or_ko_between_its_move_s_claim_and_copy_is_refused(
    open_factory: Open, backend: str, call: str
) -> None:
    """Without transactions a move claims the held message, copies it, then deletes it;
    the claim left the holder's own guard matching, so its ok (or ko) sent at once from
    another task, landing between the claim and the copy, ended the message (or gave it
    back) and was told so, and the move copied it on all the same: a message acknowledged
    as done went on to the next queue. The move took the reservation first: the ok or
    ko is refused, as on every other backend (one of the two acts)."""
    q = await (await open_factory(backend, transactions=False)).queue("from")
    to = await (await open_factory(backend)).queue("to")
    await q.push_many(["job", "other"], ids=["a", "b"])
    held = sorted(await q.reserve_many(2, timeout=0), key=lambda m: m.id)
    message = held[0]
    store: Any = q._store  # type: ignore[attr-defined]
    insert_docs = store._insert_docs
    between: list[Any] = []

    async def holder_first(coll: Any, *args: Any, **kwargs: Any) -> Any:
        if coll.name != store._coll.name and not between:
            if call == "ok":
                between.append(await q.ok(message))
            elif call == "ok_many":
                between.append(await q.ok_many(held))
            elif call == "ko":
                between.append(await q.ko(message, delay=3600))
            else:
                between.append(await q.ok(message.id))
        return await insert_docs(coll, *args, **kwargs)

    store._insert_docs = holder_first
    try:
        moved = await q.move(message, "to")
    finally:
        store._insert_docs = insert_docs
    refused = [False, True] if call == "ok_many" else KoResult.MISSING if call == "ko" else False
    assert between == [refused]
    assert moved == message.id
    assert await q.total_size() == (1 if call != "ok_many" else 0)
    assert [m.id for m in await to.pop_many(2, timeout=0)] == [message.id]


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_move_whose_message_another_consumer_took_leaves_it_to_that_consumer(
    open_factory: Open, backend: str
) -> None:
    """Without transactions a move claims the held message (its lease on ``mature`` and
    ``moving``, the holder's owner left); the holder's renewal, landing meanwhile, rewrites
    ``mature`` to its own, shorter, end. Should the copy take longer than that, another
    consumer reserves the message, and the move's delete (asking for the holder's owner)
    leaves it: a duplicate, the copy having landed. The move then left its running claim
    (``moving``) on that consumer's reservation, and its ok, refused as if moved, sent the
    message round once more. The move that no longer holds the message gives its claim
    up."""
    q, message, store = await _held_without_transactions(open_factory, backend)
    insert_docs = store._insert_docs
    taken: list[Any] = []

    async def taken_meanwhile(coll: Any, *args: Any, **kwargs: Any) -> Any:
        if coll.name != store._coll.name and not taken:
            # the holder's renewal, then its end passing (as if the copy were slow)
            assert await q.extend(message, 3600)
            await store._coll.update_one({}, {"$set": {"mature": time.time() - 1}})
            taken.extend((await store.reserve(1, 3600.0)).messages)
        return await insert_docs(coll, *args, **kwargs)

    store._insert_docs = taken_meanwhile
    try:
        assert await q.move(message, "to") == message.id
    finally:
        store._insert_docs = insert_docs
    (theirs,) = taken
    assert await store.commit([Ack(theirs.id, theirs.tries, theirs.token)]) == [True]
    assert await q.total_size() == 0


Write = Callable[..., Awaitable[Any]]


class _Writes:
    """A store's real collection (every call goes to the server), with ``before`` run
    once ahead of the first write of a batch ok (a filter over several ids): what lands
    there lands after the batch's read, if it reads, and before any write of its own.
    ``alone``, when given, runs each write of one message (an ok of one) in its place."""

    def __init__(
        self,
        coll: Any,
        before: Callable[[], Awaitable[None]],
        alone: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        self._coll = coll
        self._before: Callable[[], Awaitable[None]] | None = before
        self._alone = alone

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coll, name)

    async def _write(self, write: Write, filter: Any, *args: Any, **kwargs: Any) -> Any:
        if "$in" not in str(filter):
            if self._alone is not None:
                return await self._alone(write, filter, *args, **kwargs)
        elif self._before is not None:
            before, self._before = self._before, None
            await before()
        return await write(filter, *args, **kwargs)

    async def update_many(self, filter: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._write(self._coll.update_many, filter, *args, **kwargs)

    async def delete_many(self, filter: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._write(self._coll.delete_many, filter, *args, **kwargs)


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
@pytest.mark.parametrize("ended_there", [False, True], ids=["held-there", "ended-there"])
async def test_a_batch_ok_is_false_for_a_message_taken_over_between_its_read_and_its_end(
    open_factory: Open, backend: str, ended_there: bool
) -> None:
    """A batch ok ends (deletes, or marks processed) the valid ones of its messages with
    one filter. A message whose reservation lapsed and that another consumer reserved
    before that no longer matched it, so it was not ended; yet a short count's read-back,
    finding it no longer under the filter, once answered True for it (and counted a
    commit). The holder is told False; the new holder's ok ends it. Should the new holder
    end it first, the batch's own message is still answered True: mongo-history's
    records keep the batch's mark, and mongo's batch claims what it may end before it
    deletes what it claimed (before, deleting two of which one was ended here, it knew
    neither was ours and answered False for both)."""
    q = await (await open_factory(backend, stats="memory")).queue("raced")
    other = await (await open_factory(backend, stats="memory")).queue("raced")
    await q.push_many(["a", "b"], ids=["a", "b"])
    held = await q.reserve_many(2, timeout=0)
    assert sorted(m.id for m in held) == ["a", "b"]
    a, b = sorted(held, key=lambda m: m.id)
    store: Any = q._store  # type: ignore[attr-defined]
    taken: list[aio_keuss.Message | None] = []

    async def taken_over() -> None:
        # b's reservation lapses, and the other consumer reserves it: after the read
        await store._coll.update_one({"_id": b.id}, {"$set": {"mature": time.time() - 60}})
        taken.append(theirs := await other.reserve(timeout=0))
        if ended_there:
            assert theirs is not None and await other.ok(theirs) is True

    store._coll = _Writes(store._coll, taken_over)
    assert await q.ok_many([a, b]) == [True, False]
    (theirs,) = taken
    assert theirs is not None and theirs.id == b.id and theirs.tries == b.tries + 1
    assert (await q.stats())["commit"] == 1
    if not ended_there:
        assert await other.ok(theirs) is True
    assert await q.size() == 0 and await q.resv_size() == 0


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_batch_ok_is_true_for_its_own_when_another_process_ends_one_first(
    open_factory: Open, backend: str
) -> None:
    """The holder's ok of one message of a batch sent again from another process (another
    factory, the same reservation) lands after the batch's read and before its end: that
    ok ends the message and is answered True there; the batch's other message is ended
    here, and its caller is answered True too (mongo answered False for both: two gone,
    one deleted here, and no telling which)."""
    q = await (await open_factory(backend, stats="memory")).queue("elsewhere")
    other = await (await open_factory(backend, stats="memory")).queue("elsewhere")
    await q.push_many(["a", "b"], ids=["a", "b"])
    a, b = sorted(await q.reserve_many(2, timeout=0), key=lambda m: m.id)
    store: Any = q._store  # type: ignore[attr-defined]

    async def ended_elsewhere() -> None:
        assert await other.ok(a) is True

    store._coll = _Writes(store._coll, ended_elsewhere)
    assert await q.ok_many([a, b]) == [False, True]
    assert (await q.stats())["commit"] == 1
    assert await q.size() == 0 and await q.resv_size() == 0


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_batch_ok_is_true_for_its_own_when_a_resent_ok_ends_another_first(
    open_factory: Open, backend: str
) -> None:
    """A holder whose ok was cancelled sends it again, in another batch: the first send
    is still under way, and lands after the second batch's read and before its end, which
    then ends one message of two. The message this batch ended is answered True (seen
    False in the chaos test, mongo-history, max_batch 3: a False for an ok of a
    reservation its caller holds tells the caller it was not acked)."""
    q = await (await open_factory(backend, stats="memory")).queue("resent")
    await q.push_many(["a", "b"], ids=["a", "b"])
    held = await q.reserve_many(2, timeout=0)
    a, b = sorted(held, key=lambda m: m.id)
    store: Any = q._store  # type: ignore[attr-defined]

    async def first_send_lands() -> None:
        assert await q.ok(a) is True  # the first send of a's ok, its caller cancelled

    store._coll = _Writes(store._coll, first_send_lands)
    assert await q.ok_many([a, b]) == [False, True]
    assert (await q.stats())["commit"] == 2
    assert await q.size() == 0 and await q.resv_size() == 0


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_batch_ok_needs_no_reply_of_an_earlier_ok_whose_end_landed_first(
    open_factory: Open, backend: str
) -> None:
    """As above, the first send's end landing before the batch's end, and its reply held
    until the batch has answered: the batch still tells which message it ended, from what
    it finds in the database alone. (mongo once learned it from that send's reply, so
    waited for the commits of its store begun before it; without the wait it answered
    False for both.)"""
    q = await (await open_factory(backend, stats="memory")).queue("resent")
    await q.push_many(["a", "b"], ids=["a", "b"])
    held = await q.reserve_many(2, timeout=0)
    a, b = sorted(held, key=lambda m: m.id)
    store: Any = q._store  # type: ignore[attr-defined]
    a_sent, batch_ends = asyncio.Event(), asyncio.Event()
    a_ended, batch_answered = asyncio.Event(), asyncio.Event()

    async def first_send(write: Write, *args: Any, **kwargs: Any) -> Any:
        a_sent.set()
        await batch_ends.wait()
        result = await write(*args, **kwargs)
        a_ended.set()
        await batch_answered.wait()  # its reply held
        return result

    async def lands_first() -> None:
        batch_ends.set()
        await a_ended.wait()

    store._coll = _Writes(store._coll, lands_first, first_send)
    first = asyncio.ensure_future(q.ok(a))
    try:
        async with asyncio.timeout(60):  # (a batch waiting for that reply fails, not hangs)
            await a_sent.wait()
            answered = await q.ok_many([a, b])
    finally:
        batch_answered.set()
    assert answered == [False, True]
    assert await first is True
    assert (await q.stats())["commit"] == 2
    assert await q.size() == 0 and await q.resv_size() == 0


async def test_a_requeue_whose_hold_lapsed_does_not_move_a_message_a_pop_has_claimed(
    open_factory: Open,
) -> None:
    """A requeue holds a message by id, then moves it under the count the hold handed out.
    A pop of mongo claims a message for a lease without counting a try (reserved, under
    its own owner token, the count unchanged), then deletes it. Once the hold had lapsed, a
    pop's claim still matched the move's guard (the count alone, no token): the message
    was moved back to its origin while the pop handed it over, two deliveries of one
    message. The hold now hands out its token too, and the move asks for it."""
    dl = await (await open_factory("mongo")).queue("__deadletter__")
    other = await (await open_factory("mongo")).queue("__deadletter__")
    jobs = await (await open_factory("mongo")).queue("jobs")
    message_id = await dl.push("job", headers={"x-dl-from-queue": "jobs"})
    store: Any = dl._store  # type: ignore[attr-defined]
    real_move = store.move
    coll: Any = other._store._coll  # type: ignore[attr-defined]
    real_delete = coll.delete_one
    moved: list[str | None] = []
    popped: list[aio_keuss.Message | None] = []

    async def popped_around(moves: Any) -> Any:
        store.move = real_move

        async def moved_first(*args: Any, **kwargs: Any) -> Any:  # between claim and delete
            coll.delete_one = real_delete
            moved.extend(await real_move(moves))
            return await real_delete(*args, **kwargs)

        # the hold lapses, and another consumer's pop claims the message
        await store._coll.update_one({"_id": message_id}, {"$set": {"mature": time.time() - 1}})
        coll.delete_one = moved_first
        popped.append(await other.pop(timeout=0))
        return moved

    store.move = popped_around
    result = await dl.requeue([message_id])
    (got,) = popped
    assert got is not None and got.id == message_id
    assert moved == [None]  # the pop's claim is not the hold's
    assert result == {}
    assert await jobs.total_size() == 0 and await dl.total_size() == 0
