"""What every Redis backend shares: the connection, key naming and error translation.

All keys of one queue carry the hash tag ``{queue}`` so that every script touching one queue
runs on one Redis Cluster node.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigError, MissingDependencyError, translate_errors
from .base import Backend

try:
    import redis.asyncio as aioredis
    from redis import exceptions as redis_errors
    from redis.asyncio.cluster import RedisCluster
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("redis", "redis") from exc

if TYPE_CHECKING:
    from ..signal.base import SignalBus
    from ..stats.base import StatsStore

RedisClient = aioredis.Redis | RedisCluster


@contextmanager
def redis_errors_translated() -> Iterator[None]:
    with translate_errors(
        (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError),
        (redis_errors.RedisError,),
    ):
        yield


class RedisBackend(Backend):
    """Base of the Redis backends: ``url=`` (or ``client=``), ``prefix=``, ``cluster=``."""

    options: ClassVar[dict[str, Any]] = {
        "url": "redis://127.0.0.1:6379/0",
        "client": None,
        "prefix": "keuss",
        "cluster": False,
    }

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        prefix = self.settings["prefix"]
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise ConfigError(f"prefix must be a non-empty str without braces, not {prefix!r}")
        self.prefix: str = prefix
        self._owns_client = self.settings["client"] is None
        self.client: RedisClient = self.settings["client"] or self._make_client()

    def _make_client(self) -> RedisClient:
        url = self.settings["url"]
        if not isinstance(url, str):
            raise ConfigError(f"url must be a str, not {url!r}")
        if self.settings["cluster"]:
            return RedisCluster.from_url(url, decode_responses=False)
        return aioredis.Redis.from_url(url, decode_responses=False)

    async def open(self) -> None:
        with redis_errors_translated():
            await self.client.ping()

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    def key(self, queue: str, *parts: str) -> str:
        """``prefix:{queue}:part:...`` — the braces make one cluster slot per queue."""
        return ":".join((self.prefix, "{" + queue + "}", *parts))

    def signal_bus(self, debounce: float) -> SignalBus:
        from ..signal.redis import RedisSignalBus

        return RedisSignalBus(self, debounce)

    def stats_store(self) -> StatsStore:
        from ..stats.redis import RedisStats

        return RedisStats(self)
