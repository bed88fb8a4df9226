"""``queue.consume(handler)``: workers that reserve, run a handler and acknowledge.

Made to be started in a web framework's lifespan and stopped cleanly: ``stop()`` stops taking
new messages, lets in-flight handlers finish (for ``grace`` seconds), and a handler still
running after that is cancelled and its message released at once, costing no try. Nothing a
worker held is lost. On a backend without reserve the workers pop (at-most-once).

A consumer outlives its backend's outages: a worker whose reserve fails (connection lost,
server restarting, an error answer) waits with capped, jittered exponential backoff and tries
again, for as long as it takes. Randomised ("jittered") backoff keeps many clients from
retrying in lockstep against a server that is coming back (see "Exponential Backoff And
Jitter" on the AWS Architecture Blog, which compares full and equal jitter). An outage is
logged once per consumer when it starts (WARNING, or ERROR with the traceback when the server
answered with an error rather than being unreachable; again only if the kind of failure
changes) and once at INFO when it ends, not once per worker and attempt;
:attr:`Consumer.state` and :meth:`Consumer.status` show it meanwhile.
An ``ok`` / ``ko`` that fails after the handler ran is logged the same way and the worker goes
on: the message comes back when its reservation expires (at-least-once).

Handler exceptions are logged at WARNING with their traceback, at most one traceback per
queue every :data:`TRACEBACK_EVERY` seconds; the failures in between are counted and
summarised in one line, so a poison message retried in a loop cannot flood the log.

A handler given a ``timeout`` that runs longer is cancelled and counts as failed
(:class:`~aio_keuss.errors.HandlerTimeoutError`): its message is ko-ed with the usual backoff,
and deadlettered past ``max_ko``. With ``prefetch`` N, a worker that finds nothing buffered
reserves, in one round trip, one message for each worker waiting with it plus N, and leaves
the rest for the next free workers; those never started are given back at once, costing no
try, when the consumer stops (not after its grace).
With ``prefetch`` a worker also does not wait for the ``ok`` of a handled message before it
takes the next one: the ok goes to a background sender (at most ``2 * (concurrency +
prefetch)`` unanswered; ``stop`` waits for them), which sends the oks handled while its last
round trip was out together, with ``ok_many`` (no task per message). The message was handled
either way; an ok that fails is logged and the message comes back when its reservation
expires, as with an awaited ok.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Protocol, Self, cast

from . import observe
from .cancels import MAX_HEARD, POLL_SHARE, CancelWatch, request_ttl
from .contract import Stored
from .deadlines import Deadlines, Limit
from .errors import (
    ClosedError,
    ConfigError,
    HandlerTimeoutError,
    InvalidDelayError,
    InvalidInputError,
    KeussConnectionError,
    NotSupportedError,
    RateLimited,
)
from .message import Message
from .metrics import Histogram, QueueMetrics
from .options import check_seconds
from .outcomes import NO_RESULT, exception_text
from .renewals import Renewals
from .signal import Signal
from .types import Capabilities, KoResult

log = logging.getLogger("aio_keuss.consumer")

CUT_SHORT = "cancelled: its consumer stopped before the handler finished"
"""The failure kept for a popped message whose handler a stop cancelled (it is gone)."""

Handler = Callable[[Message], Awaitable[Any] | Any]
BatchHandler = Callable[[list[Message]], Awaitable[Any] | Any]
"""What ``consume(batch=N)`` calls: with a list of up to N messages."""
Settle = Callable[[Message, Any], Awaitable[Any]]
"""Acknowledges a message from what its handler returned, instead of ``ok``."""
State = Literal["running", "reconnecting", "stopped"]

RETRY_FIRST = 0.1
"""Backoff of the first retry after a failed round trip, in seconds (doubled per failure)."""
RETRY_CAP = 5.0
"""Longest backoff between retries: a recovered server is noticed within about this long
(sooner when the signal bus reconnects first, as it wakes every waiting consumer)."""
TRACEBACK_EVERY = 10.0
"""Shortest interval between two handler tracebacks logged for one queue."""

_NOT_RETRIED = (ClosedError, InvalidInputError, NotSupportedError, ConfigError)


class HandlerCancelled(RuntimeError):
    """A handler raised a ``CancelledError`` of its own (it awaited something another task
    cancelled) while its worker was not asked to stop: a failure of that message (ko with
    backoff), not a stop of the worker, which would end it with nothing logged."""


class HandlerAborted(RuntimeError):
    """A handler raised a ``BaseException`` that is not an ``Exception`` (``GeneratorExit``,
    a class of its own): a failure of that message (ko with backoff), as any exception is.
    Left to propagate, it would end the worker silently for good, its message neither ko-ed
    nor given back (``KeyboardInterrupt`` and ``SystemExit`` still propagate: they stop the
    process, and closing the factory gives its reservations back)."""


def describe(exc: BaseException) -> str:
    """``repr(exc)``, or what it is when its ``__repr__`` raises: logging a handler's
    exception must not fail in its turn (the message would not be ko-ed)."""
    try:
        return repr(exc)
    except Exception:
        return f"<{type(exc).__qualname__} (its repr raised)>"


def _asked_to_stop() -> bool:
    """Whether the running task's own cancellation is pending (a stop, a timeout), as
    opposed to a handler raising a ``CancelledError`` it got from something it awaited."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


_IN_HANDLER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "aio_keuss_in_handler", default=False
)
"""Set in every consumer worker task, and so in the tasks its handler starts (a task
created copies its creator's context: Python's ``asyncio.create_task`` documentation)."""


def in_handler() -> bool:
    """Whether the running code is a consumer's handler, or a task one started
    (``asyncio.gather``, ``asyncio.wait_for`` on Python 3.11): a close it waited for may
    wait for that very handler (see ``Factory._current``)."""
    return _IN_HANDLER.get()


class _HandlerScope:
    """The ``with`` around a handler's call (``Consumer._in_handler``). A class, not a
    ``contextlib.contextmanager`` generator: it is entered once per handled message, and a
    generator's set-up, ``next`` and ``throw`` cost about three times as much."""

    __slots__ = ("_handling", "_loop", "_task")

    def __init__(self, handling: set[asyncio.Task[Any]], loop: asyncio.AbstractEventLoop) -> None:
        self._handling = handling
        self._loop = loop

    def __enter__(self) -> asyncio.Task[Any]:
        # with the loop given: without it, Python 3.11 looks the running loop up, which
        # costs a getpid() system call per handled message (12 % of a 32-worker consumer's
        # samples on redis-oq)
        task = cast(asyncio.Task[Any], asyncio.current_task(self._loop))
        self._task = task
        self._handling.add(task)
        return task

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        self._handling.discard(self._task)
        if exc is None or isinstance(exc, (Exception, KeyboardInterrupt, SystemExit)):
            return False
        if isinstance(exc, asyncio.CancelledError):
            if _asked_to_stop():
                return False
            raise HandlerCancelled(f"the handler raised {exc!r} unasked") from exc
        raise HandlerAborted(f"the handler raised {describe(exc)}") from exc


class _KoHold:
    """A failed message whose ko waits out its retry backoff in a task of its own (a
    backend without delays), its worker gone on; ``named``: a cancel request named it
    meanwhile (or once its handler had failed, before the hold began)."""

    __slots__ = ("message", "named")

    def __init__(self, message: Message, named: bool) -> None:
        self.message = message
        self.named = named


async def _bounded(
    tasks: set[asyncio.Task[Any]] | list[asyncio.Task[None]], abandon: float | None = None
) -> set[asyncio.Task[Any]]:
    """Wait for ``tasks`` at most ``ACK_WAIT`` seconds, then cancel what is left and wait
    for it to end: as long as it takes, or ``abandon`` seconds at most (a task that
    swallows its cancellation must not hold a stop for ever). Returns the tasks still
    running then (none without ``abandon``); the others' outcomes are retrieved, so that
    asyncio does not report them as never retrieved."""
    if not tasks:
        return set()
    _, late = await asyncio.wait(set(tasks), timeout=ACK_WAIT)
    for task in late:
        task.cancel()
    if abandon is None:
        await asyncio.gather(*tasks, return_exceptions=True)
        return set()
    if late:
        _, late = await asyncio.wait(late, timeout=abandon)
    await asyncio.gather(*(t for t in tasks if t not in late), return_exceptions=True)
    return late


async def _awaited(work: Awaitable[Any]) -> Any:
    return await work


def retryable(exc: BaseException) -> bool:
    """Whether a failed round trip is worth retrying: connection and server errors are (and
    any unexpected exception from a store); a closed queue or a misuse never heals."""
    return isinstance(exc, Exception) and not isinstance(exc, _NOT_RETRIED)


