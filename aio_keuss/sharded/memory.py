"""``memory-sharded``: the sharded model's storage contract in this process's memory.

A second implementation of :class:`~.storage.ShardStorage` beside Redis's, step for step the
same model (pointers, records, sideline, schedule, ready index with versions, consumers,
metadata record, lease), so the conformance suite and the contract tests run on both. Each
operation runs to its end without awaiting anything but one loop pass taken first (see
:func:`_pass`), so each is atomic; the clock is ``time.time()``. Nothing is shared with other
processes or other factories.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ..coalesce import Uncancellable
from ..contract import (
    Ack,
    Entry,
    Extend,
    LocalRates,
    LoopTurns,
    Nack,
    RateGrant,
    RateRule,
    Stored,
)
from ..results import MemoryResults, ResultStore
from ..stats import MemoryStats, StatsStore
from ..types import Capabilities, KoResult
from . import meta
from .backend import ShardedBackend
from .settings import CAPABILITIES, ShardedOptions
from .storage import (
    DEADLETTER_HOLD,
    Deadlines,
    Doomed,
    Fired,
    Loaded,
    MetaRecord,
    ReadyHead,
    ReadyMark,
    RolledBack,
    ShardSizes,
    ShardStorage,
    ShovelStep,
    SweepStep,
)

PROMOTE = 1000
"""Matured scheduled records a fire loads at most (as the Redis scripts)."""
PURGE = 1000
"""Expired records at the magazine's head ``sizes`` deletes at most."""


async def _pass() -> None:
    """One pass of the event loop, taken before an operation's work (a load's after it, so
    that side-by-side loads keep their callers' order): a caller in a loop
    (``while True: await q.pop()``) then lets other tasks run. It refuses cancellation like a
    server's reply, so under ``RunToEnd`` a fetch over several shards cancelled midway still
    completes (and the queue puts back what it took), while a caller not under it is
    cancelled here, before any work."""
    turn = Uncancellable()
    asyncio.get_running_loop().call_soon(turn.set_result, None)
    await turn


@dataclass(slots=True)
class _Record:
    id: str
    payload: bytes
    headers: bytes
    tries: int
    mature: float
    end: float | None
    """End of life (message TTL; None: none)."""
    deadline: float | None = None
    """Reservation deadline, once fired by a reserve."""
    place: int = -1
    """Its place in the shard's order (Redis's o field, else its pointer): the pointer it
    was loaded at, kept by a put-back before the fire pointer."""

    def dead(self, now: float) -> bool:
        return self.end is not None and self.end <= now


