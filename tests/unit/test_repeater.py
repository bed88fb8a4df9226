"""The repeater's own behaviour, fed a push function instead of a queue: failed pushes are
retried with backoff without the repeater dying, an error that cannot heal stops it, and a
stop is idempotent and cancellation-safe. No timing is asserted: the tests wait, with
generous bounds, for counts and states."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest

from aio_keuss import InvalidInputError, KeussConnectionError, Repeater, repeat
from aio_keuss.message import Headers
from aio_keuss.repeat import RepeatPlan, occurrence_id

WAIT = 20.0


async def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


class Pushes:
    """A push function that fails ``fail`` times first (or raises ``error`` for ever)."""

    def __init__(self, fail: int = 0, error: Exception | None = None) -> None:
        self.fail = fail
        self.error = error
        self.calls = 0
        self.ids: list[str] = []
        self.delays: list[float] = []

    async def __call__(self, delay: float, headers: Headers, message_id: str) -> str:
        self.calls += 1
        await asyncio.sleep(0)
        if self.error is not None:
            raise self.error
        if self.fail:
            self.fail -= 1
            raise KeussConnectionError("server away")
        self.ids.append(message_id)
        self.delays.append(delay)
        assert headers["repeat"] == "k"
        return message_id


def _start(push: Pushes, every: float = 0.2) -> tuple[Repeater, list[Repeater]]:
    stopped: list[Repeater] = []
    plan = RepeatPlan.make("k", every, None, "UTC", {"h": 1})
    return Repeater(plan, "q", push, stopped.append), stopped


async def test_failed_pushes_are_retried_and_the_outage_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    push = Pushes(fail=3)
    began = time.time()
    repeater, stopped = _start(push, every=30.0)
    await _until(lambda: repeater.pushed == 1)
    assert push.calls == 4 and repeater.state == "running" and repeater.failure is None
    assert isinstance(repeater.last_error, KeussConnectionError)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "repeat 'k'" in warnings[0].getMessage()
    # the first occurrence after the start, on the 30 s grid (the one after, had the
    # retries run past the first: it is skipped, not pushed late)
    first = repeater.schedule.next_after(began)
    second = repeater.schedule.next_after(first)
    (pushed,) = push.ids
    assert pushed == occurrence_id("k", first if repeater.missed == 0 else second)
    assert 0 < push.delays[0] <= 30.0
    await repeater.stop()
    assert stopped == [repeater]


async def test_pushes_failing_past_an_occurrence_skip_it_and_go_on() -> None:
    push = Pushes(error=KeussConnectionError("server away"))
    repeater, _ = _start(push, every=0.2)
    await _until(lambda: repeater.missed >= 2)
    assert repeater.state == "reconnecting" and repeater.pushed == 0
    push.error = None
    await _until(lambda: repeater.pushed >= 2)
    assert repeater.state == "running"
    assert len(set(push.ids)) == len(push.ids)
    await repeater.stop()
    assert repeater.state == "stopped"


async def test_an_error_that_cannot_heal_stops_it(caplog: pytest.LogCaptureFixture) -> None:
    push = Pushes(error=InvalidInputError("refused"))
    repeater, stopped = _start(push)
    await repeater.wait()
    assert repeater.state == "stopped" and isinstance(repeater.failure, InvalidInputError)
    assert stopped == [repeater] and push.calls == 1
    assert any("repeat 'k' stopped" in r.getMessage() for r in caplog.records)


async def test_stop_is_idempotent_and_cancellation_safe() -> None:
    started = asyncio.Event()

    async def stuck(delay: float, headers: Headers, message_id: str) -> str:
        started.set()
        await asyncio.Event().wait()  # a push that never returns
        return message_id

    stopped: list[Repeater] = []
    repeater = Repeater(RepeatPlan.make("k", 1.0, None, "UTC", None), "q", stuck, stopped.append)
    await started.wait()
    stopping = asyncio.ensure_future(repeater.stop())
    await asyncio.sleep(0)
    stopping.cancel()  # the caller gives up waiting: the repeater stops all the same
    with contextlib.suppress(asyncio.CancelledError):
        await stopping
    await repeater.wait()
    assert repeater.state == "stopped" and stopped == [repeater]
    await repeater.stop()
    await repeater.stop()
    async with repeater:
        pass
    assert repeater.failure is None


async def test_a_stop_cancelled_before_it_ran_still_stops_it() -> None:
    """A stop wrapped in a task (``gather``, a task group, the queue's close) may be cancelled
    before its coroutine takes a step: the stop is asked for when ``stop()`` is called."""
    push = Pushes()
    repeater, stopped = _start(push, every=30.0)
    await _until(lambda: repeater.pushed == 1)
    stopping = asyncio.ensure_future(repeater.stop())
    stopping.cancel()  # before it ever ran
    with contextlib.suppress(asyncio.CancelledError):
        await stopping
    assert repeater.state == "stopped"
    await asyncio.wait_for(repeater.wait(), WAIT)  # not still sleeping towards its next push
    assert stopped == [repeater] and push.calls == 1


@pytest.mark.parametrize("cron", [None, "* * * * *"], ids=["every", "cron"])
async def test_a_late_wake_before_a_ttl_lead_push_counts_what_it_skips(
    monkeypatch: pytest.MonkeyPatch, cron: str | None
) -> None:
    """On a queue with a ``message_ttl`` an occurrence is pushed only a share of it before
    its time: a wake past the occurrence skips it and those after (counted by division for
    ``every``, walked for a cron). The repeater's clock is the test's: it stands still
    until stepped."""
    period = 60.0
    now = [(time.time() // period) * period + 1.0]
    monkeypatch.setattr(repeat, "clock", lambda: now[0])
    monkeypatch.setattr(repeat, "LONGEST_NAP", 0.01)
    push = Pushes()
    plan = RepeatPlan.make("k", None if cron else period, cron, "UTC", {})
    repeater = Repeater(plan, "q", push, lambda _: None, message_ttl=20.0)  # pushed 10 s before
    await asyncio.sleep(0)  # its task's first step: ``first`` found, asleep till its lead
    first = now[0] - 1.0 + period
    now[0] = first + 10.5 * period  # asleep until 10 s before ``first``: 11 skipped
    await _until(lambda: repeater.missed > 0)
    assert repeater.missed == 11 and push.calls == 0
    now[0] = first + 11 * period - 5.0  # within the lead of the next one
    await _until(lambda: repeater.pushed == 1)
    await repeater.stop()
    assert push.ids == [occurrence_id("k", first + 11 * period)] and repeater.missed == 11
