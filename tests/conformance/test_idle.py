"""An idle factory costs next to no CPU, on every backend.

Idle: a queue is open, a consumer waits on it, nothing happens. What the factory may still do
then (a signal listener waiting on the server, consumers' poll timers) must stay under 1 % of
one CPU. The measure is this process's CPU time (``time.process_time``), not wall time, so a
busy machine does not inflate it; the test servers run in processes of their own (nx-27017
too, see ``mongo_server.py``), so their work is not counted. The factory is left idle for a
couple of seconds before measuring: on a MongoDB server that does not wait on getMore (such as
nx-27017) the signal listener polls, less and less often the longer nothing happens.

The sharded backends run with their shipped sweeper timings here: the suite's other tests
make the sweeper pass four times a second so that lapsed reservations come back quickly,
which is not idle as a user gets it (each pass is a wake-up and a few round trips).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from backends import BackendCase
from conftest import Connect

from aio_keuss.sharded.settings import ShardedOptions

pytestmark = pytest.mark.timeout(60)

SETTLE = 2.0
MEASURE = 2.0
BOUND = 0.01
"""Share of one CPU; typical values are 0 to 0.3 %."""


def shipped_sweeper(case: BackendCase) -> dict[str, float]:
    """A sharded backend's sweeper timings as shipped (none for the other backends)."""
    if not case.name.endswith("-sharded"):
        return {}
    shipped = ShardedOptions()
    names = ("sweep_interval", "shovel_interval", "lease_ttl")
    return {name: getattr(shipped, name) for name in names}


async def test_an_idle_factory_uses_under_one_percent_of_a_cpu(
    case: BackendCase, connect: Connect
) -> None:
    factory = await connect(poll_interval=30.0, **shipped_sweeper(case))
    q = await factory.queue("idle")
    await q.push("warm-up")
    assert await q.pop(timeout=10) is not None  # connections, scripts, indexes: all in place
    waiting = asyncio.create_task(q.pop())  # a consumer with nothing to do, as idle workers are
    try:
        await asyncio.sleep(SETTLE)
        started = time.process_time()
        await asyncio.sleep(MEASURE)
        used = time.process_time() - started
        assert not waiting.done()
    finally:
        waiting.cancel()
        await asyncio.wait({waiting})
    assert used < BOUND * MEASURE, f"idle factory used {used / MEASURE:.2%} of a CPU"