def refused(exc: BaseException) -> bool:
    """Whether ``exc``, or an error that led to it, is a refused connection: the server was
    not reached, so the call sent nothing and may be made again without running twice
    (which a call whose reply was lost may have done). Over a unix socket a server that is
    down (stopped, restarting) has removed its socket file: a connect then finds no file
    (ENOENT) rather than a refusal, and sent nothing either. A server that answered it
    cannot serve the call now (``KeussConnectionError.ran_nothing``: a restarted one still
    loading its data, ...) did not run it either, nor was a call sent whose connection
    failed to open (``ran_nothing`` too: every address of a host name refusing, which
    asyncio reports as one ``OSError`` with no errno)."""
    seen: BaseException | None = exc
    for _ in range(16):  # a chain, not a cycle
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError | FileNotFoundError):
            return True
        if isinstance(seen, KeussConnectionError) and seen.ran_nothing:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def retry_backoff(failures: int) -> float:
    """Seconds to wait after ``failures`` (0, 1, ...) failures in a row: "equal jitter", half
    of the capped exponential step plus a random share of the other half, so retries spread
    out but never come back faster than half the step."""
    step = min(RETRY_CAP, math.ldexp(RETRY_FIRST, min(failures, 32)))
    return step / 2 + random.uniform(0, step / 2)


class Outage:
    """What one consumer (or one ``async for`` loop) knows about its backend's health.

    ``failed`` records a failed round trip and logs the start of an outage once; ``succeeded``
    ends it with one INFO line. ``generation`` counts recoveries: a round trip that began
    before the last recovery and fails after it is a straggler of the outage that ended
    (a command stuck on a connection that died), not the start of a new one.
    """

    __slots__ = (
        "_logged",
        "attempts",
        "failing",
        "generation",
        "last_error",
        "last_error_at",
        "queue",
        "since",
        "who",
    )

    def __init__(self, queue: str, who: str) -> None:
        self.queue = queue
        self.who = who
        self.failing = False
        self.generation = 0
        self.since: float | None = None
        self.attempts = 0
        self.last_error: Exception | None = None
        self.last_error_at: float | None = None
        self._logged: bool | None = None  # kind logged in this outage: connection error?

    def failed(self, exc: Exception, generation: int, doing: str) -> None:
        """Record a round trip begun at ``generation`` that failed; one not worth retrying
        (see :func:`retryable`) is raised again instead."""
        if not retryable(exc):
            raise exc
        self.last_error, self.last_error_at = exc, time.time()
        if not self.failing:
            if generation != self.generation:
                log.debug(
                    "queue %r: %s failed after the backend came back: %r", self.queue, doing, exc
                )
                return
            self.failing, self.since, self.attempts = True, time.monotonic(), 0
        self.attempts += 1
        unreachable = isinstance(exc, KeussConnectionError)
        if self._logged is unreachable:  # this outage is already in the log
            log.debug("queue %r: %s failed again: %r", self.queue, doing, exc)
            return
        self._logged = unreachable
        if unreachable:
            log.warning(
                "queue %r: %s cannot reach the backend (%s failed: %s); retrying with backoff",
                self.queue,
                self.who,
                doing,
                exc,
            )
        else:
            log.error(
                "queue %r: %s: the backend failed (%s: %r); retrying with backoff",
                self.queue,
                self.who,
                doing,
                exc,
                exc_info=exc,
            )

    def succeeded(self) -> None:
        """A round trip worked: an outage in progress is over (one INFO line)."""
        if not self.failing:
            return
        seconds = 0.0 if self.since is None else time.monotonic() - self.since
        log.info(
            "queue %r: %s reaches the backend again after %.1f s (%d failed attempts)",
            self.queue,
            self.who,
            seconds,
            self.attempts,
        )
        self.failing, self.since, self._logged = False, None, None
        self.generation += 1


class HandlerFailures:
    """Handler exceptions of one queue, logged with their traceback at WARNING at most once
    every ``every`` seconds; those in between are counted (each at DEBUG) and summarised in
    one WARNING line when the interval ends (or the consumer stops)."""

    def __init__(self, queue: str, every: float = TRACEBACK_EVERY) -> None:
        self.queue = queue
        self.every = every
        self._quiet_until = -math.inf
        self._suppressed = 0
        self._last = ""
        self._timer: asyncio.TimerHandle | None = None

    def report(self, message: Message, exc: Exception) -> None:
        now = time.monotonic()
        if now >= self._quiet_until:
            self.flush()
            self._quiet_until = now + self.every
            log.warning(
                "queue %r: handler failed on message %s (tries %d): %s",
                self.queue,
                message.id,
                message.tries,
                describe(exc),
                exc_info=exc,
            )
            return
        self._suppressed += 1
        self._last = f"{describe(exc)} on message {message.id} (tries {message.tries})"
        log.debug(
            "queue %r: handler failed on message %s (tries %d): %s",
            self.queue,
            message.id,
            message.tries,
            self._last,
        )
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._quiet_until - now, self.flush)

    def flush(self) -> None:
        """Log the summary of the failures not shown, if any."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._suppressed:
            log.warning(
                "queue %r: %d more handler failures (tracebacks not shown, at most one per "
                "%g s); the last: %s",
                self.queue,
                self._suppressed,
                self.every,
                self._last,
            )
            self._suppressed = 0


ACK_WAIT = 10.0
"""Longest a stop waits, past its grace, for acknowledgements already on their way (the ok
of a handler that returned, prefetched messages given back): a server that never answers
must not hold a stop for ever. What is cut short comes back when its reservation expires."""
ABANDON_WAIT = 5.0
"""Longest a stop waits for the workers it cancelled once ``ACK_WAIT`` is over: a handler
that swallows every cancellation (catches ``CancelledError`` and goes on) is then abandoned,
logged, instead of holding the stop, and the process, for ever (what a second Ctrl-C does to
uvicorn and Celery). Its messages are not given back: another consumer would take them while
it may still run; their reservations are extended while it runs in this process, and they
come back when those expire after it ended (or the process did)."""
OK_SENDERS = 2
"""Background ok round trips a consumer with prefetch keeps out at once: while one is
answered, the oks of the messages handled meanwhile go out together in the other."""

OK_ROOM = 2
"""Handled messages whose oks may be unanswered, per worker and prefetched message. With
one each, the workers of a consumer with short handlers waited for the ok round trips more
than for messages (3 workers, prefetch 10, no-op handler, interleaved: redis-oq 19,718 ->
23,608 msgs/s, client CPU 41.5 -> 30.6 us per message; redis-reliable 21,953 -> 27,965;
postgres within noise); three did no better than two. They are messages already handled:
a crash delivers them again, as it would any whose ok was lost."""


class Source(Protocol):
    """What a consumer needs of its queue. The queue hands its consumers a small link that
    offers just this, so a consumer never reaches into the queue's insides."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def reserve_delay(self) -> float:
        """Seconds a reservation lasts."""
        ...

    @property
    def paused(self) -> bool:
        """Whether the queue is paused, as this process knows it (see ``Queue.pause``)."""
        ...

    @property
    def keeps_results(self) -> bool:
        """Whether handlers' values and final failures are kept (a ``result_ttl``): fixed
        when the queue opens. Without, the consumer passes none, at no cost per message."""
        ...

    async def next(
        self,
        outage: Outage,
        n: int,
        gather: bool = False,
        kept: dict[str, Stored] | None = None,
        timeout: float | None = None,
    ) -> list[Message]:
        """The next 1 to ``n`` messages (reserved, or popped without reserve), riding out
        outages; none once the queue drains or closes, or ``timeout`` (seconds) passes.
        ``gather``: wait up to the queue's ``max_wait_time`` for ``n``. ``kept``: popped
        ones are noted there by id as the store handed them out, what a put-back of them
        needs."""

    def ok(self, message: Message, value: Any = ...) -> Awaitable[bool]:
        """``value``: what the handler returned, kept as the message's result where the
        queue keeps results (left out: nothing is kept)."""

    def ok_many(
        self, messages: list[Message], values: list[Any] | None = None
    ) -> Awaitable[list[bool]]:
        """``values``: one per message, kept as for :meth:`ok` (None: nothing is kept)."""

    def ko(
        self, message: Message, delay: float | None, failure: str | None = None
    ) -> Awaitable[KoResult]:
        """``failure``: why it failed, kept as its result where the queue keeps results
        and this ko ends it for good (None: nothing is kept)."""

    def keep(
        self, messages: list[Message], value: Any, failure: str | None
    ) -> Awaitable[None] | None:
        """Keep the result of popped messages (no ok carries it): ``value`` for each, or
        ``failure`` when it is not None and ``value`` is left out; None (nothing to await)
        where the queue keeps no results or there is nothing to keep."""

    def extend_many(self, messages: list[Message]) -> Awaitable[list[bool]]:
        """Extend these reservations by ``reserve_delay`` from now (see :mod:`.renewals`)."""

    def lost_since(self, taken: float) -> bool:
        """Where reservations do not expire one by one: whether those taken at ``taken``
        (``time.monotonic()``) may have been lost since, all at once (see
        ``Store.lost_since``)."""

    def release(self, messages: list[Message], *, unseen: bool = False) -> Awaitable[None]:
        """Give back reservations whose handler was cancelled, or that no handler started
        (``unseen``: not counted as reserved then), costing no try: in one call, so that
        the store can put them back in their order (several calls at once may run in any
        order)."""

    def put_back(
        self,
        messages: list[Message],
        kept: Mapping[str, Stored] | None = None,
        retry_for: float = 0.0,
    ) -> Awaitable[None]:
        """Put popped messages no handler started back in the queue (without reserve),
        keeping the end of life and place noted in ``kept`` (see :meth:`next`); tried
        again for up to ``retry_for`` seconds while the server refuses connections."""

    def rate_limited(self, messages: list[Message], seconds: object) -> Awaitable[bool]:
        """A handler raised ``RateLimited(seconds)``: hold the queue's deliveries in every
        process and give ``messages`` back at no try; False (nothing done) where the queue
        has no rate limit."""

    def handler_failed(self, message: Message, exc: Exception) -> None:
        """Log a handler's exception (rate-limited per queue)."""

    def stopped(self, consumer: Consumer) -> None:
        """The consumer has stopped: the queue no longer waits for it on close."""

    # cancelling (see aio_keuss.cancels)

    @property
    def hears_cancels(self) -> bool:
        """Whether messages of this queue can be cancelled while held (the backend keeps
        results, where the requests are left)."""
        ...

    @property
    def polls_cancels(self) -> bool:
        """Whether consumers also look the requests up while handlers run (a queue with
        ``result_ttl``: one without pays nothing)."""
        ...

    def subscribe_cancels(self, listener: Callable[[Signal], None]) -> Callable[[], None]:
        """Hear the "cancel" signals of the queue; returns the unsubscribe."""
        ...

    async def cancel_requests(self, ids: list[str]) -> list[str]:
        """Those of ``ids`` a cancel request names."""
        ...

    def cancelled(self, messages: list[Message], keep: bool) -> Awaitable[None]:
        """Messages stopped on request: their failure results kept (``keep``, where the
        queue keeps results), then ok-ed."""
        ...

    def use_up(self, ids: list[str], *, told_only: bool = False) -> Awaitable[list[str]]:
        """The requests of ``ids``, whose messages ended though their handlers were asked
        to stop, are used up (as those of messages stopped are, by :meth:`cancelled`);
        the ids whose request was. ``told_only``: a request heard of once its message was
        done, used up only where the store tells that no message of its id is in the queue
        (else it may be a later one's)."""
        ...


