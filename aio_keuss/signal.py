"""Wake-up and pause signals between queue objects, in this process and in others.

The generic half lives here, once: subscribers in this process are told at once; other
processes are told through a transport (Redis pub/sub, LISTEN/NOTIFY, ...) that a subclass
provides with :meth:`SignalBus._publish` and by calling :meth:`SignalBus._receive`.

A transport that must hold a connection open to hear the others provides
:meth:`SignalBus._listen`, and the lifecycle around it is the base's, the same for every
database: one task per bus; ``open`` waits until it listens, so a push made right after
``connect`` returns is heard (or raises, if it cannot listen at all); a lost connection is
reopened with capped exponential backoff while consumers keep going on their poll interval,
and once it listens again every local queue is woken, since what was signalled meanwhile
went unheard; ``close`` cancels it.

Insertion events for a queue are debounced per queue: the first one of a burst goes out at
once, later ones within the window are folded into one trailing event carrying the earliest
mature time, sent when the window closes, so the last event of a burst is never dropped.
Signals are hints: a lost one costs a consumer at most its poll interval.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import orjson

from .coalesce import stop_task

log = logging.getLogger("aio_keuss.signal")

SignalKind = Literal["insert", "pause", "resume", "resync", "result", "cancel", "grant"]

RESULTS_ROUTE = "?results "
"""What a "result" signal's queue field starts with (the queue's name follows): no queue
name can start with ``?`` (see ``options.check_queue_name``), so a listener of a release
that knows no results, which routes signals by that field, finds nobody to wake: its
consumers are never woken by results (a result put is frequent, one per ok)."""
CANCELS_ROUTE = "?cancel "
"""What a "cancel" signal's queue field starts with (the queue's name follows), routed apart
from the queue's listeners as results are (see :data:`RESULTS_ROUTE`): a release that
knows no cancel drops it, and only the consumers holding messages of that queue hear it."""
GRANTS_ROUTE = "?grant "
"""What a "grant" signal's queue field starts with (the queue's name follows), routed apart
from the queue's listeners as results are (see :data:`RESULTS_ROUTE`): a release that knows
no grant signal takes any kind it does not know on the queue's own route for a wake-up of
all its consumers of that queue, each then costing a limiter round trip; on this route it
finds nobody to wake and drops it."""
MAX_SIGNAL_IDS = 64
"""Most ids a "result" signal names; beyond, it names none and every waiter looks."""
MAX_SIGNAL_BYTES = 7000
"""Longest encoded signal sent with ids: PostgreSQL's NOTIFY payload holds less than 8,000
bytes (its documentation, NOTIFY); longer, the ids are left out."""

RECONNECT_FIRST = 0.05
RECONNECT_CAP = 2.0
STABLE_AFTER = 10.0
"""Seconds a listener must stay in place after an outage before it counts as back (logged,
backoff reset): one lost sooner (a cluster in a fail state accepts a subscribe, then drops
it) is the same outage, logged once, its reconnects still backing off."""
OPEN_WAIT = 5.0
"""Longest ``open`` waits for the listener to be in place."""


def _raise_if_cancelled(cause: BaseException | None) -> None:
    """Stop a listener that was cancelled (``close``) even if the driver turned the
    cancellation into an error of its own, or into an ordinary end of the connection (redis-py
    can, when the server goes away at that moment): retrying then would leave a listener that
    nobody can stop, and ``close`` waiting for it forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from cause


# Not frozen: one is made per push, and a frozen dataclass's __init__ costs an
# object.__setattr__ call per field. Listeners only read it.
@dataclass(slots=True)
class Signal:
    queue: str
    kind: SignalKind
    mature: float | None = None
    count: int | None = None
    """How many messages an insert announces (it wakes that many waiting consumers);
    None: unknown, which wakes them all."""
    ids: list[str] | None = None
    """The messages a "result" signal announces results of, or a "cancel" signal asks to
    stop; None: unknown (all look)."""


Listener = Callable[[Signal], None]


