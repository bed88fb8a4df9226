"""The storage contract: the only part of the bucket engine a database author writes.

A database stores whole buckets and offers five atomic operations over them: prepare (create
what it needs), insert new buckets, lease free ones (taking over a dead holder's), write the
state of leased ones (guarded by the lease token) and count them. Everything else, pushing,
serving from leased buckets and writing their state back, is the engine's, written once.

The owner a lease writes is a token of that lease alone (the store's token and a lease
number), not of the store: a write is applied only while the bucket's owner is still the
token of the lease it was made under. A write whose reply never came may still reach the
server after its store gave the bucket back and leased it again; under one token per store
it then landed on the new lease (a release freed the bucket under it, its reservations
served elsewhere too); under one per lease it is refused, as a fencing token refuses a
stale lock holder (M. Kleppmann, "How to do distributed locking", 2016,
https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html). The stored
owner is the same string field as before, so existing data needs no migration: a bucket
stored by an earlier release holds ``""`` (free) or that release's store token, which no
write of this one carries (a write's owner is never ``""``), so nothing stale matches it,
and such a bucket is leased (taken over once its lease lapses) as any other.

The token fences other leases, not the same lease's own older writes: a write whose reply
never came (a dropped connection, a client timeout) may still reach the server after a
newer write of that lease landed, and, carrying the same token, rolled the bucket's state
back (an ok-ed message live again, a ko's delay gone). So every write of a lease also
carries a sequence number, counted per bucket from 1 in each lease, and is applied only
when it is past the one stored, in the same atomic step as the owner check; a lease sets
the stored one back to 0. A bucket stored by an earlier release has none: read as 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum


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
    """Write back a leased bucket, only if its stored owner is still ``owner``: the token
    of the lease it was taken under (never ``""``), and its stored sequence number (0 when
    leased, or when none is stored) is below ``seq``, this write's number in that lease.

    ``mode``: KEEP (stay leased, score = lease deadline), RELEASE (owner = "", score = when
    it is next worth leasing) or DELETE (nothing left). ``state`` None keeps the stored state
    (a lease renewal only).
    """

    id: str
    mode: str
    score: float
    remaining: int
    state: bytes | None
    owner: str
    seq: int


class Outcome(Enum):
    """What became of one :class:`StateWrite`."""

    WRITTEN = "written"
    """Applied; or this very write was already (its number is the one stored: a retry)."""
    SUPERSEDED = "superseded"
    """Refused: a later write of the same lease is stored, with everything this one had
    (a lease's writes of a bucket are serialized, each snapshot after the one before).
    The lease is still the writer's."""
    LOST = "lost"
    """Refused: that lease is over (taken over, given back, or the bucket is gone)."""


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

    max_bucket_bytes: int = 128 * 2**20
    """Most bytes of messages (payloads, headers and their slot state) one bucket may hold:
    a push bucket is sealed before it grows past it, and a message that cannot fit in a
    bucket of its own is refused. Each database bounds one stored value (Redis's
    ``proto-max-bulk-len``, 512 MB; PostgreSQL's 1 GB protocol message; MongoDB's 16 MB
    document)."""

    async def prepare(self) -> None:
        """Called before each queue's store is made (e.g. to create indexes on first use)."""

    @abstractmethod
    async def insert_buckets(self, queue: str, buckets: Sequence[NewBucket]) -> None:
        """Insert free buckets (owner ``""``), durably, all or none. One whose id is stored
        already is left as it is: a deadletter copy, named after its slot, may be written
        by two holders of that slot's bucket (see the bucket store's docstring)."""

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
        exclude: Collection[str] = (),
    ) -> Lease:
        """Atomically take buckets: set owner = token (this lease's), score = deadline,
        and the stored write sequence number back to 0 (``StateWrite.seq``).

        Without ``ids``: buckets with ``score <= now`` in (score, id) order, stopping once
        their ``remaining`` adds up to ``want`` or ``max_buckets`` were taken. With ``ids``:
        those of them that are free (whatever their score) or whose lease expired.

        ``exclude`` (without ``ids``): buckets never taken, nor counted in ``next_score``:
        those the asking store still has in memory (see ``BucketStore._lease``), whose
        stored state is older than its own and whose next time it knows itself.
        """

    @abstractmethod
    async def write(self, queue: str, writes: Sequence[StateWrite]) -> list[Outcome]:
        """Apply each write whose bucket is still owned by its ``owner`` and whose ``seq``
        is past the stored one (the check and the write one atomic step per bucket); one
        outcome per write."""

    @abstractmethod
    async def census(self, queue: str, exclude: Collection[str], now: float) -> Census:
        """Sizes and earliest score of the buckets not in ``exclude`` (the asker's own)."""
