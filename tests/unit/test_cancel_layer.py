"""The pieces of cancelling that need no backend: the cancel space's name, the reason's
checks and encoding, and the routing of "cancel" signals."""

from __future__ import annotations

import pytest

import aio_keuss
import aio_keuss.sync
from aio_keuss import CancelResult, InvalidInputError
from aio_keuss.cancels import (
    cancelled_text,
    check_reason,
    decode_request,
    encode_request,
    request_ttl,
)
from aio_keuss.errors import InvalidQueueNameError
from aio_keuss.options import check_queue_name
from aio_keuss.results import cancel_space, space_queue
from aio_keuss.signal import CANCELS_ROUTE, Signal, SignalBus


def test_the_cancel_space_is_a_name_no_queue_can_take() -> None:
    assert cancel_space("q1") == ":q1"
    with pytest.raises(InvalidQueueNameError):
        check_queue_name(cancel_space("q1"))
    assert space_queue(cancel_space("q1")) == "q1"
    assert space_queue("q1") == "q1"


@pytest.mark.parametrize("bad", [1, b"x", "x" * 1001])
def test_bad_reasons(bad: object) -> None:
    with pytest.raises(InvalidInputError):
        check_reason(bad)


def test_reasons_round_trip_and_read_in_the_failure() -> None:
    assert check_reason("x" * 1000) == "x" * 1000
    for reason in (None, "", "why", "é\n"):
        assert decode_request(encode_request(reason)) == reason
    assert decode_request(b"\xff not ours") is None
    assert cancelled_text(None) == cancelled_text("") == "cancelled"
    assert cancelled_text("why") == "cancelled: why"
    assert request_ttl(30) == 120


async def test_cancel_signals_reach_only_their_listeners_and_travel_with_ids() -> None:
    heard: list[Signal] = []
    queue_heard: list[Signal] = []
    sent: list[bytes] = []

    class Recording(SignalBus):
        async def _publish(self, payload: bytes) -> None:
            sent.append(payload)

    bus = Recording()
    bus.subscribe_cancels("q1", heard.append)
    bus.subscribe("q1", queue_heard.append)
    bus.cancels("q1", ["a"])
    await bus.published()
    assert [(s.queue, s.kind, s.ids) for s in heard] == [(CANCELS_ROUTE + "q1", "cancel", ["a"])]
    assert queue_heard == []  # a queue's own listeners (and older releases') never hear it
    other = Recording()
    other_heard: list[Signal] = []
    other.subscribe_cancels("q1", other_heard.append)
    other._receive(sent[0])
    assert [(s.kind, s.ids) for s in other_heard] == [("cancel", ["a"])]
    await bus.close()
    await other.close()


def test_the_sync_shim_cancels() -> None:
    with aio_keuss.sync.connect("memory") as factory:
        q = factory.queue("jobs")
        waiting = q.push(1, delay=3600)
        assert q.cancel(waiting, reason="no") is CancelResult.REMOVED
        assert q.cancel(waiting) is CancelResult.MISSING
        with pytest.raises(InvalidInputError):
            q.cancel("x", reason=3)  # type: ignore[arg-type]
