"""``aio-keuss cancel`` in-process, on the memory backend (which the subprocess tests cannot
share): what it answers and its exit code."""

from __future__ import annotations

import io
import json

import pytest

import aio_keuss
from aio_keuss.worker import admin, cli


async def _run(factory: aio_keuss.Factory, *argv: str) -> tuple[int, object]:
    args = cli._parser().parse_args([*argv, "--backend", "memory", "--json"])
    stream = io.StringIO()
    code = await args.run(factory, args, admin.Output(True, stream))
    return code, json.loads(stream.getvalue())


async def test_cancel_says_removed_or_requested_or_exits_4() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs", result_ttl=60)
        waiting = await q.push("waiting", delay=3600)
        held = await q.push("held")
        assert await _run(factory, "cancel", "jobs", waiting, "--reason", "no") == (
            0,
            {"queue": "jobs", "id": waiting, "outcome": "removed"},
        )
        found = await q.result(waiting)
        assert found is not None and found.error == "cancelled: no"
        assert await q.reserve(timeout=0) is not None
        assert await _run(factory, "cancel", "jobs", held) == (
            0,
            {"queue": "jobs", "id": held, "outcome": "requested"},
        )
        code, _ = await _run(factory, "cancel", "jobs", "gone")
        assert code == admin.EXIT_NOT_FOUND


async def test_a_bad_reason_is_refused_before_the_queue_is_opened() -> None:
    async with aio_keuss.connect("memory") as factory:
        args = cli._parser().parse_args(
            ["cancel", "jobs", "some-id", "--reason", "x" * 1001, "--backend", "memory"]
        )
        with pytest.raises(aio_keuss.InvalidInputError):
            await args.run(factory, args, admin.Output(False, io.StringIO()))
        assert "jobs" not in await factory.list()
