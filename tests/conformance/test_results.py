"""Conformance: results. A queue opened with ``result_ttl`` keeps what its handlers returned
(or why a message failed for good) for that long, readable from any process through
``Queue.result`` and awaited by ``Queue.push_and_wait`` (arq's ``Job.result``, BullMQ's
``Job.waitUntilFinished``).

Every backend runs it: those without ``capabilities.results`` refuse a ``result_ttl`` (at
connect, or when the queue opens) before anything is written, and the rest is skipped
there. Nothing here times the backend: waits that must end have generous hang guards, and
expiry is asserted only as happening eventually.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import Connect, needs
from polling import until

import aio_keuss
import aio_keuss.queue
from aio_keuss import (
    JobFailedError,
    JobResult,
    Message,
    ResultMissingError,
    ResultTimeoutError,
)
from aio_keuss.results import ResultStore, leave_space

pytestmark = pytest.mark.timeout(120)

GUARD = 30.0
"""Hang guard of a wait that must end."""
TTL = 600.0
"""A result_ttl no test outlives."""


async def _results_factory(connect: Connect, **options: Any) -> aio_keuss.Factory:
    factory = await connect(**{"poll_interval": 60.0, **options})
    needs(factory, "results")
    return factory


async def _reserve_all(q: aio_keuss.Queue, n: int) -> list[Message]:
    """``n`` reservations, however many each take hands over (a bucket store's pushes are
    visible once flushed, a sharded queue's spread over shards)."""
    held: list[Message] = []
    while len(held) < n:
        held += await q.reserve_many(n - len(held), timeout=GUARD)
    return held


async def _store_of(factory: aio_keuss.Factory) -> ResultStore:
    """The factory's result store, as its queues reach it."""
    return await factory._results.get()


# options and capability -------------------------------------------------------------------


async def test_result_ttl_is_refused_where_the_backend_keeps_no_results(connect: Connect) -> None:
    factory = await connect()
    if factory.capabilities.results:
        pytest.skip("this backend keeps results")
    with pytest.raises(aio_keuss.ConfigError, match="result_ttl"):
        await factory.queue("q1", result_ttl=5)
    with pytest.raises(aio_keuss.ConfigError, match="result_ttl"):
        await connect(result_ttl=5)
    q = await factory.queue("q1")
    with pytest.raises(aio_keuss.NotSupportedError):
        await q.result("some-id")
    with pytest.raises(aio_keuss.NotSupportedError):
        await q.push_and_wait(1, timeout=1)
    assert (await q.sizes()).total == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), 1e10, "5", True])
async def test_a_bad_result_ttl_is_a_config_error(connect: Connect, bad: object) -> None:
    factory = await connect()
    with pytest.raises(aio_keuss.ConfigError):
        await factory.queue("q1", result_ttl=bad)


async def test_result_ttl_is_recorded_with_the_other_options(connect: Connect) -> None:
    factory = await _results_factory(connect)
    await factory.queue("q1", result_ttl=30)
    assert (await factory.list())["q1"]["result_ttl"] == 30


