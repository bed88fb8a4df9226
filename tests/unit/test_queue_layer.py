"""The queue layer's own behaviour, pinned on a recording subclass of the real memory store:
how many store calls concurrent callers make, what a cancelled caller leaves behind. No
database is involved; the store is the real one, only counted."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine, Sequence
from typing import Any

import pytest

import aio_keuss
from aio_keuss import Queue
from aio_keuss.contract import Ack, Entry, Fetched
from aio_keuss.memory import MemoryBackend, MemoryStore
from aio_keuss.options import QueueOptions
from aio_keuss.signal import LocalSignalBus
from aio_keuss.stats import MemoryStats


class RecordingStore(MemoryStore):
    """The memory store, each primitive recorded; a call first waits one loop turn, as a
    round trip to a server would, so that other callers can arrive meanwhile."""

    def __init__(self, *args: Any, in_caller: bool) -> None:
        super().__init__(*args)
        self.run_in_caller = in_caller
        self.uninterruptible = in_caller
        self.calls: list[tuple[str, int]] = []
        self.reserving = asyncio.Event()

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        self.calls.append(("insert", len(entries)))
        await asyncio.sleep(0)
        return await super().insert(entries)

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        self.calls.append(("reserve", n))
        self.reserving.set()
        await asyncio.sleep(0)
        return await super().reserve(n, reserve_delay)

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        self.calls.append(("commit", len(acks)))
        await asyncio.sleep(0)
        return await super().commit(acks)

    def made(self, kind: str) -> list[int]:
        return [size for name, size in self.calls if name == kind]


def _queue(in_caller: bool, **options: Any) -> tuple[Queue, RecordingStore]:
    backend = MemoryBackend({})
    queue_options = QueueOptions().updated(options)
    store = RecordingStore("q", queue_options, backend, in_caller=in_caller)
    queue = Queue(
        "q",
        queue_options,
        store,
        backend.capabilities,
        LocalSignalBus(),
        MemoryStats(),
        None,
    )
    return queue, store


async def test_concurrent_pushes_share_one_insert() -> None:
    queue, store = _queue(in_caller=False)
    await asyncio.gather(*(queue.push(i) for i in range(100)))
    assert store.made("insert") == [100]
    assert await queue.size() == 100


async def test_in_the_callers_task_the_first_runs_at_once_and_the_rest_batch() -> None:
    queue, store = _queue(in_caller=True)
    await asyncio.gather(*(queue.push(i) for i in range(100)))
    assert store.made("insert") == [1, 99]  # nobody waited for company; the rest came along


async def test_push_many_is_cut_at_max_batch() -> None:
    queue, store = _queue(in_caller=False, max_batch=30)
    ids = await queue.push_many(list(range(100)))
    assert sorted(store.made("insert")) == [10, 30, 30, 30]
    popped: list[str] = []
    while batch := await queue.pop_many(100, timeout=0):
        popped.extend(m.id for m in batch)
    assert popped == ids  # order kept across the chunks


async def test_concurrent_reserves_and_oks_share_round_trips() -> None:
    queue, store = _queue(in_caller=False)
    await queue.push_many(list(range(10)))
    held = await asyncio.gather(*(queue.reserve(timeout=0) for _ in range(10)))
    assert store.made("reserve") == [10]
    assert sorted(m.payload for m in held if m is not None) == list(range(10))
    assert all(await asyncio.gather(*(queue.ok(m) for m in held if m is not None)))
    assert store.made("commit") == [10]


async def test_a_push_cancelled_before_its_batch_starts_is_not_written() -> None:
    queue, store = _queue(in_caller=False)
    pushes = [asyncio.ensure_future(queue.push(i)) for i in range(3)]
    await asyncio.sleep(0)  # all three are queued; their batch starts on the next turn
    assert store.made("insert") == []
    pushes[1].cancel()
    await asyncio.gather(*pushes, return_exceptions=True)
    assert pushes[1].cancelled()
    assert store.made("insert") == [2]
    assert sorted(m.payload for m in await queue.pop_many(10, timeout=0)) == [0, 2]


@pytest.mark.parametrize("in_caller", [False, True])
async def test_a_reserve_cancelled_after_the_store_took_gives_the_message_back(
    in_caller: bool,
) -> None:
    queue, store = _queue(in_caller=in_caller)
    await queue.push("only")
    waiter = asyncio.ensure_future(queue.reserve(timeout=5))
    await store.reserving.wait()  # the store has the call: the message is taken
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    again = await queue.reserve(timeout=5)
    assert again is not None and again.payload == "only"
    assert again.tries == 0  # given back unseen: it cost no try


async def test_factory_close_closes_every_queue_when_one_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One queue failing to close (redis-reliable with its server away) stopped the loop:
    # the other queues' consumers ran on after close.
    async def handler(message: aio_keuss.Message) -> None:
        pass

    factory = await aio_keuss.connect("memory")
    first, second = await factory.queue("a"), await factory.queue("b")
    first.consume(handler)
    others = second.consume(handler)

    async def away() -> None:
        raise aio_keuss.KeussConnectionError("the server is away")

    monkeypatch.setattr(first, "close", away)
    with pytest.raises(aio_keuss.KeussConnectionError):
        await factory.close()
    assert others.state == "stopped"


async def test_an_ask_joining_the_factory_s_own_open_of_the_deadletter_queue_gets_its_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An ask with options arriving while the factory opened the deadletter queue for another
    # queue's routing shared that open, with the defaults: refused as already open.
    async with aio_keuss.connect("memory", deadletter={"max_ko": 1}) as factory:
        opening, held = asyncio.Event(), asyncio.Event()
        store = factory.backend.store

        async def gated(name: str, options: QueueOptions) -> Any:
            if name == "__deadletter__" and not held.is_set():
                opening.set()
                await held.wait()
            return await store(name, options)

        monkeypatch.setattr(factory.backend, "store", gated)
        work = asyncio.ensure_future(factory.queue("work"))
        await opening.wait()  # the factory's own open of it is under way
        asked = asyncio.ensure_future(factory.queue("__deadletter__", reserve_delay=45.0))
        await asyncio.sleep(0)  # the ask's first step: it joins that open
        held.set()
        await work
        assert (await asked).options.reserve_delay == 45.0


@pytest.mark.parametrize("prefetch", [0, 2])
async def test_a_stop_is_bounded_when_an_ok_never_returns(
    monkeypatch: pytest.MonkeyPatch, prefetch: int
) -> None:
    # A worker whose handler returned waits for its ok, which a stop lets finish; a server
    # that never answers must still not hold the stop past its grace and ACK_WAIT.
    from aio_keuss import consumer as consumer_module

    monkeypatch.setattr(consumer_module, "ACK_WAIT", 0.3, raising=False)
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("q")
        await q.push({"a": 1})
        handled = asyncio.Event()

        async def handler(message: aio_keuss.Message) -> None:
            handled.set()

        async def never(*args: Any, **kwargs: Any) -> Any:
            await asyncio.Event().wait()  # a dead server: no answer

        monkeypatch.setattr(q, "ok", never)
        monkeypatch.setattr(q, "ok_many", never)
        consumer = q.consume(handler, prefetch=prefetch)
        await asyncio.wait_for(handled.wait(), 10)
        await asyncio.sleep(0.05)  # its ok is on its way
        await asyncio.wait_for(consumer.stop(grace=0.2), 10)
        assert consumer.state == "stopped"


async def test_a_prefetching_consumer_fetches_for_every_waiting_worker() -> None:
    # With prefetch P, a fetch used to reserve P + 1 whatever the number of idle workers:
    # 32 workers with short handlers were fed 11 messages a round trip, one round trip at a
    # time. A fetch now reserves one for each worker waiting on it, plus P.
    queue, store = _queue(in_caller=False)
    await queue.push_many(list(range(100)))
    started: list[int] = []
    release = asyncio.Event()

    async def handler(message: aio_keuss.Message) -> None:
        started.append(message.payload)
        await release.wait()

    consumer = queue.consume(handler, concurrency=8, prefetch=2)
    for _ in range(1000):
        if len(started) == 8:
            break
        await asyncio.sleep(0)
    assert len(started) == 8
    # the first worker fetched alone (1 + 2); the seven behind it waited for that fetch,
    # and the next fetch was for the five of them still without a message (5 + 2)
    assert store.made("reserve") == [3, 7]
    release.set()
    await consumer.stop()
    await queue.close()


async def test_a_stopping_consumer_gives_back_at_once_what_it_prefetched() -> None:
    # A fetch reserves one message for each waiting worker plus the prefetch: a stop that
    # comes while the waiting workers take theirs (here a handler begins it) cancels them,
    # leaving their messages, more than the prefetch, in the buffer. They were held, never
    # to be started, for the whole grace (here as long as the handlers run) instead of
    # going back to the queue for other consumers.
    async with aio_keuss.connect("memory") as factory:
        queue = await factory.queue("jobs")
        started: list[int] = []
        release = asyncio.Event()
        consumers: list[aio_keuss.Consumer] = []

        async def handler(message: aio_keuss.Message) -> None:
            started.append(message.payload)
            if len(started) == 4:
                await consumers[0].stop(grace=None)  # from a handler: begins the stop
            await release.wait()

        consumer = queue.consume(handler, concurrency=8, prefetch=2)
        consumers.append(consumer)
        for _ in range(3000):  # every worker waits for a message
            if consumer._starving == 8:
                break
            await asyncio.sleep(0.01)
        await queue.push_many(list(range(40)))
        for _ in range(3000):  # stopping: the workers not in a handler have ended
            running = sum(not task.done() for task in consumer._workers)
            if consumer.state == "stopped" and running == len(started):
                break
            await asyncio.sleep(0.01)
        assert 4 <= len(started) < 8
        taken: list[aio_keuss.Message] = []
        try:
            for _ in range(300):  # another consumer gets every message no handler started
                taken += await queue.reserve_many(40, timeout=0.03)
                if len(started) + len(taken) == 40:
                    break
            assert len(started) + len(taken) == 40
        finally:
            release.set()
        await asyncio.wait_for(consumer.wait(), 30)


async def _gathering_first(queue: Queue) -> Coroutine[Any, Any, list[aio_keuss.Message]]:
    """A ``pop_many`` that took the one message pushed here and gathers for more: driven by
    hand until it sleeps (a future yielded, not a round trip's bare yield), to be closed."""
    await queue.push("first")
    gathering = queue.pop_many(5, timeout=1, max_wait=30)
    step = gathering.send(None)
    while step is None:
        step = gathering.send(None)
    return gathering


async def test_a_gathering_pop_whose_coroutine_is_closed_puts_back_what_it_took() -> None:
    """A coroutine closed rather than cancelled (a task garbage-collected while pending, an
    interpreter exit) gets GeneratorExit, and may not await anything then: the messages a
    ``pop_many`` gathering for ``max_wait`` had taken go back by a task of their own, instead
    of the put-back (a round trip) raising "coroutine ignored GeneratorExit" unsent."""
    queue, store = _queue(in_caller=True)
    gathering = await _gathering_first(queue)
    gathering.close()
    again = await queue.pop(timeout=1)
    assert again is not None and again.payload == "first"
    assert store.made("insert") == [1, 1]  # the push, then the put-back


async def test_a_put_back_cancelled_again_as_it_yields_a_turn_still_puts_everything_back() -> None:
    """A gathering ``pop_many`` cancelled puts back what it took, in its own task; a second
    cancellation landing while that put-back yields a turn to the loop (the memory store's
    insert does, once per ``PUSH_TURN`` messages) interrupted the insert before it ran, and
    every message taken was lost."""
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("q")
        await q.push_many(list(range(40)))  # more than PUSH_TURN: the put-back yields once
        taking = asyncio.create_task(q.pop_many(100, max_wait=30))
        await asyncio.sleep(0.05)  # took the 40, and gathers for more
        assert await q.size() == 0
        taking.cancel()
        await asyncio.sleep(0)  # its put-back begins, and yields a turn
        taking.cancel()  # a second cancellation (a task group, a shutdown) lands there
        with pytest.raises(asyncio.CancelledError):
            await taking
        assert await q.size() == 40


async def test_a_cancelled_close_lets_a_background_put_back_finish() -> None:
    """The put-back of a closed coroutine (see above) runs in a task of its own, which a
    close waits for. A close cancelled while it waited cancelled that put-back with it
    (``asyncio.gather`` cancels what it gathers), and the messages it carried were lost;
    the rest of a cancelled close is meant to still run (within its grace)."""
    queue, store = _queue(in_caller=True)
    gathering = await _gathering_first(queue)
    gate = asyncio.Event()
    real = store.insert

    async def slow_insert(entries: Sequence[Entry]) -> list[bool]:
        await gate.wait()  # a round trip that takes its time
        return await real(entries)

    store.insert = slow_insert  # type: ignore[method-assign]
    gathering.close()  # its put-back starts in a task of its own, held at the gate
    closing = asyncio.ensure_future(queue.close())
    await asyncio.sleep(0.05)  # the close waits for the put-back
    assert not closing.done()
    closing.cancel()
    await asyncio.sleep(0.05)
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert (await store.sizes()).size == 1  # put back, not lost


async def test_a_rate_limit_on_a_backend_without_the_capability_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every backend shipped has rate limits; one that has none (a third party's) refuses
    a queue with a ``rate_limit`` at open and a ``connect`` default before connecting,
    writing nothing, while a queue without one opens as ever."""
    without = dataclasses.replace(MemoryBackend.capabilities, rate_limit=False)
    monkeypatch.setattr(MemoryBackend, "capabilities", without)
    with pytest.raises(aio_keuss.ConfigError, match="rate limits"):
        await aio_keuss.connect("memory", rate_limit=5)
    async with aio_keuss.connect("memory") as factory:
        with pytest.raises(aio_keuss.ConfigError, match="rate limits"):
            await factory.queue("limited", rate_limit=5)
        assert "limited" not in await factory.list()
        plain = await factory.queue("limited")
        await plain.push("x")
        assert await plain.total_size() == 1
