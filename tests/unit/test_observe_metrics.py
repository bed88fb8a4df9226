"""Queue metrics on the memory backend: the registry, its Prometheus text, OpenTelemetry."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from metrics_reading import otel_points, point
from own_servers import free_port

import aio_keuss
from aio_keuss import Message, observe
from aio_keuss.metrics import queue_text

otel_sdk = pytest.importorskip("opentelemetry.sdk.metrics")
otel_export = pytest.importorskip("opentelemetry.sdk.metrics.export")


@pytest.fixture(autouse=True)
def metrics_off() -> Iterator[None]:
    observe.disable()
    yield
    observe.disable()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text, found by name and exact labels."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{wanted}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    raise AssertionError(f"no {prefix!r} in:\n{text}")


async def test_nothing_is_counted_until_metrics_are_enabled() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push(1)
        assert await q.pop() is not None
        assert observe.active is None
        registry = aio_keuss.enable_metrics()
        assert aio_keuss.enable_metrics() is registry  # idempotent
        await q.push(2)
        text = await registry.prometheus_text()
        assert sample(text, "aio_keuss_queue_pushed_total", queue="jobs") == 1
        assert sample(text, "aio_keuss_queue_delivered_total", queue="jobs") == 0
        aio_keuss.disable_metrics()
        await q.push(3)
        assert observe.active is None
        assert (await q.stats())["put"] == 3  # q.stats() counts whatever metrics do


async def test_counters_follow_every_kind_of_event() -> None:
    registry = aio_keuss.enable_metrics()
    options: dict[str, Any] = {"deadletter": {"max_ko": 1, "queue": "dead"}}
    async with aio_keuss.connect("memory", **options) as factory:
        q = await factory.queue("jobs")
        await q.push_many([1, 2, 3, 4])
        first = await q.reserve()
        assert first is not None and await q.ok(first)
        second = await q.reserve()
        assert second is not None
        assert await q.ko(second) is aio_keuss.KoResult.ROLLED_BACK
        third = await q.reserve()
        assert third is not None and await q.move(third, "next") is not None
        assert await q.pop() is not None
        again = await q.reserve()  # the one rolled back, now on its second try
        assert again is not None and again.id == second.id
        assert await q.ko(again) is aio_keuss.KoResult.DEADLETTERED

        text = await registry.prometheus_text()
        expected = {
            "pushed": 4,
            "delivered": 5,
            "acked": 2,  # the ok, and the move out
            "nacked": 1,
            "deadlettered": 1,
            "moved": 1,
        }
        for name, value in expected.items():
            assert sample(text, f"aio_keuss_queue_{name}_total", queue="jobs") == value, name
        assert sample(text, "aio_keuss_queue_pushed_total", queue="next") == 1
        assert sample(text, "aio_keuss_queue_pushed_total", queue="dead") == 1
        assert sample(text, "aio_keuss_queue_delivery_latency_seconds_count", queue="jobs") == 5
        le_inf = sample(
            text, "aio_keuss_queue_delivery_latency_seconds_bucket", queue="jobs", le="+Inf"
        )
        assert le_inf == 5
        stats = await q.stats()
        assert (stats["put"], stats["commit"], stats["rollback"]) == (4, 2, 1)


async def test_sizes_are_gauges_read_at_scrape_time_and_kept_briefly() -> None:
    registry = aio_keuss.enable_metrics()
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push_many([1, 2])
        await q.push(3, delay=3600)
        held = await q.reserve()
        assert held is not None
        text = await registry.prometheus_text()
        assert sample(text, "aio_keuss_queue_messages", queue="jobs", state="ready") == 1
        assert sample(text, "aio_keuss_queue_messages", queue="jobs", state="scheduled") == 1
        assert sample(text, "aio_keuss_queue_messages", queue="jobs", state="reserved") == 1
        await q.push(4)
        sizes = await registry.refresh_sizes(max_age=3600)  # young enough: not read again
        assert sizes["jobs"].size == 1
        sizes = await registry.refresh_sizes(max_age=0)
        assert sizes["jobs"].size == 2
        # an open queue shows its counters even before anything happened to it
        await factory.queue("idle")
        await registry.refresh_sizes(max_age=0)
        text = await registry.prometheus_text()
        assert sample(text, "aio_keuss_queue_pushed_total", queue="idle") == 0
    # a closed factory's queues are no longer read
    assert "jobs" not in await registry.refresh_sizes(max_age=0)


async def test_handler_durations_by_outcome() -> None:
    registry = aio_keuss.enable_metrics()
    reader = otel_export.InMemoryMetricReader()
    aio_keuss.enable_opentelemetry(otel_sdk.MeterProvider(metric_readers=[reader]))
    assert observe.active is registry  # the same registry feeds both
    done = asyncio.Event()
    seen: list[int] = []

    async def handle(message: Message) -> None:
        seen.append(message.payload)
        if len(seen) == 3:
            done.set()
        if message.payload == 2:
            raise ValueError("no")

    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push_many([1, 2, 3])
        async with q.consume(handle, retry_delay=3600):
            await done.wait()
        text = await registry.prometheus_text()
        assert sample(text, "aio_keuss_handler_duration_seconds_count", queue="jobs") == 3
        durations = otel_points(reader)["aio_keuss.handler.duration"]
        assert point(durations, queue="jobs", outcome="ok").count == 2
        assert point(durations, queue="jobs", outcome="error").count == 1


async def test_opentelemetry_instruments_read_the_registry() -> None:
    reader = otel_export.InMemoryMetricReader()
    aio_keuss.enable_opentelemetry(otel_sdk.MeterProvider(metric_readers=[reader]))
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push_many([1, 2, 3])
        message = await q.reserve()
        assert message is not None and await q.ok(message)
        registry = observe.active
        assert registry is not None
        # the collector runs on the SDK's thread and never waits for the event loop: it
        # shows the sizes last read (and starts a read when they are old)
        await registry.refresh_sizes(max_age=0)
        points = otel_points(reader)
        assert point(points["aio_keuss.queue.pushed"], queue="jobs").value == 3
        assert point(points["aio_keuss.queue.delivered"], queue="jobs").value == 1
        assert point(points["aio_keuss.queue.acked"], queue="jobs").value == 1
        latency = point(points["aio_keuss.queue.delivery_latency"], queue="jobs")
        assert latency.count == 1
        assert tuple(latency.explicit_bounds) == observe.LATENCY_BUCKETS  # our advice
        ready = point(points["aio_keuss.queue.messages"], queue="jobs", state="ready")
        assert ready.value == 2


async def test_a_new_opentelemetry_call_replaces_the_old_instruments() -> None:
    first = otel_export.InMemoryMetricReader()
    second = otel_export.InMemoryMetricReader()
    aio_keuss.enable_opentelemetry(otel_sdk.MeterProvider(metric_readers=[first]))
    aio_keuss.enable_opentelemetry(otel_sdk.MeterProvider(metric_readers=[second]))
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push(1)
        assert "aio_keuss.queue.pushed" not in otel_points(first)
        assert point(otel_points(second)["aio_keuss.queue.pushed"], queue="jobs").value == 1
        aio_keuss.disable_metrics()
        await q.push(2)
        assert "aio_keuss.queue.pushed" not in otel_points(second)


async def test_a_new_opentelemetry_call_on_the_same_provider_keeps_reporting() -> None:
    """The OpenTelemetry SDK hands back the instrument already registered under a name on
    a meter, and drops the callbacks given again: a second ``enable_opentelemetry`` on the
    same provider (called twice, or again after ``disable_metrics``) left the first call's
    callbacks, which report nothing once replaced, so every counter and the sizes gauge
    went silent for good. Counts start again from the new enable, as documented."""
    reader = otel_export.InMemoryMetricReader()
    provider = otel_sdk.MeterProvider(metric_readers=[reader])
    aio_keuss.enable_opentelemetry(provider)
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push(1)
        assert point(otel_points(reader)["aio_keuss.queue.pushed"], queue="jobs").value == 1
        aio_keuss.enable_opentelemetry(provider)
        await q.push(2)
        assert point(otel_points(reader)["aio_keuss.queue.pushed"], queue="jobs").value == 2
        aio_keuss.disable_metrics()
        aio_keuss.enable_opentelemetry(provider, delivery_latency=False)
        await q.push(3)
        assert await q.pop() is not None
        registry = observe.active
        assert registry is not None
        await registry.refresh_sizes(max_age=0)
        points = otel_points(reader)
        assert point(points["aio_keuss.queue.pushed"], queue="jobs").value == 1
        assert point(points["aio_keuss.queue.delivered"], queue="jobs").value == 1
        ready = point(points["aio_keuss.queue.messages"], queue="jobs", state="ready")
        assert ready.value == 2


async def test_the_worker_endpoint_shows_queue_metrics_while_it_runs() -> None:
    port = free_port()
    stop = asyncio.Event()
    handled = asyncio.Event()

    async def handle(message: Message) -> None:
        handled.set()

    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push("x")
        worker = asyncio.create_task(
            aio_keuss.run_worker(handle, "jobs", factory=factory, health_port=port, stop=stop)
        )
        await handled.wait()
        text = await asyncio.to_thread(_get, port, "/metrics")
        stop.set()
        await worker
    assert sample(text, "aio_keuss_handled_total", queue="jobs") >= 0  # the consumer section
    assert sample(text, "aio_keuss_queue_delivered_total", queue="jobs") == 1
    assert sample(text, "aio_keuss_queue_messages", queue="jobs", state="ready") == 0
    assert text.count("# TYPE aio_keuss_handler_duration_seconds histogram") == 1
    assert observe.active is None  # the worker enabled metrics, and disabled them after


async def test_metrics_enabled_while_a_worker_counts_outlive_that_worker() -> None:
    """A worker serving /metrics enables counting and disables it when it stops, when it
    was the one that enabled it. An application that called ``enable_metrics`` (or
    ``enable_opentelemetry``) while such a worker ran lost its metrics when the worker
    stopped: the registry was dropped, nothing was counted any more and its OpenTelemetry
    instruments went silent. What the application enabled now stays enabled."""
    port = free_port()
    stop = asyncio.Event()
    handled = asyncio.Event()

    async def handle(message: Message) -> None:
        handled.set()

    reader = otel_export.InMemoryMetricReader()
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push("x")
        worker = asyncio.create_task(
            aio_keuss.run_worker(handle, "jobs", factory=factory, health_port=port, stop=stop)
        )
        await handled.wait()
        registry = aio_keuss.enable_metrics()
        aio_keuss.enable_opentelemetry(otel_sdk.MeterProvider(metric_readers=[reader]))
        stop.set()
        await worker
        assert observe.active is registry
        await q.push("y")
        # counted from the worker's start, which came after the first push
        assert registry.series["jobs"].counts["put"] == 1
        assert point(otel_points(reader)["aio_keuss.queue.pushed"], queue="jobs").value == 1


def _get(port: int, path: str) -> str:
    """GET from the worker, which may not listen yet (it starts serving after its consumers)."""
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as got:
                body: bytes = got.read()
                return body.decode()
        except urllib.error.URLError as exc:
            if not isinstance(exc.reason, ConnectionRefusedError):
                raise
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port}")


async def test_the_per_message_latency_instrument_can_be_left_out() -> None:
    reader = otel_export.InMemoryMetricReader()
    provider = otel_sdk.MeterProvider(metric_readers=[reader])
    aio_keuss.enable_opentelemetry(provider, delivery_latency=False)
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push(1)
        assert await q.pop() is not None
        points = otel_points(reader)
        assert "aio_keuss.queue.delivery_latency" not in points
        assert point(points["aio_keuss.queue.delivered"], queue="jobs").value == 1
        registry = observe.active
        assert registry is not None and registry.series["jobs"].latency.count == 1


def test_enable_opentelemetry_without_the_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # import fails as if absent
    with pytest.raises(aio_keuss.MissingDependencyError, match=r"aio-keuss\[otel\]"):
        aio_keuss.enable_opentelemetry()
    assert observe.active is None  # nothing half-enabled


def test_queues_of_the_blocking_api_are_read_on_their_own_loop() -> None:
    from aio_keuss import sync

    registry = aio_keuss.enable_metrics()
    with sync.connect("memory") as factory:
        q = factory.queue("jobs")
        q.push_many([1, 2])
        assert q.pop() is not None
        # a scrape from another event loop (here: a new one in this thread)
        sizes = asyncio.run(registry.refresh_sizes(max_age=0))
        assert sizes["jobs"].size == 1
        text = asyncio.run(registry.prometheus_text())
        assert sample(text, "aio_keuss_queue_pushed_total", queue="jobs") == 2
        assert sample(text, "aio_keuss_queue_delivered_total", queue="jobs") == 1
        assert registry.cached_sizes()["jobs"].size == 1  # what a collector thread sees


async def test_a_collector_thread_reads_while_the_loop_opens_queues() -> None:
    """OpenTelemetry collects on its own thread, which lists each factory's open queues
    while the event loop opens more: that listing once walked the factory's map of queues
    as it grew, and failed ("dictionary changed size during iteration"), losing the sizes
    gauge of that collection. A tiny switch interval makes the threads interleave often."""
    registry = aio_keuss.enable_metrics()
    errors: list[BaseException] = []
    done = threading.Event()

    def collect() -> None:
        while not done.is_set() and not errors:
            try:
                registry.cached_sizes()
            except Exception as exc:  # what the test reports
                errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        async with aio_keuss.connect("memory") as factory:
            await factory.queue("first")  # tracked: the collector lists its queues
            collector = threading.Thread(target=collect)
            collector.start()
            try:
                for i in range(2000):
                    await factory.queue(f"q{i}")
                    if errors:
                        break
            finally:
                done.set()
                collector.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


def test_two_event_loop_threads_add_to_one_series_without_losing_counts() -> None:
    """The blocking API runs its own event loop thread beside the application's, and both
    count into the series of a queue name they share, with no lock: each update is one
    step under the GIL (no call between reading a count and storing it back). A tiny switch
    interval makes the threads interleave often; every event must be counted."""
    from aio_keuss import sync

    registry = aio_keuss.enable_metrics()
    n = 2000

    def blocking() -> None:
        with sync.connect("memory") as factory:
            q = factory.queue("jobs")
            for i in range(n):
                q.push(i)
                message = q.reserve()
                assert message is not None
                assert q.ok(message)

    async def asynchronous() -> None:
        async with aio_keuss.connect("memory") as factory:
            q = await factory.queue("jobs")
            for i in range(n):
                await q.push(i)
                message = await q.reserve()
                assert message is not None
                assert await q.ok(message)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [
            threading.Thread(target=blocking),
            threading.Thread(target=asyncio.run, args=(asynchronous(),)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    series = registry.series["jobs"]
    assert (series.total("put"), series.total("reserve"), series.total("commit")) == (
        2 * n,
        2 * n,
        2 * n,
    )
    assert series.latency.count == 2 * n


def test_a_histogram_read_while_another_thread_observes_stays_consistent() -> None:
    """A scrape renders a histogram bucket by bucket while another event loop thread (the
    blocking API's) may observe into it: the ``+Inf`` bucket, the sum of the buckets read,
    then fell short of ``_count``, read after, which the exposition format requires equal
    (OpenMetrics, "Histogram"). ``_count`` is now the count of the buckets rendered. A tiny
    switch interval makes the threads interleave often; the first mismatch fails."""
    registry = aio_keuss.enable_metrics()
    registry.handled("jobs", 0.003, "ok")
    stop = threading.Event()

    def observe_forever() -> None:
        while not stop.is_set():
            registry.handled("jobs", 0.003, "ok")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    observer = threading.Thread(target=observe_forever)
    observer.start()
    try:
        for _ in range(3000):
            text = queue_text(list(registry.series.values()), {})
            name = "aio_keuss_handler_duration_seconds"
            every = sample(text, f"{name}_bucket", queue="jobs", le="+Inf")
            assert every == sample(text, f"{name}_count", queue="jobs"), text
    finally:
        stop.set()
        observer.join()
        sys.setswitchinterval(interval)


_GLOBAL_PROVIDER_SCRIPT = """
import asyncio
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
import aio_keuss
from metrics_reading import otel_points, point

async def main():
    aio_keuss.enable_opentelemetry()  # at start-up, before the SDK is configured
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push(1)
        assert point(otel_points(reader)["aio_keuss.queue.pushed"], queue="jobs").value == 1
        {again}
        await q.push(2)
        pushed = otel_points(reader).get("aio_keuss.queue.pushed", [])
        assert point(pushed, queue="jobs").value == 2, pushed

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "again",
    [
        "aio_keuss.enable_opentelemetry()",
        "aio_keuss.enable_opentelemetry(metrics.get_meter_provider())",
    ],
    ids=["default", "named"],
)
def test_a_second_call_on_the_global_provider_once_it_is_set_keeps_reporting(
    again: str,
) -> None:
    """The global provider is a stand-in until the SDK's is set, and the instruments made
    on it are then bound to the SDK's: a second call on the global provider, now the SDK's
    object, made new instruments of the same names there, which the SDK answers with the
    ones it has (dropping the new callbacks), while the first ones stopped reporting: every
    counter went silent. Its own process: the global provider is set once per process."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    script = _GLOBAL_PROVIDER_SCRIPT.replace("{again}", again)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_a_loop_that_is_not_running_is_not_asked_for_sizes() -> None:
    """A factory left open on an event loop that no longer runs (``run_until_complete``
    returned, the loop not closed) can never read its sizes: every scrape waited for it
    until the timeout (six seconds), and left a coroutine never awaited."""
    registry = aio_keuss.enable_metrics()
    idle = asyncio.new_event_loop()

    async def opened() -> aio_keuss.Factory:
        factory = await aio_keuss.connect("memory")
        await factory.queue("idle")
        return factory

    factory = idle.run_until_complete(opened())
    try:
        assert registry.request_sizes() == []  # nothing started that could never finish

        async def scrape() -> str:
            async with aio_keuss.connect("memory") as running:
                q = await running.queue("running")
                await q.push(1)
                return await registry.prometheus_text()

        text = asyncio.run(scrape())
        assert sample(text, "aio_keuss_queue_messages", queue="running", state="ready") == 1
        assert 'queue="idle",state=' not in text
    finally:
        idle.run_until_complete(factory.close())
        idle.close()
