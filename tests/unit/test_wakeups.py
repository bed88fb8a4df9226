"""Waking only as many waiting consumers as new messages need (no thundering herd), and
never leaving a ready message with every consumer asleep. Pinned on the recording memory
store: how many reserve round trips waiting consumers make. No timing is asserted; the
poll interval is an hour, so a message found at all was found by a wake-up."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from test_queue_layer import RecordingStore, _queue
from test_signal_debounce import RecordingBus

from aio_keuss import Message, Queue
from aio_keuss.contract import Entry
from aio_keuss.ids import new_id
from aio_keuss.message import encode_headers, encode_payload
from aio_keuss.signal import Signal
from aio_keuss.wakeups import Wakeups

HOUR = 3600.0


async def _asleep(store: RecordingStore, waiters: int) -> None:
    """Until ``waiters`` consumers made their first (empty) reserve and went to sleep."""
    await _until(lambda: _asked(store) >= waiters)
    for _ in range(5):
        await asyncio.sleep(0)
    store.calls.clear()


def _asked(store: RecordingStore) -> int:
    """Messages asked for by reserves (one per consumer that tried): coalesced round trips
    carry several consumers' requests."""
    return sum(store.made("reserve"))


async def _consumers(queue: Queue, count: int, got: list[Message]) -> list[asyncio.Task[None]]:
    async def consume() -> None:
        while True:
            message = await queue.reserve()
            if message is None:
                return
            got.append(message)
            await queue.ok(message)

    return [asyncio.create_task(consume()) for _ in range(count)]


async def _stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _until(check: object, turns: int = 10_000) -> None:
    for _ in range(turns):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("not reached")


async def test_a_push_wakes_one_of_64_waiting_consumers() -> None:
    queue, store = _queue(in_caller=True, poll_interval=HOUR)
    got: list[Message] = []
    tasks = await _consumers(queue, 64, got)
    await _asleep(store, 64)
    for n in range(5):
        await queue.push(n)
        await _until(lambda n=n: len(got) == n + 1)
        for _ in range(5):
            await asyncio.sleep(0)
    assert sorted(m.payload for m in got) == [0, 1, 2, 3, 4]
    # per push: the woken consumer, its next try after its ok (and a baton pass): not 64
    assert _asked(store) <= 5 * 3
    await _stop(tasks)


async def test_a_batch_wakes_as_many_as_it_brings() -> None:
    queue, store = _queue(in_caller=True, poll_interval=HOUR)
    got: list[Message] = []
    tasks = await _consumers(queue, 64, got)
    await _asleep(store, 64)
    await queue.push_many(list(range(10)))
    await _until(lambda: len(got) == 10)
    for _ in range(10):
        await asyncio.sleep(0)
    assert sorted(m.payload for m in got) == list(range(10))
    # each woken consumer, its next try after its ok, a baton pass each: not 64 + 10
    assert _asked(store) <= 3 * 10
    await _stop(tasks)


async def test_an_unknown_count_wakes_everyone() -> None:
    queue, store = _queue(in_caller=True, poll_interval=HOUR)
    got: list[Message] = []
    tasks = await _consumers(queue, 8, got)
    await _asleep(store, 8)
    queue._on_signal(Signal("q", "insert", 0.0, None))  # e.g. from an older release
    await _until(lambda: _asked(store) == 8)
    await _stop(tasks)


async def test_a_backlog_pulls_sleepers_in_even_when_the_count_was_short() -> None:
    """Messages that arrived with no signal at all (count 0): the one consumer woken by a
    later signal passes the baton until every message is taken."""
    queue, store = _queue(in_caller=True, poll_interval=HOUR)
    got: list[Message] = []
    tasks = await _consumers(queue, 16, got)
    await _asleep(store, 16)
    await store.insert(_entries(40))  # behind the queue's back
    queue._on_signal(Signal("q", "insert", 0.0, 1))
    await _until(lambda: len(got) == 40)
    await _stop(tasks)


async def test_a_woken_consumer_that_leaves_hands_its_wake_up_on() -> None:
    queue, store = _queue(in_caller=True, poll_interval=HOUR)
    got: list[Message] = []
    first = asyncio.create_task(queue.reserve())  # the longest waiting: woken first
    await _asleep(store, 1)
    tasks = await _consumers(queue, 3, got)
    await _asleep(store, 3)
    queue._on_signal(Signal("q", "insert", 0.0, 1))  # wakes ``first``...
    first.cancel()  # ... which is cancelled before it fetches
    with contextlib.suppress(asyncio.CancelledError):
        await first
    await store.insert(_entries(1))
    await _until(lambda: len(got) == 1)  # another consumer took the wake-up and the message
    await _stop(tasks)


async def test_the_line_wakes_the_longest_sleeping_until_the_count_is_covered() -> None:
    line = Wakeups()
    woke: list[str] = []

    async def sleeper(name: str, wanted: int) -> None:
        if await line.sleep(wanted, HOUR):
            woke.append(name)

    a, b, c = (asyncio.create_task(sleeper(x, w)) for x, w in (("a", 1), ("b", 5), ("c", 1)))
    await _until(lambda: len(line) == 3)
    line.wake(3)  # a (1) and b (5) cover 3
    await _until(lambda: len(woke) == 2)
    assert woke == ["a", "b"] and len(line) == 1
    line.announce(1)
    await _until(lambda: woke == ["a", "b", "c"])
    assert line.announced == 0  # a sleeper covered it: those fetching need not look again
    line.announce(1)
    assert line.announced == 1  # nobody asleep: left to whoever is fetching
    d = asyncio.create_task(sleeper("d", 1))
    e = asyncio.create_task(sleeper("e", 1))
    await _until(lambda: len(line) == 2)
    line.wake(1)  # d is woken ...
    d.cancel()  # ... but cancelled before it runs: its wake-up goes on to e
    await _until(lambda: "e" in woke)
    await asyncio.gather(a, b, c, e)


async def test_with_nobody_asleep_what_is_announced_is_left_to_those_fetching() -> None:
    line = Wakeups()
    line.announce(2)
    line.announce(None)  # an unknown count, a resume, a drain or a close
    assert line.announced == 2
    line.announce(0)  # nothing new: those fetching need not look again
    assert line.announced == 2


async def test_remote_signals_carry_their_count_and_merge_it_in_the_window() -> None:
    bus = RecordingBus(debounce=0.05)
    bus.insert("q", 5.0, 3)
    bus.insert("q", 4.0, 2)
    bus.insert("q", 6.0, 4)
    await asyncio.sleep(0.1)
    assert [(s["m"], s["n"]) for s in bus.sent] == [(5.0, 3), (4.0, 6)]
    bus.insert("r", 1.0)
    bus.insert("r", 1.0, 2)
    await asyncio.sleep(0.1)
    assert [s["n"] for s in bus.sent if s["q"] == "r"] == [None, 2]
    got: list[Signal] = []
    bus.subscribe("q", got.append)
    bus._receive(orjson.dumps({"o": "other", "q": "q", "k": "insert", "m": 1.0, "n": 7}))
    bus._receive(orjson.dumps({"o": "other", "q": "q", "k": "insert", "m": 1.0}))  # older
    assert [s.count for s in got] == [7, None]
    await bus.close()


def _entries(n: int) -> list[Entry]:
    return [Entry(new_id(), encode_payload(i), encode_headers(None)) for i in range(n)]
