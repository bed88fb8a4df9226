"""Signals between processes over PostgreSQL LISTEN/NOTIFY.

One channel per schema (``aio_keuss_<schema>``): every factory on that schema LISTENs on one
dedicated connection of its own (``PostgresConnection.listen``), and publishes with
``pg_notify`` through the pool.

"NOTIFY only after commit": the queue layer announces an insertion only after
``store.insert()`` returned, and every store statement runs in its own implicit transaction,
so a notification never precedes the commit of the messages it announces (a NOTIFY inside
the insert's transaction would give the same guarantee at the cost of one more statement per
batch and no debouncing).

The listener connection is watched (its termination callback, and a liveness check in case
that never comes): when it dies (server restart, network), :meth:`_listen` returns and the
base class reconnects with backoff, waking every local subscriber once back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import KeussConnectionError
from ..signal import SignalBus

if TYPE_CHECKING:
    from .connection import PostgresConnection

_CLOSE_WAIT = 2.0
_CHECK_EVERY = 5.0
"""Seconds between liveness checks of the listener connection, in case the termination
callback never comes (a silently dropped TCP connection)."""
_PING_WAIT = 5.0
"""Longest a liveness check waits for the server's answer before the connection is taken
for dead: ``is_closed()`` alone only knows what this side saw, and a connection dropped
silently (a NAT or firewall forgetting it) looks open forever."""


class PostgresSignalBus(SignalBus):
    def __init__(self, backend: PostgresConnection, debounce: float = 0.05) -> None:
        super().__init__(debounce)
        self._backend = backend
        # Case kept: schema names are quoted, so "Jobs" and "jobs" are two schemas, and a
        # shared channel would let one's pause / resume act on the other's queues.
        self.channel = f"aio_keuss_{backend.schema}"

    async def _publish(self, payload: bytes) -> None:
        await self._backend.execute(
            self._backend.sql["signal_notify"], self.channel, payload.decode()
        )

    async def _listen(self, ready: Callable[[], None]) -> None:
        lost = asyncio.Event()
        connection = await self._backend.listen(
            self.channel, self._on_notification, lambda _connection: lost.set()
        )
        try:
            ready()
            while not lost.is_set() and not connection.is_closed():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_CHECK_EVERY):
                        await lost.wait()
                if lost.is_set() or connection.is_closed():
                    break
                try:  # a round trip: only the server's answer shows the connection is alive
                    async with asyncio.timeout(_PING_WAIT):
                        await connection.fetchval("SELECT 1")
                except Exception as exc:  # no answer in time, or the connection broke
                    connection.terminate()
                    reason = "no answer to SELECT 1" if isinstance(exc, TimeoutError) else exc
                    raise KeussConnectionError(f"listener connection lost: {reason}") from exc
        finally:
            if connection.is_closed():
                connection.terminate()  # frees what a broken connection still holds
            else:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(_CLOSE_WAIT):
                        await connection.close()

    def _on_notification(self, _connection: Any, _pid: int, _channel: str, payload: str) -> None:
        self._receive(payload)
