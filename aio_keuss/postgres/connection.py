"""The bottom of the PostgreSQL package: the pool, the connect options, the schema and its
migrations, and the one place where asyncpg's errors become ours.

Every role of this database (the stores, the signal bus, the stats store) talks to the
server through the few methods of :class:`PostgresConnection` (``execute``, ``fetch``,
``fetchrow``, ``fetchval``, ``transaction``, ``listen``), and each of them translates the
driver's errors on the way out, so no caller has to.

The schema is versioned: ``sql/migrations`` holds numbered steps, and
:meth:`PostgresConnection.open` applies those a schema lacks, in order, under a
transaction-scoped advisory lock (PostgreSQL manual, "Advisory Locks"), so processes
starting at once take turns instead of racing on the catalog, and a schema made by an
earlier release is upgraded in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import keepalive
from ..contract import Backend
from ..errors import (
    BackendError,
    ConfigError,
    KeussConnectionError,
    KeussError,
    MissingDependencyError,
    raise_translated,
    translating,
)
from ..options import BackendOptions, check_int, without_password
from . import lockwait
from .spelling import spelling
from .sql import migrations, queries

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
_DRIVER_ERRORS = (*CONNECTION_ERRORS, asyncpg.PostgresError)


def _ours(exc: Exception) -> KeussError | None:
    """The error of ours a driver error becomes: a bad setting -> ConfigError; connection
    trouble -> KeussConnectionError; misuse or any other server error -> BackendError. None
    for what is not the driver's."""
    if not isinstance(exc, _DRIVER_ERRORS):
        return None
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, _CONFIG_ERRORS):
        return ConfigError(text)
    if isinstance(exc, _MISUSE_ERRORS):
        return BackendError(text)
    if isinstance(exc, CONNECTION_ERRORS):
        return KeussConnectionError(text)
    return BackendError(text)


translated = translating(_ours)
"""For the connection's methods that talk to the server: asyncpg's errors leave as ours."""


_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")


def quote_schema(schema: object) -> str:
    """Validate a schema name (letters, digits, underscore) and return it double-quoted.
    ``pg_...`` is refused too: PostgreSQL reserves that prefix for system schemas (manual,
    CREATE SCHEMA), so the server would refuse it at the first connection."""
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigError(
            f"schema must be 1-48 letters, digits or underscores, not starting with a digit,"
            f" not {schema!r}"
        )
    if schema.startswith("pg_"):
        raise ConfigError(f"schema {schema!r}: the prefix pg_ is reserved by PostgreSQL")
    return '"' + schema + '"'


MAX_POOL_SIZE = 10_000
"""asyncpg sets up a holder per ``max_size`` slot when it opens a pool; far more than any
server's ``max_connections`` is a typo, refused rather than allocated."""
MOVE_ATTEMPTS = 20
"""How often a move or deadlettering rollback runs again after a concurrent one into the
same queue took the name it picked (see ``PostgresConnection.fetch_moving``)."""


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
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    hosts = authority.rpartition("@")[2]
    for host in hosts.split(","):
        if host.startswith("["):  # an IPv6 address: [::1]:5432
            address_end = host.find("]")
            port = host[address_end + 1 :] if address_end > 0 else "?"
            if port and not port.startswith(":"):
                raise ConfigError(f"url {shown!r}: malformed IPv6 host {host!r}")
            port = port[1:]
        else:
            port = host.partition(":")[2]
        _check_port(port, shown)
    _check_query(url, authority, shown)
    return url


ASYNCPG_PARAMETERS = frozenset(
    {
        "host",
        "port",
        "dbname",
        "database",
        "user",
        "password",
        "passfile",
        "service",
        "sslmode",
        "sslcert",
        "sslkey",
        "sslrootcert",
        "sslnegotiation",
        "sslcrl",
        "sslpassword",
        "ssl_min_protocol_version",
        "ssl_max_protocol_version",
        "target_session_attrs",
        "krbsrvname",
        "gsslib",
    }
)
"""The URL query parameters asyncpg reads itself (its DSN parsing, asyncpg 0.30-0.32);
every other one it sends to the server as a setting of the session."""

_SETTING_REFUSALS: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.UndefinedObjectError,  # 42704: unrecognized configuration parameter
    asyncpg.exceptions.InvalidParameterValueError,  # 22023: a bad value for it
    asyncpg.exceptions.CantChangeRuntimeParamError,  # 55P02: only at server start
    asyncpg.exceptions.InsufficientPrivilegeError,  # 42501: a superuser's setting
)
"""How the server refuses a session setting at connect (PostgreSQL manual, "PostgreSQL
Error Codes"); with settings in the URL's query, a ConfigError naming them."""


def url_settings(url: str) -> list[str]:
    """The query parameters of ``url`` that asyncpg sends to the server as settings."""
    try:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    except ValueError:
        return []
    return [name for name in query if name not in ASYNCPG_PARAMETERS]


