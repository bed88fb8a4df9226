"""The sharded model through the queue API, on every sharded storage (in memory, Redis, Redis
Cluster): routing (round-robin, by key, by id), the ready index (no empty shards, repaired by
the sweeper), sweep -> sideline -> shovel with its counters, the leader lease, the metadata
record and queue expiry, message TTL, delays. What needs several processes sharing one
storage (SIGKILLed consumers, the consumer cap across factories) is in
``tests/redis/test_redis_sharded.py``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from backends import SHARDED_CASES, BackendCase, ko_through_a_cut_close
from conftest import Connect, usable_case
from sharded_checks import assert_metadata_of_q

import aio_keuss
import aio_keuss.queue
from aio_keuss.contract import Ack, Entry, Nack
from aio_keuss.message import EMPTY_HEADERS
from aio_keuss.registry import load_backend
from aio_keuss.sharded.backend import ShardedBackend
from aio_keuss.sharded.settings import REPAIR_PASSES, SWEEP_BATCH, shard_of
from aio_keuss.sharded.storage import ReadyMark, ShardStorage
from aio_keuss.sharded.store import ShardedStore
from aio_keuss.sharded.sweeper import Sweeper
from aio_keuss.types import Sizes

pytestmark = pytest.mark.timeout(120)

FAST = {"shards": 4, "sweep_interval": 0.1, "shovel_interval": 0.2, "lease_ttl": 2.0}


@pytest.fixture(params=SHARDED_CASES, ids=lambda case: case.id)
def case(request: pytest.FixtureRequest) -> BackendCase:
    """Only the sharded cases (this overrides the suite-wide fixture)."""
    return usable_case(request)


@pytest.fixture
def sharded(connect: Connect) -> Connect:
    """Factories with quick sweeps and 4 shards."""

    async def _connect(**extra: Any) -> aio_keuss.Factory:
        return await connect(**{"poll_interval": 0.5, **FAST, **extra})

    return _connect


def backend_of(factory: aio_keuss.Factory) -> ShardedBackend:
    backend = factory.backend
    assert isinstance(backend, ShardedBackend)
    return backend


def store_of(q: aio_keuss.Queue) -> ShardedStore:
    store = q._store  # type: ignore[attr-defined]
    assert isinstance(store, ShardedStore)
    return store


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 60.0) -> None:
    """Wait for a condition the background tasks bring about (a bound against hangs, not a
    performance assertion)."""
    deadline = time.monotonic() + seconds
    while not await condition():
        assert time.monotonic() < deadline, "condition never met"
        await asyncio.sleep(0.05)


async def ready_shards(storage: ShardStorage, queue: str) -> list[int]:
    return (await storage.ready_head(queue)).due


def _cancel_after_fire(storage: ShardStorage, caller: asyncio.Future[Any]) -> Callable[[], None]:
    """Make the storage's fire cancel ``caller`` (a pop) as it starts: the cancellation
    lands while the fire is answered (a reply that refuses it, or a batch task's), so the
    fire takes its records and the queue puts back what it took. Returns what undoes it."""
    fire = storage.fire

    async def fire_then_cancel(*args: Any) -> Any:
        caller.cancel()
        return await fire(*args)

    setattr(storage, "fire", fire_then_cancel)  # noqa: B010
    return lambda: delattr(storage, "fire")


async def _popped_then_cancelled(q: aio_keuss.Queue, storage: ShardStorage) -> None:
    """A pop that takes a message and is cancelled before its caller gets it."""
    await _taken_then_cancelled(q.pop, storage)


async def _taken_then_cancelled(take: Callable[..., Awaitable[Any]], storage: ShardStorage) -> None:
    """A pop or reserve that takes a message and is cancelled before its caller gets it."""
    task = asyncio.ensure_future(take(timeout=5))
    undo = _cancel_after_fire(storage, task)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        undo()
    assert task.cancelled()


# routing --------------------------------------------------------------------------------


async def test_ids_name_their_shard_and_explicit_ids_hash(sharded: Connect) -> None:
    q = await (await sharded(sweeper=False)).queue("q")
    made = await q.push("x")
    assert made.rsplit("~", 1)[1] in {"0", "1", "2", "3"}
    assert shard_of(made, 4) == int(made.rsplit("~", 1)[1])
    assert shard_of("order-17", 4) == zlib.crc32(b"order-17") % 4
    assert await q.push("y", id="order-17") == "order-17"
    assert await q.push("again", id="order-17") == "order-17"  # dedup within its shard
    assert await q.size() == 2


async def test_messages_with_one_key_keep_their_order(sharded: Connect) -> None:
    q = await (await sharded(sweeper=False)).queue("q")
    for i in range(40):
        await q.push({"key": f"k{i % 3}", "n": i}, headers={"x-shard-key": f"k{i % 3}"})
    got = await q.pop_many(100, timeout=1)
    assert len(got) == 40
    for key in ("k0", "k1", "k2"):
        shard = zlib.crc32(key.encode()) % 4
        mine = [m for m in got if m.payload["key"] == key]
        assert {int(m.id.rsplit("~", 1)[1]) for m in mine} == {shard}
        numbers = [m.payload["n"] for m in mine]
        assert numbers == sorted(numbers)


async def test_delayed_messages_with_one_key_keep_their_order(sharded: Connect) -> None:
    """Delayed messages of one push_many wait in their shard's schedule due at the same
    time; they load in push order (the tenth before the eleventh, not by text)."""
    q = await (await sharded(sweeper=False)).queue("q")
    await q.push_many(list(range(12)), delay=0.3, headers={"x-shard-key": "k"})
    got: list[aio_keuss.Message] = []
    while len(got) < 12:
        batch = await q.pop_many(12, timeout=10)
        assert batch, "the scheduled messages never matured"
        got += batch
    assert [m.payload for m in got] == list(range(12))


async def test_a_push_many_past_max_batch_with_one_key_keeps_its_order(sharded: Connect) -> None:
    """push_many's chunks of max_batch run side by side on these stores (their round trips
    pipeline), trusting each chunk to send its load in its first step. A chunk that awaited
    something else first (the metadata renewal, due every lease_ttl; memory's turn given to
    the loop) had its load overtaken by the chunks after it: one key's messages came out
    out of order."""
    factory = await sharded(sweeper=False)
    q = await factory.queue("q", max_batch=10)
    for _ in range(2):
        store_of(q)._touch_at = 0.0  # the metadata record's renewal is due (lease_ttl on)
        await q.push_many(list(range(50)), headers={"x-shard-key": "k"})
        got: list[int] = []
        while len(got) < 50:
            batch = await q.pop_many(10, timeout=5)
            assert batch, "messages pushed were not served"
            got += [m.payload for m in batch]
        assert got == list(range(50))


async def test_round_robin_spreads_batches_and_reserve_takes_from_each(sharded: Connect) -> None:
    factory = await sharded(sweeper=False)
    storage = backend_of(factory).storage
    q = await factory.queue("q")
    for i in range(8):
        await q.push(i)
    assert sorted(await ready_shards(storage, "q")) == [0, 1, 2, 3]
    got = [await q.reserve_many(2, timeout=1) for _ in range(3)]
    # consumers go round the shards: each fetch from the next one
    assert len({m.id.rsplit("~", 1)[1] for batch in got for m in batch}) == 3
    for batch in got:
        for message in batch:
            assert await q.ok(message)
    rest = await q.reserve_many(10, timeout=1)
    assert len(rest) == 2
    assert await q.reserve(timeout=0) is None
    # emptied shards left the index: consumers never look at them
    assert await ready_shards(storage, "q") == []
    assert (await storage.ready_head("q")).earliest is None
    for message in rest:
        assert await q.ok(message)
    assert await q.sizes() == Sizes(0, 0, 0, 0)


async def test_a_lost_ready_hint_is_restored_by_the_sweeper(sharded: Connect) -> None:
    factory = await sharded()
    storage = backend_of(factory).storage
    q = await factory.queue("q")
    mid = await q.push("stranded")
    # as if the pusher died between its two steps: the shard is not in the index
    await storage.ready_drop("q", [ReadyMark(shard_of(mid, 4), 10**9)])
    assert await ready_shards(storage, "q") == []
    message = await q.pop(timeout=30)
    assert message is not None and message.payload == "stranded"


async def test_a_look_past_stale_hints_finds_the_ready_shard(sharded: Connect) -> None:
    """The ready index may name shards with nothing left to fire: a sweep step read before a
    fire emptied its shard announces it after the fire's drop (the sweeper's hint comes
    late), as may a push racing a consumer. A fetch that met only such shards in its first
    slice of a fresh read answered nothing, though another shard of that read held a ready
    message: ``pop(timeout=0)`` said the queue was empty."""
    factory = await sharded(sweeper=False)
    storage = backend_of(factory).storage
    q = await factory.queue("q")
    for attempt in range(12):  # the rotation starts at a random shard of the read
        mid = await q.push(attempt)
        home = shard_of(mid, 4)
        stale = [ReadyMark(s, 0) for s in range(4) if s != home]
        await storage.ready_add("q", stale)  # late hints of shards with nothing in them
        message = await q.pop(timeout=0)
        assert message is not None and message.payload == attempt, attempt
    assert await q.sizes() == Sizes(0, 0, 0, 0)


class CountedSweeps:
    """Counts the sweep steps a storage runs, per shard (the real steps still run)."""

    def __init__(self, storage: ShardStorage) -> None:
        self.shards: list[int] = []
        real = storage.sweep

        async def sweep(queue: str, shard: int, batch: int) -> Any:
            self.shards.append(shard)
            return await real(queue, shard, batch)

        storage.sweep = sweep  # type: ignore[method-assign]

    def take(self) -> list[int]:
        taken, self.shards = sorted(self.shards), []
        return taken


async def test_an_idle_queue_costs_a_pass_no_shard_sweep(sharded: Connect) -> None:
    """A pass swept every shard of every queue: 32 scripts a second per idle queue with the
    shipped settings. A shard found with nothing to do is passed over until its stamp moves
    (a load, a schedule, a reload announce it), and every REPAIR_PASSES-th pass sweeps all."""
    factory = await sharded(sweeper=False, reserve_delay=0.2)
    q = await factory.queue("q")
    await q.push("warm-up")  # lists the queue
    assert await q.pop(timeout=5) is not None
    backend = backend_of(factory)
    counted = CountedSweeps(backend.storage)
    leader = Sweeper(backend.storage, backend.sharded, lambda *_: None)
    await leader.step()
    assert counted.take() == [0, 1, 2, 3]  # the first pass sweeps everything
    for _ in range(REPAIR_PASSES - 1):
        await leader.step()
    assert counted.take() == []  # idle: nothing swept
    await leader.step()
    assert counted.take() == [0, 1, 2, 3]  # the repair pass
    # a reservation on a quiet shard: its announcement moves the stamp, the shard is swept
    mid = await q.push("held")
    held = await q.reserve(timeout=5)
    assert held is not None and held.id == mid
    await leader.step()
    assert counted.take() == [shard_of(mid, 4)]
    await asyncio.sleep(0.4)  # the reservation lapses
    await leader.step()
    assert counted.take() == [shard_of(mid, 4)]
    assert leader.swept == 1
    assert not await q.ok(held)
    await leader.stop()


async def test_a_lost_hint_on_a_quiet_shard_is_restored_by_the_repair_pass(
    sharded: Connect,
) -> None:
    factory = await sharded(sweeper=False)
    q = await factory.queue("q")
    await q.push("warm-up")
    assert await q.pop(timeout=5) is not None
    backend = backend_of(factory)
    leader = Sweeper(backend.storage, backend.sharded, lambda *_: None)
    await leader.step()  # every shard found quiet
    # as if a pusher died between its load and its announcement: no stamp moved
    entry = Entry("lost~2", b'J"stranded"', EMPTY_HEADERS)
    loaded = await backend.storage.load("q", 2, [entry], 0.0, None)
    assert loaded.announce and await ready_shards(backend.storage, "q") == []
    while leader.passes % REPAIR_PASSES:
        await leader.step()
    await leader.step()
    assert await ready_shards(backend.storage, "q") == [2]
    message = await q.pop(timeout=5)
    assert message is not None and message.payload == "stranded"
    await leader.stop()


async def test_a_ko_whose_reply_is_lost_comes_back_once(
    sharded: Connect, case: BackendCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ko's rollback run by the storage whose reply never came: a connection lost, or on a
    cluster a CLUSTERDOWN reply or, with a client passed with redis-py's default
    ``reinitialize_steps``, every fifth MOVED reply (a slot moving), on which redis-py
    closes all its connections itself and the commands in flight then fail with
    "Connection closed by server". The ko raises, and
    its second step (the ready hint) is not taken; the message must neither vanish (the
    sweeper announces the shard again) nor be held twice (the stale holder's retry, ok and
    close find another's reservation, not theirs)."""
    if not case.shared:
        pytest.skip("a second factory does not see an in-process storage")
    factory = await sharded(sweeper=False, reserve_delay=60.0)
    backend = backend_of(factory)
    storage = backend.storage
    q = await factory.queue("q")
    mid = await q.push("victim")
    held = await q.reserve(timeout=30)
    assert held is not None and held.id == mid
    shard = shard_of(mid, 4)
    assert await ready_shards(storage, "q") == []  # the fire emptied the shard
    rollback = storage.rollback

    async def reply_lost(*args: Any) -> Any:
        monkeypatch.undo()
        await rollback(*args)  # the storage ran it
        raise aio_keuss.KeussConnectionError("ConnectionError: Connection closed by server.")

    monkeypatch.setattr(storage, "rollback", reply_lost)
    with pytest.raises(aio_keuss.KeussConnectionError):
        await q.ko(held)
    # the holder's retry, ok and close, sent as q sends them (a retry through q would
    # also make q forget the reservation, and its close give nothing back)
    store, missing = store_of(q), [aio_keuss.KoResult.MISSING]
    assert await store.rollback([Nack(mid, held.tries, 0.0)], None) == missing  # done already
    leader = Sweeper(storage, backend.sharded, lambda *_: None)
    for _ in range(REPAIR_PASSES + 1):
        await leader.step()
        if shard in await ready_shards(storage, "q"):
            break
    assert await ready_shards(storage, "q") == [shard]
    other = await (await sharded(sweeper=False, reserve_delay=60.0)).queue("q")
    again = await other.reserve(timeout=30)
    assert again is not None and again.id == mid and again.tries == held.tries + 1
    assert await store.rollback([Nack(mid, held.tries, 0.0)], None) == missing
    assert await store.commit([Ack(mid, held.tries)]) == [False]
    await factory.close()  # gives back what q still counts as its own: refused
    assert await other.reserve(timeout=0) is None
    assert await other.ok(again)
    assert await other.sizes() == Sizes(0, 0, 0, 0)
    await leader.stop()


