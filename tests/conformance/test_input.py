"""Bad input is refused with a typed error before anything is written; good input
round-trips exactly, types included.

Payloads and headers (a property-based test on every backend, plus the edge cases named),
delays, timeouts and options past their bound, hand-built messages given to ok / ko /
remove, and URLs each backend must refuse before connecting.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import subprocess
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from backends import REDIS_URL, BackendCase, _drop_redis_prefix, new_token
from conftest import Connect, needs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aio_keuss
from aio_keuss import Message
from aio_keuss.message import (
    MAX_KNOWN_ID_LENGTH,
    MAX_TRIES,
    check_id,
    check_ids,
    decode_message,
    encode_headers,
    encode_payload,
    encode_payloads,
)
from aio_keuss.mongo.connection import check_mongo_url
from aio_keuss.options import MAX_COUNT, MAX_SECONDS, brief, check_seconds
from aio_keuss.redis.connection import check_redis_url

pytestmark = pytest.mark.timeout(120)


class Color(enum.Enum):
    RED = 1


class Size(enum.IntEnum):
    BIG = 2


class Mode(enum.StrEnum):
    FAST = "fast"


class Tagged(dict[str, Any]):
    pass


class Blob(bytes):
    pass


class Ratio(float):
    pass


def _nested_lists(depth: int) -> Any:
    return functools.reduce(lambda inner, _: [inner], range(depth), 1)


# the rules, written independently of the library -----------------------------------------


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _storable(value: object, whole: bool = True) -> bool:
    """Whether the contract says ``value`` round-trips (else it must be refused)."""
    kind = type(value)
    if kind is bytes:
        return whole
    if kind is dict:
        return all(
            type(k) is str and _utf8(k) and _storable(v, False)
            for k, v in value.items()  # type: ignore[attr-defined]
        )
    if kind is list:
        return all(_storable(v, False) for v in value)  # type: ignore[attr-defined]
    if kind is str:
        return _utf8(value)  # type: ignore[arg-type]
    if kind is bool or value is None:
        return True
    if kind is int:
        return -(2**63) <= value < 2**64  # type: ignore[operator]
    if kind is float:
        return math.isfinite(value)  # type: ignore[arg-type]
    return False


def _storable_headers(headers: object) -> bool:
    if headers is None:
        return True
    if type(headers) is not dict:
        return False
    for key, value in headers.items():
        if type(key) is not str or not _utf8(key) or type(value) not in (str, int, float, bool):
            return False
        if type(value) is not bool and not _storable(value, False):
            return False
    return True


def same(a: object, b: object) -> bool:
    """Equality that also compares types (1 == 1.0 == True in Python), key order and the
    sign of zero."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        assert isinstance(b, float)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def test_same_is_type_strict() -> None:
    assert same({"a": [1, 2.5, None]}, {"a": [1, 2.5, None]})
    assert not same(1, 1.0) and not same(1, True) and not same(0.0, -0.0)
    assert not same({"a": 1, "b": 2}, {"b": 2, "a": 1}) and not same([1], (1,))


# 8. payloads and headers -----------------------------------------------------------------

_NON_FINITE = st.sampled_from([math.nan, -math.nan, math.inf, -math.inf])
_BAD_LEAVES = st.one_of(
    _NON_FINITE,
    st.uuids(),
    st.sampled_from([Color.RED, Size.BIG, Mode.FAST, orjson.Fragment(b"[1]")]),
    st.binary(max_size=8),  # nested bytes
    st.binary(max_size=8).map(bytearray),
    st.sampled_from([2**64, -(2**63) - 1, 2**100]),
    st.sampled_from(["\ud800", "a\udfffb"]),  # lone surrogates
    st.frozensets(st.integers(0, 3), max_size=2),
)
_GOOD_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["null", "NaN", "", "\x00", "\u2028", "é😀"]),
)
_KEYS = st.one_of(
    st.text(max_size=6),
    st.text(max_size=6),
    st.text(max_size=6),
    st.sampled_from([1, Mode.FAST, "\ud800"]),  # refused: non-str, str subclass, not UTF-8
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(_KEYS, children, max_size=4),
        st.lists(children, max_size=4),
        st.dictionaries(_KEYS, children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4), children, max_size=2).map(Tagged),
    )


def _good_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    )


# Half the payloads are made of what round-trips only, half may hold anything.
_GOOD_NESTED = st.recursive(_GOOD_LEAVES, _good_containers, max_leaves=10)
_ANY_NESTED = st.recursive(
    st.one_of(_GOOD_LEAVES, _GOOD_LEAVES, _GOOD_LEAVES, _BAD_LEAVES), _containers, max_leaves=8
)
PAYLOADS = st.one_of(
    _GOOD_NESTED,
    _GOOD_NESTED,
    _ANY_NESTED,
    _ANY_NESTED,
    st.binary(max_size=16),  # bytes as the whole payload: round-trips
    st.one_of(  # would come back as bytes
        st.binary(max_size=8).map(bytearray),
        st.binary(max_size=8).map(memoryview),
        st.binary(max_size=8).map(Blob),
    ),
)
_GOOD_HEADER_VALUES = st.one_of(
    st.text(max_size=8),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
)
_ANY_HEADER_VALUES = st.one_of(
    _GOOD_HEADER_VALUES,
    _GOOD_HEADER_VALUES,
    _NON_FINITE,
    st.sampled_from([None, Size.BIG, Mode.FAST, 2**64, [1], {"x": 1}, b"b", "\ud800"]),
)
HEADERS = st.one_of(
    st.none(),
    st.dictionaries(st.text(max_size=6), _GOOD_HEADER_VALUES, max_size=4),
    st.dictionaries(st.text(max_size=6), _GOOD_HEADER_VALUES, max_size=4),
    st.dictionaries(_KEYS, _ANY_HEADER_VALUES, max_size=4),
)