class _Shard:
    """A shard: pointers and counters, the magazine, sideline and schedule, the id index."""

    def __init__(self) -> None:
        self.load = self.fire = self.sweep = 0
        self.side_load = self.side_fire = 0
        self.seq = 0
        self.back = 0  # records put back before the fire pointer, ever (Redis's b)
        self.fired = self.swept = self.shoveled = self.expired = 0
        self.magazine: dict[int, _Record] = {}
        self.sideline: dict[int, _Record] = {}
        self.waiting: dict[int, _Record] = {}  # by schedule sequence
        self.schedule: list[tuple[float, int]] = []  # heap of (mature, sequence)
        self.where: dict[str, int | str] = {}  # id -> pointer, "s<pointer>" or "z<seq>"
        self.windows: dict[str, float] = {}  # explicit id -> end of its dedup window
        self.window_ends: list[tuple[float, str]] = []  # heap, to purge ended windows
        self.stepped: list[tuple[float, int]] = []
        """Heap of (deadline, pointer): reservations the sweep stepped over (Redis's k)."""

    @property
    def version(self) -> int:
        return self.load + self.seq + self.back

    def next_scheduled(self) -> float | None:
        return self.schedule[0][0] if self.schedule else None

    def forget(self, record: _Record) -> None:
        self.where.pop(record.id, None)

    def put(self, record: _Record) -> None:
        """Load at the load pointer."""
        self.magazine[self.load] = record
        self.where[record.id] = self.load
        record.place = self.load
        self.load += 1

    def put_back(self, records: list[tuple[int | None, _Record]]) -> list[_Record]:
        """Load put-backs (each with its place, None: unknown) where they were fired from:
        in the free slots just before the fire pointer, which moves back over them (the
        sweep pointer too, if past it), in the order of their places among themselves and
        the put-backs already there, so those of one key given back one by one keep their
        order. A cancelled pop's put-back (a load with ``front``) and a reservation released
        at no try (a rollback) both come here. Those there is no room for (a reservation
        still held right behind) are returned, the latest places first to go."""
        room = 0
        while room < len(records) and self.fire - room - 1 >= 0:
            if self.fire - room - 1 in self.magazine:
                break
            room += 1
        if not room:
            return [record for _, record in records]
        ordered = sorted(records, key=lambda pr: -1 if pr[0] is None else pr[0])
        chosen = ordered[:room]
        for place, record in chosen:
            record.place = -1 if place is None else place
        # the records ahead with an earlier place (put back before) move down with them
        top = chosen[-1][1].place
        at, ahead = self.fire, []
        while at < self.load:
            found = self.magazine.get(at)
            if found is None or found.place >= top:
                break
            ahead.append(found)
            at += 1
        merged = sorted([*ahead, *(r for _, r in chosen)], key=lambda r: r.place)
        self.fire -= room
        self.sweep = min(self.sweep, self.fire)
        self.back += room
        for slot, record in enumerate(merged, self.fire):
            self.magazine[slot] = record
            self.where[record.id] = slot
        return [record for _, record in ordered[room:]]

    def schedule_at(self, record: _Record, due: float) -> None:
        record.mature = due
        seq = self.seq
        self.seq += 1
        self.waiting[seq] = record
        heapq.heappush(self.schedule, (due, seq))
        self.where[record.id] = f"z{seq}"

    def promote(self, now: float) -> None:
        """Load the matured scheduled records (up to PROMOTE); one past its end of life is
        deleted instead (counted expired), as Redis's promote does: loaded, it counted as
        ready until the fire pointer reached it."""
        for _ in range(PROMOTE):
            if not self.schedule or self.schedule[0][0] > now:
                return
            _, seq = heapq.heappop(self.schedule)
            record = self.waiting.pop(seq, None)
            if record is None:
                continue
            if record.dead(now):
                self.forget(record)
                self.expired += 1
            else:
                self.put(record)

    def duplicate(self, entry: Entry, now: float) -> bool:
        """Whether ``entry`` is refused: its id has a record that is :meth:`live`, or (an
        explicit id) was pushed within its dedup window. A record of the id no one holds
        past its end of life refuses nothing by itself: an accepted entry replaces it (see
        :meth:`bury`), as it would find nothing once a step had deleted it."""
        if self.live(entry.id, now):
            return True
        if not entry.dedup:
            return False
        ends = self.window_ends
        while ends and ends[0][0] <= now:
            end, mid = heapq.heappop(ends)
            if self.windows.get(mid) == end:
                del self.windows[mid]
        return entry.id in self.windows

    def live(self, message_id: str, now: float) -> bool:
        """Whether ``message_id`` has a record a result may still come for: not one no one
        holds past its end of life, which is never delivered (deleted where it is met, or
        replaced by a push of its id)."""
        at = self.where.get(message_id)
        if at is None:
            return False
        if isinstance(at, int):
            record = self.magazine.get(at)
            if record is not None and record.deadline is not None:
                return True  # held: its holder may still ok it
        else:
            record = self.aside(at)
        return record is None or not record.dead(now)

    def aside(self, at: str) -> _Record | None:
        """The record an index entry names outside the magazine: ``s<pointer>`` in the
        sideline, ``z<seq>`` in the schedule."""
        if at[0] == "s":
            return self.sideline.get(int(at[1:]))
        return self.waiting.get(int(at[1:]))

    def bury(self, message_id: str, now: float) -> None:
        """Delete the record of ``message_id`` past its end of life that no one holds (one
        :meth:`live` says is not), if any, counted expired: the step of the push that takes
        its id, so nothing of it is left to fire, shovel, promote or count, nor to forget
        the new record's index entry when met. In the magazine its slot is left empty, as
        an acknowledged one is (the walks pass over it; ``sizes`` counts it as ready, as
        it counted the dead record, until the fire pointer passes it)."""
        at = self.where.get(message_id)
        if at is None:
            return
        if isinstance(at, int):
            record = self.magazine.pop(at, None)
        elif at[0] == "s":
            record = self.sideline.pop(int(at[1:]), None)
        else:
            seq = int(at[1:])
            record = self.waiting.pop(seq, None)
            self.schedule = [item for item in self.schedule if item[1] != seq]
            heapq.heapify(self.schedule)
        del self.where[message_id]
        if record is not None and record.dead(now):
            self.expired += 1

    def held(self, message_id: str, tries: int | None) -> tuple[int, _Record] | None:
        at = self.where.get(message_id)
        if not isinstance(at, int):
            return None
        record = self.magazine.get(at)
        if record is None or record.deadline is None:
            return None
        if tries is not None and tries != record.tries:
            return None
        return at, record

    def lapse(self, at: int, record: _Record, now: float) -> int:
        """A reservation past its deadline leaves the magazine: to the sideline, or deleted
        if past its end of life; 1 if it went to the sideline."""
        del self.magazine[at]
        self.fired -= 1
        if record.dead(now):
            self.forget(record)
            self.expired += 1
            return 0
        self.sideline[self.side_load] = record
        self.where[record.id] = f"s{self.side_load}"
        self.side_load += 1
        self.swept += 1
        return 1

    def purge(self, now: float, most: int) -> None:
        """Delete the magazine's expired head (up to ``most`` records looked at)."""
        stop = min(self.load, self.fire + most)
        while self.fire < stop:
            record = self.magazine.get(self.fire)
            if record is not None:
                if not record.dead(now):
                    return
                del self.magazine[self.fire]
                self.forget(record)
                self.expired += 1
            self.fire += 1


