"""The fast lane's bound commands send exactly the bytes redis-py's hiredis packer makes for
the whole command, whatever the arguments (none, numbers that compare equal but print apart,
more than nine, a payload too large to keep for a repeat)."""

from __future__ import annotations

from typing import Any

import pytest

hiredis = pytest.importorskip("hiredis")

from aio_keuss.redis.connection import Script, _Bound  # noqa: E402


class _Lane:
    """Hands back what would go on the wire."""

    def call_packed(self, packed: bytes, script: Script | None = None) -> bytes:
        return packed


CALLS: list[tuple[Any, ...]] = [
    (),
    (),
    (30.0,),
    (30.0,),
    (30,),  # equal to 30.0, packed apart
    (1,),
    (1.0,),
    ("an-id", ""),
    ("an-id", 3),
    ("id", b"x" * 10, 0.5),
    tuple(range(9)),
    tuple(range(10)),
    tuple(range(25)),
    (b"y" * 5000,),
    (b"y" * 5000,),
]


@pytest.mark.parametrize("script", [Script("return 1"), None])
def test_a_bound_command_sends_what_the_whole_command_packs_to(script: Script | None) -> None:
    head: tuple[Any, ...] = (
        ("EVALSHA", script.sha, 2, "k:{q}:a", "k:{q}:b") if script else ("LPUSH", "k:{q}")
    )
    bound = _Bound(_Lane(), head, script)  # type: ignore[arg-type]
    for args in CALLS:
        if not args and script is None:
            continue
        assert bound(*args) == hiredis.pack_command((*head, *args)), args
