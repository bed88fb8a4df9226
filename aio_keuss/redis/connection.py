"""What every Redis backend shares: the connection, key naming, scripts and error translation.

All keys of one queue carry the hash tag ``{queue}`` so that every script touching one queue
runs on one Redis Cluster node.

The hot path (the stores' primitives) goes through :meth:`RedisBackend.execute`. When the
backend made its own client from a ``redis://`` or ``unix://`` URL on a single Redis, that is
a *fast lane*: one pipelined connection (an asyncio protocol parsing with hiredis) that costs
a fraction of redis-py's per-command overhead, and lets several coalesced batches be in
flight at once. A user-supplied client, TLS and Redis Cluster use redis-py. Either way the
connection's methods raise our errors, caused by the exception redis-py raises (or would raise)
for the same failure: nothing above this module sees a driver error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import logging
import operator
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol, TypeVar, cast
from urllib.parse import parse_qs, urlsplit

from .. import coalesce, cpu, keepalive
from ..contract import Backend
from ..errors import (
    BackendError,
    ClosedError,
    ConfigError,
    KeussConnectionError,
    KeussError,
    MissingDependencyError,
    raise_translated,
)
from ..options import BackendOptions, check_bool, without_password

try:
    import hiredis
    import redis
    import redis.asyncio as aioredis
    from redis import exceptions as redis_errors
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.connection import AbstractConnection, parse_url
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("redis", exc.name or "redis") from exc


RedisClient = aioredis.Redis | RedisCluster
log = logging.getLogger("aio_keuss.redis")
_T = TypeVar("_T")
_HASH_TAG = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")
CONNECT_TIMEOUT = 10.0
SUBSCRIBE_PING_EVERY = 5.0
"""Seconds of silence on the signal subscription after which it PINGs the server; no answer
in as long again and the connection is taken for dead (a connection dropped silently, by a
NAT or firewall forgetting it, would otherwise be listened to forever)."""
CANCEL_GRACE = 10.0
"""How long a cancelled caller may wait for the reply to a command already sent."""


_CONNECTION_ERRORS = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)

# Error replies meaning "this server cannot serve that now": the command was not executed,
# and the same command succeeds once the server is ready, so they are connection errors (the
# caller retries) rather than backend errors. From the Redis manual: LOADING while the
# dataset is loaded at startup; MASTERDOWN from a replica that lost its primary with
# ``replica-serve-stale-data no``; CLUSTERDOWN while a hash slot is not served; TRYAGAIN
# while a slot is being resharded; READONLY from a primary a failover turned into a replica;
# BUSY while a script or function runs past ``busy-reply-threshold``; NOREPLICAS while fewer
# replicas than ``min-replicas-to-write`` are connected. (OOM, MISCONF and the rest need
# someone to act: backend errors.) redis-py has classes for some, which the fast lane
# raises too; the others are recognised by their code.
_NOT_READY_ERRORS = (
    redis_errors.ReadOnlyError,
    redis_errors.ClusterDownError,  # MasterDownError too
    redis_errors.TryAgainError,
)
_RETRYABLE = (*_CONNECTION_ERRORS, *_NOT_READY_ERRORS)
_NOT_READY_CODES = frozenset(
    ("LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "BUSY", "NOREPLICAS")
)
_REPLY_ERRORS: dict[str, type[redis_errors.RedisError]] = {
    "NOSCRIPT": redis_errors.NoScriptError,
    "LOADING": redis_errors.BusyLoadingError,
    "READONLY": redis_errors.ReadOnlyError,
    "MASTERDOWN": redis_errors.MasterDownError,
    "CLUSTERDOWN": redis_errors.ClusterDownError,
    "TRYAGAIN": redis_errors.TryAgainError,
}
"""The fast lane's error replies as the redis-py classes redis-py itself would raise."""


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, _RETRYABLE):
        return True
    if isinstance(exc, redis_errors.ResponseError):
        return str(exc).split(" ", 1)[0] in _NOT_READY_CODES
    if isinstance(exc, redis_errors.SlotNotCoveredError):
        return True  # redis-py's cluster client: no node serves the slot (a failover)
    if isinstance(exc, redis_errors.ClusterError) and str(exc) == "TTL exhausted.":
        # redis-py's cluster client gave up following redirections (MOVED, ASK) and
        # TRYAGAIN replies: a slot being resharded, without the last reply as the cause
        return True
    if isinstance(exc, redis_errors.RedisClusterException):
        # e.g. "Redis Cluster cannot be connected", raised from the connection error
        return isinstance(exc.__cause__, _CONNECTION_ERRORS)
    return False


GIVE_BACK_REPLAY = (
    "a give-back (no try counted) sent again after another consumer reserved the message, "
    "with the same tries, passes that consumer's guard and releases its reservation: a third "
    "may then take the message while the second still works on it"
)
"""The replay hazard (``RedisConnection.replay_hazard``) of the backends whose guard is
"held, with the holder's tries"."""


def _no_retry() -> Retry:
    """redis-py's documented way to turn its retries off ("Retry Helpers" in the redis-py
    docs): a command is sent once, whatever happens to its reply."""
    return Retry(NoBackoff(), 0)


def _pool_checks_connections() -> dict[str, Any]:
    """Keyword arguments for the redis-py clients built here that turn redis-py's
    maintenance notifications off, where this redis-py has them (none elsewhere).

    Before handing out a pooled connection, redis-py checks that the server has not closed
    it (a restart, a ``timeout`` reaping idle clients, CLIENT KILL) and opens a new one if
    it has. redis-py 8.1's asyncio pool skips that check while maintenance notifications
    are on, and under RESP3, its default, they are on ("auto") unless turned off (redis-py
    issue #4252): the first command after a restart was then written on the closed
    connection and failed with "Connection closed by server", which cannot tell that it
    never ran, so a stop's put-back of popped messages was dropped. The notifications serve
    managed Redis's planned maintenance (relaxed timeouts, early reconnects); a connection
    error here is handled either way."""
    if not _has_maint_notifications():
        return {}
    config = importlib.import_module("redis.maint_notifications").MaintNotificationsConfig
    # built for each client, as before: no config object shared between pools
    return {"maint_notifications_config": config(enabled=False)}


