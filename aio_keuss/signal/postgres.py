"""Signals between processes over PostgreSQL LISTEN/NOTIFY.

One channel per schema (``aio_keuss_<schema>``): every factory on that schema LISTENs on one
dedicated connection of its own (never one of the pool's, which are handed to other callers
and would drop the LISTEN on release), and publishes with ``pg_notify`` through the pool.

"NOTIFY only after commit": the queue layer announces an insertion only after
``store.insert()`` returned, and every store statement runs in its own implicit transaction,
so a notification never precedes the commit of the messages it announces (a NOTIFY inside
the insert's transaction would give the same guarantee at the cost of one more statement per
batch and no debouncing).

The listener connection is watched: when it dies (server restart, network) a task reconnects
with exponential backoff and, once back, wakes every local subscriber, since pushes made
while it was away were not heard. Meanwhile consumers keep going on their poll interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import asyncpg  # type: ignore[import-untyped]

from ..backends.postgres import CONNECTION_ERRORS, postgres_errors_translated
from .base import Signal, SignalBus

if TYPE_CHECKING:
    from ..backends.postgres import PostgresBackend

log = logging.getLogger("aio_keuss.signal.postgres")

_NOTIFY = "SELECT pg_notify($1, $2)"
_MIN_BACKOFF = 0.05
_MAX_BACKOFF = 5.0
_CHECK_EVERY = 5.0
"""Seconds between liveness checks of the listener connection, in case the termination
callback never comes (a silently dropped TCP connection)."""


class PostgresSignalBus(SignalBus):
    def __init__(self, backend: PostgresBackend, debounce: float = 0.05) -> None:
        super().__init__(debounce)
        self._backend = backend
        self.channel = f"aio_keuss_{backend.schema}".lower()
        self._connection: Any = None
        self._lost = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Listen before returning (so a push right after connect is heard), then watch."""
        with postgres_errors_translated():
            await self._listen()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        await super().close()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        await self._drop_connection()

    async def _publish(self, payload: bytes) -> None:
        with postgres_errors_translated():
            await self._backend.pool.execute(_NOTIFY, self.channel, payload.decode())

    # the listener connection ----------------------------------------------------------

    async def _listen(self) -> None:
        connection = await asyncpg.connect(**self._backend.connect_params)
        try:
            self._lost = asyncio.Event()
            connection.add_termination_listener(self._on_terminated)
            await connection.add_listener(self.channel, self._on_notification)
        except BaseException:
            await connection.close()
            raise
        self._connection = connection

    def _on_notification(self, _connection: Any, _pid: int, _channel: str, payload: str) -> None:
        self._receive(payload)

    def _on_terminated(self, _connection: Any) -> None:
        self._lost.set()

    async def _watch(self) -> None:
        """Reconnect the listener whenever it is lost, backing off while the server is away."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), _CHECK_EVERY)
            if self._connection is not None and not self._connection.is_closed():
                continue
            await self._drop_connection()
            backoff = _MIN_BACKOFF
            while True:
                try:
                    await self._listen()
                    break
                except (*CONNECTION_ERRORS, asyncpg.PostgresError) as exc:
                    log.debug("signal listener reconnect failed: %s", exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF)
            log.info("signal listener reconnected")
            for queue in list(self._listeners):  # what was pushed meanwhile went unheard
                self._deliver(Signal(queue, "insert"))

    async def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.is_closed():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 2.0)
        elif connection is not None:
            connection.terminate()
