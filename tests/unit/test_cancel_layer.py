"""The pieces of cancelling that need no backend: the cancel space's name, the reason's
checks and encoding, and the routing of "cancel" signals."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from polling import until

import aio_keuss
import aio_keuss.sync
from aio_keuss import CancelResult, InvalidInputError, Message
from aio_keuss.cancels import (
    USED,
    CancelWatch,
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


async def _requests(factory: aio_keuss.Factory, queue: str, ids: list[str]) -> list[bytes | None]:
    store = await factory._results.get()
    return await store.get(cancel_space(queue), ids)


async def test_a_message_that_ends_as_its_request_is_left_uses_the_request_up() -> None:
    """The message is ok-ed between the cancel's look-up and its request landing: nothing
    holds it any more to use the request up, so the cancel does, and says it stopped
    nothing; a later push of the id past its dedup window is left alone."""
    async with aio_keuss.connect("memory", poll_interval=60.0) as factory:
        q = await factory.queue("jobs", result_ttl=600.0)
        message_id = await q.push(1, id="job-1")
        message = await q.reserve(timeout=0)
        assert message is not None and message.id == message_id
        store = await factory._results.get()
        put = store.put

        async def finished_first(queue: str, results: Any, ttl: float) -> None:
            if queue == cancel_space(q.name) and results[0][1] != USED:
                assert await q.ok(message)  # the handler returned as the request was left
            await put(queue, results, ttl)

        store.put = finished_first  # type: ignore[method-assign]
        assert await q.cancel(message_id) is CancelResult.MISSING
        assert await _requests(factory, q.name, [message_id]) == [USED]


async def test_a_request_that_reached_its_message_stands() -> None:
    """The second look finds the message still held: the request is left for its holder."""
    async with aio_keuss.connect("memory", poll_interval=60.0) as factory:
        q = await factory.queue("jobs", result_ttl=600.0)
        message_id = await q.push(1)
        assert await q.reserve(timeout=0) is not None
        assert await q.cancel(message_id, reason="why") is CancelResult.REQUESTED
        (body,) = await _requests(factory, q.name, [message_id])
        assert body is not None and decode_request(body) == "why"


def test_every_request_has_a_body_of_its_own() -> None:
    """Two requests with one reason differ: a use-up writes over the one it read only."""
    assert encode_request("why") != encode_request("why")
    assert decode_request(b'"why"') == "why"  # a request written before the nonce
    assert decode_request(b"null") is None
    assert decode_request(USED) is None


async def test_a_request_left_for_a_later_push_of_its_id_is_not_used_up() -> None:
    """A use-up by a consumer that heard of a request once its message was done reads
    the request, then looks the id up: pushed again (past its dedup window) and under a
    reservation, the request may be the new message's, and is left for its holder."""
    async with aio_keuss.connect("memory", poll_interval=60.0) as factory:
        q = await factory.queue("jobs", result_ttl=600.0, dedup_window=0.0)
        await q.push(1, id="job-1")
        first = await q.reserve(timeout=0)
        assert first is not None and await q.ok(first)
        await q.push(2, id="job-1")
        assert await q.reserve(timeout=0) is not None
        assert await q.cancel("job-1", reason="new") is CancelResult.REQUESTED
        assert await q._use_up_requests(["job-1"], told_only=True) == []
        (body,) = await _requests(factory, q.name, ["job-1"])
        assert body is not None and decode_request(body) == "new"


async def test_a_use_up_spares_a_request_written_after_its_read() -> None:
    """The request read is overwritten only while it is still that one: another cancel's,
    written between the read and the write, stands."""
    async with aio_keuss.connect("memory", poll_interval=60.0) as factory:
        q = await factory.queue("jobs", result_ttl=600.0, dedup_window=0.0)
        await q.push(1, id="job-1")
        held = await q.reserve(timeout=0)
        assert held is not None
        assert await q.cancel("job-1", reason="old") is CancelResult.REQUESTED
        assert await q.ok(held)
        store = await factory._results.get()
        get = store.get

        async def then_another(queue: str, ids: Any) -> list[bytes | None]:
            found = await get(queue, ids)
            await store.put(queue, [("job-1", encode_request("newer"))], 600.0)
            return found

        store.get = then_another  # type: ignore[method-assign]
        assert await q._use_up_requests(["job-1"], told_only=True) == ["job-1"]
        store.get = get  # type: ignore[method-assign]
        (body,) = await _requests(factory, q.name, ["job-1"])
        assert body is not None and decode_request(body) == "newer"
        assert await q._use_up_requests(["job-1"], told_only=True) == ["job-1"]
        assert await _requests(factory, q.name, ["job-1"]) == [USED]


