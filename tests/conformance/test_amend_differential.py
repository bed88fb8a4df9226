"""Conformance: a random sequence of pushes, takes and changes (promote, reschedule,
change_priority, remove, ko, ok, find, peek) answers as it does on ``memory``; changes and
requeues racing takes or removes hand nothing out twice and lose nothing."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from conftest import Connect, needs

import aio_keuss

pytestmark = pytest.mark.timeout(300)

LATER = 3600.0


async def _step(q: aio_keuss.Queue, held: dict[str, aio_keuss.Message], op: tuple[Any, ...]) -> Any:
    kind = op[0]
    if kind == "push":
        _, mid, delay, prio = op
        return await q.push(mid, id=mid, delay=delay, priority=prio)
    if kind == "reserve":
        got = await q.reserve_many(op[1], timeout=0)
        for m in got:
            held[m.id] = m
        return sorted((m.id, m.tries, m.priority) for m in got)
    if kind == "pop":
        got = await q.pop_many(op[1], timeout=0)
        return sorted((m.id, m.tries, m.priority) for m in got)
    if kind == "ok":
        mine = held.pop(op[1], None)
        return None if mine is None else await q.ok(mine)
    if kind == "ko":
        mine = held.pop(op[1], None)
        return None if mine is None else bool(await q.ko(mine, delay=op[2]))
    if kind == "promote":
        return await q.promote(op[1])
    if kind == "reschedule":
        return await q.reschedule(op[1], op[2])
    if kind == "priority":
        return await q.change_priority(op[1], op[2])
    if kind == "remove":
        return await q.remove(op[1])
    if kind == "find":
        view = await q.find(op[1])
        if view is None or view.state == "processed":  # mongo-history keeps what was consumed
            return None
        return (view.state, view.message.tries, view.message.priority)
    if kind == "peek":
        views = await q.peek(1000, state=op[1])
        return sorted((v.message.id, v.state, v.message.tries, v.message.priority) for v in views)
    raise AssertionError(kind)


def _ops(seed: int, n: int) -> list[tuple[Any, ...]]:
    rnd = random.Random(seed)
    ids = [f"m{k}" for k in range(8)]
    ops: list[tuple[Any, ...]] = []
    for _ in range(n):
        mid = rnd.choice(ids)
        kind = rnd.choice(
            [
                "push",
                "push",
                "reserve",
                "pop",
                "ok",
                "ko",
                "promote",
                "reschedule",
                "priority",
                "remove",
                "find",
                "peek",
            ]
        )
        if kind == "push":
            ops.append(("push", mid, rnd.choice([0.0, LATER]), rnd.choice([0, 0, 3, -2])))
        elif kind in ("reserve", "pop"):
            ops.append((kind, 100))  # everything ready: order-free comparison
        elif kind == "ko":
            ops.append(("ko", mid, rnd.choice([0.0, LATER])))
        elif kind == "reschedule":
            ops.append(("reschedule", mid, rnd.choice([0.0, LATER])))
        elif kind == "priority":
            ops.append(("priority", mid, rnd.choice([0, 5, -5])))
        elif kind == "peek":
            ops.append(("peek", rnd.choice(["ready", "scheduled", "reserved", "all"])))
        else:
            ops.append((kind, mid))
    return ops


@pytest.mark.parametrize("seed", range(8))
async def test_a_random_sequence_answers_as_on_memory(connect: Connect, seed: int) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reschedule", "priority", "reserve", "peek")
    reference = await aio_keuss.connect("memory")
    try:
        q = await factory.queue("diff")
        r = await reference.queue("diff")
        held_q: dict[str, aio_keuss.Message] = {}
        held_r: dict[str, aio_keuss.Message] = {}
        for k, op in enumerate(_ops(seed, 150)):
            got = await _step(q, held_q, op)
            want = await _step(r, held_r, op)
            assert got == want, (seed, k, op)
            s, t = await q.sizes(), await r.sizes()
            assert (s.size, s.total, s.scheduled, s.reserved) == (
                t.size,
                t.total,
                t.scheduled,
                t.reserved,
            ), (seed, k, op)
    finally:
        await reference.close()


async def test_requeue_with_some_removed_meanwhile(connect: Connect) -> None:
    """A requeue by ids racing removes of some of them: each message is either removed or
    moved back (tries reset), never both, never lost."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "reserve", "peek", "hold", "move", "remove")
    jobs = await factory.queue("jobs")
    dl = await factory.queue("__deadletter__")
    ids = await jobs.push_many(list(range(60)))
    for m in await jobs.reserve_many(60, timeout=5):
        await jobs.ko(m)
    assert await dl.total_size() == 60
    removed = ids[::3]

    async def remove_some() -> list[bool]:
        out = []
        for i in removed:
            out.append(await dl.remove(i))
            await asyncio.sleep(0)
        return out

    moved, gone = await asyncio.gather(dl.requeue(ids), remove_some())
    got_removed = {i for i, ok in zip(removed, gone, strict=True) if ok}
    assert not (set(moved) & got_removed), "a message both removed and moved"
    assert set(moved) | got_removed == set(ids)
    assert await jobs.total_size() == len(moved)
    assert await dl.total_size() == 0
    back = await jobs.reserve_many(100, timeout=0)
    assert sorted(m.id for m in back) == sorted(moved.values())
    assert all(m.tries == 0 for m in back)


async def test_amends_from_another_factory_racing_reserves(connect: Connect, case: Any) -> None:
    """Changes made by one factory while consumers of two take the same messages: each is
    handed out once."""
    if not case.shared:
        pytest.skip("two factories of this backend share no queues")
    fa = await connect(poll_interval=5.0)
    needs(fa, "reserve", "reschedule", "priority")
    fb = await connect(poll_interval=5.0)
    qa = await fa.queue("race")
    qb = await fb.queue("race")
    ids = await qa.push_many(list(range(300)))
    got: list[str] = []
    done = asyncio.Event()

    async def consume(q: aio_keuss.Queue) -> None:
        while len(got) < 300:
            batch = await q.reserve_many(7, timeout=0.05)
            got.extend(m.id for m in batch)
        done.set()

    async def amend() -> None:
        rnd = random.Random(3)
        while not done.is_set():
            i = rnd.choice(ids)
            op = rnd.randrange(3)
            if op == 0:
                await qb.change_priority(i, rnd.choice([0, 4, -4]))
            elif op == 1:
                await qb.reschedule(i, 0)
            else:
                await qb.promote(i)
            await asyncio.sleep(0)

    await asyncio.wait_for(
        asyncio.gather(consume(qa), consume(qb), consume(qa), amend(), amend()), 120
    )
    assert len(got) == len(set(got)) == 300
    s = await qa.sizes()
    assert (s.size, s.reserved) == (0, 300)
