"""Stats in the database file: counters, paused flags, queue options and pipeline
topologies, in the tables the schema's migrations make beside the messages.

Increments are buffered by :class:`StatsStore` and written as one transaction per flush,
whatever the number of queues and counters in it.

The database thread runs a write to its end whatever becomes of its caller, and a caller
cancelled meanwhile (a close that gave up waiting) is told only that: not whether the write
committed. So each flush carries a number, recorded in ``stats_flushes`` in the same
transaction as the counters, and a flush whose outcome is unknown is kept aside and sent
again with its number, which applies it only if it had not committed (see
:class:`NumberedFlushes`).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from typing import TYPE_CHECKING, Any

import orjson

from ..errors import KeussError
from ..stats import Increments, NumberedFlushes

if TYPE_CHECKING:
    from .connection import SqliteConnection

STALE_FLUSHES = 7 * 24 * 3600.0
"""Seconds after which a store's flush number is taken for that of a process that ended
without closing, and deleted by the next factory to open."""


class SqliteStats(NumberedFlushes):
    def __init__(self, backend: SqliteConnection) -> None:
        super().__init__()
        self._db = backend
        self._sql = backend.sql

    async def open(self) -> None:
        await super().open()
        with contextlib.suppress(KeussError):  # housekeeping: a later open does it
            await self._run("stats_forget_stale_flushes", time.time() - STALE_FLUSHES)

    async def _forget_flushes(self, queues: list[str]) -> None:
        await self._run("stats_forget_flushes", self._origin)

    async def _write(self, increments: Increments, seq: int) -> None:
        """The flush's number is claimed and the counters added in one transaction: a
        flush lands whole, once, or not at all."""
        rows = [
            (queue, name, value)
            for queue, counters in increments.items()
            for name, value in counters.items()
            if value
        ]
        claim, apply = self._sql["stats_flush_claim"], self._sql["stats_apply"]
        flush = (self._origin, seq, time.time())

        def write(c: sqlite3.Connection) -> None:
            if c.execute(claim, flush).rowcount:
                c.executemany(apply, rows)

        await self._db.write(write)

    async def _landed(self, queue: str, seq: int) -> bool:
        statement, origin = self._sql["stats_flushed"], self._origin
        row = await self._db.read(lambda c: c.execute(statement, (origin,)).fetchone())
        return row is not None and row[0] >= seq

    async def _stored_counters(self, queue: str) -> dict[str, int]:
        statement = self._sql["stats_counters"]
        rows = await self._db.read(lambda c: c.execute(statement, (queue,)).fetchall())
        return {row[0]: row[1] for row in rows}

    async def _reset(self, queue: str) -> None:
        await self._run("stats_reset", queue)

    async def set_paused(self, queue: str, paused: bool) -> None:
        await self._run("stats_set_paused", queue, int(paused))

    async def is_paused(self, queue: str) -> bool:
        statement = self._sql["stats_is_paused"]
        row = await self._db.read(lambda c: c.execute(statement, (queue,)).fetchone())
        return bool(row is not None and row[0])

    async def save_options(
        self, queue: str, options: dict[str, Any], *, replace: bool = True
    ) -> None:
        name = "stats_save_options" if replace else "stats_keep_options"
        await self._run(name, queue, orjson.dumps(options).decode())

    async def queues(self) -> dict[str, dict[str, Any]]:
        statement = self._sql["stats_queues"]
        rows = await self._db.read(lambda c: c.execute(statement).fetchall())
        return {row[0]: orjson.loads(row[1]) for row in rows}

    async def save_pipeline(self, name: str, topology: dict[str, Any]) -> None:
        await self._run("stats_save_pipeline", name, orjson.dumps(topology).decode(), time.time())

    async def keep_pipeline(self, name: str, topology: dict[str, Any]) -> dict[str, Any]:
        keep, read = self._sql["stats_keep_pipeline"], self._sql["stats_pipeline"]
        args = (name, orjson.dumps(topology).decode(), time.time())

        def run(c: sqlite3.Connection) -> str:  # one write transaction: nothing in between
            c.execute(keep, args)
            found: str = c.execute(read, (name,)).fetchone()[0]
            return found

        stored: dict[str, Any] = orjson.loads(await self._db.write(run))
        return stored

    async def pipelines(self) -> dict[str, dict[str, Any]]:
        statement = self._sql["stats_pipelines"]
        rows = await self._db.read(lambda c: c.execute(statement).fetchall())
        return {row[0]: orjson.loads(row[1]) for row in rows}

    async def remove_pipeline(self, name: str) -> bool:
        return await self._run("stats_remove_pipeline", name) == 1

    async def _run(self, name: str, *args: object) -> int:
        """One statement in a write transaction of its own; the rows it changed."""
        statement = self._sql[name]

        def run(c: sqlite3.Connection) -> int:
            return c.execute(statement, args).rowcount

        return await self._db.write(run)
