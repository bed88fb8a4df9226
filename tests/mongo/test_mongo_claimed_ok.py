"""A ``mongo`` batch ok claims what it may end (``acker``, ``owner`` moved to
``acked_owner``, a claim lease on ``mature``), then deletes what carries its token: what
happens to a message left in that claimed state (the delete failed, or has not landed yet).

Runs on the server of ``tests/mongo_server.py``. The failed delete is a write this wrapper
of the store's real collection refuses before sending it (as a connection cut would); every
other call goes to the server. No timed assertions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import new_token
from mongo_copies import copies_refused
from mongo_server import MONGO_URL, start_mongo

import aio_keuss
from aio_keuss import KoResult
from aio_keuss.contract import Ack, Amend, Extend, Move
from aio_keuss.errors import KeussError
from aio_keuss.mongo.store import CLAIM_LEASE

pymongo = pytest.importorskip("pymongo")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def queue() -> AsyncIterator[aio_keuss.Queue]:
    reason = start_mongo()
    if reason:
        pytest.skip(reason)
    database = f"akt_{new_token()}"
    factory = await aio_keuss.connect(
        "mongo", url=MONGO_URL, database=database, poll_interval=30.0, stats="memory"
    )
    yield await factory.queue("claimed")
    await factory.close()
    client: Any = pymongo.AsyncMongoClient(MONGO_URL)
    await client.drop_database(database)
    await client.close()


class _DeleteFails:
    """The store's real collection, whose next ``delete_many`` of a batch ok's claim (its
    filter names ``acker``) fails without reaching the server."""

    def __init__(self, coll: Any) -> None:
        self._coll = coll
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coll, name)

    async def delete_many(self, filter: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.failed and "acker" in str(filter):
            self.failed = True
            raise pymongo.errors.AutoReconnect("connection cut (test)")
        return await self._coll.delete_many(filter, *args, **kwargs)


async def _claimed_not_ended(q: aio_keuss.Queue) -> list[aio_keuss.Message]:
    """Two messages reserved, a batch ok of both whose claim landed and whose delete failed."""
    await q.push_many(["a", "b"], ids=["a", "b"])
    held = sorted(await q.reserve_many(2, timeout=0), key=lambda m: m.id)
    assert [m.id for m in held] == ["a", "b"]
    store: Any = q._store  # type: ignore[attr-defined]
    real, cut = store._coll, _DeleteFails(store._coll)
    store._coll = cut
    try:
        with pytest.raises(KeussError):
            await q.ok_many(held)
    finally:
        store._coll = real
    assert cut.failed
    assert await real.count_documents({"acker": {"$exists": True}}) == 2
    return held


@pytest.mark.parametrize("resend", ["batch", "one-by-one"])
async def test_an_ok_sent_again_after_the_claim_landed_and_the_delete_failed_ends_it(
    queue: aio_keuss.Queue, resend: str
) -> None:
    """The claim of a batch ok landed, its delete failed: the holder (or its consumer's
    retry) sends the same oks again. They end the messages and are answered True; they
    answered False (the claim had moved the owner token the guard asks for), and the
    messages came back after the claim's lease, delivered again though handled."""
    a, b = await _claimed_not_ended(queue)
    if resend == "batch":
        assert await queue.ok_many([a, b]) == [True, True]
    else:
        assert await queue.ok(a) is True
        assert await queue.ok(b) is True
    assert (await queue.stats())["commit"] == 2
    assert await queue.total_size() == 0


async def test_an_ok_sent_again_by_a_stale_holder_does_not_end_a_claimed_message(
    queue: aio_keuss.Queue,
) -> None:
    """Only the reservation the claim was made for: a holder with another count (a stale
    one, or a forged one) is refused, and the message stays claimed."""
    a, b = await _claimed_not_ended(queue)
    a = dataclasses.replace(a, tries=a.tries + 1)
    object.__setattr__(a, "_token", b._token)  # (one reserve: one token for both)
    assert await queue.ok_many([a, b]) == [False, True]
    assert await queue.ok(a) is False
    assert await queue.total_size() == 1


