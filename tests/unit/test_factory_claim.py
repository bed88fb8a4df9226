"""The factory's claim of a queue it opened by itself (the deadletter queue for a queue's
routing, a move's or a replay's target): the user's first ``factory.queue(name, **options)``
with other options reopens it with them, and nothing that uses the factory's own open at
that moment may fail for it. Pinned on the real memory store, made to refuse calls once
closed (as a bucket store does, or a client whose connection is gone) and to hold a call
on an Event, so that each interleaving is made on purpose."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

import aio_keuss
from aio_keuss.contract import Cursor, Entry, Peeked, PeekPage, Store
from aio_keuss.factory import Factory
from aio_keuss.memory import MemoryStore
from aio_keuss.options import QueueOptions
from aio_keuss.types import Sizes, State

HANG_GUARD = 30.0  # seconds: only against a hang, never a timing assertion


@dataclasses.dataclass
class Gate:
    """One store call held: ``entered`` once it is made, it goes on once ``go`` is set."""

    entered: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    go: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class Stores:
    """The stores a factory made, by queue, and the calls to hold (queue, call) -> Gate."""

    def __init__(self) -> None:
        self.made: dict[str, list[ShutStore]] = {}
        self.gates: dict[tuple[str, str], Gate] = {}
        self.processed: set[str] = set()  # queues whose messages locate shows as consumed

    def hold(self, queue: str, call: str) -> Gate:
        gate = self.gates[(queue, call)] = Gate()
        return gate


class ShutStore(MemoryStore):
    """The memory store, refusing its calls once closed (its server connection gone)."""

    def __init__(self, name: str, options: QueueOptions, backend: Any, stores: Stores) -> None:
        super().__init__(name, options, backend)
        self._stores = stores
        self.shut = False

    async def _through(self, call: str) -> None:
        self._refuse_if_shut()
        gate = self._stores.gates.pop((self.name, call), None)
        if gate is not None:
            gate.entered.set()
            await gate.go.wait()
        self._refuse_if_shut()  # closed while the round trip was out: its reply is lost

    def _refuse_if_shut(self) -> None:
        if self.shut:
            raise aio_keuss.ClosedError(f"store of {self.name!r} is closed")

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        await self._through("insert")
        return await super().insert(entries)

    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        await self._through("locate")
        found = await super().locate(ids)
        if self.name not in self._stores.processed:
            return found
        return [None if r is None else dataclasses.replace(r, state=State.PROCESSED) for r in found]

    async def sizes(self) -> Sizes:
        await self._through("sizes")
        return await super().sizes()

    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        await self._through("peek")
        return await super().peek(state, after, limit)

    async def close(self) -> None:
        self.shut = True
        await super().close()


def _shut_stores(monkeypatch: pytest.MonkeyPatch, factory: Factory) -> Stores:
    """Every store the factory makes from now on a ShutStore; the backend claims
    ``history`` (a replay reads the messages of a queue in ``Stores.processed`` as
    consumed ones)."""
    stores = Stores()
    backend = factory.backend

    async def store(name: str, options: QueueOptions) -> Store:
        made = ShutStore(name, options, backend, stores)
        stores.made.setdefault(name, []).append(made)
        return made

    monkeypatch.setattr(backend, "store", store)
    history = dataclasses.replace(backend.capabilities, history=True)
    monkeypatch.setattr(backend, "capabilities", history)
    return stores


async def _turns(count: int) -> None:
    """Let the other tasks run ``count`` loop turns (the memory store does no I/O: each
    step of theirs is one turn)."""
    for _ in range(count):
        await asyncio.sleep(0)


async def test_a_replay_into_the_factory_s_open_of_its_target_ends_across_the_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replay copies batch by batch into its target, opened by the factory with the
    defaults. The user's open of the target with options of its own closed that open under
    the replay: its next batch failed (ClosedError) after the first was pushed, and a
    replay tried again pushed those copies twice."""
    async with aio_keuss.connect("memory", max_batch=1) as factory:
        stores = _shut_stores(monkeypatch, factory)
        src = await factory.queue("src")
        ids = await src.push_many(["a", "b", "c"])
        stores.processed.add("src")
        gate = stores.hold("tgt", "insert")
        replaying = asyncio.ensure_future(src.replay(ids, to="tgt"))
        await asyncio.wait_for(gate.entered.wait(), HANG_GUARD)  # its first copy is going in
        claiming = asyncio.ensure_future(factory.queue("tgt", reserve_delay=45.0))
        await _turns(50)  # the claim goes as far as it can meanwhile
        gate.go.set()
        copies = await asyncio.wait_for(replaying, HANG_GUARD)
        tgt = await asyncio.wait_for(claiming, HANG_GUARD)
        assert len(copies) == 3
        assert tgt.options.reserve_delay == 45.0
        assert await factory.queue("tgt") is tgt
        popped = [await tgt.pop(timeout=0) for _ in range(4)]  # (max_batch 1)
        assert sorted(m.payload for m in popped if m is not None) == ["a", "b", "c"]


