"""Conformance: ``Queue.cancel`` (saq's and arq's ``job.abort()``, procrastinate's
``cancel_job(abort=True)``). A waiting message is removed; a running one's handler is
stopped by whichever consumer holds it, in this process or another, and the message is
done for good; a prefetched one never runs.

Every backend runs it, skipping by capability: removing needs ``remove``; stopping a held
message needs ``results`` (the requests are kept in the result store); what is about
reservations (prefetch, batches given back, lapses) needs ``reserve``. A popped message's
running handler is stopped too: out of the store, it may be running, so the request is
left. Nothing here times the backend: waits that must end have generous hang guards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import Connect, needs
from polling import until

import aio_keuss
from aio_keuss import CancelResult, JobResult, Message

pytestmark = pytest.mark.timeout(120)

GUARD = 30.0
"""Hang guard of a wait that must end."""
TTL = 600.0
"""A result_ttl no test outlives."""


async def _kept(q: aio_keuss.Queue, message_id: str) -> JobResult:
    found = await q.result(message_id, timeout=GUARD)
    assert found is not None
    return found


async def _gone(q: aio_keuss.Queue) -> None:
    async def empty() -> bool:
        return (await q.sizes()).total == 0

    await until(empty, GUARD)


class Blocked:
    """A handler that waits for ever (until cancelled), noting what it saw."""

    def __init__(self) -> None:
        self.started: dict[str, asyncio.Event] = {}
        self.cancelled: list[str] = []
        self.ran: list[str] = []

    def began(self, message_id: str) -> asyncio.Event:
        return self.started.setdefault(message_id, asyncio.Event())

    async def __call__(self, message: Message) -> None:
        self.ran.append(message.id)
        self.began(message.id).set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(message.id)
            raise


async def _held_factory(connect: Connect, **options: Any) -> aio_keuss.Factory:
    factory = await connect(**{"poll_interval": 60.0, **options})
    needs(factory, "results", "reserve")
    return factory


async def _running_factory(connect: Connect, **options: Any) -> aio_keuss.Factory:
    """One whose running handlers can be stopped: reserved, or popped (out of the store
    while the handler runs, which a cancel cannot tell from never pushed)."""
    factory = await connect(**{"poll_interval": 60.0, **options})
    needs(factory, "results")
    return factory


# waiting messages ---------------------------------------------------------------------------


async def test_a_waiting_message_is_removed(connect: Connect) -> None:
    factory = await connect(poll_interval=60.0)
    q = await factory.queue("q1", **({"result_ttl": TTL} if factory.capabilities.results else {}))
    needs(q, "remove")
    message_id = await q.push(1, delay=3600 if q.capabilities.delay else 0.0)
    outcome: list[CancelResult] = []

    async def removed() -> bool:  # (a bucket store's push is visible once flushed)
        outcome.append(await q.cancel(message_id, reason="not needed"))
        return outcome[-1] is CancelResult.REMOVED

    await until(removed, GUARD)
    assert (await q.sizes()).total == 0
    if factory.capabilities.results:
        found = await _kept(q, message_id)
        assert (found.ok, found.error) == (False, "cancelled: not needed")


async def test_a_waiting_message_without_reason_says_cancelled(connect: Connect) -> None:
    factory = await connect(poll_interval=60.0)
    needs(factory, "results", "remove")
    q = await factory.queue("q1", result_ttl=TTL)
    message_id = await q.push(1, delay=3600 if q.capabilities.delay else 0.0)

    async def removed() -> bool:
        return await q.cancel(message_id) is CancelResult.REMOVED

    await until(removed, GUARD)
    assert (await _kept(q, message_id)).error == "cancelled"


async def test_nothing_to_cancel(connect: Connect) -> None:
    factory = await connect(poll_interval=60.0)
    q = await factory.queue("q1")
    capabilities = q.capabilities
    if not capabilities.remove and not capabilities.results:
        with pytest.raises(aio_keuss.NotSupportedError):
            await q.cancel("nowhere")
        return
    outcome = await q.cancel("nowhere")
    if (capabilities.peek and capabilities.reserve) or not capabilities.results:
        assert outcome is CancelResult.MISSING
        assert not outcome
    else:  # cannot look, or a popped message may be running where no look finds it
        assert outcome is CancelResult.REQUESTED


@pytest.mark.parametrize(
    "bad", [42, b"bytes", "x" * 1001, "not \ud800 UTF-8"], ids=["int", "bytes", "long", "surrogate"]
)
async def test_a_bad_reason_is_refused_before_anything(connect: Connect, bad: object) -> None:
    """A lone surrogate was found only by the JSON of the request or of the failure kept,
    as a raw TypeError, after a waiting message had been removed."""
    factory = await connect(poll_interval=60.0)
    q = await factory.queue("q1", **({"result_ttl": TTL} if factory.capabilities.results else {}))
    message_id = await q.push(1)
    with pytest.raises(aio_keuss.InvalidInputError):
        await q.cancel(message_id, reason=bad)  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.InvalidIdError):
        await q.cancel(42)  # type: ignore[arg-type]
    assert (await q.sizes()).total == 1


async def test_a_reason_of_1000_characters_is_kept_whole(connect: Connect) -> None:
    factory = await connect(poll_interval=60.0)
    needs(factory, "results", "remove")
    q = await factory.queue("q1", result_ttl=TTL)
    message_id = await q.push(1, delay=3600 if q.capabilities.delay else 0.0)
    reason = "r" * 1000

    async def removed() -> bool:
        return await q.cancel(message_id, reason=reason) is CancelResult.REMOVED

    await until(removed, GUARD)
    error = (await _kept(q, message_id)).error
    assert error is not None and error.startswith("cancelled: r")


# running handlers ---------------------------------------------------------------------------


async def _stopped_while_running(canceller: aio_keuss.Queue, serving: aio_keuss.Queue) -> None:
    handler = Blocked()
    message_id = await serving.push({"work": 1})
    async with serving.consume(handler) as consumer:
        await asyncio.wait_for(handler.began(message_id).wait(), GUARD)
        assert await canceller.cancel(message_id, reason="user asked") is CancelResult.REQUESTED
        found = await _kept(canceller, message_id)
        assert (found.ok, found.error) == (False, "cancelled: user asked")
        await _gone(serving)
        assert handler.cancelled == [message_id]
        assert consumer.status().cancelled == 1
    assert handler.ran == [message_id]  # done for good: never delivered again


async def test_a_running_handler_is_stopped(connect: Connect) -> None:
    factory = await _running_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    await _stopped_while_running(q, q)


async def test_a_running_handler_is_stopped_from_another_factory(connect: Connect) -> None:
    factory = await _running_factory(connect)
    needs(factory, "shared")
    other = await connect(poll_interval=60.0)
    serving = await factory.queue("q1", result_ttl=TTL)
    asking = await other.queue("q1", result_ttl=TTL)
    await _stopped_while_running(asking, serving)


async def test_a_running_handler_is_stopped_on_a_queue_without_result_ttl(
    connect: Connect,
) -> None:
    factory = await _running_factory(connect)
    q = await factory.queue("q1")
    handler = Blocked()
    message_id = await q.push(1)
    async with q.consume(handler) as consumer:
        await asyncio.wait_for(handler.began(message_id).wait(), GUARD)
        assert await q.cancel(message_id) is CancelResult.REQUESTED
        await _gone(q)
        assert handler.cancelled == [message_id]
        assert consumer.status().cancelled == 1


async def test_a_lost_signal_is_made_up_for_while_the_handler_runs(connect: Connect) -> None:
    """The canceller's bus announces no cancel: the holder finds the request on its own,
    looking the requests of what it holds up while its handlers run."""
    factory = await _running_factory(connect)
    asking_factory = await connect(poll_interval=60.0) if factory.capabilities.shared else factory
    asking_factory.signal.cancels = lambda queue, ids: None  # type: ignore[method-assign]
    serving = await factory.queue("q1", result_ttl=TTL, reserve_delay=2.0)
    asking = await asking_factory.queue("q1", result_ttl=TTL, reserve_delay=2.0)
    handler = Blocked()
    message_id = await serving.push(1)
    async with serving.consume(handler):
        await asyncio.wait_for(handler.began(message_id).wait(), GUARD)
        assert await asking.cancel(message_id) is CancelResult.REQUESTED
        assert (await _kept(asking, message_id)).error == "cancelled"
        await _gone(serving)
    assert handler.cancelled == [message_id]


async def test_a_prefetched_message_never_runs(connect: Connect) -> None:
    factory = await _held_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    first, second, third = await q.push_many([1, 2, 3])
    handler = Blocked()
    async with q.consume(handler, prefetch=2):
        await asyncio.wait_for(handler.began(first).wait(), GUARD)
        assert await q.cancel(second, reason="late") in (
            CancelResult.REMOVED,
            CancelResult.REQUESTED,
        )
        assert (await _kept(q, second)).error == "cancelled: late"
        assert await q.cancel(first) is CancelResult.REQUESTED  # frees the only worker
        await asyncio.wait_for(handler.began(third).wait(), GUARD)
        assert await q.cancel(third) is CancelResult.REQUESTED
        await _gone(q)
    assert second not in handler.ran
    assert handler.cancelled == [first, third]


async def test_a_batch_handler_is_stopped_and_the_rest_of_its_batch_given_back(
    connect: Connect,
) -> None:
    factory = await _held_factory(connect, max_wait_time=0.2)
    q = await factory.queue("q1", result_ttl=TTL)
    ids = await q.push_many([1, 2, 3])
    first_batch: list[str] = []
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def handler(messages: list[Message]) -> str:
        if first_batch:
            return "handled"
        first_batch.extend(m.id for m in messages)
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async with q.consume(handler, batch=3) as consumer:
        await asyncio.wait_for(started.wait(), GUARD)
        named = first_batch[0]
        assert await q.cancel(named) is CancelResult.REQUESTED
        await asyncio.wait_for(cancelled.wait(), GUARD)
        results = {message_id: await _kept(q, message_id) for message_id in ids}
        await _gone(q)
        assert consumer.status().cancelled == 1
    assert results[named].error == "cancelled"
    others = [results[i] for i in ids if i != named]
    assert [(r.ok, r.value) for r in others] == [(True, "handled"), (True, "handled")]


async def test_a_handler_that_ignores_cancellation_keeps_its_result(connect: Connect) -> None:
    factory = await _running_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    message_id = await q.push(1)
    started, heard, go_on = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def handler(message: Message) -> str:
        started.set()
        try:
            await go_on.wait()
        except asyncio.CancelledError:  # ignored: it goes on working
            heard.set()
            await go_on.wait()
        return "finished anyway"

    async with q.consume(handler):
        await asyncio.wait_for(started.wait(), GUARD)
        assert await q.cancel(message_id) is CancelResult.REQUESTED
        await asyncio.wait_for(heard.wait(), GUARD)
        go_on.set()
        found = await _kept(q, message_id)
        await _gone(q)
    assert (found.ok, found.value) == (True, "finished anyway")


async def test_a_handler_stopped_cleans_up_and_its_worker_goes_on(connect: Connect) -> None:
    factory = await _running_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    first = await q.push("block")
    cleaned = asyncio.Event()
    started = asyncio.Event()

    async def handler(message: Message) -> str:
        if message.payload == "block":
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                cleaned.set()
        return message.payload.upper()

    async with q.consume(handler):
        await asyncio.wait_for(started.wait(), GUARD)
        assert await q.cancel(first) is CancelResult.REQUESTED
        await asyncio.wait_for(cleaned.wait(), GUARD)
        assert await asyncio.wait_for(q.push_and_wait("next"), GUARD) == "NEXT"


async def test_a_request_is_honoured_by_a_later_holder(connect: Connect) -> None:
    """The holder asked went away (its reservation lapses); the consumer that takes the
    message next never heard the signal, and finds the request while the handler runs."""
    factory = await _held_factory(connect)
    needs(factory, "reservation_expiry")
    q = await factory.queue("q1", result_ttl=TTL, reserve_delay=1.0)
    message_id = await q.push(1)

    async def reserved() -> bool:
        return await q.reserve(timeout=0) is not None

    await until(reserved, GUARD)  # by a holder that never acknowledges it
    assert await q.cancel(message_id, reason="stale") is CancelResult.REQUESTED
    handler = Blocked()
    async with q.consume(handler) as consumer:
        found = await _kept(q, message_id)
        await _gone(q)
        assert consumer.status().cancelled == 1
    assert found.error == "cancelled: stale"
    assert handler.cancelled == handler.ran == [message_id]


async def test_a_pipeline_station_is_stopped(connect: Connect) -> None:
    factory = await _held_factory(connect)
    needs(factory, "move")
    handler = Blocked()
    pipeline = factory.pipeline("p").sink("incoming", handler)
    incoming = await factory.queue("incoming")
    message_id = await incoming.push(1)
    async with pipeline.run():
        await asyncio.wait_for(handler.began(message_id).wait(), GUARD)
        assert await incoming.cancel(message_id) is CancelResult.REQUESTED
        await _gone(incoming)
    assert handler.cancelled == [message_id]


async def test_a_queue_without_result_ttl_never_looks_requests_up(connect: Connect) -> None:
    """Its consumers hear the signals only: no round trip of theirs while handlers run.
    The one request that stopped a message is read once it is done, to be used up."""
    from aio_keuss.cancels import USED
    from aio_keuss.results import cancel_space

    factory = await _held_factory(connect)
    q = await factory.queue("q1", reserve_delay=1.0)
    store = await factory._results.get()
    looked: list[str] = []
    get = store.get

    async def counted(queue: str, ids: Any) -> list[bytes | None]:
        looked.append(queue)
        return await get(queue, ids)

    store.get = counted  # type: ignore[method-assign]
    handler = Blocked()
    message_id = await q.push(1)
    async with q.consume(handler):
        await asyncio.wait_for(handler.began(message_id).wait(), GUARD)
        await asyncio.sleep(1.0)  # four of the rounds a queue with result_ttl would look in
        assert looked == []
        assert await q.cancel(message_id) is CancelResult.REQUESTED
        await _gone(q)

        async def used_up() -> bool:
            return await get(cancel_space(q.name), [message_id]) == [USED]

        await until(used_up, GUARD)
    assert looked == [cancel_space(q.name)]


async def test_a_request_once_honoured_does_not_cancel_a_later_push_of_its_id(
    connect: Connect,
) -> None:
    """An explicit id pushed again once its dedup window is over is a new message: the
    request that stopped the first one was used up, and neither the consumer that heard
    it nor a look at the requests stops the new one."""
    factory = await _held_factory(connect)
    needs(factory, "idempotent")
    q = await factory.queue("q1", result_ttl=TTL, reserve_delay=1.0, dedup_window=0.2)
    handler = Blocked()
    async with q.consume(handler) as consumer:
        await q.push("first", id="order-1")
        await asyncio.wait_for(handler.began("order-1").wait(), GUARD)
        assert await q.cancel("order-1") is CancelResult.REQUESTED
        await _gone(q)
        assert (await _kept(q, "order-1")).error == "cancelled"
        await asyncio.sleep(0.5)  # past the dedup window: the same id is a new message
        handler.started.clear()
        await q.push("second", id="order-1")
        await asyncio.wait_for(handler.began("order-1").wait(), GUARD)
        await asyncio.sleep(1.0)  # four looks at the requests while it runs
        assert handler.cancelled == ["order-1"]
        assert consumer.status().cancelled == 1
        await consumer.stop(grace=0)  # the second one waits for ever: not for the grace


@pytest.mark.parametrize("settings", [{}, {"prefetch": 2}, {"batch": 2}], ids=str)
async def test_a_request_a_handler_ignored_is_used_up(
    connect: Connect, settings: dict[str, Any]
) -> None:
    """The handler shielded itself from the cancellation and returned: its message is
    ok-ed as handled, and the request that asked it to stop is used up all the same, so
    that the id pushed again past its dedup window is a new message that runs."""
    q, used_up = await _reused_id_queue(connect, result_ttl=TTL)
    ran: list[str] = []
    started, heard, go_on = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def work(payload: str) -> str:
        ran.append(payload)
        if payload == "first":
            started.set()
            try:
                await go_on.wait()
            except asyncio.CancelledError:  # ignored: it goes on working
                heard.set()
                await go_on.wait()
        return payload

    async def handler(message: Message | list[Message]) -> str:
        if isinstance(message, list):
            return "+".join([await work(m.payload) for m in message])
        return await work(message.payload)

    async with q.consume(handler, **settings) as consumer:
        await q.push("first", id="order-1")
        await asyncio.wait_for(started.wait(), GUARD)
        assert await q.cancel("order-1") is CancelResult.REQUESTED
        await asyncio.wait_for(heard.wait(), GUARD)
        go_on.set()
        await _gone(q)
        await until(used_up, GUARD)
        await _a_later_push_runs(q, consumer, ran)


async def test_a_message_finished_as_its_request_lands_is_missing(connect: Connect) -> None:
    """The message is ok-ed between the cancel's look-up and its request landing (the
    result store's put is made to wait for that ok): the cancel looks again, uses its
    request up, and says it stopped nothing."""
    from aio_keuss.cancels import USED
    from aio_keuss.results import cancel_space

    factory = await _held_factory(connect)
    needs(factory, "peek")
    q = await factory.queue("q1", result_ttl=TTL)
    message_id = await q.push(1)

    async def reserved() -> bool:
        return await q.reserve(timeout=0) is not None

    await until(reserved, GUARD)
    store = await factory._results.get()
    put = store.put

    async def finished_first(queue: str, results: Any, ttl: float) -> None:
        if queue == cancel_space(q.name) and results[0][1] != USED:
            assert await q.ok(message_id)
        await put(queue, results, ttl)

    store.put = finished_first  # type: ignore[method-assign]
    assert await q.cancel(message_id) is CancelResult.MISSING
    assert await store.get(cancel_space(q.name), [message_id]) == [USED]


async def test_the_rest_of_a_stopped_batch_costs_no_try(connect: Connect) -> None:
    factory = await _held_factory(connect, max_wait_time=0.2)
    q = await factory.queue("q1", result_ttl=TTL)
    ids = await q.push_many([1, 2, 3])
    tries: dict[str, list[int]] = {}
    started = asyncio.Event()

    async def handler(messages: list[Message]) -> None:
        for m in messages:
            tries.setdefault(m.id, []).append(m.tries)
        if not started.is_set():
            started.set()
            await asyncio.Event().wait()

    async with q.consume(handler, batch=3):
        await asyncio.wait_for(started.wait(), GUARD)
        named = next(iter(tries))
        assert await q.cancel(named) is CancelResult.REQUESTED
        await _gone(q)
    others = [i for i in ids if i != named]
    assert all(len(tries[i]) == 2 and tries[i][1] == tries[i][0] for i in others), tries
    assert tries[named] == [tries[named][0]]


async def test_a_request_heard_while_its_id_is_looked_up_stands(connect: Connect) -> None:
    """A consumer that heard an id named (no request left: a stale hint) looks the request
    up before skipping the message it took; a request left and signalled during that look
    (which read before it was put) must still stop the message."""
    from aio_keuss.cancels import encode_request, request_ttl
    from aio_keuss.results import cancel_space

    factory = await _held_factory(connect)
    q = await factory.queue("q1")  # no result_ttl: no look while the handler runs
    store = await factory._results.get()
    look = q._cancel_requests

    async def late(ids: list[str]) -> dict[str, str | None]:
        found = await look(ids)  # read before the request is left
        ttl = request_ttl(q.options.reserve_delay)
        await store.put(cancel_space(q.name), [(i, encode_request(None)) for i in ids], ttl)
        factory.signal.cancels(q.name, ids)
        return found

    q._cancel_requests = late  # type: ignore[method-assign]
    handler = Blocked()
    async with q.consume(handler) as consumer:
        factory.signal.cancels(q.name, ["job-1"])  # heard of before it exists

        async def counted() -> bool:
            return consumer.status().cancelled == 1

        await q.push(1, id="job-1" if q.capabilities.idempotent else None)
        if not q.capabilities.idempotent:
            pytest.skip("needs an explicit id")
        await until(counted, GUARD)
        await _gone(q)
    assert handler.ran == []


async def test_a_cancel_during_a_stops_grace_ends_the_message(connect: Connect) -> None:
    """Stopping with a grace, a handler cancelled on request meanwhile: its message is
    ok-ed (done for good, its result kept), not given back, and the stop ends."""
    factory = await _held_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    handler = Blocked()
    message_id = await q.push(1)
    consumer = q.consume(handler)
    await asyncio.wait_for(handler.began(message_id).wait(), GUARD)
    stopping = asyncio.ensure_future(consumer.stop(grace=GUARD))
    await asyncio.sleep(0.1)
    assert await q.cancel(message_id, reason="grace") is CancelResult.REQUESTED
    await asyncio.wait_for(stopping, GUARD)
    assert (await _kept(q, message_id)).error == "cancelled: grace"
    await _gone(q)
    assert handler.cancelled == [message_id]
    assert consumer.status().cancelled == 1


async def test_a_handler_past_its_timeout_is_still_stopped_on_request(connect: Connect) -> None:
    """Its timeout cancelled it and it is still cleaning up when the request comes: the
    request wins (the message is done for good, its result says cancelled), not a ko."""
    factory = await _held_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    message_id = await q.push(1)
    timed_out, stopped = asyncio.Event(), asyncio.Event()

    async def handler(message: Message) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            timed_out.set()
            try:
                await asyncio.Event().wait()  # a long cleanup
            except asyncio.CancelledError:
                stopped.set()
                raise

    async with q.consume(handler, timeout=0.2) as consumer:
        await asyncio.wait_for(timed_out.wait(), GUARD)
        assert await q.cancel(message_id, reason="late") is CancelResult.REQUESTED
        await asyncio.wait_for(stopped.wait(), GUARD)
        assert (await _kept(q, message_id)).error == "cancelled: late"
        await _gone(q)
        status = consumer.status()
        assert (status.cancelled, status.failed) == (1, 0)


@pytest.mark.parametrize("settings", [{}, {"prefetch": 2}, {"batch": 2}], ids=str)
async def test_a_request_heard_while_the_ok_is_on_its_way_is_used_up(
    connect: Connect, settings: dict[str, Any]
) -> None:
    """The handler returned and its ok is held on its way as the cancel comes: the cancel
    finds the message still reserved, leaves its request and signals; the consumer, its
    handler done, uses the request up once the ok lands, so that the id pushed again past
    its dedup window is a new message that runs."""
    q, used_up = await _reused_id_queue(connect)
    held, release = asyncio.Event(), asyncio.Event()
    ok, ok_many = q.ok, q.ok_many

    async def gate() -> None:
        if not release.is_set():
            held.set()
            await release.wait()

    async def held_ok(message: Any) -> bool:
        await gate()
        return await ok(message)

    async def held_ok_many(messages: Any) -> list[bool]:
        await gate()
        return await ok_many(messages)

    q.ok = held_ok  # type: ignore[method-assign]
    q.ok_many = held_ok_many  # type: ignore[method-assign]
    ran: list[str] = []

    async def handler(message: Message | list[Message]) -> None:
        ran.extend(m.payload for m in (message if isinstance(message, list) else [message]))

    async with q.consume(handler, **settings) as consumer:
        await q.push("first", id="order-1")
        await asyncio.wait_for(held.wait(), GUARD)
        assert await q.cancel("order-1") is CancelResult.REQUESTED
        release.set()
        await until(used_up, GUARD)
        await _gone(q)
        await _a_later_push_runs(q, consumer, ran)


async def _a_later_push_runs(q: aio_keuss.Queue, consumer: Any, ran: list[str]) -> None:
    """Past the queue's dedup window (0.2 s), "order-1" pushed again is a new message, which
    the used-up request does not stop: it runs after "first"."""
    await asyncio.sleep(0.5)

    async def ended() -> bool:
        return len(ran) == 2 or consumer.status().cancelled > 0

    await q.push("second", id="order-1")
    await until(ended, GUARD)
    assert (ran, consumer.status().cancelled) == (["first", "second"], 0)


async def _reused_id_queue(
    connect: Connect, **options: Any
) -> tuple[aio_keuss.Queue, Callable[[], Awaitable[bool]]]:
    """Queue "q1" of a factory that signals little (see ``_held_factory``), with a dedup
    window of 0.2 s, for a test that pushes "order-1" again once its request is used up;
    and the check that it is (skipped where ids cannot be given)."""
    from aio_keuss.cancels import USED
    from aio_keuss.results import cancel_space

    factory = await _held_factory(connect, max_wait_time=0.2)
    needs(factory, "idempotent")
    q = await factory.queue("q1", dedup_window=0.2, **options)
    store = await factory._results.get()

    async def used_up() -> bool:
        return await store.get(cancel_space(q.name), ["order-1"]) == [USED]

    return q, used_up


@pytest.mark.parametrize("retry_delay", [0.0, 0.5], ids=["at-once", "held"])
async def test_a_request_heard_while_a_failed_message_is_deadlettered_is_used_up(
    connect: Connect, retry_delay: float
) -> None:
    """The handler failed on its last try and the ko that deadletters the message is on
    its way as the cancel comes: the cancel finds the message still reserved, leaves its
    request and signals. Once the ko lands the message is done here for good, as after an
    ok, so its consumer uses the request up: left, it would stop the id pushed again past
    its dedup window. ``held``: on a backend without delays (redis-reliable) the ko waits
    out the retry backoff in a task of its own, its worker gone on to other messages."""
    from aio_keuss.cancels import USED
    from aio_keuss.results import cancel_space

    factory = await _held_factory(connect, max_wait_time=0.2, deadletter={"max_ko": 0})
    needs(factory, "idempotent")
    q = await factory.queue("q1", dedup_window=0.2)
    store = await factory._results.get()

    async def used_up() -> bool:
        return await store.get(cancel_space(q.name), ["order-1"]) == [USED]

    held, release = asyncio.Event(), asyncio.Event()
    ko = q._ko  # what the consumer's ko calls

    async def held_ko(message: Any, *args: Any, **kwargs: Any) -> Any:
        held.set()
        await release.wait()
        return await ko(message, *args, **kwargs)

    q._ko = held_ko  # type: ignore[method-assign]
    ran: list[str] = []

    async def handler(message: Message) -> None:
        ran.append(message.payload)
        if message.payload == "first":
            raise RuntimeError("poison")

    async with q.consume(handler, retry_delay=retry_delay) as consumer:
        await q.push("first", id="order-1")
        await asyncio.wait_for(held.wait(), GUARD)
        assert await q.cancel("order-1") is CancelResult.REQUESTED
        release.set()

        async def deadlettered() -> bool:
            return consumer.deadlettered == 1

        await until(deadlettered, GUARD)
        await until(used_up, GUARD)
        await _gone(q)
        await _a_later_push_runs(q, consumer, ran)


async def test_a_request_heard_while_two_deliveries_oks_are_on_their_way_is_used_up(
    connect: Connect,
) -> None:
    """With prefetch, the first delivery's ok is held on its way until its reservation
    lapses and the same consumer takes the message again; the second delivery's ok is held
    too as the cancel comes (the message is still reserved: the request is left). The
    first ok is refused (its reservation is gone), the second taken: the request is used
    up then. Marks kept by id alone let the refused ok drop the second delivery's."""
    q, used_up = await _reused_id_queue(connect, reserve_delay=1.0)
    needs(q, "reservation_expiry")
    gates: list[tuple[int, asyncio.Event, asyncio.Future[list[bool]]]] = []
    ok_many = q.ok_many

    async def held_ok_many(messages: list[Message]) -> list[bool]:
        gate = asyncio.Event()
        landed: asyncio.Future[list[bool]] = asyncio.get_running_loop().create_future()
        gates.append((messages[0].tries, gate, landed))
        await gate.wait()
        try:
            flags = await ok_many(messages)
        except Exception as exc:
            landed.set_exception(exc)
            raise
        landed.set_result(flags)
        return flags

    q.ok_many = held_ok_many  # type: ignore[method-assign]
    ran: list[tuple[str, int]] = []

    async def handler(message: Message) -> None:
        ran.append((message.payload, message.tries))

    async def both_held() -> bool:
        return len(gates) == 2

    async with q.consume(handler, prefetch=2) as consumer:
        await q.push("first", id="order-1")
        await until(both_held, GUARD)  # the second after the first's reservation lapsed
        (first_tries, first, first_landed), (second_tries, second, _) = gates
        assert second_tries > first_tries
        assert await q.cancel("order-1") is CancelResult.REQUESTED
        first.set()
        assert await asyncio.wait_for(first_landed, GUARD) == [False]
        second.set()
        await until(used_up, GUARD)
        await _gone(q)
        assert consumer.status().cancelled == 0
        await asyncio.sleep(0.5)  # past the dedup window: the same id is a new message

        async def ended() -> bool:
            return len(ran) == 3 or consumer.status().cancelled > 0

        gates.clear()
        await q.push("second", id="order-1")
        await until(ended, GUARD)
        for _, gate, _ in gates:
            gate.set()
        assert [payload for payload, _ in ran] == ["first", "first", "second"]
        assert consumer.status().cancelled == 0


