"""Conformance: Queue.move: a held message into another queue in one atomic step.

Every backend runs it, skipping what it does not claim. Time bounds are generous
functional limits, never performance assertions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from conftest import Connect, needs

import aio_keuss
from aio_keuss import KoResult
from aio_keuss.contract import Entry
from aio_keuss.message import MAX_ID_LENGTH, encode_payload

pytestmark = pytest.mark.timeout(90)


# move -----------------------------------------------------------------------------------


async def test_move_takes_a_held_message_to_another_queue(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("step1")
    nxt = await factory.queue("step2")
    mid = await q.push({"n": 1}, headers={"origin": "a", "keep": 1})
    first = await q.reserve(timeout=5)
    assert first is not None and await q.ko(first) == KoResult.ROLLED_BACK  # tries 1 now
    held = await q.reserve(timeout=5)
    assert held is not None and held.tries == 1
    moved = await q.move(held, "step2", payload={"n": 2}, headers={"origin": "b"})
    assert moved == mid
    assert await q.total_size() == 0
    arrived = await nxt.reserve(timeout=5)
    assert arrived is not None
    assert (arrived.id, arrived.payload, arrived.tries) == (mid, {"n": 2}, 0)
    assert arrived.headers == {"origin": "b", "keep": 1}
    assert await nxt.ok(arrived)
    assert (await q.stats())["commit"] == 1 and (await nxt.stats())["put"] == 1


async def test_move_keeps_the_payload_and_honours_the_delay(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    dst = await factory.queue("dst")
    await q.push(None)  # None is a payload: kept, not taken for "no new payload"
    held = await q.reserve(timeout=5)
    assert held is not None
    delay = 30.0 if factory.capabilities.delay else 0.0
    assert await q.move(held, "dst", delay=delay) == held.id
    if delay:
        assert (await dst.sched_size(), await dst.pop(timeout=0)) == (1, None)
        return
    arrived = await dst.pop(timeout=5)
    assert arrived is not None and arrived.payload is None and arrived.headers == {}


async def test_move_of_what_is_no_longer_held_moves_nothing(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    dst = await factory.queue("dst")
    await q.push_many(["rolled back", "done"])
    stale = await q.reserve(timeout=5)
    done = await q.reserve(timeout=5)
    assert stale is not None and done is not None
    assert await q.ko(stale) == KoResult.ROLLED_BACK  # a newer delivery is due: not ours
    assert await q.ok(done)
    assert await q.move(stale, "dst") is None
    assert await q.move(done, "dst") is None
    assert await dst.total_size() == 0 and await q.total_size() == 1


async def test_move_renames_an_id_the_destination_holds(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move", "idempotent")
    dst = await factory.queue("dst")
    await dst.push("already there", id="order-7")
    names = []
    for round_ in range(3):
        q = await factory.queue(f"src{round_}")
        await q.push(round_, id="order-7")
        held = await q.reserve(timeout=5)
        assert held is not None
        names.append(await q.move(held, "dst"))
    assert names == ["order-7.mv", "order-7.mv.2", "order-7.mv.3"]
    assert await dst.total_size() == 4


async def test_a_renamed_id_longer_than_a_pushed_one_can_still_be_acknowledged(
    connect: Connect,
) -> None:
    """An id of the longest length a push takes, renamed on a move, is longer than that:
    ok / find / remove of it must not refuse the library's own id (they did, so the
    message came back for ever)."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move", "idempotent")
    longest = "k" * MAX_ID_LENGTH
    dst = await factory.queue("dst")
    await dst.push("already there", id=longest)
    q = await factory.queue("src")
    await q.push("moved", id=longest)
    held = await q.reserve(timeout=5)
    assert held is not None
    renamed = await q.move(held, "dst")
    assert renamed == f"{longest}.mv"
    if factory.capabilities.peek:
        found = await dst.find(renamed)
        assert found is not None and found.message.payload == "moved"
    taken = [await dst.reserve(timeout=5), await dst.reserve(timeout=5)]
    assert sorted(m.id for m in taken if m is not None) == [longest, renamed]
    for message in taken:
        assert message is not None and await dst.ok(message)
    assert await dst.total_size() == 0