@functools.cache
def _has_maint_notifications() -> bool:
    """Whether this redis-py's asyncio pool takes ``maint_notifications_config``: read once,
    not on every connect (the installed redis-py does not change while the process runs)."""
    init = getattr(aioredis.ConnectionPool, "__init__", None)
    return init is not None and "maint_notifications_config" in inspect.signature(init).parameters


SKIPS_CLOSED_CHECK = ("8.1.0",)
"""The redis-py releases whose asyncio pool hands out a connection the server closed
without noticing it while maintenance notifications are on (redis-py issue #4252; fixed
after 8.1.0)."""


def skips_closed_check(client: object) -> bool:
    """Whether ``client`` (a standalone redis-py client) hands out pooled connections the
    server closed (a restart) unchecked: its maintenance notifications are on, and this
    redis-py is one of ``SKIPS_CLOSED_CHECK`` (see ``_pool_checks_connections``)."""
    if not isinstance(client, aioredis.Redis) or redis.__version__ not in SKIPS_CLOSED_CHECK:
        return False
    enabled = getattr(client.connection_pool, "maint_notifications_enabled", None)
    return bool(enabled is not None and enabled())


def command_retries(client: object) -> int | None:
    """How many times ``client`` sends a command again after a connection error (None for
    a client that is not redis-py's). redis-py retries a command whose reply was lost
    after the server ran it, so a retry may run a script twice.

    A standalone client's commands get their connection's retry policy: the ``retry`` of
    the connection keyword arguments, else one retry when ``retry_on_error`` or
    ``retry_on_timeout`` is given, else none (redis-py's ``Connection``). A cluster client
    retries at its own level (its nodes' connections never do): by its ``retry`` since
    redis-py 6.0, by its ``cluster_error_retry_attempts`` before, whatever ``retry`` said
    (see ``_cluster_attempts_off``)."""
    if isinstance(client, RedisCluster):
        attempts = getattr(client, "cluster_error_retry_attempts", None)
        return int(attempts) if attempts is not None else _retries(client.retry)
    if isinstance(client, aioredis.Redis):
        kwargs = client.connection_pool.connection_kwargs
        retry = kwargs.get("retry")
        if retry is not None:
            return _retries(retry)
        return 1 if kwargs.get("retry_on_error") or kwargs.get("retry_on_timeout") else 0
    return None


def _retries(retry: Retry) -> int:
    """How many times ``retry`` tries again: redis-py before 6.0 has no ``get_retries``."""
    get = getattr(retry, "get_retries", None)
    return int(get() if get is not None else retry._retries)


def _cluster_attempts_off(client: RedisCluster) -> RedisCluster:
    """``client`` (built here) made to send a command once on the redis-py releases before
    6.0 too: their cluster client sends a command again after a connection error up to
    ``cluster_error_retry_attempts`` times (3 by default), which its ``retry`` does not
    govern (redis-py 6.0.0 deprecated that argument: "configure the 'retry' object
    instead"). A command whose reply was lost when its node stopped was then sent again,
    and the refused connect of that second attempt made it look never sent: a stop's
    put-back tried again on it stored its messages twice. It is read on every command
    there, so setting it after construction serves; later releases have no such attribute
    (passing the argument only warns there)."""
    if getattr(client, "cluster_error_retry_attempts", None) is not None:
        setattr(client, "cluster_error_retry_attempts", 0)  # noqa: B010 - absent from 6.0 on
    return client


CLUSTER_REINITIALIZE_STEPS = 0
"""The ``reinitialize_steps`` of the cluster clients built here: no MOVED reply makes
redis-py reload the whole topology.

redis-py's cluster client counts the MOVED replies it meets, across every task sharing it,
and on each ``reinitialize_steps``-th (5 by default) it closes the client
(``RedisCluster.aclose``: every connection to every node, at once) so that its next command
loads the topology again. Connections are shared by all the tasks of the process, so
whatever another task had in flight was cut ("Connection closed by server"): a pop's script
that had run lost its messages with its reply, a push that was stored raised, and the
signal listener's subscription dropped, during every slot migration. With 0, redis-py's
documented way "to avoid reinitializing the cluster on moved errors" (the ``RedisCluster``
docstring), each MOVED only points its slot at the node the reply names, where the
command is sent again (a redirected command did not run), so the slot map is learnt slot
by slot, one redirection each, and no connection is closed. A topology redis-py must
reload (a node gone: a connection error) still is, by the next command; a CLUSTERDOWN
reply still closes every connection (redis-py offers no option there)."""


def command_reinitializes(client: object) -> int | None:
    """Every how many MOVED replies ``client`` (a redis-py cluster client) closes all its
    connections (see ``CLUSTER_REINITIALIZE_STEPS``); None where it never does."""
    if isinstance(client, RedisCluster) and client.reinitialize_steps:
        return int(client.reinitialize_steps)
    return None


class ScriptMissing(BackendError):
    """NOSCRIPT: the server lacks a script (restarted, or its script cache was flushed);
    :meth:`RedisConnection.run_script` loads it and runs it again."""


def _not_run(exc: BaseException) -> bool:
    """Whether ``exc`` is an error reply saying the server cannot serve the command now, so
    did not run it (see ``_NOT_READY_CODES``)."""
    if isinstance(exc, (redis_errors.BusyLoadingError, *_NOT_READY_ERRORS)):
        return True
    return (
        isinstance(exc, redis_errors.ResponseError)
        and str(exc).split(" ", 1)[0] in _NOT_READY_CODES
    )


def _ours(exc: Exception) -> KeussError | None:
    """The error of ours a redis-py (or socket) error becomes; None for any other."""
    text = f"{type(exc).__name__}: {exc}"
    if _is_connection_error(exc):
        error = KeussConnectionError(text)
        error.ran_nothing = _not_run(exc)
        return error
    if isinstance(exc, redis_errors.NoScriptError):
        return ScriptMissing(text)
    if isinstance(exc, redis_errors.RedisError | redis_errors.RedisClusterException):
        return BackendError(text)
    return None


def _unsent(exc: Exception) -> KeussError | None:
    """What a failure to connect (or to authenticate and select the database) before a
    command was written becomes: a connection error says that nothing of the command ran,
    whatever the failure was. Every address of a host name refusing is one of them: asyncio
    then raises a plain ``OSError`` listing the attempts, with no errno and no refusal to
    recognise in its chain (``loop.create_connection`` in Python's asyncio documentation)."""
    ours = _ours(exc)
    if isinstance(ours, KeussConnectionError):
        ours.ran_nothing = True
    return ours


