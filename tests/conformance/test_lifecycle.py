"""Conformance: Stats, consume, iteration, drain, close and the queue list.

Every backend runs it, skipping what it does not claim. Time bounds are generous
functional limits, never performance assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
from backends import BackendCase
from conftest import Connect, drain_all, needs

import aio_keuss
from aio_keuss import Message, Queue

pytestmark = pytest.mark.timeout(90)

_ONE_OF_EACH_KIND = (
    "memory",
    "redis-oq",
    "redis-reliable",
    "postgres",
    "mongo",
    "bucket-redis",
    "sqlite",
)
"""One backend of each kind of store: tests of the queue layer or the consumer whose
outcome depends only on how a store answers run on these."""


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


async def test_consume_backs_off_between_retries_of_a_failing_message(connect: Connect) -> None:
    """An exception -> ko after retry_delay * 2**tries: on a backend without delays
    (redis-reliable) the worker waits it out itself, holding the message (a poison message
    was handed straight back, with no pause, until deadlettered). Only lower bounds: a slow
    machine lengthens the gaps, never shortens them."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("poison", reserve_delay=30)
    attempts: list[float] = []

    async def handler(message: Message) -> None:
        attempts.append(time.monotonic())
        raise RuntimeError("poison")

    await q.push("poison")
    consumer = q.consume(handler, retry_delay=0.2, max_retry_delay=0.4)
    for _ in range(600):
        if len(attempts) >= 4:
            break
        await asyncio.sleep(0.05)
    await consumer.stop()
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert len(gaps) >= 3 and min(gaps[:3]) >= 0.15, gaps  # 0.2, 0.4, 0.4 s
    assert await q.total_size() == 1  # still there: nothing deadletters it here


async def test_a_failing_message_in_its_backoff_does_not_hold_up_the_others(
    connect: Connect,
) -> None:
    """One worker, a poison message first: while it waits out its backoff (on redis-reliable
    held in the process, elsewhere delayed by the backend), the worker handles the rest."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("mixed", reserve_delay=120)
    seen: list[Any] = []
    done = asyncio.Event()

    async def handler(message: Message) -> None:
        seen.append(message.payload)
        if message.payload == "poison":
            raise RuntimeError("poison")
        if seen.count("poison") and len([p for p in seen if p != "poison"]) == 5:
            done.set()

    await q.push("poison")
    await q.push_many([1, 2, 3, 4, 5])
    consumer = q.consume(handler, concurrency=1, retry_delay=30, max_retry_delay=30)
    await asyncio.wait_for(done.wait(), 20)  # well inside the 30 s the poison waits
    await consumer.stop()
    assert seen.count("poison") == 1 and sorted(p for p in seen if p != "poison") == [1, 2, 3, 4, 5]


async def test_a_stop_ends_a_backoff_held_in_the_process(connect: Connect) -> None:
    """The backoff a worker waits itself (no delays on the backend) does not hold up a stop:
    the message is ko-ed at once and comes back at once."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("poison", reserve_delay=600)
    failed = asyncio.Event()

    async def handler(message: Message) -> None:
        failed.set()
        raise RuntimeError("poison")

    await q.push("poison")
    consumer = q.consume(handler, retry_delay=200, max_retry_delay=200)
    await asyncio.wait_for(failed.wait(), 60)
    await consumer.stop(grace=60)
    if not q.capabilities.delay:  # rolled back without a delay: ready again at once
        again = await q.reserve(timeout=30)
        assert again is not None and again.payload == "poison"


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


async def test_a_queue_opening_as_the_factory_closes_is_closed_with_it(connect: Connect) -> None:
    """``factory.queue()`` still opening when ``factory.close()`` runs: the close waits for
    it and closes it with the others; it was handed out open over the closed backend, never
    closed (a push went to the server on redis-oq, failed with a ConfigError on postgres)."""
    factory = await connect(poll_interval=5.0)
    opening = asyncio.create_task(factory.queue("late"))
    await asyncio.sleep(0)  # it begins opening
    await asyncio.wait_for(factory.close(), 30)
    with pytest.raises(aio_keuss.ClosedError):
        q = await opening  # (opened at once on some backends, before the close began)
        await q.push("after close")


