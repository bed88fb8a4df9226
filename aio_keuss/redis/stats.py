"""Stats in Redis: a HASH of counters and a paused key per queue, one HASH of queue options, one of
pipeline topologies.

Per-queue keys carry the queue's hash tag, so in cluster mode they spread over the nodes; the
increments of one flush go out together.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson

from ..stats import Increments, PartlyWritten, StatsStore
from .connection import Script

if TYPE_CHECKING:
    from .connection import RedisConnection


# KEYS: a HASH. ARGV: field, value. HSET, but first a write that cannot grow memory: at
# maxmemory (noeviction) Redis refuses a script whose first write may (an HSET), and a
# process opening a queue (which records its options) to drain a full Redis must not be.
_REPLACE = Script("""
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
""")


# KEYS: a queue's counters HASH. ARGV: pairs counter, increment. First a write that cannot
# grow memory (see _REPLACE): the flush of consumers draining a full Redis is not refused.
_INCREMENT = Script("""
redis.call('HDEL', KEYS[1], '')
for i = 1, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
""")


class RedisStats(StatsStore):
    def __init__(self, backend: RedisConnection) -> None:
        super().__init__()
        self._backend = backend
        self._queues_key = f"{backend.prefix}:queues"
        self._pipelines_key = f"{backend.prefix}:pipelines"

    def _counters_key(self, queue: str) -> str:
        return self._backend.key(queue, "stats")

    def _paused_key(self, queue: str) -> str:
        return self._backend.key(queue, "paused")

    async def _apply(self, increments: Increments) -> None:
        """One script per queue (its counters' HINCRBYs after a write that cannot grow
        memory, so the flush works at maxmemory too, and a close there does not raise), all
        sent at once: pipelined on the fast lane's one connection, spread over pooled
        connections (and cluster nodes) through redis-py."""
        batches = [
            (queue, [x for name, n in counters.items() if n for x in (name, n)])
            for queue, counters in increments.items()
        ]
        batches = [(queue, args) for queue, args in batches if args]
        run = self._backend.run_script
        results = await asyncio.gather(
            *(run(_INCREMENT, [self._counters_key(queue)], args) for queue, args in batches),
            return_exceptions=True,
        )
        unwritten: Increments = {}
        failure: BaseException | None = None
        for (queue, _), result in zip(batches, results, strict=True):
            if isinstance(result, BaseException):
                failure = failure or result
                unwritten[queue] = {name: n for name, n in increments[queue].items() if n}
        if failure is not None:
            # Only what failed goes back: the increments that landed must not be added again.
            raise PartlyWritten(unwritten, failure)

    async def _load_counters(self, queue: str) -> dict[str, int]:
        stored = await self._backend.hash_items(self._counters_key(queue))
        return {name.decode(): int(value) for name, value in stored}

    async def _reset(self, queue: str) -> None:
        await self._backend.execute("DEL", self._counters_key(queue))

    async def set_paused(self, queue: str, paused: bool) -> None:
        if paused:
            await self._backend.execute("SET", self._paused_key(queue), b"1")
        else:
            await self._backend.execute("DEL", self._paused_key(queue))

    async def is_paused(self, queue: str) -> bool:
        return bool(await self._backend.execute("EXISTS", self._paused_key(queue)))

    async def save_options(
        self, queue: str, options: dict[str, Any], *, replace: bool = True
    ) -> None:
        if replace:
            args = [queue, orjson.dumps(options)]
            await self._backend.run_script(_REPLACE, [self._queues_key], args)
        else:
            await self._backend.execute("HSETNX", self._queues_key, queue, orjson.dumps(options))

    async def queues(self) -> dict[str, dict[str, Any]]:
        stored = await self._backend.hash_items(self._queues_key)
        return {name.decode(): orjson.loads(value) for name, value in stored}

    async def save_pipeline(self, name: str, topology: dict[str, Any]) -> None:
        await self._backend.execute("HSET", self._pipelines_key, name, orjson.dumps(topology))

    async def pipelines(self) -> dict[str, dict[str, Any]]:
        stored = await self._backend.hash_items(self._pipelines_key)
        return {name.decode(): orjson.loads(value) for name, value in sorted(stored)}

    async def remove_pipeline(self, name: str) -> bool:
        return bool(await self._backend.execute("HDEL", self._pipelines_key, name))