async def test_a_ko_by_id_racing_a_batch_ok_s_claim_is_not_also_deleted(
    queue: aio_keuss.Queue,
) -> None:
    """A ko by bare id (no count, no token) lands between a batch ok's claim and its
    delete. It gave the message back, and the batch's delete removed the message the ko
    was told it put back (both were answered as done, the message gone); now the ko
    yields to the holder's ok under way: refused, and the batch ends both."""
    await queue.push_many(["a", "b"], ids=["a", "b"])
    held = sorted(await queue.reserve_many(2, timeout=0), key=lambda m: m.id)
    store: Any = queue._store  # type: ignore[attr-defined]
    real = store._coll
    kos: list[KoResult] = []

    class _KoFirst:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        async def delete_many(self, filter: Any, *args: Any, **kwargs: Any) -> Any:
            if "acker" in str(filter) and not kos:
                kos.append(await queue.ko("a", 0))
            return await real.delete_many(filter, *args, **kwargs)

    store._coll = _KoFirst()
    try:
        done = await queue.ok_many(held)
    finally:
        store._coll = real
    assert kos == [KoResult.MISSING]
    assert done == [True, True]
    assert await queue.total_size() == 0


async def test_a_late_delete_of_a_lapsed_claim_leaves_the_message_an_amend_made_waiting(
    queue: aio_keuss.Queue,
) -> None:
    """A batch ok's delete lands after its claim's lease lapsed, and an amend (the rule
    of remove: a lapsed reservation is waiting) changed the message meanwhile: it is
    waiting, not reserved, and holds no owner. The delete, which asked only for the
    batch's token and no owner, removed that waiting message, and the batch answered True
    for a message it no longer held."""
    await queue.push_many(["a", "b"], ids=["a", "b"])
    held = sorted(await queue.reserve_many(2, timeout=0), key=lambda m: m.id)
    store: Any = queue._store  # type: ignore[attr-defined]
    real = store._coll
    amended: list[bool] = []

    class _LapsedFirst:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        async def delete_many(self, filter: Any, *args: Any, **kwargs: Any) -> Any:
            if "acker" in str(filter) and not amended:
                await real.update_one({"_id": "a"}, {"$set": {"mature": time.time() - 60}})
                amended.extend(await store.amend([Amend("a", delay=3600)]))
            return await real.delete_many(filter, *args, **kwargs)

    store._coll = _LapsedFirst()
    try:
        done = await queue.ok_many(held)
    finally:
        store._coll = real
    assert amended == [True]
    assert done == [False, True]
    assert await queue.total_size() == 1


async def _ok_many_with(queue: aio_keuss.Queue, between: Any) -> list[bool]:
    """``ok_many`` of the two messages ``a`` and ``b`` reserved together, ``between``
    (awaited with the store and the held messages) run once the batch's claim landed and
    before its delete is sent: the interleaving of a call from elsewhere, made exact."""
    await queue.push_many(["a", "b"], ids=["a", "b"])
    held = sorted(await queue.reserve_many(2, timeout=0), key=lambda m: m.id)
    store: Any = queue._store  # type: ignore[attr-defined]
    real = store._coll
    ran: list[bool] = []

    class _Between:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        async def delete_many(self, filter: Any, *args: Any, **kwargs: Any) -> Any:
            if "acker" in str(filter) and not ran:
                ran.append(True)
                store._coll = real  # the call between goes straight to the server
                await between(store, held)
            return await real.delete_many(filter, *args, **kwargs)

    store._coll = _Between()
    try:
        done = await queue.ok_many(held)
    finally:
        store._coll = real
    assert ran == [True]
    return done


async def test_an_ok_by_bare_id_between_a_batch_s_claim_and_delete_leaves_it_to_the_batch(
    queue: aio_keuss.Queue,
) -> None:
    """An ok by bare id (no count, no token: another client's, or an admin's) lands
    between a batch ok's claim and its delete. It ended the claimed message, and the
    batch, finding two gone for one deleted, answered False for both: its caller of ``b``,
    whose ok ended ``b``, was told it had not. The holder's ok, under way, ends the
    message; the ok by id is refused, so that exactly one caller is told it ended it."""
    bare: list[list[bool]] = []

    async def bare_ok(store: Any, held: list[aio_keuss.Message]) -> None:
        bare.append(await store.commit([Ack("a", None, None)]))
        bare.append(await store.commit([Ack("a", None, None), Ack("b", None, None)]))

    done = await _ok_many_with(queue, bare_ok)
    assert bare == [[False], [False, False]]
    assert done == [True, True]
    assert (await queue.stats())["commit"] == 2
    assert await queue.total_size() == 0


