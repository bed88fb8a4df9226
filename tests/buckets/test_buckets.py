"""Bucket backends (bucket-redis, bucket-postgres, bucket-mongo) beyond the conformance suite:
what survives a process killed with SIGKILL, and many consumer processes sharing one queue.

Producers and consumers run as real child processes (the script below) so a crash is a
real crash: no finally blocks, no flush, no lease release.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from backends import CASES, BackendCase, a_poison_reserved, ko_through_a_cut_close, new_token

import aio_keuss
from aio_keuss import KeussConnectionError, KoResult
from aio_keuss.buckets.codec import decode_blob, decode_state, encode_blob, encode_state
from aio_keuss.buckets.settings import BucketSettings, split_id
from aio_keuss.coalesce import Uncancellable

pytestmark = pytest.mark.timeout(120)

BUCKET_CASES = [c for c in CASES if c.name.startswith("bucket-")]

# The child: ``python -c CHILD <mode> <backend> <options json> <queue> <arg>``. It prints
# one JSON line when it reached the point where the parent kills it, then sleeps.
CHILD = r"""
import asyncio, json, sys
import aio_keuss
from aio_keuss import KeussConnectionError

async def main(mode, backend, options, queue, arg):
    factory = await aio_keuss.connect(backend, **json.loads(options))
    q = await factory.queue(queue)
    if mode == "produce":  # concurrent single pushes, all acknowledged
        n = int(arg)
        ids = await asyncio.gather(*(q.push(i) for i in range(n)))
        print(json.dumps({"acked": len(ids)}), flush=True)
    elif mode == "reserve":  # reserve some, ok half of them, wait for the state flush
        got = await q.reserve_many(int(arg), timeout=5)
        oked = [m.payload for m in got[: len(got) // 2]]
        for m in got[: len(got) // 2]:
            assert await q.ok(m)
        await asyncio.sleep(0.5)
        held = [m.payload for m in got[len(got) // 2 :]]
        print(json.dumps({"oked": oked, "held": held}), flush=True)
    elif mode == "pop":  # pop some and report them at once
        got = await q.pop_many(int(arg), timeout=5)
        print(json.dumps({"popped": [m.payload for m in got]}), flush=True)
    elif mode == "consume":  # reserve + ok until the queue stays empty; ids to a file
        seen = []
        while True:
            got = await q.reserve_many(500, timeout=2)
            if not got:
                break
            results = await asyncio.gather(*(q.ok(m) for m in got))
            assert all(results)
            seen.extend(m.payload for m in got)
        with open(arg, "w") as out:
            json.dump(seen, out)
        await factory.close()
        return
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


def _spawn(mode: str, case: BackendCase, options: dict[str, Any], queue: str, arg: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, case.name, json.dumps(options), queue, arg],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )


async def _report(child: Any, timeout: float = 30.0) -> dict[str, Any]:
    """The child's JSON line; then it is killed with SIGKILL on the spot."""
    line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), timeout)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert line, "the child died before reporting"
    report: dict[str, Any] = json.loads(line)
    return report


@pytest.fixture(params=BUCKET_CASES, ids=lambda case: case.id)
async def bucket_case(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[BackendCase, dict[str, Any]]]:
    case: BackendCase = request.param
    reason = case.available()
    if reason:
        pytest.skip(reason)
    options = case.options(new_token())
    yield case, options
    if case.cleanup is not None:
        await case.cleanup(options)


async def _take_all(q: aio_keuss.Queue, idle: float = 1.0) -> list[aio_keuss.Message]:
    got: list[aio_keuss.Message] = []
    while True:
        batch = await q.reserve_many(1000, timeout=idle)
        if not batch:
            return got
        got.extend(batch)
        assert all(await asyncio.gather(*(q.ok(m) for m in batch)))


# framing ---------------------------------------------------------------------------------


def test_blob_and_state_round_trip() -> None:
    from array import array

    payloads = [b"J{}", b"", b"B\x00\xff" * 100]
    headers = [b"{}", b'{"k":"v"}', b"{}"]
    blob = encode_blob(payloads, headers)
    count, p, h = decode_blob(blob)
    assert count == 3
    assert [blob[p[i] : p[i + 1]] for i in range(3)] == payloads
    assert [blob[h[i] : h[i + 1]] for i in range(3)] == headers
    state = encode_state(bytes([0, 1, 2]), array("I", [0, 5, 7]), array("d", [1.5, 2.5, 3.5]))
    assert len(state) == 3 * 13  # fixed width: u8 + u32 + f64 per slot
    states, tries, mature = decode_state(state, 3)
    assert (list(states), list(tries), list(mature)) == ([0, 1, 2], [0, 5, 7], [1.5, 2.5, 3.5])
    assert split_id("0123abc-17") == ("0123abc", 17)
    assert split_id("no-slot-x") is None and split_id("plain") is None


def test_a_state_names_the_deadletter_queue_of_each_slot_on_its_way_there() -> None:
    """Past the fixed-width columns, which a reader of those alone (an earlier release)
    reads as before; a state stored without it names none."""
    from array import array

    from aio_keuss.buckets.codec import decode_targets, encode_targets

    columns = encode_state(bytes([3, 1, 3]), array("I", [1, 0, 2]), array("d", [1.5, 2.5, 3.5]))
    state = columns + encode_targets({2: "dead.b", 0: "graveyard"})
    assert decode_targets(state, 3) == {0: "graveyard", 2: "dead.b"}
    assert decode_state(state, 3) == decode_state(columns, 3)
    assert decode_targets(columns, 3) == {}


def test_settings_are_validated() -> None:
    base = {
        "bucket_max_size": 1024,
        "bucket_max_wait": 0.5,
        "state_flush_period": 0.5,
        "reject_delta_base": 10.0,
        "reject_delta_factor": None,
        "reject_timeout_grace": None,
        "ack_on_buffer": False,
    }
    assert BucketSettings.parse(base).bucket_max_size == 1024
    for key, bad in [
        ("bucket_max_size", 0),
        ("bucket_max_size", 1.5),
        ("bucket_max_wait", -1),
        ("state_flush_period", 0),
        ("reject_timeout_grace", float("nan")),
        ("ack_on_buffer", "yes"),
    ]:
        with pytest.raises(aio_keuss.ConfigError):
            BucketSettings.parse({**base, key: bad})


# in-process behaviour --------------------------------------------------------------------


async def test_many_messages_share_few_buckets_and_ids_name_them(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, bucket_max_size=100) as factory:
        q = await factory.queue("packed")
        ids = await q.push_many(list(range(250)))
        buckets = {split_id(i)[0] for i in ids}  # type: ignore[index]
        assert len(buckets) == 3  # 100 + 100 + 50
        got = await _take_all(q)
        assert sorted(m.payload for m in got) == list(range(250))
        assert await q.total_size() == 0


async def test_delayed_slot_is_never_served_early(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A ready and a delayed message in one leased bucket: the delayed one waits."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, reserve_delay=5.0) as factory:
        q = await factory.queue("early")
        await q.push_many(["a", "b"])
        first = await q.reserve(timeout=1)
        assert first is not None
        start = time.monotonic()  # before the ko: the message cannot be due sooner than 0.5 s on
        await q.ko(first, delay=0.5)  # same bucket as b, now due later
        second = await q.reserve(timeout=1)
        assert second is not None and second.payload != first.payload
        again = await q.reserve(timeout=5)
        assert again is not None and again.payload == first.payload and again.tries == 1
        assert time.monotonic() - start >= 0.45  # a slow machine only makes this longer


async def test_ko_without_delay_follows_keuss_retry_polynomial(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """reject_delta_base + reject_delta_factor * tries, when the ko names no delay."""
    case, options = bucket_case
    options = {**options, "reject_delta_base": 0.3, "reject_delta_factor": 0.4}
    async with aio_keuss.connect(case.name, **options, reserve_delay=5.0) as factory:
        q = await factory.queue("poly")
        await q.push("x")
        first = await q.reserve(timeout=1)
        assert first is not None and first.tries == 0
        # Each ko's message is held back for its delay; a busy machine may get to ask only
        # after it, so an early answer is checked against the time it came back by.
        start = time.monotonic()
        assert await q.ko(first)  # due after 0.3 + 0.4 * 0 seconds
        early = await q.reserve(timeout=0.1)
        assert early is None or time.monotonic() - start >= 0.25, "served before its delay"
        second = early or await q.reserve(timeout=5)
        assert second is not None and second.tries == 1
        assert time.monotonic() - start >= 0.25
        start = time.monotonic()
        assert await q.ko(second)  # due after 0.3 + 0.4 * 1 seconds
        early = await q.reserve(timeout=0.4)
        assert early is None or time.monotonic() - start >= 0.6, "served before its delay"
        third = early or await q.reserve(timeout=5)
        assert third is not None and third.tries == 2
        assert time.monotonic() - start >= 0.6
        assert await q.ok(third)


async def test_durable_push_is_visible_elsewhere_once_acknowledged(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """Every acknowledged push, from few or many concurrent pushers, is already stored:
    another factory (another process, as far as storage goes) counts it at once."""
    case, options = bucket_case
    async with (
        aio_keuss.connect(case.name, **options) as factory,
        aio_keuss.connect(case.name, **options) as other,
    ):
        q, elsewhere = await factory.queue("durable"), await other.queue("durable")
        for pushers in (1, 3, 40):
            before = await elsewhere.total_size()
            await asyncio.gather(*(q.push(i) for i in range(pushers)))
            assert await elsewhere.total_size() == before + pushers
        got = await _take_all(elsewhere)
        assert len(got) == 44


async def test_cancelled_pushers_never_strand_the_ones_sharing_their_write(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """Pushers cancelled at every point of a shared bucket write: the others are still
    acknowledged, an acknowledged push is stored, and nothing is stored twice."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("cancelled-pushers")
        acknowledged: set[int] = set()

        async def push(value: int) -> None:
            await q.push(value)
            acknowledged.add(value)

        value = 0
        for round_no in range(30):
            tasks = []
            for _ in range(8):
                tasks.append(asyncio.create_task(push(value)))
                value += 1
            for _ in range(round_no % 4):  # cancel at a different moment each round
                await asyncio.sleep(0)
            for task in tasks[::3]:
                task.cancel()
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            assert all(r is None or isinstance(r, asyncio.CancelledError) for r in done)
        stored = [m.payload for m in await _take_all(q)]
        assert len(stored) == len(set(stored))
        assert acknowledged <= set(stored) <= set(range(value))
        assert len(acknowledged) >= value // 2


async def test_a_push_cancelled_while_its_buckets_are_written_is_still_counted(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A pusher cancelled while its buckets are written: they are written all the same (the
    write is shared, and goes on), so the queue's ``put`` counts every message of it, as it
    counts a cancelled push the store took on every other backend. Two cases: one bucket,
    its write held back at a gate; and many buckets, the first round trip done before the
    cancellation and the second held back. The gate refuses cancellation, as a Redis reply
    does, so a pusher writing its own bucket in its own task is cancelled once it is written."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, bucket_max_size=1) as factory:
        q = await factory.queue("cancelled-counted")
        storage = q._store._storage  # type: ignore[attr-defined]
        real_insert = storage.insert_buckets
        calls = 0
        hold_call = 1
        reached = asyncio.Event()
        gate = Uncancellable()

        async def gated_insert(queue: str, buckets: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == hold_call:
                reached.set()
                await gate
            await real_insert(queue, buckets)

        async def counted() -> int:
            await q._store.flush()  # type: ignore[attr-defined]  # the write under way ends
            return (await q.stats())["put"]

        storage.insert_buckets = gated_insert
        try:
            pushing = asyncio.create_task(q.push("one"))
            await asyncio.wait_for(reached.wait(), 10)
            pushing.cancel()
            gate.set_result(None)
            with pytest.raises(asyncio.CancelledError):
                await pushing
            assert await counted() == 1

            # 17 one-message buckets: 16 in the first round trip, the last in a second one.
            calls, hold_call, reached, gate = 0, 2, asyncio.Event(), Uncancellable()
            pushing = asyncio.create_task(q.push_many(list(range(17))))
            await asyncio.wait_for(reached.wait(), 10)
            pushing.cancel()
            gate.set_result(None)
            with pytest.raises(asyncio.CancelledError):
                await pushing
            assert await counted() == 18
        finally:
            storage.insert_buckets = real_insert
        assert len(await _take_all(q)) == 18


async def test_a_failed_lease_gives_back_what_the_pop_took_from_memory(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A pop serves what memory holds, then leases for the rest: when that lease fails,
    the slots already taken are available again (not lost as if popped)."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, bucket_max_size=2) as factory:
        q = await factory.queue("failed-lease")
        await q.push_many(["a", "b"])
        first = await q.pop(timeout=1)  # leases the bucket: "b" stays in memory
        assert first is not None and first.payload == "a"
        await q.push_many(["c", "d"])
        storage = q._store._storage  # type: ignore[attr-defined]
        real_lease = storage.lease

        async def failing_lease(*args: Any, **kwargs: Any) -> Any:
            raise KeussConnectionError("injected: the lease round trip failed")

        storage.lease = failing_lease
        try:
            with pytest.raises(KeussConnectionError):
                await q.pop_many(3, timeout=1)
        finally:
            storage.lease = real_lease
        rest = await q.pop_many(10, timeout=1)
        assert sorted(m.payload for m in rest) == ["b", "c", "d"]


async def test_sizes_count_a_bucket_whose_final_write_is_in_flight(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The state flusher takes a finished bucket out of memory, then deletes it in storage:
    sizes asked between the two count it from memory (nothing left), not from the state
    storage still holds (every message reserved). The write is held back at a gate, so the
    window is certain, not a matter of timing."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **{**options, "state_flush_period": 0.05}) as factory:
        q = await factory.queue("final-write")
        await q.push_many(list(range(5)))
        got = await q.reserve_many(5, timeout=1)
        assert len(got) == 5
        store = q._store  # type: ignore[attr-defined]
        storage = store._storage
        await store.flush()  # the reservations are written: storage says reserved
        real_write = storage.write
        gate, reached = asyncio.Event(), asyncio.Event()

        async def gated_write(*args: Any, **kwargs: Any) -> Any:
            reached.set()
            await gate.wait()
            return await real_write(*args, **kwargs)

        storage.write = gated_write
        try:
            assert await q.ok_many(got) == [True] * 5  # marked in memory
            await asyncio.wait_for(reached.wait(), 10)  # the flusher's delete, held back
            assert not store._held_buckets
            assert await q.total_size() == 0
        finally:
            gate.set()
            storage.write = real_write
        assert await q.total_size() == 0


async def test_close_during_the_flushers_final_write_still_deletes_the_bucket(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The state flusher had taken a finished bucket out of memory for its delete when
    the close began: the close found nothing left to give back, then stopped the flusher,
    whose cancelled write put the bucket back in memory with nobody left to write it. The
    bucket stayed stored, its oks undone once the lease lapsed. The flusher's write is
    held at a gate until it is cancelled."""
    case, options = bucket_case
    factory = await aio_keuss.connect(case.name, **{**options, "state_flush_period": 0.05})
    try:
        q = await factory.queue("closing")
        await q.push_many(list(range(3)))
        got = await q.reserve_many(3, timeout=1)
        assert len(got) == 3
        store = q._store  # type: ignore[attr-defined]
        storage = store._storage
        await store.flush()
        real_write = storage.write
        reached = asyncio.Event()

        async def held_first(*args: Any, **kwargs: Any) -> Any:
            if not reached.is_set():  # the flusher's: held until it is cancelled
                reached.set()
                await asyncio.Event().wait()
            return await real_write(*args, **kwargs)

        storage.write = held_first
        assert await q.ok_many(got) == [True] * 3
        await asyncio.wait_for(reached.wait(), 10)
    finally:
        await factory.close()
    async with aio_keuss.connect(case.name, **options) as other:
        assert await (await other.queue("closing")).total_size() == 0


async def test_a_holder_that_stopped_consuming_gives_its_bucket_back(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A process that reserved one message and then stopped consuming (a hung handler, an
    idle process) kept the whole bucket: its lapsed reservation counted as active, so the
    idle release never came and the lease was renewed for ever. Now the bucket goes back
    once idle, the lapsed reservation with its try."""
    case, options = bucket_case
    settings = {**options, "state_flush_period": 0.1}
    async with (
        aio_keuss.connect(case.name, **settings) as holder,
        aio_keuss.connect(case.name, **settings) as other,
    ):
        held_q = await holder.queue("hostage", reserve_delay=1.0)
        other_q = await other.queue("hostage", reserve_delay=1.0)
        await held_q.push_many(list(range(10)))
        held = await held_q.reserve(timeout=5)
        assert held is not None
        got: list[aio_keuss.Message] = []
        for _ in range(10):  # the idle release comes after 5 s
            got += await other_q.reserve_many(10, timeout=10)
            if len(got) == 10:
                break
        assert sorted(m.payload for m in got) == list(range(10))
        assert {m.id: m.tries for m in got}[held.id] == 1
        assert await other_q.ok_many(got) == [True] * 10


async def _poison_held(
    factory: aio_keuss.Factory, name: str
) -> tuple[aio_keuss.Queue, aio_keuss.Message]:
    """Queue ``name`` holding one message, reserved (for 30 s) by the caller: what a ko
    deadletters with ``max_ko`` 0."""
    q = await factory.queue(name, reserve_delay=30)
    await q.push("poison")
    held = await q.reserve(timeout=5)
    assert held is not None
    return q, held


async def test_a_failed_deadletter_write_gives_the_reservation_back(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """While its deadletter copy is written, a slot is out of reach (no reserve, no second
    ko); if the write fails, the ko fails and the slot is the holder's again, as it was:
    still reserved, and the same ko can be sent again."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, deadletter={"max_ko": 0}) as factory:
        q, held = await _poison_held(factory, "dl-fails")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                q._store._storage,  # type: ignore[attr-defined]
                "insert_buckets",
                _raising(aio_keuss.BackendError("the deadletter write failed")),
            )
            with pytest.raises(aio_keuss.BackendError):
                await q.ko(held)
        sizes = await q.sizes()
        assert (sizes.total, sizes.reserved) == (1, 1)
        assert await q.ko(held) == KoResult.DEADLETTERED
        dead = await (await factory.queue("__deadletter__")).pop(timeout=5)
        assert dead is not None and dead.payload == "poison"
        assert await q.total_size() == 0


async def test_a_ko_cancelled_once_its_deadletter_copy_is_written_leaves_one_copy(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A ko cancelled while its deadletter write's reply is on its way (the copy stored)
    gave the reservation back, as for a failed write: the ko sent again (or the message's
    next delivery, ko-ed) wrote a second copy. Seen in the chaos test on bucket-postgres.
    The write now runs to its end and the slot is done; the ko still ends cancelled."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, deadletter={"max_ko": 0}) as factory:
        q, held = await _poison_held(factory, "dl-cut")
        storage = q._store._storage  # type: ignore[attr-defined]
        insert = storage.insert_buckets
        cancel: list[asyncio.Task[KoResult]] = []

        async def written_then_cancelled(*args: Any, **kwargs: Any) -> Any:
            result = await insert(*args, **kwargs)
            cancel[0].cancel()  # the copy is stored: the caller's cancellation comes now
            await asyncio.sleep(0)
            return result

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(storage, "insert_buckets", written_then_cancelled)
            cancel.append(asyncio.ensure_future(q.ko(held)))
            with pytest.raises(asyncio.CancelledError):
                await cancel[0]
        assert await q.ko(held) == KoResult.MISSING  # done, not deadlettered again
        got = await _take_all(await factory.queue("__deadletter__"))
        assert [m.payload for m in got] == ["poison"]
        assert await q.total_size() == 0


def _raising(error: Exception) -> Callable[..., Awaitable[Any]]:
    async def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    return fail


@asynccontextmanager
async def _buffering_beside_durable(
    case: BackendCase, options: dict[str, Any], max_wait: float = 0.3
) -> AsyncIterator[tuple[aio_keuss.Factory, aio_keuss.Factory]]:
    """A factory acknowledging on buffer (written after ``max_wait`` seconds), and one
    standing for another process on the same storage."""
    async with (
        aio_keuss.connect(
            case.name, **{**options, "bucket_max_wait": max_wait}, ack_on_buffer=True
        ) as factory,
        aio_keuss.connect(case.name, **options) as other,
    ):
        yield factory, other


async def test_ack_on_buffer_acknowledges_before_the_write(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    case, options = bucket_case
    # Written after an hour, unless drained: the push returns (within the test's timeout)
    # only if it does not wait for the write, and nothing else writes it meanwhile.
    async with _buffering_beside_durable(case, options, max_wait=3600) as (factory, other):
        q, seen_by_other = await factory.queue("buffered"), await other.queue("buffered")
        await q.push("quick")
        assert await seen_by_other.total_size() == 0  # buffered, not yet written
        assert await q.total_size() == 1  # its own buffer counts
        await q.drain()  # writes it
        message = await seen_by_other.pop(timeout=2)
        assert message is not None and message.payload == "quick"


async def test_ack_on_buffer_wakes_a_consumer_elsewhere_once_written(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The insert signal sent at buffer time comes before other processes can see the
    message; the one sent after the write must wake them, long before their poll."""
    case, options = bucket_case
    async with _buffering_beside_durable(case, options) as (factory, other):
        q = await factory.queue("buffered-wake")
        # its poll comes after its timeout: only the write's signal can end the wait early
        elsewhere = await other.queue("buffered-wake", poll_interval=3600)
        waiting = asyncio.create_task(elsewhere.pop(timeout=60))
        await asyncio.sleep(0.2)  # waiting, having found nothing (else it finds it at once)
        await q.push("written later")
        message = await waiting
        assert message is not None and message.payload == "written later"


async def test_close_gives_leased_buckets_back_at_once(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A reservation held at close goes back without a try and without the grace period."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, reserve_delay=60.0) as first:
        q = await first.queue("handover")
        await q.push_many(list(range(10)))
        assert await q.reserve(timeout=1) is not None
    async with aio_keuss.connect(case.name, **options) as second:
        got = await _take_all(await second.queue("handover"), idle=0.5)
        assert sorted(m.payload for m in got) == list(range(10))
        assert all(m.tries == 0 for m in got)


async def test_a_close_cancelled_as_it_gives_the_buckets_back_still_gives_them_back(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A queue's close cancelled (a shutdown timeout, a second Ctrl-C) while its store gives
    the leased buckets back: the cancelled close closes the store again, and that close
    gives them back. It returned at once, the store being closed already, and so did every
    later close: the buckets stayed leased, their messages out of reach, until the lease
    lapsed (minutes)."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, reserve_delay=600.0) as first:
        q = await first.queue("handover")
        await q.push_many(list(range(10)))
        assert len(await q.reserve_many(3, timeout=5)) == 3
        store: Any = q._store
        flush_state = store._flush_state
        releasing = asyncio.Event()

        async def slow_flush_state(release_all: bool = False) -> None:
            if release_all:  # the close's: a round trip to a far server
                releasing.set()
                await asyncio.sleep(0.2)
            await flush_state(release_all)

        store._flush_state = slow_flush_state
        closing = asyncio.create_task(q.close())
        await asyncio.wait_for(releasing.wait(), 30)
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
    async with aio_keuss.connect(case.name, **options) as second:
        got = await _take_all(await second.queue("handover"), idle=0.5)
        assert sorted(m.payload for m in got) == list(range(10))
        assert all(m.tries == 0 for m in got)


async def test_a_deadletter_a_close_gives_up_on_still_ends_in_one_queue(
    bucket_case: tuple[BackendCase, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ko past max_ko writes the message into the deadletter queue, then marks it done
    here. A close past its grace gave up the ko's round trips while the deadletter write
    was in flight: the reservation was handed back and the close gave the bucket back with
    the message available, once written there already: in both queues. The store's close
    now lets the write and the mark end first."""
    import aio_keuss.queue

    monkeypatch.setattr(aio_keuss.queue, "CANCELLED_CLOSE_GRACE", 0.0)  # gives up at once
    case, options = bucket_case
    options = {**options, "stats": "memory", "signal": "local"}
    factory, q, message = await a_poison_reserved(case.name, **options)
    store: Any = q._store
    copied, store_closing = asyncio.Event(), asyncio.Event()
    write_dead = store._write_dead

    async def write_then_wait(*args: Any) -> None:
        await write_dead(*args)
        copied.set()  # written there; not yet marked done here
        await store_closing.wait()

    store._write_dead = write_then_wait
    # in a batch task, as when every slot is busy (a ko alone runs in its caller's task,
    # which the close does not cancel)
    q._rollbacks._inline = False  # type: ignore[attr-defined]
    await ko_through_a_cut_close(factory, q, message, copied, store_closing)
    async with aio_keuss.connect(case.name, **options) as second:
        left = await _take_all(await second.queue("work"), idle=0.5)
        dead = await _take_all(await second.queue("__deadletter__"), idle=0.5)
    assert ([m.payload for m in left], [m.payload for m in dead]) == ([], ["poison"])


async def test_a_second_close_after_a_cancelled_one_warns_of_nothing(
    bucket_case: tuple[BackendCase, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """A queue's close cancelled while it waits for a running handler closes its store,
    which gives back every bucket, reservations and all. Closing the queue again then
    warned that the reservations it had handed out "could not be given back" and would
    "come back when their reservations expire" (the closed store refused them), when they
    were back already."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, reserve_delay=600.0) as first:
        q = await first.queue("handover")
        await q.push_many(list(range(10)))
        assert len(await q.reserve_many(3, timeout=5)) == 3  # held, never acknowledged
        started = asyncio.Event()

        async def handler(message: aio_keuss.Message) -> None:
            started.set()
            await asyncio.Event().wait()  # runs until cancelled

        q.consume(handler)
        await asyncio.wait_for(started.wait(), 30)
        closing = asyncio.create_task(q.close())
        await asyncio.sleep(0.1)  # the close waits for the handler, with the stop's grace
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        with caplog.at_level(logging.WARNING, logger="aio_keuss"):
            await q.close()
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    async with aio_keuss.connect(case.name, **options) as second:
        got = await _take_all(await second.queue("handover"), idle=0.5)
        assert sorted(m.payload for m in got) == list(range(10))


async def test_a_bucket_given_back_on_close_wakes_consumers_elsewhere(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A consumer of another factory waiting on the queue while a holder leases its only
    bucket found nothing to lease; when the holder closes and gives the bucket back, the
    waiting consumer is woken (a signal once the release is written), not left asleep
    until its poll interval."""
    case, options = bucket_case
    settings = {**options, "poll_interval": 30.0}
    async with aio_keuss.connect(case.name, **settings) as other:
        waiting_q = await other.queue("handed-back")
        holder = await aio_keuss.connect(case.name, **settings)
        try:
            q = await holder.queue("handed-back")
            await q.push_many(["first", "second", "third"])
            first = await q.reserve(timeout=5)  # leases the bucket: all three held here
            assert first is not None and await q.ok(first)
            waiting = asyncio.ensure_future(waiting_q.reserve_many(2, timeout=10))
            await asyncio.sleep(0.3)  # it leased nothing and sleeps now
        finally:
            await holder.close()
        got = await asyncio.wait_for(waiting, 5)  # the poll interval is 30 s
        assert sorted(m.payload for m in got) == ["second", "third"]
        assert await waiting_q.ok_many(got) == [True, True]


# crashes ---------------------------------------------------------------------------------


async def test_killed_producer_loses_no_acknowledged_push(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    case, options = bucket_case
    # a long max wait: only the durable ack makes these writes happen before the kill
    child_options = {**options, "bucket_max_wait": 30.0}
    report = await _report(_spawn("produce", case, child_options, "produced", "300"))
    assert report == {"acked": 300}
    async with aio_keuss.connect(case.name, **options) as factory:
        got = await _take_all(await factory.queue("produced"))
    assert sorted(m.payload for m in got) == list(range(300))


async def test_killed_consumer_reservations_come_back(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    case, options = bucket_case
    options = {**options, "reject_timeout_grace": 0.5, "reserve_delay": 60.0}
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("crash")
        await q.push_many(list(range(50)))
        report = await _report(_spawn("reserve", case, options, "crash", "20"))
        oked, held = set(report["oked"]), set(report["held"])
        assert len(oked) == 10 and len(held) == 10
        start = time.monotonic()
        got = await _take_all(q)
        payloads = [m.payload for m in got]
        assert len(payloads) == len(set(payloads))  # none twice
        assert set(payloads) == set(range(50)) - oked  # none lost, persisted oks stay done
        assert all(m.tries == 1 for m in got if m.payload in held)  # that delivery was a try
        assert time.monotonic() - start < 10


async def test_pop_is_not_repeated_after_a_consumer_crash(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    case, options = bucket_case
    # state is never flushed by the timer before the kill: only the pop's own write counts
    options = {**options, "reject_timeout_grace": 0.5, "state_flush_period": 30.0}
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("popped")
        await q.push_many(list(range(40)))
        report = await _report(_spawn("pop", case, options, "popped", "15"))
        popped = report["popped"]
        assert len(popped) == 15
        rest = [m.payload for m in await _take_all(q)]
        assert sorted(popped + rest) == list(range(40))


@pytest.mark.slow
async def test_200k_messages_through_4_consumer_processes_exactly_once(
    bucket_case: tuple[BackendCase, dict[str, Any]], tmp_path: Path
) -> None:
    case, options = bucket_case
    # The bucket layer is shared: 200,000 on one storage, a quarter on the others (suite time)
    total = 200_000 if case.name == "bucket-redis" else 50_000
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("fanout")
        for start in range(0, total, 10_000):
            await q.push_many(list(range(start, start + 10_000)))
        files = [tmp_path / f"consumer-{i}.json" for i in range(4)]
        children = [_spawn("consume", case, options, "fanout", str(f)) for f in files]
        started = time.monotonic()
        try:
            for child in children:
                await asyncio.wait_for(asyncio.to_thread(child.wait), 90)
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
        elapsed = time.monotonic() - started
        assert all(child.returncode == 0 for child in children)
        seen: list[int] = []
        for f in files:
            mine = json.loads(f.read_text())
            assert mine, "every consumer got a share"
            seen.extend(mine)
        assert len(seen) == total  # no duplicates ...
        assert sorted(seen) == list(range(total))  # ... and no gaps
        assert await q.total_size() == 0
        print(f"{case.id}: {total} reserve+ok in {elapsed:.1f} s by 4 processes")


async def test_push_buckets_are_bounded_by_bytes_too(
    bucket_case: tuple[BackendCase, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket is one stored value, which each database bounds (Redis 512 MB, PostgreSQL
    1 GB, MongoDB 16 MB): a push bucket counted only messages, so messages every other
    backend stores (1000 x 600 kB on Redis; 1024 x 20 kB on MongoDB) were refused once they
    shared a bucket. Here with a 1 MB bound: a bucket is sealed before it passes it, and a
    message that cannot fit in a bucket of its own is refused before anything is written."""
    from aio_keuss.buckets.storage import BucketStorage
    from aio_keuss.mongo.buckets import MongoBucketStorage

    for storage in (BucketStorage, MongoBucketStorage):  # Mongo has a bound of its own
        monkeypatch.setattr(storage, "max_bucket_bytes", 1_000_000, raising=False)
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("bytes")
        ids = await q.push_many([b"y" * 400_000] * 5)
        assert len({split_id(i)[0] for i in ids}) >= 3  # at most two 400 kB per 1 MB bucket
        with pytest.raises(aio_keuss.InvalidPayloadError):
            await q.push(b"z" * 1_000_000)
        with pytest.raises(aio_keuss.InvalidPayloadError):
            await q.push_many([b"ok", b"z" * 1_000_000])
        got = await _take_all(q)
        assert sorted(m.id for m in got) == sorted(ids)
        assert all(m.payload == b"y" * 400_000 for m in got)


async def test_deadlettered_messages_go_in_buckets_bounded_by_bytes(
    bucket_case: tuple[BackendCase, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The messages one ko batch deadletters went into one bucket whatever their bytes:
    past the database's bound (MongoDB's 16 MB document) the write failed, the messages
    came back, and failed again, never reaching the deadletter queue. Here a 1 MB bound."""
    from aio_keuss.buckets.storage import BucketStorage
    from aio_keuss.mongo.buckets import MongoBucketStorage

    for storage in (BucketStorage, MongoBucketStorage):
        monkeypatch.setattr(storage, "max_bucket_bytes", 1_000_000, raising=False)
    case, options = bucket_case
    async with aio_keuss.connect(case.name, deadletter={"max_ko": 0}, **options) as factory:
        q = await factory.queue("dying")
        for _ in range(5):
            await q.push_many([b"d" * 300_000] * 2)
        held: list[aio_keuss.Message] = []
        for _ in range(100):
            held += await q.reserve_many(10, timeout=1)
            if len(held) == 10:
                break
        assert len(held) == 10
        assert all(await asyncio.gather(*(q.ko(m) for m in held)))  # kos batched
        dead = await factory.queue("__deadletter__")
        got = await _take_all(dead)
        assert len(got) == 10 and all(m.payload == b"d" * 300_000 for m in got)
        per_bucket = collections.Counter(split_id(m.id)[0] for m in got)
        assert max(per_bucket.values()) <= 3  # three of 300 kB fill a 1 MB bucket


async def test_sizes_count_buckets_whose_insert_is_in_flight(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A push bucket is counted from memory while it fills or waits for a writer, and from
    storage once written. It was counted nowhere while its insert was in flight: with
    ``ack_on_buffer`` an acknowledged message then dropped out of ``total_size`` for a round
    trip (and a put-back of a cancelled pop's message, so a drain could end before it was
    back). Now counted from memory until its insert returns, and left out of the census
    meanwhile, so never twice either: the insert is held at a gate, then let through with
    the census asked in between."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, ack_on_buffer=True) as factory:
        q = await factory.queue("in-flight-counted")
        storage = q._store._storage  # type: ignore[attr-defined]
        real_insert = storage.insert_buckets
        reached, gate, written = asyncio.Event(), Uncancellable(), asyncio.Event()

        async def gated_insert(queue: str, buckets: Any) -> None:
            reached.set()
            await gate
            await real_insert(queue, buckets)
            written.set()

        storage.insert_buckets = gated_insert
        await q.push("one")
        assert await q.total_size() == 1  # buffered
        flushing = asyncio.create_task(q._store.flush())  # type: ignore[attr-defined]
        try:
            await asyncio.wait_for(reached.wait(), 10)
            assert await q.total_size() == 1  # its insert in flight (was 0)
        finally:
            gate.set_result(None)  # else the close waits for the write for ever
        await asyncio.wait_for(written.wait(), 10)
        assert await q.total_size() == 1  # written, its insert's reply not yet read
        await flushing
        assert await q.sizes() == aio_keuss.Sizes(1, 1, 0, 0)
        assert [m.payload for m in await q.pop_many(10, timeout=5)] == ["one"]


async def test_a_pop_whose_lease_fails_keeps_what_it_served_from_a_bucket_gone_meanwhile(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A pop serves what memory holds, then leases for more. Should that lease fail, what it
    served is made available again (as the test above has it), but that was done only in
    buckets still held: the state flusher could delete (or release) a bucket meanwhile,
    with those slots done, and they were lost, neither returned nor stored. Here the pop
    takes the last message of its bucket, a state flush runs while the lease is held at a
    gate, and the lease fails: the message is still there (the flush leaves the bucket)."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("served-then-failed")
        store = q._store  # type: ignore[attr-defined]
        await q.push_many(["a", "b"])  # one bucket
        assert [m.payload for m in await q.pop_many(1, timeout=5)] == ["a"]  # now held
        real_lease = store._storage.lease
        reached, gate = asyncio.Event(), Uncancellable()

        async def failing_lease(*args: Any, **kwargs: Any) -> Any:
            reached.set()
            await gate
            raise KeussConnectionError("the server went away")

        store._storage.lease = failing_lease
        try:
            popping = asyncio.create_task(store.get(5))
            await asyncio.wait_for(reached.wait(), 10)
            await store._flush_state()  # "b" served: nothing left, the bucket was deleted
        finally:
            gate.set_result(None)
        with pytest.raises(KeussConnectionError):
            await popping
        store._storage.lease = real_lease
        assert [m.payload for m in await q.pop_many(5, timeout=0)] == ["b"]  # lost before


async def _held_unrenewed(q: aio_keuss.Queue) -> tuple[aio_keuss.Message, Any]:
    """A message ("m") pushed and reserved through ``q``, whose store then stops writing
    (see :func:`_stop_renewing`): the message, and that store."""
    await q.push("m")
    held = await q.reserve(timeout=5)
    assert held is not None
    store = q._store  # type: ignore[attr-defined]
    await _stop_renewing(store)
    return held, store


async def _stop_renewing(store: Any) -> None:
    """The holder stops writing (as a stopped process would): no state flush, no renewal,
    until every lease it holds has lapsed (watched, not timed: 30 s at most)."""
    from aio_keuss.coalesce import stop_task

    await store.flush()  # what it did so far is written, as a running holder's is
    store._start_flusher = lambda: None
    if store._flusher is not None:
        await stop_task(store._flusher)
    for _ in range(3000):
        if all(b.lease_until < time.time() for b in store._held_buckets.values()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the leases never lapsed")


@asynccontextmanager
async def _two_factories(
    bucket_case: tuple[BackendCase, dict[str, Any]],
    name: str,
    reserve_delay: float,
    **extra: Any,
) -> AsyncIterator[tuple[aio_keuss.Queue, aio_keuss.Queue, aio_keuss.Factory]]:
    """Queue ``name`` opened by two factories (two processes, as far as the buckets go):
    the first's, the second's, and the second factory."""
    case, options = bucket_case
    async with (
        aio_keuss.connect(case.name, **options, **extra) as first,
        aio_keuss.connect(case.name, **options, **extra) as second,
    ):
        one = await first.queue(name, reserve_delay=reserve_delay)
        two = await second.queue(name, reserve_delay=reserve_delay)
        yield one, two, second


async def test_a_remove_by_a_holder_whose_bucket_was_taken_over_is_false(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A holder stopped past its lease; another process took the bucket over. The old
    holder's remove of a message in it cannot happen (its state write is refused): it
    answers False, and the message is still delivered by the new holder."""
    async with _two_factories(bucket_case, "taken-over", 1.0) as (old_q, new_q, _):
        await old_q.push_many(["a", "b"])  # one bucket
        held = await old_q.reserve(timeout=5)  # leases the bucket
        assert held is not None
        other = "b" if held.payload == "a" else "a"
        other_id = held.id.rpartition("-")[0] + "-" + str(1 - int(held.id.rpartition("-")[2]))
        await _stop_renewing(old_q._store)  # type: ignore[attr-defined]
        got = await new_q.reserve_many(10, timeout=10)
        assert sorted(m.payload for m in got) == ["a", "b"]
        assert await old_q.remove(other_id) is False
        assert await new_q.ok_many(got) == [True, True]
        assert other in [m.payload for m in got]


class _TakenOver(NamedTuple):
    old: aio_keuss.Queue  # the holder stopped past its lease
    new: aio_keuss.Queue  # of the factory that took its bucket over
    held: aio_keuss.Message  # the old holder's reservation
    got: aio_keuss.Message  # the new holder's, of the same message
    factory: aio_keuss.Factory  # the new holder's


@asynccontextmanager
async def _taken_over(
    bucket_case: tuple[BackendCase, dict[str, Any]], name: str, **extra: Any
) -> AsyncIterator[_TakenOver]:
    """One message reserved, its holder stopped past its lease, the bucket taken over by a
    second factory."""
    async with _two_factories(bucket_case, name, 1.0, **extra) as (old_q, new_q, new):
        held, _ = await _held_unrenewed(old_q)
        got = await new_q.reserve(timeout=10)
        assert got is not None and got.id == held.id and got.tries == 1
        yield _TakenOver(old_q, new_q, held, got, new)


async def test_a_deadletter_ko_by_a_holder_whose_bucket_was_taken_over_is_missing(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The old holder's ko past max_ko cannot apply: the new holder has the message (and
    handed it out again), so it must not be deadlettered as well (a second copy)."""
    async with _taken_over(bucket_case, "taken-over-dl", deadletter={"max_ko": 0}) as t:
        assert await t.old.ko(t.held) == KoResult.MISSING
        assert await t.new.ok(t.got) is True
        dead_q = await t.factory.queue("__deadletter__")
        assert await dead_q.pop(timeout=0.5) is None


async def test_an_ok_by_a_holder_whose_bucket_was_taken_over_is_false(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    async with _taken_over(bucket_case, "taken-over-ok") as t:
        assert await t.old.ok(t.held) is False
        assert await t.new.ok(t.got) is True


async def test_a_ko_by_a_holder_whose_bucket_was_taken_over_is_missing(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A ko (with a delay) of the old holder cannot apply: the new holder has the message
    and serves it again at once. It answers MISSING, as a ko of a reservation no longer
    held does, not ROLLED_BACK."""
    async with _taken_over(bucket_case, "taken-over-ko") as t:
        assert await t.old.ko(t.held, delay=60) == KoResult.MISSING
        assert await t.new.ok(t.got) is True


async def test_a_remove_in_flight_when_the_queue_closes_leaves_nothing_leased(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A remove of a message in a bucket this store does not hold leases that bucket. A
    close while that lease is in flight gave back what the store held then; the bucket
    leased after it stayed leased by a closed store (nothing flushes there any more), its
    other messages out of every consumer's reach until the lease lapsed. The lease is held
    until the close is over, or (a close that waits for it) for up to 2 s: the close's
    outcome checked after does not depend on which."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options) as other:
        factory = await aio_keuss.connect(case.name, **options)
        try:
            q = await factory.queue("remove-closing", reserve_delay=60)
            await q.push_many(["a", "b"])  # one bucket, nobody holds it
            other_q = await other.queue("remove-closing", reserve_delay=60)
            probe = await other_q.reserve(timeout=5)
            assert probe is not None  # find the bucket's id, then give it back
            await other_q._store.close()  # type: ignore[attr-defined]
            bucket_id = probe.id.rpartition("-")[0]
            store = q._store  # type: ignore[attr-defined]
            real_lease = store._storage.lease
            reached, closing_started = asyncio.Event(), asyncio.Event()

            async def gated_lease(*args: Any, **kwargs: Any) -> Any:
                reached.set()
                await closing_started.wait()
                await asyncio.wait({closing}, timeout=2)
                return await real_lease(*args, **kwargs)

            store._storage.lease = gated_lease
            removing = asyncio.create_task(q.remove(f"{bucket_id}-0"))
            await asyncio.wait_for(reached.wait(), 10)
            closing = asyncio.create_task(q.close())
            closing_started.set()
            await closing
            await removing
            store._storage.lease = real_lease
            assert not store._held_buckets
        finally:
            await factory.close()
    async with aio_keuss.connect(case.name, **options) as third:
        sizes = await (await third.queue("remove-closing")).sizes()
        assert sizes.reserved == 0


async def test_a_bucket_whose_final_write_is_in_flight_is_not_leased_again_from_its_old_state(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The state flusher gives back a bucket (its only message ko-ed with a delay) and
    its write is slow, slower than the lease (a stalled server). A lease of this same store
    meanwhile found the bucket's lease lapsed, with itself as the holder: it took it again
    from the state storage still held (the message reserved, not yet ko-ed), so the
    message was served at once despite its delay, and the release landing after freed the
    bucket under the new copy. The give-back is in flight still: the lease leaves it be.
    The release is held at a gate until the lease lapsed and a reserve ran."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("slow-release", reserve_delay=1.0)
        await q.push("a")
        held = await q.reserve(timeout=5)
        assert held is not None
        store = q._store  # type: ignore[attr-defined]
        await store.flush()  # stored: reserved
        real_write = store._storage.write
        reached, gate = asyncio.Event(), asyncio.Event()

        async def gated_write(queue: str, writes: Any) -> Any:
            if any(w.mode == "r" for w in writes):
                reached.set()
                await gate.wait()
            return await real_write(queue, writes)

        store._storage.write = gated_write
        try:
            assert await q.ko(held, delay=30) == KoResult.ROLLED_BACK
            await asyncio.wait_for(reached.wait(), 10)  # the give-back, held
            (leaving,) = store._leaving.values()
            for _ in range(3000):
                if leaving.lease_until < time.time():
                    break
                await asyncio.sleep(0.01)
            assert await q.reserve(timeout=0) is None  # not due for 30 s
        finally:
            gate.set()
        for _ in range(1000):
            if not store._leaving:
                break
            await asyncio.sleep(0.01)
        store._storage.write = real_write
        assert not store._held_buckets
        sizes = await q.sizes()
        assert (sizes.total, sizes.scheduled, sizes.reserved) == (1, 1, 0)


async def test_a_remove_cancelled_while_it_leases_strands_no_bucket(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A remove of a message in a bucket nobody holds leases that bucket. Cancelled once
    the lease was taken (its reply on its way), it dropped the reply: the bucket stayed
    leased by a store that did not know it held it, its messages out of every consumer's
    reach until the lease lapsed (0.8 x reserve_delay, 48 s here). The lease is held at a
    gate once taken, and the remove cancelled there."""
    async with _two_factories(bucket_case, "remove-cancelled", 60) as (q, other_q, _):
        await q.push_many(["a", "b"])  # one bucket, nobody holds it
        probe = await other_q.reserve(timeout=5)
        assert probe is not None  # the bucket's id; then given back
        assert await other_q.ko(probe, delay=0) == KoResult.ROLLED_BACK
        other_store = other_q._store  # type: ignore[attr-defined]
        await other_store._flush_state(release_all=True)
        bucket_id = probe.id.rpartition("-")[0]
        store = q._store  # type: ignore[attr-defined]
        real_lease = store._storage.lease
        taken, gate = asyncio.Event(), asyncio.Event()

        async def gated_lease(*args: Any, **kwargs: Any) -> Any:
            lease = await real_lease(*args, **kwargs)
            taken.set()
            await gate.wait()
            return lease

        store._storage.lease = gated_lease
        removing = asyncio.create_task(q.remove(f"{bucket_id}-0"))
        await asyncio.wait_for(taken.wait(), 10)
        removing.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await removing
        store._storage.lease = real_lease
        got = await other_q.reserve_many(10, timeout=20)
        assert sorted(m.payload for m in got) == ["a", "b"]


async def test_a_lease_landing_before_our_own_release_does_not_serve_the_old_state(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The state flusher gives back a bucket whose lease lapsed (one message ok-ed, the
    other ko-ed with a delay) while a lease of this same store is on its way on another
    connection. The lease lands first and takes the bucket (its lease lapsed, the holder
    being this store) from the state storage still holds, both messages reserved; the
    release lands next and, conditioned on this store's token which the lease wrote
    again, frees the bucket. Its reply arrives first, so the lease's reply finds nothing
    of the bucket in memory: the copy it took was served, the ok-ed message delivered
    again (and, the bucket being free in storage, anyone could serve it a third time).
    The server order and the reply order are set by gates: the release waits for the
    lease to land, the lease's reply for the release's to be read."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("lease-before-release", reserve_delay=1.0)
        await q.push_many(["a", "b"])  # one bucket
        got = await q.reserve_many(2, timeout=5)
        assert sorted(m.payload for m in got) == ["a", "b"]
        store = q._store  # type: ignore[attr-defined]
        await store.flush()  # stored: both reserved
        storage = store._storage
        real_write, real_lease = storage.write, storage.lease
        releasing, landed, replied = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def gated_write(queue: str, writes: Any) -> Any:
            if not any(w.mode == "r" for w in writes):
                return await real_write(queue, writes)
            releasing.set()
            await landed.wait()
            try:
                return await real_write(queue, writes)
            finally:
                asyncio.get_running_loop().call_soon(replied.set)

        async def gated_lease(*args: Any, **kwargs: Any) -> Any:
            lease = await real_lease(*args, **kwargs)
            landed.set()
            if releasing.is_set():
                await asyncio.wait_for(replied.wait(), 10)
            return lease

        store._storage.write = gated_write
        store._storage.lease = gated_lease
        try:
            a = next(m for m in got if m.payload == "a")
            b = next(m for m in got if m.payload == "b")
            assert await q.ok(a) is True
            assert await q.ko(b, delay=30) == KoResult.ROLLED_BACK
            await asyncio.wait_for(releasing.wait(), 10)  # the give-back, held
            (leaving,) = store._leaving.values()
            for _ in range(3000):  # its lease lapses (watched, not timed)
                if leaving.lease_until < time.time():
                    break
                await asyncio.sleep(0.01)
            again = await q.reserve(timeout=0)
            assert again is None, f"{again.payload!r} served again"
        finally:
            landed.set()
            store._storage.write = real_write
            store._storage.lease = real_lease
        for _ in range(1000):
            if not store._leaving:
                break
            await asyncio.sleep(0.01)
        sizes = await q.sizes()
        assert (sizes.total, sizes.scheduled, sizes.reserved) == (1, 1, 0)


async def test_a_release_landing_after_the_store_leased_the_bucket_again_is_refused(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A release whose reply never came (the connection dropped, a client timeout) may
    still reach the server later. The store retried it (it landed, the bucket went back),
    then leased the bucket again and reserved its message; the first release then landed,
    and, conditioned on the owner being this store, freed the bucket under the new lease:
    the reserved message was free again, served elsewhere at once (delivered twice). The
    first release is held (as a request still on its way) until the new lease took the
    message."""
    case, options = bucket_case
    async with (
        aio_keuss.connect(case.name, **options) as factory,
        aio_keuss.connect(case.name, **options) as elsewhere,
    ):
        q = await factory.queue("late-release", reserve_delay=1.0)
        other = await elsewhere.queue("late-release", reserve_delay=1.0)
        await q.push_many(["a", "b"])  # one bucket
        got = await q.reserve_many(2, timeout=5)
        assert sorted(m.payload for m in got) == ["a", "b"]
        store = q._store  # type: ignore[attr-defined]
        await store.flush()  # stored: both reserved
        real_write = store._storage.write
        gate = asyncio.Event()
        late: list[asyncio.Task[Any]] = []

        async def on_its_way(*args: Any) -> Any:
            await gate.wait()
            return await real_write(*args)

        async def lost_reply(*args: Any) -> Any:
            if not late and any(w.mode == "r" for w in args[-1]):
                late.append(asyncio.create_task(on_its_way(*args)))
                raise KeussConnectionError("the reply was lost")
            return await real_write(*args)

        store._storage.write = lost_reply
        try:
            assert await q.ok(next(m for m in got if m.payload == "a")) is True
            b = next(m for m in got if m.payload == "b")
            assert await q.ko(b, delay=0.2) == KoResult.ROLLED_BACK
            for _ in range(3000):  # given back by the retry (watched, not timed)
                if late and not store.in_memory():
                    break
                await asyncio.sleep(0.01)
            again = await q.reserve(timeout=10)  # leased again once b is due
            assert again is not None and again.payload == "b"
            gate.set()
            await late[0]  # the first release lands now
        finally:
            gate.set()
            store._storage.write = real_write
        twice = await other.reserve(timeout=0)
        assert twice is None, f"{twice.payload!r} delivered twice"
        assert await q.ok(again) is True
        await store.flush()
        assert await other.total_size() == 0


@contextmanager
def _copies_held(store: Any) -> Iterator[asyncio.Event]:
    """While the block runs, the bucket inserts of ``store`` (a deadletter ko's copies) wait
    until it ends; the event yielded is set once one is waiting."""
    insert = store._storage.insert_buckets
    reached, gate = asyncio.Event(), asyncio.Event()

    async def held_copy(*args: Any, **kwargs: Any) -> Any:
        reached.set()
        await gate.wait()
        return await insert(*args, **kwargs)

    store._storage.insert_buckets = held_copy
    try:
        yield reached
    finally:
        gate.set()
        store._storage.insert_buckets = insert


async def _lease_lapsed(store: Any) -> None:
    """Until the lease of the one bucket ``store`` holds has lapsed (watched, not timed:
    a bound of 30 s against a hang)."""
    (bucket,) = store._held_buckets.values()
    for _ in range(3000):
        if bucket.lease_until < time.time():
            return
        await asyncio.sleep(0.01)


async def test_a_takeover_while_a_deadletter_copy_is_on_its_way_leaves_one_copy(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A ko past max_ko by a holder whose lease lapsed renews the lease, then writes the
    copy into the deadletter queue, then marks the slot done. Should the copy take longer
    than a lease (the holder unable to write meanwhile), another consumer takes the bucket
    over from its stored state. That state said the slot was reserved: the new holder
    delivered the message again, the copy then landed and the mark was refused, the
    message in both queues. Now it says the slot is on its way to the deadletter queue:
    the new holder writes the copy (the same one) instead. The old holder's copy is held
    until the takeover happened."""
    async with _two_factories(bucket_case, "dl-takeover", 1.0, deadletter={"max_ko": 0}) as (
        old_q,
        new_q,
        factory,
    ):
        held, old = await _held_unrenewed(old_q)
        with _copies_held(old) as reached:
            ko = asyncio.create_task(old_q.ko(held))
            await asyncio.wait_for(reached.wait(), 10)  # renewed, the copy on its way
            await _lease_lapsed(old)  # the renewed lease
            got = await new_q.reserve(timeout=0)
            # taken over, the copy written by the new holder, the slot done: nothing left
            assert await new_q.total_size() == 0
        result = await ko
        dead = await _take_all(await factory.queue("__deadletter__"), idle=0.5)
        copies = len(dead) + (got is not None)
        assert copies == 1, f"ko {result!r}, redelivered {got is not None}, dead {len(dead)}"
        assert await new_q.total_size() == 0


async def test_a_deadletter_move_whose_holder_died_after_the_mark_is_finished_by_the_next(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A holder stored a slot as on its way to the deadletter queue, then died before its
    copy was written (here: its copy fails, and it writes nothing more). Whoever takes the
    bucket over neither delivers the message again nor loses it: it writes the copy itself
    and marks the slot done."""
    async with _two_factories(
        bucket_case, "dl-died", 1.0, deadletter={"max_ko": 0}, poll_interval=3600.0
    ) as (
        old_q,
        new_q,
        factory,
    ):
        held, old = await _held_unrenewed(old_q)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(old._storage, "insert_buckets", _raising(aio_keuss.BackendError("died")))
            with pytest.raises(aio_keuss.BackendError):
                await old_q.ko(held)  # the mark is stored, the copy is not
        await _lease_lapsed(old)
        # A consumer of the deadletter queue waiting in the taker's process, whose poll
        # would come only after an hour: the finished move's signal wakes it.
        dlq = await factory.queue("__deadletter__")
        waiting = asyncio.create_task(dlq.reserve(timeout=60))
        await asyncio.sleep(0)
        got = await new_q.reserve(timeout=0)
        assert got is None, "delivered again"
        assert await new_q.total_size() == 0  # taken over, copied, done
        woken = await waiting
        assert woken is not None and woken.payload == "m", "the deadletter queue was not told"
        assert await dlq.ok(woken) is True
        assert await dlq.total_size() == 0
        assert await new_q.total_size() == 0
        stats = await new_q.stats()
        assert stats["deadletter"] == 1 and (await dlq.stats())["put"] == 1, stats


async def test_a_deadletter_move_finished_by_a_taker_configured_otherwise_lands_where_it_began(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The holder deadletters into its own deadletter queue ("graveyard"); the process that
    takes the bucket over while the copy is on its way has no deadletter option. It copied
    into ``__deadletter__`` (the only queue it knew), the holder's copy landed in the
    graveyard: the message in two deadletter queues, and in the wrong one had the holder
    died. The slot's stored state names its target, so the taker writes the same copy."""
    case, options = bucket_case
    async with (
        aio_keuss.connect(
            case.name, **options, deadletter={"max_ko": 0, "queue": "graveyard"}
        ) as first,
        aio_keuss.connect(case.name, **options) as second,
    ):
        old_q = await first.queue("dl-elsewhere", reserve_delay=1.0)
        new_q = await second.queue("dl-elsewhere", reserve_delay=1.0)
        held, old = await _held_unrenewed(old_q)
        with _copies_held(old) as reached:
            ko = asyncio.create_task(old_q.ko(held))
            await asyncio.wait_for(reached.wait(), 10)  # stored as on its way
            await _lease_lapsed(old)  # the renewed lease
            assert await new_q.reserve(timeout=0) is None
            assert await new_q.total_size() == 0
        await ko
        stray = await _take_all(await second.queue("__deadletter__"), idle=0.5)
        dead = await _take_all(await second.queue("graveyard"), idle=0.5)
        assert [m.payload for m in stray] == []
        assert [(m.payload, m.headers["x-dl-from-queue"]) for m in dead] == [("m", "dl-elsewhere")]


async def test_a_bucket_given_back_with_a_deadletter_move_unfinished_is_taken_at_once(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A holder stored a slot as on its way and died; the process that took the bucket over
    could not write the copy either (the deadletter queue out of reach) and closed, giving
    the bucket back with the slot still on its way. Its score was the earliest mature time
    of its available slots: another message of the bucket ko-ed for an hour, nobody took
    the bucket, nor finished the move, for an hour. A slot on its way makes the bucket
    worth leasing at once."""
    case, options = bucket_case
    async with (
        aio_keuss.connect(case.name, **options, deadletter={"max_ko": 1}) as first,
        aio_keuss.connect(case.name, **options, deadletter={"max_ko": 1}) as second,
        aio_keuss.connect(case.name, **options, deadletter={"max_ko": 1}) as third,
    ):
        old_q = await first.queue("dl-given-back", reserve_delay=1.0)
        await old_q.push_many(["later", "poison"])  # one bucket
        got = await old_q.reserve_many(2, timeout=5)
        assert sorted(m.payload for m in got) == ["later", "poison"]
        later, poison = sorted(got, key=lambda m: m.payload != "later")
        assert await old_q.ko(later, delay=3600) == KoResult.ROLLED_BACK
        assert await old_q.ko(poison) == KoResult.ROLLED_BACK
        again = await old_q.reserve(timeout=5)
        assert again is not None and again.payload == "poison"
        old = old_q._store  # type: ignore[attr-defined]
        await _stop_renewing(old)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(old._storage, "insert_buckets", _raising(aio_keuss.BackendError("died")))
            with pytest.raises(aio_keuss.BackendError):
                await old_q.ko(again)  # stored as on its way, the copy not written
        (bucket,) = old._held_buckets.values()
        for _ in range(3000):  # its lease lapses (watched, not timed)
            if bucket.lease_until < time.time():
                break
            await asyncio.sleep(0.01)
        taker = await second.queue("dl-given-back", reserve_delay=1.0)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                taker._store._storage,  # type: ignore[attr-defined]
                "insert_buckets",
                _raising(aio_keuss.BackendError("away")),
            )
            assert await taker.reserve(timeout=0) is None  # taken over, the copy failed
            await taker.close()  # fails again: the bucket goes back, the move unfinished
        last = await third.queue("dl-given-back", reserve_delay=1.0)
        assert await last.reserve(timeout=0) is None  # taken at once, the move finished
        dead = await _take_all(await third.queue("__deadletter__"), idle=0.5)
        assert [m.payload for m in dead] == ["poison"]
        sizes = await last.sizes()
        assert (sizes.total, sizes.scheduled) == (1, 1)


async def test_an_insert_of_a_bucket_id_already_stored_leaves_the_stored_one_as_it_is(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A deadletter copy written by two holders, or a push sent again (a redis-py retry):
    the second insert neither frees a leased bucket under its holder nor replaces its
    content, and the holder's writes still land."""
    from array import array

    from aio_keuss.buckets.storage import RELEASE, NewBucket, Outcome, StateWrite

    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("insert-twice")
        storage = q._store._storage  # type: ignore[attr-defined]
        now = time.time()

        def bucket(payload: bytes) -> NewBucket:
            state = encode_state(bytes(1), array("I", [0]), array("d", [now]))
            return NewBucket("b.dl0", now, 1, encode_blob([payload], [b"{}"]), state)

        await storage.insert_buckets(q.name, [bucket(b"first")])
        lease = await storage.lease(q.name, "holder.1", now, now + 60, 1, 10)
        assert [row.id for row in lease.buckets] == ["b.dl0"]
        await storage.insert_buckets(q.name, [bucket(b"second")])
        assert (await storage.lease(q.name, "other.1", now, now + 60, 1, 10)).buckets == []
        state = encode_state(bytes(1), array("I", [3]), array("d", [now]))
        (written,) = await storage.write(
            q.name, [StateWrite("b.dl0", RELEASE, now, 1, state, "holder.1", 1)]
        )
        assert written is Outcome.WRITTEN  # still the holder's, given back by it
        (row,) = (await storage.lease(q.name, "holder.2", now, now + 60, 1, 10, ["b.dl0"])).buckets
        assert (row.blob, row.state) == (lease.buckets[0].blob, state)


async def test_a_bucket_held_by_an_earlier_release_that_died_is_taken_over(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A bucket stored by the previous release: its owner that release's store token (no
    lease number), its lease lapsed, one slot handed out and one done. This release takes
    it over as any other: the handed-out message comes back with one more try, the done
    one does not, and the state this release writes under its own lease is kept."""
    from array import array

    from aio_keuss.buckets.codec import DONE, HANDED_OUT
    from aio_keuss.buckets.storage import KEEP, Outcome, StateWrite

    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options) as factory:
        q = await factory.queue("earlier-release", reserve_delay=1.0)
        await q.push_many(["a", "b"])  # one bucket
        store = q._store  # type: ignore[attr-defined]
        await store.flush()
        storage = store._storage
        old_token = os.urandom(8).hex()  # as the previous release wrote it
        now = time.time()
        lease = await storage.lease(q.name, old_token, now, now + 60, 2, 10)
        (row,) = lease.buckets
        states = bytes([DONE, HANDED_OUT])
        old_state = encode_state(states, array("I", [0, 0]), array("d", [now, now]))
        (kept,) = await storage.write(
            q.name, [StateWrite(row.id, KEEP, now - 1, 1, old_state, old_token, 1)]
        )
        assert kept is Outcome.WRITTEN
        got = await q.reserve(timeout=5)
        assert got is not None and got.payload == "b" and got.tries == 1
        assert await q.reserve(timeout=0) is None
        assert await q.ok(got) is True
        await store.flush()
        assert await q.total_size() == 0


async def test_an_older_state_write_of_the_same_lease_landing_late_is_refused(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A state write whose reply never came (the connection dropped, a client timeout) may
    still reach the server later, after a newer flush of the same lease landed. Both carry
    the lease's token, so the owner alone let the older one in: the bucket's stored state
    went back to before the ok, and the next holder (this one stopped past its lease)
    delivered the ok-ed message again. The first write is held (as a request still on its
    way) until the newer flush landed."""
    from aio_keuss.buckets.storage import Outcome

    async with _two_factories(bucket_case, "late-state-write", 1.0) as (q, other, _):
        await q.push_many(["a", "b"])  # one bucket
        got = await q.reserve_many(2, timeout=5)
        assert sorted(m.payload for m in got) == ["a", "b"]
        store = q._store  # type: ignore[attr-defined]
        real_write = store._storage.write
        gate = asyncio.Event()
        late: list[asyncio.Task[Any]] = []

        async def on_its_way(*args: Any) -> Any:
            await gate.wait()
            return await real_write(*args)

        async def lost_reply(*args: Any) -> Any:
            if not late and any(w.state is not None for w in args[-1]):
                late.append(asyncio.create_task(on_its_way(*args)))
                raise KeussConnectionError("the reply was lost")
            return await real_write(*args)

        store._storage.write = lost_reply
        try:
            with pytest.raises(KeussConnectionError):
                await store.flush()  # both reserved: on its way, its reply lost
            assert await q.ok(next(m for m in got if m.payload == "a")) is True
            await store.flush()  # the newer state (a done) lands first
            gate.set()
            # the older one (a reserved) lands now: refused, and not as a lost lease
            assert await late[0] == [Outcome.SUPERSEDED]
        finally:
            gate.set()
            store._storage.write = real_write
        (bucket,) = store._held_buckets.values()
        assert not bucket.lost  # our own older write refused: the lease is still ours
        await _stop_renewing(store)
        again = await other.reserve_many(10, timeout=10)  # taken over: the stored state
        assert [m.payload for m in again] == ["b"], "the ok-ed message was delivered again"
        assert again[0].tries == 1
        assert await other.ok_many(again) == [True]


async def test_a_state_write_refused_as_superseded_keeps_the_lease(
    bucket_case: tuple[BackendCase, dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A write of this lease refused because a later one of the same lease is stored says
    nothing of the lease being over: the holder keeps the bucket (no lost-lease warning, its
    oks still count) and writes again. A later write is put ahead of the flush's own."""
    import dataclasses

    from aio_keuss.buckets.storage import Outcome

    async with _two_factories(bucket_case, "superseded-write", 1.0) as (q, other, _):
        await q.push_many(["a", "b"])  # one bucket
        got = await q.reserve_many(2, timeout=5)
        assert sorted(m.payload for m in got) == ["a", "b"]
        assert await q.ok(next(m for m in got if m.payload == "a")) is True
        store = q._store  # type: ignore[attr-defined]
        real_write = store._storage.write
        outcomes: list[list[Outcome]] = []

        async def overtaken(queue: str, writes: Any) -> Any:
            if not outcomes:
                ahead = [dataclasses.replace(w, seq=w.seq + 1) for w in writes]
                await real_write(queue, ahead)
            outcomes.append(await real_write(queue, writes))
            return outcomes[-1]

        store._storage.write = overtaken
        try:
            with caplog.at_level(logging.WARNING, "aio_keuss.buckets"):
                await store.flush()
        finally:
            store._storage.write = real_write
        assert outcomes[0] == [Outcome.SUPERSEDED]
        assert "was lost" not in caplog.text
        (bucket,) = store._held_buckets.values()
        assert not bucket.lost and bucket.persisted == bucket.version
        await _stop_renewing(store)
        again = await other.reserve_many(10, timeout=10)  # taken over: the stored state
        assert [m.payload for m in again] == ["b"]
        assert await other.ok_many(again) == [True]


# extend ----------------------------------------------------------------------------------


async def test_an_extended_reservation_outlives_the_lease_it_was_made_under(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A reservation's end lives only in its holder's memory (the stored state says handed
    out, not until when): another process takes it only by taking the whole bucket over,
    which it may once the holder's lease lapses. Extended past the lease it was made under,
    the reservation holds because the holder keeps renewing the lease while a reservation
    of the bucket is live: once that lease and the reservation first given have both ended
    (watched, not timed), another process still finds nothing, and the holder's ok stands."""
    async with _two_factories(bucket_case, "extend-lease", 0.5, reject_timeout_grace=2.0) as (
        q,
        other,
        _,
    ):
        await q.push("long")
        held = await q.reserve(timeout=5)
        assert held is not None
        store = q._store  # type: ignore[attr-defined]
        (bucket,) = store._held_buckets.values()
        asked = time.time()
        assert await q.extend(held, 60) is True
        first_lease = bucket.lease_until
        for _ in range(3000):
            if time.time() > max(first_lease, asked + 0.5) and bucket.lease_until > first_lease:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the lease was never renewed")
        assert await other.reserve(timeout=0) is None
        assert (await other.sizes()).reserved == 1  # a bucket leased elsewhere
        assert (await q.sizes()).reserved == 1
        assert await q.ok(held) is True
        await store.flush()
        assert await other.total_size() == 0


async def test_an_extend_on_a_lapsed_lease_nobody_took_renews_it_first(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The holder could not renew its lease in time, but nobody took the bucket over: the
    reservation is still its own, and so is the extension, but only once the lease is
    renewed (until then another process may take the bucket at any moment). The extend
    writes before it answers, as an ok there does."""
    async with _two_factories(bucket_case, "extend-lapsed", 0.5, reject_timeout_grace=2.0) as (
        q,
        other,
        _,
    ):
        await q.push("long")
        held = await q.reserve(timeout=5)
        assert held is not None
        store = q._store  # type: ignore[attr-defined]
        await _stop_renewing(store)
        (bucket,) = store._held_buckets.values()
        lapsed = bucket.lease_until
        assert await q.extend(held, 60) is True
        assert bucket.lease_until > lapsed and not bucket.lost  # renewed by the extend
        del store._start_flusher  # renewing again, as a holder that came back does
        store._start_flusher()
        assert await other.reserve(timeout=0) is None
        assert await q.ok(held) is True
        await store.flush()
        assert await other.total_size() == 0


async def test_an_extend_by_a_holder_whose_bucket_was_taken_over_is_false(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """Its stale copy still says handed out with the same tries, but the bucket is the new
    holder's, which serves the message again: the old holder's extend is refused (found
    lost by the write it makes first), and the new holder's reservation stands."""
    async with _taken_over(bucket_case, "taken-over-extend") as t:
        assert await t.old.extend(t.held, 60) is False
        assert await t.new.extend(t.got, 60) is True
        assert await t.new.ok(t.got) is True


async def test_a_holder_resuming_after_a_taker_finished_its_deadletter_counts_it_once(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The holder's copy is held past its lease; a taker finishes the move and counts it.
    The holder then resumes: its copy lands on the taker's (the same id), its mark is
    refused (the lease is the taker's). Its ko counted the deadletter a second time; now
    it answers MISSING (the move was the taker's to finish), and the count stays one."""
    async with _two_factories(bucket_case, "dl-count-once", 1.0, deadletter={"max_ko": 0}) as (
        old_q,
        new_q,
        factory,
    ):
        held, old = await _held_unrenewed(old_q)
        with _copies_held(old) as reached:
            ko = asyncio.create_task(old_q.ko(held))
            await asyncio.wait_for(reached.wait(), 10)  # stored as on its way
            await _lease_lapsed(old)  # the renewed lease
            assert await new_q.reserve(timeout=0) is None  # taken over, finished, counted
        assert await ko == KoResult.MISSING
        dead = await _take_all(await factory.queue("__deadletter__"), idle=0.5)
        assert [m.payload for m in dead] == ["m"]
        assert (await new_q.stats())["deadletter"] == 1


async def test_a_taker_stalled_before_its_mark_leaves_the_count_to_whoever_finishes(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A holder died with a slot on its way; a taker's copy is held past its own lease, and
    a third process finishes the move. The taker then resumes: its copy lands on the
    third's and its mark is refused. It counted the deadletter before its mark was
    stored: counted twice. Now only the finisher whose mark is stored counts it."""
    case, options = bucket_case
    extra = {"deadletter": {"max_ko": 0}, "poll_interval": 3600.0}
    async with (
        aio_keuss.connect(case.name, **options, **extra) as first,
        aio_keuss.connect(case.name, **options, **extra) as second,
        aio_keuss.connect(case.name, **options, **extra) as third,
    ):
        old_q = await first.queue("dl-taker-stalls", reserve_delay=1.0)
        held, old = await _held_unrenewed(old_q)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(old._storage, "insert_buckets", _raising(aio_keuss.BackendError("died")))
            with pytest.raises(aio_keuss.BackendError):
                await old_q.ko(held)  # stored as on its way, the copy not written
        await _lease_lapsed(old)
        taker_q = await second.queue("dl-taker-stalls", reserve_delay=1.0)
        taker = taker_q._store  # type: ignore[attr-defined]
        with _copies_held(taker) as reached:
            taking = asyncio.create_task(taker_q.reserve(timeout=0))
            await asyncio.wait_for(reached.wait(), 10)  # taken over, its copy on its way
            await _stop_renewing(taker)
            last_q = await third.queue("dl-taker-stalls", reserve_delay=1.0)
            assert await last_q.reserve(timeout=0) is None  # taken over, finished
        assert await taking is None
        dead = await _take_all(await third.queue("__deadletter__"), idle=0.5)
        assert [m.payload for m in dead] == ["m"]
        assert await last_q.total_size() == 0
        assert (await last_q.stats())["deadletter"] == 1


async def test_a_deadletter_copy_that_keeps_failing_does_not_keep_the_bucket(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """A holder died with a slot on its way; the process that took the bucket over (here for
    a remove, which finds that slot not removable) cannot write the copy (its deadletter
    queue refuses it, every time). It held the bucket for ever, retrying at every state
    flush: the bucket's other message was never delivered anywhere else. Now a failed copy
    is retried with backoff, and the bucket is kept only as it would be without that slot:
    given back, another process finishes the move and delivers the rest."""
    case, options = bucket_case
    extra = {"deadletter": {"max_ko": 1}}
    async with (
        aio_keuss.connect(case.name, **options, **extra) as first,
        aio_keuss.connect(case.name, **options, **extra) as second,
        aio_keuss.connect(case.name, **options, **extra) as third,
    ):
        old_q = await first.queue("dl-keeps-failing", reserve_delay=1.0)
        await old_q.push_many(["later", "poison"])  # one bucket
        got = await old_q.reserve_many(2, timeout=5)
        poison = next(m for m in got if m.payload == "poison")
        assert await old_q.ko(poison) == KoResult.ROLLED_BACK
        again = await old_q.reserve(timeout=5)
        assert again is not None and again.payload == "poison"
        old = old_q._store  # type: ignore[attr-defined]
        await _stop_renewing(old)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(old._storage, "insert_buckets", _raising(aio_keuss.BackendError("died")))
            with pytest.raises(aio_keuss.BackendError):
                await old_q.ko(again)  # stored as on its way, the copy not written
        await _lease_lapsed(old)
        taker = await second.queue("dl-keeps-failing", reserve_delay=1.0)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                taker._store._storage,  # type: ignore[attr-defined]
                "insert_buckets",
                _raising(aio_keuss.BackendError("refused")),
            )
            assert await taker.remove(again.id) is False  # on its way; the copy failed
            last = await third.queue("dl-keeps-failing", reserve_delay=1.0)
            later = await last.reserve(timeout=60)  # its lease deadline, or a poll
            assert later is not None and later.payload == "later"
            assert await last.ok(later) is True
        dead = await _take_all(await third.queue("__deadletter__"), idle=0.5)
        assert [m.payload for m in dead] == ["poison"]
        assert await last.total_size() == 0
        assert (await last.stats())["deadletter"] == 1


async def test_a_deadletter_ko_whose_mark_fails_to_be_written_is_counted_once_it_is(
    bucket_case: tuple[BackendCase, dict[str, Any]],
) -> None:
    """The copy landed, the write of the done mark failed (the server erroring on it): the
    ko fails and counted nothing, and the next state write stored the mark: the move was
    counted by nobody. Now the write that stores the mark counts it."""
    case, options = bucket_case
    async with aio_keuss.connect(case.name, **options, deadletter={"max_ko": 0}) as factory:
        q, held = await _poison_held(factory, "dl-mark-fails")
        store = q._store  # type: ignore[attr-defined]
        insert, write = store._storage.insert_buckets, store._storage.write
        copied: list[bool] = []

        async def copy(*args: Any, **kwargs: Any) -> Any:
            result = await insert(*args, **kwargs)
            copied.append(True)
            return result

        async def mark(*args: Any, **kwargs: Any) -> Any:
            if copied:  # the mark's write, once
                copied.clear()
                raise aio_keuss.BackendError("the mark's write failed")
            return await write(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(store._storage, "insert_buckets", copy)
            patch.setattr(store._storage, "write", mark)
            with pytest.raises(aio_keuss.BackendError):
                await q.ko(held)
        await q.drain()  # the state write that stores the mark
        got = await _take_all(await factory.queue("__deadletter__"), idle=0.5)
        assert [m.payload for m in got] == ["poison"]
        assert await q.total_size() == 0
        assert (await q.stats())["deadletter"] == 1
