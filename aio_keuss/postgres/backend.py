"""The roles PostgreSQL plays beside storing messages: the signal bus (LISTEN / NOTIFY), the
stats store, the result store and the queues' rate limiters, on the connection every
PostgreSQL backend shares."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from ..coalesce import stop_task
from ..contract import RATE_SLACK, RateGrant, RateRule
from ..errors import KeussError
from ..results import ResultStore
from ..signal import SignalBus
from ..stats import StatsStore
from .connection import PostgresConnection
from .results import PostgresResults
from .signal import PostgresSignalBus
from .stats import PostgresStats

log = logging.getLogger("aio_keuss.postgres")

RATE_RECLAIM_PERIOD = 60.0
"""Seconds between two reclaims of idle limiter rows by one backend (one factory)."""
RATE_RECLAIM_BATCH = 1_000
"""Limiter rows one reclaim statement deletes at most."""


class PostgresBackend(PostgresConnection):
    """Base of the PostgreSQL backends (messages, buckets): signals, stats, results and rate
    limits in the same database as the queues."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self._reclaimed_at = -math.inf  # time.monotonic() of the last reclaim started
        self._reclaim: asyncio.Task[None] | None = None
        self._shut = False

    def signal_bus(self, debounce: float) -> SignalBus:
        return PostgresSignalBus(self, debounce)

    def stats_store(self) -> StatsStore:
        return PostgresStats(self)

    def result_store(self) -> ResultStore:
        return PostgresResults(self)

    async def rate_take(
        self, queue: str, rule: RateRule, count: int, hold: float, end: float = math.inf
    ) -> RateGrant:
        """``contract.rate_step`` as one upsert of the queue's row, on the server's clock
        (the statement ``rate_take`` of ``sql/queries.sql`` says which and why). A step
        also starts, at most once a ``RATE_RECLAIM_PERIOD``, a reclaim of the rows whose
        times are past (idle queues'), in a task of its own: the step does not wait for
        it. Only backends that step limiters run it, so a factory without rate limits
        sends nothing more."""
        row = await self.fetchrow(
            self.sql["rate_take"], queue, rule.interval, rule.burst, count, hold, RATE_SLACK, end
        )
        self._reclaim_when_due()
        return RateGrant(
            int(row["granted"]), float(row["wait"]), float(row["tat"]), int(row["refused"])
        )

    def _reclaim_when_due(self) -> None:
        now = time.monotonic()
        if self._shut or now - self._reclaimed_at < RATE_RECLAIM_PERIOD:
            return
        if self._reclaim is not None and not self._reclaim.done():
            return  # the last one still going (a slow server): not a second beside it
        self._reclaimed_at = now
        self._reclaim = asyncio.get_running_loop().create_task(
            self._reclaim_idle_limiters(), name="keuss-rate-reclaim"
        )

    async def _reclaim_idle_limiters(self) -> None:
        """Delete the limiter rows whose times are past, ``RATE_RECLAIM_BATCH`` a statement
        so that none holds locks for long, until a statement finds fewer. A failure (the
        server away) is left to the next period."""
        try:
            while True:
                done = await self.execute(self.sql["rate_reclaim"], RATE_RECLAIM_BATCH)
                if not done.endswith(f" {RATE_RECLAIM_BATCH}"):
                    return
                await asyncio.sleep(0)  # more to delete: go on, letting others run
        except KeussError as exc:
            log.warning("postgres rate limiter reclaim failed (%r); retrying later", exc)

    async def close(self) -> None:
        self._shut = True
        if self._reclaim is not None:
            await stop_task(self._reclaim)
            self._reclaim = None
        await super().close()
