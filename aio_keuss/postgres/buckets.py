"""bucket-postgres: the bucket engine (``aio_keuss.buckets``) over PostgreSQL; this file holds
only its atomic bucket operations, each ONE statement (one round trip, its own transaction):
the ``buckets_*`` blocks of ``sql/queries.sql``.

The pool, schema, signal bus (LISTEN/NOTIFY) and stats store are those every PostgreSQL
backend shares (:class:`PostgresBackend`). The table is one of the schema's migrations:

``buckets(queue, id, score, owner, count, remaining, blob, state, seq)``, keyed by (queue, id),
indexed by (queue, score, id) for leasing, ``blob`` and ``state`` stored uncompressed.

Leasing is ``UPDATE ... FROM (SELECT ... ORDER BY score, id FOR UPDATE SKIP LOCKED)``, so
concurrent consumers never wait for each other nor take the same bucket. Times come from the
caller (the bucket engine's clock).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, ClassVar

from ..buckets.settings import bucket_backend_options
from ..buckets.storage import (
    BucketStorage,
    Census,
    Lease,
    LeasedBucket,
    NewBucket,
    Outcome,
    StateWrite,
)
from ..buckets.store import BucketBackend
from .backend import PostgresBackend
from .connection import PostgresConnectionOptions


class PostgresBucketStorage(BucketStorage):
    def __init__(self, backend: PostgresBackend) -> None:
        self._db = backend
        self._sql = backend.sql

    async def insert_buckets(self, queue: str, buckets: Sequence[NewBucket]) -> None:
        await self._db.execute(
            self._sql["buckets_insert"],
            queue,
            [b.id for b in buckets],
            [b.score for b in buckets],
            [b.count for b in buckets],
            [b.blob for b in buckets],
            [b.state for b in buckets],
        )

    async def lease(
        self,
        queue: str,
        token: str,
        now: float,
        deadline: float,
        want: int,
        max_buckets: int,
        ids: Sequence[str] | None = None,
        exclude: Collection[str] = (),
    ) -> Lease:
        if ids is not None:
            rows = await self._db.fetch(
                self._sql["buckets_lease_ids"], queue, token, now, deadline, list(ids)
            )
            return Lease([LeasedBucket(r[0], r[1], r[2], r[3]) for r in rows], None)
        rows = await self._db.fetch(
            self._sql["buckets_lease"],
            queue,
            token,
            now,
            deadline,
            want,
            max_buckets,
            list(exclude),
        )
        buckets = [LeasedBucket(r[0], r[1], r[2], r[3]) for r in rows if r[0] is not None]
        return Lease(buckets, rows[0][4] if rows else None)

    async def write(self, queue: str, writes: Sequence[StateWrite]) -> list[Outcome]:
        rows = await self._db.fetch(
            self._sql["buckets_write"],
            queue,
            [w.owner for w in writes],
            [w.id for w in writes],
            [w.mode for w in writes],
            [w.score for w in writes],
            [w.remaining for w in writes],
            [w.state for w in writes],
            [w.seq for w in writes],
        )
        stored = {r[0]: r[1] for r in rows}
        return [_outcome(w, stored.get(w.id)) for w in writes]

    async def census(self, queue: str, exclude: Collection[str], now: float) -> Census:
        row = await self._db.fetchrow(self._sql["buckets_census"], queue, now, list(exclude))
        assert row is not None  # an aggregate always answers one row
        return Census(int(row[0]), int(row[1]), int(row[2]), row[3])


def _outcome(write: StateWrite, stored: int | None) -> Outcome:
    """A write's outcome from the number its row holds after it (None: no row owned by its
    lease)."""
    if stored is None:
        return Outcome.LOST
    return Outcome.WRITTEN if stored == write.seq else Outcome.SUPERSEDED


class PostgresBucketBackend(BucketBackend, PostgresBackend):
    """``bucket-postgres``: the options of every PostgreSQL backend (url, pool, schema, pool
    sizes; not ``durable_acks``, which tunes the message table only: bucket state has its
    own flusher) plus the bucket options of
    :data:`aio_keuss.buckets.settings.BUCKET_OPTIONS` (seconds), which the bucket engine
    checks into its own typed settings."""

    name = "bucket-postgres"
    options_type: ClassVar[type[PostgresConnectionOptions]] = PostgresConnectionOptions
    options: ClassVar[dict[str, Any]] = bucket_backend_options(PostgresConnectionOptions.defaults())

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.use_storage(PostgresBucketStorage(self))
