"""Measures idle factories of several backends over one shared window (``test_idle.py``).

Run as ``python tests/idle_probe.py CASE_ID...``; prints one JSON object, keyed by case id.

Each backend runs in a process of its own, forked from this one once every backend's driver
is imported (so the imports are paid once, not once per backend), and measures its own
``time.process_time``: the CPU of that backend's factory alone, every thread of it included
(the sqlite backend does its work on a database thread of its own), never another backend's.
The children start together, so their settle and measuring windows overlap: the whole run
takes about one window instead of one window per backend.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from backends import CASES, BackendCase, new_token

import aio_keuss
from aio_keuss.registry import load_backend
from aio_keuss.sharded.settings import ShardedOptions

SETTLE = 2.0
"""Seconds left idle before measuring: on a MongoDB server that does not wait on getMore
(such as nx-27017) the signal listener polls, less and less often the longer nothing
happens."""
MEASURE = 2.0
"""Seconds of the measuring window."""


def shipped_sweeper(case: BackendCase) -> dict[str, float]:
    """A sharded backend's sweeper timings as shipped (none for the other backends)."""
    if not case.name.endswith("-sharded"):
        return {}
    shipped = ShardedOptions()
    names = ("sweep_interval", "shovel_interval", "lease_ttl")
    return {name: getattr(shipped, name) for name in names}


async def measure(case: BackendCase) -> dict[str, Any]:
    """CPU seconds this process used over MEASURE seconds of an idle factory of ``case``."""
    options = case.options(new_token())
    try:
        factory = await aio_keuss.connect(
            case.name, **{**options, "poll_interval": 30.0, **shipped_sweeper(case)}
        )
        try:
            q = await factory.queue("idle")
            await q.push("warm-up")
            # connections, scripts, indexes: all in place
            warmed = await q.pop(timeout=10) is not None
            waiting = asyncio.create_task(q.pop())  # a consumer with nothing to do
            try:
                await asyncio.sleep(SETTLE)
                started = time.process_time()
                await asyncio.sleep(MEASURE)
                used = time.process_time() - started
                still_waiting = not waiting.done()
            finally:
                waiting.cancel()
                await asyncio.wait({waiting})
        finally:
            await factory.close()
    finally:
        if case.cleanup is not None:
            await case.cleanup(options)
    return {"used": used, "measured": MEASURE, "warmed": warmed, "waiting": still_waiting}


def child(case: BackendCase, out: int) -> None:
    """Measure ``case`` and write the result (or the traceback) to ``out``; never returns."""
    try:
        result = asyncio.run(measure(case))
    except BaseException:
        result = {"error": traceback.format_exc()}
    try:
        os.write(out, json.dumps(result).encode())
    finally:
        os._exit(0)


def main(ids: list[str]) -> dict[str, Any]:
    cases = {case.id: case for case in CASES}
    for case_id in ids:
        load_backend(cases[case_id].name)  # the drivers are imported before forking
    # A child forked while another thread held a lock would wait on it for ever.
    assert threading.active_count() == 1, threading.enumerate()
    readers: dict[str, tuple[int, int]] = {}
    for case_id in ids:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            child(cases[case_id], write)
        os.close(write)
        readers[case_id] = (pid, read)
    results: dict[str, Any] = {}
    for case_id, (pid, read) in readers.items():
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        data = b"".join(chunks)
        results[case_id] = (
            json.loads(data) if data else {"error": f"exited with status {status}, no result"}
        )
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
