"""Handler timeouts, prefetch, ``run_worker`` and the worker's settings, on the memory backend
(the command itself runs against real servers in the acceptance tests)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

import aio_keuss
from aio_keuss import HandlerTimeoutError, KoResult, Message, PipelineError, observe
from aio_keuss.consumer import check_batch_bounds, check_settings
from aio_keuss.errors import ConfigError, InvalidInputError
from aio_keuss.metrics import Histogram, QueueMetrics, prometheus_text
from aio_keuss.pipeline import Forward, Pipeline
from aio_keuss.worker import cli
from aio_keuss.worker import run as worker_run
from aio_keuss.worker.health import HealthServer, health
from aio_keuss.worker.settings import resolve


async def test_a_handler_past_its_timeout_is_ko_ed_then_deadlettered() -> None:
    async with aio_keuss.connect("memory", deadletter={"max_ko": 1, "queue": "dead"}) as factory:
        q = await factory.queue("jobs")
        await q.push("slow")
        seen: list[int] = []

        async def hang(message: Message) -> None:
            seen.append(message.tries)
            await asyncio.sleep(3600)

        consumer = q.consume(hang, timeout=0.05, retry_delay=0.0)
        dead = await factory.queue("dead")
        assert (await dead.pop(timeout=30)) is not None
        await consumer.stop()
        assert seen == [0, 1]
        status = consumer.status()
        assert (status.timed_out, status.failed, status.retried, status.deadlettered) == (
            2,
            2,
            1,
            1,
        )
        assert consumer.durations.count == 2
        _, body = health([consumer])  # /healthz carries every count status() has
        (counts,) = orjson.loads(body)["consumers"]
        assert {k: counts[k] for k in ("timed_out", "failed", "retried", "deadlettered")} == {
            "timed_out": 2,
            "failed": 2,
            "retried": 1,
            "deadlettered": 1,
        }


async def test_a_handler_raising_timeout_error_itself_is_not_a_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push("x")
        done = asyncio.Event()

        async def raises(message: Message) -> None:
            done.set()
            raise TimeoutError("mine")

        consumer = q.consume(raises, timeout=30)
        await done.wait()
        await consumer.stop()
        assert consumer.timed_out == 0 and consumer.failed == 1
        assert "TimeoutError('mine')" in caplog.text
        assert HandlerTimeoutError.__name__ not in caplog.text


async def test_prefetched_messages_are_given_back_on_stop_at_no_cost() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push_many(list(range(20)))
        started = asyncio.Event()

        async def block(message: Message) -> None:
            started.set()
            await asyncio.sleep(3600)

        consumer = q.consume(block, concurrency=1, prefetch=5)
        await started.wait()
        assert await q.resv_size() == 6  # the one running and the five waiting
        await consumer.stop(grace=0)
        assert await q.resv_size() == 0
        back = await q.pop_many(100, timeout=0)
        assert len(back) == 20 and {m.tries for m in back} == {0}


async def test_a_stop_gives_back_what_was_prefetched_in_one_call() -> None:
    """Prefetched reservations go back together: one call each, awaited in turn, cost a
    round trip per prefetched message on every stop of a consumer of a remote queue."""
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push_many(list(range(20)))
        started = asyncio.Event()
        store = q._store  # type: ignore[attr-defined]
        rollback = store.rollback
        calls: list[int] = []

        def counted(nacks: Any, plan: Any) -> Any:
            calls.append(len(nacks))
            return rollback(nacks, plan)

        store.rollback = counted

        async def block(message: Message) -> None:
            started.set()
            await asyncio.sleep(3600)

        consumer = q.consume(block, concurrency=1, prefetch=5)
        await started.wait()
        await consumer.stop(grace=0)
        assert sorted(calls) == [1, 5]  # the cancelled handler's message, then the five
        assert await q.resv_size() == 0


async def test_prefetch_handles_everything_once() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push_many(list(range(200)))
        handled: list[int] = []
        all_done = asyncio.Event()

        async def note(message: Message) -> None:
            handled.append(message.payload)
            if len(handled) == 200:
                all_done.set()

        consumer = q.consume(note, concurrency=3, prefetch=16)
        await asyncio.wait_for(all_done.wait(), 60)
        await consumer.stop()
        assert sorted(handled) == list(range(200))


async def test_prefetch_oks_share_calls_and_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """With prefetch, handled messages' oks go out several to an ``ok_many`` call, at most
    two calls out at a time and at most 2 * (concurrency + prefetch) oks unanswered: while
    the oks are held back, the workers stop taking messages."""
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        await q.push_many(list(range(60)))
        real_ok_many = q.ok_many
        release = asyncio.Event()
        calls: list[int] = []
        out = 0
        most_out = 0

        async def held_ok_many(messages: list[Message]) -> list[bool]:
            nonlocal out, most_out
            calls.append(len(messages))
            out += 1
            most_out = max(most_out, out)
            await release.wait()
            out -= 1
            return await real_ok_many(messages)

        monkeypatch.setattr(q, "ok_many", held_ok_many)
        handled = 0
        reached = {14: asyncio.Event(), 60: asyncio.Event()}

        async def note(message: Message) -> None:
            nonlocal handled
            handled += 1
            if handled in reached:
                reached[handled].set()

        consumer = q.consume(note, concurrency=2, prefetch=4)
        try:
            # 2 * (concurrency + prefetch) = 12 oks unanswered, then each worker handles
            # one more and waits to hand its ok over
            await reached[14].wait()
            for _ in range(20):
                await asyncio.sleep(0)
            assert handled == 14 and most_out <= 2
        finally:
            release.set()
        await reached[60].wait()
        await consumer.stop()
        assert sum(calls) == 60 and max(calls) > 1 and most_out <= 2
        assert await q.total_size() == 0


async def test_bad_timeout_and_prefetch_are_refused() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        for bad in (0, -1, float("nan"), "1"):
            with pytest.raises(InvalidInputError):
                q.consume(print, timeout=bad)  # type: ignore[arg-type]
        for bad_prefetch in (-1, True, 1.5, 10**9):
            with pytest.raises(InvalidInputError):
                q.consume(print, prefetch=bad_prefetch)  # type: ignore[arg-type]


def test_settings_are_checked_before_a_queue_is_known_and_its_bound_once_it_is() -> None:
    """run_worker checks a handler's settings before connecting, when no queue's max_batch
    is known yet: it passed the prefetch itself as the bound (a check that could not fail)
    and checked every setting again per queue. The settings are checked without the bound
    (max_batch None), and the bound alone once each queue is open."""
    check_settings(4, timeout=1.0, prefetch=10**9, settled=False, max_batch=None)
    with pytest.raises(InvalidInputError, match="concurrency"):
        check_settings(0, prefetch=1, settled=False, max_batch=None)
    with pytest.raises(InvalidInputError, match="at most max_batch"):
        check_batch_bounds(prefetch=6, batch=0, max_batch=5)
    check_batch_bounds(prefetch=5, batch=0, max_batch=5)


async def test_run_worker_consumes_until_asked_to_stop() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("a")
        await q.push_many([1, 2, 3])
        await (await factory.queue("b")).push_many([4, 5])
        handled: list[int] = []
        stop = asyncio.Event()

        async def note(message: Message) -> None:
            handled.append(message.payload)
            if len(handled) == 5:
                stop.set()

        await asyncio.wait_for(
            aio_keuss.run_worker(note, ["a", "b"], factory=factory, concurrency=2, stop=stop),
            60,
        )
        assert sorted(handled) == [1, 2, 3, 4, 5]
        assert await q.resv_size() == 0
    with pytest.raises(InvalidInputError):
        await aio_keuss.run_worker(note, [])


def test_settings_flag_beats_environment_beats_file(tmp_path: Path) -> None:
    config = tmp_path / "w.toml"
    config.write_text(
        'handler = "file:h"\nqueues = ["from_file"]\nconcurrency = 2\ngrace = 5\n'
        '[options]\nprefix = "file"\nschema = "s"\n'
    )
    env = {"AIO_KEUSS_CONFIG": str(config), "AIO_KEUSS_CONCURRENCY": "3", "AIO_KEUSS_URL": "u"}
    settings = resolve({"concurrency": "4", "options": {"prefix": "flag"}}, env)
    assert settings.handler == "file:h" and settings.queues == ("from_file",)
    assert (settings.concurrency, settings.grace, settings.url) == (4, 5.0, "u")
    assert settings.connect_options() == {"prefix": "flag", "schema": "s", "url": "u"}
    assert resolve({"handler": "m:f", "queues": ["q"]}, {"AIO_KEUSS_QUEUE": "x,y"}).queues == ("q",)
    assert resolve({"handler": "m:f"}, {"AIO_KEUSS_QUEUE": "x, y"}).queues == ("x", "y")
    for flags, says in [
        ({"handler": "m:f", "queues": ["q"], "concurrency": "0"}, "concurrency"),
        ({"handler": "m:f", "queues": ["q"], "timeout": "soon"}, "timeout"),
        ({"handler": "m:f", "queues": ["q"], "log_level": "loud"}, "log_level"),
        ({"handler": "m:f"}, "no queue"),
        ({"queues": ["q"]}, "no handler"),
    ]:
        with pytest.raises(ConfigError, match=says):
            resolve(flags, {})


def test_prometheus_text_has_cumulative_buckets() -> None:
    durations = Histogram((0.1, 1.0))
    for seconds in (0.05, 0.5, 0.5, 3.0):
        durations.observe(seconds)
    text = prometheus_text(
        [QueueMetrics('a"b', "running", 3, 1, 0, 1, 0, 2, durations)], prefix="x"
    )
    assert 'x_handled_total{queue="a\\"b"} 3' in text
    assert 'x_handler_duration_seconds_bucket{queue="a\\"b",le="0.1"} 1' in text
    assert 'x_handler_duration_seconds_bucket{queue="a\\"b",le="1.0"} 3' in text
    assert 'x_handler_duration_seconds_bucket{queue="a\\"b",le="+Inf"} 4' in text
    assert 'x_handler_duration_seconds_count{queue="a\\"b"} 4' in text
    assert 'x_consumer_up{queue="a\\"b"} 1' in text
    assert KoResult.ROLLED_BACK  # the counters follow ko's outcome


async def test_run_worker_runs_a_pipeline_until_asked_to_stop() -> None:
    async with aio_keuss.connect("memory") as factory:
        await (await factory.queue("in")).push_many([1, 2, 3])
        stop = asyncio.Event()
        ended: list[int] = []

        async def double(message: Message) -> Forward:
            return Forward(payload=message.payload * 2)

        async def end(message: Message) -> None:
            ended.append(message.payload)
            if len(ended) == 3:
                stop.set()

        def build(opened: aio_keuss.Factory) -> Pipeline:
            return opened.pipeline("doubling").link("in", "out", double).sink("out", end)

        await asyncio.wait_for(
            aio_keuss.run_worker(pipeline=build, factory=factory, stop=stop, concurrency=2), 60
        )
        assert sorted(ended) == [2, 4, 6]
        assert list(await factory.pipelines()) == ["doubling"]
        with pytest.raises(InvalidInputError, match="not both"):
            await aio_keuss.run_worker(end, ["in"], pipeline=build, factory=factory)
        with pytest.raises(PipelineError, match="no module named 'nowhere_x'"):
            await aio_keuss.run_worker(pipeline="nowhere_x:build", factory=factory)


async def test_a_pipeline_builder_must_build_on_the_worker_s_factory() -> None:
    """A Pipeline given as such is refused when built on another factory; one returned by a
    builder (ignoring the factory it was given) ran there instead: on a backend the worker
    neither connected to nor closes, its stations out of the worker's reach."""
    async with (
        aio_keuss.connect("memory") as factory,
        aio_keuss.connect("memory") as other,
    ):

        async def forward(message: Message) -> Forward:
            return Forward()

        elsewhere = other.pipeline("elsewhere").link("in", "out", forward)
        stopped = asyncio.Event()
        stopped.set()  # else it runs until stopped: not a wait for the refusal
        for source in (elsewhere, lambda opened: elsewhere):
            with pytest.raises(PipelineError, match="built on another factory"):
                await aio_keuss.run_worker(pipeline=source, factory=factory, stop=stopped)
        assert await other.pipelines() == {} and await factory.pipelines() == {}


