"""Checks shared by the sharded model's tests on every storage and the Redis-only ones."""

from __future__ import annotations

import aio_keuss
from aio_keuss.sharded.backend import ShardedBackend


async def assert_metadata_of_q(reader: aio_keuss.Factory) -> None:
    """Queue ``q``'s metadata record as ``reader`` reads it, where a factory opened it with 4
    shards, ``message_ttl=60``, ``queue_expiry=3600`` and ``reserve_delay=30``."""
    backend = reader.backend
    assert isinstance(backend, ShardedBackend)
    info = await backend.queue_info("q")
    assert info is not None
    assert info["shards"] == 4 and info["active"] is True
    assert info["message_ttl"] == 60.0 and info["queue_expiry"] == 3600.0
    assert info["sweep_duration"] == 30.0 and info["max_consumers"] == 100
    assert info["created"] <= info["seen"] + 1
    listed = await reader.list()
    assert listed["q"]["sharded"]["shards"] == 4
    assert await backend.queue_info("never-opened") is None
