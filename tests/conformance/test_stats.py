"""What ``q.stats()`` adds to the stored counters: this process's increments not stored yet.

A flush takes its batch out of the buffer before the database has it. A read overlapping
that window must count the batch exactly once: not zero times (it is in neither the buffer
nor the database yet), not twice (it landed while still being flushed). The generic layer is
pinned with stores whose ``_apply`` is held on an event: one keeping its counters in this
process (every step then happens at a known point, no I/O), and the real Redis, PostgreSQL
and MongoDB stores with only ``_apply`` held.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from backends import CASES

import aio_keuss
from aio_keuss.consumer import Consumer
from aio_keuss.redis.stats import _INCREMENT
from aio_keuss.stats import Increments, StatsStore

pytestmark = pytest.mark.timeout(60)


class HeldStore(StatsStore):
    """A store in this process whose writes wait for ``release``: ``taken`` is set when a
    flush has its batch, ``landed`` once the counters hold it, and then the write returns
    only after ``returned`` (its reply still on the way); ``fail`` makes it fail instead of
    landing."""

    flush_interval = 0.01

    def __init__(self) -> None:
        super().__init__()
        self.stored: dict[str, dict[str, int]] = {}
        self.taken = asyncio.Event()
        self.release = asyncio.Event()
        self.landed = asyncio.Event()
        self.returned = asyncio.Event()
        self.returned.set()
        self.fail = False

    async def _apply(self, increments: Increments) -> None:
        self.taken.set()
        await self.release.wait()
        if self.fail:
            raise aio_keuss.KeussConnectionError("server away")
        for queue, counters in increments.items():
            for name, value in counters.items():
                row = self.stored.setdefault(queue, {})
                row[name] = row.get(name, 0) + value
        self.landed.set()
        await self.returned.wait()

    async def _load_counters(self, queue: str) -> dict[str, int]:
        return dict(self.stored.get(queue, {}))

    async def _reset(self, queue: str) -> None:
        raise NotImplementedError

    async def set_paused(self, queue: str, paused: bool) -> None:
        raise NotImplementedError

    async def is_paused(self, queue: str) -> bool:
        raise NotImplementedError

    async def save_options(self, queue: str, options: dict[str, Any]) -> None:
        raise NotImplementedError

    async def queues(self) -> dict[str, dict[str, Any]]:
        raise NotImplementedError


async def _turns(times: int = 20) -> None:
    """Let every ready task run ``times`` steps (no I/O is involved)."""
    for _ in range(times):
        await asyncio.sleep(0)


async def test_a_read_during_a_flush_counts_its_batch_once() -> None:
    store = HeldStore()
    await store.open()
    try:
        store.incr("q", "put", 3)
        await store.taken.wait()  # the batch left the buffer; the database does not have it
        read = asyncio.create_task(store.counters("q"))
        await _turns()  # a read that does not wait for the flush is done by now
        store.incr("q", "put", 1)  # buffered while the read is under way
        store.release.set()
        assert (await read)["put"] == 4  # the batch once, the late increment once
        assert (await store.counters("q"))["put"] == 4
    finally:
        store.release.set()
        await store.close()
    assert store.stored == {"q": {"put": 4}}


async def test_a_read_after_the_batch_landed_but_before_the_flush_returned() -> None:
    store = HeldStore()
    store.returned.clear()
    await store.open()
    try:
        store.incr("q", "get", 2)
        store.release.set()
        await store.landed.wait()  # stored, while the flush still holds the batch
        read = asyncio.create_task(store.counters("q"))
        await _turns()
        store.returned.set()
        assert (await read)["get"] == 2
    finally:
        store.returned.set()
        await store.close()


async def test_a_read_during_a_failing_flush_counts_the_batch_from_the_buffer() -> None:
    store = HeldStore()
    store.fail = True
    await store.open()
    try:
        store.incr("q", "commit", 5)
        await store.taken.wait()
        read = asyncio.create_task(store.counters("q"))
        await _turns()
        store.release.set()
        assert (await read)["commit"] == 5  # back in the buffer, not lost, not doubled
        store.fail = False
        store.landed.clear()
        await store.landed.wait()  # the next flush writes it
        assert (await store.counters("q"))["commit"] == 5
        assert store.stored == {"q": {"commit": 5}}
    finally:
        store.release.set()
        await store.close()


async def test_close_lets_a_flush_in_flight_land() -> None:
    store = HeldStore()
    await store.open()
    store.incr("q", "put", 7)
    await store.taken.wait()
    closing = asyncio.create_task(store.close())
    await _turns()
    store.release.set()
    await closing
    assert store.stored == {"q": {"put": 7}}  # neither lost by a cancel nor written twice


_FLUSHING = ("redis-oq", "postgres", "mongo", "sqlite")


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in _FLUSHING], indirect=True, ids=lambda c: c.id
)
async def test_real_store_read_during_a_flush_counts_the_batch_once(connect: Any) -> None:
    factory: aio_keuss.Factory = await connect()
    real = type(factory.stats_store)
    taken, release = asyncio.Event(), asyncio.Event()

    class Held(real):  # type: ignore[valid-type, misc]
        async def _apply(self, increments: Increments) -> None:
            taken.set()
            await release.wait()
            await super()._apply(increments)

    store: StatsStore = Held(factory.backend)
    await store.open()
    try:
        store.incr("held", "put", 3)
        await taken.wait()
        read = asyncio.create_task(store.counters("held"))
        # A read that does not wait for the flush answers 0 here; one that waits cannot
        # answer before the release. Either way the answer must count the batch once.
        done, _ = await asyncio.wait({read}, timeout=0.5)
        assert not done or read.result()["put"] == 3
        release.set()
        assert (await read)["put"] == 3
        assert (await store.counters("held"))["put"] == 3
        assert (await factory.stats_store.counters("held"))["put"] == 3  # stored once
    finally:
        release.set()
        await store.close()


_NUMBERED = ("redis-oq", "postgres", "sqlite")


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in _NUMBERED], indirect=True, ids=lambda c: c.id
)
@pytest.mark.parametrize("landed", [False, True], ids=["before-sending", "reply-lost"])
async def test_close_giving_up_on_a_stuck_flush_sends_its_batch_again(
    connect: Any, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """close waits CLOSE_WAIT for a flush in flight, then cancels it: its batch, sent or
    not, is sent again by close's own flush (numbered, so it lands once either way)."""
    monkeypatch.setattr("aio_keuss.stats.CLOSE_WAIT", 0.05)
    factory: aio_keuss.Factory = await connect()
    real = type(factory.stats_store)
    taken, release = asyncio.Event(), asyncio.Event()

    class Stuck(real):  # type: ignore[valid-type, misc]
        async def _write(self, increments: Increments, seq: int) -> None:
            first = not taken.is_set()  # the first write hangs, before or after landing
            taken.set()
            if first and not landed:
                await release.wait()
            await super()._write(increments, seq)
            if first and landed:
                await release.wait()

    store: StatsStore = Stuck(factory.backend)
    await store.open()
    store.incr("stuck", "put", 7)
    await taken.wait()
    await store.close()
    assert (await factory.stats_store.counters("stuck"))["put"] == 7  # neither lost nor twice


