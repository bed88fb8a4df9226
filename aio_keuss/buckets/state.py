"""The state writer: what this store changed in its leased buckets goes back to storage.

Every ``min(state_flush_period, reject_timeout_grace / 3)`` it writes the state of every
leased bucket that changed and renews every lease that needs it; deletes buckets with nothing
left; releases buckets with nothing deliverable and nothing reserved (or unused for
``IDLE_RELEASE`` seconds). Writes are conditional on the token of the lease the bucket was
taken under, so a holder whose lease was taken over never overwrites the new holder's
state, nor does a write of an earlier lease of this store that reaches the server late;
and each carries its number in the lease, so neither does an older write of the same
lease landing after a newer one (its reply was lost, and the flush after wrote again). A
final write (delete, release) that failed is tried again by the next flush.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping

from ..coalesce import Uncancellable
from ..contract import FinishedDeadletters
from .codec import AVAILABLE
from .held import HeldBucket
from .settings import (
    IDLE_RELEASE,
)
from .storage import DELETE, KEEP, RELEASE, BucketStorage, Outcome, StateWrite

log = logging.getLogger("aio_keuss.buckets")


class StateWriter:
    """The bucket store's state-writing half, mixed into it: the attributes below are the
    store's."""

    name: str
    _storage: BucketStorage
    _grace: float
    _period: float
    _closed: bool
    _held_buckets: dict[str, HeldBucket]
    _departing: dict[str, tuple[HeldBucket, str]]
    _leaving: dict[str, HeldBucket]
    _flusher: asyncio.Task[None] | None
    _visible: Callable[[float], None] | None
    _finished: FinishedDeadletters | None
    _copying: set[tuple[str, int]]
    _kept_reserved: dict[str, set[int]]

    async def _sync(
        self,
        buckets: Iterable[HeldBucket],
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

    async def _write(self, buckets: list[HeldBucket], final: Mapping[str, str]) -> None:
        """One round trip writing several buckets; see :class:`StateWrite`."""
        future = Uncancellable()
        now = time.time()
        writes, versions = [], []
        for bucket in buckets:
            bucket.writing = future
            bucket.writes += 1
            seq = bucket.writes
            versions.append(bucket.version)
            mode = DELETE if bucket.remaining == 0 else final.get(bucket.id, KEEP)
            if mode == DELETE:
                writes.append(StateWrite(bucket.id, DELETE, now, 0, None, bucket.owner, seq))
            elif mode == RELEASE:
                score = bucket.next_available(now)
                writes.append(
                    StateWrite(
                        bucket.id,
                        RELEASE,
                        now if score is None else score,
                        bucket.remaining,
                        bucket.snapshot(),
                        bucket.owner,
                        seq,
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
                        bucket.owner,
                        seq,
                    )
                )
        try:
            outcomes = await self._storage.write(self.name, writes)
        finally:
            for bucket in buckets:
                bucket.writing = None
            future.set_result(None)
        released: list[float] = []
        for bucket, write, version, outcome in zip(
            buckets, writes, versions, outcomes, strict=True
        ):
            if outcome is Outcome.SUPERSEDED:
                # A later write of this lease is stored: the lease is still ours. Nothing
                # is known of what that write carried here (its reply is another's), so
                # the bucket stays as it was; a caller still needing it written (``_sync``)
                # writes again, under a number past every one sent.
                continue
            if outcome is Outcome.WRITTEN and write.mode == RELEASE and write.remaining:
                released.append(write.score)
            if outcome is Outcome.LOST:
                if not bucket.lost:
                    log.warning("queue %r: lease of bucket %s was lost", self.name, bucket.id)
                bucket.lost = True
                self._forget(bucket)
                continue
            bucket.persisted = max(bucket.persisted, version)
            if bucket.uncounted:
                self._count_finished(bucket)
            if write.mode == KEEP:
                bucket.lease_until = write.score
            else:
                bucket.gone = True
                self._forget(bucket)
        if released and self._visible is not None:
            # Messages only this store could serve are free for every consumer now: tell
            # the ones waiting elsewhere (they leased nothing while it held them, and would
            # otherwise sleep until their poll interval).
            self._visible(min(released))

    def _count_finished(self, bucket: HeldBucket) -> None:
        """Count the deadletter moves whose done mark is now stored (``on_finished_deadletter``:
        the queue counts them and wakes the deadletter queue's consumers). One count per
        move, by whoever's mark is stored: a mark is stored once, under the lease of the
        holder that finished the move, and every other holder's is refused (a ko's result
        counts the ko's own moves, see the store's ``_deadletter``)."""
        persisted = bucket.persisted
        stored = [(queue, i) for version, queue, i in bucket.uncounted if version <= persisted]
        if not stored:
            return
        bucket.uncounted = [e for e in bucket.uncounted if e[0] > persisted]
        if self._finished is not None:
            by_queue: dict[str, list[str]] = {}
            for queue, message_id in stored:
                by_queue.setdefault(queue, []).append(message_id)
            for queue, ids in by_queue.items():
                self._finished(queue, len(ids), ids)

    async def _finish_deadletters(self, buckets: Iterable[HeldBucket]) -> None:
        """The store's: copies of slots a previous holder left on their way to the
        deadletter queue, written and marked done."""

    async def _try_finishing_deadletters(self, buckets: Iterable[HeldBucket]) -> None:
        """:meth:`_finish_deadletters`, a failure logged: the next state flush tries again,
        and a bucket released meanwhile leaves it to its next holder."""
        try:
            await self._finish_deadletters(buckets)
        except Exception as exc:
            log.warning("queue %r: deadletter copy failed: %s", self.name, exc)

    def _forget(self, bucket: HeldBucket) -> None:
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
        await self._try_finishing_deadletters(list(self._held_buckets.values()))
        now = time.time()
        renew_before = now + self._grace / 2
        keep: list[HeldBucket] = []
        final: dict[str, str] = {}
        copying = {bucket_id for bucket_id, _ in self._copying}
        for bucket in list(self._held_buckets.values()):
            if (bucket.writing is not None or bucket.serving) and not release_all:
                # a write of it is in flight, and renews its lease; or a fetch served slots
                # of it, which it makes available again should it fail
                continue
            if bucket.remaining == 0:
                final[bucket.id] = DELETE
            elif release_all:
                final[bucket.id] = RELEASE
            else:
                deliverable, reserved = bucket.is_idle(now)
                # a deadletter copy of one of its slots on its way: kept (and renewed) until
                # it is written and the slot marked done
                reserved = reserved or bucket.id in copying
                if not reserved and (not deliverable or now - bucket.last_used > IDLE_RELEASE):
                    final[bucket.id] = RELEASE
                elif bucket.version > bucket.persisted or bucket.lease_until < renew_before:
                    keep.append(bucket)
        leaving = [self._held_buckets[i] for i in final]
        for bucket in leaving:
            if release_all:  # close: reservations go back without a try
                kept = self._kept_reserved.get(bucket.id, ())
                for slot, deadline in bucket.deadline.items():
                    bucket.states[slot] = AVAILABLE
                    if slot in kept:  # its handler runs on: back once it would have lapsed
                        bucket.tries[slot] += 1
                        bucket.mature[slot] = max(bucket.mature[slot], deadline)
                bucket.deadline.clear()
                bucket.version += 1
                # this store's pace of deadletter copies is no other's: worth leasing at once
                bucket.copy_due = 0.0
            else:  # idle, with no active reservation: lapsed ones go back with their try
                bucket.lapse(now)
            self._forget(bucket)  # no longer served from; the write below gives it back
        for bucket, mode in self._departing.values():
            leaving.append(bucket)
            final[bucket.id] = mode
        self._departing.clear()
        if keep or leaving:
            # Until their final write lands, storage still holds their old state: sizes
            # count them from here meanwhile (see ``in_memory``).
            self._leaving.update((bucket.id, bucket) for bucket in leaving)
            try:
                await self._sync([*keep, *leaving], final, renew_before)
            except BaseException:
                # Out of memory already: without another try its oks (and the release)
                # would be undone once its lease lapses.
                for bucket in leaving:
                    if not (bucket.gone or bucket.lost):
                        self._departing[bucket.id] = (bucket, final[bucket.id])
                raise
            finally:
                for bucket in leaving:
                    if self._leaving.get(bucket.id) is bucket:
                        del self._leaving[bucket.id]

    def in_memory(self) -> dict[str, HeldBucket]:
        """The buckets whose true state is this store's, by id: those it serves from, and
        those leaving it whose final write (delete, release) is in flight or failed, which
        storage would show as they were before. Sizes count these from memory and the
        rest from storage."""
        found = {bucket.id: bucket for bucket, _ in self._departing.values()}
        found.update(self._leaving)
        found.update(self._held_buckets)
        return found

    # sizes ---------------------------------------------------------------------------