def test_settings_take_a_pipeline_instead_of_a_handler() -> None:
    assert resolve({"pipeline": "etl:build"}, {}).pipeline == "etl:build"
    assert resolve({}, {"AIO_KEUSS_PIPELINE": "etl.toml"}).pipeline == "etl.toml"
    with pytest.raises(ConfigError, match="not both"):
        resolve({"pipeline": "etl:build", "handler": "m:f", "queues": ["q"]}, {})


def test_replace_pipeline_comes_from_a_flag_the_environment_or_the_file(tmp_path: Path) -> None:
    """A boolean, off by default: the flag (``--no-replace-pipeline`` too) beats the
    environment, which beats the file; a value that is no boolean, or the setting without a
    pipeline, stops the command before it connects."""
    assert resolve({"pipeline": "etl:build"}, {}).replace_pipeline is False
    assert resolve({"pipeline": "etl:build", "replace_pipeline": True}, {}).replace_pipeline
    for text, wanted in [
        ("true", True), ("1", True), ("YES", True), (" on ", True),
        ("false", False), ("0", False), ("No", False), ("off", False), ("", False),
    ]:  # fmt: skip
        env = {"AIO_KEUSS_PIPELINE": "etl.toml", "AIO_KEUSS_REPLACE_PIPELINE": text}
        assert resolve({}, env).replace_pipeline is wanted, text
    env = {"AIO_KEUSS_REPLACE_PIPELINE": "true"}
    flags = {"pipeline": "etl:build", "replace_pipeline": False}
    assert resolve(flags, env).replace_pipeline is False  # --no-replace-pipeline
    config = tmp_path / "w.toml"
    config.write_text('[worker]\npipeline = "etl.toml"\nreplace_pipeline = true\n')
    assert resolve({"config": str(config)}, {}).replace_pipeline is True
    assert not resolve(
        {"config": str(config)}, {"AIO_KEUSS_REPLACE_PIPELINE": "0"}
    ).replace_pipeline
    for bad in ("maybe", "2", "truee", 1, 0.0):
        with pytest.raises(ConfigError, match="replace_pipeline must be true or false"):
            resolve({"pipeline": "etl:build", "replace_pipeline": bad}, {})
    with pytest.raises(ConfigError, match="--replace-pipeline is for a --pipeline worker"):
        resolve({"handler": "m:f", "queues": ["q"], "replace_pipeline": True}, {})
    flags = {"handler": "m:f", "queues": ["q"], "replace_pipeline": False}
    assert resolve(flags, {}).replace_pipeline is False


