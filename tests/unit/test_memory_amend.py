"""The memory store's ``amend``, where its lazy heaps could go wrong: entries left behind by
a priority changed back and forth, a change to a message whose reservation lapsed (waiting,
as ``remove`` counts it). The real store, no queue layer."""

from __future__ import annotations

import asyncio

from aio_keuss.contract import Ack, Amend, Entry
from aio_keuss.memory import MemoryBackend, MemoryStore
from aio_keuss.options import QueueOptions


def _store() -> MemoryStore:
    backend = MemoryBackend({})
    return MemoryStore("q", QueueOptions(), backend)


async def test_a_priority_changed_back_and_forth_is_taken_once() -> None:
    store = _store()
    await store.insert([Entry(f"m{i}", b"", b"", 0.0) for i in range(3)])
    await store.insert([Entry("p", b"", b"", 0.0, priority=1)])
    await store.get(0)  # matures every entry into the heap by priority
    for priority in (5, 1, 5, 1):
        assert await store.amend([Amend("m1", priority=priority)]) == [True]
    fetched = await store.get(10)
    assert [m.id for m in fetched.messages] == ["m1", "p", "m0", "m2"]
    assert fetched.next_mature is None


async def test_a_lapsed_reservation_is_waiting_and_its_holder_loses_it() -> None:
    store = _store()
    await store.insert([Entry("m", b"x", b"", 0.0)])
    (held,) = (await store.reserve(1, 0.01)).messages
    await asyncio.sleep(0.05)  # the reservation lapses: a condition, then asserted directly
    assert await store.amend([Amend("m", delay=3600.0)]) == [True]
    assert await store.commit([Ack("m", held.tries)]) == [False]  # no longer its holder
    sizes = await store.sizes()
    assert (sizes.scheduled, sizes.reserved) == (1, 0)
    assert await store.amend([Amend("m", delay=0.0, scheduled_only=True)]) == [True]
    (again,) = (await store.reserve(1, 30.0)).messages
    assert again.tries == held.tries + 1  # the lapsed delivery was a try, counted once


async def test_an_active_reservation_and_a_ready_promote_are_refused() -> None:
    store = _store()
    await store.insert([Entry("r", b"", b"", 0.0), Entry("w", b"", b"", 0.0)])
    await store.reserve(1, 30.0)
    amends = [Amend("r", delay=0.0), Amend("w", delay=0.0, scheduled_only=True), Amend("x")]
    assert await store.amend(amends) == [False, False, False]
