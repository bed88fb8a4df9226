"""Conformance: A push with an id is deduplicated within the dedup window.

Every backend runs it, skipping what it does not claim. Time bounds are generous
functional limits, never performance assertions.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import Connect, needs

import aio_keuss

pytestmark = pytest.mark.timeout(90)


# idempotent push ------------------------------------------------------------------------


async def test_idempotent_push(queue: aio_keuss.Queue) -> None:
    if not queue.capabilities.idempotent:
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.push(1, id="order-17")
        assert await queue.total_size() == 0
        return
    assert await queue.push({"v": 1}, id="order-17") == "order-17"
    assert await queue.push({"v": 2}, id="order-17") == "order-17"
    assert await queue.total_size() == 1
    message = await queue.pop(timeout=1)
    assert message is not None and message.id == "order-17" and message.payload == {"v": 1}
    # consumed, but still within the dedup window: no second copy
    await queue.push({"v": 3}, id="order-17")
    assert await queue.total_size() == 0
    ids = await queue.push_many(["a", "b", "a2"], ids=["k1", "k2", "k1"])
    assert ids == ["k1", "k2", "k1"]
    assert await queue.total_size() == 2
    stats = await queue.stats()
    assert stats["put"] == 3


async def test_dedup_window_expires(connect: Connect) -> None:
    factory = await connect(dedup_window=0.3)
    needs(factory, "idempotent")
    q = await factory.queue("q1")
    await q.push(1, id="same")
    assert await q.pop(timeout=1) is not None
    await asyncio.sleep(0.6)
    await q.push(2, id="same")
    message = await q.pop(timeout=1)
    assert message is not None and message.payload == 2


async def test_push_many_ids_against_queued_remembered_and_repeated(connect: Connect) -> None:
    """A batch of user ids (what a Spark write sends: stores take it as two columns) and a
    batch of pushes that differ in headers (one record per entry) refuse alike: an id
    queued, an id consumed within the window, and the second of a repeat in the batch."""
    factory = await connect(dedup_window=60.0)
    needs(factory, "idempotent")
    q = await factory.queue("q1")
    await q.push("consumed", id="a")
    message = await q.pop(timeout=1)
    assert message is not None and message.id == "a"
    await q.push("queued", id="b")
    ids = ["a", "b", "c", "c", "d"]
    assert await q.push_many([1, 2, 3, 4, 5], ids=ids) == ids
    others = ["b", "e", "a", "f"]
    pushed = await asyncio.gather(
        *(q.push(n, id=key, headers={"n": n}) for n, key in enumerate(others))
    )
    assert pushed == others
    payloads: dict[str, object] = {}
    while (got := await q.pop_many(10, timeout=0)) != []:
        payloads.update((m.id, m.payload) for m in got)
    assert payloads == {"b": "queued", "c": 3, "d": 5, "e": 1, "f": 3}
    assert (await q.stats())["put"] == 6


async def test_push_many_of_rising_ids_refuses_those_queued_or_remembered(
    connect: Connect,
) -> None:
    """Ids that rise and are all distinct (a Spark partition's): some queued, some consumed
    within the window, first, inside and last; the others go in, in order, counted once."""
    factory = await connect(dedup_window=60.0)
    needs(factory, "idempotent")
    q = await factory.queue("q1")
    for key in ("k1", "k4"):  # consumed, remembered within the window
        await q.push("consumed", id=key)
        assert (await q.pop(timeout=1)) is not None
    for key in ("k0", "k6"):
        await q.push("queued", id=key)
    ids = [f"k{i}" for i in range(7)]
    assert await q.push_many(list(range(7)), ids=ids) == ids
    taken = []
    while (got := await q.pop_many(10, timeout=0)) != []:
        taken += [(m.id, m.payload) for m in got]
    assert sorted(taken) == [
        ("k0", "queued"),
        ("k2", 2),
        ("k3", 3),
        ("k5", 5),
        ("k6", "queued"),
    ]
    assert (await q.stats())["put"] == 7


@pytest.mark.parametrize(
    "ids",
    [["k1", "k2", "k2", "k2", "k3"], ["k3", "k2", "k3", "k1", "k2"]],
    ids=["never falling", "falling"],
)
async def test_push_many_refuses_the_repeats_of_a_batch_whatever_its_order(
    connect: Connect, ids: list[str]
) -> None:
    """The first of each id goes in, the later ones are refused: next to it (ids that never
    fall, as a Spark partition's) or anywhere after it."""
    factory = await connect(dedup_window=60.0)
    needs(factory, "idempotent")
    q = await factory.queue("q1")
    assert await q.push_many(list(range(5)), ids=ids) == ids
    taken = []
    while (got := await q.pop_many(10, timeout=0)) != []:
        taken += [(m.id, m.payload) for m in got]
    first = {key: ids.index(key) for key in ids}
    assert sorted(taken) == sorted(first.items())
    assert (await q.stats())["put"] == 3
