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

Both transports wait on the server: a getMore on the stream or the tailable cursor is answered
when something arrives or after ``maxAwaitTimeMS`` (see "Tailable Cursors" and "Change
Streams" in the MongoDB manual). A server that ignores that wait and answers an empty batch at
once (some MongoDB look-alikes do) would make the listener spin, burning a CPU core while the
factory is idle; so an empty batch answered much sooner than the wait is followed by a pause
that grows with the time since the last signal (see ``IDLE_SLOPE``). A server that does wait
is never paused for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pymongo import CursorType
from pymongo import errors as mongo_errors

from ..signal import SignalBus
from .connection import translated

if TYPE_CHECKING:
    from .connection import Collection, MongoConnection

SIGNAL_TTL = 60
CAPPED_SIZE = 1 << 20
NAMESPACE_EXISTS = 48
AWAIT_MS = 1000
"""``maxAwaitTimeMS`` asked of the server: how long a getMore may wait for a signal."""
IDLE_FIRST = 0.01
IDLE_SLOPE = 0.2
IDLE_CAP = 1.0
"""The pause after an empty batch the server did not wait for: ``IDLE_SLOPE`` times the time
since the last signal, within [``IDLE_FIRST``, ``IDLE_CAP``] seconds. A signal then waits at
most a fifth of the silence before it (a second at most) on such a server, and an idle
factory asks about once a second."""


class _Pacing:
    """Pauses between getMores that a server answered empty without waiting."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._asked = self._quiet_since = self._loop.time()

    def ask(self) -> None:
        """A getMore (or a pass over the cursor) starts now."""
        self._asked = self._loop.time()

    def got(self) -> None:
        """A signal came in: the next pauses are short again."""
        self._quiet_since = self._loop.time()

    async def empty(self) -> None:
        """The getMore came back empty: pause if the server answered without waiting."""
        now = self._loop.time()
        if now - self._asked >= AWAIT_MS / 2000:
            return  # it waited, as asked: ask again at once
        quiet = now - self._quiet_since
        await asyncio.sleep(min(IDLE_CAP, max(IDLE_FIRST, quiet * IDLE_SLOPE)))


class MongoSignalBus(SignalBus):
    def __init__(self, backend: MongoConnection, debounce: float = 0.05) -> None:
        super().__init__(debounce)
        self._backend = backend
        self._capped = backend.config.signal_transport == "capped"
        parts = ("signals", "capped") if self._capped else ("signals",)
        self._coll: Collection = backend.collection(*parts)

    @translated
    async def _publish(self, payload: bytes) -> None:
        await self._coll.insert_one({"p": payload.decode(), "t": datetime.now(UTC)})

    @translated
    async def _listen(self, ready: Callable[[], None]) -> None:
        if self._capped:
            await self._tail(ready)
        else:
            await self._watch(ready)

    async def _watch(self, ready: Callable[[], None]) -> None:
        await self._coll.create_index("t", expireAfterSeconds=SIGNAL_TTL)
        pipeline = [{"$match": {"operationType": "insert"}}]
        async with await self._coll.watch(pipeline, max_await_time_ms=AWAIT_MS) as stream:
            ready()
            pacing = _Pacing()
            while stream.alive:
                pacing.ask()
                change = await stream.try_next()  # at most one getMore
                if change is None:
                    await pacing.empty()
                else:
                    pacing.got()
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
        ).max_await_time_ms(AWAIT_MS)
        ready()
        pacing = _Pacing()
        try:
            while cursor.alive:
                pacing.ask()
                async for doc in cursor:  # what is buffered, then getMores until an empty one
                    pacing.got()
                    self._feed(doc)
                    pacing.ask()
                await pacing.empty()
        finally:
            await cursor.close()
        raise ConnectionError("tailable cursor died")

    def _feed(self, doc: Any) -> None:
        payload = doc.get("p") if isinstance(doc, dict) else None
        if isinstance(payload, str | bytes):
            self._receive(payload)
