"""redis-reliable specifics, on a real Redis: key layout, tries, the stale-holder guard,
deadletter into another queue, and recovery of the reservations of consumers that die
(processes killed with SIGKILL), including two processes recovering at once."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from backends import (
    REDIS_URL,
    _drop_redis_prefix,
    a_poison_reserved,
    ko_through_a_cut_close,
    new_token,
    sizes_after,
)
from fault_proxy import BEFORE, FaultProxy
from polling import until
from redis_cluster import _drop_redis_cluster_prefix, _redis_cluster, start_redis_cluster

import aio_keuss
from aio_keuss.contract import Entry
from aio_keuss.message import decode_headers
from aio_keuss.registry import load_backend
from aio_keuss.types import KoResult, Sizes

try:
    import redis.asyncio as aioredis
except ImportError:  # pragma: no cover
    pytest.skip("redis is not installed", allow_module_level=True)

try:
    load_backend("redis-reliable")
except ImportError as exc:  # pragma: no cover
    pytest.skip(str(exc), allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
TTL = 1.0
"""heartbeat_ttl in these tests: a killed consumer is recovered within ~1.5 s."""


def _bus_options() -> dict[str, Any]:
    """In-process signals / stats until the Redis ones exist; the Redis ones once they do."""
    options: dict[str, Any] = {}
    if importlib.util.find_spec("aio_keuss.redis.signal") is None:
        options["signal"] = "local"
    if importlib.util.find_spec("aio_keuss.redis.stats") is None:
        options["stats"] = "memory"
    return options


Connect = Callable[..., Awaitable[aio_keuss.Factory]]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    name = f"akt-rr-{new_token()}"
    yield name
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": name})


@pytest.fixture
async def redis(prefix: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()


@pytest.fixture
async def connect(prefix: str) -> AsyncIterator[Connect]:
    opened: list[aio_keuss.Factory] = []

    async def _connect(**extra: Any) -> aio_keuss.Factory:
        options = {
            "url": REDIS_URL,
            "prefix": prefix,
            "heartbeat_ttl": TTL,
            "poll_interval": 0.2,
            **_bus_options(),
            **extra,
        }
        factory = await aio_keuss.connect("redis-reliable", **options)
        opened.append(factory)
        return factory

    yield _connect
    for factory in opened:
        await factory.close()


def key(prefix: str, queue: str, *parts: str) -> str:
    return ":".join((prefix, "{" + queue + "}", *parts))


async def test_push_pop_reserve_ok_ko_and_key_layout(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    q = await (await connect()).queue("q1")
    first = await q.push({"n": 1}, headers={"h": "v"})
    await q.push_many([2, b"three"])
    assert await redis.llen(key(prefix, "q1", "pending")) == 3
    assert await redis.hget(key(prefix, "q1", "msg", first), "t") == b"0"

    popped = await q.pop(timeout=1)
    assert popped is not None and popped.id == first and popped.payload == {"n": 1}
    assert popped.headers == {"h": "v"} and popped.tries == 0
    assert not await redis.exists(key(prefix, "q1", "msg", first))

    reserved = await q.reserve(timeout=1)
    assert reserved is not None and reserved.payload == 2
    store = q._store
    processing = key(prefix, "q1", "processing", store.consumer)  # type: ignore[attr-defined]
    assert await redis.lrange(processing, 0, -1) == [reserved.id.encode()]
    assert await redis.sismember(key(prefix, "q1", "consumers"), store.consumer)  # type: ignore[attr-defined]
    assert await redis.exists(key(prefix, "q1", "heartbeat", store.consumer))  # type: ignore[attr-defined]

    assert await q.ko(reserved) == KoResult.ROLLED_BACK
    assert await redis.llen(processing) == 0
    # a ko goes to the far end: b"three" is delivered before the retried message
    nxt = await q.reserve(timeout=1)
    assert nxt is not None and nxt.payload == b"three"
    again = await q.reserve(timeout=1)
    assert again is not None and again.id == reserved.id and again.tries == 1
    assert await q.ok(nxt) and await q.ok(again)
    assert not await q.ok(again)
    assert await redis.get(key(prefix, "q1", "processed")) == b"2"
    assert await redis.llen(processing) == 0


async def test_ko_counts_tries_and_stale_ok_is_refused(connect: Connect) -> None:
    q = await (await connect()).queue("q1")
    await q.push("x")
    first = await q.reserve(timeout=1)
    assert first is not None and first.tries == 0
    assert await q.ko(first)
    second = await q.reserve(timeout=1)
    assert second is not None and second.tries == 1
    assert not await q.ok(first)  # the holder of the earlier delivery is stale
    assert not await q.ko(first)
    assert await q.ok(second)
    assert not await q.ok(second.id)  # gone


async def test_ok_by_another_consumer_is_refused(connect: Connect) -> None:
    """A reservation belongs to the store (consumer) that made it."""
    q1 = await (await connect()).queue("q1")
    q2 = await (await connect()).queue("q1")
    await q1.push("x")
    message = await q1.reserve(timeout=1)
    assert message is not None
    assert not await q2.ok(message)
    assert not await q2.ko(message)
    assert await q1.ok(message)


async def test_sizes_count_every_consumers_reservations(connect: Connect) -> None:
    q1 = await (await connect()).queue("q1")
    q2 = await (await connect()).queue("q1")
    await q1.push_many(list(range(5)))
    assert await q1.sizes() == Sizes(5, 5, 0, 0)
    assert await q1.next_mature_t() is not None
    a = await q1.reserve_many(2, timeout=1)
    b = await q2.reserve(timeout=1)
    assert len(a) == 2 and b is not None
    sizes = await q2.sizes()
    assert (sizes.size, sizes.reserved, sizes.scheduled, sizes.total) == (2, 3, 0, 5)
    for m in a:
        assert await q1.ok(m)
    assert await q2.ok(b)
    assert [m.payload for m in await q1.pop_many(10, timeout=1)] == [3, 4]
    assert await q1.sizes() == Sizes(0, 0, 0, 0)
    assert await q1.next_mature_t() is None


async def test_idempotent_push(connect: Connect) -> None:
    q = await (await connect(dedup_window=60)).queue("q1")
    assert await q.push(1, id="order-17") == "order-17"
    assert await q.push(2, id="order-17") == "order-17"
    assert await q.size() == 1
    message = await q.pop(timeout=1)
    assert message is not None and message.payload == 1
    await q.push(3, id="order-17")  # still within the window after it was consumed
    assert await q.size() == 0


async def test_cancelled_pop_put_back_keeps_its_turn(connect: Connect) -> None:
    q = await (await connect()).queue("q1")
    store = q._store
    await q.push_many(["a", "b", "c"])
    fetched = await store.get(2)
    assert [s.payload for s in fetched.messages] == [b'J"a"', b'J"b"']
    entries = [
        Entry(s.id, s.payload, s.headers, tries=s.tries, mature=s.mature) for s in fetched.messages
    ]
    assert await store.insert(entries) == [True, True]
    assert [m.payload for m in await q.pop_many(3, timeout=1)] == ["a", "b", "c"]


async def test_reservations_given_back_together_keep_their_turn(connect: Connect) -> None:
    """A close gives back what it holds in one rollback, in the order reserved; each went to
    the consuming end in turn, so the later came out first (1, 0, 2, 3)."""
    first = await connect()
    q = await first.queue("q1")
    await q.push_many([0, 1, 2, 3])
    held = await q.reserve_many(2, timeout=5)
    assert [m.payload for m in held] == [0, 1]
    await first.close()  # gives back both, unseen, costing no try
    again = await (await connect()).queue("q1")
    got = await again.reserve_many(4, timeout=5)
    assert [m.payload for m in got] == [0, 1, 2, 3]
    assert [m.tries for m in got] == [0, 0, 0, 0]


async def test_deadletter_moves_to_another_queue(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    factory = await connect(deadletter={"max_ko": 1, "queue": "dlq"})
    q = await factory.queue("q1")
    mid = await q.push({"p": 1}, headers={"k": "v"})
    m = await q.reserve(timeout=1)
    assert m is not None and await q.ko(m) == KoResult.ROLLED_BACK
    m = await q.reserve(timeout=1)
    assert m is not None and m.tries == 1
    assert await q.ko(m) == KoResult.DEADLETTERED
    assert await q.sizes() == Sizes(0, 0, 0, 0)
    assert await redis.lrange(key(prefix, "q1", "failed"), 0, -1) == [mid.encode()]
    assert await redis.get(key(prefix, "q1", "failed-count")) == b"1"
    dead = await (await factory.queue("dlq")).pop(timeout=1)
    assert dead is not None and dead.id == mid and dead.payload == {"p": 1} and dead.tries == 0
    assert dead.headers["k"] == "v"
    assert dead.headers["x-dl-from-queue"] == "q1"
    assert dead.headers["x-dl-tries"] == 2
    assert isinstance(dead.headers["x-dl-t"], str)


async def test_close_unregisters_a_consumer_that_holds_nothing(
    connect: Connect, redis: aioredis.Redis, prefix: str
) -> None:
    factory = await connect()
    q = await factory.queue("q1")
    await q.push(1)
    m = await q.reserve(timeout=1)
    assert m is not None and await q.ok(m)
    consumer = q._store.consumer  # type: ignore[attr-defined]
    assert await redis.exists(key(prefix, "q1", "heartbeat", consumer))
    await factory.close()
    assert not await redis.exists(key(prefix, "q1", "heartbeat", consumer))
    assert not await redis.sismember(key(prefix, "q1", "consumers"), consumer)


# -- consumers in other processes -----------------------------------------------------------

_HOLDER = """
import asyncio, sys
import aio_keuss

