"""The worker command's event loop: run as ``asyncio.run`` runs one, but its end is bounded.

``asyncio.run`` cancels the tasks still pending once its coroutine returns, then waits for
every one of them to end (Python's asyncio documentation, "Runners"). A handler that
swallows its cancellation (catches ``CancelledError`` and goes on), which ``run_worker``
abandons after a second signal, then kept the process alive for ever after the worker had
stopped. Such a process now exits without them, as a process killed would, once its logs are
written and its atexit hooks ran: ``os._exit`` skips the interpreter's finalization, atexit
hooks included (the atexit documentation: "functions registered are not called when the
program is killed ... or when os._exit() is called"), so those run first, in a thread given
``ATEXIT_WAIT`` seconds: an exporter's last flush (OpenTelemetry's SDK flushes its providers
from an atexit hook) or the sync API's close of its factories, but not a hook held for ever
by a lock the abandoned handler's thread holds.

Handlers ``run_worker`` abandoned are known as it returns: it leaves its connection open, as
their reservations are extended through it while they run (closed, another consumer got
their messages while they still ran them, as the process lived up to 20 s more), and the
command calls :func:`exit_running` at once, in the loop still running: the atexit hooks run
while the loop goes on extending those reservations, and the process exits with the
extensions still going, skipping the leftover tasks, the loop's shutdown and the
connection's close. Another consumer gets those messages only once their reservations
expire, ``reserve_delay`` after their last extension: after the process has exited (see
the README's *Stopping*).

Other tasks left that swallow their cancellation (one a handler started, say) are only found
once the worker returned: they get ``LEFT_WAIT`` seconds to end once cancelled, and the
process exits without the ones that do not (:func:`exit_if_abandoned`), after the loop's
shutdown (left to the interpreter's exit, each was closed as it was collected, running its
cleanup on a closed loop). So it does without threads of the loop's default executor still
running ``LEFT_WAIT`` seconds after the loop's end: a handler's ``asyncio.to_thread`` call
goes on once cancelled, and the interpreter's exit joins such threads, for ever if they block.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

log = logging.getLogger("aio_keuss.worker")

T = TypeVar("T")

LEFT_WAIT = 5.0
"""Seconds the tasks left when the worker returns get, once cancelled, to end."""

ATEXIT_WAIT = 5.0
"""Seconds the atexit hooks get to run before a process that abandoned tasks exits."""

_abandoned: list[asyncio.Task[Any]] = []
"""Tasks that outlived their loop (the log named what they held)."""

_threads_left = False
"""Whether threads of the loop's default executor outlived it: a handler's
``asyncio.to_thread`` call goes on once its task is cancelled (a thread cannot be), and
those threads are not daemons: the interpreter's exit joins them (the
``concurrent.futures`` documentation), for ever if they block."""


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` in a new event loop, then close it as ``asyncio.run`` does, except that
    the tasks left get ``LEFT_WAIT`` seconds to end once cancelled, not for ever."""
    loop = asyncio.new_event_loop()
    executor = ThreadPoolExecutor(thread_name_prefix="asyncio")
    loop.set_default_executor(executor)  # kept, to shut it down within a bound (_shut_down)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _end_left(loop)
            loop.run_until_complete(_within(loop.shutdown_asyncgens()))
            _shut_down(executor)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def _within(work: Coroutine[Any, Any, None]) -> None:
    try:
        await asyncio.wait_for(work, LEFT_WAIT)
    except TimeoutError:
        log.warning("exiting without waiting longer for the loop's shutdown")


def _shut_down(executor: ThreadPoolExecutor) -> None:
    """Wait ``LEFT_WAIT`` seconds at most for the default executor's threads to end.

    ``loop.shutdown_default_executor`` cannot be bounded before Python 3.12: cancelled, it
    still joins the thread that waits for them (asyncio's source, ``base_events.py``), so a
    handler's ``asyncio.to_thread(time.sleep, 3600)`` held the loop's end for an hour. Those
    left are known before the wait, so that one more SIGINT during it still exits without
    them (see :func:`exit_if_abandoned`)."""
    global _threads_left
    _threads_left = True
    if _ended_within(
        _in_daemon(executor.shutdown, "executor shutdown"),
        LEFT_WAIT,
        "exiting without the threads of the loop's default executor still running "
        "(an asyncio.to_thread call that went on once its task was cancelled)",
    ):
        _threads_left = False