def test_the_worker_command_reads_replace_pipeline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parse = cli._parser().parse_args
    assert cli._flags(parse(["worker", "--pipeline", "p.toml"]))["replace_pipeline"] is None
    given = cli._flags(parse(["worker", "--pipeline", "p.toml", "--replace-pipeline"]))
    assert given["replace_pipeline"] is True
    given = cli._flags(parse(["worker", "--pipeline", "p.toml", "--no-replace-pipeline"]))
    assert given["replace_pipeline"] is False
    monkeypatch.setenv("AIO_KEUSS_REPLACE_PIPELINE", "sometimes")
    # exit 2, the value named, before the pipeline is imported or the backend reached
    args = ["worker", "--pipeline", "nowhere_x:build", "--backend", "postgres"]
    assert cli.main([*args, "--url", "postgresql://nobody@127.0.0.1:1/none"]) == 2
    assert "replace_pipeline must be true or false" in capsys.readouterr().err


async def test_run_worker_replaces_a_stored_pipeline_only_when_told_to() -> None:
    """A worker starting a changed pipeline (a station added) is refused while another
    topology is stored under its name, and stores its own with ``replace_pipeline``."""

    async def forward(message: Message) -> Forward:
        return Forward()

    async def end(message: Message) -> None:
        return None

    def old(opened: aio_keuss.Factory) -> Pipeline:
        return opened.pipeline("etl").link("in", "out", forward).sink("out", end)

    def new(opened: aio_keuss.Factory) -> Pipeline:
        return old(opened).sink("rejected", end)

    stop = asyncio.Event()
    stop.set()  # it starts the stations, then stops at once
    async with aio_keuss.connect("memory") as factory:
        await aio_keuss.run_worker(pipeline=old, factory=factory, stop=stop)
        with pytest.raises(PipelineError, match="--replace-pipeline"):
            await aio_keuss.run_worker(pipeline=new, factory=factory, stop=stop)
        assert (await factory.pipelines())["etl"] == old(factory).topology()
        await aio_keuss.run_worker(pipeline=new, factory=factory, stop=stop, replace_pipeline=True)
        assert (await factory.pipelines())["etl"] == new(factory).topology()
        with pytest.raises(InvalidInputError, match="replace_pipeline must be True or False"):
            await aio_keuss.run_worker(
                pipeline=new,
                factory=factory,
                stop=stop,
                replace_pipeline="no",  # type: ignore[arg-type]
            )
        with pytest.raises(InvalidInputError, match="replace_pipeline is for a pipeline"):
            await aio_keuss.run_worker(
                end, ["in"], factory=factory, stop=stop, replace_pipeline=True
            )


