"""Signals between processes sharing one database file: a table and a look at
``PRAGMA data_version``.

SQLite has no LISTEN / NOTIFY: a signal is a row in ``signals``, written in a transaction
of its own after the messages it announces were committed (the queue layer signals once an
insert has returned), so it never precedes them. Other processes find it without reading
the table on a timer: ``PRAGMA data_version`` answers a different number once another
connection has committed to the file, and the same number otherwise (SQLite documentation,
"PRAGMA data_version"); it reads the WAL index in shared memory, not the table. The
database thread looks at it between calls, every ``signal_poll`` seconds (20 ms by
default), and only when it changed reads the rows past the last one it read and hands them
to the event loop. Once the file has been quiet for a while the looks slow down (a tenth of
the quiet time apart, at most five times ``signal_poll``: 100 ms by default), since each
one wakes the thread. So an idle process costs a few cheap looks a second on a thread and
no wake-up of the event loop, and a consumer of another process wakes within about
``signal_poll`` of a push while the file is busy, within about 100 ms after a quiet
spell. Rows older than a minute are pruned by publishers; our own
rows come back among the others' and are dropped by their origin (``SignalBus._receive``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import KeussError
from ..signal import SignalBus
from .connection import raise_ours

if TYPE_CHECKING:
    from .connection import SqliteConnection

KEEP = 60.0
"""Seconds a signal row is kept: far longer than any listener takes to read it."""
PRUNE_EVERY = 5.0
"""Seconds between two prunes by one publisher."""


class _Seen:
    """What the watch has seen: the file's data_version and the last signal row read.
    Touched only on the database thread."""

    __slots__ = ("last", "version")

    def __init__(self, version: int, last: int) -> None:
        self.version = version
        self.last = last


class SqliteSignalBus(SignalBus):
    def __init__(self, backend: SqliteConnection, debounce: float = 0.05) -> None:
        super().__init__(debounce)
        self._db = backend
        self._sql = backend.sql
        self._pruned = 0.0  # when this bus last pruned (read and written on the thread)

    async def _publish(self, payload: bytes) -> None:
        text = payload.decode()
        sql = self._sql

        def publish(c: sqlite3.Connection) -> None:
            now = time.time()
            c.execute(sql["signal_publish"], (now, text))
            if now - self._pruned > PRUNE_EVERY:
                self._pruned = now
                c.execute(sql["signal_prune"], (now - KEEP,))

        await self._db.write(publish)

    async def _listen(self, ready: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[None] = loop.create_future()
        sql = self._sql

        def start(c: sqlite3.Connection) -> _Seen:
            # data_version first: a signal committed after it changes it, and is read
            version = c.execute("PRAGMA data_version").fetchone()[0]
            return _Seen(version, c.execute(sql["signal_last"]).fetchone()[0])

        seen = await self._db.read(start)

        def look(c: sqlite3.Connection) -> bool:
            try:
                version = c.execute("PRAGMA data_version").fetchone()[0]
                if version == seen.version:
                    return False
                seen.version = version
                rows = c.execute(sql["signal_since"], (seen.last,)).fetchall()
                if rows:
                    seen.last = rows[-1][0]
                    with contextlib.suppress(RuntimeError):  # the loop is closed
                        loop.call_soon_threadsafe(self._heard, [r[1] for r in rows])
            except Exception as exc:  # the bus reopens its listener after a pause
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_fail, failed, exc)
            return True

        self._db.watch(look)
        try:
            ready()
            try:
                await failed
            except KeussError:
                raise
            except Exception as exc:
                raise_ours(exc)
        finally:
            with contextlib.suppress(KeussError):  # the backend is closed already
                self._db.watch(None)

    def _heard(self, payloads: list[str]) -> None:
        for payload in payloads:
            self._receive(payload)


def _fail(failed: asyncio.Future[None], exc: Exception) -> None:
    if not failed.done():
        failed.set_exception(exc)
