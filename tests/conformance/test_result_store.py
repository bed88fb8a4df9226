"""The result store's contract (``aio_keuss.results.ResultStore``), the same on every
backend that has one: bodies are opaque bytes kept by (queue, id), a put again replaces
and renews, an expired result is never read, every id the library can hand out (up to
``MAX_KNOWN_ID_LENGTH`` characters, anything but NUL) keeps its own result, and batches
far past each database's per-statement limits go through. Through a real factory's
backend, as the queue layer reaches it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from backends import CASES, BackendCase
from conftest import usable_case
from polling import until

import aio_keuss
from aio_keuss.message import MAX_KNOWN_ID_LENGTH
from aio_keuss.results import ResultStore

pytestmark = pytest.mark.timeout(180)

Connect = Callable[..., Awaitable[aio_keuss.Factory]]
LONG = 3600.0
"""A ttl no test outlives."""

POLL_GUARD = 120.0
"""Hang guard of a wait for what a store does in its own time (an expiry)."""


STORE_CASES = ("memory", "redis-oq", "redis-oq-cluster", "postgres", "sqlite", "mongo")
"""One case per result store: a store belongs to a database, not to a backend (the
sharded, bucket and history backends of a database keep their results in its store)."""


@pytest.fixture(params=[c for c in CASES if c.id in STORE_CASES], ids=lambda c: c.id)
def case(request: pytest.FixtureRequest) -> BackendCase:
    return usable_case(request)


@pytest.fixture
async def store(connect: Connect) -> AsyncIterator[ResultStore]:
    factory = await connect(stats="memory")
    if not factory.capabilities.results:
        pytest.skip("this backend keeps no results")
    made = factory.backend.result_store()
    await made.open()
    yield made
    await made.close()


def not_on_a_cluster(case: BackendCase) -> None:
    """Tens of thousands of keys: the cluster cases run the same store's code as their
    single-Redis ones, and their cleanup (a scan of every node) would take half a minute."""
    if case.id.endswith("-cluster"):
        pytest.skip("run on the single Redis; the same code")


async def test_bodies_come_back_as_bytes_in_the_order_asked(store: ResultStore) -> None:
    every_byte = bytes(range(256)) * 4
    await store.put("q1", [("a", b"one"), ("b", b""), ("c", every_byte)], LONG)
    found = await store.get("q1", ["c", "missing", "a", "b", "a"])
    assert found == [every_byte, None, b"one", b"", b"one"]
    assert all(type(body) is bytes for body in found if body is not None)
    assert await store.get("q1", []) == []
    await store.put("q1", [], LONG)  # nothing to put: nothing happens


async def test_a_put_again_replaces_the_body_and_an_id_twice_keeps_its_last(
    store: ResultStore,
) -> None:
    await store.put("q1", [("a", b"first"), ("b", b"b1")], LONG)
    await store.put("q1", [("a", b"second"), ("b", b"b2"), ("a", b"third")], LONG)
    assert await store.get("q1", ["a", "b"]) == [b"third", b"b2"]


async def test_a_put_again_starts_the_ttl_anew(store: ResultStore) -> None:
    await store.put("q1", [("a", b"short"), ("b", b"short")], 0.05)
    await store.put("q1", [("a", b"long")], LONG)

    async def b_gone() -> bool:
        return await store.get("q1", ["b"]) == [None]

    await until(b_gone, POLL_GUARD)
    assert await store.get("q1", ["a"]) == [b"long"]


async def test_a_result_expires(store: ResultStore) -> None:
    await store.put("q1", [("a", b"x"), ("b", b"y")], 0.05)

    async def gone() -> bool:
        return await store.get("q1", ["a", "b"]) == [None, None]

    await until(gone, POLL_GUARD)


ODD_IDS = [
    "a:b",
    "a/b",
    "{x}y",
    "}",
    "a b",
    "line\nbreak",
    "tab\there",
    "%s%%",
    "'; drop table results; --",
    "\\",
    "\u202e\u2066",
    "\U0001f600" * 3,
    "é",
    "e\u0301",  # not normalized: another id than "é"
    "x" * MAX_KNOWN_ID_LENGTH,
    "\U0001f600" * MAX_KNOWN_ID_LENGTH,
]


async def test_every_id_the_library_hands_out_keeps_its_own_result(store: ResultStore) -> None:
    await store.put("q1", [(i, f"{n}".encode()) for n, i in enumerate(ODD_IDS)], LONG)
    found = await store.get("q1", ODD_IDS)
    assert found == [f"{n}".encode() for n in range(len(ODD_IDS))]
    await store.put("q1", [(ODD_IDS[-1], b"one")], LONG)  # one id alone: other paths
    assert await store.get("q1", [ODD_IDS[-1]]) == [b"one"]


async def test_queues_and_ids_a_joined_key_would_mix_stay_apart(store: ResultStore) -> None:
    pairs = [("q1", "a:b"), ("q1:a", "b"), ("q1", "a/b"), ("q1:result", "x"), ("q1", "}:x")]
    pairs += [("q1", "result:x"), ("q1.a", "b"), ("q1", ".a")]
    for n, (queue, message_id) in enumerate(pairs):
        await store.put(queue, [(message_id, str(n).encode())], LONG)
    for n, (queue, message_id) in enumerate(pairs):
        assert await store.get(queue, [message_id]) == [str(n).encode()]
    assert await store.get("q2", ["a:b"]) == [None]


async def test_a_batch_past_each_databases_statement_limits_goes_in_one_call(
    store: ResultStore, case: BackendCase
) -> None:
    """20,000 results: past Lua's unpack stack (about 8,000), SQLite's 32,766 bound
    variables (four a row), PostgreSQL's 65,535 parameters (four a row). Not on MongoDB,
    which has no such limit: a put is one bulk of upserts that the driver splits past
    100,000 writes or 48 MB (MongoDB manual, "MongoDB Limits and Thresholds"), and the
    get's limit, 16 MiB of ids, is crossed by the next test."""
    not_on_a_cluster(case)
    if case.id == "mongo":
        pytest.skip("no per-statement limit below 100,000 writes; the get's is tested next")
    results = [(f"id-{n}", n.to_bytes(4, "big")) for n in range(20_000)]
    await store.put("q1", results, LONG)
    found = await store.get("q1", [i for i, _ in results])
    assert found == [body for _, body in results]


