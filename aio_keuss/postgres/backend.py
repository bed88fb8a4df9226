"""The roles PostgreSQL plays beside storing messages: the signal bus (LISTEN / NOTIFY) and
the stats store, on the connection every PostgreSQL backend shares."""

from __future__ import annotations

from ..signal import SignalBus
from ..stats import StatsStore
from .connection import PostgresConnection
from .signal import PostgresSignalBus
from .stats import PostgresStats


class PostgresBackend(PostgresConnection):
    """Base of the PostgreSQL backends (messages, buckets): signals and stats in the same
    database as the queues."""

    def signal_bus(self, debounce: float) -> SignalBus:
        return PostgresSignalBus(self, debounce)

    def stats_store(self) -> StatsStore:
        return PostgresStats(self)