@dataclass(frozen=True, slots=True)
class ConsumerStatus:
    """A snapshot of a consumer, e.g. for a health endpoint."""

    queue: str
    state: State
    """"running", "reconnecting" (the backend fails; the workers retry by themselves) or
    "stopped" (stopped, or the queue closed)."""
    concurrency: int
    in_flight: int
    """Handlers running now."""
    handled: int
    """Messages whose handler returned."""
    failed: int
    """Handler exceptions and timeouts (each one a ko on a backend with reserve)."""
    timed_out: int
    """Handlers cancelled for running past the handler ``timeout``."""
    retried: int
    """Failed messages put back for another try."""
    deadlettered: int
    """Failed messages sent to the deadletter queue."""
    last_error: Exception | None
    """The last failed round trip to the backend (reserve, ok, ko), outage or not."""
    last_error_at: float | None
    """When it happened (seconds since the epoch)."""
    reconnecting_for: float | None
    """Seconds since the current outage began, or None."""
    extended: int = 0
    """Reservations of running handlers extended (see ``consume(renew=...)``)."""
    lapsed: int = 0
    """Reservations found lapsed and taken by another consumer while their handler ran
    (its message may be handled twice: raise ``reserve_delay``, or check why the extensions
    did not reach the backend in time)."""
    cancelled: int = 0
    """Messages cancelled (``Queue.cancel``) while this consumer held them: their handler
    stopped, or never started."""


def check_settings(
    concurrency: object = 1,
    retry_delay: object = 1.0,
    max_retry_delay: object = 60.0,
    timeout: object = None,
    prefetch: object = 0,
    batch: object = 0,
    *,
    settled: bool,
    max_batch: int | None,
) -> None:
    """Refuse, with :class:`InvalidInputError`, what ``consume`` (or a pipeline station, which
    is ``settled`` by its link) cannot run with: checked in full before anything starts, so
    a pipeline opens no queue and stores no topology for a setting it will refuse. The
    defaults are ``consume``'s, for a station that leaves a setting to them. ``max_batch``
    None: the queue is not known yet (a worker checks before it connects), and
    :func:`check_batch_bounds` checks the bounds once it is."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidInputError(f"concurrency must be a positive int, not {concurrency!r}")
    check_seconds(retry_delay, "retry_delay")  # they become ko delays: same bounds
    check_seconds(max_retry_delay, "max_retry_delay")
    if timeout is not None and check_seconds(timeout, "timeout") <= 0:
        raise InvalidDelayError(f"timeout must be > 0 seconds, not {timeout!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise InvalidInputError(f"prefetch must be an int >= 0, not {prefetch!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise InvalidInputError(f"batch must be an int >= 0, not {batch!r}")
    if batch and (prefetch or settled):
        raise InvalidInputError("batch cannot be combined with prefetch (nor in a pipeline)")
    if max_batch is not None:
        check_batch_bounds(prefetch, batch, max_batch)


def check_batch_bounds(prefetch: int, batch: int, max_batch: int) -> None:
    """Refuse a ``prefetch`` or ``batch`` (checked by :func:`check_settings`) above the
    queue's ``max_batch``: what one fetch may take."""
    if prefetch > max_batch:
        raise InvalidInputError(f"prefetch must be at most max_batch ({max_batch}), not {prefetch}")
    if batch > max_batch:
        raise InvalidInputError(f"batch must be at most max_batch ({max_batch}), not {batch}")


class StoppedOnExit:
    """``async with`` a background runner (a consumer, a repeater) stops it on the way out,
    however the block ends."""

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


