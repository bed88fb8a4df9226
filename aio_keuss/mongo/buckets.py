"""bucket-mongo: the bucket store (``bucket.py``) over MongoDB, Keuss's bucket-mongo-safe;
this file holds only its atomic bucket operations.

The client, database, signal bus and stats store are those of the ``mongo`` backends (see
:mod:`aio_keuss.mongo.connection`), which this one extends with one collection,
``<prefix>_buckets``: one document per bucket, every queue in it::

    {_id: bucket id, id: bucket id, queue, score, owner, count, remaining,
     blob: Binary, state: Binary, seq}

(``seq``: the number of the last state write of its lease, 0 once leased; a document
of an earlier release has none, read as 0.)

indexed by (queue, score, id) for leasing (created on first use; creating it again, or
concurrently, is harmless). ``id`` repeats ``_id`` because some servers (the SQLite-backed
test server among them) cannot put ``_id`` in a compound index.

Every operation is atomic per bucket, not across buckets (no multi-document transactions):

- insert: ``insert_many(ordered=False)``. Not all-or-none: a failure may leave some of the
  buckets written (their pushes were reported failed, so at worst a retry duplicates them).
  A duplicate key is a bucket an earlier attempt already wrote, so a retry succeeds.
- lease: ``find_one_and_update`` on ``score <= now`` in (score, id) order, one bucket per
  round trip until their ``remaining`` covers the request; each takes a bucket atomically,
  so concurrent leasers never get the same one. When they do not cover it, one more read
  for the lowest score left; when they do, ``next_score`` is ``now`` ("look again"), as
  only a fetch that came up short reads it, and such a fetch leases again. By id (a
  remove): one ``find_one_and_update`` per bucket.
- write: every update in ONE ``bulk_write``, each conditioned on ``owner`` being the token
  of the lease it was made under and on ``seq`` being below its own (missing counts as
  0), and stamping a per-call nonce; a bulk result only counts matches, so when fewer
  matched than were sent one read says which did (the nonce) and which were refused by
  ``seq`` alone (owner still theirs: superseded, the lease kept). A release taken over and
  written by its next holder before that read is reported lost: the bucket left either
  way, only a warning is logged. A delete is its own ``delete_one`` (once in a bucket's
  life, bar a retry), so its result is its own; a refused one is looked at by the same
  read.
- census: one ``$group`` aggregation.

Times come from the caller (see ``bucket.py``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection, Sequence
from typing import Any, ClassVar

from pymongo import ASCENDING, ReturnDocument, UpdateOne
from pymongo import errors as mongo_errors

from ..buckets.settings import bucket_backend_options
from ..buckets.storage import (
    DELETE,
    RELEASE,
    BucketStorage,
    Census,
    Lease,
    LeasedBucket,
    NewBucket,
    Outcome,
    StateWrite,
)
from ..buckets.store import BucketBackend
from .backend import MongoBackend
from .connection import DUPLICATE_KEY, Document, Once, translated
from .connection import Collection as MongoCollection

BY_SCORE = [("queue", ASCENDING), ("score", ASCENDING), ("id", ASCENDING)]
"""The lease index, and the sort of every query on it: with ``queue`` fixed by the filter this
is (score, id) order, spelled in full so that the SQLite-backed test server also walks the
index (sorted on (score, id) alone it sorts the whole collection)."""
LEASED_FIELDS: Document = {"blob": 1, "state": 1, "owner": 1, "remaining": 1}


class MongoBucketStorage(BucketStorage):
    max_bucket_bytes = 15 * 2**20  # a bucket is one document: MongoDB's 16 MB BSON limit

    def __init__(self, backend: MongoBackend) -> None:
        self._backend = backend
        self._coll: MongoCollection = backend.collection("buckets")
        self._indexed = Once()

    async def prepare(self) -> None:
        """Create the lease index once per backend (see :class:`Once`)."""
        await self._indexed.run("buckets", self._create_index)

    @translated
    async def _create_index(self) -> None:
        await self._coll.create_index(BY_SCORE)

    @translated
    async def insert_buckets(self, queue: str, buckets: Sequence[NewBucket]) -> None:
        docs = [
            {
                "_id": b.id,
                "id": b.id,
                "queue": queue,
                "score": b.score,
                "owner": "",
                "count": b.count,
                "remaining": b.count,
                "blob": b.blob,
                "state": b.state,
            }
            for b in buckets
        ]
        try:
            await self._coll.insert_many(docs, ordered=False)
        except mongo_errors.BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            if not errors or any(e.get("code") != DUPLICATE_KEY for e in errors):
                raise

    @translated
    async def lease(
        self,
        queue: str,
        token: str,
        now: float,
        deadline: float,
        want: int,
        max_buckets: int,
        ids: Sequence[str] | None = None,
        exclude: Collection[str] = (),
    ) -> Lease:
        take = {"$set": {"owner": token, "score": deadline, "seq": 0}}
        if ids is not None:
            # Free, or its lease expired. Spelled with $and: the SQLite-backed test
            # server drops the other fields of a write's filter next to a top-level $or.
            free = {"$or": [{"owner": ""}, {"score": {"$lte": now}}]}
            found = await asyncio.gather(
                *(
                    self._coll.find_one_and_update(
                        {"$and": [{"_id": i}, {"queue": queue}, free]},
                        take,
                        projection=LEASED_FIELDS,
                        return_document=ReturnDocument.BEFORE,
                    )
                    for i in dict.fromkeys(ids)
                )
            )
            return Lease([_leased(d) for d in found if d is not None], None)
        due: Document = {"queue": queue, "score": {"$lte": now}}
        if exclude:
            due["_id"] = {"$nin": list(exclude)}
        taken: list[LeasedBucket] = []
        total = 0
        while len(taken) < max_buckets and (total < want or not taken):
            doc = await self._coll.find_one_and_update(
                due,
                take,
                sort=BY_SCORE,
                projection=LEASED_FIELDS,
                return_document=ReturnDocument.BEFORE,
            )
            if doc is None:
                break
            taken.append(_leased(doc))
            total += int(doc["remaining"])
        if taken and total >= want:
            # Covered: the wait loop reads ``next_score`` only after a fetch that came
            # up short, and such a fetch leases again (and reads the exact score then);
            # ``now`` ("look again") spares a round trip on every covered lease.
            return Lease(taken, now)
        rest: Document = {"queue": queue}
        if taken or exclude:
            rest["_id"] = {"$nin": [*(b.id for b in taken), *exclude]}
        low = await self._coll.find_one(rest, {"score": 1}, sort=BY_SCORE)
        return Lease(taken, None if low is None else float(low["score"]))

    @translated
    async def write(self, queue: str, writes: Sequence[StateWrite]) -> list[Outcome]:
        nonce = os.urandom(8).hex()
        updates: list[int] = []
        requests: list[UpdateOne] = []
        deletes: list[int] = []
        for k, w in enumerate(writes):
            if w.mode == DELETE:
                deletes.append(k)
                continue
            fields: Document = {
                "score": w.score,
                "remaining": w.remaining,
                "seq": w.seq,
                "wid": nonce,
            }
            if w.state is not None:
                fields["state"] = w.state
            if w.mode == RELEASE:
                fields["owner"] = ""
            updates.append(k)
            requests.append(UpdateOne(_mine(queue, w), {"$set": fields}))
        outcomes = [Outcome.LOST] * len(writes)
        deleted, matched = await asyncio.gather(
            asyncio.gather(*(self._coll.delete_one(_mine(queue, writes[k])) for k in deletes)),
            self._bulk(requests),
        )
        refused = [
            k for k, result in zip(deletes, deleted, strict=True) if not result.deleted_count
        ]
        for k in deletes:
            if k not in refused:
                outcomes[k] = Outcome.WRITTEN
        if matched == len(updates):
            for k in updates:
                outcomes[k] = Outcome.WRITTEN
        else:
            refused += updates
        if refused:
            # Which matched (the nonce), and which were refused by their number alone: the
            # owner is still theirs then (a lease's token never comes back once replaced),
            # so a later write of that lease is stored.
            cursor = self._coll.find(
                {"_id": {"$in": [writes[k].id for k in refused]}},
                {"_id": 1, "wid": 1, "owner": 1, "seq": 1},
            )
            found = {d["_id"]: d for d in await cursor.to_list()}
            for k in refused:
                doc = found.get(writes[k].id)
                if doc is None:
                    continue
                if doc.get("wid") == nonce:
                    outcomes[k] = Outcome.WRITTEN
                elif doc.get("owner") == writes[k].owner:
                    seq = int(doc.get("seq", 0))
                    outcomes[k] = Outcome.WRITTEN if seq == writes[k].seq else Outcome.SUPERSEDED
        return outcomes

    async def _bulk(self, requests: list[UpdateOne]) -> int:
        if not requests:
            return 0
        result = await self._coll.bulk_write(requests, ordered=False)
        return result.matched_count

    @translated
    async def census(self, queue: str, exclude: Collection[str], now: float) -> Census:
        match: Document = {"queue": queue}
        if exclude:
            match["_id"] = {"$nin": list(exclude)}
        later = {"$gt": ["$score", now]}
        pipeline: list[Document] = [
            {"$match": match},
            {
                "$group": {
                    "_id": None,
                    "ready": {"$sum": {"$cond": [{"$lte": ["$score", now]}, "$remaining", 0]}},
                    "scheduled": {
                        "$sum": {
                            "$cond": [
                                {"$and": [later, {"$eq": ["$owner", ""]}]},
                                "$remaining",
                                0,
                            ]
                        }
                    },
                    "reserved": {
                        "$sum": {
                            "$cond": [
                                {"$and": [later, {"$ne": ["$owner", ""]}]},
                                "$remaining",
                                0,
                            ]
                        }
                    },
                    "low": {"$min": "$score"},
                }
            },
        ]
        rows = await (await self._coll.aggregate(pipeline)).to_list()
        if not rows:
            return Census(0, 0, 0, None)
        row = rows[0]
        low = row.get("low")
        return Census(
            int(row["ready"]),
            int(row["scheduled"]),
            int(row["reserved"]),
            None if low is None else float(low),
        )


def _mine(queue: str, write: StateWrite) -> Document:
    """The filter of ``write``: its bucket, still owned by its lease, its number past the
    one stored (a document of an earlier release has none). Spelled with $and around the
    $or: the SQLite-backed test server drops the other fields of a filter next to a
    top-level $or."""
    newer = {"$or": [{"seq": {"$lt": write.seq}}, {"seq": {"$exists": False}}]}
    return {"$and": [{"_id": write.id}, {"queue": queue}, {"owner": write.owner}, newer]}


def _leased(doc: Document) -> LeasedBucket:
    return LeasedBucket(doc["_id"], bytes(doc["blob"]), bytes(doc["state"]), doc["owner"])


class MongoBucketBackend(BucketBackend, MongoBackend):
    """``bucket-mongo``: the MongoDB options (url, client, database, prefix, signal transport,
    server selection timeout) plus the bucket options of
    :data:`aio_keuss.buckets.settings.BUCKET_OPTIONS` (seconds)."""

    name = "bucket-mongo"
    options: ClassVar[dict[str, Any]] = bucket_backend_options(
        MongoBackend.options, without="transactions"
    )

    def __init__(self, options: dict[str, Any]) -> None:
        # transactions tunes the per-message deadletter move only; buckets never use them
        super().__init__({**options, "transactions": False})
        self.use_storage(MongoBucketStorage(self))
