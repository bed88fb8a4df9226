"""The sweeper and the shovel of the sharded model, run by one elected leader per storage.

Election: a lease (:meth:`~.storage.ShardStorage.lease`) taken when free and renewed by its
holder every ``sweep_interval``. Every process with ``sweeper=True`` tries each period, so
when the leader dies its lease expires and another process holds it within ``lease_ttl`` +
``sweep_interval``. A leader that stalls past its lease may overlap with its successor for
one pass: harmless, since each sweep and shovel step is atomic on its shard and re-reads the
shard's pointers, so a record is never moved twice; it only wastes work.

Each pass the leader walks every shard of every queue listed in the storage:

- sweep: from the shard's sweep pointer, up to ``SWEEP_BATCH`` records a step (IgnisMQ's
  ``SWEEP_BATCH_SIZE``), records fired by a reserve whose deadline (fire time +
  ``reserve_delay``, IgnisMQ's ``sweepDuration``) passed move to the shard's sideline; a
  record still within its deadline is noted and stepped over, and looked at again by the
  first step after its deadline passes (so one long reservation does not keep the lapsed
  ones behind it, however far, from coming back). The shard's sweep pointer and
  swept counter advance in the same step.
- ready index repair: a shard with records in its magazine is announced again, which
  restores a hint lost when a process died between a shard's step and the index's.
- quiet shards: a shard the sweep found with nothing to do (nothing fired and not
  acknowledged, nothing in its magazine, sideline or schedule) can only get work by a step
  that announces it in the ready index, which raises the shard's stamp. So the next passes
  read the queue's stamps (one read) and sweep only the shards whose stamp moved since, or
  that had work; every ``REPAIR_PASSES``-th pass sweeps them all, for the hint a process
  lost by dying between its load and its announcement. An idle queue then costs a pass one
  read instead of a script per shard.
- shovel (every ``shovel_interval``, ``shovel_concurrency`` shards at once): sideline
  records go back into the magazine, one more try each, and an insertion signal wakes the
  consumers. IgnisMQ needs a "sideline sweep" and a threshold keeping records about to be
  shoveled from being swept twice, because its shovel fires from the sideline and loads into
  the main magazine in two steps; here one atomic step moves a record, so a record is never
  half-shoveled and has nothing to be swept from.

A queue whose metadata record ended (``queue_expiry``) is taken off the list: its data stays.
A queue whose sweep, shovel or expiry check fails (its node down) is logged and passed over
until the next pass; the others go on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable

from ..coalesce import stop_task
from ..errors import KeussError
from .settings import (
    REPAIR_PASSES,
    SHOVEL_BATCH,
    SWEEP_BATCH,
    SWEEP_CONCURRENCY,
    ShardedOptions,
)
from .storage import ReadyMark, ShardStorage

log = logging.getLogger("aio_keuss.sharded")

Shoveled = Callable[[str, int], None]
"""Told ``(queue, count)`` after a shovel put records back, to wake the consumers."""


class Sweeper:
    """The leader's loop of one backend (see the module docstring)."""

    def __init__(self, storage: ShardStorage, options: ShardedOptions, shoveled: Shoveled) -> None:
        self._storage = storage
        self._options = options
        self._shoveled = shoveled
        self.token = os.urandom(8).hex()
        self.leader = False
        self.swept = 0
        self.shoveled = 0
        self.passes = 0
        self._task: asyncio.Task[None] | None = None
        self._next_shovel = 0.0
        self._failing = False
        self._failing_queues: set[tuple[str, str]] = set()
        """(sweep or shovel, queue) of the queue steps whose last try failed."""
        self._sidelined: dict[str, set[int]] = {}
        """Per queue, the shards whose sideline the last sweeps found records in."""
        self._quiet: dict[str, dict[int, int | None]] = {}
        """Per queue, the shards the last sweep found with nothing to do, each with its
        stamp as read before that sweep (None: never announced)."""
        self._repair_in = 0
        """Passes tried before the next one that sweeps every shard (0 or less: this one).
        Counted over the passes tried, not those completed: a queue whose sweep fails on
        every pass (its node down) must not hold back the repair of the others."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="keuss-sharded-sweeper")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        if self.leader:
            self.leader = False
            try:
                await self._storage.release(self.token)
            except Exception:  # the lease then expires on its own
                log.debug("sharded: lease not released", exc_info=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self.step()
            except Exception as exc:
                if not self._failing:  # once per outage; a traceback only for the unexpected
                    expected = isinstance(exc, KeussError)
                    log.warning(
                        "sharded sweeper pass failed (%s); retrying",
                        exc,
                        exc_info=not expected,
                    )
                self._failing = True
            else:
                if self._failing:
                    log.info("sharded sweeper passes again")
                self._failing = False
            await asyncio.sleep(self._options.sweep_interval)

    async def renew(self) -> bool:
        """Take or renew the lease; whether this process leads now."""
        held = await self._storage.lease(self.token, self._options.lease_ttl)
        if held and not self.leader:
            log.info("sharded: this process now runs the sweeper (%s)", self.token)
            self._quiet.clear()  # another leader swept meanwhile: start from every shard
        self.leader = held
        return held

    async def step(self) -> None:
        """One pass: renew the lease, and if held, sweep (and shovel when due) every queue."""
        if not await self.renew():
            return
        everything = self._repair_in <= 0
        self._repair_in -= 1
        await self._pass(everything)
        if everything:
            self._repair_in = REPAIR_PASSES - 1
        self.passes += 1

    async def _pass(self, everything: bool) -> None:
        storage = self._storage
        queues = await storage.listed()
        if everything:
            for name in list(queues):
                await self._each_queue("expiry check", name, self._expire(name, queues))
        for name in [name for name in self._quiet if name not in queues]:
            del self._quiet[name]
        for name, shards in queues.items():
            await self._each_queue("sweep", name, self.sweep_queue(name, shards, everything))
        if time.monotonic() >= self._next_shovel:
            self._next_shovel = time.monotonic() + self._options.shovel_interval
            for name, shards in queues.items():
                await self._each_queue("shovel", name, self.shovel_queue(name, shards))

    async def _expire(self, name: str, queues: dict[str, int]) -> int:
        """Take ``name`` off the list (and ``queues``) if idle past ``queue_expiry``: no
        longer swept, its data kept (see .meta); 1 if it was."""
        if await self._storage.read_meta(name) is not None:
            return 0
        await self._storage.unlist(name)
        del queues[name]
        log.info("sharded %r: queue expired, no longer swept", name)
        return 1

    async def _each_queue(self, what: str, name: str, work: Awaitable[int]) -> None:
        """One queue's sweep, shovel or expiry check, its failure logged and not raised: a
        queue out of reach (its node down) must not keep the queues listed after it from
        theirs. Logged once per outage of that queue, a traceback only for the unexpected."""
        try:
            await work
        except Exception as exc:
            if (what, name) not in self._failing_queues:
                log.warning(
                    "sharded %r: %s failed (%s); the other queues go on",
                    name,
                    what,
                    exc,
                    exc_info=not isinstance(exc, KeussError),
                )
                self._failing_queues.add((what, name))
        else:
            if (what, name) in self._failing_queues:
                self._failing_queues.discard((what, name))
                log.info("sharded %r: %s works again", name, what)

    async def sweep_queue(self, name: str, shards: int, everything: bool = True) -> int:
        """Sweep the shards of one queue (all of them, or with ``everything`` false only
        those that may have work: see the module docstring); returns how many records went
        to the sideline."""
        storage = self._storage
        marks: list[ReadyMark] = []
        moved = 0
        to_shovel = self._sidelined.setdefault(name, set())
        quiet = self._quiet.setdefault(name, {})
        stamps = await storage.stamps(name)  # read before the sweeps it vouches for
        todo = [
            shard
            for shard in range(shards)
            if everything or shard not in quiet or quiet[shard] != stamps.get(shard)
        ]

        async def one(shard: int) -> None:
            nonlocal moved
            while True:
                step = await storage.sweep(name, shard, SWEEP_BATCH)
                moved += step.moved
                if step.left <= 0:  # each step passes up to a batch: this ends
                    break
            if step.in_magazine > 0:
                marks.append(ReadyMark(shard, step.version))
            elif step.next_scheduled is not None:
                marks.append(ReadyMark(shard, step.version, step.next_scheduled))
            if step.sidelined > 0:
                to_shovel.add(shard)
            idle = step.left <= 0 and not step.stopped
            idle = idle and step.in_magazine <= 0 and step.sidelined <= 0
            if idle and step.next_scheduled is None:
                quiet[shard] = stamps.get(shard)
            else:
                quiet.pop(shard, None)

        await _bounded(SWEEP_CONCURRENCY, one, todo)
        if marks:
            await storage.ready_add(name, marks)
        if moved:
            self.swept += moved
            log.info("sharded %r: %d expired reservation(s) sidelined", name, moved)
        return moved

    async def shovel_queue(self, name: str, shards: int) -> int:
        """Move the sidelines the sweep found records in back into their magazines,
        ``shovel_concurrency`` shards at a time; returns how many records moved."""
        todo = sorted(self._sidelined.pop(name, set()))
        if not todo:
            return 0
        storage = self._storage
        marks: list[ReadyMark] = []
        moved = 0

        async def one(shard: int) -> None:
            nonlocal moved
            here = 0
            while True:
                step = await storage.shovel(name, shard, SHOVEL_BATCH)
                here += step.moved
                if step.left <= 0 or step.moved == 0:
                    break
            if here:
                moved += here
                marks.append(ReadyMark(shard, step.version))

        await _bounded(self._options.shovel_concurrency, one, todo)
        if marks:
            await storage.ready_add(name, marks)
            self.shoveled += moved
            self._shoveled(name, moved)
        return moved


async def _bounded(
    limit: int, job: Callable[[int], Awaitable[None]], shards: Iterable[int]
) -> None:
    """Run ``job`` on each shard, at most ``limit`` at once."""
    gate = asyncio.Semaphore(limit)

    async def run(shard: int) -> None:
        async with gate:
            await job(shard)

    await asyncio.gather(*(run(shard) for shard in shards))
