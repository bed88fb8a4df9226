"""``connect()`` and the Factory: one backend connection, its signal bus and stats store,
and the queues opened through them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any

from . import observe
from .contract import Backend, RateRule, Store
from .errors import ClosedError, ConfigError
from .options import (
    QUEUE_OPTION_NAMES,
    DeadletterOptions,
    QueueOptions,
    check_queue_name,
    check_seconds,
)
from .pipeline import Pipeline, check_pipeline_name
from .queue import CANCELLED_CLOSE_GRACE, Closing, Limiter, Queue
from .registry import load_backend
from .results import ResultStore
from .signal import LocalSignalBus, SignalBus
from .stats import MemoryStats, StatsStore
from .types import Capabilities, Sizes

log = logging.getLogger(__name__)

_FACTORY_OPTIONS = frozenset({"signal", "stats", "deadletter", "signal_debounce"})

CLOSE_TIMEOUT = 60.0
"""Seconds :meth:`Factory.close` spends by default on its ordinary course (the consumers'
handlers finishing, within their 30 s stop grace; the queues giving back what nobody
acknowledged; the stats store's last write; the signals on their way out) before it goes on
as a cancelled close does: a server that accepts connections but stopped answering never
ends any of them, and a close that never returns holds up a process's shutdown for good."""


class Factory:
    """Opens queues of one backend; close it (or use ``async with``) to release everything."""

    def __init__(
        self,
        backend: Backend,
        signal: SignalBus,
        stats: StatsStore,
        defaults: QueueOptions,
        deadletter: DeadletterOptions | None,
    ) -> None:
        self.backend = backend
        self.signal = signal
        self.stats_store = stats
        self.defaults = defaults
        self.deadletter = deadletter
        self._queues: dict[str, Queue] = {}
        # Opened by the factory itself (the deadletter queue for a queue's routing, a move's
        # or a replay's target), not yet asked for through ``queue``: see ``_claim``
        self._unclaimed: set[str] = set()
        # The calls using a queue the factory reached for them (see ``_using``): how many
        # hold each, and the futures a claim's reopen waits on until none does
        self._holds: dict[Queue, int] = {}
        self._released: dict[Queue, asyncio.Future[None]] = {}
        self._opening: dict[str, asyncio.Future[Queue]] = {}
        self._closed = False
        # While a close waits for the running handlers: a queue one of them reaches (a move's
        # target) still opens, and is closed with the others.
        self._siblings_open = False
        # Past the close's wait for the queues still opening (its grace spent, or cancelled
        # again): one whose open completes later is closed by that open (see _open_queue).
        self._opens_left = False
        self._closing = Closing("factory")
        self._close_begun = False  # its task ran a step (see close)
        # The close run by a caller after its task was cancelled before it ran a step (see
        # close): the closes called meanwhile wait for it
        self._rest: asyncio.Future[None] | None = None
        self._results = _ResultStoreOnce(backend)
        self._timed_out = False  # the close was cancelled by its timeout (see close)
        observe.track(self)  # weakly: metrics read the sizes of its open queues

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    @property
    def backend_name(self) -> str:
        return self.backend.name

    async def queue(self, name: str, **options: Any) -> Queue:
        """The queue called ``name``, created on first use. One Queue object per name and
        factory: asking again with different options is an error. A queue this factory
        opened by itself with the defaults (the deadletter queue, for the routing of any
        queue; a move's or a replay's target), or with its recorded options for a tool
        looking at it (the dashboard), is not asked for yet: the first ask reopens it with
        its options, the defaults for an ask giving none."""
        if self._closed:
            raise ClosedError("factory is closed")
        check_queue_name(name)
        queue_options = self.defaults_for(name).updated(options)
        found = await self._current(name, queue_options)
        if name in self._unclaimed:  # (also when this ask joined the factory's own open)
            # with the options asked for, the defaults when none are: one a looking tool
            # opened with its recorded options (see ``_recorded``) is no ask of the user's
            found = await self._claim(found, queue_options)
        if self._closed:  # closed while it opened (the close waited for it, and closed it)
            raise ClosedError("factory is closed")
        if options and found.options != queue_options:
            raise ConfigError(f"queue {name!r} is already open with {found.options}")
        if self.deadletter is not None and self.deadletter.queue not in self._queues:
            # opened for its routing, with the defaults: not recorded over the options the
            # process that owns it recorded (as for a move's target, see ``_sibling``), and
            # not claimed (asked for later with options of its own, it reopens with them)
            dead = self.deadletter.queue
            await self._open_queue(dead, self.defaults_for(dead), sibling=True)
            if self._closed:
                raise ClosedError("factory is closed")
        return found

    def defaults_for(self, name: str) -> QueueOptions:
        """The options queue ``name`` opens with where it is given none: the connect
        defaults, less their ``rate_limit`` for the deadletter queue. That queue gathers
        the failures of every queue, and is drained (requeue, the admin commands) as one
        job of its own, not at the pace set for the others' work; a limit given for it,
        ``queue(name, rate_limit=...)``, still holds."""
        dead = self.deadletter is not None and name == self.deadletter.queue
        if dead and self.defaults.rate_limit:
            return self.defaults.updated({"rate_limit": 0})  # its burst goes with it
        return self.defaults

    async def _current(self, name: str, options: QueueOptions, *, sibling: bool = False) -> Queue:
        """The queue open under ``name`` now, opened (see :meth:`_open_queue`) if none is.
        An open this one joined may be claimed and replaced before this ask resumes: it
        then gets the queue replacing it, never the one being closed. One the user closed
        (``queue.close()``) is dropped once its close ends, and the name opened afresh:
        handed out again, it raised ClosedError on every call for good. One whose close
        failed after it counted as closed is closed again first (see
        ``Queue._closed_by_own_close``)."""
        while True:
            found = self._queues.get(name)
            if found is not None:
                if not await found._closed_by_own_close():
                    return found
                if self._queues.get(name) is found:
                    del self._queues[name]
                    self._unclaimed.discard(name)
                continue
            found = await self._open_queue(name, options, sibling=sibling)
            if self._queues.get(name) is found:
                return found

    async def _claim(self, found: Queue, options: QueueOptions) -> Queue:
        """The user's first ask for a queue the factory opened by itself: it is theirs from
        now on, reopened with ``options`` when they differ (and recorded with them, as any
        queue asked for). Nothing of it is lost: the factory never handed it out, so no
        consumer or repeater runs on it, and its messages are in the backend, which the
        queue reopened reads.

        Nor does a call using it fail: the factory's own open is handed only to calls that
        hold it while they use it (a replay into it, a find looking in it: see ``_using``),
        and its close waits until none does; the calls that reach it meanwhile wait for the
        reopened one. Why not the other ways round: the options cannot change on the queue
        object in place (``max_batch`` sizes its batching, ``reserve_delay`` its one-message
        reserve, ``rate_limit`` its limiter, ``dedup_window`` and ``reserve_delay`` its
        store's own state: each open gets a store made with its options), and the old one
        cannot close later, beside the reopened one: nothing promises that two opens of one
        name share nothing a close shuts (the sharded backends find a queue's store by its
        name). So this ask waits for those calls (as the close of any queue waits for its
        round trips in flight): a long replay into the queue holds it back that long."""
        name = found.name
        if self._closed:  # closed while this ask opened it (and closing it with the others)
            raise ClosedError("factory is closed")
        self._unclaimed.discard(name)
        if found.options == options or found._consumers or found._repeaters:
            return found  # (a consumer is never started on it: refused as already open)
        del self._queues[name]
        return await self._open_queue(name, options, replacing=found)

    async def _sibling(self, name: str) -> Queue:
        """A queue one of ours reaches (move, requeue, replay, deadletter lookups): opened
        with the defaults if this factory has not opened it, and recorded only if the
        backend does not know it yet. Another process may have recorded it with options of
        its own (the admin commands reopen it with them): a move here must not replace them
        with this factory's defaults. Also while a close waits for the running handlers."""
        if self._closed and not self._siblings_open:
            raise ClosedError("factory is closed")
        check_queue_name(name)
        return await self._current(name, self.defaults_for(name), sibling=True)

    async def _recorded(self, name: str, options: Mapping[str, Any]) -> Queue:
        """A queue the backend knows, opened by a tool that looks at queues (the admin
        commands, the dashboard) with ``options``, those recorded for it: not recorded
        again, as a :meth:`_sibling` is not. Recorded again, the record was replaced by
        this release's view of it, losing the options a newer release recorded that this
        one does not know. Options this release refuses raise, as for :meth:`queue`. Not
        claimed: the application's first :meth:`queue` of it, with options or without,
        reopens it with what it asks for, as if the tool had not looked."""
        if self._closed:
            raise ClosedError("factory is closed")
        check_queue_name(name)
        queue_options = self.defaults_for(name).updated(dict(options))
        return await self._current(name, queue_options, sibling=True)

    @contextlib.asynccontextmanager
    async def _using(self, name: str) -> AsyncIterator[Queue]:
        """:meth:`_sibling`, held for one call that uses it (a replay's copies, a find's
        lookup): a claim's reopen closes the factory's own open of it only once no call
        holds it (see :meth:`_claim`)."""
        queue = await self._sibling(name)
        self._holds[queue] = self._holds.get(queue, 0) + 1
        try:
            yield queue
        finally:
            left = self._holds.pop(queue) - 1
            if left:
                self._holds[queue] = left
            else:
                released = self._released.pop(queue, None)
                if released is not None and not released.done():
                    released.set_result(None)

    async def _unheld(self, queue: Queue) -> None:
        """Until no call holds ``queue`` (see :meth:`_using`)."""
        if queue not in self._holds:
            return
        released = self._released.get(queue)
        if released is None:
            released = self._released[queue] = asyncio.get_running_loop().create_future()
        await asyncio.shield(released)  # a cancelled claim leaves it to the next one

    async def _open_queue(
        self,
        name: str,
        options: QueueOptions,
        *,
        sibling: bool = False,
        replacing: Queue | None = None,
    ) -> Queue:
        """Open ``name`` once however many ask at the same time. ``sibling``: opened by the
        factory itself, with the defaults, recorded only if the backend does not know it
        yet, and not claimed (see :meth:`queue`). ``replacing``: that queue (unclaimed, out
        of ``_queues`` already) closes first, once no call holds it, the asks meanwhile
        waiting for this open; refused or cancelled before its close began, it is the
        factory's own open again, which those asks then get."""
        opening = self._opening.get(name)
        if opening is not None:  # opened concurrently: share the one being made
            return await asyncio.shield(opening)
        if self._closed and not (sibling and self._siblings_open):
            raise ClosedError("factory is closed")
        future: asyncio.Future[Queue] = asyncio.get_running_loop().create_future()
        self._opening[name] = future
        closing = False  # ``replacing``'s close begun
        store: Store | None = None
        queue: Queue | None = None
        try:
            limiter = self._limiter(name, options)  # refused before anything is written
            if options.result_ttl:
                check_results(self.backend)
                await self._results.get()  # made now: one that cannot open fails the open
            if replacing is not None:
                await self._unheld(replacing)
                closing = True
                await replacing.close()
            store = await self.backend.store(name, options)
            if self._opens_left:
                # the factory's close gave this open up and may have ended: the queue's
                # open would ask a closed backend (on Redis a closed client may open a
                # connection nothing closes); the store made closes below
                raise ClosedError("factory is closed")
            queue = Queue(
                name,
                options,
                store,
                self.capabilities,
                self.signal,
                self.stats_store,
                self.deadletter,
                self._using,
                limiter,
                self._results.get if self.capabilities.results else None,
            )
            await queue._open()
            await self.stats_store.save_options(name, options.as_dict(), replace=not sibling)
        except BaseException as exc:
            try:
                if store is not None:
                    # before the open ends: a factory's close waiting for it closes the
                    # backend after (see _close_opened)
                    await _close_unopened(name, store, queue)
            finally:
                if replacing is not None and not closing:  # still open: as it was
                    self._queues[name] = replacing
                    self._unclaimed.add(name)
                    future.set_result(replacing)
                else:
                    if replacing is not None and replacing._closing.failed:
                        # Its close failed (the server away): kept as it was, its close run
                        # again by the next ask (see Queue._closed_by_own_close, _claim) or
                        # the factory's close. Dropped, nothing closed it again, and what it
                        # held (a bucket store's leased buckets) stayed out of reach until
                        # the lease lapsed.
                        self._queues[name] = replacing
                        self._unclaimed.add(name)
                    future.set_exception(exc)
                    future.exception()  # retrieved: the awaiting callers re-raise it
            raise
        finally:
            del self._opening[name]
        if self._opens_left:
            # the factory's close no longer waits for this open (see _close_opened): closed
            # here, not handed out open over a closed backend, nor left open for good
            error = ClosedError("factory is closed")
            future.set_exception(error)
            future.exception()  # retrieved: the awaiting callers re-raise it themselves
            with contextlib.suppress(Exception):  # (its backend closed meanwhile)
                await queue._shut(cut_short=True)
            raise ClosedError("factory is closed")
        self._queues[name] = queue
        if sibling:
            self._unclaimed.add(name)
        future.set_result(queue)
        return queue

    def _limiter(self, name: str, options: QueueOptions) -> Limiter | None:
        """The rate limiter of a queue opened with a ``rate_limit`` (None without one); a
        ConfigError where the backend has none."""
        if not options.rate_limit:
            return None
        check_rate_limits(self.backend)
        rule = RateRule(
            options.rate_limit, options.rate_period, options.rate_burst or options.rate_limit
        )
        return functools.partial(self.backend.rate_take, name, rule)

    def _check_open(self) -> None:
        """Refuse a call that reaches the stats store once the factory is closed: each
        backend's closed client fails its own way, and a Redis client opens a connection
        again that nothing closes."""
        if self._closed:
            raise ClosedError("factory is closed")

    def open_queues(self) -> list[Queue]:
        """The queues this factory has open now (none once it is closed). Not one closed
        by its own ``close()``, kept in the map until the next ``queue(name)`` drops it (or,
        its close failed, closes it again and then drops it):
        the metrics read the sizes of these, one per name over every factory, and that
        closed one hid another factory's open queue of the name. Called from other threads
        too (an OpenTelemetry collector's): the map is copied in one step under the GIL
        before it is walked, as the event loop may add a queue meanwhile."""
        if self._closed:
            return []
        return [queue for queue in list(self._queues.values()) if not queue._closed]

    def _claimed_options(self) -> dict[str, QueueOptions]:
        """The options of the open queues asked for through :meth:`queue`: those it would
        refuse other options for (one the factory opened by itself reopens with them)."""
        return {
            name: queue.options
            for name, queue in self._queues.items()
            if name not in self._unclaimed
        }

    async def list(self) -> dict[str, dict[str, Any]]:
        """Queues known to this backend (from any process) with their options."""
        self._check_open()
        return await self.stats_store.queues()

    def pipeline(
        self,
        name: str,
        *,
        acyclic: bool = False,
        queue_options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Pipeline:
        """A new, empty pipeline over this factory's queues: add stations with ``link``,
        ``choice`` and ``sink``, then ``async with pipeline.run(...)``. See
        :mod:`aio_keuss.pipeline`."""
        if self._closed:
            raise ClosedError("factory is closed")
        return Pipeline(self, name, acyclic=acyclic, queue_options=queue_options)

    async def pipelines(self, *, sizes: bool = False) -> dict[str, dict[str, Any]]:
        """Pipelines stored in this backend (by any process, when they started): their
        topology (stations, handlers by name, queues). With ``sizes``, each also has
        ``"sizes"``: the :class:`~aio_keuss.Sizes` of every queue it touches (which opens
        them in this factory, as a move reaches a queue: not recorded over the options the
        pipeline's process recorded for them)."""
        self._check_open()
        found = await self.stats_store.pipelines()
        if sizes:
            for topology in found.values():
                topology["sizes"] = {
                    name: await self._sizes_of(name) for name in topology["queues"]
                }
        return found

    async def _sizes_of(self, name: str) -> Sizes:
        async with self._using(name) as queue:
            return await queue.sizes()

    async def remove_pipeline(self, name: str) -> bool:
        """Forget a stored pipeline topology (its queues and messages stay)."""
        checked = check_pipeline_name(name, None)
        self._check_open()
        return await self.stats_store.remove_pipeline(checked)

    async def close(self, timeout: float | None = CLOSE_TIMEOUT) -> None:
        """Drain and close every queue, then the stats store, signal bus and connection.

        Each queue first stops its consumers (their running handlers finish and acknowledge),
        then gives back the reservations it handed out that nobody ok-ed or ko-ed: they are
        deliverable again at once, with the tries they had, instead of after ``reserve_delay``.
        Called by a consumer's handler, it cannot wait for that handler to end: it starts the
        close and returns (as ``consumer.stop()`` does). Closes called while one is under way
        wait for it. Cancelled (a shutdown timeout), it skips the handlers' grace but still
        lets each queue finish for up to ``CANCELLED_CLOSE_GRACE`` seconds before the
        connection closes: a round trip in flight would lose its reply, and the reservations
        held would stay out of reach until they expire. Past it the calls still waiting for
        the server are given up with the connection at once (``Backend.abandon``), not each
        after a grace of its own. The stats store's last write and the signals still on
        their way out get what is left of that grace, no more: past it the last counters
        are dropped (a WARNING) and the signals too (another process's waiter then finds
        the messages by its poll), never a message.

        ``timeout`` (seconds, default ``CLOSE_TIMEOUT``; None: no limit) bounds a close that
        nobody cancels the same way: past it the close is cancelled once, with a WARNING,
        and goes on as a cancelled close (so it ends at most ``CANCELLED_CLOSE_GRACE``
        seconds later, plus the connection's own bounded close), then returns without
        raising. Without it, a server that accepts connections but stopped answering (hung,
        stopped, behind a dropped connection) kept the close waiting for good. It is the
        timeout of the close this call begins; a close called while one is under way waits
        for that one.
        """
        if timeout is not None:  # refused before anything closes
            timeout = check_seconds(timeout, "timeout")
        owner = self._closing.task is None
        if owner:
            self._closed = True
            self._closing.begin(self._close())
            if timeout is not None:
                self._time_out_after(timeout)
        elif not self._closing.under_way and not self._rest_due():
            return
        queues = list(self._queues.values())
        if any(queue._runs_a_handler() for queue in queues):
            for queue in queues:  # from now on, as a stop from a handler does
                queue._stop_taking()
            return
        try:
            await self._closing.wait(owner)
        except asyncio.CancelledError:
            if owner and self._rest_due():
                # Cancelled before the close's task ran a step (a task cancelled before it
                # starts runs nothing): no queue closed, the reservations held stayed
                # reserved and the backend open. It runs here, as a cancelled close; its
                # failure (the server away) is logged, the cancellation raised.
                try:
                    await self._run_rest()
                except Exception as exc:
                    log.warning("cancelled close failed: %r", exc)
            task = asyncio.current_task()
            if owner and self._timed_out and (task is None or not task.cancelling()):
                return  # cancelled by its timeout, not by our caller: it is over
            raise
        # A close joined here returns once the close is over: one whose task its owner's
        # cancellation ended before it ran a step is then still to run, or running in the
        # owner's task (or, should the owner not wait for it, here).
        if self._rest_due():
            await self._run_rest()

    def _time_out_after(self, timeout: float) -> None:
        """Cancel the close's task once, ``timeout`` seconds from now, if it is still
        running: as a caller's shutdown timeout does, so that the rest of the close is
        bounded as a cancelled close's is."""
        closing = self._closing.task
        assert closing is not None

        def time_out() -> None:
            if closing.done():
                return
            self._timed_out = True
            log.warning(
                "factory close: not over after its timeout of %s s (a server that does not"
                " answer?): it goes on as a cancelled close, bounded",
                timeout,
            )
            closing.cancel()

        timer = asyncio.get_running_loop().call_later(timeout, time_out)
        closing.add_done_callback(lambda _: timer.cancel())

    def _rest_due(self) -> bool:
        """Whether the close's task was cancelled before it ran a step, and the close it
        did not run has not ended since."""
        task = self._closing.task
        if task is None or not task.cancelled():
            return False
        if self._rest is not None:
            return not self._rest.done()
        return not self._close_begun

    async def _run_rest(self) -> None:
        """Run the close the cancelled task did not, as a cancelled close, or wait for the
        caller running it."""
        if self._rest is not None:
            await asyncio.shield(self._rest)
            return
        rest = self._rest = asyncio.get_running_loop().create_future()
        try:
            await self._close(cut_short=True)
        except Exception as exc:
            rest.set_exception(exc)
            rest.exception()  # retrieved: the closes waiting re-raise it themselves
            raise
        finally:
            if not rest.done():
                rest.set_result(None)

    async def _stop_consumers(self) -> Sequence[BaseException | None]:
        """Every queue's consumers stop first, side by side, while every queue is still
        open: a handler finishing in its grace may push into another queue of this factory
        (closed under it, its push failed and its message was handled again). A cancelled
        close (a second Ctrl-C) reaches every consumer's stop at once."""
        # queues still opening when the close began are closed with the others, not handed
        # out open over a closed backend (and never closed)
        while self._opening:
            await asyncio.wait(list(self._opening.values()))
        self._siblings_open = True  # a handler's move may open its target meanwhile
        return await asyncio.gather(
            *(queue._stop_consumers() for queue in list(self._queues.values())),
            return_exceptions=True,
        )

    async def _close_opened(self, opening: asyncio.Future[Queue], end: float | None) -> None:
        """Close the queue whose open ``opening`` is under way, once open, as the rest of a
        cancelled close: waited for until ``end`` (its grace's) only, past which its open
        closes it (see :meth:`_open_queue`)."""
        timeout = None if end is None else max(0.0, end - asyncio.get_running_loop().time())
        await asyncio.wait({opening}, timeout=timeout)
        if not opening.done():  # given up (cancelled again: see _close_queues)
            self._opens_left = True
            return
        if opening.cancelled() or opening.exception() is not None:
            return  # no queue made
        await opening.result()._shut(cut_short=True)

    async def _close(self, cut_short: bool = False) -> None:
        """``close``'s work; ``cut_short``: the rest of a close cancelled before it began,
        without the consumers' grace (bounded as a cancelled close). Three steps, each run
        whatever the one before raised: the consumers stop, every queue closes, then the
        connection and what shares it."""
        self._close_begun = True
        # a cancelled close's grace: the queues' closes, then the stats store's last write
        # and the signals on their way out share it (a silent server answers neither)
        grace = _Grace()
        if cut_short:
            grace.begin()
        cancelled: asyncio.CancelledError | None = None
        try:
            stops: Sequence[BaseException | None] = ()
            try:
                if not cut_short:
                    stops = await self._stop_consumers()
            except asyncio.CancelledError:
                grace.begin()  # the queues' closes are bounded as cancelled ones
                raise
            finally:
                closes = await self._close_queues(grace)
            for result in (*stops, *closes):
                if isinstance(result, Exception):
                    raise result
        except asyncio.CancelledError as exc:
            cancelled = exc
            raise
        finally:
            self._opens_left = True  # (none is left past here)
            try:
                await self._close_connection(grace)
            except Exception as exc:
                if cancelled is None:
                    raise
                # Cancelled: the cancellation is the answer, not the connection's failure
                # (the server away), which raised in its place swallowed the caller's
                # cancel (a TaskGroup, a shutdown timeout saw a failure where it cancelled).
                log.warning("cancelled close: the connection's close failed: %r", exc)
            finally:
                grace.cancel_give_up()

    async def _close_queues(self, grace: _Grace) -> Sequence[BaseException | None]:
        """Close every queue, once the consumers are stopped (or their stop was cancelled):
        side by side, each close's failure returned. As a cancelled close once ``grace``
        began, and past its end the connection is given up (see :meth:`_Grace.give_up`).
        Cancelled, every queue still closes, as the rest of a cancelled close, before this
        raises: else the backend closed under the calls in flight."""
        self._siblings_open = False  # no queue begins to open from here on
        # opened by a move as the consumers stopped (a handler's, or a task's): closed with
        # the others, once open
        opening = list(self._opening.values())
        cancelled: asyncio.CancelledError | None = None
        if opening and grace.end is None:
            try:
                await asyncio.wait(opening)
            except asyncio.CancelledError as exc:
                # Cancelled here, the close left at once: no queue closed, and the backend
                # closed under them. They close as after a cancelled stop.
                cancelled = exc
                grace.begin()
        # still opening in a cancelled close: waited for within its grace only (an open on
        # a server that stopped answering never ends), beside the closes
        opening = [future for future in opening if not future.done()]
        queues = list(self._queues.values())
        cut_short = grace.end is not None
        if cut_short:
            grace.give_up(self.backend.abandon)
        # one failing to close (its server away) must not keep the others open; after a
        # cancelled stop too, so that each still gives back what it holds before the
        # backend closes under it
        closing = [
            asyncio.ensure_future(queue._shut(cut_short=True) if cut_short else queue.close())
            for queue in queues
        ]
        closing += [
            asyncio.ensure_future(self._close_opened(future, grace.end)) for future in opening
        ]
        try:
            # not gather: cancelled, it raised only once every queue's grace was over, and
            # the grace's start, which bounds what follows, was unknown
            if closing:
                await asyncio.wait(closing)
        except asyncio.CancelledError:
            # Cancelled again (a close cancelled already, or cut short): the grace under way
            # holds, not a new one, and so does its one give-up.
            grace.begin()
            grace.give_up(self.backend.abandon)
            for task in closing:
                task.cancel()
            await asyncio.gather(*closing, return_exceptions=True)
            # Cancelled before a queue's close had run its first step, that close never ran
            # (a task cancelled before it starts runs nothing): it runs now as the rest of a
            # cancelled close, bounded alike; one under way is waited for.
            await asyncio.gather(
                *(queue._shut(cut_short=True) for queue in queues),
                *(self._close_opened(future, grace.end) for future in opening),
                return_exceptions=True,
            )
            raise
        if cancelled is not None:
            raise cancelled
        return [None if task.cancelled() else task.exception() for task in closing]

    async def _close_connection(self, grace: _Grace) -> None:
        """The last of a close, once the queues are closed: the stats store's last write,
        the signals on their way out (both within what is left of ``grace``), the result
        store, then the backend's connection; each closes whatever the one before raised."""
        try:
            # raises when the server is away at close
            await grace.within(self.stats_store.close(), "the stats store's close")
        finally:
            try:
                await self.signal.close(grace.end)  # ... and the listener must still stop
            finally:
                try:
                    await self._results.close()
                finally:
                    await self.backend.close()

    async def __aenter__(self) -> Factory:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def _close_unopened(name: str, store: Store, queue: Queue | None) -> None:
    """Close what an open that failed, or was cancelled, had made: its store, and the queue
    over it (its signal subscriptions). Nothing else holds them: left as they were, the
    store stayed open (a bucket store's state, its flusher) and the queue went on hearing
    the queue's signals for good. Closed as the rest of a cancelled close, bounded alike
    (the server may be what failed the open); a failure to close is logged, the open's own
    failure is what its caller hears."""
    try:
        if queue is not None:
            await queue._shut(cut_short=True)
        else:
            await store.close()
    except Exception as exc:
        log.warning("queue %r: a failed open's store did not close: %r", name, exc)


class _Grace:
    """When a cancelled close's grace ends (the loop's clock; None while the close is not
    cancelled): the queues' closes, then the stats store's last write and the signals on
    their way out, which share what is left of it."""

    def __init__(self) -> None:
        self.end: float | None = None
        self._give_up: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        """The grace begins now, unless it has: cancelled again, the grace under way holds
        (the README bounds a cancelled close by it, 'or until it is cancelled again')."""
        if self.end is None:
            self.end = asyncio.get_running_loop().time() + CANCELLED_CLOSE_GRACE

    def give_up(self, abandon: Callable[[], None]) -> None:
        """Run ``abandon`` (``Backend.abandon``) when the grace ends, unless the close ended
        first (see :meth:`cancel_give_up`): once the grace is spent, what still waits for
        the server is given up at once with the connection. On Redis each reply a silent
        server never sent held its caller for its own cancel grace, one after the other
        (the queue's drain, the bucket store's write-backs, its state flusher), and a
        cancelled close of bucket-redis ended after a minute rather than within its grace.
        Set once: set again (cancelled again), it replaced the first, never cancelled,
        which then ran after the close had ended."""
        if self._give_up is None and self.end is not None:
            self._give_up = asyncio.get_running_loop().call_at(self.end, abandon)

    def cancel_give_up(self) -> None:
        """The close is over: nothing is given up any more."""
        if self._give_up is not None:
            self._give_up.cancel()

    async def within(self, step: Coroutine[Any, Any, None], what: str) -> None:
        """Run ``step`` of a close; once the grace began, stop waiting for it at its end: a
        server that stopped answering never ends it, and a command already sent is only let
        go some time after its cancellation (Redis runs it whatever the caller does). What
        it had still to write is lost (the last counters of the stats store); the backend's
        close then ends it. Cancelled while it runs without a grace (a close cancelled, or
        timed out, just as the queues had closed), the grace begins then, and the
        cancellation is raised once the step ended or was given up: cancelling the step
        itself lost its write with no WARNING, and the signals after it were then waited
        for without limit."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(step)
        cancelled: asyncio.CancelledError | None = None
        while True:
            timeout = None if self.end is None else max(0.0, self.end - loop.time())
            try:
                done, _ = await asyncio.wait({task}, timeout=timeout)
            except asyncio.CancelledError as exc:
                if self.end is not None:  # cancelled again, in the grace
                    task.cancel()
                    raise
                cancelled = exc
                self.begin()
                continue
            break
        if not done:
            task.cancel()
            log.warning("cancelled close: %s given up (no answer within the grace)", what)
            if cancelled is not None:
                raise cancelled
            return
        if cancelled is not None:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:  # the cancellation is raised in its place
                log.warning("cancelled close: %s failed: %r", what, failure)
            raise cancelled
        task.result()


class _Connecting:
    """What ``connect`` returns: ``await`` it, or use it as ``async with``."""

    def __init__(self, backend: str, options: dict[str, Any]) -> None:
        self._backend = backend
        self._options = options
        self._factory: Factory | None = None

    def __await__(self) -> Generator[Any, None, Factory]:
        return _open_factory(self._backend, self._options).__await__()

    async def __aenter__(self) -> Factory:
        self._factory = await _open_factory(self._backend, self._options)
        return self._factory

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._factory is not None:
            await self._factory.close()


def connect(backend: str = "memory", **options: Any) -> _Connecting:
    """Connect to a backend by name (see ``aio_keuss.backend_names()``).

    Options: the backend's own (``url``, ``client``, ...), any queue option as a default for
    every queue (``reserve_delay``, ``poll_interval``, ``dedup_window``, ``max_batch``;
    ``rate_limit`` too, but not for the deadletter queue: see ``Factory.defaults_for``),
    ``deadletter={"max_ko": 3, "queue": "__deadletter__"}``, ``signal`` / ``stats``
    (``"local"`` / ``"memory"`` to keep them in-process; default: the backend's database),
    and ``signal_debounce`` (seconds, default 0.05).
    """
    return _Connecting(backend, options)


async def _open_factory(backend_name: str, options: dict[str, Any]) -> Factory:
    backend_class = load_backend(backend_name)
    known = _FACTORY_OPTIONS | QUEUE_OPTION_NAMES | set(backend_class.options)
    unknown = set(options) - known
    if unknown:
        raise ConfigError(
            f"unknown option(s) for backend {backend_name!r}: {', '.join(sorted(unknown))}"
        )
    defaults = QueueOptions().updated({k: v for k, v in options.items() if k in QUEUE_OPTION_NAMES})
    deadletter = DeadletterOptions.parse(options.get("deadletter"))
    debounce = options.get("signal_debounce", 0.05)
    if (
        isinstance(debounce, bool)
        or not isinstance(debounce, int | float)
        or not 0 <= debounce < 60
    ):
        raise ConfigError(f"signal_debounce must be seconds in [0, 60), not {debounce!r}")
    signal_kind = options.get("signal")
    stats_kind = options.get("stats")
    if signal_kind not in (None, "local"):
        raise ConfigError(f"signal must be 'local' or left out, not {signal_kind!r}")
    if stats_kind not in (None, "memory"):
        raise ConfigError(f"stats must be 'memory' or left out, not {stats_kind!r}")

    if defaults.rate_limit:  # before the backend makes a client it would have to close
        check_rate_limits(backend_class)
    if defaults.result_ttl:
        check_results(backend_class)
    backend = backend_class({k: v for k, v in options.items() if k in backend_class.options})
    await backend.open()
    try:
        signal = LocalSignalBus(debounce) if signal_kind else backend.signal_bus(debounce)
        stats = MemoryStats() if stats_kind else backend.stats_store()
        await signal.open()
        try:
            await stats.open()
        except BaseException:
            await signal.close()
            raise
    except BaseException:
        await backend.close()
        raise
    return Factory(backend, signal, stats, defaults, deadletter)


def check_rate_limits(backend: Backend | type[Backend]) -> None:
    """Refuse a ``rate_limit`` where the backend cannot keep one."""
    if not backend.capabilities.rate_limit:
        raise ConfigError(f"backend {backend.name!r} has no rate limits (rate_limit must be 0)")


def check_results(backend: Backend | type[Backend]) -> None:
    """Refuse a ``result_ttl`` where the backend cannot keep results."""
    if not backend.capabilities.results:
        raise ConfigError(f"backend {backend.name!r} keeps no results (result_ttl must be 0)")


class _ResultStoreOnce:
    """The backend's result store of one factory: made and opened by the first queue that
    needs it (a queue opened with ``result_ttl``, a first ``result``), closed with the
    factory. A factory that never needs one never makes one (no table, no index)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._opening: asyncio.Task[ResultStore] | None = None

    async def get(self) -> ResultStore:
        opening = self._opening
        if opening is None:
            opening = asyncio.get_running_loop().create_task(self._open())
            self._opening = opening
        try:
            # shielded: one caller's cancellation must not fail the others' open
            return await asyncio.shield(opening)
        except Exception:
            if opening.done() and self._opening is opening:
                self._opening = None  # the next caller tries again (a server back)
            raise

    async def _open(self) -> ResultStore:
        store = self._backend.result_store()
        await store.open()
        return store

    async def close(self) -> None:
        opening, self._opening = self._opening, None
        if opening is None:
            return
        if not opening.done():
            opening.cancel()
        try:
            store = await opening
        except (Exception, asyncio.CancelledError):
            return  # never opened: nothing to close
        await store.close()
