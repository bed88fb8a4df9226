"""Signals over Redis pub/sub: one channel per key prefix, one listener task per factory.

Pub/sub is fire-and-forget, which suits hints: while the listener is disconnected (a Redis
restart) consumers fall back to polling, and once it is back every local queue is woken so
nothing that arrived meanwhile waits for a poll. On Redis Cluster a PUBLISH reaches every
node, so the listener subscribes through the cluster client's pub/sub (redis-py picks the
node serving the channel's slot) and publishes through the cluster client as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..signal import SignalBus

if TYPE_CHECKING:
    from .connection import RedisConnection


class RedisSignalBus(SignalBus):
    def __init__(self, backend: RedisConnection, debounce: float = 0.05) -> None:
        super().__init__(debounce)
        self._backend = backend
        self.channel = f"{backend.prefix}:signal"

    async def _publish(self, payload: bytes) -> None:
        await self._backend.execute("PUBLISH", self.channel, payload)

    async def _listen(self, ready: Callable[[], None]) -> None:
        await self._backend.subscribe(self.channel, self._receive, ready)