@settings(
    max_examples=40,
    deadline=None,
    database=None,  # no example database: nothing to clean up
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=PAYLOADS, headers=HEADERS)
async def test_payloads_and_headers_round_trip_exactly_or_are_refused(
    queue: aio_keuss.Queue, payload: Any, headers: Any
) -> None:
    payload_ok, headers_ok = _storable(payload), _storable_headers(headers)
    before = await queue.total_size()
    if payload_ok and headers_ok:
        await queue.push(payload, headers=headers)
        message = await queue.pop(timeout=10)
        assert message is not None
        assert same(message.payload, payload), (message.payload, payload)
        assert same(message.headers, headers or {}), (message.headers, headers)
    else:
        wanted: Any = (
            aio_keuss.InvalidHeadersError if payload_ok
            else aio_keuss.InvalidPayloadError if headers_ok
            else (aio_keuss.InvalidPayloadError, aio_keuss.InvalidHeadersError)
        )  # fmt: skip
        with pytest.raises(wanted):
            await queue.push(payload, headers=headers)
        with pytest.raises(wanted):
            await queue.push_many(["fine", payload], headers=headers)
    assert await queue.total_size() == before


REFUSED_PAYLOADS: list[tuple[str, Any]] = [
    ("NaN", math.nan),
    ("inf", math.inf),
    ("-inf", -math.inf),
    ("NaN in a list", [1.0, math.nan]),
    ("inf deep in a dict", {"a": {"b": [None, -math.inf]}}),
    ("NaN beside None", {"a": None, "b": math.nan}),
    ("UUID", uuid.uuid4()),
    ("nested UUID", {"id": uuid.uuid4()}),
    ("Enum", Color.RED),
    ("IntEnum", Size.BIG),
    ("StrEnum in a list", [Mode.FAST]),
    ("tuple", (1, 2)),
    ("nested tuple", {"t": (1,)}),
    ("bytearray", bytearray(b"x")),
    ("memoryview", memoryview(b"x")),
    ("bytes subclass", Blob(b"x")),
    ("nested bytes", {"b": b"x"}),
    ("bytes in a list", [b"x"]),
    ("set", {1, 2}),
    ("frozenset in a list", [frozenset()]),
    ("int key", {1: "a"}),
    ("StrEnum key", {Mode.FAST: 1}),
    ("int beyond 64 bits", 2**64),
    ("negative int beyond 64 bits", [-(2**63) - 1]),
    ("lone surrogate", "\ud800"),
    ("lone surrogate key", {"\udfff": 1}),
    ("orjson Fragment", [orjson.Fragment(b"1")]),
    ("dict subclass", OrderedDict(a=1)),
    ("float subclass", {"x": Ratio(0.5)}),
    ("object", object()),
    ("too deep", _nested_lists(300)),  # orjson's limit is 255 levels
]


@pytest.mark.parametrize(
    "payload", [p for _, p in REFUSED_PAYLOADS], ids=[n for n, _ in REFUSED_PAYLOADS]
)
def test_payloads_that_would_change_are_refused(payload: Any) -> None:
    with pytest.raises(aio_keuss.InvalidPayloadError):
        encode_payload(payload)


def test_the_nested_bytes_refusal_says_whole_bytes_payloads_work() -> None:
    with pytest.raises(aio_keuss.InvalidPayloadError, match="only as the whole payload"):
        encode_payload({"b": b"x"})
    assert encode_payload(b"x")  # the whole payload: fine


@pytest.mark.parametrize(
    "payload", [{"a": [1, 2.5, None]}, "x" * 10_000, b"\x00raw", None, [{"deep": {"k": True}}]]
)
def test_a_decoded_message_is_the_one_the_constructor_makes(payload: Any) -> None:
    """Deliveries are built through the slots, not ``__init__``: the same value, still
    frozen."""
    mature = 1_764_000_000.25
    made = decode_message("m1", encode_payload(payload), b'{"h":1}', 3, mature)
    expected = Message("m1", payload, {"h": 1}, 3, datetime.fromtimestamp(mature, UTC))
    assert made == expected and repr(made) == repr(expected)
    assert type(made.payload) is type(payload) and made.mature.tzinfo is UTC
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.tries = 4  # type: ignore[misc]


def _encoded_one_by_one(payloads: list[Any]) -> list[bytes] | str:
    """What ``encode_payload`` makes of each, or the refusal of the first one refused."""
    try:
        return [encode_payload(p) for p in payloads]
    except aio_keuss.InvalidPayloadError as exc:
        return str(exc)


