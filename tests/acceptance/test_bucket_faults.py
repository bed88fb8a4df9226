"""Bucket backends (and the memory backend) under faults: a producer loop that never waits,
drain and close while other tasks keep calling, a process killed while it floods a queue, and
a server away longer than a lease.

A server stopped here is a private instance on its own port (``tests/own_servers.py``): the
shared servers are never touched. Time bounds only keep a broken run from hanging; what is
asserted is behaviour (who got what, what is stored), never how fast the machine is.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from backends import CASES, BackendCase, new_token
from own_servers import OwnPostgres, OwnRedis, own_postgres, own_redis

import aio_keuss
from aio_keuss import ClosedError, KeussConnectionError
from aio_keuss.buckets.settings import BUFFERED_BUCKETS

pytestmark = pytest.mark.timeout(180)

BUCKET_CASES = [c for c in CASES if c.name.startswith("bucket-")]
MEMORY = next(c for c in CASES if c.name == "memory")
MAX_PUSHES = 200_000
"""A producer loop stops here at the latest. Where pushes let the loop run, what the test
waits for happens after a few thousand (a 10 ms timer, a bucket write); where they do not,
the loop never runs before this many."""


async def _until(condition: Callable[[], Any], within: float = 60.0) -> None:
    """Wait for a condition that depends on the code under test, not on timing; the bound
    only keeps a broken run from hanging."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@asynccontextmanager
async def _case_options(case: BackendCase) -> AsyncIterator[dict[str, Any]]:
    reason = case.available()
    if reason:
        pytest.skip(reason)
    options = case.options(new_token())
    try:
        yield options
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)


async def _take_all(q: aio_keuss.Queue, idle: float = 1.0) -> list[Any]:
    """Reserve and ok everything until the queue stays empty; the payloads."""
    got: list[Any] = []
    while True:
        batch = await q.reserve_many(1000, timeout=idle)
        if not batch:
            return got
        got.extend(m.payload for m in batch)
        assert all(await asyncio.gather(*(q.ok(m) for m in batch)))


# a producer loop -------------------------------------------------------------------------

PRODUCERS = [
    pytest.param(MEMORY, False, id="memory"),
    *(
        pytest.param(case, ack, id=f"{case.id}-{'buffered' if ack else 'durable'}")
        for case in BUCKET_CASES
        for ack in (False, True)
    ),
]


@pytest.mark.parametrize(("case", "ack_on_buffer"), PRODUCERS)
async def test_a_producer_loop_lets_other_tasks_run(case: BackendCase, ack_on_buffer: bool) -> None:
    """``while True: await q.push(x)`` beside a 10 ms ticker: the ticker keeps ticking."""
    extra = {"ack_on_buffer": True} if ack_on_buffer else {}
    async with (
        _case_options(case) as options,
        aio_keuss.connect(case.name, **options, **extra) as factory,
    ):
        q = await factory.queue("producer-loop")
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beside = asyncio.create_task(ticker())
        pushes = 0
        try:
            while ticks < 5 and pushes < MAX_PUSHES:
                await q.push(pushes)
                pushes += 1
        finally:
            beside.cancel()
        assert ticks >= 5, f"the ticker starved: {ticks} ticks in {pushes} pushes"


@asynccontextmanager
async def _buffering_beside_durable(
    case: BackendCase,
) -> AsyncIterator[tuple[aio_keuss.Factory, aio_keuss.Factory]]:
    """A factory acknowledging pushes on buffer, and one standing for another process."""
    async with (
        _case_options(case) as options,
        aio_keuss.connect(
            case.name, **{**options, "bucket_max_wait": 0.3}, ack_on_buffer=True
        ) as factory,
        aio_keuss.connect(case.name, **options) as other,
    ):
        yield factory, other