async def test_a_push_cancelled_while_its_load_is_answered_announces_the_shard(
    sharded: Connect,
) -> None:
    """A cancellation arriving while a load's reply is awaited (a reply that refuses it) was
    raised once the load was in, before the announcement: the message sat in a shard the
    ready index did not list and whose stamp did not move, so no consumer saw it and the
    sweeper passed the shard over until its repair pass (REPAIR_PASSES passes)."""
    factory = await sharded(sweeper=False)
    storage = backend_of(factory).storage
    if not storage.uninterruptible:
        pytest.skip("a cancellation there interrupts the request (the repair pass restores it)")
    q = await factory.queue("q")
    real = storage.load
    pusher: asyncio.Task[str] | None = None

    async def load(*args: Any, **named: Any) -> Any:
        assert pusher is not None
        pusher.cancel()  # lands while the reply is awaited
        return await real(*args, **named)

    storage.load = load  # type: ignore[method-assign]
    pusher = asyncio.create_task(q.push("cancelled", id="c-1"))
    with contextlib.suppress(asyncio.CancelledError):
        await pusher
    storage.load = real  # type: ignore[method-assign]
    assert await q.size() == 1  # it went in
    assert await ready_shards(storage, "q") == [shard_of("c-1", 4)]


async def test_a_push_failing_on_one_shard_announces_the_shards_it_loaded(
    sharded: Connect,
) -> None:
    """A push spread over several shards whose load failed on one (its node down) raised
    before announcing the others: their messages sat out of the ready index with their
    stamps unmoved until a repair pass, and the caller's retry, finding those magazines no
    longer empty, did not announce them either."""
    factory = await sharded(sweeper=False)
    storage = backend_of(factory).storage
    q = await factory.queue("q")
    ids: dict[int, str] = {}
    n = 0
    while len(ids) < 4:
        ids.setdefault(shard_of(f"m{n}", 4), f"m{n}")
        n += 1
    real = storage.load

    async def load(queue: str, shard: int, *rest: Any, **named: Any) -> Any:
        if shard == 3:
            raise aio_keuss.KeussConnectionError("injected: the shard's node is down")
        return await real(queue, shard, *rest, **named)

    storage.load = load  # type: ignore[method-assign]
    with pytest.raises(aio_keuss.KeussConnectionError):
        await q.push_many(["x"] * 4, ids=[ids[shard] for shard in range(4)])
    storage.load = real  # type: ignore[method-assign]
    assert sorted(await ready_shards(storage, "q")) == [0, 1, 2]
    got: list[aio_keuss.Message] = []
    while len(got) < 3:  # a fetch serves some shards per call
        more = await q.pop_many(10, timeout=5)
        assert more, "a message that went in was never served"
        got += more


