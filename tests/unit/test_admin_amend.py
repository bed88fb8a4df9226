"""``aio-keuss promote | reschedule | priority`` in-process, on the memory backend (which
the subprocess tests cannot share): what each answers and its exit code."""

from __future__ import annotations

import io
import json

import pytest

import aio_keuss
from aio_keuss.errors import InvalidInputError
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


async def test_list_and_stats_read_the_backend_s_queues_once_not_once_per_queue() -> None:
    """Each queue was opened with its recorded options read by a ``factory.list()`` of its
    own: ``list`` and ``stats`` over N queues read every queue's record N + 1 times, so
    their cost grew with the square of the number of queues (1,000 queues on redis-oq:
    10 s, a million records decoded). The listing is read once per command, or round."""
    async with aio_keuss.connect("memory") as factory:
        for number in range(20):
            await (await factory.queue(f"q{number}")).push(number)
        listed = factory.list
        reads = 0

        async def counted() -> dict[str, dict[str, object]]:
            nonlocal reads
            reads += 1
            return await listed()

        factory.list = counted  # type: ignore[method-assign]
        code, rows = await _run(factory, "list")
        assert code == 0 and isinstance(rows, list) and len(rows) == 20
        assert reads == 1
        reads = 0
        code, rows = await _run(factory, "stats")
        assert code == 0 and isinstance(rows, list) and len(rows) == 20
        assert reads == 1


async def test_list_and_stats_leave_out_a_recorded_name_this_release_refuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A queue recorded under a name this release refuses (by a newer release allowing it,
    or by hand) cannot be opened at all: it failed ``list`` and ``stats`` for every queue,
    as bad usage, after a note saying it was opened with the defaults. It is now left out,
    said once on stderr; asked for by name, it is still bad usage."""
    async with aio_keuss.connect("memory") as factory:
        await (await factory.queue("jobs")).push(1)
        recorded = (await factory.list())["jobs"]
        await factory.stats_store.save_options("a queue/with space", recorded)
        code, rows = await _run(factory, "list")
        assert code == 0 and isinstance(rows, list)
        assert [row["queue"] for row in rows] == ["jobs"]
        err = capsys.readouterr().err
        assert "'a queue/with space'" in err and "defaults" not in err
        code, rows = await _run(factory, "stats")
        assert code == 0 and isinstance(rows, list)
        assert [row["queue"] for row in rows] == ["jobs"]
        with pytest.raises(InvalidInputError, match="invalid queue name"):
            await _run(factory, "info", "a queue/with space")
        assert "defaults" not in capsys.readouterr().err