class _OneSlotAway:
    """The factory's Redis connection, except that the increments of queue ``away``'s key
    fail (the node serving its slot is down) while ``away`` is set."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.away = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def execute(self, *args: Any) -> Any:
        if self.away and args[0] == "HINCRBY" and "{away}" in args[1]:

            async def fail() -> None:
                raise aio_keuss.KeussConnectionError("the node serving this slot is away")

            return fail()
        return self._real.execute(*args)

    def run_script(self, script: Any, keys: Any, args: Any) -> Any:
        if self.away and script is _INCREMENT and "{away}" in keys[0]:

            async def fail() -> None:
                raise aio_keuss.KeussConnectionError("the node serving this slot is away")

            return fail()
        return self._real.run_script(script, keys, args)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id == "redis-oq"], indirect=True, ids=lambda c: c.id
)
async def test_a_partly_failed_flush_does_not_add_the_written_part_again(connect: Any) -> None:
    factory: aio_keuss.Factory = await connect()
    backend = _OneSlotAway(factory.backend)
    store: StatsStore = type(factory.stats_store)(backend)
    await store.open()
    try:
        store.incr("here", "put", 7)
        store.incr("away", "put", 5)
        await asyncio.sleep(0.6)  # several flushes: "here" lands, "away" keeps failing
        backend.away = False
        for _ in range(500):  # until a flush writes "away"
            if (await store.counters("away"))["put"] == 5:
                break
            await asyncio.sleep(0.02)
        assert (await store.counters("here"))["put"] == 7
        assert (await store.counters("away"))["put"] == 5
        assert (await factory.stats_store.counters("here"))["put"] == 7  # stored once
    finally:
        backend.away = False
        await store.close()


async def test_options_recorded_if_absent_keep_what_is_there(connect: Any) -> None:
    """A queue reached by a move or a deadletter is recorded with this process's defaults
    only if it is not recorded yet. That was a read of every recorded queue, then a write:
    options another process recorded in between were replaced. Now one atomic step."""
    factory = await connect(poll_interval=5.0)
    if factory.backend.name.endswith("-sharded"):
        pytest.skip("lists only queues with a live metadata record (their stats stores' own)")
    stats = factory.stats_store
    await stats.save_options("fresh", {"reserve_delay": 5.0}, replace=False)
    await stats.save_options("fresh", {"reserve_delay": 7.0}, replace=False)
    await stats.set_paused("paused-only", True)  # a record without options
    await stats.save_options("paused-only", {"reserve_delay": 9.0}, replace=False)
    recorded = await stats.queues()
    assert recorded["fresh"] == {"reserve_delay": 5.0}
    assert recorded["paused-only"] == {"reserve_delay": 9.0}
    await stats.save_options("fresh", {"reserve_delay": 7.0})  # replace: the default
    assert (await stats.queues())["fresh"] == {"reserve_delay": 7.0}


async def test_prefetched_messages_given_back_unseen_are_counted_once(connect: Any) -> None:
    """A consumer's stop gives back what it prefetched and no handler started. Counted as
    taken when the store handed them out, and again when taken after the give-back, those
    messages showed two gets (or reserves) for one delivery to user code."""
    factory: aio_keuss.Factory = await connect(poll_interval=5.0)
    q = await factory.queue("prefetched", reserve_delay=600)
    await q.push_many(list(range(4)))
    counter = "reserve" if q.capabilities.reserve else "get"
    handled: list[aio_keuss.Message] = []
    consumers: list[Consumer] = []

    async def handler(message: aio_keuss.Message) -> None:
        handled.append(message)
        await consumers[0].stop()  # from its handler: the stop gives back the prefetched

    consumers.append(q.consume(handler, concurrency=1, prefetch=3))
    await consumers[0].wait()
    await consumers[0].stop()
    assert len(handled) == 1
    taken: list[aio_keuss.Message] = []
    for _ in range(50):  # the three given back, whatever number a take returns
        if len(taken) == 3:
            break
        if q.capabilities.reserve:
            batch = await q.reserve_many(3 - len(taken), timeout=5)
            assert all(await q.ok_many(batch))
        else:
            batch = await q.pop_many(3 - len(taken), timeout=5)
        taken.extend(batch)
    assert sorted(m.payload for m in handled + taken) == [0, 1, 2, 3]
    stats = await q.stats()
    assert (stats["put"], stats[counter]) == (4, 4), stats
