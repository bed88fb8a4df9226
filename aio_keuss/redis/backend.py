"""The roles Redis plays beside storing messages: the signal bus (pub/sub), the stats store,
the queues' rate limiters and the results of their messages, on the connection every
Redis backend shares."""

from __future__ import annotations

import math

from ..contract import RateGrant, RateRule
from ..results import ResultStore
from ..signal import SignalBus
from ..stats import StatsStore
from .connection import RedisConnection
from .limiter import rate_take
from .results import RedisResults
from .signal import RedisSignalBus
from .stats import RedisStats


class RedisBackend(RedisConnection):
    """Base of the Redis backends: signals, stats, rate limits and results in the same Redis
    as the queues (so every backend built on it, sharded and bucket ones too, has them)."""

    def signal_bus(self, debounce: float) -> SignalBus:
        return RedisSignalBus(self, debounce)

    def stats_store(self) -> StatsStore:
        return RedisStats(self)

    async def rate_take(
        self, queue: str, rule: RateRule, count: int, hold: float, end: float = math.inf
    ) -> RateGrant:
        return await rate_take(self, queue, rule, count, hold, end)

    def result_store(self) -> ResultStore:
        return RedisResults(self)