def _check_port(port: str, shown: str) -> None:
    if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"url {shown!r}: the port must be an int in 1..65535, not {port!r}")


def _check_query(url: str, authority: str, shown: str) -> None:
    """The URL's ``?param=value`` part, as asyncpg reads it (its docs, ``connect``: the
    parameters it knows -- host, port, dbname, user, password, sslmode, ... -- and every
    other one sent to the server as a setting for the session). Refused here:

    - a malformed query (asyncpg: a bare ``ValueError`` at connect);
    - ``host`` / ``port`` / ``dbname`` / ``database`` / ``user`` / ``password`` given in
      the query while the URL's own parts give it already: asyncpg then keeps the URL's
      and silently ignores the query's (libpq takes the query's), so
      ``postgresql://db/app?port=5433`` connected to 5432;
    - a port that is not an int in 1..65535 (asyncpg: a bare ``ValueError``);
    - one of the server settings aio-keuss sets itself (``SERVER_SETTINGS``): ours
      override the URL's, so the user's was silently dropped.

    Other settings are the server's to judge (a custom ``app.x`` is accepted by any, a
    name depends on its version): its refusal at connect becomes a ConfigError in
    ``open``. Values asyncpg checks itself (``sslmode``, ``target_session_attrs``, ...)
    are refused by it before it connects, a ConfigError too."""
    try:
        parts = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qs(parts.query, strict_parsing=True) if parts.query else {}
    except ValueError as exc:
        raise ConfigError(f"url {shown!r}: malformed query ({exc})") from None
    credentials, at, host_part = authority.rpartition("@")
    user, _, password = credentials.partition(":")
    given = {
        "host": bool(host_part),
        "port": bool(host_part),
        "dbname": bool(parts.path),
        "database": bool(parts.path),
        "user": bool(at and user),
        "password": bool(at and password),
    }
    for name, values in query.items():
        if given.get(name):
            part = "host" if name == "port" else name  # a host given, asyncpg's port is its
            raise ConfigError(
                f"url {shown!r}: ?{name}= is ignored by asyncpg when the URL itself gives"
                f" the {part} (before the ?): give it there only"
            )
        if name == "port" and not given["port"]:
            for port in values[-1].split(","):
                _check_port(port, shown)
        if name in SERVER_SETTINGS:
            raise ConfigError(
                f"url {shown!r}: ?{name}= is a server setting aio-keuss sets itself"
                f" ({name}={SERVER_SETTINGS[name]!r}) and would override"
            )


@dataclass(frozen=True)
class PostgresConnectionOptions(BackendOptions):
    """What every PostgreSQL backend takes: ``url=`` (or an existing asyncpg ``pool=``),
    ``schema=`` (default ``keuss``), and ``min_pool_size`` / ``max_pool_size`` for a pool
    the backend makes itself."""

    url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    pool: Any = None
    schema: str = "keuss"
    min_pool_size: int = 2
    max_pool_size: int = 10

    def __post_init__(self) -> None:
        quote_schema(self.schema)
        check_postgres_url(self.url)
        check_int(self.min_pool_size, "min_pool_size", 0, MAX_POOL_SIZE)
        check_int(self.max_pool_size, "max_pool_size", 0, MAX_POOL_SIZE)
        if self.max_pool_size < max(1, self.min_pool_size):
            raise ConfigError("max_pool_size must be >= 1 and >= min_pool_size")
        if self.pool is not None and not isinstance(self.pool, asyncpg.Pool):
            raise ConfigError(f"pool must be an asyncpg.Pool, not {type(self.pool).__name__}")


_SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(hashtext('aio_keuss:' || $1))"
"""Serializes schema changes across processes (CREATE ... IF NOT EXISTS alone races on the
catalog's unique indexes). The key is derived from the schema name."""

_NO_TIMEOUTS = "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0"