async def test_a_handler_pushing_to_another_queue_finishes_during_the_factory_close(
    connect: Connect, case: Any
) -> None:
    """A handler still running when ``factory.close()`` begins pushes into another queue of
    the factory when it ends: the close lets it finish with every queue open (its consumers
    stop before any queue closes). Closing the queues side by side closed the other queue
    under it at once: its push raised ClosedError, the message it had handled was ko-ed to
    be handled again, and a traceback was logged."""
    if case.id not in _ONE_OF_EACH_KIND:
        pytest.skip("run on one backend of each kind")
    factory = await connect(poll_interval=5.0)
    jobs = await factory.queue("jobs", reserve_delay=600)
    results = await factory.queue("results")
    started, closing_began = asyncio.Event(), asyncio.Event()
    pushed: list[str] = []

    async def handler(message: Message) -> None:
        started.set()
        await closing_began.wait()
        for _ in range(100):  # the other queue closes now if it is going to
            if results._closed:
                break
            await asyncio.sleep(0.02)
        pushed.append(await results.push({"done": message.payload}))

    consumer = jobs.consume(handler)
    await jobs.push("job")
    await asyncio.wait_for(started.wait(), 30)
    closing = asyncio.create_task(factory.close())
    await asyncio.sleep(0)  # the close begins: it waits for the running handler
    closing_began.set()
    await asyncio.wait_for(closing, 30)
    assert (consumer.handled, consumer.failed) == (1, 0)
    assert len(pushed) == 1
    if factory.capabilities.shared:
        other = await (await connect(poll_interval=5.0)).queue("results")
        assert [m.id for m in await other.pop_many(10, timeout=0)] == pushed


async def test_a_handler_moving_to_an_unopened_queue_finishes_during_the_factory_close(
    connect: Connect, case: Any
) -> None:
    """A handler still running when ``factory.close()`` begins moves its message into a
    queue this factory has not opened yet: the move opens (and records) it as at any other
    time, and the close closes it with the others. The move raised ClosedError ("factory is
    closed"), the message stayed and was ko-ed to be handled again, with a traceback."""
    if case.id not in _ONE_OF_EACH_KIND:
        pytest.skip("run on one backend of each kind")
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    jobs = await factory.queue("jobs", reserve_delay=600)
    started, closing_began = asyncio.Event(), asyncio.Event()
    moved: list[str | None] = []

    async def handler(message: Message) -> None:
        started.set()
        await closing_began.wait()
        moved.append(await jobs.move(message, "done"))

    consumer = jobs.consume(handler)
    job = await jobs.push("job")
    await asyncio.wait_for(started.wait(), 30)
    closing = asyncio.create_task(factory.close())
    await asyncio.sleep(0)  # the close begins: it waits for the running handler
    closing_began.set()
    await asyncio.wait_for(closing, 30)
    assert (consumer.handled, consumer.failed, moved) == (1, 0, [job])
    if factory.capabilities.shared:
        other = await connect(poll_interval=5.0)
        assert "done" in await other.list()
        assert [m.payload for m in await (await other.queue("done")).pop_many(10, timeout=0)] == [
            "job"
        ]


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


async def test_a_prefetched_message_whose_reservation_ran_out_is_not_handled_twice_at_once(
    connect: Connect, case: Any
) -> None:
    """A message prefetched by one consumer and left waiting past its reservation is taken
    by another consumer: the first must not start a handler on it as well (a prefetched
    message with less than half its reservation left is given back instead). The give-back
    is the consumer's, the same on every backend: one of each kind of store runs it."""
    if case.id not in ("redis-oq", "postgres", "mongo", "bucket-redis", "redis-sharded", "sqlite"):
        pytest.skip("run on one backend of each kind")
    first = await connect(poll_interval=5.0)
    needs(first, "reserve")
    if not first.capabilities.reservation_expiry or not first.capabilities.shared:
        pytest.skip("reservations that expire, seen by another factory")
    second = await connect(poll_interval=5.0)
    q1 = await first.queue("jobs", reserve_delay=2)
    q2 = await second.queue("jobs", reserve_delay=2)
    running: dict[str, int] = {}
    overlaps: list[object] = []
    handled: set[str] = set()

    async def handler(message: Message) -> None:
        if running.get(message.id):
            overlaps.append(message.payload)
        running[message.id] = running.get(message.id, 0) + 1
        try:
            await asyncio.sleep(1.5)
        finally:
            running[message.id] -= 1
            handled.add(message.id)

    ids = await q1.push_many([0, 1, 2, 3])
    slow = q1.consume(handler, concurrency=1, prefetch=3)  # reserves all four at once
    await asyncio.sleep(0.3)
    other = q2.consume(handler, concurrency=2)
    for _ in range(3000):
        if handled >= set(ids):
            break
        await asyncio.sleep(0.01)
    await slow.stop(5)
    await other.stop(5)
    assert handled >= set(ids)
    assert overlaps == []


async def test_a_handler_raising_cancelled_error_itself_fails_and_the_worker_goes_on(
    connect: Connect,
) -> None:
    """A CancelledError the handler raises (it awaited a task someone else cancelled) is a
    handler failure, not a stop: the worker must not die with it, silently, for good."""
    factory = await connect(poll_interval=5.0)
    q = await factory.queue("jobs")
    seen: list[str] = []

    async def handler(message: Message) -> None:
        seen.append(message.payload)
        if message.payload == "poison":
            other = asyncio.ensure_future(asyncio.sleep(10))
            await asyncio.sleep(0)
            other.cancel()
            await other  # CancelledError, raised inside the handler

    consumer = q.consume(handler, concurrency=1, retry_delay=0.01, max_retry_delay=0.05)
    try:
        await q.push("poison")
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.05)
        await q.push("after")
        for _ in range(200):
            if "after" in seen:
                break
            await asyncio.sleep(0.05)
        assert consumer.state == "running"
        assert "after" in seen
        assert consumer.failed >= 1
    finally:
        await consumer.stop(grace=1)


