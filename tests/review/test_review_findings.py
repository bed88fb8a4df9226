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
