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
import logging
from typing import TYPE_CHECKING, Any

from ..backends._redis import redis_errors_translated
from .base import Signal, SignalBus

if TYPE_CHECKING:
    from ..backends._redis import RedisBackend

log = logging.getLogger("aio_keuss.signal")

RECONNECT_FIRST = 0.05
RECONNECT_CAP = 2.0
OPEN_WAIT = 5.0
"""Longest ``open`` waits for the first subscription, so a push right after connect is seen."""


class RedisSignalBus(SignalBus):
    def __init__(self, backend: RedisBackend, debounce: float = 0.05) -> None:
        super().__init__(debounce)
        self._client = backend.client
        self.channel = f"{backend.prefix}:signal"
        self._listener: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    async def open(self) -> None:
        self._listener = asyncio.get_running_loop().create_task(self._listen_forever())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(OPEN_WAIT):
                await self._subscribed.wait()

    async def close(self) -> None:
        await super().close()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None

    async def _publish(self, payload: bytes) -> None:
        with redis_errors_translated():
            await self._client.publish(self.channel, payload)

    async def _listen_forever(self) -> None:
        """Subscribe, feed messages to the bus; on any failure back off and start again."""
        backoff = RECONNECT_FIRST
        while True:
            pubsub: Any = self._client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is None:
                        continue
                    if message["type"] == "message":
                        self._receive(message["data"])
                    elif message["type"] == "subscribe":
                        backoff = RECONNECT_FIRST
                        self._on_subscribed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure means: reconnect
                log.warning("redis signal listener lost its connection (%s); retrying", exc)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(pubsub.aclose())
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_CAP)

    def _on_subscribed(self) -> None:
        """(Re)subscribed: after an outage wake every local queue, since signals published
        meanwhile were lost."""
        if self._subscribed.is_set():
            for queue in list(self._listeners):
                self._deliver(Signal(queue, "insert"))
        self._subscribed.set()