def _hold_keep_popped(q: Any) -> tuple[asyncio.Event, asyncio.Event]:
    """Gate the queue's keeping of popped messages' outcomes: the first event is set when
    one is on its way, which waits until the second is set."""
    held, release = asyncio.Event(), asyncio.Event()
    keep = q._keep_popped

    async def held_keep(messages: Any, *args: Any, **kwargs: Any) -> Any:
        held.set()
        await release.wait()
        return await keep(messages, *args, **kwargs)

    q._keep_popped = held_keep
    return held, release


@pytest.mark.parametrize("batch", [0, 2], ids=["one", "batch"])
async def test_a_request_heard_once_a_popped_messages_handler_failed_is_used_up(
    connect: Connect, batch: int
) -> None:
    """Without reserve the message is out of the store from its pop: a cancel leaves its
    request whatever it finds. Heard while the consumer is still done-ing a message whose
    handler failed (its failure result on its way), the request is used up, as after a
    handler that returned: the message is gone for good, nothing else would. (No backend
    without reserve takes explicit ids yet, so there the request left stopped no later
    push; the consumers that heard it still remembered it until it expired.)"""
    from aio_keuss.cancels import USED
    from aio_keuss.results import cancel_space

    factory = await _running_factory(connect, max_wait_time=0.2)
    if factory.capabilities.reserve:
        pytest.skip("a reserved message's failure is a ko (see the deadletter test)")
    q = await factory.queue("q1", result_ttl=TTL)
    store = await factory._results.get()
    held, release = _hold_keep_popped(q)

    async def handler(message: Message | list[Message]) -> None:
        raise RuntimeError("poison")

    message_id = await q.push(1)
    async with q.consume(handler, batch=batch) as consumer:
        await asyncio.wait_for(held.wait(), GUARD)
        assert await q.cancel(message_id) is CancelResult.REQUESTED
        release.set()

        async def used_up() -> bool:
            return await store.get(cancel_space(q.name), [message_id]) == [USED]

        await until(used_up, GUARD)
        assert (await _kept(q, message_id)).error == "RuntimeError: poison"
        status = consumer.status()
        assert (status.failed, status.cancelled) == (1, 0)


