"""``redis-sharded``: one queue spread over shards, each a "magazine" of records.

The model is the one IgnisMQ describes for its Aerospike storage: a queue is split into
shards (1-512, default 32); each shard is a magazine with a load pointer and a fire pointer
and one record per message keyed by its pointer. A push loads records at the load pointer;
a consumer fires them (advances the fire pointer) and, when it reserves, stamps each with
its reservation deadline. ``ok`` deletes the record; ``ko`` reloads it at the load pointer.
A sweeper, run by one elected leader per backend (:mod:`.sharded_sweeper`), walks each
shard's fired records from its sweep pointer and moves those whose deadline passed into the
shard's sideline magazine; a shovel moves them back into the magazine, one more try each.

Every shard's keys carry the hash tag ``{queue#shard}`` (``#`` cannot occur in a queue
name), so on Redis Cluster the shards of one queue spread over the nodes while each
operation on a shard is one Lua script in one hash slot (:mod:`.sharded_lua`). Every script
does O(1) work per message or a bounded batch.

Which shard: a message's shard is a function of its id, so ``ok`` / ``ko`` and the dedup
check of an explicit id need no lookup: ids the queue makes end in ``~<shard>``; any other
id goes to ``crc32(id) % shards``. A push without an id goes round-robin over the shards
(a chunk of a batch to each shard, so a ``push_many`` stays in order within its chunk), or,
with a header ``x-shard-key``, to the shard that key hashes to: messages with one key keep
their order. Explicit ids route by their id (the header is not used for them).

Consumers find work without scanning empty shards: the queue's ``ready`` sorted set holds
the shards that have records to fire. A producer whose load finds a shard's magazine empty
adds the shard; a consumer serves the ready shards in a rotation of its own (starting at a
random one, read again every ``REFRESH`` seconds or when it runs out), so shards are served
in turn and a fire is one round trip; a consumer that empties a shard removes it. That
index lives in the queue's own hash slot, apart from the shards, so it is kept by a second
script after the shard's; a race between a consumer emptying a shard and a producer loading
it is settled by the shard's version, which every load raises (``_READY_DROP``), and a hint
lost when a process dies between the two scripts is restored by the sweeper, which sees
every shard.

Delays: a magazine is FIFO, so a delayed push or ko waits outside it, in the shard's
schedule (a sorted set), and is loaded at the load pointer by the first fire on its shard
after it matured; the shard sits in the ready index at that time. What this model does not
offer: ``remove``, atomic ``move``; order holds within a shard only.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
import zlib
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import orjson

from ..contract import (
    Ack,
    DeadletterPlan,
    Entry,
    Fetched,
    Nack,
    Store,
    Stored,
    deadletter_tag,
    moved_id,
)
from ..errors import ConfigError, TooManyConsumersError
from ..message import append_headers
from ..options import check_bool, check_int, check_option_seconds
from ..types import Capabilities, KoResult, Sizes
from . import sharded_lua as lua
from . import sharded_meta as meta
from .backend import RedisBackend
from .connection import RedisOptions

if TYPE_CHECKING:
    from ..options import QueueOptions
    from ..signal import SignalBus
    from ..stats import StatsStore
    from .sharded_sweeper import Sweeper

SHARD_KEY_HEADER = "x-shard-key"
MAX_SHARDS = 512
MAX_CONSUMERS = 100
"""Consumers a queue allows across processes (IgnisMQ's ``MAX_CONSUMERS_ALLOWED``)."""
PUSH_CHUNK = 100
"""Messages of one batch loaded into one shard before the next shard takes the rest."""
FIRE_SHARE = 16
"""Messages a fetch asks of each shard it fires from: a coalesced fetch of 32 fires from two
shards, not from 32 (one script each); the rotation spreads successive fetches."""
REFRESH = 0.05
"""Seconds a consumer serves its own rotation of ready shards before reading the index
again (sooner when the rotation runs out), so it sees shards that gained work meanwhile."""

_SUFFIX = re.compile(r"~(\d{1,3})$")
_KEY_MARK = SHARD_KEY_HEADER.encode()


def shard_of(message_id: str, shards: int) -> int:
    """The shard of a message, from its id alone (see the module docstring)."""
    found = _SUFFIX.search(message_id)
    if found is not None and int(found.group(1)) < shards:
        return int(found.group(1))
    return zlib.crc32(message_id.encode()) % shards


def _key_shard(headers: bytes, shards: int) -> int | None:
    """The shard the ``x-shard-key`` header hashes to, if the message has one."""
    if _KEY_MARK not in headers:
        return None
    key = orjson.loads(headers).get(SHARD_KEY_HEADER)
    if key is None:
        return None
    return zlib.crc32(str(key).encode()) % shards


def _stored(flat: list[Any], start: int) -> list[Stored]:
    return [
        Stored(flat[i].decode(), flat[i + 1], flat[i + 2], int(flat[i + 3]), float(flat[i + 4]))
        for i in range(start, len(flat), 5)
    ]


T = TypeVar("T")


async def _each(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run one script per shard side by side; a lone one is awaited directly (the common
    case, one message on one shard), sparing the task ``asyncio.gather`` wraps it in."""
    if len(calls) == 1:
        return [await calls[0]]
    return list(await asyncio.gather(*calls))


class RedisShardedStore(Store):
    """One queue over ``shards`` magazines."""

    batch_concurrency: ClassVar[int] = 4

    def __init__(
        self,
        name: str,
        options: QueueOptions,
        backend: RedisShardedBackend,
        shards: int,
        message_ttl: float | None = None,
        max_consumers: int = MAX_CONSUMERS,
    ) -> None:
        super().__init__(name, options)
        # A reserve is several round trips (index, shards, index): not one reply that
        # refuses cancellation, so fetches run in batch tasks; pushes still run in the caller.
        self.run_in_caller = backend.has_fast_lane
        self._backend = backend
        self.shards = shards
        self._bases = [backend.shard_base(name, s) for s in range(shards)]
        self._keys = [backend.shard_keys(name, s) for s in range(shards)]
        self._ready = backend.ready_keys(name)
        self._window = options.dedup_window
        self._turn = random.randrange(shards)
        self._rotation: list[int] = []
        self._refresh_at = 0.0
        self._run = backend.run_script
        self._ttl = "" if message_ttl is None else repr(message_ttl)
        self._max_consumers = max_consumers
        self._touch_every = meta.touch_period(backend.sharded)
        self._touch_at = time.monotonic() + (self._touch_every or 0.0)
        self._token = os.urandom(8).hex()
        self._enrol_at = 0.0
        self._enrolled = False

    # producing ---------------------------------------------------------------------------

    def _route(self, entries: Sequence[Entry]) -> dict[int, list[Entry]]:
        """Group entries by shard, naming the ids the queue made after their shard."""
        by_shard: dict[int, list[Entry]] = {}
        chunk = 0
        for e in entries:
            if e.dedup or e.mature is not None:  # an explicit id, or a put-back: its id rules
                shard = shard_of(e.id, self.shards)
            else:
                keyed = _key_shard(e.headers, self.shards)
                if keyed is None:
                    if chunk == 0:
                        self._turn = (self._turn + 1) % self.shards
                    chunk = (chunk + 1) % PUSH_CHUNK
                    shard = self._turn
                else:
                    shard = keyed
                e.id = f"{e.id}~{shard}"
            by_shard.setdefault(shard, []).append(e)
        return by_shard

    async def _touch(self) -> None:
        """Renew the queue's metadata record while in use (with ``queue_expiry`` only)."""
        if self._touch_every is not None and time.monotonic() >= self._touch_at:
            self._touch_at = time.monotonic() + self._touch_every
            record = meta.record(self.shards, self.options, self._backend.sharded)
            await self._backend.touch(self.name, record)

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        await self._touch()
        by_shard = self._route(entries)
        shards = list(by_shard)
        replies = await _each([self._insert(s, by_shard[s]) for s in shards])
        announce: list[Any] = []
        flags: dict[int, bool] = {}
        for shard, reply in zip(shards, replies, strict=True):
            if reply[1] == 1:  # the magazine was empty: this push announces the shard
                announce += (shard, reply[0], "")
            elif reply[2]:  # scheduled: the shard is due when the first matures
                announce += (shard, reply[0], reply[2])
            for e, f in zip(by_shard[shard], reply[3:], strict=True):
                flags[id(e)] = f == 1
        if announce:
            await self._run(lua.READY_ADD, self._ready, announce)
        return [flags[id(e)] for e in entries]

    async def _insert(self, shard: int, entries: list[Entry]) -> list[Any]:
        args: list[Any] = [self._bases[shard], self._window, self._ttl]
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
            )
        reply: list[Any] = await self._run(lua.INSERT, self._keys[shard], args)
        return reply

    # consuming ---------------------------------------------------------------------------

    async def get(self, n: int) -> Fetched:
        return await self._fire(n, "")

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        """Fire and stamp each record with its deadline, now + ``reserve_delay`` (server
        clock): the sweeper sidelines it once that passes without ok / ko."""
        return await self._fire(n, repr(reserve_delay))

    async def _enrol(self) -> None:
        """Enrol (or renew) this consumer, within the queue's ``max_consumers``."""
        settings = self._backend.sharded
        lease_ms = max(1, round(settings.lease_ttl * 1000))
        args = [self._token, lease_ms, self._max_consumers]
        if not await self._run(lua.ENROL, [self._backend.key(self.name, "consumers")], args):
            raise TooManyConsumersError(
                f"queue {self.name!r} already has {self._max_consumers} consumers"
            )
        self._enrolled = True
        self._enrol_at = time.monotonic() + settings.lease_ttl / 3

    async def close(self) -> None:
        """Leave the queue's consumers, so the place is free at once."""
        self._enrol_at = 0.0
        if self._enrolled:
            self._enrolled = False
            await self._backend.execute(
                "ZREM", self._backend.key(self.name, "consumers"), self._token
            )

    async def _candidates(self) -> tuple[list[int], float | None]:
        """The shards due now as the ready index has them, in a rotation of our own that
        starts at a random one, so consumers of several processes spread over the shards;
        and the index's earliest due time (None: empty)."""
        reply = await self._run(lua.READY_HEAD, self._ready[:1], ())
        ready = [int(s) for s in reply[1:]]
        if ready:
            start = random.randrange(len(ready))
            ready = ready[start:] + ready[:start]
        self._refresh_at = time.monotonic() + REFRESH
        return ready, float(reply[0]) if reply[0] else None

    async def _fire(self, n: int, delay: str) -> Fetched:
        """Fire from the next ``n / FIRE_SHARE`` shards of the rotation (``n`` shared among
        them). The rotation is read from the ready index when it runs out or is ``REFRESH``
        old, so a fire is one round trip in the steady state; a shard found empty leaves
        both."""
        await self._touch()
        if time.monotonic() >= self._enrol_at:
            await self._enrol()
        messages: list[Stored] = []
        left = False
        fresh = False
        head: float | None = None
        for _ in range(3):
            if not self._rotation or time.monotonic() >= self._refresh_at:
                self._rotation, head = await self._candidates()
                fresh = True
            rotation = self._rotation
            if not rotation:
                break
            chosen = rotation[: -(-n // FIRE_SHARE)]
            self._rotation = rotation[len(chosen) :] + chosen
            share, extra = divmod(n, len(chosen))
            replies = await _each(
                [
                    self._run(
                        lua.FIRE,
                        self._keys[s],
                        [self._bases[s], share + (1 if k < extra else 0), delay],
                    )
                    for k, s in enumerate(chosen)
                ]
            )
            emptied: list[Any] = []
            for shard, reply in zip(chosen, replies, strict=True):
                messages += _stored(reply, 3)
                if reply[0] > 0:
                    left = True
                else:
                    emptied += (shard, reply[1], reply[2])
            if emptied:
                gone = set(emptied[::3])
                self._rotation = [s for s in self._rotation if s not in gone]
                await self._run(lua.READY_DROP, self._ready, emptied)
            if messages or fresh:
                break
        if left or self._rotation:
            return Fetched(messages, time.time())
        return Fetched(messages, head)

    # acknowledging -----------------------------------------------------------------------

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        by_shard: dict[int, list[int]] = {}
        for k, ack in enumerate(acks):
            by_shard.setdefault(shard_of(ack.id, self.shards), []).append(k)
        out = [False] * len(acks)

        async def one(shard: int, members: list[int]) -> None:
            args: list[Any] = [self._bases[shard]]
            for k in members:
                args += (acks[k].id, "" if acks[k].tries is None else acks[k].tries)
            flags = await self._run(lua.COMMIT, self._keys[shard], args)
            for k, flag in zip(members, flags, strict=True):
                out[k] = flag == 1

        await _each([one(s, m) for s, m in by_shard.items()])
        return out

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        """Reload each at the load pointer of its shard, or schedule it after its delay,
        or past ``max_ko`` copy it into the deadletter queue, then drop it here."""
        by_shard: dict[int, list[int]] = {}
        for k, nack in enumerate(nacks):
            by_shard.setdefault(shard_of(nack.id, self.shards), []).append(k)
        out = [KoResult.MISSING] * len(nacks)
        deferred: list[tuple[str, bytes, bytes, int]] = []
        announce: list[Any] = []
        max_ko = "" if deadletter is None else deadletter.max_ko

        async def one(shard: int, members: list[int]) -> None:
            args: list[Any] = [self._bases[shard], max_ko]
            for k in members:
                nack = nacks[k]
                args += (
                    nack.id,
                    "" if nack.tries is None else nack.tries,
                    "1" if nack.count_try else "0",
                    nack.delay,
                )
            reply = await self._run(lua.ROLLBACK, self._keys[shard], args)
            i = 3
            for k in members:
                code = reply[i]
                if code == 3:
                    deferred.append((nacks[k].id, reply[i + 1], reply[i + 2], int(reply[i + 3])))
                    out[k] = KoResult.DEADLETTERED
                    i += 4
                else:
                    out[k] = KoResult(code)
                    i += 1
            if reply[1] == 1:
                announce.extend((shard, reply[0], ""))
            elif reply[2]:
                announce.extend((shard, reply[0], reply[2]))

        await _each([one(s, m) for s, m in by_shard.items()])
        if announce:
            await self._run(lua.READY_ADD, self._ready, announce)
        if deferred and deadletter is not None:
            await self._deadletter(deferred, deadletter)
        return out

    async def _deadletter(
        self, deferred: list[tuple[str, bytes, bytes, int]], plan: DeadletterPlan
    ) -> None:
        """Copy into the deadletter queue, then drop here with the guard of a commit: the
        message stays held until its copy exists, so a crash between the two steps leaves a
        duplicate (swept back later), never a loss. An id already there is renamed by the
        rule every backend follows."""
        target = await self._backend.store_of(plan.queue, self.options)
        now = time.time()
        pending = [
            (mid, append_headers(headers, plan.headers(tries + 1, now)), payload, tries)
            for mid, payload, headers, tries in deferred
        ]
        clash = 0
        while pending:
            entries = [
                Entry(
                    moved_id(mid, deadletter_tag(tries + 1), clash),
                    payload,
                    headers,
                    dedup=False,
                    mature=now,
                )
                for mid, headers, payload, tries in pending
            ]
            flags = await target.insert(entries)
            pending = [p for p, ok in zip(pending, flags, strict=True) if not ok]
            clash += 1
        await self.commit([Ack(mid, tries) for mid, _, _, tries in deferred])

    # observing ---------------------------------------------------------------------------

    async def shard_sizes(self) -> list[list[Any]]:
        """Per shard: ready (in the magazine, or scheduled and mature), fired and not
        acknowledged, sidelined, load pointer, swept ever, shoveled ever, sweep pointer,
        fire pointer, expired ever, scheduled, next mature scheduled (None: none). One
        script per shard (an observation, not the hot path)."""
        replies = await asyncio.gather(
            *(
                self._run(lua.SIZES, keys, [base])
                for keys, base in zip(self._keys, self._bases, strict=True)
            )
        )
        return [[int(x) for x in r[:10]] + [float(r[10]) if r[10] else None] for r in replies]

    async def sizes(self) -> Sizes:
        """size: ready records; reserved: fired and not acknowledged (until the sweeper
        sidelines those past their deadline); scheduled: delayed, and sidelined (waiting
        for the shovel)."""
        size = reserved = scheduled = 0
        for shard in await self.shard_sizes():
            size += shard[0]
            reserved += shard[1]
            scheduled += shard[2] + shard[9]
        return Sizes(size, size + reserved + scheduled, scheduled, reserved)

    async def next_mature(self) -> float | None:
        """Now if a record is ready or sidelined; else the earliest scheduled mature time,
        or for reservations their latest possible deadline (now + ``reserve_delay``)."""
        now = time.time()
        times: list[float] = []
        for shard in await self.shard_sizes():
            if shard[0] or shard[2]:
                return now
            if shard[10] is not None:
                times.append(shard[10])
            if shard[1]:
                times.append(now + self.options.reserve_delay)
        return min(times) if times else None


@dataclass(frozen=True)
class RedisShardedOptions(RedisOptions):
    """The Redis options and the sharded model's own (see :class:`RedisShardedBackend`)."""

    shards: int = 32
    sweeper: bool = True
    sweep_interval: float = 1.0
    shovel_interval: float = 5.0
    shovel_concurrency: int = 4
    lease_ttl: float = 10.0
    message_ttl: float = 0.0
    queue_expiry: float = 0.0
    max_consumers: int = MAX_CONSUMERS

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.shards, "shards", 1, MAX_SHARDS)
        check_bool(self.sweeper, "sweeper")
        check_int(self.shovel_concurrency, "shovel_concurrency", 1, 64)
        check_int(self.max_consumers, "max_consumers", 1, MAX_CONSUMERS)
        for what in ("sweep_interval", "shovel_interval", "lease_ttl"):
            seconds = check_option_seconds(getattr(self, what), what)
            if seconds < 0.01 or seconds > 86400:
                raise ConfigError(f"{what} must be seconds in [0.01, 86400], not {seconds!r}")
        check_option_seconds(self.message_ttl, "message_ttl")
        check_option_seconds(self.queue_expiry, "queue_expiry")
        if self.lease_ttl <= self.sweep_interval:
            raise ConfigError("lease_ttl must be longer than sweep_interval (it is renewed then)")


class RedisShardedBackend(RedisBackend):
    """Sharded queues after IgnisMQ. Options beyond the Redis ones:

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
      :mod:`.sharded_meta`.
    max_consumers: consumers a queue allows across processes (1-100): a consumer is a
      queue object of a factory that pops or reserves, enrolled with a lease of
      ``lease_ttl`` renewed while it fetches; one more raises TooManyConsumersError.

    The first process to open a queue writes its metadata record; ``shards``,
    ``message_ttl`` and ``max_consumers`` are then the queue's, whatever later processes
    pass.
    """

    name = "redis-sharded"
    capabilities: Capabilities = Capabilities(
        remove=False, reservation_expiry=True, move=False, fifo=False
    )
    options_type: ClassVar[type[RedisOptions]] = RedisShardedOptions
    options: ClassVar[dict[str, Any]] = RedisShardedOptions.defaults()

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        assert isinstance(self.config, RedisShardedOptions)
        self.sharded: RedisShardedOptions = self.config
        self.capabilities = RedisShardedBackend.capabilities  # move stays false everywhere
        self.registry_key = f"{self.prefix}:sharded:queues"
        self.lease_key = f"{self.prefix}:sharded:leader"
        self.bus: SignalBus | None = None
        self._stores: dict[str, RedisShardedStore] = {}
        self._sweeper: Sweeper | None = None
        self._explicit_shards = "shards" in options

    def shard_base(self, queue: str, shard: int) -> str:
        return self.key(f"{queue}#{shard}") + ":"

    def shard_keys(self, queue: str, shard: int) -> list[str]:
        """The keys every shard script is given: m, ix, d, z (see :mod:`.sharded_lua`)."""
        base = self.shard_base(queue, shard)
        return [base + "m", base + "ix", base + "d", base + "z"]

    def ready_keys(self, queue: str) -> list[str]:
        return [self.key(queue, "ready"), self.key(queue, "stamps")]

    def meta_key(self, queue: str) -> str:
        return self.key(queue, "meta")

    def signal_bus(self, debounce: float) -> SignalBus:
        self.bus = super().signal_bus(debounce)
        return self.bus

    async def open(self) -> None:
        await super().open()
        if self.sharded.sweeper:
            from .sharded_sweeper import Sweeper

            self._sweeper = Sweeper(self)
            self._sweeper.start()

    async def close(self) -> None:
        if self._sweeper is not None:
            await self._sweeper.stop()
        await super().close()

    async def store(self, queue: str, options: QueueOptions) -> Store:
        return await self.store_of(queue, options)

    async def store_of(self, queue: str, options: QueueOptions) -> RedisShardedStore:
        """The store of ``queue``, writing its metadata record on first use."""
        found = self._stores.get(queue)
        if found is not None:
            return found
        wanted = self.sharded.shards
        shards, ttl, most = await self.touch(queue, meta.record(wanted, options, self.sharded))
        if shards != wanted and self._explicit_shards:
            raise ConfigError(f"queue {queue!r} was created with {shards} shards, not {wanted}")
        store = RedisShardedStore(queue, options, self, shards, ttl, most)
        self._stores[queue] = store
        return store

    async def touch(self, queue: str, record: list[Any]) -> tuple[int, float | None, int]:
        """Write (if missing) and renew the queue's metadata record, and list the queue for
        the sweeper; the stored shard count and message TTL."""
        shards, ttl, most = await self.run_script(lua.META, [self.meta_key(queue)], record)
        await self.execute("HSET", self.registry_key, queue, shards)
        return int(shards), float(ttl) if ttl else None, int(most) if most else MAX_CONSUMERS

    async def queue_info(self, queue: str) -> dict[str, Any] | None:
        """The queue's metadata record (None once it expired or was never written)."""
        fields = await self.hash_items(self.meta_key(queue))
        return meta.decode(fields) if fields else None

    def stats_store(self) -> StatsStore:
        return meta.RedisShardedStats(self)

    async def queue_shards(self) -> dict[str, int]:
        """Every queue any process opened on this prefix, with its shard count."""
        return {
            name.decode(): int(count) for name, count in await self.hash_items(self.registry_key)
        }
