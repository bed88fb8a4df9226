"""postgres: every queue of a schema in one table, dequeued with ``FOR UPDATE SKIP LOCKED``.

Layout (schema ``keuss`` by default, created on first connect, see ``_SCHEMA_DDL``):

- ``messages``: one row per queued message of *every* queue, keyed by ``(queue, id)``.
  ``mature`` is float epoch seconds from the server clock; a reserved message's ``mature`` is
  its reservation deadline, so an expired reservation simply becomes mature again and the
  next reserve counts that delivery as a try (``tries + reserved::int``). ``seq`` (an
  identity column) breaks ties between equal mature times so equal-time messages leave in
  insertion order. One table for all queues means a deadletter move (and later a pipeline
  step) is a single ``UPDATE ... SET queue = ...``: atomic by construction.
- ``dedup``: ``(queue, id, expires)`` for ids the user chose, so an id stays refused for the
  dedup window even after its message was consumed. Expired rows are purged a hundred at a
  time by the next idempotent push of that queue.
- ``stats`` and ``queues`` (counters; options and the paused flag) belong to
  :mod:`aio_keuss.postgres.stats`.

Every primitive is ONE statement (one round trip, its own implicit transaction), built from
data-modifying CTEs over ``unnest``-ed array parameters so a coalesced batch of any size costs
the same single prepared statement. Time is always ``now()`` on the server: clients with
skewed clocks agree on what is mature, and a reservation deadline is the server's *now* plus
``reserve_delay`` (never the old mature time plus the delay, Keuss's redis-oq mistake).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from ..contract import Ack, Backend, DeadletterPlan, Entry, Fetched, Nack, Store, Stored
from ..errors import BackendError, ConfigError, MissingDependencyError, translate_errors
from ..options import brief, without_password
from ..types import Capabilities, KoResult, Sizes

try:
    import asyncpg  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("postgres", "asyncpg") from exc

if TYPE_CHECKING:
    from ..options import QueueOptions
    from ..signal import SignalBus
    from ..stats import StatsStore

# Driver errors meaning "the server is (or was) out of reach": the caller may retry later.
# SQLSTATEs from the PostgreSQL manual's "PostgreSQL Error Codes" appendix.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.PostgresConnectionError,  # 08xxx, incl. ConnectionDoesNotExistError
    asyncpg.exceptions.CannotConnectNowError,  # 57P03: starting up / shutting down
    asyncpg.exceptions.AdminShutdownError,  # 57P01: server restarted under us
    asyncpg.exceptions.CrashShutdownError,  # 57P02
    asyncpg.exceptions.IdleSessionTimeoutError,  # 57P05: the server closed an idle session
    # 53300: refused at connection start while max_connections are in use; nothing ran,
    # and a retry succeeds once other clients let go
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.InterfaceError,  # e.g. "connection is closed", "pool is closing" (not misuse below)
    # a connection broken mid-operation can leave asyncpg's protocol in a bad state
    asyncpg.exceptions._base.InternalClientError,
    OSError,  # refused, reset, unreachable
    TimeoutError,  # connect / command timeouts
)

# asyncpg's InterfaceErrors that say nothing about the connection, so a retry cannot help: a
# bad connection setting (a ConfigError), an argument it cannot encode, a feature the client
# or the server lacks (BackendErrors). Looked up by name: not every supported asyncpg has all.
_CONFIG_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(asyncpg.exceptions._base, name)
    for name in ("ClientConfigurationError",)
    if hasattr(asyncpg.exceptions._base, name)
)
_MISUSE_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(asyncpg.exceptions._base, name)
    for name in ("DataError", "UnsupportedClientFeatureError", "UnsupportedServerFeatureError")
    if hasattr(asyncpg.exceptions._base, name)
)

_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")

# Serializes concurrent schema creation across processes (CREATE ... IF NOT EXISTS alone
# races on the catalog's unique indexes). The key is derived from the schema name.
_SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(hashtext('aio_keuss:' || $1))"

_SCHEMA_DDL = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.messages (
    queue    text NOT NULL,
    id       text NOT NULL,
    seq      bigint GENERATED ALWAYS AS IDENTITY,
    mature   double precision NOT NULL,
    tries    integer NOT NULL DEFAULT 0,
    reserved boolean NOT NULL DEFAULT false,
    payload  bytea NOT NULL,
    headers  bytea NOT NULL,
    PRIMARY KEY (queue, id)
);
CREATE INDEX IF NOT EXISTS messages_by_mature ON {s}.messages (queue, mature, seq);
CREATE TABLE IF NOT EXISTS {s}.dedup (
    queue   text NOT NULL,
    id      text NOT NULL,
    expires double precision NOT NULL,
    PRIMARY KEY (queue, id)
);
CREATE TABLE IF NOT EXISTS {s}.stats (
    queue   text NOT NULL,
    counter text NOT NULL,
    value   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (queue, counter)
);
CREATE TABLE IF NOT EXISTS {s}.queues (
    queue   text PRIMARY KEY,
    options jsonb NOT NULL DEFAULT '{}',
    paused  boolean NOT NULL DEFAULT false
);
"""

