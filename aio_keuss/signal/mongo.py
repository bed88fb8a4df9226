"""Signals over MongoDB: one small document per signal, one listener task per factory.

Two transports (backend option ``signal_transport``):

- ``"changestream"`` (default): signals are inserted into ``<prefix>_signals`` (a TTL index
  drops them after a minute) and the listener watches that collection's inserts. Change
  streams need a replica set or a sharded cluster on a real MongoDB: a one-node replica set
  (``mongod --replSet rs0`` + ``rs.initiate()``) is enough.
- ``"capped"``: Keuss's way, for standalone servers: a capped collection
  ``<prefix>_signals_capped`` read with a tailable await cursor. (Servers without capped
  collections, such as the SQLite-backed test server, cannot use it.)

The payload is stored as a string (the JSON the base class encodes), not as binary, so any
server echoes it back as it was. Signals are hints: while the listener is disconnected
consumers fall back to polling; once it is back every local queue is woken, since what was
signalled meanwhile is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pymongo import CursorType
from pymongo import errors as mongo_errors

from ..backends._mongo import mongo_errors_translated
from .base import SignalBus

if TYPE_CHECKING:
    from ..backends._mongo import Collection, MongoBackend

SIGNAL_TTL = 60
CAPPED_SIZE = 1 << 20
NAMESPACE_EXISTS = 48


class MongoSignalBus(SignalBus):
    def __init__(self, backend: MongoBackend, debounce: float = 0.05) -> None:
        super().__init__(debounce)
        self._backend = backend
        self._capped = backend.settings["signal_transport"] == "capped"
        parts = ("signals", "capped") if self._capped else ("signals",)
        self._coll: Collection = backend.collection(*parts)

    async def _publish(self, payload: bytes) -> None:
        with mongo_errors_translated():
            await self._coll.insert_one({"p": payload.decode(), "t": datetime.now(UTC)})

    async def _listen(self, ready: Callable[[], None]) -> None:
        with mongo_errors_translated():
            if self._capped:
                await self._tail(ready)
            else:
                await self._watch(ready)

    async def _watch(self, ready: Callable[[], None]) -> None:
        await self._coll.create_index("t", expireAfterSeconds=SIGNAL_TTL)
        pipeline = [{"$match": {"operationType": "insert"}}]
        async with await self._coll.watch(pipeline) as stream:
            ready()
            async for change in stream:
                self._feed(change.get("fullDocument"))

    async def _tail(self, ready: Callable[[], None]) -> None:
        try:
            await self._backend.db.create_collection(self._coll.name, capped=True, size=CAPPED_SIZE)
        except mongo_errors.CollectionInvalid:
            pass  # exists already
        except mongo_errors.OperationFailure as exc:
            if exc.code != NAMESPACE_EXISTS:
                raise
        # A tailable cursor on an empty capped collection dies at once: keep one document.
        last = await self._coll.find_one({}, sort=[("$natural", -1)])
        if last is None:
            await self._coll.insert_one({"p": None, "t": datetime.now(UTC)})
            last = await self._coll.find_one({}, sort=[("$natural", -1)])
        assert last is not None
        cursor = self._coll.find(
            {"_id": {"$gt": last["_id"]}}, cursor_type=CursorType.TAILABLE_AWAIT
        )
        ready()
        try:
            while cursor.alive:
                async for doc in cursor:
                    self._feed(doc)
        finally:
            await cursor.close()
        raise ConnectionError("tailable cursor died")

    def _feed(self, doc: Any) -> None:
        payload = doc.get("p") if isinstance(doc, dict) else None
        if isinstance(payload, str | bytes):
            self._receive(payload)