class _Queue:
    def __init__(self) -> None:
        self.shards: dict[int, _Shard] = {}
        self.ready: dict[int, float] = {}
        self.stamps: dict[int, int] = {}
        self.consumers: dict[str, float] = {}
        self.meta: dict[str, str] | None = None
        self.meta_end: float | None = None
        self.count: int | None = None
        """The shard count, kept past the record (as Redis's ``shards`` key)."""

    def shard(self, shard: int) -> _Shard:
        found = self.shards.get(shard)
        if found is None:
            found = self.shards[shard] = _Shard()
        return found

    def live_meta(self, now: float) -> dict[str, str] | None:
        if self.meta_end is not None and self.meta_end <= now:
            self.meta = self.meta_end = None
        return self.meta


class MemoryShardStorage(ShardStorage):
    """The model in memory (see the module docstring)."""

    uninterruptible = True
    run_in_caller = True

    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}
        self._listed: dict[str, int] = {}
        self._holder: str | None = None
        self._lease_end = 0.0
        self._turns = LoopTurns()

    def _queue(self, queue: str) -> _Queue:
        found = self._queues.get(queue)
        if found is None:
            found = self._queues[queue] = _Queue()
        return found

    def _shard(self, queue: str, shard: int) -> _Shard:
        return self._queue(queue).shard(shard)

    # per shard ---------------------------------------------------------------------------

    async def load(
        self,
        queue: str,
        shard: int,
        entries: Sequence[Entry],
        dedup_window: float,
        message_ttl: float | None,
        *,
        front: bool = False,
    ) -> Loaded:
        # The turn given to the loop comes after the work: push_many's chunks run side by
        # side and keep their order only if each loads in its first step (see the store).
        loaded = self._load(queue, shard, entries, dedup_window, message_ttl, front)
        if self._turns.due(len(entries)):
            await _pass()
        return loaded

    async def queued(self, queue: str, shard: int, ids: Sequence[str]) -> list[bool]:
        s = self._shard(queue, shard)
        now = time.time()
        return [s.live(message_id, now) for message_id in ids]

    def _load(
        self,
        queue: str,
        shard: int,
        entries: Sequence[Entry],
        dedup_window: float,
        message_ttl: float | None,
        front: bool,
    ) -> Loaded:
        s = self._shard(queue, shard)
        now = time.time()
        was_empty = s.load == s.fire
        end = None if message_ttl is None else now + message_ttl
        flags: list[bool] = []
        loaded = False
        soonest: float | None = None
        seen: set[str] = set()
        accepted: list[tuple[Entry, _Record]] = []
        for e in entries:
            checked = e.dedup or e.mature is not None
            if checked and (e.id in seen or s.duplicate(e, now)):
                flags.append(False)
                continue
            seen.add(e.id)
            if checked:  # a dead record of its id, if any, goes in this step
                s.bury(e.id, now)
            if e.mature is None:  # a push: its life counts from now
                record = _Record(e.id, e.payload, e.headers, e.tries, now, end)
            else:  # a put-back keeps the end of life it had
                life = end if e.expires is None else e.expires
                record = _Record(e.id, e.payload, e.headers, e.tries, e.mature, life)
            if e.dedup:
                s.windows[e.id] = now + dedup_window
                heapq.heappush(s.window_ends, (now + dedup_window, e.id))
            accepted.append((e, record))
            flags.append(True)
        # put-backs first, where they were fired from: the loads below then index the rest
        backs = [(e.place, record) for e, record in accepted if front and e.mature is not None]
        behind = {id(record) for record in s.put_back(backs)} if backs else set()
        loaded = len(behind) < len(backs)
        for e, record in accepted:
            if e.mature is None and e.delay > 0:
                s.schedule_at(record, now + e.delay)
                soonest = now + e.delay if soonest is None else min(soonest, now + e.delay)
            elif not (front and e.mature is not None) or id(record) in behind:
                s.put(record)
                loaded = True
        return Loaded(flags, s.version, loaded and was_empty, soonest)

    async def fire(self, queue: str, shard: int, n: int, reserve_delay: float | None) -> Fired:
        await _pass()
        s = self._shard(queue, shard)
        now = time.time()
        s.promote(now)
        deadline = None if reserve_delay is None else now + reserve_delay
        messages: list[Stored] = []
        stop = min(s.load, s.fire + n + PROMOTE)
        while len(messages) < n and s.fire < stop:
            record = s.magazine.get(s.fire)
            if record is not None and record.dead(now):
                del s.magazine[s.fire]
                s.forget(record)
                s.expired += 1
            elif record is not None:
                if deadline is not None:
                    record.deadline = deadline
                    s.fired += 1
                else:
                    del s.magazine[s.fire]
                    s.forget(record)
                messages.append(
                    Stored(
                        record.id,
                        record.payload,
                        record.headers,
                        record.tries,
                        record.mature,
                        record.end,
                        record.place,
                    )
                )
            s.fire += 1
        return Fired(messages, s.load - s.fire, s.version, s.next_scheduled())

    async def commit(self, queue: str, shard: int, acks: Sequence[Ack]) -> list[bool]:
        s = self._shard(queue, shard)
        out: list[bool] = []
        for ack in acks:
            found = s.held(ack.id, ack.tries)
            if found is not None:
                del s.magazine[found[0]]
                s.forget(found[1])
                s.fired -= 1
            out.append(found is not None)
        return out

    async def extend(self, queue: str, shard: int, extends: Sequence[Extend]) -> list[bool]:
        s = self._shard(queue, shard)
        now = time.time()
        out: list[bool] = []
        moved: dict[int, float] = {}
        for extend in extends:
            found = s.held(extend.id, extend.tries)
            if found is not None:
                found[1].deadline = moved[found[0]] = now + extend.seconds
            out.append(found is not None)
        if moved and s.stepped:
            # the sweep's notes of these slots move with them (as Redis's ZADD XX of k)
            s.stepped = [(moved.get(at, due), at) for due, at in s.stepped]
            heapq.heapify(s.stepped)
        return out

    async def rollback(
        self, queue: str, shard: int, nacks: Sequence[Nack], max_ko: int | None
    ) -> RolledBack:
        s = self._shard(queue, shard)
        now = time.time()
        results: list[KoResult] = []
        doomed: list[Doomed] = []
        soonest: float | None = None
        leaving: list[tuple[_Record, bool]] = []  # back into the magazine; released unseen?
        for nack in nacks:
            found = s.held(nack.id, nack.tries)
            if found is None:
                results.append(KoResult.MISSING)
                continue
            at, record = found
            tries = record.tries + 1 if nack.count_try else record.tries
            del s.magazine[at]
            record.deadline = None
            record.tries = tries
            s.fired -= 1
            if max_ko is not None and nack.count_try and tries > max_ko:
                # set aside while its copy is written (as Redis): held by no one, so a
                # racing ok / ko of it finds nothing; back after the hold if the copier dies
                due = now + DEADLETTER_HOLD
                s.schedule_at(record, due)
                soonest = due if soonest is None else min(soonest, due)
                aside = s.where[record.id]
                assert isinstance(aside, str)
                doomed.append(Doomed(record.id, record.payload, record.headers, tries, aside))
                results.append(KoResult.DEADLETTERED)
                continue
            if nack.delay > 0:
                due = now + nack.delay
                s.schedule_at(record, due)
                soonest = due if soonest is None else min(soonest, due)
            else:
                leaving.append((record, not nack.count_try))
            results.append(KoResult.ROLLED_BACK)
        # released at no try (its holder never saw it): back to its place, as a put-back;
        # the others, and those with no room there, reloaded at the back in the nacks' order
        # (their slots are all free by now, so each release finds the room its own left)
        releases: list[tuple[int | None, _Record]] = [
            (record.place, record) for record, unseen in leaving if unseen
        ]
        behind = {id(record) for record in s.put_back(releases)} if releases else set()
        for record, unseen in leaving:
            if not unseen or id(record) in behind:
                s.put(record)
        reloaded = bool(leaving)
        return RolledBack(results, doomed, s.version, reloaded, soonest)

    async def drop_doomed(self, queue: str, shard: int, doomed: Sequence[Doomed]) -> list[bool]:
        s = self._shard(queue, shard)
        out: list[bool] = []
        for d in doomed:
            seq = int(d.aside[1:]) if s.where.get(d.id) == d.aside else None
            record = None if seq is None else s.waiting.get(seq)
            if seq is None or record is None or record.tries != d.tries:
                out.append(False)
                continue
            del s.waiting[seq]
            s.forget(record)
            s.schedule = [item for item in s.schedule if item[1] != seq]
            heapq.heapify(s.schedule)
            out.append(True)
        return out

    async def sizes(self, queue: str, shard: int) -> ShardSizes:
        s = self._shard(queue, shard)
        now = time.time()
        s.promote(now)  # a matured record past its end of life is deleted, not counted
        s.purge(now, PURGE)
        matured = sum(1 for due, _ in s.schedule if due <= now)
        return ShardSizes(
            ready=s.load - s.fire + matured,
            fired=s.fired,
            sidelined=s.side_load - s.side_fire,
            load=s.load,
            swept=s.swept,
            shoveled=s.shoveled,
            sweep=s.sweep,
            fire=s.fire,
            expired=s.expired,
            scheduled=len(s.schedule) - matured,
            next_scheduled=s.next_scheduled(),
        )

    async def next_deadline(self, queue: str, shard: int, most: int) -> Deadlines:
        s = self._shard(queue, shard)
        ends: list[float] = []
        whole = s.fire <= s.sweep + most
        for at in range(s.sweep, min(s.fire, s.sweep + most)):
            record = s.magazine.get(at)
            if record is not None and record.deadline is not None:
                ends.append(record.deadline)
        noted = heapq.nsmallest(most, s.stepped)
        for _, at in noted:  # in deadline order (an extension moves the note): first held
            record = s.magazine.get(at) if at < s.fire else None
            if record is not None and record.deadline is not None:
                ends.append(record.deadline)
                break
        else:
            whole = whole and len(s.stepped) == len(noted)
        return Deadlines(min(ends, default=None), whole)

    async def sweep(self, queue: str, shard: int, batch: int) -> SweepStep:
        s = self._shard(queue, shard)
        now = time.time()
        s.purge(now, batch)
        moved = 0
        # first the reservations stepped over earlier whose deadline has passed since
        looked = 0
        while s.stepped and s.stepped[0][0] <= now and looked < batch:
            _, at = heapq.heappop(s.stepped)
            looked += 1
            record = s.magazine.get(at)
            if record is not None and record.deadline is not None:
                if record.deadline > now:  # its slot fired again meanwhile, held longer
                    heapq.heappush(s.stepped, (record.deadline, at))
                else:
                    moved += s.lapse(at, record, now)
        # then the walk: one within its deadline is noted and stepped over (as Redis)
        stop = min(s.fire, s.sweep + batch)
        at = s.sweep
        while at < stop:
            record = s.magazine.get(at)
            if record is not None and record.deadline is not None:
                if record.deadline > now:
                    heapq.heappush(s.stepped, (record.deadline, at))
                else:
                    moved += s.lapse(at, record, now)
            at += 1
        s.sweep = at
        return SweepStep(
            moved,
            s.fire - s.sweep,
            s.load - s.fire,
            s.version,
            bool(s.stepped),
            s.side_load - s.side_fire,
            s.next_scheduled(),
        )

    async def shovel(self, queue: str, shard: int, batch: int) -> ShovelStep:
        s = self._shard(queue, shard)
        now = time.time()
        handled = 0
        while s.side_fire < s.side_load and handled < batch:
            record = s.sideline.pop(s.side_fire, None)
            if record is not None and record.dead(now):
                s.forget(record)
                s.expired += 1
                handled += 1
            elif record is not None:
                record.deadline = None
                record.tries += 1
                s.put(record)
                s.shoveled += 1
                handled += 1
            s.side_fire += 1
        return ShovelStep(handled, s.side_load - s.side_fire, s.version)

    # per queue ---------------------------------------------------------------------------

    async def ready_add(self, queue: str, marks: Sequence[ReadyMark]) -> None:
        q = self._queue(queue)
        now = time.time()
        for mark in marks:
            if mark.version > q.stamps.get(mark.shard, -1):
                q.stamps[mark.shard] = mark.version
            due = now if mark.due is None else mark.due
            known = q.ready.get(mark.shard)
            q.ready[mark.shard] = due if known is None else min(known, due)

    async def ready_drop(self, queue: str, marks: Sequence[ReadyMark]) -> None:
        q = self._queue(queue)
        for mark in marks:
            if q.stamps.get(mark.shard, -1) <= mark.version:
                if mark.due is None:
                    q.ready.pop(mark.shard, None)
                else:
                    q.ready[mark.shard] = mark.due

    async def ready_head(self, queue: str) -> ReadyHead:
        q = self._queue(queue)
        if not q.ready:
            return ReadyHead([], None)
        now = time.time()
        ordered = sorted(q.ready.items(), key=lambda item: (item[1], str(item[0])))
        return ReadyHead([s for s, due in ordered if due <= now], ordered[0][1])

    async def stamps(self, queue: str) -> dict[int, int]:
        return dict(self._queue(queue).stamps)

    async def enrol(self, queue: str, token: str, lease: float, most: int) -> bool:
        q = self._queue(queue)
        now = time.time()
        q.consumers = {t: end for t, end in q.consumers.items() if end > now}
        if token not in q.consumers and len(q.consumers) >= most:
            return False
        q.consumers[token] = now + lease
        return True

    async def leave(self, queue: str, token: str) -> None:
        self._queue(queue).consumers.pop(token, None)

    async def touch(self, queue: str, record: MetaRecord, life: float | None) -> MetaRecord:
        q = self._queue(queue)
        now = time.time()
        stored = q.live_meta(now)
        if stored is None:
            stored = q.meta = dict(record)
            # opened again after it expired: its data stays in the shards it had (each one a
            # producer ever loaded has a stamp), and routes by the count it had
            most = int(stored["shards"])
            if q.stamps and q.count is not None:
                most = q.count
            stored["shards"] = str(max([most, *(shard + 1 for shard in q.stamps)]))
        q.count = int(stored["shards"])
        stored["active"] = "true"
        stored["seen"] = str(int(now))
        if life is not None:
            q.meta_end = now + life
        self._listed[queue] = int(stored["shards"])
        names = ("shards", "message_ttl", "max_consumers")
        return {name: stored[name] for name in names if name in stored}

    async def read_meta(self, queue: str) -> MetaRecord | None:
        q = self._queues.get(queue)
        found = None if q is None else q.live_meta(time.time())
        return None if found is None else dict(found)

    async def listed(self) -> dict[str, int]:
        return dict(self._listed)

    async def unlist(self, queue: str) -> None:
        self._listed.pop(queue, None)

    # per backend -------------------------------------------------------------------------

    async def lease(self, token: str, ttl: float) -> bool:
        now = time.time()
        if self._holder is not None and self._lease_end <= now:
            self._holder = None
        if self._holder in (None, token):
            self._holder, self._lease_end = token, now + ttl
            return True
        return False

    async def release(self, token: str) -> None:
        if self._holder == token:
            self._holder = None