async def test_a_consumer_stopped_by_an_error_ends_the_worker_with_an_error() -> None:
    """A worker whose consumer stops on an error not worth retrying exits (1 for the
    command) rather than run on with a queue nobody consumes."""

    async def handle(message: Message) -> None:
        return None

    async def refused(*args: object, **kwargs: object) -> list[Message]:
        raise ConfigError("the store refuses this for good")

    async with aio_keuss.connect("memory") as factory:
        await (await factory.queue("a")).push(1)
        broken = await factory.queue("b")
        broken._next = refused  # type: ignore[method-assign]
        with pytest.raises(aio_keuss.ConsumerFailedError, match="'b'") as raised:
            await asyncio.wait_for(aio_keuss.run_worker(handle, ["a", "b"], factory=factory), 60)
        assert isinstance(raised.value.__cause__, ConfigError)
        assert await (await factory.queue("a")).size() == 0


async def test_a_queue_given_twice_to_a_worker_is_refused() -> None:
    async def handle(message: Message) -> None:
        return None

    stop = asyncio.Event()
    stop.set()  # without the check, run_worker would return at once rather than raise
    async with aio_keuss.connect("memory") as factory:
        with pytest.raises(InvalidInputError, match="more than once"):
            await aio_keuss.run_worker(handle, ["a", "b", "a"], factory=factory, stop=stop)
        assert not factory.open_queues()  # refused before any queue was opened
    for flags, env in [
        ({"handler": "m:f", "queues": ["a", "a"]}, {}),
        ({"handler": "m:f"}, {"AIO_KEUSS_QUEUE": "a, a"}),
    ]:
        with pytest.raises(ConfigError, match="more than once"):
            resolve(flags, env)


async def test_metrics_stay_enabled_until_the_last_worker_that_enabled_them_stops() -> None:
    observe.disable()

    async def handle(message: Message) -> None:
        return None

    async with aio_keuss.connect("memory") as factory:
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(
            aio_keuss.run_worker(handle, "a", factory=factory, health_port=0, stop=stop_a)
        )
        while observe.active is None:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        b = asyncio.create_task(
            aio_keuss.run_worker(handle, "b", factory=factory, health_port=0, stop=stop_b)
        )
        await asyncio.sleep(0.2)
        stop_a.set()
        await asyncio.wait_for(a, 30)
        assert observe.active is not None  # b still serves /metrics
        await (await factory.queue("b")).push_many([1, 2, 3])
        for _ in range(500):
            series = observe.active.series.get("b") if observe.active else None
            if series is not None and series.total("get", "reserve") == 3:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("worker b's deliveries were not counted")
        stop_b.set()
        await asyncio.wait_for(b, 30)
        assert observe.active is None


class _Abort(BaseException):
    """Neither an Exception nor a CancelledError: what some libraries raise to unwind."""


@pytest.mark.parametrize("raised", [_Abort("mine"), GeneratorExit()], ids=["own", "GeneratorExit"])
async def test_a_handler_raising_a_base_exception_fails_and_the_worker_goes_on(
    raised: BaseException,
) -> None:
    """A handler raising a BaseException that is not an Exception must fail its message (ko)
    like any exception: it used to end its worker silently, the message held until its
    reservation expired, and run_worker returned (exit 0) as if the queue had closed."""
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs", reserve_delay=600)
        seen: list[str] = []
        after = asyncio.Event()

        async def handler(message: Message) -> None:
            seen.append(message.payload)
            if message.payload == "poison":
                raise raised
            after.set()

        consumer = q.consume(handler, retry_delay=60.0)
        await q.push("poison")
        await q.push("after")
        await asyncio.wait_for(after.wait(), 30)
        await consumer.stop()
        assert consumer.failed == 1 and consumer.retried == 1 and consumer.handled == 1
        sizes = await q.sizes()
        assert (sizes.reserved, sizes.scheduled) == (0, 1)  # ko-ed with its backoff