@pytest.mark.parametrize("resend", ["one", "batch"])
async def test_an_ok_sent_again_between_a_batch_s_claim_and_delete_leaves_both_true(
    queue: aio_keuss.Queue, resend: str
) -> None:
    """The same reservation's ok sent again (a retry of the holder, this process or
    another) lands between the batch's claim and its delete and ends ``a``, as it must
    once the first delete failed. The batch then found two gone for one deleted and
    answered False for both, ``b`` too, which it ended. Both calls are the one holder's,
    for the one reservation: each is told its message was ended."""
    again: list[list[bool]] = []

    async def ok_again(store: Any, held: list[aio_keuss.Message]) -> None:
        a = held[0]
        acks = [Ack(a.id, a.tries, a._token)]  # type: ignore[attr-defined]
        if resend == "batch":
            acks.append(Ack("c", None, None))  # (not there: a batch of two, one claimed)
        again.append(await store.commit(acks))

    done = await _ok_many_with(queue, ok_again)
    assert again == [[True] if resend == "one" else [True, False]]
    assert done == [True, True]
    assert await queue.total_size() == 0


async def test_a_move_by_bare_id_between_a_batch_s_claim_and_delete_leaves_it_to_the_batch(
    queue: aio_keuss.Queue,
) -> None:
    """A move by bare id landing between the claim and the delete took the claimed
    message to another queue: the batch answered False for both it and the one it
    ended. The holder's ok, under way, ends it; the move is refused."""
    moved: list[str | None] = []

    async def move(store: Any, held: list[aio_keuss.Message]) -> None:
        moved.extend(await store.move([Move("a", None, "elsewhere")]))

    done = await _ok_many_with(queue, move)
    assert moved == [None]
    assert done == [True, True]
    assert await queue.total_size() == 0


async def test_a_claim_left_by_a_crash_between_claim_and_delete_is_delivered_after_its_lease(
    queue: aio_keuss.Queue,
) -> None:
    """A process died between a batch ok's claim and its delete (here: the delete never
    sent), and no one sends the oks again. Its messages are held by the claim, as by a
    reservation, until the lease ends (an older release, which knows no claim, reads them
    so too: reserved, due later, no owner); then they are delivered again, counted as a
    further try, and the new holder's oks, one and batch, end them, its ko and bare-id
    calls act on them. The dead holder's late oks are refused. The lease's end is written
    into the documents (``mature``) rather than waited for."""
    a, b = await _claimed_not_ended(queue)
    store: Any = queue._store  # type: ignore[attr-defined]
    assert await queue.reserve_many(2, timeout=0) == []  # held by the claim
    assert await queue.remove(a.id) is False
    claimed = await store._coll.find({}).to_list()
    assert all(d["reserved"] and "owner" not in d and d["mature"] > time.time() for d in claimed)
    await store._coll.update_many({}, {"$set": {"mature": time.time() - 1}})  # the lease ends
    again = sorted(await queue.reserve_many(2, timeout=0), key=lambda m: m.id)
    assert [(m.id, m.tries) for m in again] == [("a", a.tries + 1), ("b", b.tries + 1)]
    assert await queue.ok_many([a, b]) == [False, False]  # the dead holder's, late
    assert await queue.ok(a) is False
    assert await queue.ko(again[1], 0) is KoResult.ROLLED_BACK
    assert await queue.ok_many([again[0]]) == [True]
    (b_again,) = await queue.reserve_many(2, timeout=0)
    assert await queue.ok(b_again.id) is True  # by bare id: the stale claim's fields do not hold it
    assert await queue.total_size() == 0
    assert (await queue.stats())["commit"] == 2


async def test_a_move_by_bare_id_in_a_transaction_between_a_batch_s_claim_and_delete_is_refused(
    queue: aio_keuss.Queue,
) -> None:
    """The move of the test above, on a server with transactions (a replica set: here
    ``transactions=True``, the same path): its read took the claimed message, and the
    transaction deleted it here and inserted it there. The batch, finding ``a`` gone while
    its claim ran, answered True for it too: the message was both ended by the holder's ok
    and moved. It yields to the claim as the move without transactions does."""
    moved: list[str | None] = []

    async def move(store: Any, held: list[aio_keuss.Message]) -> None:
        backend = store._backend
        was, backend.transactions = backend.transactions, True
        try:
            moved.extend(await store.move([Move("a", None, "elsewhere")]))
        finally:
            backend.transactions = was

    done = await _ok_many_with(queue, move)
    assert moved == [None]
    assert done == [True, True]
    assert await queue.total_size() == 0


