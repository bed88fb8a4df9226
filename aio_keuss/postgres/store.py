"""postgres: every queue of a schema in one table, dequeued with ``FOR UPDATE SKIP LOCKED``.

Layout (schema ``keuss`` by default, created and upgraded on connect by the numbered steps
in ``sql/migrations``; the statements are in ``sql/queries.sql``):

- ``messages``: one row per queued message of *every* queue, keyed by ``(queue, id)``.
  ``mature`` is float epoch seconds from the server clock; a reserved message's ``mature`` is
  its reservation deadline, so an expired reservation simply becomes mature again and the
  next reserve counts that delivery as a try (``tries + reserved::int``). ``seq`` (an
  identity column) breaks ties between equal mature times so equal-time messages leave in
  insertion order. One table for all queues means a move (``Queue.move``, deadletter, a
  pipeline step) is a single ``UPDATE ... SET queue = ...``: atomic by construction.
  ``priority`` (0 unless pushed with one) stays with the row through all of that; only
  rows with a priority enter a second, partial index, which the take reads beside the
  first (see ``_pick`` in ``queries.sql``).
- ``dedup``: ``(queue, id, expires)`` for ids the user chose, so an id stays refused for the
  dedup window even after its message was consumed. Expired rows are purged a hundred at a
  time by the next idempotent push of that queue.
- ``stats`` and ``queues`` (counters; options and the paused flag) belong to
  :mod:`aio_keuss.postgres.stats`.

Every primitive is ONE statement (one round trip, its own implicit transaction), built from
data-modifying CTEs over ``unnest``-ed array parameters so a coalesced batch of any size
costs the same single prepared statement. (Two exceptions, both inserts tried first without
``ON CONFLICT``: new messages of which one has an id already taken, never met with generated
ids, and a bulk load of user ids of which one is queued or remembered go again by a second
statement; see ``insert_new`` and ``insert_dedup_bulk_new`` in ``queries.sql``.) Time is
always the server's: ``now()``, or for an amend ``clock_timestamp()`` read once its rows are
locked; clients with skewed clocks agree on what is mature, and a
reservation deadline is the server's *now* plus ``reserve_delay`` (never the old mature time
plus the delay, Keuss's redis-oq mistake).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from ..coalesce import stop_task, to_the_end
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
    Store,
    Stored,
    bulk_columns,
    bulk_head,
    check_seq_cursor,
)
from ..errors import ConfigError, KeussError
from ..options import check_bool
from ..types import Capabilities, KoResult, Sizes
from .backend import PostgresBackend
from .connection import PostgresConnectionOptions
from .sql import queries

if TYPE_CHECKING:
    from ..options import QueueOptions


log = logging.getLogger("aio_keuss.postgres")

HISTORY_EXPIRY_BATCH = 10_000
"""History records one expiry statement deletes at most."""
STATEMENT_BYTES = 256 * 2**20
"""Most payload and header bytes one insert statement carries. PostgreSQL refuses a protocol
message of 1 GB or more ("invalid message length") and drops the connection, so a batch of
messages each fine on its own goes in as several statements, in order, rather than failing
every caller in it: concurrent pushes are split between callers by the queue (see
``max_insert_bytes``), and one larger ``push_many`` here."""

_RELAX = "AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL"
"""With durable_acks=False, reserve / commit / rollback / move carry this condition: an
InitPlan run once that turns synchronous_commit off for their own transaction only. A server
crash (not a clean restart) may then forget the last few hundred milliseconds of them: a
reservation or an ok comes undone and the message is delivered again -- at-least-once still
holds, no message is lost. Inserts and pops always wait for the WAL flush."""


def _first_occurrences(ids: Sequence[str], done: set[str]) -> list[bool]:
    """One flag per request: true for the first request naming an id the statement acted
    on (a batch may name an id twice; the second is what the memory store would refuse)."""
    flags = []
    for message_id in ids:
        if message_id in done:
            done.discard(message_id)
            flags.append(True)
        else:
            flags.append(False)
    return flags


def _by_bytes(entries: Sequence[Entry], most: int) -> list[Sequence[Entry]]:
    """Consecutive groups of at most ``most`` bytes (a larger entry alone), in order."""
    groups: list[Sequence[Entry]] = []
    start, size = 0, 0
    for i, entry in enumerate(entries):
        length = len(entry.payload) + len(entry.headers)
        if i > start and size + length > most:
            groups.append(entries[start:i])
            start, size = i, 0
        size += length
    groups.append(entries[start:])
    return groups


def _fetched(rows: list[Any] | None) -> Fetched:
    """Rows of get / reserve: messages (NULL id when none) each carrying next_in, the
    seconds from the server's now to the next mature time, made a time on our clock (the
    wait loop sleeps on it: a client clock off the server's must not wake that much early
    or late).

    None: the take gave up on a table lock another session holds (see
    ``PostgresConnection.fetch_take``), having taken nothing. Messages may be ready behind
    it, so the next mature time is now: a caller with a timeout looks again until it ends,
    the wait loop backing off between looks (a lock held long is looked past less and less
    often, up to the queue's ``poll_interval``), rather than sleeping out its timeout or
    waiting for the lock."""
    if rows is None:
        return Fetched([], time.time())
    next_in = rows[0][5] if rows else None
    next_mature = None if next_in is None else time.time() + next_in
    messages = [
        Stored(r[0], r[1], r[2], r[3], r[4], priority=r[6]) for r in rows if r[0] is not None
    ]
    return Fetched(messages, next_mature)


def _peeked(row: Any) -> Peeked:
    """A row of peek / locate: id, payload, headers, tries, mature, seq, reserved, now,
    priority. A
    ready one shows the tries its next delivery is given: a lapsed reservation was a try
    its row does not count yet (reserve adds it)."""
    mature, now = row[4], row[7]
    state = "ready" if mature <= now else "reserved" if row[6] else "scheduled"
    tries = row[3] + 1 if row[6] and mature <= now else row[3]
    return Peeked(Stored(row[0], row[1], row[2], tries, mature, priority=row[8]), state, mature)


def _processed(row: Any) -> Peeked:
    """A history row: id, payload, headers, tries, processed, seq, priority (kept so that
    a replay pushes its copy at it)."""
    message = Stored(row[0], row[1], row[2], row[3], row[4], priority=row[6])
    return Peeked(message, "processed", row[4])


class PostgresStore(Store):
    """One queue's view of the shared table: one statement of ``sql/queries.sql`` per
    primitive."""

    batch_concurrency: ClassVar[int] = 3

    def __init__(self, name: str, options: QueueOptions, backend: PostgresQueueBackend) -> None:
        super().__init__(name, options)
        self.max_insert_bytes = STATEMENT_BYTES  # concurrent pushes past it: several calls
        self._db = backend
        self._sql = backend.sql

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        if len(entries) > 1 and sum(len(e.payload) + len(e.headers) for e in entries) > (
            STATEMENT_BYTES
        ):  # several statements, in order: the first of an id still wins
            groups = _by_bytes(entries, STATEMENT_BYTES)
            return [flag for group in groups for flag in await self.insert(group)]
        if self._db.keeps_history:
            # A popped message put back (its caller was cancelled) was never consumed: the
            # record its pop's DELETE left in the history goes, as mongo-history revives it.
            # Before the insert: once back, the message may be popped again at once, and
            # that pop's record would then be the latest.
            back = [e.id for e in entries if e.mature is not None and not e.dedup]
            if back:
                await self._db.execute(self._sql["forget_history"], self.name, back)
        return await self._insert(entries)

    async def _insert(self, entries: Sequence[Entry]) -> list[bool]:
        if not entries:
            return []
        if (bulk_load := bulk_columns(entries)) is not None:
            ids, payloads = bulk_load
            head, delay = bulk_head(entries)
            bulk = (self.name, ids, payloads, head, delay, self.options.dedup_window)
            if await self._db.execute_unless_duplicate(self._sql["insert_dedup_bulk_new"], *bulk):
                return [True] * len(entries)
            rows = await self._db.fetch(self._sql["insert_dedup_bulk"], *bulk)
            if len(rows) == len(entries):
                return [True] * len(entries)
            return _first_occurrences(ids, {r[0] for r in rows})
        ids = [e.id for e in entries]
        payloads = [e.payload for e in entries]
        headers = [e.headers for e in entries]
        delays = [e.delay for e in entries]
        dedup = any(e.dedup for e in entries)
        if (
            not dedup
            and all(e.mature is None and not e.tries and not e.priority for e in entries)
            and await self._db.execute_unless_duplicate(
                self._sql["insert_new"], self.name, ids, payloads, headers, delays
            )
        ):
            return [True] * len(entries)  # new messages, all in (else an id was taken: below)
        columns: list[Any] = [
            self.name,
            ids,
            payloads,
            headers,
            delays,
            [e.tries for e in entries],
            [e.mature for e in entries],
        ]
        priorities = [e.priority for e in entries]
        if dedup:
            columns += [[e.dedup for e in entries], self.options.dedup_window, priorities]
            rows = await self._db.fetch(self._sql["insert_dedup"], *columns)
        else:
            rows = await self._db.fetch(self._sql["insert"], *columns, priorities)
        if len(rows) == len(entries):  # the common case: everything went in
            return [True] * len(entries)
        return _first_occurrences(ids, {r[0] for r in rows})

    async def get(self, n: int) -> Fetched:
        # to its end: a cancellation (the loop ending) must not lose what the DELETE took
        rows = await to_the_end(self._db.fetch_take(self._sql["get"], self.name, n))
        return _fetched(rows)

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        # to its end: what it reserved is then given back, not left reserved
        take = self._db.fetch_take(self._sql["reserve"], self.name, n, reserve_delay)
        return _fetched(await to_the_end(take))

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        if not acks:
            return []
        ids = [a.id for a in acks]
        rows = await self._db.fetch(self._sql["commit"], self.name, ids, [a.tries for a in acks])
        deleted = {r[0]: r[1] for r in rows}  # id -> the tries its holder was given
        flags = []
        for ack in acks:  # the first request whose guard the deleted row met is the holder's
            tries = deleted.get(ack.id)
            if tries is not None and (ack.tries is None or ack.tries == tries):
                del deleted[ack.id]
                flags.append(True)
            else:
                flags.append(False)
        return flags

    async def extend(self, extends: Sequence[Extend]) -> list[bool]:
        if not extends:
            return []
        rows = await self._db.fetch(
            self._sql["extend"],
            self.name,
            [e.id for e in extends],
            [e.tries for e in extends],
            [e.seconds for e in extends],
        )
        extended = {r[0]: r[1] for r in rows}  # id -> the tries its holder was given
        # every request whose guard the row met holds it (an extension leaves the guard as
        # it found it, so the requests of a batch naming one id do not exclude each other)
        flags = []
        for extend in extends:
            tries = extended.get(extend.id)
            flags.append(tries is not None and extend.tries in (None, tries))
        return flags

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        """Releases and deadletters in one statement; a deadletter runs the move body of
        :meth:`move` (one SQL fragment pasted into both), so the two cannot drift apart."""
        if not nacks:
            return []
        ids = [n.id for n in nacks]
        if deadletter is None:
            max_ko, target, prefix = None, self.name, b""
        else:
            max_ko, target = deadletter.max_ko, deadletter.queue
            # The constant part of the appended headers; x-dl-t and x-dl-tries come from SQL.
            prefix = b'"x-dl-from-queue":' + orjson.dumps(deadletter.from_queue) + b',"x-dl-t":"'
        rows = await self._db.fetch_moving(
            self._sql["rollback"],
            self.name,
            ids,
            [n.tries for n in nacks],
            [n.delay for n in nacks],
            [n.count_try for n in nacks],
            max_ko,
            target,
            prefix,
        )
        results = [KoResult.MISSING] * len(nacks)
        for position, outcome in rows:
            results[position - 1] = KoResult(outcome)
        return results

    async def move(self, moves: Sequence[Move]) -> list[str | None]:
        """One UPDATE of the rows in place (all queues share the table): atomic by
        construction; ``moved_id`` in SQL names a message whose id the target holds."""
        if not moves:
            return []
        rows = await self._db.fetch_moving(
            self._sql["move"],
            self.name,
            [m.id for m in moves],
            [m.tries for m in moves],
            [m.queue for m in moves],
            [m.payload for m in moves],
            [orjson.dumps(m.headers)[1:] if m.headers else None for m in moves],
            [m.delay for m in moves],
            [m.tag for m in moves],
        )
        moved: list[str | None] = [None] * len(moves)
        for new_id, position in rows:
            moved[position - 1] = new_id
        return moved

    async def remove(self, ids: Sequence[str]) -> list[bool]:
        if not ids:
            return []
        rows = await self._db.fetch(self._sql["remove"], self.name, list(ids))
        return _first_occurrences(ids, {r[0] for r in rows})

    async def amend(self, amends: Sequence[Amend]) -> list[bool]:
        """One statement for the batch (``amend`` in ``queries.sql``). Waiting is
        :meth:`remove`'s rule: a lapsed reservation nobody took since is amendable, and is
        released by the change (its try counted, as the next reserve would have); requests
        naming one id apply in their order."""
        if not amends:
            return []
        rows = await self._db.fetch(
            self._sql["amend"],
            self.name,
            [a.id for a in amends],
            [a.delay for a in amends],
            [a.priority for a in amends],
            [a.scheduled_only for a in amends],
        )
        flags = [False] * len(amends)
        for (position,) in rows:
            flags[position - 1] = True
        return flags

    def check_cursor(self, cursor: Cursor | None) -> Cursor | None:
        """(time, seq): seq a bigint's decimal digits."""
        return check_seq_cursor(cursor)

    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        """The cursor is (mature, seq): the order of the table's index."""
        mature, seq = (-math.inf, -1) if after is None else (after[0], int(after[1]))
        rows = await self._db.fetch(self._sql["peek"], self.name, mature, seq, state, limit)
        found = [_peeked(r) for r in rows]
        last = rows[-1] if len(rows) == limit else None
        return PeekPage(found, None if last is None else (last[4], str(last[5])))

    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        if not ids:
            return []
        rows = await self._db.fetch(self._sql["locate"], self.name, list(ids))
        found = {r[0]: _peeked(r) for r in rows}
        missing = [i for i in ids if i not in found]
        if missing and self._db.keeps_history:
            kept = await self._db.fetch(self._sql["locate_history"], self.name, missing)
            found.update((r[0], _processed(r)) for r in kept)
        return [found.get(i) for i in ids]

    async def hold(self, ids: Sequence[str], reserve_delay: float) -> list[Held | None]:
        if not ids:
            return []
        rows = await self._db.fetch(self._sql["hold"], self.name, list(ids), reserve_delay)
        held = {r[0]: Held(r[1]) for r in rows}
        return [held.pop(i, None) for i in ids]

    async def history(
        self, since: float, until: float, after: Cursor | None, limit: int
    ) -> PeekPage:
        if not self._db.keeps_history:
            return await super().history(since, until, after, limit)
        processed, seq = (-math.inf, -1) if after is None else (after[0], int(after[1]))
        rows = await self._db.fetch(
            self._sql["history"], self.name, since, until, processed, seq, limit
        )
        found = [_processed(r) for r in rows]
        last = rows[-1] if len(rows) == limit else None
        return PeekPage(found, None if last is None else (last[4], str(last[5])))

    async def sizes(self) -> Sizes:
        row = await self._db.fetchrow(self._sql["sizes"], self.name)
        assert row is not None  # an aggregate always answers one row
        return Sizes(size=row[0], total=row[1], scheduled=row[2], reserved=row[3])

    async def next_mature(self) -> float | None:
        mature: float | None = await self._db.fetchval(self._sql["next_mature"], self.name)
        return mature


@dataclass(frozen=True)
class PostgresOptions(PostgresConnectionOptions):
    """The ``postgres`` backend's options: those of every PostgreSQL backend (url, pool,
    schema, pool sizes), ``durable_acks`` (default True; False trades crash-durability of
    reserve / ok / ko / move for about twice their speed, see ``_RELAX``), ``history``
    (default False; True keeps consumed messages in the schema, ``history_ttl`` seconds,
    default 7 days)."""

    durable_acks: bool = True
    history: bool = False
    history_ttl: float = 7 * 86400.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self.durable_acks, "durable_acks")
        check_bool(self.history, "history")
        ttl = self.history_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < 2**31:
            raise ConfigError(f"history_ttl must be a positive number of seconds, not {ttl!r}")


