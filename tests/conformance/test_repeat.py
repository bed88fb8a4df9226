"""Conformance: repeatable pushes (``Queue.repeat``) on every backend that has explicit ids
and delays, and their refusal (before anything is written) elsewhere.

Occurrences come every 0.5 s. Nothing here asserts a time or a duration: the tests wait, with
generous bounds, for ids, counts and uniqueness, and an occurrence a loaded machine skips
(a repeater that woke after the next one was due) only makes a wait longer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import pytest
from backends import BackendCase
from conftest import Connect, needs

import aio_keuss
import aio_keuss.repeat
from aio_keuss import Message

pytestmark = pytest.mark.timeout(90)

EVERY = 0.5
WAIT = 20.0


async def _distinct(queues: list[aio_keuss.Queue], count: int) -> list[Message]:
    """Pop from ``queues`` until ``count`` messages are in (all of them, duplicates too)."""
    got: list[Message] = []
    deadline = time.monotonic() + WAIT
    while len({m.id for m in got}) < count:
        assert time.monotonic() < deadline, f"only {len(got)} occurrences in {WAIT} s"
        for q in queues:
            message = await q.pop(timeout=0.2)
            if message is not None:
                got.append(message)
    return got


async def _empty(q: aio_keuss.Queue) -> list[Message]:
    """Pop until nothing is left, the occurrence still delayed included."""
    got: list[Message] = []
    deadline = time.monotonic() + WAIT
    while await q.total_size() > 0:
        assert time.monotonic() < deadline
        message = await q.pop(timeout=1.0)
        if message is not None:
            got.append(message)
    return got


def _repeatable(holder: aio_keuss.Factory | aio_keuss.Queue) -> None:
    needs(holder, "idempotent", "delay")


async def test_occurrences_arrive_with_their_ids_and_headers(queue: aio_keuss.Queue) -> None:
    _repeatable(queue)
    async with queue.repeat("tick", {"n": 1}, every=EVERY, headers={"who": "test"}) as repeater:
        assert repeater.state == "running"
        got = await _distinct([queue], 3)
    assert repeater.state == "stopped"
    for message in got:
        key, _, ms = message.id.partition("@")
        assert key == "tick" and int(ms) % 500 == 0  # aligned to the epoch
        assert message.payload == {"n": 1}
        assert message.headers["repeat"] == "tick" and message.headers["who"] == "test"
        scheduled = datetime.fromisoformat(str(message.headers["scheduled"]))
        assert scheduled.utcoffset() is not None and scheduled.utcoffset().total_seconds() == 0
        assert round(scheduled.timestamp() * 1000) == int(ms)
    assert len({m.id for m in got}) == len(got)
    assert repeater.pushed >= 3 and repeater.failure is None


async def test_occurrences_carry_the_payload_as_it_was_given(queue: aio_keuss.Queue) -> None:
    """The payload is checked when repeat() is called, so that is the payload pushed: a
    caller changing the object afterwards (reusing a dict) neither changes the occurrences
    nor, with something that cannot be stored, stops the repeater."""
    _repeatable(queue)
    payload: dict[str, object] = {"n": 1}
    async with queue.repeat("given", payload, every=EVERY) as repeater:
        payload["n"] = 2
        payload["later"] = {1, 2}  # a set: no payload can hold it
        got = await _distinct([queue], 2)
        assert repeater.failure is None
    assert [m.payload for m in got] == [{"n": 1}] * len(got)


async def test_cron_repeat_keeps_its_next_occurrence_queued(queue: aio_keuss.Queue) -> None:
    _repeatable(queue)
    repeater = queue.repeat("minutely", "x", cron="* * * * *", tz="Europe/Madrid")
    deadline = time.monotonic() + WAIT
    while repeater.pushed == 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await repeater.stop()
    # the next minute, delayed (and the one before, should a minute have turned meanwhile)
    assert 1 <= await queue.total_size() <= repeater.pushed
    assert repeater.next_at is not None
    assert repeater.next_at.second == 0 and repeater.next_at.microsecond == 0
    if queue.capabilities.remove:
        assert await queue.remove(f"minutely@{round(repeater.next_at.timestamp() * 1000)}")


async def test_two_processes_push_each_occurrence_once(case: BackendCase, connect: Connect) -> None:
    first = await connect()
    _repeatable(first)
    # two processes' worth: two factories on one server (one, where queues are not shared)
    second = await connect() if case.shared else first
    q1, q2 = await first.queue("q1"), await second.queue("q1")
    r1 = q1.repeat("both", {"p": 1}, every=EVERY)
    r2 = q2.repeat("both", {"p": 1}, every=EVERY)
    got = await _distinct([q1, q2], 3)
    await asyncio.gather(r1.stop(), r2.stop())
    got += await _empty(q1)
    ids = [m.id for m in got]
    assert len(ids) == len(set(ids)), f"an occurrence came twice: {sorted(ids)}"
    assert r1.pushed >= 1 and r2.pushed >= 1


async def test_stop_stops_pushing(queue: aio_keuss.Queue) -> None:
    _repeatable(queue)
    repeater = queue.repeat("stopped", 0, every=EVERY)
    deadline = time.monotonic() + WAIT
    while await queue.total_size() == 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await repeater.stop()
    await repeater.stop()  # again: nothing more to do
    assert repeater.state == "stopped"
    left = await _empty(queue)  # the occurrence it had queued is still delivered
    assert len(left) <= 2
    await asyncio.sleep(3 * EVERY)
    assert await queue.total_size() == 0


async def test_close_stops_its_repeaters(case: BackendCase, connect: Connect) -> None:
    factory = await connect()
    _repeatable(factory)
    q = await factory.queue("q1")
    repeater = q.repeat("closing", 0, every=EVERY)
    deadline = time.monotonic() + WAIT
    while repeater.pushed == 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await factory.close()
    assert repeater.state == "stopped" and repeater.failure is None
    with pytest.raises(aio_keuss.ClosedError):
        q.repeat("late", 0, every=EVERY)
    if case.shared:  # seen from another process: nothing pushed after the close
        other = await (await connect()).queue("q1")
        await _empty(other)
        await asyncio.sleep(3 * EVERY)
        assert await other.total_size() == 0


BAD_INPUT: list[tuple[dict[str, object], type[Exception]]] = [
    ({"key": "k", "payload": 1}, aio_keuss.InvalidInputError),  # neither every nor cron
    ({"key": "k", "payload": 1, "every": 1, "cron": "* * * * *"}, aio_keuss.InvalidInputError),
    ({"key": "k", "payload": 1, "every": 0}, aio_keuss.InvalidDelayError),
    ({"key": "k", "payload": 1, "every": -5}, aio_keuss.InvalidDelayError),
    ({"key": "k", "payload": 1, "every": True}, aio_keuss.InvalidDelayError),
    ({"key": "k", "payload": 1, "every": "60"}, aio_keuss.InvalidDelayError),
    ({"key": "k", "payload": 1, "cron": "61 * * * *"}, aio_keuss.InvalidInputError),
    ({"key": "k", "payload": 1, "cron": "* * * *"}, aio_keuss.InvalidInputError),
    (
        {"key": "k", "payload": 1, "cron": "0 0 * * *", "tz": "Nowhere/Town"},
        aio_keuss.InvalidInputError,
    ),
    ({"key": "", "payload": 1, "every": 1}, aio_keuss.InvalidInputError),
    ({"key": 7, "payload": 1, "every": 1}, aio_keuss.InvalidInputError),
    ({"key": "has space", "payload": 1, "every": 1}, aio_keuss.InvalidIdError),
    ({"key": "k" * 200, "payload": 1, "every": 1}, aio_keuss.InvalidIdError),
    ({"key": "k", "payload": float("nan"), "every": 1}, aio_keuss.InvalidPayloadError),
    ({"key": "k", "payload": (1, 2), "every": 1}, aio_keuss.InvalidPayloadError),
    ({"key": "k", "payload": 1, "every": 1, "headers": {"a": []}}, aio_keuss.InvalidHeadersError),
    (
        {"key": "k", "payload": 1, "every": 1, "headers": {"repeat": "x"}},
        aio_keuss.InvalidHeadersError,
    ),
]


async def test_bad_input_is_refused_before_anything_is_written(queue: aio_keuss.Queue) -> None:
    """On every backend, capable or not: input is checked before the backend's abilities."""
    for given, error in BAD_INPUT:
        arguments = dict(given)
        key, payload = arguments.pop("key"), arguments.pop("payload")
        with pytest.raises(error):
            queue.repeat(key, payload, **arguments)  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    assert await queue.total_size() == 0


