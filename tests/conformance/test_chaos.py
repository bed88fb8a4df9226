"""Conformance: a seeded random model test of the queue contract, with cancellations.

Several tasks on one queue push, push_many (with and without ids of their own), pop,
pop_many, reserve, reserve_many, ok and ko at random, and start many of those calls as
tasks that they cancel after a random number of event-loop iterations (never after a
wall-clock time). A model follows every call and checks, as it goes and at the end:

- nothing a push acknowledged is lost: it is popped, ok-ed, or found by the final drain;
- a popped message is never delivered again, nor an ok-ed one;
- a message is never handed out while someone holds its reservation;
- a message comes with tries equal to the kos it had (a reservation cancelled unseen is
  released at no try);
- a cancelled push is stored at most once, a retry of one with its own id exactly once,
  and a second push of an id already stored is never delivered.

Where queues are shared, half the tasks go through a second factory, closed at the end with
the reservations its tasks still hold: the close gives them back at no try. Every other seed
runs with max_batch 3, so callers' lists are cut in chunks.

Messages are told apart by their payload (a counter), not their id. Each seed fixes the
choices of every task; the interleaving of server replies still varies from run to run.
Reservations last 600 s, so none lapses during a run. AK_CHAOS_SEEDS and AK_CHAOS_SPIN
widen a run, to hunt (e.g. AK_CHAOS_SEEDS=1-50 AK_CHAOS_SPIN=3000).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from backends import BackendCase
from conftest import Connect

import aio_keuss
from aio_keuss import KoResult

pytestmark = pytest.mark.timeout(180)

T = TypeVar("T")


def _seeds() -> list[int]:
    """AK_CHAOS_SEEDS=first-last runs more seeds, to hunt; three by default."""
    first, _, last = os.environ.get("AK_CHAOS_SEEDS", "1-3").partition("-")
    return list(range(int(first), int(last or first) + 1))


SEEDS = _seeds()
TASKS = 6
STEPS = 30
CANCEL_P = 0.35
SPIN = int(os.environ.get("AK_CHAOS_SPIN", "5"))
"""Most loop iterations before a cancellation; AK_CHAOS_SPIN=2000 reaches into server
round trips (a reply being read, a put-back under way), to hunt."""
DRAIN_BOUND = 60.0
"""Seconds the final drain waits for messages the queue counts and no pop finds yet."""


class Cancelled(Exception):
    """The call was cancelled before it returned."""


CALLS: dict[str, int] = {}
"""Outcomes of the calls chosen for cancellation (printed with -s): how many took."""


@dataclass
class Model:
    seed: int
    stable_ids: bool
    """ids stay as the push returned them (bucket backends give a message put back or
    ko-ed a slot of a new bucket, so a new id)."""
    counter: int = 0
    started: set[int] = field(default_factory=set)
    """payloads whose push began (a push in flight may be delivered before it returns)."""
    acked: dict[int, str] = field(default_factory=dict)
    """payload -> id returned by its push."""
    maybe: set[int] = field(default_factory=set)
    """payloads of cancelled pushes (stored or not)."""
    never: set[int] = field(default_factory=set)
    """payloads pushed under an id already stored: never delivered."""
    popped: dict[int, str] = field(default_factory=dict)
    okd: set[int] = field(default_factory=set)
    held: dict[int, int] = field(default_factory=dict)
    """payload -> task holding its reservation."""
    kos: dict[int, int] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    """payload -> deliveries (pop or reserve)."""
    violations: list[str] = field(default_factory=list)
    max_ko: int | None = None
    """the factory's deadletter max_ko, when it has one."""
    dead: set[int] = field(default_factory=set)
    """payloads of messages deadlettered (by a ko past max_ko)."""
    story: dict[int, list[str]] = field(default_factory=dict)
    context: list[str] = field(default_factory=list)
    """payload -> what happened to it, timed (printed for the payloads a failure names)."""

    def note(self, n: int, what: str) -> None:
        self.story.setdefault(n, []).append(f"{time.time():.3f} {what}")

    def new(self) -> int:
        self.counter += 1
        self.started.add(self.counter)
        return self.counter

    def delivered(self, who: int, how: str, message: aio_keuss.Message) -> int | None:
        n = message.payload
        if not isinstance(n, int):
            self.violations.append(f"{how} by {who}: unknown payload {n!r}")
            return None
        self.seen[n] = self.seen.get(n, 0) + 1
        where = f"{how} by task {who}: {n} (id {message.id}, tries {message.tries})"
        self.note(n, where)
        if n not in self.started:
            self.violations.append(f"{where}: never pushed")
        if n in self.never:
            self.violations.append(f"{where}: pushed under an id already stored")
        if n in self.popped:
            self.violations.append(f"{where}: already popped as {self.popped[n]}")
        if n in self.okd:
            self.violations.append(f"{where}: already ok-ed")
        if n in self.dead:
            self.violations.append(f"{where}: already deadlettered")
        if n in self.held:
            self.violations.append(f"{where}: held by task {self.held[n]}")
        if message.tries != self.kos.get(n, 0):
            self.violations.append(f"{where}: tries, {self.kos.get(n, 0)} kos")
        if self.stable_ids and n in self.acked and message.id != self.acked[n]:
            self.violations.append(f"{where}: pushed as {self.acked[n]}")
        return n


