"""The queue layer's part of results, on the memory backend: the body encoding, the routing
of "result" signals, the factory's store (made once, closed with it), a backend without
results, closing under a waiter, the sync shim, the worker setting and the admin command."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import pickle
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson
import pytest
from polling import until

import aio_keuss
import aio_keuss.queue
from aio_keuss import Message, sync
from aio_keuss.contract import Backend
from aio_keuss.factory import Factory, check_results
from aio_keuss.memory import MemoryBackend
from aio_keuss.options import QueueOptions
from aio_keuss.outcomes import (
    MAX_ERROR_CHARS,
    decode_result,
    encode_failure,
    encode_success,
    exception_text,
)
from aio_keuss.results import MemoryResults, ResultStore
from aio_keuss.signal import MAX_SIGNAL_IDS, RESULTS_ROUTE, LocalSignalBus, Signal, SignalBus
from aio_keuss.stats import MemoryStats
from aio_keuss.worker import admin
from aio_keuss.worker.settings import resolve

pytestmark = pytest.mark.timeout(60)

GUARD = 30.0


# encoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, 0, "text", b"\x00\n\xff", {"a": [1, 2.5, None]}, []])
def test_a_success_round_trips(value: Any) -> None:
    found = decode_result("q", "id1", encode_success(value, 1_700_000_000.5))
    assert (found.id, found.ok, found.value, found.error) == ("id1", True, value, None)
    assert found.finished.timestamp() == 1_700_000_000.5
    assert found.finished.tzinfo is not None


def test_a_failure_round_trips_and_its_error_is_bounded() -> None:
    found = decode_result("q", "id1", encode_failure("x" * 5000))
    assert (found.ok, found.value) == (False, None)
    assert found.error is not None and len(found.error) == MAX_ERROR_CHARS


def test_an_unencodable_value_is_refused() -> None:
    with pytest.raises(aio_keuss.InvalidPayloadError):
        encode_success(object())


@pytest.mark.parametrize(
    "body",
    [b"", b"\xff", b"[]", b'{"ok": true}', b'{"ok": true, "error": null, "finished": 1}'],
)
def test_a_body_this_library_did_not_write_reads_as_a_failure(
    body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "aio_keuss.queue"):
        found = decode_result("q", "id1", body)
    assert found.ok is False and found.error is not None
    assert "could not be read" in found.error and "id1" in caplog.text


def test_exception_text_names_the_type_and_survives_a_broken_str() -> None:
    class Broken(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert exception_text(ValueError("boom")) == "ValueError: boom"
    assert exception_text(KeyError()) == "KeyError"
    assert exception_text(Broken()).startswith("Broken: ")


# signals ----------------------------------------------------------------------------------


class _Recording(SignalBus):
    """A bus whose transport records what it would send."""

    def __init__(self) -> None:
        super().__init__(debounce=0.0)
        self.sent: list[dict[str, Any]] = []

    async def _publish(self, payload: bytes) -> None:
        assert len(payload) <= 8000  # PostgreSQL's NOTIFY bound
        self.sent.append(orjson.loads(payload))


async def test_result_signals_reach_result_listeners_and_not_queue_listeners() -> None:
    bus = _Recording()
    heard: list[Signal] = []
    queue_heard: list[Signal] = []
    bus.subscribe_results("q1", heard.append)
    bus.subscribe("q1", queue_heard.append)
    bus.results("q1", ["a", "b"])
    await bus.published()
    assert [s.ids for s in heard] == [["a", "b"]] and not queue_heard
    (sent,) = bus.sent
    assert sent["k"] == "result" and sent["i"] == ["a", "b"]
    # a release that knows no results routes by the queue field: no queue is named so
    with pytest.raises(aio_keuss.InvalidQueueNameError):
        aio_keuss.options.check_queue_name(sent["q"])
    # another process's, received
    other = _Recording()
    got: list[Signal] = []
    other.subscribe_results("q1", got.append)
    other._receive(orjson.dumps(sent))
    assert [s.ids for s in got] == [["a", "b"]]
    await bus.close()
    await other.close()


async def test_many_or_long_ids_are_sent_without_ids() -> None:
    bus = _Recording()
    bus.results("q1", [str(n) for n in range(MAX_SIGNAL_IDS + 1)])
    bus.results("q1", ["x" * 1000] * 10)  # 10 kB of ids
    await bus.published()
    assert [("i" in sent) for sent in bus.sent] == [False, False]
    await bus.close()


async def test_a_malformed_ids_field_wakes_every_waiter() -> None:
    bus = _Recording()
    got: list[Signal] = []
    bus.subscribe_results("q1", got.append)
    payload = {"o": "elsewhere", "q": RESULTS_ROUTE + "q1", "k": "result", "i": [1, 2]}
    bus._receive(orjson.dumps(payload))
    assert [s.ids for s in got] == [None]
    await bus.close()


# the factory's store ----------------------------------------------------------------------


class _CountingResults(MemoryResults):
    def __init__(self) -> None:
        super().__init__()
        self.opened = self.closed = 0
        self.gets: list[int] = []

    async def open(self) -> None:
        self.opened += 1

    async def close(self) -> None:
        self.closed += 1

    async def get(self, queue: str, ids: Sequence[str]) -> list[bytes | None]:
        self.gets.append(len(ids))
        return await super().get(queue, ids)


class _CountingBackend(MemoryBackend):
    made: list[_CountingResults]

    def result_store(self) -> ResultStore:
        store = _CountingResults()
        self.made.append(store)
        return store


class _NoResultsBackend(MemoryBackend):
    """A backend whose database keeps no results."""

    capabilities = replace(MemoryBackend.capabilities, results=False)
    result_store = Backend.result_store  # type: ignore[assignment]


def _factory(backend: Backend, bus: SignalBus | None = None) -> Factory:
    return Factory(backend, bus or LocalSignalBus(), MemoryStats(), QueueOptions(), None)


async def test_the_store_is_made_once_when_first_needed_and_closed_with_the_factory() -> None:
    backend = _CountingBackend({})
    backend.made = []
    factory = _factory(backend)
    plain = await factory.queue("plain")
    assert backend.made == []  # no queue needs it yet
    assert await plain.result("x") is None  # a reader without result_ttl makes it
    await factory.queue("kept", result_ttl=60)
    await factory.queue("also", result_ttl=60)
    (store,) = backend.made
    assert store.opened == 1
    await factory.close()
    assert store.closed == 1


async def test_a_backend_without_results_refuses_them_before_anything_is_written() -> None:
    assert _NoResultsBackend.capabilities.results is False
    with pytest.raises(aio_keuss.ConfigError, match="result_ttl"):
        check_results(_NoResultsBackend)
    factory = _factory(_NoResultsBackend({}))
    with pytest.raises(aio_keuss.ConfigError, match="result_ttl"):
        await factory.queue("q1", result_ttl=5)
    assert "q1" not in await factory.list()
    q = await factory.queue("q1")
    with pytest.raises(aio_keuss.NotSupportedError):
        await q.result("x", timeout=1)
    with pytest.raises(aio_keuss.NotSupportedError):
        await q.push_and_wait(1)
    assert (await q.sizes()).total == 0
    await factory.close()


async def test_a_wait_ends_with_closed_error_when_its_queue_closes() -> None:
    factory = _factory(MemoryBackend({}))
    q = await factory.queue("q1", result_ttl=60)
    waiting = asyncio.ensure_future(q.result("never", timeout=GUARD))
    await asyncio.sleep(0.01)
    await q.close()
    with pytest.raises(aio_keuss.ClosedError):
        await waiting
    await factory.close()


async def test_many_waiters_of_one_queue_share_their_gets() -> None:
    backend = _CountingBackend({})
    backend.made = []
    factory = _factory(backend)
    q = await factory.queue("q1", result_ttl=60, poll_interval=60)
    ids = await q.push_many(list(range(100)))
    waits = [asyncio.ensure_future(q.result(i, timeout=GUARD)) for i in ids]
    held = await q.reserve_many(100, timeout=GUARD)
    await q.ok_many(held, results=[m.payload for m in held])
    found = await asyncio.gather(*waits)
    assert [f.value for f in found if f is not None] == list(range(100))
    (store,) = backend.made
    assert max(store.gets) == 100 and len(store.gets) <= 3
    await factory.close()


class _GetFailingOnce(MemoryResults):
    """A store whose first get fails, as one does while its server is away."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def get(self, queue: str, ids: Sequence[str]) -> list[bytes | None]:
        if not self.failed:
            self.failed = True
            raise aio_keuss.BackendError("server away")
        return await super().get(queue, ids)


