"""The event loop ending under a factory nobody closed: ``asyncio.run(main())`` returning (or
raising) while a pop or a reserve is in flight.

``asyncio.run`` then cancels every task left and runs the loop until they have ended (Python's
asyncio documentation, "Runners"). On stores whose calls cannot be interrupted (Redis's own
connection, SQLite's database thread) the store takes the messages whatever happens to the
caller; the cancelled tasks must give them back before they end, since nothing runs once the
loop is closed. Each case runs a script in a process of its own, holds the reply of one batch
of pops (or reserves) taken by a batch task until ``asyncio.run`` has cancelled everything,
and then counts, from this process, what the callers got and what is still in the queue:
every message is one or the other, exactly once.

The reply is held, not raced: on Redis and PostgreSQL the script stops reading its
connections (the commands are on the wire, the server runs them, their replies wait in the
socket); on MongoDB, whose driver resumes reading on every call, a proxy in threads of its
own holds the server's replies from the moment a batch sends its claim (the find before it
has been answered); on SQLite it holds the file's write lock from a connection of its own.
A task that only waits releases either when ``asyncio.run`` cancels it, after ``main`` has
returned.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from backends import CASES, BackendCase, new_token

import aio_keuss

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = 30

_SCRIPT = r"""
import asyncio, json, sqlite3, sys
import aio_keuss

backend, options, kind, ending = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
if backend.startswith("mongo"):
    from reply_gate import ReplyGate  # holds the server's replies in threads of its own

    gate = ReplyGate(*options["url"].rsplit("/", 1)[-1].split(":"))
    options["url"] = f"mongodb://127.0.0.1:{gate.port}/?directConnection=true"
got = []
kept = []  # the loop holds its tasks weakly: one nothing else refers to may be collected


async def main():
    factory = await aio_keuss.connect(backend, **options)  # never closed: the point
    q = await factory.queue("jobs", reserve_delay=3600.0)
    await q.push_many([{"n": n} for n in range(int(sys.argv[5]))])
    store = q._store
    if backend == "sqlite":
        blocker = sqlite3.connect(options["path"], timeout=60, isolation_level=None)
        hold = lambda: blocker.execute("BEGIN IMMEDIATE")
        release = lambda: blocker.execute("ROLLBACK")
    elif backend == "postgres":
        # the pool's connections stop reading: the statement runs and commits, its rows
        # wait in the socket. Prepared first on each (asyncpg waits for the server's
        # description of a new statement before it sends it to run).
        warm = await factory.queue("warm")
        for _ in range(3):
            await asyncio.gather(
                *(warm.pop_many(2, timeout=0) for _ in range(8)),
                *(warm.reserve_many(2, timeout=0) for _ in range(8)),
            )
        holders = factory.backend._pool._holders
        def transports():
            return [h._con._transport for h in holders if h._con is not None]
        hold = lambda: [t.pause_reading() for t in transports()]
        release = lambda: [t.resume_reading() for t in transports() if not t.is_closing()]
    elif backend.startswith("mongo"):
        # a batch of n claims its messages with an update_many after a find: the gate shuts
        # as the claim is sent, so the find's reply has come and the claim's waits
        hold, release = gate.shut, gate.open
    else:
        transport = factory.backend._lane._protocol.transport
        hold, release = transport.pause_reading, transport.resume_reading
    callers = set()
    in_flight = asyncio.Event()
    owner, name = (store._coll, "update_many") if backend.startswith("mongo") else (store, kind)
    primitive = getattr(owner, name)

    async def held(*args, **kwargs):
        if asyncio.current_task() not in callers and not in_flight.is_set():
            hold()  # a batch task's round trip: its reply waits until the loop ends
            in_flight.set()
        return await primitive(*args, **kwargs)

    setattr(owner, name, held)

    async def caller():
        messages = await (q.pop_many(2) if kind == "get" else q.reserve_many(2))
        got.extend(m.id for m in messages)

    forever = asyncio.Event()

    async def releaser():
        try:
            await forever.wait()
        finally:
            release()  # cancelled by asyncio.run, after main ended

    kept.append(asyncio.create_task(releaser()))
    # More callers than the store has slots: the first run in their own tasks, the rest
    # queue up and go in a batch task as soon as a slot frees.
    for _ in range(store.batch_concurrency + 4):
        callers.add(asyncio.create_task(caller()))
    kept.extend((factory, *callers))
    await in_flight.wait()
    if ending == "raise":
        raise RuntimeError("main failed")


