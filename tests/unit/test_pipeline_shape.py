"""Pipelines refused before they run, with errors naming the station (memory backend)."""

from __future__ import annotations

from typing import Any

import pytest

import aio_keuss
from aio_keuss import Message, PipelineError
from aio_keuss.pipeline import ChoiceLink, DirectLink, Drop, Forward, Sink, from_dict


async def _noop(message: Message) -> Any:
    return Forward()


@pytest.fixture
async def factory() -> Any:
    async with aio_keuss.connect("memory") as opened:
        yield opened


async def test_a_cycle_is_refused_when_declared_acyclic(factory: aio_keuss.Factory) -> None:
    pipeline = (
        factory.pipeline("loop", acyclic=True)
        .link("a", "b", _noop)
        .choice("b", ["c", "a"], _noop, name="router")
        .sink("c", _noop)
    )
    with pytest.raises(PipelineError, match=r"acyclic.*'(router|a)'.*a -> b -> a|b -> a -> b"):
        pipeline.validate()
    with pytest.raises(PipelineError, match="acyclic"):
        async with pipeline.run():
            pass
    factory.pipeline("loop-ok").link("a", "b", _noop).link("b", "a", _noop).validate()


async def test_stations_competing_or_named_twice_are_refused(factory: aio_keuss.Factory) -> None:
    pipeline = factory.pipeline("p").link("a", "b", _noop, name="first")
    with pytest.raises(PipelineError, match="'first' and 'second' both consume 'a'"):
        pipeline.link("a", "c", _noop, name="second")
    with pytest.raises(PipelineError, match="two stations are named 'first'"):
        pipeline.sink("b", _noop, name="first")
    with pytest.raises(PipelineError, match=r"station 'x'.*its own input"):
        pipeline.link("x", "x", _noop)
    with pytest.raises(PipelineError, match="station 'bad name'"):
        pipeline.link("bad name", "y", _noop)
    with pytest.raises(PipelineError, match=r"station 'c'.*unknown setting"):
        pipeline.sink("c", _noop, concurency=3)
    with pytest.raises(PipelineError, match=r"station 'd'.*non-empty list"):
        pipeline.choice("d", "e", _noop)
    with pytest.raises(PipelineError, match=r"station 'f'.*callable"):
        pipeline.sink("f", "module:function")  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="no stations"):
        factory.pipeline("empty").validate()


def test_each_link_checks_what_its_handler_returned() -> None:
    direct = DirectLink("a", "b", _noop, name="step")
    assert direct.settle(Forward()).destination == "b"
    assert direct.settle(Forward(to="b", delay=2)).delay == 2
    assert direct.settle(Drop).destination is None
    with pytest.raises(PipelineError, match=r"station 'step'.*returned 42"):
        direct.settle(42)
    assert direct.settle(Forward(to=0)).destination == "b"
    for not_an_index in (False, 0.0):  # equal to 0, but not its index
        with pytest.raises(PipelineError, match=r"station 'step'.*forwarded to"):
            direct.settle(Forward(to=not_an_index))  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match=r"station 'step'.*forwarded to 'c'"):
        direct.settle(Forward(to="c"))
    choice = ChoiceLink("a", ["b", "c"], _noop)
    assert choice.settle(Forward(to=1)).destination == "c"
    assert choice.settle(Forward(to="b")).destination == "b"
    for wrong in (Forward(), Forward(to=2), Forward(to=True), Forward(to="d"), None):
        with pytest.raises(PipelineError, match="station 'a'"):
            choice.settle(wrong)
    sink = Sink("z", _noop)
    assert sink.settle(None).destination is None and sink.settle(Drop).destination is None
    with pytest.raises(PipelineError, match=r"station 'z'.*a sink forwards nothing"):
        sink.settle(Forward())


async def test_descriptions_are_checked_and_name_the_station(factory: aio_keuss.Factory) -> None:
    good = {"name": "p", "stations": [{"from": "a", "handler": f"{__name__}:_noop"}]}
    assert [link.kind for link in from_dict(factory, good).links] == ["sink"]
    cases = [
        ({"stations": []}, "name"),
        ({"name": "p", "stations": []}, "non-empty list"),
        ({"name": "p", "stations": [{"from": "a"}], "extra": 1}, "unknown key"),
        ({"name": "p", "stations": [{"from": "a"}]}, "station 'a'.*handler"),
        (
            {"name": "p", "stations": [{"from": "a", "handler": "no_such_module_x:f"}]},
            "station 'a'.*no module named 'no_such_module_x'",
        ),
        (
            {"name": "p", "stations": [{"from": "a", "handler": f"{__name__}:missing"}]},
            "station 'a'.*has no attribute 'missing'",
        ),
        (
            {"name": "p", "stations": [{"from": "a", "handler": "os:sep"}]},
            "station 'a'.*not callable",
        ),
        (
            {"name": "p", "stations": [{"from": "a", "to": 3, "handler": f"{__name__}:_noop"}]},
            "station 'a'.*list of queue names",
        ),
        (
            {
                "name": "p",
                "stations": [{"from": "a", "kind": "fan", "handler": f"{__name__}:_noop"}],
            },
            "station 'a'.*kind must be",
        ),
        (
            {"name": "p", "stations": [{"name": "s", "from": "a", "handler": "print()"}]},
            "station 's'.*module:function",
        ),
    ]
    for doc, says in cases:
        with pytest.raises(PipelineError, match=says):
            from_dict(factory, doc)