async def test_a_get_of_ids_past_a_database_command_s_size_answers(
    store: ResultStore, case: BackendCase
) -> None:
    """Ids of the longest kind, more of them than one 16 MiB command holds (MongoDB's
    limit on a command document): a get still answers, in order. One id in ten is stored,
    spread over the whole get, so that every part of it is seen to find its own; storing
    all 17,000 crossed no other limit (a put's upserts go out as a document sequence, split
    by the driver past 48 MB) and cost most of the test's time on the suite's protocol
    server."""
    not_on_a_cluster(case)
    ids = [f"{n:08}" + "x" * (MAX_KNOWN_ID_LENGTH - 8) for n in range(17_000)]
    stored = ids[::10]
    await store.put("q1", [(i, i[:8].encode()) for i in stored], LONG)
    found = await store.get("q1", [*ids, "missing"])
    kept = set(stored)
    assert found == [*(i[:8].encode() if i in kept else None for i in ids), None]


async def test_large_bodies_round_trip(store: ResultStore) -> None:
    big = bytes(range(256)) * (4 * 2**20 // 256)  # 4 MiB each
    await store.put("q1", [("a", big), ("b", big[::-1])], LONG)
    assert await store.get("q1", ["a", "b"]) == [big, big[::-1]]


async def test_concurrent_puts_of_one_id_leave_one_whole_body(store: ResultStore) -> None:
    """Two deliveries of one message ok-ed at once: no error, and each id ends with the
    body of one put or the other, never a mix or nothing."""
    ids = [f"m{n}" for n in range(50)]

    async def put(tag: bytes, order: list[str]) -> None:
        await store.put("q1", [(i, tag + i.encode()) for i in order], LONG)

    await asyncio.gather(*(put(b"%d:" % k, ids if k % 2 else ids[::-1]) for k in range(8)))
    found = await store.get("q1", ids)
    for message_id, body in zip(ids, found, strict=True):
        assert body is not None
        tag, _, rest = body.partition(b":")
        assert rest == message_id.encode() and int(tag) in range(8)


async def test_a_cancelled_put_leaves_each_result_whole_or_absent(store: ResultStore) -> None:
    ids = [f"m{n}" for n in range(200)]
    await store.put("q1", [(i, b"old") for i in ids], LONG)
    for steps in range(8):  # cancelled at each of its first steps in turn
        put = asyncio.ensure_future(store.put("q1", [(i, b"new" * 100) for i in ids], LONG))
        for _ in range(steps):
            await asyncio.sleep(0)
        put.cancel()
        await asyncio.gather(put, return_exceptions=True)
        for body in await store.get("q1", ids):
            assert body in (b"old", b"new" * 100)
    await store.put("q1", [("after", b"x")], LONG)  # still usable, replies in step
    assert await store.get("q1", ["after", "m0"]) in ([b"x", b"old"], [b"x", b"new" * 100])


async def test_close_while_puts_and_their_cleanup_run(connect: Connect) -> None:
    """A store closed with puts under way (and the background cleanup the first put
    starts) closes without hanging and leaves no task behind."""
    factory = await connect(stats="memory")
    if not factory.capabilities.results:
        pytest.skip("this backend keeps no results")
    store = factory.backend.result_store()
    await store.open()
    await store.put("q1", [("a", b"x")], 0.01)  # the first put: a cleanup, where any
    puts = [asyncio.ensure_future(store.put("q1", [(f"m{n}", b"y")], LONG)) for n in range(5)]
    await asyncio.gather(*puts, return_exceptions=True)
    async with asyncio.timeout(60):
        await store.close()
    await asyncio.sleep(0)
    pending = [t for t in asyncio.all_tasks() if "result" in t.get_name().lower()]
    pending = [t for t in pending if not t.done()]
    assert pending == []


async def test_a_put_finishing_after_close_starts_no_background_work(connect: Connect) -> None:
    """A put still under way when the store closes (an ok racing the factory's close)
    must not start a cleanup that nothing will stop: it would run on a connection being
    closed, or be destroyed pending at exit."""
    factory = await connect(stats="memory")
    if not factory.capabilities.results:
        pytest.skip("this backend keeps no results")
    store = factory.backend.result_store()
    await store.open()
    await store.close()  # before its first put, which is when a store cleans up at once
    before = asyncio.all_tasks()
    await store.put("q1", [("b", b"y")], LONG)
    started = [t for t in asyncio.all_tasks() - before if not t.done() and _ours(t)]
    assert started == []


def _ours(task: asyncio.Task[Any]) -> bool:
    """A task of the library's (a driver's own, such as PyMongo's per-operation watchers,
    may still be ending when the put returns)."""
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and "aio_keuss" in code.co_filename


async def test_a_ttl_of_the_longest_time_option_keeps_and_a_tiny_one_expires(
    store: ResultStore,
) -> None:
    """``result_ttl`` is checked like the other time options: up to 1e9 s (about 31.7
    years), and any positive value however small."""
    await store.put("q1", [("long", b"x")], 1e9)
    await store.put("q1", [("tiny", b"y"), ("tiny2", b"z")], 1e-6)
    assert await store.get("q1", ["long"]) == [b"x"]

    async def gone() -> bool:
        return await store.get("q1", ["tiny", "tiny2"]) == [None, None]

    await until(gone, POLL_GUARD)
    assert await store.get("q1", ["long"]) == [b"x"]


async def _clean_up(store: ResultStore) -> None:
    """One full reclaim of expired results, by whichever method the store has."""
    for name in ("clean_up_once", "reclaim", "sweep"):
        method = getattr(store, name, None)
        if method is not None:
            await method()
            return
    pytest.skip("this store reclaims on its own (Redis expiry, the memory heap)")


async def test_a_cleanup_racing_puts_that_renew_expired_results_deletes_none_of_them(
    store: ResultStore,
) -> None:
    """Results expired, then put again (a redelivered message ok-ed again) while a
    cleanup deletes what has expired: every renewed result is still there after."""
    ids = [f"m{n}" for n in range(1500)]
    for round_ in range(3):
        await store.put("q1", [(i, b"old") for i in ids], 0.01)

        async def expired() -> bool:
            return set(await store.get("q1", ids)) == {None}

        await until(expired, POLL_GUARD)
        new = b"new%d" % round_
        halves = [ids[: len(ids) // 2], ids[len(ids) // 2 :]]
        await asyncio.gather(
            _clean_up(store),
            *(store.put("q1", [(i, new) for i in half], LONG) for half in halves),
            _clean_up(store),
        )
        assert set(await store.get("q1", ids)) == {new}


async def test_a_replace_writes_only_over_the_body_it_names(store: ResultStore) -> None:
    """A compare-and-set (how cancel requests are used up): each id's body is replaced
    only while it is the old one given; another body, a missing one or an expired one is
    left as it is (an expired one never comes back)."""
    await store.put("q1", [("a", b"old"), ("b", b"other"), ("gone", b"old")], LONG)
    await store.put("q1", [("gone", b"old")], 0.05)
    await store.replace(
        "q1",
        [("a", b"old", b"new"), ("b", b"old", b"new"), ("c", b"old", b"new")],
        LONG,
    )
    assert await store.get("q1", ["a", "b", "c"]) == [b"new", b"other", None]
    await store.replace("q2", [("a", b"new", b"elsewhere")], LONG)  # another queue's
    assert await store.get("q1", ["a"]) == [b"new"]
    assert await store.get("q2", ["a"]) == [None]

    async def expired() -> bool:
        return await store.get("q1", ["gone"]) == [None]

    await until(expired, POLL_GUARD)
    await store.replace("q1", [("gone", b"old", b"back")], LONG)
    assert await store.get("q1", ["gone"]) == [None]
    await store.replace("q1", [], LONG)  # nothing to replace: nothing happens


async def test_a_replace_sets_the_ttl_of_what_it_writes(store: ResultStore) -> None:
    await store.put("q1", [("a", b"old"), ("b", b"old")], LONG)
    await store.replace("q1", [("a", b"old", b"new"), ("b", b"old", b"short")], 0.05)

    async def gone() -> bool:
        return await store.get("q1", ["a", "b"]) == [None, None]

    await until(gone, POLL_GUARD)
