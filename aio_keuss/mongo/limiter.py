"""The queues' rate limiters in MongoDB: ``contract.rate_step`` on one document per queue.

``<prefix>_rates`` holds ``{_id: queue, t, u, r, v, expires}``: ``t`` (GCRA's theoretical
arrival time) and ``u`` (held until) in epoch seconds, ``r`` the count of takes refused
(``RateState.refused``; none in a document written before it was kept: 0), ``v`` the
token of the step that wrote it, ``expires`` the later of the two times as a date under a
TTL index (MongoDB manual, "Expire Data from Collections by Setting TTL"), so an idle
queue's limiter leaves nothing behind: a state whose both times are past is the same as none.

A step is a compare-and-set on that document: read it, run ``rate_step`` in Python, write
the new state only where ``v`` is still the token read (an insert where there was none,
refused as a duplicate ``_id`` when another step inserted first); a write that finds another
step's in between reads again. Every step thus applies to the state it read, none is lost,
and one of any racing steps always lands. One ``find_one_and_update`` with an
aggregation-pipeline update (MongoDB 4.2+) would run the step on the server in one call,
but the SQLite-backed look-alike the test suite runs, and others like it, refuse a pipeline
as an update; ``$$NOW``, the server's clock, exists only inside one.

Clock: the client's ``time.time()``, as for every time of the MongoDB backends (see
``aio_keuss.mongo.connection``). Clients sharing a queue's limit must keep their clocks in
sync: a skew of s seconds moves when grants fall due by up to s. The TTL index deletes on
the server's clock, so a document outlives its last time by ``EXPIRY_SLACK``: a server
clock ahead of a client's by less than that never drops a state still in force.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pymongo import ASCENDING
from pymongo.errors import DuplicateKeyError

from ..contract import RateGrant, RateRule, RateState, rate_step
from ..ids import new_id
from .connection import Document, Once, translated

if TYPE_CHECKING:
    from .connection import MongoConnection

EXPIRY_SLACK = 60.0
"""Seconds a limiter's document is kept past its last time (see the module's docstring)."""


class MongoRates:
    """The rate limiters of one MongoDB backend: ``Backend.rate_take`` on its database."""

    def __init__(self, backend: MongoConnection) -> None:
        self._coll = backend.collection("rates")
        self._indexed = Once()

    async def _ensure_index(self) -> None:
        """The TTL index, made once per backend (see :class:`Once`)."""
        await self._indexed.run("rates", self._create_index)

    async def _create_index(self) -> None:
        await self._coll.create_index([("expires", ASCENDING)], expireAfterSeconds=0)

    @translated
    async def take(
        self, queue: str, rule: RateRule, count: int, hold: float, end: float
    ) -> RateGrant:
        await self._ensure_index()
        while True:
            doc = await self._coll.find_one({"_id": queue})
            now = time.time()
            state = RateState() if doc is None else _state(doc)
            new, grant = rate_step(state, now, rule, count, hold, end)
            if await self._write(queue, doc, new, now):
                return grant

    async def _write(self, queue: str, doc: Document | None, new: RateState, now: float) -> bool:
        """Put ``new`` where ``doc`` (None: no document) was read; False if another step
        wrote in between. A state all past is stored as no document; one the step left as
        it was is not written (the step then took effect at its read)."""
        if doc is not None and new == _state(doc):
            return True
        last = max(new.tat, new.until)
        if last <= now:
            if doc is None:
                return True
            deleted = await self._coll.delete_one({"_id": queue, "v": doc["v"]})
            return deleted.deleted_count == 1
        fields = {
            "t": new.tat,
            "u": new.until,
            "r": new.refused,
            "v": new_id(),
            "expires": datetime.fromtimestamp(last + EXPIRY_SLACK, UTC),
        }
        if doc is None:
            try:
                await self._coll.insert_one({"_id": queue, **fields})
            except DuplicateKeyError:
                return False
            return True
        updated = await self._coll.update_one({"_id": queue, "v": doc["v"]}, {"$set": fields})
        return updated.matched_count == 1


def _state(doc: Document) -> RateState:
    return RateState(float(doc["t"]), float(doc["u"]), int(doc.get("r", 0)))
