"""Queue metrics of a worker on real servers, read where a user reads them: the worker's
``/metrics`` (Prometheus text) and an OpenTelemetry SDK reader."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator

import pytest
from backends import CASES, BackendCase, new_token
from metrics_reading import otel_points, point
from own_servers import free_port

import aio_keuss
from aio_keuss import Message, observe

otel_sdk = pytest.importorskip("opentelemetry.sdk.metrics")
otel_export = pytest.importorskip("opentelemetry.sdk.metrics.export")

BACKENDS = [case for case in CASES if case.id in ("redis-oq", "postgres")]


@pytest.fixture(params=BACKENDS, ids=lambda case: case.id)
async def factory(request: pytest.FixtureRequest) -> AsyncIterator[aio_keuss.Factory]:
    case: BackendCase = request.param
    reason = case.available()
    if reason:
        pytest.skip(reason)
    options = case.options(new_token())
    opened = await aio_keuss.connect(
        case.name, deadletter={"max_ko": 1, "queue": "dead"}, **options
    )
    try:
        yield opened
    finally:
        await opened.close()
        if case.cleanup is not None:
            await case.cleanup(options)


@pytest.fixture(autouse=True)
def metrics_off() -> Iterator[None]:
    observe.disable()
    yield
    observe.disable()


def _get(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as got:
            body: bytes = got.read()
            return body.decode()
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return ""  # not listening yet
        raise


def _samples(text: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


async def _scrape_until(port: int, wanted: dict[str, float], seconds: float = 60.0) -> str:
    """Scrape until every wanted sample has its value (the worker gets there at its pace)."""
    deadline = time.monotonic() + seconds
    text = ""
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(_get, port)
        found = _samples(text)
        if all(found.get(name) == value for name, value in wanted.items()):
            return text
        await asyncio.sleep(0.2)
    pytest.fail(f"never saw {wanted} in:\n{text}")


async def test_worker_metrics_count_pushes_deliveries_acks_and_deadletters(
    factory: aio_keuss.Factory,
) -> None:
    reader = otel_export.InMemoryMetricReader()
    aio_keuss.enable_opentelemetry(otel_sdk.MeterProvider(metric_readers=[reader]))
    queue = await factory.queue("jobs")
    await queue.push_many(["a", "b", "poison", "c", "d"])

    async def handle(message: Message) -> None:
        if message.payload == "poison":
            raise ValueError("poison")

    port = free_port()
    stop = asyncio.Event()
    worker = asyncio.create_task(
        aio_keuss.run_worker(
            handle, "jobs", factory=factory, health_port=port, stop=stop, concurrency=2
        )
    )
    try:
        # The poison message: delivered, ko-ed (back after the retry delay, 1 s), delivered
        # again and deadlettered (max_ko 1); the four others handled and acknowledged.
        wanted = {
            'aio_keuss_queue_pushed_total{queue="jobs"}': 5,
            'aio_keuss_queue_delivered_total{queue="jobs"}': 6,
            'aio_keuss_queue_acked_total{queue="jobs"}': 4,
            'aio_keuss_queue_nacked_total{queue="jobs"}': 1,
            'aio_keuss_queue_deadlettered_total{queue="jobs"}': 1,
            'aio_keuss_queue_moved_total{queue="jobs"}': 0,
            'aio_keuss_queue_pushed_total{queue="dead"}': 1,
            'aio_keuss_queue_delivery_latency_seconds_count{queue="jobs"}': 6,
            'aio_keuss_queue_messages{queue="jobs",state="ready"}': 0,
            'aio_keuss_queue_messages{queue="jobs",state="scheduled"}': 0,
            'aio_keuss_queue_messages{queue="jobs",state="reserved"}': 0,
            'aio_keuss_queue_messages{queue="dead",state="ready"}': 1,
            'aio_keuss_handled_total{queue="jobs"}': 4,  # the consumer's own section
            'aio_keuss_failed_total{queue="jobs"}': 2,
            'aio_keuss_handler_duration_seconds_count{queue="jobs"}': 6,
        }
        text = await _scrape_until(port, wanted)
        assert text.count("# TYPE aio_keuss_handler_duration_seconds histogram") == 1
    finally:
        stop.set()
        await worker
    assert observe.active is not None  # enabled by the caller, so left on by the worker

    registry = observe.active
    await registry.refresh_sizes(max_age=0)  # OpenTelemetry's collector shows the last read
    points = otel_points(reader)
    assert point(points["aio_keuss.queue.pushed"], queue="jobs").value == 5
    assert point(points["aio_keuss.queue.delivered"], queue="jobs").value == 6
    assert point(points["aio_keuss.queue.acked"], queue="jobs").value == 4
    assert point(points["aio_keuss.queue.nacked"], queue="jobs").value == 1
    assert point(points["aio_keuss.queue.deadlettered"], queue="jobs").value == 1
    assert point(points["aio_keuss.queue.pushed"], queue="dead").value == 1
    assert point(points["aio_keuss.queue.delivery_latency"], queue="jobs").count == 6
    durations = points["aio_keuss.handler.duration"]
    assert point(durations, queue="jobs", outcome="ok").count == 4
    assert point(durations, queue="jobs", outcome="error").count == 2
    dead = point(points["aio_keuss.queue.messages"], queue="dead", state="ready")
    assert dead.value == 1
