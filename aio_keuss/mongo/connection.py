"""What the MongoDB backends share: the client, collection naming, indexes, error translation.

Reached with PyMongo's native ``AsyncMongoClient`` (Motor is deprecated). Collections of one
backend live in ``database`` (default ``keuss``) and carry the backend's ``prefix``:

- ``<prefix>_q_<queue>``: the messages of one queue, ``_id`` = message id (see
  :mod:`aio_keuss.mongo.store` for the document shape),
- ``<prefix>_dedup_<queue>``: ids the user chose, kept for the dedup window (TTL index),
- ``<prefix>_stats``: one document per queue (:mod:`aio_keuss.mongo.stats`),
- ``<prefix>_signals``: the signal bus (:mod:`aio_keuss.mongo.signal`),
- ``<prefix>_rates``: one document per rate-limited queue (:mod:`aio_keuss.mongo.limiter`).
- ``<prefix>_results``: the kept results of finished messages (:mod:`aio_keuss.mongo.results`).

Collection names are kept to letters, digits and underscores (some MongoDB look-alikes accept
nothing else): a queue name's ``_ . : -`` are escaped as ``__ _d _c _h``, a one-to-one mapping.

One collection per queue, rather than one shared collection with a ``q`` field, because every
hot query then runs on the primary key or on a single-field index on ``mature`` (cheap on every
server, including SQLite-backed look-alikes whose planners handle compound indexes badly), and
dropping a queue is dropping a collection. The price is that a deadletter move crosses
collections: it runs in a transaction on a replica set or mongos, and as an ordered sequence
that never loses a message elsewhere (see ``MongoStore._deadletter``).

Clock: MongoDB has no cheap server-time read (``$$NOW`` exists only inside pipeline updates,
which not every server speaks), so every time is the *client's* ``time.time()``; clients of one
deployment must keep their clocks in sync (NTP), a skew of s seconds shifting maturity by s.
Two exceptions bound what a clock running ahead does: a reservation given back unseen is due
at the server's time when that is earlier, and a push waits for another's pending id claim no
longer than its lease from when it met it, whatever lease end the other wrote.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar

from ..contract import Backend
from ..errors import (
    BackendError,
    ConfigError,
    KeussConnectionError,
    KeussError,
    MissingDependencyError,
    translating,
)
from ..options import BackendOptions, brief, without_password

try:
    from pymongo import ASCENDING, DESCENDING, AsyncMongoClient
    from pymongo import errors as mongo_errors
    from pymongo.asynchronous.collection import AsyncCollection
    from pymongo.asynchronous.database import AsyncDatabase
    from pymongo.uri_parser import split_options
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("mongo", exc.name or "pymongo") from exc

Document = dict[str, Any]
Collection = AsyncCollection[Document]

BY_PRIORITY = [("raised", DESCENDING), ("lowered", ASCENDING), ("mature", ASCENDING)]
"""The take's order once a queue has priorities: a message's priority p is stored as
``raised: p`` (p > 0) or ``lowered: -p`` (p < 0), and not at all when 0 (every document of
an earlier release, every plain push). A missing field sorts as null, below every number
(MongoDB manual, "Comparison/Sort Order"): one field holding p itself would put the
negatives before the zeros when sorted descending; these two put the zeros between."""
PRIORITY_LOOK = 1.0
"""Seconds between two looks, by a queue's stores that have not seen one, for the index
that tells that the queue has priorities (see :meth:`MongoConnection.prioritized`)."""

CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    mongo_errors.ConnectionFailure,  # AutoReconnect, NetworkTimeout, ServerSelectionTimeout...
    OSError,
)
DUPLICATE_KEY = 11000

# Server error codes meaning "not primary, shutting down, or cannot reach a host right now"
# (names from the MongoDB manual's "Error Codes" reference): what the drivers' retryable
# reads and writes specifications retry. The operation was refused or interrupted by a state
# that passes, so it is a connection error. PyMongo raises its NotPrimaryError (one of the
# ConnectionFailure family above) for most of them on a failed command, but not when they
# come as a write error, a write concern error or inside a bulk write's details, nor for
# the network codes a mongos relays from a shard.
NOT_READY_CODES = frozenset(
    {
        6,  # HostUnreachable
        7,  # HostNotFound
        89,  # NetworkTimeout
        91,  # ShutdownInProgress
        134,  # ReadConcernMajorityNotAvailableYet
        189,  # PrimarySteppedDown
        262,  # ExceededTimeLimit
        9001,  # SocketException
        10058,  # LegacyNotPrimary
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
    }
)


class Once:
    """Index creations, each run once per backend and key (idempotent on the server too):
    concurrent first callers share one creation, and a failed one is tried again by the
    next caller rather than remembered."""

    def __init__(self) -> None:
        self._runs: dict[str, asyncio.Future[None]] = {}

    async def run(self, key: str, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        pending = self._runs.get(key)
        if pending is None:
            pending = self._runs[key] = asyncio.ensure_future(make())
        try:
            await asyncio.shield(pending)
        except BaseException:
            failed = pending.done() and pending.exception() is not None
            if failed and self._runs.get(key) is pending:
                del self._runs[key]  # try again next time
            raise


def _is_priority_index(key: Any) -> bool:
    """Whether an index's key (as ``index_information`` gives it) is ``BY_PRIORITY``'s
    fields. The directions are not compared: some look-alikes report 1 for every field."""
    fields = [pair[0] for pair in key if isinstance(pair, list | tuple) and pair]
    return fields == [field for field, _ in BY_PRIORITY]


def _not_ready(exc: mongo_errors.OperationFailure) -> bool:
    if exc.code in NOT_READY_CODES or exc.has_error_label("RetryableWriteError"):
        return True
    if isinstance(exc, mongo_errors.BulkWriteError):
        details = exc.details or {}
        errors = [*details.get("writeErrors", ()), *details.get("writeConcernErrors", ())]
        return any(isinstance(e, dict) and e.get("code") in NOT_READY_CODES for e in errors)
    return False


def _ours(exc: Exception) -> KeussError | None:
    """Connection trouble (and the server's "not ready" codes, wherever PyMongo puts them)
    -> KeussConnectionError; any other driver error -> BackendError; None for the rest."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, CONNECTION_ERRORS) or (
        isinstance(exc, mongo_errors.OperationFailure) and _not_ready(exc)
    ):
        return KeussConnectionError(text)
    if isinstance(exc, mongo_errors.PyMongoError):
        return BackendError(text)
    return None