class _GetFailingOnceBackend(MemoryBackend):
    def result_store(self) -> ResultStore:
        return _GetFailingOnce()


async def test_a_failed_look_fails_its_waits_and_not_the_later_ones() -> None:
    factory = _factory(_GetFailingOnceBackend({}))
    q = await factory.queue("q1", result_ttl=60, poll_interval=60)
    with pytest.raises(aio_keuss.BackendError, match="away"):
        await asyncio.wait_for(q.result("x", timeout=None), GUARD)
    async with q.consume(lambda m: m.payload * 2):  # the shared task still serves waits
        assert await asyncio.wait_for(q.push_and_wait(4), GUARD) == 8
    await factory.close()


async def test_a_cancelled_wait_leaves_the_others_sharing_its_round_trips() -> None:
    factory = _factory(MemoryBackend({}))
    q = await factory.queue("q1", result_ttl=60, poll_interval=60)
    message_id = await q.push(1)
    waits = [asyncio.ensure_future(q.result(message_id, timeout=None)) for _ in range(4)]
    await asyncio.sleep(0.01)
    waits[0].cancel()
    waits[2].cancel()
    (held,) = await q.reserve_many(1, timeout=GUARD)
    await q.ok(held, result="v")
    for wait in (waits[1], waits[3]):
        found = await asyncio.wait_for(wait, GUARD)
        assert found is not None and found.value == "v"
    await factory.close()


