"""Stats in PostgreSQL: counters, paused flags and queue options in the backend's schema.

The tables (``stats``, ``queues``, ``pipelines``) are made by the schema's migrations with
the message table, and the statements are the ``stats_*`` blocks of ``sql/queries.sql``. Increments
are buffered by :class:`StatsStore` and written as ONE upsert per flush, whatever the number
of queues and counters in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from ..stats import Increments, StatsStore

if TYPE_CHECKING:
    from .connection import PostgresConnection


class PostgresStats(StatsStore):
    def __init__(self, backend: PostgresConnection) -> None:
        super().__init__()
        self._db = backend
        self._sql = backend.sql

    async def _apply(self, increments: Increments) -> None:
        queues: list[str] = []
        names: list[str] = []
        values: list[int] = []
        for queue, counters in increments.items():
            for name, value in counters.items():
                if value:
                    queues.append(queue)
                    names.append(name)
                    values.append(value)
        if values:
            await self._db.execute(self._sql["stats_apply"], queues, names, values)

    async def _load_counters(self, queue: str) -> dict[str, int]:
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

    async def pipelines(self) -> dict[str, dict[str, Any]]:
        rows = await self._db.fetch(self._sql["stats_pipelines"])
        return {row[0]: orjson.loads(row[1]) for row in rows}

    async def remove_pipeline(self, name: str) -> bool:
        done = await self._db.execute(self._sql["stats_remove_pipeline"], name)
        return str(done).endswith(" 1")
