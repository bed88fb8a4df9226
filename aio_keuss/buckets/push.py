"""The push side: buckets filling in memory, and how they are written.

A push goes to a push bucket (one for "ready now", one per ``DELAY_GRANULE`` of mature time);
a bucket is written when full, after ``bucket_max_wait``, or at once by a pusher that finds
a free write slot (see the bucket store's module docstring for the whole story)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from array import array
from collections.abc import Callable, Sequence

from ..coalesce import RunToEnd
from ..contract import Entry, LoopTurns
from ..errors import ClosedError, InvalidInputError, KeussError
from .codec import U32, encode_blob, encode_state
from .settings import (
    ACK_ON_BUFFER_RETRIES,
    DELAY_GRANULE,
    PUSH_WRITERS,
    READY_KEY,
    WRITE_MAX_BUCKETS,
    BucketSettings,
    new_bucket_id,
)
from .storage import BucketStorage, NewBucket

log = logging.getLogger("aio_keuss.buckets")


SLOT_BYTES = 21
"""Bytes a message takes in a bucket beside its payload and headers: their two u32 lengths
in the blob, and its slot state (status byte, u32 tries, f64 mature)."""
BUCKET_BYTES = 4
"""Bytes of a bucket beside its slots (the u32 count)."""
WRITE_MAX_BYTES = 256 * 2**20
"""Most bytes of push buckets in one insert round trip (at least one bucket): PostgreSQL
takes them as one statement, which must stay under its 1 GB protocol message."""


def slot_bytes(entry: Entry) -> int:
    return len(entry.payload) + len(entry.headers) + SLOT_BYTES


class Waiter:
    """One caller waiting for a bucket to be written: its own future, and the slots of its
    messages in the bucket (``count`` from ``first``; none for a flush). A cancelled pusher
    leaves its messages in the bucket, which is written all the same: then they are counted
    for it (see ``PushSide._orphaned``)."""

    __slots__ = ("bucket", "count", "first", "future")

    def __init__(self, bucket: PushBucket, first: int, count: int) -> None:
        self.bucket = bucket
        self.first = first
        self.count = count
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        bucket.waiters.append(self)

    def earliest(self) -> float:
        """When the first of its messages matures."""
        if not self.count:
            return math.inf
        return min(self.bucket.mature[self.first : self.first + self.count])


class PushBucket:
    """A bucket being filled in memory. Whoever waits for it to be durable (a pusher, a
    flush) gets a future of its own in ``waiters`` rather than a shield of a shared one: a
    cancelled waiter cancels only its own."""

    __slots__ = (
        "bytes",
        "flush_at",
        "headers",
        "id",
        "key",
        "mature",
        "payloads",
        "timer",
        "tries",
        "waiters",
    )

    def __init__(self, key: int) -> None:
        self.id = new_bucket_id()
        self.key = key
        self.payloads: list[bytes] = []
        self.headers: list[bytes] = []
        self.mature = array("d")
        self.tries = array(U32)
        self.waiters: list[Waiter] = []
        self.timer: asyncio.TimerHandle | None = None
        self.flush_at = 0.0
        self.bytes = BUCKET_BYTES

    def written(self) -> asyncio.Future[None]:
        """A future of the caller's own, resolved (or failed) when the bucket is written."""
        return Waiter(self, 0, 0).future

    def settle(self, error: Exception | None) -> list[Waiter]:
        """Resolve (or fail) every waiter. Once written, the cancelled waiters whose messages
        were in it: nobody counted them yet."""
        orphans = []
        for waiter in self.waiters:
            future = waiter.future
            if future.done():  # its waiter was cancelled
                if error is None and waiter.count:
                    orphans.append(waiter)
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        return orphans

    def add(self, entry: Entry, mature: float) -> int:
        slot = len(self.payloads)
        self.bytes += slot_bytes(entry)
        self.payloads.append(entry.payload)
        self.headers.append(entry.headers)
        self.mature.append(mature)
        self.tries.append(entry.tries)
        return slot

    def encode(self) -> NewBucket:
        count = len(self.payloads)
        state = encode_state(bytes(count), self.tries, self.mature)
        blob = encode_blob(self.payloads, self.headers)
        return NewBucket(self.id, min(self.mature), count, blob, state)