async def test_a_find_looking_in_the_deadletter_queue_ends_across_its_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A find looks in the deadletter queue, opened by the factory for the routing. The
    user's open of it with options of its own closed it under the find's lookup there."""
    async with aio_keuss.connect("memory", deadletter={"max_ko": 1}) as factory:
        stores = _shut_stores(monkeypatch, factory)
        work = await factory.queue("work")
        gate = stores.hold("__deadletter__", "locate")
        finding = asyncio.ensure_future(work.find("nowhere"))
        await asyncio.wait_for(gate.entered.wait(), HANG_GUARD)
        claiming = asyncio.ensure_future(factory.queue("__deadletter__", reserve_delay=45.0))
        await _turns(50)
        gate.go.set()
        assert await asyncio.wait_for(finding, HANG_GUARD) is None
        dl = await asyncio.wait_for(claiming, HANG_GUARD)
        assert dl.options.reserve_delay == 45.0
        assert await work.find("nowhere") is None  # through the queue the user opened


async def test_asks_joining_the_factory_s_own_open_get_the_queue_claimed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two asks of the deadletter queue, one with options and one without, joined the
    factory's own open of it: the first claimed it (reopened with its options), the other
    was handed the queue being closed, and its push failed (ClosedError)."""
    async with aio_keuss.connect("memory", deadletter={"max_ko": 1}) as factory:
        stores = _shut_stores(monkeypatch, factory)
        opening, held = asyncio.Event(), asyncio.Event()
        store = factory.backend.store

        async def gated(name: str, options: QueueOptions) -> Any:
            if name == "__deadletter__" and not held.is_set():
                opening.set()
                await held.wait()
            return await store(name, options)

        monkeypatch.setattr(factory.backend, "store", gated)
        work = asyncio.ensure_future(factory.queue("work"))
        await asyncio.wait_for(opening.wait(), HANG_GUARD)  # the factory's own open of it
        asked = asyncio.ensure_future(factory.queue("__deadletter__", reserve_delay=45.0))
        plain = asyncio.ensure_future(factory.queue("__deadletter__"))
        await _turns(2)  # both join that open
        held.set()
        await asyncio.wait_for(work, HANG_GUARD)
        dl = await asyncio.wait_for(asked, HANG_GUARD)
        assert dl.options.reserve_delay == 45.0
        assert await asyncio.wait_for(plain, HANG_GUARD) is dl
        await dl.push("in")
        assert len(stores.made["__deadletter__"]) == 2  # the factory's open, then the user's


