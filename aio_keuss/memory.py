"""The in-process backend: the embedded default, and the reference Store.

Each factory holds its own queues. A queue is a dict of records plus a heap ordered by
(mature, sequence) with lazy deletion: a record whose mature time changes gets a new sequence
number and a new heap entry, and stale entries are skipped when they surface. Every
primitive runs without awaiting, which is what makes it atomic on one event loop.

Priorities: once a queue has held a message with a priority, a take first moves what is
mature from that heap into a second one ordered by (-priority, mature, sequence), and takes
from there; a queue that never had one keeps the single heap and pays nothing for them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .contract import (
    Ack,
    Amend,
    Backend,
    Cursor,
    DeadletterPlan,
    Entry,
    Extend,
    Fetched,
    Held,
    LocalRates,
    LoopTurns,
    Move,
    Nack,
    Peeked,
    PeekPage,
    RateGrant,
    RateRule,
    Store,
    Stored,
    check_seq_cursor,
    deadletter_tag,
    moved_id,
)
from .message import merge_headers
from .results import MemoryResults, ResultStore
from .types import Capabilities, KoResult, Sizes

if TYPE_CHECKING:
    from .options import QueueOptions


class _Record:
    __slots__ = ("headers", "id", "mature", "payload", "priority", "reserved", "seq", "tries")

    def __init__(
        self,
        id: str,
        payload: bytes,
        headers: bytes,
        mature: float,
        seq: int,
        tries: int,
        priority: int,
    ) -> None:
        self.id = id
        self.payload = payload
        self.headers = headers
        self.mature = mature
        self.seq = seq
        self.tries = tries
        self.priority = priority
        self.reserved = False


class _QueueData:
    """The storage of one queue; shared by every Store made for that name in a factory."""

    def __init__(self) -> None:
        self.records: dict[str, _Record] = {}
        self.heap: list[tuple[float, int, str]] = []
        self.ready: list[tuple[int, float, int, str]] = []
        """Mature records by (-priority, mature, seq), once ``prioritized``."""
        self.prioritized = False
        self.sequence = itertools.count()
        self.dedup: dict[str, float] = {}
        self.dedup_expiry: deque[tuple[float, str]] = deque()

    def add(self, record: _Record) -> None:
        self.records[record.id] = record
        if record.priority:
            self.prioritized = True
        heapq.heappush(self.heap, (record.mature, record.seq, record.id))

    def reschedule(self, record: _Record, mature: float) -> None:
        record.mature = mature
        record.seq = next(self.sequence)
        heapq.heappush(self.heap, (mature, record.seq, record.id))

    def take_mature(self, n: int, now: float) -> list[_Record]:
        """Unlink up to ``n`` mature records from the heap, earliest first (highest
        priority first, once the queue has priorities)."""
        if self.prioritized:
            return self._take_by_priority(n, now)
        taken: list[_Record] = []
        heap, records = self.heap, self.records
        while heap and len(taken) < n:
            mature, seq, message_id = heap[0]
            if mature > now:
                break
            heapq.heappop(heap)
            record = records.get(message_id)
            if record is not None and record.seq == seq:
                taken.append(record)
        return taken

    def _take_by_priority(self, n: int, now: float) -> list[_Record]:
        self.ripen(now)
        ready, records = self.ready, self.records
        taken: list[_Record] = []
        seen: set[str] = set()  # a priority changed back and forth leaves two live entries
        while ready and len(taken) < n:
            rank, _, seq, message_id = heapq.heappop(ready)
            record = records.get(message_id)
            if record is not None and _live(record, rank, seq) and message_id not in seen:
                seen.add(message_id)
                taken.append(record)
        return taken

    def ripen(self, now: float) -> None:
        """Move what is mature from the heap into the one by priority."""
        heap, ready, records = self.heap, self.ready, self.records
        while heap and heap[0][0] <= now:
            mature, seq, message_id = heapq.heappop(heap)
            record = records.get(message_id)
            if record is not None and record.seq == seq:
                heapq.heappush(ready, (-record.priority, mature, seq, message_id))

    def change_priority(self, record: _Record, priority: int, now: float) -> None:
        """Give a record a new priority where it stands: its sequence number, so its place
        among those of its new priority, stays (as if pushed with it). Its entry in the
        heap by priority, if it has one, goes stale by its rank (see ``_live``)."""
        if priority == record.priority:
            return
        record.priority = priority
        if not self.prioritized:
            self.prioritized = bool(priority)  # its entry is in the heap: read when taken
            return
        self.ripen(now)  # after this a mature record's live entry is in ``ready``
        if record.mature <= now:
            heapq.heappush(self.ready, (-priority, record.mature, record.seq, record.id))

    def next_mature(self) -> float | None:
        ready, records = self.ready, self.records
        while ready:  # mature already, whatever the other heap holds
            rank, mature, seq, message_id = ready[0]
            record = records.get(message_id)
            if record is not None and _live(record, rank, seq):
                return mature
            heapq.heappop(ready)
        heap = self.heap
        while heap:
            mature, seq, message_id = heap[0]
            record = records.get(message_id)
            if record is not None and record.seq == seq:
                return mature
            heapq.heappop(heap)
        return None

    def is_duplicate(self, message_id: str, now: float) -> bool:
        while self.dedup_expiry and self.dedup_expiry[0][0] <= now:
            expiry, expired_id = self.dedup_expiry.popleft()
            if self.dedup.get(expired_id) == expiry:
                del self.dedup[expired_id]
        return message_id in self.records or message_id in self.dedup

    def remember(self, message_id: str, expiry: float) -> None:
        self.dedup[message_id] = expiry
        self.dedup_expiry.append((expiry, message_id))


def _live(record: _Record, rank: int, seq: int) -> bool:
    """Whether an entry of the heap by priority is the record's current one: a new mature
    time gives a record a new sequence number, a new priority a new rank."""
    return record.seq == seq and record.priority == -rank


def _stored(record: _Record, tries: int, mature: float) -> Stored:
    return Stored(
        record.id, record.payload, record.headers, tries, mature, priority=record.priority
    )


def _state(record: _Record, now: float) -> str:
    if record.mature <= now:
        return "ready"
    return "reserved" if record.reserved else "scheduled"


def _peeked(record: _Record, now: float) -> Peeked:
    """A record as peek shows it: a ready one with the tries its next delivery is given
    (a lapsed reservation was a try its record does not count yet, see ``get``)."""
    lapsed = record.reserved and record.mature <= now
    tries = record.tries + 1 if lapsed else record.tries
    return Peeked(_stored(record, tries, record.mature), _state(record, now), record.mature)


class MemoryStore(Store):
    run_in_caller = True
    uninterruptible = True  # nothing is awaited inside a primitive

    def __init__(self, name: str, options: QueueOptions, backend: MemoryBackend) -> None:
        super().__init__(name, options)
        self._backend = backend
        self._data = backend.data(name)
        self._turns = LoopTurns()

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        if self._turns.due(len(entries)):  # nothing else here suspends
            await asyncio.sleep(0)
        return self._insert_into(self._data, entries, time.time())

    def _insert_into(self, data: _QueueData, entries: Sequence[Entry], now: float) -> list[bool]:
        results: list[bool] = []
        window = self.options.dedup_window
        for entry in entries:
            if entry.dedup and data.is_duplicate(entry.id, now):
                results.append(False)
                continue
            if entry.id in data.records:  # a generated id cannot collide; a put-back can't
                results.append(False)
                continue
            mature = entry.mature if entry.mature is not None else now + entry.delay
            record = _Record(
                entry.id,
                entry.payload,
                entry.headers,
                mature,
                next(data.sequence),
                entry.tries,
                entry.priority,
            )
            data.add(record)
            if entry.dedup:
                data.remember(entry.id, now + window)
            results.append(True)
        return results

    async def get(self, n: int) -> Fetched:
        # Nothing here suspends: without this a consumer loop would run until the queue is
        # empty, starving the other consumers and every other task. Yield before taking.
        await asyncio.sleep(0)
        data = self._data
        messages = []
        for record in data.take_mature(n, time.time()):
            del data.records[record.id]
            tries = record.tries + 1 if record.reserved else record.tries
            messages.append(_stored(record, tries, record.mature))
        return Fetched(messages, data.next_mature())

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        await asyncio.sleep(0)  # as in get
        data = self._data
        now = time.time()
        messages = []
        for record in data.take_mature(n, now):
            if record.reserved:  # its earlier reservation expired: that delivery was a try
                record.tries += 1
            messages.append(_stored(record, record.tries, record.mature))
            record.reserved = True
            data.reschedule(record, now + reserve_delay)
        return Fetched(messages, data.next_mature())

    def _held(self, message_id: str, tries: int | None) -> _Record | None:
        record = self._data.records.get(message_id)
        if record is None or not record.reserved:
            return None
        if tries is not None and tries != record.tries:
            return None
        return record

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        results = []
        for ack in acks:
            record = self._held(ack.id, ack.tries)
            if record is not None:
                del self._data.records[record.id]
            results.append(record is not None)
        return results

    async def extend(self, extends: Sequence[Extend]) -> list[bool]:
        now = time.time()
        results = []
        for extend in extends:
            record = self._held(extend.id, extend.tries)
            if record is not None:
                self._data.reschedule(record, now + extend.seconds)
            results.append(record is not None)
        return results

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        now = time.time()
        results = []
        for nack in nacks:
            record = self._held(nack.id, nack.tries)
            if record is None:
                results.append(KoResult.MISSING)
                continue
            tries = record.tries + 1 if nack.count_try else record.tries
            if deadletter is not None and nack.count_try and tries > deadletter.max_ko:
                headers = deadletter.headers(tries, now)
                plan = Move(
                    record.id, None, deadletter.queue, None, headers, 0.0, deadletter_tag(tries)
                )
                self._move_record(record, plan, now)
                results.append(KoResult.DEADLETTERED)
                continue
            record.tries = tries
            record.reserved = False
            self._data.reschedule(record, now + nack.delay)
            results.append(KoResult.ROLLED_BACK)
        return results

    async def move(self, moves: Sequence[Move]) -> list[str | None]:
        now = time.time()
        results: list[str | None] = []
        for move in moves:
            record = self._held(move.id, move.tries)
            results.append(None if record is None else self._move_record(record, move, now))
        return results

    def _move_record(self, record: _Record, move: Move, now: float) -> str:
        """The one body of a move (and so of a deadletter): out of here, into the other
        queue under the first free name of the shared rename rule."""
        del self._data.records[record.id]
        payload = record.payload if move.payload is None else move.payload
        headers = merge_headers(record.headers, move.headers) if move.headers else record.headers
        target = self._backend.data(move.queue)
        entry = Entry(record.id, payload, headers, move.delay, priority=record.priority)
        clash = 0
        while not self._insert_into(target, [entry], now)[0]:
            clash += 1  # the id is there already, from an earlier life: rename
            entry.id = moved_id(record.id, move.tag, clash)
        return entry.id

    async def remove(self, ids: Sequence[str]) -> list[bool]:
        now = time.time()
        records = self._data.records
        results = []
        for message_id in ids:
            record = records.get(message_id)
            if record is None or (record.reserved and record.mature > now):
                results.append(False)
            else:
                del records[message_id]
                results.append(True)
        return results

    async def amend(self, amends: Sequence[Amend]) -> list[bool]:
        """Waiting is what ``remove`` takes: a record not under an active reservation, so a
        lapsed one too. Amending that one ends its reservation as a new delivery would, the
        lapsed delivery counted as a try (the tries ``peek`` shows already), so its old
        holder can no longer ok it. All of it runs without awaiting: atomic against every
        take of this loop."""
        now = time.time()
        return [self._amend_one(amend, now) for amend in amends]

    def _amend_one(self, amend: Amend, now: float) -> bool:
        data = self._data
        record = data.records.get(amend.id)
        if record is None or (record.reserved and record.mature > now):
            return False
        if amend.scheduled_only and record.mature <= now:
            return False
        if record.reserved:
            record.reserved = False
            record.tries += 1
        if amend.priority is not None:
            data.change_priority(record, amend.priority, now)
        if amend.delay is not None:
            data.reschedule(record, now + amend.delay)
        return True

    def check_cursor(self, cursor: Cursor | None) -> Cursor | None:
        """(mature, seq): seq the decimal digits of a record's sequence number."""
        return check_seq_cursor(cursor)

    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        """A walk is a bounded selection over all records per page (``heapq.nsmallest``):
        no index to keep for a store that lives in this process anyway. It goes in the
        heap's order, (mature, sequence), so messages due together are listed as they are
        delivered (push order), not by id; the cursor is (mature, sequence)."""
        now = time.time()
        records = self._data.records.values()
        past = None if after is None else (after[0], int(after[1]))
        candidates = (
            r
            for r in records
            if (past is None or (r.mature, r.seq) > past)
            and (state == "all" or _state(r, now) == state)
        )
        page = heapq.nsmallest(limit, candidates, key=lambda r: (r.mature, r.seq))
        rows = [_peeked(r, now) for r in page]
        cursor = (page[-1].mature, str(page[-1].seq)) if len(page) == limit else None
        return PeekPage(rows, cursor)

    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        now = time.time()
        records = self._data.records
        found = [records.get(i) for i in ids]
        return [None if r is None else _peeked(r, now) for r in found]

    async def hold(self, ids: Sequence[str], reserve_delay: float) -> list[Held | None]:
        now = time.time()
        records = self._data.records
        results: list[Held | None] = []
        for message_id in ids:
            record = records.get(message_id)
            if record is None or (record.reserved and record.mature > now):
                results.append(None)
                continue
            if record.reserved:  # an expired reservation: that delivery was a try
                record.tries += 1
            record.reserved = True
            self._data.reschedule(record, now + reserve_delay)
            results.append(Held(record.tries))
        return results

    async def sizes(self) -> Sizes:
        now = time.time()
        ready = reserved = scheduled = 0
        for record in self._data.records.values():
            if record.mature <= now:
                ready += 1
            elif record.reserved:
                reserved += 1
            else:
                scheduled += 1
        return Sizes(ready, len(self._data.records), scheduled, reserved)

    async def next_mature(self) -> float | None:
        return self._data.next_mature()


class MemoryBackend(Backend):
    name = "memory"
    capabilities: Capabilities = Capabilities(
        shared=False,
        move=True,
        peek=True,
        hold=True,
        extend=True,
        priority=True,
        reschedule=True,
    )

    def __init__(self, options: dict[str, object]) -> None:
        super().__init__(options)
        self._queues: dict[str, _QueueData] = {}
        self._rates = LocalRates()
        self._results = MemoryResults()

    def data(self, queue: str) -> _QueueData:
        found = self._queues.get(queue)
        if found is None:
            found = self._queues[queue] = _QueueData()
        return found

    async def store(self, queue: str, options: QueueOptions) -> Store:
        return MemoryStore(queue, options, self)

    async def rate_take(
        self, queue: str, rule: RateRule, count: int, hold: float, end: float = math.inf
    ) -> RateGrant:
        return self._rates.take(queue, rule, count, hold, end)

    def result_store(self) -> ResultStore:
        return self._results