class _Deaf(LocalSignalBus):
    """Loses every result signal."""

    def results(self, queue: str, ids: Sequence[str]) -> None:
        pass


async def test_a_lost_result_signal_is_made_up_for_by_the_poll() -> None:
    factory = _factory(MemoryBackend({}), _Deaf())
    q = await factory.queue("q1", result_ttl=60, poll_interval=0.05)
    async with q.consume(lambda m: m.payload * 2):
        assert await q.push_and_wait(4, timeout=GUARD) == 8
    await factory.close()


async def test_a_joiner_in_its_grace_finds_a_failure_whose_signal_was_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A duplicate that found its earlier message just removed waits the grace for the
    failure kept after it; with that failure's signal lost and no poll due within the
    grace, the look at the grace's end still finds it: a lost signal costs latency only."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 5.0)
    factory = _factory(MemoryBackend({}), _Deaf())
    q = await factory.queue("q1", result_ttl=60, poll_interval=60)
    await q.push(1, id="job", delay=3600)
    store = await factory._results.get()
    entered, release, looked = asyncio.Event(), asyncio.Event(), asyncio.Event()
    looks = 0
    put, get = store.put, store.get

    async def held_put(space: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        if space == "q1":  # its failure (not the note before the remove)
            entered.set()
            await release.wait()
        await put(space, results, ttl)

    async def counted_get(space: str, ids: Sequence[str]) -> list[bytes | None]:
        nonlocal looks
        found = await get(space, ids)
        looks += "job" in ids
        if looks >= 2:  # looked before and after finding it gone
            looked.set()
        return found

    store.put = held_put  # type: ignore[method-assign]
    store.get = counted_get  # type: ignore[method-assign]
    removing = asyncio.ensure_future(q.remove("job"))
    await asyncio.wait_for(entered.wait(), GUARD)  # gone, its failure not kept yet
    joining = asyncio.ensure_future(q.push_and_wait(2, id="job", timeout=GUARD))
    await asyncio.wait_for(looked.wait(), GUARD)
    release.set()
    assert await asyncio.wait_for(removing, GUARD) is True
    with pytest.raises(aio_keuss.JobFailedError) as raised:
        await asyncio.wait_for(joining, GUARD)
    assert raised.value.error == "removed"
    await factory.close()


async def test_a_joiner_gets_the_failure_of_a_remover_that_keeps_it_past_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ordered by events, not time: the remover's put of the failure is held until the
    joiner has found the message gone, waited its grace and asked where it is again."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)
    factory = _factory(MemoryBackend({}))
    q = await factory.queue("q1", result_ttl=60, poll_interval=60)
    await q.push(1, id="job", delay=3600)
    store = await factory._results.get()
    entered, release, past_grace = asyncio.Event(), asyncio.Event(), asyncio.Event()
    put, still_queued, asked = store.put, q._still_queued, 0

    async def held_put(space: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        if space == "q1":  # its failure (not the note before the remove)
            entered.set()
            await release.wait()
        await put(space, results, ttl)

    async def counted(message_id: str) -> bool:
        nonlocal asked
        queued = await still_queued(message_id)
        asked += 1
        if asked == 2:  # on joining, then at the grace's end
            past_grace.set()
        return queued

    store.put = held_put  # type: ignore[method-assign]
    q._still_queued = counted  # type: ignore[method-assign]
    removing = asyncio.ensure_future(q.remove("job"))
    await asyncio.wait_for(entered.wait(), GUARD)  # gone, its failure not kept yet
    joining = asyncio.ensure_future(q.push_and_wait(2, id="job", timeout=GUARD))
    try:
        await asyncio.wait_for(past_grace.wait(), GUARD)
        release.set()  # the remover goes on, past the joiner's grace
        assert await asyncio.wait_for(removing, GUARD) is True
        with pytest.raises(aio_keuss.JobFailedError) as raised:
            await asyncio.wait_for(joining, GUARD)
        assert raised.value.error == "removed"
    finally:
        release.set()
        joining.cancel()
        await factory.close()


async def test_a_joiner_that_found_its_message_gone_looks_again_before_it_gives_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message can be out of the queue for a moment and back (a pop cancelled before its
    reply was handed over puts it back): a joiner that found it gone, and no failure kept
    within the grace, looks where it is once more and, finding it queued again, waits for
    its result rather than raising ResultMissingError."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)
    factory = _factory(MemoryBackend({}))
    q = await factory.queue("q1", result_ttl=60, poll_interval=0.2)
    await q.push(1, id="job")
    looks = 0  # the first look finds it gone; the next ones see the store
    still_queued = q._still_queued
    looked_again = asyncio.Event()

    async def out_for_a_moment(message_id: str) -> bool:
        nonlocal looks
        looks += 1
        if looks == 1:
            return False
        looked_again.set()
        return await still_queued(message_id)

    q._still_queued = out_for_a_moment  # type: ignore[method-assign]
    joining = asyncio.ensure_future(q.push_and_wait(2, id="job", timeout=GUARD))
    (held,) = await q.reserve_many(1, timeout=GUARD)
    again = asyncio.ensure_future(looked_again.wait())
    done, _ = await asyncio.wait(
        [joining, again], timeout=GUARD, return_when=asyncio.FIRST_COMPLETED
    )
    again.cancel()
    assert joining not in done  # it did not give up after its grace
    assert await q.ok(held, result="done")
    assert await asyncio.wait_for(joining, GUARD) == "done"
    await factory.close()


async def test_a_joiner_of_a_held_message_waits_with_the_shared_looks_between_its_rechecks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A joiner that found its message still queued asks where it is each poll interval,
    and only that: its result is looked for by the queue's one waiting task, with every
    other wait, as for a new message. (Looking for it itself, and entering a new wait, at
    each recheck cost two round trips more per poll interval and joiner, none shared.)"""
    factory = _factory(MemoryBackend({}))
    q = await factory.queue("q1", result_ttl=60, poll_interval=0.05)
    await q.push(1, id="job")
    (held,) = await q.reserve_many(1, timeout=GUARD)
    waits = q._waits()
    entered = 0
    wait = waits.wait

    async def counted_wait(message_id: str, timeout: float | None) -> bytes | None:
        nonlocal entered
        entered += 1
        return await wait(message_id, timeout)

    waits.wait = counted_wait  # type: ignore[method-assign]
    rechecks = 0
    still_queued = q._still_queued

    async def counted_recheck(message_id: str) -> bool:
        nonlocal rechecks
        rechecks += 1
        return await still_queued(message_id)

    q._still_queued = counted_recheck  # type: ignore[method-assign]
    joining = asyncio.ensure_future(q.push_and_wait(2, id="job", timeout=GUARD))

    async def rechecked() -> bool:
        return joining.done() or rechecks >= 4

    await until(rechecked, GUARD)
    assert not joining.done()
    assert entered == 1  # one wait, through every recheck
    assert await q.ok(held, result="done")
    assert await asyncio.wait_for(joining, GUARD) == "done"
    await factory.close()


async def test_a_joiner_finds_the_result_of_a_message_back_and_finished_as_it_looked_where(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A joiner that found its message gone looks where it is once more after the grace;
    the message may have come back and been ok-ed with a result just before that look
    (tells it gone): an ok keeps the result before the message leaves, so the result is
    looked for after it, and the joiner gets it rather than ResultMissingError."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)
    factory = _factory(MemoryBackend({}))
    q = await factory.queue("q1", result_ttl=60, poll_interval=60)
    await q.push(1, id="job")
    (held,) = await q.reserve_many(1, timeout=GUARD)
    looks = 0
    still_queued = q._still_queued

    async def back_and_done(message_id: str) -> bool:
        nonlocal looks
        looks += 1
        if looks == 1:  # out for a moment (a cancelled pop puts it back)
            return False
        if looks == 2:  # back, taken and ok-ed with a result just as this look goes out
            assert await q.ok(held, result="done")
        return await still_queued(message_id)

    q._still_queued = back_and_done  # type: ignore[method-assign]
    assert await q.push_and_wait(2, id="job", timeout=GUARD) == "done"
    await factory.close()


async def test_push_and_wait_asks_where_its_message_is_only_for_a_duplicate_without_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new message's wait, and that of a duplicate whose earlier message's result is
    kept, cost no round trip more than the push and the result's look."""
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)  # its ResultMissingError
    factory = _factory(MemoryBackend({}))
    q = await factory.queue("q1", result_ttl=60, poll_interval=60)
    located: list[list[str]] = []
    locate = q._store.locate

    async def counted(ids: Sequence[str]) -> list[Any]:
        located.append(list(ids))
        return await locate(ids)

    q._store.locate = counted  # type: ignore[method-assign]
    async with q.consume(lambda m: m.payload * 2):
        assert await q.push_and_wait(4, timeout=GUARD) == 8
        assert await q.push_and_wait(5, id="job", timeout=GUARD) == 10
        assert await q.push_and_wait(6, id="job", timeout=GUARD) == 10  # joined: kept
    assert located == []
    await q.push(7, id="done")
    (held,) = await q.reserve_many(1, timeout=GUARD)
    assert await q.ok(held)  # no result kept
    with pytest.raises(aio_keuss.ResultMissingError):
        await q.push_and_wait(8, id="done", timeout=GUARD)
    assert located == [["done"], ["done"]]  # gone, then, past the grace, gone still
    await factory.close()


# the sync shim, the worker, the admin command ---------------------------------------------


def test_the_sync_shim_keeps_and_waits_for_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio_keuss.queue, "LEAVE_GRACE", 0.05)  # its ResultMissingError
    with sync.connect("memory") as factory:
        q = factory.queue("q1", result_ttl=60)
        message_id = q.push(1)
        message = q.reserve(timeout=GUARD)
        assert message is not None
        assert q.ok(message, result={"done": True})
        found = q.result(message_id)
        assert found is not None and found.value == {"done": True}
        second = q.push(2)
        held = q.reserve(timeout=GUARD)
        assert held is not None
        assert q.ko(held, error="nope") is aio_keuss.KoResult.ROLLED_BACK
        assert q.result(second) is None
        with pytest.raises(aio_keuss.ResultTimeoutError):
            q.push_and_wait(3, timeout=0.05)
        other = factory.queue("q2", result_ttl=60)
        other.push(1, id="job")
        done = other.reserve(timeout=GUARD)
        assert done is not None and other.ok(done)  # finished, no result kept
        with pytest.raises(aio_keuss.ResultMissingError):  # raised through the shim
            other.push_and_wait(2, id="job", timeout=GUARD)


