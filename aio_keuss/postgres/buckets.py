"""bucket-postgres: the bucket store (``bucket.py``) over PostgreSQL; this file holds only its
atomic bucket operations, each ONE statement (one round trip, its own transaction).

The connection pool, schema, signal bus (LISTEN/NOTIFY) and stats store are those of the
``postgres`` backend, which this one extends with one table (created on connect):

``buckets(queue, id, score, owner, count, remaining, blob, state)``, keyed by (queue, id),
indexed by (queue, score, id) for leasing. ``blob`` and ``state`` are stored uncompressed
(``STORAGE EXTERNAL``): compressing them would cost server CPU on every write for little
gain, and an UPDATE of ``state`` leaves the large, never-changing ``blob`` untouched.

Leasing is ``UPDATE ... FROM (SELECT ... ORDER BY score, id FOR UPDATE SKIP LOCKED)``, so
concurrent consumers never wait for each other nor take the same bucket. Times come from the
caller (see ``bucket.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, ClassVar

from ..buckets.settings import bucket_backend_options
from ..buckets.storage import BucketStorage, Census, Lease, LeasedBucket, NewBucket, StateWrite
from ..buckets.store import BucketBackend
from .backend import PostgresBackend
from .connection import SCHEMA_LOCK, postgres_errors_translated

_DDL = """
DO $$ BEGIN
IF to_regclass('{s}.buckets') IS NULL THEN
CREATE TABLE {s}.buckets (
    queue     text NOT NULL,
    id        text NOT NULL,
    score     double precision NOT NULL,
    owner     text NOT NULL DEFAULT '',
    count     integer NOT NULL,
    remaining integer NOT NULL,
    blob      bytea NOT NULL,
    state     bytea NOT NULL,
    PRIMARY KEY (queue, id)
);
ALTER TABLE {s}.buckets ALTER COLUMN blob SET STORAGE EXTERNAL;
ALTER TABLE {s}.buckets ALTER COLUMN state SET STORAGE EXTERNAL;
CREATE INDEX buckets_by_score ON {s}.buckets (queue, score, id);
END IF;
END $$;
"""

# $1 queue; then one array per column.
_INSERT = """
INSERT INTO {s}.buckets (queue, id, score, count, remaining, blob, state)
SELECT $1, b.id, b.score, b.count, b.count, b.blob, b.state
FROM unnest($2::text[], $3::float8[], $4::int4[], $5::bytea[], $6::bytea[])
     AS b(id, score, count, blob, state)
"""

# $1 queue, $2 token, $3 now, $4 deadline, $5 want, $6 max buckets. Candidates are locked
# (skipping ones another lease holds), then the oldest are kept until their remaining
# messages cover ``want``. Locking CTEs are MATERIALIZED so they are evaluated exactly once
# whatever plan is chosen: a lease updates exactly the buckets it returns. One row per leased
# bucket plus the lowest score left; a single row with a NULL id when nothing was leased.
_LEASE = """
WITH candidate AS MATERIALIZED (
    SELECT id, score, owner, remaining FROM {s}.buckets
    WHERE queue = $1 AND score <= $3
    ORDER BY score, id
    LIMIT $6
    FOR UPDATE SKIP LOCKED
), pick AS (
    SELECT id, score, owner FROM (
        SELECT id, score, owner,
               sum(remaining) OVER (ORDER BY score, id) - remaining AS before,
               row_number() OVER (ORDER BY score, id) AS n
        FROM candidate
    ) c
    WHERE before < $5 OR n = 1
), leased AS (
    UPDATE {s}.buckets b SET owner = $2, score = $4
    FROM pick
    WHERE b.queue = $1 AND b.id = pick.id
    RETURNING b.id, b.blob, b.state, pick.owner AS previous, pick.score AS old_score
), rest AS (
    SELECT min(score) AS low FROM {s}.buckets
    WHERE queue = $1 AND id NOT IN (SELECT id FROM pick)
)
SELECT l.id, l.blob, l.state, l.previous, r.low
FROM rest r LEFT JOIN leased l ON true
ORDER BY l.old_score, l.id
"""

# $1 queue, $2 token, $3 now, $4 deadline, $5 ids: the free ones, or those whose lease expired.
_LEASE_IDS = """
WITH pick AS MATERIALIZED (
    SELECT id, owner FROM {s}.buckets
    WHERE queue = $1 AND id = ANY($5::text[]) AND (owner = '' OR score <= $3)
    FOR UPDATE SKIP LOCKED
)
UPDATE {s}.buckets b SET owner = $2, score = $4
FROM pick
WHERE b.queue = $1 AND b.id = pick.id
RETURNING b.id, b.blob, b.state, pick.owner AS previous
"""

# $1 queue, $2 token, then one array per StateWrite field; only rows still owned by $2.
_WRITE = """
WITH w AS (
    SELECT * FROM unnest($3::text[], $4::text[], $5::float8[], $6::int4[], $7::bytea[])
        AS w(id, mode, score, remaining, state)
), deleted AS (
    DELETE FROM {s}.buckets b USING w
    WHERE b.queue = $1 AND b.id = w.id AND b.owner = $2 AND w.mode = 'd'
    RETURNING b.id
), updated AS (
    UPDATE {s}.buckets b
    SET score = w.score, remaining = w.remaining, state = coalesce(w.state, b.state),
        owner = CASE WHEN w.mode = 'r' THEN '' ELSE b.owner END
    FROM w
    WHERE b.queue = $1 AND b.id = w.id AND b.owner = $2 AND w.mode <> 'd'
    RETURNING b.id
)
SELECT id FROM deleted UNION ALL SELECT id FROM updated
"""

# $1 queue, $2 now, $3 excluded ids.
_CENSUS = """
SELECT coalesce(sum(remaining) FILTER (WHERE score <= $2), 0),
       coalesce(sum(remaining) FILTER (WHERE score > $2 AND owner = ''), 0),
       coalesce(sum(remaining) FILTER (WHERE score > $2 AND owner <> ''), 0),
       min(score)