async def main() -> None:
    factory = await aio_keuss.connect(
        "redis-reliable", url=sys.argv[1], prefix=sys.argv[2], heartbeat_ttl=float(sys.argv[4]),
        signal="local", stats="memory",
    )
    queue = await factory.queue("q1")
    messages = await queue.reserve_many(int(sys.argv[3]), timeout=5)
    print(" ".join(m.id for m in messages), flush=True)
    await asyncio.sleep(3600)  # holds them until killed

asyncio.run(main())
"""

_RECOVERER = """
import asyncio, sys
from aio_keuss.redis.reliable import RedisReliableBackend
from aio_keuss.options import QueueOptions

async def main() -> None:
    backend = RedisReliableBackend(
        {"url": sys.argv[1], "prefix": sys.argv[2], "heartbeat_ttl": 1.0}
    )
    await backend.open()
    store = await backend.store("q1", QueueOptions())
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    moved = 0
    for _ in range(30):
        moved += await store.recover()
    print(moved, flush=True)
    await store.close()
    await backend.close()

asyncio.run(main())
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


async def _spawn(script: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        *args,
        env=_env(),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def _holder_killed(tmp_path: Path, prefix: str, n: int) -> list[str]:
    """A consumer process reserves ``n`` messages and dies holding them (SIGKILL)."""
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    child = await _spawn(script, REDIS_URL, prefix, str(n), str(TTL))
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 20)
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()
    ids = line.decode().split()
    assert len(ids) == n
    return ids