translated = translating(_ours)
"""For every method of this package that talks to the server: PyMongo's errors leave it as
ours. Inside, code may still catch the driver's own (a duplicate key, say); only what leaves
the method is translated."""


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
_ESCAPES = str.maketrans({"_": "__", ".": "_d", ":": "_c", "-": "_h"})


def _check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ConfigError(
            f"{what} must be 1-48 letters, digits or underscores, not starting with a digit,"
            f" not {value!r}"
        )
    return value


def collection_part(queue: str) -> str:
    """A queue name as letters, digits and underscores (one-to-one)."""
    return queue.translate(_ESCAPES)


def check_mongo_url(url: object) -> str:
    """Refuse a URL that is not a MongoDB connection string before PyMongo sees it (the
    MongoDB manual's "Connection Strings": ``mongodb://`` or ``mongodb+srv://``); PyMongo
    then checks the rest (hosts, ports, options) when the client is made, before connecting,
    and what it refuses is raised as :class:`ConfigError` too."""
    if not isinstance(url, str):
        raise ConfigError(f"url must be a str, not {type(url).__name__}")
    if not url.startswith(("mongodb://", "mongodb+srv://")):
        raise ConfigError(
            f"url {without_password(url)!r}: expected mongodb:// or mongodb+srv:// then the host"
        )
    _check_url_options(url)
    return url


