"""The roles MongoDB plays beside storing messages: the signal bus (change streams, else a
capped collection) and the stats store, on the connection every MongoDB backend shares."""

from __future__ import annotations

from ..signal import SignalBus
from ..stats import StatsStore
from .connection import MongoConnection
from .signal import MongoSignalBus
from .stats import MongoStats


class MongoBackend(MongoConnection):
    """Base of the MongoDB backends: signals and stats in the same database as the queues."""

    def signal_bus(self, debounce: float) -> SignalBus:
        return MongoSignalBus(self, debounce)

    def stats_store(self) -> StatsStore:
        return MongoStats(self)
