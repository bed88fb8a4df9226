"""Counters a consumer keeps about its handlers, and their Prometheus text form.

The exposition format is the one of the Prometheus documentation ("Exposition formats",
text-based format 0.0.4): ``# HELP`` and ``# TYPE`` lines, then one sample per line; a
histogram is cumulative ``_bucket`` samples with an ``le`` label ending at ``+Inf``, then
``_sum`` and ``_count``. Nothing here needs a Prometheus client library.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
        """(upper bound, observations <= it), ending with (inf, count)."""
        found, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
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
        label = f'queue="{_label(q.queue)}"'
        for bound, n in q.durations.cumulative():
            lines.append(f'{metric}_bucket{{{label},le="{_number(bound)}"}} {n}')
        lines.append(f"{metric}_sum{{{label}}} {_number(q.durations.total)}")
        lines.append(f"{metric}_count{{{label}}} {q.durations.count}")
    return "\n".join(lines) + "\n"
