"""The roles PostgreSQL plays beside storing messages: the signal bus (LISTEN / NOTIFY), the
stats store, the result store and the queues' rate limiters, on the connection every
PostgreSQL backend shares."""

from __future__ import annotations

import math

from ..contract import RATE_SLACK, RateGrant, RateRule
from ..results import ResultStore
from ..signal import SignalBus
from ..stats import StatsStore
from .connection import PostgresConnection
from .results import PostgresResults
from .signal import PostgresSignalBus
from .stats import PostgresStats


class PostgresBackend(PostgresConnection):
    """Base of the PostgreSQL backends (messages, buckets): signals, stats, results and rate
    limits in the same database as the queues."""

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
        (the statement ``rate_take`` of ``sql/queries.sql`` says which and why)."""
        row = await self.fetchrow(
            self.sql["rate_take"], queue, rule.interval, rule.burst, count, hold, RATE_SLACK, end
        )
        return RateGrant(int(row["granted"]), float(row["wait"]), float(row["tat"]))
