"""The conformance suite: every backend runs it, skipping what it does not claim.

Time bounds here are generous functional limits (did a signal or the mature time, rather
than the poll interval, wake the consumer?), never performance assertions.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from conftest import Connect, needs

import aio_keuss
from aio_keuss import KoResult, Message

pytestmark = pytest.mark.timeout(90)


async def _sizes(q: aio_keuss.Queue) -> tuple[int, int, int, int]:
    s = await q.sizes()
    return s.size, s.total, s.scheduled, s.reserved


async def _drain_all(q: aio_keuss.Queue) -> list[Message]:
    got: list[Message] = []
    while True:
        batch = await q.pop_many(500, timeout=0)
        if not batch:
            return got
        got.extend(batch)


# sizes and order ------------------------------------------------------------------------


async def test_empty_queue_sizes(queue: aio_keuss.Queue) -> None:
    assert await queue.size() == 0
    assert await queue.total_size() == 0
    assert await queue.sched_size() == 0
    assert await queue.resv_size() == 0
    assert await queue.next_mature_t() is None
    assert await queue.pop(timeout=0) is None


async def test_fifo_push_pop(queue: aio_keuss.Queue) -> None:
    for i in range(20):
        await queue.push(i)
    assert await queue.size() == 20
    assert [m.payload for m in await _drain_all(queue)] == list(range(20))
    assert await queue.total_size() == 0


async def test_push_returns_ids_and_pop_many(queue: aio_keuss.Queue) -> None:
    ids = await queue.push_many([{"n": i} for i in range(50)])
    assert len(set(ids)) == 50 and all(isinstance(i, str) for i in ids)
    first = await queue.pop_many(30, timeout=1)
    rest = await queue.pop_many(30, timeout=1)
    assert [m.id for m in first + rest] == ids
    assert await queue.pop_many(5, timeout=0) == []


async def test_delayed_messages_come_out_by_mature_time(queue: aio_keuss.Queue) -> None:
    needs_delay = queue.capabilities.delay
    if not needs_delay:
        pytest.skip("no delay")
    await queue.push("late", delay=0.6)
    await queue.push("soon", delay=0.3)
    await queue.push("now")
    assert await queue.sched_size() == 2
    nmt = await queue.next_mature_t()
    assert nmt is not None and nmt.tzinfo is not None
    assert (await queue.pop(timeout=1)).payload == "now"  # type: ignore[union-attr]
    assert await queue.pop(timeout=0) is None
    start = time.monotonic()
    soon = await queue.pop(timeout=5)
    late = await queue.pop(timeout=5)
    assert soon is not None and soon.payload == "soon"
    assert late is not None and late.payload == "late"
    assert late.mature >= soon.mature
    assert time.monotonic() - start >= 0.2


@pytest.mark.parametrize("op", ["pop", "reserve"])
async def test_timeout_returns_none_on_time(queue: aio_keuss.Queue, op: str) -> None:
    if op == "reserve" and not queue.capabilities.reserve:
        pytest.skip("no reserve")
    start = time.monotonic()
    assert await getattr(queue, op)(timeout=0.3) is None
    elapsed = time.monotonic() - start
    assert 0.25 <= elapsed < 15.0  # on time; the upper bound only catches a hang


@pytest.mark.parametrize("op", ["pop", "reserve", "pop_many", "reserve_many"])
async def test_cancelling_a_waiting_consumer_loses_nothing(queue: aio_keuss.Queue, op: str) -> None:
    if "reserve" in op and not queue.capabilities.reserve:
        pytest.skip("no reserve")
    args: tuple[Any, ...] = (10,) if op.endswith("many") else ()
    waiters = [asyncio.create_task(getattr(queue, op)(*args, timeout=10)) for _ in range(5)]
    await asyncio.sleep(0.05)
    await queue.push("precious")
    # cancel at once: the store may already have handed the message to a waiter
    for task in waiters:
        task.cancel()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    delivered = [r for r in results if not isinstance(r, BaseException) and r]
    if delivered:  # a waiter finished before the cancel reached it
        return
    message = await queue.pop(timeout=5)
    assert message is not None and message.payload == "precious"


@pytest.mark.parametrize("op", ["pop", "reserve"])
async def test_consumers_share_the_queue_and_the_loop(queue: aio_keuss.Queue, op: str) -> None:
    """Calls answered from memory still let other tasks run: three consumers each get a
    fair share, and a task beside them is not starved."""
    if op == "reserve" and not queue.capabilities.reserve:
        pytest.skip("no reserve")
    total = 600
    await queue.push_many(list(range(total)))
    ticks = ticks_while_flowing = 0
    taken = [0, 0, 0]

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def consume(me: int) -> None:
        nonlocal ticks_while_flowing
        while (message := await getattr(queue, op)(timeout=1)) is not None:
            if op == "reserve":
                assert await queue.ok(message)
            taken[me] += 1
            if sum(taken) == total:
                ticks_while_flowing = ticks

    beside = asyncio.create_task(ticker())
    await asyncio.gather(*(consume(i) for i in range(3)))
    beside.cancel()
    assert sum(taken) == total
    assert min(taken) >= total // 10, taken
    assert ticks_while_flowing >= total // 10


async def test_cancel_storm_during_traffic_loses_nothing(queue: aio_keuss.Queue) -> None:
    """Consumers cancelled at random points while messages flow: every message is
    either received by someone or still in the queue."""
    total = 300
    received: list[Any] = []

    async def consumer() -> None:
        while True:
            message = await queue.pop(timeout=5)
            if message is None:
                return
            received.append(message.payload)

    await queue.push_many(list(range(total)))
    tasks = [asyncio.create_task(consumer()) for _ in range(8)]
    for _ in range(20):
        await asyncio.sleep(0.002)
        victim = tasks.pop(0)
        victim.cancel()
        tasks.append(asyncio.create_task(consumer()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.1)  # put-backs of cancelled batches are written in the background
    left = [m.payload for m in await _drain_all(queue)]
    assert sorted(received + left) == list(range(total))


# reserve / ok / ko ----------------------------------------------------------------------


async def test_reserve_then_ok(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    mid = await queue.push({"job": 1}, headers={"k": "v"})
    message = await queue.reserve(timeout=1)
    assert message is not None
    assert (message.id, message.payload, message.headers, message.tries) == (
        mid,
        {"job": 1},
        {"k": "v"},
        0,
    )
    assert await queue.resv_size() == 1 or not queue.capabilities.reservation_expiry
    assert await queue.size() == 0
    assert await queue.ok(message) is True
    assert await queue.ok(message) is False
    assert await queue.total_size() == 0


async def test_reserve_then_ko_counts_tries_and_honours_delay(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    await queue.push("x")
    first = await queue.reserve(timeout=1)
    assert first is not None and first.tries == 0
    if queue.capabilities.delay:
        assert await queue.ko(first, delay=0.4) == KoResult.ROLLED_BACK
        assert await queue.reserve(timeout=0.1) is None
        assert await queue.sched_size() == 1
        start = time.monotonic()
        second = await queue.reserve(timeout=5)
        assert time.monotonic() - start >= 0.2
    else:
        assert await queue.ko(first) == KoResult.ROLLED_BACK
        second = await queue.reserve(timeout=5)
    assert second is not None and second.id == first.id and second.tries == 1
    assert await queue.ko(second)
    third = await queue.reserve(timeout=5)
    assert third is not None and third.tries == 2
    assert await queue.ok(third)


async def test_ok_ko_of_unknown_id_is_false(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    assert await queue.ok("no-such-id") is False
    assert await queue.ko("no-such-id") == KoResult.MISSING
    assert not await queue.ko("no-such-id")


async def test_ok_of_a_popped_message_is_false(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    await queue.push(1)
    message = await queue.pop(timeout=1)
    assert message is not None
    assert await queue.ok(message) is False


async def test_ok_by_id_string(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    mid = await queue.push(1)
    assert await queue.reserve(timeout=1) is not None
    assert await queue.ok(mid) is True


async def test_expired_reservation_is_redelivered(connect: Connect) -> None:
    factory = await connect(reserve_delay=0.3, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry")
    q = await factory.queue("q1")
    await q.push("again")
    first = await q.reserve(timeout=1)
    assert first is not None and first.tries == 0
    assert await q.reserve(timeout=0.05) is None
    second = await q.reserve(timeout=5)
    assert second is not None and second.id == first.id and second.tries == 1
    # the first holder's reservation is stale now: its ok must not delete the message
    assert await q.ok(first) is False
    assert await q.ok(second) is True
    assert await q.total_size() == 0


async def test_sizes_stay_coherent(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    delay = queue.capabilities.delay

    async def check(size: int, scheduled: int, reserved: int) -> None:
        s = await queue.sizes()
        assert (s.size, s.scheduled, s.reserved) == (size, scheduled, reserved)
        assert s.total == s.size + s.scheduled + s.reserved

    await queue.push_many(["a", "b", "c"])
    if delay:
        await queue.push("d", delay=30)
    sched = 1 if delay else 0
    await check(3, sched, 0)
    a = await queue.reserve(timeout=1)
    assert a is not None
    await check(2, sched, 1)
    if delay:  # ko'd with a delay: scheduled again
        await queue.ko(a, delay=30)
        await check(2, sched + 1, 0)
    else:
        await queue.ko(a)
        await check(3, 0, 0)
    b = await queue.reserve(timeout=1)
    assert b is not None
    await check(1 if delay else 2, sched + (1 if delay else 0), 1)
    assert await queue.ok(b)
    await check(1 if delay else 2, sched + (1 if delay else 0), 0)


async def test_reserve_many_and_ok_many(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    await queue.push_many(list(range(100)))
    got = await queue.reserve_many(60, timeout=1)
    got += await queue.reserve_many(60, timeout=1)
    assert sorted(m.payload for m in got) == list(range(100))
    results = await asyncio.gather(*(queue.ok(m) for m in got))
    assert all(results)
    assert await queue.total_size() == 0


# remove ---------------------------------------------------------------------------------


async def test_remove(queue: aio_keuss.Queue) -> None:
    needs(queue, "remove", "reserve")
    assert await queue.remove("unknown") is False
    plain = await queue.push("plain")
    assert await queue.remove(plain) is True
    assert await queue.remove(plain) is False
    held = await queue.push("held")
    message = await queue.reserve(timeout=1)
    assert message is not None and message.id == held
    assert await queue.remove(held) is False
    assert await queue.ko(message)
    assert await queue.remove(held) is True
    assert await queue.remove(held) is False
    assert await queue.total_size() == 0


async def test_remove_takes_only_the_message_named(queue: aio_keuss.Queue) -> None:
    needs(queue, "remove")
    first = await queue.push("first")
    second = await queue.push("second")
    third = await queue.push("third")
    assert await queue.remove(second) is True
    await queue.drain()  # bucket stores: serve what is held in memory, write the rest
    left = await queue.pop_many(10, timeout=1)
    assert [(m.id, m.payload) for m in left] == [(first, "first"), (third, "third")]


# payloads -------------------------------------------------------------------------------

PAYLOADS: list[Any] = [
    {"a": 1, "nested": {"l": [1, 2.5, "x", None, True]}},
    [1, "two", 3.0, False, None, {"k": []}],
    "a string with ünïcödé and \x00 nul",
    "",
    42,
    -(2**62),
    3.141592653589793,
    1e-300,
    True,
    False,
    None,
    b"\x00\xffbinary\x80",
    b"",
]


@pytest.mark.parametrize("with_headers", [False, True], ids=["plain", "headers"])
async def test_payload_round_trip(queue: aio_keuss.Queue, with_headers: bool) -> None:
    headers = {"s": "v", "i": 7, "f": 1.5, "b": True} if with_headers else None
    for payload in PAYLOADS:
        await queue.push(payload, headers=headers)
    got = await _drain_all(queue)
    assert len(got) == len(PAYLOADS)
    for message, payload in zip(got, PAYLOADS, strict=True):
        assert message.payload == payload
        assert type(message.payload) is type(payload)
        assert message.headers == (headers or {})
        assert isinstance(message.mature, datetime) and message.mature.tzinfo is not None


# deadletter -----------------------------------------------------------------------------


async def test_deadletter_after_max_ko(connect: Connect) -> None:
    factory = await connect(deadletter={"max_ko": 2}, poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("work")
    dl = await factory.queue("__deadletter__")
    mid = await q.push({"poison": True}, headers={"origin": "test"})
    results = []
    for expected_tries in range(3):
        message = await q.reserve(timeout=5)
        assert message is not None and message.tries == expected_tries
        results.append(await q.ko(message))
    assert results == [KoResult.ROLLED_BACK, KoResult.ROLLED_BACK, KoResult.DEADLETTERED]
    assert await q.total_size() == 0
    dead = await dl.pop(timeout=5)
    assert dead is not None
    assert dead.payload == {"poison": True}
    assert dead.headers["origin"] == "test"
    assert dead.headers["x-dl-from-queue"] == "work"
    assert dead.headers["x-dl-tries"] == 3
    dl_time = datetime.fromisoformat(str(dead.headers["x-dl-t"]))
    assert abs((datetime.now(UTC) - dl_time).total_seconds()) < 60
    assert dead.tries == 0
    assert dead.id == mid or isinstance(dead.id, str)
    stats = await q.stats()
    assert stats["deadletter"] == 1 and stats["rollback"] == 2


async def test_no_deadletter_without_max_ko(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    await queue.push("keeps coming back")
    for expected in range(6):
        message = await queue.reserve(timeout=5)
        assert message is not None and message.tries == expected
        assert await queue.ko(message) == KoResult.ROLLED_BACK
    assert await queue.total_size() == 1


# pause ----------------------------------------------------------------------------------


async def test_pause_with_waiting_consumers(queue: aio_keuss.Queue) -> None:
    waiting = asyncio.create_task(queue.pop(timeout=10))
    await asyncio.sleep(0.05)
    await queue.pause()
    assert await queue.is_paused()
    await queue.push("held back")
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await queue.resume()
    message = await asyncio.wait_for(waiting, 5)
    assert message is not None and message.payload == "held back"
    assert not await queue.is_paused()


async def test_consumers_arriving_while_paused_and_timeouts(queue: aio_keuss.Queue) -> None:
    await queue.push("x")
    await queue.pause()
    start = time.monotonic()
    assert await queue.pop(timeout=0.3) is None
    assert 0.25 <= time.monotonic() - start < 15.0
    late = asyncio.create_task(queue.pop(timeout=10))
    await asyncio.sleep(0.1)
    assert not late.done()
    await queue.resume()
    message = await asyncio.wait_for(late, 5)
    assert message is not None and message.payload == "x"


async def test_delayed_message_maturing_while_paused(queue: aio_keuss.Queue) -> None:
    if not queue.capabilities.delay:
        pytest.skip("no delay")
    await queue.pause()
    await queue.push("d", delay=0.2)
    waiter = asyncio.create_task(queue.pop(timeout=10))
    await asyncio.sleep(0.5)
    assert not waiter.done()
    await queue.resume()
    message = await asyncio.wait_for(waiter, 5)
    assert message is not None and message.payload == "d"


async def test_pause_is_seen_by_another_factory(connect: Connect, case: Any) -> None:
    if not case.shared:
        pytest.skip("queues are per factory")
    one, two = await connect(poll_interval=30.0), await connect(poll_interval=30.0)
    q1, q2 = await one.queue("shared"), await two.queue("shared")
    waiter = asyncio.create_task(q2.pop(timeout=20))
    await asyncio.sleep(0.1)
    await q1.pause()
    assert await q2.is_paused()
    await q1.push("p")
    await asyncio.sleep(0.3)
    assert not waiter.done()
    await q1.resume()
    message = await asyncio.wait_for(waiter, 5)
    assert message is not None and message.payload == "p"


# wake-ups -------------------------------------------------------------------------------


async def test_push_wakes_a_waiting_consumer_at_once(connect: Connect) -> None:
    factory = await connect(poll_interval=30.0)
    q = await factory.queue("q1")
    waiter = asyncio.create_task(q.pop(timeout=20))
    await asyncio.sleep(0.1)
    start = time.monotonic()
    await q.push("wake")
    message = await asyncio.wait_for(waiter, 25)
    assert message is not None and message.payload == "wake"
    assert time.monotonic() - start < 15.0  # woken, not polled: the poll interval is 30 s


async def test_push_wakes_a_consumer_of_another_factory(connect: Connect, case: Any) -> None:
    if not case.shared:
        pytest.skip("queues are per factory")
    producer, consumer = await connect(poll_interval=30.0), await connect(poll_interval=30.0)
    qp, qc = await producer.queue("shared"), await consumer.queue("shared")
    waiter = asyncio.create_task(qc.pop(timeout=20))
    await asyncio.sleep(0.2)
    start = time.monotonic()
    await qp.push("across")
    message = await asyncio.wait_for(waiter, 25)
    assert message is not None and message.payload == "across"
    assert time.monotonic() - start < 15.0  # woken, not polled: the poll interval is 30 s


async def test_waiting_for_a_delayed_message_wakes_on_time(connect: Connect) -> None:
    factory = await connect(poll_interval=30.0)
    needs(factory, "delay")
    q = await factory.queue("q1")
    await q.push("later", delay=0.5)
    start = time.monotonic()
    message = await q.pop(timeout=20)
    elapsed = time.monotonic() - start
    assert message is not None and message.payload == "later"
    assert 0.3 <= elapsed < 15.0  # the poll interval is 30 s


async def test_burst_within_debounce_wakes_every_consumer(connect: Connect, case: Any) -> None:
    producer = await connect(poll_interval=30.0, signal_debounce=0.2)
    consumer = await connect(poll_interval=30.0) if case.shared else producer
    qp, qc = await producer.queue("burst"), await consumer.queue("burst")
    waiters = [asyncio.create_task(qc.pop(timeout=20)) for _ in range(6)]
    await asyncio.sleep(0.2)
    start = time.monotonic()
    for i in range(6):
        await qp.push(i)
        await asyncio.sleep(0.01)
    got = await asyncio.wait_for(asyncio.gather(*waiters), 25)
    assert sorted(m.payload for m in got if m is not None) == list(range(6))
    assert time.monotonic() - start < 15.0  # the poll interval is 30 s


async def test_many_consumers_get_each_message_exactly_once(queue: aio_keuss.Queue) -> None:
    total = 10_000
    use_reserve = queue.capabilities.reserve
    seen: list[int] = []

    async def consume() -> None:
        while True:
            message = await (queue.reserve(timeout=1) if use_reserve else queue.pop(timeout=1))
            if message is None:
                return
            seen.append(message.payload)
            if use_reserve:
                assert await queue.ok(message)

    consumers = [asyncio.create_task(consume()) for _ in range(16)]
    for start in range(0, total, 1000):
        await queue.push_many(list(range(start, start + 1000)))
    await asyncio.gather(*consumers)
    assert len(seen) == total
    assert sorted(seen) == list(range(total))
    assert await queue.total_size() == 0


# idempotent push ------------------------------------------------------------------------


async def test_idempotent_push(queue: aio_keuss.Queue) -> None:
    if not queue.capabilities.idempotent:
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.push(1, id="order-17")
        assert await queue.total_size() == 0
        return
    assert await queue.push({"v": 1}, id="order-17") == "order-17"
    assert await queue.push({"v": 2}, id="order-17") == "order-17"
    assert await queue.total_size() == 1
    message = await queue.pop(timeout=1)
    assert message is not None and message.id == "order-17" and message.payload == {"v": 1}
    # consumed, but still within the dedup window: no second copy
    await queue.push({"v": 3}, id="order-17")
    assert await queue.total_size() == 0
    ids = await queue.push_many(["a", "b", "a2"], ids=["k1", "k2", "k1"])
    assert ids == ["k1", "k2", "k1"]
    assert await queue.total_size() == 2
    stats = await queue.stats()
    assert stats["put"] == 3


async def test_dedup_window_expires(connect: Connect) -> None:
    factory = await connect(dedup_window=0.3)
    needs(factory, "idempotent")
    q = await factory.queue("q1")
    await q.push(1, id="same")
    assert await q.pop(timeout=1) is not None
    await asyncio.sleep(0.6)
    await q.push(2, id="same")
    message = await q.pop(timeout=1)
    assert message is not None and message.payload == 2


# bad input ------------------------------------------------------------------------------


class _Unserializable:
    pass


BAD_PUSHES: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("object payload", {"payload": _Unserializable()}, aio_keuss.InvalidPayloadError),
    ("set payload", {"payload": {1, 2}}, aio_keuss.InvalidPayloadError),
    ("datetime payload", {"payload": datetime.now(UTC)}, aio_keuss.InvalidPayloadError),
    ("int-keyed dict", {"payload": {1: "a"}}, aio_keuss.InvalidPayloadError),
    ("nested header", {"payload": 1, "headers": {"h": {"x": 1}}}, aio_keuss.InvalidHeadersError),
    ("None header", {"payload": 1, "headers": {"h": None}}, aio_keuss.InvalidHeadersError),
    ("int header key", {"payload": 1, "headers": {1: "x"}}, aio_keuss.InvalidHeadersError),
    ("list headers", {"payload": 1, "headers": ["x"]}, aio_keuss.InvalidHeadersError),
    ("negative delay", {"payload": 1, "delay": -1}, aio_keuss.InvalidDelayError),
    ("NaN delay", {"payload": 1, "delay": math.nan}, aio_keuss.InvalidDelayError),
    ("inf delay", {"payload": 1, "delay": math.inf}, aio_keuss.InvalidDelayError),
    ("str delay", {"payload": 1, "delay": "5"}, aio_keuss.InvalidDelayError),
    ("int id", {"payload": 1, "id": 17}, aio_keuss.InvalidIdError),
    ("empty id", {"payload": 1, "id": ""}, aio_keuss.InvalidIdError),
    ("spaced id", {"payload": 1, "id": "a b"}, aio_keuss.InvalidIdError),
    ("long id", {"payload": 1, "id": "x" * 500}, aio_keuss.InvalidIdError),
]


@pytest.mark.parametrize(
    "kwargs,error", [b[1:] for b in BAD_PUSHES], ids=[b[0] for b in BAD_PUSHES]
)
async def test_bad_push_raises_typed_error_and_writes_nothing(
    queue: aio_keuss.Queue, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    args = dict(kwargs)
    payload = args.pop("payload")
    with pytest.raises(error) as raised:
        await queue.push(payload, **args)
    assert isinstance(raised.value, aio_keuss.KeussError)
    if "id" in args:
        args["ids"] = ["fine-1", args.pop("id"), "fine-3"]
    with pytest.raises(error):
        await queue.push_many(["fine", payload, "fine"], **args)
    assert await queue.total_size() == 0
    assert (await queue.stats())["put"] == 0


async def test_capabilities_missing_raise_before_writing(queue: aio_keuss.Queue) -> None:
    caps = queue.capabilities
    if not caps.delay:
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.push(1, delay=5)
    if not caps.reserve:
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.reserve(timeout=0)
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.ok("some-id")
    if not caps.remove:
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.remove("some-id")
    assert await queue.total_size() == 0


async def test_bad_arguments(factory: aio_keuss.Factory, queue: aio_keuss.Queue) -> None:
    for name in ["", "has space", "a{b}", "x" * 200, 12, ".dot", "slash/y", "$dollar"]:
        with pytest.raises(aio_keuss.InvalidQueueNameError):
            await factory.queue(name)  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.ConfigError):
        await factory.queue("q1", no_such_option=1)
    with pytest.raises(aio_keuss.ConfigError):
        await factory.queue("q2", reserve_delay=-1)
    with pytest.raises(aio_keuss.InvalidDelayError):
        await queue.pop(timeout=-1)
    with pytest.raises(aio_keuss.InvalidInputError):
        await queue.pop_many(0)
    with pytest.raises(aio_keuss.InvalidInputError):
        await queue.push_many("not a list")  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.InvalidInputError):
        await queue.push_many([1, 2], ids=["only-one"])
    if queue.capabilities.reserve:
        for bad in [None, 5, "", "with space"]:
            with pytest.raises(aio_keuss.InvalidIdError):
                await queue.ok(bad)  # type: ignore[arg-type]
            with pytest.raises(aio_keuss.InvalidIdError):
                await queue.ko(bad)  # type: ignore[arg-type]
        with pytest.raises(aio_keuss.InvalidDelayError):
            await queue.ko("some-id", delay=-3)
    assert await queue.total_size() == 0


async def test_unknown_backend_and_options(case: Any) -> None:
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect("no-such-backend")
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect(case.name, no_such_option=True)
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect(case.name, deadletter={"max_ko": -1})
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect(case.name, poll_interval=0)


# stats ----------------------------------------------------------------------------------


async def test_stats_match_operations(queue: aio_keuss.Queue) -> None:
    await queue.push_many(list(range(10)))
    assert len(await queue.pop_many(3, timeout=1)) == 3
    expected = {"put": 10, "get": 3, "reserve": 0, "commit": 0, "rollback": 0, "deadletter": 0}
    if queue.capabilities.reserve:
        reserved = await queue.reserve_many(4, timeout=1)
        assert len(reserved) == 4
        for message in reserved[:3]:
            assert await queue.ok(message)
        assert await queue.ko(reserved[3])
        assert await queue.ok("unknown-id") is False
        expected.update(reserve=4, commit=3, rollback=1)
    assert await queue.stats() == expected


# lifecycle: consume, iterate, drain, close, list ---------------------------------------


async def test_consume_processes_and_retries(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    q = await factory.queue("jobs")
    handled: list[Any] = []
    failures: dict[Any, int] = {}

    async def handler(message: Message) -> None:
        if message.payload == "flaky" and failures.get("flaky", 0) < 2:
            failures["flaky"] = failures.get("flaky", 0) + 1
            raise RuntimeError("try again")
        handled.append(message.payload)

    consumer = q.consume(handler, concurrency=4, retry_delay=0.05)
    await q.push_many(["a", "b", "flaky", "c"])
    for _ in range(200):
        if len(handled) == 4 or (not q.capabilities.reserve and len(handled) == 3):
            break
        await asyncio.sleep(0.05)
    await consumer.stop()
    if q.capabilities.reserve:
        assert sorted(handled) == ["a", "b", "c", "flaky"]
        assert failures["flaky"] == 2
        assert await q.total_size() == 0
    else:  # at-most-once: the failing message is gone
        assert sorted(handled) == ["a", "b", "c"]


async def test_consume_stop_gives_back_in_flight_messages(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("jobs")
    started = asyncio.Event()

    async def slow(message: Message) -> None:
        started.set()
        await asyncio.sleep(30)

    async with q.consume(slow, concurrency=2) as consumer:
        await q.push("long job")
        await asyncio.wait_for(started.wait(), 5)
        await consumer.stop(grace=0.1)
    message = await q.reserve(timeout=5)
    assert message is not None and message.payload == "long job"
    assert message.tries == 0  # going back after a cancel costs no try


async def test_async_for_and_drain(queue: aio_keuss.Queue) -> None:
    await queue.push_many([1, 2, 3])
    seen = []
    async for message in queue.messages(timeout=0.2):
        seen.append(message.payload)
        if queue.capabilities.reserve:
            await queue.ok(message)
    assert seen == [1, 2, 3]

    async def iterate() -> list[Any]:
        return [m.payload async for m in queue]

    task = asyncio.create_task(iterate())
    await asyncio.sleep(0.1)
    await queue.drain()
    assert await asyncio.wait_for(task, 5) == []


async def test_drain_stops_waiters_and_close_refuses(factory: aio_keuss.Factory) -> None:
    q = await factory.queue("q1")
    waiters = [asyncio.create_task(q.pop(timeout=30)) for _ in range(3)]
    await asyncio.sleep(0.05)
    await q.drain()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [None, None, None]
    await q.push("after drain")
    assert (await q.pop(timeout=1)) is not None
    waiter = asyncio.create_task(q.pop(timeout=30))
    await asyncio.sleep(0.05)
    await factory.close()
    assert await asyncio.wait_for(waiter, 5) is None
    with pytest.raises(aio_keuss.ClosedError):
        await q.push(1)
    with pytest.raises(aio_keuss.ClosedError):
        await factory.queue("q1")


async def test_connect_context_manager_and_list(case: Any) -> None:
    from backends import new_token

    options = case.options(new_token())
    try:
        async with aio_keuss.connect(case.name, **options) as factory:
            assert isinstance(factory, aio_keuss.Factory)
            assert factory.backend_name == case.name
            await factory.queue("listed-a", reserve_delay=30)
            await factory.queue("listed-b")
            same = await factory.queue("listed-a")
            assert same is await factory.queue("listed-a")
            with pytest.raises(aio_keuss.ConfigError):
                await factory.queue("listed-a", reserve_delay=31)
            listed = await factory.list()
            assert listed["listed-a"]["reserve_delay"] == 30
            assert "listed-b" in listed
        if case.shared:
            async with aio_keuss.connect(case.name, **options) as again:
                assert {"listed-a", "listed-b"} <= set(await again.list())
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)


def needs_reserve(queue: aio_keuss.Queue) -> None:
    if not queue.capabilities.reserve:
        pytest.skip("no reserve")


async def test_factory_close_stops_consumers_first(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("jobs")
    finished: list[Any] = []
    started = asyncio.Event()

    async def handler(message: Message) -> None:
        started.set()
        await asyncio.sleep(0.2)
        finished.append(message.payload)

    q.consume(handler, concurrency=2)
    await q.push("in flight")
    await asyncio.wait_for(started.wait(), 5)
    await factory.close()  # lets the running handler finish and ok its message
    assert finished == ["in flight"]


async def test_deadletter_twice_with_the_same_id_keeps_both(connect: Connect) -> None:
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "reserve", "idempotent")
    q = await factory.queue("work", dedup_window=0.01)
    dl = await factory.queue("__deadletter__")
    for round_ in range(3):
        await asyncio.sleep(0.05)  # past the dedup window: the same id may come again
        await q.push({"round": round_}, id="same-order")
        message = await q.reserve(timeout=5)
        assert message is not None
        assert await q.ko(message) == KoResult.DEADLETTERED
    dead = await _drain_all(dl)
    assert sorted(m.payload["round"] for m in dead) == [0, 1, 2]
    # the one rename rule of every backend: its own id, then .dl<failed>, then .dl<failed>.N
    names = {m.payload["round"]: m.id for m in dead}
    assert names == {0: "same-order", 1: "same-order.dl1", 2: "same-order.dl1.2"}


# move -----------------------------------------------------------------------------------


async def test_move_takes_a_held_message_to_another_queue(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("step1")
    nxt = await factory.queue("step2")
    mid = await q.push({"n": 1}, headers={"origin": "a", "keep": 1})
    first = await q.reserve(timeout=5)
    assert first is not None and await q.ko(first) == KoResult.ROLLED_BACK  # tries 1 now
    held = await q.reserve(timeout=5)
    assert held is not None and held.tries == 1
    moved = await q.move(held, "step2", payload={"n": 2}, headers={"origin": "b"})
    assert moved == mid
    assert await q.total_size() == 0
    arrived = await nxt.reserve(timeout=5)
    assert arrived is not None
    assert (arrived.id, arrived.payload, arrived.tries) == (mid, {"n": 2}, 0)
    assert arrived.headers == {"origin": "b", "keep": 1}
    assert await nxt.ok(arrived)
    assert (await q.stats())["commit"] == 1 and (await nxt.stats())["put"] == 1


async def test_move_keeps_the_payload_and_honours_the_delay(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    dst = await factory.queue("dst")
    await q.push(None)  # None is a payload: kept, not taken for "no new payload"
    held = await q.reserve(timeout=5)
    assert held is not None
    delay = 30.0 if factory.capabilities.delay else 0.0
    assert await q.move(held, "dst", delay=delay) == held.id
    if delay:
        assert (await dst.sched_size(), await dst.pop(timeout=0)) == (1, None)
        return
    arrived = await dst.pop(timeout=5)
    assert arrived is not None and arrived.payload is None and arrived.headers == {}


async def test_move_of_what_is_no_longer_held_moves_nothing(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    dst = await factory.queue("dst")
    await q.push_many(["rolled back", "done"])
    stale = await q.reserve(timeout=5)
    done = await q.reserve(timeout=5)
    assert stale is not None and done is not None
    assert await q.ko(stale) == KoResult.ROLLED_BACK  # a newer delivery is due: not ours
    assert await q.ok(done)
    assert await q.move(stale, "dst") is None
    assert await q.move(done, "dst") is None
    assert await dst.total_size() == 0 and await q.total_size() == 1


async def test_move_renames_an_id_the_destination_holds(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move", "idempotent")
    dst = await factory.queue("dst")
    await dst.push("already there", id="order-7")
    names = []
    for round_ in range(3):
        q = await factory.queue(f"src{round_}")
        await q.push(round_, id="order-7")
        held = await q.reserve(timeout=5)
        assert held is not None
        names.append(await q.move(held, "dst"))
    assert names == ["order-7.mv", "order-7.mv.2", "order-7.mv.3"]
    assert await dst.total_size() == 4


async def test_move_refuses_bad_input_before_writing(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("src")
    await q.push("x")
    held = await q.reserve(timeout=5)
    assert held is not None
    if not factory.capabilities.move:
        with pytest.raises(aio_keuss.NotSupportedError):
            await q.move(held, "dst")
    else:
        with pytest.raises(aio_keuss.InvalidInputError):
            await q.move(held, "src")  # its own queue: that is a ko
        with pytest.raises(aio_keuss.InvalidQueueNameError):
            await q.move(held, "no spaces")
        with pytest.raises(aio_keuss.InvalidHeadersError):
            await q.move(held, "dst", headers={"k": object()})  # type: ignore[dict-item]
        with pytest.raises(aio_keuss.InvalidPayloadError):
            await q.move(held, "dst", payload=float("nan"))
        with pytest.raises(aio_keuss.InvalidDelayError):
            await q.move(held, "dst", delay=-1)
    assert await q.ok(held)  # still held: nothing moved