class PushSide:
    """The bucket store's push half, mixed into it: the attributes below are the store's."""

    name: str
    _storage: BucketStorage
    _settings: BucketSettings
    _closed: bool
    _filling: dict[int, PushBucket]
    _sealed: list[PushBucket]
    _in_flight: set[PushBucket]
    _writers: int
    _writer_starting: bool
    _writer_tasks: set[asyncio.Task[None]]
    _buffered: int
    _buffer_limit: int
    _room: list[asyncio.Future[None]]
    _turns: LoopTurns
    _visible: Callable[[float], None] | None
    _orphaned: Callable[[int, float], None] | None

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        if not entries:
            return []
        buffered = self._settings.ack_on_buffer
        if buffered:
            await self._admit(len(entries))
        self._check_open()  # after close nothing may be buffered: no one would write it
        now = time.time()
        size = self._settings.bucket_max_size
        most = self._storage.max_bucket_bytes
        touched: dict[int, tuple[PushBucket, int]] = {}  # and the first slot of this call
        for entry in entries:
            if entry.dedup:
                raise InvalidInputError("bucket backends do not support user-chosen ids")
            mature = entry.mature if entry.mature is not None else now + entry.delay
            key = READY_KEY if mature <= now else int(mature / DELAY_GRANULE)
            bucket = self._filling.get(key)
            if bucket is not None and bucket.payloads and bucket.bytes + slot_bytes(entry) > most:
                self._seal(bucket)  # full by bytes: the database bounds one bucket
                bucket = None
            if bucket is None:
                bucket = self._filling[key] = PushBucket(key)
                if buffered:
                    bucket.flush_at = now + self._settings.bucket_max_wait
                    bucket.timer = asyncio.get_running_loop().call_later(
                        self._settings.bucket_max_wait, self._seal, bucket
                    )
            slot = bucket.add(entry, mature)
            entry.id = f"{bucket.id}-{slot}"
            self._buffered += 1
            if id(bucket) not in touched:
                touched[id(bucket)] = (bucket, slot)
            if len(bucket.payloads) >= size:
                self._seal(bucket)
        if buffered:
            return [True] * len(entries)
        # No await since the first entry: this call's slots of a bucket are consecutive.
        waiters = [Waiter(b, first, len(b.payloads) - first) for b, first in touched.values()]
        own = self._storage.uninterruptible and self._writers < PUSH_WRITERS
        try:
            if own and (mine := [b for b, _ in touched.values() if self._unfill(b)]):
                await self._write_own(mine)
            else:
                self._start_writer()
            for waiter in waiters:
                await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiters)
            raise
        return [True] * len(entries)

    def _abandon(self, waiters: list[Waiter]) -> None:
        """A pusher cancelled while its buckets are written: they are written all the same
        (each write is shared, and goes on), but the queue counts and signals only what an
        insert returns. What was written already is counted here, the rest by its write:
        the pusher's waiters still pending are cancelled, so that the write finds them."""
        written = []
        for waiter in waiters:
            future = waiter.future
            if not future.done():
                future.cancel()
            elif not future.cancelled() and future.exception() is None and waiter.count:
                written.append(waiter)
        if written:
            self._count_orphans(written)

    def _count_orphans(self, waiters: list[Waiter]) -> None:
        if self._orphaned is not None:
            earliest = min(waiter.earliest() for waiter in waiters)
            self._orphaned(sum(waiter.count for waiter in waiters), earliest)

    async def _admit(self, count: int) -> None:
        """``ack_on_buffer``: let the event loop run, and hold the push while the messages
        acknowledged but not yet written reach the limit (backpressure), until a write
        makes room. Before buffering: a push cancelled here buffered nothing."""
        if self._buffered < self._buffer_limit:
            if self._turns.due(count):
                await asyncio.sleep(0)
            return
        self._turns.reset()
        for bucket in list(self._filling.values()):  # what fills waits for nothing now
            self._seal(bucket)
        loop = asyncio.get_running_loop()
        while self._buffered >= self._buffer_limit and not self._closed:
            room: asyncio.Future[None] = loop.create_future()
            self._room.append(room)
            await room

    def _make_room(self) -> None:
        """Wake the pushers held by ``_admit`` (each checks the limit again)."""
        if self._room and (self._buffered < self._buffer_limit or self._closed):
            for room in self._room:
                if not room.done():
                    room.set_result(None)
            self._room.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"queue {self.name!r} is closed")

    async def _write_own(self, buckets: list[PushBucket]) -> None:
        """Write these push buckets in the caller's task (see ``BucketStorage.uninterruptible``).
        A cancellation that arrives meanwhile takes effect once the write is done."""
        self._writers += 1
        work = RunToEnd(self._write_push_buckets(buckets))
        try:
            await work
        finally:
            self._writer_done()
        if work.held is not None:
            raise work.held

    def on_visible(self, listener: Callable[[float], None]) -> None:
        self._visible = listener

    def on_orphaned_insert(self, listener: Callable[[int, float], None]) -> None:
        self._orphaned = listener

    def _unfill(self, bucket: PushBucket) -> bool:
        """Take a bucket out of the filling ones; false if it was already."""
        if self._filling.get(bucket.key) is not bucket:
            return False
        del self._filling[bucket.key]
        if bucket.timer is not None:
            bucket.timer.cancel()
        return True

    def _seal(self, bucket: PushBucket) -> None:
        if self._unfill(bucket):
            self._sealed.append(bucket)
            self._start_writer()

    def _start_writer(self) -> None:
        """Start a writer task unless one is about to run (it takes what this loop iteration
        adds) or every write slot is busy (the next one to free takes it)."""
        if self._writer_starting or self._writers >= PUSH_WRITERS:
            return
        self._writers += 1
        self._writer_starting = True
        task = asyncio.get_running_loop().create_task(self._write_sealed())
        self._writer_tasks.add(task)
        task.add_done_callback(self._writer_tasks.discard)

    def _writer_done(self) -> None:
        self._writers -= 1
        if self._sealed or (self._filling and not self._settings.ack_on_buffer):
            self._start_writer()

    async def _write_sealed(self) -> None:
        """Write push buckets, several per round trip, until none is left. In durable mode
        every filling bucket is taken too: pushers wait for each."""
        try:
            while True:
                self._writer_starting = False
                if not self._settings.ack_on_buffer:
                    for bucket in list(self._filling.values()):
                        self._seal(bucket)
                if not self._sealed:
                    return
                take, weight = 0, 0
                for bucket in self._sealed[:WRITE_MAX_BUCKETS]:
                    if take and weight + bucket.bytes > WRITE_MAX_BYTES:
                        break
                    take, weight = take + 1, weight + bucket.bytes
                batch, self._sealed = self._sealed[:take], self._sealed[take:]
                await self._write_push_buckets(batch)
        finally:
            self._writers -= 1

    async def _write_push_buckets(self, batch: list[PushBucket]) -> None:
        """Write, then settle every waiter of the batch: with the outcome, or with an error
        when the write itself is cancelled (loop shutdown), so that no pusher waits for ever."""
        self._in_flight.update(batch)
        try:
            await self._insert_settling(batch)
        except BaseException:
            lost = KeussError("push interrupted: its bucket may or may not have been written")
            for bucket in batch:
                bucket.settle(lost)
            raise
        finally:
            self._in_flight.difference_update(batch)
            self._buffered -= sum(len(bucket.payloads) for bucket in batch)
            self._make_room()

    async def _insert_settling(self, batch: list[PushBucket]) -> None:
        encoded = [b.encode() for b in batch]
        attempts = ACK_ON_BUFFER_RETRIES if self._settings.ack_on_buffer else 1
        for attempt in range(attempts):
            try:
                await self._storage.insert_buckets(self.name, encoded)
            except Exception as exc:
                # a connection given up by a cancelled close (``Backend.abandon``) refuses
                # every retry: their backoff only kept the close past its bound
                if attempt + 1 < attempts and not isinstance(exc, ClosedError):
                    await asyncio.sleep(0.1 * 2**attempt)
                    continue
                if self._settings.ack_on_buffer:
                    log.error(
                        "queue %r: %d buffered messages lost, their bucket was not written: %s",
                        self.name,
                        sum(b.count for b in encoded),
                        exc,
                    )
                for bucket in batch:
                    bucket.settle(exc)
                return
            # A pusher cancelled while its bucket was written no longer counts nor signals
            # its messages (the queue does once the insert returns): they are in, so it is
            # done here.
            orphans = [waiter for bucket in batch for waiter in bucket.settle(None)]
            if orphans:
                self._count_orphans(orphans)
            if self._settings.ack_on_buffer and self._visible is not None:
                self._visible(min(b.score for b in encoded))  # now other processes see them
            return