try:
    asyncio.run(main())
except RuntimeError as exc:
    assert str(exc) == "main failed", exc
print(json.dumps({"got": got}), flush=True)
"""

_CASES = {case.id: case for case in CASES}


async def _run_script(script: str, *args: str) -> tuple[dict[str, Any], str]:
    """Run ``script`` in a process of its own: the JSON record it prints last, and its
    standard error, once it exited cleanly with every task ended in the loop."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "tests")))},
    )
    out, err = await asyncio.wait_for(process.communicate(), 90)
    assert process.returncode == 0, err.decode()
    assert b"destroyed but it is pending" not in err, err.decode()  # all ended in the loop
    record: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return record, err.decode()


async def _left_in_jobs(case: BackendCase, options: dict[str, Any]) -> tuple[list[str], int]:
    """From this process: the ids ready in the queue ``jobs`` (taken), and its size after."""
    factory = await aio_keuss.connect(case.name, **options)
    try:
        q = await factory.queue("jobs", reserve_delay=3600.0)
        queued: list[str] = []
        while batch := await q.pop_many(100, timeout=0):
            queued.extend(m.id for m in batch)
        return queued, (await q.sizes()).total
    finally:
        await factory.close()


@pytest.fixture(
    params=[
        pytest.param((backend, kind, ending), id=f"{backend}-{kind}-{ending}")
        for backend in (
            "redis-oq",
            "redis-reliable",
            "sqlite",
            "postgres",
            "mongo",
            "mongo-history",
        )
        for kind in ("get", "reserve")
        for ending in ("return", "raise")
    ]
)
async def setup(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[BackendCase, dict[str, Any], str, str]]:
    backend, kind, ending = request.param
    case = _CASES[backend]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    options = case.options(new_token())
    if backend == "sqlite":
        options["busy_timeout"] = 60.0
    yield case, options, kind, ending
    if case.cleanup is not None:
        await case.cleanup(options)


async def test_messages_taken_as_the_loop_ends_are_delivered_or_still_queued(
    setup: tuple[BackendCase, dict[str, Any], str, str],
) -> None:
    """The messages a batch had taken when ``asyncio.run`` cancelled its callers (and the
    batch task itself) are back in the queue, popped ones as they were and reservations
    released, ready at once: none is lost, none is both delivered and queued."""
    case, options, kind, ending = setup
    record, err = await _run_script(
        _SCRIPT, case.name, json.dumps(options), kind, ending, str(MESSAGES)
    )
    got: list[str] = record["got"]
    queued, total = await _left_in_jobs(case, options)
    assert len(set(got)) == len(got)
    assert not set(got) & set(queued), "delivered and still queued"
    # what a caller got was delivered (a reservation it holds stays reserved); the rest
    # is ready now, not reserved for the batch nobody received
    assert len(got) + len(queued) == MESSAGES, (len(got), len(queued), err)
    assert total == (len(got) if kind == "reserve" else 0)


_CONSUMER_SCRIPT = r"""
import asyncio, json, sys
import aio_keuss

backend, options = sys.argv[1], json.loads(sys.argv[2])
started = []
kept = []  # the loop holds its tasks weakly: what nothing else refers to may be collected


async def main():
    factory = await aio_keuss.connect(backend, **options)  # never closed: the point
    q = await factory.queue("jobs", reserve_delay=3600.0)
    await q.push_many([{"n": n} for n in range(int(sys.argv[3]))])
    running = asyncio.Event()

    async def handler(message):
        started.append(message.id)
        running.set()
        await asyncio.Event().wait()  # runs until the loop ends

    kept.extend((factory, q.consume(handler, prefetch=5)))
    await running.wait()  # one message handled, the rest of the fetch prefetched


asyncio.run(main())
print(json.dumps({"started": started}), flush=True)
"""


