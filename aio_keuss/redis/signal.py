"""Signals over Redis pub/sub: one channel per key prefix, one listener task per factory.

Pub/sub is fire-and-forget, which suits hints: while the listener is disconnected (a Redis
restart) consumers fall back to polling, and once it is back every local queue is woken so
nothing that arrived meanwhile waits for a poll. On Redis Cluster a PUBLISH reaches every
node, so the listener subscribes through the cluster client's pub/sub (redis-py picks the
node serving the channel's slot) and publishes through the cluster client as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..signal import SignalBus
from .connection import redis_errors_translated

if TYPE_CHECKING:
    from .connection import RedisConnection


class RedisSignalBus(SignalBus):
    def __init__(self, backend: RedisConnection, debounce: float = 0.05) -> None:
        super().__init__(debounce)
        self._client = backend.client
        self.channel = f"{backend.prefix}:signal"

    async def _publish(self, payload: bytes) -> None:
        with redis_errors_translated():
            await self._client.publish(self.channel, payload)

    async def _listen(self, ready: Callable[[], None]) -> None:
        pubsub: Any = self._client.pubsub()
        try:
            with redis_errors_translated():
                await pubsub.subscribe(self.channel)
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is None:
                        continue
                    if message["type"] == "message":
                        self._receive(message["data"])
                    elif message["type"] == "subscribe":
                        ready()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(pubsub.aclose())