class MemoryShardedStats(MemoryStats):
    """``factory.list()`` shows only active queues, each with its ``"sharded"`` metadata."""

    def __init__(self, backend: MemoryShardedBackend) -> None:
        super().__init__()
        self._sharded = backend

    async def queues(self) -> dict[str, dict[str, Any]]:
        return await meta.active_queues(await super().queues(), self._sharded.queue_info)


class MemoryShardedBackend(ShardedBackend):
    """``memory-sharded``: the sharded model in this process (options as ``redis-sharded``'s
    but the Redis ones); for tests, and as the contract's second implementation."""

    name = "memory-sharded"
    capabilities: Capabilities = replace(CAPABILITIES, shared=False)
    options: ClassVar[dict[str, Any]] = ShardedOptions.defaults()

    def __init__(self, options: dict[str, Any]) -> None:
        sharded = ShardedOptions.parse_own(options)
        super().__init__(options)
        self.use_storage(MemoryShardStorage(), sharded, "shards" in options)
        self._rates = LocalRates()
        self._results = MemoryResults()

    async def rate_take(
        self, queue: str, rule: RateRule, count: int, hold: float, end: float = math.inf
    ) -> RateGrant:
        return self._rates.take(queue, rule, count, hold, end)

    def stats_store(self) -> StatsStore:
        return MemoryShardedStats(self)

    def result_store(self) -> ResultStore:
        return self._results
