"""Bucket stores (Keuss's bucket-mongo-safe): many messages per storage unit.

Written once for every database. A database contributes only a :class:`BucketStorage`: a
handful of atomic operations over *whole buckets* (insert, lease, write state, census),
see ``storage.py``, and the ``buckets`` module of each database package. Everything else is here.

Why buckets: a per-message queue is bound by one storage operation per message. Packing up
to ``bucket_max_size`` messages in one storage unit turns a push, pop or commit into a
fraction of a round trip; the bottleneck moves to this process's CPU.

Storage unit (one bucket):

- ``id`` (time-ordered), the queue, ``score``, ``owner`` (lease token, ``""`` when free),
  ``count``, ``remaining`` (slots not done), ``blob`` and ``state``.
- ``blob``: every message, written once and never changed. Binary framing, little endian::

      u32 count | u32 payload_len[count] | u32 headers_len[count] | payloads... | headers...

- ``state``: fixed width per slot, laid out column-wise so each column is one ``array``
  copy (no per-slot Python work) and any slot can still be patched in place::

      u8 state[count] | u32 tries[count] | f64 mature[count]

  state 0 = available, 1 = done, 2 = handed out (reserved), 3 = on its way to the
  deadletter queue.
- ``score``: when the bucket is worth leasing. Free: a lower bound of the earliest mature
  time of its available slots (exact when this module writes it). Leased: the lease deadline.

A message id is ``f"{bucket_id}-{slot}"``, assigned by the store when it is pushed (so
user-chosen, idempotent ids are not supported).

Push: entries go to an in-memory *push bucket* (one for "ready now", one per 50 ms of
mature time for delayed entries, so a delayed ko never holds fresh pushes). A push returns
only once its bucket is durable; up to ``PUSH_WRITERS`` bucket writes are in flight at once.
A pusher that finds a free write slot has its bucket written at once: by itself, in its own
task, where the storage's round trips pipeline and refuse cancellation (the Redis fast lane:
the write is on the wire in the same loop iteration), else by a writer task that starts on
the next iteration and takes whatever the pushers of this one added. Pushes that find every
slot busy fill a bucket that the next free writer takes (group commit): a few producers
are not held for ``bucket_max_wait``, many share one write. ``ack_on_buffer=True`` is
Keuss's trade-off instead: a push returns when buffered, and a bucket is written when full
or after ``bucket_max_wait``; it is lost if the process dies before that (a failed write is
retried a few times, then logged). Such a push waits for nothing, so it yields to the event
loop every ``PUSH_TURN`` messages (:class:`LoopTurns`; else a producer loop holds the loop: no
timer fires, no bucket is ever written, every other task starves); and once
``BUFFERED_BUCKETS`` full buckets' worth of acknowledged messages are not yet written, pushes
wait for a write (backpressure). What a crash loses is thus at most that, plus the buckets
still filling (each at most ``bucket_max_size`` messages and ``bucket_max_wait`` old).

Drain writes what is buffered when it starts (not what is pushed meanwhile, so it ends
while producers keep pushing), then the state of the leased buckets. Close first refuses
every further call (``ClosedError``), then writes what is buffered and gives every leased
bucket back.

Pop / reserve: serve from buckets leased into memory. Leasing atomically takes free buckets
(and buckets whose lease expired) with ``score <= now``, sets ``owner`` to a token of that
lease alone (this store's token and a lease number; see ``storage.py``) and ``score`` to
``now + reject_timeout_grace``. A bucket leased while it still had an owner means its
previous holder died (or stalled past its lease): its handed-out slots become available
again with one more try. A holder serves nothing from a bucket whose lease lapsed
(it could not renew it in time), since another consumer may be serving it by now; an ok on
such a bucket writes the state before it answers. Each slot keeps its own mature time and
is never served before it. Pop is at-most-once even across a crash: the state of the touched
buckets is written (one coalesced round trip) before the messages are returned; if that
write finds the lease lost, those messages are not returned (their new holder delivers
them). Reserve marks slots handed out with an in-memory deadline (now + reserve_delay);
that state is persisted lazily by the state flusher. ok / ko only change memory (but see
the lapsed lease above). Where the storage's replies refuse cancellation (the Redis fast
lane), pops and reserves run in the caller's task: callers sharing a lease or a state write
await it as an :class:`Uncancellable`, so a cancelled caller still completes, and the queue
puts back what it took. Slots served before a failed lease or state write are made
available again, never lost.

State flusher, every ``min(state_flush_period, reject_timeout_grace / 3)``: writes the state
of every leased bucket that changed and renews every lease (score = now + grace) that needs
it, changed or not; deletes buckets with nothing left; releases buckets with nothing
deliverable and nothing reserved (and, after ``IDLE_RELEASE`` seconds unused, buckets nobody
here serves from) with score = earliest mature time of their available slots; a delete or
release that failed is tried again. Writes are conditional on the lease's token, so a holder
whose lease was taken over never overwrites the new holder's state, and writes of one bucket
are serialized (a later snapshot always contains the earlier changes).

What a crash can cost (at-least-once holds; pop stays at-most-once):
- reservations not yet persisted come back with their old ``tries`` count;
- oks not yet persisted come back (delivered again);
- a deadletter move is three steps, since the copy and the mark are writes to two queues'
  records, atomic together on no storage here (Redis Cluster keeps each queue in its own
  hash slot, and bucket-mongo has no multi-document transactions): the slot is stored as on
  its way (a state write under the lease, as an ok's), then the copy is written under an id
  made of the slot's (``<bucket id>.dl<slot>``; an insert leaves an id already stored as it
  is), then the slot is marked done. Whoever takes the bucket over between the first step
  and the last (the holder crashed, or stalled past its lease) never delivers that slot
  again: it writes the copy itself, which lands once whoever writes it first, and marks the
  slot done. A second copy is still possible where the first one was taken out of the
  deadletter queue (consumed, its bucket deleted) before the second write of the same id
  reached it: a holder stalled past its lease right after its copy landed, or a copy whose
  reply was lost (the ko fails, the reservation comes back) ko-ed again later. The move is
  counted once (``on_finished_deadletter``, or the ko's result), by the holder whose done
  mark is stored: every other holder's mark is refused, its lease being over (a ko whose
  mark is refused answers MISSING). A copy that fails for whoever took the bucket over is
  tried again with backoff (``COPY_RETRY_FIRST``), the bucket meanwhile kept or given back
  as if that slot were not there.

What an outage can cost. A lease is a holder's only claim on a bucket, and it lapses
``reject_timeout_grace`` (default 0.8 x reserve_delay) after its last renewal; renewing it,
like writing the state, takes the server. When a holder cannot write for that long (the
server away or out of reach, its event loop stalled), the next consumer to lease the bucket
takes it over with the state last written, exactly as if the holder had crashed:
- its oks, kos and reservations made since that state write are undone, as in a crash: ok-ed
  messages are delivered again; reserved ones come back with one more try, possibly to
  another consumer while the first still works on them (a reservation is exclusive until
  its end, ``reserve_delay`` or as extended, or until its holder's lease lapses, whichever
  comes first: a reservation's end lives only in its holder's memory, the stored state
  saying handed out, never until when, so an extension holds through the lease, which the
  flusher renews while a reservation of the bucket is live);
- the old holder finds out at its next write (refused: a warning is logged, the bucket is
  forgotten, and oks of its slots return False), or when it leases the bucket again (it
  then starts from the stored state, never from its stale copy).
An ok that returned True is therefore durable once the next state write after it succeeds
(within one flush period while the server answers), and undone only if the holder cannot
write from the ok until its lease lapses and another consumer then leases the bucket before
the holder's write gets through. If the holder writes first (its lease is still its own in
storage, nobody having leased the bucket), everything it acknowledged is kept. An ok on a
bucket whose lease already lapsed writes before it answers: True only once written, an
error while the server is away. So does an extend there (``extend``).

Clock: every time here is this process's clock (``time.time()``), also for leases; processes
sharing a queue need synchronized clocks (NTP), as with Keuss.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import os
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ..coalesce import Finishing, Uncancellable, stop_task, to_the_end
from ..contract import (
    Ack,
    DeadletterPlan,
    Extend,
    Fetched,
    FinishedDeadletters,
    LoopTurns,
    Nack,
    Store,
    Stored,
)
from ..errors import ClosedError, KeussConnectionError
from ..message import merge_headers
from ..options import DEFAULT_DEADLETTER_QUEUE
from ..types import Capabilities, KoResult, Sizes
from .codec import AVAILABLE, DEADLETTERING, DONE, HANDED_OUT, U32, encode_blob, encode_state
from .held import HeapEntry, HeldBucket, serving
from .push import BUCKET_BYTES, SLOT_BYTES, WRITE_MAX_BYTES, PushBucket, PushSide
from .settings import (
    ACK_ON_BUFFER_RETRIES,
    BUFFERED_AT_LEAST,
    BUFFERED_BUCKETS,
    CAPABILITIES,
    CLOSE_BOUND,
    COPY_RETRY_FIRST,
    COPY_RETRY_MAX,
    LEASE_AT_LEAST,
    LEASE_MAX_BUCKETS,
    MIN_GRACE,
    PIPELINED_CALLS,
    BucketSettings,
    split_id,
)
from .state import StateWriter
from .storage import BucketStorage, NewBucket

if TYPE_CHECKING:
    from ..options import QueueOptions

log = logging.getLogger("aio_keuss.buckets")


class _Moving(NamedTuple):
    """A slot on its way to the deadletter queue: what to write, and its reservation as it
    was, to give back if the write fails."""

    bucket: HeldBucket
    slot: int
    tries: int
    deadline: float
    held_tries: int
    result: int  # its index in the ko's results


class BucketStore(PushSide, StateWriter, Store):
    """The bucket logic over any :class:`BucketStorage` (see the module docstring)."""

    batch_concurrency: ClassVar[int] = 64
    """Many calls in flight, each held for a durable round trip, share a push bucket or a
    state write; serving is mostly in memory."""
    run_in_caller = True  # pushes share a bucket write, oks and kos are marks in memory

    def __init__(
        self,
        name: str,
        options: QueueOptions,
        storage: BucketStorage,
        settings: BucketSettings,
    ) -> None:
        super().__init__(name, options)
        self._storage = storage
        # Every await of a pop / reserve is a storage reply or an Uncancellable: with a
        # storage whose replies refuse cancellation, they may run in the caller's task.
        # There, as on the other Redis stores, a few calls in flight and the rest batched
        # behind them beats one state write per pop.
        self.uninterruptible = storage.uninterruptible
        self.max_message_bytes = storage.max_bucket_bytes - BUCKET_BYTES - SLOT_BYTES
        if self.uninterruptible:
            self.batch_concurrency = PIPELINED_CALLS  # type: ignore[misc]
        self._settings = settings
        grace = settings.reject_timeout_grace
        self._grace = max(MIN_GRACE, options.reserve_delay * 0.8 if grace is None else grace)
        self._period = min(settings.state_flush_period, self._grace / 3)
        factor = settings.reject_delta_factor
        self._delta_factor = (options.reserve_delay or 30.0) if factor is None else factor
        self._token = os.urandom(8).hex()  # a lease's is this and its number (``_lease``)
        self._lease_number = 0
        self._closed = False
        self._shut = False  # a close ran to its end (see ``close``)
        # push side
        self._filling: dict[int, PushBucket] = {}
        self._sealed: list[PushBucket] = []
        self._in_flight: set[PushBucket] = set()  # sealed, insert round trip under way
        self._writers = 0
        self._writer_starting = False
        self._writer_tasks: set[asyncio.Task[None]] = set()
        self._buffered = 0  # messages pushed and not yet written (or given up on)
        self._buffer_limit = max(BUFFERED_BUCKETS * settings.bucket_max_size, BUFFERED_AT_LEAST)
        self._room: list[asyncio.Future[None]] = []  # pushers waiting for the buffer to drain
        self._turns = LoopTurns()  # ``ack_on_buffer``: a buffered push awaits nothing else
        # pull side
        self._held_buckets: dict[str, HeldBucket] = {}
        self._seq = 0
        self._ready: list[HeapEntry] = []
        self._held: list[HeapEntry] = []
        self._leasing: asyncio.Future[None] | None = None
        self._leases: set[asyncio.Future[None]] = set()  # every lease in flight (close waits)
        self._deadlettering = Finishing()  # deadletter writes and their marks (close waits)
        self._copying: set[tuple[str, int]] = set()  # (bucket id, slot) being deadlettered
        # bucket id -> slots whose reservations close leaves to expire (see keep_reserved)
        self._kept_reserved: dict[str, set[int]] = {}
        # bucket id -> (failures, next try) of a previous holder's deadletter copy that
        # failed here: kept when the bucket is given back, so that leasing it again does
        # not start the backoff over (see ``COPY_RETRY_FIRST``)
        self._copy_retries: dict[str, tuple[int, float]] = {}
        self._plan: DeadletterPlan | None = None  # this queue's (``on_deadletter``)
        self._finished: FinishedDeadletters | None = None  # on_finished_deadletter
        self._storage_next: float | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._visible: Callable[[float], None] | None = None
        self._orphaned: Callable[[int, float], None] | None = None
        # Buckets that left memory (released or finished) whose final write failed: retried
        # by the next state flush, else their oks would come back once their lease lapses.
        self._departing: dict[str, tuple[HeldBucket, str]] = {}
        self._leaving: dict[str, HeldBucket] = {}  # their final write is in flight

    # push ---------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write every push bucket buffered now, then the state of every leased bucket.

        Only what is buffered when it starts: while producers keep pushing there is always
        another bucket to write, and a drain or close must end. A failed write of buffered
        (``ack_on_buffer``) messages is raised; a durable push's failure is its pusher's."""
        for bucket in list(self._filling.values()):
            self._seal(bucket)
        waits = [b.written() for b in (*self._sealed, *self._in_flight)]
        outcomes = await asyncio.gather(*waits, return_exceptions=True)
        if self._settings.ack_on_buffer:
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        await self._sync(list(self._held_buckets.values()))

    # lease ---------------------------------------------------------------------------

    async def _lease(self, want: int, ids: Sequence[str] | None = None) -> list[HeldBucket]:
        """Take more buckets into memory; concurrent callers share one lease in flight.

        Never a bucket this store still has in memory (``_unleasable``): its stored state is
        older than the one here, and a write of it may be in flight on another connection.
        Taken again, the lease read that older state, and its copy was served once the
        reply of a final write (release) landing after the lease had taken the bucket out of
        memory: an ok-ed message was delivered again (and, the write conditioned on one
        token per store then, the bucket freed under that copy was served elsewhere too;
        with one token per lease the write is refused, its oks undone all the same). Such a
        bucket is renewed, released or found lost by the state flusher, as any held one; one
        whose lease lapsed is renewed first, here (``_renew_lapsed``), as the lease once
        took it again."""
        if ids is None and self._leasing is not None:
            await self._leasing
            return []
        future = Uncancellable()
        if ids is None:
            self._leasing = future
        self._leases.add(future)
        try:
            await self._renew_lapsed()
            now = time.time()
            # One token per lease (see ``storage.py``): a write of an earlier lease of this
            # store landing late is refused, not applied to this one.
            self._lease_number += 1
            token = f"{self._token}.{self._lease_number}"
            unleasable = self._unleasable(now)
            if ids is not None:
                ids = [i for i in ids if i not in unleasable]
                if not ids:
                    return []
            lease = await self._storage.lease(
                self.name,
                token,
                now,
                now + self._grace,
                want,
                LEASE_MAX_BUCKETS,
                ids,
                () if ids is not None else unleasable,
            )
            if ids is None:
                self._storage_next = lease.next_score
            taken = []
            for row in lease.buckets:
                departing = self._departing.pop(row.id, None)
                stale_write = None
                for stale in (self._held_buckets.get(row.id), departing and departing[0]):
                    if stale is not None:
                        # Left out of the lease while its lease was this store's: here,
                        # another consumer held the bucket since (a clock ahead of ours),
                        # and our copy is stale (writing it would undo that consumer's
                        # work). A write of it still in flight is refused (its lease's token
                        # is not this one's); the fresh state is written after it.
                        stale.lost = True
                        self._forget(stale)
                        stale_write = stale.writing or stale_write
                self._seq += 1
                bucket = HeldBucket(row, token, self._seq, now)
                bucket.lease_until = now + self._grace
                if stale_write is not None:
                    bucket.version = bucket.persisted + 1
                    bucket.follow(stale_write)
                self._held_buckets[bucket.id] = bucket
                if DEADLETTERING in bucket.states and bucket.id in self._copy_retries:
                    bucket.copy_due = self._copy_retries[bucket.id][1]
                else:
                    self._copy_retries.pop(bucket.id, None)
                ready = [
                    (bucket.mature[slot], bucket.seq, slot, bucket)
                    for slot, state in enumerate(bucket.states)
                    if state == AVAILABLE
                ]
                if len(ready) > 64:
                    self._ready.extend(ready)
                    heapq.heapify(self._ready)
                else:
                    for item in ready:
                        heapq.heappush(self._ready, item)
                taken.append(bucket)
            if taken:
                self._start_flusher()
            recovering = [b for b in taken if DEADLETTERING in b.states]
            if recovering:
                # Before anything else could read the queue's deadletter copies: the sooner
                # the copy is written again, the less likely the first one was already
                # consumed from there (see "What a crash can cost").
                await self._try_finishing_deadletters(recovering)
            return taken
        finally:
            if ids is None:
                self._leasing = None
            self._leases.discard(future)
            future.set_result(None)

    async def _renew_lapsed(self) -> None:
        """Renew the held buckets whose lease lapsed (the server was away, the flusher
        stalled), before a lease that leaves them out: each is then served from again, or
        found lost (another consumer took it over meanwhile) and forgotten, so that this
        lease takes it from storage. Left to the next state flush, a lease meanwhile found
        neither its slots nor the bucket (the old lease took it again, in one round
        trip)."""
        now = time.time()
        lapsed = [b for b in self._held_buckets.values() if b.lease_until <= now]
        if lapsed:
            await self._sync(lapsed, renew_before=now + self._grace / 2)

    def _unleasable(self, now: float) -> set[str]:
        """The buckets a lease of this store must leave alone: every one leaving memory
        (final write in flight or to retry) and every held one a lease could take (its
        lease lapsed; storage may hold a later deadline, never an earlier one)."""
        found = set(self._leaving)
        found.update(self._departing)
        found.update(i for i, b in self._held_buckets.items() if b.lease_until <= now)
        return found

    # pop / reserve -------------------------------------------------------------------

    def _serve(
        self, n: int, now: float, reserve_delay: float | None, touched: dict[str, HeldBucket]
    ) -> list[Stored]:
        """Hand out up to ``n`` deliverable slots from memory, earliest first.

        ``reserve_delay`` None = pop (slots done), else reserve (handed out until
        now + reserve_delay). An expired reservation counts as a try.

        Nothing is served from a bucket whose lease lapsed (its holder could not renew it,
        the server being away): another consumer may have leased it meanwhile and be serving
        the same slots. Its entries wait until the state flusher renews the lease (or finds
        it lost, and forgets the bucket).
        """
        ready, held = self._ready, self._held
        out: list[Stored] = []
        lapsed: list[tuple[list[HeapEntry], HeapEntry]] = []
        while len(out) < n:
            self._clean_tops()
            take_ready = bool(ready) and ready[0][0] <= now
            take_held = bool(held) and held[0][0] <= now
            if take_ready and take_held:
                take_ready = ready[0][0] <= held[0][0]
            if not (take_ready or take_held):
                break
            heap = ready if take_ready else held
            top = heapq.heappop(heap)
            mature, _, slot, bucket = top
            if bucket.lease_until <= now:
                lapsed.append((heap, top))
                continue
            if take_ready:
                tries = bucket.tries[slot]
            else:
                tries = bucket.tries[slot] + 1
                bucket.tries[slot] = tries
            if reserve_delay is None:
                bucket.states[slot] = DONE
                bucket.deadline.pop(slot, None)
                bucket.remaining -= 1
            else:
                bucket.states[slot] = HANDED_OUT
                deadline = now + reserve_delay
                bucket.deadline[slot] = deadline
                heapq.heappush(held, (deadline, bucket.seq, slot, bucket))
            bucket.version += 1
            bucket.last_used = now
            touched[bucket.id] = bucket
            out.append(bucket.message(slot, tries, mature))
        for heap, entry in lapsed:
            heapq.heappush(heap, entry)
        return out

    def _clean_tops(self) -> None:
        """Drop stale heap heads: a slot's state or time changed since it was pushed, or its
        bucket left memory (heap entries are deleted lazily)."""
        ready, held = self._ready, self._held
        while ready:
            mature, _, slot, bucket = ready[0]
            if bucket.live and bucket.states[slot] == AVAILABLE and bucket.mature[slot] == mature:
                break
            heapq.heappop(ready)
        while held:
            deadline, _, slot, bucket = held[0]
            live = bucket.live and bucket.states[slot] == HANDED_OUT
            if live and bucket.deadline.get(slot) == deadline:
                break
            heapq.heappop(held)

    def _memory_next(self) -> float | None:
        """Earliest time something held in memory becomes deliverable."""
        self._clean_tops()
        times = [h[0][0] for h in (self._ready, self._held) if h]
        return min(times) if times else None

    def _next_mature(self) -> float | None:
        """For the wait loop. With ``ack_on_buffer`` a push is signalled before its bucket
        is written: buffered buckets count from when they will be written, so consumers of
        this process do not sleep through their arrival."""
        times = [t for t in (self._memory_next(), self._storage_next) if t is not None]
        times += [max(b.flush_at, min(b.mature)) for b in self._filling.values()]
        times += [min(b.mature) for b in (*self._sealed, *self._in_flight)]
        return min(times) if times else None

    async def _fetch(
        self, n: int, reserve_delay: float | None, touched: dict[str, HeldBucket]
    ) -> list[Stored]:
        if self.uninterruptible and reserve_delay is not None:
            # Served from memory, a reserve in the caller's task need not suspend at all (a
            # pop always does: it writes its state): a consumer loop would then hold the
            # event loop for a whole bucket, starving the other consumers and everything
            # else. Yield once, before taking anything.
            await asyncio.sleep(0)
            self._check_open()
        out = self._serve(n, time.time(), reserve_delay, touched)
        for _ in range(2):
            if len(out) >= n or self._closed:
                break
            # Waiting for another caller's lease, this one may find its buckets emptied by
            # others by the time it runs again: then it leases for itself.
            shared = self._leasing is not None
            with serving(touched.values()):  # made available again should the lease fail
                try:
                    await self._lease(max(n - len(out), LEASE_AT_LEAST))
                except BaseException:
                    self._unserve(out, touched)  # never handed to the caller
                    raise
            out += self._serve(n - len(out), time.time(), reserve_delay, touched)
            if not shared:
                break
        return out

    async def get(self, n: int) -> Fetched:
        self._check_open()
        touched: dict[str, HeldBucket] = {}
        out = await self._fetch(n, None, touched)
        if out:
            with serving(touched.values()):  # made available again should the write fail
                try:
                    await self._sync(touched.values())
                except BaseException:
                    self._unserve(out, touched)
                    raise
            if any(b.lost for b in touched.values()):
                # a bucket whose lease was lost meanwhile: its new holder delivers those
                out = [m for m in out if not touched[m.id.rpartition("-")[0]].lost]
        return Fetched(out, self._next_mature())

    def _unserve(self, messages: list[Stored], touched: dict[str, HeldBucket]) -> None:
        """Served slots that never reached the caller (a lease or the pop's state write
        failed): available again, as they were."""
        for message in messages:
            bucket_id, _, slot_text = message.id.rpartition("-")
            bucket, slot = touched[bucket_id], int(slot_text)
            if not bucket.live:
                continue
            if bucket.states[slot] == DONE:
                bucket.remaining += 1
            elif bucket.states[slot] == HANDED_OUT:
                del bucket.deadline[slot]
            else:
                continue
            bucket.states[slot] = AVAILABLE
            bucket.version += 1
            heapq.heappush(self._ready, (bucket.mature[slot], bucket.seq, slot, bucket))

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        self._check_open()
        out = await self._fetch(n, reserve_delay, {})
        return Fetched(out, self._next_mature())

    # acknowledge ---------------------------------------------------------------------

    def _handed_out(self, message_id: str, tries: int | None) -> tuple[HeldBucket, int] | None:
        parsed = split_id(message_id)
        if parsed is None:
            return None
        bucket = self._held_buckets.get(parsed[0])
        slot = parsed[1]
        if bucket is None or slot >= bucket.count or bucket.states[slot] != HANDED_OUT:
            return None
        if tries is not None and bucket.tries[slot] != tries:
            return None  # a stale holder: the message was handed to someone else since
        return bucket, slot

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        """Mark the slots done in memory; the state flusher writes them. Where the bucket's
        lease lapsed (its renewal failed: the server was away), another consumer may take
        the bucket over with its stored state at any moment, which would undo a mark made
        only in memory: there the ok writes the state (renewing the lease) before it
        answers, true only if the lease was still this store's."""
        self._check_open()
        results: list[bool] = []
        now = time.time()
        lapsed: list[tuple[int, HeldBucket]] = []
        for ack in acks:
            found = self._handed_out(ack.id, ack.tries)
            if found is not None:
                bucket, slot = found
                bucket.states[slot] = DONE
                del bucket.deadline[slot]
                bucket.remaining -= 1
                bucket.version += 1
                if bucket.lease_until <= now:
                    lapsed.append((len(results), bucket))
            results.append(found is not None)
        if lapsed:
            await self._sync({bucket for _, bucket in lapsed})
            for index, bucket in lapsed:
                results[index] = not bucket.lost
        return results

    async def extend(self, extends: Sequence[Extend]) -> list[bool]:
        """Move the slots' reservation ends, which live in this store's memory alone: the
        stored state says a slot is handed out, never until when, and whoever takes the
        bucket over makes it available again with a try, whatever its end. So what keeps
        another process from a reservation extended past the lease it was made under is
        that lease, renewed by the state flusher for as long as a reservation of the bucket
        is live (an idle bucket is released, one with a live reservation never is).

        Where the lease lapsed (its renewal failed), another consumer may take the bucket
        over at any moment: as an ok there (``commit``), the extend writes first, renewing
        the lease, true only if the lease was still this store's."""
        self._check_open()
        results: list[bool] = []
        now = time.time()
        lapsed: list[tuple[int, HeldBucket]] = []
        for extend in extends:
            found = self._handed_out(extend.id, extend.tries)
            if found is not None:
                bucket, slot = found
                deadline = now + extend.seconds
                bucket.deadline[slot] = deadline
                heapq.heappush(self._held, (deadline, bucket.seq, slot, bucket))
                if bucket.lease_until <= now:
                    lapsed.append((len(results), bucket))
            results.append(found is not None)
        if lapsed:
            # Nothing stored changed (no version to write): a renewal, as a deadletter
            # move's on a lapsed lease.
            await self._sync(
                {bucket for _, bucket in lapsed}, renew_before=time.time() + self._grace / 2
            )
            for index, bucket in lapsed:
                results[index] = not bucket.lost
        return results

    def default_ko_delay(self, tries: int | None) -> float:
        """Keuss's retry polynomial, for a ko that gave no delay."""
        return self._settings.reject_delta_base + self._delta_factor * (tries or 0)

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        self._check_open()
        now = time.time()
        results: list[KoResult] = []
        moving: list[_Moving] = []
        lapsed: list[tuple[int, HeldBucket]] = []
        for nack in nacks:
            found = self._handed_out(nack.id, nack.tries)
            if found is None:
                results.append(KoResult.MISSING)
                continue
            bucket, slot = found
            tries = bucket.tries[slot] + (1 if nack.count_try else 0)
            if deadletter is not None and nack.count_try and tries > deadletter.max_ko:
                # Out of reach while the deadletter write is awaited: its reservation must not
                # lapse into another delivery (that one would be deadlettered or ok-ed too),
                # nor its holder ko it again. Stored so before the copy is written, so that
                # whoever takes the bucket over meanwhile finishes the move (``_deadletter``).
                moving.append(
                    _Moving(
                        bucket,
                        slot,
                        tries,
                        bucket.deadline.pop(slot),
                        bucket.tries[slot],
                        len(results),
                    )
                )
                bucket.states[slot] = DEADLETTERING
                bucket.targets[slot] = deadletter.queue
                bucket.tries[slot] = tries
                bucket.version += 1
                self._copying.add((bucket.id, slot))
                results.append(KoResult.DEADLETTERED)
                continue
            del bucket.deadline[slot]
            bucket.states[slot] = AVAILABLE
            bucket.tries[slot] = tries
            mature = now + nack.delay
            bucket.mature[slot] = mature
            bucket.version += 1
            heapq.heappush(self._ready, (mature, bucket.seq, slot, bucket))
            if bucket.lease_until <= now:
                lapsed.append((len(results), bucket))
            results.append(KoResult.ROLLED_BACK)
        if moving and deadletter is not None:
            for index in await self._deadletter(moving, deadletter, now):
                results[index] = KoResult.MISSING
        if lapsed:
            # As an ok there (see ``commit``): written before it answers, MISSING if
            # another consumer took the bucket over (it serves the message again itself).
            await self._sync({bucket for _, bucket in lapsed})
            for index, bucket in lapsed:
                if bucket.lost:
                    results[index] = KoResult.MISSING
        return results

    def _dead_copies(
        self, slots: list[tuple[HeldBucket, int]], plan: DeadletterPlan, now: float
    ) -> list[NewBucket]:
        """One bucket per deadlettered message, named after its slot: whoever writes the copy
        (this holder, or whoever took the bucket over while the copy was on its way) writes
        the same bucket, which an insert stores once. One message each also keeps every
        copy within the storage's byte bound. The x-dl-* headers are merged into the stored
        ones, each key once (appended, a message deadlettered again and again carried one
        more set each time)."""
        copies = []
        for bucket, slot in slots:
            tries = bucket.tries[slot]
            stored = bucket.message(slot, tries, now)
            headers = merge_headers(stored.headers, plan.headers(tries, now))
            copies.append(
                NewBucket(
                    f"{bucket.id}.dl{slot}",
                    now,
                    1,
                    encode_blob([stored.payload], [headers]),
                    encode_state(bytes(1), array(U32, [0]), array("d", [now])),
                )
            )
        return copies

    async def _deadletter(
        self, moving: list[_Moving], plan: DeadletterPlan, now: float
    ) -> list[int]:
        """Store the slots as on their way (renewing the lease), write the copies into the
        deadletter queue, then mark the slots done: see "What a crash can cost" in the
        module docstring. A failed step before the copy is stored hands the reservations
        back, to come back when those lapse. The copy runs to its end when the ko is
        cancelled, even by a close past its grace (``Finishing``, which the store's close
        waits for; the queue's ``RunToEnd`` holds the cancellation until the ko is done):
        cut short, a write whose copy was already stored handed the reservations back too.

        A bucket found taken over by the first write was so before the slots were stored
        as on their way: its new holder serves them again, and a copy written here would be
        a second one. Those are not moved; their results' indexes are returned
        (MISSING)."""
        try:
            await self._sync({m.bucket for m in moving}, renew_before=time.time() + self._grace / 2)
        except BaseException:
            self._give_back_moving(moving)
            raise
        lost = [m for m in moving if m.bucket.lost]
        self._copying.difference_update((m.bucket.id, m.slot) for m in lost)
        missing = [m.result for m in lost]
        moving = [m for m in moving if not m.bucket.lost]
        if not moving:
            return missing
        slots = [(m.bucket, m.slot) for m in moving]
        touched = await self._deadlettering.run(self._copy_then_mark(slots, moving))
        try:
            await self._sync(touched)
        except BaseException:
            # The ko fails, and counts nothing: the mark is counted by the state write that
            # stores it (or, refused, by whoever then finishes the move).
            for m in moving:
                if m.bucket.states[m.slot] == DONE:
                    m.bucket.uncounted.append(
                        (m.bucket.version, plan.queue, m.bucket.slot_id(m.slot))
                    )
            raise
        # A bucket taken over while the copy was on its way (this holder stalled past its
        # lease): the taker read the slot as on its way, and finishes the move and counts
        # it (``on_finished_deadletter``). Counted here too, it was counted twice.
        return missing + [m.result for m in moving if m.bucket.lost]

    async def _copy_then_mark(
        self, slots: list[tuple[HeldBucket, int]], moving: list[_Moving] | None = None
    ) -> list[HeldBucket]:
        """The deadletter write and the marks that follow it, as one piece of work that the
        store's close waits for: a close past its grace gives up the batch awaiting it, and
        a write cut short there handed the reservations back, so that the close gave the
        messages back here once written there already. A failed write gives a ko's
        reservations back (``moving``); slots a previous holder left are left as they are,
        for the next state flush to try again."""
        into = self._by_target(slots)
        now = time.time()
        try:
            for queue, copies in into.items():
                plan = DeadletterPlan(0, queue, self.name)
                await self._write_dead(queue, self._dead_copies(copies, plan, now))
        except BaseException:
            if moving is not None:
                self._give_back_moving(moving)
            raise
        finally:
            self._copying.difference_update((bucket.id, slot) for bucket, slot in slots)
        touched = {}
        for bucket, slot in slots:
            if bucket.states[slot] == DEADLETTERING:
                target = self._target(bucket, slot)
                bucket.states[slot] = DONE
                bucket.targets.pop(slot, None)
                bucket.remaining -= 1
                bucket.version += 1
                touched[bucket.id] = bucket
                if moving is None and target is not None:
                    # A previous holder's move: counted once the write of this mark lands
                    # (see ``_count_finished``), never before: a mark refused (this store
                    # stalled past its lease in turn) leaves the move to the next holder,
                    # which reads the slot as on its way and counts it.
                    bucket.uncounted.append((bucket.version, target, bucket.slot_id(slot)))
        return list(touched.values())

    def _give_back_moving(self, moving: list[_Moving]) -> None:
        """The slots of a deadletter move that failed: their reservations, as they were. Their
        on-their-way state, if stored, is written over by the next state write; a takeover
        before it writes the copy (the same one, should this one have landed)."""
        for bucket, slot, _, deadline, tries, _ in moving:
            self._copying.discard((bucket.id, slot))
            if bucket.states[slot] == DEADLETTERING:
                bucket.states[slot] = HANDED_OUT
                bucket.targets.pop(slot, None)
                bucket.deadline[slot] = deadline
                bucket.tries[slot] = tries
                bucket.version += 1
                heapq.heappush(self._held, (deadline, bucket.seq, slot, bucket))

    async def _finish_deadletters(self, buckets: Iterable[HeldBucket]) -> None:
        """Write the copies of the slots stored as on their way to the deadletter queue by a
        holder this store took the bucket over from, and mark them done: that holder may
        have died before writing its copy, and may still write it (the same bucket, into
        the queue the slot's state names, see ``_target``)."""
        now = time.time()
        slots = [
            (bucket, slot)
            for bucket in buckets
            if DEADLETTERING in bucket.states
            and bucket.live
            and not bucket.lost
            and bucket.copy_due <= now
            for slot, state in enumerate(bucket.states)
            if state == DEADLETTERING
            and (bucket.id, slot) not in self._copying
            and self._target(bucket, slot) is not None
        ]
        if not slots:
            return
        self._copying.update((bucket.id, slot) for bucket, slot in slots)
        moved = {bucket.id: bucket for bucket, _ in slots}
        try:
            touched = await self._deadlettering.run(self._copy_then_mark(slots))
        except Exception:
            self._copy_failed(moved.values())
            raise
        for bucket_id in moved:
            self._copy_retries.pop(bucket_id, None)
        await self._sync(touched)

    def _copy_failed(self, buckets: Iterable[HeldBucket]) -> None:
        """A previous holder's deadletter copy failed (the deadletter queue refusing it, the
        server erroring on that write): tried again with backoff, not at every state flush,
        and meanwhile the bucket is kept or given back as it would be without that slot
        (``HeldBucket.is_idle``), so that its other messages stay deliverable and a process
        whose copy keeps failing does not hold them for ever. Giving it back rather than
        holding it until the copy lands: another process (its own connection, perhaps its
        own deadletter options' server) may succeed where this one fails, and either way a
        lease is exclusive and the slot's stored state names its target, so a move passed
        on is neither lost nor finished twice."""
        now = time.time()
        for bucket_id, (_, due) in list(self._copy_retries.items()):
            if due < now - COPY_RETRY_MAX:  # finished elsewhere, or long enough ago
                del self._copy_retries[bucket_id]
        for bucket in buckets:
            failures = self._copy_retries.get(bucket.id, (0, 0.0))[0] + 1
            bucket.copy_due = now + min(COPY_RETRY_MAX, COPY_RETRY_FIRST * 2 ** (failures - 1))
            self._copy_retries[bucket.id] = (failures, bucket.copy_due)

    def _by_target(
        self, slots: list[tuple[HeldBucket, int]]
    ) -> dict[str, list[tuple[HeldBucket, int]]]:
        """``slots`` by the deadletter queue their copies go to (see :meth:`_target`; a
        ko's slots always have one: a queue deadletters into another)."""
        into: dict[str, list[tuple[HeldBucket, int]]] = {}
        for bucket, slot in slots:
            into.setdefault(self._target(bucket, slot) or "", []).append((bucket, slot))
        return into

    def _target(self, bucket: HeldBucket, slot: int) -> str | None:
        """The deadletter queue of a slot on its way there: the one its state names, so
        that a holder deadlettering elsewhere than this process would (another option, or
        none) and the one finishing its move write the same copy into the same queue. A
        state stored without it (by the release before) falls back to this queue's
        deadletter queue, else the default one; None where that is this very queue."""
        target = bucket.targets.get(slot)
        if target is None:
            target = DEFAULT_DEADLETTER_QUEUE if self._plan is None else self._plan.queue
        return None if target == self.name else target

    def on_deadletter(self, plan: DeadletterPlan | None) -> None:
        self._plan = plan

    def on_finished_deadletter(self, listener: FinishedDeadletters) -> None:
        self._finished = listener

    async def _write_dead(self, queue: str, buckets: list[NewBucket]) -> None:
        for write in _writes(buckets):
            await self._storage.insert_buckets(queue, write)

    async def _borrow(self, ids: list[str]) -> None:
        """Lease the buckets ``ids`` (held nowhere) for a remove: released by the next state
        flush if unused."""
        for bucket in await self._lease(0, ids):
            bucket.last_used = -math.inf

    async def remove(self, ids: Sequence[str]) -> list[bool]:
        self._check_open()
        now = time.time()
        parsed = [split_id(i) for i in ids]
        elsewhere = sorted(
            {p[0] for p in parsed if p is not None and p[0] not in self._held_buckets}
        )
        if elsewhere:
            # To its end: cut short once the lease is taken (a cancelled remove), its reply
            # was dropped, and the buckets stayed leased, unknown here, until it lapsed.
            await to_the_end(self._borrow(elsewhere))
        results = []
        touched = {}
        removed: list[tuple[int, HeldBucket]] = []
        for p in parsed:
            found = None if p is None else self._held_buckets.get(p[0])
            if p is None or found is None or p[1] >= found.count:
                results.append(False)
                continue
            bucket, slot = found, p[1]
            state = bucket.states[slot]
            if state in (DONE, DEADLETTERING) or (
                state == HANDED_OUT and bucket.deadline.get(slot, now) > now
            ):
                results.append(False)
                continue
            bucket.states[slot] = DONE
            bucket.deadline.pop(slot, None)
            bucket.remaining -= 1
            bucket.version += 1
            touched[bucket.id] = bucket
            removed.append((len(results), bucket))
            results.append(True)
        if touched:
            await self._sync(list(touched.values()))
            # A bucket whose lease was lost (another consumer took it over after ours
            # lapsed): the write was refused, and its new holder still has the message.
            for index, bucket in removed:
                results[index] = not bucket.lost
        return results

    # state persistence ---------------------------------------------------------------

    async def sizes(self) -> Sizes:
        """Every bucket counted once: from storage, or from memory where this store's state
        is the true one (``in_memory``) and for push buckets not yet written. A push bucket
        whose insert is in flight is counted from memory too (and left out of the census,
        which may or may not see it yet): it was counted nowhere for that round trip, and
        with ``ack_on_buffer`` acknowledged messages dropped out of the sizes meanwhile (a
        put-back of a cancelled pop's messages, likewise)."""
        mine = self.in_memory()
        pushing = [*self._filling.values(), *self._sealed, *self._in_flight]
        census = await self._storage.census(
            self.name, [*mine.keys(), *(p.id for p in pushing)], time.time()
        )
        now = time.time()
        ready, scheduled, reserved = census.ready, census.scheduled, census.reserved
        for bucket in mine.values():  # final state even if released meanwhile
            mature, deadline = bucket.mature, bucket.deadline
            for slot, state in enumerate(bucket.states):
                if state == AVAILABLE:
                    if mature[slot] <= now:
                        ready += 1
                    else:
                        scheduled += 1
                elif state == HANDED_OUT:
                    if deadline[slot] <= now:
                        ready += 1
                    else:
                        reserved += 1
                elif state == DEADLETTERING:  # out of reach until it is done
                    reserved += 1
        for push in pushing:  # not yet written, or their insert's reply not yet read
            for mature_t in push.mature:
                if mature_t <= now:
                    ready += 1
                else:
                    scheduled += 1
        return Sizes(ready, ready + scheduled + reserved, scheduled, reserved)

    async def next_mature(self) -> float | None:
        census = await self._storage.census(self.name, self._held_buckets.keys(), time.time())
        times = [t for t in (self._memory_next(), census.min_score) if t is not None]
        times += [min(p.mature) for p in [*self._filling.values(), *self._sealed] if p.mature]
        return min(times) if times else None

    # shutdown ------------------------------------------------------------------------

    def keep_reserved(self, ids: Iterable[str]) -> None:
        """The close gives these slots back available only from their reservation's
        deadline, with the try it cost, as a lapsed reservation (see ``Store``)."""
        for message_id in ids:
            bucket_id, _, slot = message_id.rpartition("-")
            if bucket_id and slot.isdigit():
                self._kept_reserved.setdefault(bucket_id, set()).add(int(slot))

    async def close(self) -> None:
        """Refuse further calls (ClosedError), write what is buffered, then give every
        leased bucket back at once (reserved slots become available without a try), so
        nothing waits for the grace period.

        Ends while other tasks keep pushing or acknowledging: they are refused from the
        start, so there is a last bucket to write. A write that fails is tried again a few
        times (a short outage); then close raises, and what was not written is a crash's
        cost (see the module docstring). So does a close whose writes take more than
        ``CLOSE_BOUND`` seconds in all (a server that stopped answering): unbounded, it
        waited for a reply that never came, so a queue's close, even cancelled, never
        ended."""
        if self._shut:
            return
        # Refused from now on; but only a close that ended is done: one cancelled (a shutdown
        # timeout, a second Ctrl-C: the queue's cancelled close closes its store again) or
        # failed runs again, else the buckets still leased stayed out of reach until their
        # lease lapsed.
        self._closed = True
        self._make_room()  # pushers held by backpressure: refused
        failure: Exception | None = None
        try:
            # a deadletter written there and not yet marked done here would be given back
            # with the buckets below: in both queues (bounded by the wait itself)
            await self._deadlettering.wait(
                self.name, "deadletter writes given up: their messages may be in both queues"
            )
            async with asyncio.timeout(CLOSE_BOUND):
                failure = await self._give_everything_back()
        except TimeoutError:
            raise KeussConnectionError(
                f"queue {self.name!r}: close gave up writing back after {CLOSE_BOUND:g} s"
                " (the server did not answer): the buckets still leased come back once"
                " their lease lapses, and what was buffered is lost"
            ) from None
        finally:
            if self._flusher is not None:
                await stop_task(self._flusher)
        self._shut = True
        if failure is not None:
            raise failure

    async def _give_everything_back(self) -> Exception | None:
        """The close's writes, once the deadletter moves under way ended: the buffer, then
        every leased bucket given back. Answers the buffer's failure (the leases are given
        back all the same)."""
        failure: Exception | None = None
        try:
            await self.flush()
        except Exception as exc:  # give the leases back all the same
            failure = exc
        while self._writer_tasks:  # no new one starts: nothing is pushed any more
            await asyncio.gather(*self._writer_tasks, return_exceptions=True)
        while self._leases:
            # A lease begun before the close (a remove's, of a bucket held nowhere: no
            # queue call waits for it) takes buckets the loop below must give back;
            # landing after it, they stayed leased until the lease lapsed.
            await asyncio.gather(*self._leases, return_exceptions=True)
        if self._flusher is not None:
            # A state write of the flusher in flight holds the buckets it gives back
            # (out of those the loop below looks at): were it to fail after the loop
            # found nothing left, they would stay stored, their oks undone once the
            # lease lapsed. Stopped first, its write lands or puts them back.
            await stop_task(self._flusher)
        attempt = 0
        while self._held_buckets or self._departing:
            try:
                await self._flush_state(release_all=True)
            except ClosedError:
                # the connection itself was given up (a cancelled close's grace is spent,
                # see ``Backend.abandon``): no retry gets through, and its 3 s of backoff
                # only kept the close past its bound
                raise
            except Exception:
                attempt += 1
                if attempt >= ACK_ON_BUFFER_RETRIES:
                    raise
                await asyncio.sleep(0.1 * 2**attempt)
        return failure


class BucketBackend:
    """Mixed in before a database's :class:`Backend`: one :class:`BucketStore` per queue over
    that database's :class:`BucketStorage`, which ``use_storage`` installs."""

    capabilities: Capabilities = CAPABILITIES
    settings: dict[str, Any]
    bucket_settings: BucketSettings
    _storage: BucketStorage

    def use_storage(self, storage: BucketStorage) -> None:
        self.bucket_settings = BucketSettings.parse(self.settings)
        self._storage = storage

    async def store(self, queue: str, options: QueueOptions) -> Store:
        await self._storage.prepare()
        return BucketStore(queue, options, self._storage, self.bucket_settings)


def _writes(buckets: list[NewBucket]) -> list[list[NewBucket]]:
    """Buckets in insert round trips of at most ``WRITE_MAX_BYTES`` (at least one each)."""
    writes: list[list[NewBucket]] = []
    size = 0
    for bucket in buckets:
        weight = len(bucket.blob) + len(bucket.state)
        if not writes or (writes[-1] and size + weight > WRITE_MAX_BYTES):
            writes.append([])
            size = 0
        writes[-1].append(bucket)
        size += weight
    return writes
