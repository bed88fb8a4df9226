"""The store of the sharded model, over any :class:`~.storage.ShardStorage`.

Which shard: a message's shard is a function of its id (:func:`~.settings.shard_of`), so
``ok`` / ``ko`` and the dedup check of an explicit id need no lookup. A push without an id
goes round-robin over the shards (a chunk of a batch to each shard, so a ``push_many`` stays
in order within its chunk), or, with a header ``x-shard-key``, to the shard that key hashes
to: messages with one key keep their order. Explicit ids route by their id.

Consumers find work without scanning empty shards: the queue's ready index holds the shards
that have records to fire. A producer whose load finds a shard's magazine empty announces
the shard; a consumer serves the ready shards in a rotation of its own (starting at a random
one, read again every ``REFRESH`` seconds or when it runs out), so shards are served in turn
and a fire is one step; a consumer that empties a shard reports it. The index is apart from
the shards (another hash slot on a Redis Cluster), so it is kept by a second step after the
shard's; a race between a consumer emptying a shard and a producer loading it is settled by
the shard's version, which every load raises (:meth:`~.storage.ShardStorage.ready_drop`),
and a hint lost when a process dies between the two steps is restored by the sweeper, which
sees every shard.

Delays: a magazine is FIFO, so a delayed push or ko waits outside it, in the shard's
schedule, and is loaded by the first fire on its shard after it matured; the shard sits in
the ready index at that time. Not offered: ``remove``, atomic ``move``; order holds within a
shard only.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..coalesce import Finishing, RunToEnd, SideBySide, stop_task
from ..contract import (
    Ack,
    DeadletterPlan,
    Entry,
    Extend,
    Fetched,
    Nack,
    Store,
    Stored,
    deadletter_tag,
    moved_id,
)
from ..errors import TooManyConsumersError
from ..message import merge_headers
from ..types import KoResult, Sizes
from . import meta
from .settings import (
    FIRE_SHARE,
    PUSH_CHUNK,
    REFRESH,
    SWEEP_BATCH,
    ShardedOptions,
    key_shard,
    shard_of,
)
from .storage import Doomed, Loaded, ReadyMark, ShardSizes, ShardStorage

if TYPE_CHECKING:
    from ..options import QueueOptions

T = TypeVar("T")


StoreOf = Callable[[str, "QueueOptions"], Awaitable["ShardedStore"]]
"""How a store finds another queue's store of its backend (the deadletter queue)."""


async def _caught(call: Awaitable[T]) -> T | Exception:
    """``call``'s result, or the exception it raised."""
    try:
        return await call
    except Exception as exc:
        return exc


