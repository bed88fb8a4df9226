"""A factory close cancelled while a round trip is in flight (``asyncio.timeout`` around
``factory.close()``, a second Ctrl-C), with reservations the user holds and has not
acknowledged.

The close is cancelled at a point the test controls: while it waits for a pop sent before it
began, whose reply the test holds (on Redis the client stops reading its connection: the
command ran, its reply waits in the socket; on SQLite a connection of the test's own holds
the file's write lock, so the pop runs once it is released). The reply is let through once
the cancellation is in. Then a second factory counts: every message was received by the
pop, or is ready again, none left reserved for a closed queue or lost with a connection
closed under its reply.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from backends import CASES, BackendCase, new_token, until_closed

import aio_keuss

pytestmark = pytest.mark.timeout(120)

MESSAGES = 10
_CASES = {case.id: case for case in CASES}


@pytest.fixture(params=["redis-oq", "redis-reliable", "sqlite"])
async def case_options(request: pytest.FixtureRequest) -> AsyncIterator[tuple[BackendCase, Any]]:
    case = _CASES[request.param]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    # Counters and wake-ups in memory: their close makes no round trip of its own, which
    # would wait behind the held reply and let it through before the connection closed.
    options = {**case.options(new_token()), "stats": "memory", "signal": "local"}
    if case.name == "sqlite":
        options["busy_timeout"] = 60.0
    yield case, options
    if case.cleanup is not None:
        await case.cleanup(options)


def _holder(
    factory: aio_keuss.Factory, case: BackendCase, options: dict[str, Any]
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(hold, release) of the replies to the factory's next calls (see the module's
    docstring)."""
    if case.name == "sqlite":
        blocker = sqlite3.connect(options["path"], timeout=60, isolation_level=None)
        return (lambda: blocker.execute("BEGIN IMMEDIATE")), (lambda: blocker.execute("ROLLBACK"))
    transport = factory.backend._lane._protocol.transport  # type: ignore[attr-defined]
    return transport.pause_reading, transport.resume_reading


async def _left_in(
    case: BackendCase, options: dict[str, Any], name: str
) -> tuple[list[str], aio_keuss.Sizes]:
    """Through another factory, once the close is over: the ids ready in queue ``name``
    (taken, so the sizes after show what stayed reserved), and those sizes."""
    other = await aio_keuss.connect(case.name, **options)
    try:
        o = await other.queue(name, reserve_delay=3600.0)
        ready: list[str] = []
        while batch := await o.pop_many(100, timeout=0):
            ready.extend(m.id for m in batch)
        return ready, await o.sizes()
    finally:
        await other.close()


@pytest.mark.parametrize("cancelled", [True, False], ids=["cancelled", "plain"])
@pytest.mark.parametrize("kind", ["pop", "reserve"])
async def test_a_close_during_a_round_trip_loses_nothing_and_hands_out_nothing_twice(
    case_options: tuple[BackendCase, dict[str, Any]], kind: str, cancelled: bool
) -> None:
    """A close cancelled while a pop or a reserve is in flight still waits for it (closing
    the connection under it lost the messages Redis had popped) and gives back the
    reservations the user held (they stayed reserved for ``reserve_delay``). Cancelled or
    not, the messages a reserve in flight took are given back with the rest, and so are not
    handed to its caller as well (another consumer could take them at once)."""
    case, options = case_options
    factory = await aio_keuss.connect(case.name, **options)
    q = await factory.queue("jobs", reserve_delay=3600.0)
    await q.push_many([{"n": n} for n in range(MESSAGES)])
    held = await q.reserve_many(3)  # the user's, never acknowledged
    assert len(held) == 3
    hold, release = _holder(factory, case, options)
    hold()
    taking = asyncio.create_task(q.pop_many(2) if kind == "pop" else q.reserve_many(2))
    await asyncio.sleep(0)  # the call is sent; its reply is held
    closing = asyncio.create_task(factory.close())
    await until_closed(q)  # the close waits for what is in flight
    assert q._closed and not taking.done()
    if cancelled:
        closing.cancel()  # as asyncio.timeout around the close would
        await asyncio.sleep(0.05)
    release()
    outcome = await asyncio.gather(closing, return_exceptions=True)
    assert isinstance(outcome[0], asyncio.CancelledError) if cancelled else outcome == [None]
    got = [m.id for m in await asyncio.wait_for(taking, 30)]
    with pytest.raises(aio_keuss.ClosedError):
        await q.ok(held[0])
    ready, sizes = await _left_in(case, options, "jobs")
    assert sizes.total == 0, sizes  # nothing left reserved for a closed queue
    assert {m.id for m in held} <= set(ready)  # given back, ready at once
    assert not set(got) & set(ready), "handed out and queued again"
    assert len(ready) + len(got) == MESSAGES
    assert len(got) == (2 if kind == "pop" else 0)


