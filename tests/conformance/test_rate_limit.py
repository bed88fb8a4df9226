"""Conformance: rate limits. A queue opened with ``rate_limit`` hands out (pop and reserve,
so consumers too) at most ``rate_limit`` messages per ``rate_period``, over every factory
and process sharing the backend, bursts of at most ``rate_burst``; a handler's
``RateLimited(seconds)`` gives its message back at no try and holds the queue's deliveries
everywhere for that long.

Every backend runs it: those without ``capabilities.rate_limit`` refuse a rate limit when
the queue opens (or at connect), before anything is written. Nothing here times the
backend: grants are counted against the limiter's own clock with periods of an hour
(nothing more falls due during a test), a short wait that nothing more comes is a bound on
behaviour, and the long waits are hang guards.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from conftest import Connect, needs

import aio_keuss
from aio_keuss import Message, RateLimited
from aio_keuss.contract import RateGrant, RateRule

pytestmark = pytest.mark.timeout(120)

HOUR = 3600.0
"""A period no test outlives: no grant falls due again during it."""
QUIET = 0.5
"""How long a take waits to show that nothing more comes (a bound on behaviour)."""
GUARD = 30.0
"""Hang guard of a wait that must end."""


async def _until(condition: Callable[[], Awaitable[bool] | bool], guard: float = GUARD) -> None:
    """Wait for a condition, polling: a condition, not a guess at how long it takes."""

    async def poll() -> None:
        while True:
            outcome = condition()
            if outcome if isinstance(outcome, bool) else await outcome:
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), guard)


async def _take(q: aio_keuss.Queue, n: int, *, reserve: bool = False) -> list[Message]:
    """Up to ``n`` messages, waiting for the first (a bucket store's are visible once
    flushed), then what comes within a short while."""
    take = q.reserve_many if reserve else q.pop_many
    got = await take(n, timeout=GUARD)
    while got and len(got) < n:
        more = await take(n - len(got), timeout=QUIET)
        if not more:
            break
        got += more
    return got


async def _limited_queue(connect: Connect, name: str, **options: object) -> aio_keuss.Queue:
    factory = await connect(poll_interval=60.0)
    needs(factory, "rate_limit")
    return await factory.queue(name, **options)


# options and capability -------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"rate_limit": -1},
        {"rate_limit": True},
        {"rate_limit": 1.5},
        {"rate_limit": 2**31},
        {"rate_limit": 5, "rate_period": 0},
        {"rate_limit": 5, "rate_period": -1.0},
        {"rate_limit": 5, "rate_period": "1"},
        {"rate_limit": 5, "rate_burst": -1},
        {"rate_burst": 3},
        {"rate_limit": 1, "rate_period": 1e9, "rate_burst": 2},  # a burst of 2e9 s
    ],
)
async def test_bad_rate_options_are_refused(connect: Connect, options: dict[str, object]) -> None:
    factory = await connect()
    with pytest.raises(aio_keuss.ConfigError):
        await factory.queue("bad", **options)
    with pytest.raises(aio_keuss.ConfigError):
        await connect(**options)
    assert "bad" not in await factory.list()


async def test_a_queue_opts_out_of_the_factorys_rate_limit_with_rate_limit_0(
    connect: Connect,
) -> None:
    """A connect default of a limit and a burst: a queue given ``rate_limit=0`` has none,
    its inherited burst going with it (it was refused as a burst without a limit)."""
    factory = await connect(poll_interval=60.0, rate_limit=5, rate_burst=2)
    needs(factory, "rate_limit")
    free = await factory.queue("free", rate_limit=0)
    assert (free.options.rate_limit, free.options.rate_burst) == (0, 0)
    await free.push_many(list(range(5)))
    assert len(await _take(free, 5)) == 5
    with pytest.raises(aio_keuss.ConfigError):  # a burst given with no limit still is
        await factory.queue("bad", rate_limit=0, rate_burst=3)


async def test_a_connect_default_leaves_the_deadletter_queue_unlimited(connect: Connect) -> None:
    """The deadletter queue took the connect defaults, a ``rate_limit`` with them: the
    queue that gathers every queue's failures was drained (requeue, the admin commands) at
    the rate meant for those queues' work. The connect default does not reach it, whoever
    opens it first (the factory for its routing, or the user); a limit of its own does."""
    options = {"poll_interval": 60.0, "rate_limit": 1, "rate_period": HOUR, "rate_burst": 1}
    dead_options = {"deadletter": {"max_ko": 1, "queue": "dead"}}
    factory = await connect(**options, **dead_options)
    needs(factory, "rate_limit")
    jobs = await factory.queue("jobs")  # the factory opens "dead" beside it, for its routing
    assert jobs.options.rate_limit == 1
    dead = await factory.queue("dead")
    assert (dead.options.rate_limit, dead.options.rate_burst) == (0, 0)
    await dead.push_many(list(range(5)))
    assert len(await _take(dead, 5)) == 5
    first = await (await connect(**options, **dead_options)).queue("dead")  # asked first
    assert (first.options.rate_limit, first.options.rate_burst) == (0, 0)
    own = await (await connect(**options, **dead_options)).queue("dead", rate_limit=2)
    assert (own.options.rate_limit, own.options.rate_period) == (2, HOUR)
    await own.push_many(list(range(5)))
    assert len(await _take(own, 5)) == 2


async def test_a_rate_limit_where_the_backend_has_none_is_refused_at_open(
    connect: Connect,
) -> None:
    factory = await connect()
    if factory.capabilities.rate_limit:
        pytest.skip("this backend has rate limits")
    with pytest.raises(aio_keuss.ConfigError, match="rate limits"):
        await factory.queue("limited", rate_limit=5)
    assert "limited" not in await factory.list()
    with pytest.raises(aio_keuss.ConfigError, match="rate limits"):
        await connect(rate_limit=5)
    plain = await factory.queue("limited")  # the default, 0: no limit, opens as ever
    await plain.push("x")
    assert await plain.total_size() == 1


# the limit --------------------------------------------------------------------------------


async def test_only_the_limit_comes_out_then_the_consumer_waits(connect: Connect) -> None:
    q = await _limited_queue(connect, "five", rate_limit=5, rate_period=HOUR)
    await q.push_many(list(range(20)))
    got = await _take(q, 20)
    assert [m.payload for m in got] == list(range(5))
    assert await q.pop_many(20, timeout=QUIET) == []
    assert await q.total_size() == 15  # the rest waits, none lost


async def test_pop_and_reserve_both_count(connect: Connect) -> None:
    q = await _limited_queue(connect, "both", rate_limit=6, rate_period=HOUR)
    needs(q, "pop", "reserve")
    await q.push_many(list(range(20)))
    popped = await _take(q, 4)
    assert len(popped) == 4
    reserved = await _take(q, 20, reserve=True)
    assert len(reserved) == 2
    assert await q.reserve(timeout=QUIET) is None
    assert await q.pop(timeout=QUIET) is None
    assert await q.ok_many(reserved) == [True, True]
    assert await q.total_size() == 14


async def test_an_empty_queue_does_not_spend_the_limit(connect: Connect) -> None:
    """Takes that find nothing give their grants back: consumers polling an idle queue do
    not use up the limit of the messages still to come."""
    q = await _limited_queue(connect, "idle", rate_limit=3, rate_period=HOUR)
    for _ in range(5):
        assert await q.pop_many(3, timeout=0) == []
    await q.push_many(list(range(10)))
    # no timeout: a limit spent would leave the take asleep until the next grant (an hour)
    got = await asyncio.wait_for(q.pop_many(10), GUARD)
    while more := await q.pop_many(10, timeout=QUIET):
        got += more
    assert len(got) == 3


async def test_two_factories_share_one_limit(connect: Connect) -> None:
    first = await connect(poll_interval=60.0)
    needs(first, "rate_limit", "shared")
    q1 = await first.queue("shared", rate_limit=4, rate_period=HOUR)
    await q1.push_many(list(range(20)))
    assert len(await _take(q1, 3)) == 3
    await first.close()  # a bucket store's leased messages go back for the other to see
    second = await connect(poll_interval=60.0)
    q2 = await second.queue("shared", rate_limit=4, rate_period=HOUR)
    assert len(await _take(q2, 20)) == 1
    assert await q2.pop(timeout=QUIET) is None
    assert await q2.total_size() == 16


async def test_consumers_follow_the_limit(connect: Connect) -> None:
    q = await _limited_queue(connect, "workers", rate_limit=3, rate_period=HOUR)
    await q.push_many(list(range(10)))
    seen: list[int] = []

    async def handle(message: Message) -> None:
        seen.append(message.payload)

    consumer = q.consume(handle, concurrency=4, prefetch=2)
    try:
        await _until(lambda: len(seen) >= 3)
        await asyncio.sleep(QUIET)
        assert len(seen) == 3
    finally:
        await consumer.stop()
    assert await q.total_size() == 7


async def test_a_waiting_consumer_wakes_when_a_grant_falls_due(connect: Connect) -> None:
    """One grant per half second, evenly spaced: the second take waits for the limiter's
    next grant, woken by its own timer (the poll interval is a minute, and nothing is
    pushed meanwhile to signal it)."""
    q = await _limited_queue(connect, "spaced", rate_limit=1, rate_period=0.5, rate_burst=1)
    await q.push_many(list(range(3)))
    got = await _take(q, 3)
    assert len(got) >= 1
    while len(got) < 3:
        more = await asyncio.wait_for(q.pop_many(3, timeout=GUARD), GUARD)
        assert more, "the grant fell due, and the waiting consumer was not woken"
        got += more
    assert [m.payload for m in got] == [0, 1, 2]


async def test_a_burst_spends_at_most_rate_burst(connect: Connect) -> None:
    q = await _limited_queue(connect, "burst", rate_limit=10, rate_period=HOUR, rate_burst=2)
    await q.push_many(list(range(10)))
    assert len(await _take(q, 10)) == 2
    assert await q.pop(timeout=QUIET) is None


# RateLimited ------------------------------------------------------------------------------


async def test_rate_limited_gives_back_and_stops_every_factory(connect: Connect) -> None:
    q = await _limited_queue(connect, "refused", rate_limit=1000, rate_period=1.0)
    await q.push("job")
    refused: list[Message] = []

    async def handle(message: Message) -> None:
        refused.append(message)
        raise RateLimited(HOUR)

    consumer = q.consume(handle)
    try:
        await _until(lambda: consumer.rate_limited == 1)
    finally:
        await consumer.stop()
    assert len(refused) == 1 and consumer.failed == 0
    assert await q.total_size() == 1  # given back, not lost
    assert await q.pop(timeout=QUIET) is None  # held here
    if q.capabilities.shared:
        other = await connect(poll_interval=60.0)
        there = await other.queue("refused", rate_limit=1000, rate_period=1.0)
        assert await there.pop(timeout=QUIET) is None  # and there
    if q.capabilities.peek and q.capabilities.reserve:
        (view,) = await q.peek(5, state="all")
        assert view.message.tries == 0


async def test_rate_limited_costs_no_try(connect: Connect) -> None:
    q = await _limited_queue(connect, "retry", rate_limit=1000, rate_period=1.0)
    needs(q, "reserve")
    await q.push("job")
    tries: list[int] = []

    async def handle(message: Message) -> None:
        tries.append(message.tries)
        if len(tries) == 1:
            raise RateLimited(0.2)

    consumer = q.consume(handle, retry_delay=HOUR)  # a ko's backoff would not end in time
    try:
        await _until(lambda: consumer.handled == 1)
    finally:
        await consumer.stop()
    assert tries == [0, 0]
    assert consumer.rate_limited == 1 and consumer.failed == 0
    assert await q.total_size() == 0


async def test_rate_limited_without_a_rate_limit_is_a_failure(connect: Connect) -> None:
    factory = await connect(poll_interval=60.0)
    needs(factory, "reserve")
    q = await factory.queue("unlimited")
    await q.push("job")

    async def handle(message: Message) -> None:
        raise RateLimited(HOUR)

    consumer = q.consume(handle, retry_delay=HOUR)
    try:
        await _until(lambda: consumer.failed == 1)
    finally:
        await consumer.stop()
    assert consumer.rate_limited == 0


async def test_rate_limited_for_no_time_is_a_failure(connect: Connect) -> None:
    """``RateLimited(0)`` would give the message back at no try and take it again at once:
    a handler raising it every time spun for ever. It counts as a failure (a try, then the
    deadletter queue)."""
    q = await _limited_queue(connect, "zero", rate_limit=1000, rate_period=1.0)
    needs(q, "reserve")
    await q.push("job")

    async def handle(message: Message) -> None:
        raise RateLimited(0)

    consumer = q.consume(handle, retry_delay=HOUR)
    try:
        await _until(lambda: consumer.failed == 1)
    finally:
        await consumer.stop()
    assert consumer.rate_limited == 0


async def test_rate_limited_from_a_batch_handler_gives_back_the_whole_batch(
    connect: Connect,
) -> None:
    q = await _limited_queue(connect, "batches", rate_limit=1000, rate_period=1.0)
    needs(q, "reserve")
    await q.push_many(["a", "b", "c"])
    batches: list[list[int]] = []

    async def handle(batch: list[Message]) -> None:
        batches.append([m.tries for m in batch])
        if len(batches) == 1:
            raise RateLimited(0.2)

    consumer = q.consume(handle, batch=3, retry_delay=HOUR)
    try:
        await _until(lambda: consumer.handled == 3)
    finally:
        await consumer.stop()
    assert consumer.rate_limited == len(batches[0]) and consumer.failed == 0
    assert all(tries == 0 for batch in batches for tries in batch)
    assert await q.total_size() == 0


async def test_pushes_do_not_wake_a_consumer_the_limiter_holds(connect: Connect) -> None:
    """A consumer the limiter refused sleeps until the next grant: the pushes meanwhile
    cannot make one fall due sooner, so they do not wake it to ask the limiter again (each
    push cost a limiter round trip, a backlog pushed faster than the limit as many)."""
    factory = await connect(poll_interval=60.0)
    needs(factory, "rate_limit")
    asked: list[int] = []
    rate_take = factory.backend.rate_take

    async def counted(queue: str, rule: RateRule, count: int, *more: float) -> RateGrant:
        asked.append(count)
        return await rate_take(queue, rule, count, *more)

    factory.backend.rate_take = counted  # type: ignore[method-assign,assignment]
    q = await factory.queue("held", rate_limit=1, rate_period=HOUR)
    await q.push("first")
    assert len(await _take(q, 1)) == 1  # the limit spent for the hour
    waiter = asyncio.create_task(q.pop(timeout=GUARD))
    await _until(lambda: len(asked) >= 2)  # the waiter asked, and was refused
    before = len(asked)
    for k in range(20):
        await q.push(k)
        await asyncio.sleep(0.01)  # a turn for the signal to come in
    await asyncio.sleep(QUIET)
    assert not waiter.done()
    assert len(asked) - before <= 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_grants_given_back_late_lend_nothing_to_the_takes_made_since(
    connect: Connect,
) -> None:
    """Backend.rate_take as the queue layer calls it: a take's grants given back once their
    time went by (the take's store round trip was slow) give back nothing, so the grant
    another take got meanwhile is not handed out a second time at once.

    The give-back's answer says where it left the limiter (``end``): still at the other
    take's end, whenever it ran (the defect moved it back an interval). The take after it
    must be refused only if it came within the other's interval: a machine that stalled
    2 s between them made the next grant due by right, so it is checked against the time
    it came back by."""
    factory = await connect(poll_interval=60.0)
    needs(factory, "rate_limit")
    rule = RateRule(1, 2.0, 1)  # one every 2 s, evenly
    backend = factory.backend
    first = await backend.rate_take("late", rule, 1, 0.0)
    assert first.granted == 1
    await asyncio.sleep(first.wait + 0.1)  # its time goes by: the next grant falls due
    asked = time.monotonic()
    other = await backend.rate_take("late", rule, 1, 0.0)
    assert other.granted == 1
    back = await backend.rate_take("late", rule, -1, 0.0, first.end)  # the first found nothing
    assert back.granted == 0 and back.end >= other.end - 0.001, (back, other)  # nothing lent
    after = await backend.rate_take("late", rule, 1, 0.0)
    if time.monotonic() - asked < rule.interval - 0.1:  # all within the other's interval
        assert after.granted == 0 and after.wait > 0  # before: granted beside the other's


async def _one_grant_an_hour_on_two_factories(
    connect: Connect, name: str
) -> tuple[aio_keuss.Factory, aio_keuss.Queue, aio_keuss.Queue]:
    """Queue ``name`` opened on two factories (each polling every 30 s), one grant an hour:
    the second factory, and the queue on the first and on the second."""
    first = await connect(poll_interval=30.0)
    needs(first, "rate_limit", "shared")
    second = await connect(poll_interval=30.0)
    q1 = await first.queue(name, rate_limit=1, rate_period=HOUR, rate_burst=1)
    q2 = await second.queue(name, rate_limit=1, rate_period=HOUR, rate_burst=1)
    return second, q1, q2


@asynccontextmanager
async def _refused_while_a_grant_is_held(
    q1: aio_keuss.Queue, q2: aio_keuss.Queue, refused: asyncio.Event
) -> AsyncIterator[
    tuple[asyncio.Event, asyncio.Future[Message | None], asyncio.Future[Message | None]]
]:
    """A take on ``q1`` holds the only grant and finds nothing, its give-back held until
    the event yielded first is set; meanwhile a pop on ``q2`` (30 s timeout) is refused
    (the caller's ``refused`` set, by its own hook on ``q2``'s limiter). Yields that event,
    the take and the pop; on the way out the give-back goes on and both are cancelled."""
    holding, release = asyncio.Event(), asyncio.Event()
    give_back = q1._give_back_grants

    async def held(count: int, end: float) -> RateGrant | None:
        holding.set()  # the grant taken, nothing found
        await release.wait()
        return await give_back(count, end)

    q1._give_back_grants = held  # type: ignore[method-assign]
    taking = asyncio.ensure_future(q1.pop(timeout=0))
    waiting: asyncio.Future[Message | None] | None = None
    try:
        await asyncio.wait_for(holding.wait(), GUARD)
        waiting = asyncio.ensure_future(q2.pop(timeout=30.0))
        await asyncio.wait_for(refused.wait(), GUARD)
        yield release, taking, waiting
    finally:
        release.set()
        for task in (taking, waiting):
            if task is not None:
                task.cancel()


@pytest.mark.parametrize("pushed_while_refused", [False, True], ids=["after", "meanwhile"])
async def test_a_grant_given_back_unused_wakes_a_consumer_it_kept_waiting(
    connect: Connect, pushed_while_refused: bool
) -> None:
    """A take holds the only grant and finds nothing; a consumer of another factory asks
    meanwhile and is refused (the next grant an hour away). Once the grant is given back,
    a message pushed must reach that consumer, not wait for its 30 s timeout: it slept until
    the limiter's next grant, and the give-back told nobody. ``meanwhile``: the push comes
    while the refused consumer's limiter call is still on its way back (announced to it
    before it sleeps, not while it sleeps): it slept on without noting that a push had
    come, so the give-back woke nobody. Ordered by events; the bound is half the
    consumer's timeout, far above any latency."""
    _, q1, q2 = await _one_grant_an_hour_on_two_factories(connect, "given-back")
    refused, pushed = asyncio.Event(), asyncio.Event()
    ask = q2._ask_limiter

    async def noted(count: int, hold: float, end: float = math.inf) -> RateGrant:
        grant = await ask(count, hold, end)
        if count > 0 and not grant.granted and not refused.is_set():
            refused.set()
            if pushed_while_refused:
                await pushed.wait()  # the answer is back once the push was announced here
        return grant

    q2._ask_limiter = noted  # type: ignore[method-assign]
    try:
        async with _refused_while_a_grant_is_held(q1, q2, refused) as (release, taking, waiting):
            if pushed_while_refused:
                announced = q2._wakeups.announced
                await q1.push("the message")
                await _until(lambda: q2._wakeups.announced != announced)
                pushed.set()
                await _until(lambda: len(q2._wakeups) > 0)  # asleep again, refused
            release.set()
            assert await asyncio.wait_for(taking, GUARD) is None
            if not pushed_while_refused:
                await q1.push("the message")
            message = await asyncio.wait_for(waiting, 15.0)
            assert message is not None and message.payload == "the message"
    finally:
        pushed.set()