class SignalBus:
    """In-process delivery plus debounced publishing; the base class alone is local-only."""

    def __init__(self, debounce: float = 0.05) -> None:
        self.debounce = debounce
        self.origin = os.urandom(8).hex()
        # Tuples, replaced on the rare subscribe and unsubscribe: every push delivers, and a
        # listener may unsubscribe while it is called, so a set would be copied per delivery.
        self._listeners: dict[str, tuple[Listener, ...]] = {}
        self._windows: dict[str, tuple[float, int | None] | None] = {}
        self._publishing: set[asyncio.Task[None]] = set()
        self._closed = False
        self._listener: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()  # set once the listener has listened
        self._opening = False  # while ``open`` waits for it
        self._failing = False
        self._settling: asyncio.TimerHandle | None = None  # until it counts as back
        self._backoff = RECONNECT_FIRST
        self._remote = type(self)._publish is not SignalBus._publish  # read on every push

    async def open(self) -> None:
        """Start the transport's listener, if it has one, and wait until it listens.

        A listener that fails before it ever listened fails ``open`` with its error: the
        server refused it, or cannot do it (change streams on a standalone MongoDB). One
        that is merely slow is left to come up while consumers poll.
        """
        if type(self)._listen is SignalBus._listen:
            return
        listener = asyncio.get_running_loop().create_task(self._listen_forever())
        self._listener = listener
        listening = asyncio.ensure_future(self._listening.wait())
        self._opening = True
        try:
            await asyncio.wait(
                (listener, listening), timeout=OPEN_WAIT, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:
            await self._stop_listener()
            raise
        finally:
            self._opening = False
            listening.cancel()
        if listener.done():
            self._listener = None
            listener.result()

    async def close(self, deadline: float | None = None) -> None:
        """Send what is still to go out, then stop the listener. ``deadline`` (the loop's
        clock): a cancelled close's grace, past which the signals still on their way out
        are dropped, not waited for: a server that stopped answering never takes them, and
        a lost signal only costs a waiter in another process its poll interval."""
        # Trailing signals of open debounce windows go out now: once closed, the window's
        # timer would drop them (the last announcement of a burst, e.g. what a queue
        # closing just before gave back).
        self._send_trailing()
        self._windows.clear()
        self._closed = True
        try:
            if deadline is None:
                await self._sent()
            elif self._publishing:
                loop = asyncio.get_running_loop()
                timeout = max(0.0, deadline - loop.time())
                await asyncio.wait(tuple(self._publishing), timeout=timeout)
                for task in tuple(self._publishing):
                    task.cancel()  # given up: not left pending as the loop closes
                    log.debug("signal publish dropped at a cancelled close")
        finally:
            await self._stop_listener()

    async def published(self) -> None:
        """Send the trailing signals of open debounce windows now, and wait for the signals
        on their way out: for work that ends as the loop does (a put-back for a cancelled
        caller as ``asyncio.run`` ends), whose publish would otherwise be a task still
        pending when the loop closes, or one a window's timer starts as it does."""
        self._send_trailing()
        await self._sent()

    def _send_trailing(self) -> None:
        """The signals folded into open debounce windows go out now; the windows stay open."""
        for queue, pending in list(self._windows.items()):
            if pending is not None:
                self._windows[queue] = None
                self._send(Signal(queue, "insert", *pending))

    async def _sent(self) -> None:
        if self._publishing:
            # not gather: cancelled, it would cancel the publishes of others' work too
            await asyncio.wait(tuple(self._publishing))

    def subscribe(self, queue: str, listener: Listener) -> Callable[[], None]:
        listeners = self._listeners.get(queue, ())
        if listener not in listeners:
            self._listeners[queue] = (*listeners, listener)

        def unsubscribe() -> None:
            listeners = self._listeners.get(queue, ())
            if listener in listeners:
                kept = tuple(other for other in listeners if other != listener)
                if kept:
                    self._listeners[queue] = kept
                else:
                    del self._listeners[queue]

        return unsubscribe

    def insert(self, queue: str, mature: float, count: int | None = None) -> None:
        """Announce ``count`` messages (None: unknown) in ``queue``, the first maturing at
        ``mature``; never blocks."""
        signal = Signal(queue, "insert", mature, count)
        self._deliver(signal)
        if not self._remote:
            return
        windows = self._windows
        if queue in windows:  # within the debounce window: merged into its last signal
            pending = windows[queue]
            if pending is None:
                windows[queue] = (mature, count)
            else:
                earlier, counted = pending
                merged = None if counted is None or count is None else counted + count
                windows[queue] = (earlier if earlier <= mature else mature, merged)
            return
        self._open_window(queue)
        self._send(signal)

    def subscribe_results(self, queue: str, listener: Listener) -> Callable[[], None]:
        """Hear the "result" signals of ``queue`` (and, as any listener, the resyncs after
        the transport was away: a result announced meanwhile went unheard)."""
        return self.subscribe(RESULTS_ROUTE + queue, listener)

    def results(self, queue: str, ids: Sequence[str]) -> None:
        """Announce that results of ``ids`` of ``queue`` were kept; never debounced (the
        waiters of each id are woken by its own), never blocks."""
        named = list(ids) if len(ids) <= MAX_SIGNAL_IDS else None
        signal = Signal(RESULTS_ROUTE + queue, "result", ids=named)
        self._deliver(signal)
        self._send(signal)

    def subscribe_cancels(self, queue: str, listener: Listener) -> Callable[[], None]:
        """Hear the "cancel" signals of ``queue`` (and, as any listener, the resyncs after
        the transport was away: a cancel sent meanwhile went unheard)."""
        return self.subscribe(CANCELS_ROUTE + queue, listener)

    def cancels(self, queue: str, ids: Sequence[str]) -> None:
        """Ask the holders of ``ids`` of ``queue`` to stop them (``Queue.cancel``); never
        debounced, never blocks."""
        named = list(ids) if len(ids) <= MAX_SIGNAL_IDS else None
        signal = Signal(CANCELS_ROUTE + queue, "cancel", ids=named)
        self._deliver(signal)
        self._send(signal)

    def subscribe_grants(self, queue: str, listener: Listener) -> Callable[[], None]:
        """Hear the "grant" signals of ``queue`` (and, as any listener, the resyncs and
        wake-ups after the transport was away, which the queue's own route carries too)."""
        return self.subscribe(GRANTS_ROUTE + queue, listener)

    def granted(self, queue: str) -> None:
        """Announce that a take gave back the rate grants it found no message for, after
        the limiter refused another take: the consumers the limiter refused meanwhile may take again
        (see ``Queue._on_grant_back``); never debounced. Sent on :data:`GRANTS_ROUTE`."""
        signal = Signal(GRANTS_ROUTE + queue, "grant")
        self._deliver(signal)
        self._send(signal)

    def paused(self, queue: str, paused: bool) -> None:
        """Announce a pause or resume; never debounced."""
        signal = Signal(queue, "pause" if paused else "resume")
        self._deliver(signal)
        self._send(signal)

    # transport side -------------------------------------------------------------------

    async def _listen(self, ready: Callable[[], None]) -> None:
        """Connect, call ``ready()`` once listening, then feed :meth:`_receive` until the
        connection fails (raise) or ends (return); the base then starts it again.

        Raise aio_keuss errors (translate the driver's): a first attempt's error is what
        ``open`` raises. The base never calls this one: a bus without it has no listener.
        """

    def _ready(self) -> None:
        """The listener is (again) in place. Every local queue is told to resync (woken, and
        its paused flag read again), since signals sent while it was away went unheard (on
        the first call there is no local queue yet)."""
        if self._failing and self._settling is None:
            self._settling = asyncio.get_running_loop().call_later(STABLE_AFTER, self._back)
        for queue in list(self._listeners):
            self._deliver(Signal(queue, "resync"))
        self._listening.set()

    def _back(self) -> None:
        """The listener stayed in place ``STABLE_AFTER`` after an outage: it is over."""
        self._settling = None
        log.info("%s listener is back", type(self).__name__)
        self._failing = False
        self._backoff = RECONNECT_FIRST

    async def _listen_forever(self) -> None:
        while True:
            try:
                await self._listen(self._ready)
                reason = "connection ended"
            except Exception as exc:
                _raise_if_cancelled(exc)
                if self._opening and not self._listening.is_set():
                    raise  # it cannot listen at all: ``open`` raises this
                reason = str(exc) or type(exc).__name__
            _raise_if_cancelled(None)
            if self._settling is not None:  # lost again before it counted as back
                self._settling.cancel()
                self._settling = None
            # one warning per outage, not one per attempt while the server is away
            level = logging.DEBUG if self._failing else logging.WARNING
            log.log(level, "%s listener lost (%s); retrying", type(self).__name__, reason)
            if not self._failing:
                self._failing = True
                # the server may be away: waiting consumers look now, and report an outage
                # (consumer state, /healthz) at once rather than at their next poll
                for queue in list(self._listeners):
                    self._deliver(Signal(queue, "insert"))
            await asyncio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, RECONNECT_CAP)

    async def _stop_listener(self) -> None:
        if self._settling is not None:
            self._settling.cancel()
            self._settling = None
        listener, self._listener = self._listener, None
        if listener is not None:
            await stop_task(listener)

    async def _publish(self, payload: bytes) -> None:
        """Send one encoded signal to other processes; the local bus has none to tell."""

    def _receive(self, payload: bytes | str) -> None:
        """Feed a signal from the transport; our own echoes are dropped (already delivered)."""
        try:
            data = orjson.loads(payload)
            if data["o"] == self.origin:
                return
            ids = data.get("i")
            if ids is not None and not (
                isinstance(ids, list) and all(isinstance(i, str) for i in ids)
            ):
                ids = None  # all look: a lost id would cost a waiter its poll interval
            self._deliver(Signal(data["q"], data["k"], data.get("m"), data.get("n"), ids))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("ignoring malformed signal %r", payload)

    @property
    def remote(self) -> bool:
        """Whether this bus reaches other processes (worth debouncing and publishing)."""
        return self._remote

    # internals --------------------------------------------------------------------------

    def _deliver(self, signal: Signal) -> None:
        for listener in self._listeners.get(signal.queue, ()):
            try:
                listener(signal)
            except Exception:  # a listener's bug must not stop the others
                log.exception("signal listener failed")

    def _open_window(self, queue: str) -> None:
        self._windows[queue] = None
        asyncio.get_running_loop().call_later(self.debounce, self._close_window, queue)

    def _close_window(self, queue: str) -> None:
        pending = self._windows.pop(queue, None)
        if pending is not None and not self._closed:
            self._open_window(queue)
            self._send(Signal(queue, "insert", *pending))

    def _send(self, signal: Signal) -> None:
        if self._closed or not self._remote:
            return
        fields: dict[str, object] = {
            "o": self.origin,
            "q": signal.queue,
            "k": signal.kind,
            "m": signal.mature,
            "n": signal.count,
        }
        if signal.ids is not None:
            fields["i"] = signal.ids
        payload = orjson.dumps(fields)
        if len(payload) > MAX_SIGNAL_BYTES and signal.ids is not None:
            del fields["i"]  # every waiter of the queue looks, rather than the signal lost
            payload = orjson.dumps(fields)
        task = asyncio.get_running_loop().create_task(self._publish_quietly(payload))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish_quietly(self, payload: bytes) -> None:
        try:
            await self._publish(payload)
        except Exception as exc:  # a lost signal costs latency, never correctness
            log.debug("signal publish failed: %s", exc)


class LocalSignalBus(SignalBus):
    """The in-process bus: no transport, since :class:`SignalBus` already delivers to this
    process's subscribers (queue objects of one process wake each other directly)."""