_CONNECTING = frozenset(
    method.__code__
    for name in ("connect", "connect_check_health")
    if (method := getattr(AbstractConnection, name, None)) is not None
)
"""The code of redis-py's opening of a connection (with its handshake: AUTH, SELECT), which
a command is sent only after."""


def _while_connecting(exc: BaseException) -> bool:
    """Whether redis-py raised ``exc`` while opening the connection to send a command on:
    its traceback goes through that opening. A redis-py error says no more (a refusal at
    every address of a host name is asyncio's errno-less ``OSError`` in its context, see
    :func:`_unsent`); a version of redis-py that opens connections elsewhere makes this
    False, which only gives up a retry."""
    trace = exc.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code in _CONNECTING:
            return True
        trace = trace.tb_next
    return False


def _ours_sent_once(exc: Exception) -> KeussError | None:
    """:func:`_ours` for a client that sends a command once (no retries): a failure to open
    the connection then means it was never sent."""
    ours = _ours(exc)
    if isinstance(ours, KeussConnectionError) and _while_connecting(exc):
        ours.ran_nothing = True
    return ours


def _another_loop() -> ConfigError:
    return ConfigError(
        "client= was made (and connected) on another event loop than the one this factory runs"
        " on (redis-py binds its connections to their loop): make the client on this loop,"
        " or pass url= (the blocking aio_keuss.sync runs the factory on a loop thread of its"
        " own)"
    )


def _refuse_another_loop(client: Any) -> None:
    """Refuse a user's client whose pooled connections belong to another event loop than
    the running one (the blocking shim's loop thread, a second ``asyncio.run``), before any
    command: one sent on them was written from this loop into the other's transport, and
    its reply, awaited here on the other loop's stream, raised redis-py's raw
    ``RuntimeError`` ("attached to a different loop"). Best effort, by what redis-py keeps
    (a cluster client's nodes are not looked at): the open's first command catches the rest."""
    running = asyncio.get_running_loop()
    pool = getattr(client, "connection_pool", None)
    try:
        connections = [
            *getattr(pool, "_available_connections", ()),
            *getattr(pool, "_in_use_connections", ()),
        ]
    except RuntimeError:  # changed while read: by another thread, whose loop uses them
        raise _another_loop() from None
    for connection in connections:
        made_on = getattr(getattr(connection, "_reader", None), "_loop", None)
        if made_on is not None and made_on is not running:
            raise _another_loop()


async def translated(call: Awaitable[_T], sent_once: bool = False) -> _T:
    """Await a call into redis-py; its errors leave as ours. ``sent_once``: the client sends
    a command once, whatever happens to it (see ``_no_retry``). Used only in this module: the
    rest of the package reaches the server through :class:`RedisConnection`'s methods."""
    try:
        return await call
    except Exception as exc:
        raise_translated(exc, _ours_sent_once if sent_once else _ours)


class _Reply(asyncio.Future[Any]):
    """The reply to a command already on the wire. Redis executes the command whatever the
    caller does, so cancelling the wait would only lose its result (messages a pop took):
    a cancellation instead takes effect when the reply is in (see ``coalesce.RunToEnd``),
    or after ``CANCEL_GRACE`` seconds if Redis does not answer, or at once when a
    cancelled close's grace is spent (``_FastLane.abandon``)."""

    _grace: asyncio.TimerHandle | None = None

    def cancel(self, msg: Any | None = None) -> bool:
        if not self.done() and self._grace is None:
            self._grace = self.get_loop().call_later(CANCEL_GRACE, self._give_up, msg)
        return False

    def _give_up(self, msg: Any | None) -> None:
        super().cancel(msg)


def _late(loop: asyncio.AbstractEventLoop) -> _Reply:
    """The reply future swapped in for a plain one cancelled with its caller (see
    ``_LaneProtocol.send_plain``): that caller was cancelled once already, so its grace runs
    from now."""
    late = _Reply(loop=loop)
    late.cancel()
    return late


_Future = asyncio.Future
_PROTOCOLS: weakref.WeakSet[_LaneProtocol] = weakref.WeakSet()
"""Every fast-lane protocol, for ``late_reply`` to find a plain future in (seldom: only
after a cancellation). Of every loop of the process: loops in other threads (the sync
shim's, an application's) add theirs while one looks, so it is read and added to under
``_PROTOCOLS_LOCK``, and each protocol's queue of replies is read by its own loop only."""
_PROTOCOLS_LOCK = threading.Lock()


def late_reply(future: asyncio.Future[Any]) -> asyncio.Future[Any] | None:
    """For a plain reply future cancelled with its caller (see ``_LaneProtocol.send_plain``):
    the future that gets its reply instead, which refuses cancellation and runs the grace
    (see ``_Reply``); None for any other future. Registered with
    ``coalesce.LATE_REPLIES``."""
    if type(future) is not _Future or not future.cancelled():
        return None
    loop = future.get_loop()
    with _PROTOCOLS_LOCK:
        protocols = [protocol for protocol in _PROTOCOLS if protocol._loop is loop]
    for protocol in protocols:
        late = protocol._parked.pop(future, None)
        if late is not None:
            return late
        for i, (waiting, script, packed) in enumerate(protocol._waiting):
            if waiting is future:
                late = _late(protocol._loop)
                protocol._waiting[i] = (late, script, packed)
                return late
    return None


coalesce.LATE_REPLIES.append(late_reply)


_EVALSHA_HEAD = b"$7\r\nEVALSHA\r\n$40\r\n"


def _as_eval(packed: bytes, script: Script) -> bytes:
    """A packed ``EVALSHA sha numkeys ...`` as ``EVAL text numkeys ...``.

    EVAL runs the script and caches it in one command: a SCRIPT LOAD followed by the
    EVALSHA again would need the SCRIPT command (an ACL may deny it, and the real cause was
    then hidden behind a second NOSCRIPT), and a SCRIPT FLUSH landing between the two made
    the caller see NOSCRIPT after all."""
    start = packed.index(b"\n") + 1  # after the "*<count>" line, which stays the same
    sha_end = start + len(_EVALSHA_HEAD) + 40 + 2
    assert packed[start : start + len(_EVALSHA_HEAD)] == _EVALSHA_HEAD, packed[:64]
    text = script.text
    return b"%b$4\r\nEVAL\r\n$%d\r\n%b\r\n%b" % (
        packed[:start],
        len(text),
        text,
        packed[sha_end:],
    )


