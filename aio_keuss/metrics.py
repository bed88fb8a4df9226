"""Counters a consumer keeps about its handlers, the per-queue series the registry of
:mod:`aio_keuss.observe` keeps, and their Prometheus text form.

The exposition format is the one of the Prometheus documentation ("Exposition formats",
text-based format 0.0.4): ``# HELP`` and ``# TYPE`` lines, then one sample per line; a
histogram is cumulative ``_bucket`` samples with an ``le`` label ending at ``+Inf``, then
``_sum`` and ``_count``. Nothing here needs a Prometheus client library.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .types import Sizes

DURATION_BUCKETS: tuple[float, ...] = (
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
)
"""Upper bounds (seconds) of the handler duration histogram: the Prometheus client
libraries' defaults, and two longer ones for slow jobs."""


class Histogram:
    """Observations counted per bucket (not cumulative until rendered), with sum and count."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float] = DURATION_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), ending with (inf, count): of a copy of the
        buckets taken in one step under the GIL, as another event loop thread (the blocking
        API's) may observe meanwhile, and :attr:`count` may already be past them."""
        found, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts[:], strict=True):
            running += n
            found.append((bound, running))
        return found


@dataclass(frozen=True, slots=True)
class QueueMetrics:
    """What one consumer of one queue reports."""

    queue: str
    state: str
    handled: int
    failed: int
    timed_out: int
    retried: int
    deadlettered: int
    in_flight: int
    durations: Histogram
    cancelled: int = 0


@dataclass(slots=True)
class QueueSeries:
    """What this process counted about one queue since metrics were enabled: events by
    ``q.stats()`` counter name (and ``move``), delivery latency and handler durations."""

    queue: str
    latency: Histogram
    handlers: Histogram
    counts: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))

    def total(self, *counters: str) -> int:
        return sum(self.counts.get(c, 0) for c in counters)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


_COUNTERS = (
    ("handled", "Messages whose handler returned."),
    ("failed", "Handler exceptions and timeouts (each one a ko on a backend with reserve)."),
    ("timed_out", "Handlers cancelled for running past the handler timeout."),
    ("retried", "Messages a failed handler put back for another try."),
    ("deadlettered", "Messages a failed handler sent to the deadletter queue."),
    ("cancelled", "Messages whose handler a cancel stopped, or that it kept from starting."),
)


def prometheus_text(queues: Iterable[QueueMetrics], prefix: str = "aio_keuss") -> str:
    """The metrics of every queue in the Prometheus text format."""
    queues = list(queues)
    lines: list[str] = []
    for name, help_text in _COUNTERS:
        metric = f"{prefix}_{name}_total"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        lines += [f'{metric}{{queue="{_label(q.queue)}"}} {getattr(q, name)}' for q in queues]
    metric = f"{prefix}_in_flight"
    lines += [f"# HELP {metric} Handlers running now.", f"# TYPE {metric} gauge"]
    lines += [f'{metric}{{queue="{_label(q.queue)}"}} {q.in_flight}' for q in queues]
    metric = f"{prefix}_consumer_up"
    lines += [
        f"# HELP {metric} 1 while the consumer runs, 0 while it reconnects or has stopped.",
        f"# TYPE {metric} gauge",
    ]
    lines += [f'{metric}{{queue="{_label(q.queue)}"}} {int(q.state == "running")}' for q in queues]
    metric = f"{prefix}_handler_duration_seconds"
    lines += [
        f"# HELP {metric} How long handlers ran, whatever their outcome.",
        f"# TYPE {metric} histogram",
    ]
    for q in queues:
        _histogram(lines, metric, f'queue="{_label(q.queue)}"', q.durations)
    return "\n".join(lines) + "\n"


QUEUE_COUNTERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("pushed", ("put",), "Messages that entered the queue: pushed, moved or deadlettered in."),
    ("delivered", ("get", "reserve"), "Messages handed out by pop or reserve."),
    ("acked", ("commit",), "Reservations committed by ok, moves out included."),
    ("nacked", ("rollback",), "Reservations rolled back by ko (due again later)."),
    ("deadlettered", ("deadletter",), "Messages moved to the deadletter queue by a ko."),
    ("moved", ("move",), "Messages moved out to another queue (pipelines, q.move)."),
)
"""(name, ``q.stats()`` counters it adds up, help) of the per-queue counters."""

SIZE_STATES = ("ready", "scheduled", "reserved")


def _histogram(lines: list[str], metric: str, label: str, histogram: Histogram) -> None:
    """``_count`` is the ``+Inf`` bucket, which the format requires it to equal: the
    histogram's own count may include observations made after its buckets were read."""
    buckets = histogram.cumulative()
    for bound, n in buckets:
        lines.append(f'{metric}_bucket{{{label},le="{_number(bound)}"}} {n}')
    lines.append(f"{metric}_sum{{{label}}} {_number(histogram.total)}")
    lines.append(f"{metric}_count{{{label}}} {buckets[-1][1]}")


def queue_text(
    series: Sequence[QueueSeries],
    sizes: Mapping[str, Sizes],
    *,
    handlers: bool = True,
    prefix: str = "aio_keuss",
) -> str:
    """Per-queue counters, sizes (gauges), delivery latency and, with ``handlers``, handler
    duration histograms in the Prometheus text format."""
    series = sorted(series, key=lambda s: s.queue)
    lines: list[str] = []
    for name, counters, help_text in QUEUE_COUNTERS:
        metric = f"{prefix}_queue_{name}_total"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        lines += [f'{metric}{{queue="{_label(s.queue)}"}} {s.total(*counters)}' for s in series]
    metric = f"{prefix}_queue_messages"
    lines += [
        f"# HELP {metric} Messages in the queue by state (ready: deliverable now; scheduled:"
        " waiting for their time; reserved: held by a consumer).",
        f"# TYPE {metric} gauge",
    ]
    for queue in sorted(sizes):
        found = sizes[queue]
        values = (found.size, found.scheduled, found.reserved)
        for state, n in zip(SIZE_STATES, values, strict=True):
            lines.append(f'{metric}{{queue="{_label(queue)}",state="{state}"}} {n}')
    metric = f"{prefix}_queue_delivery_latency_seconds"
    lines += [
        f"# HELP {metric} From when a message became deliverable to when it was handed out.",
        f"# TYPE {metric} histogram",
    ]
    for s in series:
        _histogram(lines, metric, f'queue="{_label(s.queue)}"', s.latency)
    if handlers:
        metric = f"{prefix}_handler_duration_seconds"
        lines += [
            f"# HELP {metric} How long handlers ran, whatever their outcome.",
            f"# TYPE {metric} histogram",
        ]
        for s in series:
            _histogram(lines, metric, f'queue="{_label(s.queue)}"', s.handlers)
    return "\n".join(lines) + "\n"