def _end_left(loop: asyncio.AbstractEventLoop) -> None:
    left = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not left:
        return
    for task in left:
        task.cancel()
    # known as outliving the loop until they end: one more SIGINT during this wait (the
    # worker's signal handlers are gone) raises KeyboardInterrupt out of it, and the
    # command must still exit without them (exit_if_abandoned), not through the
    # interpreter's exit, which waits for the atexit hooks and threads without bound
    _abandoned.extend(left)
    done, pending = loop.run_until_complete(asyncio.wait(left, timeout=LEFT_WAIT))
    _abandoned[:] = [task for task in _abandoned if task not in done]
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
        log.warning("exiting with %d tasks that went on after being cancelled", len(pending))


def exit_if_abandoned(code: int) -> None:
    """End the process with ``code`` now if tasks, or threads of its default executor,
    outlived the loop: run the atexit hooks
    (``ATEXIT_WAIT`` seconds at most), flush the logs and the output, and exit without the
    rest of the interpreter's finalization (see the module's docstring).

    Whatever happens on the way, it ends in ``os._exit``: one more SIGINT raises
    ``KeyboardInterrupt`` in the wait for the hooks (the worker's signal handlers are gone),
    and left to the interpreter's exit the process ran the hooks again, those that had run
    twice, and waited for one that does not return for ever."""
    if not _abandoned and not _threads_left:
        return
    try:
        _ended_within(
            _atexit_hooks(lambda: None),
            ATEXIT_WAIT,
            "exiting without waiting longer for the atexit hooks",
        )
    except KeyboardInterrupt:
        log.warning("interrupted: exiting without waiting longer for the atexit hooks")
    finally:
        _exit(code)


async def exit_running(code: int) -> NoReturn:
    """End the process with ``code`` from within its running loop, once the atexit hooks
    ran (``ATEXIT_WAIT`` seconds at most) while the loop goes on: for handlers abandoned
    with their reservations still extended, which must not stop before the process does
    (see the module's docstring).

    One more SIGINT or SIGTERM (the worker's handlers are gone) cuts the wait short, and
    whatever ends the wait (a ``KeyboardInterrupt`` or a cancellation, say) it ends in
    ``os._exit(code)``: a SIGINT left to Python's handler raised ``KeyboardInterrupt`` out
    of the loop, whose end cancelled this wait, and the command then ran the hooks a second
    time and waited for one that never returns for ever (Python's signal documentation:
    the default SIGINT handler raises ``KeyboardInterrupt`` in the main thread)."""
    loop = asyncio.get_running_loop()
    ran = asyncio.Event()
    interrupted: list[int] = []

    def interrupt(signum: int) -> None:
        interrupted.append(signum)
        ran.set()

    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            # not in the main thread (nor on Windows): the finally below still exits
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(signum, interrupt, signum)
        _atexit_hooks(lambda: loop.call_soon_threadsafe(ran.set))
        try:
            await asyncio.wait_for(ran.wait(), ATEXIT_WAIT)
        except TimeoutError:
            log.warning("exiting without waiting longer for the atexit hooks")
        if interrupted:
            log.warning(
                "interrupted (%s): exiting without waiting longer for the atexit hooks",
                signal.Signals(interrupted[0]).name,
            )
    except (KeyboardInterrupt, asyncio.CancelledError):
        log.warning("interrupted: exiting without waiting longer for the atexit hooks")
    finally:
        _exit(code)


def _atexit_hooks(then: Callable[[], object]) -> threading.Thread:
    """Start running the atexit hooks, then ``then``, in a daemon thread: a hook that never
    returns (blocked on what an abandoned handler holds) is left to ``os._exit``, which ends
    its thread with the process, instead of holding the exit for ever."""

    def run_them() -> None:
        try:
            atexit._run_exitfuncs()
        finally:
            then()

    return _in_daemon(run_them, "atexit hooks")


def _in_daemon(target: Callable[[], object], name: str) -> threading.Thread:
    """Start ``target`` in a daemon thread: one that never ends is left to the process's
    exit (``os._exit``, or the interpreter's, which joins no daemon thread)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _ended_within(thread: threading.Thread, seconds: float, warning: str) -> bool:
    """Wait ``seconds`` at most for ``thread`` to end; whether it did. Past the bound,
    ``warning`` is logged and the thread left to run."""
    thread.join(seconds)
    if thread.is_alive():
        log.warning(warning)
        return False
    return True


def _exit(code: int) -> NoReturn:
    """Flush the logs and the output, and exit without the interpreter's finalization."""
    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe
                stream.flush()
    finally:  # even if one more SIGINT interrupts the flush
        os._exit(code)
