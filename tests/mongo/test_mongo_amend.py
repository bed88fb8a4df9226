"""``Store.amend`` on ``mongo`` and ``mongo-history``, called on a queue's store: promote
(``scheduled_only`` with delay 0), a new mature time, a new priority (with the index a
prioritized push makes), the rule of ``remove`` (a lapsed reservation is waiting), what an
amend leaves alone, and amends racing reserves.

Runs on the server of ``tests/mongo_server.py``. No timed assertions: waits are conditions,
timeouts only hang guards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import new_token
from mongo_server import MONGO_URL, start_mongo

import aio_keuss
from aio_keuss.contract import Amend

pymongo = pytest.importorskip("pymongo")

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.parametrize("backend", ["mongo", "mongo-history"]),
]

PRIORITY_KEYS = ["raised", "lowered", "mature"]
UNCHANGED = ("payload", "headers", "tries")
ROUNDING = 1e-4
"""Slack for a mature time the store cut to what the test server keeps (at most 10 µs
early): the store reads its clock within microseconds of the test's, so a time the test
read before the call may lie within the same 10 µs as the store's and above its cut."""


@pytest.fixture
async def factory(backend: str) -> AsyncIterator[aio_keuss.Factory]:
    reason = start_mongo()
    if reason:
        pytest.skip(reason)
    database = f"akt_{new_token()}"
    opened = await aio_keuss.connect(
        backend, url=MONGO_URL, database=database, poll_interval=30.0, reserve_delay=600
    )
    yield opened
    await opened.close()
    client: Any = pymongo.AsyncMongoClient(MONGO_URL)
    await client.drop_database(database)
    await client.close()


def _store(q: aio_keuss.Queue) -> Any:
    return q._store  # type: ignore[attr-defined]


def _coll(q: aio_keuss.Queue) -> Any:
    return _store(q)._coll


async def _doc(q: aio_keuss.Queue, message_id: str) -> dict[str, Any]:
    doc = await _coll(q).find_one({"_id": message_id})
    assert doc is not None
    return dict(doc)


async def _amend(q: aio_keuss.Queue, *amends: Amend) -> list[bool]:
    result: list[bool] = await _store(q).amend(list(amends))
    return result


async def _lapse(q: aio_keuss.Queue, message_id: str) -> None:
    """End a message's reservation as time would: its mature time in the past."""
    await _coll(q).update_one({"_id": message_id}, {"$set": {"mature": time.time() - 1}})