def _host_zone() -> ZoneInfo:
    """The host's own zone as a ``ZoneInfo`` (skipped where the zone directory has none)."""
    try:
        return ZoneInfo("localtime")
    except (ZoneInfoNotFoundError, ValueError):
        pytest.skip("no 'localtime' in this system's zone directory")


async def test_the_host_zone_is_refused_as_a_zoneinfo_too(queue: aio_keuss.Queue) -> None:
    """Refused as the name "localtime" is, before anything is written: each machine's own
    zone would make processes on machines in different zones fire every occurrence at
    different instants, under different ids, so the dedup could not keep one."""
    with pytest.raises(aio_keuss.InvalidInputError, match="tz"):
        queue.repeat("k", 1, cron="0 0 * * *", tz=_host_zone())
    await asyncio.sleep(0.1)
    assert await queue.total_size() == 0


async def test_backend_without_ids_or_delay_is_refused(queue: aio_keuss.Queue) -> None:
    capabilities = queue.capabilities
    if capabilities.idempotent and capabilities.delay:
        pytest.skip("this backend can repeat")
    with pytest.raises(aio_keuss.NotSupportedError):
        queue.repeat("k", 1, every=EVERY)
    with pytest.raises(aio_keuss.NotSupportedError):
        queue.repeat("k", 1, cron="* * * * *")
    await asyncio.sleep(0.1)
    assert await queue.total_size() == 0


