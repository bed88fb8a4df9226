"""``run_worker(repeats=...)`` and the worker's repeat settings, on the memory backend (the
command runs them against real servers in the acceptance tests, ``run_worker`` on every
backend in the conformance tests).

Occurrences come every 0.05 s. Nothing here asserts a time or a duration: the tests wait,
with generous bounds, for counts and states.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from own_servers import free_port

import aio_keuss
import aio_keuss.pipeline as aio_keuss_pipeline
from aio_keuss import Message, Repeat
from aio_keuss.errors import (
    ConfigError,
    ConsumerFailedError,
    InvalidDelayError,
    InvalidHeadersError,
    InvalidIdError,
    InvalidInputError,
    InvalidPayloadError,
    InvalidQueueNameError,
)
from aio_keuss.worker.health import health
from aio_keuss.worker.settings import parse_repeat, resolve

pytestmark = pytest.mark.timeout(120)

EVERY = 0.05
WAIT = 60.0


async def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not await condition():
        assert time.monotonic() < deadline, f"no {what} in {WAIT} s"
        await asyncio.sleep(0.01)


async def _nothing_more_pushed(q: aio_keuss.Queue) -> None:
    """Take what is left (the occurrence queued ahead included), then see nothing new come
    over several periods: the repeat has stopped."""
    deadline = time.monotonic() + WAIT
    while await _waiting(q):
        assert time.monotonic() < deadline
        await q.pop(timeout=1.0)
    await asyncio.sleep(10 * EVERY)
    assert await _waiting(q) == 0


async def _waiting(q: aio_keuss.Queue) -> int:
    """Messages ready or scheduled (not those a handler holds)."""
    sizes = await q.sizes()
    return sizes.size + sizes.scheduled


async def test_a_worker_consumes_the_occurrences_of_its_own_repeat() -> None:
    async with aio_keuss.connect("memory") as factory:
        handled: list[Message] = []
        stop = asyncio.Event()

        async def note(message: Message) -> None:
            handled.append(message)
            if len({m.id for m in handled}) >= 3:
                stop.set()

        tick = Repeat("jobs", "tick", {"n": 1}, every=EVERY, headers={"who": "worker"})
        await asyncio.wait_for(
            aio_keuss.run_worker(note, "jobs", repeats=[tick], factory=factory, stop=stop), WAIT
        )
        assert len({m.id for m in handled}) == len(handled) >= 3
        for message in handled:
            assert message.id.startswith("tick@") and message.payload == {"n": 1}
            assert message.headers["repeat"] == "tick" and message.headers["who"] == "worker"
        await _nothing_more_pushed(await factory.queue("jobs"))


async def test_a_worker_with_repeats_alone_only_schedules() -> None:
    """No handler and no queues: the occurrences are for consumers elsewhere (here, the test
    itself); repeats may target several queues."""
    async with aio_keuss.connect("memory") as factory:
        stop = asyncio.Event()
        repeats = [Repeat("a", "ta", 1, every=EVERY), Repeat("b", "tb", 2, every=EVERY)]
        worker = asyncio.ensure_future(
            aio_keuss.run_worker(repeats=repeats, factory=factory, stop=stop)
        )
        a, b = await factory.queue("a"), await factory.queue("b")
        got = [await a.pop(timeout=WAIT), await b.pop(timeout=WAIT)]
        assert [m.payload if m else None for m in got] == [1, 2]
        stop.set()
        await asyncio.wait_for(worker, WAIT)
        await _nothing_more_pushed(a)
        await _nothing_more_pushed(b)


async def test_repeats_stop_when_the_stop_begins_not_when_the_grace_ends() -> None:
    async with aio_keuss.connect("memory") as factory:
        stop, started, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def hold(message: Message) -> None:
            started.set()
            await release.wait()

        worker = asyncio.ensure_future(
            aio_keuss.run_worker(
                hold,
                "jobs",
                repeats=[Repeat("jobs", "tick", 0, every=EVERY)],
                factory=factory,
                stop=stop,
                grace=600,
            )
        )
        await asyncio.wait_for(started.wait(), WAIT)
        stop.set()
        await _nothing_more_pushed(await factory.queue("jobs"))
        assert not worker.done()  # still in its grace, the handler running
        release.set()
        await asyncio.wait_for(worker, WAIT)


async def test_a_stop_before_or_during_the_start_is_clean() -> None:
    async with aio_keuss.connect("memory") as factory:
        stop = asyncio.Event()
        stop.set()
        tick = Repeat("jobs", "tick", 0, every=EVERY)
        await asyncio.wait_for(
            aio_keuss.run_worker(print, "jobs", repeats=[tick], factory=factory, stop=stop), WAIT
        )
        q = await factory.queue("jobs")
        await _nothing_more_pushed(q)
        for steps in range(6):  # cancelled at each step of the start, and once running
            worker = asyncio.ensure_future(
                aio_keuss.run_worker(repeats=[tick], factory=factory, stop=asyncio.Event())
            )
            for _ in range(steps):
                await asyncio.sleep(0)
            worker.cancel()
            with pytest.raises(asyncio.CancelledError):
                await worker
            await _nothing_more_pushed(q)


BAD: list[tuple[Any, type[Exception]]] = [
    (Repeat("jobs", "k", 1), InvalidInputError),  # neither every nor cron
    (Repeat("jobs", "k", 1, every=1, cron="* * * * *"), InvalidInputError),
    (Repeat("jobs", "k", 1, every=0), InvalidDelayError),
    (Repeat("jobs", "k", 1, cron="61 * * * *"), InvalidInputError),
    (Repeat("jobs", "k", 1, cron="0 0 30 2 *"), InvalidInputError),  # no such date
    (Repeat("jobs", "k", 1, cron="0 3 * * *", tz="Nowhere/Town"), InvalidInputError),
    (Repeat("jobs", "k", 1, every=1, tz="Nowhere/Town"), InvalidInputError),
    (Repeat("jobs", "has space", 1, every=1), InvalidIdError),
    (Repeat("jobs", "k", float("nan"), every=1), InvalidPayloadError),
    (Repeat("jobs", "k", (1, 2), every=1), InvalidPayloadError),
    (Repeat("jobs", "k", 1, every=1, headers={"repeat": "x"}), InvalidHeadersError),
    (Repeat("jobs", "k", 1, every=1, headers={"a": [1]}), InvalidHeadersError),  # type: ignore[dict-item]
    (Repeat("a/b", "k", 1, every=1), InvalidQueueNameError),
]


@pytest.mark.parametrize(("spec", "error"), BAD)
async def test_a_bad_repeat_is_refused_before_anything_connects(
    spec: Repeat, error: type[Exception]
) -> None:
    """Against a port where nothing listens: a check made after connecting would raise
    KeussConnectionError instead."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(error):
        await aio_keuss.run_worker(print, "jobs", repeats=[spec], backend="redis-oq", url=url)
    with pytest.raises(error):
        await aio_keuss.run_worker(repeats=[spec], backend="redis-oq", url=url)