async def test_push_and_wait_needs_a_result_ttl_before_it_pushes(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1")
    with pytest.raises(aio_keuss.ConfigError, match="result_ttl"):
        await q.push_and_wait({"a": 1}, timeout=1)
    message = await q.push(1)
    if factory.capabilities.reserve:  # else ok is refused as not supported, first
        with pytest.raises(aio_keuss.ConfigError, match="result_ttl"):
            await q.ok(message, result=1)
    assert (await q.sizes()).total == 1  # only the push of this test


# results after consuming ------------------------------------------------------------------


async def test_a_handler_value_is_kept_and_read_back(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    message_id = await q.push({"n": 21})
    assert await q.result(message_id) is None  # not handled yet: looked once

    async def handler(message: Message) -> dict[str, Any]:
        return {"double": message.payload["n"] * 2, "raw": None}

    async with q.consume(handler):
        found = await q.result(message_id, timeout=GUARD)
    assert isinstance(found, JobResult)
    assert found == JobResult(message_id, True, {"double": 42, "raw": None}, None, found.finished)
    assert found.finished.tzinfo is not None
    assert await q.result(message_id) == found  # kept: read again at once


async def test_push_and_wait_returns_the_handler_value(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    async with q.consume(lambda m: m.payload.upper()):
        assert await q.push_and_wait("hello", timeout=GUARD) == "HELLO"
        assert await q.push_and_wait(b"\x00bytes", timeout=GUARD) == b"\x00BYTES"


async def test_none_is_a_result(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    async with q.consume(lambda m: None):
        assert await q.push_and_wait(1, timeout=GUARD) is None


async def test_push_and_wait_across_two_factories(connect: Connect) -> None:
    """Two processes' worth: the waiter's factory and the consumer's share only the backend."""
    waiter = await _results_factory(connect)
    needs(waiter, "shared")
    worker = await connect(poll_interval=60.0)
    asking = await waiter.queue("q1", result_ttl=TTL)
    serving = await worker.queue("q1", result_ttl=TTL)
    async with serving.consume(lambda m: m.payload + 1, concurrency=2):
        got = await asyncio.gather(
            *(asyncio.wait_for(asking.push_and_wait(n), GUARD) for n in range(10))
        )
    assert got == list(range(1, 11))
    # a reader with no result_ttl of its own reads them too
    reader = await (await connect()).queue("q1")
    message_id = await asking.push(41)
    async with serving.consume(lambda m: m.payload + 1):
        found = await reader.result(message_id, timeout=GUARD)
    assert found is not None and found.value == 42


async def test_a_batch_handler_value_is_each_message_result(connect: Connect) -> None:
    factory = await _results_factory(connect, max_wait_time=0.2)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")
    ids = await q.push_many([1, 2, 3])

    async def handler(messages: list[Message]) -> int:
        return sum(m.payload for m in messages)

    seen: list[JobResult | None] = []
    async with q.consume(handler, batch=3):
        for message_id in ids:
            seen.append(await q.result(message_id, timeout=GUARD))
    values = [found.value for found in seen if found is not None]
    assert len(values) == 3 and len(set(values)) == 1  # the one value of one batch...
    assert values[0] in (1, 2, 3, 3, 5, 6)  # ... or of its first messages, gathered first


async def test_a_value_that_cannot_be_stored_still_oks_the_message(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")
    with caplog.at_level(logging.WARNING, "aio_keuss.queue"):
        async with q.consume(lambda m: object()):
            with pytest.raises(JobFailedError, match="not storable") as raised:
                await q.push_and_wait(1, timeout=GUARD)
    assert raised.value.error is not None and "not storable" in raised.value.error
    assert (await q.sizes()).total == 0  # ok-ed: the work is done
    assert "not storable" in caplog.text


TOO_LARGE = 16 * 2**20
"""Bytes no MongoDB document holds (MongoDB manual, "MongoDB Limits and Thresholds")."""


async def test_a_value_too_large_to_keep_still_oks_the_message(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    """Encodable, but more than the store keeps: as for a value that cannot be encoded,
    the message is ok-ed (a retry would redo the work, and fail alike for ever) and a
    failure saying so is kept; an ``ok(result=...)`` of such a value is refused before
    anything is written, and a concurrent ok's result is not lost with it."""
    factory = await _results_factory(connect, max_wait_time=0.2)
    if "mongo" not in factory.backend_name:
        pytest.skip("only MongoDB bounds the size of a result")
    q = await factory.queue("q1", result_ttl=TTL)
    with caplog.at_level(logging.WARNING, "aio_keuss.queue"):
        async with q.consume(lambda m: b"x" * TOO_LARGE if m.payload else 1):
            with pytest.raises(JobFailedError, match="not storable") as raised:
                await q.push_and_wait(True, timeout=GUARD)
            assert await q.push_and_wait(False, timeout=GUARD) == 1
    assert raised.value.error is not None and "not storable" in raised.value.error
    assert (await q.sizes()).total == 0
    ids = await q.push_many([1, 2])
    big, small = sorted(await _reserve_all(q, 2), key=lambda m: m.payload)
    too_big = q.ok(big, result=b"x" * TOO_LARGE)
    fine = q.ok(small, result="fine")
    done = await asyncio.gather(too_big, fine, return_exceptions=True)
    assert isinstance(done[0], aio_keuss.InvalidPayloadError)
    assert done[1] is True
    assert await q.result(ids[0]) is None
    found = await q.result(ids[1])
    assert found is not None and found.value == "fine"


async def test_a_popped_message_whose_handler_is_cut_short_keeps_a_failure(
    connect: Connect,
) -> None:
    """A consumer stopped past its grace cancels its handlers; a reserved message goes
    back, but a popped one is gone for good: its failure is kept, as a deadlettered
    message's is, so that its waiters do not wait for ever."""
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    if q.capabilities.reserve:
        pytest.skip("a reserved message goes back: it may still finish")
    started = asyncio.Event()

    async def handler(message: Message) -> None:
        started.set()
        await asyncio.sleep(3600)

    consumer = q.consume(handler)
    message_id = await q.push(1)
    await asyncio.wait_for(started.wait(), GUARD)
    await consumer.stop(grace=0.05)
    assert (await q.sizes()).total == 0  # gone, not put back
    found = await q.result(message_id, timeout=GUARD)
    assert found is not None and found.ok is False
    assert found.error is not None and "cancelled" in found.error


async def test_ok_with_a_result_and_ok_many_with_results(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")
    ids = await q.push_many([0, 1, 2])
    one, *two = await _reserve_all(q, 3)
    assert await q.ok(one, result=[1, "two"])
    assert await q.ok_many(two, results=["a", b"b"]) == [True, True]
    expected = {one.id: [1, "two"], two[0].id: "a", two[1].id: b"b"}
    for message_id in ids:
        found = await q.result(message_id)
        assert found is not None and found.value == expected[message_id]


async def test_bad_results_are_refused_before_anything_is_written(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")
    await q.push_many([1, 2])
    held = await _reserve_all(q, 2)
    with pytest.raises(aio_keuss.InvalidPayloadError):
        await q.ok(held[0], result={1, 2})
    with pytest.raises(aio_keuss.InvalidPayloadError):
        await q.ok_many(held, results=[1, float("nan")])
    with pytest.raises(aio_keuss.InvalidInputError):
        await q.ok_many(held, results=[1])
    with pytest.raises(aio_keuss.InvalidInputError):
        await q.ko(held[0], error=42)  # type: ignore[arg-type]
    assert (await q.sizes()).reserved == 2  # no ok, no ko went through
    assert [await q.result(m) for m in held] == [None, None]


async def test_a_ko_error_that_is_not_utf8_is_refused_before_the_deadletter(
    connect: Connect,
) -> None:
    """A lone surrogate in ``error`` cannot be kept (JSON is UTF-8): it was found only once
    the ko had deadlettered the message, and raised orjson's raw TypeError."""
    factory = await _results_factory(connect, deadletter={"max_ko": 0})
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")
    await q.push_many([1, 2])
    held = await _reserve_all(q, 2)
    with pytest.raises(aio_keuss.InvalidInputError):
        await q.ko(held[0], error="bad \ud800 input")
    assert (await q.sizes()).reserved == 2  # the ko did not go through
    assert [await q.result(m) for m in held] == [None, None]


# failures ---------------------------------------------------------------------------------


async def test_a_final_handler_failure_is_kept(connect: Connect) -> None:
    factory = await _results_factory(connect, deadletter={"max_ko": 1})
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")

    def handler(message: Message) -> None:
        raise ValueError(f"boom {message.tries}")

    async with q.consume(handler, retry_delay=0.01, max_retry_delay=0.01):
        with pytest.raises(JobFailedError) as raised:
            await q.push_and_wait(1, timeout=GUARD)
    assert raised.value.error == "ValueError: boom 1"  # its last try's exception
    assert raised.value.id is not None


async def test_a_final_handler_failure_with_a_lone_surrogate_is_kept(connect: Connect) -> None:
    """An exception's message may hold a lone surrogate (a file name decoded with
    ``surrogateescape``): its final ko must still go through and keep a failure."""
    factory = await _results_factory(connect, deadletter={"max_ko": 0})
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")

    def handler(message: Message) -> None:
        raise ValueError("no file b\udcff")

    # the handler's failure is logged as it is: no capture of that may reach a pytest-xdist
    # report, which cannot carry a lone surrogate
    logging.disable(logging.CRITICAL)
    try:
        async with q.consume(handler, retry_delay=0.01, max_retry_delay=0.01):
            with pytest.raises(JobFailedError) as raised:
                await q.push_and_wait(1, timeout=GUARD)
    finally:
        logging.disable(logging.NOTSET)
    assert raised.value.error == "ValueError: no file b\\udcff"
    assert (await q.sizes()).total == 0  # deadlettered, not left reserved


async def test_a_ko_that_deadletters_keeps_a_failure(connect: Connect) -> None:
    factory = await _results_factory(connect, deadletter={"max_ko": 0})
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")
    first, second = await q.push_many([1, 2])
    held = await _reserve_all(q, 2)
    by_id = {m.id: m for m in held}
    assert await q.ko(by_id[first], error="bad input") is aio_keuss.KoResult.DEADLETTERED
    assert await q.ko(by_id[second]) is aio_keuss.KoResult.DEADLETTERED
    one, two = await q.result(first), await q.result(second)
    assert one is not None and (one.ok, one.value, one.error) == (False, None, "bad input")
    assert two is not None and two.ok is False and two.error == "failed after 1 deliveries"


async def test_a_ko_that_rolls_back_keeps_nothing(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")
    message_id = await q.push(1)
    message = await q.reserve(timeout=GUARD)
    assert message is not None
    assert await q.ko(message, delay=0, error="later") is aio_keuss.KoResult.ROLLED_BACK
    assert await q.result(message_id) is None


async def test_a_removed_message_fails_its_waiters(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "remove")
    message_id = await q.push(1, delay=3600 if q.capabilities.delay else 0.0)
    waiting = asyncio.ensure_future(q.result(message_id, timeout=GUARD))
    await asyncio.sleep(0)

    async def removed() -> bool:  # (a bucket store's push is visible once flushed)
        return await q.remove(message_id)

    await until(removed, GUARD)
    found = await waiting
    assert found is not None and (found.ok, found.error) == (False, "removed")
    assert not await q.remove(message_id)  # nothing removed: the result stays as it was


# waiting ----------------------------------------------------------------------------------


async def test_a_short_wait_still_finds_a_result_already_kept(connect: Connect) -> None:
    """A wait looks at least once, however short its timeout (shorter than a round trip):
    else it read None for a result that a look (``timeout=0``) finds."""
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")
    message_id = await q.push(1)
    (held,) = await _reserve_all(q, 1)
    await q.ok(held, result="kept")
    assert await q.result(message_id, timeout=1e-6) is not None
    found = await q.result(message_id, timeout=1e-6)  # a wait of its own, the task idle
    assert found is not None and found.value == "kept"


async def test_a_timeout_leaves_the_message_queued(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    with pytest.raises(ResultTimeoutError) as raised:
        await q.push_and_wait({"a": 1}, timeout=0.2)
    assert isinstance(raised.value, TimeoutError)
    assert isinstance(raised.value, aio_keuss.KeussError)
    assert (await q.sizes()).total == 1
    assert await q.result(raised.value.id, timeout=0.05) is None


async def test_results_expire(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=0.05)
    needs(q, "reserve")
    message_id = await q.push(1)
    message = await q.reserve(timeout=GUARD)
    assert message is not None
    await q.ok(message, result="short-lived")

    async def gone() -> bool:
        return await q.result(message_id) is None

    await until(gone, GUARD)


# an id pushed again: joining the first message -------------------------------------------


def _tells_finished(q: aio_keuss.Queue) -> bool:
    """Whether the queue can tell a finished message from a waiting or running one: it keeps
    a message until its ok (reserve) and can look it up (peek, or a sharded store's look in
    the id index of the message's shard)."""
    return q.capabilities.reserve and (q.capabilities.peek or q._store.tells_queued)


def _needs_telling_finished(q: aio_keuss.Queue) -> None:
    needs(q, "idempotent")
    if not _tells_finished(q):
        pytest.skip("this backend cannot tell a finished message")


async def _note_looks(factory: aio_keuss.Factory) -> set[str]:
    """The ids the factory's result store is asked for from now on: a waiter's push is
    done once its id is asked for (nothing else tells a caller's push was refused)."""
    store = await _store_of(factory)
    looked: set[str] = set()
    get = store.get

    async def noted(queue: str, ids: Sequence[str]) -> list[bytes | None]:
        looked.update(ids)
        return await get(queue, ids)

    store.get = noted  # type: ignore[method-assign]
    return looked


async def test_a_duplicate_push_and_wait_gets_the_first_message_value(connect: Connect) -> None:
    """An id still queued is not queued again: the second caller waits for the first
    message's result (a job id enqueued twice runs once, as in arq and BullMQ)."""
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "idempotent", "reserve")
    looked = await _note_looks(factory)
    await q.push("first", id="job-1")
    (held,) = await _reserve_all(q, 1)  # taken, not finished: still in the queue
    joining = asyncio.ensure_future(q.push_and_wait("second", id="job-1", timeout=GUARD))

    async def waiting() -> bool:
        return joining.done() or "job-1" in looked

    await until(waiting, GUARD)
    assert not joining.done()  # the first message is still there: its result may come
    assert await q.ok(held, result=held.payload.upper())
    assert await asyncio.wait_for(joining, GUARD) == "FIRST"
    assert (await q.sizes()).total == 0  # the second push queued nothing


async def test_a_joiner_of_a_held_message_that_then_finishes_with_no_result_is_told(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The joiner found the earlier message still queued (held by a consumer) and waits;
    that message then finishes with no result kept (an ok without one): none can come, so
    the joiner, looking again where the message is each poll interval, is told so rather
    than left waiting for ever (no timeout given)."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)
    factory = await _results_factory(connect, poll_interval=0.2)
    q = await factory.queue("q1", result_ttl=TTL)
    _needs_telling_finished(q)
    looked = await _note_looks(factory)
    await q.push(1, id="job-1")
    (held,) = await _reserve_all(q, 1)
    joining = asyncio.ensure_future(q.push_and_wait(2, id="job-1"))  # timeout=None

    async def waiting() -> bool:
        return joining.done() or "job-1" in looked

    await until(waiting, GUARD)
    assert not joining.done()
    assert await q.ok(held)  # no result kept
    with pytest.raises(ResultMissingError):
        await asyncio.wait_for(joining, GUARD)


@pytest.mark.parametrize("kept", ["nothing", "an expired result"])
async def test_a_duplicate_push_and_wait_of_a_finished_message_with_no_result_raises(
    connect: Connect, kept: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first message finished and its result is gone (never kept, or expired): no
    result can come, and the waiter is told so once the grace for a failure kept just
    after a removal has passed (made short here), whatever its timeout beyond it (arq's
    ``ResultNotFound``), where the backend keeps a message until its ok."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)
    factory = await _results_factory(connect)
    expiring = kept == "an expired result"
    q = await factory.queue("q1", result_ttl=0.05 if expiring else TTL)
    _needs_telling_finished(q)
    await q.push(1, id="job-1")
    (held,) = await _reserve_all(q, 1)
    if expiring:
        assert await q.ok(held, result="short-lived")

        async def gone() -> bool:
            return await q.result("job-1") is None

        await until(gone, GUARD)
    else:
        assert await q.ok(held)  # no result kept
    with pytest.raises(ResultMissingError) as raised:
        await asyncio.wait_for(q.push_and_wait(2, id="job-1"), GUARD)  # timeout=None
    assert raised.value.id == "job-1"
    assert isinstance(raised.value, aio_keuss.KeussError)
    assert (await q.sizes()).total == 0  # refused as a duplicate: nothing queued
    with pytest.raises(ResultMissingError):
        await asyncio.wait_for(q.push_and_wait(2, id="job-1", timeout=GUARD), GUARD)
    # A timeout within the grace ends the wait first: a failure might still have come.
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", GUARD)
    with pytest.raises(ResultTimeoutError):
        await asyncio.wait_for(q.push_and_wait(2, id="job-1", timeout=0.05), GUARD)


class _HeldPut:
    """The factory's result store with the puts of one id held back: ``entered`` is set once
    one began (the message has left, its failure is being kept), and each waits for
    ``release``; the looks of that id that returned are counted in ``looks``."""

    def __init__(self, store: ResultStore, queue: str, message_id: str) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.looks = 0
        put, get = store.put, store.get

        async def held_put(space: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
            if space == queue and any(i == message_id for i, _ in results):
                self.entered.set()
                await self.release.wait()
            await put(space, results, ttl)

        async def counted_get(space: str, ids: Sequence[str]) -> list[bytes | None]:
            found = await get(space, ids)
            if space == queue and message_id in ids:
                self.looks += 1
            return found

        store.put = held_put  # type: ignore[method-assign]
        store.get = counted_get  # type: ignore[method-assign]


async def _join_while_held(q: aio_keuss.Queue, held: _HeldPut, leaving: Any) -> Any:
    """A duplicate push_and_wait of ``job-1`` made while its message has left the queue
    (``leaving``, its remove, cancel or ko, is out) and its failure result is not yet kept:
    the failure is let through once the joiner has looked for the result twice (before
    and after finding the message gone), and the joiner's outcome returned."""
    await asyncio.wait_for(held.entered.wait(), GUARD)
    joining = asyncio.ensure_future(q.push_and_wait(2, id="job-1", timeout=GUARD))

    async def looked_twice() -> bool:
        return joining.done() or held.looks >= 2

    await until(looked_twice, GUARD)
    held.release.set()
    await asyncio.wait_for(leaving, GUARD)
    return await asyncio.wait_for(joining, GUARD)


@pytest.mark.parametrize("how", ["remove", "cancel"])
async def test_a_duplicate_push_and_wait_of_a_message_just_removed_fails_with_it(
    connect: Connect, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remove (or a cancel that removes) keeps the message's failure just after the
    message left: a duplicate that finds it gone before that failure is kept waits for it
    (a bounded grace, made long here) and fails with it, not with ResultMissingError."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", GUARD)
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    _needs_telling_finished(q)
    needs(q, "remove")
    await q.push(1, id="job-1", delay=3600 if q.capabilities.delay else 0.0)
    held = _HeldPut(await _store_of(factory), "q1", "job-1")
    leaving = asyncio.ensure_future(q.remove("job-1") if how == "remove" else q.cancel("job-1"))
    with pytest.raises(JobFailedError) as raised:
        await _join_while_held(q, held, leaving)
    assert raised.value.error == ("removed" if how == "remove" else "cancelled")
    assert leaving.result() in (True, aio_keuss.CancelResult.REMOVED)


async def test_a_duplicate_push_and_wait_of_a_message_just_deadlettered_fails_with_it(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ko that deadletters keeps the failure once the message moved: a duplicate that
    finds it gone in between waits for that failure (see the remove case above)."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", GUARD)
    factory = await _results_factory(connect, deadletter={"max_ko": 0})
    q = await factory.queue("q1", result_ttl=TTL)
    _needs_telling_finished(q)
    await q.push(1, id="job-1")
    (message,) = await _reserve_all(q, 1)
    held = _HeldPut(await _store_of(factory), "q1", "job-1")
    leaving = asyncio.ensure_future(q.ko(message, error="bad input"))
    with pytest.raises(JobFailedError) as raised:
        await _join_while_held(q, held, leaving)
    assert raised.value.error == "bad input"
    assert leaving.result() is aio_keuss.KoResult.DEADLETTERED


@pytest.mark.parametrize("how", ["remove", "cancel", "deadletter"])
async def test_a_duplicate_push_and_wait_gets_a_failure_kept_past_the_grace(
    connect: Connect, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remover (or a ko that deadletters) that keeps the failure later than the grace
    after the message left (a stalled process) still has it reach a duplicate that found
    the message gone: the note it left before the message left tells the joiner a failure
    is on its way. Ordered by events: the failure is let through only once the joiner,
    past its grace (made short here), asked for that note."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)
    deadletters = how == "deadletter"
    factory = await _results_factory(
        connect, **({"deadletter": {"max_ko": 0}} if deadletters else {})
    )
    q = await factory.queue("q1", result_ttl=TTL)
    _needs_telling_finished(q)
    if deadletters:
        await q.push(1, id="job-1")
        (message,) = await _reserve_all(q, 1)
    else:
        needs(q, "remove")
        await q.push(1, id="job-1", delay=3600 if q.capabilities.delay else 0.0)
    store = await _store_of(factory)
    held = _HeldPut(store, "q1", "job-1")
    noted = 0
    get = store.get

    async def counted_get(space: str, ids: Sequence[str]) -> list[bytes | None]:
        nonlocal noted
        found = await get(space, ids)
        noted += space == leave_space("q1") and "job-1" in ids
        return found

    store.get = counted_get  # type: ignore[method-assign]
    if deadletters:
        leaving = asyncio.ensure_future(q.ko(message, error="bad input"))
    else:
        leaving = asyncio.ensure_future(q.remove("job-1") if how == "remove" else q.cancel("job-1"))
    try:
        await asyncio.wait_for(held.entered.wait(), GUARD)  # gone, its failure not kept
        joining = asyncio.ensure_future(q.push_and_wait(2, id="job-1", timeout=GUARD))

        async def past_the_grace() -> bool:
            return joining.done() or noted >= 1

        await until(past_the_grace, GUARD)
        held.release.set()
        with pytest.raises(JobFailedError) as raised:
            await asyncio.wait_for(joining, GUARD)
    finally:
        held.release.set()
    expected = {"remove": "removed", "cancel": "cancelled", "deadletter": "bad input"}[how]
    assert raised.value.error == expected
    assert await asyncio.wait_for(leaving, GUARD) in (
        True,
        aio_keuss.CancelResult.REMOVED,
        aio_keuss.KoResult.DEADLETTERED,
    )


@pytest.mark.parametrize("how", ["remove", "cancel", "deadletter"])
async def test_no_leave_note_is_written_where_no_duplicate_can_read_it(
    connect: Connect, how: str
) -> None:
    """The note a remove (or a ko that may deadletter) leaves for a duplicate
    ``push_and_wait`` is one write more on its path: written only where such a duplicate
    can be and can read it (idempotent ids, and a message found gone: reserve with peek,
    or a store that tells). The bucket backends (no idempotent ids) wrote it on every
    remove, cancel and last ko for nobody."""
    deadletters = how == "deadletter"
    factory = await _results_factory(
        connect, **({"deadletter": {"max_ko": 0}} if deadletters else {})
    )
    q = await factory.queue("q1", result_ttl=TTL)
    if q.capabilities.idempotent and _tells_finished(q):
        pytest.skip("a duplicate push_and_wait reads the note here")
    needs(q, "reserve" if deadletters else "remove")
    message_id = await q.push(1, delay=0.0 if deadletters or not q.capabilities.delay else 3600)
    if deadletters:
        (message,) = await _reserve_all(q, 1)
        assert await q.ko(message, error="bad input") is aio_keuss.KoResult.DEADLETTERED
    elif how == "remove":
        await q.remove(message_id)  # (found or not: the note came before)
    else:
        await q.cancel(message_id)
    store = await _store_of(factory)
    assert await store.get(leave_space("q1"), [message_id]) == [None]


async def test_a_duplicate_push_and_wait_of_a_finished_message_gets_its_kept_result(
    connect: Connect,
) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "idempotent", "reserve")
    await q.push(1, id="job-1")
    (held,) = await _reserve_all(q, 1)
    assert await q.ok(held, result="done")
    assert await asyncio.wait_for(q.push_and_wait(2, id="job-1"), GUARD) == "done"


async def test_a_duplicate_push_and_wait_waits_where_the_backend_cannot_tell(
    connect: Connect,
) -> None:
    """Without reserve and peek a finished message cannot be told from one whose handler
    still runs (a popped message is out of the store): the waiter waits, as for any
    result, up to its timeout."""
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "idempotent")
    if _tells_finished(q):
        pytest.skip("this backend can tell a finished message")
    await q.push(1, id="job-1")
    if q.capabilities.reserve:  # finished, no result kept
        (held,) = await _reserve_all(q, 1)
        assert await q.ok(held)
    else:  # out of the store, as while a consumer's handler runs
        assert await q.pop(timeout=GUARD) is not None
    with pytest.raises(ResultTimeoutError):
        await q.push_and_wait(2, id="job-1", timeout=0.2)


async def test_a_lost_signal_costs_only_the_poll_interval(connect: Connect) -> None:
    """The consumer's factory announces nothing: the waiter finds the result on its poll."""
    waiter = await _results_factory(connect, poll_interval=0.2)
    q = await waiter.queue("q1", result_ttl=TTL)
    silent = waiter
    if waiter.capabilities.shared:
        silent = await connect(poll_interval=60.0)
    silent.signal.results = lambda queue, ids: None  # type: ignore[method-assign]
    serving = await silent.queue("q1", result_ttl=TTL)
    async with serving.consume(lambda m: m.payload * 3):
        assert await q.push_and_wait(3, timeout=GUARD) == 9


async def test_concurrent_waiters_share_round_trips(connect: Connect) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    needs(q, "reserve")
    store = await _store_of(factory)
    calls: list[int] = []
    get = store.get

    async def counted(queue: str, ids: Sequence[str]) -> list[bytes | None]:
        calls.append(len(ids))
        return await get(queue, ids)

    store.get = counted  # type: ignore[method-assign]
    ids = await q.push_many(list(range(50)))
    waits = [asyncio.ensure_future(q.result(i, timeout=GUARD)) for i in ids]
    held = await _reserve_all(q, 50)
    await q.ok_many(held, results=[m.payload for m in held])
    found = await asyncio.gather(*waits)
    assert sorted(f.value for f in found if f is not None) == list(range(50))
    assert max(calls) == 50  # every id waited for, in one get
    assert len(calls) <= 5  # not one get per waiter


async def test_an_undecodable_result_is_a_failure_not_an_exception(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    factory = await _results_factory(connect)
    q = await factory.queue("q1", result_ttl=TTL)
    store = await _store_of(factory)
    await store.put("q1", [("alien", b"\xff not ours")], TTL)
    with caplog.at_level(logging.WARNING, "aio_keuss.queue"):
        found = await q.result("alien")
    assert found is not None and found.ok is False
    assert found.error is not None and "could not be read" in found.error
    assert "alien" in caplog.text


async def test_a_pipeline_station_keeps_no_result(connect: Connect) -> None:
    factory = await _results_factory(connect)
    needs(factory, "move")
    done = asyncio.Event()

    async def store(message: Message) -> None:  # None: kept, it would read as a result
        done.set()

    pipeline = factory.pipeline("p", queue_options={"incoming": {"result_ttl": TTL}}).sink(
        "incoming", store
    )
    incoming = await factory.queue("incoming", result_ttl=TTL)
    message_id = await incoming.push(1)
    async with pipeline.run():
        await asyncio.wait_for(done.wait(), GUARD)

        async def handled() -> bool:
            return (await incoming.sizes()).total == 0

        await until(handled, GUARD)
    assert await incoming.result(message_id) is None
