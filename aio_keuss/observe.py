"""Per-queue metrics of this process, kept only while someone asked for them.

Nothing is counted until :func:`enable` is called (the worker does it when it serves
``/metrics``; :func:`aio_keuss.enable_opentelemetry` does it too). Until then the only cost
on the hot path is one test of the module attribute :data:`active` where the queue layer
counts an event (its stats store's ``incr``, a delivery, a move, a handler's end).

Counters come from the same events as ``q.stats()``, but only this process's, and from the
moment metrics were enabled: ``pushed`` (put: pushes, and arrivals by move or deadletter),
``delivered`` (get and reserve), ``acked`` (commit, moves out included), ``nacked``
(rollback), ``deadlettered`` and ``moved`` (moved out to another queue). Delivery latency
is the time from when a message became deliverable (pushed, or its delay, retry backoff or
expired reservation ended; the store's clock, which is the server's for PostgreSQL) to when
it was handed out. Queue sizes are read with ``q.sizes()`` when they are asked for, and kept
for :data:`SIZES_MAX_AGE` seconds so that scrapers do not each cost a round trip per queue.

Labels are queue names only: two factories of one process opening queues of the same name
add to the same series.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from .metrics import DURATION_BUCKETS, Histogram, QueueSeries, queue_text

if TYPE_CHECKING:
    from .contract import Stored
    from .types import Sizes

log = logging.getLogger("aio_keuss.observe")

LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
"""Upper bounds (seconds) of the delivery latency histogram: from a millisecond (a consumer
waiting on a local server) to minutes (a backlog)."""

SIZES_MAX_AGE = 1.0
"""Seconds queue sizes read for one scrape serve the next ones."""
SIZES_TIMEOUT = 5.0
"""Longest wait for one queue's sizes; a queue whose server does not answer is left out."""


class SizedQueue(Protocol):
    @property
    def name(self) -> str: ...

    def sizes(self) -> Awaitable[Sizes]: ...


class QueueSource(Protocol):
    """What a factory offers the registry: the queues it has open now."""

    def open_queues(self) -> Sequence[SizedQueue]: ...


class Sink(Protocol):
    """An exporter fed with every observation as it happens (OpenTelemetry histograms)."""

    def latency(self, queue: str, seconds: Sequence[float]) -> None: ...

    def handled(self, queue: str, seconds: float, outcome: str) -> None: ...


_factories: weakref.WeakKeyDictionary[Any, asyncio.AbstractEventLoop] = weakref.WeakKeyDictionary()
_factories_lock = threading.Lock()


