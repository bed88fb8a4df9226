"""The time limit of a consumer's handlers, watched by one timer for all of them.

``asyncio.timeout`` around each handled message costs a timer armed and cancelled, an object
and three look-ups of the running loop, each a ``getpid()`` system call on Python 3.11: more
than the rest of a short handler's delivery. A consumer gives every handler the same limit,
so deadlines fall due in the order the handlers started, and one timer set for the earliest
running one watches them all; it fires about once per limit, not once per message.

The expiry follows ``asyncio.timeout`` (see the asyncio manual, "Timeouts"): the handler's
task is cancelled, and the ``CancelledError`` becomes a ``TimeoutError`` unless the task was
also cancelled by someone else meanwhile (a stop past its grace), which then wins.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

EARLY = 0.001
"""A timer may fire this much before its time (libuv counts in milliseconds): a deadline
that close counts as reached, rather than arming the timer again for the rest."""


class Limit:
    """One running handler's deadline."""

    __slots__ = ("cancelling", "due", "expired", "task")

    def __init__(self, task: asyncio.Task[Any], due: float) -> None:
        self.task = task
        self.due = due
        self.cancelling = task.cancelling()  # cancellations asked before ours, not ours
        self.expired = False


class Deadlines:
    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self._loop = loop
        self._seconds = seconds
        # running handlers, in the order they started, which is the order they fall due
        self._running: dict[Limit, None] = {}
        self._timer: asyncio.TimerHandle | None = None

    def start(self, task: asyncio.Task[Any]) -> Limit:
        """A handler starts running in ``task``: it has ``seconds`` from now."""
        limit = Limit(task, self._loop.time() + self._seconds)
        self._running[limit] = None
        if self._timer is None:
            self._timer = self._loop.call_at(limit.due, self._expire)
        return limit

    def end(self, limit: Limit, error: BaseException | None) -> None:
        """The handler ended, raising ``error`` (None: it returned). Raises ``TimeoutError``
        when that error is the cancellation its expiry caused and nobody else's."""
        self._running.pop(limit, None)
        if not limit.expired:
            return
        if limit.task.uncancel() <= limit.cancelling and isinstance(error, asyncio.CancelledError):
            raise TimeoutError from error

    async def watch(self, limit: Limit, work: Awaitable[Any]) -> Any:
        """Await a handler's ``work`` under ``limit`` (from :meth:`start`): past it, the
        handler is cancelled and a ``TimeoutError`` raised instead."""
        try:
            result = await work
        except BaseException as exc:
            self.end(limit, exc)
            raise
        self.end(limit, None)
        return result

    def _expire(self) -> None:
        """Cancel every handler past its deadline; set the timer for the next one."""
        self._timer = None
        now = self._loop.time() + EARLY
        running = self._running
        while running:
            limit = next(iter(running))
            if limit.due > now:
                self._timer = self._loop.call_at(limit.due, self._expire)
                return
            del running[limit]
            limit.expired = True
            limit.task.cancel()