async def _call(
    rng: random.Random,
    make: Callable[[], Awaitable[T]],
    cancel: bool | None = None,
    on_done: Callable[[T], None] | None = None,
) -> T:
    """Run ``make()``; when chosen, as a task cancelled after 0..SPIN loop iterations.
    Raises Cancelled when the cancellation took (the call's own result, if it finished
    first or kept it, is returned as usual). ``on_done`` sees the result in the step the
    call returned in, before any other task runs: a task cancelled later resumes its
    caller only steps after, when another may have taken what it gave back."""

    async def run() -> T:
        result = await make()
        if on_done is not None:
            on_done(result)
        return result

    if cancel is None:
        cancel = rng.random() < CANCEL_P
    if not cancel:
        return await run()
    task = asyncio.ensure_future(run())
    # 0..5 uniformly; a larger SPIN log-uniformly, so short and long waits both come up
    spins = rng.randint(0, SPIN) if SPIN <= 5 else int(SPIN ** rng.random())
    for _ in range(spins):
        await asyncio.sleep(0)
    task.cancel()
    try:
        result = await task
        CALLS["finished"] = CALLS.get("finished", 0) + 1
        return result
    except asyncio.CancelledError:
        CALLS["cancelled"] = CALLS.get("cancelled", 0) + 1
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise  # the test itself is being cancelled
        raise Cancelled from None


def _listed(
    got: list[aio_keuss.Message] | aio_keuss.Message | None,
) -> list[aio_keuss.Message]:
    return got if isinstance(got, list) else [] if got is None else [got]