@pytest.mark.parametrize("backend", ["redis-list", "redis-oq", "sqlite"])
async def test_a_consumer_s_prefetched_messages_go_back_as_the_loop_ends(backend: str) -> None:
    """``main`` returns with a consumer running and its factory never closed: the messages
    it had prefetched, and not started, go back before the loop ends (popped ones on
    ``redis-list`` were lost, reservations held until ``reserve_delay``); the one whose
    handler was running is released where there are reservations, and was delivered (at
    most once) where there are not."""
    case = _CASES[backend]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    options = case.options(new_token())
    try:
        record, err = await _run_script(
            _CONSUMER_SCRIPT, case.name, json.dumps(options), str(MESSAGES)
        )
        started: list[str] = record["started"]
        assert len(started) == 1
        queued, total = await _left_in_jobs(case, options)
        reserve = backend != "redis-list"
        assert len(queued) == MESSAGES - (0 if reserve else 1), (len(queued), err)
        assert total == 0
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)


_LAST_READ_SCRIPT = r"""
import asyncio, json, sys
import aio_keuss
from reply_gate import ReplyGate

backend, options, kind = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
gate = ReplyGate(*options["url"].rsplit("/", 1)[-1].split(":"))
options["url"] = f"mongodb://127.0.0.1:{gate.port}/?directConnection=true"
got = []
kept = []  # the loop holds its tasks weakly: what nothing else refers to may be collected


async def main():
    factory = await aio_keuss.connect(backend, **options)  # never closed: the point
    q = await factory.queue("jobs", reserve_delay=3600.0)
    await q.push_many([{"n": n} for n in range(int(sys.argv[4]))])
    coll = q._store._coll
    find_one = coll.find_one
    in_flight = asyncio.Event()

    def held(*args, **kwargs):
        # the batch's last read (what matures next: it got fewer than it asked for), sent
        # once its claim is done: its reply waits until the loop ends
        if type(asyncio.current_task()).__name__ == "_ToTheEnd" and not in_flight.is_set():
            gate.shut()
            in_flight.set()
        return find_one(*args, **kwargs)

    coll.find_one = held

    async def caller():
        messages = await (q.pop_many(10) if kind == "get" else q.reserve_many(10))
        got.extend(m.id for m in messages)

    async def releaser():
        try:
            await asyncio.Event().wait()
        finally:
            gate.open()  # cancelled by asyncio.run, after main ended

    kept.append(asyncio.create_task(releaser()))
    kept.extend((factory, asyncio.create_task(caller())))
    await in_flight.wait()


asyncio.run(main())
print(json.dumps({"got": got}), flush=True)
"""


@pytest.mark.parametrize("kind", ["get", "reserve"])
@pytest.mark.parametrize("backend", ["mongo", "mongo-history"])
async def test_a_batch_s_read_after_its_claim_cut_as_the_loop_ends_loses_nothing(
    backend: str, kind: str
) -> None:
    """A batch that got fewer messages than it asked for reads what matures next once its
    claim (and a pop's delete) is done: ``asyncio.run`` cancelling PyMongo's task under that
    read ended the batch with a CancelledError, and what it had taken with it (popped ones
    were lost, reservations held for ``reserve_delay``)."""
    case = _CASES[backend]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    options = case.options(new_token())
    try:
        record, err = await _run_script(
            _LAST_READ_SCRIPT, case.name, json.dumps(options), kind, "3"
        )
        got: list[str] = record["got"]
        queued, total = await _left_in_jobs(case, options)
        assert not set(got) & set(queued), "delivered and still queued"
        assert len(got) + len(queued) == 3, (len(got), len(queued), err)
        assert total == (len(got) if kind == "reserve" else 0)
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)