async def test_a_deadletter_read_before_a_bare_batch_ok_s_claim_does_not_take_it_in_a_transaction(
    queue: aio_keuss.Queue,
) -> None:
    """A message reserved with no owner (an older release's reserve) is read by a ko by
    bare id past ``max_ko`` (its deadletter move), then claimed by a batch ok by bare ids
    before the move's transaction. The transaction's delete asked for the reservation as
    read (id, count, reserved), which the claim leaves: it moved the claimed message, and
    the batch, finding it gone while its claim ran, answered True for it as well."""
    await queue.push_many(["a", "b"], ids=["a", "b"])
    store: Any = queue._store  # type: ignore[attr-defined]
    real = store._coll
    await real.update_many({}, {"$set": {"reserved": True, "mature": time.time() + 600}})
    await real.update_many({}, {"$inc": {"tries": 1}})
    read = await real.find_one({"_id": "a"})
    moved: list[str | None] = []

    class _Between:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        async def delete_many(self, filter: Any, *args: Any, **kwargs: Any) -> Any:
            if "acker" in str(filter) and not moved:
                store._coll = real
                backend = store._backend
                was, backend.transactions = backend.transactions, True
                try:
                    moved.append(await store._move_doc(read, Move("a", None, "dead"), time.time()))
                finally:
                    backend.transactions = was
            return await real.delete_many(filter, *args, **kwargs)

    store._coll = _Between()
    try:
        done = await store.commit([Ack("a", None, None), Ack("b", None, None)])
    finally:
        store._coll = real
    assert moved == [None]
    assert done == [True, True]
    assert await queue.total_size() == 0


async def test_an_extend_by_bare_id_between_a_batch_s_claim_and_delete_keeps_the_lease(
    queue: aio_keuss.Queue,
) -> None:
    """An extend by bare id (no count, no token) landing between a batch ok's claim and
    its delete rewrote the claim's lease (``mature``) to its own, shorter, end: another
    consumer then reserved ``a`` and ended it with its ok, and the batch, finding ``a``
    gone while its claim ran, answered True for it too (two consumers told they ended
    one message). The extend yields to the claim as an ok by bare id does."""
    extended: list[bool] = []
    other: list[list[bool]] = []

    async def extend_then_take(store: Any, held: list[aio_keuss.Message]) -> None:
        extended.extend(await store.extend([Extend("a", None, 1e-3)]))
        taken = await store.reserve(1, 30.0)
        while extended == [True] and not taken.messages:  # (the extended end: 1 ms)
            await asyncio.sleep(0.01)
            taken = await store.reserve(1, 30.0)
        other.extend([await store.commit([Ack(m.id, m.tries, m.token)]) for m in taken.messages])

    done = await _ok_many_with(queue, extend_then_take)
    assert extended == [False]
    assert other == []
    assert done == [True, True]
    assert await queue.total_size() == 0


async def _a_lapsed_claim(queue: aio_keuss.Queue) -> tuple[aio_keuss.Message, Any]:
    """A batch ok's claim not ended (its process died), its lease lapsed: the claimed
    message ``a`` and the queue's store."""
    a, _ = await _claimed_not_ended(queue)
    store: Any = queue._store  # type: ignore[attr-defined]
    await store._coll.update_many({}, {"$set": {"mature": time.time() - 1}})  # the lease ends
    return a, store


async def _an_ordinary_reservation(
    queue: aio_keuss.Queue, store: Any, a: aio_keuss.Message
) -> None:
    """``a`` no longer reads as claimed by a batch ok, and its ok by bare id ends it."""
    late = {"_id": a.id, "acker": {"$exists": True}, "owner": {"$exists": False}}
    assert await store._coll.count_documents(late) == 0
    assert await queue.ok(a.id) is True
    assert await store._coll.count_documents({"_id": a.id}) == 0