async def test_killed_consumer_message_is_delivered_once_more(
    connect: Connect, tmp_path: Path
) -> None:
    q = await (await connect()).queue("q1")
    mid = await q.push({"job": 1})
    assert await _holder_killed(tmp_path, q._store._backend.prefix, 1) == [mid]  # type: ignore[attr-defined]
    assert await q.resv_size() == 1  # still held by the dead consumer

    other = await (await connect()).queue("q1")
    # Both wait; the first to get the message oks it at once and waits again while the
    # other's wait runs on: that one was not waited for to its end first (6 s, most of the
    # test's time), and both still wait at least 2.5 s after the ok, as before.
    waits = {
        asyncio.ensure_future(q.reserve(timeout=6)): q,
        asyncio.ensure_future(other.reserve(timeout=6)): other,
    }
    first, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    winner = next((t for t in first if t.result() is not None), None)
    assert winner is not None, "not delivered again within 6 s"
    got = winner.result()
    assert got is not None and got.id == mid and got.tries == 1
    assert await waits[winner].ok(got)
    # and never again
    again = await asyncio.gather(
        waits[winner].reserve(timeout=2.5), *(t for t in waits if t is not winner)
    )
    assert again == [None, None]
    assert await q.sizes() == Sizes(0, 0, 0, 0)


