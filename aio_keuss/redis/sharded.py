"""``redis-sharded``: the sharded model (:mod:`aio_keuss.sharded`) over Redis.

This module holds only :class:`RedisShardStorage`, the model's storage contract as Lua
scripts (:mod:`.sharded_lua`, one script per operation, one round trip each), and the
backend that wires it. Every shard's keys carry the hash tag ``{queue#shard}`` (``#`` cannot
occur in a queue name), so on Redis Cluster the shards of one queue spread over the nodes
while each operation on a shard runs in one hash slot; the queue's ready index, consumers and
metadata record carry ``{queue}``; the sweeper's list of queues and the leader lease are
per prefix. Times are the server's (``TIME`` in the scripts).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from ..contract import Ack, Entry, Extend, Nack, Stored
from ..sharded import meta
from ..sharded.backend import ShardedBackend
from ..sharded.settings import ShardedOptions
from ..sharded.storage import (
    Deadlines,
    Doomed,
    Fired,
    Loaded,
    MetaRecord,
    ReadyHead,
    ReadyMark,
    RolledBack,
    ShardSizes,
    ShardStorage,
    ShovelStep,
    SweepStep,
)
from ..stats import StatsStore
from ..types import KoResult
from . import sharded_lua as lua
from .backend import RedisBackend
from .connection import GIVE_BACK_REPLAY, RedisOptions
from .stats import RedisStats


def _time(raw: Any) -> float | None:
    """A time a script returned as text (``''``: none)."""
    return float(raw) if raw else None


def _marks(marks: Sequence[ReadyMark]) -> list[Any]:
    """READY_ADD / READY_DROP's arguments: triples shard, version, due (``''``: none)."""
    args: list[Any] = []
    for mark in marks:
        args += (mark.shard, mark.version, "" if mark.due is None else repr(mark.due))
    return args


