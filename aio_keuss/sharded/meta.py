"""The metadata record of a sharded queue: one per queue, readable from any process.

Written by the first process that opens the queue: its ``shards``, ``message_ttl`` and
``max_consumers`` are the queue's from then on (a later process with other values adopts
them, or, for an explicit ``shards``, is refused). Fields (text, as the storage keeps them):
shards, created (epoch seconds), active (``"true"``), seen (epoch seconds of the last touch),
sweep_duration (the queue's ``reserve_delay``), shovel_interval, shovel_concurrency,
message_ttl and queue_expiry (seconds, ``""`` = none), max_batch, max_consumers. Per-shard
sweep pointers and swept / shoveled / expired counters are the shard's own (so each step
advances them atomically); ``ShardedStore.shard_sizes()`` reads them.

Queue expiry: with ``queue_expiry`` set, the record lives ``2 * queue_expiry`` seconds
(IgnisMQ's safety factor) past the last time a process touched the queue (a push or fetch
touches it at most every quarter of ``queue_expiry``). Once it is gone the queue is idle:
the leader takes it off the list it sweeps, and ``factory.list()`` no longer shows it. Its
messages are not deleted: they stay in their shards (where a message TTL, if set, still ends
them when a step meets them), and a process that opens the queue again writes a new record
and finds them; records fired and never acknowledged wait for that too, since the sweeper
no longer visits the queue.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from .settings import MAX_CONSUMERS
from .storage import MetaRecord

if TYPE_CHECKING:
    from ..options import QueueOptions
    from .settings import ShardedOptions

EXPIRY_FACTOR = 2
"""The metadata record lives this many times ``queue_expiry`` past its last touch."""


def record(shards: int, options: QueueOptions, sharded: ShardedOptions) -> dict[str, str]:
    """The metadata record a process writes when it opens a queue."""
    ttl, expiry = sharded.message_ttl, sharded.queue_expiry
    return {
        "shards": str(shards),
        "created": repr(time.time()),
        "sweep_duration": repr(options.reserve_delay),
        "shovel_interval": repr(sharded.shovel_interval),
        "shovel_concurrency": str(sharded.shovel_concurrency),
        "message_ttl": repr(ttl) if ttl else "",
        "queue_expiry": repr(expiry) if expiry else "",
        "max_batch": str(options.max_batch),
        "max_consumers": str(sharded.max_consumers),
    }


def life(sharded: ShardedOptions) -> float | None:
    """How long the record lives past a touch (None: for ever)."""
    return sharded.queue_expiry * EXPIRY_FACTOR if sharded.queue_expiry else None


def touch_period(sharded: ShardedOptions) -> float | None:
    """How often a store in use renews its queue's record (None: written once, no TTL)."""
    return sharded.queue_expiry / 4 if sharded.queue_expiry else None


@dataclass(frozen=True, slots=True)
class Adopted:
    """The settings a queue's record fixes for every process that opens it."""

    shards: int
    message_ttl: float | None
    max_consumers: int

    @classmethod
    def of(cls, stored: MetaRecord) -> Adopted:
        ttl, most = stored.get("message_ttl"), stored.get("max_consumers")
        return cls(
            int(stored["shards"]), float(ttl) if ttl else None, int(most) if most else MAX_CONSUMERS
        )


def decode(fields: MetaRecord) -> dict[str, Any]:
    """A metadata record as Python values (numbers as numbers, ``""`` as None)."""
    found: dict[str, Any] = {}
    for name, text in fields.items():
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


async def active_queues(
    listed: dict[str, dict[str, Any]],
    info: Callable[[str], Awaitable[dict[str, Any] | None]],
) -> dict[str, dict[str, Any]]:
    """What ``factory.list()`` shows of a sharded backend: the queues whose metadata record
    exists and is active, each with it under ``"sharded"``."""
    active: dict[str, dict[str, Any]] = {}
    for name, options in listed.items():
        found = await info(name)
        if found is not None and found.get("active"):
            active[name] = {**options, "sharded": found}
    return active