async def test_the_backends_say_they_can(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("caps")
    assert q.capabilities.reschedule
    assert await _amend(q) == []


async def test_a_promote_makes_a_scheduled_message_ready_now(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("promote")
    later = await q.push("later", delay=600)
    ready = await q.push("ready")
    before = time.time()
    assert await _amend(q, Amend(later, delay=0, scheduled_only=True)) == [True]
    doc = await _doc(q, later)
    assert before - ROUNDING <= doc["mature"] <= time.time()
    got = await q.pop_many(2, timeout=5)
    assert [m.payload for m in got] == ["ready", "later"]  # in mature order among the ready
    # already ready: nothing changed, False
    again = await q.push("again")
    mature = (await _doc(q, again))["mature"]
    assert await _amend(q, Amend(again, delay=0, scheduled_only=True)) == [False]
    assert (await _doc(q, again))["mature"] == mature
    assert ready


async def test_scheduled_only_with_a_delay_moves_only_a_scheduled_message(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("later")
    scheduled = await q.push("scheduled", delay=600)
    ready = await q.push("ready")
    start = time.time()
    flags = await _amend(
        q,
        Amend(scheduled, delay=3600, scheduled_only=True),
        Amend(ready, delay=3600, scheduled_only=True),
    )
    assert flags == [True, False]
    assert (await _doc(q, scheduled))["mature"] >= start + 3600 - ROUNDING
    assert (await _doc(q, ready))["mature"] <= time.time()


async def test_a_reschedule_hides_a_ready_message_and_a_later_one_comes_back(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("reschedule")
    message_id = await q.push("x")
    start = time.time()
    assert await _amend(q, Amend(message_id, delay=600)) == [True]
    assert (await _doc(q, message_id))["mature"] >= start + 600 - ROUNDING
    assert await q.pop(timeout=0) is None
    sizes = await q.sizes()
    assert (sizes.size, sizes.scheduled, sizes.reserved) == (0, 1, 0)
    assert await _amend(q, Amend(message_id, delay=0)) == [True]
    got = await q.pop(timeout=5)
    assert got is not None and got.id == message_id


async def test_a_reserved_or_missing_message_is_not_amended(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("held")
    message_id = await q.push("held", delay=0)
    held = await q.reserve(timeout=5)
    assert held is not None and held.id == message_id
    before = await _doc(q, message_id)
    flags = await _amend(
        q,
        Amend(message_id, delay=0),
        Amend(message_id, delay=0, scheduled_only=True),
        Amend(message_id, priority=3),
        Amend("nowhere", delay=0),
    )
    assert flags == [False, False, False, False]
    assert await _doc(q, message_id) == before
    assert await q.ok(held)


async def test_a_consumed_message_is_not_amended(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("consumed")
    message_id = await q.push("gone")
    got = await q.pop(timeout=5)
    assert got is not None
    assert await _amend(q, Amend(message_id, delay=0), Amend(message_id, priority=1)) == [
        False,
        False,
    ]
    # mongo-history keeps the record: still consumed, out of every take's way
    doc = await _coll(q).find_one({"_id": message_id})
    assert doc is None or "processed" in doc


async def test_a_lapsed_reservation_is_waiting_and_its_late_holder_loses_it(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("lapsed")
    message_id = await q.push("x")
    held = await q.reserve(timeout=5)
    assert held is not None
    await _lapse(q, message_id)
    tries = (await _doc(q, message_id))["tries"]
    assert await _amend(q, Amend(message_id, delay=600)) == [True]
    doc = await _doc(q, message_id)
    assert not doc["reserved"] and "owner" not in doc and doc["tries"] == tries
    sizes = await q.sizes()
    assert (sizes.scheduled, sizes.reserved) == (1, 0)  # not read as reserved
    assert not await q.ok(held)  # the late holder's ok no longer acts on it
    assert await _coll(q).count_documents({"_id": message_id, "mature": {"$gt": time.time()}})


async def test_a_priority_change_stores_it_as_a_push_would_and_keeps_the_mature_time(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("prio")
    first, second, third = await q.push_many(["first", "second", "third"])
    coll = _coll(q)
    assert not await _has_priority_index(coll)
    mature = (await _doc(q, third))["mature"]
    assert await _amend(q, Amend(third, priority=5)) == [True]
    assert await _has_priority_index(coll)  # as the queue's first prioritized push
    doc = await _doc(q, third)
    assert doc["raised"] == 5 and "lowered" not in doc and doc["mature"] == mature
    assert await _amend(q, Amend(first, priority=-2)) == [True]
    got = await q.pop_many(3, timeout=5)
    assert [(m.payload, m.priority) for m in got] == [
        ("third", 5),
        ("second", 0),
        ("first", -2),
    ]
    # from one sign to the other, and back to 0: the other field goes
    message_id = await q.push("y", priority=4, delay=600)
    assert await _amend(q, Amend(message_id, priority=-7)) == [True]
    doc = await _doc(q, message_id)
    assert doc["lowered"] == 7 and "raised" not in doc
    assert await _amend(q, Amend(message_id, priority=0)) == [True]
    doc = await _doc(q, message_id)
    assert "lowered" not in doc and "raised" not in doc
    assert second


async def test_an_amend_keeps_id_payload_headers_and_tries(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("kept")
    message_id = await q.push({"a": [1, 2]}, headers={"h": "v"}, delay=600)
    await _coll(q).update_one({"_id": message_id}, {"$set": {"tries": 3}})
    before = await _doc(q, message_id)
    assert await _amend(q, Amend(message_id, delay=0, priority=2, scheduled_only=True)) == [True]
    after = await _doc(q, message_id)
    assert {k: after[k] for k in UNCHANGED} == {k: before[k] for k in UNCHANGED}
    assert await _coll(q).count_documents({}) == 1
    got = await q.reserve(timeout=5)
    assert got is not None
    assert (got.id, got.payload, got.headers.get("h"), got.tries, got.priority) == (
        message_id,
        {"a": [1, 2]},
        "v",
        3,
        2,
    )


async def test_one_call_answers_for_each_message(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("many")
    ids = await q.push_many([f"m{n}" for n in range(6)], delay=600)
    held_id = await q.push("held")
    held = await q.reserve(timeout=5)
    assert held is not None and held.id == held_id
    amends = [Amend(i, delay=0, scheduled_only=True) for i in ids[::2]]
    amends += [Amend(held_id, delay=0), Amend("missing", delay=0)]
    assert await _amend(q, *amends) == [True, True, True, False, False]
    got = await q.pop_many(6, timeout=5)
    # promoted in one call: ready in the order of the call
    assert [m.id for m in got] == ids[::2]


async def test_promotes_racing_reserves_never_deliver_twice(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("race")
    scheduled = await q.push_many([f"s{n}" for n in range(40)], delay=600)
    ready = await q.push_many([f"r{n}" for n in range(40)])
    delivered: list[str] = []

    async def consumer() -> None:
        while len(delivered) < len(scheduled) + len(ready):
            m = await q.reserve(timeout=0.2)
            if m is not None:
                delivered.append(m.id)

    async def promoter() -> list[bool]:
        flags: list[bool] = []
        for n in range(0, len(scheduled), 4):
            chunk = scheduled[n : n + 4]
            flags += await _amend(q, *(Amend(i, delay=0, scheduled_only=True) for i in chunk))
        return flags

    *_, promoted = await asyncio.wait_for(
        asyncio.gather(consumer(), consumer(), consumer(), promoter()), timeout=90
    )
    assert all(promoted)  # none of them was ready or held before its promote
    assert len(delivered) == len(set(delivered))
    assert sorted(delivered) == sorted(scheduled + ready)


async def test_reschedules_racing_reserves_hand_each_message_to_one_side(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("hide")
    ids = await q.push_many([f"m{n}" for n in range(60)])
    delivered: list[str] = []

    async def consumer() -> None:
        while (m := await q.reserve(timeout=0)) is not None:
            delivered.append(m.id)

    async def hider() -> list[bool]:
        # in the consumers' order, one message a call: they meet on the same messages
        return [(await _amend(q, Amend(i, delay=600)))[0] for i in ids]

    *_, hidden = await asyncio.wait_for(asyncio.gather(consumer(), consumer(), hider()), timeout=90)
    amended = {i for i, ok in zip(ids, hidden, strict=True) if ok}
    assert len(delivered) == len(set(delivered))
    assert amended.isdisjoint(delivered)
    assert amended | set(delivered) == set(ids)
    for message_id in amended:  # waiting, not held: not read as a reservation
        doc = await _doc(q, message_id)
        assert not doc["reserved"] and doc["mature"] > time.time()


async def _has_priority_index(coll: Any) -> bool:
    indexes = await coll.index_information()
    return any([k for k, _ in ix["key"]] == PRIORITY_KEYS for ix in indexes.values())


async def test_a_pop_whose_claim_lapsed_and_was_amended_hands_nothing_over(
    factory: aio_keuss.Factory, backend: str
) -> None:
    """A mongo pop claims its message (reserved, under its token), then deletes what still
    carries the token. A claim that lapsed first is waiting to an amend, which takes the
    token away: the pop's delete removes nothing and the message stays, amended."""
    if backend != "mongo":
        pytest.skip("mongo-history's pop marks the message processed in one update")
    q = await factory.queue("pop-lapsed")
    message_id = await q.push("x")
    coll = _coll(q)
    real_delete = coll.delete_one
    amended: list[bool] = []

    async def amended_first(*args: Any, **kwargs: Any) -> Any:  # between claim and delete
        coll.delete_one = real_delete
        await _lapse(q, message_id)
        amended.extend(await _amend(q, Amend(message_id, delay=600)))
        return await real_delete(*args, **kwargs)

    coll.delete_one = amended_first
    try:
        assert await q.pop(timeout=0) is None
    finally:
        coll.delete_one = real_delete
    assert amended == [True]
    doc = await _doc(q, message_id)
    assert not doc["reserved"] and "owner" not in doc and doc["mature"] > time.time()


async def test_amends_of_one_message_in_one_call_apply_in_their_order(
    factory: aio_keuss.Factory,
) -> None:
    q = await factory.queue("twice")
    message_id = await q.push("x", delay=600)
    promote = Amend(message_id, delay=0, scheduled_only=True)
    later = Amend(message_id, delay=600)
    start = time.time()
    assert await _amend(q, later, Amend(message_id, priority=3), promote) == [True] * 3
    doc = await _doc(q, message_id)
    # (a mature time is rounded down to what the server keeps: at most 10 µs early)
    assert doc["raised"] == 3 and start - ROUNDING <= doc["mature"] <= time.time()
    start = time.time()
    assert await _amend(q, promote, later) == [False, True]  # it was ready: no promote
    assert (await _doc(q, message_id))["mature"] >= start + 600 - ROUNDING
    assert await _amend(q, promote, later, promote) == [True, True, True]
    assert await q.pop(timeout=0) is not None