@pytest.mark.parametrize("case", BUCKET_CASES, ids=lambda c: c.id)
async def test_buffered_pushes_are_written_while_the_producer_loop_runs(
    case: BackendCase,
) -> None:
    """With ``ack_on_buffer``, another process sees a producer loop's messages while the loop
    still runs: buckets are written when full or after ``bucket_max_wait``, not when the
    producer stops."""
    async with _buffering_beside_durable(case) as (factory, other):
        q = await factory.queue("flood")
        elsewhere = await other.queue("flood")

        async def watch() -> None:
            while await elsewhere.total_size() == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.01)

        seen = asyncio.create_task(watch())
        pushes = 0
        try:
            while not seen.done() and pushes < MAX_PUSHES:
                await q.push(pushes)
                pushes += 1
        finally:
            if not seen.done():
                seen.cancel()
        assert pushes < MAX_PUSHES, "nothing was written while the producer ran"
        seen.result()  # the watcher's own failure, if any
        await q.drain()
        assert await elsewhere.total_size() == pushes
        assert sorted(await _take_all(elsewhere)) == list(range(pushes))


# ``python -c FLOOD <backend> <options json> <queue> <every>``: pushes 0, 1, 2, ... in a
# tight loop and prints how many were acknowledged every ``every`` pushes, until killed.
FLOOD = r"""
import asyncio, json, sys
import aio_keuss

async def main(backend, options, queue, every):
    factory = await aio_keuss.connect(backend, **json.loads(options))
    q = await factory.queue(queue)
    every, i = int(every), 0
    while True:
        await q.push(i)
        i += 1
        if i % every == 0:
            print(i, flush=True)

asyncio.run(main(*sys.argv[1:]))
"""


def _spawn_flood(case: BackendCase, options: dict[str, Any]) -> Any:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(
        [sys.executable, "-c", FLOOD, case.name, json.dumps(options), "flood", "1000"],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )


@pytest.mark.parametrize("case", BUCKET_CASES, ids=lambda c: c.id)
async def test_killed_flooding_producer_loses_only_its_bounded_buffer(case: BackendCase) -> None:
    """SIGKILL of a process pushing in a tight loop with ``ack_on_buffer``: what it loses is
    bounded by the buffer (a few buckets), not by how long the loop ran."""
    size = 128
    acked_before_kill = 30_000
    async with _case_options(case) as options:
        child_options = {**options, "ack_on_buffer": True, "bucket_max_size": size}
        child = _spawn_flood(case, child_options)
        try:
            acked = 0
            async with asyncio.timeout(120):
                while acked < acked_before_kill:
                    line = await asyncio.to_thread(child.stdout.readline)
                    assert line, "the producer died"
                    acked = int(line)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        async with aio_keuss.connect(case.name, **options) as factory:
            stored = await (await factory.queue("flood")).total_size()
        # unwritten at any time: the backpressure limit, the filling bucket, one more push
        bound = BUFFERED_BUCKETS * size + size + 1
        assert stored >= acked - bound, f"{acked} acknowledged, only {stored} stored"


# drain and close while others keep calling -----------------------------------------------


@pytest.mark.parametrize(
    ("case", "ack_on_buffer"),
    [
        pytest.param(case, ack, id=f"{case.id}-{'buffered' if ack else 'durable'}")
        for case in BUCKET_CASES
        for ack in (False, True)
    ],
)
async def test_drain_and_close_end_while_others_push_and_acknowledge(
    case: BackendCase, ack_on_buffer: bool
) -> None:
    """Pushers and consumers keep calling through a drain and a close: both end, later calls
    raise ClosedError (nothing else), and after a reopen every acknowledged push is there
    and no message whose ok returned True comes back."""
    async with _case_options(case) as options:
        factory = await aio_keuss.connect(
            case.name, **options, ack_on_buffer=ack_on_buffer, reserve_delay=30.0
        )
        q = await factory.queue("closing")
        seed = [f"seed-{i}" for i in range(200)]
        await q.push_many(seed)
        pushed: set[str] = set(seed)
        oked: set[str] = set()
        unexpected: list[BaseException] = []
        stop = False

        async def push(worker: int) -> None:
            i = 0
            while not stop:
                await asyncio.sleep(0)  # whether a push suspends is another test's subject
                payload = f"p{worker}-{i}"
                i += 1
                try:
                    await q.push(payload)
                except ClosedError:
                    await asyncio.sleep(0.01)
                    continue
                except Exception as exc:
                    unexpected.append(exc)
                    await asyncio.sleep(0.01)
                    continue
                pushed.add(payload)

        async def consume() -> None:
            while not stop:
                try:
                    message = await q.reserve(timeout=0.2)
                    if message is not None and await q.ok(message):
                        oked.add(message.payload)
                except ClosedError:
                    await asyncio.sleep(0.01)
                except Exception as exc:
                    unexpected.append(exc)
                    await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(push(i)) for i in range(8)]
        tasks += [asyncio.create_task(consume()) for _ in range(2)]
        try:
            await _until(lambda: len(pushed) >= 400 and len(oked) >= 50)
            await asyncio.wait_for(q.drain(), 60)
            flowing = len(pushed)
            await _until(lambda: len(pushed) >= flowing + 200)  # drain stopped nothing
            await asyncio.wait_for(factory.close(), 60)
            after_close = (len(pushed), len(oked))
            await asyncio.sleep(0.05)
            assert (len(pushed), len(oked)) == after_close  # refused once closed
        finally:
            stop = True
            await asyncio.gather(*tasks)
            await factory.close()
        assert not unexpected, unexpected[:3]

        async with aio_keuss.connect(case.name, **options) as reopened:
            stored = await _take_all(await reopened.queue("closing"))
        assert len(stored) == len(set(stored))
        assert not oked & set(stored), "an ok that returned True was undone"
        assert pushed <= oked | set(stored), "an acknowledged push was lost"