async def test_move_refuses_bad_input_before_writing(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("src")
    await q.push("x")
    held = await q.reserve(timeout=5)
    assert held is not None
    if not factory.capabilities.move:
        with pytest.raises(aio_keuss.NotSupportedError):
            await q.move(held, "dst")
    else:
        with pytest.raises(aio_keuss.InvalidInputError):
            await q.move(held, "src")  # its own queue: that is a ko
        with pytest.raises(aio_keuss.InvalidQueueNameError):
            await q.move(held, "no spaces")
        with pytest.raises(aio_keuss.InvalidHeadersError):
            await q.move(held, "dst", headers={"k": object()})  # type: ignore[dict-item]
        with pytest.raises(aio_keuss.InvalidPayloadError):
            await q.move(held, "dst", payload=float("nan"))
        with pytest.raises(aio_keuss.InvalidDelayError):
            await q.move(held, "dst", delay=-1)
    assert await q.ok(held)  # still held: nothing moved


async def test_a_move_wakes_the_destinations_consumers(connect: Connect, case: Any) -> None:
    factory = await connect(poll_interval=30.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    await q.push("hop")
    held = await q.reserve(timeout=5)
    assert held is not None
    # A consumer in another process (another factory on a shared backend) waits on dst.
    waiting_side = await connect(poll_interval=30.0) if case.shared else factory
    dst = await waiting_side.queue("dst")
    waiter = asyncio.create_task(dst.reserve(timeout=20))
    await asyncio.sleep(0.2)
    start = time.monotonic()
    assert await q.move(held, "dst") == held.id
    arrived = await asyncio.wait_for(waiter, 25)
    assert arrived is not None and arrived.payload == "hop"
    assert time.monotonic() - start < 15.0  # woken by the signal, not polled (30 s)


async def test_move_many_moves_what_is_held_and_nothing_else(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    dst = await factory.queue("dst")
    await q.push_many([{"n": n} for n in range(6)])
    held = [await q.reserve(timeout=5) for _ in range(6)]
    assert all(m is not None for m in held)
    messages = [m for m in held if m is not None]
    assert await q.ok(messages[0])  # acknowledged: no longer movable
    moved = await q.move_many(messages, "dst", headers={"stage": 2})
    assert moved[0] is None and moved[1:] == [m.id for m in messages[1:]]
    assert await q.total_size() == 0 and await dst.size() == 5
    got = await dst.pop_many(10)
    assert sorted(m.payload["n"] for m in got) == [1, 2, 3, 4, 5]
    assert all(m.headers == {"stage": 2} and m.tries == 0 for m in got)
    assert await q.move_many([], "dst") == []
    with pytest.raises(aio_keuss.InvalidInputError):
        await q.move_many(messages[0], "dst")  # type: ignore[arg-type]
    assert (await q.stats())["commit"] == 6 and (await dst.stats())["put"] == 5


async def test_empty_batches_check_their_arguments_as_full_ones(connect: Connect) -> None:
    """An empty list is no excuse for bad arguments: the typed error a one-message batch
    gets (move_many([], "bad name!") returned [] unchecked)."""
    factory = await connect(poll_interval=5.0)
    q = await factory.queue("src")
    if factory.capabilities.reserve and factory.capabilities.move:
        with pytest.raises(aio_keuss.InvalidQueueNameError):
            await q.move_many([], "bad name!")
        with pytest.raises(aio_keuss.InvalidInputError):
            await q.move_many([], "src")  # its own queue
        with pytest.raises(aio_keuss.InvalidHeadersError):
            await q.move_many([], "dst", headers={"k": object()})  # type: ignore[dict-item]
        with pytest.raises(aio_keuss.InvalidDelayError):
            await q.move_many([], "dst", delay=-1)
    with pytest.raises(aio_keuss.InvalidDelayError):
        await q.push_many([], delay=-1)
    with pytest.raises(aio_keuss.InvalidHeadersError):
        await q.push_many([], headers={"k": object()})  # type: ignore[dict-item]
    with pytest.raises(aio_keuss.InvalidInputError):
        await q.push_many([], priority=10**6)
    with pytest.raises(aio_keuss.InvalidInputError):
        await q.push_many([], ids=["a"])
    if factory.capabilities.reserve:
        with pytest.raises(aio_keuss.InvalidInputError):
            await q.ok_many([], results=[1])
    if factory.capabilities.reserve and factory.capabilities.extend:
        with pytest.raises(aio_keuss.InvalidDelayError):
            await q.extend_many([], -1)
    assert await q.total_size() == 0


async def _stored_headers(queue: aio_keuss.Queue, message_id: str) -> bytes:
    """The headers as the store keeps them (encoded), read without taking the message."""
    (found,) = await queue._store.locate([message_id])
    assert found is not None
    return found.message.headers


async def test_a_message_moved_round_and_round_keeps_its_headers_bounded(
    connect: Connect,
) -> None:
    """A move appended its headers to the stored ones: a message going round a cyclic
    pipeline (or moved back and forth) carried stored headers growing with every pass,
    though the decoded ones were right (a repeated key took the later value). Stored by an
    earlier release that appended, a repeated key is read as before and merged at its next
    move."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move", "peek")
    ping = await factory.queue("ping")
    pong = await factory.queue("pong")
    earlier = b'{"origin":"web","hop":0,"hop":1, "nested":{"a":[1,"},"]}}'
    assert await ping._store.insert([Entry("m1", encode_payload("x"), earlier, 0.0)])
    here, there = ping, pong
    for turn in range(200):
        held = await here.reserve(timeout=5)
        assert held is not None and held.id == "m1"
        if turn == 0:
            assert held.headers == {"origin": "web", "hop": 1, "nested": {"a": [1, "},"]}}
        assert await here.move(held, there.name, headers={"hop": turn, "via": here.name}) == "m1"
        here, there = there, here
    stored = await _stored_headers(here, "m1")
    assert len(stored) < 2 * len(earlier)  # 200 passes: thousands of bytes when appended
    arrived = await here.reserve(timeout=5)
    assert arrived is not None
    assert arrived.headers == {
        "origin": "web",
        "hop": 199,
        "nested": {"a": [1, "},"]},
        "via": "pong",
    }
    assert list(arrived.headers) == ["origin", "hop", "nested", "via"]  # as appended read


@pytest.mark.parametrize(
    ("written", "read"),
    [
        (b' {\n "a" : 1 ,\t"a":"x\\"}" , "b":[ ] } \n', {"a": 2, "b": [], "c": True}),
        (b"{ }", {"a": 2, "c": True}),
        (b"", {"a": 2, "c": True}),
    ],
    ids=["spaced", "empty-object", "empty"],
)
async def test_headers_another_program_wrote_are_merged_into_on_a_move(
    connect: Connect, written: bytes, read: dict[str, Any]
) -> None:
    """Stored headers spelled another way (whitespace, a repeated key, a quote in a string)
    are merged into, each key once; empty ones take the added headers."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move", "peek")
    q = await factory.queue("src")
    dst = await factory.queue("dst")
    assert await q._store.insert([Entry("m1", encode_payload("x"), written, 0.0)])
    held = await q.reserve(timeout=5)
    assert held is not None
    assert await q.move(held, "dst", headers={"a": 2, "c": True}) == "m1"
    assert (await _stored_headers(dst, "m1")).count(b'"a"') == 1
    arrived = await dst.reserve(timeout=5)
    assert arrived is not None and arrived.headers == read


async def test_concurrent_moves_share_round_trips_and_each_lands_once(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    dst = await factory.queue("dst")
    await q.push_many(list(range(200)))
    held = []
    while len(held) < 200:
        batch = await q.reserve_many(200 - len(held), timeout=5)
        assert batch
        held.extend(batch)
    moved = await asyncio.gather(*(q.move(m, "dst", payload=m.payload * 2) for m in held))
    assert moved == [m.id for m in held]
    again = await asyncio.gather(*(q.move(m, "dst") for m in held[:10]))  # already moved
    assert again == [None] * 10
    got = []
    while len(got) < 200:
        batch = await dst.pop_many(100, timeout=5)
        assert batch
        got.extend(batch)
    assert sorted(m.payload for m in got) == [2 * n for n in range(200)]
    assert await q.total_size() == 0


async def test_a_queue_first_reached_by_a_move_is_known_to_the_backend(connect: Connect) -> None:
    # The messages moved into a queue nobody had opened sat in a queue that factory.list(),
    # the admin commands (exit 4, "no queue named ...") and the dashboard did not know.
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    await q.push_many([1, 2, 3])
    held = await q.reserve_many(3, timeout=5)
    assert len(held) == 3
    assert await q.move(held[0], "by-move") == held[0].id
    assert await q.move_many(held[1:2], "by-move-many") == [held[1].id]
    known = await factory.list()
    assert "by-move" in known and "by-move-many" in known
    if factory.capabilities.peek and factory.capabilities.hold:
        assert await q.ko(held[2]) == KoResult.DEADLETTERED
        dl = await factory.queue("__deadletter__")
        assert await dl.requeue([held[2].id], origin="by-requeue") == {held[2].id: held[2].id}
        assert "by-requeue" in await factory.list()


async def test_a_move_keeps_the_options_another_process_recorded_for_its_target(
    connect: Connect, case: Any
) -> None:
    # Opening the target through the factory recorded this factory's defaults over the
    # options its own process had recorded (which the admin commands reopen it with).
    owner = await connect(poll_interval=5.0)
    needs(owner, "reserve", "move")
    if not case.shared:
        pytest.skip("one factory's queues only")
    await owner.queue("kept", reserve_delay=600.0)
    mover = await connect(poll_interval=5.0)
    q = await mover.queue("src")
    await q.push(1)
    (held,) = await q.reserve_many(1, timeout=5)
    assert await q.move(held, "kept") == held.id
    assert (await mover.list())["kept"]["reserve_delay"] == 600.0


async def test_opening_a_queue_keeps_the_options_another_process_recorded_for_the_deadletter(
    connect: Connect, case: Any
) -> None:
    # factory.queue() opens the deadletter queue for its routing (with the defaults): that
    # recorded the defaults over the options the process owning it had recorded.
    owner = await connect(poll_interval=5.0)
    if not case.shared:
        pytest.skip("one factory's queues only")
    await owner.queue("__deadletter__", reserve_delay=600.0)
    other = await connect(poll_interval=5.0, deadletter={"max_ko": 3})
    await other.queue("work")
    assert (await other.list())["__deadletter__"]["reserve_delay"] == 600.0


async def test_a_queue_first_reached_by_a_move_opens_with_options_of_its_own_after(
    connect: Connect,
) -> None:
    # The move opened its target with the defaults, which refused a later open with the
    # options its own consumer asks for (ConfigError: already open).
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    await q.push("moved")
    (held,) = await q.reserve_many(1, timeout=5)
    assert await q.move(held, "later") == held.id
    target = await factory.queue("later", reserve_delay=45.0)
    assert target.options.reserve_delay == 45.0
    assert (await factory.list())["later"]["reserve_delay"] == 45.0
    moved = await target.pop(timeout=5)
    assert moved is not None and moved.payload == "moved"


async def test_a_message_moved_twice_at_once_lands_once(connect: Connect) -> None:
    """Two moves of one held message in flight together: one moves it, the other finds it
    no longer held. On MongoDB without transactions both claimed it (the claim left the
    holder's guard matching), both inserted a copy: it landed twice, as <id> and <id>.mv."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    dst = await factory.queue("dst")
    other = await factory.queue("other")
    await q.push_many(["twice to one queue", "to two queues"])
    first, second = await q.reserve_many(2, timeout=5)
    moved = await q.move_many([first, first], "dst")
    assert sorted(moved, key=str) == [first.id, None]
    apart = await asyncio.gather(q.move(second, "dst"), q.move(second, "other"))
    assert apart.count(None) == 1 and second.id in apart
    assert await q.total_size() == 0
    assert await dst.total_size() + await other.total_size() == 2
    arrived = await dst.pop_many(10, timeout=0) + await other.pop_many(10, timeout=0)
    assert sorted(m.payload for m in arrived) == ["to two queues", "twice to one queue"]


async def test_a_holder_s_ok_or_ko_and_its_move_at_once_do_not_both_act(connect: Connect) -> None:
    """The holder of a message sends its ok (or ko) and a move of it at once (two tasks):
    one of them takes the reservation, the other finds it no longer held. On MongoDB
    without transactions both acted: the move's claim left the holder's guard matching,
    the ok ended the message (True) and the move copied it on (moved), so a message
    acknowledged as done went on to the next queue; a ko was told it gave back what the
    move then took."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    q = await factory.queue("src")
    dst = await factory.queue("dst")
    await q.push_many(["ok or move", "ko or move"])
    first, second = sorted(await q.reserve_many(2, timeout=5), key=lambda m: str(m.payload))
    ended, moved = await asyncio.gather(q.ok(second), q.move(second, "dst"))
    assert (ended, moved) in [(True, None), (False, second.id)]
    delay = 3600.0 if factory.capabilities.delay else 0.0
    back, moved_too = await asyncio.gather(q.ko(first, delay=delay), q.move(first, "dst"))
    assert (back, moved_too) in [(KoResult.ROLLED_BACK, None), (KoResult.MISSING, first.id)]
    assert await dst.total_size() == sum(m is not None for m in (moved, moved_too))
    assert await q.total_size() == (1 if back else 0)
