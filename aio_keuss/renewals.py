"""Reservations kept alive while their handlers run.

A reservation lasts ``reserve_delay``; a handler that runs longer would see its message
delivered to a second consumer while it still works on it. A consumer therefore extends
the reservations of its running handlers (as BullMQ renews a job's lock while its
processor runs, and as SQS's ChangeMessageVisibility is called from a heartbeat).

It costs a handler that ends soon nothing of its own: the consumer already keeps its
running messages by id (what a close must not give back), and this reads that dict. A
timer looks at it every twelfth of ``reserve_delay`` while any handler runs, noting the look
that first saw each message; one seen for ``LOOKS`` looks (a quarter to a third of
``reserve_delay`` after its handler started) is extended, with every other one due, in one
``extend_many``, and then again ``LOOKS`` looks after its last extension. A prefetched
message may have waited up to half its reservation before its handler started, so its
first extension still goes out with a sixth of the reservation left.

If the process dies, the extensions stop with it and the messages come back once their
reservations lapse: at-least-once still holds.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable

from .errors import ClosedError
from .message import Message

log = logging.getLogger(__name__)

LOOK_SHARE = 1 / 12
"""Share of ``reserve_delay`` between two looks at the running handlers."""
LOOKS = 3
"""Looks a message is seen running before its reservation is extended (again)."""
NEVER = sys.maxsize
"""The look of a message found taken by another consumer: not extended again."""

Extender = Callable[[list[Message]], Awaitable[list[bool]]]


class Renewals:
    """The reservations of one consumer's running handlers, extended while they run."""

    def __init__(
        self,
        queue: str,
        reserve_delay: float,
        extend: Extender,
        loop: asyncio.AbstractEventLoop,
        running: dict[str, Message],
    ) -> None:
        self._queue = queue
        self._reserve_delay = reserve_delay
        self._extend = extend
        self._loop = loop
        self._running = running
        """The consumer's running messages by id (it adds and drops them)."""
        self._every = reserve_delay * LOOK_SHARE
        self._looks = 0
        # id -> the delivery and the look that first saw it, or extended it: by delivery,
        # as one found taken by another consumer is never extended again, but a later
        # delivery of its id to this consumer (taken here again while the stale handler
        # still ran, so that the id never left ``running``) is extended as any other
        self._since: dict[str, tuple[Message, int]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._renewing: asyncio.Task[None] | None = None
        self._closed = False
        self.idle = True
        """No timer runs: the consumer calls :meth:`wake` when a handler starts."""
        self.extended = 0
        """Reservations extended so far."""
        self.lapsed = 0
        """Reservations found taken by another consumer while their handler ran."""

    def wake(self) -> None:
        """A handler started while idle: look again in a while."""
        if not self._closed:
            self.idle = False
            self._timer = self._loop.call_later(self._every, self._look)

    def _look(self) -> None:
        self._timer = None
        running, since = self._running, self._since
        if self._closed or not running:
            since.clear()
            self.idle = True  # the next handler to start wakes it
            return
        self._looks = looks = self._looks + 1
        for gone in since.keys() - running.keys():
            del since[gone]
        for message_id, message in running.items():
            seen = since.get(message_id)
            if seen is None or seen[0] is not message:
                since[message_id] = (message, looks)
        self._timer = self._loop.call_later(self._every, self._look)
        if self._renewing is not None:
            return  # the last extension is still out: those due wait for the next look
        due = [message for message, seen in since.values() if looks - seen >= LOOKS]
        if due:
            self._renewing = self._loop.create_task(self._renew(due))

    async def _renew(self, due: list[Message]) -> None:
        try:
            kept = await self._extend(due)
        except ClosedError:
            return  # the queue closed under its handlers: nothing to keep now
        except Exception as exc:  # an outage: tried again on the next look
            log.warning(
                "queue %r: extending %d reservations of running handlers failed (tried"
                " again in %.3g s): %s",
                self._queue,
                len(due),
                self._every,
                exc,
            )
            return
        finally:
            self._renewing = None
        running, since = self._running, self._since
        for message, ours in zip(due, kept, strict=True):
            if running.get(message.id) is not message:
                continue  # its handler ended meanwhile
            if ours:
                since[message.id] = (message, self._looks)
                self.extended += 1
                continue
            since[message.id] = (message, NEVER)
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
        self.idle = False  # never woken again
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        renewing = self._renewing
        if renewing is not None:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        self._since.clear()