def _encoded_together(payloads: list[Any]) -> list[bytes] | str:
    try:
        return encode_payloads(payloads)
    except aio_keuss.InvalidPayloadError as exc:
        return str(exc)


# Rows of a DataFrame: flat dicts of leaves, the batch path's case, a bad value rare enough
# that a batch often holds one alone (a NaN, a UUID, an Enum: what orjson writes anyway)
_ROW_VALUES = st.one_of(*[_GOOD_LEAVES] * 8, _BAD_LEAVES)
_COLUMNS = st.sampled_from(["id", "name", "value", "x"])
_ROWS = st.dictionaries(_COLUMNS, _ROW_VALUES, max_size=4)
_FLOAT_ROWS = st.dictionaries(_COLUMNS, st.one_of(*[_GOOD_LEAVES] * 8, _NON_FINITE), max_size=4)
_BATCHES = st.one_of(
    st.lists(_ROWS, min_size=8, max_size=24),
    st.lists(_FLOAT_ROWS, min_size=8, max_size=24),
    st.lists(st.dictionaries(_COLUMNS, _GOOD_NESTED, max_size=4), min_size=8, max_size=16),
    st.lists(st.dictionaries(_COLUMNS, _ANY_NESTED, max_size=3), min_size=8, max_size=16),
    st.lists(st.dictionaries(_KEYS, _ROW_VALUES, max_size=3), max_size=12),
    st.lists(PAYLOADS, max_size=12),
)


@settings(max_examples=600, deadline=None, database=None)
@given(batch=_BATCHES)
def test_a_batch_is_encoded_as_each_of_its_payloads_alone(batch: list[Any]) -> None:
    """push_many encodes its payloads together: the same blobs, the same refusal."""
    assert _encoded_together(batch) == _encoded_one_by_one(batch)


@pytest.mark.parametrize(
    "payload", [p for _, p in REFUSED_PAYLOADS], ids=[n for n, _ in REFUSED_PAYLOADS]
)
def test_a_refused_value_among_rows_refuses_the_batch(payload: Any) -> None:
    rows: list[Any] = [{"id": k, "name": f"n{k}", "value": k / 3, "none": None} for k in range(20)]
    rows[13] = {**rows[13], "bad": payload}
    with pytest.raises(aio_keuss.InvalidPayloadError):
        encode_payloads(rows)
    rows[13] = {**rows[13], "bad": [1, {"deep": [payload]}], "fine": [{"n": [1.5, None]}]}
    with pytest.raises(aio_keuss.InvalidPayloadError):
        encode_payloads(rows)
    rows[13] = payload
    with pytest.raises(aio_keuss.InvalidPayloadError):
        encode_payloads(rows)


def test_rows_holding_themselves_are_refused_not_walked_for_ever() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(aio_keuss.InvalidPayloadError):
        encode_payloads([{"x": loop}] * 10)
    assert (
        encode_payloads([{"x": _nested_lists(200)}] * 10)
        == [encode_payload({"x": _nested_lists(200)})] * 10
    )


_TWICE_HELD_LOOP = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import aio_keuss
from aio_keuss.message import encode_payloads
loop = []
loop += [loop, loop]
try:
    encode_payloads([{"x": loop}] * 10)
except aio_keuss.InvalidPayloadError:
    print("refused")
"""


def test_rows_holding_themselves_twice_are_refused_not_walked_level_by_level() -> None:
    """A list holding itself twice doubles at each level: walked a level at a time it had
    2**k items at level k, and the batch pass took all memory (MemoryError at level ~27
    under a 2 GiB limit) where ``encode_payload`` refuses it at once (orjson's depth
    limit). Run apart, under a memory limit, so that a regression fails rather than takes
    the machine's memory."""
    done = subprocess.run(
        [sys.executable, "-c", _TWICE_HELD_LOOP], capture_output=True, text=True, check=False
    )
    assert done.stdout.strip() == "refused", done.stderr[-2000:]


REFUSED_HEADERS: list[tuple[str, Any]] = [
    ("NaN", {"h": math.nan}),
    ("inf", {"h": math.inf}),
    ("-inf", {"h": -math.inf}),
    ("IntEnum value", {"h": Size.BIG}),
    ("StrEnum value", {"h": Mode.FAST}),
    ("StrEnum key", {Mode.FAST: "v"}),
    ("int beyond 64 bits", {"h": 2**64}),
    ("lone surrogate", {"h": "\ud800"}),
    ("None", {"h": None}),
    ("bytes", {"h": b"x"}),
]


@pytest.mark.parametrize(
    "headers", [h for _, h in REFUSED_HEADERS], ids=[n for n, _ in REFUSED_HEADERS]
)
def test_headers_that_would_change_are_refused(headers: Any) -> None:
    with pytest.raises(aio_keuss.InvalidHeadersError):
        encode_headers(headers)


async def test_refused_payloads_and_headers_write_nothing(queue: aio_keuss.Queue) -> None:
    for _, payload in REFUSED_PAYLOADS:
        with pytest.raises(aio_keuss.InvalidPayloadError):
            await queue.push(payload)
        with pytest.raises(aio_keuss.InvalidPayloadError):
            await queue.push_many(["fine", payload, "fine"])
    for _, headers in REFUSED_HEADERS:
        with pytest.raises(aio_keuss.InvalidHeadersError):
            await queue.push("fine", headers=headers)
    assert await queue.total_size() == 0
    assert (await queue.stats())["put"] == 0


