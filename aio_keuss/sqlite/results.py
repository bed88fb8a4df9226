"""Results in the database file: one row of ``results`` per (queue, id), so every process
sharing the file reads what any of them put.

A put is one write transaction (``BEGIN IMMEDIATE``, see :mod:`.connection`) and a get one
call on the database thread, whatever the number of ids. Expiry is on SQLite's clock
(``julianday('now')``), as the rate limiters' times are: every process sharing the file
runs on the machine that holds it. Expired rows are never read, and are deleted in the
background: at most once a minute per store (``RECLAIM_EVERY``), after a put, in batches of
at most ``RECLAIM_BATCH`` rows, each a write transaction of its own, until a batch finds
fewer; so a put waits at most for one batch queued ahead of it on the database thread,
never for the whole sweep, and the table does not grow while results keep being put.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import KeussError
from ..results import ResultStore

if TYPE_CHECKING:
    from .connection import SqliteConnection

log = logging.getLogger("aio_keuss.sqlite")

RECLAIM_BATCH = 1000
"""Most expired rows one reclaiming transaction deletes."""
RECLAIM_EVERY = 60.0
"""Fewest seconds between two sweeps of expired rows by one store."""


def _as_bytes(body: object) -> bytes:
    """A stored body as bytes: a BLOB as it is; a value another program wrote in another
    type (SQLite's columns take any, "Datatypes In SQLite Version 3") as its text, for the
    queue layer to find undecodable rather than for this store to fail on."""
    if isinstance(body, bytes):
        return body
    return str(body).encode()


class SqliteResults(ResultStore):
    """``ResultStore`` on the backend's database file (see the module's docstring)."""

    def __init__(self, backend: SqliteConnection) -> None:
        self._db = backend
        self._sql = backend.sql
        self.reclaim_every = RECLAIM_EVERY
        self._next_reclaim = 0.0  # monotonic time of the next sweep: the first put's
        self._reclaiming: asyncio.Task[int] | None = None
        self._closed = False

    async def close(self) -> None:
        """Stop a sweep under way; the batch the thread is running still commits. A put
        still under way starts none once closed (nothing would stop it)."""
        self._closed = True
        task, self._reclaiming = self._reclaiming, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # not ``await task``: a cancelled close stays so

    async def put(self, queue: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        if not results:
            return
        clock, put = self._sql["result_clock"], self._sql["result_put"]

        def write(c: sqlite3.Connection) -> None:
            expires = c.execute(clock).fetchone()[0] + ttl
            c.executemany(put, [(queue, id_, body, expires) for id_, body in results])

        await self._db.write(write)
        self._reclaim_if_due()

    async def replace(
        self, queue: str, swaps: Sequence[tuple[str, bytes, bytes]], ttl: float
    ) -> None:
        if not swaps:
            return
        clock, replace = self._sql["result_clock"], self._sql["result_replace"]

        def write(c: sqlite3.Connection) -> None:
            now = c.execute(clock).fetchone()[0]
            c.executemany(
                replace, [(new, now + ttl, queue, id_, old, now) for id_, old, new in swaps]
            )

        await self._db.write(write)

    async def get(self, queue: str, ids: Sequence[str]) -> list[bytes | None]:
        """One call on the database thread: a primary-key lookup per id (a prepared
        statement, kept by ``sqlite3``'s statement cache), against one clock reading. No
        list of ids as bound parameters, which SQLite caps (SQLite documentation, "Limits
        In SQLite", 9: 999 before 3.32)."""
        if not ids:
            return []
        clock, get = self._sql["result_clock"], self._sql["result_get"]

        def read(c: sqlite3.Connection) -> list[bytes | None]:
            now = c.execute(clock).fetchone()[0]
            found: list[bytes | None] = []
            for id_ in ids:
                row = c.execute(get, (queue, id_, now)).fetchone()
                found.append(None if row is None else _as_bytes(row[0]))
            return found

        return await self._db.read(read)

    async def reclaim(self) -> int:
        """Delete every expired row, ``RECLAIM_BATCH`` at a time, each batch a write
        transaction of its own (writes queued meanwhile go between two batches); the
        number deleted."""
        statement = self._sql["result_reclaim"]

        def batch(c: sqlite3.Connection) -> int:
            return c.execute(statement, (RECLAIM_BATCH,)).rowcount

        total = 0
        while True:
            deleted = await self._db.write(batch)
            total += deleted
            if deleted < RECLAIM_BATCH:
                return total

    def _reclaim_if_due(self) -> None:
        """Start a sweep in the background if none ran for ``reclaim_every`` seconds."""
        now = time.monotonic()
        if self._closed or now < self._next_reclaim:
            return
        if self._reclaiming and not self._reclaiming.done():
            return
        self._next_reclaim = now + self.reclaim_every
        self._reclaiming = asyncio.create_task(self._sweep(), name="aio-keuss results sweep")

    async def _sweep(self) -> int:
        try:
            return await self.reclaim()
        except KeussError:  # housekeeping: the next sweep deletes what this one left
            log.warning("sqlite results: deleting expired results failed", exc_info=True)
            return 0
