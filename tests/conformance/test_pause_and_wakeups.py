"""Conformance: Pause / resume across processes, and consumers woken by signals.

Every backend runs it, skipping what it does not claim. Time bounds are generous
functional limits, never performance assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from conftest import Connect, drain_all, needs

import aio_keuss

pytestmark = pytest.mark.timeout(90)


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


@pytest.mark.parametrize("push", ["push", "push_many", "push_each"])
async def test_a_push_cancelled_once_stored_still_wakes_a_consumer_of_another_factory(
    connect: Connect, case: Any, push: str
) -> None:
    """A push cancelled while the store's answer was awaited (the message stored, or on the
    bucket backends its bucket being written) raised before the insert signal: a consumer
    of another process, which only the signal can tell, waited for its poll interval (60 s
    here). Where a batch task does the insert (PostgreSQL, MongoDB, Redis Cluster), it
    signalled already; the test pins that too."""
    if not case.shared:
        pytest.skip("queues are per factory")
    producer, consumer = await connect(poll_interval=60.0), await connect(poll_interval=60.0)
    qp, qc = await producer.queue("shared"), await consumer.queue("shared")
    store = qp._store  # type: ignore[attr-defined]
    take = qc.reserve if qc.capabilities.reserve else qc.pop
    waiter = asyncio.create_task(take(timeout=50))
    while not len(qc._wakeups):  # type: ignore[attr-defined]  # it looked, and waits
        assert not waiter.done(), waiter
        await asyncio.sleep(0.01)
    real = store.insert
    pusher: asyncio.Task[Any] | None = None

    async def insert(entries: Any) -> Any:
        assert pusher is not None
        pusher.cancel()  # lands while the store's answer is awaited
        return await real(entries)

    store.insert = insert
    qp._one_insert = None  # type: ignore[attr-defined]  # (that one: test_one_message_calls)
    calls = {
        "push": lambda: qp.push("cancelled"),
        "push_many": lambda: qp.push_many(["cancelled"]),
        "push_each": lambda: qp.push_each([aio_keuss.NewMessage("cancelled")]),
    }
    pusher = asyncio.create_task(calls[push]())
    with contextlib.suppress(asyncio.CancelledError):
        await pusher
    store.insert = real
    message = await asyncio.wait_for(waiter, 20)  # the poll interval is 60 s
    assert message is not None and message.payload == "cancelled"


@pytest.mark.parametrize("step", ["ko", "move"])
async def test_a_ko_or_move_cancelled_once_stored_still_wakes_a_consumer_of_another_factory(
    connect: Connect, case: Any, step: str
) -> None:
    """As a push: a ko (the message back in its queue) or a move (in the other queue)
    cancelled while the store's answer was awaited raised before the queue's signal, so a
    consumer of another process waited for its poll interval (60 s here)."""
    if not case.shared:
        pytest.skip("queues are per factory")
    holder, consumer = await connect(poll_interval=60.0), await connect(poll_interval=60.0)
    needs(holder, "reserve", "move" if step == "move" else "reserve")
    source = await holder.queue("source")
    target = "target" if step == "move" else "source"
    await source.push("it")
    held = await source.reserve(timeout=10)
    assert held is not None
    qc = await consumer.queue(target)
    waiter = asyncio.create_task(qc.reserve(timeout=50))
    while not len(qc._wakeups):  # type: ignore[attr-defined]  # it looked, and waits
        assert not waiter.done(), waiter
        await asyncio.sleep(0.01)
    store = source._store  # type: ignore[attr-defined]
    primitive = "rollback" if step == "ko" else "move"
    real = getattr(store, primitive)
    stepper: asyncio.Task[Any] | None = None

    async def cancelled_meanwhile(*args: Any) -> Any:
        assert stepper is not None
        stepper.cancel()  # lands while the store's answer is awaited
        return await real(*args)

    setattr(store, primitive, cancelled_meanwhile)
    if step == "ko":
        stepper = asyncio.create_task(source.ko(held, 0.0))
    else:
        stepper = asyncio.create_task(source.move(held, target))
    with contextlib.suppress(asyncio.CancelledError):
        await stepper
    setattr(store, primitive, real)
    message = await asyncio.wait_for(waiter, 20)  # the poll interval is 60 s
    assert message is not None and message.payload == "it"


async def test_waiting_for_a_delayed_message_wakes_on_time(connect: Connect) -> None:
    factory = await connect(poll_interval=30.0)
    needs(factory, "delay")
    q = await factory.queue("q1")
    start = time.monotonic()  # before the push: the message cannot mature sooner than 0.5 s on
    await q.push("later", delay=0.5)
    message = await q.pop(timeout=20)
    elapsed = time.monotonic() - start
    assert message is not None and message.payload == "later"
    assert 0.3 <= elapsed < 15.0  # the poll interval is 30 s


async def test_a_client_clock_behind_the_servers_still_wakes_when_a_message_matures(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where mature times are the server's clock (redis-oq, redis-sharded, postgres), the
    wait loop slept toward the server's next mature time on the client's clock: a client 5 s
    behind the server got a message due in 0.3 s after 5.3 s (a poll interval at worst), one
    ahead of it woke early and backed off. The client's clock is set back here; where times
    are the client's own, the whole test runs on that clock and passes alike.

    Set back 10 s, the defect sleeps 10.3 s at least (its sleep only ends on the client's
    clock), within the 20 s asked and the 30 s poll interval; the bound, 9 s, leaves a
    machine busy with other tests 8.7 s beyond the 0.3 s due to answer."""
    factory = await connect(poll_interval=30.0)
    needs(factory, "delay")
    q = await factory.queue("q1")
    take = q.reserve if q.capabilities.reserve else q.pop
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 10.0)
    await q.push("later", delay=0.3)
    start = time.monotonic()
    message = await take(timeout=20)
    elapsed = time.monotonic() - start
    assert message is not None and message.payload == "later"
    assert elapsed < 9.0, elapsed  # due after 0.3 s; the defect took 10.3 s (clock 10 s behind)


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
    total = 4_000
    use_reserve = queue.capabilities.reserve
    seen: list[int] = []

    async def consume() -> None:
        while True:
            message = await (queue.reserve(timeout=1) if use_reserve else queue.pop(timeout=1))
            if message is None:
                return
            if message.payload == "stop":
                assert not use_reserve or await queue.ok(message)
                return
            seen.append(message.payload)
            if use_reserve:
                assert await queue.ok(message)
            if len(seen) == total:
                # One to end each consumer now (an empty queue's timeout took 1 s a test). A
                # message handed out twice is still seen: in hand, it is counted before its
                # consumer asks again; stored again, it is left in the queue (drained below).
                await queue.push_many(["stop"] * len(consumers))

    consumers = [asyncio.create_task(consume()) for _ in range(16)]
    for start in range(0, total, 500):
        await queue.push_many(list(range(start, start + 500)))
    await asyncio.gather(*consumers)
    # the stops of consumers that had left by their timeout already, and nothing else
    assert {m.payload for m in await drain_all(queue)} <= {"stop"}
    assert len(seen) == total
    assert sorted(seen) == list(range(total))
    assert await queue.total_size() == 0


