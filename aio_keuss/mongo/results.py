"""Job results in MongoDB: one document per (queue, id) in ``<prefix>_results``.

A document is ``{_id: "<queue>/<id>", body: <binary>, digest: <text>, expires: <date>}``.
Queue names never contain ``/`` (letters, digits and ``_ . : -``), so the first ``/`` of
an ``_id`` ends the queue name whatever the message id holds: ``q1`` + ``a:b`` and
``q1:a`` + ``b`` are ``q1/a:b`` and ``q1:a/b``.

- put: one ``update`` command of upserts (``bulk_write``, ``ordered=False``; PyMongo splits
  one past the server's 48 MB message into several), each a ``$set`` of the body, its
  digest and expiry, so each result is written whole and a second put of an id replaces
  the first. An upsert racing another of the same ``_id`` is retried by the server
  (MongoDB 4.2+, the manual's "Upsert with Unique Index"). Not a replacement: a server
  speaking the protocol (nx-27017) refuses to replace a document holding binary data.
- replace: one ``update`` command of updates, no upserts, each matching its document only
  while it holds the old body, unexpired; a single document's update is atomic (the
  MongoDB manual, "Atomicity and Transactions"), so a put landing first makes it match
  nothing. The body is matched by its ``digest`` (BLAKE2b, 128 bits, as hex), which every
  put writes beside it: nx-27017 matches no binary value in a filter (not by equality,
  ``$eq``, ``$in`` nor ``$expr``). A document without one was written by a release that
  kept none (a rolling upgrade): it is replaced whatever its body, as such a release used
  up its cancel requests itself (a plain put), since its body cannot be matched; the
  update that replaces it writes a digest, so the next replace matches by it again. Such
  a release writing over a body this one wrote leaves the older body's digest beside it:
  its body is then not replaced (a cancel request lapses in its time), and a replace of
  the older body, read before, writes over it.
- get: one ``find`` by ``_id`` with ``expires > now``, its first batch sized to hold every
  id asked for (a cursor's first batch is 101 documents by default); a get of more ids than
  one command holds (megabytes of them) takes one ``find`` per slice.
- expiry: a TTL index on ``expires`` (``expireAfterSeconds: 0``, the MongoDB manual's
  "Expire Data from Collections by Setting TTL"), made once per backend. MongoDB's TTL
  monitor runs about once a minute, and a server speaking the protocol may run none; so
  every store also deletes what has expired itself, in the background at most once per
  :data:`SWEEP_INTERVAL`, in batches of at most :data:`SWEEP_BATCH` documents, never
  holding up a put. (nx-27017 hands back a date an update wrote as text; it still
  compares and expires it as a date, and nothing here reads it back.)

Clock: the client's ``time.time()``, like every time of the MongoDB backends (see
``aio_keuss.mongo.connection``); the TTL monitor deletes on the server's clock, so a server
clock ahead of the writer's by s seconds ends a result up to s seconds early.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from bson import json_util
from pymongo import ASCENDING, UpdateOne

from ..coalesce import stop_task
from ..errors import InvalidPayloadError
from ..results import ResultStore
from .connection import Once, translated

if TYPE_CHECKING:
    from .connection import Collection, MongoConnection

log = logging.getLogger("aio_keuss.mongo")

MAX_BODY_BYTES = 16 * 2**20 - 8 * 2**10
"""Longest body a result may have: a result is one document, which MongoDB holds up to
16 MiB of BSON (MongoDB manual, "MongoDB Limits and Thresholds"); 8 KiB are left for its
``_id`` (a queue name and an id) and expiry. A put with a longer one is refused with
:class:`InvalidPayloadError` before anything is written, rather than by the driver as a
backend error after the other results of its bulk went in."""
SWEEP_INTERVAL = 60.0
"""Seconds between two sweeps of expired results by one store (see the module's docstring)."""
SWEEP_BATCH = 1000
"""Most documents one delete of a sweep removes."""
SWEEP_BATCHES = 100
"""Most deletes one sweep makes: past that, the rest waits for the next sweep."""


GET_KEYS_BYTES = 8 * 2**20
"""Most bytes of ``_id`` one ``find`` of a get names: a command is one BSON document of
at most 16 MiB (MongoDB manual, "MongoDB Limits and Thresholds"), and a get of more ids
than that holds (17,000 of the longest ids a message may have) was refused by the driver
(``DocumentTooLarge``, not even one of the library's errors). Half of it leaves room for
the rest of the command and each element's BSON overhead."""


def _slices(keys: list[str]) -> list[list[str]]:
    """``keys`` in order, cut into runs of at most :data:`GET_KEYS_BYTES` bytes (one run,
    the usual case, for all but the largest gets)."""
    runs: list[list[str]] = [[]]
    size = 0
    for key in keys:
        length = len(key.encode()) + 16  # the element's type, index name, length, NUL
        if size + length > GET_KEYS_BYTES and runs[-1]:
            runs.append([])
            size = 0
        runs[-1].append(key)
        size += length
    return runs


def result_key(queue: str, message_id: str) -> str:
    """The ``_id`` of a result (one-to-one: see the module's docstring)."""
    return f"{queue}/{message_id}"


def _date(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)


def _digest(body: bytes) -> str:
    """What a replace matches a body by (see the module's docstring)."""
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def _body(value: Any) -> bytes:
    """A stored body as bytes: another program's non-binary value as its Extended JSON
    text, which the queue layer then reports as a result it could not read."""
    if isinstance(value, bytes):
        return bytes(value)
    return json_util.dumps(value).encode()


def _check_sizes(results: Sequence[tuple[str, bytes]]) -> None:
    for message_id, body in results:
        if len(body) > MAX_BODY_BYTES:
            raise InvalidPayloadError(
                f"result of {message_id!r} has {len(body)} bytes encoded: MongoDB results"
                f" hold at most {MAX_BODY_BYTES}"
            )


class MongoResults(ResultStore):
    """The results of one MongoDB backend's queues (see the module's docstring)."""

    max_body_bytes = MAX_BODY_BYTES

    def __init__(self, backend: MongoConnection, indexed: Once) -> None:
        self._coll: Collection = backend.collection("results")
        self._indexed = indexed
        self.sweep_interval = SWEEP_INTERVAL
        self._next_sweep = 0.0  # monotonic: the first put sweeps
        self._sweeping: asyncio.Task[int] | None = None
        self._closed = False

    async def open(self) -> None:
        await self._ensure_index()

    async def close(self) -> None:
        """Stop a sweep under way. Not ``suppress(CancelledError)`` around ``await task``:
        that also swallowed a cancellation of the close itself (a factory close past its
        grace), which then returned as if it had finished. A put still under way starts
        none once closed (nothing would stop it)."""
        self._closed = True
        task, self._sweeping = self._sweeping, None
        if task is not None:
            await stop_task(task)

    async def _ensure_index(self) -> None:
        """The TTL index, made once per backend (see :class:`Once`): ``open`` makes it, a
        put tries again if that failed."""
        await self._indexed.run("results", self._create_index)

    @translated
    async def _create_index(self) -> None:
        await self._coll.create_index([("expires", ASCENDING)], expireAfterSeconds=0)

    @translated
    async def put(self, queue: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        if not results:
            return
        _check_sizes(results)
        await self._ensure_index()
        expires = _date(time.time() + ttl)
        last = dict(results)  # an id twice: its last body, as two puts would leave it
        await self._coll.bulk_write(
            [
                UpdateOne(
                    {"_id": result_key(queue, message_id)},
                    {"$set": {"body": body, "digest": _digest(body), "expires": expires}},
                    upsert=True,
                )
                for message_id, body in last.items()
            ],
            ordered=False,
        )
        self._maybe_sweep()

    @translated
    async def replace(
        self, queue: str, swaps: Sequence[tuple[str, bytes, bytes]], ttl: float
    ) -> None:
        if not swaps:
            return
        _check_sizes([(message_id, new) for message_id, _, new in swaps])
        now = time.time()
        expires = _date(now + ttl)
        alive = {"$gt": _date(now)}
        writes = []
        for message_id, old, new in swaps:
            key, change = (
                result_key(queue, message_id),
                {"$set": {"body": new, "digest": _digest(new), "expires": expires}},
            )
            writes.append(UpdateOne({"_id": key, "digest": _digest(old), "expires": alive}, change))
            # written by a release that kept no digest (see the module's docstring)
            unsigned = {"_id": key, "digest": {"$exists": False}, "expires": alive}
            writes.append(UpdateOne(unsigned, change))
        await self._coll.bulk_write(writes, ordered=False)

    @translated
    async def get(self, queue: str, ids: Sequence[str]) -> list[bytes | None]:
        """One ``find`` of every id, against one clock reading; ids too many for one
        command (see :data:`GET_KEYS_BYTES`) take one ``find`` per slice of them."""
        if not ids:
            return []
        keys = list(dict.fromkeys(result_key(queue, i) for i in ids))
        now = _date(time.time())
        found: dict[str, bytes] = {}
        for some in _slices(keys):
            cursor = self._coll.find(
                {"_id": {"$in": some}, "expires": {"$gt": now}},
                {"body": 1},
                batch_size=len(some),
            )
            found.update({doc["_id"]: _body(doc.get("body")) async for doc in cursor})
        return [found.get(result_key(queue, i)) for i in ids]

    def _maybe_sweep(self) -> None:
        """Start a sweep in the background when one is due and none is running."""
        now = time.monotonic()
        if self._closed or now < self._next_sweep:
            return
        if self._sweeping is not None and not self._sweeping.done():
            return
        self._next_sweep = now + self.sweep_interval
        self._sweeping = asyncio.ensure_future(self._sweep_logged())

    async def _sweep_logged(self) -> int:
        try:
            return await self.sweep()
        except Exception as exc:  # the next sweep tries again; results still expire on read
            log.warning("sweeping expired results failed: %s", exc)
            return 0

    @translated
    async def sweep(self) -> int:
        """Delete expired results, :data:`SWEEP_BATCH` at a time (each delete one bounded
        command rather than one that walks a whole backlog); how many were deleted."""
        deleted = 0
        for _ in range(SWEEP_BATCHES):
            expired = {"expires": {"$lte": _date(time.time())}}
            docs = await self._coll.find(expired, {"_id": 1}, limit=SWEEP_BATCH).to_list()
            if not docs:
                break
            ids = [doc["_id"] for doc in docs]
            # expired again: a put may have renewed one since it was found
            done = await self._coll.delete_many({"_id": {"$in": ids}, **expired})
            deleted += done.deleted_count
            if len(docs) < SWEEP_BATCH:
                break
        return deleted
