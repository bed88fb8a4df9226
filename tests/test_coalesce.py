"""The coalescer: concurrent calls share a batch; a lone call is not delayed; results of
cancelled callers are handed back."""

from __future__ import annotations

import asyncio

import pytest

from aio_keuss.coalesce import Coalescer


async def test_calls_of_one_tick_share_one_batch() -> None:
    batches: list[list[int]] = []

    async def run(requests: list[int]) -> list[int]:
        batches.append(requests)
        await asyncio.sleep(0.01)
        return [r * 10 for r in requests]

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=100)
    results = await asyncio.gather(*(coalescer.submit(i) for i in range(50)))
    assert results == [i * 10 for i in range(50)]
    assert batches == [list(range(50))]


async def test_max_batch_splits_and_calls_during_flight_form_the_next_batch() -> None:
    batches: list[list[int]] = []

    async def run(requests: list[int]) -> list[int]:
        batches.append(requests)
        await asyncio.sleep(0.01)
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=4)
    first = asyncio.gather(*(coalescer.submit(i) for i in range(6)))
    await asyncio.sleep(0.001)
    second = asyncio.gather(*(coalescer.submit(i) for i in range(6, 8)))
    await asyncio.gather(first, second)
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7]]


async def test_lone_call_runs_on_the_next_loop_iteration() -> None:
    async def run(requests: list[int]) -> list[int]:
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=10)
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await coalescer.submit(7) == 7
    assert loop.time() - start < 0.05


async def test_cancelled_after_the_work_hands_the_result_to_on_orphan() -> None:
    orphans: list[tuple[int, int]] = []
    release = asyncio.Event()

    async def run(requests: list[int]) -> list[int]:
        await release.wait()
        return [r + 100 for r in requests]

    coalescer: Coalescer[int, int] = Coalescer(
        run, max_batch=10, on_orphan=lambda req, res: orphans.append((req, res))
    )
    kept = asyncio.create_task(coalescer.submit(1))
    dropped = asyncio.create_task(coalescer.submit(2))
    await asyncio.sleep(0.01)
    dropped.cancel()
    release.set()
    assert await kept == 101
    with pytest.raises(asyncio.CancelledError):
        await dropped
    await coalescer.wait_idle()
    assert orphans == [(2, 102)]


async def test_cancelled_before_sending_is_never_sent() -> None:
    seen: list[list[int]] = []

    async def run(requests: list[int]) -> list[int]:
        seen.append(requests)
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=10)
    task = asyncio.create_task(coalescer.submit(1))
    await asyncio.sleep(0)  # submitted, batch not started yet
    task.cancel()
    assert await coalescer.submit(2) == 2
    assert seen == [[2]]


async def test_errors_reach_every_caller_of_the_batch() -> None:
    async def run(requests: list[int]) -> list[int]:
        raise RuntimeError("server gone")

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=10)
    results = await asyncio.gather(*(coalescer.submit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