async def test_run_worker_goes_on_past_a_handler_raising_a_base_exception() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs", reserve_delay=600)
        stop = asyncio.Event()

        async def handler(message: Message) -> None:
            if message.payload == "poison":
                raise GeneratorExit()
            stop.set()

        await q.push_many(["poison", "after"])
        running = aio_keuss.run_worker(handler, "jobs", factory=factory, stop=stop)
        await asyncio.wait_for(running, 30)
        assert stop.is_set()  # ended by the stop, not by its one worker dying
        assert (await q.sizes()).reserved == 0


async def test_a_handler_exception_whose_repr_raises_is_still_ko_ed() -> None:
    """The failures logged without a traceback keep ``repr(exc)``: one that raises must not
    keep the message from its ko (it stayed reserved until its reservation expired)."""

    class Ugly(Exception):
        def __repr__(self) -> str:
            raise ValueError("no repr")

        __str__ = __repr__

    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs", reserve_delay=600)
        failing = 0
        all_failed = asyncio.Event()

        async def handler(message: Message) -> None:
            nonlocal failing
            failing += 1
            if failing == 3:
                all_failed.set()
            raise Ugly()

        consumer = q.consume(handler, retry_delay=60.0)
        await q.push_many(["a", "b", "c"])
        await asyncio.wait_for(all_failed.wait(), 30)
        await consumer.stop()
        assert (consumer.failed, consumer.retried) == (3, 3)
        sizes = await q.sizes()
        assert (sizes.reserved, sizes.scheduled) == (0, 3)


async def test_a_batch_handler_taking_messages_off_its_list_still_acks_them_all() -> None:
    """A batch handler may consume the list it is given (``while messages: messages.pop()``):
    every message of the batch is still ok-ed when it returns, ko-ed when it raises."""
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs", reserve_delay=600)
        taken: list[str] = []
        batches = 0
        second = asyncio.Event()

        async def handler(messages: list[Message]) -> None:
            nonlocal batches
            batches += 1
            while messages:
                taken.append(messages.pop().payload)
            if batches == 2:
                second.set()
                raise RuntimeError("after taking them all")

        await q.push_many(["a", "b", "c"])
        consumer = q.consume(handler, batch=3, retry_delay=60.0)
        for _ in range(3000):
            if len(taken) == 3:
                break
            await asyncio.sleep(0.01)
        await q.push_many(["d", "e"])
        await asyncio.wait_for(second.wait(), 30)
        await consumer.stop()
        assert sorted(taken) == ["a", "b", "c", "d", "e"]
        assert (consumer.handled, consumer.failed, consumer.retried) == (3, 2, 2)
        sizes = await q.sizes()
        assert (sizes.reserved, sizes.scheduled, sizes.total) == (0, 2, 2)


async def test_a_bad_grace_is_refused_before_the_stop_begins() -> None:
    """``stop(grace=...)`` with a grace that is not seconds raised a TypeError from asyncio
    (or, for NaN, never returned) after the consumer had begun to stop: left half stopped,
    its running handler and prefetched messages held."""
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs", reserve_delay=600)
        await q.push_many(list(range(5)))
        started = asyncio.Event()

        async def block(message: Message) -> None:
            started.set()
            await asyncio.sleep(3600)

        consumer = q.consume(block, prefetch=2)
        await asyncio.wait_for(started.wait(), 30)
        for bad in ("1", -1.0, True, float("nan")):
            with pytest.raises(aio_keuss.InvalidDelayError):
                await asyncio.wait_for(consumer.stop(bad), 5)  # type: ignore[arg-type]
            assert consumer.state == "running"
        await consumer.stop(0)
        assert await q.resv_size() == 0


async def test_a_stop_waits_for_the_give_back_of_a_prefetched_message_past_its_time() -> None:
    """A prefetched message past half its reservation is given back rather than started; a
    stop that lands while that give-back is out waits for it, as for every other one: left
    running unowned, it could still be out as the queue's close gave the same reservation
    back once more (by then perhaps another consumer's, which the second give-back took),
    and the store could close under it."""
    async with aio_keuss.connect("memory", reserve_delay=0.2) as factory:
        q = await factory.queue("jobs")
        await q.push_many(["a", "b", "c"])
        started, go = asyncio.Event(), asyncio.Event()

        async def handler(message: Message) -> None:
            if message.payload == "a":
                started.set()
                await go.wait()

        consumer = q.consume(handler, concurrency=1, prefetch=2)  # a, b and c at once
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(0.2)  # b's reservation is half over well before this: at least
        store = q._store  # type: ignore[attr-defined]
        rollback = store.rollback
        entered, released = asyncio.Event(), asyncio.Event()

        async def slow_first(nacks: Any, plan: Any) -> Any:
            if entered.is_set():
                return await rollback(nacks, plan)
            entered.set()
            for _ in range(3000):  # the give-back of b lasts until the stop has begun
                if consumer._stopping and all(t.done() for t in consumer._workers):  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.01)
            try:
                return await rollback(nacks, plan)
            finally:
                released.set()

        store.rollback = slow_first
        go.set()  # a returns; b, past its time, is given back
        await asyncio.wait_for(entered.wait(), 30)
        await consumer.stop(grace=30)
        assert released.is_set()