class Worker:
    def __init__(
        self, i: int, q: aio_keuss.Queue, model: Model, *, reserve: bool, ids: bool
    ) -> None:
        self.i = i
        self.q = q
        self.model = model
        self.rng = random.Random(f"{model.seed}-{i}")
        self.reserve_ok = reserve
        self.ids = ids
        self.holding: dict[int, aio_keuss.Message] = {}
        self.own_ids = 0
        self.given_back = False
        """Its queue's close has begun: what it reserves from now on is given back."""

    def _id(self) -> str:
        self.own_ids += 1
        return f"t{self.i}-{self.own_ids}"

    # pushes ---------------------------------------------------------------------------

    async def push(self) -> None:
        m, rng = self.model, self.rng
        n = m.new()
        mid = self._id() if self.ids and rng.random() < 0.4 else None
        try:
            got = await _call(rng, lambda: self.q.push(n, id=mid))
        except aio_keuss.ClosedError:
            m.maybe.add(n)
            raise
        except Cancelled:
            m.maybe.add(n)
            if mid is not None and rng.random() < 0.5:  # retried under the same id
                got = await self.q.push(n, id=mid)
                m.maybe.discard(n)
                m.acked[n] = got
            return
        m.acked[n] = got
        if mid is not None and rng.random() < 0.2:  # a second push of a stored id
            dup = m.new()
            m.never.add(dup)
            assert await self.q.push(dup, id=mid) == mid

    async def push_many(self) -> None:
        m, rng = self.model, self.rng
        ns = [m.new() for _ in range(rng.randint(1, 4))]
        mids = [self._id() for _ in ns] if self.ids and rng.random() < 0.4 else None
        try:
            got = await _call(rng, lambda: self.q.push_many(ns, ids=mids))
        except aio_keuss.ClosedError:
            m.maybe.update(ns)
            raise
        except Cancelled:
            m.maybe.update(ns)
            if mids is not None and rng.random() < 0.5:
                got = await self.q.push_many(ns, ids=mids)
                m.maybe.difference_update(ns)
                m.acked.update(zip(ns, got, strict=True))
            return
        assert len(got) == len(ns)
        m.acked.update(zip(ns, got, strict=True))

    # takes ----------------------------------------------------------------------------

    def _timeout(self, cancel: bool) -> float | None:
        """timeout=None only where a cancellation will end the wait."""
        choices: list[float | None] = [0, 0.01, 0.05]
        return self.rng.choice([*choices, None] if cancel else choices)

    async def take(self, kind: str, many: bool) -> None:
        """A pop or a reserve (``kind``), of one message or of up to four."""
        cancel = self.rng.random() < CANCEL_P
        timeout, n = self._timeout(cancel), self.rng.randint(1, 4)
        wait = self.rng.choice([None, 0.01])  # max_wait: gather after the first for 10 ms
        q = self.q
        one, several = (q.pop, q.pop_many) if kind == "pop" else (q.reserve, q.reserve_many)
        noted = self._popped if kind == "pop" else self._reserved
        with contextlib.suppress(Cancelled):
            if many:
                await _call(
                    self.rng,
                    lambda: several(n, timeout=timeout, max_wait=wait),
                    cancel,
                    noted,
                )
            else:
                await _call(self.rng, lambda: one(timeout=timeout), cancel, noted)

    def _popped(self, got: list[aio_keuss.Message] | aio_keuss.Message | None) -> None:
        for message in _listed(got):
            k = self.model.delivered(self.i, "pop", message)
            if k is not None:
                self.model.popped[k] = f"pop by task {self.i}"

    def _reserved(self, got: list[aio_keuss.Message] | aio_keuss.Message | None) -> None:
        m = self.model
        got = _listed(got)
        if got and self.q._closed:
            m.violations.append(f"reserve by task {self.i}: {len(got)} after its queue closed")
        for message in got:
            k = m.delivered(self.i, "reserve", message)
            if k is not None and not self.given_back:
                m.held[k] = self.i
                self.holding[k] = message

    async def settle(self, n: int, ok: bool) -> None:
        """ok or ko (delay 0) a held reservation; a cancelled one is sent again, which
        does it or finds it done."""
        m, message = self.model, self.holding.pop(n)
        del m.held[n]  # released as soon as the store acts: another may take it then
        m.note(n, f"{'ok' if ok else 'ko'} by task {self.i} sent")
        if ok:
            m.okd.add(n)
            try:
                done = await _call(self.rng, lambda: self.q.ok(message))
            except Cancelled:
                await self.q.ok(message)
                return
            if not done:
                m.violations.append(f"ok by task {self.i} of {n}: False")
        else:
            # the ko of a message's (max_ko + 1)-th failed delivery deadletters it
            dies = m.max_ko is not None and m.kos.get(n, 0) >= m.max_ko
            if dies:
                m.dead.add(n)
            else:
                m.kos[n] = m.kos.get(n, 0) + 1
            try:
                result = await _call(self.rng, lambda: self.q.ko(message, delay=0))
            except Cancelled:
                await self.q.ko(message, delay=0)
                return
            m.note(n, f"ko by task {self.i}: {result!r}")
            if result != (KoResult.DEADLETTERED if dies else KoResult.ROLLED_BACK):
                m.violations.append(f"ko by task {self.i} of {n}: {result!r}")

    async def ok_many(self, ns: list[int]) -> None:
        """ok several held reservations in one call; a cancelled one is sent again."""
        m = self.model
        messages = [self.holding.pop(n) for n in ns]
        for n in ns:
            del m.held[n]
            m.okd.add(n)
        try:
            done = await _call(self.rng, lambda: self.q.ok_many(messages))
        except Cancelled:
            await self.q.ok_many(messages)
            return
        if not all(done):
            m.violations.append(f"ok_many by task {self.i} of {ns}: {done}")

    # the run --------------------------------------------------------------------------

    async def run(self, settle: bool = True, step: Callable[[], None] | None = None) -> None:
        """STEPS random calls; then ok or ko what is still held. Without ``settle``, it
        never acks (its queue's close is to give back what it holds) and it ends at the
        first ClosedError. ``step`` is called after each step."""
        rng = self.rng
        try:
            for _ in range(STEPS):
                choice = rng.random()
                if choice < 0.2:
                    await self.push()
                elif choice < 0.35:
                    await self.push_many()
                elif choice < 0.45 or (choice < 0.75 and not self.reserve_ok):
                    await self.take("pop", many=rng.random() < 0.5)
                elif choice < 0.75:
                    await self.take("reserve", many=rng.random() < 0.5)
                elif self.holding and choice < 0.9 and settle:
                    await self.settle(rng.choice(sorted(self.holding)), ok=rng.random() < 0.5)
                elif self.holding and settle:
                    some = rng.sample(sorted(self.holding), min(3, len(self.holding)))
                    await self.ok_many(some)
                if step is not None:
                    step()
        except aio_keuss.ClosedError:
            if settle:
                raise
            return
        for n in sorted(self.holding) if settle else ():
            await self.settle(n, ok=rng.random() < 0.5)