async def test_a_grant_given_back_heard_before_the_refusal_still_wakes_its_consumer(
    connect: Connect,
) -> None:
    """As ``test_a_grant_given_back_unused_wakes_a_consumer_it_kept_waiting``, but the
    give-back's announcement reaches the refused consumer's process before the limiter's
    answer that refused it (they come on different connections): the answer's next grant,
    an hour away, was then kept over the announcement, and the consumer slept until then,
    the message pushed after it too. Ordered by events; the bound is half the consumer's
    timeout, far above any latency."""
    second, q1, q2 = await _one_grant_an_hour_on_two_factories(connect, "heard-first")
    refused, heard = asyncio.Event(), asyncio.Event()
    limiter = q2._limiter
    assert limiter is not None

    async def late(count: int, hold: float, end: float) -> RateGrant:
        grant = await limiter(count, hold, end)
        if count > 0 and not grant.granted and not refused.is_set():
            refused.set()
            await heard.wait()  # the answer comes in once the give-back was heard here
        return grant

    q2._limiter = late
    unsubscribe = second.signal.subscribe_grants("heard-first", lambda _: heard.set())
    try:
        async with _refused_while_a_grant_is_held(q1, q2, refused) as (release, taking, waiting):
            release.set()
            assert await asyncio.wait_for(taking, GUARD) is None
            await asyncio.wait_for(heard.wait(), GUARD)
            await _until(lambda: len(q2._wakeups) > 0)  # asleep, refused
            await q1.push("the message")
            message = await asyncio.wait_for(waiting, 15.0)
            assert message is not None and message.payload == "the message"
    finally:
        unsubscribe()
        heard.set()