def test_the_worker_takes_a_result_ttl() -> None:
    base = {"handler": "m:f", "queues": ["q"]}
    assert resolve({**base, "result_ttl": "30"}, {}).result_ttl == 30.0
    assert resolve(base, {"AIO_KEUSS_RESULT_TTL": "7.5"}).result_ttl == 7.5
    assert resolve(base, {}).result_ttl == 0.0
    with pytest.raises(aio_keuss.ConfigError, match="result_ttl"):
        resolve({**base, "result_ttl": "-1"}, {})


async def test_the_admin_result_command() -> None:
    factory = _factory(MemoryBackend({}))
    q = await factory.queue("q1", result_ttl=60)
    message_id = await q.push(1)
    message = await q.reserve(timeout=GUARD)
    assert message is not None
    await q.ok(message, result=b"raw")
    out = io.StringIO()
    args = argparse.Namespace(queue="q1", id=message_id, wait=0.0)
    assert await admin._result(factory, args, admin.Output(True, out)) == admin.EXIT_OK
    shown = json.loads(out.getvalue())
    assert (shown["id"], shown["ok"], shown["value"]) == (message_id, True, {"base64": "cmF3"})
    args = argparse.Namespace(queue="q1", id="missing", wait=0.0)
    code = await admin._result(factory, args, admin.Output(True, io.StringIO()))
    assert code == admin.EXIT_NOT_FOUND
    await factory.close()