_VERSIONS_DDL = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.schema_versions (
    version integer PRIMARY KEY,
    applied timestamptz NOT NULL DEFAULT now()
)
"""


async def _session_init(connection: Any) -> None:
    """Connection hook, once per connection we make ourselves (our own pool's, the signal
    listener's). Our connections are kept for reuse, idle between statements by design:

    - a role's or database's ``idle_session_timeout`` (PostgreSQL 14 and later) ended them
      while idle, and a statement sent as the server's notice came in failed with a
      connection error (asyncpg: "another operation is in progress"), a pop waiting across
      it included. Turned off here, not in ``server_settings``: an older server refuses an
      unknown setting at connect;
    - asyncpg turns no TCP keepalive on, so a connection a NAT or load balancer forgot
      while idle hung its next statement for as long as the kernel retransmits (see
      :mod:`aio_keuss.keepalive`). Its socket is reached through the connection's
      transport, which asyncpg does not expose otherwise; where it cannot be, the server's
      own probes (``SERVER_SETTINGS``) still keep the path alive."""
    transport = getattr(connection, "_transport", None)
    if transport is not None:
        keepalive.keep_alive(transport.get_extra_info("socket"))
    if idle_off := _idle_timeout_off(connection):
        await connection.execute(idle_off)


def _idle_timeout_off(connection: Any) -> str:
    """The statement turning ``idle_session_timeout`` off, '' on a server before 14."""
    return "SET idle_session_timeout = 0" if connection.get_server_version().major >= 14 else ""


async def _light_reset(connection: Any) -> None:
    """Pool release hook. asyncpg's default reset costs one more round trip per statement
    (UNLISTEN *, RESET ALL, ...); our statements leave no session state behind (one implicit
    transaction each, transaction-local settings only) but a take's bound on lock waits
    (see :mod:`.lockwait`), so only that, or a stray transaction, e.g. from a cancelled
    call, needs undoing."""
    undo: list[str] = []
    if connection.is_in_transaction():
        undo.append("ROLLBACK")
    if lockwait.is_bound(connection):
        undo.append(lockwait.UNBIND)
    if undo:
        await connection.execute("; ".join(undo))
        lockwait.forget(connection)


SERVER_SETTINGS = {
    # Short OLTP statements: JIT compilation would only add latency.
    "jit": "off",
    # asyncpg prepares every statement, but PostgreSQL plans a prepared statement afresh
    # on each run while it judges a custom plan cheaper than the generic one (PostgreSQL
    # manual, PREPARE, "plan_cache_mode"); for our queue statements it keeps doing so, and
    # planning cost about 0.3 ms of a 0.7 ms pop. Their generic plans use the same indexes.
    "plan_cache_mode": "force_generic_plan",
    # The statements are written for READ COMMITTED (FOR UPDATE SKIP LOCKED picks, updates
    # that re-check a row changed meanwhile). A database or role whose
    # default_transaction_isolation is repeatable read or serializable made concurrent
    # reserves, oks and pushes fail with "could not serialize access" (40001).
    "default_transaction_isolation": "read committed",
    # The server probes our idle sessions too (PostgreSQL manual, "Connection Settings",
    # tcp_keepalives_*; ignored over a Unix socket): a NAT or load balancer on the way then
    # keeps them, a user's pool's included, whose sockets are not ours to set.
    "tcp_keepalives_idle": str(keepalive.IDLE),
    "tcp_keepalives_interval": str(keepalive.INTERVAL),
    "tcp_keepalives_count": str(keepalive.COUNT),
}

_SET_SERVER_SETTINGS = "; ".join(
    f"SET {name} = '{value}'" for name, value in SERVER_SETTINGS.items()
)


async def _user_pool_setup(connection: Any) -> None:
    """Run on each connection taken from a user's pool: our settings, and no
    ``idle_session_timeout`` (see ``_session_init``; a held connection is idle between
    statements by design), in one round trip. The pool's reset on release (RESET ALL by
    default) gives the user's sessions their own settings back."""
    idle_off = _idle_timeout_off(connection)
    await connection.execute(
        f"{_SET_SERVER_SETTINGS}; {idle_off}" if idle_off else _SET_SERVER_SETTINGS
    )


HELD_CONNECTIONS = 8
"""At most this many pool connections are held by one backend for its statements."""

STATEMENT_CACHE = 512
"""Prepared statements our own pool keeps per connection (asyncpg's default: 100). A batch
of one to four messages goes by a form of its statement of its own (see ``spelling``), so a
statement taking arrays is up to five prepared statements; a statement dropped from the cache
costs a prepare, one round trip more, at its next use."""


def _usable(connection: Any) -> bool:
    try:
        return not connection.is_closed()
    except asyncpg.InterfaceError:  # the pool took it back when it was closed
        return False


def _fit_to_keep(connection: Any, failure: BaseException | None) -> bool:
    """Whether a connection a statement failed on can serve the next one: after a server
    error on a live connection, yes (the server ended that statement and is ready); after
    a cancellation asyncpg cancels the statement and the pool's release waits for it; after
    anything else (connection trouble, the driver's own state errors) it is not trusted."""
    if isinstance(failure, asyncpg.PostgresError) and not isinstance(failure, CONNECTION_ERRORS):
        return _usable(connection)
    return False


log = logging.getLogger("aio_keuss.postgres")


warned_no_autovacuum = False
"""Whether this process has said that the server's autovacuum is off (said once: every
factory opened on such a server would say it again)."""


def _warn_no_autovacuum(schema: str) -> None:
    """A queue deletes every row it delivers, and PostgreSQL keeps a deleted row (and its
    index entries, which every pop walks past) until VACUUM reclaims it (manual, "Routine
    Vacuuming"). With autovacuum off nothing does, unless the user runs VACUUM: measured
    here, a million consumed messages made pops five times slower."""
    global warned_no_autovacuum
    if warned_no_autovacuum:
        return
    warned_no_autovacuum = True
    log.warning(
        "PostgreSQL's autovacuum is off: the rows of %s.messages that queues consume are"
        " never reclaimed, and pops and reserves slow down as they pile up; turn autovacuum"
        " on, or run VACUUM on that table regularly",
        schema,
    )


