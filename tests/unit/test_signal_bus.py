"""The listener lifecycle the signal bus base runs for every transport, on a scripted one
(no database involved): each bus module relies on it for open, reconnect and close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from aio_keuss import signal as base
from aio_keuss.errors import KeussConnectionError
from aio_keuss.signal import Signal, SignalBus


class ScriptedBus(SignalBus):
    """Each connection attempt does what the next script word says: ``listen`` (until
    :meth:`drop`), ``fail`` at once, ``slow`` (listen after a while), or ``stall`` (fail
    after a while, never having listened)."""

    def __init__(self, *script: str) -> None:
        super().__init__(debounce=0.0)
        self.script = list(script)
        self.backoffs: list[float] = []
        self.running = 0
        self._drop = asyncio.Event()

    async def _listen(self, ready: Callable[[], None]) -> None:
        self.backoffs.append(self._backoff)
        word = self.script.pop(0) if self.script else "listen"
        self.running += 1
        try:
            if word == "fail":
                raise KeussConnectionError("refused")
            if word in ("slow", "stall"):
                await asyncio.sleep(0.2)
            if word == "stall":
                raise KeussConnectionError("gave up")
            self._drop = asyncio.Event()
            ready()
            await self._drop.wait()
            raise KeussConnectionError("dropped")
        finally:
            self.running -= 1

    def drop(self) -> None:
        self._drop.set()


async def _until(condition: Callable[[], bool], within: float = 2.0) -> None:
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_a_bus_without_listener_opens_at_once() -> None:
    bus = SignalBus()
    await bus.open()
    assert bus._listener is None
    await bus.close()


async def test_open_returns_once_listening() -> None:
    bus = ScriptedBus("slow")
    await bus.open()
    assert bus._listening.is_set() and bus.running == 1
    await bus.close()
    assert bus.running == 0 and bus._listener is None


async def test_a_listener_that_cannot_start_fails_open() -> None:
    bus = ScriptedBus("fail")
    with pytest.raises(KeussConnectionError, match="refused"):
        await bus.open()
    assert bus.backoffs == [base.RECONNECT_FIRST]  # not retried behind open's back
    assert bus._listener is None
    await bus.close()


async def test_a_slow_listener_is_left_to_come_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "OPEN_WAIT", 0.05)
    bus = ScriptedBus("stall", "listen")
    await bus.open()  # gave up waiting: consumers poll meanwhile
    assert not bus._listening.is_set()
    await _until(bus._listening.is_set)  # its failure after open was retried, not raised
    assert len(bus.backoffs) == 2
    await bus.close()


async def test_reconnects_with_capped_backoff_and_wakes_every_queue(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(base, "RECONNECT_CAP", 0.2)
    monkeypatch.setattr(base, "STABLE_AFTER", 0.05)
    bus = ScriptedBus("listen", "fail", "fail", "fail", "listen")
    await bus.open()
    woken: list[Signal] = []
    bus.subscribe("a", woken.append)
    bus.subscribe("b", woken.append)
    caplog.set_level(logging.DEBUG, logger="aio_keuss.signal")
    bus.drop()
    await _until(lambda: len(bus.backoffs) == 5 and bus.running == 1)
    assert bus.backoffs == [0.05, 0.1, 0.2, 0.2, 0.2]
    # woken when it is lost (look now: the server may be away), and when it is back told
    # to resync (what was sent meanwhile is lost: woken, paused flag read again)
    assert sorted((s.queue, s.kind) for s in woken) == [
        ("a", "insert"),
        ("a", "resync"),
        ("b", "insert"),
        ("b", "resync"),
    ]
    await _until(lambda: bus._backoff == base.RECONNECT_FIRST)  # back once it stayed
    levels = [r.levelno for r in caplog.records if r.name == "aio_keuss.signal"]
    assert levels.count(logging.WARNING) == 1  # once per outage, not per attempt
    assert levels[-1] == logging.INFO  # and once when it is back
    await bus.close()
    assert bus.running == 0


async def test_a_listener_lost_soon_after_it_came_back_is_the_same_outage(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A cluster in a fail state accepts a subscribe, then drops it: each comeback is short.
    # That flapping is one outage (one warning), its reconnects backing off; it is back
    # (logged, backoff reset) once the listener stayed STABLE_AFTER, and only a loss after
    # that is a new outage.
    monkeypatch.setattr(base, "RECONNECT_CAP", 0.2)
    monkeypatch.setattr(base, "STABLE_AFTER", 3600.0)
    bus = ScriptedBus("listen")
    await bus.open()
    caplog.set_level(logging.DEBUG, logger="aio_keuss.signal")

    def said(level: int) -> int:
        return [r.levelno for r in caplog.records if r.name == "aio_keuss.signal"].count(level)

    for attempt in range(2, 6):
        bus.drop()
        await _until(lambda: len(bus.backoffs) == attempt and bus.running == 1)  # noqa: B023
    # each attempt records the backoff its successor will sleep: never reset by a comeback
    assert bus.backoffs == [0.05, 0.1, 0.2, 0.2, 0.2]
    assert said(logging.WARNING) == 1 and said(logging.INFO) == 0
    monkeypatch.setattr(base, "STABLE_AFTER", 0.05)  # this time it stays
    bus.drop()
    await _until(lambda: len(bus.backoffs) == 6 and bus.running == 1)
    await _until(lambda: said(logging.INFO) == 1)
    assert bus._backoff == base.RECONNECT_FIRST and said(logging.WARNING) == 1
    bus.drop()  # a new outage
    await _until(lambda: len(bus.backoffs) == 7 and bus.running == 1)
    assert said(logging.WARNING) == 2
    await bus.close()


async def test_close_during_backoff_and_cancelled_open_leave_no_task() -> None:
    bus = ScriptedBus("listen", "fail")
    await bus.open()
    bus.drop()
    await _until(lambda: len(bus.backoffs) == 2)  # now asleep before the third attempt
    listener = bus._listener
    await bus.close()
    assert listener is not None and listener.cancelled()

    stuck = ScriptedBus("slow")
    opening = asyncio.create_task(stuck.open())
    await _until(lambda: stuck.running == 1)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert stuck.running == 0 and stuck._listener is None


async def test_listeners_are_a_set_each_told_once_even_if_one_leaves_while_called() -> None:
    """A listener subscribed twice is told once and leaves with one unsubscribe; one that
    unsubscribes another while it is told does not keep it from this signal, only from the
    next (the listeners are read as they were when the signal went out)."""
    bus = SignalBus()
    heard: list[str] = []
    first = bus.subscribe("q", lambda s: heard.append("first"))

    def second(signal: Signal) -> None:
        heard.append("second")
        leave_third()

    def third(signal: Signal) -> None:
        heard.append("third")

    bus.subscribe("q", second)
    leave_second = bus.subscribe("q", second)
    leave_third = bus.subscribe("q", third)
    bus.insert("q", 0.0, 1)
    assert sorted(heard) == ["first", "second", "third"]
    heard.clear()
    bus.insert("q", 0.0, 1)
    assert sorted(heard) == ["first", "second"]
    heard.clear()
    leave_second()
    first()
    bus.insert("q", 0.0, 1)
    assert heard == []
    assert "q" not in bus._listeners  # nothing left behind for a queue nobody hears
    await bus.close()


class _Published(SignalBus):
    """A bus whose transport keeps what it would send to other processes."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []

    async def _publish(self, payload: bytes) -> None:
        self.sent.append(payload)