class _PopOnly(MemoryBackend):
    """A backend without reserve (as redis-list): consumers pop, and no ok carries a result."""

    capabilities = replace(MemoryBackend.capabilities, reserve=False)


async def test_popped_messages_keep_their_results_too() -> None:
    factory = _factory(_PopOnly({}))
    q = await factory.queue("q1", result_ttl=60)

    def handler(message: Message) -> int:
        if message.payload < 0:
            raise ValueError("negative")
        return message.payload * 10

    async with q.consume(handler):
        assert await q.push_and_wait(2, timeout=GUARD) == 20
        with pytest.raises(aio_keuss.JobFailedError, match="ValueError: negative"):
            await q.push_and_wait(-1, timeout=GUARD)
    async with q.consume(lambda messages: len(messages), batch=2):
        assert await q.push_and_wait(5, timeout=GUARD) == 1
    await factory.close()


async def test_a_deadletter_move_a_store_finished_by_itself_keeps_failures() -> None:
    """A bucket store finishing a move another process began tells the queue its ids
    (``Store.on_finished_deadletter``): no ko answers for them, so the queue keeps them."""
    factory = _factory(MemoryBackend({}))
    q = await factory.queue("q1", result_ttl=60)
    q._deadlettered("__deadletter__", 2, ["b1-0", "b1-3"])
    for message_id in ("b1-0", "b1-3"):
        found = await q.result(message_id, timeout=GUARD)
        assert found is not None and found.ok is False
        assert found.error == "failed for good (deadlettered)"
    await factory.close()