# leases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", BUCKET_CASES, ids=lambda c: c.id)
async def test_an_idle_holder_keeps_its_lease(case: BackendCase) -> None:
    """A consumer holding a reservation, with nothing else happening for longer than the
    lease grace, keeps its lease (renewed though nothing changed): no other consumer is
    handed the message while it is reserved, and its ok stands."""
    async with _case_options(case) as options:
        # A lease long enough that its renewal (due in its last half) gets through on a
        # loaded machine and a busy server: what is checked is that it is renewed at all.
        options = {**options, "reserve_delay": 120.0, "reject_timeout_grace": 10.0}
        async with (
            aio_keuss.connect(case.name, **options) as holder,
            aio_keuss.connect(case.name, **options) as other,
        ):
            q, elsewhere = await holder.queue("idle"), await other.queue("idle")
            await q.push_many([0, 1, 2])  # one bucket
            held = await q.reserve(timeout=5)
            assert held is not None
            await q.drain()  # that reservation is written: the lease's deadline is set
            bucket_id = held.id.rpartition("-")[0]
            bucket = q._store._held_buckets[bucket_id]  # type: ignore[attr-defined]
            first_lease = bucket.lease_until
            # nothing changing until that lease would have lapsed unless renewed, and then some
            await _until(lambda: time.time() > first_lease + 1.0, within=120)
            taken = await elsewhere.reserve_many(10, timeout=0.5)
            assert held.payload not in [m.payload for m in taken], "handed out twice at once"
            assert await q.ok(held)
        async with aio_keuss.connect(case.name, **options) as later:
            assert held.payload not in await _take_all(await later.queue("idle"))


@pytest.mark.parametrize("case", BUCKET_CASES, ids=lambda c: c.id)
async def test_a_holder_back_from_a_stall_never_undoes_the_next_holders_work(
    case: BackendCase,
) -> None:
    """A holder stalls past its lease (its state flusher stops, as in a process that hangs);
    another consumer takes the bucket over, acknowledges part of it and gives the rest back.
    When the first holder leases that bucket again, it starts from the stored state, not
    from its stale copy: what the other consumer acknowledged is not delivered again."""
    async with _case_options(case) as options:
        options = {**options, "reserve_delay": 30.0, "reject_timeout_grace": 0.5}
        async with aio_keuss.connect(case.name, **options) as holder:
            q = await holder.queue("stall")
            await q.push_many([0, 1, 2, 3])  # one bucket
            first = await q.reserve(timeout=5)  # leases it: 1, 2 and 3 wait in its memory
            assert first is not None and first.payload == 0
            await q.drain()  # that reservation is written
            q._store._flusher.cancel()  # type: ignore[attr-defined]  # the holder stalls
            await asyncio.sleep(1.5)  # three times the grace: its lease lapsed
            async with aio_keuss.connect(case.name, **options) as other:
                elsewhere = await other.queue("stall")
                taken = {m.payload: m for m in await elsewhere.reserve_many(10, timeout=5)}
                assert sorted(taken) == [0, 1, 2, 3]
                assert taken[0].tries == 1  # the holder's reservation lapsed with its lease
                assert await elsewhere.ok(taken[0]) and await elsewhere.ok(taken[1])
            # closed: 2 and 3 went back, 0 and 1 are done
            again = await q.reserve_many(10, timeout=5)
            assert sorted(m.payload for m in again) == [2, 3]
            assert not await q.ok(first)  # handled by the other consumer meanwhile
            assert all([await q.ok(m) for m in again])
        async with aio_keuss.connect(case.name, **options) as later:
            assert await _take_all(await later.queue("stall"), idle=0.5) == []