async def test_a_cancelled_close_waits_for_a_silent_server_only_so_long(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancelled close gives up finishing after ``CANCELLED_CLOSE_GRACE`` when a reply
    does not come (a server that stopped answering): a shutdown timeout still bounds the
    close. What it could not give back stays reserved until its reservation expires (and
    is logged), and is not handed out by the reserve whose reply never came."""
    import aio_keuss.queue

    case = _CASES["redis-oq"]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.2)
    options = {**case.options(new_token()), "stats": "memory", "signal": "local"}
    try:
        factory = await aio_keuss.connect(case.name, **options)
        q = await factory.queue("jobs", reserve_delay=3600.0)
        await q.push_many([{"n": n} for n in range(MESSAGES)])
        held = await q.reserve_many(3)
        hold, _ = _holder(factory, case, options)
        hold()  # and never released: the server seems silent from here on
        taking = asyncio.create_task(q.reserve_many(2))
        await asyncio.sleep(0)
        closing = asyncio.create_task(factory.close())
        await until_closed(q)  # the close waits for what is in flight
        closing.cancel()
        outcome = await asyncio.wait_for(asyncio.gather(closing, return_exceptions=True), 10)
        assert isinstance(outcome[0], asyncio.CancelledError)
        assert "cancelled close given up" in caplog.text
        with pytest.raises(aio_keuss.KeussConnectionError):  # its connection closed
            await asyncio.wait_for(taking, 10)
        other = await aio_keuss.connect(case.name, **options)
        try:
            sizes = await (await other.queue("jobs")).sizes()
        finally:
            await other.close()
        # reserved until they expire (at-least-once), none lost
        assert (sizes.reserved, sizes.total) == (len(held) + 2, MESSAGES), sizes
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)


def _takes_wait_for_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A take waits for a table lock as long as it is held, as every take did before they
    gave up after ``lockwait.TAKE_LOCK_WAIT``: the tests here hold a pop in flight by a
    lock, for as long as they need it there."""
    from aio_keuss.postgres import lockwait

    monkeypatch.setattr(lockwait, "BIND", "SET lock_timeout = 0")


async def test_a_cancelled_close_lets_a_batch_in_flight_end_on_postgres(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On PostgreSQL a pop runs in a batch task, whose statement a cancellation interrupts
    (asyncpg cancels it: where the server had already run it, the messages it deleted are
    lost). A close cancelled while it waits for that batch cancelled it along with the
    wait, and its caller, never cancelled itself, got a CancelledError. The close now lets
    the batch end: its caller gets its messages, and none is lost."""
    asyncpg = pytest.importorskip("asyncpg")
    case = _CASES["postgres"]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    _takes_wait_for_locks(monkeypatch)
    options = {**case.options(new_token()), "stats": "memory", "signal": "local"}
    blocker = None
    try:
        factory = await aio_keuss.connect(case.name, **options)
        q = await factory.queue("jobs")
        await q.push_many([{"n": n} for n in range(MESSAGES)])
        blocker = await asyncpg.connect(options["url"])
        # the pop's DELETE waits for this lock, in the batch task
        await blocker.execute(f'BEGIN; LOCK TABLE "{options["schema"]}".messages IN EXCLUSIVE MODE')
        taking = asyncio.create_task(q.pop_many(2))
        await asyncio.sleep(0.2)
        assert q._gets._tasks and not taking.done()
        closing = asyncio.create_task(factory.close())
        await until_closed(q)  # the close waits for what is in flight
        assert q._closed
        closing.cancel()  # as asyncio.timeout around the close would
        await asyncio.sleep(0.05)
        await blocker.execute("ROLLBACK")
        outcome = await asyncio.gather(closing, return_exceptions=True)
        assert isinstance(outcome[0], asyncio.CancelledError)
        got = [m.id for m in await asyncio.wait_for(taking, 30)]  # not cancelled: no CancelledError
        other = await aio_keuss.connect(case.name, **options)
        try:
            o = await other.queue("jobs")
            ready = [m.id for m in await o.pop_many(100, timeout=0)]
        finally:
            await other.close()
        assert len(got) == 2
        assert len(ready) + len(got) == MESSAGES
    finally:
        if blocker is not None:
            await blocker.close()
        if case.cleanup is not None:
            await case.cleanup(options)


async def test_a_cancelled_close_past_its_grace_ends_with_a_batch_stuck_on_postgres(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``CANCELLED_CLOSE_GRACE`` a cancelled close gives up the batch it waited for (a
    statement that does not end, here one waiting for a lock nobody releases): the batch is
    cancelled then, so the pool's close, which waits for every connection, can end."""
    import aio_keuss.queue

    asyncpg = pytest.importorskip("asyncpg")
    case = _CASES["postgres"]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.2)
    _takes_wait_for_locks(monkeypatch)
    options = {**case.options(new_token()), "stats": "memory", "signal": "local"}
    blocker = None
    try:
        factory = await aio_keuss.connect(case.name, **options)
        q = await factory.queue("jobs")
        await q.push_many([{"n": n} for n in range(MESSAGES)])
        blocker = await asyncpg.connect(options["url"])
        await blocker.execute(f'BEGIN; LOCK TABLE "{options["schema"]}".messages IN EXCLUSIVE MODE')
        taking = asyncio.create_task(q.pop_many(2))
        await asyncio.sleep(0.2)
        closing = asyncio.create_task(factory.close())
        await until_closed(q)  # the close waits for what is in flight
        closing.cancel()
        outcome = await asyncio.wait_for(asyncio.gather(closing, return_exceptions=True), 10)
        assert isinstance(outcome[0], asyncio.CancelledError)
        await asyncio.gather(taking, return_exceptions=True)
        await blocker.execute("ROLLBACK")
        other = await aio_keuss.connect(case.name, **options)
        try:
            sizes = await (await other.queue("jobs")).sizes()
        finally:
            await other.close()
        assert sizes.total == MESSAGES  # the pop's statement was cancelled: nothing taken
    finally:
        if blocker is not None:
            await blocker.close()
        if case.cleanup is not None:
            await case.cleanup(options)


async def test_a_close_cancelled_while_it_gives_back_still_gives_back_the_rest(
    case_options: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The close gives back the reservations nobody acknowledged, ``max_batch`` to a round
    trip. Cancelled during the first of those round trips, its grace gave back nothing
    more: the reservations not yet sent had been taken out of those held, and stayed
    reserved until ``reserve_delay``. They go back in the grace now."""
    case, options = case_options
    factory = await aio_keuss.connect(case.name, **options)
    q = await factory.queue("jobs", reserve_delay=3600.0, max_batch=2)
    await q.push_many([{"n": n} for n in range(6)])
    held = [m for _ in range(3) for m in await q.reserve_many(2)]  # the user's, never acked
    assert len(held) == 6
    hold, release = _holder(factory, case, options)
    store: Any = q._store
    primitive = store.rollback
    giving_back = asyncio.Event()

    async def rollback(*args: Any) -> Any:
        if not giving_back.is_set():
            hold()  # the first give-back's reply waits
            giving_back.set()
        return await primitive(*args)

    store.rollback = rollback
    closing = asyncio.create_task(factory.close())
    await asyncio.wait_for(giving_back.wait(), 10)
    await asyncio.sleep(0.05)
    closing.cancel()  # as asyncio.timeout around the close would
    await asyncio.sleep(0.05)
    release()
    outcome = await asyncio.gather(closing, return_exceptions=True)
    assert isinstance(outcome[0], asyncio.CancelledError)
    other = await aio_keuss.connect(case.name, **options)
    try:
        o = await other.queue("jobs", reserve_delay=3600.0)
        ready = await o.pop_many(100, timeout=0)
        sizes = await o.sizes()
    finally:
        await other.close()
    assert sizes.total == 0, sizes  # nothing left reserved for a closed queue
    assert {m.id for m in ready} == {m.id for m in held}


async def test_a_close_cancelled_during_the_handlers_grace_is_still_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shutdown timeout shorter than the handlers' grace cancels the factory's close while
    it stops the consumers; the queues then closed as if nothing had been cancelled, each
    waiting for its round trips in flight without bound: a pop whose statement does not end
    (a server that stopped answering) held the close for ever, past
    ``CANCELLED_CLOSE_GRACE``."""
    import aio_keuss.consumer
    import aio_keuss.queue

    case = _CASES["postgres"]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.2)
    monkeypatch.setattr(aio_keuss.consumer, "ACK_WAIT", 0.2)
    options = {**case.options(new_token()), "stats": "memory", "signal": "local"}
    try:
        factory = await aio_keuss.connect(case.name, **options)
        q = await factory.queue("jobs", reserve_delay=3600.0)
        await q.push_many([{"n": n} for n in range(MESSAGES)])
        handling = asyncio.Event()

        async def handler(message: aio_keuss.Message) -> None:
            handling.set()
            await asyncio.Event().wait()  # outlives any grace

        consumer = q.consume(handler)
        await asyncio.wait_for(handling.wait(), 10)
        store: Any = q._store

        async def silent(n: int) -> Any:
            await asyncio.Event().wait()  # a reply that never comes

        store.get = silent
        taking = asyncio.create_task(q.pop_many(2))
        await asyncio.sleep(0.1)
        closing = asyncio.create_task(factory.close())
        await asyncio.sleep(0.3)  # in the handler's grace
        assert consumer.state == "stopped" and not closing.done()
        closing.cancel()  # as asyncio.timeout around the close would
        done, _ = await asyncio.wait({closing}, timeout=10)
        assert closing in done, "the close hangs"
        assert closing.cancelled()
        await asyncio.gather(taking, return_exceptions=True)
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)