async def test_many_results_are_put_in_batches_of_max_batch() -> None:
    backend = _CountingBackend({})
    backend.made = []
    factory = _factory(backend)
    q = await factory.queue("q1", result_ttl=60, max_batch=10)
    store = await factory._results.get()
    puts: list[int] = []
    put = store.put

    async def counted(queue: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        puts.append(len(results))
        await put(queue, results, ttl)

    store.put = counted  # type: ignore[method-assign]
    ids = await q.push_many(list(range(25)))
    held: list[Message] = []
    while len(held) < 25:
        held += await q.reserve_many(25, timeout=GUARD)
    await q.ok_many(held, results=[m.payload for m in held])
    assert max(puts) <= 10 and sum(puts) == 25
    found = [await q.result(i) for i in ids]
    assert [f.value for f in found if f is not None] == list(range(25))
    await factory.close()


class _FailingOnce(MemoryResults):
    opens = 0

    async def open(self) -> None:
        type(self).opens += 1
        if type(self).opens == 1:
            raise aio_keuss.KeussConnectionError("the server is away")


class _FailingOnceBackend(MemoryBackend):
    def result_store(self) -> ResultStore:
        return _FailingOnce()


async def test_a_store_that_cannot_open_fails_the_queue_open_and_is_tried_again() -> None:
    factory = _factory(_FailingOnceBackend({}))
    with pytest.raises(aio_keuss.KeussConnectionError):
        await factory.queue("q1", result_ttl=60)
    assert "q1" not in await factory.list()  # nothing recorded
    q = await factory.queue("q1", result_ttl=60)  # the next open tries again
    assert await q.result("x") is None
    await factory.close()


@pytest.mark.parametrize(
    "error",
    [
        aio_keuss.JobFailedError("m1", "ValueError: no"),
        aio_keuss.ResultTimeoutError("m2", 3.0),
        aio_keuss.ResultMissingError("m3"),
    ],
)
def test_result_errors_survive_pickling(error: Exception) -> None:
    """They cross process boundaries (a process pool's task that waited for a result);
    an exception unpickles by calling its class with its ``args``."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert vars(copy) == vars(error)