async def test_period_beyond_dedup_window_is_logged(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    factory = await connect(dedup_window=100.0)
    _repeatable(factory)
    needs(factory, "shared")
    q = await factory.queue("q1")
    with caplog.at_level(logging.WARNING, logger="aio_keuss.queue"):
        async with q.repeat("often", 1, every=30.0):
            pass
        assert not caplog.records
        async with q.repeat("daily", 1, cron="0 3 * * *"):
            pass
    (record,) = caplog.records
    assert "dedup_window" in record.getMessage() and "'daily'" in record.getMessage()


async def test_a_worker_runs_its_repeats_or_refuses_the_backend(connect: Connect) -> None:
    """``run_worker(repeats=...)``: the worker consumes the occurrences its own repeat
    pushes; a backend that cannot repeat is refused once connected, before anything is
    pushed or consumed."""
    factory = await connect()
    q = await factory.queue("q1")
    await q.push({"n": 0})  # there to be consumed, unless the worker is refused
    stop = asyncio.Event()
    handled: list[str] = []

    async def note(message: Message) -> None:
        handled.append(message.id)
        if len({i for i in handled if i.startswith("tick@")}) >= 3:
            stop.set()

    tick = aio_keuss.Repeat("q1", "tick", {"n": 1}, every=EVERY)
    running = aio_keuss.run_worker(note, "q1", repeats=[tick], factory=factory, stop=stop)
    if not (factory.capabilities.idempotent and factory.capabilities.delay):
        with pytest.raises(aio_keuss.NotSupportedError, match="cannot repeat"):
            await running
        assert handled == []
        await asyncio.sleep(0.1)
        assert await q.total_size() == 1
        return
    await asyncio.wait_for(running, 2 * WAIT)
    ticks = [i for i in handled if i.startswith("tick@")]
    assert len(ticks) == len(set(ticks)) >= 3


async def test_a_worker_repeats_with_a_priority_or_refuses_the_backend(connect: Connect) -> None:
    """``Repeat(priority=...)``: each occurrence carries it; a backend without priorities
    is refused once connected, before anything is pushed (as one that cannot repeat)."""
    factory = await connect()
    needs(factory, "idempotent", "delay")
    with pytest.raises(aio_keuss.InvalidInputError, match="priority"):
        aio_keuss.Repeat("q1", "tick", every=EVERY, priority=2**15).check()
    stop = asyncio.Event()
    seen: list[int] = []

    async def note(message: Message) -> None:
        seen.append(message.priority)
        stop.set()

    tick = aio_keuss.Repeat("q1", "tick", every=EVERY, priority=5)
    running = aio_keuss.run_worker(note, "q1", repeats=[tick], factory=factory, stop=stop)
    if not factory.capabilities.priority:
        with pytest.raises(aio_keuss.NotSupportedError, match="has no priorities"):
            await running
        assert await (await factory.queue("q1")).total_size() == 0
        return
    await asyncio.wait_for(running, 2 * WAIT)
    assert seen and set(seen) == {5}


async def test_a_late_wake_counts_and_logs_the_occurrences_it_skips(
    queue: aio_keuss.Queue, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A repeater woken more than a period late (a loaded loop, a long pause, a suspended
    machine) skips what fell due meanwhile (not made up, as the README says), and counts
    each skipped occurrence in ``missed``. The clock the repeater reads is the test's: it
    stands still until the test steps it past ten occurrences, so nothing here depends on
    how fast the machine is."""
    _repeatable(queue)
    period = 60.0
    now = [(time.time() // period) * period + 1.0]  # just after an occurrence
    monkeypatch.setattr(aio_keuss.repeat, "clock", lambda: now[0])
    monkeypatch.setattr(aio_keuss.repeat, "LONGEST_NAP", 0.05)  # reads the clock often
    with caplog.at_level(logging.WARNING, logger="aio_keuss.repeat"):
        repeater = queue.repeat("late", 1, every=period)
        deadline = time.monotonic() + WAIT
        while repeater.pushed < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert repeater.next_at is not None
        first = repeater.next_at.timestamp()
        assert first == now[0] - 1.0 + period
        now[0] = first + 10.5 * period  # woken 10.5 periods late: 10 skipped
        while repeater.pushed < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await repeater.stop()
    assert repeater.next_at is not None and repeater.next_at.timestamp() == first + 11 * period
    assert repeater.missed == 10
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "10 occurrences" in record.getMessage() and "'late'" in record.getMessage()
    if queue.capabilities.remove:
        for t in (first, first + 11 * period):
            assert await queue.remove(f"late@{round(t * 1000)}")
