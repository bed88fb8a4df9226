"""Stats in PostgreSQL: counters, paused flags and queue options in the backend's schema.

The tables (``stats``, ``queues``, ``pipelines``, ``stats_flushes``) are made by the
schema's migrations with the message table, and the statements are the ``stats_*`` blocks of
``sql/queries.sql``. Increments are buffered by :class:`StatsStore` and written as ONE
upsert per flush, whatever the number of queues and counters in it.

Each flush carries a number, and the server applies it only if that number is past the last
one this store had applied (``stats_flushes``, one row per store, in the same statement). A
flush that fails is kept aside as it was, with its number, and sent again, alone and first,
by the next flush: when the server had applied it and only the reply was lost (the
connection broke), it is not applied a second time.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import orjson

from ..errors import KeussError
from ..stats import Increments, NumberedFlushes

if TYPE_CHECKING:
    from .connection import PostgresConnection


def _columns(increments: Increments) -> tuple[list[str], list[str], list[int]]:
    """The upsert's rows, sorted by queue then counter: two stores' flushes of the same
    counters lock those rows in the order they are written, and listed in each store's own
    order (the order it first counted them in) two flushes at once took them in opposite
    orders and deadlocked, the server aborting one (PostgreSQL manual, "Deadlocks": lock
    rows in a consistent order)."""
    queues: list[str] = []
    names: list[str] = []
    values: list[int] = []
    for queue in sorted(increments):
        counters = increments[queue]
        for name in sorted(counters):
            if value := counters[name]:
                queues.append(queue)
                names.append(name)
                values.append(value)
    return queues, names, values


class PostgresStats(NumberedFlushes):
    def __init__(self, backend: PostgresConnection) -> None:
        super().__init__()
        self._db = backend
        self._sql = backend.sql

    async def open(self) -> None:
        await super().open()
        with contextlib.suppress(KeussError):  # housekeeping: a later open does it
            await self._db.execute(self._sql["stats_forget_flushes"], None)

    async def _forget_flushes(self, queues: list[str]) -> None:
        await self._db.execute(self._sql["stats_forget_flushes"], self._origin)

    async def _write(self, increments: Increments, seq: int) -> None:
        """One upsert for every queue; the flush's number is checked and recorded in the
        same statement (one row per origin: a flush lands whole or not at all)."""
        queues, names, values = _columns(increments)
        await self._db.execute(self._sql["stats_apply"], queues, names, values, self._origin, seq)

    async def _landed(self, queue: str, seq: int) -> bool:
        flushed = await self._db.fetchval(self._sql["stats_flushed"], self._origin)
        return flushed is not None and flushed >= seq

    async def _stored_counters(self, queue: str) -> dict[str, int]:
        rows = await self._db.fetch(self._sql["stats_counters"], queue)
        return {row[0]: row[1] for row in rows}

    async def _reset(self, queue: str) -> None:
        await self._db.execute(self._sql["stats_reset"], queue)

    async def set_paused(self, queue: str, paused: bool) -> None:
        await self._db.execute(self._sql["stats_set_paused"], queue, paused)

    async def is_paused(self, queue: str) -> bool:
        return bool(await self._db.fetchval(self._sql["stats_is_paused"], queue))

    async def save_options(
        self, queue: str, options: dict[str, Any], *, replace: bool = True
    ) -> None:
        statement = self._sql["stats_save_options" if replace else "stats_keep_options"]
        await self._db.execute(statement, queue, orjson.dumps(options).decode())

    async def queues(self) -> dict[str, dict[str, Any]]:
        rows = await self._db.fetch(self._sql["stats_queues"])
        return {row[0]: orjson.loads(row[1]) for row in rows}

    async def save_pipeline(self, name: str, topology: dict[str, Any]) -> None:
        await self._db.execute(
            self._sql["stats_save_pipeline"], name, orjson.dumps(topology).decode()
        )

    async def keep_pipeline(self, name: str, topology: dict[str, Any]) -> dict[str, Any]:
        statement = self._sql["stats_keep_pipeline"]
        kept = await self._db.fetchval(statement, name, orjson.dumps(topology).decode())
        stored: dict[str, Any] = orjson.loads(kept)
        return stored

    async def pipelines(self) -> dict[str, dict[str, Any]]:
        rows = await self._db.fetch(self._sql["stats_pipelines"])
        return {row[0]: orjson.loads(row[1]) for row in rows}

    async def remove_pipeline(self, name: str) -> bool:
        done = await self._db.execute(self._sql["stats_remove_pipeline"], name)
        return str(done).endswith(" 1")
