"""Conformance: pipelines (stations that move messages on atomically) on every backend that
claims ``move``; the others refuse them. Time bounds are generous functional limits."""

from __future__ import annotations

import asyncio
import logging
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Connect, needs

import aio_keuss
from aio_keuss import Message
from aio_keuss.pipeline import (
    ChoiceLink,
    DirectLink,
    Drop,
    Forward,
    Pipeline,
    Sink,
    StationSettings,
    from_dict,
    load,
)

pytestmark = pytest.mark.timeout(120)


async def _until(check: Callable[[], Any], seconds: float = 60.0) -> None:
    """Wait for ``check()`` to hold (polled; a generous bound, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await check() if asyncio.iscoroutinefunction(check) else not check():
        assert loop.time() < deadline, "the pipeline did not get there in time"
        await asyncio.sleep(0.02)


async def test_a_pipeline_takes_every_message_through_its_stations(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    stored: list[Message] = []

    def validate(message: Message) -> Forward:  # a plain function works too
        return Forward(to="valid" if message.payload["n"] % 4 else 1)

    async def enrich(message: Message) -> Forward:
        return Forward(payload={**message.payload, "rich": True}, headers={"enriched": True})

    async def store(message: Message) -> None:
        stored.append(message)

    pipeline = (
        factory.pipeline("orders", acyclic=True)
        .choice("incoming", ["valid", "rejected"], validate)
        .link("valid", "enriched", enrich)
        .sink("enriched", store, concurrency=2)
    )
    incoming = await factory.queue("incoming")
    rejected = await factory.queue("rejected")
    await incoming.push_many([{"n": n} for n in range(40)], headers={"origin": "web"})

    async def done() -> bool:
        return len(stored) == 30 and await rejected.size() == 10

    async with pipeline.run(concurrency=3) as running:
        await _until(done)
        assert [s.state for s in running.status()] == ["running"] * 3
    assert sorted(m.payload["n"] for m in stored) == [n for n in range(40) if n % 4]
    assert all(m.payload["rich"] for m in stored)
    assert all(m.headers == {"origin": "web", "enriched": True} for m in stored)
    assert all(m.tries == 0 for m in stored)  # each station's delivery starts afresh
    assert await rejected.size() == 10  # no station consumes it: an end of the pipeline
    for name in ("incoming", "valid", "enriched"):
        assert await (await factory.queue(name)).total_size() == 0
    assert (await incoming.stats())["commit"] == 40


async def test_a_station_that_fails_retries_with_backoff_then_deadletters(
    connect: Connect,
) -> None:
    factory = await connect(poll_interval=5.0, deadletter={"max_ko": 2})
    needs(factory, "move")
    attempts: dict[Any, int] = {}

    async def flaky(message: Message) -> Forward:
        n = message.payload
        attempts[n] = attempts.get(n, 0) + 1
        if n == "poison" or attempts[n] == 1:
            raise RuntimeError(f"cannot handle {n} yet")
        return Forward()

    pipeline = factory.pipeline("retrying").link("in", "out", flaky)
    await (await factory.queue("in")).push_many(["a", "b", "poison"])
    out = await factory.queue("out")
    dead = await factory.queue("__deadletter__")
    async with pipeline.run(retry_delay=0.01, max_retry_delay=0.05):

        async def settled() -> bool:
            return await out.size() == 2 and await dead.size() == 1

        await _until(settled)
    assert attempts == {"a": 2, "b": 2, "poison": 3}
    left = await dead.pop(timeout=5)
    assert left is not None and left.payload == "poison"


async def test_a_bad_answer_is_a_pipeline_error_naming_the_station(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    factory = await connect(poll_interval=5.0, deadletter={"max_ko": 1})
    needs(factory, "move")

    async def confused(message: Message) -> Any:
        if message.payload == "number":
            return 42
        if message.payload == "elsewhere":
            return Forward(to="nowhere")
        return Forward(to=0, payload=float("nan"))  # cannot be stored

    pipeline = factory.pipeline("confused").choice("in", ["left", "right"], confused, name="picker")
    await (await factory.queue("in")).push_many(["number", "elsewhere", "nan"])
    dead = await factory.queue("__deadletter__")
    with caplog.at_level(logging.DEBUG, logger="aio_keuss"):
        async with pipeline.run(retry_delay=0.01, max_retry_delay=0.02):

            async def all_dead() -> bool:
                return await dead.size() == 3

            await _until(all_dead)
    text = "\n".join(
        r.getMessage() + repr(r.exc_info[1] if r.exc_info else None) for r in caplog.records
    )
    assert "PipelineError" in text
    assert "station 'picker'" in text
    for queue in ("left", "right"):
        assert await (await factory.queue(queue)).total_size() == 0


async def test_a_delay_the_backend_cannot_keep_is_a_pipeline_error_naming_the_station(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``Forward(delay=...)`` on a backend without delays (redis-reliable) is an answer the
    station cannot carry out, as a destination it does not lead to: a PipelineError naming
    the station, not the queue's bare NotSupportedError."""
    factory = await connect(poll_interval=5.0, deadletter={"max_ko": 0})
    needs(factory, "move")
    if factory.capabilities.delay:
        pytest.skip("this backend keeps delays")

    async def later(message: Message) -> Forward:
        return Forward(delay=5)

    pipeline = factory.pipeline("later").link("in", "out", later, name="delayer")
    await (await factory.queue("in")).push("a")
    dead = await factory.queue("__deadletter__")
    with caplog.at_level(logging.DEBUG, logger="aio_keuss"):
        async with pipeline.run(retry_delay=0.01, max_retry_delay=0.02):

            async def in_deadletter() -> bool:
                return await dead.size() == 1

            await _until(in_deadletter)
    failures = [r for r in caplog.records if "handler failed" in r.getMessage()]
    assert failures and all("PipelineError" in r.getMessage() for r in failures)
    assert all("station 'delayer'" in r.getMessage() for r in failures)
    assert await (await factory.queue("out")).total_size() == 0


