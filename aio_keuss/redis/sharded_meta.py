"""Queue metadata of ``redis-sharded``: one record per queue, readable from any process.

``prefix:{queue}:meta`` is a HASH written by the first process that opens the queue: its
``shards``, ``message_ttl`` and ``max_consumers`` are the queue's from then on (a later
process with other values adopts them, or, for an explicit ``shards``, is refused). Fields:
shards, created (epoch seconds), active (``"true"``), seen (epoch seconds of the last
touch), sweep_duration (the queue's ``reserve_delay``), shovel_interval,
shovel_concurrency, message_ttl and queue_expiry (seconds, ``""`` = none), max_batch,
max_consumers. Per-shard sweep pointers and swept / shoveled / expired counters live in
each shard's own ``m`` hash (so each script advances them atomically in its slot);
``RedisShardedStore.shard_sizes()`` reads them. ``prefix:sharded:queues`` (HASH name ->
shards) lists the queues the sweeper walks.

Queue expiry: with ``queue_expiry`` set, the record lives ``2 * queue_expiry`` seconds
(IgnisMQ's safety factor) past the last time a process touched the queue (a push or fetch
touches it at most every quarter of ``queue_expiry``). Once it is gone the queue is idle:
the leader drops it from the list it sweeps, and ``factory.list()`` no longer shows it.
Its messages are not deleted: they stay in their shards (where a message TTL, if set,
still ends them when a script meets them), and a process that opens the queue again writes
a new record and finds them; records fired and never acknowledged wait for that too, since
the sweeper no longer visits the queue.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import orjson

from .stats import RedisStats

if TYPE_CHECKING:
    from ..options import QueueOptions
    from .sharded import RedisShardedBackend, RedisShardedOptions

EXPIRY_FACTOR = 2
"""The metadata record lives this many times ``queue_expiry`` past its last touch."""


def record(shards: int, options: QueueOptions, sharded: RedisShardedOptions) -> list[Any]:
    """The metadata record's fields, as META's arguments (its TTL first)."""
    expiry = sharded.queue_expiry
    ttl_ms = math.ceil(expiry * EXPIRY_FACTOR * 1000) if expiry else 0
    return [
        ttl_ms,
        "shards", shards,
        "created", repr(time.time()),
        "sweep_duration", repr(options.reserve_delay),
        "shovel_interval", repr(sharded.shovel_interval),
        "shovel_concurrency", sharded.shovel_concurrency,
        "message_ttl", repr(sharded.message_ttl) if sharded.message_ttl else "",
        "queue_expiry", repr(expiry) if expiry else "",
        "max_batch", options.max_batch,
        "max_consumers", sharded.max_consumers,
    ]  # fmt: skip


def touch_period(sharded: RedisShardedOptions) -> float | None:
    """How often a store in use renews its queue's record (None: written once, no TTL)."""
    return sharded.queue_expiry / 4 if sharded.queue_expiry else None


def decode(fields: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """A metadata record as Python values (numbers as numbers, ``""`` as None)."""
    found: dict[str, Any] = {}
    for raw_name, raw in fields:
        name, text = raw_name.decode(), raw.decode()
        if name == "active":
            found[name] = text == "true"
        elif text == "":
            found[name] = None
        else:
            try:
                found[name] = orjson.loads(text)
            except orjson.JSONDecodeError:
                found[name] = text
    return found


class RedisShardedStats(RedisStats):
    """The Redis stats store, but ``factory.list()`` shows only active queues (those whose
    metadata record exists and is active), each with its ``"sharded"`` metadata."""

    def __init__(self, backend: RedisShardedBackend) -> None:
        super().__init__(backend)
        self._sharded = backend

    async def queues(self) -> dict[str, dict[str, Any]]:
        listed = await super().queues()
        active: dict[str, dict[str, Any]] = {}
        for name, options in listed.items():
            meta = await self._sharded.queue_info(name)
            if meta is not None and meta.get("active"):
                active[name] = {**options, "sharded": meta}
        return active
