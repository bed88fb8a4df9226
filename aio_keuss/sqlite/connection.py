"""The bottom of the sqlite package: the database file, the thread that owns its connection,
the schema and its migrations, and the one place where ``sqlite3``'s errors become ours.

``sqlite3`` blocks, and a connection belongs to the thread that made it (Python's sqlite3
documentation, ``check_same_thread``). So every open backend starts one thread of its own,
which opens the file, then runs the calls the event loop hands it, one at a time, and hands
each result back to the loop of its caller (``call_soon_threadsafe``): the event loop never
waits on the disk or on another process's lock. A call is a plain function of the
connection; a write runs inside ``BEGIN IMMEDIATE`` ... ``COMMIT``, which takes the database's
write lock at its start rather than at its first write, so two processes never both read
a row and then fight over updating it (SQLite documentation, "BEGIN TRANSACTION": a
deferred transaction that later writes can fail with SQLITE_BUSY instead of waiting).
Writes queued behind each other share one transaction, each in a savepoint of its own, and
are answered after its one COMMIT: one sync to disk serves them all.

The file is in WAL mode (SQLite documentation, "Write-Ahead Logging"): readers and the one
writer do not block each other, and several processes can share the file on one machine
(not over a network file system, which WAL does not support). Writers from other processes
wait for each other through the busy timeout (``busy_timeout``, "PRAGMA busy_timeout").
With ``synchronous=FULL`` (the default) a commit is on disk when it returns, so nothing
acknowledged is lost even to a power cut; ``NORMAL`` keeps it through a crash of the
process but may lose the last commits to a power cut (SQLite documentation, "PRAGMA
synchronous"). The WAL is copied back into the database by the thread itself, between
calls, once it has grown past a few MB, not by SQLite inside whichever commit crosses its
threshold (SQLite documentation, "Write-Ahead Logging", "Automatic Checkpoint"): a
checkpoint never delays the answer of the commit before it.

The thread also watches the file for commits of other connections when the signal bus asks
it to (:meth:`SqliteConnection.watch`): ``PRAGMA data_version`` changes when, and only when,
another connection committed (SQLite documentation, "PRAGMA data_version"); it is read
between calls, every ``signal_poll`` seconds, without waking the event loop, and less
often (up to five times that) once the file has been quiet for a while.

The schema is versioned: ``sql/migrations`` holds numbered steps and the file's
``user_version`` (SQLite documentation, "PRAGMA user_version") the last one applied; steps
run inside one ``BEGIN IMMEDIATE`` transaction, so processes opening the file at once take
turns. ``application_id`` marks the file as ours, so a database of another program is
refused rather than written to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import re
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn, TypeVar

from ..contract import Backend
from ..errors import (
    BackendError,
    ClosedError,
    ConfigError,
    KeussConnectionError,
    KeussError,
    raise_translated,
    translating,
)
from ..options import BackendOptions, brief, check_option_seconds
from .sql import migrations, queries

log = logging.getLogger("aio_keuss.sqlite")

T = TypeVar("T")
Work = Callable[[sqlite3.Connection], T]

MEMORY = ":memory:"
"""A database in this connection's memory: one factory's queues, gone when it closes."""
APPLICATION_ID = 0x4B455553
"""``PRAGMA application_id`` of our files ("KEUS"): SQLite documentation, "Database File
Format", offset 68, an id for the program a file belongs to."""
SYNCHRONOUS = ("full", "normal")
MAX_BUSY_TIMEOUT = (2**31 - 1) // 1000
"""Most seconds of ``busy_timeout``: SQLite takes it as an ``int`` of milliseconds, and one
at or below zero turns the busy handler off (SQLite documentation, "sqlite3_busy_timeout"),
so a larger value, wrapped into an int by ``sqlite3.connect``, made writes fail at once."""
MIN_SIGNAL_POLL = 0.001
"""Fewest seconds of ``signal_poll``: the thread wakes for every look, even on an idle file
(at most ``IDLE_SLOWDOWN`` times this apart), so a microsecond kept one CPU core busy for
as long as the factory was open, for wake-ups no finer than the event loop's timers."""
MAX_SIGNAL_POLL = 10.0
THREAD_END_WAIT = 5.0
"""Longest a close waits for its stopped database thread to end (it only closes the
connection, which checkpoints the WAL when it is the last one)."""
THREAD_END_LOOK = 0.002
"""Seconds between two looks of that wait."""
LONGEST_ROW = 1_000_000_000 - 65_536
"""SQLite's default ``SQLITE_MAX_LENGTH`` bounds a string, a BLOB and a whole row at
1,000,000,000 bytes (SQLite documentation, "Limits In SQLite"): a message's payload and
headers together stay under it with room for the rest of its row."""