@pytest.mark.parametrize(("flags", "code"), [([], 1), (["--watch", "5"], 0)])
def test_a_stats_cut_short_by_ctrl_c_exits_1_unless_it_watches(flags: list[str], code: int) -> None:
    """Only ``stats --watch`` ends with a Ctrl-C when all went well; a plain ``stats``
    interrupted before it printed was cut short, like any other command."""
    from aio_keuss.worker import admin, cli

    args = cli._parser().parse_args(["stats", "--backend", "memory", *flags])

    async def interrupted(*_: Any) -> int:
        raise KeyboardInterrupt

    args.run = interrupted
    assert admin.run(args, environ={}) == code


async def test_a_client_resetting_its_connection_is_no_error_of_the_health_endpoint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A probe that resets its connection (SO_LINGER 0, as some load balancers' TCP checks
    do) went away, as one that closes it does: it was logged as an error of ours, with a
    traceback, on every probe."""
    accepted: asyncio.Queue[None] = asyncio.Queue()
    served: asyncio.Queue[None] = asyncio.Queue()

    class Noted(HealthServer):
        async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.put_nowait(None)
            try:
                await super()._serve(reader, writer)
            finally:
                served.put_nowait(None)

    server = Noted(lambda: [], "127.0.0.1", 0)
    await server.start()
    try:
        with caplog.at_level(logging.INFO, logger="aio_keuss"):
            for sent in (b"", b"GET /heal"):
                _, writer = await asyncio.open_connection("127.0.0.1", server.port)
                if sent:
                    writer.write(sent)
                    await writer.drain()
                await asyncio.wait_for(accepted.get(), 30)  # reset once it is being read
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                await asyncio.wait_for(served.get(), 30)
    finally:
        await server.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_worker_consumes_the_deadletter_queue_with_its_queue_options() -> None:
    """The first queue opened opened the factory's deadletter queue too, with the defaults:
    consumed after it with ``queue_options``, the worker failed with a ConfigError."""
    async with aio_keuss.connect("memory", deadletter={"max_ko": 1}) as factory:
        stop = asyncio.Event()
        stop.set()  # it opens its queues and starts its consumers, then stops
        await asyncio.wait_for(
            aio_keuss.run_worker(
                print,
                ["jobs", "__deadletter__"],
                queue_options={"reserve_delay": 300},
                factory=factory,
                stop=stop,
            ),
            60,
        )
        dead = await factory.queue("__deadletter__")
        assert dead.options.reserve_delay == 300


async def _forward(message: Message) -> Forward:
    return Forward()


async def test_a_pipeline_worker_opens_its_queues_with_its_queue_options() -> None:
    """``run_worker(queue_options=...)`` are the defaults of every queue the worker opens as
    its own: a station's input and a queue the pipeline gives options for, whose own options
    win. They reached none of them (only the repeats' and the handlers' queues). A queue
    only moved into is opened as a move reaches it (another process may own it), and the
    stored topology is the pipeline's: the worker's options are no part of it."""
    stop = asyncio.Event()
    stop.set()  # it opens its queues and starts its stations, then stops
    async with aio_keuss.connect("memory") as factory:
        pipeline = (
            factory.pipeline("etl", queue_options={"clean": {"reserve_delay": 45}})
            .link("raw", "clean", _forward)
            .link("clean", "out", _forward)
        )
        tick = aio_keuss.Repeat("raw", "tick", 0, every=3600)  # opened as the run opens it
        await asyncio.wait_for(
            aio_keuss.run_worker(
                pipeline=pipeline,
                repeats=[tick],
                queue_options={"reserve_delay": 300, "max_batch": 50},
                factory=factory,
                stop=stop,
            ),
            60,
        )
        opened = {q.name: q.options for q in factory.open_queues()}
        wanted = {"raw": (300, 50), "clean": (45, 50), "out": (120, 1000)}
        assert {n: (opened[n].reserve_delay, opened[n].max_batch) for n in wanted} == wanted
        assert (await factory.pipelines())["etl"] == pipeline.topology()


async def test_a_pipeline_worker_checks_its_stations_against_its_queue_options() -> None:
    """A prefetch above the ``max_batch`` the worker's queue_options give a station's queue
    is refused before anything is opened or stored, as for a handler's queue."""
    stop = asyncio.Event()
    stop.set()
    async with aio_keuss.connect("memory") as factory:
        pipeline = factory.pipeline("narrow").link("raw", "out", _forward)
        with pytest.raises(PipelineError, match=r"station 'raw'.*max_batch \(5\)"):
            await aio_keuss.run_worker(
                pipeline=pipeline,
                prefetch=10,
                queue_options={"max_batch": 5},
                factory=factory,
                stop=stop,
            )
        assert await factory.pipelines() == {}
        assert factory.open_queues() == []


_DOWN = ["--backend", "redis-oq", "--url", "redis://127.0.0.1:1/0"]  # a closed port