async def test_a_stop_whose_grace_ends_as_a_handler_returns_keeps_its_ok(
    connect: Connect,
) -> None:
    """A handler that returned is done: the stop's grace running out while its ok is on
    the way must not cancel the ok (the message would stay reserved, then be handled
    again)."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("jobs", reserve_delay=600)
    loop = asyncio.get_running_loop()
    for attempt in range(2):
        await q.push(attempt)
        started = asyncio.Event()
        finish: asyncio.Future[None] = loop.create_future()

        async def handler(message: Message, started=started, finish=finish) -> None:
            started.set()
            await finish

        consumer = q.consume(handler)
        await asyncio.wait_for(started.wait(), 30)
        # the handler returns in the loop iteration in which the grace runs out
        loop.call_at(loop.time() + 0.3, finish.set_result, None)
        await consumer.stop(grace=0.3)
        await asyncio.sleep(0.2)
        sizes = await q.sizes()
        if consumer.handled:
            assert sizes.total == 0, f"handled, but still held: {sizes}"
        else:  # cancelled in time: given back, ready at once
            assert sizes.reserved == 0
            assert await q.pop_many(1, timeout=5)


async def test_a_stop_cancelled_during_its_grace_still_gives_everything_back(
    connect: Connect,
) -> None:
    """Leaving ``async with q.consume(...)`` by a cancellation, then being cancelled again
    during the stop's grace (a shutdown timeout, a second Ctrl-C): the running handlers are
    cancelled and every message held, prefetched ones too, is given back at once."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("jobs", reserve_delay=600)
    await q.push_many(list(range(20)))
    started = asyncio.Event()

    async def handler(message: Message) -> None:
        started.set()
        await asyncio.sleep(0.5)

    async def service() -> None:
        async with q.consume(handler, concurrency=2, prefetch=5):
            await asyncio.sleep(100)

    task = asyncio.create_task(service())
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.sleep(0.1)
    task.cancel()  # the stop begins, with its 30 s grace
    await asyncio.sleep(0.1)
    task.cancel()  # and is cancelled in turn
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(1.0)  # past the end of any handler left running
    sizes = await q.sizes()
    assert sizes.reserved == 0, sizes


async def test_a_stop_cancelled_as_it_gives_back_its_prefetched_messages_still_does(
    connect: Connect, case: Any
) -> None:
    """The handlers returned within the grace and the stop is giving back the prefetched
    messages (a round trip) when it is cancelled (a shutdown timeout, a second Ctrl-C):
    it ends giving them back, as a stop cancelled during its grace does. The end of the stop
    was not shielded there: the messages not yet given back stayed reserved until
    ``reserve_delay`` passed."""
    if case.id not in _ONE_OF_EACH_KIND:
        pytest.skip("run on one backend of each kind")
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("jobs", reserve_delay=600)
    await q.push_many(list(range(10)))
    started, finish, releasing = asyncio.Event(), asyncio.Event(), asyncio.Event()
    release = q._release_all

    async def slow_release(  # a round trip to a far server
        messages: Sequence[Message], *, unseen: bool = False
    ) -> None:
        releasing.set()
        await asyncio.sleep(0.05)
        await release(messages, unseen=unseen)

    q._release_all = slow_release  # type: ignore[method-assign]

    async def handler(message: Message) -> None:
        started.set()
        await finish.wait()

    consumer = q.consume(handler, concurrency=1, prefetch=5)
    await asyncio.wait_for(started.wait(), 30)
    stopping = asyncio.create_task(consumer.stop())
    await asyncio.sleep(0)  # the stop begins: it waits for the running handler
    finish.set()
    await asyncio.wait_for(releasing.wait(), 30)
    stopping.cancel()
    await asyncio.gather(stopping, return_exceptions=True)
    sizes = await q.sizes()
    assert (consumer.handled, sizes.reserved, sizes.total) == (1, 0, 9), sizes