@pytest.mark.parametrize("leave", ["timeout", "cancel"])
async def test_a_delayed_wakeup_outlives_the_consumer_it_woke(
    connect: Connect, case: Any, leave: str
) -> None:
    """The announcement of a delayed message wakes one sleeper, which then sleeps toward the
    mature time; when that consumer leaves first (its timeout ends, it is cancelled), another
    sleeper must still take the message when it matures, not a poll interval later. Both
    ways of leaving end in the same queue-layer code: a cancellation on one backend of each
    kind."""
    if leave == "cancel" and case.id not in ("memory", "redis-oq", "postgres", "mongo", "sqlite"):
        pytest.skip("run on one backend of each kind")
    factory = await connect(poll_interval=30.0)
    needs(factory, "delay")
    q = await factory.queue("q1")
    take = q.reserve if q.capabilities.reserve else q.pop
    first = asyncio.create_task(take(timeout=0.5 if leave == "timeout" else 20))
    await asyncio.sleep(0.2)  # the longest sleeper: the one the push wakes
    second = asyncio.create_task(take(timeout=20))
    await asyncio.sleep(0.2)
    start = time.monotonic()
    await q.push("later", delay=0.7)
    if leave == "cancel":
        await asyncio.sleep(0.3)
        first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    message = await asyncio.wait_for(second, 25)
    elapsed = time.monotonic() - start
    assert message is not None and message.payload == "later"
    assert elapsed < 10.0, elapsed  # due after 0.7 s; the poll interval is 30 s