def test_a_pipeline_file_naming_a_missing_handler_exits_2_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A handler of a ``--pipeline`` TOML file that cannot be imported is bad configuration
    (exit 2), found before the backend is reached: with the backend down it exited 3, as
    if restarting could help."""
    path = tmp_path / "etl.toml"
    path.write_text(
        'name = "etl"\n[[stations]]\nfrom = "raw"\nto = "clean"\nhandler = "nowhere_x.etl:clean"\n'
    )
    assert cli.main(["worker", "--pipeline", str(path), *_DOWN]) == 2
    err = capsys.readouterr().err
    assert "nowhere_x" in err and "cannot reach" not in err
    twice = tmp_path / "twice.toml"  # two stations on one input: the shape, checked too
    station = f'[[stations]]\nfrom = "raw"\nhandler = "{__name__}:_forward"\n'
    twice.write_text(f'name = "twice"\n{station}{station}name = "b"\n')
    assert cli.main(["worker", "--pipeline", str(twice), *_DOWN]) == 2
    assert "cannot reach" not in capsys.readouterr().err


async def test_run_worker_reads_a_pipeline_file_before_connecting(tmp_path: Path) -> None:
    path = tmp_path / "etl.toml"
    path.write_text(
        'name = "etl"\n[[stations]]\nfrom = "raw"\nhandler = "nowhere_x.etl:store"\n'
        "[queue_options.raw]\nreserve_delay = -1\n"
    )
    with pytest.raises(PipelineError, match="nowhere_x"):
        await aio_keuss.run_worker(
            pipeline=str(path), backend="redis-oq", url="redis://127.0.0.1:1/0"
        )
    path.write_text(
        f'name = "etl"\n[[stations]]\nfrom = "raw"\nhandler = "{__name__}:_forward"\n'
        "[queue_options.raw]\nreserve_delay = -1\n"
    )
    with pytest.raises(ConfigError, match="reserve_delay"):
        await aio_keuss.run_worker(
            pipeline=str(path), backend="redis-oq", url="redis://127.0.0.1:1/0"
        )
    doc = {"name": "etl", "stations": [{"from": "raw", "handler": "nowhere_x.etl:store"}]}
    with pytest.raises(PipelineError, match="nowhere_x"):
        await aio_keuss.run_worker(pipeline=doc, backend="redis-oq", url="redis://127.0.0.1:1/0")


def test_replace_pipeline_set_for_a_handler_worker_is_refused_saying_where_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Kept a refusal (a setting that would do nothing, as ``--queue`` beside ``--pipeline``),
    but the message named neither the variable nor the file it came from, nor a way out for
    an environment shared with a pipeline worker: ``--no-replace-pipeline``."""
    handler = ["worker", f"{__name__}:_forward", "--queue", "jobs", *_DOWN]
    monkeypatch.setenv("AIO_KEUSS_REPLACE_PIPELINE", "true")
    assert cli.main(handler) == 2
    err = capsys.readouterr().err
    assert "AIO_KEUSS_REPLACE_PIPELINE=true" in err and "runs no pipeline" in err
    assert "--no-replace-pipeline" in err and "cannot reach" not in err
    assert cli.main([*handler, "--no-replace-pipeline"]) == 3  # taken: the backend is down
    monkeypatch.delenv("AIO_KEUSS_REPLACE_PIPELINE")
    config = tmp_path / "w.toml"
    config.write_text("[worker]\nreplace_pipeline = true\n")
    assert cli.main([*handler, "--config", str(config)]) == 2
    assert f"replace_pipeline = true in {str(config)!r}" in capsys.readouterr().err
    assert cli.main([*handler[:4], "--replace-pipeline"]) == 2
    assert "--replace-pipeline is for" in capsys.readouterr().err
    monkeypatch.setenv("AIO_KEUSS_REPLACE_PIPELINE", "false")  # off: nothing to refuse
    assert cli.main(handler) == 3


async def test_one_sigterm_stops_workers_sharing_a_stop_event_gracefully() -> None:
    """Two ``run_worker`` side by side given the same ``stop`` event (one stop for the
    process) share the signal handler: a first SIGTERM sets that event for the first worker,
    and the second worker, seeing it set, took the signal as its second and stopped at once,
    cancelling its running handler instead of giving it its grace. A second SIGTERM still
    hurries both."""
    loop = asyncio.get_running_loop()
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the loop's signal handlers")
    release = asyncio.Event()
    started: list[str] = []
    ended: dict[str, str] = {}

    async def wait(message: Message) -> None:
        started.append(message.payload)
        try:
            await release.wait()
        except asyncio.CancelledError:
            ended[message.payload] = "cancelled"
            raise
        ended[message.payload] = "done"

    async def two_workers_running(
        factory: aio_keuss.Factory,
    ) -> tuple[asyncio.Event, asyncio.Future[Any]]:
        """Workers of queues a and b given one stop event, each running a handler."""
        await (await factory.queue("a")).push("a")
        await (await factory.queue("b")).push("b")
        stop = asyncio.Event()
        workers = asyncio.gather(
            aio_keuss.run_worker(wait, "a", factory=factory, grace=3600, stop=stop),
            aio_keuss.run_worker(wait, "b", factory=factory, grace=3600, stop=stop),
        )
        while len(started) < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        return stop, workers

    async with aio_keuss.connect("memory") as factory:
        stop, workers = await two_workers_running(factory)
        try:
            signal.raise_signal(signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), 30)
            (_, stops) = worker_run._signalled[loop]
            assert [now.is_set() for _, now in stops] == [False, False]  # not hurried
            release.set()
            await asyncio.wait_for(workers, 60)
        finally:
            release.set()
            stop.set()
            await asyncio.wait_for(asyncio.gather(workers, return_exceptions=True), 60)
        assert ended == {"a": "done", "b": "done"}
        assert loop not in worker_run._signalled

        # a second signal hurries every worker (each cancels its handler)
        started.clear()
        ended.clear()
        release.clear()
        stop, workers = await two_workers_running(factory)
        try:
            signal.raise_signal(signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), 30)
            signal.raise_signal(signal.SIGTERM)
            await asyncio.wait_for(workers, 60)
        finally:
            release.set()
            stop.set()
            await asyncio.wait_for(asyncio.gather(workers, return_exceptions=True), 60)
        assert ended == {"a": "cancelled", "b": "cancelled"}


