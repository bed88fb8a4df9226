"""``aio-keuss promote | reschedule | priority`` in-process, on the memory backend (which
the subprocess tests cannot share): what each answers and its exit code."""

from __future__ import annotations

import io
import json

import aio_keuss
from aio_keuss.worker import admin, cli


async def _run(factory: aio_keuss.Factory, *argv: str) -> tuple[int, object]:
    args = cli._parser().parse_args([*argv, "--backend", "memory", "--json"])
    stream = io.StringIO()
    code = await args.run(factory, args, admin.Output(True, stream))
    return code, json.loads(stream.getvalue())


async def test_each_command_changes_a_waiting_message_or_exits_4() -> None:
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("jobs")
        later = await q.push("later", delay=3600)
        ready = await q.push("ready")
        assert await _run(factory, "promote", "jobs", later) == (
            0,
            {"queue": "jobs", "id": later, "changed": True},
        )
        assert (await _run(factory, "promote", "jobs", ready))[0] == admin.EXIT_NOT_FOUND
        assert (await _run(factory, "reschedule", "jobs", ready, "--delay", "3600"))[0] == 0
        assert (await q.sizes()).scheduled == 1
        assert (await _run(factory, "priority", "jobs", later, "4"))[0] == 0
        first = await q.pop(timeout=0)
        assert first is not None and first.id == later and first.priority == 4
        assert (await _run(factory, "priority", "jobs", "gone", "1"))[0] == admin.EXIT_NOT_FOUND
