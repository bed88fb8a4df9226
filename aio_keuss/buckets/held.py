"""A bucket this store leased: its messages and slot states in memory, served from here
until the state is written back and the lease released."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator

from ..contract import Stored
from .codec import (
    AVAILABLE,
    DEADLETTERING,
    DONE,
    HANDED_OUT,
    decode_blob,
    decode_state,
    decode_targets,
    encode_state,
    encode_targets,
)
from .storage import LeasedBucket


class HeldBucket:
    """A bucket this store holds: the messages plus the authoritative slot state.

    ``version`` counts changes; ``persisted`` is the version last written. ``writing`` is
    the write in flight, so writes of one bucket never overtake each other here; one
    given up on (its reply lost) may still be on its way, and ``writes`` numbers each
    write of this lease, so that storage refuses it once a later one landed.
    """

    __slots__ = (
        "blob",
        "copy_due",
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
        "owner",
        "payload_at",
        "persisted",
        "remaining",
        "seq",
        "serving",
        "states",
        "targets",
        "tries",
        "uncounted",
        "version",
        "writes",
        "writing",
    )

    def __init__(self, row: LeasedBucket, owner: str, seq: int, now: float) -> None:
        self.id = row.id
        self.owner = owner  # the token of the lease that took it: its writes' condition
        self.seq = seq
        self.blob = row.blob
        self.count, self.payload_at, self.headers_at = decode_blob(row.blob)
        self.states, self.tries, self.mature = decode_state(row.state, self.count)
        # slot -> the deadletter queue it is on its way to (state DEADLETTERING)
        self.targets = decode_targets(row.state, self.count)
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
        self.writes = 0  # the last write's number in this lease (``StateWrite.seq``)
        # Fetches in flight that served slots of it and may still make them available
        # again (see ``serving``): the state flusher leaves it in memory meanwhile.
        self.serving = 0
        self.live = True  # served from
        self.gone = False  # released or deleted in storage: no more writes
        self.lost = False  # someone else took the lease over
        self.last_used = now
        self.lease_until = 0.0
        # (version, deadletter queue, message id) of each deadletter move finished here and
        # not yet counted: counted once a write of that version lands (``_count_finished``).
        self.uncounted: list[tuple[int, str, str]] = []
        # When this store may next try to copy its slots on their way to the deadletter
        # queue (a previous holder's move whose copy failed here; see ``COPY_RETRY_FIRST``).
        self.copy_due = 0.0

    def __lt__(self, other: HeldBucket) -> bool:  # heap ties (never reached in practice)
        return self.seq < other.seq

    def follow(self, write: asyncio.Future[None]) -> None:
        """Writes of this bucket wait for ``write`` (of an earlier copy of it) to end."""
        self.writing = write

        def ended(_: asyncio.Future[None]) -> None:
            if self.writing is write:
                self.writing = None

        write.add_done_callback(ended)

    def slot_id(self, slot: int) -> str:
        """The id of the message in ``slot``."""
        return f"{self.id}-{slot}"

    def message(self, slot: int, tries: int, mature: float) -> Stored:
        p, h = self.payload_at, self.headers_at
        blob = self.blob
        return Stored(
            self.slot_id(slot),
            blob[p[slot] : p[slot + 1]],
            blob[h[slot] : h[slot + 1]],
            tries,
            mature,
        )

    def snapshot(self) -> bytes:
        return encode_state(self.states, self.tries, self.mature) + encode_targets(self.targets)

    def next_available(self, now: float) -> float | None:
        """Earliest mature time of an available slot (the score when released); with a slot
        on its way to the deadletter queue, whose move the next holder finishes, at the
        latest when its copy may be tried again (``copy_due``; ``now`` unless a copy failed
        here): else it waited for the bucket's next mature time, a ko's delay away perhaps."""
        matures = [m for m, s in zip(self.mature, self.states, strict=True) if s == AVAILABLE]
        if DEADLETTERING in self.states:
            matures.append(max(now, self.copy_due))
        return min(matures) if matures else None

    def is_idle(self, now: float) -> tuple[bool, bool]:
        """(has deliverable now, has an active reservation). A reservation past its deadline
        is deliverable again, not active: a holder that stopped consuming must not keep the
        bucket, and that message, from every other process. A slot on its way to the
        deadletter queue is neither: while its copy is written the bucket is kept (the
        state flusher leaves it alone), and a copy that failed is tried again by whoever
        holds the bucket next, here or elsewhere (``next_available``)."""
        deliverable = reserved = False
        for slot, state in enumerate(self.states):
            if state == AVAILABLE:
                if self.mature[slot] <= now:
                    deliverable = True
            elif state == HANDED_OUT:
                if self.deadline.get(slot, now) > now:
                    reserved = True
                else:
                    deliverable = True
        return deliverable, reserved

    def lapse(self, now: float) -> None:
        """Make the reservations past their deadline available again, with the try that
        delivery cost (as serving them again here would), before the bucket is released."""
        lapsed = [slot for slot, deadline in self.deadline.items() if deadline <= now]
        for slot in lapsed:
            del self.deadline[slot]
            self.states[slot] = AVAILABLE
            self.tries[slot] += 1
            self.mature[slot] = now
        if lapsed:
            self.version += 1


@contextlib.contextmanager
def serving(buckets: Iterable[HeldBucket]) -> Iterator[None]:
    """Keep ``buckets`` in memory while a fetch that served slots of them awaits (a lease
    for more, its state write): should that fail, the fetch makes those slots available
    again, so they must still be there. The state flusher would otherwise delete or release
    one meanwhile (its last deliverable slot served, it is idle) with those slots done, and
    they were lost, neither returned nor stored."""
    pinned = list(buckets)
    for bucket in pinned:
        bucket.serving += 1
    try:
        yield
    finally:
        for bucket in pinned:
            bucket.serving -= 1


HeapEntry = tuple[float, int, int, HeldBucket]
"""(mature, sequence, slot, bucket): the serving heaps' entries."""
"""(time, bucket seq, slot, bucket): a ready heap entry (mature) or a held one (deadline)."""