EDGE_PAYLOADS: list[Any] = [
    -0.0,
    5e-324,
    1.7976931348623157e308,
    2**64 - 1,
    -(2**63),
    b"",
    b"\x00J{}",
    "",
    "null",
    {"a": None, "b": 1.5, "c": [None, -0.0]},  # a null beside floats: the slower check
    {"": {"": []}},
    [[[[]]]],
    _nested_lists(200),
    {"é😀\x00": "\u2028"},
]


async def test_edge_payloads_and_headers_round_trip(queue: aio_keuss.Queue) -> None:
    headers = {"f": -0.0, "i": 2**64 - 1, "n": -(2**63), "b": False, "s": "", "t": 1e-300}
    for payload in EDGE_PAYLOADS:
        await queue.push(payload, headers=headers)
        message = await queue.pop(timeout=10)
        assert message is not None
        assert same(message.payload, payload), payload
        assert same(message.headers, headers)
    assert await queue.total_size() == 0


# 9. delays, timeouts and options past their bound ----------------------------------------

TOO_LONG: list[Any] = [10**400, MAX_SECONDS * 1.5, 1e17, 2.6e11, math.inf, math.nan]


class Seconds(enum.IntEnum):
    TEN = 10


def test_check_seconds_bound() -> None:
    assert check_seconds(0, "d") == 0.0
    assert check_seconds(MAX_SECONDS, "d") == MAX_SECONDS
    assert check_seconds(int(MAX_SECONDS), "d") == MAX_SECONDS
    # an int, by its exact type or a subclass's way, comes back a float of the same value
    assert [(type(s), s) for s in (check_seconds(10, "d"), check_seconds(Seconds.TEN, "d"))] == [
        (float, 10.0)
    ] * 2
    for bad in [*TOO_LONG, int(MAX_SECONDS) + 1, -1, -(10**400), True, "1", None]:
        with pytest.raises(aio_keuss.InvalidDelayError):
            check_seconds(bad, "delay")
    with pytest.raises(aio_keuss.InvalidDelayError, match="an int of"):
        check_seconds(10**5000, "delay")  # repr() itself would raise on such an int


async def test_calls_past_the_bound_are_refused(queue: aio_keuss.Queue) -> None:
    caps = queue.capabilities
    for bad in TOO_LONG:
        with pytest.raises(aio_keuss.InvalidDelayError):
            await queue.push(1, delay=bad)
        with pytest.raises(aio_keuss.InvalidDelayError):
            await queue.push_many([1, 2], delay=bad)
        with pytest.raises(aio_keuss.InvalidDelayError):
            await queue.pop(timeout=bad)
        with pytest.raises(aio_keuss.InvalidDelayError):
            await queue.pop_many(2, timeout=bad)
        if caps.reserve:
            with pytest.raises(aio_keuss.InvalidDelayError):
                await queue.reserve(timeout=bad)
            with pytest.raises(aio_keuss.InvalidDelayError):
                await queue.ko("some-id", delay=bad)
        with pytest.raises(aio_keuss.InvalidDelayError):
            queue.consume(_never_called, retry_delay=bad)
        with pytest.raises(aio_keuss.InvalidDelayError):
            queue.consume(_never_called, max_retry_delay=bad)
    assert await queue.total_size() == 0
    assert await queue.next_mature_t() is None


async def _never_called(message: Message) -> None:
    raise AssertionError("no consumer may start")


async def test_the_longest_delay_is_stored_and_read_back(queue: aio_keuss.Queue) -> None:
    needs(queue, "delay")
    await queue.push("far", delay=MAX_SECONDS)
    await queue.push("now")
    mature = await queue.next_mature_t()  # raised for every later call past ~2.5e11 s
    assert mature is not None
    assert await queue.sched_size() == 1
    message = await queue.pop(timeout=10)
    assert message is not None and message.payload == "now"
    mature = await queue.next_mature_t()
    assert mature is not None
    assert abs(mature.timestamp() - (time.time() + MAX_SECONDS)) < 86400
    assert await queue.pop(timeout=0) is None


async def test_the_longest_queue_options_work(factory: aio_keuss.Factory) -> None:
    q = await factory.queue(
        "longest", reserve_delay=MAX_SECONDS, dedup_window=MAX_SECONDS, max_batch=MAX_COUNT
    )
    if q.capabilities.idempotent:  # redis-reliable: the dedup window goes to Redis as PX ms
        assert await q.push(1, id="same") == "same"
        assert await q.push(2, id="same") == "same"
    else:
        await q.push(1)
    assert await q.total_size() == 1
    if q.capabilities.reserve:
        message = await q.reserve(timeout=10)
        assert message is not None and message.payload == 1
        assert await q.next_mature_t() is not None  # the reservation deadline
        assert await q.ok(message)
    else:
        assert [m.payload for m in await q.pop_many(10, timeout=10)] == [1]
    assert await q.total_size() == 0


