"""Property-style checks of the header merge a move does: many generated header dicts (with
strings holding quotes, backslashes, braces, commas, colons, control characters and
non-ASCII text; big ints and floats; keys that are prefixes of others) go through a real
move on every backend that has one, and the headers that arrive must be Python's dict
merge of the stored and the added ones, in the same key order."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest
from conftest import Connect, needs

import aio_keuss
from aio_keuss.contract import Entry
from aio_keuss.message import encode_payload

pytestmark = pytest.mark.timeout(120)

_NASTY = [
    "",
    '"',
    '\\"',
    "\\",
    "\\\\",
    '\\\\"',
    "a\\",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    '","b":1,"',
    '"}',
    '{"x":1}',
    "\\u0041",
    "\n\t\r\b\f",
    "\x1f",
    "\x01",
    "\x01\x02",
    "\x01\x03",
    "\x7f",
    "é",
    "日本語",
    "😀",
    "\u2028",
    " ",
]
_KEYS = ["a", "ab", "abc", "b", "a b", "é", "k", '"', "\\", "{", ":", ",", ""]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_NASTY) for _ in range(rng.randint(0, 4)))


def _value(rng: random.Random) -> Any:
    kind = rng.randrange(6)
    if kind == 0:
        return _text(rng) + rng.choice(["", "\x00", "a\x00\\u0000", "\x01\x03\x00"])
    if kind == 1:
        return rng.choice([0, -1, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1])
    if kind == 2:
        return rng.choice([0.1, -0.0, 1e300, 5e-324, 1.2345678901234567, 1e16])
    if kind == 3:
        return rng.choice([True, False])
    return rng.randint(-1000, 1000)


def _headers(rng: random.Random) -> dict[str, Any]:
    keys = rng.sample(_KEYS, rng.randint(0, 5)) + [_text(rng) for _ in range(rng.randint(0, 2))]
    return {k: _value(rng) for k in keys}


async def test_moved_headers_are_the_dict_merge_of_stored_and_added(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    src = await factory.queue("src")
    dst = await factory.queue("dst")
    rng = random.Random(8021)
    for n in range(60):
        stored, added = _headers(rng), _headers(rng)
        await src.push(n, headers=stored, id=f"m{n}")
        held = await src.reserve(timeout=5)
        assert held is not None and held.headers == stored
        assert await src.move(held, "dst", headers=added) == f"m{n}"
        expected = {**stored, **added}
        (found,) = await dst._store.locate([f"m{n}"])
        assert found is not None  # each key once: no longer than the merge's own text
        assert len(found.message.headers) == len(orjson.dumps(expected)), (stored, added)
        arrived = await dst.reserve(timeout=5)
        assert arrived is not None
        assert arrived.headers == expected, (stored, added)
        assert list(arrived.headers) == list(expected), (stored, added)
        assert await dst.ok(arrived)


def _other_program(rng: random.Random, headers: dict[str, Any]) -> bytes:
    """``headers`` as another program may write them: spaced, indented, ASCII-escaped."""
    text = json.dumps(
        headers,
        ensure_ascii=rng.choice([True, False]),
        indent=rng.choice([None, 1, "\t"]),
        separators=rng.choice([None, (" , ", " : "), (",", ":")]),
    )
    return text.encode("utf-8", "surrogatepass")


def _nested(rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = _headers(rng)
    if rng.random() < 0.5:
        out[rng.choice(_KEYS)] = [_value(rng), {"x": _text(rng), "y": [_text(rng), {}]}, []]
    if rng.random() < 0.3:
        out[rng.choice(_KEYS)] = {}
    return out


async def test_headers_another_program_wrote_merge_as_dicts(connect: Connect) -> None:
    """Stored text spelled another way (spacing, indentation, \\u escapes, nested values):
    what arrives decodes to the dict merge."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    src: aio_keuss.Queue = await factory.queue("src")
    dst = await factory.queue("dst")
    rng = random.Random(1207)
    for n in range(40):
        stored, added = _nested(rng), _headers(rng)
        written = _other_program(rng, stored)
        assert await src._store.insert([Entry(f"m{n}", encode_payload(n), written, 0.0)])
        held = await src.reserve(timeout=5)
        assert held is not None and held.headers == stored
        assert await src.move(held, "dst", headers=added) == f"m{n}"
        arrived = await dst.reserve(timeout=5)
        assert arrived is not None
        assert arrived.headers == {**stored, **added}, (written, added)
        assert await dst.ok(arrived)


async def test_a_key_holding_nul_keeps_the_stored_headers_bounded(connect: Connect) -> None:
    """A header key holding NUL (written ``\\u0000``): moved back and forth, the stored
    headers must keep their size, as for any other key."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve", "move")
    here, there = await factory.queue("ping"), await factory.queue("pong")
    await here.push(0, headers={"a\x00b": 1, "hop": 0}, id="m1")
    for turn in range(20):
        held = await here.reserve(timeout=5)
        assert held is not None
        assert await here.move(held, there.name, headers={"a\x00b": turn, "hop": turn}) == "m1"
        here, there = there, here
    (found,) = await here._store.locate(["m1"])
    assert found is not None
    assert len(found.message.headers) == len(orjson.dumps({"a\x00b": 19, "hop": 19}))