async def test_a_cancel_heard_while_the_ok_is_queued_uses_the_request_up() -> None:
    """With prefetch, oks go out in the background, at most two round trips at once: both
    held, the next handled message's ok waits in the queue as the cancel comes; its request
    is used up once that ok lands."""
    guard = 30.0
    async with aio_keuss.connect("memory", poll_interval=60.0) as factory:
        q = await factory.queue("jobs", dedup_window=0.2)
        release = asyncio.Event()
        entered: list[list[str]] = []
        ok_many = q.ok_many

        async def held_ok_many(messages: list[Message]) -> list[bool]:
            entered.append([m.id for m in messages])
            await release.wait()
            return await ok_many(messages)

        q.ok_many = held_ok_many  # type: ignore[method-assign]
        ran: list[str] = []

        async def handler(message: Message) -> None:
            ran.append(message.payload)

        async def used_up() -> bool:
            return await _requests(factory, q.name, ["order-1"]) == [USED]

        async with q.consume(handler, prefetch=2) as consumer:
            for n, payload in enumerate(["a", "b"], 1):
                await q.push(payload)

                async def sent(n: int = n) -> bool:
                    return len(entered) == n

                await until(sent, guard)  # its ok is out, held
            await q.push("first", id="order-1")

            async def queued() -> bool:  # handled (its ok queued: no third round trip)
                return "first" in ran

            await until(queued, guard)
            assert len(entered) == 2
            assert await q.cancel("order-1") is CancelResult.REQUESTED
            release.set()
            await until(used_up, guard)
            await asyncio.sleep(0.5)  # past the dedup window: the same id is a new message

            async def ended() -> bool:
                return len(ran) == 4 or consumer.status().cancelled > 0

            await q.push("second", id="order-1")
            await until(ended, guard)
            assert (ran, consumer.status().cancelled) == (["a", "b", "first", "second"], 0)


async def test_heard_ids_are_forgotten_once_their_requests_expire() -> None:
    """Ids heard named and not held are remembered only as long as a request lives: once
    all have expired, nothing is remembered, so that a message taken later is not looked
    up again (a single cancel must not cost every later message a look for good)."""
    listeners: list[Any] = []

    def subscribe(listener: Any) -> Any:
        listeners.append(listener)
        return lambda: None

    async def look(ids: list[str]) -> list[str]:
        return []

    remember = 0.05
    watch = CancelWatch("jobs", subscribe, look, list, lambda ids: None, None, remember)
    try:
        assert not watch.heard_any
        listeners[0](Signal("jobs", "cancel", ids=["a", "b"]))
        listeners[0](Signal("jobs", "cancel", ids=["c"]))
        assert watch.asked("c") or not watch.heard_any  # heard (unless already expired)

        async def forgotten() -> bool:
            return not watch.heard_any

        await until(forgotten, 30.0)
        assert not watch._heard  # dropped, not merely skipped
        assert not watch.asked("a") and watch.marks(["a", "b", "c"]) == [None, None, None]
    finally:
        await watch.close()


async def test_a_lapsed_delivery_ending_leaves_the_late_mark_of_its_redelivery() -> None:
    """One consumer holds an id twice: the first delivery's ok waits as its reservation
    lapses, and its redelivery is handled by another worker, whose ok waits too. A cancel
    names the id then, for the newer delivery (the one held). The older worker's end must
    not drop that mark: the newer ok lands, and uses the request up."""
    guard = 30.0
    async with aio_keuss.connect("memory", reserve_delay=0.5, poll_interval=0.05) as factory:
        q = await factory.queue("jobs")
        gates = [asyncio.Event(), asyncio.Event()]
        oks: list[Message] = []
        ok = q.ok

        async def held_ok(message: Message, *args: Any) -> bool:
            oks.append(message)
            await gates[len(oks) - 1].wait()
            return await ok(message, *args)

        q.ok = held_ok  # type: ignore[method-assign]

        deliveries: list[Message] = []

        async def handler(message: Message) -> None:
            deliveries.append(message)
            if len(deliveries) == 2:  # held through the test, as renewals would
                assert await q.extend(message, 600.0)

        async with q.consume(handler, concurrency=2, renew=False) as consumer:
            await q.push("x", id="job-1")

            async def both_held() -> bool:  # lapsed as its ok waited, delivered again
                return len(oks) == 2

            await until(both_held, guard)
            assert oks == deliveries and oks[0] is not oks[1]
            assert await q.cancel("job-1") is CancelResult.REQUESTED

            async def marked() -> bool:
                return "job-1" in consumer._late

            await until(marked, guard)
            gates[0].set()  # the lapsed delivery's ok: refused, its worker ends

            async def older_ended() -> bool:
                return consumer._in_flight == 1

            await until(older_ended, guard)
            gates[1].set()

            async def newer_ended() -> bool:
                return consumer._in_flight == 0

            await until(newer_ended, guard)
            assert await _requests(factory, q.name, ["job-1"]) == [USED]