async def test_two_processes_recovering_at_once_do_not_duplicate(
    connect: Connect, tmp_path: Path, redis: aioredis.Redis, prefix: str
) -> None:
    q = await (await connect()).queue("q1")
    n = 300
    pushed = await q.push_many(list(range(n)))
    held = await _holder_killed(tmp_path, prefix, n)
    assert sorted(held) == sorted(pushed)
    await asyncio.sleep(TTL + 0.3)  # its heartbeat is gone

    script = tmp_path / "recoverer.py"
    script.write_text(_RECOVERER)
    children = [await _spawn(script, REDIS_URL, prefix) for _ in range(2)]
    for child in children:
        assert child.stdout is not None
        assert (await asyncio.wait_for(child.stdout.readline(), 20)).strip() == b"ready"
    for child in children:
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        await child.stdin.drain()
    moved = []
    for child in children:
        out, _ = await asyncio.wait_for(child.communicate(), 30)
        moved.append(int(out.split()[-1]))
    assert sum(moved) == n, moved

    assert await redis.scard(key(prefix, "q1", "consumers")) == 0
    messages = await q.pop_many(n + 10, timeout=1)
    assert sorted(m.id for m in messages) == sorted(pushed)
    assert {m.tries for m in messages} == {1}
    assert [m.payload for m in messages] == list(range(n))  # oldest first, as before
    assert await q.size() == 0


async def test_on_redis_cluster_deadletter_crosses_slots() -> None:
    """On a cluster the deadletter queue lives in another slot: the three-step move."""
    import redis_cluster

    reason = redis_cluster.start_redis_cluster()
    if reason:
        pytest.skip(reason)
    options = {"url": redis_cluster.CLUSTER_URL, "cluster": True, "prefix": f"akt-rr-{new_token()}"}
    try:
        async with aio_keuss.connect(
            "redis-reliable",
            heartbeat_ttl=TTL,
            deadletter={"max_ko": 0, "queue": "dlq"},
            **options,
        ) as factory:
            q = await factory.queue("q1")
            mid = await q.push({"a": 1}, headers={"k": "v"})
            await q.push(2)
            m = await q.reserve(timeout=1)
            assert m is not None and await q.ko(m) == KoResult.DEADLETTERED
            dead = await (await factory.queue("dlq")).pop(timeout=1)
            assert dead is not None and dead.id == mid and dead.tries == 0
            assert dead.headers["x-dl-tries"] == 1 and dead.headers["k"] == "v"
            m = await q.reserve(timeout=1)
            assert m is not None and await q.ok(m)
            assert await q.sizes() == Sizes(0, 0, 0, 0)
    finally:
        await redis_cluster._drop_redis_cluster_prefix(options)


async def test_on_redis_cluster_a_message_deadlettered_round_and_round_keeps_its_headers() -> None:
    """The cluster deadletter (the copy into the deadletter queue's own slot) appended the
    x-dl-* headers to the stored ones: a message deadlettered again and again (the
    deadletter queue's consumers fail it back to the work queue) carried one more set per
    round, the stored text growing though it decoded right. They are merged, each key once,
    as the one-slot script does."""
    import redis_cluster

    reason = redis_cluster.start_redis_cluster()
    if reason:
        pytest.skip(reason)
    options = {"url": redis_cluster.CLUSTER_URL, "cluster": True, "prefix": f"akt-rr-{new_token()}"}
    try:
        async with (
            aio_keuss.connect(
                "redis-reliable",
                heartbeat_ttl=TTL,
                deadletter={"max_ko": 0, "queue": "dlq"},
                **options,
            ) as work,
            aio_keuss.connect(
                "redis-reliable",
                heartbeat_ttl=TTL,
                deadletter={"max_ko": 0, "queue": "q1"},
                **options,
            ) as back,
        ):
            here, there = await work.queue("q1"), await back.queue("dlq")
            await here.push({"a": 1}, headers={"k": "v"})
            for turn in range(50):
                m = await here.reserve(timeout=1)
                assert m is not None and await here.ko(m) == KoResult.DEADLETTERED, turn
                here, there = there, here
            (stored,) = (await here._store.get(1)).messages  # read raw: the encoded headers
            assert stored.headers.count(b'"x-dl-tries"') == 1, stored.headers
            headers = decode_headers(stored.headers)
            assert list(headers) == ["k", "x-dl-from-queue", "x-dl-t", "x-dl-tries"]
            assert [headers["k"], headers["x-dl-from-queue"], headers["x-dl-tries"]] == [
                "v",
                "dlq",
                1,
            ]
    finally:
        await redis_cluster._drop_redis_cluster_prefix(options)


