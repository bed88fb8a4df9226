"""Stats in Redis: a HASH of counters and a paused key per queue, one HASH of queue options, one of
pipeline topologies.

Per-queue keys carry the queue's hash tag, so in cluster mode they spread over the nodes; the
increments of one flush go out together, one script per queue, each applied only if the
flush's number is past the one this store last applied there (a key beside the counters),
so a flush sent again after its reply was lost is not counted twice.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson

from ..stats import Increments, NumberedFlushes
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


# KEYS: a HASH. ARGV: field, value. HSETNX, then the value in place (the one given when it
# was set): one step, so a remove between the two cannot answer nil.
_KEEP = Script("""
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then return ARGV[2] end
return redis.call('HGET', KEYS[1], ARGV[1])
""")


# KEYS: a queue's counters HASH, this store's flush number for the queue. ARGV: the flush's
# number, that number's time to live, then pairs counter, increment. Applied only when the
# number is past the one recorded (a flush sent again after its reply was lost is not added
# twice). First a write that cannot grow memory (see _REPLACE): the flush of consumers
# draining a full Redis is not refused.
_INCREMENT = Script("""
redis.call('HDEL', KEYS[1], '')
if tonumber(redis.call('GET', KEYS[2]) or '0') >= tonumber(ARGV[1]) then return 0 end
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
""")

FLUSH_NUMBER_TTL = 7 * 86400
"""Seconds a flush number is kept: a store closing with nothing to send again deletes its
own; a dead process's go after this, and a flush it sends again later than that (an
outage of a week) may be counted twice."""


class RedisStats(NumberedFlushes):
    def __init__(self, backend: RedisConnection) -> None:
        super().__init__()
        self._backend = backend
        self._queues_key = f"{backend.prefix}:queues"
        self._pipelines_key = f"{backend.prefix}:pipelines"

    def _counters_key(self, queue: str) -> str:
        return self._backend.key(queue, "stats")

    def _paused_key(self, queue: str) -> str:
        return self._backend.key(queue, "paused")

    def _flush_key(self, queue: str) -> str:
        return self._backend.key(queue, "stats-flushed", self._origin)

    async def _write(self, increments: Increments, seq: int) -> None:
        """One script per queue (its counters' HINCRBYs, unless this flush number already
        landed there), all sent at once: pipelined on the fast lane's one connection,
        spread over pooled connections (and cluster nodes) through redis-py. Some may land
        and others fail: sent again, those that landed are not added twice."""
        run = self._backend.run_script
        calls = []
        for queue, counters in increments.items():
            pairs = [x for name, n in counters.items() if n for x in (name, n)]
            keys = [self._counters_key(queue), self._flush_key(queue)]
            calls.append(run(_INCREMENT, keys, [seq, FLUSH_NUMBER_TTL, *pairs]))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    async def _landed(self, queue: str, seq: int) -> bool:
        flushed = await self._backend.execute("GET", self._flush_key(queue))
        return flushed is not None and int(flushed) >= seq

    async def _stored_counters(self, queue: str) -> dict[str, int]:
        stored = await self._backend.hash_items(self._counters_key(queue))
        return {name.decode(): int(value) for name, value in stored}

    async def _forget_flushes(self, queues: list[str]) -> None:
        await asyncio.gather(
            *(self._backend.execute("DEL", self._flush_key(queue)) for queue in queues)
        )

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

    async def keep_pipeline(self, name: str, topology: dict[str, Any]) -> dict[str, Any]:
        args = [name, orjson.dumps(topology)]
        kept = await self._backend.run_script(_KEEP, [self._pipelines_key], args)
        stored: dict[str, Any] = orjson.loads(kept)
        return stored

    async def pipelines(self) -> dict[str, dict[str, Any]]:
        stored = await self._backend.hash_items(self._pipelines_key)
        return {name.decode(): orjson.loads(value) for name, value in sorted(stored)}

    async def remove_pipeline(self, name: str) -> bool:
        return bool(await self._backend.execute("HDEL", self._pipelines_key, name))
