"""Stats in PostgreSQL: counters, paused flags and queue options in the backend's schema.

The tables (``stats``, ``queues``) are created with the message table by the backend (see
the first migration step). Increments are buffered by
:class:`StatsStore` and written as ONE upsert per flush, whatever the number of queues and
counters in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from ..stats import Increments, StatsStore
from .connection import postgres_errors_translated

if TYPE_CHECKING:
    from .connection import PostgresConnection

_APPLY = """
INSERT INTO {s}.stats (queue, counter, value)
SELECT * FROM unnest($1::text[], $2::text[], $3::int8[])
ON CONFLICT (queue, counter) DO UPDATE SET value = stats.value + EXCLUDED.value
"""

_COUNTERS = "SELECT counter, value FROM {s}.stats WHERE queue = $1"

_RESET = "DELETE FROM {s}.stats WHERE queue = $1"

_SET_PAUSED = """
INSERT INTO {s}.queues (queue, paused) VALUES ($1, $2)
ON CONFLICT (queue) DO UPDATE SET paused = EXCLUDED.paused
"""

_IS_PAUSED = "SELECT paused FROM {s}.queues WHERE queue = $1"

_SAVE_OPTIONS = """
INSERT INTO {s}.queues (queue, options) VALUES ($1, $2::text::jsonb)
ON CONFLICT (queue) DO UPDATE SET options = EXCLUDED.options
"""

_QUEUES = "SELECT queue, options::text FROM {s}.queues ORDER BY queue"


class PostgresStats(StatsStore):
    def __init__(self, backend: PostgresConnection) -> None:
        super().__init__()
        self._backend = backend
        schema = backend.quoted_schema
        self._apply_sql = _APPLY.replace("{s}", schema)
        self._counters_sql = _COUNTERS.replace("{s}", schema)
        self._reset_sql = _RESET.replace("{s}", schema)
        self._set_paused_sql = _SET_PAUSED.replace("{s}", schema)
        self._is_paused_sql = _IS_PAUSED.replace("{s}", schema)
        self._save_options_sql = _SAVE_OPTIONS.replace("{s}", schema)
        self._queues_sql = _QUEUES.replace("{s}", schema)

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
        if not values:
            return
        with postgres_errors_translated():
            await self._backend.pool.execute(self._apply_sql, queues, names, values)

    async def _load_counters(self, queue: str) -> dict[str, int]:
        with postgres_errors_translated():
            rows = await self._backend.pool.fetch(self._counters_sql, queue)
        return {row[0]: row[1] for row in rows}

    async def _reset(self, queue: str) -> None:
        with postgres_errors_translated():
            await self._backend.pool.execute(self._reset_sql, queue)

    async def set_paused(self, queue: str, paused: bool) -> None:
        with postgres_errors_translated():
            await self._backend.pool.execute(self._set_paused_sql, queue, paused)

    async def is_paused(self, queue: str) -> bool:
        with postgres_errors_translated():
            paused = await self._backend.pool.fetchval(self._is_paused_sql, queue)
        return bool(paused)

    async def save_options(self, queue: str, options: dict[str, Any]) -> None:
        with postgres_errors_translated():
            await self._backend.pool.execute(
                self._save_options_sql, queue, orjson.dumps(options).decode()
            )

    async def queues(self) -> dict[str, dict[str, Any]]:
        with postgres_errors_translated():
            rows = await self._backend.pool.fetch(self._queues_sql)
        return {row[0]: orjson.loads(row[1]) for row in rows}