# Primary result codes (SQLite documentation, "Result and Error Codes").
_BUSY = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
_UNUSABLE_FILE = (
    sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_NOTADB,
    sqlite3.SQLITE_PERM,
    sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_AUTH,
)


def _code(exc: sqlite3.Error) -> int | None:
    code: int | None = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _ours(exc: Exception) -> KeussError | None:
    """The error of ours a ``sqlite3`` error becomes: the file locked by another process
    past the busy timeout -> KeussConnectionError (retry later); a file that cannot be
    opened, read or written -> ConfigError; a closed connection -> KeussConnectionError;
    anything else -> BackendError. None for what is not ``sqlite3``'s."""
    if not isinstance(exc, sqlite3.Error):
        return None
    text = f"sqlite3.{type(exc).__name__}: {exc}"
    code = _code(exc)
    if code in _BUSY:
        return KeussConnectionError(text)
    if code in _UNUSABLE_FILE:
        return ConfigError(text)
    if isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc):
        return KeussConnectionError(text)
    return BackendError(text)


def _at_open(exc: Exception) -> KeussError | None:
    """At open, every error but a busy file means the path is not a usable database; so
    does a path ``sqlite3.connect`` itself refuses (a ValueError: one it cannot encode)."""
    if isinstance(exc, ValueError | OSError) and not isinstance(exc, sqlite3.Error):
        return ConfigError(f"{type(exc).__name__}: {exc}")
    ours = _ours(exc)
    if ours is None or isinstance(ours, KeussConnectionError):
        return ours
    return ConfigError(str(ours))


translated = translating(_ours)
"""For the connection's methods that reach the database: sqlite3's errors leave as ours."""


def raise_ours(exc: Exception) -> NoReturn:
    """Raise what ``exc`` becomes (a failure met on the database thread outside a call,
    in a watch)."""
    raise_translated(exc, _ours)


_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})?")
_SEPARATORS = tuple(filter(None, (os.sep, os.altsep)))
"""The path separators of this platform ("/" among them everywhere Python runs)."""


def _unescape(url: str, segment: str) -> str:
    """One path segment with its ``%HH`` escapes decoded: each escape is one octet (RFC
    3986, 2.1), and text is UTF-8 before it is escaped (RFC 3986, 2.5; SQLite's "URI
    Filenames" reads its own ``file:`` URIs as UTF-8 too). A ``%`` not followed by two hex
    digits is refused: RFC 3986 has no such thing, and taking it literally would open a
    file other than the one meant (a literal ``%`` is written ``%25``). So is an escaped
    separator (``%2F``): RFC 3986 (2.2) makes it data inside the segment, not a separator,
    and no file name can hold one; and so are octets that are not UTF-8, whose file name
    would depend on the platform's encoding."""
    if "%" not in segment:
        return segment  # nothing to decode (a name the file system cannot take: check_path)
    octets = bytearray()
    start = 0
    for escape in _ESCAPE.finditer(segment):
        if escape.group(1) is None:
            raise ConfigError(
                f"url {brief(url)}: '%' must start an escape of two hex digits (%HH);"
                " a '%' of the file name is written %25"
            )
        octets += segment[start : escape.start()].encode(errors="surrogatepass")
        octets.append(int(escape.group(1), 16))
        start = escape.end()
    try:
        octets += segment[start:].encode(errors="surrogatepass")
        text = octets.decode("utf-8")
    except UnicodeError:  # a lone surrogate beside the escapes, or octets not UTF-8
        raise ConfigError(
            f"url {brief(url)}: its %-escapes are not UTF-8 (RFC 3986, 2.5)"
        ) from None
    if any(sep in text for sep in _SEPARATORS):
        raise ConfigError(
            f"url {brief(url)}: an escaped path separator (%2F) is part of a file name, which"
            " cannot hold one (RFC 3986, 2.2): write the separator itself"
        )
    return text


