"""Bucket stores (Keuss's bucket-mongo-safe, seed 000): many messages per storage unit.

Written once for every database. A database contributes only a :class:`BucketStorage`: a
handful of atomic operations over *whole buckets* (insert, lease, write state, census),
see ``bucket_redis.py`` and ``bucket_postgres.py``. Everything else is here.

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

  state 0 = available, 1 = done, 2 = handed out (reserved).
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
(and buckets whose lease expired) with ``score <= now``, sets ``owner`` to this store's token
and ``score`` to ``now + reject_timeout_grace``. A bucket leased while it still had an owner
means its previous holder died (or stalled past its lease): its handed-out slots become
available again with one more try. A holder serves nothing from a bucket whose lease lapsed
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
release that failed is tried again. Writes are conditional on the lease token, so a holder
whose lease was taken over never overwrites the new holder's state, and writes of one bucket
are serialized (a later snapshot always contains the earlier changes).

What a crash can cost (at-least-once holds; pop stays at-most-once):
- reservations not yet persisted come back with their old ``tries`` count;
- oks not yet persisted come back (delivered again);
- a deadletter move writes the message to the deadletter queue first and then marks the slot
  done: a crash between the two leaves a duplicate, never a loss.

What an outage can cost. A lease is a holder's only claim on a bucket, and it lapses
``reject_timeout_grace`` (default 0.8 x reserve_delay) after its last renewal; renewing it,
like writing the state, takes the server. When a holder cannot write for that long (the
server away or out of reach, its event loop stalled), the next consumer to lease the bucket
takes it over with the state last written, exactly as if the holder had crashed:
- its oks, kos and reservations made since that state write are undone, as in a crash: ok-ed
  messages are delivered again; reserved ones come back with one more try, possibly to
  another consumer while the first still works on them (a reservation is exclusive until
  ``reserve_delay`` passes or its holder's lease lapses, whichever comes first);
- the old holder finds out at its next write (refused: a warning is logged, the bucket is
  forgotten, and oks of its slots return False), or when it leases the bucket again (it
  then starts from the stored state, never from its stale copy).
An ok that returned True is therefore durable once the next state write after it succeeds
(within one flush period while the server answers), and undone only if the holder cannot
write from the ok until its lease lapses and another consumer then leases the bucket before
the holder's write gets through. If the holder writes first (its lease is still its own in
storage, nobody having leased the bucket), everything it acknowledged is kept. An ok on a
bucket whose lease already lapsed writes before it answers: True only once written, an
error while the server is away.

Clock: every time here is this process's clock (``time.time()``), also for leases; processes
sharing a queue need synchronized clocks (NTP), as with Keuss.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import os
import sys
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any, ClassVar

from ..coalesce import RunToEnd, Uncancellable, stop_task
from ..contract import Ack, DeadletterPlan, Entry, Fetched, LoopTurns, Nack, Store, Stored
from ..errors import ClosedError, ConfigError, InvalidDelayError, InvalidInputError, KeussError
from ..message import append_headers
from ..options import check_seconds
from ..types import Capabilities, KoResult, Sizes

if TYPE_CHECKING:
    from ..options import QueueOptions

log = logging.getLogger(__name__)

AVAILABLE, DONE, HANDED_OUT = 0, 1, 2

CAPABILITIES = Capabilities(idempotent=False)
"""pop, reserve, delay, remove and reservation expiry; no user-chosen (idempotent) ids."""

BUCKET_OPTIONS: Mapping[str, Any] = {
    "bucket_max_size": 1024,
    "bucket_max_wait": 0.5,
    "state_flush_period": 0.5,
    "reject_delta_base": 10.0,
    "reject_delta_factor": None,
    "reject_timeout_grace": None,
    "ack_on_buffer": False,
}
"""Backend options of every bucket backend, in SECONDS (Keuss's are milliseconds).

- ``bucket_max_size``: most messages in one bucket (Keuss: 1024).
- ``bucket_max_wait``: longest a push bucket fills before it is written (Keuss: 500 ms).
- ``state_flush_period``: how often leased buckets' state is written (Keuss: 500 ms).
- ``reject_delta_base`` / ``reject_delta_factor``: retry delay ``base + factor * tries`` for a
  ko without a delay (Keuss: 10 s and reserve_delay, or 30 s). The queue layer currently
  always passes a delay (0.0 when the user gave none), so this applies only to a store call
  whose ``Nack.delay`` is None.
- ``reject_timeout_grace``: lease length; a dead holder's buckets come back after it
  (default reserve_delay * 0.8, at least ``MIN_GRACE``).
- ``ack_on_buffer``: acknowledge a push when buffered (Keuss's trade-off), not when durable.
"""

READY_KEY = -1
"""Push-bucket key of entries mature at insert time; delayed ones are keyed by 50 ms slot."""
DELAY_GRANULE = 0.05
MIN_GRACE = 0.1
IDLE_RELEASE = 5.0
"""Seconds a leased bucket with deliverable messages may sit unused before it is released
for other processes (a process that stopped consuming must not hold messages for ever)."""
LEASE_MAX_BUCKETS = 64
"""Most buckets one lease takes; it stops earlier once their messages cover the request."""
LEASE_AT_LEAST = 64
"""Messages a lease asks for even when the caller wants fewer: buckets written by a few
durable pushers hold a message or a handful each, and a lease round trip per handful would
halve the pop rate. Buckets held but unused go back after ``IDLE_RELEASE``."""
WRITE_MAX_BUCKETS = 16
"""Most push buckets in one insert round trip."""
PUSH_WRITERS = 4
"""Insert round trips in flight at once per store."""
PIPELINED_CALLS = 4
"""Calls of one kind in flight at once where they run in the caller's task."""
ACK_ON_BUFFER_RETRIES = 5
BUFFERED_BUCKETS = 2 * PUSH_WRITERS
"""``ack_on_buffer``: full buckets' worth of acknowledged, unwritten messages beyond which a
push waits for a write (backpressure), so that the loss window of a crash stays about this
many buckets plus those filling (each written within ``bucket_max_wait``)."""
BUFFERED_AT_LEAST = PUSH_WRITERS * WRITE_MAX_BUCKETS
"""... and never fewer messages than this, so tiny buckets still share write round trips."""

_LITTLE = sys.byteorder == "little"
_U32 = "I" if array("I").itemsize == 4 else "L"


def _to_le(values: array[Any]) -> bytes:
    if _LITTLE:
        return values.tobytes()
    swapped = array(values.typecode, values)  # pragma: no cover - big-endian hosts
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


def _from_le(typecode: str, data: bytes | memoryview) -> array[Any]:
    values = array(typecode)
    values.frombytes(data)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        values.byteswap()
    return values


def encode_blob(payloads: Sequence[bytes], headers: Sequence[bytes]) -> bytes:
    """Frame the messages of one bucket (see the module docstring)."""
    count = len(payloads)
    lengths = array(_U32, [count])
    lengths.extend(len(p) for p in payloads)
    lengths.extend(len(h) for h in headers)
    return b"".join((_to_le(lengths), *payloads, *headers))


def decode_blob(blob: bytes) -> tuple[int, list[int], list[int]]:
    """(count, payload offsets, headers offsets): slot i's payload is
    ``blob[p[i]:p[i+1]]`` and its headers ``blob[h[i]:h[i+1]]``."""
    (count,) = _from_le(_U32, blob[:4])
    lengths = _from_le(_U32, blob[4 : 4 + 8 * count])
    start = 4 + 8 * count
    payload_offsets = list(accumulate(lengths[:count], initial=start))
    header_offsets = list(accumulate(lengths[count:], initial=payload_offsets[-1]))
    return count, payload_offsets, header_offsets


def encode_state(states: bytes | bytearray, tries: array[int], mature: array[float]) -> bytes:
    return b"".join((bytes(states), _to_le(tries), _to_le(mature)))


def decode_state(blob: bytes, count: int) -> tuple[bytearray, array[int], array[float]]:
    view = memoryview(blob)
    states = bytearray(view[:count])
    tries = _from_le(_U32, view[count : 5 * count])
    mature = _from_le("d", view[5 * count : 13 * count])
    return states, tries, mature


# --- what a database provides -----------------------------------------------------------


@dataclass(slots=True)
class NewBucket:
    """A bucket to insert: free, all slots available."""

    id: str
    score: float
    count: int
    blob: bytes
    state: bytes


@dataclass(slots=True)
class LeasedBucket:
    """A bucket a lease took: its content and who held it before (``""``: nobody)."""

    id: str
    blob: bytes
    state: bytes
    previous_owner: str


@dataclass(slots=True)
class Lease:
    """What a lease took, and the lowest score left in storage after it (for the wait loop;
    it may be one of this store's own lease deadlines, which only bounds a sleep)."""

    buckets: list[LeasedBucket]
    next_score: float | None


KEEP, RELEASE, DELETE = "k", "r", "d"


@dataclass(slots=True)
class StateWrite:
    """Write back a leased bucket, only if ``owner`` is still the writer's token.

    ``mode``: KEEP (stay leased, score = lease deadline), RELEASE (owner = "", score = when
    it is next worth leasing) or DELETE (nothing left). ``state`` None keeps the stored state
    (a lease renewal only).
    """

    id: str
    mode: str
    score: float
    remaining: int
    state: bytes | None


@dataclass(slots=True)
class Census:
    """Sums over the buckets of a queue that the asking store does not hold.

    A free bucket counts as ready when its score has passed, else scheduled; a bucket leased
    by someone else counts as reserved until its lease expires (then ready).
    """

    ready: int
    scheduled: int
    reserved: int
    min_score: float | None


class BucketStorage(ABC):
    """The atomic bucket operations one database provides; each is one round trip.

    Every method takes the queue name: a deadletter move inserts into another queue.
    """

    uninterruptible: bool = False
    """True when round trips pipeline on one connection and their replies refuse
    cancellation (see ``Store.uninterruptible``): a pusher may then write its bucket in its
    own task, since a cancelled pusher still finishes the write its fellows wait for."""

    async def prepare(self) -> None:
        """Called before each queue's store is made (e.g. to create indexes on first use)."""

    @abstractmethod
    async def insert_buckets(self, queue: str, buckets: Sequence[NewBucket]) -> None:
        """Insert free buckets (owner ``""``), durably, all or none."""

    @abstractmethod
    async def lease(
        self,
        queue: str,
        token: str,
        now: float,
        deadline: float,
        want: int,
        max_buckets: int,
        ids: Sequence[str] | None = None,
    ) -> Lease:
        """Atomically take buckets: set owner = token, score = deadline.

        Without ``ids``: buckets with ``score <= now`` in (score, id) order, stopping once
        their ``remaining`` adds up to ``want`` or ``max_buckets`` were taken. With ``ids``:
        those of them that are free (whatever their score) or whose lease expired.
        """

    @abstractmethod
    async def write(self, queue: str, token: str, writes: Sequence[StateWrite]) -> list[bool]:
        """Apply each write whose bucket is still owned by ``token``; one flag per write,
        false when the lease was lost (taken over, or the bucket is gone)."""

    @abstractmethod
    async def census(self, queue: str, exclude: Collection[str], now: float) -> Census:
        """Sizes and earliest score of the buckets not in ``exclude`` (the asker's own)."""


# --- options ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BucketSettings:
    bucket_max_size: int
    bucket_max_wait: float
    state_flush_period: float
    reject_delta_base: float
    reject_delta_factor: float | None
    reject_timeout_grace: float | None
    ack_on_buffer: bool

    @classmethod
    def parse(cls, settings: Mapping[str, Any]) -> BucketSettings:
        """Validate the bucket options of a backend's settings (ConfigError when bad)."""
        size = settings["bucket_max_size"]
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 65536:
            raise ConfigError(f"bucket_max_size must be an int in 1..65536, not {size!r}")
        ack = settings["ack_on_buffer"]
        if not isinstance(ack, bool):
            raise ConfigError(f"ack_on_buffer must be a bool, not {ack!r}")

        def seconds(key: str, optional: bool = False, positive: bool = False) -> Any:
            value = settings[key]
            if value is None and optional:
                return None
            try:
                checked = check_seconds(value, key)  # in [0, MAX_SECONDS], no OverflowError
            except InvalidDelayError as exc:
                raise ConfigError(str(exc)) from exc
            if positive and checked == 0:
                raise ConfigError(f"{key} must be > 0 seconds, not {value!r}")
            return checked

        return cls(
            bucket_max_size=size,
            bucket_max_wait=seconds("bucket_max_wait"),
            state_flush_period=seconds("state_flush_period", positive=True),
            reject_delta_base=seconds("reject_delta_base"),
            reject_delta_factor=seconds("reject_delta_factor", optional=True),
            reject_timeout_grace=seconds("reject_timeout_grace", optional=True),
            ack_on_buffer=ack,
        )


_bucket_prefix = os.urandom(4).hex()
_bucket_counter = 0


def _reseed_after_fork() -> None:
    global _bucket_prefix, _bucket_counter
    _bucket_prefix, _bucket_counter = os.urandom(4).hex(), 0


os.register_at_fork(after_in_child=_reseed_after_fork)


def new_bucket_id() -> str:
    """Time-ordered (so equal scores lease oldest first), unique across processes."""
    global _bucket_counter
    _bucket_counter += 1
    return f"{time.time_ns():016x}{_bucket_prefix}{_bucket_counter:x}"


def split_id(message_id: str) -> tuple[str, int] | None:
    """(bucket id, slot) of a message id, or None when it is not one of ours."""
    bucket_id, dash, slot = message_id.rpartition("-")
    if not dash or not bucket_id or not slot.isdigit() or len(slot) > 6:
        return None
    return bucket_id, int(slot)


# --- push side --------------------------------------------------------------------------


class _PushBucket:
    """A bucket being filled in memory. Whoever waits for it to be durable (a pusher, a
    flush) gets a future of its own in ``waiters`` rather than a shield of a shared one: a
    cancelled waiter cancels only its own."""

    __slots__ = (
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
        self.tries = array(_U32)
        self.waiters: list[asyncio.Future[None]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.flush_at = 0.0

    def written(self) -> asyncio.Future[None]:
        """A future of the caller's own, resolved (or failed) when the bucket is written."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        return waiter

    def settle(self, error: Exception | None) -> None:
        for waiter in self.waiters:
            if waiter.done():  # its waiter was cancelled
                continue
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

    def add(self, entry: Entry, mature: float) -> int:
        slot = len(self.payloads)
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


# --- pull side --------------------------------------------------------------------------


class _Leased:
    """A bucket this store holds: the messages plus the authoritative slot state.

    ``version`` counts changes; ``persisted`` is the version last written. ``writing`` is
    the write in flight, so writes of one bucket never overtake each other.
    """

    __slots__ = (
        "blob",
        "count",
        "deadline",
        "gone",
        "headers_at",
        "id",
        "last_used",
        "lease_until",
        "live",
        "lost",
        "mature",
        "payload_at",
        "persisted",
        "remaining",
        "seq",
        "states",
        "tries",
        "version",
        "writing",
    )

    def __init__(self, row: LeasedBucket, seq: int, now: float) -> None:
        self.id = row.id
        self.seq = seq
        self.blob = row.blob
        self.count, self.payload_at, self.headers_at = decode_blob(row.blob)
        self.states, self.tries, self.mature = decode_state(row.state, self.count)
        self.deadline: dict[int, float] = {}
        self.version = self.persisted = 0
        # A slot stored as handed out is nobody's live reservation any more (its holder
        # died, or lost the lease): that delivery was a failed try.
        if HANDED_OUT in self.states:
            for slot, state in enumerate(self.states):
                if state == HANDED_OUT:
                    self.states[slot] = AVAILABLE
                    self.tries[slot] += 1
            self.version = 1
        self.remaining = self.count - self.states.count(DONE)
        self.writing: asyncio.Future[None] | None = None
        self.live = True  # served from
        self.gone = False  # released or deleted in storage: no more writes
        self.lost = False  # someone else took the lease over
        self.last_used = now
        self.lease_until = 0.0

    def __lt__(self, other: _Leased) -> bool:  # heap ties (never reached in practice)
        return self.seq < other.seq

    def follow(self, write: asyncio.Future[None]) -> None:
        """Writes of this bucket wait for ``write`` (of an earlier copy of it) to end."""
        self.writing = write

        def ended(_: asyncio.Future[None]) -> None:
            if self.writing is write:
                self.writing = None

        write.add_done_callback(ended)

    def message(self, slot: int, tries: int, mature: float) -> Stored:
        p, h = self.payload_at, self.headers_at
        blob = self.blob
        return Stored(
            f"{self.id}-{slot}",
            blob[p[slot] : p[slot + 1]],
            blob[h[slot] : h[slot + 1]],
            tries,
            mature,
        )

    def snapshot(self) -> bytes:
        return encode_state(self.states, self.tries, self.mature)

    def next_available(self) -> float | None:
        """Earliest mature time of an available slot (the score when released)."""
        matures = [m for m, s in zip(self.mature, self.states, strict=True) if s == AVAILABLE]
        return min(matures) if matures else None

    def is_idle(self, now: float) -> tuple[bool, bool]:
        """(has deliverable now, has reserved)."""
        deliverable = reserved = False
        for slot, state in enumerate(self.states):
            if state == AVAILABLE:
                if self.mature[slot] <= now:
                    deliverable = True
            elif state == HANDED_OUT:
                reserved = True
        return deliverable, reserved


_Entry = tuple[float, int, int, _Leased]
"""(time, bucket seq, slot, bucket): a ready heap entry (mature) or a held one (deadline)."""


class BucketStore(Store):
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
        if self.uninterruptible:
            self.batch_concurrency = PIPELINED_CALLS  # type: ignore[misc]
        self._settings = settings
        grace = settings.reject_timeout_grace
        self._grace = max(MIN_GRACE, options.reserve_delay * 0.8 if grace is None else grace)
        self._period = min(settings.state_flush_period, self._grace / 3)
        factor = settings.reject_delta_factor
        self._delta_factor = (options.reserve_delay or 30.0) if factor is None else factor
        self._token = os.urandom(8).hex()
        self._closed = False
        # push side
        self._filling: dict[int, _PushBucket] = {}
        self._sealed: list[_PushBucket] = []
        self._in_flight: set[_PushBucket] = set()  # sealed, insert round trip under way
        self._writers = 0
        self._writer_starting = False
        self._writer_tasks: set[asyncio.Task[None]] = set()
        self._buffered = 0  # messages pushed and not yet written (or given up on)
        self._buffer_limit = max(BUFFERED_BUCKETS * settings.bucket_max_size, BUFFERED_AT_LEAST)
        self._room: list[asyncio.Future[None]] = []  # pushers waiting for the buffer to drain
        self._turns = LoopTurns()  # ``ack_on_buffer``: a buffered push awaits nothing else
        # pull side
        self._held_buckets: dict[str, _Leased] = {}
        self._seq = 0
        self._ready: list[_Entry] = []
        self._held: list[_Entry] = []
        self._leasing: asyncio.Future[None] | None = None
        self._storage_next: float | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._visible: Callable[[float], None] | None = None
        # Buckets that left memory (released or finished) whose final write failed: retried
        # by the next state flush, else their oks would come back once their lease lapses.
        self._departing: dict[str, tuple[_Leased, str]] = {}

    # push ---------------------------------------------------------------------------

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        if not entries:
            return []
        buffered = self._settings.ack_on_buffer
        if buffered:
            await self._admit(len(entries))
        self._check_open()  # after close nothing may be buffered: no one would write it
        now = time.time()
        size = self._settings.bucket_max_size
        touched: dict[int, _PushBucket] = {}
        for entry in entries:
            if entry.dedup:
                raise InvalidInputError("bucket backends do not support user-chosen ids")
            mature = entry.mature if entry.mature is not None else now + entry.delay
            key = READY_KEY if mature <= now else int(mature / DELAY_GRANULE)
            bucket = self._filling.get(key)
            if bucket is None:
                bucket = self._filling[key] = _PushBucket(key)
                if buffered:
                    bucket.flush_at = now + self._settings.bucket_max_wait
                    bucket.timer = asyncio.get_running_loop().call_later(
                        self._settings.bucket_max_wait, self._seal, bucket
                    )
            entry.id = f"{bucket.id}-{bucket.add(entry, mature)}"
            self._buffered += 1
            touched[id(bucket)] = bucket
            if len(bucket.payloads) >= size:
                self._seal(bucket)
        if buffered:
            return [True] * len(entries)
        waiters = [bucket.written() for bucket in touched.values()]
        own = self._storage.uninterruptible and self._writers < PUSH_WRITERS
        if own and (mine := [b for b in touched.values() if self._unfill(b)]):
            await self._write_own(mine)
        else:
            self._start_writer()
        for waiter in waiters:
            await waiter
        return [True] * len(entries)

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

    async def _write_own(self, buckets: list[_PushBucket]) -> None:
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

    def _unfill(self, bucket: _PushBucket) -> bool:
        """Take a bucket out of the filling ones; false if it was already."""
        if self._filling.get(bucket.key) is not bucket:
            return False
        del self._filling[bucket.key]
        if bucket.timer is not None:
            bucket.timer.cancel()
        return True

    def _seal(self, bucket: _PushBucket) -> None:
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
                batch, self._sealed = (
                    self._sealed[:WRITE_MAX_BUCKETS],
                    self._sealed[WRITE_MAX_BUCKETS:],
                )
                await self._write_push_buckets(batch)
        finally:
            self._writers -= 1

    async def _write_push_buckets(self, batch: list[_PushBucket]) -> None:
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

    async def _insert_settling(self, batch: list[_PushBucket]) -> None:
        encoded = [b.encode() for b in batch]
        attempts = ACK_ON_BUFFER_RETRIES if self._settings.ack_on_buffer else 1
        for attempt in range(attempts):
            try:
                await self._storage.insert_buckets(self.name, encoded)
            except Exception as exc:
                if attempt + 1 < attempts:
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
            for bucket in batch:
                bucket.settle(None)
            if self._settings.ack_on_buffer and self._visible is not None:
                self._visible(min(b.score for b in encoded))  # now other processes see them
            return

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

    async def _lease(self, want: int, ids: Sequence[str] | None = None) -> list[_Leased]:
        """Take more buckets into memory; concurrent callers share one lease in flight."""
        if ids is None and self._leasing is not None:
            await self._leasing
            return []
        future = Uncancellable()
        if ids is None:
            self._leasing = future
        try:
            now = time.time()
            lease = await self._storage.lease(
                self.name, self._token, now, now + self._grace, want, LEASE_MAX_BUCKETS, ids
            )
            if ids is None:
                self._storage_next = lease.next_score
            taken = []
            for row in lease.buckets:
                mine = self._held_buckets.get(row.id)
                departing = self._departing.pop(row.id, None)
                if row.previous_owner == self._token and (mine or departing) is not None:
                    # our own lease had lapsed, and nobody took it meanwhile: ours still
                    if mine is not None:
                        mine.lease_until = now + self._grace
                    if departing is not None:  # its final write is retried
                        self._departing[row.id] = departing
                    continue
                stale_write = None
                for stale in (mine, departing[0] if departing else None):
                    if stale is not None:
                        # Another consumer held the bucket since our lease lapsed: our copy
                        # is stale (writing it would undo that consumer's work). A write of
                        # it still in flight may land after this lease (the owner is us
                        # again): the fresh state is written after it.
                        stale.lost = True
                        self._forget(stale)
                        stale_write = stale.writing or stale_write
                self._seq += 1
                bucket = _Leased(row, self._seq, now)
                bucket.lease_until = now + self._grace
                if stale_write is not None:
                    bucket.version = bucket.persisted + 1
                    bucket.follow(stale_write)
                self._held_buckets[bucket.id] = bucket
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
            return taken
        finally:
            if ids is None:
                self._leasing = None
            future.set_result(None)

    # pop / reserve -------------------------------------------------------------------

    def _serve(
        self, n: int, now: float, reserve_delay: float | None, touched: dict[str, _Leased]
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
        lapsed: list[tuple[list[_Entry], _Entry]] = []
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
        self, n: int, reserve_delay: float | None, touched: dict[str, _Leased]
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
        touched: dict[str, _Leased] = {}
        out = await self._fetch(n, None, touched)
        if out:
            try:
                await self._sync(touched.values())
            except BaseException:
                self._unserve(out, touched)
                raise
            if any(b.lost for b in touched.values()):
                # a bucket whose lease was lost meanwhile: its new holder delivers those
                out = [m for m in out if not touched[m.id.rpartition("-")[0]].lost]
        return Fetched(out, self._next_mature())

    def _unserve(self, messages: list[Stored], touched: dict[str, _Leased]) -> None:
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

    def _handed_out(self, message_id: str, tries: int | None) -> tuple[_Leased, int] | None:
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
        lapsed: list[tuple[int, _Leased]] = []
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

    def default_ko_delay(self, tries: int | None) -> float:
        """Keuss's retry polynomial, for a ko that gave no delay."""
        return self._settings.reject_delta_base + self._delta_factor * (tries or 0)

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        self._check_open()
        now = time.time()
        results: list[KoResult] = []
        moving: list[tuple[int, _Leased, int, int]] = []
        for nack in nacks:
            found = self._handed_out(nack.id, nack.tries)
            if found is None:
                results.append(KoResult.MISSING)
                continue
            bucket, slot = found
            tries = bucket.tries[slot] + (1 if nack.count_try else 0)
            if deadletter is not None and nack.count_try and tries > deadletter.max_ko:
                moving.append((len(results), bucket, slot, tries))
                results.append(KoResult.DEADLETTERED)
                continue
            del bucket.deadline[slot]
            bucket.states[slot] = AVAILABLE
            bucket.tries[slot] = tries
            mature = now + nack.delay
            bucket.mature[slot] = mature
            bucket.version += 1
            heapq.heappush(self._ready, (mature, bucket.seq, slot, bucket))
            results.append(KoResult.ROLLED_BACK)
        if moving and deadletter is not None:
            await self._deadletter(moving, deadletter, now)
        return results

    async def _deadletter(
        self, moving: list[tuple[int, _Leased, int, int]], plan: DeadletterPlan, now: float
    ) -> None:
        """Write the messages into the deadletter queue (durable), then mark them done here:
        a crash in between leaves a duplicate, never a loss."""
        payloads, headers = [], []
        for _, bucket, slot, tries in moving:
            stored = bucket.message(slot, tries, now)
            payloads.append(stored.payload)
            headers.append(append_headers(stored.headers, plan.headers(tries, now)))
        count = len(payloads)
        await self._storage.insert_buckets(
            plan.queue,
            [
                NewBucket(
                    new_bucket_id(),
                    now,
                    count,
                    encode_blob(payloads, headers),
                    encode_state(bytes(count), array(_U32, [0] * count), array("d", [now] * count)),
                )
            ],
        )
        touched = {}
        for _, bucket, slot, _ in moving:
            if bucket.states[slot] == HANDED_OUT:
                bucket.states[slot] = DONE
                bucket.deadline.pop(slot, None)
                bucket.remaining -= 1
                bucket.version += 1
                touched[bucket.id] = bucket
        await self._sync(list(touched.values()))

    async def remove(self, ids: Sequence[str]) -> list[bool]:
        self._check_open()
        now = time.time()
        parsed = [split_id(i) for i in ids]
        elsewhere = sorted(
            {p[0] for p in parsed if p is not None and p[0] not in self._held_buckets}
        )
        borrowed = await self._lease(0, elsewhere) if elsewhere else []
        for bucket in borrowed:  # leased only for this: released by the next flush if unused
            bucket.last_used = -math.inf
        results = []
        touched = {}
        for p in parsed:
            found = None if p is None else self._held_buckets.get(p[0])
            if p is None or found is None or p[1] >= found.count:
                results.append(False)
                continue
            bucket, slot = found, p[1]
            state = bucket.states[slot]
            if state == DONE or (state == HANDED_OUT and bucket.deadline.get(slot, now) > now):
                results.append(False)
                continue
            bucket.states[slot] = DONE
            bucket.deadline.pop(slot, None)
            bucket.remaining -= 1
            bucket.version += 1
            touched[bucket.id] = bucket
            results.append(True)
        if touched:
            await self._sync(list(touched.values()))
        return results

    # state persistence ---------------------------------------------------------------

    async def _sync(
        self,
        buckets: Iterable[_Leased],
        final: Mapping[str, str] | None = None,
        renew_before: float = -math.inf,
    ) -> None:
        """Make the current version of each bucket durable (and renew its lease).

        ``final`` maps bucket id -> RELEASE / DELETE for buckets leaving memory (the caller
        already stopped serving from them). A bucket whose lease ends before
        ``renew_before`` is written even if nothing changed (a renewal): else a holder
        that changed nothing for a grace period would lose its reservations to the next
        consumer. Writes of one bucket are serialized: a caller finding a write in flight
        waits for it, then writes only if its changes came later (or it still needs
        renewing).
        """
        final = final or {}
        targets = {b: b.version for b in buckets}
        while True:
            for bucket, version in list(targets.items()):
                if (
                    bucket.gone
                    or bucket.lost
                    or (
                        bucket.id not in final
                        and bucket.persisted >= version
                        and bucket.lease_until >= renew_before
                    )
                ):
                    del targets[bucket]
            if not targets:
                return
            busy = {b.writing for b in targets if b.writing is not None}
            if busy:
                for future in busy:
                    await future
                continue
            await self._write(list(targets), final)

    async def _write(self, buckets: list[_Leased], final: Mapping[str, str]) -> None:
        """One round trip writing several buckets; see :class:`StateWrite`."""
        future = Uncancellable()
        now = time.time()
        writes, versions = [], []
        for bucket in buckets:
            bucket.writing = future
            versions.append(bucket.version)
            mode = DELETE if bucket.remaining == 0 else final.get(bucket.id, KEEP)
            if mode == DELETE:
                writes.append(StateWrite(bucket.id, DELETE, now, 0, None))
            elif mode == RELEASE:
                score = bucket.next_available()
                writes.append(
                    StateWrite(
                        bucket.id,
                        RELEASE,
                        now if score is None else score,
                        bucket.remaining,
                        bucket.snapshot(),
                    )
                )
            else:
                dirty = bucket.version > bucket.persisted
                writes.append(
                    StateWrite(
                        bucket.id,
                        KEEP,
                        now + self._grace,
                        bucket.remaining,
                        bucket.snapshot() if dirty else None,
                    )
                )
        try:
            flags = await self._storage.write(self.name, self._token, writes)
        finally:
            for bucket in buckets:
                bucket.writing = None
            future.set_result(None)
        for bucket, write, version, kept in zip(buckets, writes, versions, flags, strict=True):
            if not kept:
                if not bucket.lost:
                    log.warning("queue %r: lease of bucket %s was lost", self.name, bucket.id)
                bucket.lost = True
                self._forget(bucket)
                continue
            bucket.persisted = max(bucket.persisted, version)
            if write.mode == KEEP:
                bucket.lease_until = write.score
            else:
                bucket.gone = True
                self._forget(bucket)

    def _forget(self, bucket: _Leased) -> None:
        bucket.live = False
        if self._held_buckets.get(bucket.id) is bucket:
            del self._held_buckets[bucket.id]

    def _start_flusher(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_state_loop())

    async def _flush_state_loop(self) -> None:
        while (self._held_buckets or self._departing) and not self._closed:
            await asyncio.sleep(self._period)
            try:
                await self._flush_state()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the next period tries again
                log.warning("queue %r: state flush failed: %s", self.name, exc)

    async def _flush_state(self, release_all: bool = False) -> None:
        """Persist changed state, renew leases, delete finished and release idle buckets.

        ``release_all`` (close): every bucket goes back, reservations without a try.
        """
        now = time.time()
        renew_before = now + self._grace / 2
        keep: list[_Leased] = []
        final: dict[str, str] = {}
        for bucket in list(self._held_buckets.values()):
            if bucket.writing is not None and not release_all:
                continue  # a write of it is in flight, and renews its lease
            if bucket.remaining == 0:
                final[bucket.id] = DELETE
            elif release_all:
                final[bucket.id] = RELEASE
            else:
                deliverable, reserved = bucket.is_idle(now)
                if not reserved and (not deliverable or now - bucket.last_used > IDLE_RELEASE):
                    final[bucket.id] = RELEASE
                elif bucket.version > bucket.persisted or bucket.lease_until < renew_before:
                    keep.append(bucket)
        leaving = [self._held_buckets[i] for i in final]
        for bucket in leaving:
            if release_all:  # close: reservations go back without a try
                for slot in bucket.deadline:
                    bucket.states[slot] = AVAILABLE
                bucket.deadline.clear()
                bucket.version += 1
            self._forget(bucket)  # no longer served from; the write below gives it back
        for bucket, mode in self._departing.values():
            leaving.append(bucket)
            final[bucket.id] = mode
        self._departing.clear()
        if keep or leaving:
            try:
                await self._sync([*keep, *leaving], final, renew_before)
            except BaseException:
                # Out of memory already: without another try its oks (and the release)
                # would be undone once its lease lapses.
                for bucket in leaving:
                    if not (bucket.gone or bucket.lost):
                        self._departing[bucket.id] = (bucket, final[bucket.id])
                raise

    # sizes ---------------------------------------------------------------------------

    async def sizes(self) -> Sizes:
        mine = dict(self._held_buckets)
        census = await self._storage.census(self.name, mine.keys(), time.time())
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
        for push in [*self._filling.values(), *self._sealed]:  # ack_on_buffer: not yet written
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

    async def close(self) -> None:
        """Refuse further calls (ClosedError), write what is buffered, then give every
        leased bucket back at once (reserved slots become available without a try), so
        nothing waits for the grace period.

        Ends while other tasks keep pushing or acknowledging: they are refused from the
        start, so there is a last bucket to write. A write that fails is tried again a few
        times (a short outage); then close raises, and what was not written is a crash's
        cost (see the module docstring)."""
        if self._closed:
            return
        self._closed = True
        self._make_room()  # pushers held by backpressure: refused
        failure: Exception | None = None
        try:
            try:
                await self.flush()
            except Exception as exc:  # give the leases back all the same
                failure = exc
            while self._writer_tasks:  # no new one starts: nothing is pushed any more
                await asyncio.gather(*self._writer_tasks, return_exceptions=True)
            attempt = 0
            while self._held_buckets or self._departing:
                try:
                    await self._flush_state(release_all=True)
                except Exception:
                    attempt += 1
                    if attempt >= ACK_ON_BUFFER_RETRIES:
                        raise
                    await asyncio.sleep(0.1 * 2**attempt)
        finally:
            if self._flusher is not None:
                await stop_task(self._flusher)
        if failure is not None:
            raise failure


def bucket_backend_options(base: Mapping[str, Any], *, without: str = "") -> dict[str, Any]:
    """A database backend's options plus the bucket options, less one that buckets fix."""
    return {**{k: v for k, v in base.items() if k != without}, **BUCKET_OPTIONS}


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