async def test_a_claim_cancelled_while_a_find_holds_the_queue_leaves_it_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A claim waiting for a find to let go of the deadletter queue, then cancelled (a
    timeout around ``factory.queue``): the factory's own open stays open and unclaimed, and
    what reached it meanwhile got it; a claim after that reopens it as the first would."""
    async with aio_keuss.connect("memory", deadletter={"max_ko": 1}) as factory:
        stores = _shut_stores(monkeypatch, factory)
        work = await factory.queue("work")
        own = factory._queues["__deadletter__"]
        gate = stores.hold("__deadletter__", "locate")
        finding = asyncio.ensure_future(work.find("nowhere"))
        await asyncio.wait_for(gate.entered.wait(), HANG_GUARD)
        claiming = asyncio.ensure_future(factory.queue("__deadletter__", reserve_delay=45.0))
        await _turns(50)  # waiting for the find
        reaching = asyncio.ensure_future(work.find("elsewhere"))  # waits for the reopen
        await _turns(50)
        claiming.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claiming
        assert await asyncio.wait_for(reaching, HANG_GUARD) is None
        gate.go.set()
        assert await asyncio.wait_for(finding, HANG_GUARD) is None
        assert (
            factory._queues["__deadletter__"] is own and not stores.made["__deadletter__"][0].shut
        )
        dl = await asyncio.wait_for(factory.queue("__deadletter__", reserve_delay=45.0), HANG_GUARD)
        assert dl is not own and dl.options.reserve_delay == 45.0
        assert stores.made["__deadletter__"][0].shut  # the factory's open closed by the claim
        assert await work.find("nowhere") is None


async def test_a_pipeline_s_sizes_read_across_the_claim_of_a_queue_it_reaches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``factory.pipelines(sizes=True)`` reads the sizes of a queue it opens by itself; a
    claim of it meanwhile waits for that read rather than closing the store under it."""
    async with aio_keuss.connect("memory") as factory:
        stores = _shut_stores(monkeypatch, factory)
        gate = stores.hold("tgt", "sizes")
        monkeypatch.setattr(factory.stats_store, "pipelines", _one_pipeline)
        reading = asyncio.ensure_future(factory.pipelines(sizes=True))
        await asyncio.wait_for(gate.entered.wait(), HANG_GUARD)
        claiming = asyncio.ensure_future(factory.queue("tgt", reserve_delay=45.0))
        await _turns(50)
        gate.go.set()
        found = await asyncio.wait_for(reading, HANG_GUARD)
        assert found["p"]["sizes"]["tgt"].total == 0
        assert (await asyncio.wait_for(claiming, HANG_GUARD)).options.reserve_delay == 45.0


async def _one_pipeline() -> dict[str, dict[str, Any]]:
    return {"p": {"queues": ["tgt"]}}


async def test_a_queue_the_dashboard_looked_at_opens_with_the_defaults_for_a_plain_ask() -> None:
    """A queue a looking tool (the dashboard beside the application, on its factory) opened
    with the options recorded for it is not asked for: the application's
    ``factory.queue(name)`` then got it with those recorded options, not the defaults it
    asked for (nor recorded them, as it does without the dashboard), and a later ask
    giving the defaults was refused as already open with other options."""
    from aio_keuss.dashboard.board import Board  # the Board itself needs no aiohttp

    async with aio_keuss.connect("memory") as factory:
        defaults = factory.defaults.as_dict()
        # as an earlier run of the application, with max_batch=7, recorded it
        await factory.stats_store.save_options("jobs", {**defaults, "max_batch": 7})
        board = Board(factory, sample_every=3600)
        await board.state()
        jobs = await factory.queue("jobs")
        assert jobs.options == factory.defaults
        assert (await factory.list())["jobs"] == defaults
        assert await factory.queue("jobs", max_batch=defaults["max_batch"]) is jobs
        assert [row["name"] for row in (await board.state())["queues"]] == ["jobs"]


async def test_the_dashboard_s_state_reads_across_the_application_s_claim() -> None:
    """The application's first ask of a queue the dashboard opened (with its recorded
    options) reopens it with the options asked for, closing the dashboard's open: a
    state() reading it meanwhile failed with ClosedError (a failed page refresh). It
    reads the reopened queue now."""
    from aio_keuss.dashboard.board import Board  # the Board itself needs no aiohttp

    async with aio_keuss.connect("memory") as factory:
        defaults = factory.defaults.as_dict()
        await factory.stats_store.save_options("jobs", {**defaults, "max_batch": 7})
        board = Board(factory, sample_every=3600)
        await board.state()
        state, jobs = await asyncio.wait_for(
            asyncio.gather(board.state(), factory.queue("jobs")), HANG_GUARD
        )
        assert [row["name"] for row in state["queues"]] == ["jobs"]
        assert jobs.options == factory.defaults


async def _looked_at(factory: Factory, *names: str) -> Any:
    """A dashboard on ``factory`` that has opened ``names``, recorded with max_batch 7 (as
    an earlier run of the application recorded them)."""
    from aio_keuss.dashboard.board import Board  # the Board itself needs no aiohttp

    defaults = factory.defaults.as_dict()
    for name in names:
        await factory.stats_store.save_options(name, {**defaults, "max_batch": 7})
    board = Board(factory, sample_every=3600)
    await board.state()
    return board