FROM {s}.buckets
WHERE queue = $1 AND id <> ALL($3::text[])
"""


class PostgresBucketStorage(BucketStorage):
    def __init__(self, backend: PostgresBackend) -> None:
        self._backend = backend
        schema = backend.quoted_schema
        self.insert_sql = _INSERT.replace("{s}", schema)
        self.lease_sql = _LEASE.replace("{s}", schema)
        self.lease_ids_sql = _LEASE_IDS.replace("{s}", schema)
        self.write_sql = _WRITE.replace("{s}", schema)
        self.census_sql = _CENSUS.replace("{s}", schema)

    async def insert_buckets(self, queue: str, buckets: Sequence[NewBucket]) -> None:
        with postgres_errors_translated():
            await self._backend.pool.execute(
                self.insert_sql,
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
    ) -> Lease:
        pool = self._backend.pool
        with postgres_errors_translated():
            if ids is not None:
                rows = await pool.fetch(self.lease_ids_sql, queue, token, now, deadline, list(ids))
                return Lease([LeasedBucket(r[0], r[1], r[2], r[3]) for r in rows], None)
            rows = await pool.fetch(self.lease_sql, queue, token, now, deadline, want, max_buckets)
        buckets = [LeasedBucket(r[0], r[1], r[2], r[3]) for r in rows if r[0] is not None]
        return Lease(buckets, rows[0][4] if rows else None)

    async def write(self, queue: str, token: str, writes: Sequence[StateWrite]) -> list[bool]:
        with postgres_errors_translated():
            rows = await self._backend.pool.fetch(
                self.write_sql,
                queue,
                token,
                [w.id for w in writes],
                [w.mode for w in writes],
                [w.score for w in writes],
                [w.remaining for w in writes],
                [w.state for w in writes],
            )
        done = {r[0] for r in rows}
        return [w.id in done for w in writes]

    async def census(self, queue: str, exclude: Collection[str], now: float) -> Census:
        with postgres_errors_translated():
            row = await self._backend.pool.fetchrow(self.census_sql, queue, now, list(exclude))
        assert row is not None  # an aggregate always answers one row
        return Census(int(row[0]), int(row[1]), int(row[2]), row[3])


class PostgresBucketBackend(BucketBackend, PostgresBackend):
    """``bucket-postgres``: the postgres options (url, pool, schema, pool sizes) plus the
    bucket options of :data:`aio_keuss.buckets.settings.BUCKET_OPTIONS` (seconds)."""

    name = "bucket-postgres"
    options: ClassVar[dict[str, Any]] = bucket_backend_options(
        PostgresBackend.options, without="durable_acks"
    )

    def __init__(self, options: dict[str, Any]) -> None:
        # durable_acks tunes the per-message tables only; bucket state has its own flusher
        super().__init__({**options, "durable_acks": True})
        self.use_storage(PostgresBucketStorage(self))

    async def open(self) -> None:
        await super().open()
        try:
            with postgres_errors_translated():
                async with self.pool.acquire() as connection, connection.transaction():
                    await connection.execute(SCHEMA_LOCK, self.schema)
                    await connection.execute(_DDL.replace("{s}", self.quoted_schema))
        except BaseException:
            await self.close()
            raise
