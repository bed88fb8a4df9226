"""The worker command's event loop: run as ``asyncio.run`` runs one, but its end is bounded.

``asyncio.run`` cancels the tasks still pending once its coroutine returns, then waits for
every one of them to end (Python's asyncio documentation, "Runners"). A handler that
swallows its cancellation (catches ``CancelledError`` and goes on), which ``run_worker``
abandons after a second signal, then kept the process alive for ever after the worker had
stopped. Here those tasks get ``LEFT_WAIT`` seconds to end, and the process exits without
the ones that do not: at once, as a process killed would, once its logs are written (left to
the interpreter's exit, each was closed as it was collected, running its handler's cleanup
and the consumer's failure path on a closed loop). That exit (``os._exit``) skips the
interpreter's finalization, atexit hooks included, so those run first, for ``ATEXIT_WAIT``
seconds at most: an exporter's last flush (OpenTelemetry's SDK flushes its providers from an
atexit hook) or the sync API's close of its factories, but not a hook held for ever by a
lock the abandoned handler's thread holds (the atexit documentation: "functions registered
are not called when the program is killed ... or when os._exit() is called").

The abandoned handlers' reservations are no longer extended by then: the extensions go
through the connection ``run_worker`` closed as it returned (its queues' close), and none
can go out once it is closed. From that close to the exit is ``LEFT_WAIT``, up to twice
``LEFT_WAIT`` for the loop's shutdown and up to ``ATEXIT_WAIT`` (see the README's
*Stopping*).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("aio_keuss.worker")

T = TypeVar("T")

LEFT_WAIT = 5.0
"""Seconds the tasks left when the worker returns get, once cancelled, to end."""

ATEXIT_WAIT = 5.0
"""Seconds the atexit hooks get to run before a process that abandoned tasks exits."""

_abandoned: list[asyncio.Task[Any]] = []
"""Tasks that outlived their loop (the log named what they held)."""


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` in a new event loop, then close it as ``asyncio.run`` does, except that
    the tasks left get ``LEFT_WAIT`` seconds to end once cancelled, not for ever."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _end_left(loop)
            loop.run_until_complete(_within(loop.shutdown_asyncgens()))
            loop.run_until_complete(_within(loop.shutdown_default_executor()))
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def _within(work: Coroutine[Any, Any, None]) -> None:
    try:
        await asyncio.wait_for(work, LEFT_WAIT)
    except TimeoutError:
        log.warning("exiting without waiting longer for the loop's shutdown")


def _end_left(loop: asyncio.AbstractEventLoop) -> None:
    left = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not left:
        return
    for task in left:
        task.cancel()
    done, pending = loop.run_until_complete(asyncio.wait(left, timeout=LEFT_WAIT))
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception as the worker exits",
                    "exception": task.exception(),
                    "task": task,
                }
            )
    if pending:
        _abandoned.extend(pending)
        log.warning("exiting with %d tasks that went on after being cancelled", len(pending))


def exit_if_abandoned(code: int) -> None:
    """End the process with ``code`` now if tasks outlived the loop: run the atexit hooks
    (``ATEXIT_WAIT`` seconds at most), flush the logs and the output, and exit without the
    rest of the interpreter's finalization (see the module's docstring)."""
    if not _abandoned:
        return
    _run_atexit_hooks()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe
            stream.flush()
    os._exit(code)


def _run_atexit_hooks() -> None:
    """Run the atexit hooks, in a daemon thread given ``ATEXIT_WAIT`` seconds: a hook that
    does not return then (blocked on what an abandoned handler holds) is left to ``os._exit``,
    which ends its thread with the process, instead of holding the exit for ever."""
    hooks = threading.Thread(target=atexit._run_exitfuncs, name="atexit hooks", daemon=True)
    hooks.start()
    hooks.join(ATEXIT_WAIT)
    if hooks.is_alive():
        log.warning("exiting without waiting longer for the atexit hooks")