# --- the atomic primitives ---------------------------------------------------------------
# $1 is always the queue name. "now" is extract(epoch from now()): the server's clock,
# stable within the statement, usable as an index condition.

# Insert without user ids (generated ids, put-backs): no dedup table involved. A put-back
# carries its own mature time and tries; others get now + delay.
_INSERT = """
INSERT INTO {s}.messages (queue, id, mature, tries, payload, headers)
SELECT $1, e.id, coalesce(e.mature, extract(epoch from now())::float8 + e.delay),
       e.tries, e.payload, e.headers
FROM unnest($2::text[], $3::bytea[], $4::bytea[], $5::float8[], $6::int4[], $7::float8[])
     WITH ORDINALITY AS e(id, payload, headers, delay, tries, mature, ord)
ORDER BY e.ord
ON CONFLICT DO NOTHING
RETURNING id
"""

# Insert with some user-chosen ids ($8[k] true): an id remembered in ``dedup`` within the
# window is refused even though its message is gone; a queued one is refused by the primary
# key. Inserted user ids are remembered until now + window ($9). A hundred expired dedup
# rows of the queue are purged on the way (never ones this statement touches).
_INSERT_DEDUP = """
WITH entry AS (
    SELECT * FROM unnest($2::text[], $3::bytea[], $4::bytea[], $5::float8[], $6::int4[],
                         $7::float8[], $8::bool[])
           WITH ORDINALITY AS e(id, payload, headers, delay, tries, mature, dedup, ord)
), expired AS MATERIALIZED (
    SELECT x.id FROM {s}.dedup x
    WHERE x.queue = $1 AND x.expires <= extract(epoch from now())::float8
      AND x.id <> ALL($2::text[])
    LIMIT 100 FOR UPDATE SKIP LOCKED
), purged AS (
    DELETE FROM {s}.dedup d
    USING expired x
    WHERE d.queue = $1 AND d.id = x.id
), inserted AS (
    INSERT INTO {s}.messages (queue, id, mature, tries, payload, headers)
    SELECT $1, e.id, coalesce(e.mature, extract(epoch from now())::float8 + e.delay),
           e.tries, e.payload, e.headers
    FROM entry e
    WHERE NOT (e.dedup AND EXISTS (
        SELECT 1 FROM {s}.dedup d
        WHERE d.queue = $1 AND d.id = e.id
          AND d.expires > extract(epoch from now())::float8))
    ORDER BY e.ord
    ON CONFLICT DO NOTHING
    RETURNING id
), remembered AS (
    INSERT INTO {s}.dedup (queue, id, expires)
    SELECT DISTINCT $1, i.id, extract(epoch from now())::float8 + $9::float8
    FROM inserted i JOIN entry e ON e.id = i.id AND e.dedup
    ON CONFLICT (queue, id) DO UPDATE SET expires = EXCLUDED.expires
)
SELECT id FROM inserted
"""