async def test_an_extend_by_bare_id_of_a_lapsed_claim_holds_it_as_a_reservation(
    queue: aio_keuss.Queue,
) -> None:
    """A process died between a batch ok's claim and its delete, the lease lapsed, and an
    extend by bare id (no count, no token) takes the message as a reservation, as it
    does a lapsed one. It rewrote the lease itself: the message read as claimed again
    (``acker`` left, no ``owner``, the lease ahead), so the extender's own calls by bare
    id (its next renewal, its ok) yielded to a claim no one runs, and the message came
    back at the extended end, delivered again though handled. Now the extended message
    is an ordinary reservation; the dead batch's late delete no longer ends it."""
    a, store = await _a_lapsed_claim(queue)
    assert await queue.extend(a.id, 600) is True
    assert await queue.extend(a.id, 600) is True  # its next renewal
    await _an_ordinary_reservation(queue, store, a)


async def test_an_extend_by_bare_id_as_long_as_the_claim_s_lease_is_refused(
    queue: aio_keuss.Queue,
) -> None:
    """The extend of the test above asks for as long as the claim's lease: its update,
    refused, left ``a`` at an end within half a second of its own, and the read of what
    it extended (every message it extends gets the very same end) took the claim's for
    its own: it answered True for a message the holder's ok was ending."""
    extended: list[bool] = []

    async def extend(store: Any, held: list[aio_keuss.Message]) -> None:
        extended.extend(await store.extend([Extend("a", None, CLAIM_LEASE)]))

    done = await _ok_many_with(queue, extend)
    assert extended == [False]
    assert done == [True, True]
    assert await queue.total_size() == 0


async def test_a_move_by_bare_id_of_a_lapsed_claim_whose_copy_failed_leaves_no_claim(
    queue: aio_keuss.Queue,
) -> None:
    """A process died between a batch ok's claim and its delete, the lease lapsed, and a
    move by bare id takes the message (as it takes a lapsed reservation); its copy is
    refused, and the move gives its claim back. The claim of the move rewrote the lease
    and left ``acker``: the message read as claimed by a batch ok again, so every call by
    bare id (ok, ko, move, extend) was refused until that lease ended, and the dead
    batch's late delete could still end it. Now it is an ordinary reservation again."""
    a, store = await _a_lapsed_claim(queue)
    with copies_refused(store), pytest.raises(KeussError):
        await queue.move(a.id, "to")
    await _an_ordinary_reservation(queue, store, a)


async def test_a_lapsed_batch_s_late_delete_does_not_end_what_a_move_by_bare_id_copies(
    queue: aio_keuss.Queue,
) -> None:
    """A batch ok's claim lapsed before its delete was sent (a slow process), and a move
    by bare id took ``a`` (as it takes a lapsed reservation). The batch's delete, landing
    between the move's claim and its copy, still matched ``a`` (the move's claim left
    ``acker``): it ended ``a`` and answered True, and the move copied ``a`` on and
    answered moved: acknowledged as done, and in the next queue too. The move took the
    message first: the batch is refused ``a``."""
    await queue.push_many(["a", "b"], ids=["a", "b"])
    held = sorted(await queue.reserve_many(2, timeout=0), key=lambda m: m.id)
    store: Any = queue._store  # type: ignore[attr-defined]
    real, insert_docs = store._coll, store._insert_docs
    claimed, copying, answered = asyncio.Event(), asyncio.Event(), asyncio.Event()

    class _DeleteWaits:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        async def delete_many(self, filter: Any, *args: Any, **kwargs: Any) -> Any:
            if "acker" in str(filter) and not claimed.is_set():
                claimed.set()
                await copying.wait()
            return await real.delete_many(filter, *args, **kwargs)

    async def copy_after_the_delete(coll: Any, *args: Any, **kwargs: Any) -> Any:
        if coll.name != real.name:
            copying.set()
            await answered.wait()  # the batch's delete landed, and its reads after it
        return await insert_docs(coll, *args, **kwargs)

    async def ok_many() -> list[bool]:
        try:
            return await queue.ok_many(held)
        finally:
            answered.set()

    store._coll = _DeleteWaits()
    store._insert_docs = copy_after_the_delete
    try:
        batch = asyncio.create_task(ok_many())
        await claimed.wait()
        await real.update_many({}, {"$set": {"mature": time.time() - 1}})  # the lease ends
        moved = await queue.move("a", "to")
        done = await batch
    finally:
        store._coll, store._insert_docs = real, insert_docs
    assert moved == "a"
    assert done == [False, True]
    assert await queue.total_size() == 0
    assert await store._backend.queue_collection("to").count_documents({}) == 1