BAD_QUEUE_OPTIONS: list[dict[str, Any]] = [
    {"reserve_delay": 10**400},
    {"reserve_delay": 2.6e11},
    {"poll_interval": 10**400},
    {"dedup_window": 1e17},
    {"dedup_window": math.nan},
    {"max_batch": MAX_COUNT + 1},
    {"max_batch": 10**400},
]


def _option_id(options: dict[str, Any]) -> str:
    return ",".join(f"{key}={brief(value)}" for key, value in options.items())


@pytest.mark.parametrize("options", BAD_QUEUE_OPTIONS, ids=_option_id)
async def test_queue_options_past_the_bound_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(aio_keuss.ConfigError):
        await (await aio_keuss.connect("memory", **options)).close()
    async with aio_keuss.connect("memory") as factory:
        with pytest.raises(aio_keuss.ConfigError):
            await factory.queue("q", **options)


BAD_FACTORY_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("memory", {"signal_debounce": 10**400}),
    ("memory", {"signal_debounce": math.nan}),
    ("memory", {"deadletter": {"max_ko": MAX_COUNT + 1}}),
    ("memory", {"deadletter": {"max_ko": 2**64}}),
    ("redis-reliable", {"dedup_window": 1e17}),
    ("redis-reliable", {"failed_max": 10**20}),
    ("redis-reliable", {"heartbeat_ttl": 10**400}),
    ("redis-sharded", {"shards": 513}),
    ("redis-sharded", {"message_ttl": 10**400}),
    ("redis-sharded", {"queue_expiry": math.nan}),
    ("redis-sharded", {"max_consumers": 101}),
    ("memory-sharded", {"shards": 513}),
    ("memory-sharded", {"message_ttl": 10**400}),
    ("memory-sharded", {"lease_ttl": 0.5, "sweep_interval": 1.0}),
    ("bucket-redis", {"bucket_max_wait": 10**400}),
    ("bucket-redis", {"state_flush_period": MAX_SECONDS * 2}),
    ("bucket-redis", {"reject_delta_base": 1e17}),
    ("bucket-redis", {"reject_delta_factor": 10**400}),
    ("bucket-redis", {"reject_timeout_grace": math.inf}),
    ("postgres", {"max_pool_size": 10_001}),
    ("mongo", {"server_selection_timeout": 10**400}),
    ("mongo", {"server_selection_timeout": math.nan}),
    ("mongo", {"server_selection_timeout": 1e6}),
    ("mongo-history", {"history_ttl": 10**400}),
    ("sqlite", {"path": "/tmp/akt.db", "busy_timeout": 10**400}),
    ("sqlite", {"path": "/tmp/akt.db", "signal_poll": 0}),
    ("sqlite", {"path": "/tmp/akt.db", "signal_poll": math.nan}),
    ("sqlite", {"path": "/tmp/akt.db", "synchronous": "off"}),
]


@pytest.mark.parametrize(
    "backend,options",
    BAD_FACTORY_OPTIONS,
    ids=[f"{backend}-{_option_id(options)}" for backend, options in BAD_FACTORY_OPTIONS],
)
async def test_backend_options_past_the_bound_are_refused(
    backend: str, options: dict[str, Any]
) -> None:
    # Unreachable URLs: the option is refused before any connection is tried.
    url = {
        "redis-reliable": "redis://127.0.0.1:1/0",
        "redis-sharded": "redis://127.0.0.1:1/0",
        "bucket-redis": "redis://127.0.0.1:1/0",
        "postgres": "postgresql://postgres@127.0.0.1:1/test",
        "mongo": "mongodb://127.0.0.1:1",
        "mongo-history": "mongodb://127.0.0.1:1",
    }.get(backend)
    extra = {} if url is None else {"url": url}
    with pytest.raises(aio_keuss.ConfigError):
        await (await aio_keuss.connect(backend, **extra, **options)).close()


async def test_a_default_ko_delay_is_bounded_too(connect: Connect, case: BackendCase) -> None:
    """Keuss's bucket retry polynomial (base + factor * tries) can pass the bound: it is
    capped there, like a delay given to ko."""
    if not case.name.startswith("bucket-"):
        pytest.skip("only bucket stores have a default ko delay")
    factory = await connect(reject_delta_base=MAX_SECONDS, reject_delta_factor=MAX_SECONDS)
    q = await factory.queue("q")
    await q.push("x")
    first = await q.reserve(timeout=10)
    assert first is not None
    assert await q.ko(first, delay=0)
    again = await q.reserve(timeout=10)
    assert again is not None and again.tries == 1
    assert await q.ko(again)  # base + factor * 1 = 2e9 s: capped at MAX_SECONDS
    await q.drain()
    mature = await q.next_mature_t()
    assert mature is not None
    assert mature.timestamp() <= time.time() + MAX_SECONDS + 1


# 10. hand-built messages and ids --------------------------------------------------------

BAD_IDS: list[Any] = ["\ud800", "a\udfffb", "a\x00b", "", "a b", "x" * 201, 17, None]
# An id that names a stored message may be longer than a pushed one (a rename's suffix)
# (not "a b": an id another program stored, or a newer Python pushed, must stay nameable)
BAD_KNOWN_IDS: list[Any] = [*BAD_IDS[:4], "x" * (MAX_KNOWN_ID_LENGTH + 1), *BAD_IDS[6:]]
BAD_TRIES: list[Any] = [-1, MAX_TRIES + 1, 2**100, True, 1.0, "0", None]