async def test_a_pause_sent_while_the_listener_was_away_is_seen_once_it_is_back(
    connect: Connect, case: Any
) -> None:
    """A pause announced while another factory's signal listener is away (its connection
    killed, a server restart) was never heard there: once back, the bus only woke its
    queues, which went on delivering from a paused queue for good. The listener being away
    is simulated by a bus that delivers nothing, then what the listener calls once back."""
    if not case.shared:
        pytest.skip("queues are per factory")
    one, two = await connect(poll_interval=1.0), await connect(poll_interval=1.0)
    if not two.signal.remote:
        pytest.skip("no signal transport")
    q1, q2 = await one.queue("shared"), await two.queue("shared")
    two.signal._deliver = lambda signal: None  # type: ignore[method-assign]  # away
    await q1.pause()
    await asyncio.sleep(0.3)
    del two.signal._deliver  # back: the listener listens again ...
    two.signal._ready()  # ... and tells the bus so
    for _ in range(500):  # the flag is read again in the background
        if q2._paused:
            break
        await asyncio.sleep(0.02)
    await q1.push("while paused")
    assert await q2.pop(timeout=1.5) is None  # paused in every process
    await q1.resume()
    message = await q2.pop(timeout=5)
    assert message is not None and message.payload == "while paused"


@pytest.mark.parametrize("last", ["resume", "pause"])
async def test_a_pause_or_resume_heard_out_of_order_ends_in_the_stored_state(
    connect: Connect, last: str
) -> None:
    """Each pause or resume is published on its own, so another process may hear a pause
    and the resume after it in the other order. The queue took the last signal heard as
    the truth: paused after ``pause(); resume()`` until a poll (a consumer waited out its
    whole timeout, seen under load), or consuming a paused queue after ``resume();
    pause()`` until something made it read the flag. It now reads the stored flag after
    each, and ends as stored."""
    from aio_keuss.signal import Signal

    factory = await connect(poll_interval=30.0)
    q = await factory.queue("order")
    await q.push("ready")
    first = "pause" if last == "resume" else "resume"
    await getattr(q, first)()
    await getattr(q, last)()
    q._on_signal(Signal(q.name, first))  # type: ignore[attr-defined]  # heard late
    stored_paused = last == "pause"
    deadline = time.monotonic() + 30
    while q._paused != stored_paused:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"still {'paused' if q._paused else 'resumed'}"
        await asyncio.sleep(0.01)
    got = await q.pop(timeout=0)
    assert (got is None) == stored_paused


async def test_a_pause_gives_back_what_a_consumer_prefetched(queue: aio_keuss.Queue) -> None:
    """Deliveries stop on a pause: a consumer's handlers did not, going on through what it
    had prefetched (up to ``prefetch`` messages more, each a handler started on a paused
    queue). Now the messages prefetched are given back (costing no try) once it is paused,
    and handled after the resume."""
    await queue.push_many(["first", "second", "third", "fourth"])
    started, gate = asyncio.Event(), asyncio.Event()
    handled: list[aio_keuss.Message] = []

    async def handler(message: aio_keuss.Message) -> None:
        handled.append(message)
        started.set()
        if len(handled) == 1:
            await gate.wait()

    consumer = queue.consume(handler, prefetch=3)
    try:
        await asyncio.wait_for(started.wait(), 10)
        async with asyncio.timeout(10):
            while await queue.size():  # noqa: ASYNC110 - the other three are prefetched
                await asyncio.sleep(0.02)
        await queue.pause()
        gate.set()
        async with asyncio.timeout(10):
            while await queue.size() < 3:  # noqa: ASYNC110 - given back
                await asyncio.sleep(0.02)
        assert [m.payload for m in handled] == ["first"]
        await queue.resume()
        async with asyncio.timeout(10):
            while len(handled) < 4:  # noqa: ASYNC110 - taken again
                await asyncio.sleep(0.02)
        assert sorted(m.payload for m in handled[1:]) == ["fourth", "second", "third"]
        if queue.capabilities.reserve:
            assert all(m.tries == 0 for m in handled)
    finally:
        gate.set()
        await consumer.stop()