def path_from_url(url: object) -> str:
    """The path in a ``sqlite://`` URL, laid out as SQLAlchemy lays it out (its "SQLite"
    dialect documentation): ``sqlite:///relative.db``, ``sqlite:////absolute/path.db``,
    and ``sqlite://`` or ``sqlite:///:memory:`` for a database in memory. No host, no
    query, no fragment: an unescaped ``?`` or ``#`` is where RFC 3986 (3.4, 3.5) ends the
    path, and dropping what follows would open another file, so it is refused. The path's
    ``%HH`` escapes are decoded segment by segment (:func:`_unescape`), as RFC 3986 and
    SQLite's "URI Filenames" decode them: ``%20`` is a space, ``%23`` a ``#``, ``%3F`` a
    ``?``, ``%25`` a ``%``; other characters stand for themselves."""
    if not isinstance(url, str):
        raise ConfigError(f"url must be a str, not {type(url).__name__}")
    scheme, slashes, rest = url.partition("://")
    if not slashes or scheme.lower() != "sqlite":
        raise ConfigError(
            f"url {brief(url)}: expected sqlite:///relative.db or sqlite:////absolute.db"
        )
    if not rest:
        return MEMORY
    if not rest.startswith("/"):
        raise ConfigError(f"url {brief(url)}: a sqlite url has no host (sqlite:///path)")
    if "?" in rest or "#" in rest:
        raise ConfigError(
            f"url {brief(url)}: a sqlite url takes no query or fragment (a '?' or '#' of the"
            " file name is written %3F or %23)"
        )
    path = "/".join(_unescape(url, segment) for segment in rest[1:].split("/"))
    return path or MEMORY


