"""Conformance: Payloads and headers round-trip; bad input is refused before anything is written.

Every backend runs it, skipping what it does not claim. Time bounds are generous
functional limits, never performance assertions.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import pytest
from conftest import drain_all

import aio_keuss

pytestmark = pytest.mark.timeout(90)


# payloads -------------------------------------------------------------------------------

PAYLOADS: list[Any] = [
    {"a": 1, "nested": {"l": [1, 2.5, "x", None, True]}},
    [1, "two", 3.0, False, None, {"k": []}],
    "a string with ünïcödé and \x00 nul",
    "",
    42,
    -(2**62),
    3.141592653589793,
    1e-300,
    True,
    False,
    None,
    b"\x00\xffbinary\x80",
    b"",
]


@pytest.mark.parametrize("with_headers", [False, True], ids=["plain", "headers"])
async def test_payload_round_trip(queue: aio_keuss.Queue, with_headers: bool) -> None:
    headers = {"s": "v", "i": 7, "f": 1.5, "b": True} if with_headers else None
    ids = [await queue.push(payload, headers=headers) for payload in PAYLOADS]
    got = await drain_all(queue)
    assert len(got) == len(PAYLOADS)
    if not queue.capabilities.fifo:  # a sharded queue keeps push order within a shard only
        got.sort(key=lambda m: ids.index(m.id))
    for message, payload in zip(got, PAYLOADS, strict=True):
        assert message.payload == payload
        assert type(message.payload) is type(payload)
        assert message.headers == (headers or {})
        assert isinstance(message.mature, datetime) and message.mature.tzinfo is not None


# bad input ------------------------------------------------------------------------------


class _Unserializable:
    pass


BAD_PUSHES: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("object payload", {"payload": _Unserializable()}, aio_keuss.InvalidPayloadError),
    ("set payload", {"payload": {1, 2}}, aio_keuss.InvalidPayloadError),
    ("datetime payload", {"payload": datetime.now(UTC)}, aio_keuss.InvalidPayloadError),
    ("int-keyed dict", {"payload": {1: "a"}}, aio_keuss.InvalidPayloadError),
    ("nested header", {"payload": 1, "headers": {"h": {"x": 1}}}, aio_keuss.InvalidHeadersError),
    ("None header", {"payload": 1, "headers": {"h": None}}, aio_keuss.InvalidHeadersError),
    ("int header key", {"payload": 1, "headers": {1: "x"}}, aio_keuss.InvalidHeadersError),
    ("list headers", {"payload": 1, "headers": ["x"]}, aio_keuss.InvalidHeadersError),
    ("negative delay", {"payload": 1, "delay": -1}, aio_keuss.InvalidDelayError),
    ("NaN delay", {"payload": 1, "delay": math.nan}, aio_keuss.InvalidDelayError),
    ("inf delay", {"payload": 1, "delay": math.inf}, aio_keuss.InvalidDelayError),
    ("str delay", {"payload": 1, "delay": "5"}, aio_keuss.InvalidDelayError),
    ("int id", {"payload": 1, "id": 17}, aio_keuss.InvalidIdError),
    ("empty id", {"payload": 1, "id": ""}, aio_keuss.InvalidIdError),
    ("spaced id", {"payload": 1, "id": "a b"}, aio_keuss.InvalidIdError),
    ("long id", {"payload": 1, "id": "x" * 500}, aio_keuss.InvalidIdError),
]


@pytest.mark.parametrize(
    "kwargs,error", [b[1:] for b in BAD_PUSHES], ids=[b[0] for b in BAD_PUSHES]
)
async def test_bad_push_raises_typed_error_and_writes_nothing(
    queue: aio_keuss.Queue, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    args = dict(kwargs)
    payload = args.pop("payload")
    with pytest.raises(error) as raised:
        await queue.push(payload, **args)
    assert isinstance(raised.value, aio_keuss.KeussError)
    if "id" in args:
        args["ids"] = ["fine-1", args.pop("id"), "fine-3"]
    with pytest.raises(error):
        await queue.push_many(["fine", payload, "fine"], **args)
    assert await queue.total_size() == 0
    assert (await queue.stats())["put"] == 0


async def test_capabilities_missing_raise_before_writing(queue: aio_keuss.Queue) -> None:
    caps = queue.capabilities
    if not caps.delay:
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.push(1, delay=5)
    if not caps.reserve:
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.reserve(timeout=0)
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.ok("some-id")
    if not caps.remove:
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.remove("some-id")
    assert await queue.total_size() == 0


async def test_bad_arguments(factory: aio_keuss.Factory, queue: aio_keuss.Queue) -> None:
    for name in ["", "has space", "a{b}", "x" * 200, 12, ".dot", "slash/y", "$dollar"]:
        with pytest.raises(aio_keuss.InvalidQueueNameError):
            await factory.queue(name)  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.ConfigError):
        await factory.queue("q1", no_such_option=1)
    with pytest.raises(aio_keuss.ConfigError):
        await factory.queue("q2", reserve_delay=-1)
    with pytest.raises(aio_keuss.InvalidDelayError):
        await queue.pop(timeout=-1)
    with pytest.raises(aio_keuss.InvalidInputError):
        await queue.pop_many(0)
    with pytest.raises(aio_keuss.InvalidInputError):
        await queue.push_many("not a list")  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.InvalidInputError):
        await queue.push_many([1, 2], ids=["only-one"])
    if queue.capabilities.reserve:
        # (not "with space": an id another program stored must stay nameable; see
        # check_known_id)
        for bad in [None, 5, "", "nul\x00byte", "x" * 1001]:
            with pytest.raises(aio_keuss.InvalidIdError):
                await queue.ok(bad)  # type: ignore[arg-type]
            with pytest.raises(aio_keuss.InvalidIdError):
                await queue.ko(bad)  # type: ignore[arg-type]
        assert await queue.ok("with space") is False
        with pytest.raises(aio_keuss.InvalidDelayError):
            await queue.ko("some-id", delay=-3)
    assert await queue.total_size() == 0


async def test_unknown_backend_and_options(case: Any) -> None:
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect("no-such-backend")
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect(case.name, no_such_option=True)
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect(case.name, deadletter={"max_ko": -1})
    with pytest.raises(aio_keuss.ConfigError):
        await aio_keuss.connect(case.name, poll_interval=0)
