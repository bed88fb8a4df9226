"""sqlite: every queue of a database file in one table, each primitive one write
transaction.

Layout (made and upgraded on open by the numbered steps in ``sql/migrations``; the
statements are in ``sql/queries.sql``):

- ``messages``: one row per queued message of *every* queue, unique by ``(queue, id)``.
  ``mature`` is float epoch seconds; a reserved message's ``mature`` is its reservation
  deadline, so an expired reservation simply becomes mature again and the next reserve
  counts that delivery as a try (``tries + reserved``). ``seq`` (the rowid) breaks ties
  between equal mature times. One table for all queues means a move (``Queue.move``,
  deadletter, a pipeline step) is an UPDATE of the row's queue and id.
- ``dedup``: ``(queue, id, expires)`` for ids the user chose, so an id stays refused for the
  dedup window even after its message was consumed; expired rows are purged a hundred at
  a time by the next idempotent push of that queue.
- ``rates``: a row per rate-limited queue, its limiter (:mod:`aio_keuss.sqlite.limiter`).
- ``stats``, ``queues``, ``pipelines`` belong to :mod:`aio_keuss.sqlite.stats`, ``signals``
  to :mod:`aio_keuss.sqlite.signal`, ``results`` (what finished messages' handlers
  returned, for ``result_ttl``) to :mod:`aio_keuss.sqlite.results`.

Each primitive is a function of the connection run on the database thread inside one
``BEGIN IMMEDIATE`` transaction (see :mod:`aio_keuss.sqlite.connection`): a pop's select and
delete, a reserve's select and update, a move's checks and update happen while this
connection holds the file's only write lock, so no other consumer, in this process or
another, can take the same message in between; and a coalesced batch costs one
transaction whatever its size (writes of other queues queued at the same moment share its
commit, each in a savepoint of its own). Reads (sizes, peek) run outside a write
transaction and never wait for writers (WAL). Times are ``time.time()`` taken inside the
transaction, once the lock is held: every process sharing the file runs on the same machine,
so on the same clock, and a reservation deadline is *now* plus ``reserve_delay`` (never the
old mature time plus the delay, Keuss's redis-oq mistake).
"""

from __future__ import annotations

import heapq
import math
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import replace
from itertools import islice
from typing import TYPE_CHECKING, Any, ClassVar

