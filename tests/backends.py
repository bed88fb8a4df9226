"""The registry the conformance suite runs over: one entry per backend.

Each entry gives the ``connect`` options for one test (its own Redis key prefix or PostgreSQL
schema, so tests never see each other's data) and a cleanup that removes what the test made.
Adding a backend = one Store module + one entry here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from mongo_server import MONGO_URL, start_mongo
from redis_cluster import _drop_redis_cluster_prefix, _redis_cluster, start_redis_cluster

import aio_keuss
from aio_keuss.registry import load_backend

REDIS_URL = os.environ.get("AK_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("AK_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@dataclass(frozen=True)
class BackendCase:
    name: str
    options: Callable[[str], dict[str, Any]]
    """connect() options for a test, given a unique token for its keys / schema."""
    cleanup: Callable[[dict[str, Any]], Awaitable[None]] | None = None
    shared: bool = True
    """Whether two factories with the same options see the same queues."""
    label: str | None = None
    """Test id when one backend runs in several set-ups (e.g. on Redis Cluster)."""
    setup: Callable[[], str | None] | None = None
    """Run before the case's first test (start a server); returns a skip reason or None."""
    marks: tuple[Any, ...] = field(default=())
    modules: frozenset[str] | None = None
    """Test modules (by name) this case runs in; None: all. A variant of a backend whose
    difference touches only some behaviour need not rerun the rest of the suite."""

    @property
    def id(self) -> str:
        return self.label or self.name

    def available(self) -> str | None:
        """None when usable, else why the suite skips it."""
        try:
            load_backend(self.name)
        except ImportError as exc:
            return f"{self.name}: {exc}"
        if self.setup is not None:
            if self.id not in _SETUP_DONE:
                _SETUP_DONE[self.id] = self.setup()
            return _SETUP_DONE[self.id]
        return None

    @contextlib.asynccontextmanager
    async def keys(self) -> AsyncIterator[dict[str, Any]]:
        """The case's options for one test's own keys, removed after; the test is skipped
        where the case is not usable here."""
        reason = self.available()
        if reason:
            pytest.skip(reason)
        options = self.options(new_token())
        try:
            yield options
        finally:
            if self.cleanup is not None:
                await self.cleanup(options)


_SETUP_DONE: dict[str, str | None] = {}


def _no_options(_: str) -> dict[str, Any]:
    return {}


async def _drop_redis_prefix(options: dict[str, Any]) -> None:
    redis = importlib.import_module("redis.asyncio")
    client = redis.Redis.from_url(options.get("url", REDIS_URL))
    try:
        keys = [key async for key in client.scan_iter(match=options["prefix"] + ":*", count=1000)]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
    finally:
        await client.aclose()


async def _drop_postgres_schema(options: dict[str, Any]) -> None:
    asyncpg = importlib.import_module("asyncpg")
    connection = await asyncpg.connect(options.get("url", POSTGRES_URL))
    try:
        await connection.execute(f'DROP SCHEMA IF EXISTS "{options["schema"]}" CASCADE')
    finally:
        await connection.close()


async def _drop_mongo_database(options: dict[str, Any]) -> None:
    pymongo = importlib.import_module("pymongo")
    client = pymongo.AsyncMongoClient(options.get("url", MONGO_URL))
    try:
        await client.drop_database(options["database"])
    finally:
        await client.close()


async def _drop_sqlite_file(options: dict[str, Any]) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(options["path"] + suffix)


def _sqlite(token: str) -> dict[str, Any]:
    """A database file of the test's own, in the temporary directory."""
    return {"path": os.path.join(tempfile.gettempdir(), f"akt-{token}.db")}


def _mongo(token: str) -> dict[str, Any]:
    return {"url": MONGO_URL, "database": f"akt_{token}"}


def _redis(token: str) -> dict[str, Any]:
    return {"url": REDIS_URL, "prefix": f"akt-{token}"}


def _postgres(token: str) -> dict[str, Any]:
    return {"url": POSTGRES_URL, "schema": f"akt_{token}"}


# Bucket backends flush on timers: short ones keep the suite fast.
# The conformance suite expects a ko without delay to be due at once: no retry polynomial.
_BUCKET_FAST: dict[str, Any] = {
    "bucket_max_wait": 0.02,
    "state_flush_period": 0.05,
    "reject_delta_base": 0.0,
    "reject_delta_factor": 0.0,
}

# The sweeper sidelines expired reservations and the shovel brings them back: short periods
# keep the redelivery tests fast. Several shards, so the suite crosses them.
_SHARDED_FAST: dict[str, Any] = {
    "shards": 4,
    "sweep_interval": 0.25,
    "shovel_interval": 0.25,
    "lease_ttl": 2.0,
}