def _signal_once(
    q: aio_keuss.Queue, first: Callable[[], Awaitable[None]]
) -> list[asyncio.Task[None]]:
    """The cancel's "cancel" signal held back (in this process and to the others) until
    ``first`` has run: a signal slow to reach its consumer, made certain."""
    bus = q._signal
    cancels = bus.cancels
    sent: list[asyncio.Task[None]] = []

    def held_back(queue: str, ids: Any) -> None:
        async def later() -> None:
            await first()
            cancels(queue, ids)

        sent.append(asyncio.get_running_loop().create_task(later()))

    bus.cancels = held_back  # type: ignore[method-assign]
    return sent


def _lets_go(consumer: Any, message_id: str) -> Callable[[], Awaitable[bool]]:
    """Whether ``consumer`` no longer holds ``message_id`` in any way: not running, not
    prefetched, no ok or held ko of it on its way."""

    async def gone() -> bool:
        return message_id not in consumer._held_ids() and not consumer._oks_unanswered

    return gone


async def _cancel_heard_once_it_landed(
    q: Any, consumer: Any, held: asyncio.Event, release: asyncio.Event, landed: asyncio.Event
) -> None:
    """Push ``order-1`` and cancel it while the consumer's outcome of it is held at a gate
    (``held`` set on arrival, waiting for ``release``, ``landed`` set once done): the cancel
    finds it reserved and leaves a request, then the outcome lands before the cancel's
    signal reaches the consumer, which by then holds the message in no way."""

    async def lands_first() -> None:
        release.set()
        await asyncio.wait_for(landed.wait(), GUARD)
        await until(_lets_go(consumer, "order-1"), GUARD)

    sent = _signal_once(q, lands_first)
    await q.push("first", id="order-1")
    await asyncio.wait_for(held.wait(), GUARD)
    assert await q.cancel("order-1") is CancelResult.REQUESTED
    await asyncio.wait_for(asyncio.gather(*sent), GUARD)