async def test_a_close_cancelled_before_the_queues_closes_ran_still_finishes_them(
    case_options: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A factory close cancelled once it had started its queues' closes, but before those
    had run a step (each a task, and a task cancelled before it starts runs nothing): no
    queue close ran, and the backend closed under the pop in flight (the messages Redis had
    popped were lost) and left the reservations the user held reserved. The cancellation is
    made at each loop turn of the close's start in turn, from the first (the close's own
    task not started yet: it then ran nothing at all, the backend left open), so whatever
    the turn it lands on, the close finishes as a cancelled one."""
    case, options = case_options
    for turns in range(1, 12):
        factory = await aio_keuss.connect(case.name, **options)
        q = await factory.queue(f"jobs{turns}", reserve_delay=3600.0)
        await q.push_many([{"n": n} for n in range(MESSAGES)])
        held = await q.reserve_many(3)
        hold, release = _holder(factory, case, options)
        hold()
        taking = asyncio.create_task(q.pop_many(2))
        await asyncio.sleep(0)  # the call is sent; its reply is held
        closing = asyncio.create_task(factory.close())
        for _ in range(turns):
            await asyncio.sleep(0)
        closing.cancel()
        await asyncio.sleep(0.05)
        release()
        await asyncio.gather(closing, return_exceptions=True)
        got = [m.id for m in await asyncio.wait_for(taking, 30)]
        ready, sizes = await _left_in(case, options, f"jobs{turns}")
        assert sizes.total == 0, (turns, sizes)
        assert {m.id for m in held} <= set(ready), turns
        assert len(ready) + len(got) == MESSAGES, turns


async def test_a_close_joined_while_its_cancelled_owner_runs_it_returns_once_it_is_over(
    case_options: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A factory close whose caller is cancelled before the close's own task ran a step is
    run by that caller. Closes called meanwhile (one that joined it before the cancellation,
    one called while the caller runs it) returned at once, as if the close were over: the
    reservations held not yet given back and the backend still open (and with the loop
    ending next, the close was cut short). They return once it is over."""
    case, options = case_options
    factory = await aio_keuss.connect(case.name, **options)
    q = await factory.queue("joined", reserve_delay=3600.0)
    await q.push_many([{"n": n} for n in range(MESSAGES)])
    await q.reserve_many(3)
    backend_closed = asyncio.Event()
    close_backend = factory.backend.close

    async def closing_backend() -> None:
        await close_backend()
        backend_closed.set()

    factory.backend.close = closing_backend  # type: ignore[method-assign]
    hold, release = _holder(factory, case, options)
    hold()  # the close's round trips wait: it cannot be over before the release
    owner = asyncio.create_task(factory.close())
    joined = asyncio.create_task(factory.close())
    await asyncio.sleep(0)  # both are in close; the close's own task has not run a step
    owner.cancel()
    await asyncio.sleep(0.05)
    late = asyncio.create_task(factory.close())
    await asyncio.sleep(0.05)
    early = [task for task in (joined, late) if task.done()]
    release()
    await asyncio.wait_for(asyncio.gather(joined, late), 30)
    assert backend_closed.is_set()
    assert not early, "a close returned before the close was over"
    await asyncio.gather(owner, return_exceptions=True)
    assert owner.cancelled()
    ready, sizes = await _left_in(case, options, "joined")
    assert sizes.total == 0 and len(ready) == MESSAGES, sizes