async def test_a_close_cancelled_during_its_grace_still_gives_everything_back(
    connect: Connect, case: Any
) -> None:
    """Leaving ``async with connect(...)`` by a cancellation, then being cancelled again
    while the close waits for the running handlers (a shutdown timeout, a second Ctrl-C):
    the close stops at once, as a stop does, and every message held is given back; it does
    not go on in the background with the handlers running. On the bucket backends the
    cancelled close skipped the store's close, and the backend closed under the buckets it
    held: reserved until their lease lapsed."""
    from backends import new_token

    kinds = ("redis-oq", "redis-reliable", "postgres", "mongo", "sqlite")
    if case.id not in (*kinds, "bucket-redis", "bucket-postgres", "bucket-mongo"):
        pytest.skip("run on one backend of each kind, read from a second factory")
    options = case.options(new_token())
    started = asyncio.Event()

    async def handler(message: Message) -> None:
        started.set()
        await asyncio.Event().wait()  # runs until cancelled

    async def service() -> None:
        async with aio_keuss.connect(case.name, poll_interval=5.0, **options) as factory:
            needs(factory, "reserve")
            for name in ("jobs", "more"):  # the cancellation reaches both queues' closes
                q = await factory.queue(name, reserve_delay=600)
                await q.push_many(list(range(10)))
                q.consume(handler, concurrency=2, prefetch=3)
            await asyncio.sleep(100)

    try:
        task = asyncio.create_task(service())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()  # the close begins, with its stop's 30 s grace
        await asyncio.sleep(0.1)
        task.cancel()  # and is cancelled in turn
        await asyncio.gather(task, return_exceptions=True)
        async with aio_keuss.connect(case.name, poll_interval=5.0, **options) as other:
            sizes = [await (await other.queue(name)).sizes() for name in ("jobs", "more")]
        assert [s.reserved for s in sizes] == [0, 0], sizes
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)


async def test_a_cancelled_close_stops_every_consumer_of_the_queue(
    connect: Connect, case: Any
) -> None:
    """A queue with two consumers, its close cancelled while it waits for their running
    handlers (a shutdown timeout, a second Ctrl-C): the cancellation reached only the stop
    of the first consumer (they were stopped one after the other); the second was never
    stopped, its handlers ran on over the closed queue and its messages, prefetched ones
    too, stayed reserved until ``reserve_delay`` passed."""
    kinds = ("redis-oq", "redis-reliable", "postgres", "mongo", "sqlite")
    if case.id not in (*kinds, "bucket-redis", "bucket-postgres", "bucket-mongo"):
        pytest.skip("run on one backend of each kind")
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("jobs", reserve_delay=600)
    await q.push_many(list(range(20)))
    running = 0
    both = asyncio.Event()

    async def handler(message: Message) -> None:
        nonlocal running
        running += 1
        if running == 4:
            both.set()
        await asyncio.Event().wait()  # runs until cancelled

    consumers = [q.consume(handler, concurrency=2, prefetch=3) for _ in range(2)]
    await asyncio.wait_for(both.wait(), 30)
    closing = asyncio.create_task(q.close())
    await asyncio.sleep(0.1)  # the close waits for the handlers, with the stops' grace
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    assert [c.state for c in consumers] == ["stopped", "stopped"]
    await asyncio.wait_for(asyncio.gather(*(c.wait() for c in consumers)), 30)
    other = await (await connect(poll_interval=5.0)).queue("jobs")
    assert (await other.sizes()).reserved == 0, await other.sizes()


async def test_prefetched_messages_popped_without_reserve_are_put_back_on_stop(
    connect: Connect,
) -> None:
    """Without reserve the workers pop: a stop must put the prefetched messages no handler
    started back in the queue, not drop them (they were neither handled nor failed)."""
    factory = await connect(poll_interval=5.0)
    q = await factory.queue("jobs")
    if q.capabilities.reserve:
        pytest.skip("with reserve they are released, costing no try")
    await q.push_many(list(range(20)))
    handled: list[int] = []
    started = asyncio.Event()

    async def handler(message: Message) -> None:
        handled.append(message.payload)
        started.set()
        await asyncio.sleep(0.1)

    consumer = q.consume(handler, concurrency=1, prefetch=5)
    await asyncio.wait_for(started.wait(), 30)
    await consumer.stop(grace=5)
    left = [m.payload for m in await q.pop_many(100, timeout=0)]
    assert sorted(handled + left) == list(range(20))
    assert left == sorted(left)  # back in their places


async def test_an_early_fetch_on_an_empty_queue_leaves_the_buffer_to_the_free_worker(
    connect: Connect, case: Any
) -> None:
    """With two workers and a prefetch, a worker refills the buffer early, once few are
    left. On an emptied queue that fetch waited for a push with no limit, so while the other
    worker ran a long handler, the messages still buffered waited for a push too (popped
    ones in this process only). The free worker now handles every one of them."""
    if case.id not in ("memory", "redis-oq", "redis-list", "redis-reliable"):
        pytest.skip("the consumer's, the same on every backend: run on a few")
    factory = await connect(poll_interval=5.0)
    q = await factory.queue("jobs")
    pushed = 12
    await q.push_many(list(range(pushed)))
    handled: list[int] = []
    all_in = asyncio.Event()
    release = asyncio.Event()

    async def handler(message: Message) -> None:
        handled.append(message.payload)
        if len(handled) == pushed:
            all_in.set()
        if len(handled) == 1:
            await release.wait()  # the long handler: its worker takes nothing meanwhile

    consumer = q.consume(handler, concurrency=2, prefetch=5)
    try:
        await asyncio.wait_for(all_in.wait(), 30)  # a guard: with the defect, never
    finally:
        release.set()
        await consumer.stop(grace=5)
    assert sorted(handled) == list(range(pushed))
    assert await q.size() == 0


