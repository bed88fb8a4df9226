"""Stats in MongoDB: one document per queue in ``<prefix>_stats``; pipeline topologies in
``<prefix>_pipelines``.

``{_id: queue, c_put: n, c_get: n, ..., paused: bool, options: {...}}``. Counters are flat
top-level fields (not ``counters.put``): an upsert that creates a document from dotted ``$inc``
paths is exactly where MongoDB look-alikes differ, and flat fields cost nothing. Increments
are buffered by :class:`StatsStore` and written as ONE ``bulk_write`` of upserting
``UpdateOne`` per flush, whatever the number of queues in it.

A flush whose reply was lost is not counted twice when sent again: each update carries
this store's flush number and applies only where the document's ``f_<origin>`` field is
below it, setting it in the same (atomic, one-document) update. Where it is not below, the
upsert's filter matches nothing and its insert meets the existing ``_id``: that duplicate
key is the sign the queue's part had landed.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from pymongo import UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError

from ..errors import BackendError
from ..stats import COUNTERS, Increments, NumberedFlushes
from .connection import translated

if TYPE_CHECKING:
    from .connection import MongoConnection

_PREFIX = "c_"
_FLUSHED = "f_"
DUPLICATE_KEY = 11000


class MongoStats(NumberedFlushes):
    def __init__(self, backend: MongoConnection) -> None:
        super().__init__()
        self._coll = backend.collection("stats")
        self._pipelines = backend.collection("pipelines")

    @translated
    async def _write(self, increments: Increments, seq: int) -> None:
        flushed = _FLUSHED + self._origin
        below = {"$or": [{flushed: {"$exists": False}}, {flushed: {"$lt": seq}}]}
        queues = list(increments)
        for _ in range(3):
            operations = []
            for queue in queues:
                inc = {_PREFIX + name: n for name, n in increments[queue].items() if n}
                update = {"$inc": inc, "$set": {flushed: seq}}
                operations.append(UpdateOne({"_id": queue, **below}, update, upsert=True))
            try:
                await self._coll.bulk_write(operations, ordered=False)
                return
            except BulkWriteError as exc:
                errors = exc.details.get("writeErrors", [])
                if not errors or any(e.get("code") != DUPLICATE_KEY for e in errors):
                    raise
                refused = [queues[e["index"]] for e in errors]
            # Refused inserts: this flush had landed there (the filter matched nothing but
            # the document), or another process created the document in between (an
            # upsert is not retried by the server unless its filter is _id alone): those
            # go again.
            queues = [queue for queue in refused if not await self._landed(queue, seq)]
            if not queues:
                return
        raise BackendError(f"stats flush refused as a duplicate on {queues}")

    @translated
    async def _landed(self, queue: str, seq: int) -> bool:
        flushed = _FLUSHED + self._origin
        doc = await self._coll.find_one({"_id": queue}, {flushed: 1})
        value = None if doc is None else doc.get(flushed)
        return isinstance(value, int) and value >= seq

    @translated
    async def _stored_counters(self, queue: str) -> dict[str, int]:
        doc = await self._coll.find_one({"_id": queue})
        if doc is None:
            return {}
        return {k[len(_PREFIX) :]: int(v) for k, v in doc.items() if k.startswith(_PREFIX)}

    @translated
    async def _forget_flushes(self, queues: list[str]) -> None:
        unset = {"$unset": {_FLUSHED + self._origin: ""}}
        await self._coll.update_many({"_id": {"$in": queues}}, unset)

    @translated
    async def _reset(self, queue: str) -> None:
        await self._coll.update_one(
            {"_id": queue}, {"$unset": {_PREFIX + name: "" for name in COUNTERS}}
        )

    @translated
    async def set_paused(self, queue: str, paused: bool) -> None:
        await self._coll.update_one({"_id": queue}, {"$set": {"paused": paused}}, upsert=True)

    @translated
    async def is_paused(self, queue: str) -> bool:
        doc = await self._coll.find_one({"_id": queue}, {"paused": 1})
        return bool(doc and doc.get("paused"))

    @translated
    async def save_options(
        self, queue: str, options: dict[str, Any], *, replace: bool = True
    ) -> None:
        if replace:
            await self._coll.update_one({"_id": queue}, {"$set": {"options": options}}, upsert=True)
            return
        unrecorded = {"_id": queue, "options": {"$exists": False}}
        with contextlib.suppress(DuplicateKeyError):  # recorded: the upsert met its record
            await self._coll.update_one(unrecorded, {"$set": {"options": options}}, upsert=True)

    @translated
    async def queues(self) -> dict[str, dict[str, Any]]:
        docs = await self._coll.find({"options": {"$exists": True}}, {"options": 1}).to_list()
        return {doc["_id"]: dict(doc["options"]) for doc in sorted(docs, key=lambda d: d["_id"])}

    @translated
    async def save_pipeline(self, name: str, topology: dict[str, Any]) -> None:
        await self._pipelines.update_one(
            {"_id": name}, {"$set": {"topology": topology}}, upsert=True
        )

    @translated
    async def pipelines(self) -> dict[str, dict[str, Any]]:
        docs = await self._pipelines.find({}).to_list()
        return {d["_id"]: dict(d["topology"]) for d in sorted(docs, key=lambda d: d["_id"])}

    @translated
    async def remove_pipeline(self, name: str) -> bool:
        return (await self._pipelines.delete_one({"_id": name})).deleted_count == 1
