"""Stopping a background task (a signal listener, a flusher, a heartbeat) for good.

``task.cancel()`` followed by one wait is not enough with every driver: a cancellation that
lands while redis-py reconnects is caught by its retry loop as a connection error, and the
task goes on reading from the new connection. A ``close`` waiting on it would wait forever.
So the cancellation is repeated until the task ends: a fresh one reaches whatever it is
awaiting now.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_PERIOD = 0.5
"""How long a cancelled task is given to end before it is cancelled again."""


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` until it has ended, and wait for that.

    Its outcome is not raised (a failure is marked as seen, so asyncio does not log it at
    exit); the caller's own cancellation still propagates.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=RECANCEL_PERIOD)
    if not task.cancelled():
        task.exception()