class RedisShardStorage(ShardStorage):
    """The sharded model's operations as Lua scripts; key layout in :mod:`.sharded_lua`."""

    def __init__(self, backend: RedisBackend) -> None:
        self._backend = backend
        self._run = backend.run_script
        if backend.cluster:  # shard scripts must not run while their slot migrates
            run, guarded = backend.run_script, lua.CLUSTER_GUARDED
            self._run = lambda script, keys, args: run(guarded.get(script, script), keys, args)
        self.registry_key = f"{backend.prefix}:sharded:queues"
        self.lease_key = f"{backend.prefix}:sharded:leader"
        self._shards: dict[str, dict[int, tuple[str, list[str]]]] = {}
        self._ready_keys: dict[str, list[str]] = {}

    @property
    def uninterruptible(self) -> bool:  # type: ignore[override]
        """On the fast lane each script's reply refuses cancellation (see
        ``connection._Reply``); the NOSCRIPT retry awaits only such replies too."""
        return self._backend.has_fast_lane

    @property
    def run_in_caller(self) -> bool:  # type: ignore[override]
        return self._backend.has_fast_lane

    def shard_base(self, queue: str, shard: int) -> str:
        """``prefix:{queue#shard}:``, the start of every key of the shard."""
        return self._backend.key(f"{queue}#{shard}") + ":"

    def _shard(self, queue: str, shard: int) -> tuple[str, list[str]]:
        """The base and the keys every shard script is given: m, ix, d, z, k (computed
        once)."""
        of_queue = self._shards.get(queue)
        if of_queue is None:
            of_queue = self._shards[queue] = {}
        found = of_queue.get(shard)
        if found is None:
            base = self.shard_base(queue, shard)
            keys = [base + "m", base + "ix", base + "d", base + "z", base + "k"]
            found = of_queue[shard] = (base, keys)
        return found

    def _ready(self, queue: str) -> list[str]:
        """The queue's ready index and its version stamps (computed once)."""
        found = self._ready_keys.get(queue)
        if found is None:
            key = self._backend.key
            found = self._ready_keys[queue] = [key(queue, "ready"), key(queue, "stamps")]
        return found

    # per shard ---------------------------------------------------------------------------

    async def load(
        self,
        queue: str,
        shard: int,
        entries: Sequence[Entry],
        dedup_window: float,
        message_ttl: float | None,
        *,
        front: bool = False,
    ) -> Loaded:
        base, keys = self._shard(queue, shard)
        ttl = "" if message_ttl is None else repr(message_ttl)
        args: list[Any] = [base, dedup_window, ttl, "1" if front else ""]
        for e in entries:
            check = "d" if e.dedup else ("c" if e.mature is not None else "")
            args += (
                e.id,
                e.payload,
                e.headers,
                e.tries,
                check,
                "" if e.mature is None else repr(e.mature),
                e.delay if e.mature is None else 0,
                "" if e.mature is None or e.expires is None else repr(e.expires),
                "" if e.mature is None or e.place is None else e.place,
            )
        reply = await self._run(lua.INSERT, keys, args)
        return Loaded([f == 1 for f in reply[3:]], reply[0], reply[1] == 1, _time(reply[2]))

    async def fire(self, queue: str, shard: int, n: int, reserve_delay: float | None) -> Fired:
        base, keys = self._shard(queue, shard)
        delay = "" if reserve_delay is None else repr(reserve_delay)
        reply = await self._run(lua.FIRE, keys, [base, n, delay])
        messages = [
            Stored(
                reply[i].decode(),
                reply[i + 1],
                reply[i + 2],
                int(reply[i + 3]),
                float(reply[i + 4]),
                _time(reply[i + 5]),
                int(reply[i + 6]),
            )
            for i in range(3, len(reply), 7)
        ]
        return Fired(messages, reply[0], reply[1], _time(reply[2]))

    async def queued(self, queue: str, shard: int, ids: Sequence[str]) -> list[bool]:
        base, keys = self._shard(queue, shard)
        return [flag == 1 for flag in await self._run(lua.QUEUED, keys, [base, *ids])]

    async def commit(self, queue: str, shard: int, acks: Sequence[Ack]) -> list[bool]:
        base, keys = self._shard(queue, shard)
        args: list[Any] = [base]
        for ack in acks:
            args += (ack.id, "" if ack.tries is None else ack.tries)
        return [flag == 1 for flag in await self._run(lua.COMMIT, keys, args)]

    async def extend(self, queue: str, shard: int, extends: Sequence[Extend]) -> list[bool]:
        base, keys = self._shard(queue, shard)
        args: list[Any] = [base]
        for extend in extends:
            args += (extend.id, "" if extend.tries is None else extend.tries, repr(extend.seconds))
        return [flag == 1 for flag in await self._run(lua.EXTEND, keys, args)]

    async def rollback(
        self, queue: str, shard: int, nacks: Sequence[Nack], max_ko: int | None
    ) -> RolledBack:
        base, keys = self._shard(queue, shard)
        args: list[Any] = [base, "" if max_ko is None else max_ko]
        for nack in nacks:
            tries = "" if nack.tries is None else nack.tries
            args += (nack.id, tries, "1" if nack.count_try else "0", nack.delay)
        reply = await self._run(lua.ROLLBACK, keys, args)
        results: list[KoResult] = []
        doomed: list[Doomed] = []
        i = 3
        for nack in nacks:
            if reply[i] == 3:
                tries, aside = int(reply[i + 3]), reply[i + 4].decode()
                doomed.append(Doomed(nack.id, reply[i + 1], reply[i + 2], tries, aside))
                results.append(KoResult.DEADLETTERED)
                i += 5
            else:
                results.append(KoResult(reply[i]))
                i += 1
        return RolledBack(results, doomed, reply[0], reply[1] == 1, _time(reply[2]))

    async def drop_doomed(self, queue: str, shard: int, doomed: Sequence[Doomed]) -> list[bool]:
        base, keys = self._shard(queue, shard)
        args: list[Any] = [base]
        for d in doomed:
            args += (d.id, d.tries, d.aside)
        return [flag == 1 for flag in await self._run(lua.DROP_DOOMED, keys, args)]

    async def sizes(self, queue: str, shard: int) -> ShardSizes:
        base, keys = self._shard(queue, shard)
        reply = await self._run(lua.SIZES, keys, [base])
        ready, fired, sidelined, load, swept, shoveled, sweep, fire, expired, scheduled = (
            int(x) for x in reply[:10]
        )
        return ShardSizes(
            ready, fired, sidelined, load, swept, shoveled, sweep, fire, expired, scheduled,
            _time(reply[10]),
        )  # fmt: skip

    async def next_deadline(self, queue: str, shard: int, most: int) -> Deadlines:
        base, keys = self._shard(queue, shard)
        whole, earliest = await self._run(lua.NEXT_DEADLINE, keys, [base, most])
        return Deadlines(_time(earliest), whole == 1)

    async def sweep(self, queue: str, shard: int, batch: int) -> SweepStep:
        base, keys = self._shard(queue, shard)
        moved, left, in_magazine, version, stopped, sidelined, due = await self._run(
            lua.SWEEP, keys, [base, batch]
        )
        return SweepStep(moved, left, in_magazine, version, stopped == 1, sidelined, _time(due))

    async def shovel(self, queue: str, shard: int, batch: int) -> ShovelStep:
        base, keys = self._shard(queue, shard)
        moved, left, version = await self._run(lua.SHOVEL, keys, [base, batch])
        return ShovelStep(moved, left, version)

    # per queue ---------------------------------------------------------------------------

    async def ready_add(self, queue: str, marks: Sequence[ReadyMark]) -> None:
        await self._run(lua.READY_ADD, self._ready(queue), _marks(marks))

    async def ready_drop(self, queue: str, marks: Sequence[ReadyMark]) -> None:
        await self._run(lua.READY_DROP, self._ready(queue), _marks(marks))

    async def ready_head(self, queue: str) -> ReadyHead:
        reply = await self._run(lua.READY_HEAD, self._ready(queue)[:1], ())
        due_in = _time(reply[0])  # from the server's now: made a time on our clock
        return ReadyHead(
            [int(s) for s in reply[1:]], None if due_in is None else time.time() + due_in
        )

    async def stamps(self, queue: str) -> dict[int, int]:
        found = await self._backend.hash_items(self._ready(queue)[1])
        return {int(shard): int(version) for shard, version in found if shard}

    async def enrol(self, queue: str, token: str, lease: float, most: int) -> bool:
        key = self._backend.key(queue, "consumers")
        return bool(await self._run(lua.ENROL, [key], [token, max(1, round(lease * 1000)), most]))

    async def leave(self, queue: str, token: str) -> None:
        await self._backend.execute("ZREM", self._backend.key(queue, "consumers"), token)

    async def touch(self, queue: str, record: MetaRecord, life: float | None) -> MetaRecord:
        args: list[Any] = [math.ceil(life * 1000) if life else 0]
        for field, value in record.items():
            args += (field, value)
        key = self._backend.key
        keys = [key(queue, "meta"), self._ready(queue)[1], key(queue, "shards")]
        stored = await self._run(lua.META, keys, args)
        await self._run(lua.LIST, [self.registry_key], [queue, stored[0]])
        names = ("shards", "message_ttl", "max_consumers")
        return {name: v.decode() for name, v in zip(names, stored, strict=True) if v is not None}

    async def read_meta(self, queue: str) -> MetaRecord | None:
        fields = await self._backend.hash_items(self._backend.key(queue, "meta"))
        return {name.decode(): value.decode() for name, value in fields} or None

    async def listed(self) -> dict[str, int]:
        found = await self._backend.hash_items(self.registry_key)
        return {name.decode(): int(count) for name, count in found}

    async def unlist(self, queue: str) -> None:
        await self._backend.execute("HDEL", self.registry_key, queue)

    # per prefix --------------------------------------------------------------------------

    async def lease(self, token: str, ttl: float) -> bool:
        ms = max(1, round(ttl * 1000))
        return bool(await self._run(lua.LEASE, [self.lease_key], [token, ms]))

    async def release(self, token: str) -> None:
        await self._run(lua.RELEASE, [self.lease_key], [token])


