"""redis-sharded specifics, on a real Redis: routing (round-robin, by key, by id), the ready
index (fair, no empty shards, repaired), sweep -> sideline -> shovel with its counters, the
leader lease, and processes killed with SIGKILL (consumers holding fired records; the
sweeper's leader)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token

import aio_keuss
from aio_keuss.redis.sharded import RedisShardedBackend, RedisShardStorage
from aio_keuss.sharded.settings import shard_of
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


def ready_key(prefix: str, queue: str) -> str:
    return f"{prefix}:{{{queue}}}:ready"


def meta_key(prefix: str, queue: str, shard: int) -> str:
    return f"{prefix}:{{{queue}#{shard}}}:m"


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 60.0) -> None:
    """Wait for a condition the background tasks bring about (a bound against hangs, not a
    performance assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await condition():
        assert loop.time() < deadline, "condition never met"
        await asyncio.sleep(0.05)


# routing --------------------------------------------------------------------------------


async def test_ids_name_their_shard_and_explicit_ids_hash(connect: Connect) -> None:
    q = await (await connect(sweeper=False)).queue("q")
    made = await q.push("x")
    assert made.rsplit("~", 1)[1] in {"0", "1", "2", "3"}
    assert shard_of(made, 4) == int(made.rsplit("~", 1)[1])
    assert shard_of("order-17", 4) == zlib.crc32(b"order-17") % 4
    assert await q.push("y", id="order-17") == "order-17"
    assert await q.push("again", id="order-17") == "order-17"  # dedup within its shard
    assert await q.size() == 2


async def test_messages_with_one_key_keep_their_order(connect: Connect, prefix: str) -> None:
    q = await (await connect(sweeper=False)).queue("q")
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


async def test_round_robin_spreads_batches_and_reserve_takes_from_each(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    q = await (await connect(sweeper=False)).queue("q")
    for i in range(8):
        await q.push(i)
    assert await redis.zcard(ready_key(prefix, "q")) == 4
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
    assert await redis.zcard(ready_key(prefix, "q")) == 0
    for message in rest:
        assert await q.ok(message)
    assert await q.sizes() == Sizes(0, 0, 0, 0)


async def test_a_lost_ready_hint_is_restored_by_the_sweeper(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    q = await (await connect()).queue("q")
    await q.push("stranded")
    await redis.delete(ready_key(prefix, "q"))  # as if the pusher died between its scripts
    message = await q.pop(timeout=30)
    assert message is not None and message.payload == "stranded"


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


# sweep, sideline, shovel ----------------------------------------------------------------


async def test_expired_reservations_are_swept_shoveled_and_counted(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    factory = await connect(reserve_delay=0.2)
    q = await factory.queue("q")
    pushed = await q.push_many(list(range(20)))
    held = await q.reserve_many(20, timeout=1)
    assert sorted(m.id for m in held) == sorted(pushed)
    again: list[aio_keuss.Message] = []
    while len(again) < 20:
        again += await q.reserve_many(20, timeout=30)
    assert sorted(m.id for m in again) == sorted(pushed)
    assert {m.tries for m in again} == {1}
    for message in held:  # the stale holders' ok is refused
        assert not await q.ok(message)
    for message in again:
        assert await q.ok(message)
    swept = shoveled = 0
    for shard in range(4):
        counters = await redis.hmget(meta_key(prefix, "q", shard), "n", "v")
        swept += int(counters[0] or 0)
        shoveled += int(counters[1] or 0)
    assert swept == shoveled == 20
    sweeper = backend_of(factory)._sweeper
    assert sweeper is not None and sweeper.swept == sweeper.shoveled == 20
    assert await q.sizes() == Sizes(0, 0, 0, 0)


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


# metadata, queue expiry, message TTL ------------------------------------------------------


async def test_the_metadata_record_is_read_from_any_process(connect: Connect) -> None:
    first = await connect(sweeper=False, message_ttl=60.0, queue_expiry=3600.0)
    await first.queue("q", reserve_delay=30.0)
    other = await connect(sweeper=False)
    info = await backend_of(other).queue_info("q")
    assert info is not None
    assert info["shards"] == 4 and info["active"] is True
    assert info["message_ttl"] == 60.0 and info["queue_expiry"] == 3600.0
    assert info["sweep_duration"] == 30.0 and info["max_consumers"] == 100
    assert info["created"] <= info["seen"] + 1
    listed = await other.list()
    assert listed["q"]["sharded"]["shards"] == 4
    assert await backend_of(other).queue_info("never-opened") is None


async def test_an_idle_queue_expires_and_keeps_its_messages(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    factory = await connect(queue_expiry=0.2)
    q = await factory.queue("q")
    await q.push_many(["a", "b"])
    await until(lambda: _absent("q", factory.list()))
    registry = f"{prefix}:sharded:queues"
    await until(lambda: _false(redis.hexists(registry, "q")))  # the sweeper let it go
    # its data stayed: using the queue again writes a new record and finds the messages
    got = await q.pop_many(10, timeout=5)
    assert sorted(m.payload for m in got) == ["a", "b"]
    assert "q" in await factory.list()


async def _absent(name: str, listing: Awaitable[dict[str, Any]]) -> bool:
    return name not in await listing


async def _false(value: Awaitable[Any]) -> bool:
    return not await value


async def test_expired_messages_are_never_delivered_nor_counted(connect: Connect) -> None:
    factory = await connect(message_ttl=0.2, reserve_delay=0.2)
    q = await factory.queue("short")
    await q.push_many(list(range(10)))
    held = await q.reserve_many(3, timeout=1)  # fired, then expire while held
    assert len(held) == 3
    await until(lambda: _sizes_are(q, Sizes(0, 0, 0, 0)))
    assert await q.pop(timeout=0.3) is None
    store = q._store  # type: ignore[attr-defined]
    expired = sum(shard.expired for shard in await store.shard_sizes())
    assert expired == 10


async def _sizes_are(q: aio_keuss.Queue, sizes: Sizes) -> bool:
    return await q.sizes() == sizes


async def test_messages_within_their_ttl_are_delivered(connect: Connect) -> None:
    q = await (await connect(message_ttl=3600.0)).queue("long")
    await q.push_many(list(range(5)))
    got = await q.pop_many(10, timeout=1)
    assert sorted(m.payload for m in got) == list(range(5))


# consumers ------------------------------------------------------------------------------


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


def test_at_most_100_consumers_per_queue() -> None:
    with pytest.raises(aio_keuss.ConfigError):
        RedisShardedBackend({"max_consumers": 101})


# delays ---------------------------------------------------------------------------------


async def test_delayed_messages_wait_outside_the_magazine(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    q = await (await connect(sweeper=False)).queue("q")
    await q.push("later", delay=3600)
    assert await q.sizes() == Sizes(0, 1, 1, 0)
    assert await q.pop(timeout=0) is None
    # the shard waits in the index until its first scheduled record matures
    scores = await redis.zrange(ready_key(prefix, "q"), 0, -1, withscores=True)
    assert len(scores) == 1
    mature = await q.next_mature_t()
    assert mature is not None and scores[0][1] == pytest.approx(mature.timestamp(), abs=1)


async def test_a_ko_with_a_delay_is_scheduled_then_loaded_again(connect: Connect) -> None:
    q = await (await connect(sweeper=False)).queue("q")
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