# Pop: delete up to $2 mature messages, earliest first, skipping rows other consumers hold
# locked. The pick is MATERIALIZED: a ``LIMIT ... FOR UPDATE SKIP LOCKED`` subquery inlined
# into the DELETE may be evaluated more than once by some plans (a rescan skips nothing it
# locked itself, so it can match other rows), and the DELETE would then remove rows it
# never returns. A materialized CTE is computed exactly once (PostgreSQL manual, "WITH
# Queries": MATERIALIZED), so the statement deletes exactly the rows it locked and returns.
# next_mature comes in the same round trip: the statement's snapshot still sees the
# deleted rows, so they are excluded by id. One row with a NULL id when nothing was taken.
_GET = """
WITH pick AS MATERIALIZED (
    SELECT id FROM {s}.messages
    WHERE queue = $1 AND mature <= extract(epoch from now())::float8
    ORDER BY mature, seq
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), taken AS (
    DELETE FROM {s}.messages m
    USING pick
    WHERE m.queue = $1 AND m.id = pick.id
    RETURNING m.id, m.payload, m.headers, m.tries + m.reserved::int AS tries, m.mature, m.seq
), next AS (
    SELECT min(mature) AS next_mature FROM (
        SELECT mature FROM {s}.messages
        WHERE queue = $1 AND id NOT IN (SELECT id FROM taken)
        ORDER BY mature, seq
        LIMIT 1
    ) rest
)
SELECT t.id, t.payload, t.headers, t.tries, t.mature, n.next_mature
FROM next n LEFT JOIN taken t ON true
ORDER BY t.mature, t.seq
"""

# Reserve: up to $2 mature messages get mature = server now + $3 (their deadline) and
# reserved = true (the pick is MATERIALIZED for the reason given at pop); one whose
# earlier reservation expired counts that delivery as a try.
# Consumers see the mature time the message had before (when it became deliverable).
_RESERVE = """
WITH pick AS MATERIALIZED (
    SELECT id, mature, seq FROM {s}.messages
    WHERE queue = $1 AND mature <= extract(epoch from now())::float8 {relax}
    ORDER BY mature, seq
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), held AS (
    UPDATE {s}.messages m
    SET mature = extract(epoch from now())::float8 + $3::float8,
        tries = m.tries + m.reserved::int,
        reserved = true
    FROM pick
    WHERE m.queue = $1 AND m.id = pick.id
    RETURNING m.id, m.payload, m.headers, m.tries, pick.mature, pick.seq
), next AS (
    SELECT least(
        (SELECT mature FROM {s}.messages
         WHERE queue = $1 AND id NOT IN (SELECT id FROM pick)
         ORDER BY mature, seq LIMIT 1),
        CASE WHEN EXISTS (SELECT 1 FROM pick)
             THEN extract(epoch from now())::float8 + $3::float8 END
    ) AS next_mature
)
SELECT h.id, h.payload, h.headers, h.tries, h.mature, n.next_mature
FROM next n LEFT JOIN held h ON true
ORDER BY h.mature, h.seq
"""

# Commit: delete what is still reserved, with the tries the holder was given ($3[k], NULL =
# any): a consumer whose reservation expired and went to someone else deletes nothing.
_COMMIT = """
DELETE FROM {s}.messages m
USING unnest($2::text[], $3::int4[]) AS a(id, tries)
WHERE m.queue = $1 AND m.id = a.id AND m.reserved
  AND (a.tries IS NULL OR m.tries = a.tries) {relax}
RETURNING m.id
"""