async def test_a_popped_message_put_back_after_its_id_was_pushed_again_is_kept(
    connect: Connect,
) -> None:
    """A popped message goes back when its caller never got it (a cancelled pop, a stopped
    consumer, an interrupted sync call). Past its dedup window its id may have been pushed
    again meanwhile: the put-back was refused as a duplicate of that new message, and the
    popped one was dropped. It is kept under the name a move gives (``<id>.pb``)."""
    factory = await connect(poll_interval=5.0)
    q = await factory.queue("again", dedup_window=0)
    needs(q, "idempotent")
    await q.push("first", id="k")
    popped = await q.pop(timeout=10)
    assert popped is not None and popped.payload == "first"
    assert await q.push("second", id="k") == "k"  # no window: the id is free once consumed
    await q._put_back_unhandled([popped])  # type: ignore[attr-defined]
    left: dict[str, Any] = {}
    deadline = time.monotonic() + 30  # a sharded queue hands out one shard's at a time
    while len(left) < 2 and time.monotonic() < deadline:
        left.update((m.id, m.payload) for m in await q.pop_many(10, timeout=1))
    assert left == {"k": "second", "k.pb": "first"}


async def test_a_handler_closing_its_queue_keeps_its_message_from_other_consumers(
    connect: Connect, case: Any
) -> None:
    """A handler that closes its own queue ("shut down after this one"): the close cannot
    wait for that handler, but must not give back the message it is still running, or
    another consumer handles it at the same time. The consumer's, the same on every
    backend: one of each kind of store runs it."""
    kinds = ("redis-oq", "redis-reliable", "postgres", "mongo", "sqlite")
    if case.id not in (*kinds, "bucket-redis", "bucket-postgres", "bucket-mongo"):
        pytest.skip("run on one backend of each kind")
    first = await connect(poll_interval=5.0)
    needs(first, "reserve")
    second = await connect(poll_interval=5.0)
    q1 = await first.queue("jobs", reserve_delay=600)
    q2 = await second.queue("jobs", reserve_delay=600)
    await q2.push("last")
    closed = asyncio.Event()
    finish = asyncio.Event()

    async def closes(message: Message) -> None:
        await q1.close()
        closed.set()
        await finish.wait()  # still handling it

    consumer = q1.consume(closes)
    try:
        await asyncio.wait_for(closed.wait(), 30)
        assert await q2.reserve_many(1, timeout=0.5) == []  # not given to anyone else
    finally:
        finish.set()
        await asyncio.wait_for(consumer.wait(), 30)


@contextlib.asynccontextmanager
async def _a_handler_abandoned(
    connect: Connect, monkeypatch: pytest.MonkeyPatch, reserve_delay: float
) -> AsyncIterator[tuple[aio_keuss.Factory, Queue, asyncio.Event]]:
    """One message held by a handler that goes on once cancelled, which its consumer's stop
    (its waits shortened) abandoned: yields the consumer's factory, the queue as another
    factory sees it, and the event set once the handler ends (it is let end after)."""
    monkeypatch.setattr(aio_keuss.consumer, "ACK_WAIT", 0.2)
    monkeypatch.setattr(aio_keuss.consumer, "ABANDON_WAIT", 0.2)
    first = await connect(poll_interval=5.0)
    needs(first, "reserve")
    second = await connect(poll_interval=5.0)
    q1 = await first.queue("jobs", reserve_delay=reserve_delay)
    q2 = await second.queue("jobs", reserve_delay=reserve_delay)
    await q2.push("held")
    started = asyncio.Event()
    finish = asyncio.Event()
    ended = asyncio.Event()

    async def stubborn(message: Message) -> None:
        started.set()
        try:
            while not finish.is_set():
                with contextlib.suppress(asyncio.CancelledError):  # goes on
                    await asyncio.sleep(0.05)
        finally:
            ended.set()

    consumer = q1.consume(stubborn)
    try:
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.wait_for(consumer.stop(0), 30)  # abandons it
        yield first, q2, ended
    finally:
        finish.set()
        await asyncio.wait_for(ended.wait(), 30)


async def test_a_handler_abandoned_by_a_stop_keeps_its_message_through_the_close(
    connect: Connect, case: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that goes on once cancelled is abandoned by its consumer's stop, its
    message left reserved: the factory's close that follows (the worker command's) must not
    give it back either, or another consumer handles it while that handler still runs. A
    bucket store gave every reservation of its leased buckets back as it closed."""
    kinds = ("redis-oq", "redis-reliable", "redis-sharded", "postgres", "mongo", "sqlite")
    if case.id not in (*kinds, "bucket-redis", "bucket-postgres", "bucket-mongo"):
        pytest.skip("run on one backend of each kind")
    async with _a_handler_abandoned(connect, monkeypatch, 600) as (first, q2, ended):
        assert not ended.is_set()
        await asyncio.wait_for(first.close(), 30)
        assert await q2.reserve_many(1, timeout=0.5) == []  # not given to anyone else
        assert (await q2.sizes()).total == 1  # nor lost: back once its reservation expires


async def test_a_handler_abandoned_by_a_stop_keeps_its_reservation_while_it_runs(
    connect: Connect, case: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop abandons a handler that goes on once cancelled, its queue left open (the
    consumer stopped alone, or a worker given a factory it does not close): the handler
    runs on in the loop, so its reservation is still extended, else it lapsed and another
    consumer handled the message at the same time. The consumer's, the same on every
    backend that extends: two kinds of store run it."""
    if case.id not in ("redis-oq", "postgres"):
        pytest.skip("run on two backends")
    async with _a_handler_abandoned(connect, monkeypatch, 6) as (_, q2, ended):
        await asyncio.sleep(9)  # past its reservation, had it not been extended
        assert not ended.is_set()
        assert await q2.reserve_many(1, timeout=0) == []  # not given to anyone else


