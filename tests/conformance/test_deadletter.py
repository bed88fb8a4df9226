"""Conformance: Deadletter after max_ko, and the one rename rule for an id already there.

Every backend runs it, skipping what it does not claim. Time bounds are generous
functional limits, never performance assertions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest
from conftest import Connect, drain_all, needs, needs_reserve

import aio_keuss
from aio_keuss import KoResult
from aio_keuss.contract import Peeked, Store
from aio_keuss.message import decode_headers
from aio_keuss.options import QueueOptions

pytestmark = pytest.mark.timeout(90)


# deadletter -----------------------------------------------------------------------------


async def test_deadletter_after_max_ko(connect: Connect) -> None:
    factory = await connect(deadletter={"max_ko": 2}, poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("work")
    dl = await factory.queue("__deadletter__")
    mid = await q.push({"poison": True}, headers={"origin": "test"})
    results = []
    for expected_tries in range(3):
        message = await q.reserve(timeout=5)
        assert message is not None and message.tries == expected_tries
        results.append(await q.ko(message))
    assert results == [KoResult.ROLLED_BACK, KoResult.ROLLED_BACK, KoResult.DEADLETTERED]
    assert await q.total_size() == 0
    dead = await dl.pop(timeout=5)
    assert dead is not None
    assert dead.payload == {"poison": True}
    assert dead.headers["origin"] == "test"
    assert dead.headers["x-dl-from-queue"] == "work"
    assert dead.headers["x-dl-tries"] == 3
    dl_time = datetime.fromisoformat(str(dead.headers["x-dl-t"]))
    assert abs((datetime.now(UTC) - dl_time).total_seconds()) < 60
    assert dead.tries == 0
    assert dead.id == mid or isinstance(dead.id, str)
    stats = await q.stats()
    assert stats["deadletter"] == 1 and stats["rollback"] == 2


@pytest.mark.parametrize("then", ["ko", "ok"])
async def test_a_message_on_its_way_to_the_deadletter_queue_is_not_delivered_again(
    connect: Connect, then: str
) -> None:
    """A ko past max_ko of a reservation that has lapsed: while the deadletter copy is
    written, a reserve must not hand the message out again. The bucket backends did (the
    slot was still handed out, its deadline past), so it was deadlettered twice, or both
    ok-ed and deadlettered. Whoever acts, the message ends in exactly one place."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "reserve", "reservation_expiry")
    q = await factory.queue("work", reserve_delay=0.2)
    dl = await factory.queue("__deadletter__")
    await q.push({"x": 1})
    first = await q.reserve(timeout=30)
    assert first is not None
    await asyncio.sleep(0.5)  # the reservation lapses (nobody has taken it again)
    ko_first = asyncio.create_task(q.ko(first))
    await asyncio.sleep(0)  # the ko is on its way
    second = await q.reserve(timeout=0.05)
    acted = None
    if second is not None:
        acted = await (q.ko(second) if then == "ko" else q.ok(second))
    outcomes = [await ko_first, acted]
    copies = 0
    while await dl.pop(timeout=0.5) is not None:
        copies += 1
    if then == "ko":
        assert copies == 1, outcomes
        assert outcomes.count(KoResult.DEADLETTERED) == 1, outcomes
    else:
        assert copies + (acted is True) == 1, outcomes
    assert await q.total_size() == 0


async def test_no_deadletter_without_max_ko(queue: aio_keuss.Queue) -> None:
    needs_reserve(queue)
    await queue.push("keeps coming back")
    for expected in range(6):
        message = await queue.reserve(timeout=5)
        assert message is not None and message.tries == expected
        assert await queue.ko(message) == KoResult.ROLLED_BACK
    assert await queue.total_size() == 1


async def test_a_message_deadlettered_round_and_round_keeps_its_headers_bounded(
    connect: Connect,
) -> None:
    """The backends that copy a deadlettered message into the deadletter queue (buckets,
    sharded, redis-reliable on a cluster) appended the x-dl-* headers to the stored ones:
    a message deadlettered again (a deadletter queue whose own consumers' failures go back
    to the work queue, a requeue) carried one more set with every round, the stored text
    growing though it decoded right. The deadletter merges them, each key once, as a move
    does."""
    work = await connect(deadletter={"max_ko": 0, "queue": "dead"}, poll_interval=5.0)
    needs(work, "reserve", "shared")
    back = await connect(deadletter={"max_ko": 0, "queue": "jobs"}, poll_interval=5.0)
    jobs = await work.queue("jobs")
    dead = await back.queue("dead")
    await jobs.push({"n": 1}, headers={"origin": "web"})
    here, there = jobs, dead
    for turn in range(50):
        held = await here.reserve(timeout=5)
        assert held is not None, turn
        assert await here.ko(held) == KoResult.DEADLETTERED, turn
        here, there = there, here
    (stored,) = (await here._store.get(1)).messages  # read raw: the encoded headers
    assert stored.headers.count(b'"x-dl-tries"') == 1, stored.headers
    assert len(stored.headers) < 200, stored.headers
    headers = decode_headers(stored.headers)
    assert list(headers) == ["origin", "x-dl-from-queue", "x-dl-t", "x-dl-tries"]
    assert [headers["origin"], headers["x-dl-from-queue"], headers["x-dl-tries"]] == [
        "web",
        "dead",
        1,
    ]