async def test_a_queue_whose_sweeps_fail_does_not_hold_back_the_repair_of_the_others(
    sharded: Connect,
) -> None:
    """The repair pass came every REPAIR_PASSES completed passes: while one queue's sweep
    failed on every pass (its node down), no pass completed, and a hint lost in another
    queue was never restored."""
    factory = await sharded(sweeper=False)
    backend = backend_of(factory)
    storage = backend.storage
    for name in ("a", "b"):
        q = await factory.queue(name)
        await q.push("warm-up")  # lists the queue
        assert await q.pop(timeout=5) is not None
    listed = list(await storage.listed())
    assert sorted(listed) == ["a", "b"]
    healthy, failing = listed  # swept in this order
    leader = Sweeper(storage, backend.sharded, lambda *_: None)
    await leader.step()  # every shard found quiet
    real = storage.stamps

    async def stamps(queue: str) -> dict[int, int]:
        if queue == failing:
            raise aio_keuss.KeussConnectionError("injected: the queue's node is down")
        return await real(queue)

    storage.stamps = stamps  # type: ignore[method-assign]
    # as if a pusher died between its load and its announcement
    entry = Entry("lost~2", b'J"stranded"', EMPTY_HEADERS)
    assert (await storage.load(healthy, 2, [entry], 0.0, None)).announce
    for _ in range(REPAIR_PASSES + 1):
        await leader.step()
    storage.stamps = real  # type: ignore[method-assign]
    assert await ready_shards(storage, healthy) == [2]
    await leader.stop()