async def _taken_to_the_end(q: aio_keuss.Queue) -> list[aio_keuss.Message]:
    """The next messages left. While the queue still counts some that no pop finds at once
    (a bucket whose release is being written, a put-back under way), it waits for them,
    polling, for as long as a loaded machine may need: the bound only keeps a stuck message
    from hanging the run (it then fails the end's check). An empty queue costs no wait,
    so most of a seed's time is not spent on its drain's last, empty pop."""
    got = await q.pop_many(100, timeout=0)
    loop = asyncio.get_running_loop()
    until = loop.time() + DRAIN_BOUND
    while not got and loop.time() < until and await q.total_size() > 0:
        got = await q.pop_many(100, timeout=0.5)
    return got


async def _settled(
    connect: Connect, options: dict[str, Any], factory: aio_keuss.Factory, case: BackendCase
) -> tuple[aio_keuss.Factory, aio_keuss.Queue]:
    """A factory and queue to drain through once everything the run began has landed.

    A call its caller cancelled may still be under way when the tasks end: a push's batch
    shared with others, a bucket being written. Drained before it lands, its message was
    left in the queue after the drain (CI, loaded, twice). Where queues are shared, the
    run's factory is closed, which waits for all of it, and a fresh one drains; the memory
    backends' work is done by the time their tasks end."""
    if not case.shared:
        return factory, await factory.queue("chaos")
    await factory.close()
    fresh = await connect(**options)
    return fresh, await fresh.queue("chaos")


async def _drain(q: aio_keuss.Queue, model: Model) -> None:
    """Pop everything left, waiting a little for what is still on its way."""
    while True:
        got = await _taken_to_the_end(q)
        if not got:
            return
        for message in got:
            k = model.delivered(-1, "drain", message)
            if k is not None:
                model.popped[k] = "drain"


def _options(seed: int) -> dict[str, Any]:
    """Every other seed with small batches (callers' lists cut in chunks, batches shared),
    and two seeds in four with a deadletter queue."""
    options: dict[str, Any] = {"reserve_delay": 600.0, "poll_interval": 0.5}
    options["max_batch"] = 3 if seed % 2 == 0 else 1000
    if seed % 4 in (1, 2):  # the first ko or the second deadletters
        options["deadletter"] = {"max_ko": seed % 4 - 1, "queue": "chaos-dl"}
    return options


def _model(case: BackendCase, seed: int) -> Model:
    dl = _options(seed).get("deadletter")
    return Model(
        seed,
        stable_ids=not case.name.startswith("bucket-"),
        max_ko=None if dl is None else dl["max_ko"],
    )


async def _drain_deadletter(factory: aio_keuss.Factory, model: Model) -> set[int]:
    """The deadletter queue's messages: each one deadlettered here, once, at tries 0."""
    if model.max_ko is None:
        return set()
    dq = await factory.queue("chaos-dl")
    found: set[int] = set()
    while got := await _taken_to_the_end(dq):
        for message in got:
            n = message.payload
            where = f"deadletter queue: {n!r} (id {message.id}, tries {message.tries})"
            if not isinstance(n, int) or n not in model.dead:
                model.violations.append(f"{where}: not deadlettered")
            elif n in found:
                model.violations.append(f"{where}: twice")
            elif message.tries != 0 or message.headers.get("x-dl-from-queue") != "chaos":
                model.violations.append(f"{where}: headers {message.headers}")
            if isinstance(n, int):
                found.add(n)
    missing = sorted(model.dead - found)
    if missing:
        model.violations.append(f"deadlettered, not in the deadletter queue: {missing}")
    return found


def _lost(model: Model) -> list[int]:
    return sorted(set(model.acked) - set(model.popped) - model.okd - model.dead)


async def _whereabouts(q: aio_keuss.Queue, model: Model) -> list[str]:
    """Where the lost messages are (state, tries, until when), to tell who holds one."""
    if not q.capabilities.peek:
        return []
    lines = []
    for n in _lost(model)[:10]:
        view = await q.find(model.acked[n])
        lines.append(f"{n} ({model.acked[n]}) is {view!r} at {time.time():.3f}")
    return lines