class RedisShardedStats(RedisStats):
    """The Redis stats store, but ``factory.list()`` shows only active queues (those whose
    metadata record exists and is active), each with its ``"sharded"`` metadata."""

    def __init__(self, backend: RedisShardedBackend) -> None:
        super().__init__(backend)
        self._sharded = backend

    async def queues(self) -> dict[str, dict[str, Any]]:
        return await meta.active_queues(await super().queues(), self._sharded.queue_info)


class RedisShardedBackend(ShardedBackend, RedisBackend):
    """Sharded queues after IgnisMQ, on Redis. Options beyond the Redis ones (seconds):

    shards: shards of a queue this backend creates (1-512); a queue keeps the count it was
      created with (its metadata record), and opening it with another is a ConfigError.
    sweeper: whether this process takes part in the leader election that runs the sweeper
      and the shovel (one leader per prefix at a time).
    sweep_interval: seconds between sweeps of every active queue (by the leader).
    shovel_interval: seconds between shovels of the sidelines back into the magazines.
    shovel_concurrency: shards shoveled at once.
    lease_ttl: seconds the leader's lease lives; renewed every sweep_interval, so another
      process takes over within lease_ttl of the leader's death.
    message_ttl: seconds a message lives from its push (0 = for ever): an expired message is
      never delivered, and is deleted where a script meets it (see :mod:`.sharded_lua`).
    queue_expiry: seconds without use after which a queue is idle (0 = never): see
      :mod:`aio_keuss.sharded.meta`.
    max_consumers: consumers a queue allows across processes (1-100): a consumer is a
      queue object of a factory that pops or reserves, enrolled with a lease of
      ``lease_ttl`` renewed while it fetches; one more raises TooManyConsumersError.

    The first process to open a queue writes its metadata record; ``shards``,
    ``message_ttl`` and ``max_consumers`` are then the queue's, whatever later processes
    pass.
    """

    name = "redis-sharded"
    # The acknowledgements' guard is redis-oq's ("fired by a reserve, with the holder's
    # tries"), and a release at no try leaves the tries as they were: the same hazard.
    replay_hazard = GIVE_BACK_REPLAY
    options: ClassVar[dict[str, Any]] = {**RedisOptions.defaults(), **ShardedOptions.defaults()}

    def __init__(self, options: dict[str, Any]) -> None:
        sharded = ShardedOptions.parse_own(options)  # refused before a client is made
        super().__init__(options)
        self.use_storage(RedisShardStorage(self), sharded, "shards" in options)

    def stats_store(self) -> StatsStore:
        return RedisShardedStats(self)