@pytest.mark.parametrize("settings", [{}, {"prefetch": 2}, {"batch": 2}], ids=str)
async def test_a_request_heard_once_the_ok_landed_is_used_up(
    connect: Connect, settings: dict[str, Any]
) -> None:
    """The handler returned and its ok is on its way as the cancel comes: both of the
    cancel's looks find the message still reserved, so the request is left and signalled;
    the ok then lands before the signal reaches the consumer, which no longer holds the
    message as it hears it. It handled the message, whose request stands: it uses the
    request up, so that the id pushed again past its dedup window is a new message that
    runs."""
    q, used_up = await _reused_id_queue(connect)
    held, release, landed = asyncio.Event(), asyncio.Event(), asyncio.Event()
    ok, ok_many = q.ok, q.ok_many

    async def gate(work: Awaitable[Any]) -> Any:
        held.set()
        await release.wait()
        try:
            return await work
        finally:
            landed.set()

    async def held_ok(message: Any) -> bool:
        return bool(await gate(ok(message)))

    async def held_ok_many(messages: Any, *args: Any) -> list[bool]:
        return list(await gate(ok_many(messages, *args)))

    q.ok = held_ok  # type: ignore[method-assign]
    q.ok_many = held_ok_many  # type: ignore[method-assign]
    ran: list[str] = []

    async def handler(message: Message | list[Message]) -> None:
        ran.extend(m.payload for m in (message if isinstance(message, list) else [message]))

    async with q.consume(handler, **settings) as consumer:
        await _cancel_heard_once_it_landed(q, consumer, held, release, landed)
        await until(used_up, GUARD)
        await _gone(q)
        await _a_later_push_runs(q, consumer, ran)