async def test_repeats_that_are_no_list_of_specs_or_name_one_twice_are_refused() -> None:
    tick = Repeat("jobs", "tick", 0, every=1)
    url = f"redis://127.0.0.1:{free_port()}/0"
    for repeats, says in [
        (tick, "list of Repeat"),
        ("jobs tick every=1", "list of Repeat"),
        ([{"queue": "jobs", "key": "tick", "every": 1}], "Repeat specs"),
        ([tick, Repeat("jobs", "tick", 1, cron="@daily")], "given twice"),
    ]:
        with pytest.raises(InvalidInputError, match=says):
            await aio_keuss.run_worker(repeats=repeats, backend="redis-oq", url=url)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="repeats alone"):  # a handler needs queues
        await aio_keuss.run_worker(print, repeats=[tick], backend="redis-oq", url=url)
    with pytest.raises(InvalidInputError, match="repeats alone"):  # and queues a handler
        await aio_keuss.run_worker(queues="jobs", repeats=[tick], backend="redis-oq", url=url)
    async with aio_keuss.connect("memory") as factory:  # a good one beside: nothing opened
        with pytest.raises(InvalidDelayError):
            bad = Repeat("other", "k", 0, every=-1)
            await aio_keuss.run_worker(print, "jobs", repeats=[tick, bad], factory=factory)
        assert not factory.open_queues()


async def test_a_repeat_stopped_by_an_error_not_worth_retrying_ends_the_worker() -> None:
    """As a consumer's failure does: a schedule that stopped quietly would go unserved."""

    async def refused(*args: object, **kwargs: object) -> str:
        raise ConfigError("the store refuses this for good")

    async with aio_keuss.connect("memory") as factory:
        (await factory.queue("b")).push = refused  # type: ignore[method-assign]
        with pytest.raises(ConsumerFailedError, match="repeat 'tb' on queue 'b'") as raised:
            await asyncio.wait_for(
                aio_keuss.run_worker(
                    print, "a", repeats=[Repeat("b", "tb", 0, every=EVERY)], factory=factory
                ),
                WAIT,
            )
        assert isinstance(raised.value.__cause__, ConfigError)