@pytest.mark.parametrize("second", ["ko", "ok"])
async def test_on_redis_cluster_a_racing_ok_or_ko_of_a_message_being_deadlettered(
    second: str,
) -> None:
    """The three-step deadletter kept the message in the holder's processing list as it
    was, so a second ko of the same reservation racing the first deadlettered it again (two
    copies) and a racing ok acknowledged it beside its copy. The first step now sets it
    aside: whichever lands first decides, and the message ends in one place."""
    import redis_cluster

    reason = redis_cluster.start_redis_cluster()
    if reason:
        pytest.skip(reason)
    options = {"url": redis_cluster.CLUSTER_URL, "cluster": True, "prefix": f"akt-rr-{new_token()}"}
    try:
        async with aio_keuss.connect(
            "redis-reliable",
            heartbeat_ttl=TTL,
            deadletter={"max_ko": 0, "queue": "dlq"},
            **options,
        ) as factory:
            q = await factory.queue("q1")
            dlq = await factory.queue("dlq")
            await q.push({"a": 1})
            m = await q.reserve(timeout=1)
            assert m is not None
            outcomes = await asyncio.gather(q.ko(m), q.ko(m) if second == "ko" else q.ok(m))
            copies = await dlq.pop_many(10, timeout=0.5)
            if second == "ko":
                assert outcomes.count(KoResult.DEADLETTERED) == 1, outcomes
                assert len(copies) == 1, outcomes
            else:  # whichever landed first
                assert len(copies) + (outcomes[1] is True) == 1, outcomes
                assert (outcomes[0] is KoResult.DEADLETTERED) == (len(copies) == 1), outcomes
            assert all(c.headers["x-dl-tries"] == 1 for c in copies)
            assert await q.sizes() == Sizes(0, 0, 0, 0)
    finally:
        await redis_cluster._drop_redis_cluster_prefix(options)


async def test_a_reservation_no_caller_of_a_live_consumer_holds_comes_back(
    connect: Connect,
) -> None:
    """A reserve whose reply was lost (the server moved the id, the caller got a connection
    error) and an ok that failed left the message in this live consumer's processing list,
    where recovery (of dead consumers only) never looked: reserved for as long as the
    process lived. Now its own recovery gives such ids back, with one more try."""
    q = await (await connect()).queue("orphans")
    store = q._store  # type: ignore[attr-defined]
    await q.push_many(["lost reply", "failed ok"])
    # the reserve script runs, its reply never reaches a caller
    await store._reserve(store._base, 1, store.consumer, store._ttl_ms)
    held = await q.reserve(timeout=5)
    assert held is not None and held.payload == "failed ok"
    lost = aio_keuss.KeussConnectionError("connection to Redis lost")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store, "_commit", _failing(lost))
        patch.setattr(q, "_one_commit", None)  # the ok through the store's commit, failing
        with pytest.raises(aio_keuss.KeussConnectionError):
            await q.ok(held)
    back: list[aio_keuss.Message] = []
    while len(back) < 2:  # two recovery passes, heartbeat_ttl / 2 apart
        got = await q.reserve(timeout=30)
        assert got is not None, "a reservation nobody holds stayed reserved"
        back.append(got)
    assert sorted((m.payload, m.tries) for m in back) == [("failed ok", 1), ("lost reply", 1)]
    assert await q.ok_many(back) == [True, True]
    assert await q.total_size() == 0


def _failing(error: Exception) -> Callable[..., Awaitable[Any]]:
    async def fail(*args: Any) -> Any:
        raise error

    return fail


@pytest.mark.parametrize("stale", ["ok", "ko", "ok_many", "move"])
async def test_a_stale_ack_leaves_the_current_holders_reservation_alone(
    connect: Connect, stale: str
) -> None:
    """A stale holder's ok / ko (refused: the message was reserved again since, with more
    tries) took the id out of what this consumer's callers hold, so its own recovery gave
    the message back to pending while the current holder still held it: delivered to a
    second consumer at once, and the current holder's ok then refused."""
    q = await (await connect()).queue("stale-ack")
    store = q._store  # type: ignore[attr-defined]
    await q.push("x")
    first = await q.reserve(timeout=1)
    assert first is not None and await q.ko(first) == KoResult.ROLLED_BACK
    current = await q.reserve(timeout=1)
    assert current is not None and current.id == first.id and current.tries == 1
    if stale == "ok":
        assert not await q.ok(first)
    elif stale == "ko":
        assert await q.ko(first) == KoResult.MISSING
    elif stale == "ok_many":
        assert await q.ok_many([first]) == [False]
    else:
        assert await q.move(first, "stale-ack-elsewhere") is None
    for _ in range(2):  # an id counts once seen unheld in two passes in a row
        await store.recover()
    assert await q.reserve(timeout=0) is None, "a held message was handed out again"
    assert await q.ok(current)
    assert await q.total_size() == 0


