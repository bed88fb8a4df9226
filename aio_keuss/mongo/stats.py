"""Stats in MongoDB: one document per queue in ``<prefix>_stats``; pipeline topologies in
``<prefix>_pipelines``.

``{_id: queue, c_put: n, c_get: n, ..., paused: bool, options: {...}}``. Counters are flat
top-level fields (not ``counters.put``): an upsert that creates a document from dotted ``$inc``
paths is exactly where MongoDB look-alikes differ, and flat fields cost nothing. Increments
are buffered by :class:`StatsStore` and written as ONE ``bulk_write`` of upserting
``UpdateOne`` per flush, whatever the number of queues in it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from pymongo import UpdateOne
from pymongo.errors import DuplicateKeyError

from ..stats import COUNTERS, Increments, StatsStore
from .connection import translated

if TYPE_CHECKING:
    from .connection import MongoConnection

_PREFIX = "c_"


class MongoStats(StatsStore):
    def __init__(self, backend: MongoConnection) -> None:
        super().__init__()
        self._coll = backend.collection("stats")
        self._pipelines = backend.collection("pipelines")

    @translated
    async def _apply(self, increments: Increments) -> None:
        operations = []
        for queue, counters in increments.items():
            inc = {_PREFIX + name: n for name, n in counters.items() if n}
            if inc:
                operations.append(UpdateOne({"_id": queue}, {"$inc": inc}, upsert=True))
        if operations:
            await self._coll.bulk_write(operations, ordered=False)

    @translated
    async def _load_counters(self, queue: str) -> dict[str, int]:
        doc = await self._coll.find_one({"_id": queue})
        if doc is None:
            return {}
        return {k[len(_PREFIX) :]: int(v) for k, v in doc.items() if k.startswith(_PREFIX)}

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
    async def keep_pipeline(self, name: str, topology: dict[str, Any]) -> dict[str, Any]:
        # an insert refused on the _id (one step: the unique _id index), then the one in
        # place; removed in between, the insert is tried again
        while True:
            with contextlib.suppress(DuplicateKeyError):
                await self._pipelines.insert_one({"_id": name, "topology": topology})
                return topology
            doc = await self._pipelines.find_one({"_id": name})
            if doc is not None:
                return dict(doc["topology"])

    @translated
    async def pipelines(self) -> dict[str, dict[str, Any]]:
        docs = await self._pipelines.find({}).to_list()
        return {d["_id"]: dict(d["topology"]) for d in sorted(docs, key=lambda d: d["_id"])}

    @translated
    async def remove_pipeline(self, name: str) -> bool:
        return (await self._pipelines.delete_one({"_id": name})).deleted_count == 1