from ..contract import (
    Ack,
    Amend,
    Cursor,
    DeadletterPlan,
    Entry,
    Extend,
    Fetched,
    Held,
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
from ..message import MAX_PRIORITY, merge_headers
from ..results import ResultStore
from ..signal import LocalSignalBus, SignalBus
from ..stats import StatsStore
from ..types import Capabilities, KoResult, Sizes
from .connection import LONGEST_ROW, SqliteConnection, in_snapshot
from .limiter import rate_take
from .results import SqliteResults
from .signal import SqliteSignalBus
from .stats import SqliteStats

if TYPE_CHECKING:
    from ..options import QueueOptions

Row = tuple[Any, ...]
LARGEST_ROWID = 2**63 - 1
"""SQLite's largest rowid (SQLite documentation, "ROWID and the INTEGER PRIMARY KEY")."""
ABOVE_ALL = MAX_PRIORITY + 1
"""Past every priority: what is below it is all of a queue."""


def _peek_order(row: Row) -> tuple[float, int]:
    """(mature, seq) of a peek row."""
    return row[5], row[0]


def _peeked(row: Row, now: float) -> Peeked:
    """A row of peek / locate: seq, id, payload, headers, tries, mature, reserved, priority. A ready
    one shows the tries its next delivery is given: a lapsed reservation was a try its row
    does not count yet (reserve adds it)."""
    mature = row[5]
    state = "ready" if mature <= now else "reserved" if row[6] else "scheduled"
    tries = row[4] + 1 if row[6] and mature <= now else row[4]
    stored = Stored(row[1], row[2], row[3], tries, mature, priority=row[7])
    return Peeked(stored, state, mature)


class SqliteStore(Store):
    """One queue's view of the shared table. Every method awaits exactly one call on the
    database thread, whose reply refuses cancellation: a cancelled caller's work still
    completes and the queue learns its result (``uninterruptible``); a lone call runs at
    once, concurrent ones share the next transaction (``run_in_caller``, one batch at a
    time, since the thread runs one call at a time anyway)."""

    batch_concurrency: ClassVar[int] = 1
    run_in_caller = True
    uninterruptible = True
    max_message_bytes = LONGEST_ROW

    def __init__(self, name: str, options: QueueOptions, backend: SqliteQueueBackend) -> None:
        super().__init__(name, options)
        self._db = backend
        self._sql = backend.sql

    # writes: each runs on the database thread inside one BEGIN IMMEDIATE transaction ----

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        if not entries:
            return []
        return await self._db.write(lambda c: self._insert(c, entries))

    def _insert(self, c: sqlite3.Connection, entries: Sequence[Entry]) -> list[bool]:
        sql, name, now = self._sql, self.name, time.time()
        if any(e.dedup for e in entries):
            c.execute(sql["dedup_purge"], (name, now))
        flags: list[bool] = []
        for e in entries:
            if e.dedup and c.execute(sql["dedup_active"], (name, e.id, now)).fetchone():
                flags.append(False)
                continue
            mature = now + e.delay if e.mature is None else e.mature
            row = (name, e.id, mature, e.tries, e.payload, e.headers, e.priority)
            inserted = c.execute(sql["insert"], row).rowcount == 1
            if inserted and e.dedup:
                c.execute(sql["dedup_remember"], (name, e.id, now + self.options.dedup_window))
            flags.append(inserted)
        return flags

    async def get(self, n: int) -> Fetched:
        return await self._db.write(lambda c: self._take(c, n, None))

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        return await self._db.write(lambda c: self._take(c, n, reserve_delay))

    def _take(self, c: sqlite3.Connection, n: int, reserve_delay: float | None) -> Fetched:
        """Pop (``reserve_delay`` None: delete) or reserve up to ``n`` mature messages, the
        highest priority first, earliest first within one. Consumers see the mature time a
        message had before (when it became deliverable); a reserved one's row gets its
        deadline. The walk down the queue's priorities starts over below a priority at its
        first message not mature (see ``mature``): a queue that never had a priority has
        one, 0, and takes in one statement as it did before priorities."""
        sql, now = self._sql, time.time()
        rows: list[Row] = []
        later = math.inf  # the earliest mature time past now of the priorities walked
        below = ABOVE_ALL
        while len(rows) < n:
            stop = self._take_until_later(c, below, now, n - len(rows), rows)
            if stop is None:
                break
            later, below = min(later, stop[0]), stop[1]
        if reserve_delay is None:
            c.executemany(sql["delete_seq"], [(r[0],) for r in rows])
        elif rows:
            deadline = now + reserve_delay
            c.executemany(sql["reserve_seq"], [(deadline, r[0]) for r in rows])
            later = min(later, deadline)
        messages = [Stored(r[1], r[2], r[3], r[4], r[5], priority=r[6]) for r in rows]
        # A full batch means "maybe more now": the wait loop needs no next time then. Short
        # of one, every priority was walked, and each one's earliest message not taken is
        # the first not mature the walk stopped at (or it had none left).
        if len(rows) == n:
            return Fetched(messages, None)
        return Fetched(messages, None if later == math.inf else later)

    def _take_until_later(
        self, c: sqlite3.Connection, below: int, now: float, n: int, rows: list[Row]
    ) -> tuple[float, int] | None:
        """Add to ``rows`` up to ``n`` mature messages of the priorities below ``below``, in
        the index's order, up to the first one not mature. Answers its mature time and
        priority, or None where there was none (``n`` taken, or the queue walked to its
        end)."""
        found = c.execute(self._sql["mature"], (self.name, below, n))
        try:
            for row in found:
                if row[5] > now:
                    return row[5], row[6]
                rows.append(row)
            return None
        finally:
            found.close()  # ends the statement where the walk stopped

    def _next_mature(self, c: sqlite3.Connection) -> float | None:
        earliest = c.execute(self._sql["next_mature"], (self.name,)).fetchone()[0]
        return None if earliest is None else float(earliest)

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        if not acks:
            return []
        return await self._db.write(lambda c: self._commit(c, acks))

    def _commit(self, c: sqlite3.Connection, acks: Sequence[Ack]) -> list[bool]:
        statement = self._sql["commit"]
        return [c.execute(statement, (self.name, a.id, a.tries)).rowcount == 1 for a in acks]

    async def extend(self, extends: Sequence[Extend]) -> list[bool]:
        if not extends:
            return []
        return await self._db.write(lambda c: self._extend(c, extends))

    def _extend(self, c: sqlite3.Connection, extends: Sequence[Extend]) -> list[bool]:
        """In order, in the batch's one transaction: requests naming one id each find what
        the one before left, as if they ran one after another, and no consumer can take a
        lapsed reservation between a request's guard and its update."""
        statement, now = self._sql["extend"], time.time()
        return [
            c.execute(statement, (self.name, e.id, e.tries, now + e.seconds)).rowcount == 1
            for e in extends
        ]

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        if not nacks:
            return []
        return await self._db.write(lambda c: self._rollback(c, nacks, deadletter))

    def _rollback(
        self, c: sqlite3.Connection, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        """Releases and deadletters in one transaction; a deadletter goes through
        :meth:`_move_row`, the body of :meth:`move`, so the two cannot drift apart."""
        sql, now = self._sql, time.time()
        results: list[KoResult] = []
        for nack in nacks:
            row = c.execute(sql["held"], (self.name, nack.id, nack.tries)).fetchone()
            if row is None:
                results.append(KoResult.MISSING)
                continue
            failed = row[1] + 1 if nack.count_try else row[1]
            if deadletter is not None and nack.count_try and failed > deadletter.max_ko:
                plan = Move(
                    nack.id,
                    None,
                    deadletter.queue,
                    None,
                    deadletter.headers(failed, now),
                    0.0,
                    deadletter_tag(failed),
                )
                self._move_row(c, row, plan, now)
                results.append(KoResult.DEADLETTERED)
                continue
            c.execute(sql["release_seq"], (failed, now + nack.delay, row[0]))
            results.append(KoResult.ROLLED_BACK)
        return results

    async def move(self, moves: Sequence[Move]) -> list[str | None]:
        if not moves:
            return []
        return await self._db.write(lambda c: self._move(c, moves))

    def _move(self, c: sqlite3.Connection, moves: Sequence[Move]) -> list[str | None]:
        held, now = self._sql["held"], time.time()
        moved: list[str | None] = []
        for move in moves:
            row = c.execute(held, (self.name, move.id, move.tries)).fetchone()
            moved.append(None if row is None else self._move_row(c, row, move, now))
        return moved

    def _move_row(self, c: sqlite3.Connection, row: Row, move: Move, now: float) -> str:
        """The one body of a move (and so of a deadletter): the row (seq, tries, payload,
        headers of a held message) goes to the other queue under the first name there not
        taken, by the shared rename rule; tries start over."""
        seq, _, payload, headers = row
        if move.payload is not None:
            payload = move.payload
        if move.headers:
            headers = merge_headers(headers, move.headers)
        taken, base = self._sql["name_taken"], move.id
        name, clash = base, 0
        while c.execute(taken, (move.queue, name, seq)).fetchone():
            clash += 1  # the id is there already, from an earlier life: rename
            name = moved_id(base, move.tag, clash)
        c.execute(
            self._sql["move_seq"], (move.queue, name, now + move.delay, payload, headers, seq)
        )
        return name

    async def remove(self, ids: Sequence[str]) -> list[bool]:
        if not ids:
            return []
        return await self._db.write(lambda c: self._remove(c, ids))

    def _remove(self, c: sqlite3.Connection, ids: Sequence[str]) -> list[bool]:
        statement, now = self._sql["remove"], time.time()
        return [c.execute(statement, (self.name, i, now)).rowcount == 1 for i in ids]

    async def amend(self, amends: Sequence[Amend]) -> list[bool]:
        if not amends:
            return []
        return await self._db.write(lambda c: self._amend(c, amends))

    def _amend(self, c: sqlite3.Connection, amends: Sequence[Amend]) -> list[bool]:
        """All in the call's one write transaction, in order (an id named twice finds what
        the amend before left). A message is amendable under the rule of :meth:`remove`:
        any but an active reservation, so a lapsed reservation nobody took since counts as
        waiting; amended, it stops being its old holder's (see the query "amend"). The new
        mature time is on the clock every other primitive of this store uses, taken once
        the write lock is held, so a take racing the amend in another process either
        reserved the message first (the amend finds it reserved: False) or finds it
        changed."""
        statement, now = self._sql["amend"], time.time()
        return [c.execute(statement, self._amend_row(a, now)).rowcount == 1 for a in amends]

    def _amend_row(self, amend: Amend, now: float) -> Row:
        """The query's parameters: a delay is counted from now."""
        mature = None if amend.delay is None else now + amend.delay
        return (self.name, amend.id, mature, amend.priority, now, amend.scheduled_only)

    async def hold(self, ids: Sequence[str], reserve_delay: float) -> list[Held | None]:
        if not ids:
            return []
        return await self._db.write(lambda c: self._hold(c, ids, reserve_delay))

    def _hold(
        self, c: sqlite3.Connection, ids: Sequence[str], reserve_delay: float
    ) -> list[Held | None]:
        """Reserve given messages (requeue) as reserve would, unless under an active
        reservation: per id, the tries its holder presents, or None."""
        sql, now = self._sql, time.time()
        held: list[Held | None] = []
        for message_id in ids:
            row = c.execute(sql["locate"], (self.name, message_id)).fetchone()
            if row is None or (row[6] and row[5] > now):
                held.append(None)
                continue
            c.execute(sql["hold_seq"], (now + reserve_delay, row[0]))
            held.append(Held(row[4] + row[6]))
        return held

    # reads: outside any write transaction; WAL lets them run beside a writer -------------

    def check_cursor(self, cursor: Cursor | None) -> Cursor | None:
        """(mature, seq): seq the decimal digits of a rowid (a 64-bit int)."""
        return check_seq_cursor(cursor)

    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        """The cursor is (mature, seq): the order messages of one priority are indexed in,
        and the order a peek lists them in whatever their priorities (as the memory store
        does). Each priority of the queue is one stretch of the index, and the walk of each
        covers only the part where the state's messages can be: scheduled and reserved ones
        are all past now, ready ones all at or before it. Filtered row by row over the whole
        queue instead, a peek read every message of the other states first, holding the
        database thread, and so every call of the factory, for as long (a third of a second
        a million messages). A page reads up to ``limit`` rows of each priority the queue
        has and keeps the ``limit`` first of them, all in one read transaction
        (:func:`~.connection.in_snapshot`): outside one, each walk saw the latest commit,
        and a message another process moved to a lower priority between two walks was
        listed twice in one page (one moved to a higher priority: not at all)."""
        start = (-math.inf, -1) if after is None else (after[0], int(after[1]))

        def peek(c: sqlite3.Connection) -> PeekPage:
            now, until = time.time(), math.inf
            mature, seq = start
            if state in ("scheduled", "reserved"):
                # past (now, the largest rowid) is past now
                mature, seq = max(start, (now, LARGEST_ROWID))
            elif state == "ready":
                until = now
            statement, walks = self._sql["peek"], []
            for priority in self._priorities(c):
                found = c.execute(
                    statement, (self.name, mature, seq, state, limit, now, until, priority)
                )
                walks.append(found.fetchall())
            rows = list(islice(heapq.merge(*walks, key=_peek_order), limit))
            last = rows[-1] if len(rows) == limit else None
            cursor = None if last is None else (float(last[5]), str(last[0]))
            return PeekPage([_peeked(r, now) for r in rows], cursor)

        return await self._db.read(lambda c: in_snapshot(c, peek))

    def _priorities(self, c: sqlite3.Connection) -> list[int]:
        """The priorities the queue's messages have, highest first: a seek each."""
        found, below, statement = [], ABOVE_ALL, self._sql["level_below"]
        while level := c.execute(statement, (self.name, below)).fetchone():
            below = level[0]
            found.append(below)
        return found

    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        if not ids:
            return []

        def locate(c: sqlite3.Connection) -> list[Peeked | None]:
            now, statement = time.time(), self._sql["locate"]
            rows = [c.execute(statement, (self.name, i)).fetchone() for i in ids]
            return [None if r is None else _peeked(r, now) for r in rows]

        return await self._db.read(locate)

    async def sizes(self) -> Sizes:
        def sizes(c: sqlite3.Connection) -> Sizes:
            row = c.execute(self._sql["sizes"], (self.name, time.time())).fetchone()
            return Sizes(size=row[0], total=row[1], scheduled=row[2], reserved=row[3])

        return await self._db.read(sizes)

    async def next_mature(self) -> float | None:
        return await self._db.read(self._next_mature)


class SqliteQueueBackend(SqliteConnection):
    """``sqlite``: one table for every queue of a database file; signals, stats, rate
    limiters and results in the same file. A ``:memory:`` database lives in this factory's
    connection only: its queues are not shared (``Capabilities.shared`` false) and its
    signals stay in-process."""

    name = "sqlite"
    capabilities: Capabilities = Capabilities(
        move=True, peek=True, hold=True, extend=True, priority=True, reschedule=True
    )

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        if self.memory:
            self.capabilities = replace(self.capabilities, shared=False)

    async def store(self, queue: str, options: QueueOptions) -> Store:
        return SqliteStore(queue, options, self)

    def signal_bus(self, debounce: float) -> SignalBus:
        if self.memory:
            return LocalSignalBus(debounce)
        return SqliteSignalBus(self, debounce)

    def stats_store(self) -> StatsStore:
        return SqliteStats(self)

    def result_store(self) -> ResultStore:
        return SqliteResults(self)

    async def rate_take(
        self, queue: str, rule: RateRule, count: int, hold: float, end: float = math.inf
    ) -> RateGrant:
        return await rate_take(self, queue, rule, count, hold, end)
