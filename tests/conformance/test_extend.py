"""Conformance: extending a reservation (``Queue.extend``), and ``consume`` extending the
reservations of handlers that run longer than ``reserve_delay``.

Every backend runs it, skipping what it does not claim. Time bounds are generous functional
limits, never performance assertions.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
from conftest import Connect, needs

import aio_keuss
from aio_keuss import InvalidDelayError, InvalidIdError, InvalidInputError, NotSupportedError

pytestmark = pytest.mark.timeout(90)


async def _reserved_until(q: aio_keuss.Queue, message_id: str) -> float | None:
    """When the reservation of ``message_id`` ends, as the store tells (None: not known)."""
    if not q.capabilities.peek:
        return None
    seen = await q.find(message_id)
    assert seen is not None and seen.state == "reserved", seen
    return seen.at.timestamp()


async def _a_long_job_held(
    connect: Connect, reserve_delay: float
) -> tuple[aio_keuss.Queue, aio_keuss.Message]:
    """A queue of a backend that extends reservations (the test is skipped on others),
    and the one message pushed into it, reserved."""
    factory = await connect(reserve_delay=reserve_delay, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry", "extend")
    q = await factory.queue("q1")
    await q.push("long job")
    message = await q.reserve(timeout=5)
    assert message is not None
    return q, message


async def test_an_extended_reservation_outlives_reserve_delay(connect: Connect) -> None:
    q, message = await _a_long_job_held(connect, reserve_delay=1.0)
    asked = time.time()
    assert await q.extend(message, 60) is True
    until = await _reserved_until(q, message.id)
    assert until is None or until >= asked + 59, until
    await asyncio.sleep(1.3)  # past the reservation it was given first
    assert await q.reserve(timeout=0) is None
    assert (await q.sizes()).reserved == 1
    assert await q.ok(message) is True
    assert await q.total_size() == 0


async def test_extend_defaults_to_reserve_delay_and_takes_ids(connect: Connect) -> None:
    factory = await connect(reserve_delay=300.0, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry", "extend")
    q = await factory.queue("q1")
    ids = await q.push_many(["a", "b"])
    held = [await q.reserve(timeout=5), await q.reserve(timeout=5)]
    assert all(m is not None for m in held)
    asked = time.time()
    assert await q.extend_many([ids[0], held[1]]) == [True, True]  # type: ignore[list-item]
    for message_id in ids:
        until = await _reserved_until(q, message_id)
        assert until is None or until >= asked + 299, until
    assert await q.ok_many(ids) == [True, True]


async def test_a_stale_holder_cannot_extend(connect: Connect) -> None:
    """The first holder's reservation lapsed and the message went to a second one: the
    first one's extend is refused, the second one's stands."""
    factory = await connect(reserve_delay=0.3, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry", "extend")
    q = await factory.queue("q1")
    await q.push("x")
    first = await q.reserve(timeout=5)
    assert first is not None and first.tries == 0
    second = await q.reserve(timeout=5)  # once the first reservation lapsed
    assert second is not None and second.id == first.id and second.tries == 1
    assert await q.extend_many([first, second], 60) == [False, True]
    assert await q.reserve(timeout=0.5) is None  # the second one's reservation runs on
    assert await q.ok(first) is False
    assert await q.ok(second) is True


async def test_extend_of_what_is_not_held_is_false(connect: Connect) -> None:
    factory = await connect(reserve_delay=30.0, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry", "extend")
    q = await factory.queue("q1")
    await q.push_many(["ok", "ko"])
    done = await q.reserve(timeout=5)
    failed = await q.reserve(timeout=5)
    assert done is not None and failed is not None
    assert await q.ok(done) is True
    assert await q.ko(failed, delay=0)
    ready = await q.push("never reserved")
    assert await q.extend_many([done, failed, ready, "no-such-id"]) == [False] * 4
    assert (await q.sizes()).reserved == 0


async def test_extend_checks_its_input_first(connect: Connect) -> None:
    factory = await connect(reserve_delay=30.0, poll_interval=5.0)
    q = await factory.queue("q1")
    if not (q.capabilities.reserve and q.capabilities.extend):
        with pytest.raises(NotSupportedError):
            await q.extend("some-id")
        return
    await q.push("x")
    message = await q.reserve(timeout=5)
    assert message is not None
    for seconds in (0, -1, math.nan, math.inf, 2e9, "10", True):
        with pytest.raises(InvalidDelayError):
            await q.extend(message, seconds)  # type: ignore[arg-type]
    with pytest.raises(InvalidIdError):
        await q.extend_many([message, ""])
    with pytest.raises(InvalidInputError):
        await q.extend_many(message)  # type: ignore[arg-type]
    assert await q.ok(message) is True


async def test_consume_keeps_a_long_handlers_message_reserved(connect: Connect) -> None:
    """A handler running for twice ``reserve_delay``: its message is not delivered again
    meanwhile (another reserve finds nothing), and its ok goes through."""
    factory = await connect(reserve_delay=1.0, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry", "extend")
    q = await factory.queue("q1")
    await q.push("long")
    started = asyncio.Event()
    rival: list[aio_keuss.Message | None] = []

    async def handler(message: aio_keuss.Message) -> None:
        started.set()
        # long past the reservation it was given, while another consumer keeps asking
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            rival.append(await q.reserve(timeout=0.2))
            if rival[-1] is not None:
                return

    consumer = q.consume(handler)
    await asyncio.wait_for(started.wait(), 10)
    await consumer.stop(grace=30)
    assert [m for m in rival if m is not None] == [], "delivered again while its handler ran"
    assert consumer.handled == 1
    assert await q.total_size() == 0


async def test_consume_with_renew_false_lets_a_reservation_lapse(connect: Connect) -> None:
    factory = await connect(reserve_delay=0.3, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry")
    q = await factory.queue("q1")
    await q.push("long")
    again: asyncio.Future[aio_keuss.Message | None] = asyncio.get_running_loop().create_future()

    async def handler(message: aio_keuss.Message) -> None:
        if not again.done():
            again.set_result(await q.reserve(timeout=10))

    consumer = q.consume(handler, renew=False)
    second = await asyncio.wait_for(again, 20)
    await consumer.stop(grace=30)
    assert second is not None and second.tries == 1
    assert await q.ok(second) is True
    with pytest.raises(InvalidInputError):
        q.consume(handler, renew=1)  # type: ignore[arg-type]


async def test_an_extension_answered_after_a_give_back_does_not_note_it_held_again(
    connect: Connect,
) -> None:
    """An extension was out as its holder gave the message back (a stopped consumer, a
    cancelled handler: no try counted), and another process reserved it with the same
    count. The extension's late True must not note the reservation as this queue's again:
    its close would give back the other process's reservation."""
    factory = await connect(reserve_delay=30.0, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry", "extend", "shared")
    a = await factory.queue("q1")
    b = await (await connect(reserve_delay=30.0, poll_interval=5.0)).queue("q1")
    await a.push("x")
    mine = await a.reserve(timeout=5)
    assert mine is not None
    store = a._store  # type: ignore[attr-defined]
    real_extend, answered, release = store.extend, asyncio.Event(), asyncio.Event()

    async def late(extends: Any) -> list[bool]:
        kept = await real_extend(extends)  # done at the store: its reply is late
        answered.set()
        await release.wait()
        return kept

    store.extend = late
    extending = asyncio.ensure_future(a.extend(mine, 60))
    await asyncio.wait_for(answered.wait(), 10)
    await a._release_all([mine], unseen=True)  # type: ignore[attr-defined]
    if factory.backend_name.startswith("bucket-"):
        release.set()
        await extending
        pytest.skip("a bucket's messages go to no other process while this one leases it")
    theirs = await b.reserve(timeout=5)
    assert theirs is not None and theirs.id == mine.id and theirs.tries == mine.tries
    release.set()
    await extending
    await factory.close()  # gives back what it notes as held
    assert (await b.sizes()).reserved == 1, "the close gave back the other's reservation"
    assert await b.ok(theirs) is True


async def test_next_mature_sees_an_extended_end(connect: Connect) -> None:
    """With nothing else in the queue, the earliest mature time is the end of the one
    reservation, as extended. A sharded queue answered its ``reserve_delay`` from now (what
    a reservation not extended may last at most): early, so a caller waiting for it woke
    and looked again for nothing."""
    q, message = await _a_long_job_held(connect, reserve_delay=30.0)
    asked = time.time()
    assert await q.extend(message, 3600) is True
    mature = await q.next_mature_t()
    assert mature is not None and mature.timestamp() >= asked + 3500, mature
    assert await q.ok(message) is True
    assert await q.next_mature_t() is None