async def test_a_queue_whose_sweep_fails_does_not_stop_the_queues_after_it(
    sharded: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass swept the listed queues one after the other and ended at the first that
    failed (its node down): the queues listed after it were not swept, nor any shoveled,
    and their lapsed reservations stayed out of reach for as long as the failure lasted."""
    factory = await sharded(sweeper=False, reserve_delay=0.2)
    backend = backend_of(factory)
    storage = backend.storage
    for name in ("a", "b"):
        await (await factory.queue(name)).push("warm-up")  # lists the queue
    listed = list(await storage.listed())
    assert sorted(listed) == ["a", "b"]
    failing, healthy = listed  # swept in this order
    q = await factory.queue(healthy)
    held = await q.reserve(timeout=5)
    assert held is not None
    real = storage.sweep

    async def sweep(queue: str, shard: int, batch: int) -> Any:
        if queue == failing:
            raise aio_keuss.KeussConnectionError("injected: the queue's node is down")
        return await real(queue, shard, batch)

    storage.sweep = sweep  # type: ignore[method-assign]
    leader = Sweeper(storage, backend.sharded, lambda *_: None)
    await asyncio.sleep(0.4)  # the reservation lapses; nobody has swept it yet
    caplog.set_level(logging.INFO, logger="aio_keuss.sharded")
    await leader.step()  # one pass
    assert (leader.swept, leader.shoveled) == (1, 1)
    again = await q.reserve(timeout=5)
    assert again is not None and (again.id, again.tries) == (held.id, 1)
    assert await q.ok(again)
    await leader.step()  # failing again: said once
    storage.sweep = real  # type: ignore[method-assign]
    await leader.step()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if repr(failing) in r.getMessage()]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO], said
    await leader.stop()


async def test_bad_options_are_refused(case: BackendCase) -> None:
    backend = load_backend(case.name)
    for bad in (
        {"shards": 0},
        {"shards": 513},
        {"shards": True},
        {"sweep_interval": 0},
        {"lease_ttl": 0.05, "sweep_interval": 0.1},
        {"shovel_concurrency": 0},
        {"max_consumers": 101},
    ):
        with pytest.raises(aio_keuss.ConfigError):
            backend(bad)


# sweep, sideline, shovel, leader ----------------------------------------------------------


async def test_expired_reservations_are_swept_shoveled_and_counted(sharded: Connect) -> None:
    factory = await sharded(reserve_delay=0.2)
    q = await factory.queue("q")
    pushed = await q.push_many(list(range(20)))
    held = await q.reserve_many(20, timeout=1)
    assert sorted(m.id for m in held) == sorted(pushed)
    # The second reservations must not lapse too while the loop below gathers them (on a
    # busy machine 0.2 s passed before the last came back): they last a minute.
    q.options = dataclasses.replace(q.options, reserve_delay=60.0)
    again: list[aio_keuss.Message] = []
    while len(again) < 20:
        again += await q.reserve_many(20, timeout=30)
    assert sorted(m.id for m in again) == sorted(pushed)
    assert {m.tries for m in again} == {1}
    for message in held:  # the stale holders' ok is refused
        assert not await q.ok(message)
    for message in again:
        assert await q.ok(message)
    shards = await store_of(q).shard_sizes()
    assert sum(s.swept for s in shards) == sum(s.shoveled for s in shards) == 20
    sweeper = backend_of(factory)._sweeper
    assert sweeper is not None and sweeper.swept == sweeper.shoveled == 20
    assert await q.sizes() == Sizes(0, 0, 0, 0)


async def test_an_expired_reservation_behind_a_longer_one_comes_back(sharded: Connect) -> None:
    """Deadlines need not rise in fire order (reserve_delay is each process's own): the
    sweep stopped at the first record within its deadline, so a lapsed reservation fired
    after a 600 s one stayed reserved for those 600 s."""
    factory = await sharded(shards=1, reserve_delay=0.2)
    q = await factory.queue("q")
    await q.push_many(["long", "short"])
    fetched = await store_of(q).reserve(1, 600.0)  # another process's long reservation
    assert [m.payload for m in fetched.messages] == [b'J"long"']
    short = await q.reserve(timeout=30)
    assert short is not None and short.payload == "short"
    again = await q.reserve(timeout=30)  # once it lapsed, swept and shoveled: < 1 s
    assert again is not None and (again.id, again.tries) == (short.id, 1)
    assert await q.ok(again)


async def test_lapsed_reservations_past_a_sweep_batch_behind_a_long_one_come_back(
    sharded: Connect,
) -> None:
    """The sweep pointer stopped at the first reservation still within its deadline, and
    each step walked SWEEP_BATCH records from it: behind one long reservation, lapsed ones
    further than a batch away were never swept until it ended (here an hour: 501 of 1,500
    held that long)."""
    factory = await sharded(sweeper=False)
    backend = backend_of(factory)
    storage = backend.storage
    await factory.queue("q")
    entries = [Entry(f"m{k}~0", b'J"x"', EMPTY_HEADERS) for k in range(SWEEP_BATCH + 501)]
    await storage.load("q", 0, entries, 0.0, None)
    (long,) = (await storage.fire("q", 0, 1, 3600.0)).messages
    lapsed = (await storage.fire("q", 0, SWEEP_BATCH + 500, 0.0)).messages  # deadline: now
    assert len(lapsed) == SWEEP_BATCH + 500
    leader = Sweeper(storage, backend.sharded, lambda *_: None)
    for _ in range(3):
        await leader.sweep_queue("q", 4)
    sizes = await storage.sizes("q", 0)
    assert (sizes.fired, sizes.sidelined) == (1, SWEEP_BATCH + 500)
    # the long one, stepped over, is still its holder's; a shorter one stepped over is
    # swept once its deadline passes
    await storage.load("q", 0, [Entry("short~0", b'J"x"', EMPTY_HEADERS)], 0.0, None)
    await storage.fire("q", 0, 1, 0.5)
    await leader.sweep_queue("q", 4)

    async def swept() -> bool:
        await leader.sweep_queue("q", 4)
        return (await storage.sizes("q", 0)).fired == 1

    await until(swept)
    assert await storage.commit("q", 0, [Ack(long.id, long.tries)]) == [True]
    await leader.stop()


async def test_a_message_being_deadlettered_is_not_swept_back(sharded: Connect) -> None:
    """A ko past max_ko of a lapsed reservation copies the message into the deadletter
    queue, then drops it here; a sweep in between (another process's leader) set it aside
    for another delivery, since it was left with its lapsed deadline: deadlettered and
    delivered again. The sweep is made to run inside the copy."""
    factory = await sharded(shards=1, sweeper=False, deadletter={"max_ko": 0})
    backend = backend_of(factory)
    q = await factory.queue("work", reserve_delay=0.2)
    dl = await factory.queue("__deadletter__")
    leader = Sweeper(backend.storage, backend.sharded, lambda *_: None)
    dl_store = store_of(dl)
    real_insert = dl_store.insert

    async def insert_during_a_sweep(entries: Any) -> Any:
        await leader.step()
        return await real_insert(entries)

    await q.push("poison")
    held = await q.reserve(timeout=30)
    assert held is not None
    await asyncio.sleep(0.4)  # the reservation lapses; nobody has swept it yet
    dl_store.insert = insert_during_a_sweep  # type: ignore[method-assign]
    try:
        assert await q.ko(held) == aio_keuss.KoResult.DEADLETTERED
    finally:
        dl_store.insert = real_insert  # type: ignore[method-assign]
    await leader.step()  # the next pass would shovel back what was set aside
    assert await q.reserve(timeout=0.5) is None
    copy = await dl.pop(timeout=5)
    assert copy is not None and copy.payload == "poison"
    assert await q.total_size() == 0


async def test_a_claimed_queue_s_store_has_the_options_it_was_claimed_with(
    sharded: Connect,
) -> None:
    """The backend kept one store per name: the claim's reopen of the deadletter queue got
    the store of the factory's own open, with the defaults (its dedup window, the
    ``poll_interval`` its consumer place is renewed by). The reopened queue's store has its
    options, and is the one a ko past max_ko copies into."""
    factory = await sharded(deadletter={"max_ko": 0})
    q = await factory.queue("work")
    opened = store_of(factory.open_queues()[-1])
    assert opened.name == "__deadletter__"
    dl = await factory.queue("__deadletter__", dedup_window=0, poll_interval=2.0)
    assert store_of(dl) is not opened
    assert store_of(dl).options == dl.options
    await q.push("poison")
    held = await q.reserve(timeout=30)
    assert held is not None
    assert await q.ko(held) == aio_keuss.KoResult.DEADLETTERED
    assert await backend_of(factory).store_of("__deadletter__", q.options) is store_of(dl)
    copy = await dl.pop(timeout=30)
    assert copy is not None and copy.payload == "poison"


async def test_a_deadletter_a_close_gives_up_on_still_ends_in_one_queue(
    sharded: Connect, case: BackendCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ko past max_ko sets the message aside, copies it into the deadletter queue, then
    drops it here. A close past its grace gave up the ko's round trips and closed the store
    between the copy and the drop: the message was in the deadletter queue and, once set
    aside no more, delivered again here. The store's close now lets the drop happen."""
    import aio_keuss.queue

    if not case.shared:
        pytest.skip("a second factory does not see an in-process storage")
    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.0)  # gives up at once
    factory = await sharded(shards=1, deadletter={"max_ko": 0})
    q = await factory.queue("work")
    await q.push("poison")
    held = await q.reserve(timeout=30)
    assert held is not None
    store = store_of(q)
    storage: Any = store._storage  # type: ignore[attr-defined]
    copied, store_closing = asyncio.Event(), asyncio.Event()
    drop = storage.drop_doomed

    async def drop_once_the_store_closes(*args: Any) -> Any:
        copied.set()  # the copy is in the deadletter queue
        await store_closing.wait()
        return await drop(*args)

    monkeypatch.setattr(storage, "drop_doomed", drop_once_the_store_closes)
    await ko_through_a_cut_close(factory, q, held, copied, store_closing)
    other = await sharded(shards=1)
    left = await (await other.queue("work")).total_size()
    dead = await (await other.queue("__deadletter__")).total_size()
    assert (left, dead) == (0, 1)


async def test_one_leader_at_a_time_and_a_takeover_on_release(sharded: Connect) -> None:
    backend = backend_of(await sharded(sweeper=False))
    first = Sweeper(backend.storage, backend.sharded, lambda *_: None)
    second = Sweeper(backend.storage, backend.sharded, lambda *_: None)
    assert await first.renew()
    assert not await second.renew()
    await second.step()  # not the leader: does nothing
    assert second.passes == 0
    await first.stop()  # gives the lease up
    assert not first.leader
    assert await second.renew()
    await second.step()
    assert second.passes == 1
    await second.stop()


async def test_a_sweeper_in_an_outage_warns_once_without_a_traceback(
    sharded: Connect, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    backend = backend_of(await sharded(sweeper=False))
    sweeper = Sweeper(backend.storage, backend.sharded, lambda *_: None)
    failures = 3

    async def step() -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise aio_keuss.KeussConnectionError("the server is away")

    monkeypatch.setattr(sweeper, "step", step)
    caplog.set_level(logging.INFO, logger="aio_keuss.sharded")
    sweeper.start()
    for _ in range(1000):
        if not failures and any("again" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.01)
    await sweeper.stop()
    said = [(r.levelno, bool(r.exc_info)) for r in caplog.records if "sweeper" in r.msg]
    assert said == [(logging.WARNING, False), (logging.INFO, False)]


# metadata, queue expiry, message TTL ------------------------------------------------------


async def test_the_metadata_record_is_readable(sharded: Connect) -> None:
    factory = await sharded(sweeper=False, message_ttl=60.0, queue_expiry=3600.0)
    await factory.queue("q", reserve_delay=30.0)
    await assert_metadata_of_q(factory)


async def test_an_idle_queue_expires_and_keeps_its_messages(sharded: Connect) -> None:
    factory = await sharded(queue_expiry=0.2)
    storage = backend_of(factory).storage
    q = await factory.queue("q")
    await q.push_many(["a", "b"])
    await until(lambda: _absent("q", factory.list()))

    async def unlisted() -> bool:  # the sweeper let it go
        return "q" not in await storage.listed()

    await until(unlisted)
    # its data stayed: using the queue again writes a new record and finds the messages
    got = await q.pop_many(10, timeout=5)
    assert sorted(m.payload for m in got) == ["a", "b"]
    assert "q" in await factory.list()


async def _absent(name: str, listing: Awaitable[dict[str, Any]]) -> bool:
    return name not in await listing


async def test_expired_messages_are_never_delivered_nor_counted(sharded: Connect) -> None:
    factory = await sharded(message_ttl=0.2, reserve_delay=0.2)
    q = await factory.queue("short")
    await q.push_many(list(range(10)))
    held = await q.reserve_many(3, timeout=1)  # fired, then expire while held
    assert len(held) == 3

    async def empty() -> bool:
        return await q.sizes() == Sizes(0, 0, 0, 0)

    await until(empty)
    assert await q.pop(timeout=0.3) is None
    expired = sum(shard.expired for shard in await store_of(q).shard_sizes())
    assert expired == 10


async def test_delayed_messages_past_their_ttl_are_not_counted_once_due(sharded: Connect) -> None:
    """A delayed push, and a ko with a delay, whose end of life came before their time:
    once due they waited in the schedule, dead, and ``sizes`` counted them as ready (and
    ``next_mature_t`` said now) until a consumer fired on their shard."""
    factory = await sharded(message_ttl=1.0, sweeper=False)  # a busy machine's reserve fits
    q = await factory.queue("late")
    await q.push("delayed", delay=1.2)
    await q.push("failed")
    message = await q.reserve(timeout=1)
    assert message is not None
    assert await q.ko(message, delay=1.2)
    await asyncio.sleep(1.5)  # past both ends of life and both due times
    assert await q.sizes() == Sizes(0, 0, 0, 0)
    assert await q.next_mature_t() is None
    expired = sum(shard.expired for shard in await store_of(q).shard_sizes())
    assert expired == 2
    assert await q.pop(timeout=0) is None


async def test_a_delayed_message_loaded_by_sizes_is_fired_once(sharded: Connect) -> None:
    """``sizes`` loads the due scheduled records (so one past its end of life is not
    counted): a record it loaded into a magazine its consumer emptied before the record's
    time is still found by the ready index (the emptying consumer left the shard there,
    due at that time), and fired once."""
    factory = await sharded(sweeper=False)
    storage = backend_of(factory).storage
    q = await factory.queue("loaded")
    key = {"x-shard-key": "k"}
    await q.push("now", headers=key)
    await q.push("later", headers=key, delay=0.3)
    message = await q.pop(timeout=0)  # empties the shard, leaving it due at 0.3 s
    assert message is not None and message.payload == "now"
    assert await ready_shards(storage, "loaded") == []
    await until(lambda: _has_ready_shard(storage, "loaded"))
    assert await q.sizes() == Sizes(1, 1, 0, 0)  # loaded into the magazine
    assert await q.sizes() == Sizes(1, 1, 0, 0)  # and not again
    message = await q.pop(timeout=0)
    assert message is not None and message.payload == "later"
    assert await q.pop(timeout=0) is None
    assert await q.sizes() == Sizes(0, 0, 0, 0)


async def _has_ready_shard(storage: ShardStorage, queue: str) -> bool:
    return bool(await ready_shards(storage, queue))


async def test_a_message_put_back_after_a_cancelled_pop_keeps_its_end_of_life(
    sharded: Connect,
) -> None:
    """The TTL counts from the push, a put-back included: the message is not given a new
    life from the put-back."""
    factory = await sharded(sweeper=False, message_ttl=2.0)
    q = await factory.queue("q")
    await q.pop(timeout=0)  # enrolled
    await q.push("short-lived")
    pushed = time.time()
    await asyncio.sleep(1.5)  # the put-back comes at least 1.5 s after the push
    await _popped_then_cancelled(q, backend_of(factory).storage)

    async def put_back() -> bool:  # written (maybe by a batch task), or expired already
        shards = await store_of(q).shard_sizes()
        return sum(shard.ready + shard.expired for shard in shards) == 1

    await until(put_back)
    await asyncio.sleep(max(0.0, pushed + 2.3 - time.time()))  # past its end of life
    # (given a new life at the put-back, it would live until 3.5 s after the push at least)
    assert await q.pop(timeout=0) is None
    assert sum(shard.expired for shard in await store_of(q).shard_sizes()) == 1


@pytest.mark.parametrize("where", ["waiting", "scheduled"])
async def test_a_duplicate_push_and_wait_of_a_message_past_its_ttl_is_told_none_comes(
    sharded: Connect, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message past its end of life is never delivered (deleted where it is met, maybe
    much later: a delayed one once it matures), so no result can come for it: a duplicate
    ``push_and_wait`` joining it raises ResultMissingError once the grace passed (made
    short here), as for any message finished with none kept, instead of waiting for
    ever."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)
    factory = await sharded(sweeper=False, message_ttl=0.2)
    q = await factory.queue("q", result_ttl=600.0)
    await q.push(1, id="job-1", delay=3600.0 if where == "scheduled" else 0.0)
    pushed = time.time()
    await asyncio.sleep(max(0.0, pushed + 0.3 - time.time()))  # past its end of life
    with pytest.raises(aio_keuss.ResultMissingError):
        await asyncio.wait_for(q.push_and_wait(2, id="job-1"), 20.0)  # timeout=None


@pytest.mark.parametrize("where", ["waiting", "scheduled"])
async def test_an_id_past_its_ttl_and_its_window_is_queued_again_swept_or_not(
    sharded: Connect, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message past its end of life that no one holds is never delivered: past the dedup
    window a push of its id is queued as it is once the sweeper deleted the message (it was
    refused until then, so a push went in or not by the sweep's timing). ``push_and_wait``
    then waits for the new message, not the dead one, and it is delivered once. The first
    message's life ends as it is stored (the store's copy of the queue's TTL made 0 for its
    push), so nothing waits on the clock; no sweeper runs."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)  # a join of the dead one: told
    factory = await sharded(sweeper=False, message_ttl=3600.0)
    q = await factory.queue("q", dedup_window=0.0, result_ttl=600.0)
    store = store_of(q)
    store._ttl = 0.0
    await q.push(1, id="job-1", delay=3600.0 if where == "scheduled" else 0.0)
    store._ttl = 3600.0
    assert await store.queued(["job-1"]) == [False]  # past its end, not deleted yet
    payloads: list[int] = []

    def handler(message: aio_keuss.Message) -> int:
        payloads.append(message.payload)
        return int(message.payload) * 10

    async with q.consume(handler):
        assert await asyncio.wait_for(q.push_and_wait(2, id="job-1"), 20.0) == 20
    assert payloads == [2]
    assert await q.sizes() == Sizes(0, 0, 0, 0)  # nothing of the dead one left
    assert sum(shard.expired for shard in await store.shard_sizes()) == 1


async def test_messages_within_their_ttl_are_delivered(sharded: Connect) -> None:
    q = await (await sharded(message_ttl=3600.0)).queue("long")
    await q.push_many(list(range(5)))
    got = await q.pop_many(10, timeout=1)
    assert sorted(m.payload for m in got) == list(range(5))


async def test_a_repeat_longer_than_the_ttl_still_delivers_its_occurrences(
    sharded: Connect,
) -> None:
    """A repeat keeps its next occurrence queued, pushed up to a whole period before its
    time; a message's TTL counts from its push, so an occurrence pushed a period ahead on a
    queue whose TTL is shorter would end before it matured, and every one be lost while the
    repeater counted it pushed. Each is pushed late enough to outlive its time. No time is
    asserted: a loaded machine that misses one only makes the wait longer."""
    q = await (await sharded(message_ttl=2.0)).queue("ticks")
    async with q.repeat("tick", "x", every=3.0):
        got: set[str] = set()
        deadline = time.monotonic() + 30.0
        while len(got) < 2:
            assert time.monotonic() < deadline, f"occurrences delivered: {sorted(got)}"
            message = await q.pop(timeout=0.5)
            if message is not None:
                got.add(message.id)
    assert all(m.startswith("tick@") for m in got)


async def test_a_repeat_woken_past_an_occurrence_does_not_push_it_late(
    sharded: Connect,
) -> None:
    """On a queue with a message TTL the repeater sleeps until shortly before each
    occurrence, then pushes it. Woken only after its time (a loop held up, a suspended
    machine), it must skip it, as it skips what fell due while it slept until the one
    before: pushed late, another process's copy may have been consumed past what the dedup
    window covers, and it would be delivered twice. The loop is held up here for longer than
    a period while the repeater sleeps before an occurrence; the first occurrence it pushes
    afterwards must lie after the hold-up (no duration is asserted)."""
    every = 3.0
    q = await (await sharded(message_ttl=2.0)).queue("ticks")
    async with q.repeat("tick", "x", every=every) as repeater:
        await asyncio.sleep(0.1)  # its task started: it computed its first occurrence
        # wait until it sleeps before an occurrence: none pushed, or the last one past
        deadline = time.monotonic() + 60.0
        while repeater.next_at is not None and repeater.next_at.timestamp() > time.time():
            assert time.monotonic() < deadline, "the repeater never got past an occurrence"
            await asyncio.sleep(0.05)
        pushed = repeater.pushed
        time.sleep(every + 0.5)  # noqa: ASYNC251 - the loop held up past that occurrence
        held_until = time.time()
        while repeater.pushed == pushed:
            assert time.monotonic() < deadline + 60.0, "no occurrence pushed after the hold-up"
            await asyncio.sleep(0.05)
        assert repeater.next_at is not None
        assert repeater.next_at.timestamp() > held_until, (repeater.next_at, held_until)


# consumers, cancellation -----------------------------------------------------------------


async def test_a_consumer_past_the_cap_gets_a_typed_error(sharded: Connect) -> None:
    factory = await sharded(sweeper=False, max_consumers=1)
    storage = backend_of(factory).storage
    q = await factory.queue("q")
    await q.push("x")
    assert await storage.enrol("q", "another process", 60.0, 1)
    with pytest.raises(aio_keuss.TooManyConsumersError):
        await q.reserve(timeout=0)
    assert await q.push("a producer is not a consumer")
    await storage.leave("q", "another process")
    assert await q.reserve(timeout=1) is not None


@pytest.mark.parametrize("op", ["pop_many", "reserve_many"])
async def test_fetches_over_several_shards_cancelled_anywhere_lose_nothing(
    sharded: Connect, case: BackendCase, op: str
) -> None:
    """Each fetch fires from 4 shards at once; cancelled after 0, 1, 2, ... loop passes, it
    still hands what it took back to the queue (popped: put back; reserved: released)."""
    q = await (await sharded(sweeper=False, reserve_delay=3600.0)).queue("q")
    # in the caller's task wherever replies refuse cancellation (not through redis-py)
    assert store_of(q).uninterruptible == (case.id != "redis-sharded-cluster")
    total = 400
    await q.push_many(list(range(total)))
    received: list[int] = []
    for ticks in range(12):
        task = asyncio.create_task(getattr(q, op)(64, timeout=0))
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        if not isinstance(outcome, BaseException):  # it ended before the cancel came
            for message in outcome:
                assert op == "pop_many" or await q.ok(message)
                received.append(message.payload)
    left: list[int] = []

    async def all_back() -> bool:
        left.extend(m.payload for m in await q.pop_many(500, timeout=0))
        return len(received) + len(left) >= total

    await until(all_back)  # put-backs are written in the background
    assert sorted(received + left) == list(range(total))
    assert await q.sizes() == Sizes(0, 0, 0, 0)


async def _one_key(
    sharded: Connect, count: int, **options: Any
) -> tuple[aio_keuss.Factory, aio_keuss.Queue, list[str]]:
    """A queue of a sharded factory (no sweeper) this process is enrolled in, holding the
    messages 0 .. ``count`` - 1 of one key, in order; and their ids."""
    factory = await sharded(sweeper=False)
    q = await factory.queue("q", **options)
    await q.pop(timeout=0)  # enrolled
    ids = [await q.push(n, headers={"x-shard-key": "customer-4"}) for n in range(count)]
    return factory, q, ids


async def test_a_message_put_back_after_a_cancelled_pop_keeps_its_place_in_its_key(
    sharded: Connect,
) -> None:
    """A pop cancelled once it took the first message of a key puts it back where it was
    (the caller never saw it): the key's messages still come out in order."""
    factory, q, _ = await _one_key(sharded, 4)
    await _popped_then_cancelled(q, backend_of(factory).storage)

    async def all_back() -> bool:
        return await q.size() == 4

    await until(all_back)  # the put-back may be written in the background (a batch task)
    assert [m.payload for m in await q.pop_many(10, timeout=0)] == [0, 1, 2, 3]
    assert await q.sizes() == Sizes(0, 0, 0, 0)


async def test_the_put_backs_of_two_cancelled_pops_of_one_key_keep_its_order(
    sharded: Connect,
) -> None:
    """Two pops cancelled once their fires took 0 and 1 of one key each give back their
    own, 0's first: the key's messages still come out 0, 1, 2, 3 (the second put-back does
    not go in front of the first)."""
    factory, q, _ = await _one_key(sharded, 4)
    storage = backend_of(factory).storage
    real = storage.load
    gates: list[asyncio.Event] = []

    async def load(*args: Any, front: bool = False, **named: Any) -> Any:
        if front:  # a put-back: held until the test lets it in
            gate = asyncio.Event()
            gates.append(gate)
            await gate.wait()
        return await real(*args, front=front, **named)

    async def held_back() -> bool:
        return len(gates) == len(pops)

    storage.load = load  # type: ignore[method-assign]
    pops: list[asyncio.Task[Any]] = []
    for _ in range(2):
        pops.append(asyncio.ensure_future(q.pop(timeout=5)))
        undo = _cancel_after_fire(storage, pops[-1])
        try:
            await until(held_back)  # its fire answered, its put-back waiting at its gate
        finally:
            undo()
    for size, (gate, task) in enumerate(zip(gates, pops, strict=True), 3):  # 0's, then 1's
        gate.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled()

        async def written(size: int = size) -> bool:  # maybe by a batch task, after the pop
            return await q.size() == size

        await until(written)
    del storage.load
    assert [m.payload for m in await q.pop_many(10, timeout=0)] == [0, 1, 2, 3]
    assert await q.sizes() == Sizes(0, 0, 0, 0)


async def test_a_reservation_released_after_a_cancelled_reserve_keeps_its_place_in_its_key(
    sharded: Connect,
) -> None:
    """A reserve cancelled once its fire took the first message of a key releases it (a
    rollback costing no try): it goes back to its place, so the key's messages still come
    out 0, 1, 2, 3 (reloaded at the load pointer, they came out 1, 2, 3, 0)."""
    factory, q, _ = await _one_key(sharded, 4)
    storage = backend_of(factory).storage
    await _taken_then_cancelled(q.reserve, storage)

    async def all_back() -> bool:
        return await q.size() == 4

    await until(all_back)
    assert [m.payload for m in await q.pop_many(10, timeout=0)] == [0, 1, 2, 3]


async def test_a_stopping_consumer_gives_back_its_prefetched_reservations_in_key_order(
    sharded: Connect,
) -> None:
    """A consumer stopping with reservations prefetched gives them back at no try, one by
    one: each goes back to its place only if nothing is still held just behind it, so they
    go latest first and the key's messages still come out in order (given back earliest
    first, all but the last found the next one held and went to the back: 3, 4, 5, 6, 7, 1,
    2)."""
    _, q, _ = await _one_key(sharded, 8)
    started, finish = asyncio.Event(), asyncio.Event()
    seen: list[int] = []

    async def handler(message: aio_keuss.Message) -> None:
        seen.append(message.payload)
        started.set()
        await finish.wait()

    consumer = q.consume(handler, concurrency=1, prefetch=3)
    await started.wait()

    async def prefetched() -> bool:
        return len(consumer._buffer) == 3

    await until(prefetched)
    finish.set()
    await consumer.stop()
    assert seen == [0]
    assert [m.payload for m in await q.pop_many(10, timeout=0)] == list(range(1, 8))


async def test_a_batch_handler_cancelled_on_stop_gives_its_batch_back_in_key_order(
    sharded: Connect,
) -> None:
    """A batch consumer's handler cancelled by a stop gives its batch back at no try, in one
    call: released one each at once (each its own round trip, run in any order), all but the
    last found the next one still held and went to the back of the key (4, 5, 6, 7, 3, 2, 1,
    0 or the like)."""
    _, q, _ = await _one_key(sharded, 8)
    started = asyncio.Event()
    seen: list[list[int]] = []

    async def handler(messages: list[aio_keuss.Message]) -> None:
        seen.append([m.payload for m in messages])
        started.set()
        await asyncio.Event().wait()  # until the stop cancels it

    consumer = q.consume(handler, concurrency=1, batch=4)
    await started.wait()
    await consumer.stop(grace=0)
    assert seen == [[0, 1, 2, 3]]
    back = await q.pop_many(10, timeout=0)
    assert [m.payload for m in back] == list(range(8))
    assert {m.tries for m in back} == {0}


async def test_a_close_gives_back_more_than_a_batch_of_reservations_in_key_order(
    sharded: Connect,
) -> None:
    """A queue closing with more reservations than one round trip carries (``max_batch``)
    gives them back a batch at a time, at no try: the latest batch first, so each finds its
    place free and the key's messages still come out in order (the earliest batch first
    found the next still held and went to the back: 2, 3, 4, 5, 0, 1)."""
    factory, q, ids = await _one_key(sharded, 6, max_batch=2)
    got = await q.reserve_many(2, timeout=0) + await q.reserve_many(2, timeout=0)
    assert [m.payload for m in got] == [0, 1, 2, 3]
    await q.close()
    storage = backend_of(factory).storage
    left: list[str] = []
    for shard in range(store_of(q).shards):
        left += [m.id for m in (await storage.fire("q", shard, 10, None)).messages]
    assert left == ids


async def test_the_sync_shim_gives_back_an_interrupted_reserve_many_in_key_order(
    sharded: Connect,
) -> None:
    """What a sync ``reserve_many`` took for a caller interrupted by Ctrl-C is released on
    the loop thread in one call, so the key's messages still come out in order (released
    one by one in the order taken: 2, 3, 4, 5, 0, 1; one by one latest first, each in a
    task of its own, Redis Cluster ran them out of order once: 1, 2, 3, 4, 5, 0)."""
    from aio_keuss import sync

    _, q, _ = await _one_key(sharded, 6)
    got = await q.reserve_many(3, timeout=0)
    assert [m.payload for m in got] == [0, 1, 2]
    sync._release(q, got, {})  # as _abandon does, on the loop thread

    async def all_back() -> bool:
        return (await q.sizes()).reserved == 0

    await until(all_back)
    assert [m.payload for m in await q.pop_many(10, timeout=0)] == list(range(6))


# delays ---------------------------------------------------------------------------------


async def test_delayed_messages_wait_outside_the_magazine(sharded: Connect) -> None:
    factory = await sharded(sweeper=False)
    q = await factory.queue("q")
    await q.push("later", delay=3600)
    assert await q.sizes() == Sizes(0, 1, 1, 0)
    assert await q.pop(timeout=0) is None
    # the shard waits in the index until its first scheduled record matures
    head = await backend_of(factory).storage.ready_head("q")
    assert head.due == []
    mature = await q.next_mature_t()
    assert mature is not None and head.earliest == pytest.approx(mature.timestamp(), abs=1)


async def test_a_ko_with_a_delay_is_scheduled_then_loaded_again(sharded: Connect) -> None:
    q = await (await sharded(sweeper=False)).queue("q")
    mid = await q.push("x")
    first = await q.reserve(timeout=1)
    assert first is not None and first.id == mid
    assert await q.ko(first, delay=0.2)
    assert await q.sizes() == Sizes(0, 1, 1, 0)
    assert not await q.ok(first)  # scheduled: held by no one
    again = await q.reserve(timeout=30)
    assert again is not None and again.id == mid and again.tries == 1
    assert await q.ok(again)
    assert await q.sizes() == Sizes(0, 0, 0, 0)
