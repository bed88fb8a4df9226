"""Counters, the paused flag and queue options, shared by every process of a backend.

Counting is on the hot path, so increments are buffered here, once, and a background task
hands them to the database every ``flush_interval`` seconds (and on close); a subclass only
writes a batch of increments. Stores that live in this process apply them at once. The
flusher sleeps while the buffer is empty, so an idle factory does not wake up ten times a
second for nothing.

A read (:meth:`StatsStore.counters`) adds this process's increments that are not stored yet
to what the database holds. A flush takes its batch out of the buffer before the database
has it, so a read overlapping that window would find the batch in neither place, or, once
it has landed while still counted as in flight, in both. Reads and flushes therefore take
turns (one lock): a read waits for a flush in flight to land or fail back into the buffer,
and no flush starts while a read waits for the database; then the stored counters and the
buffer are disjoint and together complete.

While the database is unreachable the increments stay buffered and every flush retries them;
that is logged once per outage (a warning), and once more (info) when a flush lands again.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

from . import observe

log = logging.getLogger("aio_keuss.stats")

COUNTERS = ("put", "get", "reserve", "commit", "rollback", "deadletter")

Increments = dict[str, dict[str, int]]


class PartlyWritten(Exception):
    """Raised by :meth:`StatsStore._apply` when only part of a batch was written (a Redis
    Cluster node away while the others answer): only ``unwritten`` goes back into the
    buffer, since what was written must not be added again by the next flush."""

    def __init__(self, unwritten: Increments, cause: BaseException) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.unwritten = unwritten
        self.__cause__ = cause


CLOSE_WAIT = 2.0
"""Longest ``close`` waits for the flusher; a driver that never returns must not hang it."""


class StatsStore(ABC):
    flush_interval: float | None = 0.1
    """Seconds between flushes of buffered increments; None for a store that never buffers."""

    def __init__(self) -> None:
        self._buffer: defaultdict[str, defaultdict[str, int]] = defaultdict(
            lambda: defaultdict(int)
        )
        self._flusher: asyncio.Task[None] | None = None
        self._closing = False
        self._turns = asyncio.Lock()  # a flush and a read never overlap (see the module doc)
        self._flushing = False  # the flusher is writing a batch (or waiting for its turn)
        self._failing = False  # the last flush failed: an outage was already reported
        self._dirty = asyncio.Event()  # set whenever the buffer holds something
        self._local_pipelines: dict[str, dict[str, Any]] = {}

    async def open(self) -> None:
        if self.flush_interval is not None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_forever())

    async def close(self) -> None:
        self._closing = True
        flusher, self._flusher = self._flusher, None
        stuck = False
        if flusher is not None:
            # A batch being written is let land: cancelled half-way it would be lost, or,
            # merged back after the database had it, counted twice.
            if not self._flushing:
                flusher.cancel()
            done, _ = await asyncio.wait({flusher}, timeout=CLOSE_WAIT)
            if not done:
                flusher.cancel()
                done, _ = await asyncio.wait({flusher}, timeout=CLOSE_WAIT)
            stuck = not done
        if stuck:  # it still holds its turn: write what is left beside it
            await self._flush_buffer()
        else:
            await self.flush()

    def incr(self, queue: str, counter: str, n: int = 1) -> None:
        """Count ``n`` events. The one place where metrics (:mod:`aio_keuss.observe`), when
        enabled, see them; the counting itself is :meth:`_add`."""
        if observe.active is not None:
            observe.active.count(queue, counter, n)
        self._add(queue, counter, n)

    def uncount(self, queue: str, counter: str, n: int) -> None:
        """Take back ``n`` events of ``counter``: messages counted as taken (``get``,
        ``reserve``) when the store handed them out, then put back before user code saw
        them (a stopped consumer's prefetch, an interrupted blocking call). Taken again,
        they are counted again; so the counters show one take per delivery. Metrics are
        left alone: a Prometheus counter only goes up, a decrease reads as a restart
        (Prometheus documentation, "Metric types")."""
        self._add(queue, counter, -n)

    def _add(self, queue: str, counter: str, n: int) -> None:
        """Buffered until the next flush (a local store overrides this)."""
        if n:
            if not self._buffer:
                self._dirty.set()
            self._buffer[queue][counter] += n

    async def counters(self, queue: str) -> dict[str, int]:
        """Stored counters plus this process's increments not stored yet (buffered, or in a
        flush in flight, which is waited for), every known counter present."""
        async with self._turns:
            stored = await self._load_counters(queue)
            buffered = dict(self._buffer.get(queue, {}))
        result = dict.fromkeys(COUNTERS, 0)
        for source in (stored, buffered):
            for name, value in source.items():
                result[name] = result.get(name, 0) + value
        return result

    async def flush(self) -> None:
        async with self._turns:
            await self._flush_buffer()

    async def _flush_buffer(self) -> bool:
        """Write the buffer out; whether there was anything to write. On failure the batch
        goes back into the buffer for the next flush."""
        if not self._buffer and not self._unsettled():
            return False
        batch: Increments = {q: dict(c) for q, c in self._buffer.items()}
        self._buffer.clear()
        try:
            await self._apply(batch)
        except PartlyWritten as exc:
            self._merge_back(exc.unwritten)
            # the caller (close, flush) gets the typed error a write raised, not this
            # bookkeeping class, which is no aio_keuss error
            typed = exc.__cause__
            if typed is None:
                raise
            raise typed from typed.__cause__  # keeps the driver's error as its cause
        except Exception:
            self._merge_back(batch)
            raise
        return True

    async def _flush_forever(self) -> None:
        assert self.flush_interval is not None
        while not self._closing:
            await self._dirty.wait()
            await asyncio.sleep(self.flush_interval)
            self._flushing = True
            try:
                async with self._turns:
                    wrote = await self._flush_buffer()
            except Exception as exc:  # kept buffered; the next flush tries again
                self._flush_failed(exc)
            else:
                if wrote and self._failing:
                    self._failing = False
                    log.info("%s: stats flush works again", type(self).__name__)
            finally:
                self._flushing = False
                if not self._buffer and not self._unsettled():  # a failed batch: stays set
                    self._dirty.clear()

    def _flush_failed(self, exc: Exception) -> None:
        """One warning per outage: the flusher retries every ``flush_interval``, and a
        warning per attempt would bury everything else in the log while a server is away."""
        if self._failing:
            log.debug("%s: stats flush failed again: %s", type(self).__name__, exc)
            return
        self._failing = True
        log.warning(
            "%s: stats flush failed (%s); increments stay buffered and are retried every"
            " %s s until it works again",
            type(self).__name__,
            exc,
            self.flush_interval,
        )

    def _merge_back(self, batch: Increments) -> None:
        if batch:
            self._dirty.set()
        for queue, counters in batch.items():
            for name, value in counters.items():
                self._buffer[queue][name] += value

    # what a database provides ---------------------------------------------------------

    def _unsettled(self) -> bool:
        """Whether a batch :meth:`_apply` kept aside (its outcome unknown, it raised
        :class:`PartlyWritten` without it) must still be sent: the next flush calls
        :meth:`_apply` for it even with nothing new buffered."""
        return False

    @abstractmethod
    async def _apply(self, increments: Increments) -> None:
        """Add a batch of increments: {queue: {counter: n}}."""

    @abstractmethod
    async def _load_counters(self, queue: str) -> dict[str, int]: ...

    async def reset(self, queue: str) -> None:
        """Zero a queue's counters, this process's unwritten increments included. A flush in
        flight lands first, not after the reset (reads and flushes take turns)."""
        async with self._turns:
            self._buffer.pop(queue, None)
            self._forget_unsent(queue)
            await self._reset(queue)

    def _forget_unsent(self, queue: str) -> None:
        """Drop ``queue`` from a batch kept aside (see :meth:`_unsettled`): a reset zeroes it."""

    @abstractmethod
    async def _reset(self, queue: str) -> None:
        """Delete a queue's stored counters."""

    @abstractmethod
    async def set_paused(self, queue: str, paused: bool) -> None: ...

    @abstractmethod
    async def is_paused(self, queue: str) -> bool: ...

    @abstractmethod
    async def save_options(
        self, queue: str, options: dict[str, Any], *, replace: bool = True
    ) -> None:
        """Record a queue and its options so ``factory.list()`` finds it from any process.
        With ``replace`` false, only if none are recorded yet, in one atomic step: a queue
        reached by a move is recorded with this process's defaults, and a check then a
        write would replace the options another process recorded in between."""

    @abstractmethod
    async def queues(self) -> dict[str, dict[str, Any]]:
        """Every recorded queue with its options."""

    # Pipeline topologies: kept in this process unless a store keeps them in its database
    # (every database's store does, so ``factory.pipelines()`` sees every process's).

    async def save_pipeline(self, name: str, topology: dict[str, Any]) -> None:
        """Record a pipeline's topology so ``factory.pipelines()`` finds it, replacing the
        one recorded under that name, if any."""
        self._local_pipelines[name] = copy.deepcopy(topology)

    async def keep_pipeline(self, name: str, topology: dict[str, Any]) -> dict[str, Any]:
        """Record a pipeline's topology unless one is recorded under that name, in one
        atomic step (two processes starting it at once: one records, the other reads what
        it recorded); returns the topology recorded after the call."""
        kept = self._local_pipelines.setdefault(name, copy.deepcopy(topology))
        return copy.deepcopy(kept)

    async def pipelines(self) -> dict[str, dict[str, Any]]:
        """Every recorded pipeline's topology, by name."""
        kept = self._local_pipelines
        return {name: copy.deepcopy(kept[name]) for name in sorted(kept)}

    async def remove_pipeline(self, name: str) -> bool:
        """Forget a pipeline's topology (its queues stay); False if none was recorded."""
        return self._local_pipelines.pop(name, None) is not None