async def test_healthz_lists_the_repeats_and_counts_them() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        assert health([], [])[0] == 503  # nothing running is nothing healthy
        async with q.repeat("tick", 0, every=EVERY) as repeater:
            await _until(lambda: _true(repeater.pushed > 0), "push")
            status, body = health([], [repeater])
            assert status == 200
            (shown,) = orjson.loads(body)["repeats"]
            assert shown["queue"] == "jobs" and shown["key"] == "tick"
            assert shown["state"] == "running" and shown["pushed"] >= 1
            assert shown["next_at"].startswith(str(repeater.next_at.year))  # type: ignore[union-attr]
        assert health([], [repeater])[0] == 503  # stopped


async def _true(value: bool) -> bool:
    return value


def test_a_repeat_on_one_line() -> None:
    assert parse_repeat("jobs tick every=0.5") == Repeat("jobs", "tick", None, every=0.5)
    assert parse_repeat(
        'reports nightly  30 2 * * mon-fri tz=Europe/Madrid {"kind": "report", "n": [1, 2]}'
    ) == Repeat(
        "reports",
        "nightly",
        {"kind": "report", "n": [1, 2]},
        cron="30 2 * * mon-fri",
        tz="Europe/Madrid",
    )
    assert parse_repeat("jobs k @daily 7") == Repeat("jobs", "k", 7, cron="@daily")
    assert parse_repeat('jobs k every=60 "tz=x"').payload == "tz=x"  # JSON: a string
    for text, says in [
        ("jobs", "a queue, a key and a schedule are needed"),
        ("jobs k 0 3 * *", "five fields, not 4"),
        ("jobs k 0 0 3 * * * {}", r"payload '\* \{\}' is not JSON.*five fields"),
        ("jobs k every=soon", "'every=soon' is not a number of seconds"),
        ("jobs k every=0", "every must be a number of seconds in"),
        ("jobs k 61 * * * *", "minute field '61'"),
        ("jobs k @daily tz=Nowhere/Town", "not a known IANA time zone"),
        ('jobs k every=1 {"x": NaN}', "NaN"),
        ("jobs k every=1 [1,", "not JSON"),
        ("a/b k every=1", "invalid queue name"),
    ]:
        with pytest.raises(ConfigError, match=says):
            parse_repeat(text)


def test_repeat_settings_from_flags_environment_and_file(tmp_path: Path) -> None:
    config = tmp_path / "w.toml"
    config.write_text(
        '[worker]\nhandler = "m:f"\nqueues = ["jobs"]\n'
        '[[repeat]]\nqueue = "reports"\nkey = "nightly"\ncron = "30 2 * * *"\n'
        'tz = "Europe/Madrid"\npayload = {kind = "report"}\nheaders = {team = "ops"}\n'
        '[[repeat]]\nqueue = "jobs"\nkey = "tick"\nevery = 0.5\n'
    )
    from_file = resolve({"config": str(config)}, {}).repeats
    assert from_file == (
        Repeat(
            "reports",
            "nightly",
            {"kind": "report"},
            cron="30 2 * * *",
            tz="Europe/Madrid",
            headers={"team": "ops"},
        ),
        Repeat("jobs", "tick", None, every=0.5),
    )
    nested = tmp_path / "nested.toml"  # [[worker.repeat]] is the same
    nested.write_text(
        '[worker]\nhandler = "m:f"\nqueues = ["jobs"]\n'
        '[[worker.repeat]]\nqueue = "jobs"\nkey = "tick"\nevery = 0.5\n'
    )
    assert resolve({"config": str(nested)}, {}).repeats == from_file[1:]
    # a list, like queues: the layer that gives any gives all
    env = {"AIO_KEUSS_CONFIG": str(config), "AIO_KEUSS_REPEAT": "a t1 every=1\n\nb t2 @hourly\n"}
    assert [r.key for r in resolve({}, env).repeats] == ["t1", "t2"]
    assert [r.key for r in resolve({"repeats": ["c t3 every=2"]}, env).repeats] == ["t3"]
    # repeats alone: a worker that only schedules
    alone = resolve({"repeats": ["c t3 every=2"]}, {})
    assert (alone.handler, alone.queues, len(alone.repeats)) == ("", (), 1)
    with pytest.raises(ConfigError, match="no handler"):
        resolve({"queues": ["jobs"], "repeats": ["c t3 every=2"]}, {})
    with pytest.raises(ConfigError, match="no queue"):
        resolve({"handler": "m:f", "repeats": ["c t3 every=2"]}, {})