def check_path(path: object) -> str:
    """The database file, checked before anything opens it: a str or path-like naming a
    file (or ``:memory:``) whose directory exists. SQLite would create the file, but not
    its directory, and its error says only "unable to open database file"."""
    if not isinstance(path, str | os.PathLike):
        raise ConfigError(f"path must be a str or path-like, not {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"path must be a non-empty file name, not {brief(path)}")
    if text == MEMORY:
        return text
    if "\x00" in text:
        raise ConfigError(f"path {brief(text)} has a NUL character")
    try:
        os.fsencode(text)  # what sqlite3.connect does with it (Python's os documentation)
    except UnicodeEncodeError:
        raise ConfigError(
            f"path {brief(text)} cannot be a file name here: it has a character the file"
            " system encoding cannot encode"
        ) from None
    if text.endswith(_SEPARATORS):
        # Path() drops the separator and SQLite opens the name without it: "data/" made a
        # file called "data" where a directory was meant
        raise ConfigError(f"path {text!r} ends with a separator: it names a directory")
    file = Path(text)
    if file.is_dir():
        raise ConfigError(f"path {text!r} is a directory, not a database file")
    if not file.parent.is_dir():
        raise ConfigError(f"path {text!r}: no directory {str(file.parent)!r}")
    return text


URI_PREFIX = "file:"
"""How a URI filename starts: SQLite reads a name starting so as a URI even when the
caller did not ask for one (``uri=False``), if it was built with ``SQLITE_USE_URI`` (SQLite
documentation, "URI Filenames", 3.0; Debian's and others' builds are), and ``sqlite3``
has no way to turn that off for one connection."""


def file_name(database: str) -> str:
    """The name handed to ``sqlite3.connect`` for the checked ``database``: itself, but a
    relative name that SQLite would read as a URI (``file:queues.db`` opened
    ``queues.db``; ``file:q.db?mode=ro`` opened ``q.db`` read-only) is given as
    ``./file:...``, the same file, which no SQLite reads as a URI."""
    if database.startswith(URI_PREFIX):
        return os.path.join(os.curdir, database)
    return database


@dataclass(frozen=True)
class SqliteOptions(BackendOptions):
    """The ``sqlite`` backend's options: the database file as ``path=`` or ``url=``
    (``sqlite:///relative.db``, ``sqlite:////absolute.db``; ``:memory:`` for one factory's
    own in-memory database), ``busy_timeout`` (seconds a write waits for another
    process's, default 5), ``synchronous`` (``"full"``, default, or ``"normal"``) and
    ``signal_poll`` (seconds between looks for other processes' signals, default 0.02)."""

    path: Any = None
    url: str | None = None
    busy_timeout: float = 5.0
    synchronous: str = "full"
    signal_poll: float = 0.02

    def __post_init__(self) -> None:
        if (self.path is None) == (self.url is None):
            raise ConfigError("the sqlite backend needs path= or url= (one of them)")
        self.database()
        if check_option_seconds(self.busy_timeout, "busy_timeout") > MAX_BUSY_TIMEOUT:
            raise ConfigError(
                f"busy_timeout must be at most {MAX_BUSY_TIMEOUT:,} seconds (SQLite's limit),"
                f" not {brief(self.busy_timeout)}"
            )
        if self.synchronous not in SYNCHRONOUS:
            raise ConfigError(
                f"synchronous must be one of {', '.join(SYNCHRONOUS)}, not"
                f" {brief(self.synchronous)}"
            )
        poll = check_option_seconds(self.signal_poll, "signal_poll")
        if not MIN_SIGNAL_POLL <= poll <= MAX_SIGNAL_POLL:
            raise ConfigError(
                f"signal_poll must be in [{MIN_SIGNAL_POLL}, {MAX_SIGNAL_POLL}] seconds"
            )

    def database(self) -> str:
        """The checked file name (or ``:memory:``)."""
        if self.url is None:
            return check_path(self.path)
        try:
            return check_path(path_from_url(self.url))
        except ConfigError as exc:
            if str(exc).startswith("url "):
                raise
            raise ConfigError(f"url {brief(self.url)}: {exc}") from None


class _Reply(asyncio.Future[Any]):
    """The answer of a call on the database thread. It refuses cancellation: the thread
    does the work whatever happens to the caller, so a caller cancelled meanwhile still
    learns what was done (a pop's messages are then put back, see ``Store.uninterruptible``)
    rather than leaving it half known."""

    def cancel(self, msg: Any | None = None) -> bool:
        return False


def _settle(reply: _Reply, result: Any, error: BaseException | None) -> None:
    if reply.done():  # answered before a failed thread answered it again: the first stands
        return
    if error is None:
        reply.set_result(result)
    else:
        reply.set_exception(error)


class _Call:
    """One call handed to the database thread: ``work`` and where its answer goes.
    ``write``: run it in a write transaction (shared with the writes queued behind it)."""

    __slots__ = ("loop", "reply", "work", "write")

    def __init__(
        self,
        work: Callable[[sqlite3.Connection], Any],
        write: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.work = work
        self.write = write
        self.loop = loop
        self.reply = _Reply(loop=loop)

    def answer(self, result: Any, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
            self.loop.call_soon_threadsafe(_settle, self.reply, result, error)


_LOOK = object()
"""Put on the call queue to wake the thread for a look at the file (a new watch)."""
_NOTHING = object()
"""No item taken from the call queue and left to serve."""
IDLE_SLOWDOWN = 5
"""How many times ``signal_poll`` apart the looks at an idle file may grow."""
GROUP_MOST = 64
"""Most write calls one transaction (one commit) serves."""
CHECKPOINT_BYTES = 4 * 1024 * 1024
"""WAL bytes past which the database thread checkpoints: about SQLite's own default of
1000 pages of 4 KiB (SQLite documentation, "Write-Ahead Logging", "Automatic Checkpoint"),
and the size the WAL file is cut back to once the log restarts ("PRAGMA
journal_size_limit"). Once a checkpoint has to wait for calls queued behind it, it waits
for one more of these at most."""


_OPEN_THREADS: weakref.WeakSet[_Thread] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads: a call handed to one would wait
    for ever. SQLite's documentation ("How To Corrupt An SQLite Database File", 2.6) also
    forbids carrying an open connection across a fork. So the child refuses the calls."""
    for thread in _OPEN_THREADS:
        thread.orphaned = True


if hasattr(os, "register_at_fork"):  # not on Windows, where processes are spawned
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Thread:
    """The thread that owns the connection: runs calls in order, and between them, while
    a watch is set, looks for other connections' commits every ``poll`` seconds."""

    def __init__(self, database: str, busy_timeout: float, poll: float) -> None:
        self.orphaned = False
        _OPEN_THREADS.add(self)
        self._database = database
        self._busy_timeout = busy_timeout
        self._poll = poll
        self._calls: queue.SimpleQueue[_Call | object | None] = queue.SimpleQueue()
        self._next: object = _NOTHING  # taken from the queue, not served yet
        self._next_look = 0.0
        self._active = time.monotonic()  # when the file last changed or a call came
        self._watch: Callable[[sqlite3.Connection], bool] | None = None
        self._serving: list[_Call] = []  # the calls being run, answered or not yet
        self._wal: str | None = None  # the WAL file, once this thread checkpoints it
        self._wrote = False  # a write since the last look at the WAL's size
        self._checkpoint_past = CHECKPOINT_BYTES  # WAL bytes that call for a checkpoint
        self._checkpointed_at = 0  # the WAL's size at this thread's last checkpoint
        self._ended: BaseException | None = None  # what ended the thread, if it failed
        self._thread = threading.Thread(
            target=self._main, name=f"aio-keuss sqlite {database}", daemon=True
        )
        self._thread.start()

    def submit(self, work: Callable[[sqlite3.Connection], Any], write: bool = False) -> _Reply:
        if self.orphaned:
            raise KeussConnectionError(
                "this sqlite backend was opened before a fork, in the parent process:"
                " connect again in this one"
            )
        if self._ended is not None:
            raise self._end_error()
        call = _Call(work, write, asyncio.get_running_loop())
        self._calls.put(call)
        if self._ended is not None:  # it ended meanwhile, maybe after its last look
            self._fail_queued()
        return call.reply

    @property
    def ended(self) -> BaseException | None:
        """What ended the thread, if it failed."""
        return self._ended

    def checkpoint(self, wal: str) -> None:
        """Have this thread checkpoint ``wal`` (the connection's own automatic checkpoint
        was turned off): called once the setup call returned, before any other call."""
        self._wal = wal

    def watch(self, look: Callable[[sqlite3.Connection], bool] | None) -> None:
        self._watch = look
        self._next_look = 0.0  # at once
        self._calls.put(_LOOK)

    def stop(self) -> None:
        self._calls.put(None)

    async def ended_within(self, bound: float) -> None:
        """Wait, without blocking the loop, until the thread has ended (it was stopped),
        ``bound`` seconds at most. A stopped thread only closes its connection and returns,
        but it does so in its own time: a close that returned before it had, left it to be
        counted by whoever looks at the process's threads next (a fork, a test)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound
        # looked at, not signalled: a thread is still alive (and listed) for a moment after
        # its last line runs, so only is_alive() tells it has gone
        while self._thread.is_alive() and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(THREAD_END_LOOK)

    def close_connection(self, connection: sqlite3.Connection) -> None:
        """The close's call, run on this thread: the watch and the checkpoint are dropped
        with the connection, so that nothing runs on it between this call and the stop that
        follows (a checkpoint left for later by a write with this call queued behind it ran
        on the closed connection, and logged its failure as a warning)."""
        self._watch = None
        self._wal = None
        connection.close()

    def _connect(self) -> sqlite3.Connection | Exception:
        try:
            # isolation_level=None: no implicit transactions; every write says BEGIN
            # IMMEDIATE itself. timeout: the busy timeout, in seconds.
            return sqlite3.connect(
                file_name(self._database),
                timeout=self._busy_timeout,
                isolation_level=None,
                cached_statements=256,
            )
        except Exception as exc:  # a path it cannot encode is a ValueError, say
            return exc

    def _main(self) -> None:
        """Serve calls until stopped. Should the thread fail anyway, every call it took
        and every call still queued is answered with that failure: a reply refuses
        cancellation, so a call nobody answers holds its caller for ever, past any
        timeout."""
        try:
            self._serve()
        except BaseException as exc:
            log.critical("the sqlite database thread failed", exc_info=True)
            self._end(exc)

    def _end(self, exc: BaseException) -> None:
        self._ended = exc
        error = self._end_error()
        for call in self._serving:  # one answered already keeps its answer (_settle)
            call.answer(None, error)
        left, self._next = self._next, _NOTHING
        if isinstance(left, _Call):
            left.answer(None, error)
        self._fail_queued()

    def _end_error(self) -> KeussConnectionError:
        return KeussConnectionError(
            f"the sqlite database thread failed ({self._ended!r}): connect again"
        )

    def _fail_queued(self) -> None:
        """Answer the calls queued for a thread that has ended (from either thread: each
        call is taken off the queue once)."""
        error = self._end_error()
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Call):
                item.answer(None, error)

    def _serve(self) -> None:
        connection = self._connect()
        try:
            while True:
                item, self._next = self._next, _NOTHING
                if item is _NOTHING:
                    wait = None if self._watch is None else self._until_look()
                    try:
                        item = self._calls.get(timeout=wait)
                    except queue.Empty:
                        item = _LOOK
                if item is None:
                    return
                if isinstance(item, _Call):
                    self._active = time.monotonic()
                    self._serving = [item]
                    if not isinstance(connection, sqlite3.Connection):
                        item.answer(None, connection)
                    elif item.write:
                        self._serving = self._group(item)
                        _write_group(connection, self._serving)
                        self._wrote = True
                    else:
                        _read(connection, item)
                    self._serving = []
                if isinstance(connection, sqlite3.Connection):
                    self._look_if_due(connection)
                    if self._wrote:
                        self._checkpoint_if_due(connection)
        finally:
            if isinstance(connection, sqlite3.Connection):
                with contextlib.suppress(sqlite3.Error):
                    connection.close()

    def _until_look(self) -> float:
        return max(0.0, self._next_look - time.monotonic())

    def _look_if_due(self, connection: sqlite3.Connection) -> None:
        """Run the watch if its time has come. Looks are ``poll`` apart while the file
        changes (or this thread serves calls); after a quiet spell they slow down, to a
        tenth of its length, at most ``IDLE_SLOWDOWN`` times ``poll``: each look wakes this
        thread, which costs more than the look itself, and an idle factory should cost next
        to nothing."""
        look = self._watch
        now = time.monotonic()
        if look is None or now < self._next_look:
            return
        try:
            if look(connection):
                self._active = now
        except Exception:  # its owner reports its own failures; keep serving
            log.exception("sqlite watch failed")
        quiet = now - self._active
        self._next_look = now + min(self._poll * IDLE_SLOWDOWN, max(self._poll, quiet / 10))

    def _checkpoint_if_due(self, connection: sqlite3.Connection) -> None:
        """Copy the WAL back into the database once it has grown past ``CHECKPOINT_BYTES``,
        here, after the calls of the last commit were answered, rather than inside that
        commit: with SQLite's automatic checkpoint the COMMIT that crosses the threshold
        runs the checkpoint before it returns (SQLite documentation, "Write-Ahead
        Logging", "Automatic Checkpoint"), so one caller in a thousand pages waited for
        it. It waits for the thread to be idle (nothing queued), unless calls keep coming
        until the WAL has grown by one more ``CHECKPOINT_BYTES``: then it runs between two
        of them, so the WAL cannot grow without bound.

        PASSIVE never waits for readers or writers, of this process or another ("PRAGMA
        wal_checkpoint"): it copies what no reader still needs. What a reader's snapshot
        holds back is copied by a later checkpoint, tried once the WAL has grown by
        another ``CHECKPOINT_BYTES`` (not after every commit, which would only find the
        same reader). Once every frame is copied, the next writer of any process starts
        the log over and, with ``journal_size_limit``, cuts the file back to
        ``CHECKPOINT_BYTES``; the WAL file's size on disk is what is watched (a ``stat``,
        no lock taken), and its shrinking tells that the log started over."""
        wal = self._wal
        if wal is None:
            self._wrote = False
            return
        try:
            size = os.stat(wal).st_size
        except OSError:  # not made yet, or removed by the last connection to close
            size = 0
        if size < self._checkpointed_at:  # the log started over since: count afresh
            self._checkpoint_past, self._checkpointed_at = CHECKPOINT_BYTES, 0
        if size <= self._checkpoint_past:
            self._wrote = False
            return
        idle = self._next is _NOTHING and self._calls.empty()
        if not idle and size <= self._checkpoint_past + CHECKPOINT_BYTES:
            return  # after the calls queued, or between two of them past one more
        self._wrote = False
        self._checkpointed_at = size
        self._checkpoint_past = size + CHECKPOINT_BYTES
        try:
            busy, log_frames, copied = connection.execute(
                "PRAGMA wal_checkpoint(PASSIVE)"
            ).fetchone()
        except sqlite3.Error:  # nothing is lost: the frames stay in the WAL for the next
            log.warning("sqlite checkpoint failed", exc_info=True)
            return
        log.debug(
            "sqlite checkpoint of %s: %d of %d frames copied%s",
            wal,
            copied,
            log_frames,
            " (another checkpoint was running)" if busy else "",
        )

    def _group(self, first: _Call) -> list[_Call]:
        """``first`` and the write calls queued right behind it (up to ``GROUP_MOST``):
        they share one transaction and so one commit, which with ``synchronous=FULL`` is
        one sync of the WAL to disk instead of one per call (SQLite documentation, "PRAGMA
        synchronous"). The first other item is kept to be served next, in order."""
        group = [first]
        while len(group) < GROUP_MOST:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Call) and item.write:
                group.append(item)
            else:
                self._next = item
                break
        return group


def _read(connection: sqlite3.Connection, call: _Call) -> None:
    try:
        result = call.work(connection)
    except BaseException as exc:  # handed to the caller, whatever it is
        call.answer(None, exc)
    else:
        call.answer(result, None)


_Outcome = tuple[Any, BaseException | None]
"""A call's result, or the error it is answered with."""


def _write_group(connection: sqlite3.Connection, group: list[_Call]) -> None:
    """Run the calls of ``group`` in one ``BEGIN IMMEDIATE`` transaction, each inside a
    savepoint of its own (SQLite documentation, "SAVEPOINT"): a call that fails is rolled
    back alone and answered with its error; the others are answered once the one COMMIT
    has returned, so none is acknowledged before it is durable. If the transaction cannot
    begin or commit, every call of it is answered with that error, having changed
    nothing."""

    def each_in_a_savepoint(connection: sqlite3.Connection) -> list[_Outcome]:
        outcomes: list[_Outcome] = []
        for call in group:
            connection.execute("SAVEPOINT call")
            try:
                result = call.work(connection)
            except BaseException as exc:
                if not connection.in_transaction:
                    raise  # SQLite rolled the whole transaction back (an I/O error)
                connection.execute("ROLLBACK TO call")
                connection.execute("RELEASE call")
                outcomes.append((None, exc))
            else:
                connection.execute("RELEASE call")
                outcomes.append((result, None))
        return outcomes

    try:
        outcomes = in_transaction(connection, each_in_a_savepoint)
    except BaseException as exc:  # nothing of the group was kept
        outcomes = [(None, exc)] * len(group)
    for call, (result, error) in zip(group, outcomes, strict=True):
        call.answer(result, error)


def in_transaction(connection: sqlite3.Connection, work: Work[T]) -> T:
    """Run ``work`` inside ``BEGIN IMMEDIATE`` ... ``COMMIT`` (on the database thread);
    rolled back if it raises, so a primitive is applied whole or not at all."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        result = work(connection)
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                connection.execute("ROLLBACK")
        raise
    return result


def in_snapshot(connection: sqlite3.Connection, work: Work[T]) -> T:
    """Run ``work``'s reads in one read transaction (a deferred ``BEGIN``, then ended), so
    that they see the file as it was at one moment: outside one each statement sees the
    latest commit, and another process's commit can fall between two of them (SQLite
    documentation, "Transaction", "Isolation In SQLite")."""
    connection.execute("BEGIN")
    try:
        return work(connection)
    finally:
        if connection.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                connection.execute("ROLLBACK")


def _version(connection: sqlite3.Connection, known: int) -> int:
    """The schema version of the file, refusing (ConfigError) a file another program
    marked as its own, or one a newer aio-keuss migrated past the ``known`` steps. These
    are the first reads of the file: one that is not a database fails here too. Its reads
    are to see one state of the file (:func:`in_snapshot`, or the migrating transaction):
    the marks read before another process's migration committed and the tables after it
    looked like another program's tables."""
    owner = connection.execute("PRAGMA application_id").fetchone()[0]
    version: int = connection.execute("PRAGMA user_version").fetchone()[0]
    # Unmarked, it is ours to take only while empty: most programs set neither mark, and
    # ours sets both in the transaction that makes its first table (SQLite documentation,
    # "The Schema Table").
    unmarked = owner == 0 and version == 0
    if (
        owner not in (0, APPLICATION_ID)
        or (owner == 0 and version != 0)
        or (unmarked and connection.execute("SELECT count(*) FROM sqlite_master").fetchone()[0])
    ):
        raise ConfigError(
            "the file is a database of another program (its application_id or"
            " user_version is not aio-keuss's, or it has tables without aio-keuss's"
            " application_id): use a file of its own for the queues"
        )
    if version > known:
        raise ConfigError(
            f"the database is at schema version {version}, made by a newer aio-keuss"
            f" than this one (which knows versions up to {known}): upgrade aio-keuss"
            " to open it"
        )
    return version


def _migrate(connection: sqlite3.Connection, known: int) -> None:
    """Apply the steps the file lacks, in order, record the last in ``user_version`` and
    mark the file as ours, all in one write transaction."""

    def apply(connection: sqlite3.Connection) -> None:
        version = _version(connection, known)  # again: another process may have migrated
        for step, statements in migrations():
            if step > version:
                for statement in statements:
                    connection.execute(statement)
                connection.execute(f"PRAGMA user_version = {step:d}")
        connection.execute(f"PRAGMA application_id = {APPLICATION_ID:d}")

    in_transaction(connection, apply)


def _check_writable(connection: sqlite3.Connection) -> None:
    """Refuse (ConfigError) a file this process may read but not write. SQLite opens one
    read-only without a word ("sqlite3_open_v2": read-write "if possible, or reading only
    if the file is write protected by the operating system"), and ``sqlite3`` cannot ask
    which it got (``sqlite3_db_readonly`` is not exposed), so a write is tried: the
    ``user_version`` set to what it is, in a write transaction rolled back, which leaves
    the file as it was. Otherwise the open succeeded and the first write of every queue
    failed. Taking the write lock, it waits for another process's writer like any write."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        connection.execute(f"PRAGMA user_version = {version:d}")
    except sqlite3.Error as exc:
        if _code(exc) != sqlite3.SQLITE_READONLY:
            raise
        raise ConfigError(
            f"the database file is read-only for this process ({exc}): its permissions,"
            " its owner, or a read-only file system; the queues need to write to it"
        ) from exc
    finally:
        if connection.in_transaction:
            connection.execute("ROLLBACK")


def _setup(connection: sqlite3.Connection, options: SqliteOptions, memory: bool) -> str | None:
    """Check the file is ours (or new) before anything is written to it, then WAL,
    durability, and the schema steps it lacks. Answers the WAL file's name, for the
    database thread to checkpoint (None in memory): this connection's automatic
    checkpoint is turned off ("PRAGMA wal_autocheckpoint"), since it would run inside
    the commit that crosses its threshold, and ``journal_size_limit`` cuts the WAL file
    back once the log starts over, which SQLite does not do by default ("PRAGMA
    journal_size_limit")."""
    steps = migrations()
    known = steps[-1][0] if steps else 0
    version = in_snapshot(connection, lambda connection: _version(connection, known))
    wal = None
    if not memory:
        _check_writable(connection)
        mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ConfigError(f"the database could not be put in WAL mode (it is in {mode})")
        connection.execute("PRAGMA wal_autocheckpoint = 0")
        connection.execute(f"PRAGMA journal_size_limit = {CHECKPOINT_BYTES:d}")
        # the file's full name, as SQLite opened it: a later chdir does not move it
        files = {row[1]: row[2] for row in connection.execute("PRAGMA database_list")}
        wal = files["main"] + "-wal"
    connection.execute(f"PRAGMA synchronous = {options.synchronous.upper()}")
    if version < known:
        _migrate(connection, known)
    return wal


class SqliteConnection(Backend):
    """The database thread (started on open), the schema and the statements, for every
    role of the sqlite backend; the only way they reach the file."""

    options_type: ClassVar[type[SqliteOptions]] = SqliteOptions
    options: ClassVar[dict[str, Any]] = SqliteOptions.defaults()

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.config = self.options_type.parse_own(options)
        self.database = self.config.database()
        self.memory = self.database == MEMORY
        self.sql: dict[str, str] = queries()
        self._thread: _Thread | None = None

    @translating(_at_open)
    async def open(self) -> None:
        thread = _Thread(self.database, self.config.busy_timeout, self.config.signal_poll)
        self._thread = thread
        config, memory = self.config, self.memory
        try:
            wal = await thread.submit(lambda connection: _setup(connection, config, memory))
        except BaseException as exc:
            self._thread = None
            thread.stop()
            if isinstance(exc, Exception):
                # as a close does: a refused connect that returned before its thread had
                # ended left one more thread per failed attempt for whoever counts them
                # (a retry loop, a fork); a cancelled one only stops it
                await thread.ended_within(THREAD_END_WAIT)
            raise
        if wal is not None:
            thread.checkpoint(wal)

    async def close(self) -> None:
        """Stop the thread; it closes the connection (the last connection to close
        checkpoints the WAL into the file and removes it)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            # in a forked child there is no thread to close it; a failed one closed it
            if not thread.orphaned and thread.ended is None:
                with contextlib.suppress(sqlite3.Error):
                    await thread.submit(thread.close_connection)
        finally:  # a close cancelled while the thread closed the connection: it still ends
            thread.stop()
        await thread.ended_within(THREAD_END_WAIT)

    def _running(self) -> _Thread:
        if self._thread is None:
            raise ClosedError("the sqlite backend is not open")
        return self._thread

    # The choke point: every statement of every role goes through one of these.

    @translated
    async def read(self, work: Work[T]) -> T:
        """Run ``work`` on the database thread, outside any explicit transaction (each of
        its statements sees the latest commit)."""
        result: T = await self._running().submit(work)
        return result

    @translated
    async def write(self, work: Work[T]) -> T:
        """Run ``work`` on the database thread in a write transaction (``BEGIN IMMEDIATE``),
        inside a savepoint of its own when writes queued behind it share the transaction:
        applied whole or not at all, with no writer of any process in between, and
        answered once committed."""
        result: T = await self._running().submit(work, write=True)
        return result

    def watch(self, look: Callable[[sqlite3.Connection], bool] | None) -> None:
        """Have the database thread call ``look`` with the connection between calls, every
        ``signal_poll`` seconds (up to ``IDLE_SLOWDOWN`` times that once the file has been
        quiet a while), or stop (None). ``look`` runs on that thread and answers whether
        the file changed."""
        self._running().watch(look)