CASES: list[BackendCase] = [
    BackendCase("memory", _no_options, shared=False),
    BackendCase("memory-sharded", lambda _: dict(_SHARDED_FAST), shared=False),
    BackendCase("redis-list", _redis, _drop_redis_prefix),
    BackendCase("redis-oq", _redis, _drop_redis_prefix),
    BackendCase(
        "redis-oq",
        _redis_cluster,
        _drop_redis_cluster_prefix,
        label="redis-oq-cluster",
        setup=start_redis_cluster,
    ),
    BackendCase(  # every queue in one hash slot: move and one-script deadletter on a cluster
        "redis-oq",
        lambda t: {**_redis_cluster(t), "hash_tag": f"akt-{t}"},
        _drop_redis_cluster_prefix,
        label="redis-oq-cluster-one-slot",
        setup=start_redis_cluster,
        # what the shared slot changes: moves and deadletter in one script, finding a
        # message across queues; the rest is the redis-oq-cluster case's code
        modules=frozenset(
            {
                "test_move",
                "test_deadletter",
                "test_pipeline",
                "test_visibility",
                "test_lifecycle",
                "test_reserve",
                "test_chaos",
                "test_priority",  # a priority through a one-script move and deadletter
            }
        ),
    ),
    BackendCase("redis-reliable", _redis, _drop_redis_prefix),
    BackendCase("redis-sharded", lambda t: {**_redis(t), **_SHARDED_FAST}, _drop_redis_prefix),
    BackendCase(
        "redis-sharded",
        # through redis-py (no fast lane): a slower sweep keeps an idle factory idle
        lambda t: {**_redis_cluster(t), **_SHARDED_FAST, "sweep_interval": 0.5},
        _drop_redis_cluster_prefix,
        label="redis-sharded-cluster",
        setup=start_redis_cluster,
    ),
    BackendCase("postgres", _postgres, _drop_postgres_schema),
    BackendCase(  # consumed messages kept: history and replay
        "postgres",
        lambda t: {**_postgres(t), "history": True},
        _drop_postgres_schema,
        label="postgres-history",
        # where messages leave the queue (the history trigger's work) or history is read
        modules=frozenset(
            {
                "test_visibility",
                "test_input",
                "test_lifecycle",
                "test_reserve",
                "test_deadletter",
                "test_move",
                "test_pipeline",
                "test_batching",
                "test_chaos",
                "test_extend",
                "test_priority",  # a replay copies the priority the history kept
                "test_amend_store",  # an amend is an update: the history records nothing
            }
        ),
    ),
    BackendCase("bucket-redis", lambda t: {**_redis(t), **_BUCKET_FAST}, _drop_redis_prefix),
    BackendCase(
        "bucket-postgres", lambda t: {**_postgres(t), **_BUCKET_FAST}, _drop_postgres_schema
    ),
    BackendCase("sqlite", _sqlite, _drop_sqlite_file),
    BackendCase("mongo", _mongo, _drop_mongo_database, setup=start_mongo),
    BackendCase("mongo-history", _mongo, _drop_mongo_database, setup=start_mongo),
    BackendCase(
        "bucket-mongo",
        lambda t: {**_mongo(t), **_BUCKET_FAST},
        _drop_mongo_database,
        setup=start_mongo,
    ),
]


SHARDED_CASES = [c for c in CASES if c.name.endswith("-sharded")]
"""The cases of the sharded model, whatever their storage."""


def new_token() -> str:
    return uuid.uuid4().hex[:12]


async def until_closed(queue: Any) -> None:
    """Until ``queue``'s close has marked it closed, and so waits for what is in flight:
    watched rather than timed, for tests that act on a close at that point (10 s at most)."""
    for _ in range(1000):
        if queue._closed:
            return
        await asyncio.sleep(0.01)


async def ko_through_a_cut_close(
    factory: Any, queue: Any, message: Any, copied: asyncio.Event, store_closing: asyncio.Event
) -> None:
    """ko ``message`` (a deadletter: max_ko 0) and close ``factory`` past its grace while the
    move is between its steps: the caller's hold on the store's step after the copy sets
    ``copied`` and waits for ``store_closing``, set here when the store's close begins.
    For tests that check the message then ends in one queue only."""
    store = queue._store
    close = store.close

    async def close_store() -> None:
        store_closing.set()
        await close()

    store.close = close_store
    ko = asyncio.ensure_future(queue.ko(message))
    await copied.wait()
    closing = asyncio.ensure_future(factory.close())
    await until_closed(queue)  # the close waits for the ko
    closing.cancel()  # past its grace at once: the ko's round trip is given up
    await asyncio.gather(closing, ko, return_exceptions=True)


async def a_poison_reserved(backend: str, **options: Any) -> tuple[Any, Any, Any]:
    """A factory of ``backend`` whose first ko deadletters (max_ko 0), its queue ``work``,
    and the one message pushed there, reserved."""
    factory = await aio_keuss.connect(backend, deadletter={"max_ko": 0}, **options)
    queue = await factory.queue("work")
    await queue.push("poison")
    message = await queue.reserve(timeout=5)
    assert message is not None
    return factory, queue, message


async def sizes_after(backend: str, **options: Any) -> tuple[int, int]:
    """How many messages ``work`` and the deadletter queue hold, seen by a new factory."""
    async with aio_keuss.connect(backend, **options) as other:
        left = await (await other.queue("work")).total_size()
        dead = await (await other.queue("__deadletter__")).total_size()
    return left, dead