QK = 'queue = "q"\nkey = "k"\n'


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        (QK, "exactly one of every"),
        (QK + 'every = 1\ncron = "@daily"\n', "exactly one of every"),
        (QK + 'every = "60"\n', "every must be a number"),
        (QK + 'cron = "0 3 * *"\n', "cron expression"),
        (QK + 'every = 1\ntz = "Nowhere/Town"\n', "IANA time zone"),
        (QK + 'every = 1\nschedule = "x"\n', r"unknown setting\(s\) \['schedule'\]"),
        ('queue = "q"\nevery = 1\n', "no key"),
        (QK + "every = 1\npayload = 1979-05-27\n", "payload"),
        (QK + 'every = 1\nheaders = {repeat = "x"}\n', "headers"),
        (QK + "every = 1\n[[repeat]]\n" + QK + 'cron = "@daily"\n', "given twice"),
    ],
)
def test_a_bad_repeat_table_is_a_config_error(tmp_path: Path, toml: str, says: str) -> None:
    config = tmp_path / "w.toml"
    config.write_text(f'handler = "m:f"\nqueues = ["jobs"]\n[[repeat]]\n{toml}')
    with pytest.raises(ConfigError, match=says):
        resolve({"config": str(config)}, {})


def test_repeats_in_two_places_of_a_file_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "w.toml"
    table = 'queue = "q"\nkey = "k"\nevery = 1\n'
    config.write_text(f'[worker]\nhandler = "m:f"\n[[worker.repeat]]\n{table}[[repeat]]\n{table}')
    with pytest.raises(ConfigError, match="both"):
        resolve({"config": str(config)}, {})
    with pytest.raises(ConfigError, match="repeat must be a list"):
        resolve({"repeats": 5}, {})


async def test_a_repeat_into_a_pipeline_opens_its_queue_with_the_pipelines_options() -> None:
    """Opened with the worker's options instead, the pipeline's own open of that queue would
    be refused (one Queue per name, and other options)."""
    async with aio_keuss.connect("memory") as factory:
        stop = asyncio.Event()
        ended: list[int] = []

        async def double(message: Message) -> aio_keuss_pipeline.Forward:
            return aio_keuss_pipeline.Forward(payload=message.payload * 2)

        async def end(message: Message) -> None:
            ended.append(message.payload)
            if len(ended) >= 3:
                stop.set()

        def build(opened: aio_keuss.Factory) -> aio_keuss_pipeline.Pipeline:
            stations = opened.pipeline("doubling", queue_options={"in": {"reserve_delay": 30}})
            return stations.link("in", "out", double).sink("out", end)

        await asyncio.wait_for(
            aio_keuss.run_worker(
                pipeline=build,
                repeats=[Repeat("in", "tick", 21, every=EVERY)],
                queue_options={"reserve_delay": 5},
                factory=factory,
                stop=stop,
            ),
            WAIT,
        )
        assert set(ended) == {42}
        assert (await factory.queue("in")).options.reserve_delay == 30


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"concurrency": 0}, InvalidInputError),
        ({"concurrency": True}, InvalidInputError),
        ({"timeout": -1}, InvalidDelayError),
        ({"prefetch": -1}, InvalidInputError),
    ],
)
async def test_bad_consumer_settings_are_refused_before_anything_connects(
    settings: dict[str, Any], error: type[Exception]
) -> None:
    """Against a port where nothing listens: checked only as the consumers start, they
    raised KeussConnectionError instead (and, with a server there, after the repeats had
    pushed their first occurrences)."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    tick = Repeat("jobs", "tick", 0, every=60)
    with pytest.raises(error):
        await aio_keuss.run_worker(
            print, "jobs", repeats=[tick], backend="redis-oq", url=url, **settings
        )


async def test_a_prefetch_above_max_batch_is_refused_before_a_repeat_pushes() -> None:
    """A prefetch the queue's max_batch refuses is found once the queue is open, but before
    any repeat starts: the worker that raised left no occurrence behind."""
    tick = Repeat("jobs", "tick", 0, every=60)
    async with aio_keuss.connect("memory") as factory:
        with pytest.raises(InvalidInputError, match="max_batch"):
            await aio_keuss.run_worker(
                print,
                "jobs",
                repeats=[tick],
                factory=factory,
                prefetch=6,
                queue_options={"max_batch": 5},
            )
        assert await _waiting(await factory.queue("jobs")) == 0


async def test_a_station_prefetch_above_max_batch_is_refused_before_a_repeat_pushes() -> None:
    """The same for a pipeline: its stations' settings are checked before any repeat
    starts, not as the stations start."""

    async def end(message: Message) -> None:
        pass

    def build(opened: aio_keuss.Factory) -> aio_keuss_pipeline.Pipeline:
        stations = opened.pipeline("ending", queue_options={"in": {"max_batch": 5}})
        return stations.sink("in", end)

    async with aio_keuss.connect("memory") as factory:
        with pytest.raises(aio_keuss.PipelineError, match="max_batch"):
            await aio_keuss.run_worker(
                pipeline=build,
                repeats=[Repeat("in", "tick", 0, every=60)],
                factory=factory,
                prefetch=6,
            )
        assert await _waiting(await factory.queue("in", max_batch=5)) == 0


async def test_a_pipeline_stored_with_another_topology_is_refused_before_a_repeat_pushes() -> None:
    """Another release's topology under the pipeline's name refuses the start: found once the
    worker is connected, but before any repeat starts, so the refused worker left no
    occurrence behind (as for the other refusals above)."""

    async def end(message: Message) -> None:
        pass

    def build(opened: aio_keuss.Factory) -> aio_keuss_pipeline.Pipeline:
        return opened.pipeline("ending").sink("in", end)

    async with aio_keuss.connect("memory") as factory:
        await factory.pipeline("ending").link("in", "out", end).save()
        with pytest.raises(aio_keuss.PipelineError, match="another topology"):
            await aio_keuss.run_worker(
                pipeline=build, repeats=[Repeat("in", "tick", 0, every=60)], factory=factory
            )
        assert await _waiting(await factory.queue("in")) == 0
        stored = (await factory.pipelines())["ending"]
        assert [station["kind"] for station in stored["stations"]] == ["direct"]


async def test_a_repeat_does_not_open_the_deadletter_queue_under_a_pipeline_s_options() -> None:
    """The repeat's queue opened first opened the deadletter queue too, with the defaults:
    the pipeline's options for it were then refused, after the repeat had pushed."""
    async with aio_keuss.connect("memory", deadletter={"max_ko": 1}) as factory:
        stop = asyncio.Event()

        async def fix(message: Message) -> aio_keuss_pipeline.Forward:
            return aio_keuss_pipeline.Forward()

        async def end(message: Message) -> None:
            stop.set()

        def build(opened: aio_keuss.Factory) -> aio_keuss_pipeline.Pipeline:
            options = {"__deadletter__": {"reserve_delay": 45}}
            stations = opened.pipeline("repair", queue_options=options)
            return stations.link("__deadletter__", "in", fix).sink("in", end)

        await asyncio.wait_for(
            aio_keuss.run_worker(
                pipeline=build,
                repeats=[Repeat("in", "tick", 0, every=EVERY)],
                factory=factory,
                stop=stop,
            ),
            WAIT,
        )
        assert (await factory.queue("__deadletter__")).options.reserve_delay == 45


