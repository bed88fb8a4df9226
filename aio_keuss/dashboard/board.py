"""What the dashboard shows and does, read through one factory, as plain JSON-ready data.

Queues come from ``factory.list()`` (every queue any process opened on the backend), each
opened here with the options it was recorded with: opening a queue records its options, so
opening it with this process's defaults would overwrite what the application set. Recorded
options that fail to apply here (a value a newer release allows) leave the queue opened with
the defaults without recording them. A queue the backend knows is opened without being
recorded again: the record may hold options a newer release added.

Rates come from the shared counters (``Queue.stats``): a background task samples them every
``sample_every`` seconds and keeps the last ``keep`` seconds, so the chart has a history as
soon as a page opens, and pages open at once cost no more than one.

A payload is rendered here to text (indented JSON, or a hex preview of bytes), and headers
and ids too, with line breaks and bidi controls as escapes (:func:`visible`); the page
inserts them as text, so nothing in a message ever becomes markup or reorders what is
shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson

from ..errors import ClosedError, ConfigError, InvalidInputError, KeussError
from ..factory import Factory
from ..message import visible
from ..options import DEFAULT_DEADLETTER_QUEUE, QUEUE_OPTION_NAMES, check_queue_name
from ..queue import Queue
from ..types import PEEK_STATES, MessageView

T = TypeVar("T")

log = logging.getLogger("aio_keuss.dashboard")

PAYLOAD_CHARS = 4000
"""Characters of a payload shown at most (a message may be megabytes)."""
BYTES_SHOWN = 256
PEEK_MAX = 200
REQUEUE_MAX = 1000
REQUEUE_SCAN_MAX = 10 * REQUEUE_MAX
"""Ready messages one Requeue all looks at, at most: it walks past those it cannot move
(no valid ``x-dl-from-queue``) to reach movable ones behind them, bounded per click."""
SAMPLE_EVERY = (0.2, 3600.0)
"""Seconds allowed between rate samples (the command's ``--sample-seconds`` range): each
sample reads every queue's counters and sizes, so a shorter interval, 0 or a negative one
makes the sampler a busy loop on the backend."""


class UnknownQueueError(InvalidInputError):
    """The queue is not among those the backend lists."""


def payload_text(payload: Any) -> str:
    if isinstance(payload, bytes):
        head = payload[:BYTES_SHOWN].hex(" ")
        more = " ..." if len(payload) > BYTES_SHOWN else ""
        return f"({len(payload)} bytes) {head}{more}"
    # JSON escapes only what is below U+0020; the line breaks left are the indentation's
    text = visible(orjson.dumps(payload, option=orjson.OPT_INDENT_2, default=repr).decode(), "\n")
    if len(text) > PAYLOAD_CHARS:
        return text[:PAYLOAD_CHARS] + f"\n... ({len(text) - PAYLOAD_CHARS} more characters)"
    return text


def message_data(found: MessageView) -> dict[str, Any]:
    message = found.message
    return {
        "queue": found.queue,
        "id": message.id,  # what the page sends back to name the message
        "shown_id": visible(message.id),  # what it shows (a stored id may hold anything)
        "state": found.state,
        "at": found.at.timestamp(),
        "tries": message.tries,
        "priority": message.priority,
        "headers": {visible(key): visible(str(value)) for key, value in message.headers.items()},
        "payload": payload_text(message.payload),
    }


class Board:
    """The dashboard's view of one backend. ``deadletter`` is the queue the deadletter view
    shows: by default the one the factory's ``deadletter`` option names (a factory
    connected with ``deadletter={"queue": "failed"}`` sends failed messages there, and a
    view of ``__deadletter__`` would show none of them), else ``__deadletter__``."""

    def __init__(
        self,
        factory: Factory,
        *,
        deadletter: str | None = None,
        sample_every: float = 5.0,
        keep: float = 600.0,
    ) -> None:
        self.factory = factory
        if deadletter is None:  # where this factory's kos send messages, else the default
            configured = factory.deadletter
            deadletter = DEFAULT_DEADLETTER_QUEUE if configured is None else configured.queue
        self.deadletter = check_queue_name(deadletter)
        low, high = SAMPLE_EVERY
        number = isinstance(sample_every, (int, float)) and not isinstance(sample_every, bool)
        if not (number and low <= sample_every <= high):  # NaN fails the comparison too
            raise ConfigError(
                f"sample_every must be in [{low}, {high}] seconds, not {sample_every!r}"
            )
        self.sample_every = float(sample_every)
        self._samples: deque[tuple[float, dict[str, tuple[int, int, int]]]] = deque(
            maxlen=max(2, int(keep / sample_every) + 1)
        )
        self._queues: dict[str, Queue] = {}
        self._opening = asyncio.Lock()
        self._sampler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sampler = asyncio.get_running_loop().create_task(self._sample_forever())

    async def stop(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler

    # queues ---------------------------------------------------------------------------

    async def _listed(self) -> dict[str, Queue]:
        """Every listed queue, opened here once with its recorded options, and again once
        the application closed it (``queue.close()`` on the object its factory hands out,
        this one): kept, the closed queue failed every read (ClosedError), where the
        factory opens the name afresh."""
        listed = await self.factory.list()
        names = []
        for name in sorted(listed):
            try:  # a name this release refuses cannot be opened at all: not shown
                names.append(check_queue_name(name))
            except InvalidInputError as exc:  # (a newer release allowed it, or a hand)
                log.debug("queue %r left out: %s", name, exc)
        async with self._opening:
            for name, queue in list(self._queues.items()):
                if queue._closed or queue._closing.under_way:
                    del self._queues[name]
            for name in names:
                if name in self._queues:
                    continue
                options = {k: v for k, v in listed[name].items() if k in QUEUE_OPTION_NAMES}
                try:  # not recorded again: the record may hold a newer release's options
                    self._queues[name] = await self.factory._recorded(name, options)
                except KeussError as exc:  # e.g. options a newer release recorded
                    # shown all the same, opened with the defaults as a move reaches a queue:
                    # not recorded over what the application recorded (factory.queue would)
                    log.debug("queue %r opened with defaults, unrecorded: %s", name, exc)
                    self._queues[name] = await self.factory._sibling(name)
        return {name: self._queues[name] for name in names}

    async def queue(self, name: object) -> Queue:
        checked = check_queue_name(name)
        found = (await self._listed()).get(checked)
        if found is None:
            raise UnknownQueueError(f"no queue {checked!r} on this backend")
        return found

    async def _read(self, read: Callable[[dict[str, Queue]], Awaitable[T]]) -> T:
        """``read`` of the listed queues, again as long as one closed under it: the
        application's first ``factory.queue`` of a queue opened here (not asked for, see
        ``Factory._recorded``) reopens it with the options asked for, closing this open;
        listed again, the reopened queue is read. Again each time: a worker opening its
        queues one by one (a pipeline's stations) closes one under each read. It ends, as
        each queue is claimed once; a ClosedError with none of them closed (the factory
        closed) is raised."""
        while True:
            queues = await self._listed()
            try:
                return await read(queues)
            except ClosedError:
                if not any(q._closed or q._closing.under_way for q in queues.values()):
                    raise

    async def _one(self, name: object, read: Callable[[Queue], Awaitable[T]]) -> T:
        """``read`` of the listed queue ``name`` (see :meth:`_read`): a peek, pause or
        promote failed with ClosedError when the application's first ask reopened it."""
        checked = check_queue_name(name)

        async def one(queues: dict[str, Queue]) -> T:
            found = queues.get(checked)
            if found is None:
                raise UnknownQueueError(f"no queue {checked!r} on this backend")
            return await read(found)

        return await self._read(one)

    async def _rows(self, queues: dict[str, Queue]) -> list[dict[str, Any]]:
        return await asyncio.gather(*(self._row(name, queue) for name, queue in queues.items()))

    async def state(self) -> dict[str, Any]:
        rows = await self._read(self._rows)
        pipelines = await self.factory.pipelines()
        capabilities = self.factory.capabilities
        return {
            "backend": self.factory.backend_name,
            "now": time.time(),
            "deadletter": self.deadletter,
            "capabilities": {
                "peek": capabilities.peek,
                "requeue": capabilities.peek and capabilities.hold and capabilities.move,
                "promote": capabilities.reschedule,
            },
            "queues": rows,
            "pipelines": [_pipeline_data(doc) for doc in pipelines.values()],
            "rates": self.rates(),
            "sample_every": self.sample_every,
        }

    async def _row(self, name: str, queue: Queue) -> dict[str, Any]:
        sizes, paused, counters = await asyncio.gather(
            queue.sizes(), queue.is_paused(), queue.stats()
        )
        return {
            "name": name,
            "size": sizes.size,
            "scheduled": sizes.scheduled,
            "reserved": sizes.reserved,
            "total": sizes.total,
            "paused": paused,
            "counters": counters,
            "deadletter": name == self.deadletter,
        }

    async def peek(self, name: object, state: object, n: object) -> list[dict[str, Any]]:
        if not isinstance(state, str) or state not in PEEK_STATES:
            raise InvalidInputError(f"state must be one of {', '.join(sorted(PEEK_STATES))}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= PEEK_MAX:
            raise InvalidInputError(f"n must be an int in [1, {PEEK_MAX}]")
        found = await self._one(name, lambda queue: queue.peek(n, state=state))
        return [message_data(message) for message in found]

    async def pause(self, name: object, paused: bool) -> bool:
        async def pause(queue: Queue) -> bool:
            await (queue.pause() if paused else queue.resume())
            return await queue.is_paused()

        return await self._one(name, pause)

    async def promote(self, name: object, message_id: object) -> bool:
        """Make a scheduled message ready now; False when it is no longer scheduled (taken,
        removed, or ready meanwhile: the page showed an older peek)."""
        return await self._one(name, lambda queue: queue.promote(message_id))  # type: ignore[arg-type]  # checked there

    async def requeue(self, name: object, ids: object) -> dict[str, Any]:
        """Move deadlettered messages back where they failed: ``ids`` (answered with id here
        -> id in its origin), or, when ``ids`` is None, the first :data:`REQUEUE_MAX` ready
        ones that name a valid origin, found among at most :data:`REQUEUE_SCAN_MAX` (a
        message without one would otherwise hide those behind it, click after click),
        answered with ``moved`` (that mapping), ``unmovable`` (passed over for want of a
        valid ``x-dl-from-queue``) and ``left`` (ready messages the deadletter queue has
        after: the page's count is one refresh old). The deadletter queue is held
        meanwhile, as a replay holds its target (see ``Factory._using``): the application's
        first ask of it, reopening the factory's own open, waits for the requeue to end.
        Closed under it, the requeue failed (ClosedError) past the batches it had moved:
        not one read to try again, as the others here are."""
        checked = (await self.queue(name)).name  # known, and opened as it was recorded
        await self._listed()  # origins open with their recorded options, not the defaults
        if ids is not None and not (
            isinstance(ids, list)
            and len(ids) <= REQUEUE_MAX
            and all(isinstance(i, str) for i in ids)
        ):
            raise InvalidInputError(f"ids must be a list of at most {REQUEUE_MAX} strings")
        async with self.factory._using(checked) as queue:
            if ids is not None:
                return await queue.requeue(list(ids)) if ids else {}
            chosen: list[str] = []
            unmovable = 0
            seen = itertools.count(1)
            async for found in queue.browse(state="ready", page_size=REQUEUE_MAX):
                if _movable(found):
                    chosen.append(found.message.id)
                else:
                    unmovable += 1
                if len(chosen) == REQUEUE_MAX or next(seen) == REQUEUE_SCAN_MAX:
                    break
            moved = await queue.requeue(chosen) if chosen else {}
            left = (await queue.sizes()).size
            return {"moved": moved, "unmovable": unmovable, "left": left}

    # rates ----------------------------------------------------------------------------

    async def sample(self) -> None:
        """One point of the chart, read as :meth:`_read` does: a queue the application
        claimed under it cost the sample (a warning saying the backend was away)."""
        counts = await self._read(self._counts)
        self._samples.append((time.time(), counts))

    async def _counts(self, queues: dict[str, Queue]) -> dict[str, tuple[int, int, int]]:
        counts: dict[str, tuple[int, int, int]] = {}
        for name, queue in queues.items():
            counters = await queue.stats()
            size = (await queue.sizes()).total
            counts[name] = (counters["put"], counters["commit"] + counters["get"], size)
        return counts

    async def _sample_forever(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception as exc:  # the backend is away: the next sample tries again
                log.warning("dashboard: sampling failed: %r", exc)
            await asyncio.sleep(self.sample_every)

    def rates(self) -> dict[str, list[list[float]]]:
        """Per queue, ``[time, pushed/s, done/s, total size]`` between consecutive samples."""
        series: dict[str, list[list[float]]] = {}
        for (t0, before), (t1, after) in itertools.pairwise(self._samples):
            span = t1 - t0
            if span <= 0:
                continue
            for name, (put, done, size) in after.items():
                put0, done0, _ = before.get(name, (put, done, size))
                series.setdefault(name, []).append(
                    [t1, max(0, put - put0) / span, max(0, done - done0) / span, size]
                )
        return series


def _movable(found: MessageView) -> bool:
    """Whether ``Queue.requeue`` could move this message: its ``x-dl-from-queue`` header
    names a valid queue (anyone may push into a deadletter queue, headers and all)."""
    try:
        check_queue_name(found.message.headers.get("x-dl-from-queue"))
    except InvalidInputError:
        return False
    return True


def _pipeline_data(doc: dict[str, Any]) -> dict[str, Any]:
    """The part of a stored topology the graph needs."""
    stations = []
    for station in doc.get("stations", []):
        to = station.get("to", [])
        stations.append(
            {
                "name": str(station.get("name")),
                "kind": str(station.get("kind")),
                "from": str(station.get("from")),
                "to": [str(t) for t in (to if isinstance(to, list) else [to])],
                "handler": str(station.get("handler")),
            }
        )
    return {
        "name": str(doc.get("name")),
        "stations": stations,
        "queues": [str(q) for q in doc.get("queues", [])],
    }
