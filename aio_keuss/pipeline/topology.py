"""Pipelines from plain data: a dict, or a TOML file.

Handlers are named ``module:function`` and imported; nothing is evaluated from a string. ::

    name = "orders"
    acyclic = true

    [[stations]]
    from = "incoming"
    to = ["valid", "rejected"]      # a list: a choice; a string: a direct link; none: a sink
    handler = "myapp.etl:validate"
    concurrency = 4                  # and timeout, prefetch, retry_delay, max_retry_delay

    [queue_options.incoming]
    reserve_delay = 60

The same shape is what :meth:`Pipeline.topology` returns and what the backend stores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PipelineError
from ..loading import import_callable, read_toml
from ..options import QueueOptions
from .builder import Pipeline, _settings, check_shape, queues_of
from .links import STATION_SETTINGS, ChoiceLink, DirectLink, Link, Sink

if TYPE_CHECKING:
    from ..factory import Factory

_TOP = frozenset({"name", "acyclic", "stations", "queue_options", "queues"})
_STATION = frozenset({"name", "kind", "from", "to", "handler"}) | STATION_SETTINGS


def from_dict(factory: Factory, doc: Mapping[str, Any], *, name: str | None = None) -> Pipeline:
    """The pipeline ``doc`` describes (``name`` overrides the one it gives)."""
    described = _described(doc, name)
    pipeline = Pipeline(
        factory,
        described.name,
        acyclic=described.acyclic,
        queue_options=described.queue_options,
    )
    for link in described.links:  # checked as validate() checks them, by _described
        pipeline.add(link)
    return pipeline


def check(doc: Any, *, name: str | None = None) -> None:
    """Raise what :func:`from_dict` raises for ``doc`` without a backend: its shape, its
    stations (their handlers imported) and the values of its queue options. A worker checks
    a described pipeline so before it connects, so that a bad description (a handler that
    cannot be imported) is told from a backend out of reach."""
    described = _described(doc, name)
    for options in described.queue_options.values():
        QueueOptions().updated(dict(options))  # raises what factory.queue would


def load(factory: Factory, path: str) -> Pipeline:
    """The pipeline a TOML file describes (at the top level or under ``[pipeline]``)."""
    return from_dict(factory, read(path))


def read(path: str) -> dict[str, Any]:
    """The tables of a pipeline's TOML file, unchecked (see :func:`check`)."""
    return read_toml(path, "pipeline file", error=PipelineError)


@dataclass(frozen=True)
class _Description:
    name: str
    acyclic: bool
    queue_options: Mapping[str, Mapping[str, Any]]
    links: list[Link]


def _described(doc: Any, name: str | None) -> _Description:
    """``doc`` read and checked as far as no backend is needed."""
    if not isinstance(doc, Mapping):
        raise PipelineError(f"a pipeline description must be a table, not {type(doc).__name__}")
    doc = doc.get("pipeline", doc) if "stations" not in doc else doc
    if not isinstance(doc, Mapping):  # a [pipeline] that is no table
        raise PipelineError(f"a pipeline description must be a table, not {type(doc).__name__}")
    unknown = set(doc) - _TOP
    if unknown:
        raise PipelineError(f"pipeline description: unknown key(s) {sorted(unknown)}")
    title = name or doc.get("name")
    if not isinstance(title, str) or not title:
        raise PipelineError("pipeline description: a non-empty 'name' is needed")
    acyclic = doc.get("acyclic", False)
    if not isinstance(acyclic, bool):
        raise PipelineError(f"pipeline {title!r}: acyclic must be true or false")
    queue_options = doc.get("queue_options", {})
    if not isinstance(queue_options, Mapping) or not all(
        isinstance(o, Mapping) for o in queue_options.values()
    ):
        raise PipelineError(f"pipeline {title!r}: queue_options must be a table of tables")
    stations = doc.get("stations")
    if not isinstance(stations, list) or not stations:
        raise PipelineError(f"pipeline {title!r}: 'stations' must be a non-empty list")
    links = [_link(title, index, station) for index, station in enumerate(stations)]
    check_shape(title, links, acyclic, queue_options)
    queues = doc.get("queues")
    if queues is not None and (
        not isinstance(queues, list)
        or not all(isinstance(q, str) for q in queues)
        or sorted(queues) != sorted(queues_of(links))
    ):
        # what topology() writes: derived from the stations, so it must agree with them
        raise PipelineError(
            f"pipeline {title!r}: 'queues' must list its stations' queues {queues_of(links)},"
            f" not {queues!r}"
        )
    return _Description(title, acyclic, queue_options, links)


def _link(pipeline: str, index: int, station: Any) -> Link:
    if not isinstance(station, Mapping):
        raise PipelineError(f"pipeline {pipeline!r}: station #{index + 1} must be a table")
    source = station.get("from")
    label = station.get("name") or source or f"#{index + 1}"
    unknown = set(station) - _STATION
    if unknown:
        raise PipelineError(f"station {label!r}: unknown key(s) {sorted(unknown)}")
    if not isinstance(source, str):
        raise PipelineError(f"station {label!r}: 'from' must name its input queue")
    spec = station.get("handler")
    if not isinstance(spec, str):
        raise PipelineError(f"station {label!r}: 'handler' must be 'module:function'")
    handler = import_callable(spec, f"station {label!r}: handler", error=PipelineError)
    to = station.get("to")
    kind = station.get("kind") or (
        "sink" if to is None else "direct" if isinstance(to, str) else "choice"
    )
    name = station.get("name", "")
    settings = _settings({k: v for k, v in station.items() if k in STATION_SETTINGS}, label)
    common: dict[str, Any] = {"name": name, "settings": settings, "handler_spec": spec}
    if kind == "sink":
        if to not in (None, []):
            raise PipelineError(f"station {label!r}: a sink has no 'to'")
        return Sink(source, handler, **common)
    if kind == "direct":
        if isinstance(to, list) and len(to) == 1:
            to = to[0]
        if not isinstance(to, str):
            raise PipelineError(f"station {label!r}: a direct link's 'to' is one queue name")
        return DirectLink(source, to, handler, **common)
    if kind == "choice":
        if not isinstance(to, list) or not all(isinstance(t, str) for t in to):
            raise PipelineError(f"station {label!r}: a choice's 'to' is a list of queue names")
        return ChoiceLink(source, to, handler, **common)
    raise PipelineError(f"station {label!r}: kind must be direct, choice or sink, not {kind!r}")