class ShardedStore(Store):
    """One queue over ``shards`` magazines of a :class:`ShardStorage`."""

    batch_concurrency: ClassVar[int] = 4

    def __init__(
        self,
        name: str,
        options: QueueOptions,
        storage: ShardStorage,
        sharded: ShardedOptions,
        adopted: meta.Adopted,
        store_of: StoreOf,
    ) -> None:
        super().__init__(name, options)
        self.run_in_caller = storage.run_in_caller
        # Every await of a fetch is then a reply that refuses cancellation, and the steps
        # on several shards run side by side in the caller's task (see ``_each``).
        self.uninterruptible = storage.uninterruptible
        self._storage = storage
        self._sharded = sharded
        self._store_of = store_of
        self.shards = adopted.shards
        self._ttl = adopted.message_ttl
        self.message_ttl = adopted.message_ttl or None
        self._max_consumers = adopted.max_consumers
        self._window = options.dedup_window
        self._turn = random.randrange(self.shards)
        self._rotation: list[int] = []
        self._refresh_at = 0.0
        # without queue_expiry too, now and then: a record lost with its node (a cluster
        # node restarted without its data) is written again, so the queue is listed and
        # swept again and the sweep announces the shards that still hold records
        self._touch_every = meta.touch_period(sharded) or sharded.lease_ttl
        self._touch_at = time.monotonic() + self._touch_every
        self._token = os.urandom(8).hex()
        self._enrol_at = 0.0
        self._enrolled = False
        self._fetched_at = 0.0
        self._renewal: asyncio.Task[None] | None = None
        self._deferring = Finishing()
        """Deadletters past their set-aside: copying there, then dropping here."""

    async def _each(self, calls: list[Coroutine[Any, Any, T]]) -> list[T]:
        """Run one step per shard side by side: a lone one is awaited directly (the common
        case, one message on one shard); several share the caller's task where the storage
        is uninterruptible (each sends its request before any reply is awaited, and a
        cancellation waits for every reply), else each gets a task of ``asyncio.gather``."""
        if len(calls) == 1:
            return [await calls[0]]
        if self.uninterruptible:
            return await SideBySide(calls)
        return list(await asyncio.gather(*calls))

    # producing ---------------------------------------------------------------------------

    def _route(self, entries: Sequence[Entry]) -> dict[int, list[Entry]]:
        """Group entries by shard, naming the ids the queue made after their shard."""
        by_shard: dict[int, list[Entry]] = {}
        chunk = 0
        for e in entries:
            if e.dedup or e.mature is not None:  # an explicit id, or a put-back: its id rules
                shard = shard_of(e.id, self.shards)
            else:
                keyed = key_shard(e.headers, self.shards)
                if keyed is None:
                    if chunk == 0:
                        self._turn = (self._turn + 1) % self.shards
                    chunk = (chunk + 1) % PUSH_CHUNK
                    shard = self._turn
                else:
                    shard = keyed
                e.id = f"{e.id}~{shard}"
            by_shard.setdefault(shard, []).append(e)
        return by_shard

    async def _touch(self) -> None:
        """Renew the queue's metadata record while in use (or write it again if lost)."""
        if time.monotonic() >= self._touch_at:
            self._touch_at = time.monotonic() + self._touch_every
            record = meta.record(self.shards, self.options, self._sharded)
            await self._storage.touch(self.name, record, meta.life(self._sharded))

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        """Push, or put back where they were the messages of a cancelled pop."""
        return await self._insert_guarded(entries, front=True)

    async def _insert_guarded(self, entries: Sequence[Entry], *, front: bool) -> list[bool]:
        if not self.uninterruptible:
            return await self._insert(entries, front)
        # A cancellation arriving while a load's reply is awaited (a reply that refuses it)
        # would otherwise be raised once the load is in, before the announcement: the
        # messages would sit in a shard the ready index and the sweeper's stamps know
        # nothing of until a repair pass. Held here until the announcement is made too.
        work = RunToEnd(self._insert(entries, front))
        flags = await work
        work.raise_held()
        return flags

    async def _insert(self, entries: Sequence[Entry], front: bool) -> list[bool]:
        # The loads are sent in this coroutine's first step, the metadata renewal after
        # them: push_many's chunks run side by side where round trips pipeline, and keep
        # their order (one key's messages theirs) only if each sends its load at once.
        by_shard = self._route(entries)
        shards = list(by_shard)
        load = self._storage.load
        calls = [
            load(self.name, s, by_shard[s], self._window, self._ttl, front=front) for s in shards
        ]
        if len(calls) == 1:
            loads: list[Loaded] = [await calls[0]]
            failure: Exception | None = None
        else:
            # A load failing on one shard (its node down) must not lose the announcements
            # of those that went in: their shards would stay out of the ready index, and
            # their stamps unmoved, until a repair pass; a retry would not announce them
            # either (it finds their magazines no longer empty).
            outcomes = await self._each([_caught(call) for call in calls])
            failure = next((o for o in outcomes if isinstance(o, Exception)), None)
            went_in = [
                (shard, outcome)
                for shard, outcome in zip(shards, outcomes, strict=True)
                if not isinstance(outcome, Exception)
            ]
            shards = [shard for shard, _ in went_in]
            loads = [loaded for _, loaded in went_in]
        marks: list[ReadyMark] = []
        for shard, loaded in zip(shards, loads, strict=True):
            if loaded.announce:  # the magazine was empty: this push announces the shard
                marks.append(ReadyMark(shard, loaded.version))
            elif loaded.scheduled is not None:  # the shard is due when the first matures
                marks.append(ReadyMark(shard, loaded.version, loaded.scheduled))
        if marks:
            await self._storage.ready_add(self.name, marks)
        if failure is not None:
            raise failure
        await self._touch()
        if len(loads) == 1:
            return loads[0].flags
        flags: dict[int, bool] = {}
        for shard, loaded in zip(shards, loads, strict=True):
            for e, flag in zip(by_shard[shard], loaded.flags, strict=True):
                flags[id(e)] = flag
        return [flags[id(e)] for e in entries]

    # consuming ---------------------------------------------------------------------------

    async def get(self, n: int) -> Fetched:
        return await self._fire(n, None)

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        """Fire and stamp each record with its deadline, now + ``reserve_delay`` (storage
        clock): the sweeper sidelines it once that passes without ok / ko."""
        return await self._fire(n, reserve_delay)

    async def _enrol(self) -> None:
        """Enrol (or renew) this consumer, within the queue's ``max_consumers``."""
        lease = self._sharded.lease_ttl
        if not await self._storage.enrol(self.name, self._token, lease, self._max_consumers):
            raise TooManyConsumersError(
                f"queue {self.name!r} already has {self._max_consumers} consumers"
            )
        self._enrolled = True
        self._enrol_at = time.monotonic() + lease / 3
        if self._renewal is None or self._renewal.done():
            self._renewal = asyncio.create_task(self._keep_place(), name="keuss-sharded-place")

    async def _keep_place(self) -> None:
        """Renew the place between fetches. A consumer waiting for messages fetches only
        every ``poll_interval`` (15 s by default, longer than ``lease_ttl``): without this,
        another process would take the place meanwhile and this consumer's next fetch would
        be refused. A queue object that has not fetched for ``poll_interval`` + ``lease_ttl``
        (a handler running longer than that, a paused queue, one no longer used) is taken
        for gone: its place lapses as a dead process's does, and its next fetch enrols
        again, or is refused if the place was taken."""
        lease = self._sharded.lease_ttl
        idle_after = self.options.poll_interval + lease
        while self._enrolled:
            now = time.monotonic()
            if now - self._fetched_at > idle_after:
                return  # the lease runs out; the next fetch enrols again
            if now < self._enrol_at:
                await asyncio.sleep(self._enrol_at - now)
                continue
            try:
                held = await self._storage.enrol(self.name, self._token, lease, self._max_consumers)
            except Exception:  # a server away: the next fetch raises it; try again soon
                self._enrol_at = time.monotonic() + lease / 6
                continue
            if not held:  # lapsed in an outage and taken: the next fetch enrols or is refused
                self._enrol_at = 0.0
                return
            self._enrol_at = time.monotonic() + lease / 3

    async def close(self) -> None:
        """Leave the queue's consumers, so the place is free at once. The deadletters begun
        here end first (see ``Finishing``: a storage that does not answer may leave a
        message in both queues, as a crash between their steps would)."""
        await self._deferring.wait(
            self.name,
            "deadletters given up between copy and drop: their messages come back here once"
            " set aside no more",
        )
        self._enrol_at = 0.0
        if self._renewal is not None:
            await stop_task(self._renewal)
            self._renewal = None
        if self._enrolled:
            self._enrolled = False
            await self._storage.leave(self.name, self._token)

    async def _candidates(self) -> tuple[list[int], float | None]:
        """The shards due now as the ready index has them, in a rotation of our own that
        starts at a random one, so consumers of several processes spread over the shards;
        and the index's earliest due time (None: empty)."""
        head = await self._storage.ready_head(self.name)
        ready = head.due
        if ready:
            start = random.randrange(len(ready))
            ready = ready[start:] + ready[:start]
        self._refresh_at = time.monotonic() + REFRESH
        return ready, head.earliest

    async def _fire(self, n: int, reserve_delay: float | None) -> Fetched:
        """Fire from the next ``n / FIRE_SHARE`` shards of the rotation (``n`` shared among
        them). The rotation is read from the ready index when it runs out or is ``REFRESH``
        old, so a fire is one step in the steady state; a shard found empty leaves both.
        The index may name shards with nothing to fire (a hint that came late: a sweep step
        read before a fire emptied the shard announces it after that fire's drop), so a
        fetch that found nothing goes on through the shards of its fresh read it has not
        fired from yet, each such hint costing one step once: stopping at the first empty
        slice answered nothing while another shard held a ready message, and a
        ``pop(timeout=0)`` took the queue for empty."""
        await self._touch()
        self._fetched_at = time.monotonic()
        if self._fetched_at >= self._enrol_at:
            await self._enrol()
        fire = self._storage.fire
        messages: list[Stored] = []
        left = False
        fresh = False
        untried: set[int] = set()  # shards of the fresh read not fired from yet
        head: float | None = None
        for _ in range(3 + self.shards):
            if not self._rotation or time.monotonic() >= self._refresh_at:
                if fresh and not untried:
                    break  # the fresh read was walked whole
                self._rotation, head = await self._candidates()
                fresh = True
                untried = set(self._rotation)
            rotation = self._rotation
            if not rotation:
                break
            chosen = rotation[: -(-n // FIRE_SHARE)]
            self._rotation = rotation[len(chosen) :] + chosen
            untried.difference_update(chosen)
            share, extra = divmod(n, len(chosen))
            fired = await self._each(
                [
                    fire(self.name, s, share + (1 if k < extra else 0), reserve_delay)
                    for k, s in enumerate(chosen)
                ]
            )
            emptied: list[ReadyMark] = []
            for shard, got in zip(chosen, fired, strict=True):
                messages += got.messages
                if got.left > 0:
                    left = True
                else:
                    emptied.append(ReadyMark(shard, got.version, got.next_scheduled))
            if emptied:
                gone = {mark.shard for mark in emptied}
                self._rotation = [s for s in self._rotation if s not in gone]
                await self._storage.ready_drop(self.name, emptied)
            if messages or (fresh and not untried):
                break
        if left or self._rotation:
            return Fetched(messages, time.time())
        return Fetched(messages, head)

    # acknowledging -----------------------------------------------------------------------

    def _by_shard(self, ids: list[str]) -> dict[int, list[int]]:
        """Indexes of the given messages grouped by shard."""
        by_shard: dict[int, list[int]] = {}
        for k, message_id in enumerate(ids):
            by_shard.setdefault(shard_of(message_id, self.shards), []).append(k)
        return by_shard

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        return await self._flags_by_shard(acks, [a.id for a in acks], self._storage.commit)

    tells_queued = True

    async def queued(self, ids: Sequence[str]) -> list[bool]:
        """A message's shard is a function of its id: one step on each shard asked (one,
        for the one id a duplicate ``push_and_wait`` asks about), reading its id index."""
        return await self._flags_by_shard(list(ids), list(ids), self._storage.queued)

    async def extend(self, extends: Sequence[Extend]) -> list[bool]:
        """One step per shard, side by side, as :meth:`commit`: each moves the deadline the
        sweeper goes by, so a reservation extended past its first deadline is not sidelined
        (see :meth:`ShardStorage.extend`)."""
        return await self._flags_by_shard(extends, [e.id for e in extends], self._storage.extend)

    async def _flags_by_shard(
        self,
        items: Sequence[T],
        ids: list[str],
        step: Callable[[str, int, list[T]], Awaitable[list[bool]]],
    ) -> list[bool]:
        """``step`` (a storage call) once per shard over its share of ``items`` (whose
        ``ids`` say where each is), the shards side by side; one flag per item, in order."""
        out = [False] * len(items)

        async def one(shard: int, members: list[int]) -> None:
            flags = await step(self.name, shard, [items[k] for k in members])
            for k, flag in zip(members, flags, strict=True):
                out[k] = flag

        await self._each([one(s, m) for s, m in self._by_shard(ids).items()])
        return out

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        """Reload each at the load pointer of its shard (a release at no try: back to its
        place, see :meth:`ShardStorage.rollback`), or schedule it after its delay, or past
        ``max_ko`` copy it into the deadletter queue, then drop it here."""
        out = [KoResult.MISSING] * len(nacks)
        doomed: list[Doomed] = []
        marks: list[ReadyMark] = []
        max_ko = None if deadletter is None else deadletter.max_ko

        async def one(shard: int, members: list[int]) -> None:
            done = await self._storage.rollback(
                self.name, shard, [nacks[k] for k in members], max_ko
            )
            for k, result in zip(members, done.results, strict=True):
                out[k] = result
            doomed.extend(done.doomed)
            if done.reloaded:
                marks.append(ReadyMark(shard, done.version))
            elif done.scheduled is not None:
                marks.append(ReadyMark(shard, done.version, done.scheduled))

        by_shard = self._by_shard([nack.id for nack in nacks])
        await self._each([one(s, m) for s, m in by_shard.items()])
        if marks:
            await self._storage.ready_add(self.name, marks)
        if doomed and deadletter is not None:
            # cut between the copy and the drop (a close past its grace gives the ko up),
            # the message would be in both queues, back here once set aside no more
            await self._deferring.run(self._deadletter(doomed, deadletter))
        return out

    async def _deadletter(self, doomed: list[Doomed], plan: DeadletterPlan) -> None:
        """Copy into the deadletter queue, then drop here what the rollback set aside (see
        :class:`Doomed`): a crash between the two steps leaves a duplicate (it comes back
        after the hold), never a loss. An id already there is renamed by the rule every
        backend follows. The x-dl-* headers are merged into the stored ones, each key once:
        appended, a message deadlettered again and again carried one more set each time."""
        target = await self._store_of(plan.queue, self.options)
        now = time.time()
        pending = [
            (d.id, merge_headers(d.headers, plan.headers(d.tries, now)), d.payload, d.tries)
            for d in doomed
        ]
        clash = 0
        while pending:
            entries = [
                Entry(
                    moved_id(mid, deadletter_tag(tries), clash),
                    payload,
                    headers,
                    dedup=False,
                    mature=now,
                )
                for mid, headers, payload, tries in pending
            ]
            flags = await target._insert_guarded(entries, front=False)  # arrivals: at the back
            pending = [p for p, ok in zip(pending, flags, strict=True) if not ok]
            clash += 1
        drop = self._storage.drop_doomed
        by_shard = self._by_shard([d.id for d in doomed])
        await self._each(
            [drop(self.name, s, [doomed[k] for k in members]) for s, members in by_shard.items()]
        )

    # observing ---------------------------------------------------------------------------

    async def shard_sizes(self) -> list[ShardSizes]:
        """Every shard's counts and pointers, one step per shard (an observation, not the
        hot path)."""
        sizes = self._storage.sizes
        return await self._each([sizes(self.name, s) for s in range(self.shards)])

    async def sizes(self) -> Sizes:
        """size: ready records; reserved: fired and not acknowledged (until the sweeper
        sidelines those past their deadline); scheduled: delayed, and sidelined (waiting
        for the shovel)."""
        size = reserved = scheduled = 0
        for shard in await self.shard_sizes():
            size += shard.ready
            reserved += shard.fired
            scheduled += shard.sidelined + shard.scheduled
        return Sizes(size, size + reserved + scheduled, scheduled, reserved)

    async def next_mature(self) -> float | None:
        """Now if a record is ready or sidelined; else the earliest scheduled mature time or
        reservation end. A shard reads its reservations' ends (see
        :meth:`ShardStorage.next_deadline`), extended ones included; where it could not
        read them all, the latest end a reservation not extended can have (now +
        ``reserve_delay``) stands for the rest: early if they were extended (a caller looks
        again), never a reason to miss a message."""
        now = time.time()
        times: list[float] = []
        held: list[int] = []
        for shard, sizes in enumerate(await self.shard_sizes()):
            if sizes.ready or sizes.sidelined:
                return now
            if sizes.next_scheduled is not None:
                times.append(sizes.next_scheduled)
            if sizes.fired:
                held.append(shard)
        read = self._storage.next_deadline
        for found in await self._each([read(self.name, s, SWEEP_BATCH) for s in held]):
            if found.earliest is not None:
                times.append(found.earliest)
            if not found.whole:
                times.append(now + self.options.reserve_delay)
        return min(times) if times else None
