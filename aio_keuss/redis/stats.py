"""Stats in Redis: a HASH of counters and a paused key per queue, one HASH of queue options.

Per-queue keys carry the queue's hash tag, so in cluster mode they spread over the nodes; the
increments of one flush go out in one non-transactional pipeline, which redis-py's cluster
pipeline splits per node.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson

from ..stats import Increments, StatsStore
from .connection import redis_errors_translated

if TYPE_CHECKING:
    from .connection import RedisConnection


class RedisStats(StatsStore):
    def __init__(self, backend: RedisConnection) -> None:
        super().__init__()
        self._backend = backend
        self._client: Any = backend.client  # Redis | RedisCluster: the same calls on both
        self._queues_key = f"{backend.prefix}:queues"

    def _counters_key(self, queue: str) -> str:
        return self._backend.key(queue, "stats")

    def _paused_key(self, queue: str) -> str:
        return self._backend.key(queue, "paused")

    async def _apply(self, increments: Increments) -> None:
        increments_by_key = [
            (self._counters_key(queue), name, n)
            for queue, counters in increments.items()
            for name, n in counters.items()
        ]
        with redis_errors_translated():
            if self._backend.has_fast_lane:  # pipelined on one connection already
                execute = self._backend.execute
                await asyncio.gather(*(execute("HINCRBY", *args) for args in increments_by_key))
                return
            pipe = self._client.pipeline(transaction=False)
            for key, name, n in increments_by_key:
                pipe.hincrby(key, name, n)
            await pipe.execute()

    async def _load_counters(self, queue: str) -> dict[str, int]:
        with redis_errors_translated():
            stored = await self._client.hgetall(self._counters_key(queue))
        return {name.decode(): int(value) for name, value in stored.items()}

    async def _reset(self, queue: str) -> None:
        with redis_errors_translated():
            await self._client.delete(self._counters_key(queue))

    async def set_paused(self, queue: str, paused: bool) -> None:
        with redis_errors_translated():
            if paused:
                await self._client.set(self._paused_key(queue), b"1")
            else:
                await self._client.delete(self._paused_key(queue))

    async def is_paused(self, queue: str) -> bool:
        with redis_errors_translated():
            return bool(await self._client.exists(self._paused_key(queue)))

    async def save_options(self, queue: str, options: dict[str, Any]) -> None:
        with redis_errors_translated():
            await self._client.hset(self._queues_key, queue, orjson.dumps(options))

    async def queues(self) -> dict[str, dict[str, Any]]:
        with redis_errors_translated():
            stored = await self._client.hgetall(self._queues_key)
        return {name.decode(): orjson.loads(value) for name, value in stored.items()}