async def test_a_grant_given_back_while_held_wakes_a_consumer_it_kept_waiting(
    connect: Connect,
) -> None:
    """As ``test_a_grant_given_back_unused_wakes_a_consumer_it_kept_waiting``, but a
    handler's ``RateLimited`` holds the limiter (a few seconds) when the grant comes back:
    the give-back leaves no grant due before the hold ends, yet brings the next one from an
    hour away to the hold's end. It was announced only if a grant was due at once, so
    nobody was told: the refused consumer slept on until the limiter's next grant, an hour
    after the hold had ended, and so did the message pushed after it. Ordered by events;
    the bound is half the consumer's timeout, far above the hold and any latency."""
    _, q1, q2 = await _one_grant_an_hour_on_two_factories(connect, "held-back")
    refused = asyncio.Event()
    ask = q2._ask_limiter

    async def noted(count: int, hold: float, end: float = math.inf) -> RateGrant:
        grant = await ask(count, hold, end)
        if count > 0 and not grant.granted:
            refused.set()
        return grant

    q2._ask_limiter = noted  # type: ignore[method-assign]
    async with _refused_while_a_grant_is_held(q1, q2, refused) as (release, taking, waiting):
        await q1._ask_limiter(0, 3.0)  # as a handler's RateLimited(3) does
        release.set()
        assert await asyncio.wait_for(taking, GUARD) is None
        await q1.push("the message")
        message = await asyncio.wait_for(waiting, 15.0)
        assert message is not None and message.payload == "the message"