# Rollback, and deadletter in the same statement. For each held message (same guard as a
# commit) the failed-delivery count is tries + count_try. Past max_ko ($6, NULL = no
# deadletter) it moves to queue $7 in place: tries 0, mature now, headers appended as
# message.append_headers does (x-dl-from-queue from $8, x-dl-t server now in Python's
# isoformat, x-dl-tries); an id already present there gets a ".dl<tries>.<seq>" suffix
# (seq is unique per row, so the renamed id cannot collide with an earlier move).
# Others are released: reserved = false, mature = now + delay.
_ROLLBACK = """
WITH nack AS (
    SELECT DISTINCT ON (n.id) n.* FROM unnest($2::text[], $3::int4[], $4::float8[], $5::bool[])
           WITH ORDINALITY AS n(id, tries, delay, count_try, ord)
    ORDER BY n.id, n.ord
), held AS MATERIALIZED (
    SELECT m.id, m.tries + n.count_try::int AS failed, n.delay,
           ($6::int4 IS NOT NULL AND n.count_try AND m.tries + 1 > $6::int4) AS dead
    FROM {s}.messages m JOIN nack n ON m.queue = $1 AND m.id = n.id
    WHERE m.reserved AND (n.tries IS NULL OR m.tries = n.tries) {relax}
    FOR UPDATE OF m
), released AS (
    UPDATE {s}.messages m
    SET tries = h.failed, reserved = false,
        mature = extract(epoch from now())::float8 + h.delay
    FROM held h
    WHERE m.queue = $1 AND m.id = h.id AND NOT h.dead
    RETURNING m.id, 1 AS outcome
), moved AS (
    UPDATE {s}.messages m
    SET queue = $7,
        id = CASE
               WHEN NOT EXISTS (SELECT 1 FROM {s}.messages x WHERE x.queue = $7 AND x.id = m.id)
                 THEN m.id
               WHEN NOT EXISTS (SELECT 1 FROM {s}.messages x
                                WHERE x.queue = $7 AND x.id = m.id || '.dl' || h.failed)
                 THEN m.id || '.dl' || h.failed
               ELSE m.id || '.dl' || h.failed || '.' || m.seq
             END,
        tries = 0, reserved = false, mature = extract(epoch from now())::float8,
        headers = CASE WHEN m.headers = '\\x7b7d'::bytea THEN '\\x7b'::bytea
                       ELSE substring(m.headers FROM 1 FOR length(m.headers) - 1) || '\\x2c'::bytea
                  END
                  || $8::bytea
                  || convert_to(
                       to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
                       || CASE WHEN extract(microseconds FROM now())::bigint % 1000000 = 0
                               THEN '' ELSE to_char(now() AT TIME ZONE 'UTC', '.US') END
                       || '+00:00","x-dl-tries":' || h.failed || '}', 'UTF8')
    FROM held h
    WHERE m.queue = $1 AND m.id = h.id AND h.dead
    RETURNING h.id, 2 AS outcome
)
SELECT id, outcome FROM released UNION ALL SELECT id, outcome FROM moved
"""

# With durable_acks=False, reserve / commit / rollback carry this condition: an InitPlan run
# once that turns synchronous_commit off for their own transaction only. A server crash
# (not a clean restart) may then forget the last few hundred milliseconds of them: a
# reservation or an ok comes undone and the message is delivered again -- at-least-once
# still holds, no message is lost. Inserts and pops always wait for the WAL flush.
_RELAX = "AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL"

# Remove: anything of the queue but an active reservation.
_REMOVE = """
DELETE FROM {s}.messages
WHERE queue = $1 AND id = ANY($2::text[])
  AND NOT (reserved AND mature > extract(epoch from now())::float8)
RETURNING id
"""

_SIZES = """
SELECT count(*) FILTER (WHERE mature <= t.now) AS size,
       count(*) AS total,
       count(*) FILTER (WHERE mature > t.now AND NOT reserved) AS scheduled,
       count(*) FILTER (WHERE mature > t.now AND reserved) AS reserved
FROM {s}.messages, (SELECT extract(epoch from now())::float8 AS now) t
WHERE queue = $1
"""