WRITE_MODES = ("auto", "first", "gather", "each")


def _cpu_wait(write_mode: str) -> cpu.CpuWait:
    if write_mode == "auto":
        return cpu.this_thread()
    return cpu.CpuWait.fixed(write_mode == "gather")


class _LaneProtocol(asyncio.Protocol):
    """Replies come back in request order, so a FIFO of futures is all the bookkeeping.
    Errors are set on the futures as ours already, each caused by the redis-py exception
    redis-py would have raised for the same reply, so both paths raise alike.

    Writes (``write_mode``): while the loop's thread gets a CPU when it wants one, the
    first command of a loop iteration is written as it is sent, so Redis starts on it
    while the callers woken with it run, and their commands go in one write at the end of
    the iteration; while the thread has to wait for a CPU (a busy machine, see
    :mod:`aio_keuss.cpu`) every command of the iteration waits for that one write.
    ``each`` writes every command as it is sent."""

    def __init__(self, write_mode: str = "auto") -> None:
        self._reader = hiredis.Reader()
        # Each command's reply future, and for an EVALSHA what to send again should the
        # server lack the script (NOSCRIPT, after a restart or a SCRIPT FLUSH): the same
        # command as an EVAL of the script's text, whose reply the future gets.
        self._waiting: deque[tuple[asyncio.Future[Any], Script | None, bytes]] = deque()
        # Plain futures cancelled with their callers before ``late_reply`` swapped them:
        # the futures their replies went to (see ``send_plain``)
        self._parked: dict[asyncio.Future[Any], asyncio.Future[Any]] = {}
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._cpu = _cpu_wait(write_mode)
        self._each = write_mode == "each"
        self._gathered: list[bytes] = []
        self._flush_due = False
        with _PROTOCOLS_LOCK:
            _PROTOCOLS.add(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # No isinstance check: uvloop's transports do not derive from asyncio's classes.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        cpu_wait, now = self._cpu, time.monotonic()
        if now >= cpu_wait.next_check:
            cpu_wait.sample(now)
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                entry = self._waiting.popleft()
                future = entry[0]
                if isinstance(reply, hiredis.ReplyError):
                    self._reply_error(entry, str(reply))
                elif not future.done():
                    future.set_result(reply)
                elif type(future) is _Future and future.cancelled():
                    self._park(future).set_result(reply)
                # else given up on, or failed: its caller was cancelled
        except hiredis.ProtocolError as exc:  # pragma: no cover - a broken server
            self._fail(KeussConnectionError(f"Redis protocol error: {exc}"))
            if self.transport is not None:
                self.transport.abort()

    def _park(self, future: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """The future a plain one's reply goes to when it came before ``late_reply``
        swapped one in: kept for ``late_reply`` to hand over."""
        late = self._parked[future] = _late(self._loop)
        return late

    def _reply_error(
        self, entry: tuple[asyncio.Future[Any], Script | None, bytes], message: str
    ) -> None:
        future, script, packed = entry
        if future.done() and type(future) is _Future and future.cancelled():
            future = self._park(future)
        if (
            script is not None and message.startswith("NOSCRIPT") and not future.done()
        ):  # run it again as an EVAL, once (which also caches it); its reply is this future's
            if self.transport is None:  # dropped meanwhile (a failover): the caller retries
                future.set_exception(KeussConnectionError("connection to Redis lost"))
                return
            self._waiting.append((future, None, b""))
            self._write(_as_eval(packed, script))
            return
        cause = _response_error(message)
        error = _ours(cause) or BackendError(message)
        error.__cause__ = cause  # as if raised from it, like the redis-py path
        if isinstance(cause, redis_errors.ReadOnlyError) and self.transport is not None:
            # A failover made this server a replica. Like redis-py's Sentinel client, drop
            # the connection so that the caller's retry connects again, to the primary the
            # address leads to now; what is still in flight was refused or is only a read.
            transport, self.transport = self.transport, None
            transport.abort()
        if not future.done():
            future.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(KeussConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def _fail(self, error: BaseException) -> None:
        while self._waiting:
            future = self._waiting.popleft()[0]
            if not future.done():
                future.set_exception(error)
            elif type(future) is _Future and future.cancelled():
                self._park(future).set_exception(error)

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        if self.transport is None or self.transport.is_closing():
            raise KeussConnectionError("connection to Redis lost")
        future = _Reply(loop=self._loop)
        self._waiting.append((future, None, b""))
        self._write(packed)
        return future

    def send_plain(self, packed: bytes, script: Script | None) -> asyncio.Future[Any]:
        """:meth:`send` (:meth:`send_script` with a ``script``) with a plain future for the
        reply, for the one-message calls (see ``_Bound.sender``): the task awaiting one
        takes asyncio's fast path, where a future of a class of its own costs its awaiter
        about 4,000 client instructions more (a method looked up and called for each of
        its steps: a sixteenth of a pop's instructions). A plain future does not refuse
        cancellation: it is cancelled with its caller, and its reply then goes to the
        future ``late_reply`` swaps in, which does (the caller awaits that one next, see
        ``coalesce.settled``)."""
        if self.transport is None or self.transport.is_closing():
            raise KeussConnectionError("connection to Redis lost")
        # asyncio's own class, not the loop's ``create_future`` (which a loop may make of a
        # class of its own): cancelled, it must be one ``late_reply`` and ``data_received``
        # know, else its reply would be dropped
        future: asyncio.Future[Any] = _Future(loop=self._loop)
        self._waiting.append((future, script, packed))
        self._write(packed)
        return future

    def _write(self, packed: bytes) -> None:
        """Written now, or gathered for the iteration's write at its end (see the class).
        Once a flush is due, whatever the mode says now, a command goes behind what was
        gathered: replies are matched to callers by order alone."""
        if self._flush_due:
            self._gathered.append(packed)
            return
        if self._cpu.contended:
            self._gathered.append(packed)
        else:  # the iteration's first: now (and, but for each, its others gathered)
            cast(asyncio.Transport, self.transport).write(packed)
            if self._each:
                return
        self._flush_due = True
        self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what was gathered. Nothing if the connection was lost or aborted
        meanwhile: ``connection_lost`` fails the callers waiting for those replies."""
        self._flush_due = False
        gathered, transport = self._gathered, self.transport
        if not gathered:
            return
        self._gathered = []
        if transport is not None and not transport.is_closing():
            transport.write(gathered[0] if len(gathered) == 1 else b"".join(gathered))

    def send_script(self, script: Script, packed: bytes) -> asyncio.Future[Any]:
        """Send an EVALSHA of ``script``; loaded and sent again if the server lacks it."""
        if self.transport is None or self.transport.is_closing():
            raise KeussConnectionError("connection to Redis lost")
        future = _Reply(loop=self._loop)
        self._waiting.append((future, script, packed))
        self._write(packed)
        return future


class _FastLane:
    """One pipelined connection, reconnected on the next call after it was lost."""

    def __init__(self, settings: dict[str, Any], write_mode: str = "auto") -> None:
        self._settings = settings
        self._write_mode = write_mode
        self._protocol: _LaneProtocol | None = None
        self._connecting: asyncio.Lock | None = None
        self._abandoned = False

    def call(self, args: Sequence[Any]) -> Awaitable[Any]:
        """Send one command; the reply (an error reply raises) is what the result awaits.

        Connected, the result is the reply future itself rather than a coroutine around it:
        the hot path then costs no coroutine frame, and the caller is woken straight from
        ``data_received``.
        """
        return self.call_packed(_pack(args))

    def call_packed(self, packed: bytes, script: Script | None = None) -> Awaitable[Any]:
        """:meth:`call` with the command already packed; for an EVALSHA of ``script``, a
        server that lacks the script gets it loaded, and the command again, by the
        protocol."""
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None:
            if script is None:
                return protocol.send(packed)
            return protocol.send_script(script, packed)
        return self._connect_and_send(packed, script)

    async def _connect_and_send(self, packed: bytes, script: Script | None) -> Any:
        try:
            protocol = await self._connect()
        except KeussConnectionError as exc:  # lost during the handshake
            exc.ran_nothing = True
            raise
        except Exception as exc:
            raise_translated(exc, _unsent)
        if script is None:
            return await protocol.send(packed)
        return await protocol.send_script(script, packed)

    async def _connect(self) -> _LaneProtocol:
        if self._abandoned:  # never again: the factory is closing (see ``abandon``)
            raise ClosedError("the factory's close gave up its connection to Redis")
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._protocol is not None and self._protocol.transport is not None:
                return self._protocol  # another caller reconnected meanwhile
            loop = asyncio.get_running_loop()
            settings = self._settings

            def make() -> _LaneProtocol:
                return _LaneProtocol(self._write_mode)

            async with asyncio.timeout(CONNECT_TIMEOUT):
                if settings.get("path"):
                    _, protocol = await loop.create_unix_connection(make, settings["path"])
                else:
                    transport, protocol = await loop.create_connection(
                        make, settings.get("host", "localhost"), settings.get("port", 6379)
                    )
                    keepalive.keep_alive(transport.get_extra_info("socket"))
                handshake = []
                if settings.get("password") is not None:
                    user = settings.get("username")
                    auth = (
                        ("AUTH", user, settings["password"])
                        if user
                        else ("AUTH", settings["password"])
                    )
                    handshake.append(protocol.send(_pack(auth)))
                if settings.get("db"):
                    handshake.append(protocol.send(_pack(("SELECT", settings["db"]))))
                try:
                    await asyncio.gather(*handshake)
                except KeussError:  # an error reply: a wrong password, a bad db index
                    if protocol.transport is not None:
                        protocol.transport.close()
                    raise
            self._protocol = protocol
            return protocol

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.flush()
            self._protocol.transport.close()
        self._protocol = None

    def abandon(self) -> None:
        """Fail every reply still awaited, at once, and refuse to connect again. A caller
        cancelled while waiting for a reply waits for it up to ``CANCEL_GRACE`` (see
        :class:`_Reply`); once a cancelled close's grace is spent, a server that stopped
        answering left each such wait, one after the other, to run its whole grace."""
        self._abandoned = True
        protocol, self._protocol = self._protocol, None
        if protocol is None:
            return
        protocol._fail(ClosedError("the factory's close gave up its connection to Redis"))
        if protocol.transport is not None:
            protocol.transport.abort()


_pack_command: Callable[[Any], bytes] = hiredis.pack_command  # its stubs say a 1-tuple


def _pack(args: Sequence[Any]) -> bytes:
    return _pack_command(args if type(args) is tuple else tuple(args))


def _response_error(message: str) -> redis_errors.RedisError:
    if message.startswith("ERR max number of clients reached"):
        return redis_errors.ConnectionError(message)  # as redis-py has it
    return _REPLY_ERRORS.get(message.split(" ", 1)[0], redis_errors.ResponseError)(message)


class Script:
    """A Lua script run by SHA; loaded on the server the first time it is missing there."""

    def __init__(self, text: str) -> None:
        import hashlib

        self.text = text.encode()
        self.sha = hashlib.sha1(self.text).hexdigest()


_KEPT_PACKED = 1024
"""The largest command a bound command keeps for a repeat of the same call: a bulk insert's
payloads are not held on to between calls."""


class BoundCall(Protocol):
    """A command with its first words fixed (see :meth:`RedisConnection.bind`)."""

    def __call__(self, *args: Any) -> Awaitable[Any]:
        """The command with ``args`` after its first words; its reply is what it awaits."""

    def sender(self, *args: Any) -> Callable[[], asyncio.Future[Any] | None]:
        """The command with ``args``, sent by each call of the result at once as its reply
        future, plain: cancelled with its caller, its reply goes to the one that refuses
        cancellation swapped in for it (see ``coalesce.settled``); or None when that cannot
        be done then (not connected, or no fast lane)."""

    def send_now(self, *args: Any) -> asyncio.Future[Any] | None:
        """:meth:`sender`'s call made once, with its packing: the future, or None."""


def _send_nothing() -> None:
    return None


class _Unbound:
    """A bound command on redis-py's client (no fast lane): nothing to pack ahead."""

    __slots__ = ("_run",)

    def __init__(self, run: Callable[[tuple[Any, ...]], Awaitable[Any]]) -> None:
        self._run = run

    def __call__(self, *args: Any) -> Awaitable[Any]:
        return self._run(args)

    def sender(self, *args: Any) -> Callable[[], asyncio.Future[Any] | None]:
        return _send_nothing

    def send_now(self, *args: Any) -> asyncio.Future[Any] | None:
        return None


class _Bound:
    """A command with its first words packed once (see :meth:`RedisConnection.bind`)."""

    __slots__ = ("_count", "_heads", "_lane", "_last_args", "_last_packed", "_prefix", "_script")

    def __init__(self, lane: _FastLane, head: Sequence[Any], script: Script | None) -> None:
        self._lane = lane
        self._script = script
        packed = _pack(head)
        self._count = len(head)
        self._prefix = packed[packed.index(b"\n") + 1 :]  # without its "*<count>" line
        # The whole head for up to 9 arguments, whose own packing starts "*<n>\r\n" (4 bytes)
        self._heads = [b"*%d\r\n%b" % (self._count + n, self._prefix) for n in range(10)]
        self._last_args: tuple[Any, ...] | None = None
        self._last_packed = b""

    def __call__(self, *args: Any) -> Awaitable[Any]:
        return self._lane.call_packed(self._packed(args), self._script)

    def sender(self, *args: Any) -> Callable[[], asyncio.Future[Any] | None]:
        """The call with these ``args``, packed now, and sent by each call of the result
        as its reply future; None when the lane is not connected (the caller then makes
        the call, which connects)."""
        lane, packed, script = self._lane, self._packed(args), self._script

        def send() -> asyncio.Future[Any] | None:
            protocol = lane._protocol
            if protocol is None or protocol.transport is None:
                return None
            return protocol.send_plain(packed, script)

        return send

    def send_now(self, *args: Any) -> asyncio.Future[Any] | None:
        """The call with these ``args``, sent at once as its reply future; None when the
        lane is not connected (the caller then makes the call, which connects)."""
        protocol = self._lane._protocol
        if protocol is None or protocol.transport is None:
            return None
        return protocol.send_plain(self._packed(args), self._script)

    def _packed(self, args: tuple[Any, ...]) -> bytes:
        last = self._last_args
        # Equal and of the same types (1 == 1.0 == True, but they pack apart)
        if args == last and all(map(operator.is_, map(type, args), map(type, last))):
            packed = self._last_packed
        else:
            n = len(args)
            if n == 0:
                packed = self._heads[0]
            elif n < 10:
                packed = self._heads[n] + _pack(args)[4:]
            else:
                tail = _pack(args)
                packed = b"*%d\r\n%b%b" % (
                    self._count + n,
                    self._prefix,
                    tail[tail.index(b"\n") + 1 :],
                )
            if len(packed) <= _KEPT_PACKED:  # a pop's or a reserve's, not a batch of payloads
                self._last_args, self._last_packed = args, packed
        return packed


_MAX_DB = 2**31 - 1


def check_redis_url(url: object, cluster: bool) -> str:
    """Refuse, before connecting, a URL redis-py would misread or refuse with a bare
    ``ValueError``: it ignores what it cannot parse, so ``redis:/127.0.0.1:6399`` connected
    to localhost:6379, and ``redis://host/x`` to database 0.

    Accepted, as redis-py documents them: ``redis://[[user]:password@]host[:port][/db]``,
    ``rediss://`` the same over TLS, ``unix://[[user]:password@]/path/to.sock``; query
    arguments as redis-py reads them (``?db=N`` among them). A port is an int in 1..65535, a
    database index an int >= 0 (Redis Cluster has only database 0).
    """
    if not isinstance(url, str):
        raise ConfigError(f"url must be a str, not {type(url).__name__}")
    shown = without_password(url)

    def bad(problem: str) -> ConfigError:
        return ConfigError(f"url {shown!r}: {problem}")

    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when it is not an int in 0..65535
    except ValueError as exc:
        raise bad(str(exc)) from exc
    scheme = parts.scheme  # lower-cased by urlsplit
    if scheme not in ("redis", "rediss", "unix"):
        raise bad("the scheme must be redis://, rediss:// or unix://")
    if url[len(scheme) + 1 : len(scheme) + 3] != "//":
        raise bad(f"expected {scheme}:// then the host (or for unix://, the socket path)")
    query = parse_qs(parts.query, keep_blank_values=True)
    ours = sorted(
        name
        for name in set(query) & _SET_HERE
        if [value.lower() for value in query[name]] != [_DEFAULT_HERE.get(name)]
    )
    if ours:
        raise bad(f"{', '.join(map(repr, ours))} is set by aio-keuss, not in the URL")
    unknown = sorted(set(query) - _query_names(scheme, cluster))
    if unknown:
        raise bad(
            f"redis-py takes no query argument {', '.join(map(repr, unknown))} in a"
            f" {scheme}:// URL{' for Redis Cluster' if cluster else ''}"
        )
    databases = query.get("db", [])
    if scheme == "unix":
        if cluster:
            raise bad("Redis Cluster needs a redis:// or rediss:// URL")
        if parts.hostname or port is not None:
            raise bad("a unix:// URL takes no host: unix:///path/to/redis.sock")
        if parts.path in ("", "/"):
            raise bad("a unix:// URL needs the socket path: unix:///path/to/redis.sock")
    else:
        if not parts.hostname:
            raise bad(f"no host: expected {scheme}://host[:port][/db]")
        if port == 0:
            raise bad("port 0 cannot be connected to")
        if parts.path not in ("", "/"):
            databases.insert(0, parts.path[1:])
    for db in databases:
        if not (db.isascii() and db.isdigit()) or int(db) > _MAX_DB:
            raise bad(f"the database index must be an int >= 0, not {db!r}")
        if cluster and int(db) != 0:
            raise bad("Redis Cluster has only database 0")
    return url


_SET_HERE = frozenset(
    {
        "connection_class",
        "decode_responses",
        "encoding",
        "encoding_errors",
        "maint_notifications_config",
        "reinitialize_steps",
        "retry",
    }
)
"""Client arguments the library sets itself (see ``_make_client``) or relies on at their
defaults: redis-py lets a URL's query override the keywords its caller passed, so
``?decode_responses=true`` handed the stores str replies where they read bytes, and
``?encoding=`` wrote str keys and arguments as other bytes than every other client's."""
_DEFAULT_HERE = {"encoding": "utf-8", "encoding_errors": "strict"}
"""Values of those a URL may still give, once each: they are what the library relies on
(redis-py's defaults), so a URL written for another client keeps working."""


@functools.cache  # a few (scheme, cluster) pairs; the signatures are read once for each
def _query_names(scheme: str, cluster: bool) -> frozenset[str]:
    """The query arguments redis-py can pass on for a URL of ``scheme``: ``from_url`` hands
    every one it does not know to the client's constructor as a keyword (the pool's and the
    connection class's for one node, ``RedisCluster``'s for a cluster), which fails with a
    bare ``TypeError`` at the first command (redis-py docs, "Connecting to Redis": URL
    query arguments). Read from the constructors' signatures, so a redis-py that adds one
    needs no change here; once per process for each scheme (the installed redis-py does
    not change under it)."""
    if cluster:
        constructors: tuple[type, ...] = (RedisCluster,)
    else:
        connection = {
            "redis": aioredis.Connection,
            "rediss": aioredis.SSLConnection,
            "unix": aioredis.UnixDomainSocketConnection,
        }[scheme]
        constructors = (aioredis.ConnectionPool, connection)
    names: set[str] = set()
    for constructor in constructors:
        for cls in constructor.__mro__:
            init = vars(cls).get("__init__")
            if init is None:
                continue
            names.update(
                name
                for name, parameter in inspect.signature(init).parameters.items()
                if name != "self"
                and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
            )
    return frozenset(names)


@dataclass(frozen=True)
class RedisOptions(BackendOptions):
    """``url=`` (or an existing redis-py ``client=``), ``prefix=`` of every key,
    ``cluster=`` for Redis Cluster, ``hash_tag=`` to keep every queue of the factory in
    one cluster hash slot (what ``move`` between queues needs on a cluster), and
    ``write_mode=`` of the library's own connection: ``auto`` (``first`` while the loop's
    thread gets a CPU when it wants one, ``gather`` while it waits for one), ``first``
    (the first command of a loop iteration written as it is sent, the iteration's others
    in one write at its end), ``gather`` (one write at the end of each iteration) or
    ``each`` (every command as it is sent)."""

    url: str = "redis://127.0.0.1:6379/0"
    client: Any = None
    prefix: str = "keuss"
    cluster: bool = False
    hash_tag: str | None = None
    write_mode: str = "auto"

    def __post_init__(self) -> None:
        prefix = self.prefix
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise ConfigError(f"prefix must be a non-empty str without braces, not {prefix!r}")
        if self.client is None:
            check_bool(self.cluster, "cluster")
            check_redis_url(self.url, self.cluster)
        tag = self.hash_tag
        if tag is not None and (not isinstance(tag, str) or not _HASH_TAG.fullmatch(tag)):
            raise ConfigError(f"hash_tag must be 1-64 letters, digits or _ . : -, not {tag!r}")
        if self.write_mode not in WRITE_MODES:
            raise ConfigError(
                f"write_mode must be one of {', '.join(WRITE_MODES)}, not {self.write_mode!r}"
            )


class RedisConnection(Backend):
    """The client (and the fast lane) every Redis role shares, and the names of its keys."""

    options_type: ClassVar[type[RedisOptions]] = RedisOptions
    options: ClassVar[dict[str, Any]] = RedisOptions.defaults()
    replay_hazard: ClassVar[str | None] = None
    """What a command run twice does on this backend (redis-py sending it again after its
    reply was lost), for the warning about a user's client that retries; None where
    nothing goes wrong."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.config = self.options_type.parse_own(options)
        self.prefix: str = self.config.prefix
        self._owns_client = self.config.client is None
        self.client: RedisClient = self.config.client or self._make_client()
        if not self._owns_client:
            self._warn_of_retries()
        self._sends_once = self._owns_client or command_retries(self.client) == 0
        self.cluster = isinstance(self.client, RedisCluster)
        if self.cluster and not hasattr(RedisCluster, "pubsub"):
            # the signal listener subscribes through the cluster client, which redis-py's
            # asyncio RedisCluster offers from 8.0 on; earlier, consumers would never be woken
            raise ConfigError("a Redis Cluster needs redis-py 8.0 or later (its pubsub)")
        self._tag = "" if self.config.hash_tag is None else "{" + self.config.hash_tag + "}:"
        self._lane = self._make_lane()
        if not self.one_slot:  # a script cannot reach two queues: no move between them
            self.capabilities = replace(self.capabilities, move=False)

    @property
    def one_slot(self) -> bool:
        """Whether a script may touch the keys of two queues (a single node, or a cluster
        whose queues all carry the factory's hash tag)."""
        return not self.cluster or bool(self._tag)

    def _make_client(self) -> RedisClient:
        """A redis-py client that never sends a command twice (see ``_no_retry``): the
        retry overrules ``retry_on_timeout`` in the URL too. A lost reply then raises
        KeussConnectionError, and what the command may have left reserved comes back when
        its reservation ends. On a cluster, MOVED and ASK are still followed and the
        topology reloaded after a connection error (by the next command): a redirected
        command did not run on the node that refused it. No number of MOVED replies closes
        the connections other tasks use (``CLUSTER_REINITIALIZE_STEPS``). A single node's
        pool checks a connection is still open before handing it out
        (``_pool_checks_connections``)."""
        cluster, url = self.config.cluster, self.config.url
        try:
            if cluster:
                return _cluster_attempts_off(
                    RedisCluster.from_url(
                        url,
                        decode_responses=False,
                        retry=_no_retry(),
                        reinitialize_steps=CLUSTER_REINITIALIZE_STEPS,
                    )
                )
            return aioredis.Redis.from_url(
                url, decode_responses=False, retry=_no_retry(), **_pool_checks_connections()
            )
        except ValueError as exc:  # a query argument redis-py cannot read
            raise ConfigError(f"url: {exc}") from exc

    def _warn_of_retries(self) -> None:
        """The user's client is theirs to configure (never changed here); say what its
        retries (and, on a cluster, its reloads of the topology; on a redis-py that skips
        it, the missing check for a closed connection) risk, once, as the backend is made."""
        steps = command_reinitializes(self.client)
        if steps:
            log.warning(
                "%s: the Redis Cluster client passed as client= closes every connection it "
                "holds on every %dth MOVED reply (reinitialize_steps), as a slot migrates: "
                "commands other tasks have in flight then fail, and a pop whose reply is "
                "cut loses its messages. Pass a client made with reinitialize_steps=0",
                self.name,
                steps,
            )
        if skips_closed_check(self.client):
            log.warning(
                "%s: the Redis client passed as client= has redis-py's maintenance "
                "notifications on (the default under RESP3), with which redis-py %s hands out "
                "a pooled connection the server closed (a restart) unchecked: the first "
                "command on it then fails, and a stop's put-back of popped messages is lost. "
                "Pass a client made with maint_notifications_config="
                "MaintNotificationsConfig(enabled=False) (redis.maint_notifications)",
                self.name,
                redis.__version__,
            )
        retries = command_retries(self.client)
        if not retries or self.replay_hazard is None:
            return
        log.warning(
            "%s: the Redis client passed as client= sends a command again after a "
            "connection error (%d retries): a command whose reply was lost after Redis ran "
            "it then runs twice, and %s. Pass a client made with "
            "retry=Retry(NoBackoff(), 0) (redis.asyncio.retry.Retry, redis.backoff.NoBackoff)",
            self.name,
            retries,
            self.replay_hazard,
        )

    def _make_lane(self) -> _FastLane | None:
        if not self._owns_client or self.cluster:
            return None
        url = self.config.url
        if not url.startswith(("redis://", "unix://")):
            return None  # TLS and the rest: redis-py knows them
        parsed = parse_url(url)
        if set(parsed) - {"host", "port", "db", "username", "password", "path", "connection_class"}:
            return None  # query options (timeouts, ...) that only redis-py honours
        return _FastLane(dict(parsed), self.config.write_mode)

    @property
    def has_fast_lane(self) -> bool:
        return self._lane is not None

    async def open(self) -> None:
        if self._owns_client:
            await translated(self.client.ping())
        else:
            _refuse_another_loop(self.client)
            try:
                await translated(self.client.ping())
            except RuntimeError as exc:  # a connection the check above could not see
                if "loop" not in str(exc):
                    raise
                raise _another_loop() from exc
        if self._lane is not None:
            await self._lane.call(("PING",))

    async def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        if self._owns_client:
            await self.client.aclose()

    def abandon(self) -> None:
        """See :meth:`Backend.abandon`: the fast lane's replies refuse cancellation for a
        while; redis-py's calls end once cancelled."""
        if self._lane is not None:
            self._lane.abandon()

    def key(self, queue: str, *parts: str) -> str:
        """``prefix:{queue}:part:...``: the braces make one cluster slot per queue. With
        ``hash_tag``, ``prefix:{tag}:{queue}:part:...``: Redis hashes only the first braces
        (Redis Cluster specification, "Hash tags"), so every queue shares the tag's slot."""
        return ":".join((self.prefix, self._tag + "{" + queue + "}", *parts))

    # The choke point: every command of every role goes through one of these, and each
    # raises ours (KeussConnectionError, BackendError), never redis-py's.

    def execute(self, *args: Any) -> Awaitable[Any]:
        """One command. On the fast lane the raw RESP reply (bytes, ints, lists); through
        redis-py, what redis-py makes of it (HGETALL gives a dict there).

        Not a coroutine function, so the fast lane's reply future is awaited directly (see
        :meth:`_FastLane.call`); await the result at once, as with a coroutine.
        """
        if self._lane is not None:
            return self._lane.call(args)
        return translated(self.client.execute_command(*args), self._sends_once)

    def run_script(
        self, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> Awaitable[Any]:
        """EVALSHA, loading the script once where the server lacks it (after a restart).

        Not a coroutine function (see :meth:`execute`): on the fast lane the reply future,
        which reloads the script itself when needed."""
        if self._lane is not None:
            return self._lane.call_packed(
                _pack(("EVALSHA", script.sha, len(keys), *keys, *args)), script
            )
        return self._run_script_slow(script, keys, args)

    async def _run_script_slow(
        self, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        try:
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except ScriptMissing:
            # EVAL runs it and caches it in one command (see ``_as_eval``); on a cluster,
            # on the node serving the keys
            return await self.execute("EVAL", script.text, len(keys), *keys, *args)

    def bind_script(self, script: Script, keys: Sequence[str]) -> BoundCall:
        """``script`` on fixed ``keys``, called with its arguments only: ``run(*args)``.

        On the fast lane the command is packed from a prefix packed once, and a call with
        the same arguments as the one before (a pop's none, a reserve's delay) sends the
        same bytes again without packing anything."""
        lane = self._lane
        if lane is None:
            return _Unbound(lambda args: self._run_script_slow(script, keys, args))
        return _Bound(lane, ("EVALSHA", script.sha, len(keys), *keys), script)

    def bind(self, *head: Any) -> BoundCall:
        """A command's first words (``"RPOP", key``), called with the rest: ``run(*args)``,
        packed as :meth:`bind_script` packs a script's call."""
        lane = self._lane
        if lane is None:
            return _Unbound(lambda args: self.execute(*head, *args))
        return _Bound(lane, head, None)

    async def hash_items(self, key: str) -> list[tuple[bytes, bytes]]:
        """HGETALL as (field, value) pairs, whichever path answered."""
        reply = await self.execute("HGETALL", key)
        if isinstance(reply, dict):
            return list(reply.items())
        return list(zip(reply[::2], reply[1::2], strict=True))

    async def subscribe(
        self, channel: str, on_message: Callable[[bytes], None], ready: Callable[[], None]
    ) -> None:
        """Deliver what is published on ``channel`` until cancelled or the connection is
        lost (KeussConnectionError); ``ready`` is called once the subscription is in place.
        Through redis-py's pub/sub, which on a cluster picks the node serving the channel."""
        pubsub: Any = self.client.pubsub()
        try:
            await translated(pubsub.subscribe(channel))
            pinged = False
            while True:
                message = await translated(pubsub.get_message(timeout=SUBSCRIBE_PING_EVERY))
                if message is None:
                    if pinged:  # silence since the PING: nobody is at the other end
                        raise KeussConnectionError("no answer to PING on the signal channel")
                    await translated(pubsub.ping())
                    pinged = True
                    continue
                pinged = False  # anything heard (a pong too) shows the connection is alive
                if message["type"] == "message":
                    on_message(message["data"])
                elif message["type"] == "subscribe":
                    ready()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(pubsub.aclose())
