"""Conformance: a stored message that cannot be decoded (written by another program, or
corrupted) is delivered as stored, marked ``x-undecodable``, and never fails its batch.

Every backend runs it, skipping what it does not claim. The bad messages are written with the
store's own insert and bytes chosen here, as another program writing the same rows would.
Time bounds are generous functional limits, never performance assertions.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import pytest
from conftest import Connect, needs

import aio_keuss
from aio_keuss import Message
from aio_keuss.contract import Entry, Nack
from aio_keuss.ids import new_id
from aio_keuss.message import EMPTY_HEADERS, encode_payload
from aio_keuss.sharded.settings import shard_of
from aio_keuss.sharded.sweeper import Sweeper

pytestmark = pytest.mark.timeout(120)

UNDECODABLE = "x-undecodable"  # the headers' names, as users read them
RAW_HEADERS = "x-raw-headers"
BAD_PAYLOAD = b"not our tagged JSON"
BAD_HEADERS = b"[1, 2]"


async def plant(queue: aio_keuss.Queue, payload: bytes, headers: bytes) -> str:
    """Store a message with these stored bytes as they are; its id."""
    entry = Entry(new_id(), payload, headers)
    assert await queue._store.insert([entry]) == [True]  # type: ignore[attr-defined]
    return entry.id  # a bucket store names the slot it took


async def mixed(queue: aio_keuss.Queue) -> tuple[list[str], str, str]:
    """Good messages around a bad payload and bad headers: (good ids, bad payload's id, bad
    headers' id)."""
    good = [await queue.push({"n": 0})]
    bad_payload = await plant(queue, BAD_PAYLOAD, EMPTY_HEADERS)
    good.append(await queue.push({"n": 1}, headers={"k": "v"}))
    bad_headers = await plant(queue, encode_payload({"n": "h"}), BAD_HEADERS)
    good.append(await queue.push({"n": 2}))
    return good, bad_payload, bad_headers


def check_bad(by_id: dict[str, Message], bad_payload: str, bad_headers: str) -> None:
    payload_one = by_id[bad_payload]
    assert payload_one.payload == BAD_PAYLOAD and type(payload_one.payload) is bytes
    assert set(payload_one.headers) == {UNDECODABLE}
    assert str(payload_one.headers[UNDECODABLE]).startswith("payload: ")
    headers_one = by_id[bad_headers]
    assert headers_one.payload == {"n": "h"}
    assert headers_one.headers[RAW_HEADERS] == BAD_HEADERS.decode()
    assert str(headers_one.headers[UNDECODABLE]).startswith("headers: ")
    assert set(headers_one.headers) == {UNDECODABLE, RAW_HEADERS}


async def take_all(
    queue: aio_keuss.Queue, how: str, ids: set[str], bound: float = 30.0
) -> dict[str, Message]:
    """Take with ``pop_many`` / ``reserve_many`` until every id in ``ids`` came (a sharded
    queue hands out one shard's at a time), for up to ``bound`` seconds."""
    take = queue.pop_many if how == "pop" else queue.reserve_many
    got: dict[str, Message] = {}
    deadline = time.monotonic() + bound
    while not ids <= set(got) and time.monotonic() < deadline:
        for message in await take(10, timeout=1):
            assert message.id not in got
            got[message.id] = message
    return got


async def test_pop_many_delivers_a_batch_with_undecodable_messages(
    queue: aio_keuss.Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """One bad message used to fail the whole pop, whose messages were already deleted."""
    good, bad_payload, bad_headers = await mixed(queue)
    with caplog.at_level("WARNING", logger="aio_keuss.queue"):
        got = await take_all(queue, "pop", {*good, bad_payload, bad_headers})
    assert set(got) == {*good, bad_payload, bad_headers}
    assert [got[i].payload for i in good] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert got[good[1]].headers == {"k": "v"}
    check_bad(got, bad_payload, bad_headers)
    warned = [r.getMessage() for r in caplog.records if r.name == "aio_keuss.queue"]
    assert len(warned) == 2 and all("undecoded" in w for w in warned)
    assert await queue.total_size() == 0


async def test_reserve_many_delivers_a_batch_with_undecodable_messages(
    connect: Connect,
) -> None:
    """One bad message used to fail the whole reserve: the batch stayed reserved, delivered
    to nobody, until its reservations expired. Each is delivered, and can be ok-ed."""
    factory = await connect(poll_interval=5.0, reserve_delay=600)
    needs(factory, "reserve")
    queue = await factory.queue("q1")
    good, bad_payload, bad_headers = await mixed(queue)
    got = await take_all(queue, "reserve", {*good, bad_payload, bad_headers})
    assert set(got) == {*good, bad_payload, bad_headers}
    assert [got[i].payload for i in good] == [{"n": 0}, {"n": 1}, {"n": 2}]
    check_bad(got, bad_payload, bad_headers)
    assert [await queue.ok(m) for m in got.values()] == [True] * 5
    assert await queue.total_size() == 0


async def test_peek_shows_undecodable_messages(queue: aio_keuss.Queue) -> None:
    needs(queue, "peek")
    good, bad_payload, bad_headers = await mixed(queue)
    seen = {v.message.id: v.message for v in await queue.peek(10, state="all")}
    assert set(seen) == {*good, bad_payload, bad_headers}
    check_bad(seen, bad_payload, bad_headers)


async def test_consume_goes_on_past_an_undecodable_message(connect: Connect) -> None:
    """A consumer used to take the decoding failure for an outage of the backend, and stop
    delivering the batch that held it. The bad message reaches the handler; one that fails
    on it has it ko-ed, and deadlettered like any poison message (handled, where a queue
    only pops)."""
    factory = await connect(poll_interval=5.0, reserve_delay=600, deadletter={"max_ko": 0})
    queue = await factory.queue("work")
    dl = await factory.queue("__deadletter__")
    good, bad_payload, bad_headers = await mixed(queue)
    reserving = queue.capabilities.reserve
    seen: dict[str, Message] = {}
    handled: set[str] = set()

    async def handle(message: Message) -> None:
        seen[message.id] = message
        if reserving and message.id == bad_payload:
            raise ValueError("cannot use it")
        handled.add(message.id)

    wanted = {*good, bad_headers} if reserving else {*good, bad_payload, bad_headers}
    dead: list[Message] = []
    async with queue.consume(handle, concurrency=2, retry_delay=0.0):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if reserving and not dead:
                dead = await dl.pop_many(10, timeout=0)
            if handled == wanted and (dead or not reserving):
                break
            await asyncio.sleep(0.05)
    assert handled == wanted
    check_bad(seen, bad_payload, bad_headers)
    if reserving:
        assert len(dead) == 1 and dead[0].payload == BAD_PAYLOAD
        # its stored headers, {}, got the deadletter's; the payload is still not ours
        assert dead[0].headers["x-dl-from-queue"] == "work"
        assert str(dead[0].headers[UNDECODABLE]).startswith("payload: ")
    assert await queue.total_size() == 0


async def test_a_list_element_not_in_our_framing_is_delivered_whole(
    queue: aio_keuss.Queue,
) -> None:
    """redis-list keeps a message's id and headers framed in its list element: one pushed
    there by another program failed the whole pop, after the pop had removed it and the
    others. Each is delivered, the bad ones whole as bytes under an id of their own."""
    store = queue._store  # type: ignore[attr-defined]
    if not hasattr(store, "_key") or queue.capabilities.reserve:
        pytest.skip("redis-list's framing")
    not_utf8_id = struct.pack(">dHI", time.time(), 2, 2) + b"\xff\xfe{}Jnull"
    raw = [b"hi", b"a plain text from another program", not_utf8_id]
    first = await queue.push("first")
    await store._execute("LPUSH", store._key, *raw)
    last = await queue.push("last")
    got = await take_all(queue, "pop", {first, last}, bound=10)
    assert set(got) >= {first, last} and len(got) == 5
    assert got[first].payload == "first" and got[last].payload == "last"
    others = [m for m in got.values() if m.id not in (first, last)]
    assert sorted(m.payload for m in others) == sorted(raw)
    assert all(str(m.headers[UNDECODABLE]).startswith("element: ") for m in others)
    assert await queue.total_size() == 0


async def test_a_redis_oq_record_not_in_our_framing_is_delivered_whole(
    queue: aio_keuss.Queue,
) -> None:
    """redis-oq keeps tries and headers framed in the hash value of a message's record:
    one written there by another program failed the whole pop, after the pop had deleted
    it and the others. It is delivered whole as bytes, under its own id."""
    store = queue._store  # type: ignore[attr-defined]
    if type(store).__name__ != "RedisOQStore":
        pytest.skip("redis-oq's framing")
    first = await queue.push("first")
    due, records = store._keys[0], store._keys[1]
    for bad_id, raw in (("bad-1", b"no framing at all"), ("bad-2", b"x:y:z")):
        await store._backend.execute("HSET", records, bad_id, raw)
        await store._backend.execute("ZADD", due, 0, bad_id)
    got = await take_all(queue, "pop", {first, "bad-1", "bad-2"}, bound=10)
    assert set(got) == {first, "bad-1", "bad-2"}
    assert got[first].payload == "first"
    assert got["bad-1"].payload == b"no framing at all" and got["bad-2"].payload == b"x:y:z"
    assert all(str(got[i].headers[UNDECODABLE]).startswith("record: ") for i in ("bad-1", "bad-2"))
    assert await queue.total_size() == 0


@pytest.mark.parametrize("again", ["lone", "batch"])
async def test_a_redis_oq_record_not_in_our_framing_is_acknowledged_and_counts_its_tries(
    connect: Connect, again: str
) -> None:
    """Its holder's ok and ko never passed the scripts' guard (the tries read from the
    record), so it came back for ever; and once its reservation lapsed, counting that try
    failed every reserve of the queue ("attempt to perform arithmetic on a nil value").
    The scripts now count it as a record of its bytes whole, which it becomes when one of
    them first writes it; a record whose framing still tells its tries keeps them."""
    factory = await connect(poll_interval=5.0, reserve_delay=0.5)
    queue = await factory.queue("foreign")
    store = queue._store  # type: ignore[attr-defined]
    if type(store).__name__ != "RedisOQStore":
        pytest.skip("redis-oq's framing")
    due, records = store._keys[0], store._keys[1]
    raw = {"bare": b"no framing at all", "acked": b"x:y:z", "kept": b"7:2:{}untagged"}
    for bad_id, record in raw.items():
        await store._backend.execute("HSET", records, bad_id, record)
        await store._backend.execute("ZADD", due, 0, bad_id)
    first = await take_all(queue, "reserve", set(raw))
    assert {i: (m.payload, m.tries) for i, m in first.items()} == {
        "bare": (raw["bare"], 0),
        "acked": (raw["acked"], 0),
        "kept": (b"untagged", 7),
    }  # "kept" is in our framing: its payload alone is not ours
    assert await queue.ok(first["acked"])
    assert await queue.ko(first["kept"], delay=0) is aio_keuss.KoResult.ROLLED_BACK
    # "bare" is left to lapse: the next reserve counts that try
    take = queue.reserve if again == "lone" else lambda **kw: _first(queue.reserve_many(1, **kw))
    back: dict[str, Message] = {}
    deadline = time.monotonic() + 30
    while set(back) != {"bare", "kept"} and time.monotonic() < deadline:
        message = await take(timeout=1)
        if message is not None:
            back[message.id] = message
    assert back["bare"].tries == 1 and back["bare"].payload == raw["bare"]
    assert str(back["bare"].headers[UNDECODABLE]).startswith("record: ")
    assert back["kept"].tries == 8 and back["kept"].payload == b"untagged"
    assert all([await queue.ok(m) for m in back.values()])
    assert await queue.total_size() == 0


# Ids a push here refuses (check_id: printable, no spaces) but a store may still hold:
# characters a newer Python's Unicode knows and this one's does not (unassigned here, so
# not printable; a zero-width space and a byte order mark stand for them), and what another
# program wrote (a space, a tab).
STORED_BY_OTHERS = ["order-\u200b-1", "x\u2028y", "bom\ufeff", "sp ace", "tab\there"]


async def test_every_id_a_store_hands_out_can_be_acknowledged(queue: aio_keuss.Queue) -> None:
    """ok, ko, find and remove took an id only if this Python found it printable: a message
    pushed by a newer Python with a character this one's Unicode lacks, or by another
    program with a space, was delivered, then refused by its ok (InvalidIdError), and came
    back for ever."""
    needs(queue, "reserve")
    needs(queue, "idempotent")  # a store that names every message itself holds no such id
    for message_id in STORED_BY_OTHERS:
        entry = Entry(message_id, encode_payload(message_id), EMPTY_HEADERS, dedup=True)
        assert await queue._store.insert([entry]) == [True]  # type: ignore[attr-defined]
    got: dict[str, Message] = {}
    deadline = time.monotonic() + 30
    while len(got) < len(STORED_BY_OTHERS) and time.monotonic() < deadline:
        for message in await queue.reserve_many(10, timeout=1):
            got[message.id] = message
    assert len(got) == len(STORED_BY_OTHERS)
    # (redis-sharded gives an id its scripts cannot name, an ASCII space in it, a new one
    # of its own, and delivers the record whole, marked: see its section of the README)
    kept = {m.id: m.payload for m in got.values() if UNDECODABLE not in m.headers}
    assert all(message_id == payload for message_id, payload in kept.items())
    first, *others = got.values()
    assert await queue.ko(first, delay=0) is aio_keuss.KoResult.ROLLED_BACK
    assert all([await queue.ok(m) for m in others])
    again = await queue.reserve(timeout=10)
    assert again is not None and again.id == first.id
    if queue.capabilities.peek:
        assert (await queue.find(again.id)) is not None
    assert await queue.ok(again)
    assert await queue.total_size() == 0


async def _first(taking: Any) -> Message | None:
    got = await taking
    return got[0] if got else None


# redis-sharded keeps a message as a hash of fields (id, payload, headers, tries, mature time,
# end of life, place): its records here are ours rewritten field by field, as another program
# (or corruption) would leave them, each next to good messages

SHARDED_RAW: dict[str, dict[str, bytes | None]] = {  # None: the field deleted
    "bare": {"p": b"an id and a payload, no more", "h": None, "t": None, "m": None},
    "tries": {"p": b"tries not a number", "h": b'{"k": "v"}', "t": b"x"},
    "ttl": {"p": b"end of life not a number", "t": b"7", "e": b"never"},
    "mature": {"p": b"mature time not a number", "m": b"soon"},
    "place": {"p": b"place not a number", "o": b"first"},
}
SHARDED_TRIES = {"bare": 0, "tries": 0, "ttl": 7, "mature": 0, "place": 0}
"""The tries each is delivered with: those its fields still tell, else none."""


async def rewrite_sharded(queue: aio_keuss.Queue, message_id: str, **fields: bytes | None) -> None:
    """Rewrite fields of a redis-sharded message's record in place (None: delete it)."""
    store = queue._store  # type: ignore[attr-defined]
    storage = store._storage
    base, keys = storage._shard(queue.name, shard_of(message_id, store.shards))
    at = await storage._backend.execute("HGET", keys[1], message_id)
    key = base + "r:" + (at.decode() if isinstance(at, bytes) else str(at))
    for field, value in fields.items():
        if value is None:
            await storage._backend.execute("HDEL", key, field)
        else:
            await storage._backend.execute("HSET", key, field, value)


def needs_redis_sharded(queue: aio_keuss.Queue) -> None:
    store = queue._store  # type: ignore[attr-defined]
    storage = getattr(store, "_storage", None)
    if type(storage).__name__ != "RedisShardStorage":
        pytest.skip("redis-sharded's framing")


async def plant_sharded(queue: aio_keuss.Queue) -> list[str]:
    """The records of SHARDED_RAW, each pushed by us then rewritten, between good messages;
    the good ones' ids."""
    needs_redis_sharded(queue)
    good = [await queue.push({"n": 0})]
    for name, fields in SHARDED_RAW.items():
        await queue.push("ours", id=name)
        await rewrite_sharded(queue, name, **fields)
        good.append(await queue.push({"n": len(good)}))
    return good


def check_sharded(
    got: dict[str, Message], names: Any = SHARDED_RAW, bump: int = 0, tries: Any = None
) -> None:
    """Each record delivered whole: its payload field as bytes, marked, with its tries
    (``tries`` reads them, where not the message's own) and ``bump`` more."""
    for name in names:
        message = got[name]
        assert message.payload == SHARDED_RAW[name]["p"], name
        assert str(message.headers[UNDECODABLE]).startswith("record: "), name
        counted = message.tries if tries is None else tries(message)
        assert counted == SHARDED_TRIES[name] + bump, name
    if "tries" in names:  # its stored headers, kept beside the mark
        assert got["tries"].headers[RAW_HEADERS] == '{"k": "v"}'


async def test_a_redis_sharded_record_not_in_our_framing_is_popped_whole(
    queue: aio_keuss.Queue,
) -> None:
    """A missing or unreadable field failed the whole pop (in the client, after the script
    had deleted the fired records: lost), or, for an end of life that is not a number, every
    fetch of its shard in the script. Each is delivered whole, as bytes, marked."""
    good = await plant_sharded(queue)
    got = await take_all(queue, "pop", {*good, *SHARDED_RAW})
    assert set(got) == {*good, *SHARDED_RAW}
    assert [got[i].payload for i in good] == [{"n": n} for n in range(len(good))]
    check_sharded(got)
    assert await queue.total_size() == 0


@pytest.mark.parametrize("again", ["lone", "batch"])
async def test_a_redis_sharded_record_not_in_our_framing_is_acknowledged_and_counts_its_tries(
    connect: Connect, again: str
) -> None:
    """Reserved, each is delivered whole and stored in our framing (so the same on every
    delivery): ok and ko pass the guard, and one left to lapse comes back through the
    sweeper and the shovel with its try counted."""
    factory = await connect(poll_interval=5.0, reserve_delay=2.0)
    queue = await factory.queue("foreign")
    good = await plant_sharded(queue)
    first = await take_all(queue, "reserve", {*good, *SHARDED_RAW})
    check_sharded(first)
    assert all([await queue.ok(first[i]) for i in (*good, "mature", "place")])
    assert await queue.ko(first["ttl"], delay=0) is aio_keuss.KoResult.ROLLED_BACK
    # "bare" and "tries" are left to lapse: the sweeper sidelines them, the shovel counts a try
    take = queue.reserve if again == "lone" else lambda **kw: _first(queue.reserve_many(1, **kw))
    back = await ok_as_they_come(queue, take, {"bare", "tries", "ttl"})
    check_sharded(back, ("bare", "tries", "ttl"), bump=1)
    assert await queue.total_size() == 0


async def ok_as_they_come(queue: aio_keuss.Queue, take: Any, ids: set[str]) -> dict[str, Message]:
    """Take one at a time until every id in ``ids`` came, ok-ing each at once (so none
    lapses while the others are awaited), for up to 30 seconds."""
    back: dict[str, Message] = {}
    deadline = time.monotonic() + 30
    while set(back) != ids and time.monotonic() < deadline:
        message = await take(timeout=1)
        if message is not None:
            assert message.id not in back
            back[message.id] = message
            assert await queue.ok(message), message.id
    return back


async def test_a_redis_sharded_record_not_in_our_framing_is_deadlettered_whole(
    connect: Connect,
) -> None:
    factory = await connect(poll_interval=5.0, reserve_delay=600, deadletter={"max_ko": 0})
    queue = await factory.queue("foreign")
    dl = await factory.queue("__deadletter__")
    good = await plant_sharded(queue)
    got = await take_all(queue, "reserve", {*good, *SHARDED_RAW})
    assert all([await queue.ok(got[i]) for i in good])
    for name in SHARDED_RAW:
        assert await queue.ko(got[name]) is aio_keuss.KoResult.DEADLETTERED
    dead = await take_all(dl, "pop", set(SHARDED_RAW))
    check_sharded(dead, bump=1, tries=lambda m: m.headers["x-dl-tries"])
    assert all(m.headers["x-dl-from-queue"] == "foreign" for m in dead.values())
    assert await queue.total_size() == 0


async def test_a_redis_sharded_record_unreadable_while_held_is_acknowledged_or_comes_back(
    connect: Connect,
) -> None:
    """Tries or a reservation deadline that are not numbers, written while the message is
    held: its holder's ok and ko never passed the guard, the sweep of its shard failed on
    every pass ("attempt to compare number with nil"), and the shovel of its shard did once
    it was sidelined ("hash value is not an integer"). Tries that cannot be read count as
    none, a deadline that cannot be read as passed."""
    factory = await connect(poll_interval=5.0, reserve_delay=3.0)
    queue = await factory.queue("held")
    needs_redis_sharded(queue)
    ids = {name: await queue.push(name, id=name) for name in ("acked", "koed", "tries", "due")}
    got = await take_all(queue, "reserve", set(ids))
    for name in ("acked", "koed", "tries"):
        await rewrite_sharded(queue, name, t=b"not a number")
    await rewrite_sharded(queue, "due", x=b"soon")
    assert await queue.ok(got["acked"])
    assert await queue.ko(got["koed"], delay=0) is aio_keuss.KoResult.ROLLED_BACK
    back = await ok_as_they_come(queue, queue.reserve, {"koed", "tries", "due"})
    assert {i: (m.payload, m.tries) for i, m in back.items()} == {
        "koed": ("koed", 1),
        "tries": ("tries", 1),
        "due": ("due", 1),
    }
    assert await queue.total_size() == 0


async def sharded_key(queue: aio_keuss.Queue, message_id: str) -> tuple[Any, list[str], str]:
    """(the storage's backend, the shard's keys, the key of the message's record)."""
    store = queue._store  # type: ignore[attr-defined]
    storage = store._storage
    base, keys = storage._shard(queue.name, shard_of(message_id, store.shards))
    at = await storage._backend.execute("HGET", keys[1], message_id)
    return storage._backend, keys, base + "r:" + (at.decode() if isinstance(at, bytes) else str(at))


@pytest.mark.parametrize("how", ["pop", "reserve"])
@pytest.mark.parametrize("kind", ["not-utf8", "no-id", "control"])
async def test_a_redis_sharded_record_whose_id_is_not_usable_is_delivered_under_a_new_one(
    connect: Connect, how: str, kind: str
) -> None:
    """An id that is not UTF-8 failed the whole batch in the client (for a pop, after the
    script had deleted it and the others: lost), and a record with no id was passed over,
    left behind for ever. Each is delivered whole under a new id, which its holder's ok
    acknowledges, and leaves nothing behind."""
    factory = await connect(poll_interval=5.0, reserve_delay=600)
    queue = await factory.queue("ids")
    needs_redis_sharded(queue)
    good = [await queue.push({"n": 0})]
    stored: dict[str, bytes] = {}
    planted = []
    for name in (kind, kind + "-too"):
        await queue.push(name, id=name)
        backend, keys, key = await sharded_key(queue, name)
        stored[name] = await backend.execute("HGET", key, "p")
        planted.append(key)
        raw = {"not-utf8": b"\xff\xfe", "control": b"a\nb"}.get(kind)
        raw = raw and raw + name[len(kind) :].encode()
        await backend.execute("HDEL", keys[1], name)
        if raw is None:
            await backend.execute("HDEL", key, "i")
        else:  # indexed under its stored id, as another program would
            await backend.execute("HSET", key, "i", raw)
            await backend.execute("HSET", keys[1], raw, key.rsplit(":", 1)[1])
        good.append(await queue.push({"n": len(good)}))
    got: dict[str, Message] = {}
    deadline = time.monotonic() + 30
    while len(got) < len(good) + len(stored) and time.monotonic() < deadline:
        taken = await (queue.pop_many if how == "pop" else queue.reserve_many)(10, timeout=1)
        got.update((m.id, m) for m in taken)
    assert set(good) <= set(got) and len(got) == len(good) + len(stored)
    assert [got[i].payload for i in good] == [{"n": n} for n in range(len(good))]
    others = {m.payload: m for m in got.values() if m.id not in good}
    assert set(others) == set(stored.values())
    for message in others.values():
        assert str(message.headers[UNDECODABLE]).startswith("record: "), message.headers
    if how == "reserve":
        assert all([await queue.ok(m) for m in got.values()])
    assert await queue.total_size() == 0
    store = queue._store  # type: ignore[attr-defined]
    for shard in range(store.shards):
        assert await backend.execute("HLEN", store._storage._shard(queue.name, shard)[1][1]) == 0
    assert [await backend.execute("EXISTS", key) for key in planted] == [0] * len(planted)


@pytest.mark.parametrize(
    ("where", "field"), [("held", "i"), ("held", "x"), ("sidelined", "i"), ("scheduled", "i")]
)
async def test_a_redis_sharded_record_stripped_where_it_waits_comes_back(
    connect: Connect, case: Any, where: str, field: str
) -> None:
    """A record another program stripped of its id while it was held, in the sideline or in
    the schedule was passed over by the sweep, the shovel or the load of matured records
    (left there for ever, counted as reserved or scheduled), and its lost id's index entry
    refused every later push of that id; a held one stripped of its reservation deadline
    was passed over too. Each comes back (whole under a new id, if it lost its own), its
    stale holder's ok refused, and its old id can be pushed again."""
    if case.name != "redis-sharded":
        pytest.skip("redis-sharded's framing")
    # no dedup window: an id is refused only while queued (what the lost id's entry said)
    factory = await connect(poll_interval=5.0, reserve_delay=0.2, sweeper=False, dedup_window=0)
    queue = await factory.queue("stripped")
    backend_ = factory.backend
    leader = Sweeper(backend_.storage, backend_.sharded, lambda *_: None)  # type: ignore[attr-defined]
    shards = queue._store.shards  # type: ignore[attr-defined]
    await queue.push("kept", id="kept", delay=0.2 if where == "scheduled" else 0.0)
    backend, keys, _ = await sharded_key(queue, "kept")
    base = keys[0][:-1]
    seen: set[str] = set()

    async def record_key() -> str:
        at = (await backend.execute("HGET", keys[1], "kept")).decode()
        key = base + {"s": "s:" + at[1:], "z": "q:" + at[1:]}.get(at[0], "r:" + at)
        seen.add(key)
        return key

    held = None if where == "scheduled" else await queue.reserve(timeout=5)
    if held is not None:
        assert held.id == "kept"
        await record_key()
    if where == "sidelined":
        deadline = time.monotonic() + 30
        while not await leader.sweep_queue(queue.name, shards):
            assert time.monotonic() < deadline, "never swept"
            await asyncio.sleep(0.05)
    key = await record_key()
    stored = await backend.execute("HGET", key, "p")
    assert await backend.execute("HDEL", key, field) == 1
    if held is not None:
        assert not await queue.ok(held)
    back = None
    deadline = time.monotonic() + 30
    while back is None:
        assert time.monotonic() < deadline, "never came back"
        await leader.sweep_queue(queue.name, shards)
        await leader.shovel_queue(queue.name, shards)
        back = await queue.reserve(timeout=0.1)
    if field == "i":
        assert back.id != "kept" and back.payload == stored
        assert "(no id)" in str(back.headers[UNDECODABLE])
    else:
        assert (back.id, back.payload) == ("kept", "kept")
    assert back.tries == (0 if where == "scheduled" else 1)
    assert await queue.ok(back)
    await queue.push("again", id="kept")
    again = await queue.reserve(timeout=5)
    assert again is not None and (again.id, again.payload) == ("kept", "again")
    assert await queue.ok(again)
    assert await queue.total_size() == 0
    for shard in range(shards):
        index = queue._store._storage._shard(queue.name, shard)[1][1]  # type: ignore[attr-defined]
        assert await backend.execute("HLEN", index) == 0
    assert [await backend.execute("EXISTS", k) for k in sorted(seen)] == [0] * len(seen)
    await leader.stop()


async def test_a_redis_sharded_key_of_another_type_put_back_where_a_reservation_was_noted(
    connect: Connect, case: Any
) -> None:
    """A reservation the sweep stepped over is noted for a later look; released unseen, its
    record goes back to its slot, before the fire pointer. A key of another type written
    there was adopted by that later look as a lapsed reservation: sidelined although
    never fired, and the count of reservations went below zero. It is delivered whole by
    a fetch instead, and nothing counts it as held."""
    if case.name != "redis-sharded":
        pytest.skip("redis-sharded's framing")
    factory = await connect(poll_interval=5.0, sweeper=False)
    queue = await factory.queue("noted")
    store = queue._store  # type: ignore[attr-defined]
    storage = store._storage
    entries = [Entry(f"held{k}~0", b'J"x"', EMPTY_HEADERS) for k in range(2)]
    await storage.load(queue.name, 0, entries, 0.0, None)
    held = (await storage.fire(queue.name, 0, 2, 600.0)).messages
    assert (await storage.sweep(queue.name, 0, 1000)).stopped  # within their deadline: noted
    released = await storage.rollback(
        queue.name, 0, [Nack(m.id, 0, 0.0, False) for m in held], None
    )
    assert released.results == [aio_keuss.KoResult.ROLLED_BACK] * 2
    base, keys = storage._shard(queue.name, 0)
    backend = storage._backend
    assert await backend.execute("HGET", keys[1], "held1~0") == b"1"  # back in its slot
    await backend.execute("SET", base + "r:1", b"plain bytes")  # behind a live one
    await backend.execute("ZADD", keys[4], 0, "1")  # its noted deadline, as if passed
    step = await storage.sweep(queue.name, 0, 1000)
    assert (step.moved, step.sidelined) == (0, 0)
    sizes = await storage.sizes(queue.name, 0)
    assert (sizes.fired, sizes.sidelined, sizes.ready) == (0, 0, 2)
    got = (await storage.fire(queue.name, 0, 2, None)).messages
    assert [m.payload for m in got] == [b'J"x"', b"Bplain bytes"]


async def test_a_redis_sharded_record_key_of_another_type_is_delivered_whole(
    connect: Connect,
) -> None:
    """A record's key holding a string or a list (another program's, or corrupted) failed
    every fetch of its shard (WRONGTYPE): one key blocked the shard for ever. A string is
    delivered as its bytes, any other type as its DUMP serialization, under a new id;
    one written over a held record comes back through the sweeper, its stale holder's
    ok refused."""
    factory = await connect(poll_interval=5.0, reserve_delay=1.0)
    queue = await factory.queue("types")
    needs_redis_sharded(queue)
    good = [await queue.push({"n": 0})]
    for name in ("string", "list"):
        await queue.push(name, id=name)
        backend, _, key = await sharded_key(queue, name)
        await backend.execute("DEL", key)
        if name == "string":
            await backend.execute("SET", key, b"plain bytes")
        else:
            await backend.execute("RPUSH", key, b"a", b"b")
        good.append(await queue.push({"n": len(good)}))
    held = await queue.push("held", id="held")
    got: dict[str, Message] = {}
    deadline = time.monotonic() + 30
    while len(got) < len(good) + 3 and time.monotonic() < deadline:
        got.update((m.id, m) for m in await queue.reserve_many(10, timeout=1))
    assert set(good) | {held} <= set(got) and len(got) == len(good) + 3
    assert [got[i].payload for i in good] == [{"n": n} for n in range(len(good))]
    others = [m for m in got.values() if m.id not in good and m.id != held]
    assert sorted(str(m.headers[UNDECODABLE]) for m in others) == [
        "record: a list, not a hash (its DUMP serialization)",
        "record: a string, not a hash",
    ]
    assert b"plain bytes" in [m.payload for m in others]
    assert all([await queue.ok(m) for m in (*others, *(got[i] for i in good))])
    _, _, key = await sharded_key(queue, held)
    await backend.execute("DEL", key)
    await backend.execute("SET", key, b"written over")
    assert not await queue.ok(got[held])
    back: dict[str, Message] = {}
    deadline = time.monotonic() + 30
    while not back and time.monotonic() < deadline:
        message = await queue.reserve(timeout=1)
        if message is not None:
            back[message.id] = message
            assert await queue.ok(message)
    assert [m.payload for m in back.values()] == [b"written over"]
    assert await queue.total_size() == 0


async def test_a_redis_sharded_record_losing_its_payload_while_held_is_deadlettered(
    connect: Connect,
) -> None:
    """Its payload or headers deleted while it is held, a ko past max_ko handed the client
    a nil for them (the reply shifted: the ko failed). The deadletter copy is the record
    whole: its payload field (empty when gone) as bytes, marked."""
    factory = await connect(poll_interval=5.0, reserve_delay=600, deadletter={"max_ko": 0})
    queue = await factory.queue("gone")
    needs_redis_sharded(queue)
    dl = await factory.queue("__deadletter__")
    ids = [await queue.push(name, id=name) for name in ("no-p", "no-h", "neither")]
    got = await take_all(queue, "reserve", set(ids))
    await rewrite_sharded(queue, "no-p", p=None)
    await rewrite_sharded(queue, "no-h", h=None)
    await rewrite_sharded(queue, "neither", p=None, h=None)
    for name in ids:
        assert await queue.ko(got[name]) is aio_keuss.KoResult.DEADLETTERED, name
    dead = await take_all(dl, "pop", set(ids))
    assert set(dead) == set(ids)
    assert dead["no-p"].payload == b"" and dead["neither"].payload == b""
    assert dead["no-h"].payload == encode_payload("no-h")
    for message in dead.values():
        assert str(message.headers[UNDECODABLE]).startswith("record: "), message.headers
        assert message.headers["x-dl-from-queue"] == "gone"
    assert await queue.total_size() == 0


# stored headers another program may write: the deadletter and move headers are added to them

STORED_HEADERS = [b"", b"{}", b'{"a": "b"}', b" \n", b"{ }", b'{"a": "b"}\n', b' {"a": "b" }\r\n']
STORED_IDS = ["empty", "empty-object", "object", "space", "spaced-empty", "newline", "spaced"]


@pytest.mark.parametrize("stored", STORED_HEADERS, ids=STORED_IDS)
async def test_deadletter_adds_its_headers_to_any_stored_headers(
    connect: Connect, stored: bytes
) -> None:
    """Headers stored as empty bytes (ours are ``{}``, another program may write nothing):
    PostgreSQL's append took a substring of length -1, so the ko failed, every time, and
    the message stayed reserved; elsewhere the deadletter copy's headers came out as
    ``,"x-dl-from-queue":...}``, undecodable."""
    factory = await connect(poll_interval=5.0, reserve_delay=600, deadletter={"max_ko": 0})
    needs(factory, "reserve")
    queue = await factory.queue("work")
    dl = await factory.queue("__deadletter__")
    await plant(queue, encode_payload({"n": 1}), stored)
    message = await queue.reserve(timeout=30)
    assert message is not None and message.payload == {"n": 1}
    assert UNDECODABLE not in message.headers  # empty stored headers are none
    assert await queue.ko(message) is aio_keuss.KoResult.DEADLETTERED
    dead = await dl.pop(timeout=30)
    assert dead is not None and dead.payload == {"n": 1}
    assert UNDECODABLE not in dead.headers, dead.headers
    assert dead.headers["x-dl-from-queue"] == "work"
    assert dead.headers.get("a") == ("b" if b'"a"' in stored else None)
    assert await queue.total_size() == 0


@pytest.mark.parametrize("stored", STORED_HEADERS, ids=STORED_IDS)
async def test_move_adds_its_headers_to_any_stored_headers(connect: Connect, stored: bytes) -> None:
    """The same append, for a move with headers."""
    factory = await connect(poll_interval=5.0, reserve_delay=600)
    needs(factory, "reserve", "move")
    queue = await factory.queue("from")
    other = await factory.queue("to")
    await plant(queue, encode_payload({"n": 1}), stored)
    message = await queue.reserve(timeout=30)
    assert message is not None
    assert await queue.move(message, "to", headers={"m": 1}) is not None
    moved = await other.pop(timeout=30)
    assert moved is not None and moved.payload == {"n": 1}
    assert UNDECODABLE not in moved.headers, moved.headers
    assert moved.headers["m"] == 1
    assert moved.headers.get("a") == ("b" if b'"a"' in stored else None)
    assert await queue.total_size() == 0