async def test_deadletter_twice_with_the_same_id_keeps_both(connect: Connect) -> None:
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "reserve", "idempotent")
    q = await factory.queue("work", dedup_window=0.01)
    dl = await factory.queue("__deadletter__")
    for round_ in range(3):
        await asyncio.sleep(0.05)  # past the dedup window: the same id may come again
        await q.push({"round": round_}, id="same-order")
        message = await q.reserve(timeout=5)
        assert message is not None
        assert await q.ko(message) == KoResult.DEADLETTERED
    dead = await drain_all(dl)
    assert sorted(m.payload["round"] for m in dead) == [0, 1, 2]
    # the one rename rule of every backend: its own id, then .dl<failed>, then .dl<failed>.N
    names = {m.payload["round"]: m.id for m in dead}
    assert names == {0: "same-order", 1: "same-order.dl1", 2: "same-order.dl1.2"}


async def test_the_deadletter_queue_opens_with_options_of_its_own_after_another_queue(
    connect: Connect,
) -> None:
    """Opening any queue opened the deadletter queue for its routing, with the defaults, and
    that refused a later open of the deadletter queue with options of its own (ConfigError:
    already open). An open the user never asked for is replaced by theirs: what was
    deadlettered before stays, and what is deadlettered after lands in the same queue."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("work")
    await q.push_many(["before", "after"])
    message = await q.reserve(timeout=5)
    assert message is not None
    assert await q.ko(message) == KoResult.DEADLETTERED
    dl = await factory.queue("__deadletter__", reserve_delay=45.0)
    assert dl.options.reserve_delay == 45.0
    assert (await factory.list())["__deadletter__"]["reserve_delay"] == 45.0
    assert await factory.queue("__deadletter__") is dl
    message = await q.reserve(timeout=5)
    assert message is not None
    assert await q.ko(message) == KoResult.DEADLETTERED
    assert sorted(m.payload for m in await drain_all(dl)) == ["after", "before"]
    # asked for once, its options are the user's: another set is refused as for any queue
    with pytest.raises(aio_keuss.ConfigError, match="already open"):
        await factory.queue("__deadletter__", reserve_delay=60.0)


@pytest.mark.parametrize("first", [True, False])
async def test_the_deadletter_queue_asked_for_with_options_while_others_open(
    connect: Connect, first: bool
) -> None:
    """Asked for while other queues open (and open it for their routing): the ask that
    joins the factory's own open of it, or that the factory's own open joins, ends with its
    options all the same."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    others = [factory.queue(name) for name in ("a", "b", "c")]
    asked = factory.queue("__deadletter__", reserve_delay=45.0)
    opened = await asyncio.gather(asked, *others) if first else await asyncio.gather(*others, asked)
    dl = opened[0] if first else opened[-1]
    assert dl.options.reserve_delay == 45.0
    assert await factory.queue("__deadletter__") is dl
    assert (await factory.list())["__deadletter__"]["reserve_delay"] == 45.0


async def test_the_options_a_claim_reopens_the_deadletter_queue_with_are_in_effect(
    connect: Connect,
) -> None:
    """The claim reopens the queue with the user's options: the queue object has them, and
    so must what its store does with them. A sharded backend keeps one store per name, and
    handed the reopened queue the factory's own, made with the defaults: its dedup window
    (an hour by default) still kept a consumed id out although the user asked for none."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "idempotent")
    await factory.queue("work")  # opens the deadletter queue for its routing, by default
    dl = await factory.queue("__deadletter__", dedup_window=0)
    assert dl.options.dedup_window == 0
    await dl.push("first", id="k")
    popped = await dl.pop(timeout=10)
    assert popped is not None and popped.payload == "first"
    assert await dl.push("second", id="k") == "k"  # no window: the id is free once consumed
    assert await dl.total_size() == 1
    popped = await dl.pop(timeout=10)
    assert popped is not None and popped.payload == "second"


async def test_a_deadletter_queue_asked_for_with_the_defaults_keeps_them(
    connect: Connect,
) -> None:
    """Only an open the user never asked for gives way: one asked for without options is
    theirs (with the defaults), as for any other queue."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    await factory.queue("work")
    dl = await factory.queue("__deadletter__")
    with pytest.raises(aio_keuss.ConfigError, match="already open"):
        await factory.queue("__deadletter__", reserve_delay=45.0)
    assert await factory.queue("__deadletter__") is dl


