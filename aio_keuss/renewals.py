"""Reservations kept alive while their handlers run.

A reservation lasts ``reserve_delay``; a handler that runs longer would see its message
delivered to a second consumer while it still works on it. A consumer therefore extends
the reservations of its running handlers (as BullMQ renews a job's lock while its
processor runs, and as SQS's ChangeMessageVisibility is called from a heartbeat). A
handler that ends before a quarter of ``reserve_delay`` costs nothing but two dict
operations: no timer or task per message. One timer ticks every tenth of
``reserve_delay`` while a handler runs; each tick extends, in one ``extend_many``, those
due: a quarter of ``reserve_delay`` after their handler started, then a third of it after
their last extension. A prefetched message may have waited up to half its reservation
before its handler started, so its first extension still comes with at least a tenth of
the reservation left (a quarter, plus a tick of delay, after that half).

If the process dies, the extensions stop with it and the messages come back once their
reservations lapse: at-least-once still holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from .errors import ClosedError
from .message import Message

log = logging.getLogger(__name__)

FIRST = 1 / 4
"""Share of ``reserve_delay`` a handler runs before its reservation is first extended."""
AGAIN = 1 / 3
"""Share of ``reserve_delay`` between two extensions of one reservation."""
TICK = 1 / 10
"""Share of ``reserve_delay`` between two looks at the running handlers."""

Extender = Callable[[list[Message]], Awaitable[list[bool]]]


class Renewals:
    """The reservations of one consumer's running handlers, extended while they run."""

    def __init__(
        self,
        queue: str,
        reserve_delay: float,
        extend: Extender,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._queue = queue
        self._reserve_delay = reserve_delay
        self._extend = extend
        self._loop = loop
        self._first = reserve_delay * FIRST
        self._again = reserve_delay * AGAIN
        self._tick = reserve_delay * TICK
        self._running: dict[str, tuple[Message, float]] = {}  # id -> (message, next due)
        self._timer: asyncio.TimerHandle | None = None
        self._renewing: asyncio.Task[None] | None = None
        self._closed = False
        self.extended = 0
        """Reservations extended so far."""
        self.lapsed = 0
        """Reservations found taken by another consumer while their handler ran."""

    def started(self, messages: Sequence[Message]) -> None:
        """Their handler starts now."""
        due = time.monotonic() + self._first
        running = self._running
        for message in messages:
            running[message.id] = (message, due)
        if self._timer is None and not self._closed:
            self._timer = self._loop.call_later(self._tick, self._look)

    def ended(self, ids: Sequence[str]) -> None:
        """Their handler ended (its ok or ko is on its way)."""
        running = self._running
        for message_id in ids:
            running.pop(message_id, None)

    def _look(self) -> None:
        self._timer = None
        if self._closed or not self._running:
            return  # the next handler to start arms the timer again
        self._timer = self._loop.call_later(self._tick, self._look)
        if self._renewing is not None:
            return  # the last extension is still out: those due wait for the next tick
        now = time.monotonic()
        due = [message for message, when in self._running.values() if when <= now]
        if due:
            self._renewing = self._loop.create_task(self._renew(due))

    async def _renew(self, due: list[Message]) -> None:
        try:
            kept = await self._extend(due)
        except ClosedError:
            return  # the queue closed under its handlers: nothing to keep now
        except Exception as exc:  # an outage: tried again on the next tick
            log.warning(
                "queue %r: extending %d reservations of running handlers failed (tried"
                " again in %.3g s): %s",
                self._queue,
                len(due),
                self._tick,
                exc,
            )
            return
        finally:
            self._renewing = None
        again = time.monotonic() + self._again
        running = self._running
        for message, ours in zip(due, kept, strict=True):
            entry = running.get(message.id)
            if entry is None or entry[0] is not message:
                continue  # its handler ended meanwhile
            if ours:
                running[message.id] = (message, again)
                self.extended += 1
                continue
            del running[message.id]
            self.lapsed += 1
            log.warning(
                "queue %r: message %s: its reservation lapsed while its handler ran and"
                " another consumer took it (%.3g s reserve_delay): it may be handled twice,"
                " and this handler's ok will be refused",
                self._queue,
                message.id,
                self._reserve_delay,
            )

    async def close(self) -> None:
        """No more extensions: the consumer's handlers have all ended."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        renewing = self._renewing
        if renewing is not None:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        self._running.clear()