def test_check_id_refuses_what_is_not_utf8_or_printable() -> None:
    for bad in BAD_IDS:
        with pytest.raises(aio_keuss.InvalidIdError):
            check_id(bad)
    assert check_id("é😀-1") == "é😀-1"


def test_ids_checked_together_are_refused_as_each_alone() -> None:
    fine = [f"job:{k}:é😀" for k in range(20)]
    assert check_ids(fine) == fine and check_ids([]) == []
    for bad in [*BAD_IDS, "a\u2028b", "a\u200bb"]:
        for at in (0, 7, 19):
            ids = [*fine[:at], bad, *fine[at + 1 :]]
            with pytest.raises(aio_keuss.InvalidIdError) as together:
                check_ids(ids)
            with pytest.raises(aio_keuss.InvalidIdError) as alone:
                check_id(bad)
            assert str(together.value) == str(alone.value)
    assert check_ids(["x" * 1000], MAX_KNOWN_ID_LENGTH) == ["x" * 1000]


def test_ascii_ids_checked_together_are_refused_as_each_alone() -> None:
    """Ids all ASCII (a Spark write's) are checked by another way than the others: every
    ASCII character, inside an id among plain ones, is taken or refused as check_id does."""
    fine = [f"job-1:{k}" for k in range(20)]
    assert check_ids(fine) == fine
    for code in range(128):
        odd = f"a{chr(code)}b"
        ids = [*fine[:7], odd, *fine[8:]]
        try:
            check_id(odd)
        except aio_keuss.InvalidIdError as alone:
            with pytest.raises(aio_keuss.InvalidIdError) as together:
                check_ids(ids)
            assert str(together.value) == str(alone)
        else:
            assert check_ids(ids) == ids


async def test_hand_built_messages_are_validated(queue: aio_keuss.Queue) -> None:
    needs(queue, "reserve")
    await queue.push("x")
    real = await queue.reserve(timeout=10)
    assert real is not None
    calls: list[Callable[[Message], Awaitable[Any]]] = [queue.ok, queue.ko]
    if queue.capabilities.remove:
        calls.append(queue.remove)
    for call in calls:
        for bad_id in BAD_KNOWN_IDS:
            with pytest.raises(aio_keuss.InvalidIdError):
                await call(dataclasses.replace(real, id=bad_id))
        for bad_tries in BAD_TRIES:
            with pytest.raises(aio_keuss.InvalidInputError):
                await call(dataclasses.replace(real, tries=bad_tries))
    assert await queue.resv_size() == 1  # none of that touched the reservation
    assert await queue.ok(dataclasses.replace(real, tries=real.tries))
    assert await queue.total_size() == 0


# Ids the naming calls take though no push here makes them: each names nothing stored
STRANGE_KNOWN_IDS = ["a b", "tab\there", "x\u2028y", "zw\u200bsp", "q:1", "~0", "é😀", "x" * 1000]


async def test_ids_nobody_stored_name_nothing(queue: aio_keuss.Queue) -> None:
    """Every store is handed ids it never made by ok, ko, remove and find: a bucket id's
    slot, a sharded id's shard, a space, must each come back as nothing there (False,
    MISSING, None), never an error, and leave the real reservation alone."""
    await _each_names_nothing(queue, lambda _: STRANGE_KNOWN_IDS)


async def _each_names_nothing(
    queue: aio_keuss.Queue, others: Callable[[Message], list[str]]
) -> None:
    """ok, ko, remove and find of each of ``others(real)`` (``real``: a message reserved
    here) name nothing, and leave ``real``'s reservation alone."""
    needs(queue, "reserve")
    await queue.push("x")
    real = await queue.reserve(timeout=10)
    assert real is not None
    for other in others(real):
        assert await queue.ok(other) is False
        assert await queue.ok(dataclasses.replace(real, id=other)) is False
        assert await queue.ko(other) is aio_keuss.KoResult.MISSING
        if queue.capabilities.remove:
            assert await queue.remove(other) is False
        if queue.capabilities.peek:
            assert await queue.find(other) is None
    assert await queue.resv_size() == 1
    assert await queue.ok(real)
    assert await queue.total_size() == 0


_ARABIC_INDIC = str.maketrans("0123456789", "".join(map(chr, range(0x660, 0x66A))))


def _other_forms(message_id: str) -> list[str]:
    """Ids that differ from ``message_id`` in how its number after the last ``-`` is
    written (a bucket id's slot): a leading zero, Arabic-Indic digits, a superscript two, a
    circled one. ``int`` reads the first two as that number and refuses the others, which
    ``isdigit`` takes for digits."""
    head, _, number = message_id.rpartition("-")
    arabic = number.translate(_ARABIC_INDIC)
    return [f"{head}-0{number}", f"{head}-{arabic}", f"{head}-\u00b2", f"{head}-\u2460"]


async def test_a_number_written_another_way_names_nothing(queue: aio_keuss.Queue) -> None:
    """A bucket store read the slot of an id with ``int`` once ``isdigit`` passed: a leading
    zero or Arabic-Indic digits named the real message (ok of an id nobody was given
    acknowledged it), and a superscript digit, a digit to ``isdigit`` but not to ``int``,
    failed ok, ko and remove with a ValueError."""
    await _each_names_nothing(queue, lambda real: _other_forms(real.id))


