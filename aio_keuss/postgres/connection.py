"""The bottom of the PostgreSQL package: the pool, the schema and its migrations, the SQL
files, and the one place where asyncpg's errors become ours.

Every role of this database (the stores, the signal bus, the stats store) talks to the
server through a :class:`PostgresConnection`. The schema is versioned: ``sql/migrations``
holds numbered steps, and :meth:`PostgresConnection.open` applies those a schema lacks, in
order, under a transaction-scoped advisory lock (PostgreSQL manual, "Advisory Locks"), so
processes starting at once take turns instead of racing on the catalog, and a schema made
by an earlier release is upgraded in place.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources
from typing import Any, ClassVar

from ..contract import Backend
from ..errors import BackendError, ConfigError, MissingDependencyError, translate_errors
from ..options import BackendOptions, brief, check_bool, without_password

try:
    import asyncpg  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("postgres", "asyncpg") from exc

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

SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(hashtext('aio_keuss:' || $1))"
"""Serializes schema changes across processes (CREATE ... IF NOT EXISTS alone races on the
catalog's unique indexes). The key is derived from the schema name."""

_VERSIONS_DDL = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.schema_versions (
    version integer PRIMARY KEY,
    applied timestamptz NOT NULL DEFAULT now()
)
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


@cache
def queries(schema: str, relax: str) -> dict[str, str]:
    """The named statements of ``sql/queries.sql`` (each after a ``-- name: x`` line) with
    the quoted schema and the durability condition filled in."""
    text = resources.files(__package__).joinpath("sql/queries.sql").read_text("utf-8")
    found: dict[str, str] = {}
    for block in text.split("\n-- name: ")[1:]:
        name, _, body = block.partition("\n")
        found[name.strip()] = body.replace("{s}", schema).replace("{relax}", relax)
    return found


def migrations() -> list[tuple[int, str]]:
    """(version, SQL) of every step in ``sql/migrations``, in order; a file is
    ``NNN_what.sql``."""
    folder = resources.files(__package__).joinpath("sql/migrations")
    steps = []
    for item in folder.iterdir():
        if item.name.endswith(".sql"):
            steps.append((int(item.name.split("_", 1)[0]), item.read_text("utf-8")))
    return sorted(steps)


async def _light_reset(connection: Any) -> None:
    """Pool release hook. asyncpg's default reset costs one more round trip per statement
    (UNLISTEN *, RESET ALL, ...); our statements leave no session state behind (one implicit
    transaction each, transaction-local settings only), so only a stray transaction, e.g.
    from a cancelled call, needs undoing."""
    if connection.is_in_transaction():
        await connection.execute("ROLLBACK")


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


@dataclass(frozen=True)
class PostgresOptions(BackendOptions):
    """``url=`` (or an existing asyncpg ``pool=``), ``schema=`` (default ``keuss``),
    ``min_pool_size`` / ``max_pool_size`` for a pool this backend makes itself, and
    ``durable_acks`` (default True; False trades crash-durability of reserve / ok / ko for
    about twice their speed)."""

    url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    pool: Any = None
    schema: str = "keuss"
    min_pool_size: int = 2
    max_pool_size: int = 10
    durable_acks: bool = True

    def __post_init__(self) -> None:
        quote_schema(self.schema)
        check_bool(self.durable_acks, "durable_acks")
        check_postgres_url(self.url)
        for key in ("min_pool_size", "max_pool_size"):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_POOL_SIZE
            ):
                raise ConfigError(
                    f"{key} must be an int in [0, {MAX_POOL_SIZE}], not {brief(value)}"
                )
        if self.max_pool_size < max(1, self.min_pool_size):
            raise ConfigError("max_pool_size must be >= 1 and >= min_pool_size")
        if self.pool is not None and not isinstance(self.pool, asyncpg.Pool):
            raise ConfigError(f"pool must be an asyncpg.Pool, not {type(self.pool).__name__}")


class PostgresConnection(Backend):
    """The pool (made here, or the user's) and the schema, for every PostgreSQL role."""

    options_type: ClassVar[type[PostgresOptions]] = PostgresOptions
    options: ClassVar[dict[str, Any]] = PostgresOptions.defaults()

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        own = {f.name for f in fields(self.options_type)}  # a bucket backend adds its own
        self.config = self.options_type.parse({k: v for k, v in options.items() if k in own})
        self.schema: str = self.config.schema
        self.quoted_schema = quote_schema(self.schema)
        self.url: str = self.config.url
        self._owns_pool = self.config.pool is None
        self._pool: asyncpg.Pool | None = self.config.pool

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
                    min_size=self.config.min_pool_size,
                    max_size=self.config.max_pool_size,
                    # Short OLTP statements: JIT compilation would only add latency.
                    server_settings={"jit": "off"},
                    reset=_light_reset,
                )
            try:
                await self.migrate()
            except BaseException:
                await self.close()
                raise

    async def migrate(self) -> None:
        """Apply the migration steps the schema lacks, in order, each recorded in
        ``schema_versions`` in the same transaction, all under the schema's advisory lock."""
        schema = self.quoted_schema
        async with self.pool.acquire() as connection, connection.transaction():
            await connection.execute(SCHEMA_LOCK, self.schema)
            await connection.execute(_VERSIONS_DDL.replace("{s}", schema))
            done = await connection.fetchval(
                f"SELECT coalesce(max(version), 0) FROM {schema}.schema_versions"
            )
            for version, step in migrations():
                if version > done:
                    await connection.execute(step.replace("{s}", schema))
                    await connection.execute(
                        f"INSERT INTO {schema}.schema_versions (version) VALUES ($1)", version
                    )

    async def close(self) -> None:
        if self._owns_pool and self._pool is not None:
            pool, self._pool = self._pool, None
            with postgres_errors_translated():
                await pool.close()