def _drop_held(q: aio_keuss.Queue) -> tuple[asyncio.Event, asyncio.Event]:
    """A cluster deadletter of ``q``'s store held between its steps: the first event is
    set once the copy is in the deadletter queue, and the drop here waits for the second."""
    store: Any = q._store
    copied, go_on = asyncio.Event(), asyncio.Event()
    drop = store._scripts.drop_deadlettered

    async def held_drop(*args: Any, **kwargs: Any) -> Any:
        copied.set()
        await go_on.wait()
        return await drop(*args, **kwargs)

    store._scripts.drop_deadlettered = held_drop
    return copied, go_on


async def test_a_cluster_deadletter_a_close_gives_up_on_still_ends_in_one_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a Redis Cluster without hash_tag a deadletter is done in steps: set aside in the
    consumer's processing list, a copy in the deadletter queue, then a drop here. A close
    past its grace gave up the ko's round trips and closed the store between the copy and
    the drop: the message was in the deadletter queue and held here still, to be recovered
    and delivered again. The close now lets it end."""
    import aio_keuss.queue

    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.0)  # gives up at once
    options = {**_redis_cluster(new_token()), "stats": "memory", "signal": "local"}
    try:
        factory, q, message = await a_poison_reserved("redis-reliable", **options)
        copied, store_closing = _drop_held(q)
        await ko_through_a_cut_close(factory, q, message, copied, store_closing)
        assert await sizes_after("redis-reliable", **options) == (0, 1)
    finally:
        await _drop_redis_cluster_prefix(options)


async def test_own_recovery_leaves_a_message_reserved_again_between_its_passes(
    connect: Connect,
) -> None:
    """An id counts as held by no caller once two passes of the consumer's own recovery saw
    it so. Both passes may see a reservation whose reply is on its way to its caller (on a
    pooled redis-py connection the reply of a reserve run before the look may be read after
    it): the first pass saw one, its caller got it, ko-ed it, and reserved it again, the
    reply of that on its way as the second pass looked. The second pass took it for the
    same unheld id and gave it back to pending while its caller held it: handed out twice
    at once, and the holder's ok refused."""
    q = await (await connect(heartbeat_ttl=60.0)).queue("recycled")  # passes run by hand
    store = q._store  # type: ignore[attr-defined]
    reserve = store._reserve
    ran, reply = asyncio.Event(), asyncio.Event()

    async def reply_held_back(*args: Any) -> Any:
        flat = await reserve(*args)  # the script ran: the id is in the processing list
        ran.set()
        await reply.wait()
        return flat

    async def reserve_while_recovery_looks() -> aio_keuss.Message:
        ran.clear()
        reply.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(store, "_reserve", reply_held_back)
            patch.setattr(q, "_one_reserve", None)  # the reserve through the store's reserve
            taking = asyncio.create_task(q.reserve(timeout=1))
            await ran.wait()
            await store.recover()  # a pass of its own recovery, before the reply is read
            reply.set()
            message = await taking
        assert message is not None
        return message

    await q.push("x")
    first = await reserve_while_recovery_looks()
    assert await q.ko(first) == KoResult.ROLLED_BACK
    current = await reserve_while_recovery_looks()
    assert current.id == first.id and current.tries == 1
    assert await q.reserve(timeout=0) is None, "a held message was handed out again"
    assert await q.ok(current)
    assert await q.total_size() == 0


async def test_on_redis_cluster_own_recovery_leaves_a_deadletter_between_its_steps() -> None:
    """On a Redis Cluster without hash_tag a deadletter sets the message aside in the
    consumer's processing list, copies it into the deadletter queue, then drops it here.
    The ko had let go of the id, so a copy slower than two passes of the consumer's own
    recovery (the deadletter queue's node away for a while) had the set-aside message given
    back to pending, out of its reach: the drop found it no longer set aside, and the
    message was in both queues, delivered again though the ko said deadlettered."""
    reason = start_redis_cluster()
    if reason:
        pytest.skip(reason)
    options = {**_redis_cluster(new_token()), "stats": "memory", "signal": "local"}
    try:
        factory, q, message = await a_poison_reserved("redis-reliable", **options)
        store: Any = q._store
        copied, passes_done = _drop_held(q)
        ko = asyncio.ensure_future(q.ko(message))
        await copied.wait()
        for _ in range(2):  # an id counts once seen unheld in two passes in a row
            await store.recover()
        passes_done.set()
        assert await ko == KoResult.DEADLETTERED
        await factory.close()
        assert await sizes_after("redis-reliable", **options) == (0, 1)
    finally:
        await _drop_redis_cluster_prefix(options)