@pytest.mark.parametrize("retry_delay", [0.0, 0.5], ids=["at-once", "held"])
async def test_a_request_heard_once_a_failed_message_was_deadlettered_is_used_up(
    connect: Connect, retry_delay: float
) -> None:
    """As above, with the ko that deadletters a message whose handler failed on its last
    try (held for the retry backoff, on a backend without delays): it lands before the
    consumer hears the signal, and the consumer uses the request up."""
    from aio_keuss.cancels import USED
    from aio_keuss.results import cancel_space

    factory = await _held_factory(connect, max_wait_time=0.2, deadletter={"max_ko": 0})
    needs(factory, "idempotent")
    q = await factory.queue("q1", dedup_window=0.2)
    store = await factory._results.get()

    async def used_up() -> bool:
        return await store.get(cancel_space(q.name), ["order-1"]) == [USED]

    held, release, landed = asyncio.Event(), asyncio.Event(), asyncio.Event()
    ko = q._ko  # what the consumer's ko calls

    async def held_ko(message: Any, *args: Any, **kwargs: Any) -> Any:
        held.set()
        await release.wait()
        try:
            return await ko(message, *args, **kwargs)
        finally:
            landed.set()

    q._ko = held_ko  # type: ignore[method-assign]
    ran: list[str] = []

    async def handler(message: Message) -> None:
        ran.append(message.payload)
        if message.payload == "first":
            raise RuntimeError("poison")

    async with q.consume(handler, retry_delay=retry_delay) as consumer:
        await _cancel_heard_once_it_landed(q, consumer, held, release, landed)
        assert consumer.deadlettered == 1
        await until(used_up, GUARD)
        await _gone(q)
        await _a_later_push_runs(q, consumer, ran)


