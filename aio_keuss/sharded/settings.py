"""The sharded model's options (seconds), their checks, its constants, and which shard a
message belongs to."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import orjson

from ..errors import ConfigError
from ..options import BackendOptions, check_bool, check_int, check_option_seconds
from ..types import Capabilities

CAPABILITIES = Capabilities(
    remove=False, reservation_expiry=True, move=False, fifo=False, extend=True
)
"""No remove, no atomic move (so no pipelines), order within a shard only."""

SHARD_KEY_HEADER = "x-shard-key"
MAX_SHARDS = 512
MAX_CONSUMERS = 100
"""Consumers a queue allows across processes (IgnisMQ's ``MAX_CONSUMERS_ALLOWED``)."""
PUSH_CHUNK = 100
"""Messages of one batch loaded into one shard before the next shard takes the rest."""
FIRE_SHARE = 16
"""Messages a fetch asks of each shard it fires from: a coalesced fetch of 32 fires from two
shards, not from 32 (one step each); the rotation spreads successive fetches."""
REFRESH = 0.05
"""Seconds a consumer serves its own rotation of ready shards before reading the index
again (sooner when the rotation runs out), so it sees shards that gained work meanwhile."""
SWEEP_BATCH = 1000
"""Records one sweep step looks at (IgnisMQ's ``SWEEP_BATCH_SIZE``), so the storage is never
blocked for long."""
SHOVEL_BATCH = 1000
"""Records one shovel step moves."""
SWEEP_CONCURRENCY = 8
"""Shards of one queue swept at once."""
REPAIR_PASSES = 10
"""Every this many passes the sweeper sweeps every shard, those it found with nothing to do
included: so a ready hint lost when a process died between its load and its announcement is
restored within ``REPAIR_PASSES * sweep_interval`` (10 s by default). The other passes
sweep only the shards that may have work (see the sweeper)."""


@dataclass(frozen=True)
class ShardedOptions(BackendOptions):
    """The sharded model's ``connect`` options (see ``docs/sharded.md``)."""

    shards: int = 32
    sweeper: bool = True
    sweep_interval: float = 1.0
    shovel_interval: float = 5.0
    shovel_concurrency: int = 4
    lease_ttl: float = 10.0
    message_ttl: float = 0.0
    queue_expiry: float = 0.0
    max_consumers: int = MAX_CONSUMERS

    def __post_init__(self) -> None:
        check_int(self.shards, "shards", 1, MAX_SHARDS)
        check_bool(self.sweeper, "sweeper")
        check_int(self.shovel_concurrency, "shovel_concurrency", 1, 64)
        check_int(self.max_consumers, "max_consumers", 1, MAX_CONSUMERS)
        for what in ("sweep_interval", "shovel_interval", "lease_ttl"):
            seconds = check_option_seconds(getattr(self, what), what)
            if seconds < 0.01 or seconds > 86400:
                raise ConfigError(f"{what} must be seconds in [0.01, 86400], not {seconds!r}")
        check_option_seconds(self.message_ttl, "message_ttl")
        check_option_seconds(self.queue_expiry, "queue_expiry")
        if self.lease_ttl <= self.sweep_interval:
            raise ConfigError("lease_ttl must be longer than sweep_interval (it is renewed then)")


_SUFFIX = re.compile(r"~(\d{1,3})$")
_KEY_MARK = SHARD_KEY_HEADER.encode()


def shard_of(message_id: str, shards: int) -> int:
    """The shard of a message, from its id alone: ids the queue makes end in ``~<shard>``;
    any other id goes to ``crc32(id) % shards``. So ``ok`` / ``ko`` and the dedup check of
    an explicit id need no lookup."""
    found = _SUFFIX.search(message_id)
    if found is not None and int(found.group(1)) < shards:
        return int(found.group(1))
    return zlib.crc32(message_id.encode()) % shards


def key_shard(headers: bytes, shards: int) -> int | None:
    """The shard the ``x-shard-key`` header hashes to, if the message has one."""
    if _KEY_MARK not in headers:
        return None
    key = orjson.loads(headers).get(SHARD_KEY_HEADER)
    if key is None:
        return None
    return zlib.crc32(str(key).encode()) % shards
