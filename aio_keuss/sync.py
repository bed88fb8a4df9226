"""Blocking mirror of :func:`aio_keuss.connect`, :class:`Factory` and :class:`Queue`.

Why a loop thread and not ``asyncio.run`` per call: the async library keeps connections,
signal subscriptions and coalescers alive on one event loop. So the whole process shares
ONE background event-loop thread (anyio's blocking portal); every blocking call submits a
coroutine to it and waits for the result. Calls made at the same moment by many threads
land in the same loop and are batched exactly like concurrent tasks would be.

Lifecycle:

* the loop thread starts on the first :func:`connect` (lazily, under a lock, so two threads
  connecting at once still get one loop);
* it stops when the last :class:`SyncFactory` closes, and at interpreter exit for factories
  nobody closed (a Spark executor never does);
* after ``os.fork()`` the child forgets the parent's loop thread (only the forking thread
  survives a fork, so that loop is not running there) and starts its own on first use.
  Factories inherited from the parent raise :class:`ClosedError` in the child.

Errors are the library's own (:class:`InvalidDelayError`, :class:`ClosedError`, ...): the
portal re-raises in the calling thread whatever the coroutine raised.

    from aio_keuss import sync

    with sync.connect("redis-oq", url="redis://127.0.0.1:6379/0") as factory:
        q = factory.queue("jobs")
        q.push({"a": 1})
        msg = q.reserve(timeout=5)
        if msg is not None:
            q.ok(msg)
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import os
import signal
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from datetime import datetime
from types import FrameType, TracebackType
from typing import Any, TypeVar, cast

from anyio.from_thread import BlockingPortal, start_blocking_portal

from .contract import Stored
from .errors import ClosedError, LoopThreadError
from .factory import CLOSE_TIMEOUT, Factory
from .factory import connect as _async_connect
from .message import UNCHANGED, Headers, Message, NewMessage, Payload, Unchanged
from .options import check_seconds
from .outcomes import NO_RESULT
from .queue import CANCELLED_CLOSE_GRACE, Queue
from .repeat import Repeater
from .types import CancelResult, Capabilities, JobResult, KoResult, MessageView, Page, Sizes

__all__ = ["SyncFactory", "SyncQueue", "connect"]

T = TypeVar("T")

log = logging.getLogger("aio_keuss.sync")

EXIT_CLOSE_WAIT = CANCELLED_CLOSE_GRACE
"""Seconds the close of a factory nobody closed may take at interpreter exit before it is
cancelled: the async close waits for the round trips in flight, which with a server that
went silent (a network partition, a host that hangs) never end, and the process never
exited. Cancelled, the rest of the close is bounded by the async close's own grace
(``CANCELLED_CLOSE_GRACE``)."""

EXIT_GRACE_WAIT = CANCELLED_CLOSE_GRACE
"""Seconds the close cancelled at exit (see ``EXIT_CLOSE_WAIT``) may take to finish in its
grace (give back the reservations held, write out what is buffered) before it is cancelled
for good: a step of it may wait on a server that does not answer past the grace."""


class _Runtime:
    """The process's one loop thread and who uses it.

    Module state (not per factory) because the point is sharing: every factory and thread of
    the process talks to the same loop. ``users`` counts open factories; the loop stops when
    it drops to zero so a closed program leaves no thread behind.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Never held by the main thread (see ``_aside``)."""
        self.stack: contextlib.ExitStack | None = None
        self.portal: BlockingPortal | None = None
        self.users = 0
        self.open: set[SyncFactory] = set()
        """Factories not closed yet: strong references, so atexit can still close them."""
        self.generation = 0
        """Bumped by a fork: factories of an older generation belong to the parent."""
        self.loop_thread: int | None = None
        """``threading.get_ident()`` of the loop thread while it runs."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """Its event loop, for callbacks that must not wait for it (see ``SyncFactory._take``)."""

    def acquire(self) -> tuple[BlockingPortal, int]:
        """The running portal (started if needed), counted as one more user."""
        return _aside(self._acquire)

    def _acquire(self) -> tuple[BlockingPortal, int]:
        with self.lock:
            if self.portal is None:
                stack = contextlib.ExitStack()
                self.portal = stack.enter_context(start_blocking_portal())
                self.stack = stack
                self.loop_thread = self.portal.call(threading.get_ident)
                self.loop = self.portal.call(asyncio.get_running_loop)
            self.users += 1
            return self.portal, self.generation

    def release(self, generation: int) -> None:
        """One user fewer; the last one stops the loop thread (and waits for it to end)."""
        _aside(functools.partial(self._release, generation))

    def _release(self, generation: int) -> None:
        with self.lock:
            if generation != self.generation:  # opened by the parent before a fork
                return
            self.users -= 1
            if self.users > 0:
                return
            stack, self.stack, self.portal = self.stack, None, None
            self.loop_thread = None
            self.loop = None
        if stack is not None:
            stack.close()

    def note_open(self, factory: SyncFactory, generation: int) -> None:
        _aside(functools.partial(self._note_open, factory, generation))

    def _note_open(self, factory: SyncFactory, generation: int) -> None:
        with self.lock:
            if generation == self.generation:
                self.open.add(factory)

    def note_closed(self, factory: SyncFactory) -> None:
        _aside(functools.partial(self._note_closed, factory))

    def _note_closed(self, factory: SyncFactory) -> None:
        with self.lock:
            self.open.discard(factory)

    def refuse_on_loop_thread(self, what: str) -> None:
        """Raise :class:`LoopThreadError` when called on the loop thread itself (from a
        coroutine given to ``call``): waiting there for the loop would wait for itself."""
        if self.loop_thread is not None and threading.get_ident() == self.loop_thread:
            raise LoopThreadError(
                f"a blocking aio_keuss.sync {what} on the shim's own loop thread would wait"
                " for itself: use the async API there (SyncFactory.factory)"
            )

    def shutdown(self) -> None:
        """At interpreter exit: close forgotten factories (their buffers are flushed and
        reservations released by the async close), then stop the loop thread."""
        for factory in _aside(self._open_now):
            with contextlib.suppress(Exception):
                factory._close_once(EXIT_CLOSE_WAIT)
        _aside(self._stop)

    def _open_now(self) -> list[SyncFactory]:
        with self.lock:
            return list(self.open)

    def _stop(self) -> None:
        with self.lock:
            stack, self.stack, self.portal, self.users = self.stack, None, None, 0
            self.loop_thread = None
            self.loop = None
        if stack is not None:
            stack.close()

    def forget(self) -> None:
        """In a forked child: the parent's loop thread does not exist here, and a lock held
        by another parent thread at fork time would never be released. Start afresh, never
        touching the parent's portal (calling it would block forever).

        The parent's exit stack is kept referenced, so that it is not finalized in the
        middle of the child's work, but the interpreter's finalization frees it all the same
        (a normal exit clears the modules' globals): the ``start_blocking_portal`` generator
        inside is then closed, and its ``finally`` calls the portal to stop it, which waited
        for ever for the parent's loop thread, not running here, and the child's exit hung.
        So the portal is marked stopped here, as its own ``stop`` marks it (anyio's
        ``BlockingPortal``): that call then raises ``RuntimeError``, which the generator
        ignores, and its join of the loop thread returns at once, ``threading`` having
        marked the parent's other threads as stopped in the child. That mark is an
        attribute private to anyio (there from anyio 4.0 on): only tried, last, so that a
        portal that cannot take it (slots in a later anyio) still has the parent forgotten,
        the child's exit alone left to hang as before.
        """
        portal = self.portal
        _inherited.append((self.stack, portal, self.open))
        self.lock = threading.Lock()
        self.stack = None
        self.portal = None
        self.users = 0
        self.open = set()
        self.generation += 1
        self.loop_thread = None
        self.loop = None
        if portal is not None:
            with contextlib.suppress(AttributeError):
                portal._event_loop_thread_id = None


def _aside(work: Callable[[], T]) -> T:
    """``work()``, which takes the runtime's lock, run by another thread when called by the
    main thread, which waits for it.

    Python runs signal handlers in the main thread, between two bytecodes (Python docs,
    signal, "Execution of Python signal handlers"): a handler calling connect or close (a
    script's "stop on SIGTERM") while that thread held the lock waited for a lock only the
    thread it interrupted could release, and the process hung. No re-entrant lock would do:
    the handler would change the state half-way through a change (a loop thread started
    twice, a count lost). Done aside, the bookkeeping goes on while a handler runs, and a
    connect or close in the handler waits for it as another thread's would."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as exc:
            done.set_exception(exc)

    helper = threading.Thread(target=run, name="aio-keuss sync bookkeeping", daemon=True)
    try:
        helper.start()
    except RuntimeError:  # no new thread at interpreter exit (Python 3.12+): nothing to wait
        return work()
    helper.join()  # ended, not merely done: a caller counting threads next sees it gone
    return done.result()


_inherited: list[object] = []
"""What a forked child got from its parent, kept from being finalized while the child works
(only the interpreter's finalization frees it; see ``forget``)."""

_runtime = _Runtime()
atexit.register(_runtime.shutdown)
os.register_at_fork(after_in_child=_runtime.forget)


def connect(backend: str = "memory", **options: Any) -> SyncFactory:
    """Blocking :func:`aio_keuss.connect`: same backends and options. Close the factory (or
    use ``with``) to release its connections; the loop thread stops with the last one.

    Interrupted (KeyboardInterrupt), it leaves nothing behind: neither a loop thread nor a
    factory nobody closes. Starting the loop thread, spawning the opening task and making
    the sync factory are each done whole, a Ctrl-C meanwhile being raised once they are
    (see ``_sigint_held``); the opening itself, which may wait for a server, stays
    interruptible, and what it opens is closed (see ``_Opening``)."""
    _runtime.refuse_on_loop_thread("connect")
    state = _Opening()
    acquired: tuple[BlockingPortal, int] | None = None
    made: SyncFactory | None = None
    try:
        with _sigint_held():
            acquired = _runtime.acquire()
            opening = acquired[0].start_task_soon(_open_factory, state, backend, options)
        factory = opening.result()
        with _sigint_held():
            made = SyncFactory(factory, *acquired, (backend, options))
    except BaseException:
        if made is not None:  # counted as open: its own close undoes it all
            made.close()
        elif acquired is not None:
            try:
                _close_unwanted(acquired[0], state)
            finally:
                _runtime.release(acquired[1])
        raise
    return made


class _Opening:
    """A factory being opened for a connect that may be interrupted. The task spawned for
    it may run even when the caller never learnt of it (interrupted while anyio's
    ``start_task_soon`` waited for the spawn), and may finish after the caller gave up:
    whichever of the two comes second closes the factory, under ``lock``."""

    __slots__ = ("abandoned", "factory", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held for two assignments, also on the loop thread
        self.factory: Factory | None = None
        self.abandoned = False


async def _open_factory(state: _Opening, backend: str, options: dict[str, Any]) -> Factory:
    factory = await _async_connect(backend, **options)
    with state.lock:
        abandoned = state.abandoned
        state.factory = factory
    if abandoned:  # the caller is gone: nobody else would close it
        await factory.close()
    return factory


def _close_unwanted(portal: BlockingPortal, state: _Opening) -> None:
    """Interrupted (KeyboardInterrupt) while a factory opened: it opens anyway, and nobody
    would close it, leaving its connections open. Close it if it is open; else the opening
    task closes it once open (the loop thread, if this was its last user, stops only once
    that task has ended)."""
    with state.lock:
        state.abandoned = True
        opened = state.factory
    if opened is not None:
        with contextlib.suppress(Exception):  # the interruption is what the caller hears of
            portal.call(opened.close)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold a Ctrl-C until the block ends, then run the SIGINT handler that was there.

    Python runs signal handlers in the main thread, between two bytecodes (Python docs,
    signal, "Execution of Python signal handlers"), so ``KeyboardInterrupt`` can cut any
    step of a connect half-way: inside anyio's portal start it left a loop thread running
    for nobody; inside ``start_task_soon`` a task opening a factory nobody would close.
    Held here for steps that wait only for the loop thread's next turn, never for a
    server. Other threads never see ``KeyboardInterrupt``: nothing to hold there, nor
    where the handler is not Python's (ignored, default, or set from C)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    held: list[tuple[int, FrameType | None]] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append((signum, frame))

    try:
        signal.signal(signal.SIGINT, hold)
    except ValueError:  # the main thread of another interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(*held[0])


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class SyncFactory:
    """Blocking :class:`aio_keuss.Factory`; safe to share between threads."""

    def __init__(
        self,
        factory: Factory,
        portal: BlockingPortal,
        generation: int,
        reopen: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        self.factory = factory
        """The async factory, for code already running on the loop thread (see ``call``)."""
        self._portal = portal
        self._generation = generation
        self._close_lock = threading.Lock()
        self._closers: set[int] = set()
        """Threads in :meth:`close` (a signal handler may run a close within a close)."""
        self._closing: Future[None] | None = None
        self._closed = False
        self._loop = _runtime.loop
        self._reopen = reopen
        """What :func:`connect` was given: a popped message whose caller was interrupted
        after this factory's close goes back through a connection of its own."""
        _runtime.note_open(self, generation)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<SyncFactory {self.factory.backend_name!r} {state}>"

    @property
    def closed(self) -> bool:
        """True once closed here, or when inherited across a fork (unusable in the child)."""
        return self._closed or self._generation != _runtime.generation

    @property
    def capabilities(self) -> Capabilities:
        return self.factory.capabilities

    @property
    def backend_name(self) -> str:
        return self.factory.backend_name

    def call(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await func(*args)`` on the loop thread and return (or raise) its result.

        Used by every blocking method, and open to callers that want several async calls
        in one hop (``asyncio.gather`` of many pushes) instead of one hop each.
        """
        future = self._start(func, *args)
        try:
            return _outcome(future)
        except BaseException:
            # Interrupted (KeyboardInterrupt) while waiting: cancel the task too. A no-op
            # when the future already holds the coroutine's own exception.
            future.cancel()
            raise

    def _take(
        self,
        queue: Queue,
        give_back: _GiveBack,
        func: _Taker[T],
        taking: _Taking | None = None,
        elsewhere: _Elsewhere | None = None,
    ) -> T:
        """:meth:`call` for what takes messages (pop, reserve, the next of ``messages``),
        ``func`` given a dict in which a pop notes what the store handed out (what a
        put-back keeps: the end of life and place a Message does not carry).

        Interrupted while waiting (KeyboardInterrupt), the caller will never see what was
        taken: the loop thread cancels the call if it still runs (a cancelled pop or
        reserve puts back what it held), or gives back what it returned. Cancelling the
        future instead, as :meth:`call` does, dropped a result that was already on its way:
        a popped message was lost, a reserved one invisible for ``reserve_delay``.

        That give-back reaches the loop thread when the caller's interruption is handled,
        possibly after another thread's close of the queue closed its store: so the close
        itself gives back a result its caller has not got in hand (see ``_settle``), and
        the caller then gets what a close gives a waiting call, nothing.

        Interrupted once it had the result in hand (its claim first) but before it returned
        it, the caller gives it back, and that close may have run meanwhile, the loop
        thread stopped with it: see ``_after_claim``; ``elsewhere`` then gives back a
        popped message (a reservation is given back by the close, or lapses).
        """
        if taking is None:
            taking = _Taking()
        try:
            # inside the try: anyio's start_task_soon waits for the task to be spawned, and
            # an interruption there leaves it running for nobody
            future: Future[T] = self._start(_take, taking, queue, give_back, func)
            result = _outcome(future)
            if not _settle_once(taking):  # given back by the queue's close meanwhile
                result = cast(T, [] if isinstance(result, list) else None)
            if taking.settle is not None:
                queue._handovers.discard(taking.settle)
            return result
        except BaseException:
            if taking.taken and taking.claims and taking.claims[0] is _CALLER:
                self._after_claim(taking, queue, give_back, elsewhere)
                raise
            # Also after the call's own error: then nothing was taken and the task has ended.
            # A callback, not a portal call, which would wait for the loop thread.
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop stopped: nothing runs there
                    self._loop.call_soon_threadsafe(_abandon, taking, queue, give_back)
            raise

    def _after_claim(
        self,
        taking: _Taking,
        queue: Queue,
        give_back: _GiveBack,
        elsewhere: _Elsewhere | None,
    ) -> None:
        """Give back what the caller had in hand (its claim first, so no close gave it back)
        when it was interrupted before returning it: a signal handler runs between two
        bytecodes, any of them. Another thread's close of the queue may have run its
        give-backs meanwhile, closed the store, and (the last close) stopped the loop
        thread: a give-back sent there then had nowhere to run, and a popped message was
        lost. A close cannot wait for the caller instead: the caller may be the one
        waiting for it (a signal handler closing the factory, run by the caller's thread).

        The entry added back is one the close either runs (the close gives back, on the
        loop thread, before its store closes) or leaves to this thread (the flag the close
        sets once it ran them all, read after the add). Both may think the other late;
        ``_gives_back`` lets the first of them do it. Here, a popped message goes back
        through a new connection (``elsewhere``), waited for: a second Ctrl-C stops the
        wait, not the give-back, and one during the few steps before it is held until
        they are done (cut there, the close might have run the entry before the caller's
        mark, and nobody given the message back)."""
        helper: threading.Thread | None = None
        with _sigint_held():
            # a new entry, not the one a close may be dropping as it ends its run
            taking.settle = settle = functools.partial(_settle, taking, queue, give_back)
            queue._handovers.add(settle)
            taking.claims.append(_ABANDONED)
            if not queue._handovers_sealed:  # that close's next pass, or the callback
                if self._loop is not None:
                    with contextlib.suppress(RuntimeError):
                        self._loop.call_soon_threadsafe(_abandon, taking, queue, give_back)
            elif elsewhere is not None and taking.taken and _gives_back(taking):
                helper = elsewhere(taking.taken, taking.kept)
        if helper is not None:
            helper.join()

    def _put_back_elsewhere(
        self, queue: Queue, messages: list[Message], kept: Mapping[str, Stored]
    ) -> threading.Thread | None:
        """Start putting back popped ``messages`` of ``queue`` through a connection of their
        own, on an event loop of their own (the shared one may have stopped), in a thread
        returned to be waited for. Not a daemon: the interpreter, exiting on the Ctrl-C,
        lets it end first; each step is bounded by ``CANCELLED_CLOSE_GRACE``, as a
        cancelled close is. Nothing to do where the queues live in this process only (the
        memory backend): they closed with the factory."""
        if self._reopen is None or not self.factory.capabilities.shared:
            return None
        backend, options = self._reopen
        name, queue_options = queue.name, queue.options.as_dict()

        def run() -> None:
            try:
                asyncio.run(_put_back_anew(backend, options, name, queue_options, messages, kept))
            except Exception as exc:  # a popped message is then lost
                log.warning(
                    "queue %r: could not put back %d popped message(s) of an interrupted"
                    " caller after the close: %r",
                    name,
                    len(messages),
                    exc,
                )

        helper = threading.Thread(target=run, name="aio-keuss sync give-back")
        helper.start()
        return helper

    def _start(self, func: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        if self.closed:
            if self._closed:
                raise ClosedError("factory is closed")
            raise ClosedError(
                "factory of the parent process, inherited across fork(): its loop thread"
                " does not run in this process; connect again in the child"
            )
        try:
            return self._portal.start_task_soon(_contained, func, *args)
        except RuntimeError as exc:  # the loop stopped under us: closed by another thread
            if self.closed:
                raise ClosedError("factory is closed") from exc
            if _loop_running_here():  # anyio refuses a call from the portal's own thread
                raise LoopThreadError(
                    "a blocking aio_keuss.sync call on the shim's own loop thread would wait"
                    " for itself (call_soon is refused there too): await the async queue"
                    " there (SyncQueue.queue)"
                ) from exc
            raise

    def call_soon(self, func: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        """Start ``await func(*args)`` on the loop thread and return at once; ``result()`` on
        the future waits for it. Lets a producer prepare its next batch while the last one
        is on the wire (a Spark executor pushing a partition)."""
        return _unwrapping(self._start(func, *args))

    def queue(self, name: str, **options: Any) -> SyncQueue:
        """Blocking :meth:`Factory.queue`: the queue ``name``, created on first use."""
        return SyncQueue(self, self.call(functools.partial(self.factory.queue, name, **options)))

    def list(self) -> dict[str, dict[str, Any]]:
        """Queues known to this backend (from any process) with their options."""
        return self.call(self.factory.list)

    def pipelines(self, *, sizes: bool = False) -> dict[str, dict[str, Any]]:
        """Blocking :meth:`Factory.pipelines`: the stored pipeline topologies."""
        return self.call(functools.partial(self.factory.pipelines, sizes=sizes))

    def remove_pipeline(self, name: str) -> bool:
        """Blocking :meth:`Factory.remove_pipeline`."""
        return self.call(self.factory.remove_pipeline, name)

    def close(self, timeout: float | None = CLOSE_TIMEOUT) -> None:
        """Close the async factory (drains its queues); the last factory stops the loop.
        Idempotent, and a no-op for a factory inherited from the parent of a fork. A close
        called while another thread's is under way waits for it, as the async close does.
        ``timeout``: as :meth:`Factory.close`'s (past it, the close goes on as a cancelled
        one, bounded, so it returns even when the server stopped answering)."""
        if timeout is not None:  # refused before anything closes
            timeout = check_seconds(timeout, "timeout")
        if self._generation != _runtime.generation:
            # Inherited from the parent of a fork: nothing to close here, and its close lock
            # may be held by a parent thread that does not exist in this process.
            self._closed = True
            return
        if not self.closed:  # before anything changes: the factory stays open and usable
            _runtime.refuse_on_loop_thread("close")
        me = threading.get_ident()
        if me in self._closers:
            # A signal handler (a script's "close on SIGTERM") run by this thread in the
            # middle of its own close: the lock is held by the close it interrupted, which
            # goes on only once the handler returns. Wait for the async close, if begun.
            closing = self._closing
            if closing is not None and closing.done():
                return
            if self._closed:
                # Its task may not be handed to the loop thread yet (interrupted before
                # start_task_soon submitted it): its future would never settle, and
                # waiting for it hung both. A second async close waits for the first, or
                # runs it (the first then finds it done); the portal runs until the
                # interrupted close's future is done.
                with contextlib.suppress(Exception):  # the close under way raises it
                    self._portal.call(self.factory.close)
            return
        try:  # added inside: a Ctrl-C right after the add would leave it there
            self._closers.add(me)
            self._close_once(timeout=timeout)
        finally:
            self._closers.discard(me)

    def _close_once(self, wait: float | None = None, timeout: float | None = CLOSE_TIMEOUT) -> None:
        """The close, by one thread; ``wait``: seconds before it is cancelled (at exit);
        ``timeout``: the async close's own (see :meth:`Factory.close`)."""
        with self._close_lock:  # held throughout: a second close returns once this one ends
            if self._closed:
                return
            try:
                # Done whole, a Ctrl-C held until the close is under way: marked closed and
                # not closing, the async factory was closed by nobody (no later close nor
                # the exit would), and the loop thread stayed counted for it.
                with _sigint_held():
                    self._closed = True
                    _runtime.note_closed(self)
                    # made before the task starts, and settled by it on the loop thread: a
                    # signal handler's close run by this thread while it is still inside
                    # start_task_soon (which waits for the loop thread to spawn the task,
                    # by then under way) waits for this one; a future start_task_soon
                    # returns would exist only once the handler returned
                    self._closing = closing = Future[None]()
                    running: list[asyncio.Task[Any]] = []
                    task = self._portal.start_task_soon(
                        _settling,
                        closing,
                        # the default passed as such: a close wrapped without it still runs
                        self.factory.close
                        if timeout == CLOSE_TIMEOUT
                        else functools.partial(self.factory.close, timeout=timeout),
                        running,
                    )
                if wait is None:
                    closing.result()
                    return
                try:
                    closing.result(timeout=wait)
                except TimeoutError:
                    log.warning(
                        "%r: close at exit given up after %s s (a server that does not"
                        " answer?): cancelled, the rest of it is bounded",
                        self,
                        wait,
                    )
                    # Cancelled once, as a shutdown timeout does: the portal's own cancel
                    # (its future's cancel()) cancels its task again on every loop
                    # iteration until it ends, which cut the close's grace at once
                    # (reservations held stayed reserved, buffered writes were dropped).
                    if self._loop is not None:
                        with contextlib.suppress(RuntimeError):  # the loop already stopped
                            self._loop.call_soon_threadsafe(_cancel_once, running)
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        try:
                            closing.result(timeout=EXIT_GRACE_WAIT)
                        except TimeoutError:
                            task.cancel()  # the portal's: again until the task ends
                            closing.result()
            finally:
                if self._closed:  # else interrupted before anything changed: still open
                    _runtime.release(self._generation)

    def __enter__(self) -> SyncFactory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Carried(Exception):
    """A BaseException that is not an Exception (SystemExit, KeyboardInterrupt, ...)
    raised by a coroutine run for a caller, on its way to that caller's thread."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(repr(exc))
        self.exc = exc


async def _contained(func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await func(*args)``, a BaseException it raises (a ``sys.exit()`` in a coroutine
    given to ``call``) carried as an Exception: anyio's portal hands such an exception to
    the caller and also re-raises it into the task group running the portal (anyio
    documentation, "Calling asynchronous code from an external thread"), which ended the
    loop thread every factory of the process uses. A cancellation is left as it is: it is
    the portal's own, from a caller's ``future.cancel()``."""
    try:
        return await func(*args)
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:
        raise _Carried(exc) from None


def _outcome(future: Future[T]) -> T:
    """``future.result()``, a carried BaseException raised as itself (see ``_contained``)."""
    try:
        return future.result()
    except _Carried as carried:
        raise carried.exc from None


def _unwrapping(future: Future[T]) -> Future[T]:
    """A future settled as ``future`` is, a carried BaseException as itself (see
    ``_contained``); cancelling it cancels ``future`` (and so the task)."""
    outer: Future[T] = Future()

    def copy(done: Future[T]) -> None:
        if done.cancelled():
            outer.cancel()
            return
        exc = done.exception()
        with contextlib.suppress(InvalidStateError):  # cancelled by its holder meanwhile
            if exc is None:
                outer.set_result(done.result())
            else:
                outer.set_exception(exc.exc if isinstance(exc, _Carried) else exc)

    def cancel(done: Future[T]) -> None:
        if done.cancelled():
            future.cancel()

    outer.add_done_callback(cancel)
    future.add_done_callback(copy)
    return outer


async def _settling(
    done: Future[None],
    work: Callable[[], Awaitable[None]],
    running: list[asyncio.Task[Any]] | None = None,
) -> None:
    """``await work()``, its outcome copied into ``done`` (see ``SyncFactory._close_once``);
    the task running it is put in ``running``, for a cancellation of its own."""
    task = asyncio.current_task()
    if running is not None and task is not None:
        running.append(task)
    try:
        await work()
    except BaseException as exc:
        done.set_exception(exc)
        raise
    done.set_result(None)


def _cancel_once(running: list[asyncio.Task[Any]]) -> None:
    """Cancel the close's task once (see ``SyncFactory._close_once``): a close cancelled
    once still finishes in its grace, one cancelled again gives the rest up at once
    (``Factory.close``)."""
    for task in running:
        task.cancel()


class SyncQueue:
    """Blocking :class:`aio_keuss.Queue`: same arguments, timeouts, results and errors."""

    def __init__(self, factory: SyncFactory, queue: Queue) -> None:
        self._factory = factory
        self.queue = queue
        """The async queue, for coroutines handed to :meth:`SyncFactory.call`."""

    def __repr__(self) -> str:
        return f"<SyncQueue {self.queue.name!r}>"

    @property
    def name(self) -> str:
        return self.queue.name

    @property
    def capabilities(self) -> Capabilities:
        return self.queue.capabilities

    def call(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await func(queue, *args)`` on the loop thread, ``queue`` being the async
        :class:`aio_keuss.Queue`: several async calls in one hop (``asyncio.gather`` of many
        pushes) instead of one hop each."""
        return self._factory.call(func, self.queue, *args)

    def call_soon(self, func: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        """:meth:`call` without waiting: the future's ``result()`` waits (see
        :meth:`SyncFactory.call_soon`)."""
        return self._factory.call_soon(func, self.queue, *args)

    def _call(self, func: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        if kwargs:
            return self._factory.call(functools.partial(func, *args, **kwargs))
        return self._factory.call(func, *args)

    # producing ------------------------------------------------------------------------

    def push(
        self,
        payload: Payload,
        *,
        delay: float = 0.0,
        headers: Headers | None = None,
        id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue one message; returns its id. Higher ``priority`` first, where the backend
        has them (see ``Queue.push``)."""
        return self._call(
            self.queue.push, payload, delay=delay, headers=headers, id=id, priority=priority
        )

    def push_many(
        self,
        payloads: Sequence[Payload],
        *,
        delay: float = 0.0,
        headers: Headers | None = None,
        ids: Sequence[str] | None = None,
        priority: int = 0,
    ) -> list[str]:
        """Queue many messages in order, in as few round trips as ``max_batch`` allows."""
        return self._call(
            self.queue.push_many,
            payloads,
            delay=delay,
            headers=headers,
            ids=ids,
            priority=priority,
        )

    def push_each(self, messages: Sequence[NewMessage]) -> list[str]:
        """Queue many messages, each with its own delay, headers, id and priority, all
        checked before any is written (see ``Queue.push_each``)."""
        return self._call(self.queue.push_each, messages)

    def repeat(
        self,
        key: str,
        payload: Payload,
        *,
        every: float | None = None,
        cron: str | None = None,
        headers: Headers | None = None,
        tz: str = "UTC",
        priority: int = 0,
    ) -> SyncRepeater:
        """Blocking :meth:`aio_keuss.Queue.repeat`: the repeater runs on the loop thread,
        pushing each occurrence while this thread goes on; ``stop()`` it, use ``with``, or
        close the factory. Its input is refused as ``Queue.repeat`` refuses it, before
        anything is written."""
        repeater = self._call(
            _start_repeat, self.queue, key, payload, every, cron, headers, tz, priority
        )
        return SyncRepeater(self._factory, repeater)

    # consuming ------------------------------------------------------------------------

    def pop(self, timeout: float | None = None) -> Message | None:
        """Take one message at-most-once; None when ``timeout`` passes (or on drain/close)."""
        return self._take(
            _put_back_popped,
            lambda kept: self.queue._pop_kept(kept, timeout),
            elsewhere=self._put_back_elsewhere,
        )

    def pop_many(
        self, n: int, timeout: float | None = None, *, max_wait: float | None = None
    ) -> list[Message]:
        """Up to ``n``; once one is in, up to ``max_wait`` s more to fill (as async)."""
        return self._take(
            _put_back_popped,
            lambda kept: self.queue._pop_many_kept(kept, n, timeout, max_wait),
            elsewhere=self._put_back_elsewhere,
        )

    def reserve(self, timeout: float | None = None) -> Message | None:
        """Reserve one message at-least-once; ``ok`` or ``ko`` it afterwards."""
        return self._take(_release, lambda _: self.queue.reserve(timeout))

    def reserve_many(
        self, n: int, timeout: float | None = None, *, max_wait: float | None = None
    ) -> list[Message]:
        """Up to ``n``; once one is in, up to ``max_wait`` s more to fill (as async)."""
        return self._take(
            _release, lambda _: self.queue.reserve_many(n, timeout, max_wait=max_wait)
        )

    def _take(
        self,
        give_back: _GiveBack,
        func: _Taker[T],
        taking: _Taking | None = None,
        *,
        elsewhere: _Elsewhere | None = None,
    ) -> T:
        return self._factory._take(self.queue, give_back, func, taking, elsewhere)

    def _put_back_elsewhere(
        self, messages: list[Message], kept: Mapping[str, Stored]
    ) -> threading.Thread | None:
        return self._factory._put_back_elsewhere(self.queue, messages, kept)

    def messages(self, timeout: float | None = None) -> Iterator[Message]:
        """Reserved messages (popped ones on a backend without reserve) until drain, close,
        or ``timeout`` seconds with nothing, like :meth:`Queue.messages`."""
        # The async iterator itself, advanced through the portal: it rides out server
        # outages (backoff, one warning per outage) exactly as ``async for`` does.
        iterator = self.queue.messages(timeout)
        popping = not self.queue.capabilities.reserve
        give_back = _put_back_popped if popping else _release
        elsewhere = self._put_back_elsewhere if popping else None
        taking: _Taking | None = None
        try:
            while not self._factory.closed:
                taking = _Taking()
                message = self._take(
                    give_back, lambda _: _advance(iterator), taking, elsewhere=elsewhere
                )
                if message is None:
                    return
                yield message
        finally:
            if not self._factory.closed:
                self._call(_close_after, taking, iterator)

    def __iter__(self) -> Iterator[Message]:
        return self.messages()

    # acknowledging --------------------------------------------------------------------

    def ok(self, message: Message | str, result: Any = NO_RESULT) -> bool:
        return self._call(self.queue.ok, message, result)

    def ok_many(
        self, messages: Sequence[Message | str], results: Sequence[Any] | None = None
    ) -> list[bool]:
        return self._call(self.queue.ok_many, messages, results)

    def ko(
        self, message: Message | str, delay: float | None = None, error: str | None = None
    ) -> KoResult:
        return self._call(self.queue.ko, message, delay, error)

    def extend(self, message: Message | str, seconds: float | None = None) -> bool:
        return self._call(self.queue.extend, message, seconds)

    def extend_many(
        self, messages: Sequence[Message | str], seconds: float | None = None
    ) -> list[bool]:
        return self._call(self.queue.extend_many, messages, seconds)

    def move(
        self,
        message: Message | str,
        queue: str,
        *,
        payload: Payload | Unchanged = UNCHANGED,
        headers: Headers | None = None,
        delay: float = 0.0,
    ) -> str | None:
        return self._call(
            self.queue.move, message, queue, payload=payload, headers=headers, delay=delay
        )

    def move_many(
        self,
        messages: Sequence[Message | str],
        queue: str,
        *,
        headers: Headers | None = None,
        delay: float = 0.0,
    ) -> list[str | None]:
        return self._call(self.queue.move_many, messages, queue, headers=headers, delay=delay)

    def remove(self, message: Message | str) -> bool:
        return self._call(self.queue.remove, message)

    def promote(self, message: Message | str) -> bool:
        return self._call(self.queue.promote, message)

    def reschedule(self, message: Message | str, delay: float) -> bool:
        return self._call(self.queue.reschedule, message, delay)

    def change_priority(self, message: Message | str, priority: int) -> bool:
        return self._call(self.queue.change_priority, message, priority)

    def cancel(self, message: Message | str, reason: str | None = None) -> CancelResult:
        """Blocking :meth:`Queue.cancel`."""
        return self._call(self.queue.cancel, message, reason)

    # results --------------------------------------------------------------------------

    def result(self, message: Message | str, timeout: float | None = 0.0) -> JobResult | None:
        """Blocking :meth:`Queue.result`."""
        return self._call(self.queue.result, message, timeout)

    def push_and_wait(
        self,
        payload: Payload,
        *,
        timeout: float | None = None,
        delay: float = 0.0,
        headers: Headers | None = None,
        id: str | None = None,
        priority: int = 0,
    ) -> Any:
        """Blocking :meth:`Queue.push_and_wait`; its errors (``JobFailedError``,
        ``ResultTimeoutError``, ``ResultMissingError``) are raised here as they are."""
        return self._call(
            self.queue.push_and_wait,
            payload,
            timeout=timeout,
            delay=delay,
            headers=headers,
            id=id,
            priority=priority,
        )

    # observing and administering ------------------------------------------------------

    def sizes(self) -> Sizes:
        return self._call(self.queue.sizes)

    def size(self) -> int:
        return self._call(self.queue.size)

    def total_size(self) -> int:
        return self._call(self.queue.total_size)

    def sched_size(self) -> int:
        return self._call(self.queue.sched_size)

    def resv_size(self) -> int:
        return self._call(self.queue.resv_size)

    def next_mature_t(self) -> datetime | None:
        return self._call(self.queue.next_mature_t)

    def pause(self) -> None:
        self._call(self.queue.pause)

    def resume(self) -> None:
        self._call(self.queue.resume)

    def is_paused(self) -> bool:
        return self._call(self.queue.is_paused)

    # looking inside and repairing -----------------------------------------------------

    def peek(self, n: int = 10, *, state: str = "ready") -> list[MessageView]:
        """The first ``n`` messages in ``state``, without taking them (:meth:`Queue.peek`)."""
        return self._call(self.queue.peek, n, state=state)

    def page(self, *, state: str = "all", after: str | None = None, limit: int = 1000) -> Page:
        return self._call(self.queue.page, state=state, after=after, limit=limit)

    def browse(
        self, *, state: str = "all", after: str | None = None, page_size: int = 1000
    ) -> Iterator[MessageView]:
        """Every message in ``state``, a page per hop to the loop thread (:meth:`Queue.browse`)."""
        cursor = after
        while True:
            found = self.page(state=state, after=cursor, limit=page_size)
            yield from found.items
            if found.cursor is None:
                return
            cursor = found.cursor

    def find(self, message: Message | str) -> MessageView | None:
        return self._call(self.queue.find, message)

    def purge(self) -> int:
        return self._call(self.queue.purge)

    def requeue(
        self, ids: Sequence[str] | None = None, *, origin: str | None = None
    ) -> dict[str, str]:
        return self._call(self.queue.requeue, ids, origin=origin)

    def history(
        self,
        *,
        since: datetime | float | None = None,
        until: datetime | float | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> Page:
        return self._call(self.queue.history, since=since, until=until, limit=limit, after=after)

    def replay(
        self,
        ids: Sequence[str] | None = None,
        *,
        since: datetime | float | None = None,
        until: datetime | float | None = None,
        to: str | None = None,
    ) -> list[str]:
        return self._call(self.queue.replay, ids, since=since, until=until, to=to)

    def stats(self) -> dict[str, int]:
        return self._call(self.queue.stats)

    def drain(self) -> None:
        self._call(self.queue.drain)


_GiveBack = Callable[[Queue, list[Message], Mapping[str, Stored]], None]
"""Gives back, on the loop thread, what a call took for a caller that was interrupted (with
what the store handed out for it, by id, where the call noted it)."""

_Taker = Callable[[dict[str, Stored]], Awaitable[T]]
"""A call that takes messages, given where to note what the store handed out."""

_Elsewhere = Callable[[list[Message], Mapping[str, Stored]], threading.Thread | None]
"""Starts giving back, not through the loop thread, what a call took for a caller
interrupted after it had it in hand, once the queue's close has run: the thread doing it,
for the caller to wait for (None: nothing to do)."""


class SyncRepeater:
    """Blocking handle of a :class:`aio_keuss.Repeater` running on the loop thread."""

    def __init__(self, factory: SyncFactory, repeater: Repeater) -> None:
        self._factory = factory
        self.repeater = repeater
        """The async repeater: its counters (``pushed``, ``missed``), ``next_at``, ``state``."""

    def __repr__(self) -> str:
        return f"<SyncRepeater {self.repeater.key!r} on {self.repeater.queue!r}>"

    @property
    def key(self) -> str:
        return self.repeater.key

    @property
    def state(self) -> str:
        """One of "running", "reconnecting" (pushes fail; it retries) or "stopped"."""
        return self.repeater.state

    def stop(self) -> None:
        """Stop pushing (the occurrence already queued stays queued). Safe to call again,
        and after the factory closed, which stopped it already."""
        if self._factory.closed:
            return
        with contextlib.suppress(ClosedError):  # closed meanwhile: that close stopped it
            self._factory.call(self.repeater.stop)

    def __enter__(self) -> SyncRepeater:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


async def _start_repeat(
    queue: Queue,
    key: str,
    payload: Payload,
    every: float | None,
    cron: str | None,
    headers: Headers | None,
    tz: str,
    priority: int,
) -> Repeater:
    """On the loop thread: a repeater's task belongs to the loop it runs on."""
    return queue.repeat(
        key, payload, every=every, cron=cron, headers=headers, tz=tz, priority=priority
    )


class _Taking:
    """A pop or reserve run for a thread that may be interrupted while it waits. Its fields
    are set on the loop thread only, so "still running" or "done" is never ambiguous; the
    caller's thread only reads them and adds to ``claims`` (and, interrupted after its
    claim, to ``givers``, with a new ``settle``: see ``SyncFactory._after_claim``)."""

    __slots__ = ("abandoned", "claims", "givers", "kept", "settle", "taken", "task")

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.taken: list[Message] | None = None
        self.kept: dict[str, Stored] = {}
        self.abandoned = False
        self.claims: list[str] = []
        """Who claimed the result, in turn (see ``_settle_once``): the first one decides."""
        self.givers: list[object] = []
        """Who gives back a result its caller claimed but never returned (see
        ``SyncFactory._after_claim``): the first one does."""
        self.settle: Callable[[], Awaitable[None]] | None = None
        """Noted on the queue while its caller may not have the result in hand."""


async def _take(taking: _Taking, queue: Queue, give_back: _GiveBack, func: _Taker[T]) -> T:
    if taking.abandoned:  # the caller was interrupted before this even started
        raise asyncio.CancelledError
    taking.task = asyncio.current_task()
    # noted before the call: a close of the queue waits for it, and gives back what it took
    # should its caller not take it in hand
    taking.settle = settle = functools.partial(_settle, taking, queue, give_back)
    queue._handovers.add(settle)
    try:
        result = await func(taking.kept)
    except BaseException:
        queue._handovers.discard(settle)
        raise
    # no await from here to the return: an abandon runs before this line or after it
    if isinstance(result, Message):
        taking.taken = [result]
    elif isinstance(result, list):
        taking.taken = result
    if not taking.taken:
        queue._handovers.discard(settle)
    return result


def _abandon(taking: _Taking, queue: Queue, give_back: _GiveBack) -> None:
    """On the loop thread (a callback, after the one that spawned the task, if any), once
    the caller of ``_take`` was interrupted."""
    taking.abandoned = True
    if taking.taken and taking.claims and taking.claims[0] is _CALLER:
        # interrupted after it claimed the result: sent by ``SyncFactory._after_claim`` only
        # if the queue's close had not run its handovers then (this runs before the close
        # ends, which waits for the entry that thread added back)
        if _gives_back(taking):
            if taking.settle is not None:
                queue._handovers.discard(taking.settle)
            give_back(queue, taking.taken, taking.kept)
        return
    if taking.taken:
        if taking.settle is not None:
            queue._handovers.discard(taking.settle)
        # the caller never claimed the result (a claim of its own is the branch above):
        # back, unless a close gave it back already
        taking.claims.append(_ABANDONED)
        if taking.claims[0] is not _CLOSE:
            give_back(queue, taking.taken, taking.kept)
    elif taking.task is not None:
        taking.task.cancel()  # a no-op once it ended (nothing taken, or its own error)


async def _settle(taking: _Taking, queue: Queue, give_back: _GiveBack) -> None:
    """Run by the queue's close before it closes its store: once the call has ended, what
    it took goes back unless its caller has it in hand already."""
    task = taking.task
    if task is not None and not task.done():
        await asyncio.wait([task])
    if not taking.taken:
        return
    claims = taking.claims
    # once: a close cancelled meanwhile runs this again in its grace
    if _CLOSE not in claims and _settle_once(taking, _CLOSE):
        give_back(queue, taking.taken, taking.kept)
    elif claims[0] is _CALLER and _ABANDONED in claims and _gives_back(taking):
        # the caller claimed it, then was interrupted before it returned it
        give_back(queue, taking.taken, taking.kept)


_CALLER, _CLOSE, _ABANDONED = "caller", "close", "abandoned"


def _gives_back(taking: _Taking) -> bool:
    """True for the first of the close, the callback of the interrupted caller (both on
    the loop thread) and that caller's own thread to give back a result the caller claimed
    but never returned: each appends a token of its own, in one step (as in
    ``_settle_once``), and the first token's owner does it."""
    me = object()
    givers = taking.givers
    givers.append(me)
    return givers[0] is me


def _settle_once(taking: _Taking, who: str = _CALLER) -> bool:
    """True for the first of the caller taking the result in hand and a close's give-back,
    False for the other. A list's append is one step that neither a thread switch nor a
    signal handler splits, and the first claim stays first; a lock would not do: held by
    the main thread when a handler ran there (one closing the factory), the loop thread
    would wait for it, and the handler for the loop thread. Kept, the claims also tell the
    caller's give-back (``_abandon``) whether the caller had claimed the result before an
    interruption kept it from returning it: a claim removed (a pop) could not."""
    claims = taking.claims
    claims.append(who)
    return claims[0] is who


def _put_back_popped(queue: Queue, messages: list[Message], kept: Mapping[str, Stored]) -> None:
    queue._in_background(queue._put_back_unhandled(messages, kept))


def _release(queue: Queue, messages: list[Message], _: Mapping[str, Stored]) -> None:
    queue._in_background(queue._release_all(messages, unseen=True))


async def _put_back_anew(
    backend: str,
    options: dict[str, Any],
    name: str,
    queue_options: dict[str, Any],
    messages: list[Message],
    kept: Mapping[str, Stored],
) -> None:
    """Popped ``messages`` back into queue ``name`` through a factory opened for it alone."""
    async with asyncio.timeout(CANCELLED_CLOSE_GRACE):
        factory = await _async_connect(backend, **options)
    try:
        async with asyncio.timeout(CANCELLED_CLOSE_GRACE):
            queue = await factory.queue(name, **queue_options)
            await queue._put_back_unhandled(messages, kept)
    finally:
        async with asyncio.timeout(CANCELLED_CLOSE_GRACE):  # then a cancelled close's grace
            await factory.close()


async def _close_after(taking: _Taking | None, iterator: AsyncGenerator[Message, None]) -> None:
    """Close ``iterator`` once its last advance has ended. Abandoned (the caller
    interrupted), that advance may still run: cancelled once the reply was in, it hands back
    what it took first, and an async generator closed meanwhile raises RuntimeError
    ("already running") in place of the interruption. Run after the abandon (spawned
    later), so the advance has begun by now if it ever will."""
    task = None if taking is None else taking.task
    if task is not None and not task.done():
        await asyncio.wait([task])
    await iterator.aclose()


async def _advance(iterator: AsyncGenerator[Message, None]) -> Message | None:
    """The next message, or None when the iterator ended (a StopAsyncIteration does not
    cross the portal as a plain return value would)."""
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return None
