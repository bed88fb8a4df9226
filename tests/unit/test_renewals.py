"""The extension of running handlers' reservations, on its own (the queue's extend is
replaced by a function the test answers), then through ``consume`` on the memory backend."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import pytest
from polling import until

import aio_keuss
from aio_keuss import Message
from aio_keuss.renewals import Renewals

RESERVE_DELAY = 0.24  # a look every 20 ms: the tests wait for calls, never for times


def _message(message_id: str) -> Message:
    return Message(message_id, None, {}, 0, datetime.now(UTC))


class Extender:
    """Answers each extension with the next of ``answers`` (an exception is raised)."""

    def __init__(self, *answers: list[bool] | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[list[str]] = []
        self.called = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, messages: list[Message]) -> list[bool]:
        self.asked.append([m.id for m in messages])
        self.called.set()
        await self.release.wait()
        answer = self.answers.pop(0) if self.answers else [True] * len(messages)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def wait_calls(self, n: int) -> None:
        while len(self.asked) < n:
            self.called.clear()
            await asyncio.wait_for(self.called.wait(), 10)


class Handlers:
    """A consumer's running messages, as the renewals see them."""

    def __init__(self, extender: Extender) -> None:
        self.running: dict[str, Message] = {}
        self.renewals = Renewals(
            "jobs", RESERVE_DELAY, extender, asyncio.get_running_loop(), self.running
        )

    def started(self, *ids: str) -> list[Message]:
        messages = [_message(i) for i in ids]
        self.running.update((m.id, m) for m in messages)
        if self.renewals.idle:
            self.renewals.wake()
        return messages

    def ended(self, *ids: str) -> None:
        for i in ids:
            del self.running[i]


async def test_a_running_handlers_reservation_is_extended_again_and_again() -> None:
    extender = Extender()
    handlers = Handlers(extender)
    renewals = handlers.renewals
    handlers.started("a")
    await extender.wait_calls(3)
    assert extender.asked[:3] == [["a"], ["a"], ["a"]]
    handlers.ended("a")
    await renewals.close()
    assert renewals.extended >= 3 and renewals.lapsed == 0


async def test_a_reservation_found_lapsed_is_counted_logged_and_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    extender = Extender([False, True])
    handlers = Handlers(extender)
    renewals = handlers.renewals
    handlers.started("lost", "kept")
    with caplog.at_level(logging.WARNING, "aio_keuss.renewals"):
        await extender.wait_calls(2)
    assert extender.asked[0] == ["lost", "kept"]
    assert extender.asked[1] == ["kept"]  # the lost one is not asked for again
    assert renewals.lapsed == 1
    assert "message lost" in caplog.text and "handled twice" in caplog.text
    await renewals.close()


async def test_a_handler_ending_while_its_extension_is_out_is_not_a_lapse() -> None:
    extender = Extender([False])
    extender.release.clear()
    handlers = Handlers(extender)
    renewals = handlers.renewals
    handlers.started("a")
    await extender.wait_calls(1)
    handlers.ended("a")  # its ok went first: the extension finds it gone
    extender.release.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert renewals.lapsed == 0
    await renewals.close()


async def test_a_failed_extension_is_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    extender = Extender(aio_keuss.KeussConnectionError("down"))
    handlers = Handlers(extender)
    renewals = handlers.renewals
    handlers.started("a")
    with caplog.at_level(logging.WARNING, "aio_keuss.renewals"):
        await extender.wait_calls(2)
    assert "failed" in caplog.text and "down" in caplog.text
    assert extender.asked[1] == ["a"]
    await renewals.close()


async def test_close_cancels_an_extension_out_and_stops_the_timer() -> None:
    extender = Extender()
    extender.release.clear()
    handlers = Handlers(extender)
    renewals = handlers.renewals
    handlers.started("a")
    await extender.wait_calls(1)
    await renewals.close()
    handlers.started("b")  # after close: no timer again
    await asyncio.sleep(RESERVE_DELAY)
    assert extender.asked == [["a"]]


async def test_consume_counts_its_extensions_in_its_status() -> None:
    # a second-long reservation: extended a quarter to a third of a second in, then as
    # often, so a loaded machine's late look still finds it held
    async with aio_keuss.connect("memory", reserve_delay=1.0) as factory:
        q = await factory.queue("jobs")
        await q.push("long")
        done = asyncio.Event()

        async def handler(message: Message) -> None:
            await done.wait()

        real, extensions = q.extend_many, asyncio.Semaphore(0)

        async def extend_many(messages: list[Message], seconds: float | None = None) -> list[bool]:
            kept = await real(messages, seconds)
            extensions.release()
            return kept

        q.extend_many = extend_many  # type: ignore[method-assign,assignment]
        consumer = q.consume(handler)
        for _ in range(2):
            await asyncio.wait_for(extensions.acquire(), 10)
        assert consumer.status().extended >= 2
        assert await q.reserve(timeout=0) is None
        done.set()
        await consumer.stop()
        status = consumer.status()
        assert status.handled == 1 and status.lapsed == 0
        assert await q.total_size() == 0


async def test_a_worker_ending_leaves_the_entry_of_a_later_delivery_of_its_id() -> None:
    """The first delivery's reservation lapsed (its extensions failed) and a second worker
    runs the message again: the first worker's end must not drop the second one's entry
    (its reservation would no longer be extended, nor kept from a close's give-back)."""
    async with aio_keuss.connect("memory", reserve_delay=0.3) as factory:
        q = await factory.queue("jobs")
        await q.push("twice")

        async def failing(messages: list[Message], seconds: float | None = None) -> list[bool]:
            raise aio_keuss.KeussConnectionError("down")

        q.extend_many = failing  # type: ignore[method-assign,assignment]
        second_started, first_ended, deliveries = asyncio.Event(), asyncio.Event(), []

        async def handler(message: Message) -> None:
            deliveries.append(message)
            if message.tries == 0:
                await second_started.wait()
            else:
                second_started.set()
                await first_ended.wait()

        real_ok, first_acknowledged = q.ok, asyncio.Event()

        async def ok(message: Message | str) -> bool:
            done = await real_ok(message)
            if isinstance(message, Message) and message.tries == 0:
                first_acknowledged.set()  # its worker ends in this same step
            return done

        q.ok = ok  # type: ignore[method-assign]
        consumer = q.consume(handler, 2)
        await asyncio.wait_for(first_acknowledged.wait(), 10)
        assert consumer.busy == {deliveries[1].id: deliveries[1]}
        first_ended.set()
        await consumer.stop()
        assert consumer.busy == {}


async def test_a_later_delivery_of_a_lapsed_id_is_extended() -> None:
    """A reservation found taken by another consumer is not extended again; but a later
    delivery of the same id to this consumer (given back by that consumer, reserved here
    again while the stale handler still ran) was not extended either: the mark was kept by
    id, and the id never left the running ones. Its reservation lapsed in turn, and a third
    consumer could take the message while it ran."""
    extender = Extender([False])
    handlers = Handlers(extender)
    renewals = handlers.renewals
    (stale,) = handlers.started("a")
    await extender.wait_calls(1)

    async def refused() -> bool:  # read once the call returns
        return renewals.lapsed == 1

    await until(refused, 10)
    later = _message("a")  # delivered again, while the stale handler runs
    handlers.running["a"] = later
    assert handlers.running["a"] is not stale
    await extender.wait_calls(2)
    assert extender.asked[1] == ["a"]
    handlers.ended("a")
    await renewals.close()