@pytest.mark.parametrize("batch", [0, 2], ids=["one", "batch"])
async def test_a_request_heard_as_a_stop_cuts_a_popped_message_short_is_used_up(
    connect: Connect, batch: int
) -> None:
    """Without reserve, a stop past its grace cancels a popped message's handler: the
    message is gone for good, its failure kept as cut short. A request heard while that
    failure is on its way named a message that is done: it is used up, as after a handler
    that returned or failed."""
    from aio_keuss.cancels import USED
    from aio_keuss.results import cancel_space

    factory = await _running_factory(connect, max_wait_time=0.2)
    if factory.capabilities.reserve:
        pytest.skip("a reserved message a stop cuts short is given back, not done")
    q = await factory.queue("q1", result_ttl=TTL)
    store = await factory._results.get()
    held, release = _hold_keep_popped(q)
    handler = Blocked()

    async def handle(message: Message | list[Message]) -> None:
        await handler(message[0] if isinstance(message, list) else message)

    message_id = await q.push(1)
    consumer = q.consume(handle, batch=batch)
    await asyncio.wait_for(handler.began(message_id).wait(), GUARD)
    stopping = asyncio.get_running_loop().create_task(consumer.stop(grace=0))
    await asyncio.wait_for(held.wait(), GUARD)
    assert await q.cancel(message_id) is CancelResult.REQUESTED
    release.set()
    await asyncio.wait_for(stopping, GUARD)

    async def used_up() -> bool:
        return await store.get(cancel_space(q.name), [message_id]) == [USED]

    await until(used_up, GUARD)
    assert (await _kept(q, message_id)).error.startswith("cancelled: its consumer stopped")
    assert handler.cancelled == [message_id]