async def test_drop_ends_a_message_anywhere_and_a_cycle_can_be_left(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    laps: list[int] = []

    async def around(message: Message) -> Any:
        laps.append(message.payload)
        if message.payload >= 3:
            return Drop
        return Forward(payload=message.payload + 1)

    async def back(message: Message) -> Forward:
        return Forward()

    pipeline = factory.pipeline("loop").link("a", "b", around).link("b", "a", back)
    await (await factory.queue("a")).push(0)
    async with pipeline.run():
        await _until(lambda: laps[-1:] == [3])
    assert laps == [0, 1, 2, 3]
    for name in ("a", "b"):
        assert await (await factory.queue(name)).total_size() == 0


async def test_the_topology_is_stored_for_every_process(connect: Connect, case: Any) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    pipeline = (
        factory.pipeline("etl", queue_options={"raw": {"reserve_delay": 45}})
        .link("raw", "clean", _forward, concurrency=4)
        .sink("clean", _forward_nothing)
    )
    await (await factory.queue("raw", reserve_delay=45)).push("r")
    async with pipeline.run():
        pass
    other = await connect(poll_interval=5.0) if case.shared else factory
    listed = await other.pipelines(sizes=True)
    assert list(listed) == ["etl"]
    etl = listed["etl"]
    assert etl["queues"] == ["raw", "clean"]
    assert etl["stations"][0] == {
        "name": "raw",
        "kind": "direct",
        "from": "raw",
        "to": ["clean"],
        "handler": f"{__name__}:_forward",
        "concurrency": 4,
    }
    assert etl["queue_options"] == {"raw": {"reserve_delay": 45}}
    assert set(etl["sizes"]) == {"raw", "clean"}
    assert await other.remove_pipeline("etl") and not await other.remove_pipeline("etl")
    assert await factory.pipelines() == {}


async def test_a_pipeline_stored_with_another_topology_is_refused_until_replaced(
    connect: Connect, case: Any
) -> None:
    """A second process starting a pipeline of the same name with another definition wrote
    its topology over the first one's, silently: the last one to start won. Starting, or
    saving, a pipeline whose stored topology differs is refused; the same one is taken;
    ``save(replace=True)``, or a start with ``run(replace=True)``, replaces it deliberately."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    first = factory.pipeline("etl").link("raw", "clean", _forward).sink("clean", _forward_nothing)
    async with first.run():
        pass
    other = await connect(poll_interval=5.0) if case.shared else factory

    def changed() -> Pipeline:
        return (
            other.pipeline("etl")
            .link("raw", "clean", _forward, concurrency=3)
            .sink("clean", _forward_nothing)
        )

    with pytest.raises(aio_keuss.PipelineError, match="'etl' is stored with another") as refused:
        async with changed().run():
            pass
    # the refusal names every way out: in code, for a worker, by hand
    for way in ("replace=True", "--replace-pipeline", "aio-keuss remove-pipeline etl"):
        assert way in str(refused.value)
    with pytest.raises(aio_keuss.PipelineError, match="'etl' is stored with another"):
        await changed().save()
    assert (await other.pipelines())["etl"] == first.topology()
    same = other.pipeline("etl").link("raw", "clean", _forward).sink("clean", _forward_nothing)
    async with same.run():
        pass
    await changed().save(replace=True)
    assert (await factory.pipelines())["etl"] == changed().topology()
    async with changed().run():
        pass

    def added() -> Pipeline:  # a station more: what a release changing the pipeline starts
        return changed().sink("raw-dead", _forward_nothing)

    with pytest.raises(aio_keuss.PipelineError, match="'etl' is stored with another"):
        async with added().run():
            pass
    async with added().run(replace=True):  # the start replaces it, as save(replace=True)
        pass
    assert (await factory.pipelines())["etl"] == added().topology()
    async with added().run(replace=True):  # the same one again: taken
        pass
    with pytest.raises(aio_keuss.PipelineError, match="'etl' is stored with another"):
        async with changed().run():  # the old definition is now the one refused
            pass


async def test_a_run_whose_start_was_refused_can_be_started_again(connect: Connect) -> None:
    """A start refused (here: another topology stored under the pipeline's name) left the
    run marked as running: once the way was cleared, starting that same run again said
    "already running" and nothing could start it."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    first = factory.pipeline("etl").link("raw", "clean", _forward).sink("clean", _forward_nothing)
    await first.save()
    changed = (
        factory.pipeline("etl")
        .link("raw", "clean", _forward, concurrency=3)
        .sink("clean", _forward_nothing)
    )
    run = changed.run()
    with pytest.raises(aio_keuss.PipelineError, match="'etl' is stored with another"):
        await run.start()
    assert run.consumers == []
    assert await factory.remove_pipeline("etl")
    await run.start()
    try:
        assert len(run.consumers) == 2
        with pytest.raises(aio_keuss.PipelineError, match="already running"):
            await run.start()
    finally:
        await run.stop(0.0)


async def test_a_run_whose_station_failed_to_start_is_not_left_marked_running(
    connect: Connect,
) -> None:
    """A station whose consumer could not start (its queue closed) once an earlier one had
    started: the run was stopped but stayed marked as running, so starting it again said
    "already running" (a PipelineError) rather than why it cannot start."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    pipeline = factory.pipeline("etl").link("raw", "clean", _forward).sink("clean", _forward)
    run = pipeline.run()
    queues = await run._prepare()  # what start opens (a worker opens them first too)
    await queues["clean"].close()  # the second station's queue: its consumer cannot start
    with pytest.raises(aio_keuss.ClosedError, match="'clean' is closed"):
        await run.start()
    assert run.consumers == []  # the first station, started, was stopped and let go
    await run.start()  # the factory opens the closed queue afresh: the run starts
    assert len(run.consumers) == 2
    await run.stop(0.0)


async def _forward(message: Message) -> Forward:
    return Forward()


async def _forward_nothing(message: Message) -> None:
    return None


async def test_a_declared_pipeline_runs_from_a_toml_file(
    connect: Connect, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    token = tmp_path.name.replace("-", "_")
    (tmp_path / f"stations_{token}.py").write_text(
        textwrap.dedent(
            """
            from aio_keuss.pipeline import Drop, Forward

            seen = []

            def triage(message):
                return Forward(to="big" if message.payload > 9 else "small")

            async def double(message):
                return Forward(payload=message.payload * 2)

            async def keep(message):
                seen.append(message.payload)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = tmp_path / "orders.toml"
    spec.write_text(
        textwrap.dedent(
            f"""
            [pipeline]
            name = "declared"
            acyclic = true

            [[pipeline.stations]]
            from = "numbers"
            to = ["big", "small"]
            handler = "stations_{token}:triage"

            [[pipeline.stations]]
            name = "doubler"
            from = "small"
            to = "doubled"
            handler = "stations_{token}:double"
            concurrency = 2

            [[pipeline.stations]]
            from = "doubled"
            handler = "stations_{token}:keep"
            """
        )
    )
    pipeline = load(factory, str(spec))
    assert [link.kind for link in pipeline.links] == ["choice", "direct", "sink"]
    await (await factory.queue("numbers")).push_many(list(range(15)))
    module = __import__(f"stations_{token}")
    big = await factory.queue("big")

    async def done() -> bool:
        return len(module.seen) == 10 and await big.size() == 5

    async with pipeline.run():
        await _until(done)
    assert sorted(module.seen) == [2 * n for n in range(10)]
    stored = (await factory.pipelines())["declared"]
    assert stored["stations"][1]["handler"] == f"stations_{token}:double"
    assert from_dict(factory, stored).topology()["stations"] == stored["stations"]


async def test_backends_that_cannot_move_refuse_pipelines(connect: Connect, case: Any) -> None:
    factory = await connect(poll_interval=5.0)
    if factory.capabilities.move:
        pytest.skip("this backend moves atomically")
    pipeline = factory.pipeline("nope").link("a", "b", _forward).sink("b", _forward_nothing)
    says = "hash_tag=" if "cluster" in case.id else "cannot move"
    with pytest.raises(aio_keuss.NotSupportedError, match=f"'nope'.*{says}"):
        async with pipeline.run():
            pass
    # save() stored a topology no process of this backend can run (listed, drawn)
    for replace in (False, True):
        with pytest.raises(aio_keuss.NotSupportedError, match=f"'nope'.*{says}"):
            await pipeline.save(replace=replace)
    assert await factory.pipelines() == {}  # refused before anything was stored


async def test_bad_pipeline_input_is_refused_before_anything_is_opened_or_stored(
    connect: Connect,
) -> None:
    """A run setting no station can take, queue options ``factory.queue`` would refuse, a
    name no backend can store: a PipelineError (an aio_keuss ConfigError) before a queue is
    opened or the topology stored. The run's settings were checked only after both."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")

    def built() -> aio_keuss.pipeline.Pipeline:
        return factory.pipeline("checked").link("in", "out", _forward).sink("out", _forward)

    for settings in (
        {"concurrency": 0},
        {"timeout": -1},
        {"timeout": 0},
        {"retry_delay": float("nan")},
        {"prefetch": 10**6},
        {"prefetch": True},
    ):
        with pytest.raises(aio_keuss.PipelineError):
            async with built().run(**settings):
                pass
    for options in ({"in": 5}, {"in": "xy"}, {"in": {"max_batch": 0}}, {"in": {"nope": 1}}, [1]):
        with pytest.raises(aio_keuss.ConfigError):
            factory.pipeline("checked", queue_options=options)  # type: ignore[arg-type]
    # a truthy "false" refused cycles and was stored as it was (a description says no)
    for acyclic in ("false", "no", 1, None):
        with pytest.raises(aio_keuss.PipelineError, match="acyclic"):
            factory.pipeline("checked", acyclic=acyclic)  # type: ignore[arg-type]
    for name in ("", "a\x00b", "a\ud800b", "x" * 129, 5):
        with pytest.raises(aio_keuss.PipelineError):
            factory.pipeline(name)  # type: ignore[arg-type]
        if name == "x" * 129:  # one stored before names were bounded can still be removed
            assert not await factory.remove_pipeline(name)
            continue
        with pytest.raises(aio_keuss.PipelineError):
            await factory.remove_pipeline(name)  # type: ignore[arg-type]
    assert await factory.pipelines() == {}
    assert not {"in", "out"} & set(await factory.list())


async def test_listing_pipelines_keeps_the_options_recorded_for_their_queues(
    connect: Connect, case: Any
) -> None:
    # pipelines(sizes=True) (the admin command, the dashboard) opened every queue of every
    # pipeline with the lister's defaults and recorded them over the options the pipeline's
    # process had recorded: a listing changed what list() (and the admin commands) read.
    owner = await connect(poll_interval=5.0)
    needs(owner, "move")
    if not case.shared:
        pytest.skip("one factory's queues only")
    pipeline = owner.pipeline("kept", queue_options={"raw": {"reserve_delay": 45}}).link(
        "raw", "clean", _forward
    )
    await owner.queue("clean", reserve_delay=600)
    async with pipeline.run():
        pass
    lister = await connect(poll_interval=5.0)
    listed = await lister.pipelines(sizes=True)
    assert set(listed["kept"]["sizes"]) == {"raw", "clean"}
    recorded = await lister.list()
    assert (recorded["raw"]["reserve_delay"], recorded["clean"]["reserve_delay"]) == (45, 600)


async def test_a_pipeline_keeps_the_options_another_process_recorded_for_its_end_queues(
    connect: Connect, case: Any
) -> None:
    # A queue no station consumes is only moved into: its run recorded the pipeline
    # factory's defaults over the options the process consuming it had recorded, which a
    # Queue.move into it no longer does.
    owner = await connect(poll_interval=5.0)
    needs(owner, "move")
    if not case.shared:
        pytest.skip("one factory's queues only")
    await owner.queue("rejected", reserve_delay=600.0)
    mover = await connect(poll_interval=5.0)
    pipeline = mover.pipeline("ends").choice("incoming", ["valid", "rejected"], _forward_first)
    async with pipeline.run():
        pass
    recorded = await mover.list()
    assert recorded["rejected"]["reserve_delay"] == 600.0
    assert {"incoming", "valid"} <= set(recorded)


async def _forward_first(message: Message) -> Forward:
    return Forward(to=0)


async def test_options_for_a_queue_open_with_others_are_refused_before_anything_is_written(
    connect: Connect,
) -> None:
    # run.check() passed, then start() opened and recorded the queues before the one this
    # factory had open with other options, and failed there with a ConfigError: the queue
    # record was written (and a worker's repeats had pushed, since it trusts check()).
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    await factory.queue("late", reserve_delay=30)
    pipeline = (
        factory.pipeline("clash", queue_options={"late": {"reserve_delay": 45}})
        .link("early", "late", _forward)
        .sink("late", _forward_nothing)
    )
    with pytest.raises(aio_keuss.PipelineError, match=r"'late'.*already open"):
        pipeline.run().check()
    with pytest.raises(aio_keuss.PipelineError, match=r"'late'.*already open"):
        async with pipeline.run():
            pass
    assert "early" not in await factory.list()
    assert await factory.pipelines() == {}
    same = factory.pipeline("same", queue_options={"late": {"reserve_delay": 30}})
    async with same.link("early", "late", _forward).run():  # the options it is open with
        pass


async def test_options_for_a_queue_outside_the_pipeline_are_refused(connect: Connect) -> None:
    # they were stored with the topology and never applied: a misspelt queue's options
    # (``[queue_options.incomming]``) were silently ignored
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    pipeline = factory.pipeline("typo", queue_options={"incomming": {"reserve_delay": 45}}).link(
        "incoming", "out", _forward
    )
    with pytest.raises(aio_keuss.PipelineError, match=r"'incomming'.*not one of its queues"):
        pipeline.validate()
    with pytest.raises(aio_keuss.PipelineError, match="'incomming'"):
        async with pipeline.run():
            pass
    doc = {
        "name": "typo",
        "stations": [{"from": "incoming", "to": "out", "handler": f"{__name__}:_forward"}],
        "queue_options": {"incomming": {"reserve_delay": 45}},
    }
    with pytest.raises(aio_keuss.PipelineError, match="'incomming'"):
        from_dict(factory, doc)
    assert await factory.pipelines() == {}
    assert not {"incoming", "out", "incomming"} & set(await factory.list())


async def test_save_refuses_the_station_settings_run_refuses(connect: Connect) -> None:
    # save() checked the shape only: a station's settings that run() refuses were stored
    # with the topology, and one that is no JSON raised a bare TypeError from the encoder
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    for settings in ({"concurrency": 0}, {"prefetch": 10**9}, {"timeout": object()}):
        pipeline = factory.pipeline("saved").link("in", "out", _forward, **settings)
        with pytest.raises(aio_keuss.PipelineError, match="station 'in'"):
            await pipeline.save()
    assert await factory.pipelines() == {}
    await factory.pipeline("saved").link("in", "out", _forward, concurrency=2).save()
    assert list(await factory.pipelines()) == ["saved"]


async def test_empty_queue_options_check_prefetch_against_the_open_queue(connect: Connect) -> None:
    # queue_options={"a": {}} opens "a" as it is open already (max_batch 5 here), but check()
    # measured the prefetch against the defaults' max_batch: it passed, and start() refused
    # the station only after opening the queues and storing the topology
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    await factory.queue("narrow", max_batch=5)
    pipeline = factory.pipeline("wide", queue_options={"narrow": {}}).link("narrow", "b", _forward)
    with pytest.raises(aio_keuss.PipelineError, match=r"station 'narrow'.*max_batch \(5\)"):
        pipeline.run(prefetch=10).check()
    with pytest.raises(aio_keuss.PipelineError, match=r"station 'narrow'.*max_batch \(5\)"):
        async with pipeline.run(prefetch=10):
            pass
    assert await factory.pipelines() == {}
    assert "b" not in await factory.list()


async def test_a_station_on_the_deadletter_queue_runs_with_the_options_given_for_it(
    connect: Connect,
) -> None:
    # The first queue a run opened opened the factory's deadletter queue too, with the
    # defaults: options given for it then failed the start with a ConfigError, once the
    # topology was stored and the queues before it opened
    factory = await connect(poll_interval=5.0, deadletter={"max_ko": 1})
    needs(factory, "move")
    pipeline = (
        factory.pipeline("repair", queue_options={"__deadletter__": {"reserve_delay": 45}})
        .link("in", "out", _forward)
        .link("__deadletter__", "in", _forward, name="repair")
    )
    async with pipeline.run():
        pass
    assert (await factory.queue("__deadletter__")).options.reserve_delay == 45


async def test_a_pipeline_worker_on_a_backend_that_cannot_repeat_stores_nothing(
    connect: Connect,
) -> None:
    # a worker refused because its repeats cannot run here had stored its pipeline's
    # topology first (the start that fails writes nothing, as for the other refusals)
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    if factory.capabilities.idempotent and factory.capabilities.delay:
        pytest.skip("this backend can repeat")
    pipeline = factory.pipeline("ticking").link("in", "out", _forward)
    tick = aio_keuss.Repeat("in", "tick", 0, every=60)
    with pytest.raises(aio_keuss.NotSupportedError, match="cannot repeat"):
        await aio_keuss.run_worker(pipeline=pipeline, repeats=[tick], factory=factory)
    assert await factory.pipelines() == {}


async def test_a_closed_factory_refuses_to_store_or_list_pipelines(
    connect: Connect, case: Any
) -> None:
    # after close, save() and a run's start stored the topology anyway (on Redis over a new
    # connection that nothing closed), and listing or removing raised what each backend
    # raises on a closed client, if anything: not the ClosedError every other call raises
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    pipeline = factory.pipeline("late").link("in", "out", _forward)
    await factory.close()
    for call in (
        pipeline.save,
        pipeline.run().start,
        factory.pipelines,
        lambda: factory.remove_pipeline("late"),
    ):
        with pytest.raises(aio_keuss.ClosedError):
            await call()
    if case.shared:
        assert await (await connect()).pipelines() == {}


async def test_stations_built_by_hand_take_their_settings_as_the_builder_does(
    connect: Connect,
) -> None:
    """``DirectLink(src, dst, handler, concurrency=...)`` (the README's stations take the
    builder's settings): a TypeError before; and a ``settings`` or ``handler_spec`` of the
    wrong type is a PipelineError before anything is stored (an AttributeError once the run
    began, or a handler name of 5 stored with the topology)."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "move")
    pipeline = factory.pipeline("by-hand").add(
        DirectLink("in", "out", _forward, concurrency=2, timeout=30)
    )
    pipeline.add(Sink("out", _forward_nothing, name="end", prefetch=1))
    pipeline.add(ChoiceLink("x", ["y", "z"], _forward, max_retry_delay=5))
    async with pipeline.run() as running:
        assert [s.concurrency for s in running.status()] == [2, 1, 1]
    stations = (await factory.pipelines())["by-hand"]["stations"]
    assert [(s.get("concurrency"), s.get("timeout")) for s in stations] == [
        (2, 30),
        (None, None),
        (None, None),
    ]
    assert stations[1]["prefetch"] == 1 and stations[2]["max_retry_delay"] == 5
    for bad in (
        lambda: DirectLink("a", "b", _forward, concurency=2),
        lambda: DirectLink("a", "b", _forward, settings={"concurrency": 2}),  # type: ignore[arg-type]
        lambda: DirectLink(
            "a", "b", _forward, settings=StationSettings(concurrency=2), concurrency=3
        ),
        lambda: Sink("a", _forward, handler_spec=5),  # type: ignore[arg-type]
        lambda: ChoiceLink("a", ["b"], _forward, handler_spec="no function"),
    ):
        with pytest.raises(aio_keuss.PipelineError):
            bad()
    assert set(await factory.pipelines()) == {"by-hand"}
