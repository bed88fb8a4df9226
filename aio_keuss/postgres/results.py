"""Results in PostgreSQL: one row of the schema's ``results`` table per (queue, id).

The table is one of the schema's migrations, and the statements are the ``results_*``
blocks of ``sql/queries.sql``; every one goes through the backend's connection, which
translates the driver's errors. A put of any number of results is one upsert (the ids and
bodies sent as two arrays, ``unnest``-ed by the server), a get of any number of ids one
SELECT; a result expires on the server's clock, so every process agrees on when.

PostgreSQL has no expiry of its own: expired rows are never read, and a put starts, on a
store's first put and then at most once every ``cleanup_period`` seconds, a background
task deleting them ``cleanup_batch`` rows a statement (short statements, short row locks),
until a statement finds fewer. The put does not wait for it. The first put cleans at once
so that processes living less than a period (a worker restarted often) still reclaim
what expired.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..coalesce import stop_task
from ..errors import KeussError
from ..results import ResultStore

if TYPE_CHECKING:
    from .connection import PostgresConnection

log = logging.getLogger("aio_keuss.postgres")

CLEANUP_PERIOD = 60.0
"""Seconds between two cleanups started by one store: expired rows take no part in reads,
so reclaiming their space can wait, and clients sharing a schema each run their own."""
CLEANUP_BATCH = 1000
"""Rows deleted by one statement of a cleanup."""


class PostgresResults(ResultStore):
    """The result store of every PostgreSQL backend, on the backend's connection and
    schema."""

    def __init__(self, backend: PostgresConnection) -> None:
        self._db = backend
        self._sql = backend.sql
        self.cleanup_period = CLEANUP_PERIOD
        self.cleanup_batch = CLEANUP_BATCH
        self._last_cleanup = -math.inf  # the first put starts one
        self._cleanup: asyncio.Task[None] | None = None
        self._closed = False

    async def close(self) -> None:
        """Stop a cleanup under way: it holds a connection of the backend, about to close.
        A put still under way starts none once closed (nothing would stop it)."""
        self._closed = True
        if self._cleanup is not None:
            await stop_task(self._cleanup)
            self._cleanup = None

    async def put(self, queue: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        """One upsert of every result. An id given twice keeps its last body: the upsert
        could not write one row twice, and a later result replaces an earlier one anyway.
        The rows go in order of id: the upsert locks them in the order given, and two
        puts sharing ids (a message delivered twice, ok-ed by both holders) that locked
        them in opposite orders deadlocked, one failing (PostgreSQL manual, "Deadlocks")."""
        if not results:
            return
        last = dict(results)
        ids = sorted(last)
        bodies = [last[message_id] for message_id in ids]
        await self._db.execute(self._sql["results_put"], queue, ids, bodies, float(ttl))
        self._maybe_clean_up()

    async def replace(
        self, queue: str, swaps: Sequence[tuple[str, bytes, bytes]], ttl: float
    ) -> None:
        """One update of every row, in order of id, as a put's (see :meth:`put`)."""
        if not swaps:
            return
        last = {message_id: (old, new) for message_id, old, new in swaps}
        ids = sorted(last)
        olds = [last[message_id][0] for message_id in ids]
        news = [last[message_id][1] for message_id in ids]
        await self._db.execute(self._sql["results_replace"], queue, ids, olds, news, float(ttl))

    async def get(self, queue: str, ids: Sequence[str]) -> list[bytes | None]:
        if not ids:
            return []
        rows = await self._db.fetch(self._sql["results_get"], queue, list(ids))
        found: dict[str, bytes] = {row[0]: row[1] for row in rows}
        return [found.get(message_id) for message_id in ids]

    async def clean_up_once(self) -> int:
        """Delete up to ``cleanup_batch`` expired results (of every queue); how many."""
        done = await self._db.execute(self._sql["results_expire"], self.cleanup_batch)
        return int(done.rpartition(" ")[2])

    def _maybe_clean_up(self) -> None:
        """Start a cleanup if the period has passed since the last one started (never,
        when ``cleanup_period`` is infinite), and none is running (a slow one is not
        doubled)."""
        now = time.monotonic()
        if self._closed or now - self._last_cleanup <= self.cleanup_period:
            return
        if self._cleanup is not None and not self._cleanup.done():
            return
        self._last_cleanup = now
        self._cleanup = asyncio.create_task(self._clean_up(), name="keuss-results-cleanup")

    async def _clean_up(self) -> None:
        """Batches until one deletes fewer than a full batch; a failure (the server away)
        is logged and left to the next period."""
        try:
            while True:
                if await self.clean_up_once() < self.cleanup_batch:
                    return
                await asyncio.sleep(0)  # let the rest of the process run between batches
        except KeussError as exc:
            log.warning("postgres results cleanup failed (%r); retrying later", exc)
