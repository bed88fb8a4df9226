"""Stats in the database file: counters, paused flags, queue options and pipeline
topologies, in the tables the schema's migrations make beside the messages.

Increments are buffered by :class:`StatsStore` and written as one transaction per flush,
whatever the number of queues and counters in it.
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING, Any

import orjson

from ..stats import Increments, StatsStore

if TYPE_CHECKING:
    from .connection import SqliteConnection


class SqliteStats(StatsStore):
    def __init__(self, backend: SqliteConnection) -> None:
        super().__init__()
        self._db = backend
        self._sql = backend.sql

    async def _apply(self, increments: Increments) -> None:
        rows = [
            (queue, name, value)
            for queue, counters in increments.items()
            for name, value in counters.items()
            if value
        ]
        if rows:
            statement = self._sql["stats_apply"]
            await self._db.write(lambda c: c.executemany(statement, rows))

    async def _load_counters(self, queue: str) -> dict[str, int]:
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