async def test_a_closed_factory_makes_no_pipeline(factory: aio_keuss.Factory) -> None:
    await factory.close()
    with pytest.raises(aio_keuss.ClosedError):
        factory.pipeline("late")


@pytest.mark.parametrize("name", ["a\x00b", "a\ud800", "tab\there"])
async def test_a_station_name_that_cannot_be_stored_is_refused(
    factory: aio_keuss.Factory, name: str
) -> None:
    """The topology is stored (PostgreSQL: jsonb, which refuses \\u0000; a lone surrogate is
    no JSON): such a name is refused when the station is added, on every backend."""
    with pytest.raises(PipelineError, match="printable"):
        factory.pipeline("p").sink("a", _noop, name=name)


async def test_a_pipeline_key_that_is_no_table_is_a_pipeline_error(
    factory: aio_keuss.Factory,
) -> None:
    """``{"pipeline": 5}`` (a TOML ``pipeline = 5``) raised a bare TypeError."""
    for bad in (5, None, "orders"):
        with pytest.raises(PipelineError, match="must be a table"):
            from_dict(factory, {"pipeline": bad})


@pytest.mark.parametrize("name", [0, [], False])
async def test_a_station_name_that_is_no_str_is_refused(
    factory: aio_keuss.Factory, name: Any
) -> None:
    """A falsy name of another type (``name = 0`` in a TOML file) was taken for "no name"
    and the station silently named after its input queue."""
    with pytest.raises(PipelineError, match="station name must be a str"):
        factory.pipeline("p").sink("a", _noop, name=name)
    doc = {"name": "p", "stations": [{"name": name, "from": "a", "handler": f"{__name__}:_noop"}]}
    with pytest.raises(PipelineError, match="station name must be a str"):
        from_dict(factory, doc)


async def test_a_description_s_queues_must_be_its_stations_queues(
    factory: aio_keuss.Factory,
) -> None:
    """``queues`` (what ``topology()`` writes, read back) was accepted whatever it held and
    ignored: a list naming a queue no station touches, or no list at all."""
    stations = [{"from": "a", "to": "b", "handler": f"{__name__}:_noop"}]
    read_back = from_dict(factory, {"name": "p", "stations": stations}).topology()
    assert from_dict(factory, read_back).topology() == read_back
    assert from_dict(factory, {"name": "p", "stations": stations, "queues": ["b", "a"]})
    for queues in (["a", "b", "c"], ["a"], 5, "a", [1, 2]):
        with pytest.raises(PipelineError, match="queues"):
            from_dict(factory, {"name": "p", "stations": stations, "queues": queues})


async def test_a_station_name_of_none_is_no_name(factory: aio_keuss.Factory) -> None:
    """None is "no name given" (a JSON ``"name": null``, as a null ``kind`` or ``to`` is
    read as absent): the station is named after its input queue, as it always was."""
    unnamed: Any = None
    assert factory.pipeline("p").sink("a", _noop, name=unnamed).links[0].name == "a"
    doc = {"name": "p", "stations": [{"name": None, "from": "a", "handler": f"{__name__}:_noop"}]}
    assert from_dict(factory, doc).links[0].name == "a"


async def test_a_replace_that_is_no_bool_is_refused_before_anything_is_stored(
    factory: aio_keuss.Factory,
) -> None:
    """``replace="no"`` is truthy: taken as such, it would write over a stored topology."""
    pipeline = factory.pipeline("p").link("a", "b", _noop).sink("b", _noop)
    for given in ("no", 1, None):
        with pytest.raises(PipelineError, match="replace must be True or False"):
            pipeline.run(replace=given)  # type: ignore[arg-type]
        with pytest.raises(PipelineError, match="replace must be True or False"):
            await pipeline.save(replace=given)  # type: ignore[arg-type]
    assert await factory.pipelines() == {}