class Consumer(StoppedOnExit):
    def __init__(
        self,
        queue: Source,
        handler: Handler | BatchHandler,
        concurrency: int,
        retry_delay: float,
        max_retry_delay: float,
        timeout: float | None = None,
        prefetch: int = 0,
        settle: Settle | None = None,
        batch: int = 0,
        renew: bool = True,
    ) -> None:
        if not callable(handler):
            raise InvalidInputError("handler must be callable")
        self._timeout = timeout
        self._prefetch = prefetch
        self._batch = batch
        self._settle = settle
        # prefetched messages, each with the monotonic time its reservation runs out; where
        # reservations do not expire one by one (``_lapses``), the time it was taken
        self._buffer: deque[tuple[Message, float]] = deque()
        # what the store handed out for the popped ones in the buffer (without reserve), by
        # id: a Message has neither the end of life nor the place their put-back keeps
        self._kept: dict[str, Stored] = {}
        self._fetching = asyncio.Lock()
        self._landed = asyncio.Event()  # set when the fetch out ends (a new one per fetch)
        self._fetch_unsent = False  # a fetch began in this loop iteration
        # With several workers, the next fetch starts once this few are left, not none, so
        # that its round trip runs while the others handle them (three workers with a no-op
        # handler on redis-oq: idle 31 % of the time, then 8 %; +15 % messages/s). Not with
        # more workers than the prefetch: the half left is gone at once, and fetches sized
        # for every waiting worker cost fewer round trips (32 workers: -4 % with it).
        self._refill_at = prefetch // 2 if 1 < concurrency <= prefetch else 0
        self._starving = 0  # workers that found the buffer empty and wait for a fetch
        # an early fetch found the queue empty: no other until the buffer runs dry (each
        # message left would cost a round trip that finds nothing)
        self._dry = False
        # With prefetch, oks are sent in the background, several to a round trip: handled
        # messages wait in ``_oks`` for one of at most OK_SENDERS sender tasks; at most
        # OK_ROOM * (concurrency + prefetch) are unanswered (queued or in flight) at a time.
        self._oks: list[Message] = []
        self._oks_out: list[list[Message]] = []  # the batches of oks in flight
        # the deliveries among ``_oks`` and ``_oks_out`` whose handler was asked to stop (and
        # went on), or that a request named once it had returned: their requests are used up
        # once their ok lands (see ``_use_up``); most of the time empty. Keyed by the
        # delivery (``id()`` of the Message, kept alive by the entry), not by the message's
        # id, as ``_late`` is: one consumer may have two oks of an id out (a lapsed
        # reservation delivered again as its ok was on its way), and the refused ok of the
        # older must not drop the newer's mark
        self._asked: dict[int, Message] = {}
        # ids a request named once their handler had ended, while their worker still
        # acknowledges them: used up once the message ends for good (an ok lands, a ko
        # deadletters it, or it was popped), forgotten by the worker after any other
        # outcome (the request stands for the next holder); most of the time empty.
        # By id, the delivery named: one consumer may hold an id twice (a lapsed reservation
        # delivered again as its ok was on its way), and each worker minds only its own
        self._late: dict[str, Message] = {}
        # the ids of the last messages taken (the bound of the heard ids): a request heard
        # of once one of them was done, and no longer held, was left as it ended (its ok or
        # ko landed between the cancel's second look and the signal), and nothing else
        # uses it up (see ``_finished_named``); one append a message
        self._took: deque[str] = deque(maxlen=MAX_HEARD)
        self._ok_values: list[Any] = []  # what each one's handler returned (its result)
        self._oks_unanswered = 0
        self._ok_limit = OK_ROOM * (concurrency + prefetch)
        self._ok_room: asyncio.Event | None = None
        self._ok_senders = 0
        self._acks: set[asyncio.Task[Any]] = set()  # the sender tasks
        # failed messages whose ko is held for the retry backoff (see ``_ko``): their worker
        # no longer holds them, so a cancel request heard meanwhile is noted here, and used
        # up if the ko deadletters; by delivery, as ``_asked``; most of the time empty
        self._ko_holds: set[_KoHold] = set()
        self.queue = queue
        self.concurrency = concurrency
        self._handler = handler
        self._retry_delay = retry_delay
        self._max_retry_delay = max_retry_delay
        self._reserve = queue.capabilities.reserve
        # reservations that do not expire one by one, but may all be lost at once (a
        # heartbeat that lapsed): a prefetched one is checked before its handler starts
        self._lapses = self._reserve and not queue.capabilities.reservation_expiry
        self._keeps = queue.keeps_results and settle is None  # (a station keeps none)
        self._stopping = False
        self._stop_asked = asyncio.Event()  # ends a backoff the worker waits itself
        # set once a stop has ended: every worker ended, or was abandoned (see ABANDON_WAIT)
        self._ended = asyncio.Event()
        self._stopper: asyncio.Task[None] | None = None  # a stop a handler asked for
        self._outliving: asyncio.Task[None] | None = None  # see _outlived
        self._waiting: set[asyncio.Task[None]] = set()
        # Workers running their handler: the only ones a stop past its grace cancels (one
        # whose handler returned finishes its ok / ko: cancelling it could drop the ok).
        self._handling: set[asyncio.Task[Any]] = set()
        self.busy: dict[str, Message] = {}
        """The messages whose handler runs (until acknowledged), by id: what a close of the
        queue by one of those handlers must not give back, and whose reservations are
        extended meanwhile (see :mod:`.renewals`)."""
        self._outage = Outage(queue.name, "consumer")
        self.failure: Exception | None = None
        """The error that stopped a worker (one not worth retrying, see ``retryable``)."""
        self._failed = asyncio.Event()
        self._in_flight = 0
        self.handled = 0
        self.failed = 0
        self.timed_out = 0
        self.retried = 0
        self.deadlettered = 0
        self.rate_limited = 0
        """Messages given back because their handler raised ``RateLimited``."""
        self.cancelled = 0
        """Messages stopped, or never started, because they were cancelled."""
        self._running: dict[asyncio.Task[Any], Message | list[Message]] = {}
        """What each worker task runs (or ran last: it is one to cancel only while in
        ``_handling``). One entry per worker, replaced for each message: no allocation per
        message where nobody cancels."""
        """The task running the handler of each message of ``busy``."""
        self.durations = Histogram()
        """Seconds each handler ran, whatever its outcome."""
        # Kept: on Python 3.11 asyncio.get_running_loop() costs a getpid() call.
        self._loop = loop = asyncio.get_running_loop()
        self._deadlines = None if timeout is None else Deadlines(loop, timeout)
        capabilities = queue.capabilities
        self._renewals: Renewals | None = None
        if renew and self._reserve and capabilities.extend and capabilities.reservation_expiry:
            self._renewals = Renewals(
                queue.name, queue.reserve_delay, queue.extend_many, loop, self.busy
            )
        self._cancels = self._watch_cancels()
        self._workers = [loop.create_task(self._run_worker()) for _ in range(concurrency)]

    @property
    def processed(self) -> int:
        """Former name of :attr:`handled`."""
        return self.handled

    @property
    def state(self) -> State:
        if self._stopping or all(task.done() for task in self._workers):
            return "stopped"
        return "reconnecting" if self._outage.failing else "running"

    @property
    def last_error(self) -> Exception | None:
        """The last failed round trip to the backend, kept after the outage ended."""
        return self._outage.last_error

    def status(self) -> ConsumerStatus:
        outage = self._outage
        return ConsumerStatus(
            queue=self.queue.name,
            state=self.state,
            concurrency=self.concurrency,
            in_flight=self._in_flight,
            handled=self.handled,
            failed=self.failed,
            timed_out=self.timed_out,
            retried=self.retried,
            deadlettered=self.deadlettered,
            last_error=outage.last_error,
            last_error_at=outage.last_error_at,
            reconnecting_for=None if outage.since is None else time.monotonic() - outage.since,
            extended=0 if self._renewals is None else self._renewals.extended,
            lapsed=0 if self._renewals is None else self._renewals.lapsed,
            cancelled=self.cancelled,
        )

    def metrics(self) -> QueueMetrics:
        """The counters and the handler duration histogram, e.g. for ``/metrics``."""
        return QueueMetrics(
            queue=self.queue.name,
            state=self.state,
            handled=self.handled,
            failed=self.failed,
            timed_out=self.timed_out,
            retried=self.retried,
            deadlettered=self.deadlettered,
            in_flight=self._in_flight,
            durations=self.durations,
            cancelled=self.cancelled,
        )

    @property
    def abandoned(self) -> bool:
        """Whether handlers a stop abandoned (they went on once cancelled) still run: their
        reservations are extended meanwhile, through the queue's connection, which must stay
        open for that (see :meth:`outlived`)."""
        return self._outliving is not None and not self._outliving.done()

    @property
    def stop_abandoned(self) -> bool:
        """Whether its stop abandoned handlers (they went on once cancelled), whether or not
        they still run: what a supervisor reports (the worker command's exit 70), which must
        not hang on whether they happened to end before it looked (:attr:`abandoned`)."""
        return self._outliving is not None

    async def outlived(self) -> None:
        """Until the handlers a stop abandoned have ended after all, their extensions
        stopped (at once if it abandoned none): then their queue can close. Their workers
        are waited for themselves, not only the task that waits for them: as the loop ends
        (``asyncio.run`` cancels every task left) that task is cancelled too, while the
        handlers may still run and give their messages back through the queue."""
        if self._outliving is not None:
            await asyncio.wait(self._workers)  # (a cancelled wait leaves them be)
            await asyncio.wait((self._outliving,))

    def runs_in(self, task: asyncio.Task[Any]) -> bool:
        """Whether ``task`` is one of this consumer's workers, the tasks its handlers run in
        (a stop or close they ask for cannot wait for them)."""
        return task in self._workers

    def stop_taking(self) -> None:
        """Start no more handlers: what a stop does first, for a close that begins the stop
        in a task of its own (a handler asked for it) to do at once, as ``stop`` would."""
        self._stopping = True

    async def wait(self) -> None:
        """Run until stopped (or the queue closes). Cancelling this wait leaves the
        workers running."""
        await self._end(None)

    async def _end(self, timeout: float | None) -> None:
        """Until every worker has ended, or a stop has (abandoning any left, see
        ``ABANDON_WAIT``), for ``timeout`` seconds at most."""
        every = asyncio.ensure_future(asyncio.wait(self._workers))
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait((every, ended), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            every.cancel()  # (not the workers: a cancelled asyncio.wait leaves them be)
            ended.cancel()

    async def wait_failure(self) -> Exception:
        """Wait until a worker stops on an error not worth retrying; returns that error
        (:attr:`failure`). A supervisor such as ``run_worker`` exits on it."""
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    async def stop(self, grace: float | None = 30.0) -> None:
        """Stop taking messages; wait ``grace`` seconds for running handlers, then cancel them
        (their messages go back at once); one that goes on once cancelled is abandoned after
        ``ABANDON_WAIT``, its message left reserved. Called by one of this consumer's own handlers,
        it cannot wait for that handler to end: it starts the stop and returns. ``grace``:
        seconds in [0, 1e9], or None to wait as long as the handlers run; anything else is
        refused (:class:`InvalidDelayError`) before the stop begins."""
        if grace is not None:
            grace = check_seconds(grace, "grace")
        if self._ended.is_set():
            return  # stopped already (leaving alone the handlers it abandoned, if any)
        if asyncio.current_task() in self._workers:
            self._stopping = True
            if self._stopper is None:
                self._stopper = self._loop.create_task(self.stop(grace))
            return
        self._stopping = True
        self._stop_asked.set()
        for task in self._waiting:  # waiting for a message: cancelling loses nothing
            task.cancel()
        if self._buffer:
            # prefetched, and no worker takes them now (a fetch reserves for every waiting
            # worker, just cancelled): back at once, not held through the grace
            giving_back = self._loop.create_task(self._give_back())
            self._acks.add(giving_back)  # _stopped waits for it
            giving_back.add_done_callback(self._acks.discard)
        try:
            await self._end(grace)
        except asyncio.CancelledError:
            # the caller is cancelled during the grace (a shutdown timeout, a second ^C):
            # stop at once rather than leave the workers unsupervised and the prefetched
            # messages held until their reservations expire
            if not self._ended.is_set():
                await asyncio.shield(self._stopped({t for t in self._workers if not t.done()}))
            raise
        if self._ended.is_set():
            return  # another stop (one with less grace) ended it meanwhile
        ending = asyncio.ensure_future(self._stopped({t for t in self._workers if not t.done()}))
        try:
            await asyncio.shield(ending)
        except asyncio.CancelledError:
            # cancelled as it gives back what it holds (a round trip per prefetched
            # message): it ends doing so, as when cancelled during the grace, else what it
            # had not given back yet stayed reserved until its reservation expired
            await asyncio.shield(ending)
            raise

    async def _stopped(self, late: set[asyncio.Task[None]]) -> None:
        """The end of a stop: cancel the workers still inside their handler, wait for every
        worker and acknowledgement, give back what was prefetched."""
        for task in late:
            if task in self._handling:
                task.cancel()
        abandoned = await self._workers_end()
        if abandoned:
            # they run on in this loop: their reservations are still extended while they do
            # (else another consumer took their messages meanwhile), and no longer once
            # they end, or the process does
            self._outliving = self._loop.create_task(self._outlived())
        elif self._renewals is not None:
            await self._renewals.close()
        if self._cancels is not None:
            await self._cancels.close()
        await _bounded(self._acks)
        try:
            async with asyncio.timeout(ACK_WAIT):
                await self._give_back()
        except TimeoutError:
            log.warning("queue %r: prefetched messages not given back in time", self.queue.name)
        if not abandoned:
            # else it stays known to its queue, whose close gives back what nobody
            # acknowledged but what it holds (``busy``)
            self.queue.stopped(self)
        self._ended.set()

    async def _outlived(self) -> None:
        """Once the workers a stop abandoned have ended after all: no more extensions."""
        await asyncio.wait(self._workers)
        if self._renewals is not None:
            await self._renewals.close()

    async def _workers_end(self) -> bool:
        """Wait ``ACK_WAIT`` seconds at most for the workers (the others are acknowledging
        what they handled), then cancel those left and wait ``ABANDON_WAIT`` more: those
        still running then are abandoned, logged with the messages they hold. Whether some
        were."""
        late = await _bounded(self._workers, ABANDON_WAIT)
        if not late:
            return False
        fate = (
            "left reserved, extended while these run"
            if self._reserve
            else "popped: lost unless their handlers end"
        )
        log.error(
            "queue %r: %d handlers went on after being cancelled; abandoned running, their "
            "messages %s (%s, not given back while these may still run)",
            self.queue.name,
            len(late),
            ", ".join(sorted(self.busy)) or "(none)",  # only theirs are left in it
            fate,
        )
        return True

    async def _give_back(self) -> None:
        """Give back what was prefetched and never started, at once, costing no try."""
        while self._buffer:
            if self._reserve:
                # one call for all: it gives the latest back first, as a release goes back
                # to its place only where nothing is held just behind it (sharded;
                # redis-reliable puts each at the head). One call each, awaited in turn,
                # cost a round trip per prefetched message on every stop
                held = [m for m, _ in self._buffer]
                self._buffer.clear()
                back = self.queue.release(held, unseen=True)
                await self._acknowledge_all("release", held, back)
            else:  # popped: put back in the queue, else they would be lost
                popped = [m for m, _ in self._buffer]
                self._buffer.clear()
                kept, self._kept = self._kept, {}
                # a stop during a server restart: tried again while it refuses connections
                # (nothing sent), within the stop's bound for acknowledgements
                back = self.queue.put_back(popped, kept, ACK_WAIT)
                await self._acknowledge_all("put back", popped, back)

    async def _run_worker(self) -> None:
        _IN_HANDLER.set(True)  # this task's own context: see in_handler
        try:
            await self._work()
        except asyncio.CancelledError:
            # Cancelled with no stop: only the loop ending does that (``asyncio.run``
            # cancels every task left, then runs the loop until they end; Python's asyncio
            # documentation, "Runners"). What was prefetched goes back now, in this task,
            # which that run waits for: popped messages would be lost, reservations held
            # until they expire. Every worker tries; the first takes them all.
            if not self._stopping and self._buffer:
                await self._give_back()
            raise

    async def _work(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        queue = self.queue
        while not self._stopping:
            self._waiting.add(task)
            try:
                message = await self._next()
            except asyncio.CancelledError:
                if self._stopping:
                    return
                raise
            except ClosedError:
                return
            except Exception as exc:  # not worth retrying (see ``retryable``): say so, loudly
                log.exception("queue %r: consumer worker stopped", queue.name)
                if self.failure is None:
                    self.failure = exc
                    self._failed.set()
                return
            finally:
                self._waiting.discard(task)
            if not message:  # only on drain or close, as there is no timeout
                return
            if self._cancels is not None:
                # rarely: most of the time no request is heard, and heard ones name others
                if self._cancels.heard_any and self._cancels.names_any(message):
                    message = await self._unless_cancelled(message)
                    if not message:
                        continue
                self._running[task] = message
                self._cancels.wake()
            self._in_flight += 1
            busy = self.busy
            first = message[0] if isinstance(message, list) else message
            if isinstance(message, list):
                busy.update((m.id, m) for m in message)
                self._took.extend(m.id for m in message)
            else:
                busy[message.id] = message
                self._took.append(message.id)
            renewals = self._renewals
            if renewals is not None and renewals.idle:
                renewals.wake()
            try:
                if isinstance(message, list):
                    await self._handle_batch(message)
                else:
                    await self._handle(message)
            except ClosedError:
                return
            except Exception:  # a bug of ours: logged, and the worker goes on
                log.exception("queue %r: consumer failed on message %s", queue.name, first.id)
            finally:
                self._in_flight -= 1
                # only its own entries: another worker may run a later delivery of the same
                # id (this one's reservation lapsed), whose entries must stay
                late = self._late  # named once its handler ended: used up on an ok, else stands
                if not isinstance(message, list):
                    if busy.get(message.id) is message:
                        del busy[message.id]
                    if late and late.get(message.id) is message:
                        del late[message.id]
                else:
                    for m in message:
                        if busy.get(m.id) is m:
                            del busy[m.id]
                        if late and late.get(m.id) is m:
                            del late[m.id]

    async def _next(self) -> Message | list[Message] | None:
        """A message to handle: from the prefetch buffer, else from the queue (with
        ``prefetch``, one worker at a time fetches for the others, the others waiting for
        what it brings); with ``batch``, a list. None once stopping, drained or closed."""
        if self._batch:
            return await self.queue.next(self._outage, self._batch, gather=True)
        if not self._prefetch:
            got = await self.queue.next(self._outage, 1)
            return got[0] if got else None
        buffer = self._buffer
        while True:
            if self._stopping:  # what is left in the buffer goes back (see stop)
                return None
            if buffer and self.queue.paused:
                # deliveries stop on a pause, those of what was prefetched too: given back
                # at once, costing no try (the fetch that follows waits for the resume);
                # out of the buffer already, so not cancelled with this wait (see below)
                await asyncio.shield(self._tracked(self._give_back()))
                continue
            if buffer and (len(buffer) > self._refill_at or self._fetching.locked() or self._dry):
                if self._fetch_unsent:
                    # a fetch was just started: its request goes out first (a handler that
                    # never awaits would hand out the rest before it left, and its round
                    # trip overlapped nothing); nothing is held across this wait, so a stop
                    # cancelling it loses nothing
                    await asyncio.sleep(0)
                    continue
            elif self._fetching.locked():  # a fetch is out: wait for what it brings
                self._starving += 1
                try:
                    await self._landed.wait()
                finally:
                    self._starving -= 1
                continue
            else:  # this worker fetches, for itself and every worker waiting
                starving = not buffer
                await self._fetch(starving)
                if starving and not buffer:
                    return None  # only on drain or close, as there is no timeout
                continue
            message, until = buffer.popleft()
            self._kept.pop(message.id, None)  # handed to a worker: no longer ours to give back
            if self._lapses:
                if not self.queue.lost_since(until):  # (``until``: when it was taken)
                    return message
            elif time.monotonic() < until:
                return message
            # most of its reservation ran out while it waited here (all of it, and another
            # consumer may be handling it already), or all may have been lost at once: give
            # it back, costing no try (refused if someone else holds it now), rather than
            # start a handler it may outlive, or one beside another consumer's. Those behind
            # it that are past it too go with it, in one call (the buffer is in the order
            # they were taken): one release each, awaited in turn, cost a round trip per
            # prefetched message before this worker handled anything again
            late = [message]
            while buffer and self._stale(buffer[0][1]):
                late.append(buffer.popleft()[0])
                self._kept.pop(late[-1].id, None)
            log.debug(
                "queue %r: %d prefetched messages waited too long, like %s",
                self.queue.name,
                len(late),
                message.id,
            )
            # out of the buffer already: a stop cancelling this wait must not cancel it,
            # and waits for it (see _stopped), as for the other give-backs: left unowned,
            # it could still be out as the queue's close gave the same reservation back
            await asyncio.shield(
                self._tracked(
                    self._acknowledge_all("release", late, self.queue.release(late, unseen=True))
                )
            )

    def _stale(self, until: float) -> bool:
        """Whether a prefetched message with this ``until`` (see ``_buffer``) is to be given
        back rather than started."""
        if self._lapses:
            return self.queue.lost_since(until)
        return time.monotonic() >= until

    async def _fetch(self, starving: bool) -> None:
        """Fill the prefetch buffer: when it ran dry, or early (``starving`` False), once no
        more than ``_refill_at`` are left, so that the round trip runs while the other
        workers handle those (waiting for it with nothing to do, three workers with
        short handlers were idle about 30 % of the time on redis-oq). An early one takes
        only what is ready: waiting for a push, it kept its worker from the messages still
        buffered (those wait for a push too while the other workers run long handlers), and
        from seeing a pause."""
        if starving:
            self._starving += 1
        try:
            async with self._fetching:  # free: taken without a wait (see _next)
                self._fetch_unsent = True
                # cleared on the next iteration: a worker that yields to it (see _next)
                # resumes behind what the fetch schedules now (its write, its batch task)
                self._loop.call_soon(self._fetch_sent)
                try:
                    kept = None if self._reserve else self._kept
                    taken = time.monotonic()
                    got = await self.queue.next(
                        self._outage, self._want(), kept=kept, timeout=None if starving else 0.0
                    )
                finally:
                    landed, self._landed = self._landed, asyncio.Event()
                    landed.set()
                until = math.inf  # handed out while at least half is left
                if self._lapses:
                    until = taken
                elif self._reserve and self.queue.capabilities.reservation_expiry:
                    until = time.monotonic() + self.queue.reserve_delay / 2
                self._buffer.extend((message, until) for message in got)
                self._dry = not starving and not got
        finally:
            if starving:
                self._starving -= 1

    def _fetch_sent(self) -> None:
        self._fetch_unsent = False

    def _tracked(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        """``work`` in a task of its own that a stop waits for (``_acks``)."""
        task = self._loop.create_task(_awaited(work))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)
        return task

    def _want(self) -> int:
        """How many one fetch reserves: one for each worker waiting for it (the fetcher
        included when it found the buffer empty), plus the prefetch. With one message more
        than the prefetch per fetch, many workers with short handlers were fed ``prefetch +
        1`` messages a round trip, one round trip at a time, and spent their time waiting
        for it (32 workers, prefetch 10: no faster than 3 workers)."""
        return self._starving + self._prefetch

    def _in_handler(self) -> _HandlerScope:
        """While a handler runs: its worker is one a stop past its grace cancels, and a
        ``CancelledError`` the handler raises unasked is a failure, not a stop."""
        return _HandlerScope(self._handling, self._loop)

    async def _handle(self, message: Message) -> None:
        started = time.monotonic()
        deadline: Limit | None = None
        try:
            with self._in_handler() as task:
                result = cast(Handler, self._handler)(message)
                if inspect.isawaitable(result):
                    if self._deadlines is None:
                        result = await result
                    else:
                        deadline = self._deadlines.start(task)
                        result = await self._deadlines.watch(deadline, result)
        except asyncio.CancelledError:
            if await self._stopped_on_request(task, [message], started):
                return
            self._ran(started, "cancelled")
            if self._reserve:
                await asyncio.shield(
                    self._acknowledge("release", message, self.queue.release([message]))
                )
            else:
                await asyncio.shield(self._cut_short([message]))
            raise
        except Exception as exc:
            if await self._stopped_on_request(task, [message], started):
                return
            if isinstance(exc, RateLimited) and await self._held_back([message], exc, started):
                return
            failure = self._failure(exc, deadline, started)
            self.failed += 1
            self.queue.handler_failed(message, failure)
            if self._reserve:
                await self._ko(message, failure)
                return
            if self._keeps:
                await self._keep_popped([message], failure=self._failure_text(failure))
            # popped: gone for good, as after a return (a request heard meanwhile: used up)
            late = self._late
            if late and late.get(message.id) is message:
                await self._use_up([message])
            return
        # asked, but it finished: its outcome stands, and the request is used up after it
        # (as one that named it while its ok was on its way: ``_late``)
        asked = None if self._cancels is None else self._cancels.taken(task)
        self._ran(started, "ok")
        self.handled += 1
        late = self._late
        if self._settle is not None:
            settled = await self._acknowledge("settle", message, self._settle(message, result))
            done = settled is not None and settled is not False
            if done and (asked is not None or (late and late.get(message.id) is message)):
                await self._use_up([message])
        elif self._reserve and self._prefetch:
            if asked is not None:
                self._asked[id(message)] = message
            await self._ok_later(message, result)
            if late and late.get(message.id) is message:  # named as it waited for room: queued now
                self._asked[id(message)] = message
        elif self._reserve:
            ok = self.queue.ok(message, result) if self._keeps else self.queue.ok(message)
            done = await self._acknowledge("ok", message, ok)
            if done and (asked is not None or (late and late.get(message.id) is message)):
                await self._use_up([message])
        else:
            if self._keeps:
                await self._keep_popped([message], result)
            # popped: gone for good
            if asked is not None or (late and late.get(message.id) is message):
                await self._use_up([message])

    async def _keep_popped(
        self, messages: list[Message], value: Any = NO_RESULT, failure: str | None = None
    ) -> None:
        """Popped messages (a backend without reserve) have no ok to carry their result:
        kept on their own, where the queue keeps results (a failure logged as an outage's)."""
        work = self.queue.keep(messages, value, failure)
        if work is not None:
            with contextlib.suppress(ClosedError):
                await self._acknowledge_all("keep", messages, work)

    async def _cut_short(self, messages: list[Message]) -> None:
        """Popped messages whose handler a stop cancelled: gone for good, so their waiters
        are told (where the queue keeps results), and the requests that named them once
        their handler had ended (heard as the failure was on its way) are used up, as after
        a handler that returned or failed: nothing else would."""
        if self._keeps:
            await self._keep_popped(messages, failure=CUT_SHORT)
        if self._late:
            named = self._named(None, messages)
            await self._use_up([m for m in messages if m.id in named])

    async def _ok_later(self, message: Message, value: Any) -> None:
        """Queue the ok of a handled message for a sender task (no task per message: oks
        handled while a round trip is out share the next one)."""
        while self._oks_unanswered >= self._ok_limit:
            if self._ok_room is None:
                self._ok_room = asyncio.Event()
            await self._ok_room.wait()
        self._oks.append(message)
        if self._keeps:
            self._ok_values.append(value)
        self._oks_unanswered += 1
        if self._ok_senders < OK_SENDERS:
            self._ok_senders += 1
            sender = self._loop.create_task(self._send_oks())
            self._acks.add(sender)
            sender.add_done_callback(self._acks.discard)

    async def _send_oks(self) -> None:
        out = self._oks_out
        try:
            while self._oks:
                batch, self._oks = self._oks, []
                out.append(batch)
                values = None
                if self._keeps:
                    values, self._ok_values = self._ok_values, []
                flags: list[bool] | None = None
                try:
                    # closed under them (by a handler of this consumer): they come back when
                    # their reservations expire; a ClosedError here was never retrieved
                    with contextlib.suppress(ClosedError):
                        ok = self.queue.ok_many(batch, values)
                        flags = await self._acknowledge_all("ok", batch, ok)
                finally:
                    del out[next(i for i, b in enumerate(out) if b is batch)]
                    self._oks_unanswered -= len(batch)
                    room = self._ok_room
                    if room is not None and self._oks_unanswered < self._ok_limit:
                        self._ok_room = None
                        room.set()
                if self._asked:
                    await self._use_up_asked(batch, flags)
        finally:
            self._ok_senders -= 1

    def _failure(self, exc: Exception, deadline: Limit | None, started: float) -> Exception:
        """What a handler's exception is logged as: past its timeout, a HandlerTimeoutError
        (its duration recorded with that outcome)."""
        if deadline is None or not deadline.expired:
            self._ran(started, "error")
            return exc
        self._ran(started, "timeout")
        self.timed_out += 1
        failure = HandlerTimeoutError(f"handler ran past its timeout of {self._timeout} s")
        failure.__cause__ = exc
        return failure

    def _failure_text(self, failure: Exception) -> str | None:
        """What a failure result keeps of a handler's last exception (``"ExcType:
        message"``, bounded); None where none is kept (a pipeline station's queue keeps no
        results of its own)."""
        return exception_text(failure) if self._keeps else None

    async def _ko(self, message: Message, failure: Exception) -> None:
        """ko after a failure, with capped exponential backoff by the message's tries. A
        backend without delays (redis-reliable) would hand a failing message straight back,
        so that a poison message spun at full speed: there the message is held for the
        backoff (at most half its reservation, less if asked to stop) by a task of its own,
        which then ko-es it, while the worker goes on with other messages."""
        backoff = self._retry_delay * 2.0 ** min(message.tries, 64)  # no overflow
        delay = min(backoff, self._max_retry_delay)
        queue = self.queue
        text = self._failure_text(failure)
        if queue.capabilities.delay:
            await self._ko_landed(message, queue.ko(message, delay, text))
            return
        hold = min(delay, queue.reserve_delay / 2)
        if hold <= 0 or self._stopping:
            await self._ko_landed(message, queue.ko(message, None, text))
            return
        # named once its handler failed (a RateLimited not applied awaited): its worker
        # forgets that as it ends, the hold keeps it
        late = self._late
        kept = _KoHold(message, bool(late) and late.get(message.id) is message)
        holds = self._ko_holds
        holds.add(kept)  # now: a cancel heard before the task first runs finds it
        later = self._loop.create_task(self._ko_after(kept, hold, text))
        self._acks.add(later)  # stop waits for them, and ends their wait
        later.add_done_callback(self._acks.discard)
        later.add_done_callback(lambda _: holds.discard(kept))  # (cancelled unstarted too)

    async def _ko_after(self, kept: _KoHold, hold: float, text: str | None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_asked.wait(), hold)
        with contextlib.suppress(ClosedError):  # as for the oks of _send_oks
            await self._ko_landed(kept.message, self.queue.ko(kept.message, None, text), kept)

    async def _ko_landed(
        self, message: Message, ko: Awaitable[KoResult], kept: _KoHold | None = None
    ) -> None:
        """A ko, counted. One that deadletters the message ends it here for good, as an ok
        does: a request that named it once its handler had failed (``_late``, or noted on
        its hold, ``kept``) is used up then, as nothing else would (the cancel saw it still
        held). Rolled back, the request stands for its next holder."""
        outcome = await self._acknowledge("ko", message, ko)
        self._count(outcome)
        if outcome == KoResult.DEADLETTERED:
            named = self._late.get(message.id) is message if kept is None else kept.named
            if named:
                await self._use_up([message])

    def _count(self, outcome: Any) -> None:
        if outcome == KoResult.DEADLETTERED:
            self.deadlettered += 1
        elif outcome == KoResult.ROLLED_BACK:
            self.retried += 1

    async def _handle_batch(self, messages: list[Message]) -> None:
        """A batch handler's messages share its outcome: all ok-ed when it returns, all
        ko-ed (each with its own backoff) when it raises, all given back when cancelled."""
        started = time.monotonic()
        deadline: Limit | None = None
        try:
            with self._in_handler() as task:
                # a copy: what the handler does to its list (takes messages off it) must not
                # change which messages are acknowledged
                result = cast(BatchHandler, self._handler)(list(messages))
                if inspect.isawaitable(result):
                    if self._deadlines is None:
                        result = await result
                    else:
                        deadline = self._deadlines.start(task)
                        result = await self._deadlines.watch(deadline, result)
        except asyncio.CancelledError:
            if await self._stopped_on_request(task, messages, started):
                return
            self._ran(started, "cancelled")
            if self._reserve:
                # one call: released one each at once, in any order, a sharded queue's
                # messages of one key could go back behind the key's later ones
                await asyncio.shield(
                    self._acknowledge_all("release", messages, self.queue.release(messages))
                )
            else:
                await asyncio.shield(self._cut_short(messages))
            raise
        except Exception as exc:
            if await self._stopped_on_request(task, messages, started):
                return
            if isinstance(exc, RateLimited) and await self._held_back(messages, exc, started):
                return
            failure = self._failure(exc, deadline, started)
            self.failed += len(messages)
            self.queue.handler_failed(messages[0], failure)
            if self._reserve:
                await asyncio.gather(*(self._ko(m, failure) for m in messages))
                return
            if self._keeps:
                await self._keep_popped(messages, failure=self._failure_text(failure))
            if self._late:  # popped: gone for good, as after a return
                named = self._named(None, messages)
                await self._use_up([m for m in messages if m.id in named])
            return
        # asked, but it finished: its outcome stands, and the requests are used up after it
        # (as those that named one while the oks were on their way: ``_late``)
        asked = None if self._cancels is None else self._cancels.taken(task)
        self._ran(started, "ok")
        self.handled += len(messages)
        if self._reserve:
            # the one return value is each message's result
            values = [result] * len(messages) if self._keeps else None
            ok = self.queue.ok_many(messages, values)
            flags = await self._acknowledge_all("ok", messages, ok)
            if flags and (asked is not None or self._late):
                named = self._named(asked, messages)
                done = zip(messages, flags, strict=True)
                await self._use_up([m for m, ok in done if ok and m.id in named])
        else:
            if self._keeps:
                await self._keep_popped(messages, result)
            if asked is not None or self._late:  # popped: gone for good
                named = self._named(asked, messages)
                await self._use_up([m for m in messages if m.id in named])

    def _named(self, asked: list[str] | None, messages: list[Message]) -> set[str]:
        """The ids whose request is to be used up once a batch's handler ended and its
        messages ended for good: those that asked it to stop as it ran (``asked``), and
        those named once it had ended."""
        late = self._late
        named = {m.id for m in messages if late.get(m.id) is m}
        return named if asked is None else named.union(asked)

    async def _held_back(self, messages: list[Message], exc: RateLimited, started: float) -> bool:
        """A handler's ``RateLimited``: the queue's deliveries held, its messages given back
        at no try (not a failure: no ko, no backoff). False where that could not be done
        (no rate limit on the queue, bad seconds, the limiter unreachable): the handler's
        exception is then a failure as any other."""
        try:
            held = await self.queue.rate_limited(messages, exc.seconds)
        except Exception as failure:
            log.warning("queue %r: RateLimited not applied: %r", self.queue.name, failure)
            return False
        if held:
            self._ran(started, "rate_limited")
            self.rate_limited += len(messages)
        return held

    def _ran(self, started: float, outcome: str) -> None:
        """A handler ended (``ok``, ``error``, ``timeout`` or ``cancelled``): its duration."""
        seconds = time.monotonic() - started
        self.durations.observe(seconds)
        if observe.active is not None:
            observe.active.handled(self.queue.name, seconds, outcome)

    def _acknowledge(self, doing: str, message: Message, work: Awaitable[Any]) -> Awaitable[Any]:
        return self._acknowledge_all(doing, [message], work)

    async def _acknowledge_all(
        self, doing: str, messages: list[Message], work: Awaitable[Any]
    ) -> Any:
        """ok / ko / release after the handler ran: a failure is logged (as part of an outage)
        and the worker goes on; the messages come back when their reservations expire."""
        outage = self._outage
        generation = outage.generation
        try:
            return await work
        except Exception as exc:
            many = len(messages) > 1
            what = f"{len(messages)} messages" if many else f"message {messages[0].id}"
            outage.failed(exc, generation, f"{doing} of {what}")
            return None

    # cancelling (see aio_keuss.cancels) ---------------------------------------------------

    def _watch_cancels(self) -> CancelWatch | None:
        """What hears the cancel requests of the queue, where its messages can be cancelled
        while held; looking them up while handlers run too on a queue with ``result_ttl``."""
        queue = self.queue
        if not queue.hears_cancels:
            return None
        delay = queue.reserve_delay
        return CancelWatch(
            queue.name,
            queue.subscribe_cancels,
            queue.cancel_requests,
            self._held_ids,
            self._on_cancel,
            delay * POLL_SHARE if queue.polls_cancels else None,
            request_ttl(delay),
        )

    def _held_ids(self) -> list[str]:
        """The ids of the messages this consumer holds: running, prefetched, and failed
        with their ko held for the retry backoff."""
        return [
            *self.busy,
            *(m.id for m, _ in self._buffer),
            *(kept.message.id for kept in self._ko_holds),
        ]

    def _on_cancel(self, ids: Sequence[str]) -> None:
        """Stop what this consumer holds of ``ids``: a running handler's task is cancelled
        (its worker then ok-s the message, see ``_stopped_on_request``); a prefetched message
        is ok-ed without running. One whose handler returned is not stopped: where its ok is
        on its way (sent, queued, or to be sent by its worker), the request is used up once
        the ok lands, as nothing else would (the cancel saw the message still held); where
        its handler failed, once its ko deadletters it (held for the retry backoff too)."""
        watch = self._cancels
        assert watch is not None
        named = set(ids)
        busy = self.busy
        for task, running in self._running.items():
            batch = running if isinstance(running, list) else (running,)
            stop = [m.id for m in batch if m.id in named]
            if not stop:
                continue
            if task in self._handling:
                watch.cancel(task, stop)
            else:  # its handler ended; still busy: its worker acknowledges it (see _late)
                self._late.update((m.id, m) for m in batch if m.id in named and busy.get(m.id) is m)
        for kept in self._ko_holds:  # failed, their ko held for the retry backoff
            if kept.message.id in named:
                kept.named = True
        if self._oks_unanswered:  # handled, their oks queued or in flight (prefetch)
            for oks in (self._oks, *self._oks_out):
                self._asked.update((id(m), m) for m in oks if m.id in named)
        buffer = self._buffer
        if any(m.id in named for m, _ in buffer):
            unstarted = [m for m, _ in buffer if m.id in named]
            left = [(m, until) for m, until in buffer if m.id not in named]
            buffer.clear()  # in place: a worker waiting in ``_next`` holds it
            buffer.extend(left)
            for m in unstarted:
                self._kept.pop(m.id, None)
            self._tracked(self._settle_cancelled(unstarted))
        if self._took:
            self._finished_named(named)

    def _finished_named(self, named: set[str]) -> None:
        """Of the ids a request named, those this consumer took and holds no more in any
        way: their message ended here (or was given back, or its reservation lapsed). One
        whose ok or deadlettering ko landed after the cancel's second look, with the signal
        still on its way, ended with its request standing, which nothing else uses up: its
        request is used up where the store tells that no message of its id is in the queue
        any more (see ``Queue._use_up_requests``), so a later push of the id is not
        stopped. Given back or lapsed, the message is still in the queue: left alone."""
        held = set(self._held_ids())
        if self._oks_unanswered:
            held.update(m.id for oks in (self._oks, *self._oks_out) for m in oks)
        gone = named.difference(held)
        if gone:
            gone.intersection_update(self._took)
        if gone:
            self._tracked(self._use_up_finished(sorted(gone)))

    async def _use_up_finished(self, ids: list[str]) -> None:
        """:meth:`_finished_named`'s use-up; a failure leaves the requests standing, as
        they were (they lapse in their time)."""
        try:
            used = await self.queue.use_up(ids, told_only=True)
        except ClosedError:
            return
        except Exception as exc:
            log.debug("queue %r: cancel requests not used up: %r", self.queue.name, exc)
            return
        if used and self._cancels is not None:
            self._cancels.forget(used)

    async def _unless_cancelled(
        self, message: Message | list[Message]
    ) -> Message | list[Message] | None:
        """What is left to run of what a worker took, once the messages a request heard of
        named are ok-ed unstarted. Heard of is a hint: the requests are looked up first, as
        one may have been used up since (its message stopped by another holder, then its
        id pushed again past its ``dedup_window``: a new message); an outage trusts it."""
        watch = self._cancels
        assert watch is not None
        batch = message if isinstance(message, list) else [message]
        asked = [m.id for m in batch if watch.asked(m.id)]
        if not asked:
            return message
        heard = watch.marks(asked)
        try:
            standing = set(await self.queue.cancel_requests(asked))
        except Exception as exc:
            log.debug("queue %r: cancel requests not looked up: %r", self.queue.name, exc)
            standing = set(asked)
        # heard of again during the look (a request it may have missed): it stands; one
        # forgotten meanwhile (expired, or used up) was not heard again: the look tells
        standing.update(
            i
            for i, mark in zip(asked, heard, strict=True)
            if (again := watch.mark(i)) is not None and again != mark
        )
        watch.forget(i for i in asked if i not in standing)
        if not standing:
            return message
        self._tracked(self._settle_cancelled([m for m in batch if m.id in standing]))
        batch = [m for m in batch if m.id not in standing]
        if not batch:
            return None
        return batch if isinstance(message, list) else batch[0]

    async def _settle_cancelled(self, messages: list[Message]) -> None:
        """ok messages stopped on request, keeping their failure results (not a pipeline
        station's: its queue's results are not its own to keep)."""
        self.cancelled += len(messages)
        if self._cancels is not None:  # done with: a later push of the id is a new message
            self._cancels.forget(m.id for m in messages)
        with contextlib.suppress(ClosedError):
            cancelled = self.queue.cancelled(messages, self._settle is None)
            await self._acknowledge_all("ok", messages, cancelled)

    async def _use_up_asked(self, batch: list[Message], flags: list[bool] | None) -> None:
        """The oks of ``batch`` landed (``flags``; None: not sent): the requests of those
        whose handler was asked to stop, or that a request named once it had returned, are
        used up, where the ok was taken (refused, the request stands for the next holder).
        Each delivery's ok answers for its own mark only (see ``_asked``)."""
        asked, done = self._asked, []
        for index, message in enumerate(batch):
            if asked.pop(id(message), None) is not None and flags is not None and flags[index]:
                done.append(message)
        await self._use_up(done)

    async def _use_up(self, messages: list[Message]) -> None:
        """Messages ended (ok-ed) though their handler was asked to stop (it shielded itself
        from the cancellation, or swallowed it): the requests that asked are used up, as
        those of messages stopped are (see ``Source.cancelled``). Left, one would stop a
        later push of the id (past its ``dedup_window``) for as long as it lives. Where the
        ok was refused, the request stands, for the message's next holder to honour."""
        if not messages:
            return
        if self._cancels is not None:  # done with: a later push of the id is a new message
            self._cancels.forget(m.id for m in messages)
        with contextlib.suppress(ClosedError):
            use_up = self.queue.use_up([m.id for m in messages])
            await self._acknowledge_all("cancel request use-up", messages, use_up)

    async def _stopped_on_request(
        self, task: asyncio.Task[Any], messages: list[Message], started: float
    ) -> bool:
        """Whether a handler ended (raised) because a cancel request cancelled its task:
        then the messages named are ok-ed, done for good, and the rest of a batch given back
        at no try. A stop asked meanwhile still stops the worker (CancelledError)."""
        named = None if self._cancels is None else self._cancels.taken(task)
        if named is None:
            return False
        self._ran(started, "cancelled")
        stopped = [m for m in messages if m.id in named]
        others = [m for m in messages if m.id not in named]
        work: list[Awaitable[Any]] = [self._settle_cancelled(stopped)]
        if others:
            back = self.queue.release(others) if self._reserve else self.queue.put_back(others)
            work.append(self._acknowledge_all("release", others, back))
        await asyncio.shield(asyncio.gather(*work))
        if task.cancelling():
            raise asyncio.CancelledError
        return True
