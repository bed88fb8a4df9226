"""The roles Redis plays beside storing messages: the signal bus (pub/sub) and the stats
store, on the connection every Redis backend shares."""

from __future__ import annotations

from ..signal import SignalBus
from ..stats import StatsStore
from .connection import RedisConnection
from .signal import RedisSignalBus
from .stats import RedisStats


class RedisBackend(RedisConnection):
    """Base of the Redis backends: signals and stats in the same Redis as the queues."""

    def signal_bus(self, debounce: float) -> SignalBus:
        return RedisSignalBus(self, debounce)

    def stats_store(self) -> StatsStore:
        return RedisStats(self)