def _older_release_wakes(signal: Signal, paused: bool = False) -> bool:
    """Whether a queue of a release before the grant signal (7e26c7d's
    ``Queue._on_signal``, subscribed on the queue's name) woke its consumers on ``signal``:
    an insert woke ``count`` of them, any other kind read as a control signal (a kind it does
    not know does nothing there) and then woke them all, unless the queue was paused."""
    if signal.kind == "insert":
        return not paused and signal.count != 0
    return not paused


async def test_a_grant_signal_is_dropped_by_an_older_releases_queue_listener() -> None:
    """During a rolling upgrade, the grant signal this release publishes (a give-back of the
    last grant due) reaches processes of a release that knows no grant signal: routed on
    the queue's own name, each of them woke all its consumers of that queue, every one then
    costing a limiter round trip for nothing. Routed apart (as results and cancels are), no
    queue listener of theirs hears it, while this release's grant listeners still do."""
    new = _Published()
    new.granted("q1")
    await new.published()
    (payload,) = new.sent
    # an older release's bus: the same _receive, its queue listener subscribed on the name
    older = SignalBus()
    heard: list[Signal] = []
    older.subscribe("q1", heard.append)
    older._receive(payload)
    assert not any(_older_release_wakes(signal) for signal in heard), heard
    # this release's processes hear it on the grant route, not on the queue's own
    other = SignalBus()
    grants: list[Signal] = []
    queue_heard: list[Signal] = []
    other.subscribe_grants("q1", grants.append)
    other.subscribe("q1", queue_heard.append)
    other._receive(payload)
    assert [s.kind for s in grants] == ["grant"] and not queue_heard
    await new.close()
    await older.close()
    await other.close()
