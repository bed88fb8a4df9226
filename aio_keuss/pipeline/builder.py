"""``factory.pipeline(name)``: stations linked into a pipeline, run like ``consume()``.

Each station is a consumer of its input queue whose handler's answer is settled in one
atomic step: forwarded with ``Queue.move`` (the message leaves the input and enters the next
queue together, with a new payload if the handler gave one) or acknowledged. A crash
anywhere leaves every message in exactly one queue: the one it was in (to be handled
again, at-least-once for the handler) or the next one, never both and never neither.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import shlex
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import orjson

from ..consumer import Consumer, ConsumerStatus, Handler, check_settings
from ..contract import Move
from ..errors import InvalidInputError, NotSupportedError, PipelineError
from ..message import Message
from ..options import check_queue_name
from . import graph
from .links import (
    ChoiceLink,
    DirectLink,
    Link,
    Sink,
    StationSettings,
    station_settings,
)
from .steps import Settlement

if TYPE_CHECKING:
    from ..factory import Factory
    from ..queue import Queue

log = logging.getLogger("aio_keuss.pipeline")


class Pipeline:
    """Stations over the queues of one factory. Build it with :meth:`link`, :meth:`choice`
    and :meth:`sink` (each returns the pipeline, so calls chain), then ``async with
    pipeline.run(concurrency=...)``. ``acyclic``: refuse topologies with a cycle.
    ``queue_options``: options of the queues by name (``reserve_delay``, ``max_batch``...),
    used when the run opens them."""

    def __init__(
        self,
        factory: Factory,
        name: str,
        *,
        acyclic: bool = False,
        queue_options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.factory = factory
        self.name = check_pipeline_name(name)
        self.acyclic = _checked_acyclic(self.name, acyclic)
        self.queue_options = _checked_queue_options(factory, queue_options)
        self._links: list[Link] = []

    def __repr__(self) -> str:
        return f"<Pipeline {self.name!r}: {len(self._links)} stations>"

    @property
    def links(self) -> tuple[Link, ...]:
        return tuple(self._links)

    @property
    def queues(self) -> list[str]:
        """Every queue the pipeline touches, inputs first, in the order they were added."""
        return queues_of(self._links)

    def add(self, link: Link) -> Pipeline:
        """Add a station built by hand (:class:`DirectLink`, :class:`ChoiceLink`, :class:`Sink`)."""
        if not isinstance(link, Link):
            raise PipelineError(f"pipeline {self.name!r}: expected a Link, not {link!r}")
        graph.check(self.name, [*self._links, link], acyclic=False)
        self._links.append(link)
        return self

    def link(
        self, source: str, destination: str, handler: Handler, *, name: str = "", **settings: Any
    ) -> Pipeline:
        """A station taking ``source``'s messages on to ``destination``."""
        return self.add(
            DirectLink(
                source,
                destination,
                handler,
                name=name,
                settings=_settings(settings, name or source),
            )
        )

    def choice(
        self,
        source: str,
        destinations: Sequence[str],
        handler: Handler,
        *,
        name: str = "",
        **settings: Any,
    ) -> Pipeline:
        """A station sending each message to the one of ``destinations`` its handler picks."""
        return self.add(
            ChoiceLink(
                source,
                destinations,
                handler,
                name=name,
                settings=_settings(settings, name or source),
            )
        )

    def sink(self, source: str, handler: Handler, *, name: str = "", **settings: Any) -> Pipeline:
        """A station where messages end: acknowledged once its handler returns."""
        return self.add(
            Sink(source, handler, name=name, settings=_settings(settings, name or source))
        )

    def validate(self) -> None:
        """Raise :class:`PipelineError` when the pipeline cannot run as built."""
        check_shape(self.name, self._links, self.acyclic, self.queue_options)

    def topology(self) -> dict[str, Any]:
        """The pipeline as plain data (what is stored in the backend and what
        :func:`from_dict` reads back, with handlers named ``module:function``)."""
        return {
            "name": self.name,
            "acyclic": self.acyclic,
            "stations": [_station_doc(link) for link in self._links],
            "queues": self.queues,
            "queue_options": self.queue_options,
        }

    async def save(self, *, replace: bool = False) -> None:
        """Store the topology in the backend, where any process can list it
        (``factory.pipelines()``); ``run`` does it when it starts.

        A pipeline is one definition shared by every process running it: one stored under
        this name with another topology (another process's, or an earlier release's) is
        not overwritten but refused with :class:`PipelineError`, as a queue's recorded
        options are; the same topology is taken as it is. ``replace`` stores this one
        over it, deliberately (as ``factory.remove_pipeline`` then a start does, or
        ``run(replace=True)``)."""
        replace = _checked_replace(replace)
        self._check_moves()  # a topology no process of this backend could run: not stored
        self.stations()  # a station's settings are stored too: what run refuses is not
        await self._store(replace)

    def _check_moves(self) -> None:
        """Refuse, with :class:`NotSupportedError`, a backend that cannot move a message
        between queues atomically: a station could not hand its messages on there."""
        factory = self.factory
        if not factory.capabilities.move:
            hint = ""
            if getattr(factory.backend, "cluster", False):
                hint = " (on Redis Cluster, connect with hash_tag= to keep its queues in one slot)"
            raise NotSupportedError(
                f"pipeline {self.name!r}: backend {factory.backend_name!r} cannot move a "
                f"message between queues atomically{hint}"
            )

    async def _store(self, replace: bool) -> None:
        """``save``'s write, for a caller that checked the stations already (a run's start)."""
        self.factory._check_open()
        topology = self.topology()
        store = self.factory.stats_store
        if replace:
            await store.save_pipeline(self.name, topology)
            return
        stored = await store.keep_pipeline(self.name, topology)
        if stored != orjson.loads(orjson.dumps(topology)):  # as read back from the store
            raise PipelineError(
                f"pipeline {self.name!r} is stored with another topology ({stored}); this "
                f"one ({topology}) is not written over it. To replace it: save(replace=True)"
                " or run(replace=True) in code, --replace-pipeline (AIO_KEUSS_REPLACE_PIPELINE"
                "=true) for a worker, or remove it first with aio-keuss remove-pipeline"
                f" {shlex.quote(self.name)} (factory.remove_pipeline) and start again"
            )

    def stations(
        self,
        defaults: StationSettings | None = None,
        *,
        queue_defaults: Mapping[str, Any] | None = None,
    ) -> list[tuple[Link, dict[str, Any]]]:
        """Check the pipeline and each station's settings (over ``defaults``, a run's; None:
        ``consume``'s) as ``consume`` checks them, and the queue options (over
        ``queue_defaults``, a run's) against those its queues are open with, opening
        nothing; returns each station with its settings."""
        self.validate()
        factory = self.factory
        queue_defaults = _checked_queue_defaults(factory, queue_defaults)
        given_defaults = defaults.given() if defaults is not None else {}
        stations = [(link, {**given_defaults, **link.settings.given()}) for link in self.links]
        opened = factory._claimed_options()
        for name in self.queues:  # what factory.queue refuses once others are opened
            given = self._opened_with(name, queue_defaults)
            found = opened.get(name)
            if given and found is not None and found != factory.defaults_for(name).updated(given):
                raise PipelineError(
                    f"pipeline {self.name!r}: queue {name!r} is already open with {found},"
                    f" not the options the run opens it with {given}"
                )
        for link, settings in stations:  # every setting checked before a queue is opened
            given = self._opened_with(link.source, queue_defaults)
            # no options (None or {}): the queue as it is open, as factory.queue returns it
            options = opened.get(link.source) if not given else None
            if options is None:
                options = factory.defaults_for(link.source).updated(given or {})
            try:
                check_settings(**settings, settled=True, max_batch=options.max_batch)
            except InvalidInputError as exc:
                raise PipelineError(f"station {link.name!r}: {exc}") from exc
        return stations

    def _opened_with(self, name: str, queue_defaults: Mapping[str, Any]) -> dict[str, Any] | None:
        """The options a run opens queue ``name`` with: a station's input, or a queue the
        pipeline gives options for, with ``queue_defaults`` under the pipeline's own (empty:
        as the queue is open already, as ``factory.queue`` returns it); None for a queue
        only moved into, opened as a move reaches it, keeping the options another process
        (the one consuming it) recorded."""
        given = self.queue_options.get(name)
        if given is None and all(link.source != name for link in self._links):
            return None
        return {**queue_defaults, **(given or {})}

    def run(
        self,
        concurrency: int = 1,
        *,
        timeout: float | None = None,
        prefetch: int = 0,
        retry_delay: float = 1.0,
        max_retry_delay: float = 60.0,
        replace: bool = False,
        queue_defaults: Mapping[str, Any] | None = None,
    ) -> PipelineRun:
        """Start every station (``async with``, or ``await run.start()``): each with
        ``concurrency`` workers unless it says otherwise; the other arguments are those
        of ``Queue.consume``, again per station unless it says otherwise. ``replace``: the
        start stores this topology over another one stored under the pipeline's name (as
        ``save(replace=True)``) instead of refusing to start; for the release that changes
        the pipeline. ``queue_defaults``: queue options (``reserve_delay``...) for every
        queue the run opens as its own (a station's input, a queue ``queue_options`` names),
        under the pipeline's ``queue_options`` for it: a worker's ``queue_options``. They
        are the run's, not the pipeline's: not stored with the topology, so two releases
        differing only in them share it."""
        defaults = StationSettings(concurrency, timeout, prefetch, retry_delay, max_retry_delay)
        return PipelineRun(self, defaults, replace=replace, queue_defaults=queue_defaults)