async def test_the_dashboard_s_state_reads_across_two_claims_one_after_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker opening its queues one by one beside the dashboard (a pipeline's stations)
    claims each: state() read again once when one closed under it, and failed with
    ClosedError when the next claim closed another queue under that second read."""
    async with aio_keuss.connect("memory") as factory:
        stores = _shut_stores(monkeypatch, factory)
        board = await _looked_at(factory, "a", "b")
        first = stores.hold("a", "sizes")
        reading = asyncio.ensure_future(board.state())
        await asyncio.wait_for(first.entered.wait(), HANG_GUARD)
        second = stores.hold("b", "sizes")  # held in the read after the first claim
        await asyncio.wait_for(factory.queue("a"), HANG_GUARD)
        first.go.set()
        await asyncio.wait_for(second.entered.wait(), HANG_GUARD)
        await asyncio.wait_for(factory.queue("b"), HANG_GUARD)
        second.go.set()
        state = await asyncio.wait_for(reading, HANG_GUARD)
        assert [row["name"] for row in state["queues"]] == ["a", "b"]


async def test_a_dashboard_peek_reads_across_the_application_s_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peek from the dashboard into a queue it opened, while the application's first
    ``factory.queue(name)`` reopens that queue with the defaults: the peek failed with
    ClosedError (the page's peek answered an error); it reads the reopened queue now."""
    async with aio_keuss.connect("memory") as factory:
        stores = _shut_stores(monkeypatch, factory)
        board = await _looked_at(factory, "jobs")
        gate = stores.hold("jobs", "peek")
        peeking = asyncio.ensure_future(board.peek("jobs", "ready", 5))
        await asyncio.wait_for(gate.entered.wait(), HANG_GUARD)
        jobs = await asyncio.wait_for(factory.queue("jobs"), HANG_GUARD)
        await jobs.push("in")
        gate.go.set()
        found = await asyncio.wait_for(peeking, HANG_GUARD)
        assert [row["payload"] for row in found] == ['"in"']  # (shown as JSON)


async def test_a_dashboard_requeue_ends_across_the_claim_of_the_deadletter_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A requeue from the dashboard goes through the deadletter queue's messages batch by
    batch, in the factory's own open of that queue. The application's first
    ``factory.queue("__deadletter__", **options)`` closed that open under it: its next batch
    failed (ClosedError) after the first had moved, and the page's requeue answered an
    error. The claim now waits for the requeue, as it waits for a replay into a queue."""
    from aio_keuss.dashboard.board import Board  # the Board itself needs no aiohttp

    async with aio_keuss.connect("memory", max_batch=1, deadletter={"max_ko": 1}) as factory:
        stores = _shut_stores(monkeypatch, factory)
        work = await factory.queue("work")
        await work.push_many(["a", "b"])
        while (message := await work.reserve(timeout=0)) is not None:
            await work.ko(message)  # past max_ko: deadlettered
        board = Board(factory, sample_every=3600)
        dead = await board.peek("__deadletter__", "all", 10)
        ids = [row["id"] for row in dead]
        assert len(ids) == 2
        first = stores.hold("__deadletter__", "locate")
        requeuing = asyncio.ensure_future(board.requeue("__deadletter__", ids))
        await asyncio.wait_for(first.entered.wait(), HANG_GUARD)
        second = stores.hold("__deadletter__", "locate")  # its second batch
        first.go.set()
        await asyncio.wait_for(second.entered.wait(), HANG_GUARD)
        claiming = asyncio.ensure_future(factory.queue("__deadletter__", reserve_delay=45.0))
        await _turns(50)  # the claim goes as far as it can meanwhile
        second.go.set()
        moved = await asyncio.wait_for(requeuing, HANG_GUARD)
        assert sorted(moved) == sorted(ids)
        assert (await asyncio.wait_for(claiming, HANG_GUARD)).options.reserve_delay == 45.0
        assert (await work.sizes()).size == 2


async def test_a_dashboard_sample_reads_across_the_application_s_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dashboard's sampler reads every listed queue; the application's first ask of one
    it opened closed that open under the read: the sample failed (ClosedError, logged as
    the backend being away) and the chart lost its point. It reads the reopened queue."""
    async with aio_keuss.connect("memory") as factory:
        stores = _shut_stores(monkeypatch, factory)
        board = await _looked_at(factory, "jobs")
        gate = stores.hold("jobs", "sizes")
        sampling = asyncio.ensure_future(board.sample())
        await asyncio.wait_for(gate.entered.wait(), HANG_GUARD)
        jobs = await asyncio.wait_for(factory.queue("jobs"), HANG_GUARD)
        await jobs.push("in")
        gate.go.set()
        await asyncio.wait_for(sampling, HANG_GUARD)
        assert [counts["jobs"][2] for _, counts in board._samples] == [1]