_LONE_SCRIPT = r"""
import asyncio, json, sys, time
import aio_keuss
from pymongo import AsyncMongoClient
from reply_gate import ReplyGate

backend, options, kind, held_names, done = sys.argv[1:6]
options = json.loads(options)
direct = AsyncMongoClient(options["url"])  # not through the gate
gate = ReplyGate(*options["url"].rsplit("/", 1)[-1].split(":"))
options["url"] = f"mongodb://127.0.0.1:{gate.port}/?directConnection=true"
got = []
kept = []  # the loop holds its tasks weakly: what nothing else refers to may be collected


async def main():
    factory = await aio_keuss.connect(backend, **options)  # never closed: the point
    q = await factory.queue("jobs", reserve_delay=3600.0)
    await q.push_many([{"n": n} for n in range(3)])
    coll = q._store._coll
    # connections enough in the pool: one opened once the gate is shut would wait for the
    # reply to its handshake, and the command held would never be sent
    await asyncio.gather(*(coll.find_one({"_id": n}) for n in range(8)))
    in_flight = asyncio.Event()

    def holding(primitive):
        def held(*args, **kwargs):
            # the first command of these the store's get / reserve task sends: its reply
            # waits until the loop ends
            if type(asyncio.current_task()).__name__ == "_ToTheEnd" and not in_flight.is_set():
                gate.shut()
                in_flight.set()
            return primitive(*args, **kwargs)

        return held

    for name in held_names.split(","):
        setattr(coll, name, holding(getattr(coll, name)))

    async def caller():
        message = await (q.pop() if kind == "get" else q.reserve())
        if message is not None:
            got.append(message.id)

    async def releaser():
        try:
            await asyncio.Event().wait()
        finally:
            gate.open()  # cancelled by asyncio.run, after main ended

    kept.append(asyncio.create_task(releaser()))
    kept.extend((factory, asyncio.create_task(caller())))
    try:
        await asyncio.wait_for(in_flight.wait(), 30)
    except TimeoutError:
        sys.exit(f"the {kind} of one sent none of {held_names}")
    # the server has run the command whose reply is held: 2 messages left ready (the
    # take) or in the collection (the delete), read beside the gate
    mine = direct[options["database"]][coll.name]
    deadline = time.monotonic() + 30
    while True:
        now = time.time()
        where = {"mature": {"$lte": now}} if done == "taken" else {}
        if await mine.count_documents(where) == 2:
            break
        if time.monotonic() > deadline:
            sys.exit(f"the server did not run the held command ({done})")
        await asyncio.sleep(0.01)
    await direct.close()


asyncio.run(main())
print(json.dumps({"got": got}), flush=True)
"""


@pytest.mark.parametrize(
    ("backend", "kind", "held", "done"),
    [
        # the command that takes the message: a plain pop's claim (before: its
        # findAndModify remove), a history pop's findAndModify marking it processed
        ("mongo", "get", "find_one_and_update,find_one_and_delete", "taken"),
        ("mongo-history", "get", "find_one_and_update,find_one_and_delete", "taken"),
        # a plain pop's delete of the message it claimed
        ("mongo", "get", "delete_one,delete_many", "deleted"),
        # a reserve's findAndModify (before: held until reserve_delay, an hour here)
        ("mongo", "reserve", "find_one_and_update", "taken"),
        ("mongo-history", "reserve", "find_one_and_update", "taken"),
    ],
)
async def test_a_lone_take_cut_as_the_loop_ends_loses_nothing(
    backend: str, kind: str, held: str, done: str
) -> None:
    """A pop of one message alone (no batch: one findAndModify) whose reply ``asyncio.run``
    cut, cancelling PyMongo's task that read it, ended with a CancelledError: the message
    it had taken on the server was lost (a reserve's stayed reserved for ``reserve_delay``).
    Now it is back in the queue, ready (or was delivered)."""
    case = _CASES[backend]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    options = case.options(new_token())
    try:
        record, err = await _run_script(
            _LONE_SCRIPT, case.name, json.dumps(options), kind, held, done
        )
        got: list[str] = record["got"]
        queued, total = await _left_in_jobs(case, options)
        assert not set(got) & set(queued), "delivered and still queued"
        assert len(got) + len(queued) == 3, (len(got), len(queued), err)
        assert total == (len(got) if kind == "reserve" else 0)
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)
