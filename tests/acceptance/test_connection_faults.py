"""Connection faults under load: nothing acknowledged is lost, nothing is held twice.

Every case runs producers and consumers of one backend through ``FaultProxy``
(``tests/fault_proxy.py``), which resets connections at random, with a seed, before a
request reaches the server, after the server ran it with its reply dropped, or half-way
through the reply, while producers push uniquely numbered messages (half with ids of their
own, half with generated ids) and consumers take them: ``consume()`` workers and raw
``reserve`` / ``ok`` loops on one queue, ``pop`` loops on another. The test keeps a ledger
and checks the library's promises:

- a push that returned is delivered (reserve) at least once: whatever a lost reply left
  reserved comes back once its reservation ends, so the run lasts at least one
  ``reserve_delay`` after the faults stop; on ``redis-reliable``, which has no per-message
  deadline, within about ``heartbeat_ttl``;
- a push that returned is popped at most once, and is either popped or still queued, or
  was taken by a pop whose reply was cut (at-most-once, as the README's delivery semantics
  say: "a lost reply to a pop ... cannot be replayed blindly"): at most as many such
  messages as pops that raised;
- a message is never handed to a second consumer while a reservation of it may still be
  running: a second delivery of an id less than ``reserve_delay`` after the first
  reserve was sent (the reservation's deadline is the server's time at that reserve plus
  ``reserve_delay``), with a quarter of it as margin, is a violation; so is a delivery of
  an id after an ``ok`` of it returned True, and an ``ok`` of a running reservation that
  returns False;
- every consumer ends once the messages are in, and every push and consumer gets
  ``KeussConnectionError`` (never another error) while the connection breaks.

The faults are drawn from a seeded generator, so the sequence of fault kinds is the same on
every run; which request each one hits depends on scheduling. Nothing waits for a fixed time:
every wait polls its condition, bounded generously only so a broken run cannot hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from backends import CASES, BackendCase, new_token
from fault_proxy import FaultProxy

import aio_keuss
from aio_keuss import KeussConnectionError

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SEED = int(os.environ.get("AK_FAULT_SEED", "20240611"))
N = 400
"""Messages pushed to each queue."""
RATE = 0.03
"""Probability that a request chunk is faulted while the faults last."""
RESERVE_DELAY = 6.0
MIN_FAULTS = 5
"""Faults a run injects at the least."""


def _case(name: str) -> BackendCase:
    case = next(c for c in CASES if c.id == name)
    reason = case.available()
    if reason:
        pytest.skip(reason)
    return case


def _through(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"{parts.hostname}:{port}"
    return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) > 1 else host))


async def until(condition: Callable[[], Any], within: float, what: str) -> None:
    """Poll ``condition``; the bound only keeps a broken run from hanging."""
    try:
        async with asyncio.timeout(within):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"not reached within {within} s: {what}")


@dataclass
class Ledger:
    reserve_delay: float
    unsure: frozenset[str] = frozenset()
    """Holders whose reservation's start is not known (a consume() worker's handler runs
    after its reserve's reply, however long that took): a redelivery after theirs is not
    checked."""
    acked: dict[str, int] = field(default_factory=dict)
    """Ids whose push returned, with their number."""
    delivered: Counter[str] = field(default_factory=Counter)
    numbers: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Number -> the ids it was delivered under (a push retried with a generated id may
    have stored it twice)."""
    tries: dict[int, int] = field(default_factory=Counter)
    """Number -> pushes of it that raised."""
    held: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Id -> (who holds it, the loop time its reserve was sent)."""
    oked: set[str] = field(default_factory=set)
    popped: set[str] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    """Calls that raised KeussConnectionError, by kind."""
    other_errors: list[str] = field(default_factory=list)
    copies_of_own_ids: bool = False
    """Whether a push of an id of its own whose insert went in, lost its reply and was
    consumed before the push looked may be stored again by its retry (MongoDB without
    transactions: claim and insert are two writes; the README's mongo section), and so
    delivered again after an ok of it, or popped again."""
    stored_again: set[str] = field(default_factory=set)
    """Such ids, delivered again after an ok of them returned True, or popped twice."""

    def reserved(self, message: aio_keuss.Message, who: str, sent: float) -> None:
        now = asyncio.get_running_loop().time()
        n = message.payload["n"]
        if message.id in self.oked and self.copies_of_own_ids and self.tries[n]:
            self.stored_again.add(message.id)  # a second copy, after the first was ok-ed
            self.oked.discard(message.id)
        if message.id in self.oked:
            pushes = f"its push raised {self.tries[n]} times"
            self.violations.append(
                f"{message.id} delivered to {who} after an ok returned True ({pushes})"
            )
        previous = self.held.get(message.id)
        if (
            previous is not None
            and previous[0] not in self.unsure
            and now - previous[1] < self.reserve_delay * 0.75
        ):
            self.violations.append(
                f"{message.id} delivered to {who} while {previous[0]} held it, "
                f"{now - previous[1]:.2f} s after its reserve was sent"
            )
        self.held[message.id] = (who, sent)
        self.delivered[message.id] += 1
        self.numbers[n].add(message.id)

    def ok_returned(self, message: aio_keuss.Message, who: str, result: bool) -> None:
        if result:
            if message.id in self.oked:
                self.violations.append(f"ok of {message.id} returned True twice")
            self.oked.add(message.id)
            self.held.pop(message.id, None)
            return
        sent = self.held.get(message.id, (who, 0.0))[1]
        since = asyncio.get_running_loop().time() - sent
        if since < self.reserve_delay * 0.75:
            self.violations.append(
                f"ok of {message.id} by {who} returned False while held ({since:.2f} s after"
                f" its reserve was sent; tries {message.tries}, delivered"
                f" {self.delivered[message.id]} times)"
            )

    def failed(self, kind: str, exc: BaseException) -> None:
        if isinstance(exc, KeussConnectionError):
            self.errors[kind] += 1
        else:
            self.other_errors.append(f"{kind}: {exc!r}")


@dataclass(frozen=True)
class Soak:
    backend: str
    reserve: bool = True
    own_ids: bool = True
    rate: float = RATE
    """redis-list's pushes and pops go in few, large batches: fewer requests to fault."""
    released_on_failed_ok: bool = False
    """redis-reliable: a reservation whose ok failed is given back by its consumer within
    about ``heartbeat_ttl`` (the README's redis-reliable section); it is no longer held."""
    factory_options: dict[str, Any] = field(default_factory=dict)
    copies_of_own_ids: bool = False
    """See :attr:`Ledger.copies_of_own_ids`."""


SOAKS = [
    Soak("redis-oq"),
    Soak("redis-reliable", released_on_failed_ok=True, factory_options={"heartbeat_ttl": 3.0}),
    Soak("redis-list", reserve=False, own_ids=False, rate=0.2),
    Soak("postgres"),
    Soak("mongo", copies_of_own_ids=True),
]


@contextlib.asynccontextmanager
async def _proxied(soak: Soak) -> AsyncIterator[tuple[FaultProxy, dict[str, Any], dict[str, Any]]]:
    """The case's options straight to the server, the same through a new proxy."""
    case = _case(soak.backend)
    direct = {**case.options(new_token()), **soak.factory_options}
    parts = urlsplit(direct["url"])
    proxy = FaultProxy(parts.hostname or "127.0.0.1", parts.port or 0)
    try:
        yield proxy, direct, {**direct, "url": _through(direct["url"], proxy.port)}
    finally:
        proxy.close()
        if case.cleanup is not None:
            await case.cleanup(direct)


def _mongo_paced_for_a_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shorten two waits a MongoDB run spends mostly idle, neither of them what is checked.

    - After a network error PyMongo marks the server unknown, and every operation waits in
      server selection for the monitor's next check, at least ``MIN_HEARTBEAT_INTERVAL``
      (0.5 s) after its last one (the Server Discovery and Monitoring specification's
      ``minHeartbeatFrequencyMS``): with some 70 faults that was 40 s of the producers' time,
      against 5 s at 0.05 s. The knob is the one PyMongo's own test suite turns; it is read
      when a client's monitors start, so it is set before connecting.
    - A pop whose delete was cut leaves its message claimed for ``CLAIM_LEASE`` (30 s), and
      the run waits for the pop queue to empty: the claim lapsing is what brings it back.
      A lease of ``RESERVE_DELAY`` still lapses the same way; it is the margin the reserve
      side already trusts for a take and its ok under load, and a pop slower than half of
      it renews its claim before the delete (``LATE_POP``), as with the longer lease.
    """
    import pymongo.common

    from aio_keuss.mongo import store

    monkeypatch.setattr(pymongo.common, "MIN_HEARTBEAT_INTERVAL", 0.05)
    monkeypatch.setattr(store, "CLAIM_LEASE", RESERVE_DELAY)
    monkeypatch.setattr(store, "LATE_POP", RESERVE_DELAY / 2)


async def _retrying(ledger: Ledger, kind: str, call: Callable[[], Awaitable[Any]]) -> Any:
    while True:
        try:
            return await call()
        except aio_keuss.KeussError as exc:
            ledger.failed(kind, exc)
            await asyncio.sleep(0.01)


async def _produce(q: aio_keuss.Queue, ledger: Ledger, numbers: range, own_ids: bool) -> None:
    for n in numbers:
        own = f"m{n}" if own_ids and n % 2 == 0 else None

        async def push(n: int = n, own: str | None = own) -> str:
            try:
                return await q.push({"n": n}, id=own)
            except BaseException:
                ledger.tries[n] += 1
                raise

        got = await _retrying(ledger, "push", push)
        if own is not None:
            assert got == own
        ledger.acked[got] = n


async def _reserve_loop(
    q: aio_keuss.Queue, ledger: Ledger, who: str, stop: asyncio.Event, released: bool
) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        sent = loop.time()
        try:
            message = await q.reserve(timeout=0.3)
        except aio_keuss.KeussError as exc:
            ledger.failed("reserve", exc)
            await asyncio.sleep(0.01)
            continue
        if message is None:
            continue
        ledger.reserved(message, who, sent)
        try:
            result = await q.ok(message)
        except aio_keuss.KeussError as exc:
            ledger.failed("ok", exc)
            if released:
                ledger.held.pop(message.id, None)
            continue
        ledger.ok_returned(message, who, result)


async def _pop_loop(q: aio_keuss.Queue, ledger: Ledger, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            message = await q.pop(timeout=0.3)
        except aio_keuss.KeussError as exc:
            ledger.failed("pop", exc)
            await asyncio.sleep(0.01)
            continue
        if message is None:
            continue
        if message.id in ledger.popped:
            if ledger.copies_of_own_ids and ledger.tries[message.payload["n"]]:
                ledger.stored_again.add(message.id)  # a second copy stored by a retry
            else:
                pushes = ledger.tries[message.payload["n"]]
                ledger.violations.append(
                    f"{message.id} popped twice (its push raised {pushes} times)"
                )
        ledger.popped.add(message.id)


async def _raw(backend: str, options: dict[str, Any], ids: list[str]) -> Any:
    """What the server holds for ``ids`` of queue rq, bypassing the library (diagnostics)."""
    if backend.startswith("mongo"):
        import pymongo

        client: Any = pymongo.AsyncMongoClient(options["url"])
        try:
            database = client[options["database"]]
            names = await database.list_collection_names()
            found: list[Any]
            found = []
            for name in names:
                found.append((name, await database[name].find({"_id": {"$in": ids}}).to_list()))
            return found
        finally:
            await client.close()
    return None


@pytest.mark.parametrize("soak", SOAKS, ids=lambda s: s.backend)
async def test_faults_lose_nothing_acknowledged_and_hand_nothing_out_twice(
    soak: Soak, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.ERROR)
    if soak.backend.startswith("mongo"):
        _mongo_paced_for_a_test(monkeypatch)
    loop = asyncio.get_running_loop()
    async with _proxied(soak) as (proxy, direct_options, options):
        factory = await aio_keuss.connect(soak.backend, poll_interval=1.0, **options)
        direct = await aio_keuss.connect(soak.backend, **direct_options)
        try:
            # A consume() handler cannot see when its reserve was sent: a reserve slowed by a
            # reconnection hands the message over with less than reserve_delay left (mongo
            # sets the deadline from the call's start), so its deliveries are not checked.
            reserve = Ledger(
                RESERVE_DELAY, frozenset({"consume"}), copies_of_own_ids=soak.copies_of_own_ids
            )
            pop = Ledger(RESERVE_DELAY, copies_of_own_ids=soak.copies_of_own_ids)
            stop = asyncio.Event()
            tasks: list[asyncio.Task[None]] = []
            consumer = None
            rq = pq = None
            if soak.reserve:
                rq = await factory.queue("rq", reserve_delay=RESERVE_DELAY)
                loop_time = loop.time

                async def handle(message: aio_keuss.Message) -> None:
                    reserve.reserved(message, "consume", loop_time())

                consumer = rq.consume(handle, concurrency=4)
                tasks += [
                    asyncio.create_task(
                        _reserve_loop(rq, reserve, f"loop{i}", stop, soak.released_on_failed_ok)
                    )
                    for i in range(3)
                ]
            pq = await factory.queue("pq", reserve_delay=RESERVE_DELAY)
            tasks += [asyncio.create_task(_pop_loop(pq, pop, stop)) for _ in range(3)]

            proxy.random(soak.rate, SEED)
            producers = [
                asyncio.create_task(_produce(pq, pop, range(i, N, 4), soak.own_ids))
                for i in range(4)
            ]
            if rq is not None:
                producers += [
                    asyncio.create_task(_produce(rq, reserve, range(i, N, 4), soak.own_ids))
                    for i in range(4)
                ]
            await asyncio.wait_for(asyncio.gather(*producers), 120)
            # A store that sends few, large requests (redis-reliable's fast lane) may have
            # drawn too few faults by now: the faults last, on the consumers' requests,
            # until there are enough to test anything.
            await until(lambda: len(proxy.injected) >= MIN_FAULTS, 120, "enough faults")
            proxy.calm()
            faults = Counter(kind for kind, _ in proxy.injected)

            direct_pq = await direct.queue("pq")
            sizes: list[int] = []

            async def pop_queue_empty() -> bool:
                sizes.append(await direct_pq.total_size())
                return sizes[-1] == 0

            async with asyncio.timeout(60):
                while not await pop_queue_empty():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            if rq is not None:
                direct_rq = await direct.queue("rq")
                bound = 30 + 3 * RESERVE_DELAY
                try:
                    async with asyncio.timeout(bound):
                        while not set(reserve.acked) <= set(reserve.delivered):  # noqa: ASYNC110
                            await asyncio.sleep(0.05)
                except TimeoutError:
                    missing = sorted(set(reserve.acked) - set(reserve.delivered))
                    found = [(i, await direct_rq.find(i)) for i in missing[:5]]
                    numbers = [
                        (
                            reserve.acked[i],
                            reserve.tries[reserve.acked[i]],
                            reserve.numbers.get(reserve.acked[i]),
                        )
                        for i in missing[:20]
                    ]
                    pytest.fail(
                        f"{soak.backend}: acknowledged pushes never reserved within {bound} s: "
                        f"{missing[:20]}; as stored: {found}; numbers, failed pushes and the "
                        f"ids they were delivered under: {numbers}; "
                        f"raw: {await _raw(soak.backend, direct_options, missing[:5])}"
                    )
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            if consumer is not None:
                await asyncio.wait_for(consumer.stop(), 30)
                assert consumer.status().state == "stopped"
        finally:
            await factory.close()
            await direct.close()

    print(
        f"\n{soak.backend}: faults {dict(faults)}, connections {proxy.connections}, "
        f"errors reserve-queue {dict(reserve.errors)} pop-queue {dict(pop.errors)}, "
        f"redelivered {sum(1 for c in reserve.delivered.values() if c > 1)}, "
        f"stored again {len(reserve.stored_again)} / {len(pop.stored_again)}, "
        f"pops lost {len(set(pop.acked) - pop.popped)}"
    )
    assert sum(faults.values()) >= MIN_FAULTS, "too few faults to test anything"
    assert not reserve.violations, reserve.violations[:20]
    assert not pop.violations, pop.violations[:20]
    assert not reserve.other_errors, reserve.other_errors[:10]
    assert not pop.other_errors, pop.other_errors[:10]
    lost_pops = set(pop.acked) - pop.popped
    assert len(lost_pops) <= pop.errors["pop"], (sorted(lost_pops), pop.errors)
    unknown = pop.popped - set(pop.acked)
    # a push retried after its reply was lost stored a copy under another generated id
    assert len(unknown) <= pop.errors["push"], (sorted(unknown), pop.errors)
    assert len(pop.stored_again) <= pop.errors["push"], pop.stored_again
    if soak.reserve:
        extra = set(reserve.delivered) - set(reserve.acked)
        assert len(extra) <= reserve.errors["push"], (sorted(extra), reserve.errors)
        # each stored again by a retry of a push that raised
        assert len(reserve.stored_again) <= reserve.errors["push"], reserve.stored_again


# Deterministic cases: the proxy cuts at one chosen point -------------------------------


def _mongo_command(command: str, collection: str) -> bytes:
    """The first element of a MongoDB command document as BSON: ``{command: collection}``."""
    name = collection.encode() + b"\x00"
    return b"\x02" + command.encode() + b"\x00" + struct.pack("<i", len(name)) + name


@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_push_whose_insert_and_give_back_failed_is_stored_by_its_retry(
    backend: str,
) -> None:
    """A push with an id of its own claims the id, then inserts the message; when the insert
    fails the claim is given back, so that the caller's retry is not taken for a duplicate.
    Here the connection is reset before the insert reaches the server and again before the
    give-back does: the claim stayed, and the retry returned the id without storing anything
    (an acknowledged push lost)."""
    async with (
        _proxied(Soak(backend)) as (proxy, _, options),
        aio_keuss.connect(backend, **options) as factory,
    ):
        q = await factory.queue("rq")
        prefix = "keuss_history" if backend == "mongo-history" else "keuss"
        proxy.arm("before", _mongo_command("insert", f"{prefix}_q_rq"))
        proxy.arm("before", _mongo_command("find", f"{prefix}_q_rq"))  # the give-back's read
        proxy.arm("before", _mongo_command("delete", f"{prefix}_dedup_rq"))  # its delete
        with pytest.raises(KeussConnectionError):
            await q.push({"n": 1}, id="m1")
        assert proxy.armed() == 0, proxy.injected
        retried = await _retrying(Ledger(RESERVE_DELAY), "push", lambda: q.push({"n": 1}, id="m1"))
        assert retried == "m1"
        message = await q.reserve(timeout=5)
        assert message is not None and message.id == "m1"


@pytest.mark.parametrize("backend", ["redis-oq"])
async def test_a_stats_flush_whose_reply_is_lost_is_not_counted_twice(backend: str) -> None:
    """The server applied a flush of the counters and its reply was lost with the
    connection: the batch went back into the buffer and the next flush added it again
    (PostgreSQL's case is in its own tests; MongoDB's is not fixed: the README says why)."""
    async with (
        _proxied(Soak(backend)) as (proxy, direct_options, options),
        aio_keuss.connect(backend, **options) as factory,
        aio_keuss.connect(backend, **direct_options) as direct,
    ):
        q = await factory.queue("counted")
        stored = await direct.queue("counted")

        async def stored_puts(expected: int) -> None:
            async with asyncio.timeout(30):
                while (await stored.stats())["put"] != expected:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)

        await q.push("first")
        await stored_puts(1)
        stats = factory.stats_store
        proxy.arm("after", b"}:stats")
        await q.push_many([1, 2])
        await until(lambda: proxy.armed() == 0, 30, "the flush's reply lost")
        # sent again until it works, then nothing of it left in this process
        await until(lambda: not stats._buffer and not stats._unsettled(), 30, "a flush landed")
        assert (await stored.stats())["put"] == 3
        assert (await q.stats())["put"] == 3