async def test_the_signal_handlers_there_before_a_worker_are_there_after_it() -> None:
    """A worker installs its SIGTERM / SIGINT handlers while it runs, and removing them left
    the signals to their default action: an application's own handler (the loop's, or
    Python's, as ``asyncio.run`` sets for SIGINT) was gone once the worker returned, and
    the next SIGTERM killed the process instead of reaching it."""
    loop = asyncio.get_running_loop()
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the loop's signal handlers")
    heard: list[str] = []

    def python_level(signum: int, frame: object) -> None:
        heard.append("python")

    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    loop.add_signal_handler(signal.SIGTERM, heard.append, "loop")
    signal.signal(signal.SIGINT, python_level)
    try:
        async with aio_keuss.connect("memory") as factory:
            for _ in range(2):  # the second over what the first left
                stop = asyncio.Event()
                worker = asyncio.create_task(
                    aio_keuss.run_worker(lambda m: None, "a", factory=factory, stop=stop)
                )
                while loop not in worker_run._signalled:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                stop.set()
                await asyncio.wait_for(worker, 60)
                assert signal.getsignal(signal.SIGINT) is python_level
                assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # would kill
                signal.raise_signal(signal.SIGTERM)  # heard by the loop's handler
                while "loop" not in heard:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                heard.clear()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_a_config_file_s_settings_beside_its_worker_table_are_read_or_refused(
    tmp_path: Path,
) -> None:
    """TOML puts an ``[options]`` table written after ``[worker]`` at the top, beside it, as
    it does ``[[repeat]]`` tables: read as the worker's options, not dropped (the worker
    connected without its ``prefix`` or ``schema``, to other queues). A setting at the top
    beside ``[worker]`` (``backend`` above the table) was dropped too (the worker ran on
    ``memory``): now refused, as an unknown name is."""
    config = tmp_path / "w.toml"
    config.write_text(
        '[worker]\nhandler = "m:f"\nbackend = "redis-oq"\nqueues = ["jobs"]\n'
        '[options]\nprefix = "app"\n'
    )
    settings = resolve({"config": str(config)}, {})
    assert settings.connect_options() == {"prefix": "app"}
    both = tmp_path / "both.toml"
    both.write_text(
        '[worker]\nhandler = "m:f"\nqueues = ["jobs"]\n[worker.options]\nprefix = "a"\n'
        '[options]\nschema = "s"\n'
    )
    with pytest.raises(ConfigError, match=r"both \[options\] and \[worker.options\]"):
        resolve({"config": str(both)}, {})
    above = tmp_path / "above.toml"
    above.write_text('backend = "redis-oq"\n[worker]\nhandler = "m:f"\nqueues = ["jobs"]\n')
    with pytest.raises(ConfigError, match=r"'backend' outside \[worker\]"):
        resolve({"config": str(above)}, {})


@pytest.mark.parametrize("item", ["=1", " =1", "\t= x", "prefix"])
def test_an_option_flag_without_a_key_is_refused_saying_so(
    item: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--option ' =1'`` passed the KEY=VALUE check (a key of blanks) and, stripped, became
    an option named '' that the backend then refused as ``unknown option(s) for backend
    'memory': `` (no name); the worker and the admin commands now refuse it as they refuse
    ``=1``, naming the flag."""
    for argv in (["worker", "json:dumps", "--queue", "q"], ["list"]):
        assert cli.main([*argv, "--option", item]) == 2
        assert f"--option takes KEY=VALUE, not {item!r}" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["", "  "])
async def test_a_blank_health_host_is_refused_not_every_interface(host: str) -> None:
    """asyncio listens on every interface for a host of ``""``: an
    ``AIO_KEUSS_HEALTH_HOST=`` left blank in a unit or compose file served ``/healthz`` and
    ``/metrics`` on 0.0.0.0 and [::] instead of the default loopback, logged as
    ``http://:PORT``. Refused now (a ConfigError: the command's exit 2), before connecting;
    every interface is 0.0.0.0, said so."""
    server = HealthServer(lambda: [], host, 0)
    with pytest.raises(ConfigError, match=r"0\.0\.0\.0"):
        await server.start()
    await server.close()

    async def never(message: Message) -> None:
        raise AssertionError("nothing is consumed")

    with pytest.raises(ConfigError, match="health host"):
        await aio_keuss.run_worker(never, ["q"], health_port=0, health_host=host)


def test_a_config_file_giving_queue_and_queues_is_refused(tmp_path: Path) -> None:
    """``queue`` is read as ``queues`` in the file; given both, ``queue`` silently won, the
    queues of ``queues`` left unconsumed. Refused, as ``repeat`` beside ``repeats`` is."""
    config = tmp_path / "w.toml"
    config.write_text('handler = "m:f"\nqueues = ["a", "b"]\nqueue = "c"\n')
    with pytest.raises(ConfigError, match="queue or queues, not both"):
        resolve({"config": str(config)}, {})