async def test_grants_given_back_do_not_keep_idle_consumers_waking_each_other(
    connect: Connect,
) -> None:
    """Four factories, three consumers each, a limit of two a second: twelve messages pushed
    in a burst (refused consumers note the pushes), all taken, then the queue idles. A grant
    given back wakes the consumers a push woke meanwhile, whose takes give back in turn: each
    give-back must not set up the next wake, or the idle consumers wake one another (and
    publish a signal each time) for good. Counted, not timed: over the whole run, a few per
    message and consumer at most (a wake storm publishes thousands within the quiet
    window, which only bounds how long it is watched)."""
    factories = [await connect(poll_interval=30.0) for _ in range(4)]
    needs(factories[0], "rate_limit", "shared")
    published = 0
    queues: list[aio_keuss.Queue] = []
    for factory in factories:
        queues.append(await factory.queue("storm", rate_limit=2, rate_period=1.0, rate_burst=2))
        granted = factory.signal.granted

        def counted(queue: str, granted: Callable[[str], None] = granted) -> None:
            nonlocal published
            published += 1
            granted(queue)

        factory.signal.granted = counted  # type: ignore[method-assign]
    got: list[object] = []

    async def consume(q: aio_keuss.Queue) -> None:
        while True:
            message = await q.pop(timeout=30.0)
            if message is not None:
                got.append(message.payload)

    consumers = [asyncio.ensure_future(consume(q)) for q in queues for _ in range(3)]
    try:
        for n in range(12):
            await queues[n % 4].push(n)
        await _until(lambda: len(got) == 12)
        await asyncio.sleep(3 * QUIET)  # quiet: a storm goes on through it
        assert published <= 4 * (12 + len(consumers))
    finally:
        for task in consumers:
            task.cancel()
        await asyncio.gather(*consumers, return_exceptions=True)


