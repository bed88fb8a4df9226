"""The sweeper and the shovel of ``redis-sharded``, run by one elected leader per prefix.

Election: a lease key (``prefix:sharded:leader``) taken with SET NX PX and renewed by its
holder every ``sweep_interval`` (a script that extends it only while it holds the token).
Every process with ``sweeper=True`` tries each period, so when the leader dies its lease
expires and another process holds it within ``lease_ttl`` + ``sweep_interval``. A leader
that stalls past its lease may overlap with its successor for one pass: harmless, since
each sweep and shovel step is one atomic script that re-reads the shard's pointers, so a
record is never moved twice; it only wastes work.

Each pass the leader walks every shard of every queue registered on the prefix:

- sweep: from the shard's sweep pointer, up to 1,000 records a step (as IgnisMQ's
  ``SWEEP_BATCH_SIZE``), records fired by a reserve whose deadline (fire time +
  ``reserve_delay``, IgnisMQ's ``sweepDuration``) passed move to the shard's sideline; the
  walk stops at the first record still within its deadline. The shard's sweep pointer and
  swept counter advance in the same script.
- ready index repair: a shard with records in its magazine is announced again, which
  restores a hint lost when a process died between a shard script and the index script.
- shovel (every ``shovel_interval``, ``shovel_concurrency`` shards at once): sideline
  records go back into the magazine, one more try each, and an insertion signal wakes the
  consumers. IgnisMQ needs a "sideline sweep" and a threshold keeping records about to be
  shoveled from being swept twice, because its shovel fires from the sideline and loads into
  the main magazine in two steps; here both magazines share the shard's hash slot and one
  script moves a record, so a record is never half-shoveled and has nothing to be swept from.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..coalesce import stop_task
from . import sharded_lua as lua

if TYPE_CHECKING:
    from .sharded import RedisShardedBackend

log = logging.getLogger("aio_keuss.redis_sharded")

SWEEP_BATCH = 1000
"""Records one sweep step looks at, so Redis is never blocked for long."""
SHOVEL_BATCH = 1000
"""Records one shovel step moves."""


class Sweeper:
    """The leader's loop of one backend (see the module docstring)."""

    def __init__(self, backend: RedisShardedBackend) -> None:
        self._backend = backend
        self._options = backend.sharded
        self.token = os.urandom(8).hex()
        self.leader = False
        self.swept = 0
        self.shoveled = 0
        self.passes = 0
        self._task: asyncio.Task[None] | None = None
        self._next_shovel = 0.0
        self._failing = False
        self._sidelined: dict[str, set[int]] = {}
        """Per queue, the shards whose sideline the last sweeps found records in."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="keuss-sharded-sweeper")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        if self.leader:
            self.leader = False
            try:
                await self._backend.run_script(lua.RELEASE, [self._backend.lease_key], [self.token])
            except Exception:  # the lease then expires on its own
                log.debug("redis-sharded: lease not released", exc_info=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:
                if not self._failing:
                    log.warning("redis-sharded sweeper pass failed", exc_info=True)
                self._failing = True
            else:
                self._failing = False
            await asyncio.sleep(self._options.sweep_interval)

    async def renew(self) -> bool:
        """Take or renew the lease; whether this process leads now."""
        ms = max(1, round(self._options.lease_ttl * 1000))
        held = await self._backend.run_script(
            lua.LEASE, [self._backend.lease_key], [self.token, ms]
        )
        if held and not self.leader:
            log.info("redis-sharded: this process now runs the sweeper (%s)", self.token)
        self.leader = bool(held)
        return self.leader

    async def step(self) -> None:
        """One pass: renew the lease, and if held, sweep (and shovel when due) every queue."""
        if not await self.renew():
            return
        queues = await self._backend.queue_shards()
        for name in list(queues):
            if not await self._backend.execute("EXISTS", self._backend.meta_key(name)):
                # idle past queue_expiry: no longer swept, its data kept (see sharded_meta)
                await self._backend.execute("HDEL", self._backend.registry_key, name)
                del queues[name]
                log.info("redis-sharded %r: queue expired, no longer swept", name)
        for name, shards in queues.items():
            await self.sweep_queue(name, shards)
        if time.monotonic() >= self._next_shovel:
            self._next_shovel = time.monotonic() + self._options.shovel_interval
            for name, shards in queues.items():
                await self.shovel_queue(name, shards)
        self.passes += 1

    async def sweep_queue(self, name: str, shards: int) -> int:
        """Sweep every shard of one queue; returns how many records went to the sideline."""
        backend = self._backend
        announce: list[Any] = []
        moved = 0
        to_shovel = self._sidelined.setdefault(name, set())

        async def one(shard: int) -> None:
            nonlocal moved
            base = backend.shard_base(name, shard)
            keys = backend.shard_keys(name, shard)
            while True:
                reply = await backend.run_script(lua.SWEEP, keys, [base, SWEEP_BATCH])
                step, left, in_magazine, version, stopped, sidelined, due = reply
                moved += step
                if left <= 0 or stopped:
                    break
            if in_magazine > 0:
                announce.extend((shard, version, ""))
            elif due:
                announce.extend((shard, version, due))
            if sidelined > 0:
                to_shovel.add(shard)

        await _bounded(8, one, range(shards))
        if announce:
            await backend.run_script(lua.READY_ADD, backend.ready_keys(name), announce)
        if moved:
            self.swept += moved
            log.info("redis-sharded %r: %d expired reservation(s) sidelined", name, moved)
        return moved

    async def shovel_queue(self, name: str, shards: int) -> int:
        """Move the sidelines the sweep found records in back into their magazines,
        ``shovel_concurrency`` shards at a time; returns how many records moved."""
        todo = sorted(self._sidelined.pop(name, set()))
        if not todo:
            return 0
        backend = self._backend
        announce: list[Any] = []
        moved = 0

        async def one(shard: int) -> None:
            nonlocal moved
            base = backend.shard_base(name, shard)
            keys = backend.shard_keys(name, shard)
            here = 0
            while True:
                step, left, version = await backend.run_script(
                    lua.SHOVEL, keys, [base, SHOVEL_BATCH]
                )
                here += step
                if left <= 0 or step == 0:
                    break
            if here:
                moved += here
                announce.extend((shard, version, ""))

        await _bounded(self._options.shovel_concurrency, one, todo)
        if announce:
            await backend.run_script(lua.READY_ADD, backend.ready_keys(name), announce)
            self.shoveled += moved
            if backend.bus is not None:
                backend.bus.insert(name, time.time(), moved)
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