def track(factory: QueueSource) -> None:
    """Remember a factory (weakly) and its event loop, to read its queues' sizes."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # built by hand outside a loop: its sizes cannot be read
        return
    with _factories_lock:
        _factories[factory] = loop


def _tracked() -> dict[asyncio.AbstractEventLoop, list[QueueSource]]:
    """Open factories by event loop, left out where the loop is closed or not running: it
    would never answer a read of sizes, and every scrape would wait for it to time out."""
    by_loop: dict[asyncio.AbstractEventLoop, list[QueueSource]] = {}
    with _factories_lock:
        for factory, loop in _factories.items():
            if loop.is_running() and not loop.is_closed() and factory.open_queues():
                by_loop.setdefault(loop, []).append(factory)
    return by_loop


class Registry:
    """Every queue's series in this process, read by the Prometheus text and OpenTelemetry."""

    def __init__(self) -> None:
        self.series: dict[str, QueueSeries] = {}
        self.sinks: list[Sink] = []
        self._sizes: dict[asyncio.AbstractEventLoop, dict[str, Sizes]] = {}
        self._sizes_at = -float("inf")
        self._refreshing: dict[asyncio.AbstractEventLoop, Future[None]] = {}
        self._lock = threading.Lock()

    def queue(self, name: str) -> QueueSeries:
        found = self.series.get(name)
        if found is None:  # setdefault: two event loop threads never make two
            new = QueueSeries(name, Histogram(LATENCY_BUCKETS), Histogram(DURATION_BUCKETS))
            found = self.series.setdefault(name, new)
        return found

    # what the queue layer reports ---------------------------------------------------

    def count(self, queue: str, counter: str, n: int) -> None:
        """An event of ``q.stats()`` (put, get, reserve, ...), or ``move``. No lock, though
        two event loop threads (the blocking API's beside the application's) may count into
        one series: an update is one step under the GIL (nothing between reading the count
        and storing it back lets another thread run), as is a histogram's after its bucket
        is found. A build without the GIL would need one here and in :meth:`delivered` and
        :meth:`handled`."""
        if n:
            series = self.series.get(queue) or self.queue(queue)
            series.counts[counter] += n

    def delivered(self, queue: str, stored: Iterable[Stored]) -> None:
        now = time.time()
        observe = (self.series.get(queue) or self.queue(queue)).latency.observe
        if not self.sinks:
            for s in stored:
                observe(now - s.mature if now > s.mature else 0.0)
            return
        waited = [now - s.mature if now > s.mature else 0.0 for s in stored]
        for seconds in waited:
            observe(seconds)
        for sink in self.sinks:
            sink.latency(queue, waited)

    def handled(self, queue: str, seconds: float, outcome: str) -> None:
        """A handler ended: ``ok`` (returned), ``error``, ``timeout``, ``cancelled`` or
        ``rate_limited`` (it raised ``RateLimited``)."""
        self.queue(queue).handlers.observe(seconds)
        for sink in self.sinks:
            sink.handled(queue, seconds, outcome)

    # sizes ----------------------------------------------------------------------------

    async def refresh_sizes(self, max_age: float = SIZES_MAX_AGE) -> dict[str, Sizes]:
        """Read every open queue's sizes unless the last read is younger than ``max_age``
        (on the loop of each factory: the blocking API runs its own)."""
        if time.monotonic() - self._sizes_at >= max_age:
            waits = [asyncio.wrap_future(f) for f in self.request_sizes()]
            if waits:  # a loop that stopped running never answers: bounded
                done, _ = await asyncio.wait(waits, timeout=SIZES_TIMEOUT + 1.0)
                for read in done:
                    if not read.cancelled() and read.exception() is not None:
                        log.warning("reading queue sizes failed: %r", read.exception())
        return self._merged_sizes()

    def request_sizes(self) -> list[Future[None]]:
        """Start a read of the sizes on every tracked factory's loop (from any thread;
        OpenTelemetry collects on its own thread). One read at a time per loop."""
        by_loop = _tracked()
        started: list[Future[None]] = []
        for loop, factories in by_loop.items():
            with self._lock:
                running = self._refreshing.get(loop)
                if running is None or running.done():
                    try:
                        running = asyncio.run_coroutine_threadsafe(self._read(factories), loop)
                    except RuntimeError:  # the loop stopped meanwhile
                        continue
                    self._refreshing[loop] = running
            started.append(running)
        return started

    def cached_sizes(self) -> dict[str, Sizes]:
        """The sizes last read, starting a new read (not waited for) when they are older
        than :data:`SIZES_MAX_AGE`: for a collector that cannot wait for the event loop
        (OpenTelemetry's runs on its own thread), which sees them one collection late."""
        if time.monotonic() - self._sizes_at >= SIZES_MAX_AGE:
            self.request_sizes()
        return self._merged_sizes()

    def _merged_sizes(self) -> dict[str, Sizes]:
        """The last sizes read on every loop that still has open factories."""
        live = _tracked()
        merged: dict[str, Sizes] = {}
        with self._lock:
            for loop in list(self._sizes):
                if loop in live:
                    for name, sizes in self._sizes[loop].items():
                        merged.setdefault(name, sizes)
                else:
                    del self._sizes[loop]
        return merged

    async def _read(self, factories: list[QueueSource]) -> None:
        queues: dict[str, SizedQueue] = {}
        for factory in factories:
            for q in factory.open_queues():
                queues.setdefault(q.name, q)
        names = list(queues)
        results = await asyncio.gather(
            *(asyncio.wait_for(queues[n].sizes(), SIZES_TIMEOUT) for n in names),
            return_exceptions=True,
        )
        fresh: dict[str, Sizes] = {}
        for name, result in zip(names, results, strict=True):
            self.queue(name)  # an open queue shows its counters, at 0 until something happens
            if isinstance(result, BaseException):
                log.debug("sizes of queue %r not read: %r", name, result)
            else:
                fresh[name] = result
        with self._lock:  # a queue that failed or closed is left out rather than shown stale
            self._sizes[asyncio.get_running_loop()] = fresh
            self._sizes_at = time.monotonic()

    # the Prometheus text --------------------------------------------------------------

    async def prometheus_text(self, *, handlers: bool = True) -> str:
        """This process's queue metrics in the Prometheus text format, sizes read now (or
        within :data:`SIZES_MAX_AGE`). ``handlers=False`` leaves out the handler duration
        histogram, for an endpoint that shows each consumer's own."""
        sizes = await self.refresh_sizes()
        return queue_text(list(self.series.values()), sizes, handlers=handlers)


active: Registry | None = None
"""The registry while metrics are enabled; None (nothing counted) otherwise."""


kept = False
"""Whether metrics were enabled by a caller (not only by a worker serving ``/metrics``):
then a worker that stops leaves them enabled."""


def enable(*, keep: bool = True) -> Registry:
    """Start counting this process's queue events (from now on); idempotent. ``keep=False``
    is the worker's: enabled for as long as it serves ``/metrics``, then :func:`release`
    disables them unless someone enabled them meanwhile (an application's
    ``enable_metrics`` or ``enable_opentelemetry`` must not end with the worker)."""
    global active, kept
    if active is None:
        active = Registry()
    if keep:
        kept = True
    return active


def release() -> None:
    """The worker that enabled counting (``keep=False``) stopped: disabled, unless a caller
    enabled metrics meanwhile."""
    if not kept:
        disable()


def disable() -> None:
    """Stop counting and forget what was counted; exporters see nothing more."""
    global active, kept
    active = None
    kept = False
