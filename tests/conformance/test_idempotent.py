"""Conformance: A push with an id is deduplicated within the dedup window.

Every backend runs it, skipping what it does not claim. Time bounds are generous
functional limits, never performance assertions.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import Connect, needs

import aio_keuss

pytestmark = pytest.mark.timeout(90)


# idempotent push ------------------------------------------------------------------------


async def test_idempotent_push(queue: aio_keuss.Queue) -> None:
    if not queue.capabilities.idempotent:
        with pytest.raises(aio_keuss.NotSupportedError):
            await queue.push(1, id="order-17")
        assert await queue.total_size() == 0
        return
    assert await queue.push({"v": 1}, id="order-17") == "order-17"
    assert await queue.push({"v": 2}, id="order-17") == "order-17"
    assert await queue.total_size() == 1
    message = await queue.pop(timeout=1)
    assert message is not None and message.id == "order-17" and message.payload == {"v": 1}
    # consumed, but still within the dedup window: no second copy
    await queue.push({"v": 3}, id="order-17")
    assert await queue.total_size() == 0
    ids = await queue.push_many(["a", "b", "a2"], ids=["k1", "k2", "k1"])
    assert ids == ["k1", "k2", "k1"]
    assert await queue.total_size() == 2
    stats = await queue.stats()
    assert stats["put"] == 3


async def test_dedup_window_expires(connect: Connect) -> None:
    factory = await connect(dedup_window=0.3)
    needs(factory, "idempotent")
    q = await factory.queue("q1")
    await q.push(1, id="same")
    assert await q.pop(timeout=1) is not None
    await asyncio.sleep(0.6)
    await q.push(2, id="same")
    message = await q.pop(timeout=1)
    assert message is not None and message.payload == 2