class NumberedFlushes(StatsStore):
    """For a database where a flush may be applied and its reply lost (the connection broke
    on the way back): merged back into the buffer, that batch was added a second time by the
    next flush. Each flush carries this store's ``origin`` and a number, and the database
    applies a queue's part of it only if that number is past the last one it applied for
    this origin and queue, in the same atomic step as the increments. A flush that failed is
    kept aside as it was, with its number, and sent again, alone and first, by the next one;
    a read counts it only for the queues where it has not landed.

    A database provides :meth:`_write` (the conditional increments), :meth:`_landed`,
    :meth:`_stored_counters` and :meth:`_forget_flushes` (the numbers of a store closing
    with nothing kept aside, which nothing can send again)."""

    def __init__(self) -> None:
        super().__init__()
        self._origin = os.urandom(12).hex()
        self._seq = 0  # the number of the last flush sent
        self._unsent: Increments | None = None  # flush number _seq, outcome unknown
        self._flushed: set[str] = set()  # queues a flush was sent for

    async def close(self) -> None:
        await super().close()
        if self._flushed and self._unsent is None:
            with contextlib.suppress(Exception):  # housekeeping: left for its expiry
                await self._forget_flushes(sorted(self._flushed))

    def _unsettled(self) -> bool:
        return self._unsent is not None

    def _forget_unsent(self, queue: str) -> None:
        if self._unsent is not None:  # sent again without it: applied or not, it is zeroed
            self._unsent.pop(queue, None)

    async def _apply(self, increments: Increments) -> None:
        if self._unsent is not None:  # raises again: the new batch goes back to the buffer
            await self._write(self._unsent, self._seq)
            self._unsent = None
        increments = {q: c for q, c in increments.items() if any(c.values())}
        if not increments:
            return
        self._seq += 1
        self._flushed.update(increments)
        try:
            await self._write(increments, self._seq)
        except Exception as exc:
            # The database may have applied it: kept aside with its number, not merged back
            self._unsent = increments
            raise PartlyWritten({}, exc) from exc
        except BaseException:  # cancelled (close gave up waiting): as unknown, kept aside
            self._unsent = increments
            raise

    async def _load_counters(self, queue: str) -> dict[str, int]:
        counters: dict[str, int] = {}
        unsent = self._unsent
        if unsent is not None and queue in unsent:  # applied already, or still to add?
            if await self._landed(queue, self._seq):
                del unsent[queue]  # nothing to send again for it
                if not unsent:
                    self._unsent = None
            else:
                counters = dict(unsent[queue])
        for name, value in (await self._stored_counters(queue)).items():
            counters[name] = counters.get(name, 0) + value
        return counters

    @abstractmethod
    async def _write(self, increments: Increments, seq: int) -> None:
        """Apply each queue's increments unless flush ``seq`` of this origin already was."""

    @abstractmethod
    async def _landed(self, queue: str, seq: int) -> bool:
        """Whether flush ``seq`` of this origin was applied to ``queue``."""

    @abstractmethod
    async def _stored_counters(self, queue: str) -> dict[str, int]:
        """The counters the database holds for ``queue``."""

    @abstractmethod
    async def _forget_flushes(self, queues: list[str]) -> None:
        """Delete this origin's flush numbers (of ``queues``, where they are kept apart)."""