class LegacyId(str, enum.Enum):  # noqa: UP042 (the str() a StrEnum does not have)
    """A str-mixed Enum: on Python 3.11 its ``str()`` is ``LegacyId.JOB``, not its value."""

    JOB = "job-1"


async def test_an_id_of_a_str_subclass_names_what_it_pushed(queue: aio_keuss.Queue) -> None:
    """ok and remove checked a str subclass's id as ``str(id)``: for a str-mixed Enum that
    is its name (``LegacyId.JOB``), not the id it pushed, so ok of the id a push took
    returned False and the message came back for ever."""
    needs(queue, "reserve")
    needs(queue, "idempotent")
    await queue.push("x", id=LegacyId.JOB)
    real = await queue.reserve(timeout=10)
    assert real is not None and real.id == "job-1"
    assert await queue.ok(LegacyId.JOB)
    assert await queue.total_size() == 0


async def test_pushed_ids_must_be_utf8_and_printable(queue: aio_keuss.Queue) -> None:
    for bad in BAD_IDS:
        if bad is None:  # push(id=None): an id is made
            continue
        with pytest.raises(aio_keuss.InvalidIdError):
            await queue.push(1, id=bad)
        with pytest.raises(aio_keuss.InvalidIdError):
            await queue.push_many([1, 2], ids=["fine", bad])
    assert await queue.total_size() == 0


async def test_push_many_ids_must_be_a_sequence_as_long_as_the_payloads(
    queue: aio_keuss.Queue,
) -> None:
    """A set or a generator would pair ids with payloads in no defined order (a set was
    taken); a number gave a bare TypeError."""
    for ids in ({"a", "b"}, (i for i in "ab"), 5, "ab", b"ab", ["a"]):
        with pytest.raises(aio_keuss.InvalidInputError):
            await queue.push_many([1, 2], ids=ids)
    assert await queue.total_size() == 0


async def test_push_each_checks_every_message_before_writing_any(queue: aio_keuss.Queue) -> None:
    fine = aio_keuss.NewMessage("fine")
    for messages in ("ab", b"ab", {"a": 1}, (m for m in [fine]), 5, [fine, "plain"], [None]):
        with pytest.raises(aio_keuss.InvalidInputError):
            await queue.push_each(messages)  # type: ignore[arg-type]
    bad_ones = [
        (aio_keuss.InvalidPayloadError, aio_keuss.NewMessage(float("nan"))),
        (aio_keuss.InvalidDelayError, aio_keuss.NewMessage(1, delay=-1)),
        (aio_keuss.InvalidHeadersError, aio_keuss.NewMessage(1, headers={"k": object()})),  # type: ignore[dict-item]
        (aio_keuss.InvalidIdError, aio_keuss.NewMessage(1, id="bad\x00id")),
    ]
    for error, bad in bad_ones:
        with pytest.raises(error):
            await queue.push_each([fine, fine, bad])
    assert await queue.total_size() == 0


# 11. URLs --------------------------------------------------------------------------------