async def test_prefetched_messages_recovered_by_another_consumer_are_not_handled(
    connect: Connect, prefix: str, redis: aioredis.Redis
) -> None:
    """A consumer cut off from Redis for longer than ``heartbeat_ttl`` has its processing
    list recovered by another consumer, which may take those messages at once. What it had
    prefetched must then not be handed to its own handler once it reaches Redis again (as
    it was): each message was handled by both consumers at once (its ok refused, but only
    once the handler had run). Now it gives them back instead, which the holder's tries
    refuse."""
    parts = urlsplit(REDIS_URL)
    proxy = FaultProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    try:
        name = "prefetched-recovered"
        fa = await connect(url=f"redis://127.0.0.1:{proxy.port}/0")
        a = await fa.queue(name)
        b = await (await connect()).queue(name)
        await a.push_many(["first", "second", "third"])
        started, gate = asyncio.Event(), asyncio.Event()
        handled: list[aio_keuss.Message] = []

        async def handler(message: aio_keuss.Message) -> None:
            handled.append(message)
            started.set()
            if len(handled) == 1:
                await gate.wait()

        consumer = a.consume(handler, prefetch=2)
        try:
            await asyncio.wait_for(started.wait(), 10)
            pending = key(prefix, name, "pending")

            async def prefetched() -> bool:  # the other two
                return not await redis.llen(pending)

            await until(prefetched, 10)
            proxy.random(1.0, seed=0, kinds=(BEFORE,))  # A reaches Redis no more
            heartbeat = key(prefix, name, "heartbeat", a._store.consumer)  # type: ignore[attr-defined]

            async def expired() -> bool:
                return not await redis.exists(heartbeat)

            await until(expired, 10)
            taken: list[aio_keuss.Message] = []
            async with asyncio.timeout(30):  # a guard only
                while len(taken) < 3:  # recovered (by B's own task, or here), then B's
                    await b._store.recover()  # type: ignore[attr-defined]
                    taken += await b.reserve_many(3, timeout=0.2)
            held = {m.id for m in taken if m.payload != "first"}
            proxy.calm()
            gate.set()

            async def settled() -> bool:  # what A prefetched is started or given back
                return not consumer._buffer and not consumer.status().in_flight  # type: ignore[attr-defined]

            await until(settled, 10)
            twice = [m.payload for m in handled[1:] if m.id in held]
            assert not twice, f"handled while another consumer holds them: {twice}"
            assert all([await b.ok(m) for m in taken]), "the holder's reservations stand"
        finally:
            gate.set()
            proxy.calm()
            await consumer.stop()
            await fa.close()
    finally:
        proxy.close()


async def test_prefetched_messages_a_lapse_gives_back_go_back_in_one_call(
    connect: Connect, prefix: str
) -> None:
    """Once this consumer's heartbeat may have lapsed (here its event loop was blocked past
    5/6 of ``heartbeat_ttl``), everything it had prefetched is to be given back, all taken
    before then. Each went back in a release of its own, awaited in turn by the one worker
    before it handled anything again: ``prefetch`` round trips. Now in one call."""
    name = "lapse-gives-back-at-once"
    factory = await connect()
    q = await factory.queue(name)
    await q.push_many([f"m{i}" for i in range(21)])
    store: Any = q._store  # type: ignore[attr-defined]
    rollback = store.rollback
    calls: list[int] = []

    async def counted(nacks: Any, *args: Any) -> Any:
        calls.append(len(nacks))
        return await rollback(nacks, *args)

    store.rollback = counted
    handled: list[str] = []

    async def handler(message: aio_keuss.Message) -> None:
        if not handled:
            time.sleep(TTL)  # noqa: ASYNC251 (the event loop blocked: no heartbeat refresh)
        handled.append(message.payload)

    consumer = q.consume(handler, prefetch=20)
    try:

        async def all_handled() -> bool:
            return len(set(handled)) == 21

        await until(all_handled, 30)
    finally:
        await consumer.stop()
    assert calls, "what was prefetched before the lapse was given back"
    assert len(calls) == 1, f"one release for all, not {len(calls)}: {calls}"