class MemoryStats(StatsStore):
    """Stats kept in this process: the memory backend's store, and an option for any other."""

    flush_interval = None

    def __init__(self) -> None:
        super().__init__()
        self._counters: defaultdict[str, defaultdict[str, int]] = defaultdict(
            lambda: defaultdict(int)
        )
        self._paused: set[str] = set()
        self._options: dict[str, dict[str, Any]] = {}

    def _add(self, queue: str, counter: str, n: int) -> None:
        self._counters[queue][counter] += n

    async def _apply(self, increments: Increments) -> None:
        for queue, counters in increments.items():
            for name, value in counters.items():
                self._counters[queue][name] += value

    async def _load_counters(self, queue: str) -> dict[str, int]:
        return dict(self._counters.get(queue, {}))

    async def _reset(self, queue: str) -> None:
        self._counters.pop(queue, None)

    async def set_paused(self, queue: str, paused: bool) -> None:
        if paused:
            self._paused.add(queue)
        else:
            self._paused.discard(queue)

    async def is_paused(self, queue: str) -> bool:
        return queue in self._paused

    async def save_options(
        self, queue: str, options: dict[str, Any], *, replace: bool = True
    ) -> None:
        if replace or queue not in self._options:
            self._options[queue] = dict(options)

    async def queues(self) -> dict[str, dict[str, Any]]:
        return {name: dict(opts) for name, opts in self._options.items()}