class PipelineRun:
    """The running stations of a pipeline; stop it like a consumer. ``replace`` and
    ``queue_defaults``: what :meth:`Pipeline.run` says."""

    def __init__(
        self,
        pipeline: Pipeline,
        defaults: StationSettings,
        *,
        replace: bool = False,
        queue_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.defaults = defaults
        self.replace = _checked_replace(replace)
        self.queue_defaults = _checked_queue_defaults(pipeline.factory, queue_defaults)
        self.consumers: list[Consumer] = []
        self._started = False
        self._queues: dict[str, Queue] | None = None  # stored and opened (see _prepare)

    def check(self) -> list[tuple[Link, dict[str, Any]]]:
        """Check the pipeline and every station's settings, opening nothing: what ``start``
        refuses, raised before anything is opened or written (a worker checks this before
        its repeats push). Returns each station with its settings."""
        pipeline = self.pipeline
        pipeline.validate()
        pipeline._check_moves()
        return pipeline.stations(self.defaults, queue_defaults=self.queue_defaults)

    def _options_of(self, name: str) -> dict[str, Any] | None:
        """The options the run opens queue ``name`` with (see :meth:`Pipeline._opened_with`)."""
        return self.pipeline._opened_with(name, self.queue_defaults)

    async def start(self) -> PipelineRun:
        """Check the pipeline, store its topology (refused when another is stored under its
        name unless the run was made with ``replace=True``, see :meth:`Pipeline.save`), open
        its queues and start its stations."""
        if self._started:
            raise PipelineError(f"pipeline {self.pipeline.name!r} is already running")
        self._started = True  # a second start while this one opens is refused
        try:
            stations = self.check()
            queues = await self._prepare()  # checked above, with the run's own defaults
        except BaseException:  # nothing started: the run may be started again
            self._started = False
            raise
        try:
            for link, settings in stations:
                handler, settle = _station(link, queues[link.source])
                try:
                    consumer = queues[link.source]._start_consumer(
                        handler, settle=settle, **settings
                    )
                except InvalidInputError as exc:
                    raise PipelineError(f"station {link.name!r}: {exc}") from exc
                self.consumers.append(consumer)
        except BaseException:
            # The stations started are stopped and let go, and the run may be started
            # again: else it stayed marked as running ("already running") with nothing
            # running. Its queues are opened afresh then (one may be the closed queue
            # whose consumer could not start).
            try:
                await self.stop(0.0)
            finally:
                self.consumers = []
                self._queues = None
                self._started = False
            raise
        return self

    async def _prepare(self) -> dict[str, Queue]:
        """Store the topology (what ``start`` refuses when another one is stored), then open
        the queues, once: a worker does it before its repeats push (a start refused for
        another release's topology has then written nothing), then starts the run."""
        if self._queues is not None:
            return self._queues
        pipeline = self.pipeline
        factory = pipeline.factory
        # before any queue is opened: a refused one opens nothing
        await pipeline._store(self.replace)
        queues: dict[str, Queue] = {}
        for name in pipeline.queues:
            given = self._options_of(name)
            if given is not None:
                queues[name] = await factory.queue(name, **given)
            else:  # only moved into: opened as a move reaches a queue, see Factory._sibling
                queues[name] = await factory._sibling(name)
        self._queues = queues
        return queues

    async def stop(self, grace: float | None = 30.0) -> None:
        """Stop every station: no new messages; running handlers get ``grace`` seconds,
        then are cancelled and their messages given back (costing no try)."""
        await asyncio.gather(*(consumer.stop(grace) for consumer in self.consumers))

    async def wait(self) -> None:
        """Until every station has stopped."""
        for consumer in self.consumers:
            await consumer.wait()

    def status(self) -> list[ConsumerStatus]:
        return [consumer.status() for consumer in self.consumers]

    async def __aenter__(self) -> PipelineRun:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def queues_of(links: Sequence[Link]) -> list[str]:
    """Every queue ``links`` touch, inputs first, in the order they were added."""
    found: dict[str, None] = {}
    for link in links:
        found[link.source] = None
    for link in links:
        found.update(dict.fromkeys(link.destinations))
    return list(found)


def check_shape(
    name: str, links: Sequence[Link], acyclic: bool, queue_options: Mapping[str, Any]
) -> None:
    """What :meth:`Pipeline.validate` checks, which needs no backend (a worker checks a
    described pipeline so before it connects)."""
    graph.check(name, links, acyclic)
    queues = queues_of(links)
    unused = [queue for queue in queue_options if queue not in queues]
    if unused:  # never opened by the run: options that would silently not apply
        raise PipelineError(
            f"pipeline {name!r}: queue_options name {unused[0]!r}, which is not one "
            f"of its queues {queues}"
        )


MAX_PIPELINE_NAME = 128


def check_pipeline_name(name: object, longest: int | None = MAX_PIPELINE_NAME) -> str:
    """A pipeline's name is stored as a key or a row of the backend: a non-empty str of
    printable characters (no control characters, no lone surrogates), as long as a queue's
    (``longest`` None: any length, for names stored before the bound, to remove them)."""
    if (
        not isinstance(name, str)
        or not name
        or (longest is not None and len(name) > longest)
        or not name.isprintable()
    ):
        raise PipelineError(
            f"a pipeline name must be a str of 1-{MAX_PIPELINE_NAME} printable characters,"
            f" not {name!r}"
        )
    return name


def _checked_acyclic(name: str, acyclic: object) -> bool:
    """``acyclic`` as given, a bool: a truthy "false" refused every cycle, and was stored
    with the topology as it was, where a description (``from_dict``) refuses it."""
    if not isinstance(acyclic, bool):
        raise PipelineError(f"pipeline {name!r}: acyclic must be True or False, not {acyclic!r}")
    return acyclic


def _checked_replace(replace: object) -> bool:
    """``replace`` as given, a bool: a truthy "no" must not write over a stored topology."""
    if not isinstance(replace, bool):
        raise PipelineError(f"replace must be True or False, not {replace!r}")
    return replace


def _checked_queue_options(
    factory: Factory, given: Mapping[str, Mapping[str, Any]] | None
) -> dict[str, dict[str, Any]]:
    """``queue_options`` checked as ``factory.queue`` would check them, so that a bad one is
    refused when the pipeline is built, not once its run has opened the other queues."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise PipelineError(f"queue_options must map queue names to options, not {given!r}")
    checked: dict[str, dict[str, Any]] = {}
    for queue, options in given.items():
        check_queue_name(queue)
        if not isinstance(options, Mapping):
            raise PipelineError(
                f"queue_options[{queue!r}] must be a mapping of options, not {options!r}"
            )
        factory.defaults.updated(dict(options))  # raises what factory.queue would
        checked[queue] = dict(options)
    return checked


def _checked_queue_defaults(factory: Factory, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """A run's ``queue_defaults``, checked as ``factory.queue`` checks its options, before
    the run opens anything."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise PipelineError(f"queue_defaults must be a mapping of options, not {given!r}")
    factory.defaults.updated(dict(given))  # raises what factory.queue would
    return dict(given)


def _settings(given: Mapping[str, Any], station: str) -> StationSettings:
    return station_settings(None, dict(given), station)


def _station_doc(link: Link) -> dict[str, Any]:
    handler = link.handler_spec or _spec_of(link.handler)
    doc: dict[str, Any] = {"name": link.name, "kind": link.kind, "from": link.source}
    if link.destinations:
        doc["to"] = list(link.destinations)
    doc["handler"] = handler
    doc.update(link.settings.given())
    return doc


def _spec_of(handler: Handler) -> str:
    module = getattr(handler, "__module__", None) or "?"
    qualname = getattr(handler, "__qualname__", None) or type(handler).__qualname__
    return f"{module}:{qualname}"


def _station(link: Link, queue: Queue) -> tuple[Handler, Any]:
    """The consumer handler (the user's, its answer checked into a move plan, so a bad answer
    fails like an exception: ko, retried, deadlettered) and the settle that carries it out."""
    user = link.handler
    settle_answer = link.settle

    async def handle(message: Message) -> Move | None:
        result = user(message)
        if inspect.isawaitable(result):
            result = await result
        settlement: Settlement = settle_answer(result)
        if settlement.destination is None:
            return None
        try:
            return queue._move_plan(
                message,
                settlement.destination,
                settlement.payload,
                settlement.headers,
                settlement.delay,
            )
        except (InvalidInputError, NotSupportedError) as exc:
            # a payload or headers that cannot be stored, a delay the backend cannot keep:
            # an answer the station cannot carry out, as a destination it does not lead to
            raise PipelineError(f"station {link.name!r}: cannot forward: {exc}") from exc

    async def settle(message: Message, plan: Move | None) -> Any:
        if plan is None:
            return await queue.ok(message)
        moved = await queue._submit_move(plan)
        if moved is None:  # its reservation lapsed while the handler ran: another has it
            log.warning(
                "station %r: message %s was no longer held when its handler returned (it "
                "ran past reserve_delay); not moved, it is being handled again",
                link.name,
                message.id,
            )
        return moved

    return handle, settle
