"""The roles MongoDB plays beside storing messages: the signal bus (change streams, else a
capped collection), the stats store, the queues' rate limiters and the job results, on the
connection every MongoDB backend shares."""

from __future__ import annotations

import math
from typing import Any

from ..contract import RateGrant, RateRule
from ..results import ResultStore
from ..signal import SignalBus
from ..stats import StatsStore
from .connection import MongoConnection, Once
from .limiter import MongoRates
from .results import MongoResults
from .signal import MongoSignalBus
from .stats import MongoStats


class MongoBackend(MongoConnection):
    """Base of the MongoDB backends: signals, stats, rate limits and results in the same
    database as the queues."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self._rates = MongoRates(self)
        self._results_indexed = Once()
        """The results' TTL index, made once per backend whatever the stores made of it."""

    def signal_bus(self, debounce: float) -> SignalBus:
        return MongoSignalBus(self, debounce)

    def stats_store(self) -> StatsStore:
        return MongoStats(self)

    def result_store(self) -> ResultStore:
        return MongoResults(self, self._results_indexed)

    async def rate_take(
        self, queue: str, rule: RateRule, count: int, hold: float, end: float = math.inf
    ) -> RateGrant:
        return await self._rates.take(queue, rule, count, hold, end)