async def test_asks_joining_the_factory_s_own_open_of_the_deadletter_queue_get_one_queue(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two asks of the deadletter queue, with options and without, joined the factory's own
    open of it (for another queue's routing): the first reopened it with its options, the
    other was handed the queue being closed (its consumers, its sizes: ClosedError)."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    opening, held = asyncio.Event(), asyncio.Event()
    make = factory.backend.store

    async def store(name: str, options: QueueOptions) -> Store:
        if name == "__deadletter__" and not held.is_set():
            opening.set()
            await held.wait()
        return await make(name, options)

    monkeypatch.setattr(factory.backend, "store", store)
    work = asyncio.ensure_future(factory.queue("work"))
    await asyncio.wait_for(opening.wait(), 30)  # the factory's own open of it is under way
    asked = asyncio.ensure_future(factory.queue("__deadletter__", reserve_delay=45.0))
    plain = asyncio.ensure_future(factory.queue("__deadletter__"))
    for _ in range(2):  # both join that open
        await asyncio.sleep(0)
    held.set()
    await work
    dl = await asked
    assert dl.options.reserve_delay == 45.0
    assert await plain is dl
    await dl.push("in")
    assert (await dl.sizes()).total == 1


async def test_a_find_in_the_deadletter_queue_and_a_plain_ask_end_across_its_claim(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadletter queue opened for the routing, a find looking in it, the user's open
    of it with options of its own, and an ask without options after it: the reopen closed
    the factory's open under the find's lookup (which a store refusing calls once closed
    failed), and now waits for it; the plain ask gets the reopened queue."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "peek")
    entered, go = asyncio.Event(), asyncio.Event()
    make = factory.backend.store

    async def store(name: str, options: QueueOptions) -> Store:
        made = await make(name, options)
        if name == "__deadletter__" and not entered.is_set():  # the factory's own open
            locate = made.locate

            async def held(ids: Sequence[str]) -> list[Peeked | None]:
                entered.set()
                await go.wait()
                return await locate(ids)

            monkeypatch.setattr(made, "locate", held)
        return made

    monkeypatch.setattr(factory.backend, "store", store)
    work = await factory.queue("work")
    finding = asyncio.ensure_future(work.find("nowhere"))
    await asyncio.wait_for(entered.wait(), 30)  # its lookup in the deadletter queue is out
    asked = asyncio.ensure_future(factory.queue("__deadletter__", reserve_delay=45.0))
    plain = asyncio.ensure_future(factory.queue("__deadletter__"))
    for _ in range(50):  # the claim goes as far as it can meanwhile
        await asyncio.sleep(0)
    go.set()
    assert await finding is None
    dl = await asked
    assert dl.options.reserve_delay == 45.0
    assert await plain is dl
    await dl.push("in")
    assert (await dl.sizes()).total == 1
    assert await work.find("nowhere") is None


@pytest.mark.parametrize("second", ["ko", "ok"])
async def test_a_ko_past_max_ko_racing_another_ok_or_ko_of_the_holder_ends_in_one_place(
    connect: Connect, second: str
) -> None:
    """One holder's ko past max_ko and, at the same time, another ko or an ok of the same
    reservation (two tasks handling one message): whichever lands first decides, and the
    message ends in exactly one place. On Redis Cluster (deadletter in three steps) and on
    redis-sharded (two steps) the message stayed held while its copy was written, so the
    racing ko deadlettered it a second time (two copies, both kos DEADLETTERED) and the
    racing ok acknowledged it beside its deadletter copy."""
    factory = await connect(deadletter={"max_ko": 0}, poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("work")
    dl = await factory.queue("__deadletter__")
    await q.push({"x": 1})
    held = await q.reserve(timeout=30)
    assert held is not None
    outcomes = await asyncio.gather(q.ko(held), q.ko(held) if second == "ko" else q.ok(held))
    # a copy a ko reported is waited for (a bucket store writes it out in the background);
    # a second one, the defect, would have been written beside it
    copies = 0
    wait = 30.0 if KoResult.DEADLETTERED in outcomes else 0.5
    while await dl.pop(timeout=wait) is not None:
        copies += 1
        wait = 0.5
    if second == "ko":
        assert outcomes.count(KoResult.DEADLETTERED) == 1, outcomes
        assert copies == 1, outcomes
    else:
        assert copies + (outcomes[1] is True) == 1, outcomes
        assert (outcomes[0] is KoResult.DEADLETTERED) == (copies == 1), outcomes
    assert await q.total_size() == 0
    stats = await q.stats()
    assert stats["deadletter"] == copies, (stats, outcomes)