_NEXT_MATURE = """
SELECT mature FROM {s}.messages WHERE queue = $1 ORDER BY mature, seq LIMIT 1
"""


@contextmanager
def postgres_errors_translated() -> Iterator[None]:
    """Connection trouble -> KeussConnectionError; any other server error -> BackendError."""
    with translate_errors(CONNECTION_ERRORS, (asyncpg.PostgresError,)):
        try:
            yield
        except _CONFIG_ERRORS as exc:
            raise ConfigError(f"{type(exc).__name__}: {exc}") from exc
        except _MISUSE_ERRORS as exc:
            raise BackendError(f"{type(exc).__name__}: {exc}") from exc


def quote_schema(schema: object) -> str:
    """Validate a schema name (letters, digits, underscore) and return it double-quoted."""
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigError(
            f"schema must be 1-48 letters, digits or underscores, not starting with a digit,"
            f" not {schema!r}"
        )
    return '"' + schema + '"'


class _Sql:
    """The statements above with the schema filled in, formatted once per backend."""

    def __init__(self, schema: str, durable_acks: bool) -> None:
        relax = "" if durable_acks else _RELAX
        self.insert = _INSERT.replace("{s}", schema)
        self.insert_dedup = _INSERT_DEDUP.replace("{s}", schema)
        self.get = _GET.replace("{s}", schema)
        self.reserve = _RESERVE.replace("{s}", schema).replace("{relax}", relax)
        self.commit = _COMMIT.replace("{s}", schema).replace("{relax}", relax)
        self.rollback = _ROLLBACK.replace("{s}", schema).replace("{relax}", relax)
        self.remove = _REMOVE.replace("{s}", schema)
        self.sizes = _SIZES.replace("{s}", schema)
        self.next_mature = _NEXT_MATURE.replace("{s}", schema)


async def _light_reset(connection: Any) -> None:
    """Pool release hook. asyncpg's default reset costs one more round trip per statement
    (UNLISTEN *, RESET ALL, ...); our statements leave no session state behind (one implicit
    transaction each, transaction-local settings only), so only a stray transaction, e.g.
    from a cancelled call, needs undoing."""
    if connection.is_in_transaction():
        await connection.execute("ROLLBACK")


def _first_occurrences(ids: Sequence[str], done: set[str]) -> list[bool]:
    """One flag per request: true for the first request naming an id the statement acted
    on (a batch may name an id twice; the second is what the memory store would refuse)."""
    flags = []
    for message_id in ids:
        if message_id in done:
            done.discard(message_id)
            flags.append(True)
        else:
            flags.append(False)
    return flags


def _fetched(rows: list[Any]) -> Fetched:
    """Rows of _GET / _RESERVE: messages (NULL id when none) each carrying next_mature."""
    next_mature = rows[0][5] if rows else None
    messages = [Stored(r[0], r[1], r[2], r[3], r[4]) for r in rows if r[0] is not None]
    return Fetched(messages, next_mature)