async def test_a_repeat_into_the_deadletter_queue_opens_it_with_the_worker_s_options() -> None:
    """The consumed queue opened first opened the deadletter queue too, with the defaults:
    the repeat's open of it with the worker's queue_options was then refused (ConfigError:
    already open), after the consumer had started."""
    async with aio_keuss.connect("memory", deadletter={"max_ko": 1}) as factory:
        stop = asyncio.Event()

        async def handle(message: Message) -> None:
            stop.set()

        await asyncio.wait_for(
            aio_keuss.run_worker(
                handle,
                "in",
                repeats=[
                    Repeat("in", "tick", 0, every=EVERY),
                    Repeat("__deadletter__", "tock", 0, every=EVERY),
                ],
                factory=factory,
                queue_options={"reserve_delay": 45},
                stop=stop,
            ),
            WAIT,
        )
        assert (await factory.queue("__deadletter__")).options.reserve_delay == 45


@pytest.mark.parametrize(
    "spec",
    [
        Repeat("jobs", "k", float("nan"), every=1, headers={"a": [1]}),  # type: ignore[dict-item]
        Repeat("jobs", "k", (1, 2), cron="* * * * *", headers={1: "x"}),  # type: ignore[dict-item]
    ],
)
async def test_check_raises_what_queue_repeat_raises_for_input_bad_twice(spec: Repeat) -> None:
    """A payload and headers both bad: ``check()`` names the same fault ``q.repeat`` does."""
    factory = await aio_keuss.connect("memory")
    try:
        q = await factory.queue(spec.queue)
        with pytest.raises(InvalidInputError) as by_queue:
            q.repeat(spec.key, spec.payload, every=spec.every, cron=spec.cron, headers=spec.headers)
        with pytest.raises(InvalidInputError) as by_check:
            spec.check()
        assert type(by_check.value) is type(by_queue.value)
    finally:
        await factory.close()