@pytest.mark.parametrize("closing", ["queue", "factory"])
async def test_a_handler_closing_its_queue_lets_the_other_handlers_acknowledge_first(
    connect: Connect, case: Any, closing: str
) -> None:
    """A handler closes its queue (or its factory) while another handler of its consumer
    has returned and its ok is still to be sent (with prefetch, oks go out in the
    background): the close must let that ok go through before it gives back what nobody
    acknowledged, or the message, handled, comes back to be handled again. The close cannot
    wait for the handler that called it, so it goes on after it returns, as a stop asked by
    a handler does, and that handler's message is acknowledged too. The consumer's and the
    queue's, the same on every backend: one of each kind of store runs it."""
    if case.id not in ("memory", "redis-oq", "redis-reliable", "postgres", "mongo", "sqlite"):
        pytest.skip("run on one backend of each kind")
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("jobs", reserve_delay=600)
    ids = await q.push_many(["first", "closer", "more"])
    handled: list[str] = []
    first_done = asyncio.Event()

    async def close() -> None:
        await (q.close() if closing == "queue" else factory.close())

    async def handler(message: Message) -> None:
        handled.append(message.id)
        if message.payload == "first":
            first_done.set()  # and returns: its ok goes to the background sender
        elif message.payload == "closer":
            await first_done.wait()
            await close()

    consumer = q.consume(handler, concurrency=2, prefetch=1)
    await asyncio.wait_for(consumer.wait(), 30)
    await asyncio.wait_for(close(), 30)  # waits for the close the handler began
    if factory.capabilities.shared:
        other = await (await connect(poll_interval=5.0)).queue("jobs", reserve_delay=600)
        sizes = await other.sizes()
        left = [m.id for m in await other.pop_many(10, timeout=0)]
    else:  # read past the closed queue object
        store = await factory.backend.store("jobs", q.options)
        sizes = await store.sizes()
        left = [s.id for s in (await store.get(10)).messages]
    assert set(handled).isdisjoint(left), "handled, then given back to be handled again"
    assert sizes.reserved == 0, sizes  # the closing handler's message was acknowledged too
    assert sorted(handled + left) == sorted(ids)


async def _a_handler_running(
    q: aio_keuss.Queue,
) -> tuple[Any, Callable[[Message], Awaitable[None]], asyncio.Event]:
    """A consumer whose handler is running on a message until the event returned is set."""
    started, finish = asyncio.Event(), asyncio.Event()

    async def handler(message: Message) -> None:
        started.set()
        await finish.wait()

    consumer = q.consume(handler)
    await q.push("x")
    await asyncio.wait_for(started.wait(), 30)
    return consumer, handler, finish


async def test_closes_at_once_wait_for_the_one_under_way(connect: Connect) -> None:
    """``queue.close()`` and ``factory.close()`` at once (a shutdown hook and a lifespan's
    exit) while a handler runs: the second waits for the close under way, neither raises
    (the second ran the whole close again, and its drain raised ClosedError)."""
    factory = await connect(poll_interval=5.0)
    q = await factory.queue("jobs")
    consumer, _, finish = await _a_handler_running(q)
    closes = [asyncio.create_task(q.close()), asyncio.create_task(factory.close())]
    finish.set()  # the closes begin first, then the handler returns
    assert await asyncio.wait_for(asyncio.gather(*closes), 30) == [None, None]
    assert consumer.handled == 1
    with pytest.raises(aio_keuss.ClosedError):
        await q.push(1)


async def test_consume_is_refused_once_a_close_began(connect: Connect) -> None:
    """A close under way stops the consumers it found; one started meanwhile would go on
    handling messages whose oks the closed queue then refuses (each handled again after
    ``reserve_delay``): ``consume`` is refused as soon as the close begins."""
    factory = await connect(poll_interval=5.0)
    q = await factory.queue("jobs")
    _, handler, finish = await _a_handler_running(q)
    closing = asyncio.create_task(q.close())
    await asyncio.sleep(0)  # the close begins: it waits for the running handler
    try:
        with pytest.raises(aio_keuss.ClosedError):
            late = q.consume(handler)
            await late.stop()
    finally:
        finish.set()
        await asyncio.wait_for(closing, 30)