class PostgresStore(Store):
    """One queue's view of the shared table: the SQL constants above, one per primitive."""

    batch_concurrency: ClassVar[int] = 3

    def __init__(self, name: str, options: QueueOptions, backend: PostgresBackend) -> None:
        super().__init__(name, options)
        self._pool = backend.pool
        self._sql = backend.sql

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        if not entries:
            return []
        ids = [e.id for e in entries]
        columns: list[Any] = [
            self.name,
            ids,
            [e.payload for e in entries],
            [e.headers for e in entries],
            [e.delay for e in entries],
            [e.tries for e in entries],
            [e.mature for e in entries],
        ]
        with postgres_errors_translated():
            if any(e.dedup for e in entries):
                columns += [[e.dedup for e in entries], self.options.dedup_window]
                rows = await self._pool.fetch(self._sql.insert_dedup, *columns)
            else:
                rows = await self._pool.fetch(self._sql.insert, *columns)
        if len(rows) == len(entries):  # the common case: everything went in
            return [True] * len(entries)
        return _first_occurrences(ids, {r[0] for r in rows})

    async def get(self, n: int) -> Fetched:
        with postgres_errors_translated():
            rows = await self._pool.fetch(self._sql.get, self.name, n)
        return _fetched(rows)

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        with postgres_errors_translated():
            rows = await self._pool.fetch(self._sql.reserve, self.name, n, reserve_delay)
        return _fetched(rows)

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        if not acks:
            return []
        ids = [a.id for a in acks]
        with postgres_errors_translated():
            rows = await self._pool.fetch(self._sql.commit, self.name, ids, [a.tries for a in acks])
        return _first_occurrences(ids, {r[0] for r in rows})

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        if not nacks:
            return []
        ids = [n.id for n in nacks]
        if deadletter is None:
            max_ko, target, prefix = None, self.name, b""
        else:
            max_ko, target = deadletter.max_ko, deadletter.queue
            # The constant part of the appended headers; x-dl-t and x-dl-tries come from SQL.
            prefix = b'"x-dl-from-queue":' + orjson.dumps(deadletter.from_queue) + b',"x-dl-t":"'
        with postgres_errors_translated():
            rows = await self._pool.fetch(
                self._sql.rollback,
                self.name,
                ids,
                [n.tries for n in nacks],
                [n.delay for n in nacks],
                [n.count_try for n in nacks],
                max_ko,
                target,
                prefix,
            )
        outcomes = {r[0]: KoResult(r[1]) for r in rows}
        results = []
        for message_id in ids:
            results.append(outcomes.pop(message_id, KoResult.MISSING))
        return results

    async def remove(self, ids: Sequence[str]) -> list[bool]:
        if not ids:
            return []
        with postgres_errors_translated():
            rows = await self._pool.fetch(self._sql.remove, self.name, list(ids))
        return _first_occurrences(ids, {r[0] for r in rows})

    async def sizes(self) -> Sizes:
        with postgres_errors_translated():
            row = await self._pool.fetchrow(self._sql.sizes, self.name)
        assert row is not None  # an aggregate always answers one row
        return Sizes(size=row[0], total=row[1], scheduled=row[2], reserved=row[3])

    async def next_mature(self) -> float | None:
        with postgres_errors_translated():
            mature: float | None = await self._pool.fetchval(self._sql.next_mature, self.name)
        return mature


MAX_POOL_SIZE = 10_000
"""asyncpg sets up a holder per ``max_size`` slot when it opens a pool; far more than any
server's ``max_connections`` is a typo, refused rather than allocated."""


def check_postgres_url(url: object) -> str:
    """Refuse, before connecting, a URL asyncpg would misread or fail on with a bare
    ``ValueError``. It takes the PostgreSQL manual's connection URI form ("Connection URIs"):
    ``postgresql://[user[:password]@][host][:port][,...][/dbname][?param=value&...]``, the
    scheme ``postgresql://`` or ``postgres://``; each port an int in 1..65535."""
    if not isinstance(url, str):
        raise ConfigError(f"url must be a str, not {type(url).__name__}")
    scheme, slashes, rest = url.partition("://")
    shown = without_password(url)
    if not slashes or scheme.lower() not in ("postgresql", "postgres"):
        raise ConfigError(
            f"url {shown!r}: expected postgresql:// or postgres:// then the host (see the"
            " PostgreSQL manual's connection URIs)"
        )
    hosts = re.split(r"[/?#]", rest, maxsplit=1)[0].rpartition("@")[2]
    for host in hosts.split(","):
        if host.startswith("["):  # an IPv6 address: [::1]:5432
            address_end = host.find("]")
            port = host[address_end + 1 :] if address_end > 0 else "?"
            if port and not port.startswith(":"):
                raise ConfigError(f"url {shown!r}: malformed IPv6 host {host!r}")
            port = port[1:]
        else:
            port = host.partition(":")[2]
        if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError(f"url {shown!r}: the port must be an int in 1..65535, not {port!r}")
    return url


