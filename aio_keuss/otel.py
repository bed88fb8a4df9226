"""Queue metrics as OpenTelemetry instruments, with the ``opentelemetry-api`` package.

:func:`enable_opentelemetry` enables the registry of :mod:`aio_keuss.observe` and creates,
from the meter provider you configured (yours, or the global one), instruments that read it.
The counters and the sizes gauge are observable: the SDK reads them when it collects, so a
message costs no OpenTelemetry call for them; the two histograms are recorded as things
happen (the OpenTelemetry API has no observable histogram). Names follow the OpenTelemetry
naming guidelines (dotted, no ``_total``, units in UCUM); the metrics page of the
documentation lists them beside their Prometheus names.

Only the API is needed here; the SDK and an exporter (OTLP, Prometheus, ...) are the
application's choice, configured before or after this call (the instruments of the global
provider are bound to the real one once it is set).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from typing import TYPE_CHECKING

from . import observe
from .errors import MissingDependencyError
from .metrics import DURATION_BUCKETS, QUEUE_COUNTERS, SIZE_STATES
from .observe import LATENCY_BUCKETS

if TYPE_CHECKING:
    from opentelemetry.metrics import (
        CallbackOptions,
        Histogram,
        Meter,
        MeterProvider,
        Observation,
    )

METER_NAME = "aio_keuss"


def enable_opentelemetry(
    meter_provider: MeterProvider | None = None, *, delivery_latency: bool = True
) -> None:
    """Count queue events in this process and export them through OpenTelemetry.

    ``meter_provider``: where the instruments are created; by default the global one
    (``opentelemetry.metrics.get_meter_provider()``). ``delivery_latency=False`` leaves out
    the delivery latency histogram, the one instrument recorded once per delivered message
    (a few microseconds each with the SDK). Calling it again with another provider replaces
    the instruments of the previous call (which then report nothing); with the same provider,
    its instruments go on reporting (with the new ``delivery_latency``; after a
    ``disable_metrics``, counts start again from 0); the global provider is the same one
    before and after the SDK's is set. ``aio_keuss.disable_metrics`` stops
    all. Raises :class:`~aio_keuss.MissingDependencyError` without the ``otel`` extra.
    """
    try:
        from opentelemetry import metrics
    except ImportError as exc:
        raise MissingDependencyError("otel", "opentelemetry-api", "enable_opentelemetry") from exc
    registry = observe.enable()
    for old in [s for s in registry.sinks if isinstance(s, _OtelSink)]:
        registry.sinks.remove(old)
    global _global_sink
    current = metrics.get_meter_provider()
    provider = meter_provider or current
    sink = _made.get(provider)
    if sink is None and provider is current:
        sink = _global_sink  # made on the stand-in this provider replaced, bound to it
    if sink is None:
        sink = _OtelSink(provider)
        with contextlib.suppress(TypeError):  # a provider that takes no weak reference
            _made[provider] = sink
    if provider is current:
        _global_sink = sink
    sink.bind(registry, delivery_latency)
    registry.sinks.append(sink)


_made: weakref.WeakKeyDictionary[MeterProvider, _OtelSink] = weakref.WeakKeyDictionary()
"""The instruments made on each provider, reused by a later call on it: the SDK answers a
second ``create_observable_counter`` of a name with the instrument it has, and drops the
callbacks given again (OpenTelemetry specification, "Metrics API", duplicate instrument
registration: the first one is returned), so new instruments there would never report."""


_global_sink: _OtelSink | None = None
"""The instruments made on the global provider. Until an SDK's provider is set, the global
one is a stand-in (a proxy) whose instruments are bound to the SDK's once it is set (the
global provider is set once per process): a later call on the global provider, now the
SDK's object, reuses them, as new ones of the same names there would never report (above)."""


class _OtelSink:
    """The instruments of one ``enable_opentelemetry`` call, reporting while its registry
    is the active one and it is still the registry's sink."""

    def __init__(self, provider: MeterProvider) -> None:
        from opentelemetry.metrics import Observation

        self._registry: observe.Registry | None = None
        self._observation = Observation
        self._meter = meter = provider.get_meter(METER_NAME, _version())
        for name, counters, description in QUEUE_COUNTERS:
            meter.create_observable_counter(
                f"aio_keuss.queue.{name}",
                callbacks=[self._counter(counters)],
                unit="{message}",
                description=description,
            )
        meter.create_observable_gauge(
            "aio_keuss.queue.messages",
            callbacks=[self._sizes],
            unit="{message}",
            description="Messages in the queue by state (ready, scheduled, reserved).",
        )
        self._latency: Histogram | None = None
        self._made_latency: Histogram | None = None
        self._durations = _histogram(
            meter,
            "aio_keuss.handler.duration",
            "How long consumer handlers ran, by outcome.",
            DURATION_BUCKETS,
        )
        self._attributes: dict[str, dict[str, str]] = {}

    def bind(self, registry: observe.Registry, delivery_latency: bool) -> None:
        """Report ``registry`` from now on (a call on a provider that has the instruments
        already); the latency histogram is made the first time it is asked for."""
        self._registry = registry
        if delivery_latency and self._made_latency is None:
            self._made_latency = _histogram(
                self._meter,
                "aio_keuss.queue.delivery_latency",
                "From when a message became deliverable to when it was handed out.",
                LATENCY_BUCKETS,
            )
        self._latency = self._made_latency if delivery_latency else None

    def _live(self) -> bool:
        registry = self._registry
        return registry is not None and observe.active is registry and self in registry.sinks

    def _counter(
        self, counters: tuple[str, ...]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe_counter(options: CallbackOptions) -> Iterable[Observation]:
            if not self._live():
                return []
            assert self._registry is not None  # (live)
            found = list(self._registry.series.values())  # one step under the GIL
            return [self._observation(s.total(*counters), self._queue(s.queue)) for s in found]

        return observe_counter

    def _sizes(self, options: CallbackOptions) -> Iterable[Observation]:
        if not self._live():
            return []
        assert self._registry is not None  # (live)
        found = []
        for queue, sizes in self._registry.cached_sizes().items():
            values = (sizes.size, sizes.scheduled, sizes.reserved)
            for state, n in zip(SIZE_STATES, values, strict=True):
                found.append(self._observation(n, {"queue": queue, "state": state}))
        return found

    def _queue(self, queue: str) -> dict[str, str]:
        found = self._attributes.get(queue)
        if found is None:
            found = self._attributes[queue] = {"queue": queue}
        return found

    def latency(self, queue: str, seconds: Sequence[float]) -> None:
        if self._latency is None:
            return
        attributes = self._queue(queue)
        record = self._latency.record
        for value in seconds:
            record(value, attributes)

    def handled(self, queue: str, seconds: float, outcome: str) -> None:
        self._durations.record(seconds, {"queue": queue, "outcome": outcome})


def _histogram(meter: Meter, name: str, description: str, bounds: Sequence[float]) -> Histogram:
    """A histogram in seconds with our bucket bounds as advice (the API takes advice since
    1.30; before, the SDK's default bounds apply unless a View sets them)."""
    try:
        return meter.create_histogram(
            name, unit="s", description=description, explicit_bucket_boundaries_advisory=bounds
        )
    except TypeError:
        return meter.create_histogram(name, unit="s", description=description)


def _version() -> str | None:
    try:
        return metadata.version("aio-keuss")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return None