async def test_a_handler_may_stop_its_own_consumer(connect: Connect) -> None:
    """``await consumer.stop()`` from the consumer's own handler ("stop after this one")
    must not wait for itself: the stop completes, the message is acknowledged."""
    factory = await connect(poll_interval=5.0)
    q = await factory.queue("jobs")
    consumer = None

    async def handler(message: Message) -> None:
        assert consumer is not None
        await consumer.stop(grace=2)

    consumer = q.consume(handler, concurrency=2)
    await q.push("last")
    await asyncio.wait_for(consumer.wait(), 30)
    assert consumer.handled == 1
    if q.capabilities.reserve:
        assert (await q.sizes()).total == 0


async def test_a_gathering_cancelled_after_its_close_gave_back_gives_nothing_back_again(
    connect: Connect, case: BackendCase
) -> None:
    """A ``reserve_many`` gathering more (``max_wait``) holds a reservation when its queue
    closes: the close gives it back, at no try. Another factory's consumer reserves the
    message then, with those very tries. The gathering's caller, cancelled now (before it
    saw the close), must not give it back a second time: that release passed the new
    holder's guard and took its reservation from it (its ok returned False, and the message
    was delivered again while held). The order is fixed by the close's give-back, which
    cancels the caller, waits for the other reserve, and only then lets a second release
    through."""
    if not case.shared or case.name.startswith("bucket-"):
        pytest.skip("a message another factory reserves at the same tries")
    closing = await connect(reserve_delay=600, poll_interval=60)
    needs(closing, "reserve")
    other = await connect(reserve_delay=600)
    q1, q2 = await closing.queue("gathered"), await other.queue("gathered")
    await q1.push("x")
    gathering = asyncio.ensure_future(q1.reserve_many(5, timeout=60, max_wait=60))
    for _ in range(6000):  # until it holds "x" and sleeps for more (no round trip)
        if not (await q1.size() or q1._reserves._running):
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the gathering never took the message")
    give_back = q1._store.rollback
    taken: list[Message | None] = []
    reserved_again, released_again = asyncio.Event(), asyncio.Event()
    calls = 0

    async def rollback(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:  # a second release: only once the other factory holds the message
            await reserved_again.wait()
            try:
                return await give_back(*args)
            finally:
                released_again.set()
        gathering.cancel()  # the close has taken its list; the caller has not resumed yet
        result = await give_back(*args)
        taken.append(await q2.reserve(timeout=30))
        reserved_again.set()
        return result

    q1._store.rollback = rollback  # type: ignore[method-assign]
    await closing.close()
    with pytest.raises(asyncio.CancelledError):
        await gathering
    if calls > 1:
        await released_again.wait()
    held = taken[0]
    assert held is not None and held.payload == "x" and held.tries == 0
    assert await q2.ok(held) is True
    assert await q2.total_size() == 0
    await other.close()


async def test_a_closed_factory_refuses_to_list_its_queues(connect: Connect) -> None:
    """``factory.list()`` after ``close()`` went to the store: on Redis the closed client
    connected again (a connection nothing closed), elsewhere a driver-shaped error. Calls
    after close raise ClosedError."""
    factory = await connect(poll_interval=5.0)
    await factory.queue("listed")
    assert "listed" in await factory.list()
    await factory.close()
    with pytest.raises(aio_keuss.ClosedError):
        await factory.list()


async def test_a_closed_queue_is_opened_afresh_by_the_factory(connect: Connect) -> None:
    """``queue.close()`` let go of the queue, but the factory kept handing out that closed
    object: ``factory.queue(name)`` after it raised ClosedError on every call, for good
    (a pipeline run whose queue was closed could not be started again). The factory now
    opens the name afresh, with the options asked for; the closed object stays closed."""
    factory = await connect()
    q = await factory.queue("a")
    await q.push(1)
    await q.close()
    again = await factory.queue("a")
    assert again is not q
    await again.push(2)
    with pytest.raises(aio_keuss.ClosedError):
        await q.push(3)
    assert await again.total_size() == 2
    assert await factory.queue("a") is again
    assert q not in factory.open_queues() and again in factory.open_queues()


async def test_a_handler_asking_for_a_closing_queue_does_not_hold_up_its_close(
    connect: Connect,
) -> None:
    """``factory.queue(name)`` waits for a close of that queue under way, then opens it
    afresh. Asked from a handler in a task of its own (``asyncio.gather`` in a handler,
    ``asyncio.wait_for`` on Python 3.11), whose queue's close waits for that handler, the
    two waited for each other until the consumer's stop grace (30 s) cancelled the
    handler: it gets the closing queue at once, as its own worker task does."""
    factory = await connect()
    q = await factory.queue("a")
    await q.push(1)
    started, go = asyncio.Event(), asyncio.Event()
    got: list[aio_keuss.Queue] = []

    async def handler(message: aio_keuss.Message) -> None:
        started.set()
        await go.wait()
        got.extend(await asyncio.gather(factory.queue("a")))

    q.consume(handler)
    await started.wait()
    closing = asyncio.ensure_future(q.close())
    await asyncio.sleep(0)  # the close began: it waits for the handler
    go.set()
    await closing
    assert got == [q]  # not cancelled by the stop's grace: it went on with the closing queue
    again = await factory.queue("a")
    assert again is not q and await again.total_size() == 0  # the message was acknowledged


async def test_handlers_moving_into_each_others_closing_queue_do_not_hold_up_the_closes(
    connect: Connect,
) -> None:
    """Two queues closed together, each one's handler moving its message into the other
    (a first move into a queue opens it through the factory): each waited for the other's
    close, which waited for that handler, until the stop grace (30 s) cancelled both
    handlers and nothing moved."""
    factory = await connect()
    needs(factory, "move")
    a, b = await factory.queue("a"), await factory.queue("b")
    await a.push("from a")
    await b.push("from b")
    started = [asyncio.Event(), asyncio.Event()]
    go = asyncio.Event()
    moved: list[str | None] = []

    def mover(source: aio_keuss.Queue, target: str, ready: asyncio.Event) -> Any:
        async def handler(message: aio_keuss.Message) -> None:
            ready.set()
            await go.wait()
            moved.append(await source.move(message, target))

        return handler

    a.consume(mover(a, "b", started[0]))
    b.consume(mover(b, "a", started[1]))
    await asyncio.gather(*(event.wait() for event in started))
    closing = asyncio.ensure_future(asyncio.gather(a.close(), b.close()))
    await asyncio.sleep(0)
    go.set()
    await closing
    assert len(moved) == 2 and None not in moved  # both handlers finished: both moved
    again_a, again_b = await factory.queue("a"), await factory.queue("b")
    assert [m.payload for m in await drain_all(again_a)] == ["from b"]
    assert [m.payload for m in await drain_all(again_b)] == ["from a"]


async def test_a_closed_queue_is_not_listed_open_nor_hides_another_factorys_sizes(
    connect: Connect,
) -> None:
    """``factory.open_queues()`` listed a queue closed with ``queue.close()`` until the
    next ``factory.queue(name)``. The metrics read the sizes of every factory's open
    queues, one per name: the closed one was picked, its read failed, and the size of that
    queue, open and holding a message in another factory, was left out of the gauge."""
    closed_in, open_in = await connect(), await connect()
    q = await closed_in.queue("a")
    await q.close()
    assert q not in closed_in.open_queues()
    other = await open_in.queue("a")
    await other.push(1)
    registry = aio_keuss.enable_metrics()
    try:
        sizes = await registry.refresh_sizes(max_age=0)
    finally:
        aio_keuss.observe.disable()
    assert sizes["a"].total == 1


@pytest.mark.parametrize("step", ["is_paused", "save_options"])
@pytest.mark.parametrize("how", ["fails", "cancelled"])
async def test_an_open_failing_after_its_store_was_made_closes_that_store(
    connect: Connect, case: Any, step: str, how: str
) -> None:
    """An open whose queue was made (its store, its signal subscription) but whose last
    steps failed (the stats store's read of the pause, or its record of the options: the
    server away) or were cancelled (a caller's timeout around ``factory.queue``) left that
    store open and the queue subscribed to the signals for good: nothing held the Queue any
    more to close it, not even the factory's close. It now closes the queue it made."""
    if case.id not in _ONE_OF_EACH_KIND:
        pytest.skip("the factory's open, the same over every kind of store")
    factory = await connect()
    closed: list[str] = []
    make = factory.backend.store

    async def store(name: str, options: Any) -> Any:
        made = await make(name, options)
        close = made.close

        async def recording() -> None:
            closed.append(name)
            await close()

        made.close = recording  # type: ignore[method-assign]
        return made

    factory.backend.store = store  # type: ignore[method-assign]
    reached, hold = asyncio.Event(), asyncio.Event()
    original = getattr(factory.stats_store, step)

    async def failing(*args: Any, **kwargs: Any) -> Any:
        reached.set()
        if how == "fails":
            raise aio_keuss.KeussConnectionError("the server is away")
        await hold.wait()
        return await original(*args, **kwargs)

    setattr(factory.stats_store, step, failing)
    opening = asyncio.create_task(factory.queue("a"))
    await asyncio.wait_for(reached.wait(), 10)
    if how == "cancelled":
        opening.cancel()
    (outcome,) = await asyncio.gather(opening, return_exceptions=True)
    expected = aio_keuss.KeussConnectionError if how == "fails" else asyncio.CancelledError
    assert isinstance(outcome, expected), outcome
    assert set(closed) == {"a"}, "the store made for the failed open was left open"
    assert "a" not in factory.signal._listeners, "the failed open's queue still listens"
    setattr(factory.stats_store, step, original)
    q = await factory.queue("a")  # opened afresh
    await q.push(1)
    assert await q.total_size() == 1
    await factory.close()