OWN_CLIENT_OPTIONS = {
    "tz_aware": "aio-keuss reads dates as aware datetimes",
    "serverselectiontimeoutms": "give the server_selection_timeout option instead",
}
"""What the client made here is given as keyword arguments, which take precedence over the
URL's options (PyMongo's ``MongoClient`` docs): given in the URL too, it was ignored."""


def _check_url_options(url: str) -> None:
    """Refuse a URL option PyMongo does not know, or a value it cannot take, before the
    client is made. PyMongo's client only warns of either and goes on without the option
    (``UserWarning: Unknown option``), so ``?maxPoolSiz=5`` or ``?readPreference=primery``
    ran with the default and a warning easy to miss; its own parser, asked not to warn,
    refuses them. The error names the option, never its value (it may be a credential)."""
    shown = without_password(url)
    query = url.partition("?")[2]
    if not query:
        return
    try:
        split_options(query, validate=True, warn=False)
    except (mongo_errors.ConfigurationError, ValueError, TypeError) as exc:
        for piece in re.split(r"[&;]", query):
            name = piece.partition("=")[0]
            try:
                split_options(piece, validate=True, warn=False)
            except (mongo_errors.ConfigurationError, ValueError, TypeError) as bad:
                raise ConfigError(f"url {shown!r}: option {name!r}: {bad}") from None
        raise ConfigError(f"url {shown!r}: {exc}") from None
    for piece in re.split(r"[&;]", query):
        name = piece.partition("=")[0]
        why = OWN_CLIENT_OPTIONS.get(name.lower())
        if why is not None:
            raise ConfigError(f"url {shown!r}: option {name!r} is set by aio-keuss ({why})")


@dataclass(frozen=True)
class MongoOptions(BackendOptions):
    """``url=`` (or an existing ``client=``), ``database=``, ``prefix=`` (collection name
    prefix; None: the backend's own), ``transactions=`` ("auto": on a replica set or mongos;
    True; False), ``signal_transport=`` ("changestream" or "capped"),
    ``server_selection_timeout=`` seconds for a client made here."""

    url: str = "mongodb://127.0.0.1:27017"
    client: Any = None
    database: str = "keuss"
    prefix: str | None = None
    transactions: bool | str = "auto"
    signal_transport: str = "changestream"
    server_selection_timeout: float = 10.0

    def __post_init__(self) -> None:
        _check_name(self.database, "database")
        if self.prefix is not None:
            _check_name(self.prefix, "prefix")
        if self.transactions not in ("auto", True, False):
            raise ConfigError("transactions must be 'auto', True or False")
        if self.signal_transport not in ("changestream", "capped"):
            raise ConfigError("signal_transport must be 'changestream' or 'capped'")
        timeout = self.server_selection_timeout
        # PyMongo takes it in milliseconds, under one billion (its timeout validation)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < 1e6
        ):
            raise ConfigError(
                f"server_selection_timeout must be seconds in (0, 1e6), not {brief(timeout)}"
            )
        given = self.client
        if given is not None and not isinstance(given, AsyncMongoClient):
            raise ConfigError(f"client must be a pymongo AsyncMongoClient, not {given!r}")
        if given is None:
            check_mongo_url(self.url)


