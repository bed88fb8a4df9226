"""Conformance: batches gathered for up to ``max_wait`` (IgnisMQ's maxBatchSize /
maxWaitTime): ``pop_many`` / ``reserve_many`` and ``consume(batch=N)``.

Every backend runs it, skipping what it does not claim. Waits are generous functional bounds
(a batch that never fills ends when its ``max_wait`` passes), never performance assertions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from conftest import Connect, needs

import aio_keuss
from aio_keuss import Message

pytestmark = pytest.mark.timeout(90)

LONG = 60.0  # a max_wait that only a full batch ends in a test


Take = Callable[..., Awaitable[list[Message]]]


def _taker(queue: aio_keuss.Queue) -> tuple[str, Take]:
    """reserve_many where the backend reserves, else pop_many."""
    if queue.capabilities.reserve:
        return "reserve", queue.reserve_many
    return "pop", queue.pop_many


async def _until_taken(queue: aio_keuss.Queue) -> None:
    """Until nothing is ready: what was pushed is in a gathering batch."""
    for _ in range(3000):
        if await queue.size() == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the messages were never taken")


async def test_a_batch_gathers_what_comes_after_its_first_message(
    queue: aio_keuss.Queue,
) -> None:
    _, take = _taker(queue)
    await queue.push({"n": 0})
    gathering = asyncio.ensure_future(take(4, timeout=10, max_wait=LONG))
    await _until_taken(queue)  # the first one is taken: the batch is gathering now
    assert not gathering.done()
    await queue.push_many([{"n": 1}, {"n": 2}, {"n": 3}])
    batch = await asyncio.wait_for(gathering, 30)
    assert sorted(m.payload["n"] for m in batch) == [0, 1, 2, 3]


async def test_a_batch_that_does_not_fill_ends_after_max_wait(queue: aio_keuss.Queue) -> None:
    _, take = _taker(queue)
    await queue.push_many(["a", "b"])
    batch = await take(5, timeout=10, max_wait=0.2)
    assert sorted(m.payload for m in batch) == ["a", "b"]
    assert await take(5, timeout=0.1, max_wait=0.2) == []


async def test_max_wait_time_is_a_queue_option(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("gathered", max_wait_time=LONG)
    assert q.options.max_wait_time == LONG
    _, take = _taker(q)
    await q.push("first")
    gathering = asyncio.ensure_future(take(2, timeout=10))
    await _until_taken(q)
    await q.push("second")
    assert sorted(m.payload for m in await asyncio.wait_for(gathering, 30)) == [
        "first",
        "second",
    ]
    with pytest.raises(aio_keuss.ConfigError):
        await factory.queue("bad", max_wait_time=-1)
    with pytest.raises(aio_keuss.InvalidDelayError):
        await take(2, max_wait=-1)


async def test_a_cancelled_gathering_gives_back_what_it_held(queue: aio_keuss.Queue) -> None:
    kind, take = _taker(queue)
    await queue.push_many(["x", "y"])
    gathering = asyncio.ensure_future(take(5, timeout=10, max_wait=LONG))
    await _until_taken(queue)
    gathering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gathering
    back: list[Message] = []
    for _ in range(200):
        back += await take(5, timeout=0.2)
        if len(back) == 2:
            break
    assert sorted(m.payload for m in back) == ["x", "y"]  # back at once: not after a delay
    if kind == "reserve":
        assert [m.tries for m in back] == [0, 0]  # costing no try


async def test_consume_in_batches_oks_them_all_or_kos_them_all(connect: Connect) -> None:
    factory = await connect(reserve_delay=60)
    needs(factory, "reserve")
    q = await factory.queue("batched", max_wait_time=0.2)
    await q.push_many(list(range(10)))
    sizes: list[int] = []
    seen: list[int] = []
    failed_once = False
    all_done = asyncio.Event()

    async def handle(batch: list[Message]) -> None:
        nonlocal failed_once
        assert isinstance(batch, list) and 1 <= len(batch) <= 4
        if not failed_once:
            failed_once = True
            raise RuntimeError("the whole first batch fails")
        sizes.append(len(batch))
        seen.extend(m.payload for m in batch)
        if len(seen) >= 10:
            all_done.set()

    consumer = q.consume(handle, concurrency=2, batch=4, retry_delay=0.0)
    await asyncio.wait_for(all_done.wait(), 60)
    await consumer.stop()
    assert sorted(seen) == list(range(10))  # the failed batch came back, each message once
    assert consumer.failed >= 1 and consumer.handled == 10
    assert await q.total_size() == 0
    with pytest.raises(aio_keuss.InvalidInputError):
        q.consume(handle, batch=4, prefetch=2)
    with pytest.raises(aio_keuss.InvalidInputError):
        q.consume(handle, batch=-1)


async def test_a_consumed_batch_is_handed_over_before_its_reservations_expire(
    connect: Connect,
) -> None:
    """A batch gathered for longer than ``reserve_delay`` held a message whose reservation
    had expired: another consumer reserved it while the batch still gathered, two holders
    at once. The gathering now ends while the first reservation still runs: the handler
    has the message before anyone else can take it."""
    factory = await connect(reserve_delay=4, poll_interval=0.2)
    needs(factory, "reserve")
    q = await factory.queue("short-held", max_wait_time=LONG)
    if not q.capabilities.reservation_expiry:
        pytest.skip("reservations do not expire one by one here")
    await q.push("only")
    handed: asyncio.Future[list[Message]] = asyncio.get_running_loop().create_future()
    let_go = asyncio.Event()

    async def handle(batch: list[Message]) -> None:
        handed.set_result(batch)
        await let_go.wait()

    consumer = q.consume(handle, batch=5)
    try:
        await _until_taken(q)  # reserved by the consumer's gathering batch
        rival = asyncio.ensure_future(q.reserve(timeout=LONG))
        done, _ = await asyncio.wait({handed, rival}, return_when=asyncio.FIRST_COMPLETED)
        assert handed in done and not rival.done(), "reserved by another while gathering"
        assert [(m.payload, m.tries) for m in handed.result()] == [("only", 0)]
        rival.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rival
    finally:
        let_go.set()
        await consumer.stop()


async def test_consume_batches_pop_without_reserve(connect: Connect) -> None:
    factory = await connect()
    q = await factory.queue("popped")
    if q.capabilities.reserve:
        pytest.skip("covered by the reserve case")
    await q.push_many(list(range(6)))
    seen: list[int] = []
    all_done = asyncio.Event()

    def handle(batch: list[Message]) -> None:
        seen.extend(m.payload for m in batch)
        if len(seen) == 6:
            all_done.set()

    async with q.consume(handle, batch=3):
        await asyncio.wait_for(all_done.wait(), 60)
    assert sorted(seen) == list(range(6))


async def test_push_each_gives_each_message_its_own_options(queue: aio_keuss.Queue) -> None:
    """push_many shares one delay, one set of headers; push_each (BullMQ's addBulk) takes
    each message's own, in one call."""
    caps = queue.capabilities
    ids = [f"own-{i}" for i in range(3)] if caps.idempotent else [None] * 3
    messages = [aio_keuss.NewMessage({"n": i}, headers={"k": str(i)}, id=ids[i]) for i in range(3)]
    if caps.delay:
        messages.append(aio_keuss.NewMessage("later", delay=3600))
    pushed = await queue.push_each(messages)
    assert len(pushed) == len(messages) and len(set(pushed)) == len(messages)
    if caps.idempotent:
        assert pushed[:3] == ids
        assert await queue.push_each([aio_keuss.NewMessage("again", id=ids[0])]) == ids[:1]
    if caps.pop:
        got: list[Message] = []
        while len(got) < 3:  # a sharded queue serves some shards per call
            got += await queue.pop_many(10, timeout=5)
        assert sorted((m.payload["n"], m.headers) for m in got) == [
            (i, {"k": str(i)}) for i in range(3)
        ]
    sizes = await queue.sizes()
    assert sizes.scheduled == (1 if caps.delay else 0)
    assert await queue.push_each([]) == []