def _named(model: Model, lost: list[int]) -> list[int]:
    """The payloads a failure names (the first lost ones, those of its violations)."""
    named = set(lost[:10])
    for violation in model.violations[:10]:
        named.update(int(n) for n in re.findall(r"(?:of|:) \[?(\d+)", violation))
    return sorted(named & set(model.story))


def _check(model: Model, sizes: aio_keuss.Sizes, where: list[str] | None = None) -> None:
    """The end's checks: nothing acknowledged lost, nothing left (no reservation stuck).
    A failure tells the story of the payloads it names (``Model.note``) and ``where`` the
    lost ones are."""
    lost = _lost(model)
    # A second copy of a message (a cancelled push stored twice) shows as a delivery after
    # the first was popped or ok-ed, while it is held, or with tries that its kos do not
    # explain: the checks of Model.delivered.
    if model.violations or lost or sizes.total:
        pytest.fail(
            "\n".join(
                [
                    *model.violations,
                    f"lost (acknowledged, never delivered): {lost}",
                    f"left in the queue: {sizes}",
                    *(where or []),
                    *model.context,
                    *(f"{n}: {'; '.join(model.story[n])}" for n in _named(model, lost)),
                ]
            ),
            pytrace=False,
        )


def _give_back(model: Model, workers: list[Worker]) -> None:
    """The close of these workers' queue begins: what they hold is given back at no try."""
    for w in workers:
        w.given_back = True
        for n in w.holding:
            del model.held[n]
            model.note(n, f"given back by the close of task {w.i}'s queue")
        w.holding.clear()


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_workload_with_cancellations(
    connect: Connect, case: BackendCase, seed: int
) -> None:
    CALLS.clear()
    options = _options(seed)
    factory = await connect(**options)
    q = await factory.queue("chaos")
    # Where queues are shared, half the tasks work through a second factory (another
    # process's view: signals and batches of its own), whose close at the end gives back
    # what its tasks still hold.
    other = await connect(**options) if case.shared else None
    q2 = await other.queue("chaos") if other is not None else q
    model = _model(case, seed)
    reserve, ids = q.capabilities.reserve, q.capabilities.idempotent
    workers = [Worker(i, q2 if i % 2 else q, model, reserve=reserve, ids=ids) for i in range(TASKS)]
    await asyncio.gather(*(w.run(settle=w.q is q) for w in workers))
    if other is not None:
        _give_back(model, [w for w in workers if w.q is q2])
        await other.close()
    factory, q = await _settled(connect, options, factory, case)
    await _drain(q, model)
    await _drain_deadletter(factory, model)
    _check(model, await q.sizes(), await _whereabouts(q, model))
    _stats: dict[str, Any] = {
        "pushed": len(model.started),
        "acked": len(model.acked),
        "maybe": len(model.maybe),
        "deliveries": sum(model.seen.values()),
        "deadlettered": len(model.dead),
    }
    print(case.id, seed, _stats, CALLS)


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_workload_with_a_factory_closed_mid_run(
    connect: Connect, case: BackendCase, seed: int
) -> None:
    """As above, and the second factory is closed while its tasks' calls are in flight
    (after a random number of their steps): a push refused or cut by the close may be
    stored or not, a pop in flight returns what it took, a reserve in flight returns
    nothing once the close has begun, and what they held is given back at no try."""
    if not case.shared:
        pytest.skip("one factory's queues only")
    options = _options(seed)
    factory = await connect(**options)
    q = await factory.queue("chaos")
    other = await connect(**options)
    q2 = await other.queue("chaos")
    model = _model(case, seed)
    reserve, ids = q.capabilities.reserve, q.capabilities.idempotent
    workers = [Worker(i, q2 if i % 2 else q, model, reserve=reserve, ids=ids) for i in range(TASKS)]
    closers = [w for w in workers if w.q is q2]
    close_at = random.Random(seed).randint(1, STEPS * len(closers) // 2)
    due, steps = asyncio.Event(), 0

    def step() -> None:
        nonlocal steps
        steps += 1
        if steps >= close_at:
            due.set()

    running = asyncio.gather(
        *(w.run(settle=w.q is q, step=step if w.q is q2 else None) for w in workers)
    )

    async def close() -> None:
        await due.wait()
        _give_back(model, closers)
        began = time.time()
        await other.close()
        model.context.append(f"the second factory closed {began:.3f}-{time.time():.3f}")

    await asyncio.gather(running, close())
    factory, q = await _settled(connect, options, factory, case)
    await _drain(q, model)
    await _drain_deadletter(factory, model)
    _check(model, await q.sizes(), await _whereabouts(q, model))
