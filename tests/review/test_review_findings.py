"""Defects found reviewing 66f3e14..HEAD, each shown against a real server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token

import aio_keuss
from aio_keuss import Message


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"review-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


async def test_early_refill_keeps_at_most_prefetch_waiting(prefix: str) -> None:
    """README: with prefetch=P, "at most P wait beyond the waiting workers". With 2 to P
    workers the next fetch starts once P/2 are left, and reserves P more on top of them."""
    async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        q = await factory.queue("jobs")
        await q.push_many(list(range(40)))
        gates = {k: asyncio.Event() for k in range(40)}
        started = {k: asyncio.Event() for k in range(40)}
        waiting_at: dict[int, int] = {}
        consumer: aio_keuss.Consumer | None = None

        async def handle(message: Message) -> None:
            assert consumer is not None
            waiting_at[message.payload] = len(consumer._buffer)
            started[message.payload].set()
            await gates[message.payload].wait()

        consumer = q.consume(handle, concurrency=2, prefetch=4)
        try:
            await started[0].wait()
            await started[1].wait()
            gates[0].set()  # its worker takes 2, leaving P/2 = 2
            await started[2].wait()
            gates[1].set()  # its worker fetches early, then takes 3
            await started[3].wait()
        finally:
            for gate in gates.values():
                gate.set()
            await consumer.stop()
        assert waiting_at[3] <= 4, f"{waiting_at[3]} prefetched messages wait, prefetch 4"


CLOSE_FROM_HANDLER_AT_SPAWN = r"""
import json, signal, threading
from aio_keuss import sync

seen = {}
factory = sync.connect("memory")
factory.queue("jobs").push(1)

def on_sigusr1(signum, frame):  # a script's "stop on SIGTERM": close the factory
    factory.close()
    seen["closed in handler"] = factory.closed

signal.signal(signal.SIGUSR1, on_sigusr1)
portal = factory._portal
real_start = portal.start_task_soon
armed = [True]

def start_task_soon(*args, **kwargs):
    # the signal arrives as the close enters start_task_soon, before the task is spawned
    if armed and armed.pop() and args and getattr(args[0], "__name__", "") == "_settling":
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
    return real_start(*args, **kwargs)

portal.start_task_soon = start_task_soon
factory.close()
seen["closed"] = factory.closed
print(json.dumps(seen), flush=True)
"""


def test_a_close_from_a_signal_handler_as_the_close_enters_start_task_soon_returns() -> None:
    """A handler's close waits for the future the interrupted close made just before it
    called start_task_soon; interrupted before that call submitted the task, nothing ever
    settles the future: the handler waits for ever, the close it interrupted with it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {"PYTHONPATH": str(Path(__file__).parents[2]), "PATH": "/usr/bin:/bin"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", CLOSE_FROM_HANDLER_AT_SPAWN],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,  # a bound against a hang, not a timing
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the program hung: {exc.stdout!r} {exc.stderr!r}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"closed in handler": True, "closed": True}


@pytest.mark.parametrize("taking", ["pop", "reserve"])
def test_a_ctrl_c_just_after_the_caller_settled_its_result_loses_nothing(
    prefix: str, taking: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGINT that lands as the blocking caller takes its result in hand
    (``_settle_once`` won): the caller raises KeyboardInterrupt instead of returning the
    message, and its give-back (``_abandon``) finds the result settled already, so gives
    nothing back: the popped message was lost (a reservation held to its end)."""
    import signal
    import threading

    from aio_keuss import sync

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal interrupts the main thread only")
    real = sync._settle_once
    armed = [True]

    def settle_then_interrupted(taking_: object) -> bool:
        won = real(taking_)  # type: ignore[arg-type]
        if won and armed and armed.pop():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
        return won

    with sync.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
        q = factory.queue("jobs", reserve_delay=600.0)
        q.push({"a": 1})
        monkeypatch.setattr(sync, "_settle_once", settle_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            getattr(q, taking)(timeout=60)
        monkeypatch.setattr(sync, "_settle_once", real)
    # the close waited for every give-back sent before it
    with sync.connect("redis-oq", url=REDIS_URL, prefix=prefix) as again:
        sizes = again.queue("jobs").sizes()
        assert (sizes.total, sizes.reserved) == (1, 0), sizes
