"""The debounce of the signal bus, on a recording transport (no database involved)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import orjson

from aio_keuss.signal import Signal, SignalBus


class RecordingBus(SignalBus):
    def __init__(self, debounce: float) -> None:
        super().__init__(debounce)
        self.sent: list[dict[str, object]] = []

    async def _publish(self, payload: bytes) -> None:
        self.sent.append(orjson.loads(payload))


async def test_burst_sends_first_at_once_and_trailing_with_earliest_mature() -> None:
    bus = RecordingBus(debounce=0.1)
    local: list[Signal] = []
    bus.subscribe("q", local.append)
    for mature in (5.0, 3.0, 4.0, 9.0):
        bus.insert("q", mature)
    await asyncio.sleep(0)
    assert [s["m"] for s in bus.sent] == [5.0]  # the first goes out at once
    assert len(local) == 4  # this process is told every time, undebounced
    await asyncio.sleep(0.15)
    assert [s["m"] for s in bus.sent] == [5.0, 3.0]  # trailing, earliest mature of the rest
    await asyncio.sleep(0.15)
    assert len(bus.sent) == 2  # quiet window: nothing more
    bus.insert("q", 1.0)
    await asyncio.sleep(0)
    assert len(bus.sent) == 3
    await bus.close()


async def test_queues_are_debounced_separately_and_pause_is_not() -> None:
    bus = RecordingBus(debounce=0.1)
    bus.insert("a", 1.0)
    bus.insert("b", 1.0)
    bus.paused("a", True)
    bus.paused("a", False)
    await asyncio.sleep(0)
    assert [(s["q"], s["k"]) for s in bus.sent] == [
        ("a", "insert"),
        ("b", "insert"),
        ("a", "pause"),
        ("a", "resume"),
    ]
    await bus.close()


async def test_own_echo_is_ignored_and_others_delivered() -> None:
    bus = RecordingBus(debounce=0.05)
    got: list[Signal] = []
    bus.subscribe("q", got.append)
    bus._receive(orjson.dumps({"o": bus.origin, "q": "q", "k": "insert", "m": 1.0}))
    bus._receive(orjson.dumps({"o": "someone-else", "q": "q", "k": "insert", "m": 2.0}))
    bus._receive(b"not json")
    assert got == [Signal("q", "insert", 2.0)]
    await bus.close()


class SwallowingBus(SignalBus):
    """A transport that, like redis-py reconnecting inside its retry loop, catches the first
    cancellation as a connection error and goes on reading."""

    async def _listen(self, ready: Callable[[], None]) -> None:
        ready()
        with contextlib.suppress(asyncio.CancelledError):  # taken for a lost connection
            await asyncio.Event().wait()
        await asyncio.Event().wait()


async def test_close_stops_a_listener_that_swallowed_its_cancellation() -> None:
    bus = SwallowingBus()
    await bus.open()
    async with asyncio.timeout(30):  # only keeps a broken run from hanging the suite
        await bus.close()


async def test_close_sends_the_trailing_signal_of_an_open_window() -> None:
    """The last signal of a burst (what a queue closing just before announced) goes out
    when the bus closes inside its debounce window, instead of being dropped by it."""
    bus = RecordingBus(debounce=10.0)
    bus.insert("q", 5.0, 1)
    bus.insert("q", 7.0, 2)  # folded into the window's trailing signal
    await bus.close()
    assert [(s["m"], s["n"]) for s in bus.sent] == [(5.0, 1), (7.0, 2)]