class MongoConnection(Backend):
    """The client, the database and the collection names every MongoDB role shares."""

    default_prefix: ClassVar[str] = "keuss"
    options_type: ClassVar[type[MongoOptions]] = MongoOptions
    options: ClassVar[dict[str, Any]] = MongoOptions.defaults()

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        config = self.options_type.parse_own(options)
        self.config = config
        self.database_name = config.database
        self.prefix: str = config.prefix if config.prefix is not None else self.default_prefix
        given = config.client
        self._owns_client = given is None
        if given is None:
            url = config.url
            timeout = config.server_selection_timeout
            try:  # PyMongo parses the URL here, before connecting
                given = AsyncMongoClient(
                    url, tz_aware=True, serverSelectionTimeoutMS=max(1, int(timeout * 1000))
                )
            except (mongo_errors.ConfigurationError, ValueError, TypeError) as exc:
                raise ConfigError(f"url {without_password(url)!r}: {exc}") from exc
        self.client: AsyncMongoClient[Document] = given
        self.db: AsyncDatabase[Document] = self.client[self.database_name]
        self.transactions = False
        self._indexed = Once()
        self._prioritized: set[str] = set()
        """Queues known to have the index of ``BY_PRIORITY``."""
        self._priority_look: dict[str, float] = {}
        """Queue -> monotonic time before which it is not looked for again."""

    @translated
    async def open(self) -> None:
        try:
            hello = await self.client.admin.command("hello")
        except RuntimeError as exc:
            await self.close()
            if self._owns_client or "event loop" not in str(exc):
                raise
            # PyMongo binds an AsyncMongoClient to the loop it was made on and refuses any
            # other (the blocking shim's loop thread, a second ``asyncio.run``) with a bare
            # RuntimeError: a typed error, saying what to do, instead
            raise ConfigError(
                "client= was made on another event loop than the one this factory runs on"
                f" ({exc}): make the client on this loop, or pass url= (the blocking"
                " aio_keuss.sync runs the factory on a loop thread of its own)"
            ) from exc
        except BaseException:
            await self.close()
            raise
        wanted = self.config.transactions
        if wanted == "auto":
            # Standalone servers (and SQLite-backed look-alikes, whose transactions leak
            # uncommitted writes) announce no replica set: the ordered path runs there.
            self.transactions = bool(hello.get("setName")) or hello.get("msg") == "isdbgrid"
        else:
            self.transactions = bool(wanted)

    @translated
    async def close(self) -> None:
        if self._owns_client:
            await self.client.close()

    def collection(self, *parts: str) -> Collection:
        return self.db["_".join((self.prefix, *parts))]

    def queue_collection(self, queue: str) -> Collection:
        return self.collection("q", collection_part(queue))

    def dedup_collection(self, queue: str) -> Collection:
        return self.collection("dedup", collection_part(queue))

    async def ensure_indexes(self, queue: str) -> None:
        """Create a queue's indexes once per backend (see :class:`Once`)."""
        await self._indexed.run(queue, lambda: self._create_indexes(queue))

    @translated
    async def _create_indexes(self, queue: str) -> None:
        await self.queue_collection(queue).create_index([("mature", ASCENDING)])
        await self.dedup_collection(queue).create_index(
            [("expires", ASCENDING)], expireAfterSeconds=0
        )
        await self._extra_indexes(queue)

    async def ensure_priority(self, queue: str) -> None:
        """Create the index of ``BY_PRIORITY`` on a queue, before its first message with a
        priority goes in. Only then: on a queue that never has one it would be one more
        index for every insert and every take to keep. Its being there is what tells every
        store of the queue, in any process, to take by priority (:meth:`prioritized`)."""
        if queue in self._prioritized:
            return
        await self.queue_collection(queue).create_index(BY_PRIORITY)
        self._prioritized.add(queue)

    async def prioritized(self, queue: str) -> bool:
        """Whether a queue has priorities: known once its index of ``BY_PRIORITY`` was seen
        or made here; else looked for at most once per ``PRIORITY_LOOK`` seconds (one
        ``listIndexes``, the one call this adds to a plain queue's takes). A store of
        another process that last looked just before a first priority was pushed keeps
        taking by mature time alone until its next look."""
        if queue in self._prioritized:
            return True
        now = time.monotonic()
        if now < self._priority_look.get(queue, 0.0):
            return False
        self._priority_look[queue] = now + PRIORITY_LOOK
        indexes = await self.queue_collection(queue).index_information()
        if any(_is_priority_index(ix.get("key", ())) for ix in indexes.values()):
            self._prioritized.add(queue)
            return True
        return False

    async def _extra_indexes(self, queue: str) -> None:
        """What a variant needs beyond the mature index (history: TTL on ``processed``)."""
