"""The close of a forgotten sync factory at interpreter exit, once cancelled past its wait,
still finishes within the cancelled close's grace (``Factory.close``): the reservations its
consumers and callers hold go back at once, not after ``reserve_delay``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from backends import REDIS_URL, _drop_redis_prefix, new_token

import aio_keuss

_EXIT_WITH_A_SLOW_HANDLER = """
import asyncio, sys, threading
from aio_keuss import sync

sync.EXIT_CLOSE_WAIT = 0.5  # the close waits for the handler past this: then cancelled
factory = sync.connect("redis-oq", url=sys.argv[2], prefix=sys.argv[1])
q = factory.queue("jobs")
q.push("held")
held = q.reserve(timeout=5)  # never acknowledged: the close gives it back
assert held is not None
q.push("handled")
started = threading.Event()

async def handler(message):
    started.set()
    await asyncio.sleep(5)  # longer than the exit's wait: cancelled by the close

async def start(queue):
    queue.consume(handler)

q.call_soon(start).result()
assert started.wait(10)
print("exiting", flush=True)
"""


def test_a_cancelled_exit_close_still_gives_back_what_it_held(tmp_path: Path) -> None:
    """Past ``EXIT_CLOSE_WAIT`` the exit's close is cancelled through the portal, whose
    cancel scope cancels again and again until its task ends: the close's grace (give back
    what is held, flush what is buffered) was cut at once by the second cancellation, and
    both messages stayed reserved for ``reserve_delay`` (120 s)."""
    script = tmp_path / "exit_slow_handler.py"
    script.write_text(_EXIT_WITH_A_SLOW_HANDLER)
    prefix = f"akt-{new_token()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    async def take_both() -> list[object]:
        factory = await aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix)
        try:
            queue = await factory.queue("jobs")
            taken = [await queue.reserve(timeout=3) for _ in range(2)]
            return sorted(str(m.payload) for m in taken if m is not None)
        finally:
            await factory.close()

    try:
        done = subprocess.run(
            [sys.executable, str(script), prefix, REDIS_URL],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "exiting" in done.stdout
        assert "close at exit given up" in done.stderr
        assert asyncio.run(take_both()) == ["handled", "held"], done.stderr
    finally:
        asyncio.run(_drop_redis_prefix({"url": REDIS_URL, "prefix": prefix}))
