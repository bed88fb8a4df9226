"""redis-sharded specifics, on a real Redis: the key layout (what existing data is read
from), several factories sharing one prefix (the shard count a queue keeps, the leader lease,
the metadata record, the consumer cap), and processes killed with SIGKILL (consumers holding
fired records; the sweeper's leader), on one Redis and on a Redis Cluster. The model itself,
on every storage: tests/conformance/test_sharded_model.py and test_shard_storage.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token
from sharded_checks import assert_metadata_of_q

import aio_keuss
from aio_keuss.contract import Entry
from aio_keuss.redis.sharded import RedisShardedBackend, RedisShardStorage
from aio_keuss.types import Sizes

try:
    import redis.asyncio as aioredis
except ImportError:  # pragma: no cover
    pytest.skip("redis is not installed", allow_module_level=True)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
FAST = {"sweep_interval": 0.1, "shovel_interval": 0.2, "lease_ttl": 2.0}

Connect = Callable[..., Awaitable[aio_keuss.Factory]]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    name = f"akt-sh-{new_token()}"
    yield name
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": name})


@pytest.fixture
async def redis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()


@pytest.fixture
async def connect(prefix: str) -> AsyncIterator[Connect]:
    opened: list[aio_keuss.Factory] = []

    async def _connect(**extra: Any) -> aio_keuss.Factory:
        options = {"url": REDIS_URL, "prefix": prefix, "shards": 4, "poll_interval": 0.5}
        factory = await aio_keuss.connect("redis-sharded", **{**options, **FAST, **extra})
        opened.append(factory)
        return factory

    yield _connect
    for factory in opened:
        await factory.close()


def backend_of(factory: aio_keuss.Factory) -> RedisShardedBackend:
    backend = factory.backend
    assert isinstance(backend, RedisShardedBackend)
    return backend


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 60.0) -> None:
    """Wait for a condition the background tasks bring about (a bound against hangs, not a
    performance assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await condition():
        assert loop.time() < deadline, "condition never met"
        await asyncio.sleep(0.05)


# keys, options ---------------------------------------------------------------------------


async def test_the_key_layout_is_the_documented_one(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    q = await (await connect(sweeper=False, shards=1, message_ttl=3600.0)).queue("q")
    mid = await q.push("x", headers={"k": 1})
    later = await q.push("y", delay=3600)
    message = await q.reserve(timeout=1)
    assert message is not None and message.id == mid
    base = f"{prefix}:{{q#0}}:"
    pointers = await redis.hmget(base + "m", "l", "f", "r", "q")
    assert pointers == [b"1", b"1", b"1", b"1"]
    record = await redis.hgetall(base + "r:0")
    assert set(record) == {b"i", b"p", b"h", b"t", b"m", b"x", b"e"}
    assert record[b"i"] == mid.encode() and record[b"t"] == b"0"
    seq = b"0" * 20  # scheduled records are named by their seq, zero-padded
    assert await redis.hgetall(base + "ix") == {mid.encode(): b"0", later.encode(): b"z" + seq}
    assert (await redis.hgetall(base + "q:" + seq.decode()))[b"i"] == later.encode()
    assert await redis.zrange(base + "z", 0, -1) == [seq]
    assert await redis.zrange(f"{prefix}:{{q}}:ready", 0, -1) == [b"0"]  # due later
    assert await redis.hget(f"{prefix}:{{q}}:stamps", "0") == b"2"
    assert await redis.zcard(f"{prefix}:{{q}}:consumers") == 1
    assert await redis.hget(f"{prefix}:{{q}}:meta", "shards") == b"1"
    assert await redis.hgetall(f"{prefix}:sharded:queues") == {b"q": b"1"}


async def test_a_queue_keeps_the_shard_count_it_was_created_with(connect: Connect) -> None:
    await (await connect(sweeper=False)).queue("q")
    again = await connect(sweeper=False, shards=8)
    with pytest.raises(aio_keuss.ConfigError, match="4 shards"):
        await again.queue("q")


@pytest.mark.parametrize(
    "bad",
    [
        {"shards": 0},
        {"shards": 513},
        {"shards": True},
        {"sweep_interval": 0},
        {"lease_ttl": 0.05, "sweep_interval": 0.1},
        {"shovel_concurrency": 0},
    ],
)
async def test_bad_options_are_refused_before_connecting(bad: dict[str, Any]) -> None:
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect("redis-sharded", url="redis://127.0.0.1:1/0", **bad)


# several factories on one prefix ------------------------------------------------------


async def test_one_leader_and_a_takeover_on_close(connect: Connect) -> None:
    first = backend_of(await connect())._sweeper
    second = backend_of(await connect())._sweeper
    assert first is not None and second is not None
    await until(lambda: _true(first.leader or second.leader))
    leader, other = (first, second) if first.leader else (second, first)
    assert not await other.renew()
    await leader.stop()  # a clean close gives the lease up
    assert await other.renew()


async def _true(value: bool) -> bool:
    return value


# processes killed with SIGKILL ----------------------------------------------------------

_CHILD = """
import asyncio, sys
import aio_keuss

async def main() -> None:
    url, prefix, n, leader = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    cluster = len(sys.argv) > 5
    factory = await aio_keuss.connect(
        "redis-sharded", url=url, prefix=prefix, shards=4, sweeper=leader, cluster=cluster,
        sweep_interval=0.1, shovel_interval=0.2, lease_ttl=2.0, reserve_delay=3.0,
    )
    if leader:
        sweeper = factory.backend._sweeper
        while not sweeper.leader:
            await asyncio.sleep(0.05)
        print("leader", sweeper.token, flush=True)
    queue = await factory.queue("q")
    held = []
    while len(held) < n:
        held += await queue.reserve_many(n - len(held), timeout=10)
    print(" ".join(m.id for m in held), flush=True)
    await asyncio.sleep(3600)  # holds them until killed

asyncio.run(main())
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


async def _spawn(tmp_path: Path, *args: str) -> asyncio.subprocess.Process:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    return await asyncio.create_subprocess_exec(
        sys.executable, str(script), *args, env=_env(), stdout=asyncio.subprocess.PIPE
    )


async def _line(child: asyncio.subprocess.Process) -> str:
    assert child.stdout is not None
    return (await asyncio.wait_for(child.stdout.readline(), 60)).decode().strip()


async def _kill(child: asyncio.subprocess.Process) -> None:
    if child.returncode is None:
        child.send_signal(signal.SIGKILL)
    await child.wait()


async def _take_all(q: aio_keuss.Queue, n: int) -> list[aio_keuss.Message]:
    got: list[aio_keuss.Message] = []
    while len(got) < n:
        batch = await q.reserve_many(n, timeout=60)
        assert batch, f"only {len(got)} of {n} delivered again"
        got += batch
        for message in batch:
            assert await q.ok(message)
    return got


async def test_consumers_killed_holding_records_lose_nothing(
    connect: Connect, tmp_path: Path, prefix: str
) -> None:
    """Two consumer processes fire records and die holding them: every message comes back
    through sweep -> sideline -> shovel, exactly once more, none lost."""
    factory = await connect(reserve_delay=0.5)  # this process runs the sweeper
    q = await factory.queue("q")
    pushed = await q.push_many(list(range(200)))
    children = [await _spawn(tmp_path, REDIS_URL, prefix, "100", "0") for _ in range(2)]
    held: list[str] = []
    try:
        for child in children:
            held += (await _line(child)).split()
    finally:
        for child in children:
            await _kill(child)
    assert sorted(held) == sorted(pushed)  # the children took everything between them
    again = await _take_all(q, 200)
    assert sorted(m.id for m in again) == sorted(pushed)
    assert {m.tries for m in again} == {1}
    assert await q.reserve(timeout=0.5) is None
    assert await q.sizes() == Sizes(0, 0, 0, 0)


async def test_the_sweeper_leader_killed_another_takes_over(
    connect: Connect, tmp_path: Path, prefix: str
) -> None:
    """The leader process (holding records too) is killed: this process takes the lease
    over once it expires, and sweeps the dead leader's records back."""
    child = await _spawn(tmp_path, REDIS_URL, prefix, "30", "1")
    try:
        assert (await _line(child)).startswith("leader")
        factory = await connect(reserve_delay=0.5)
        sweeper = backend_of(factory)._sweeper
        assert sweeper is not None
        assert not await sweeper.renew()  # the child holds the lease
        q = await factory.queue("q")
        pushed = await q.push_many(list(range(30)))
        held = (await _line(child)).split()
        assert sorted(held) == sorted(pushed)
    finally:
        await _kill(child)
    await until(lambda: _true(sweeper.leader))
    again = await _take_all(q, 30)
    assert sorted(m.id for m in again) == sorted(pushed)
    assert {m.tries for m in again} == {1}


async def test_the_metadata_record_is_read_from_any_process(connect: Connect) -> None:
    first = await connect(sweeper=False, message_ttl=60.0, queue_expiry=3600.0)
    await first.queue("q", reserve_delay=30.0)
    other = await connect(sweeper=False)
    await assert_metadata_of_q(other)


async def test_consumers_past_the_cap_get_a_typed_error(connect: Connect) -> None:
    factories = [await connect(sweeper=False, max_consumers=2) for _ in range(3)]
    queues = [await f.queue("q") for f in factories]
    await queues[0].push("x")
    assert await queues[0].reserve(timeout=0) is not None
    assert await queues[1].pop(timeout=0) is None
    with pytest.raises(aio_keuss.TooManyConsumersError):
        await queues[2].reserve(timeout=0)
    assert await queues[2].push("a producer is not a consumer")
    await factories[1].close()  # leaves the queue's consumers
    assert await queues[2].pop(timeout=1) is not None


async def test_a_waiting_consumer_keeps_its_place_and_an_idle_one_loses_it(
    connect: Connect,
) -> None:
    """A consumer waiting in reserve fetches only every poll_interval (longer than the lease
    here, as by default): its place must not lapse meanwhile to another process, whose
    consumer would shut it out at its next fetch. One that stopped fetching gives it up."""
    settings = {"sweeper": False, "max_consumers": 1, "lease_ttl": 2.0, "poll_interval": 3.5}
    first, second = [await connect(**settings) for _ in range(2)]
    a, b = await first.queue("q"), await second.queue("q")
    assert await a.reserve(timeout=0) is None  # a is the queue's one consumer
    waiting = asyncio.create_task(a.reserve(timeout=30))
    await asyncio.sleep(2.7)  # past a lease, no fetch meanwhile
    with pytest.raises(aio_keuss.TooManyConsumersError):
        await b.reserve(timeout=0)
    await b.push("for a")
    got = await asyncio.wait_for(waiting, 20)
    assert got is not None and got.payload == "for a"
    # a no longer fetches: after poll_interval + lease its place is free for b
    for _ in range(300):
        await asyncio.sleep(0.1)
        with contextlib.suppress(aio_keuss.TooManyConsumersError):
            await b.reserve(timeout=0)
            break
    else:
        raise AssertionError("an idle consumer kept its place")


async def test_an_expired_queue_opened_again_keeps_the_shards_its_data_is_in(
    connect: Connect,
) -> None:
    """After queue_expiry the metadata record is gone but the messages stay in their shards:
    a process opening the queue again with fewer shards must not hide those past its count
    (uncounted, their ok routed to the wrong shard, never swept). It is refused, as it is
    while the record lives."""
    first = await connect(sweeper=False, shards=8, queue_expiry=0.2)
    q = await first.queue("q")
    for i in range(16):
        await q.push(f"m{i}")  # round-robin: every shard has some
    await first.close()
    await _until_the_record_expired(await connect(sweeper=False, queue_expiry=0.2))
    later = await connect(sweeper=False, shards=2, queue_expiry=0.2)
    with pytest.raises(aio_keuss.ConfigError, match="8 shards"):
        await later.queue("q")
    again = await connect(sweeper=False, shards=8, queue_expiry=0.2)
    q = await again.queue("q")
    assert (await q.sizes()).size == 16
    for _ in range(16):
        message = await q.reserve(timeout=1)
        assert message is not None and await q.ok(message)


async def _until_the_record_expired(probe: aio_keuss.Factory) -> None:
    """Until queue "q"'s metadata record is gone (it lives 2 * queue_expiry)."""
    for _ in range(500):
        if "q" not in await probe.list():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the metadata record never expired")


async def test_an_expired_queue_opened_again_keeps_the_shard_count_its_ids_route_by(
    connect: Connect, prefix: str
) -> None:
    """A message pushed with an explicit id sits in shard crc32(id) % count: a process
    opening the expired queue again with more shards (explicit, or the default 32) routed
    its ok to another shard (ok False, the message delivered again for ever) and its dedup
    check too. The queue keeps its count: an explicit other one is refused, a default
    adopts it."""
    mid = next(f"order-{i}" for i in range(100) if zlib.crc32(f"order-{i}".encode()) % 8 >= 4)
    first = await connect(sweeper=False, shards=4, queue_expiry=0.2)
    await (await first.queue("q")).push("x", id=mid)
    await first.close()
    await _until_the_record_expired(await connect(sweeper=False, queue_expiry=0.2))
    more = await connect(sweeper=False, shards=8, queue_expiry=0.2)
    with pytest.raises(aio_keuss.ConfigError, match="4 shards"):
        await more.queue("q")
    factory = await aio_keuss.connect(  # the default shard count (32), not an explicit one
        "redis-sharded", url=REDIS_URL, prefix=prefix, sweeper=False
    )
    try:
        q = await factory.queue("q")
        message = await q.reserve(timeout=5)
        assert message is not None and message.id == mid
        assert await q.ok(message)
        assert (await q.sizes()).total == 0
    finally:
        await factory.close()


async def test_a_queue_whose_keys_a_node_lost_is_served_again(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    """On a cluster the {queue} slot (ready index, stamps, metadata record) may sit on a
    node that restarts without its data while the shards elsewhere keep their records: a
    shard with records is then never announced by a push, and the sweeper took the missing
    record for an expired queue and stopped sweeping it. Simulated by deleting those keys."""
    factory = await connect(shards=1)
    q = await factory.queue("q", poll_interval=0.5)
    await q.push("before")
    for key in [k async for k in redis.scan_iter(f"{prefix}:{{q}}:*")]:
        await redis.delete(key)
    await redis.delete(f"{prefix}:sharded:queues")
    await asyncio.sleep(0.5)  # sweeper passes meanwhile
    await q.push("after")
    got: list[str] = []
    while len(got) < 2 and (message := await q.pop(timeout=10)) is not None:
        got.append(message.payload)
    assert sorted(got) == ["after", "before"]


# the id index ----------------------------------------------------------------------------


async def _one_shard_queue(connect: Connect) -> tuple[aio_keuss.Queue, RedisShardStorage, str]:
    """A queue of one shard, no leader, no dedup window (an id is refused only while its
    index entry says it is queued); its storage and the base of its keys."""
    factory = await connect(sweeper=False, shards=1, dedup_window=0)
    storage = backend_of(factory).storage
    assert isinstance(storage, RedisShardStorage)
    q = await factory.queue("q")
    return q, storage, storage.shard_base("q", 0)


async def test_a_stale_index_entry_is_dropped_by_the_sweep(
    connect: Connect, redis: aioredis.Redis
) -> None:
    """An index entry whose record is gone (deleted by another program, evicted, lost by a
    failover) was dropped only by a later push of its id: one never pushed again stayed in
    the index for ever. The sweep looks over a slice of the index each step."""
    q, storage, base = await _one_shard_queue(connect)
    await q.push("a", id="gone")
    await q.push("b", id="kept")
    assert await redis.delete(base + "r:0") == 1
    await storage.sweep("q", 0, 1000)
    assert await redis.hgetall(base + "ix") == {b"kept": b"1"}


async def test_a_refused_ok_drops_the_stale_index_entry_it_read(
    connect: Connect, redis: aioredis.Redis
) -> None:
    """The ok of a record that is gone reads its id's entry already: it drops it there."""
    q, _, base = await _one_shard_queue(connect)
    await q.push("a", id="gone")
    held = await q.reserve(timeout=1)
    assert held is not None and held.id == "gone"
    assert await redis.delete(base + "r:0") == 1
    assert not await q.ok(held)
    assert not await redis.hexists(base + "ix", "gone")


async def _pushed_again(storage: RedisShardStorage, id: str) -> bool:
    """Whether a push of ``id`` is stored (false: refused as queued)."""
    entry = Entry(id, b"again", b"{}", dedup=True)
    return (await storage.load("q", 0, [entry], 0.0, None)).flags == [True]


async def _legacy_sidelined(q: aio_keuss.Queue, storage: RedisShardStorage, redis: Any) -> str:
    """A record of id ``old`` in the sideline, its index entry ``s`` as older versions wrote
    it (no pointer). Returns the base of the shard's keys."""
    base = storage.shard_base("q", 0)
    await q.push("old", id="old")
    held = await q.reserve(timeout=1)
    assert held is not None
    await redis.hset(base + "r:0", "x", "0")  # its reservation lapsed
    assert (await storage.sweep("q", 0, 1000)).moved == 1
    assert await redis.hget(base + "ix", "old") == b"s0"
    await redis.hset(base + "ix", "old", "s")
    return base


async def test_an_older_sideline_entry_of_a_record_that_lost_its_id_is_stale(
    connect: Connect, redis: aioredis.Redis
) -> None:
    """Older versions wrote a sidelined record's index entry as ``s`` with no pointer: one
    whose record lost its id (renamed when the shovel met it) refused its id for ever."""
    q, storage, _ = await _one_shard_queue(connect)
    base = await _legacy_sidelined(q, storage, redis)
    assert await redis.hdel(base + "s:0", "i") == 1
    assert (await storage.shovel("q", 0, 1000)).moved == 1
    assert await _pushed_again(storage, "old")


async def test_an_older_sideline_entry_of_a_record_still_there_counts(
    connect: Connect, redis: aioredis.Redis
) -> None:
    """An older sideline entry whose record is still in the sideline keeps its id refused,
    through a sweep's look over the index too, until the shovel moves the record on."""
    q, storage, _ = await _one_shard_queue(connect)
    base = await _legacy_sidelined(q, storage, redis)
    assert not await _pushed_again(storage, "old")
    await storage.sweep("q", 0, 1000)
    assert await redis.hget(base + "ix", "old") == b"s"
    assert (await storage.shovel("q", 0, 1000)).moved == 1
    assert await redis.hget(base + "ix", "old") == b"1"  # its pointer in the magazine
    assert not await _pushed_again(storage, "old")


async def test_a_sweep_step_looks_for_one_older_sideline_entry_at_most(
    connect: Connect, redis: aioredis.Redis
) -> None:
    """An older version's entry costs the sweep up to a thousand look-ups in the sideline: a
    slice of them held Redis for a hundred times that in one step (a queue of 1,200 such
    entries: 62,576 HGETs, 30 ms of script). One a step; the rest in the steps after."""
    _, storage, base = await _one_shard_queue(connect)
    await redis.hset(base + "ix", mapping={"ghost-1": "s", "ghost-2": "s"})
    await storage.sweep("q", 0, 1000)
    assert len(await redis.hgetall(base + "ix")) == 1
    await storage.sweep("q", 0, 1000)
    assert await redis.hgetall(base + "ix") == {}


# Redis Cluster ---------------------------------------------------------------------------


async def test_on_redis_cluster_shards_spread_and_killed_consumers_lose_nothing(
    tmp_path: Path,
) -> None:
    """The same kill on the 3-master cluster: each shard in its own hash slot."""
    import redis_cluster
    from redis.crc import key_slot

    reason = redis_cluster.start_redis_cluster()
    if reason:
        pytest.skip(reason)
    prefix = f"akt-shc-{new_token()}"
    options = {"url": redis_cluster.CLUSTER_URL, "prefix": prefix, "cluster": True, "shards": 4}
    try:
        async with aio_keuss.connect(
            "redis-sharded", reserve_delay=0.5, poll_interval=0.5, **options, **FAST
        ) as factory:
            storage = backend_of(factory).storage
            assert isinstance(storage, RedisShardStorage)
            slots = {key_slot(storage.shard_base("q", s).encode()) for s in range(4)}
            assert len(slots) == 4
            q = await factory.queue("q")
            pushed = await q.push_many(list(range(100)))
            children = [
                await _spawn(tmp_path, redis_cluster.CLUSTER_URL, prefix, "50", "0", "cluster")
                for _ in range(2)
            ]
            held: list[str] = []
            try:
                for child in children:
                    held += (await _line(child)).split()
            finally:
                for child in children:
                    await _kill(child)
            assert sorted(held) == sorted(pushed)
            again = await _take_all(q, 100)
            assert sorted(m.id for m in again) == sorted(pushed)
            assert {m.tries for m in again} == {1}
    finally:
        await redis_cluster._drop_redis_cluster_prefix({"prefix": prefix})