async def test_a_cancelled_close_ends_when_postgres_stops_answering(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancelled close on a PostgreSQL server that stopped answering (here the pool's
    connections stop reading: the server runs the statements, their replies never come)
    gives up the batch in flight after ``CANCELLED_CLOSE_GRACE``; then the pool's close,
    which waits for every connection to come back, waited on asyncpg's cancellation of
    that batch's statement, which waits for the server's reply: the close never ended. It
    ends now: past ``CLOSE_GRACE`` the connections still out are terminated. The
    reservation given up (the server ran it) comes back when it expires: none is lost."""
    import aio_keuss.postgres.connection
    import aio_keuss.queue

    case = _CASES["postgres"]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.2)
    monkeypatch.setattr(aio_keuss.postgres.connection, "CLOSE_GRACE", 0.5, raising=False)
    options = {**case.options(new_token()), "stats": "memory", "signal": "local"}
    try:
        factory = await aio_keuss.connect(case.name, **options)
        q = await factory.queue("jobs", reserve_delay=3600.0)
        await q.push_many([{"n": n} for n in range(MESSAGES)])
        warm = await factory.queue("warm")
        for _ in range(3):  # statements prepared on every connection (see test_loop_end)
            await asyncio.gather(*(warm.reserve_many(2, timeout=0) for _ in range(8)))
        holders = factory.backend._pool._holders  # type: ignore[attr-defined]
        for holder in holders:
            if holder._con is not None:
                holder._con._transport.pause_reading()  # and never resumed
        taking = asyncio.create_task(q.reserve_many(2))
        await asyncio.sleep(0.2)
        closing = asyncio.create_task(factory.close())
        await until_closed(q)
        closing.cancel()
        outcome = await asyncio.wait_for(asyncio.gather(closing, return_exceptions=True), 30)
        assert isinstance(outcome[0], asyncio.CancelledError)
        await asyncio.wait_for(asyncio.gather(taking, return_exceptions=True), 30)
        assert "were terminated" in caplog.text
        other = await aio_keuss.connect(case.name, **options)
        try:
            sizes = await (await other.queue("jobs")).sizes()
        finally:
            await other.close()
        assert sizes.total == MESSAGES, sizes
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)


@pytest.mark.parametrize("cancelled", [True, False], ids=["cancelled", "plain"])
async def test_a_close_past_its_grace_hands_a_user_s_pool_back_every_connection(
    monkeypatch: pytest.MonkeyPatch, cancelled: bool
) -> None:
    """The same close on a pool of the user's (``pool=``, which the close leaves open):
    nothing terminated the connections still on their way back, which stayed checked out
    of the user's pool for good. Cancelled, the batch given up's connection: the close's
    ``gather`` over the hand-backs, cancelled by ``CLOSE_GRACE``, cancelled their tasks,
    which thereby left the set ``terminate`` reads. Plain, the idle held connections: their
    hand-back (the user's pool resets each on release: a round trip) was awaited in turn,
    outside that set, and those after the first were never handed back at all."""
    import asyncpg

    import aio_keuss.postgres.connection
    import aio_keuss.queue

    case = _CASES["postgres"]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.2)
    monkeypatch.setattr(aio_keuss.postgres.connection, "CLOSE_GRACE", 0.5)
    options = {**case.options(new_token()), "stats": "memory", "signal": "local"}
    pool = await asyncpg.create_pool(options.pop("url"), min_size=4, max_size=12)
    try:
        factory = await aio_keuss.connect(case.name, pool=pool, **options)
        q = await factory.queue("jobs", reserve_delay=3600.0)
        await q.push_many([{"n": n} for n in range(MESSAGES)])
        warm = await factory.queue("warm")
        for _ in range(3):  # statements prepared on every connection (see test_loop_end)
            await asyncio.gather(*(warm.reserve_many(2, timeout=0) for _ in range(8)))
        if not cancelled:  # idle held connections, more than one
            await asyncio.gather(*(q.size() for _ in range(4)))
        holders = pool._holders  # type: ignore[attr-defined]
        for holder in holders:
            if holder._con is not None:
                holder._con._transport.pause_reading()  # and never resumed
        if cancelled:
            taking = asyncio.create_task(q.reserve_many(2))
            await asyncio.sleep(0.2)
            closing = asyncio.create_task(factory.close())
            await until_closed(q)
            closing.cancel()
            await asyncio.wait_for(asyncio.gather(closing, taking, return_exceptions=True), 30)
        else:
            await asyncio.wait_for(factory.close(), 30)
        await asyncio.sleep(0.1)
        out = [holder for holder in holders if holder._in_use is not None]
        assert not out, f"{len(out)} connections still checked out of the user's pool"
    finally:
        pool.terminate()
        if case.cleanup is not None:
            await case.cleanup(options)


async def test_a_cancelled_close_cancelled_again_gives_up_no_connection_after_it_ended(
    case_options: tuple[BackendCase, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled close gives up its connection (``Backend.abandon``) once its grace is
    spent, unless it ended before. Cancelled again while its queues closed, it scheduled
    that give-up a second time, over the first, which it never cancelled: ``abandon`` ran
    on the backend after the close had ended, a call its contract makes only during a
    close whose grace is spent."""
    import aio_keuss.factory

    case, options = case_options
    # the grace is waited out below: short, and longer than this close takes
    monkeypatch.setattr(aio_keuss.factory, "CANCELLED_CLOSE_GRACE", 2.0)
    factory = await aio_keuss.connect(case.name, **options)
    q = await factory.queue("again", reserve_delay=3600.0)
    await q.push_many([{"n": n} for n in range(MESSAGES)])
    ended = False
    given_up: list[bool] = []  # for each give-up: whether the close had ended
    abandon = factory.backend.abandon

    def recording() -> None:
        given_up.append(ended)
        abandon()

    factory.backend.abandon = recording  # type: ignore[method-assign]
    hold, release = _holder(factory, case, options)
    hold()
    taking = asyncio.create_task(q.pop_many(2))
    await asyncio.sleep(0)  # the call is sent; its reply is held
    closing = asyncio.create_task(factory.close())
    await asyncio.sleep(0)  # in close; the close's own task has not run a step
    closing.cancel()  # it runs in this task then, as a cancelled close
    await until_closed(q)  # the factory waits for the queue's close, itself for the pop
    closing.cancel()  # again
    await asyncio.sleep(0.05)
    release()
    outcome = await asyncio.gather(closing, return_exceptions=True)
    ended = True
    assert isinstance(outcome[0], asyncio.CancelledError)
    await asyncio.gather(taking, return_exceptions=True)
    # past the grace (a give-up pending is due by then), and one more turn of the loop
    await asyncio.sleep(aio_keuss.factory.CANCELLED_CLOSE_GRACE)
    await asyncio.sleep(0)
    assert True not in given_up, "the connection was given up after the close ended"


def _held_opens(factory: aio_keuss.Factory, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """(opening, let_open): queue ``name``'s open, once begun (``opening`` set), waits for
    ``let_open`` before it makes the queue's store: an open the test holds at that point."""
    opening, let_open = asyncio.Event(), asyncio.Event()
    make = factory.backend.store

    async def store(queue: str, options: Any) -> Any:
        if queue == name:
            opening.set()
            await let_open.wait()
        return await make(queue, options)

    factory.backend.store = store  # type: ignore[method-assign]
    return opening, let_open


async def _until(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds: watched rather than timed (10 s at most)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)


async def test_a_close_cancelled_while_a_queue_opens_still_closes_every_queue(
    case_options: tuple[BackendCase, dict[str, Any]],
) -> None:
    """Once the consumers are stopped the close waits for the queues still opening (a move
    made meanwhile opens its target), then closes them with the others. Cancelled during
    that wait, it closed no queue at all: the backend closed under them, the reservations
    the user held stayed reserved until ``reserve_delay``, and the queue opened meanwhile
    was left open. It now closes them as a cancelled close does, the one that opened too."""
    case, options = case_options
    factory = await aio_keuss.connect(case.name, **options)
    opening, let_open = _held_opens(factory, "target")
    q = await factory.queue("jobs", reserve_delay=3600.0)
    await q.push_many([{"n": n} for n in range(3)])
    held = await q.reserve_many(3)  # the user's, never acknowledged
    assert len(held) == 3
    handling, finish = asyncio.Event(), asyncio.Event()

    async def handler(message: aio_keuss.Message) -> None:
        handling.set()
        await finish.wait()

    q.consume(handler)
    await q.push({"n": 3})
    await asyncio.wait_for(handling.wait(), 10)
    closing = asyncio.create_task(factory.close())
    await _until(lambda: factory._siblings_open)  # the close waits for the handler
    moving = asyncio.create_task(q.move(held[0], "target"))  # opens its target
    await asyncio.wait_for(opening.wait(), 10)
    finish.set()  # the consumers stop; the close then waits for the target's open
    await _until(lambda: not factory._siblings_open)
    assert not closing.done() and "target" in factory._opening
    closing.cancel()  # as asyncio.timeout around the close would
    await asyncio.sleep(0.05)
    let_open.set()
    outcome = await asyncio.gather(closing, return_exceptions=True)
    assert isinstance(outcome[0], asyncio.CancelledError)
    await asyncio.gather(moving, return_exceptions=True)
    ready, sizes = await _left_in(case, options, "jobs")
    moved, _ = await _left_in(case, options, "target")
    assert sizes.total == 0, sizes  # nothing left reserved for a closed queue
    assert set(ready) | set(moved) == {m.id for m in held}
    target = factory._queues.get("target")
    assert target is None or target._closed, "the queue opened meanwhile was left open"


@pytest.mark.parametrize("begun", [True, False], ids=["begun", "before-its-task-ran"])
async def test_a_close_cancelled_while_a_queue_opens_ends_in_its_grace(
    case_options: tuple[BackendCase, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, begun: bool
) -> None:
    """A cancelled close waited for a queue's open (a move's target, opened as the close
    began) without bound, its grace unheeded: an open that does not end (a server that
    stopped answering) held the close for good. It now waits for it within the grace,
    closes the other queues meanwhile, and ends; the open, once it completes, closes the
    queue it made and fails, rather than hand out a queue open over a closed backend.
    Cancelled once the close's task waits for the open, or before that task ran a step
    (the close then runs in the caller's task, cut short)."""
    import aio_keuss.factory

    case, options = case_options
    monkeypatch.setattr(aio_keuss.factory, "CANCELLED_CLOSE_GRACE", 1.0)
    factory = await aio_keuss.connect(case.name, **options)
    opening, let_open = _held_opens(factory, "target")
    q = await factory.queue("jobs", reserve_delay=3600.0)
    await q.push_many([{"n": n} for n in range(3)])
    held = await q.reserve_many(3)
    moving = asyncio.create_task(q.move(held[0], "target"))
    await asyncio.wait_for(opening.wait(), 10)
    closing = asyncio.create_task(factory.close())
    if begun:
        await _until(lambda: factory._close_begun)  # it waits for the target's open
    else:
        await asyncio.sleep(0)  # in close; the close's own task has not run a step
    closing.cancel()
    done, _ = await asyncio.wait({closing}, timeout=30)
    assert closing in done, "the close waits for the open for good"
    assert closing.cancelled()
    assert not moving.done()  # the open is still held: the close ended without it
    let_open.set()
    (failure,) = await asyncio.gather(moving, return_exceptions=True)
    assert isinstance(failure, aio_keuss.ClosedError), failure
    target = factory._queues.get("target")
    assert target is None or target._closed, "the queue opened late was left open"
    ready, sizes = await _left_in(case, options, "jobs")
    assert sizes.total == 0, sizes
    assert set(ready) == {m.id for m in held}


async def test_an_open_ending_after_the_close_asks_the_closed_backend_nothing_more(
    case_options: tuple[BackendCase, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open the close gave up (held past its grace) and that made its store once the
    close had ended went on with the queue's open over the closed backend: it read the
    queue's pause and recorded its options (on Redis a closed client may open a connection
    that nothing closes), and only then found the factory closed. It now stops once its
    store is made: the store closes, the open fails with ClosedError, nothing else is
    asked."""
    import aio_keuss.factory

    case, options = case_options
    monkeypatch.setattr(aio_keuss.factory, "CANCELLED_CLOSE_GRACE", 1.0)
    factory = await aio_keuss.connect(case.name, **options)
    opening, let_open = _held_opens(factory, "target")
    asked: list[str] = []  # the stats store's calls for the target, once the close ended
    stats = factory.stats_store
    is_paused, save_options = stats.is_paused, stats.save_options

    async def paused(queue: str) -> bool:
        if queue == "target" and closing.done():
            asked.append("is_paused")
        return await is_paused(queue)

    async def save(queue: str, *args: Any, **kwargs: Any) -> None:
        if queue == "target" and closing.done():
            asked.append("save_options")
        await save_options(queue, *args, **kwargs)

    stats.is_paused = paused  # type: ignore[method-assign]
    stats.save_options = save  # type: ignore[method-assign]
    q = await factory.queue("jobs", reserve_delay=3600.0)
    await q.push({"n": 0})
    (held,) = await q.reserve_many(1)
    moving = asyncio.create_task(q.move(held, "target"))
    await asyncio.wait_for(opening.wait(), 10)
    closing = asyncio.create_task(factory.close())
    await _until(lambda: factory._close_begun)  # it waits for the target's open
    closing.cancel()
    done, _ = await asyncio.wait({closing}, timeout=30)
    assert closing in done, "the close waits for the open for good"
    let_open.set()
    (failure,) = await asyncio.gather(moving, return_exceptions=True)
    assert isinstance(failure, aio_keuss.ClosedError), failure
    assert asked == [], f"asked the closed backend {asked} for an open given up"
