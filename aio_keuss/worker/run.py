"""``run_worker``: consumers that run until the process is told to stop, and stop cleanly.

What an orchestrator expects of a worker (systemd's ``KillSignal=SIGTERM`` then
``TimeoutStopSec``, Kubernetes' SIGTERM then ``terminationGracePeriodSeconds``, ``docker
stop``): the first SIGTERM or SIGINT stops taking new messages and gives running handlers
``grace`` seconds to finish; handlers still running then are cancelled and their messages
given back at once, costing no try, so another worker takes them without waiting for a
reservation to expire. A second signal skips the rest of the grace (still giving the
messages back). Messages prefetched and never started are given back the same way. A
handler that goes on once cancelled (it swallows ``CancelledError``) is abandoned after a
short bound, logged, and the worker returns without it, as a second Ctrl-C makes uvicorn
and Celery exit: its message is not given back, as two consumers would then hold it at
once, and comes back when its reservation, extended while the handler runs (the worker's
connection stays open for that), expires after it ends, or after the process does.

A worker may also run repeats (``repeats=``): what arq's ``cron_jobs``, BullMQ's repeatable
jobs and procrastinate's periodic tasks give a worker process. They start once the worker
is connected and before it consumes, so a backend that cannot repeat stops the worker
before it takes any message, and they stop with the consumers. As every replica of a
worker pushes the same occurrence ids, the queue's dedup keeps one copy of each: running
the repeats in each replica needs no leader (see ``Queue.repeat``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from .. import observe
from ..consumer import Consumer, Handler, check_batch_bounds, check_settings, describe
from ..errors import ConsumerFailedError, InvalidInputError, NotSupportedError, PipelineError
from ..factory import Factory, connect
from ..loading import import_object
from ..options import brief, check_seconds
from ..pipeline import Pipeline, PipelineRun, from_dict
from ..pipeline.topology import check, read
from ..queue import Queue
from ..repeat import Repeat, Repeater
from .health import HealthServer
from .settings import named_twice, repeated_twice

log = logging.getLogger("aio_keuss.worker")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_counting_workers = 0
"""Workers of this process running with metrics they enabled: the last of them to stop
disables them (the first would turn them off under the others)."""


PipelineSource = Pipeline | Callable[[Factory], Pipeline] | Mapping[str, Any] | str
"""A pipeline, a function building one from the factory, a topology dict, ``module:attr``
naming any of them, or the path of a TOML file describing one."""


async def run_worker(
    handler: Handler | None = None,
    queues: str | Sequence[str] = (),
    *,
    pipeline: PipelineSource | None = None,
    replace_pipeline: bool = False,
    repeats: Sequence[Repeat] = (),
    factory: Factory | None = None,
    backend: str = "memory",
    concurrency: int = 1,
    timeout: float | None = None,
    grace: float = 30.0,
    prefetch: int = 0,
    health_port: int | None = None,
    health_host: str = "127.0.0.1",
    queue_options: Mapping[str, Any] | None = None,
    stop: asyncio.Event | None = None,
    **options: Any,
) -> None:
    """Consume ``queues`` with ``handler`` (or run ``pipeline``'s stations) until SIGTERM /
    SIGINT (or ``stop`` is set), and run ``repeats`` meanwhile.

    ``factory``: an open factory to use (you close it); without one, the worker connects to
    ``backend`` with ``options`` (``url=``, ``prefix=``, ...) once for the process and closes
    it at the end, so a server out of reach at start raises ``KeussConnectionError`` here; a
    stop asked for while it connects abandons the connect and returns.
    ``replace_pipeline``: start ``pipeline`` over another topology stored under its name,
    storing this one (``Pipeline.run(replace=True)``), instead of refusing with
    :class:`~aio_keuss.PipelineError`: for the release that changes the pipeline.
    Each queue gets ``concurrency`` workers (see ``Queue.consume`` for ``timeout`` and
    ``prefetch``), opened with ``queue_options``; with ``pipeline``, each station gets
    them unless it says otherwise, and ``queue_options`` are the defaults of the queues
    its run opens as its own (its stations' inputs, those the pipeline gives options for)
    under the pipeline's per-queue options (see ``Pipeline.run``'s ``queue_defaults``).
    ``grace``: seconds running handlers get to finish once a stop is asked for.
    ``health_port``: serve ``/healthz`` and ``/metrics`` there (0 picks a free port), on
    ``health_host``, bound before connecting (one it cannot serve raises before any
    handler starts); metrics (:mod:`aio_keuss.observe`) are then enabled from the start, and
    disabled at the end unless they already were.

    ``repeats``: :class:`~aio_keuss.Repeat` specs, all checked before anything connects
    (raising what ``Queue.repeat`` raises), started once connected and before consuming, and
    stopped with the consumers; their queues need not be consumed here, and with repeats
    neither a handler nor queues are needed (a process that only schedules, for consumers
    that run elsewhere). Their queues are opened with ``queue_options`` (with ``pipeline``,
    a queue of the pipeline as its run opens it). A backend that cannot repeat (no
    explicit ids or delays) raises :class:`~aio_keuss.NotSupportedError` before any repeat
    or consumer starts.

    Returns once every consumer has stopped and every message it held is acknowledged or
    given back, but for the handlers abandoned as they went on after being cancelled: those
    run on in the loop (the command exits without them), their messages left reserved and
    extended while they do; a factory the worker opened stays open for that, and closes
    once they end.
    Raises :class:`~aio_keuss.ConsumerFailedError` (after stopping the others)
    when a consumer's worker, or a repeat, stops on an error not worth retrying. Signal
    handlers are installed only while it runs, in the main thread; those found there before
    (the loop's, or Python's) are put back when it returns (on asyncio's loop).
    """
    names = [queues] if isinstance(queues, str) else list(queues)
    specs = _checked_repeats(repeats)
    if pipeline is not None:
        if handler is not None or names:
            raise InvalidInputError("give a pipeline, or a handler and queues, not both")
    elif handler is None and not names and specs:
        pass  # only scheduling, for consumers elsewhere
    elif handler is None or not names or not all(isinstance(n, str) for n in names):
        raise InvalidInputError(
            "a handler and queues (a queue name or a non-empty list of names) are needed,"
            " or repeats alone"
        )
    twice = named_twice(names)
    if twice:
        raise InvalidInputError(twice)
    if not isinstance(replace_pipeline, bool):
        raise InvalidInputError(f"replace_pipeline must be True or False, not {replace_pipeline!r}")
    if replace_pipeline and pipeline is None:
        raise InvalidInputError("replace_pipeline is for a pipeline, and none is given")
    grace = check_seconds(grace, "grace")
    source = None if pipeline is None else pipeline_source(pipeline)
    if pipeline is None and handler is not None:
        # what consume() refuses, before connecting (and before a repeat pushes); a
        # prefetch above a queue's max_batch is checked as soon as the queues are open
        check_settings(
            concurrency, timeout=timeout, prefetch=prefetch, settled=False, max_batch=None
        )
    if factory is not None and options:
        raise InvalidInputError("backend options are for a worker that connects by itself")
    consumers: list[Consumer] = []
    repeaters: list[Repeater] = []
    health: HealthServer | None = None
    if health_port is not None:
        # Bound before connecting, so before any consumer takes a message or a repeat
        # pushes: bound once they ran, an address it cannot serve stopped a worker whose
        # handlers had begun (popped messages they held were lost). Until the consumers
        # start, /healthz answers 503 (none runs yet).
        health = HealthServer(
            lambda: consumers, health_host, health_port, repeaters=lambda: repeaters
        )
        await health.start()
    stop = stop or asyncio.Event()
    now = asyncio.Event()
    # Before connecting: a SIGTERM during a slow connect (a server that accepts and does not
    # answer) would otherwise kill the process by the signal's default action.
    restore = _on_signals(stop, now)
    own: Factory | None = None
    stopped = counting = kept_open = False
    global _counting_workers
    try:
        own = None if factory is not None else await _connect_unless_stopped(stop, backend, options)
        opened = factory or own
        if opened is None:
            log.info("worker %d stopped while connecting", os.getpid())
            return
        counting = health_port is not None and (observe.active is None or _counting_workers > 0)
        if counting:
            observe.enable(keep=False)
            _counting_workers += 1
        stations = None if source is None else _pipeline(source, opened)
        running = None
        to_consume: list[Queue] = []
        _check_repeats_can_run(opened, specs)  # before the pipeline's topology is stored
        # every consumer's settings checked before a repeat pushes anything
        if stations is not None:
            running = stations.run(
                concurrency,
                timeout=timeout,
                prefetch=prefetch,
                replace=replace_pipeline,
                queue_defaults=queue_options,
            )
            running.check()
            # before a repeat pushes: another release's topology stored under the
            # pipeline's name refuses the start here
            await running._prepare()
        elif handler is not None:
            for name in names:
                queue = await opened.queue(name, **dict(queue_options or {}))
                check_batch_bounds(prefetch, 0, queue.options.max_batch)
                to_consume.append(queue)
        await _start_repeats(opened, specs, running, queue_options or {}, repeaters)
        if running is not None:
            try:
                await running.start()
            finally:
                consumers.extend(running.consumers)
            built = running.pipeline
            names = [f"pipeline {built.name!r} ({', '.join(built.queues)})"]
        elif handler is not None:
            for queue in to_consume:
                consumer = queue.consume(handler, concurrency, timeout=timeout, prefetch=prefetch)
                consumers.append(consumer)
        if names:
            log.info(
                "worker %d consuming %s (%d per queue) on %s",
                os.getpid(),
                ", ".join(names),
                concurrency,
                opened.backend.name,
            )
        if repeaters:
            log.info(
                "worker %d repeating %s on %s",
                os.getpid(),
                ", ".join(_schedule(spec) for spec in specs),
                opened.backend.name,
            )
        failed = await _until(stop, consumers, repeaters)
        if failed is not None:
            log.error("stopping: %s failed", _runner(failed))
        await _stop(consumers, repeaters, grace, now)
        stopped = True
        if failed is not None:
            raise ConsumerFailedError(
                f"{_runner(failed)} stopped on {describe(cast(Exception, failed.failure))}"
            ) from failed.failure
    finally:
        # recorded before the signal handlers go: a SIGINT from then on is Python's
        # KeyboardInterrupt, which may cut the closes below short, and the command still
        # reads it (``abandoned_handlers``) to exit 70
        if any(consumer.stop_abandoned for consumer in consumers):
            _abandoning.add(asyncio.get_running_loop())
        restore()
        try:
            if (consumers or repeaters) and not stopped:  # cancelled or failed above
                await asyncio.shield(_stop(consumers, repeaters, 0.0, now))
        finally:
            if health is not None:
                await health.close()
            if counting:
                _counting_workers -= 1
                if not _counting_workers:
                    observe.release()  # unless the application enabled them meanwhile
            if any(consumer.stop_abandoned for consumer in consumers):
                _abandoning.add(asyncio.get_running_loop())
            if own is not None:
                kept_open = any(consumer.abandoned for consumer in consumers)
                if kept_open:
                    _close_once_outlived(own, consumers)
                else:
                    await own.close()
    log.info(
        "worker %d stopped%s",
        os.getpid(),
        ", its connection left open for the abandoned handlers" if kept_open else "",
    )


def left_open() -> bool:
    """Whether a worker of the running loop returned with its own factory left open for the
    handlers it abandoned, which still run: the worker command then exits at once (see
    :mod:`.loop`), as closing it would end their extensions."""
    loop = asyncio.get_running_loop()
    return any(closing.get_loop() is loop for closing in _left_open)


def abandoned_handlers(loop: asyncio.AbstractEventLoop | None = None) -> bool:
    """Whether a worker of ``loop`` (default: the running loop) abandoned handlers as it
    stopped (they went on once cancelled), whether or not they still run: the worker
    command then exits 70. Not :func:`left_open`, which holds only while they run: one that
    ended between its abandonment and the worker's return left a stop that did abandon it
    exiting 0."""
    return (loop or asyncio.get_running_loop()) in _abandoning


_abandoning: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
"""The loops whose workers abandoned handlers as they stopped (weakly: a loop closed and
dropped is forgotten)."""

_left_open: set[asyncio.Task[None]] = set()
"""The closes put off by :func:`_close_once_outlived` (kept here: a loop keeps only weak
references to its tasks)."""


def _close_once_outlived(factory: Factory, consumers: Sequence[Consumer]) -> None:
    """Close ``factory`` once the handlers the consumers' stops abandoned have ended, not
    now: their reservations are extended through its connection while they run (closed,
    another consumer would get their messages while they still run them)."""

    async def outlived() -> None:
        for consumer in consumers:
            await consumer.outlived()

    async def close() -> None:
        cancelled: asyncio.CancelledError | None = None
        try:
            await outlived()
        except asyncio.CancelledError as exc:
            # The loop is ending: ``asyncio.run`` cancels every task left (the abandoned
            # handlers too) and runs the loop until they end (Python's asyncio documentation,
            # "Runners"). Still closed once they have: cancelled for good, the connection
            # was left open, a signal's publish destroyed pending, the last counters lost.
            cancelled = exc
            await outlived()
        await factory.close()
        if cancelled is not None:
            raise cancelled

    closing = asyncio.get_running_loop().create_task(close())
    _left_open.add(closing)
    closing.add_done_callback(_left_open.discard)


def pipeline_source(source: PipelineSource) -> PipelineSource:
    """``source`` checked as far as it can be without a backend, so that a bad one raises
    before the worker connects (the command exits 2, bad settings, not 3 as if the backend
    were down): ``module:attr`` imported, a TOML file read, and a description (a file's, a
    dict) checked, its handlers imported (see :func:`aio_keuss.pipeline.topology.check`).
    Returns what :func:`_pipeline` builds once connected."""
    found: Any = source
    if isinstance(source, str):
        if source.endswith(".toml"):
            found = read(source)
        else:
            found = import_object(source, "pipeline", error=PipelineError)
    if isinstance(found, Mapping):
        check(found)
    return cast(PipelineSource, found)


def _pipeline(source: PipelineSource, factory: Factory) -> Pipeline:
    """The pipeline ``source`` names (as :func:`pipeline_source` returns it), built over
    ``factory``."""
    if isinstance(source, str):
        source = pipeline_source(source)
    if isinstance(source, Pipeline):
        return _ours(source, factory)
    if isinstance(source, Mapping):
        return from_dict(factory, source)
    if callable(source):
        built = source(factory)
        if isinstance(built, Mapping):
            return from_dict(factory, built)
        if isinstance(built, Pipeline):
            return _ours(built, factory)
        raise PipelineError(f"the pipeline builder returned {built!r}, not a Pipeline")
    raise PipelineError(f"not a pipeline: {source!r}")


def _ours(pipeline: Pipeline, factory: Factory) -> Pipeline:
    """``pipeline``, if built on the worker's factory (else its stations would run on a
    backend the worker neither connected to nor closes)."""
    if pipeline.factory is not factory:
        raise PipelineError(f"pipeline {pipeline.name!r} was built on another factory")
    return pipeline


def _checked_repeats(repeats: Sequence[Repeat]) -> list[Repeat]:
    """``repeats``, each checked as ``Queue.repeat`` checks its input: a bad one raises
    before the worker connects, so a deploy with a typo fails at once."""
    if isinstance(repeats, Repeat | str | Mapping) or not isinstance(repeats, Sequence):
        raise InvalidInputError(f"repeats must be a list of Repeat, not {brief(repeats)}")
    for spec in repeats:
        if not isinstance(spec, Repeat):
            raise InvalidInputError(f"repeats takes Repeat specs, not {brief(spec)}")
        spec.check()
    twice = repeated_twice(repeats)
    if twice:
        raise InvalidInputError(twice)
    return list(repeats)


async def _start_repeats(
    factory: Factory,
    specs: Sequence[Repeat],
    running: PipelineRun | None,
    queue_options: Mapping[str, Any],
    started: list[Repeater],
) -> None:
    """Start the repeats once every one's queue is open (checked by
    :func:`_check_repeats_can_run` before)."""
    queues = []
    for spec in specs:
        options = queue_options
        if running is not None and spec.queue in running.pipeline.queues:
            # as the run opened it (one only moved into: as it is open, {})
            options = running._options_of(spec.queue) or {}
        queues.append(await factory.queue(spec.queue, **dict(options)))
    for spec, queue in zip(specs, queues, strict=True):
        started.append(
            queue.repeat(
                spec.key,
                spec.payload,
                every=spec.every,
                cron=spec.cron,
                headers=spec.headers,
                tz=spec.tz,
                priority=spec.priority,
            )
        )


def _check_repeats_can_run(factory: Factory, specs: Sequence[Repeat]) -> None:
    """A backend without explicit ids or delays stops the worker before any occurrence is
    pushed, any queue opened or a pipeline's topology stored (what :meth:`Repeat.check`
    could not see before connecting). Every queue of a factory has its capabilities."""
    capabilities = factory.capabilities
    if specs and not (capabilities.idempotent and capabilities.delay):
        spec = specs[0]
        raise NotSupportedError(
            f"repeat {spec.key!r} on queue {spec.queue!r}: backend"
            f" {factory.backend_name!r} cannot repeat (it has no explicit ids or delays)"
        )
    for spec in specs:
        if spec.priority and not capabilities.priority:
            raise NotSupportedError(
                f"repeat {spec.key!r} on queue {spec.queue!r}: backend"
                f" {factory.backend_name!r} has no priorities"
            )


def _schedule(spec: Repeat) -> str:
    when = f"every {spec.every:g} s" if spec.every is not None else f"cron {spec.cron!r}"
    if spec.cron is not None and spec.tz != "UTC":
        when += f" in {spec.tz}"
    return f"{spec.key!r} on {spec.queue} ({when})"


def _runner(runner: Consumer | Repeater) -> str:
    if isinstance(runner, Repeater):
        return f"repeat {runner.key!r} on queue {runner.queue!r}"
    return f"the consumer of queue {runner.queue.name!r}"


async def _connect_unless_stopped(
    stop: asyncio.Event, backend: str, options: Mapping[str, Any]
) -> Factory | None:
    """The factory, or None when a stop comes first: the connect is then cancelled, as a
    stop must not wait for a server that may never answer (or for its connect timeout)."""

    async def opening() -> Factory:
        return await connect(backend, **options)

    connecting = asyncio.ensure_future(opening())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((connecting, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        while not connecting.done():
            # Again until it takes: Python 3.11's asyncio.wait_for (the drivers use it)
            # loses a cancellation that lands as the call it waits for completes.
            connecting.cancel()
            await asyncio.wait((connecting,), timeout=0.1)
    if connecting.cancelled() or (stop.is_set() and connecting.exception() is not None):
        return None  # a failure of a connect a stop abandoned is no failure to start
    return connecting.result()  # connected as the stop came: the caller stops it at once


async def _until(
    stop: asyncio.Event, consumers: Sequence[Consumer], repeaters: Sequence[Repeater]
) -> Consumer | Repeater | None:
    """Until a stop is asked for, every consumer and repeater has ended by itself (its queue
    closed), or one failed (on an error not worth retrying): then returns that one. A
    repeat that died quietly would leave its schedule unserved with nothing to show for it;
    ending the worker lets its supervisor restart it, as for a consumer."""

    async def ended() -> None:
        for consumer in consumers:
            await consumer.wait()
        for repeater in repeaters:
            await repeater.wait()

    async def repeat_failure(repeater: Repeater) -> None:
        await repeater.wait()
        if repeater.failure is None:  # its queue closed: ended() sees to that
            await asyncio.Event().wait()

    failing: list[asyncio.Future[Any]] = [
        *(asyncio.ensure_future(c.wait_failure()) for c in consumers),
        *(asyncio.ensure_future(repeat_failure(r)) for r in repeaters),
    ]
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(ended()), *failing]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    runners: list[Consumer | Repeater] = [*consumers, *repeaters]
    return next((r for r in runners if r.failure is not None), None)


async def _stop(
    consumers: Sequence[Consumer],
    repeaters: Sequence[Repeater],
    grace: float,
    now: asyncio.Event,
) -> None:
    """Stop every repeater, and every consumer with ``grace``, cut short when ``now`` is set.
    The repeaters stop beside the consumers, not before them: a push under way, which a
    stop lets end, must not eat into the handlers' grace."""
    halting = asyncio.gather(*(r.stop() for r in repeaters))
    running = sum(c.status().in_flight for c in consumers)
    if grace and running:
        log.info("stopping: up to %g s for %d running handlers", grace, running)
    stopping = asyncio.ensure_future(asyncio.gather(*(c.stop(grace) for c in consumers)))
    hurry = asyncio.ensure_future(now.wait())
    try:
        await asyncio.wait((stopping, hurry), return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done() and grace:
            log.warning("stopping now: cancelling the running handlers, giving their work back")
            await asyncio.gather(*(c.stop(0.0) for c in consumers))
        await stopping
    finally:
        hurry.cancel()
        await halting


_Stops = list[tuple[asyncio.Event, asyncio.Event]]
_signalled: dict[asyncio.AbstractEventLoop, tuple[list[Callable[[], None]], _Stops]] = {}
"""The undo of the signal handlers installed on each loop, and the ``(stop, now)`` events of
the workers running there: a loop has one handler per signal, so its workers share it. Each
installing its own, one replaced another's (a SIGTERM stopped only the last worker
started), and the first to end removed the handler the others counted on (the next SIGTERM
killed the process)."""


def _install(loop: asyncio.AbstractEventLoop, signum: signal.Signals) -> Callable[[], None]:
    """Install the workers' handler of ``signum`` on ``loop``; returns the undo, which puts
    back the handler found there. Removing the loop's handler leaves the signal to its
    default action (asyncio's ``remove_signal_handler``): an application's own handler,
    the loop's or Python's (``asyncio.run`` sets one for SIGINT), was gone once the workers
    ended, and its next SIGTERM killed the process. The loop's own is read from asyncio's
    loop (another loop's is not known: left as before)."""
    own = getattr(loop, "_signal_handlers", None)
    loops = own.get(signum) if isinstance(own, dict) else None
    python = signal.getsignal(signum)
    loop.add_signal_handler(signum, _received, loop, signum)

    def undo() -> None:
        loop.remove_signal_handler(signum)
        if isinstance(loops, asyncio.Handle):
            if not loops.cancelled():
                callback = cast(Any, loops)._callback  # asyncio keeps it there
                loop.add_signal_handler(signum, callback, *loops._args)
        elif isinstance(own, dict) and python is not None:
            signal.signal(signum, python)

    return undo


def _on_signals(stop: asyncio.Event, now: asyncio.Event) -> Any:
    """SIGTERM / SIGINT set ``stop``; one more sets ``now`` (for every worker of the loop).
    Returns the undo."""
    loop = asyncio.get_running_loop()
    shared = _signalled.get(loop)
    if shared is None:
        installed: list[Callable[[], None]] = []
        for signum in STOP_SIGNALS:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                # not in the main thread, or no signals on this platform's loop
                installed.append(_install(loop, signum))
        if not installed:
            return lambda: None
        shared = _signalled[loop] = (installed, [])
    installed, workers = shared
    mine = (stop, now)
    workers.append(mine)

    def restore() -> None:
        if mine not in workers:
            return
        workers.remove(mine)
        if not workers and _signalled.get(loop) is shared:
            del _signalled[loop]
            for undo in reversed(installed):
                undo()

    return restore


def _received(loop: asyncio.AbstractEventLoop, signum: signal.Signals) -> None:
    workers = list(_signalled[loop][1]) if loop in _signalled else []
    # Each worker's state read before this signal sets anything: workers given one
    # ``stop`` event share it, and one read after the first was stopped here took this
    # first signal for a second one (stopping at once, its handlers cut).
    stopping = [stop.is_set() for stop, _ in workers]
    if workers and all(stopping):
        log.warning("%s again: stopping at once", signum.name)
    else:
        log.info("%s: stopping (no new messages; running handlers may finish)", signum.name)
    for (stop, now), was_stopping in zip(workers, stopping, strict=True):
        if was_stopping:
            now.set()
        else:
            stop.set()