async def test_an_idle_consumer_publishes_no_grant_signal_per_poll(connect: Connect) -> None:
    """A take of an idle rate-limited queue spends the only grant due (a burst of one),
    finds nothing and gives it back: nobody was refused meanwhile, so nobody is to be told.
    Each such give-back published a "grant" signal, one per poll of every idle consumer,
    for as long as the queue idled. A consumer refused meanwhile is still told (see
    ``test_a_grant_given_back_unused_wakes_a_consumer_it_kept_waiting``). Counted: polls
    that do not wait (timeout 0), each one take and one give-back."""
    factory = await connect(poll_interval=60.0)
    needs(factory, "rate_limit")
    q = await factory.queue("idle-grants", rate_limit=1, rate_period=HOUR, rate_burst=1)
    published = 0
    granted = factory.signal.granted

    def counted(queue: str) -> None:
        nonlocal published
        published += 1
        granted(queue)

    factory.signal.granted = counted  # type: ignore[method-assign]
    heard: list[object] = []
    unsubscribe = factory.signal.subscribe_grants("idle-grants", heard.append)
    try:
        for _ in range(5):
            assert await q.pop(timeout=0) is None
        if q.capabilities.reserve:
            assert await q.reserve(timeout=0) is None
        await q.push("then a message")  # the limit was not spent on the polls
        got = await q.pop(timeout=GUARD)
        assert got is not None and got.payload == "then a message"
        assert published == 0 and not [s for s in heard if getattr(s, "kind", None) == "grant"]
    finally:
        unsubscribe()
