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
    (a few microseconds each with the SDK). Calling it again replaces the
    instruments of the previous call (which then report nothing); ``aio_keuss.disable_metrics``
    stops both. Raises :class:`~aio_keuss.MissingDependencyError` without the ``otel`` extra.
    """
    try:
        from opentelemetry import metrics
    except ImportError as exc:
        raise MissingDependencyError("otel", "opentelemetry-api", "enable_opentelemetry") from exc
    registry = observe.enable()
    for old in [s for s in registry.sinks if isinstance(s, _OtelSink)]:
        registry.sinks.remove(old)
    provider = meter_provider or metrics.get_meter_provider()
    registry.sinks.append(_OtelSink(registry, provider, delivery_latency))


class _OtelSink:
    """The instruments of one ``enable_opentelemetry`` call, reporting while its registry
    is the active one and it is still the registry's sink."""

    def __init__(
        self, registry: observe.Registry, provider: MeterProvider, delivery_latency: bool
    ) -> None:
        from opentelemetry.metrics import Observation

        self._registry = registry
        self._observation = Observation
        meter = provider.get_meter(METER_NAME, _version())
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
        if delivery_latency:
            self._latency = _histogram(
                meter,
                "aio_keuss.queue.delivery_latency",
                "From when a message became deliverable to when it was handed out.",
                LATENCY_BUCKETS,
            )
        self._durations = _histogram(
            meter,
            "aio_keuss.handler.duration",
            "How long consumer handlers ran, by outcome.",
            DURATION_BUCKETS,
        )
        self._attributes: dict[str, dict[str, str]] = {}

    def _live(self) -> bool:
        return observe.active is self._registry and self in self._registry.sinks

    def _counter(
        self, counters: tuple[str, ...]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe_counter(options: CallbackOptions) -> Iterable[Observation]:
            if not self._live():
                return []
            found = list(self._registry.series.values())  # one step under the GIL
            return [self._observation(s.total(*counters), self._queue(s.queue)) for s in found]

        return observe_counter

    def _sizes(self, options: CallbackOptions) -> Iterable[Observation]:
        if not self._live():
            return []
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
