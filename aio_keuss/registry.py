"""The registry of backends by name; a backend's module is imported only when asked for."""

from __future__ import annotations

import importlib

from .contract import Backend, Store
from .errors import ConfigError, MissingDependencyError
from .types import Capabilities

# name -> (module, class, extra that installs its driver)
_REGISTRY: dict[str, tuple[str, str, str | None]] = {
    "memory": ("aio_keuss.memory", "MemoryBackend", None),
    "memory-sharded": ("aio_keuss.sharded.memory", "MemoryShardedBackend", None),
    "redis-list": ("aio_keuss.redis.list", "RedisListBackend", "redis"),
    "redis-oq": ("aio_keuss.redis.oq", "RedisOQBackend", "redis"),
    "redis-reliable": ("aio_keuss.redis.reliable", "RedisReliableBackend", "redis"),
    "redis-sharded": ("aio_keuss.redis.sharded", "RedisShardedBackend", "redis"),
    "postgres": ("aio_keuss.postgres.store", "PostgresQueueBackend", "postgres"),
    "bucket-redis": ("aio_keuss.redis.buckets", "RedisBucketBackend", "redis"),
    "bucket-postgres": ("aio_keuss.postgres.buckets", "PostgresBucketBackend", "postgres"),
    "bucket-mongo": ("aio_keuss.mongo.buckets", "MongoBucketBackend", "mongo"),
    "mongo": ("aio_keuss.mongo.store", "MongoQueueBackend", "mongo"),
    "mongo-history": ("aio_keuss.mongo.store", "MongoHistoryBackend", "mongo"),
    "sqlite": ("aio_keuss.sqlite.store", "SqliteQueueBackend", None),
}


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def load_backend(name: str) -> type[Backend]:
    try:
        module_name, class_name, extra = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown backend {name!r}; known: {', '.join(backend_names())}"
        ) from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if extra is None or exc.name is None or exc.name.startswith("aio_keuss"):
            raise
        raise MissingDependencyError(extra, exc.name) from exc
    backend: type[Backend] = getattr(module, class_name)
    return backend


__all__ = ["Backend", "Capabilities", "Store", "backend_names", "load_backend"]