# a server away longer than a lease ------------------------------------------------------


@pytest.fixture(params=["bucket-redis", "bucket-postgres"])
def own_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(backend, private server, connect options). Redis keeps its data across a restart
    (append-only file, synced on every write)."""
    backend: str = request.param
    server: OwnRedis | OwnPostgres
    try:
        if backend == "bucket-redis":
            with own_redis("--appendonly", "yes", "--appendfsync", "always") as server:
                yield backend, server, {"url": server.url, "prefix": "outage"}
        else:
            with own_postgres() as server:
                yield backend, server, {"url": server.url, "schema": "outage"}
    except RuntimeError as exc:  # the server's binaries are not installed
        pytest.skip(str(exc))


@contextmanager
def _away(server: OwnRedis | OwnPostgres) -> Iterator[None]:
    """The server is stopped inside the block, and running again after it (also when the
    block fails, so that closing the factories reports the failure, not the outage)."""
    server.stop()
    try:
        yield
    finally:
        server.start()


async def test_a_lapsed_lease_serves_and_acknowledges_nothing_from_memory(
    own_server: tuple[str, Any, dict[str, Any]],
) -> None:
    """The server is away for longer than the lease grace: the holder's buckets may belong
    to another consumer by now, so it hands out nothing more from them, and an ok no
    longer answers True from memory (it must write first, and cannot). Whoever gets the
    buckets once the server is back, a persisted ok is never undone."""
    backend, server, base = own_server
    options = {**base, "reserve_delay": 30.0, "reject_timeout_grace": 0.5}
    holder = await aio_keuss.connect(backend, **options)
    try:
        q = await holder.queue("lapse")
        await q.push_many(list(range(6)))  # one bucket
        held = await q.reserve_many(3, timeout=5)
        assert [m.payload for m in held] == [0, 1, 2]
        assert await q.ok(held[0])
        await q.drain()  # that ok is written: nothing may undo it
        with _away(server):
            await asyncio.sleep(1.5)  # three times the grace: the lease lapsed
            try:
                served = await q.reserve(timeout=0)
            except KeussConnectionError:  # nothing in memory may be served: it tried to lease
                served = None
            assert served is None, f"served {served.payload!r} from a lapsed lease"
            with pytest.raises(KeussConnectionError):  # not True: it could not be written
                await q.ok(held[1])
        await holder.close()  # gives back what it still holds, if it still holds it
    finally:
        await holder.close()
    async with aio_keuss.connect(backend, **base) as other:
        got = await _take_all(await other.queue("lapse"))
    assert len(got) == len(set(got))
    assert 0 not in got, "a persisted ok was undone"
    assert {2, 3, 4, 5} <= set(got) <= {1, 2, 3, 4, 5}  # 1: its ok raised, either is right


async def test_a_final_write_that_fails_is_tried_again(
    own_server: tuple[str, Any, dict[str, Any]],
) -> None:
    """Every slot of a bucket ok-ed while the server is briefly away (shorter than the
    lease): the state flusher's delete of the finished bucket fails, and is tried again
    once the server is back, instead of leaving the stored bucket to come back, oks
    undone, when the lease lapses."""
    backend, server, base = own_server
    options = {**base, "reserve_delay": 60.0, "reject_timeout_grace": 30.0}
    holder = await aio_keuss.connect(backend, **options, state_flush_period=0.05)
    try:
        q = await holder.queue("final")
        await q.push_many(["a", "b"])  # one bucket
        held = await q.reserve_many(2, timeout=5)
        assert len(held) == 2
        with _away(server):
            assert all([await q.ok(m) for m in held])  # the lease holds (30 s): in memory
            await asyncio.sleep(0.5)  # the state flusher tries to delete the bucket, and fails
    finally:
        await holder.close()
    async with aio_keuss.connect(backend, **base) as other:
        assert await (await other.queue("final")).total_size() == 0