CLOSE_GRACE = 10.0
"""How long a close waits for the pool's connections to come back before it terminates them."""

_IDLE_HANDED_OUT_FIRST = tuple(
    int(part) for part in re.findall(r"\d+", asyncpg.__version__)[:2]
) >= (0, 32)
"""Whether this asyncpg's pool hands out a connected idle connection before one it has to
open (its holder queue prefers them, as 0.32's does): only then does a pool with one idle
hand it out without a connect, which a take's shortcut past its bounded wait relies on.
Older releases hand out the last one given back, connected or not (one closed after its
idle lifetime, or terminated on release), and its connect had no bound."""

TAKE_CONNECTION_WAIT = lockwait.TAKE_LOCK_WAIT
"""Longest a take waits for a connection from the pool: statements waiting for a lock on
the table (pushes, oks, ...: they have no timeout) may hold every connection of the pool for
as long as the lock is held, and a take queued behind them waited as long, past its
caller's timeout. Past it the take answers "nothing now", as past ``TAKE_LOCK_WAIT``."""


class NoConnectionInTime(Exception):
    """A take found no connection within ``TAKE_CONNECTION_WAIT``: it sent nothing."""


class _HeldConnections:
    """Connections taken from the pool once and kept, for the one-statement calls.

    asyncpg's ``Pool.fetch`` acquires and releases a connection around every statement,
    which costs several times the statement itself on the client (measured here with
    ``SELECT 1`` at 3 clients: about 50 us of CPU through the pool, 10-17 us on a held
    connection). A held connection is idle between statements and used by one call at a
    time, like a pooled one; when all are busy and no more may be held, a call falls back
    on the pool, which queues it (a take for ``TAKE_CONNECTION_WAIT`` at most). A server
    error leaves a connection fit to keep; one a call was cancelled on goes back to the
    pool, whose release waits for asyncpg's cancellation of the statement (asyncpg,
    "Connection Pools"); one that failed in any other way is closed, and the pool opens a
    new one in its place.
    """

    def __init__(
        self, pool: Any, limit: int, setup: Callable[[Any], Awaitable[None]] | None = None
    ) -> None:
        self._pool = pool
        self._limit = limit
        # ``setup``: a user's pool, whose reset on release is not ours: a take's bound is
        # undone before it (``_unbind_for_user``); our own pool's (``_light_reset``) undoes it
        self._setup = setup
        self._idle: list[Any] = []
        self._held = 0
        self._handing_back: dict[asyncio.Task[None], Any] = {}  # the task -> its connection
        # Acquires from the pool that a take stopped waiting for (see ``_acquire_for_take``):
        # the next take waits on one of them rather than queueing another; one that lands
        # unclaimed goes back to the pool at once.
        self._late: set[asyncio.Task[Any]] = set()
        # How the last of them failed, landed with no take waiting for it (a server that
        # does not answer fails a connect only at the pool's timeout, after the take gave
        # up): the next take that finds no connection in time raises it, where it answered
        # "nothing now", look after look, and its caller never saw the server was away.
        self._late_failure: BaseException | None = None
        # Set by close: a statement still running then (a pop runs to its end past its
        # caller's cancellation) gives its connection back to the pool once done, since
        # nothing takes from ``_idle`` any more and a pool's close waits for it.
        self._closed = False

    async def run(
        self, method: str, query: str, args: tuple[Any, ...], bounded: bool = False
    ) -> Any:
        """``method(query, *args)`` on a held connection. ``bounded``: a take, which waits
        at most ``lockwait.TAKE_LOCK_WAIT`` for a lock (asyncpg's LockNotAvailableError past
        it) and ``TAKE_CONNECTION_WAIT`` for a connection (NoConnectionInTime); any other
        statement waits for as long as the lock is held, and for a connection as long."""
        connection = self._take_idle()
        held = True
        if connection is None:
            if bounded:
                connection = await self._acquire_for_take()
                held = self._held < self._limit
                if held:
                    self._held += 1
            else:
                held = self._held < self._limit
                if held:
                    self._held += 1
                try:
                    connection = await self._pool.acquire()
                except BaseException:
                    if held:
                        self._held -= 1
                    raise
            if self._setup is not None:  # borrowed ones too: the isolation level matters
                try:
                    await self._setup(connection)
                except BaseException as exc:
                    self._let_go(connection, exc, held)
                    raise
        try:
            if bounded and not lockwait.is_bound(connection):
                await lockwait.bind(connection)  # once: it stays so while held
            try:
                result = await getattr(connection, method)(query, *args)
            except asyncpg.LockNotAvailableError:
                if bounded or not lockwait.is_bound(connection):
                    raise
                # A statement with no timeout on a connection set for takes, past their
                # bound: it did nothing (one statement, rolled back), so it goes again on
                # the connection reset, and waits for the lock.
                await lockwait.unbind(connection)
                result = await getattr(connection, method)(query, *args)
        except BaseException as exc:
            if held and not self._closed and _fit_to_keep(connection, exc):
                self._idle.append(connection)
            else:
                self._let_go(connection, exc, held)
            raise
        self._late_failure = None  # the server answers: a connect's failure is old news
        if held and not self._closed:
            self._idle.append(connection)
        else:  # borrowed for this statement only, as Pool.fetch would (or closed meanwhile)
            # Given back in the background: the pool's reset on release (a round trip on a
            # user's pool) may fail or be cancelled, and the statement has done its work
            # (a pop's DELETE committed): its result must reach the caller all the same.
            self._let_go(connection, None, held)
        return result

    async def _acquire_for_take(self) -> Any:
        """A connection from the pool for a take, waited for ``TAKE_CONNECTION_WAIT`` at
        most (NoConnectionInTime past it, nothing sent). The acquire runs in a task of its
        own, which the wait's end does not cancel: a cancelled acquire gives up the
        connection asyncpg may be opening for it (a connect slower than the wait was given
        up at every look, for ever). Left to run, it is kept in ``_late`` for the next take
        to wait on, so a take looking again and again queues one acquire, not one a look;
        landed unclaimed, its connection goes back to the pool (``_late_landed``), so none
        is kept from the statements queued there for it.

        Our own pool with a connection idle hands it out at once (asyncpg 0.32 marks a
        connected one in use in the step that takes it from its queue; our pool has no ``setup=``
        to await between the two): taken so, with no task, which costs a loop iteration or
        two (about 50 us here, as much as the pool's own acquire and release)."""
        if (
            _IDLE_HANDED_OUT_FIRST
            and self._setup is None
            and not self._late
            and self._pool.get_idle_size()
        ):
            return await self._pool.acquire()
        # Reported by this take if it finds no connection in time either; forgotten if it
        # does, or if a statement succeeded meanwhile (the failure is then stale).
        failure, self._late_failure = self._late_failure, None
        if self._late:
            acquiring = self._late.pop()
        else:
            acquiring = asyncio.get_running_loop().create_task(self._acquire())
            acquiring.add_done_callback(self._late_landed)
        try:
            done, _ = await asyncio.wait((acquiring,), timeout=TAKE_CONNECTION_WAIT)
        except BaseException:  # cancelled: the connection, when it comes, is not lost
            self._orphan(acquiring)
            if self._late_failure is None:
                self._late_failure = failure  # nor the failure, for the next take
            raise
        if not done:
            self._orphan(acquiring)
            if failure is not None:
                raise failure
            raise NoConnectionInTime
        if acquiring.cancelled():  # a late one, by a close
            raise NoConnectionInTime
        return acquiring.result()

    async def _acquire(self) -> Any:
        return await self._pool.acquire()

    def _orphan(self, acquiring: asyncio.Task[Any]) -> None:
        """An acquire no take waits for any more: to ``_late``, and back to the pool once
        it lands (at once, if it already has; cancelled, if we are closing)."""
        self._late.add(acquiring)
        if acquiring.done():
            self._late_landed(acquiring)
        elif self._closed:
            acquiring.cancel()

    def _late_landed(self, acquiring: asyncio.Task[Any]) -> None:
        """An acquire ended: if no take claimed it, its connection goes back to the pool."""
        if acquiring not in self._late:
            return  # claimed, or being waited for, by a take
        self._late.discard(acquiring)
        if acquiring.cancelled():
            return  # by a close: nothing acquired
        failure = acquiring.exception()  # read here, so never logged as unretrieved
        if failure is not None:
            self._late_failure = failure  # for the next take to report
            return
        self._late_failure = None
        self._let_go(acquiring.result(), None, held=False)

    def _take_idle(self) -> Any:
        while self._idle:
            connection = self._idle.pop()
            if _usable(connection):
                return connection
            self._let_go(connection, None)  # ended while idle (a server restart)
        return None

    def _let_go(self, connection: Any, failure: BaseException | None, held: bool = True) -> None:
        """Hand ``connection`` back to the pool after ``failure`` (None: it had ended, or
        was borrowed for a statement now done), in the background: a release may have to
        wait for a cancelled statement to wind down, or fail in the pool's reset."""
        if held:
            self._held -= 1
        task = asyncio.get_running_loop().create_task(self._release(connection, failure))
        self._handing_back[task] = connection
        task.add_done_callback(self._handing_back.pop)

    async def _release(self, connection: Any, failure: BaseException | None = None) -> None:
        if self._setup is not None:
            await self._unbind_for_user(connection, failure)
        if (
            failure is not None
            and not isinstance(failure, asyncio.CancelledError)
            and not _fit_to_keep(connection, failure)
        ):
            # The driver's state for it is unknown (e.g. "another operation is in
            # progress"): the pool's release would keep it, since its reset runs no
            # statement, and hand it out again and again. Closed, the pool replaces it.
            with contextlib.suppress(Exception):
                connection.terminate()
        with contextlib.suppress(Exception):
            await self._pool.release(connection)

    @staticmethod
    async def _unbind_for_user(connection: Any, failure: BaseException | None) -> None:
        """A session set for takes goes back to a user's pool as the user had it. The
        pool's reset need not undo the setting: asyncpg's ``reset=`` runs in place of its
        ``RESET ALL`` (asyncpg, "Connection Pools"), and the user's own statements on the
        session then gave up on any lock held 0.1 s. Reset here, where the session is
        free for a statement; one whose statement was cancelled is not yet (the pool's
        release waits for the server to end it), and is left to the pool's reset."""
        if lockwait.is_bound(connection) and (failure is None or _fit_to_keep(connection, failure)):
            try:
                await lockwait.unbind(connection)
            except Exception:
                # not known to be reset: closed, the pool opens another in its place
                with contextlib.suppress(Exception):
                    connection.terminate()
        lockwait.forget(connection)

    async def close(self) -> None:
        """Give every held connection back (a pool waits for its connections on close).
        The idle ones go back as the others do, each in a task of ``_handing_back`` (a
        user's pool resets a connection on release: a round trip), so that ``terminate``
        reaches every one still on its way back."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            self._let_go(connection, None)
        while self._handing_back or self._late:
            for acquiring in self._late:
                acquiring.cancel()  # a late take's: one that landed meanwhile goes back
            # Not gather: cancelled (a close past its grace), it would cancel the hand-backs,
            # whose tasks then left ``_handing_back`` before ``terminate`` read it, and
            # asyncpg's release, shielded, waited on with nothing to end it.
            await asyncio.wait([*self._handing_back, *self._late])

    def terminate(self) -> None:
        """Close at once the connections still on their way back: each waits for the
        server to end a cancelled statement, which a server that stopped answering never
        does. The pool replaces a terminated connection."""
        for acquiring in self._late:
            acquiring.cancel()
        for connection in self._handing_back.values():
            with contextlib.suppress(Exception):
                connection.terminate()


def _refuse_another_loop(pool: asyncpg.Pool) -> None:
    """Refuse a user's pool made on another event loop than the running one: asyncpg binds
    a pool and its connections to the loop they were made on, so from this one (the blocking
    shim's loop thread, a second ``asyncio.run``) its connections were driven from two loops
    at once, the user's pool left broken and the error a misleading connection failure
    ("another operation is in progress")."""
    made_on = getattr(pool, "_loop", None)
    if made_on is not None and made_on is not asyncio.get_running_loop():
        raise ConfigError(
            "pool= was made on another event loop than the one this factory runs on (asyncpg"
            " binds a pool to its loop): make the pool on this loop, or pass url= (the"
            " blocking aio_keuss.sync runs the factory on a loop thread of its own)"
        )


class PostgresConnection(Backend):
    """The pool (made here, or the user's), the schema, and the statements, for every
    PostgreSQL role; the only way they reach the server."""

    options_type: ClassVar[type[PostgresConnectionOptions]] = PostgresConnectionOptions
    options: ClassVar[dict[str, Any]] = PostgresConnectionOptions.defaults()

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.config = self.options_type.parse_own(options)
        self.schema: str = self.config.schema
        self.quoted_schema = quote_schema(self.schema)
        self.url: str = self.config.url
        self.sql: dict[str, str] = queries(self.quoted_schema)
        self._owns_pool = self.config.pool is None
        self._pool: asyncpg.Pool | None = self.config.pool
        self._held: _HeldConnections | None = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise ConfigError("the postgres backend is not open")
        return self._pool

    async def _connect_outside_pool(self) -> Any:
        """A connection outside the pool (the signal bus's LISTEN connection), made the way
        the pool makes its own: from our URL, or, for a user's pool, with its arguments and
        its ``connect`` hook (asyncpg >= 0.30: ``create_pool(connect=...)``, e.g. for
        rotating credentials; without it, such a pool has no arguments, and the listener
        went to the driver's defaults -- another server, whose NOTIFYs never come)."""
        if self._owns_pool:
            return await asyncpg.connect(self.url)
        pool = self.pool
        connect = getattr(pool, "_connect", None) or asyncpg.connect
        return await connect(
            *pool._connect_args,
            connection_class=pool._connection_class,
            record_class=pool._record_class,
            **pool._connect_kwargs,
        )

    @translated
    async def open(self) -> None:
        if self._pool is not None:
            _refuse_another_loop(self._pool)
        if self._pool is None:
            try:
                self._pool = await asyncpg.create_pool(
                    self.url,
                    min_size=self.config.min_pool_size,
                    max_size=self.config.max_pool_size,
                    server_settings=SERVER_SETTINGS,
                    init=_session_init,
                    reset=_light_reset,
                    statement_cache_size=STATEMENT_CACHE,
                )
            except _SETTING_REFUSALS as exc:
                settings = url_settings(self.url)
                if not settings:
                    raise
                raise ConfigError(
                    f"url {without_password(self.url)!r}: the server refused a setting at"
                    f" connect ({type(exc).__name__}: {exc}); asyncpg sends the query"
                    f" parameters it does not know itself ({', '.join(settings)}) to the"
                    " server as settings"
                ) from exc
        # Our own pool: all but two of its connections may be held (the two serve
        # transactions and the rest). A user's pool is shared with the user: half of it.
        # The user's pool has its own settings: ours are SET on what we hold, and the
        # pool's reset on release (RESET ALL by default) undoes them.
        # At least one always stays in the pool: a held connection never goes back to it,
        # so a call finding every held one busy, waiting on a pool they had emptied (a pool
        # of one connection), waited forever.
        size = self._pool.get_max_size()
        limit = size - 2 if self._owns_pool else size // 2
        setup = None if self._owns_pool else _user_pool_setup
        limit = min(HELD_CONNECTIONS, max(1, limit), size - 1)
        self._held = _HeldConnections(self._pool, limit, setup)
        try:
            await self.migrate()
        except BaseException:
            await self.close()
            raise

    async def migrate(self) -> None:
        """Apply the migration steps the schema lacks, in order, each recorded in
        ``schema_versions`` in the same transaction, all under the schema's advisory lock.
        A schema of the first release has no versions table: the steps that release already
        took are written to be no-ops there (``IF NOT EXISTS``, or a guard). A schema a later
        release migrated past the steps this one knows is refused (ConfigError), not served
        with statements written for an older layout.

        "Lacks" is by number, not by the last one recorded: steps are numbered on branches
        that merge in any order, so a schema a build took to step n + 1 may lack a step n
        merged after it, and is given it (steps of separate branches touch separate
        things, so their order between them does not matter)."""
        schema = self.quoted_schema
        steps = migrations()
        known = steps[-1][0] if steps else 0
        recorded = f"SELECT coalesce(array_agg(version), '{{}}') FROM {schema}.schema_versions"
        async with self.transaction() as connection:
            # Up to date (every open but the first of a release): nothing to write, so no
            # lock and no DDL, which a role with only the rights to use the tables may not
            # run (CREATE ... IF NOT EXISTS checks the CREATE privilege first). Past this
            # release's steps: refused here too, before any DDL such a role would fail on.
            versions = f"{schema}.schema_versions"
            exists, autovacuum = await connection.fetchrow(
                "SELECT to_regclass($1) IS NOT NULL, current_setting('autovacuum')", versions
            )
            if autovacuum != "on":
                _warn_no_autovacuum(self.schema)
            if exists:
                done = set(await connection.fetchval(recorded))
                self._refuse_newer(max(done, default=0), known)
                if all(version in done for version, _ in steps):
                    return
            # Waiting for another process's migration, or building an index over a big
            # table, may take longer than the role's statement_timeout / lock_timeout
            # allow: for this transaction, none (a failed open would fail on every start).
            await connection.execute(_NO_TIMEOUTS)
            await connection.execute(_SCHEMA_LOCK, self.schema)
            await connection.execute(_VERSIONS_DDL.replace("{s}", schema))
            done = set(await connection.fetchval(recorded))
            self._refuse_newer(max(done, default=0), known)
            for version, step in steps:
                if version not in done:
                    await connection.execute(step.replace("{s}", schema))
                    await connection.execute(
                        f"INSERT INTO {schema}.schema_versions (version) VALUES ($1)", version
                    )

    def _refuse_newer(self, done: int, known: int) -> None:
        """ConfigError for a schema at version ``done``, past the ``known`` steps."""
        if done > known:
            raise ConfigError(
                f"schema {self.schema!r} is at version {done}, made by a newer aio-keuss"
                f" than this one (which knows versions up to {known}): upgrade aio-keuss"
                " to open it"
            )

    @translated
    async def close(self) -> None:
        """Hand the held connections back and close our pool, for up to ``CLOSE_GRACE``
        seconds: past it, or cancelled, the connections still out are terminated (asyncpg's
        ``Pool.close`` waits for every connection to be released, and a connection whose
        statement was cancelled waits for the server to answer, which one that stopped
        answering never does)."""
        held, self._held = self._held, None
        pool = self._pool if self._owns_pool else None
        if pool is not None:
            self._pool = None
        try:
            async with asyncio.timeout(CLOSE_GRACE):
                if held is not None:
                    await held.close()
                if pool is not None:
                    await pool.close()
        except (TimeoutError, asyncio.CancelledError) as exc:
            if held is not None:
                held.terminate()
            if pool is not None:
                pool.terminate()
            if not isinstance(exc, TimeoutError):
                raise
            log.warning(
                "postgres: connections not back %s s into the close were terminated",
                CLOSE_GRACE,
            )

    # The choke point: every statement of every role goes through one of these.

    @translated
    async def execute(self, query: str, *args: Any) -> str:
        status: str = await self._run("execute", query, args)
        return status

    async def execute_without_timeouts(self, query: str) -> None:
        """``query`` in a transaction of its own with no statement or lock timeout, as the
        migrations run: DDL that waits for other clients' writes (CREATE TRIGGER takes a
        lock they hold) would otherwise fail under a role's or database's shorter
        timeouts, and so would every open while the writes went on."""
        async with self.transaction() as connection:
            await connection.execute(_NO_TIMEOUTS)
            await connection.execute(query)

    @translated
    async def execute_unless_duplicate(self, query: str, *args: Any) -> bool:
        """Run a statement that may break a unique constraint: False when it did (SQLSTATE
        23505, unique_violation), and so, being one statement, changed nothing."""
        try:
            await self._run("execute", query, args)
        except asyncpg.UniqueViolationError:
            return False
        return True

    @translated
    async def fetch_moving(self, query: str, *args: Any) -> list[Any]:
        """Run a statement that moves messages into other queues (move, a deadlettering
        rollback). ``moved_id`` cannot see a name a concurrent statement has just taken and
        not yet committed: two statements moving the same id into one queue (deadletters of
        two queues, a pipeline's fan-in) then clash on the key (23505) or deadlock (40P01).
        Either way the statement changed nothing, so it runs again, and then sees the
        committed name and renames."""
        for attempt in range(MOVE_ATTEMPTS):
            try:
                rows: list[Any] = await self._run("fetch", query, args)
                return rows
            except (asyncpg.UniqueViolationError, asyncpg.DeadlockDetectedError):
                if attempt == MOVE_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.001 * (attempt + 1))
        raise AssertionError("unreachable")  # pragma: no cover

    @translated
    async def fetch(self, query: str, *args: Any) -> list[Any]:
        rows: list[Any] = await self._run("fetch", query, args)
        return rows

    @translated
    async def fetchrow(self, query: str, *args: Any) -> Any:
        return await self._run("fetchrow", query, args)

    @translated
    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self._run("fetchval", query, args)

    @translated
    async def fetch_take(self, query: str, *args: Any) -> list[Any] | None:
        """``fetch`` for a pop or reserve: None when a lock another session holds (a
        migration's, ``VACUUM FULL``'s) kept it waiting past ``lockwait.TAKE_LOCK_WAIT``.
        The server then ended it (SQLSTATE 55P03) before it changed anything: nothing was
        taken, and the caller may look again. None too when no connection came within
        ``TAKE_CONNECTION_WAIT`` (statements waiting for such a lock may hold them all):
        nothing was sent."""
        try:
            rows: list[Any] = await self._run("fetch", query, args, bounded=True)
        except (asyncpg.LockNotAvailableError, NoConnectionInTime):
            return None
        return rows

    def _run(self, method: str, query: str, args: tuple[Any, ...], bounded: bool = False) -> Any:
        if self._held is None:
            return getattr(self.pool, method)(query, *args)  # raises: not open
        written = spelling(query)  # a small batch's arrays sent as scalars (see spelling)
        if written is not None and (spelled := written.apply(args)) is not None:
            query, args = spelled[0], tuple(spelled[1])
        return self._held.run(method, query, args, bounded)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        """A pooled connection in a transaction: committed when the block ends, rolled back
        when it raises. The block's own statements on it are translated here too (they
        raise at the ``yield``).

        READ COMMITTED whatever the session's default: a user's pool keeps its own, and
        under REPEATABLE READ or SERIALIZABLE the snapshot is taken by the first statement
        (PostgreSQL manual, "Transaction Isolation"), so a migration that waited its turn
        on the schema's lock did not see the steps the process before it had committed,
        applied them again and failed."""
        try:
            async with (
                self.pool.acquire() as connection,
                connection.transaction(isolation="read_committed"),
            ):
                yield connection
        except Exception as exc:
            raise_translated(exc, _ours)

    @translated
    async def listen(
        self,
        channel: str,
        on_notify: Callable[[Any, int, str, str], None],
        on_lost: Callable[[Any], None],
    ) -> Any:
        """A connection of its own LISTENing on ``channel`` (never one of the pool's: those
        are handed to other callers, and a release would drop the LISTEN). ``on_lost`` is
        called when the server or the network ends it; the caller closes it.

        A LISTENing session is idle between notifications by design: a role's or
        database's ``idle_session_timeout`` (PostgreSQL 14 and later; manual, "Client
        Connection Defaults") shorter than the bus's liveness check ended it again and
        again, each time a warning and a gap without wake-ups. This session turns it off
        for itself, as the sessions of our own pool do (``_session_init``)."""
        connection = await self._connect_outside_pool()
        try:
            await _session_init(connection)
            connection.add_termination_listener(on_lost)
            await connection.add_listener(channel, on_notify)
        except BaseException:
            connection.terminate()
            raise
        return connection