BAD_URLS: list[tuple[str, str]] = [
    ("redis-oq", "http://127.0.0.1:6379/0"),
    ("redis-oq", "redis:/127.0.0.1:6399"),  # connected to localhost:6379 before
    ("redis-oq", "redis:127.0.0.1:6399"),
    ("redis-oq", "redis://"),
    ("redis-oq", "redis://:secret@/0"),
    ("redis-oq", "redis://127.0.0.1:99999/0"),
    ("redis-oq", "redis://127.0.0.1:0/0"),
    ("redis-oq", "redis://127.0.0.1:port/0"),
    ("redis-oq", "redis://127.0.0.1:6379/x"),  # connected to database 0 before
    ("redis-oq", "redis://127.0.0.1:6379/0/1"),
    ("redis-oq", "redis://127.0.0.1:6379/-1"),
    ("redis-oq", "redis://127.0.0.1:6379/0?db=x"),
    ("redis-oq", "redis://127.0.0.1:6379/0?socket_timeout=never"),
    ("redis-oq", "unix://"),
    # a query argument no redis-py connection takes: a TypeError traceback at the first
    # command (exit 1 from the admin commands, not 2)
    ("redis-oq", "redis://:secret@127.0.0.1:6379/0?bogus=1"),
    ("redis-list", "redis://127.0.0.1:6379/0?ssl_cert_reqs=none"),  # TLS only: rediss://
    ("redis-reliable", "unix:///tmp/redis.sock?socket_keepalive=true"),  # TCP only
    # what the library sets on its own client, which the URL overrode: replies came back
    # decoded (an AttributeError traceback on the first read), str keys encoded otherwise
    ("redis-oq", "redis://127.0.0.1:6379/0?decode_responses=true"),
    ("redis-list", "redis://127.0.0.1:6379/0?encoding=latin-1"),
    ("redis-oq", "unix:///tmp/redis.sock?retry=5"),
    ("redis-oq", "unix://127.0.0.1/tmp/redis.sock"),
    ("redis-list", "rediss:/127.0.0.1"),
    ("redis-reliable", "127.0.0.1:6379"),
    ("redis-sharded", "redis://127.0.0.1:6379/x"),
    ("bucket-redis", "redis:/127.0.0.1:6399"),
    ("postgres", "mysql://postgres@127.0.0.1/test"),
    ("postgres", "postgresql:/127.0.0.1/test"),
    ("postgres", "postgresql://postgres@127.0.0.1:port/test"),
    ("postgres", "postgresql://postgres@127.0.0.1:70000/test"),
    ("postgres", "postgresql://postgres@[::1/test"),
    ("bucket-postgres", "host=127.0.0.1 dbname=test"),
    ("mongo", "http://127.0.0.1:27017"),
    ("mongo", "mongodb:/127.0.0.1:27017"),
    ("mongo", "mongodb://127.0.0.1:99999"),
    ("mongo", "mongodb://"),
    ("mongo-history", "mongodb://127.0.0.1:port"),
    ("bucket-mongo", "mongodb+srv://host.example:27017"),  # +srv takes no port
    # PyMongo only warns of an unknown option, or a bad value of a known one, and then
    # connects without it: a typo went by with the option's default
    ("mongo", "mongodb://u:secret@127.0.0.1:27017/?maxPoolSiz=5"),
    ("mongo", "mongodb://127.0.0.1:27017/?maxPoolSize=abc"),
    ("mongo-history", "mongodb://127.0.0.1:27017/?readPreference=primery"),
    ("bucket-mongo", "mongodb://127.0.0.1:27017/?retryWrites=maybe&password=secret"),
    # what aio-keuss gives the client itself, which overrides the URL's
    ("mongo", "mongodb://127.0.0.1:27017/?tz_aware=false"),
    ("mongo", "mongodb://127.0.0.1:27017/?serverSelectionTimeoutMS=100"),
    ("sqlite", "file:///tmp/akt.db"),
    ("sqlite", "sqlite:/tmp/akt.db"),
    ("sqlite", "sqlite://host/tmp/akt.db"),
    ("sqlite", "sqlite:////tmp/akt.db?mode=ro"),
    ("sqlite", "sqlite:////no/such/directory/akt.db"),
]


@pytest.mark.parametrize("backend,url", BAD_URLS, ids=[f"{b}-{u}" for b, u in BAD_URLS])
async def test_bad_urls_are_refused_before_connecting(backend: str, url: str) -> None:
    with pytest.raises(aio_keuss.ConfigError, match="url") as raised:
        await (await aio_keuss.connect(backend, url=url)).close()
    assert "secret" not in str(raised.value)


def test_mongo_url_options_pymongo_takes_are_accepted() -> None:
    for url in [
        "mongodb://127.0.0.1:27017/?maxPoolSize=5&appName=x&directConnection=true",
        "mongodb://u:p@a.example,b.example/db?replicaSet=rs0&readPreference=secondaryPreferred",
        "mongodb://127.0.0.1/?w=majority;wtimeoutMS=100;retryWrites=false",
        "mongodb+srv://cluster.example/?tls=true&authSource=admin",
    ]:
        assert check_mongo_url(url) == url


async def test_redis_cluster_urls_have_database_0_only() -> None:
    for url in [
        "redis://127.0.0.1:1/1",
        "unix:///tmp/redis.sock",
        "redis://127.0.0.1:1?bogus=1",
        "redis://127.0.0.1:1?decode_responses=1",
        "redis://127.0.0.1:1?reinitialize_steps=1",
    ]:
        with pytest.raises(aio_keuss.ConfigError):
            await (await aio_keuss.connect("redis-oq", url=url, cluster=True)).close()


def test_redis_url_forms_redis_py_documents_are_accepted() -> None:
    for url in [
        "redis://127.0.0.1",
        "redis://localhost:6379/",
        "REDIS://127.0.0.1:6379/15",
        "redis://user:p%40ss@127.0.0.1:6379/0",
        "redis://[::1]:6379/2",
        "redis://127.0.0.1?db=3&socket_timeout=1",
        "rediss://cache.example:6380/0",
        "unix:///var/run/redis.sock",
        "unix://:secret@/var/run/redis.sock?db=1",
        "redis://127.0.0.1?client_name=app&max_connections=5&health_check_interval=2",
        "rediss://cache.example:6380/0?ssl_cert_reqs=none&ssl_check_hostname=false",
    ]:
        assert check_redis_url(url, cluster=False) == url
    for url in ["redis://127.0.0.1:6379/0?client_name=app", "rediss://c.example?ssl_ca_certs=x"]:
        assert check_redis_url(url, cluster=True) == url


async def test_good_redis_url_variants_connect() -> None:
    """The checks refuse nothing a working URL needs: no database, a trailing slash."""
    base = REDIS_URL.rsplit("/", 1)[0]
    prefix = f"akt-{new_token()}"
    try:
        for url in [base, base + "/", base + "/0?db=0"]:
            async with aio_keuss.connect("redis-oq", url=url, prefix=prefix) as factory:
                q = await factory.queue("q")
                await q.push(url)
                message = await q.pop(timeout=10)
                assert message is not None and message.payload == url
    finally:
        await _drop_redis_prefix({"url": REDIS_URL, "prefix": prefix})