class PostgresQueueBackend(PostgresBackend):
    """``postgres``: one table for every queue of the schema."""

    name = "postgres"
    capabilities: Capabilities = Capabilities(
        move=True, peek=True, hold=True, extend=True, priority=True, reschedule=True
    )
    options_type: ClassVar[type[PostgresConnectionOptions]] = PostgresOptions
    options: ClassVar[dict[str, Any]] = PostgresOptions.defaults()

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        assert isinstance(self.config, PostgresOptions)
        if not self.config.durable_acks:
            self.sql = queries(self.quoted_schema, _RELAX)
        self.keeps_history = self.config.history
        self.history_ttl = float(self.config.history_ttl)
        self._expiry: asyncio.Task[None] | None = None
        if self.keeps_history:
            self.capabilities = replace(self.capabilities, history=True)

    async def open(self) -> None:
        """With ``history``: install the schema's trigger, and expire old records every
        tenth of the TTL (between 1 s and a minute), ``HISTORY_EXPIRY_BATCH`` at a time so
        no statement holds locks for long."""
        await super().open()
        if self.keeps_history:
            try:
                await self.execute_without_timeouts(self.sql["history_on"])
            except BaseException:  # e.g. a role that may not create the trigger
                await self.close()  # a failed open is not closed by its caller
                raise
            self._expiry = asyncio.create_task(self._expire(), name="keuss-history-expiry")

    async def _expire(self) -> None:
        period = min(60.0, max(1.0, self.history_ttl / 10))
        while True:
            try:
                done = await self.execute(
                    self.sql["expire_history"], self.history_ttl, HISTORY_EXPIRY_BATCH
                )
                if done.endswith(f" {HISTORY_EXPIRY_BATCH}"):
                    await asyncio.sleep(0)  # more to delete: go on at once
                    continue
            except KeussError as exc:  # the server is away: try again next period
                log.warning("postgres history expiry failed (%r); retrying", exc)
            await asyncio.sleep(period)

    async def close(self) -> None:
        if self._expiry is not None:
            await stop_task(self._expiry)
            self._expiry = None
        await super().close()

    async def store(self, queue: str, options: QueueOptions) -> Store:
        return PostgresStore(queue, options, self)