class PostgresBackend(Backend):
    """``url=`` (or an existing asyncpg ``pool=``), ``schema=`` (default ``keuss``),
    ``min_pool_size`` / ``max_pool_size`` for a pool this backend makes itself, and
    ``durable_acks`` (default True; False trades crash-durability of reserve / ok / ko for
    about twice their speed, see ``_RELAX``)."""

    name = "postgres"
    capabilities: ClassVar[Capabilities] = Capabilities()
    options: ClassVar[dict[str, Any]] = {
        "url": "postgresql://postgres@127.0.0.1:5432/postgres",
        "pool": None,
        "schema": "keuss",
        "min_pool_size": 2,
        "max_pool_size": 10,
        "durable_acks": True,
    }

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.schema: str = self.settings["schema"]
        self.quoted_schema = quote_schema(self.schema)
        durable_acks = self.settings["durable_acks"]
        if not isinstance(durable_acks, bool):
            raise ConfigError(f"durable_acks must be a bool, not {durable_acks!r}")
        self.sql = _Sql(self.quoted_schema, durable_acks)
        self.url: str = check_postgres_url(self.settings["url"])
        for key in ("min_pool_size", "max_pool_size"):
            value = self.settings[key]
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_POOL_SIZE
            ):
                raise ConfigError(
                    f"{key} must be an int in [0, {MAX_POOL_SIZE}], not {brief(value)}"
                )
        if self.settings["max_pool_size"] < max(1, self.settings["min_pool_size"]):
            raise ConfigError("max_pool_size must be >= 1 and >= min_pool_size")
        given = self.settings["pool"]
        if given is not None and not isinstance(given, asyncpg.Pool):
            raise ConfigError(f"pool must be an asyncpg.Pool, not {type(given).__name__}")
        self._owns_pool = given is None
        self._pool: asyncpg.Pool | None = given

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise ConfigError("the postgres backend is not open")
        return self._pool

    @property
    def connect_params(self) -> dict[str, Any]:
        """How to open a connection outside the pool (the signal bus's LISTEN connection)."""
        if self._owns_pool:
            return {"dsn": self.url}
        # A user's pool: reuse its connection arguments.
        args, kwargs = self.pool._connect_args, self.pool._connect_kwargs
        return {"dsn": args[0] if args else None, **kwargs}

    async def open(self) -> None:
        with postgres_errors_translated():
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    self.url,
                    min_size=self.settings["min_pool_size"],
                    max_size=self.settings["max_pool_size"],
                    # Short OLTP statements: JIT compilation would only add latency.
                    server_settings={"jit": "off"},
                    reset=_light_reset,
                )
            try:
                await self._create_schema()
            except BaseException:
                await self.close()
                raise

    async def _create_schema(self) -> None:
        """Idempotent; the advisory lock makes several processes starting at once take
        turns instead of racing on the catalog."""
        async with self.pool.acquire() as connection, connection.transaction():
            await connection.execute(_SCHEMA_LOCK, self.schema)
            await connection.execute(_SCHEMA_DDL.replace("{s}", self.quoted_schema))

    async def close(self) -> None:
        if self._owns_pool and self._pool is not None:
            pool, self._pool = self._pool, None
            with postgres_errors_translated():
                await pool.close()

    async def store(self, queue: str, options: QueueOptions) -> Store:
        return PostgresStore(queue, options, self)

    def signal_bus(self, debounce: float) -> SignalBus:
        from .signal import PostgresSignalBus

        return PostgresSignalBus(self, debounce)

    def stats_store(self) -> StatsStore:
        from .stats import PostgresStats

        return PostgresStats(self)
