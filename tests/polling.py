"""Waiting in tests for what a store or a consumer does in its own time (an expiry, a
handler stopped), without assuming how long the machine takes: poll until it holds, with
a guard that only keeps a broken one from hanging the suite."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def until(check: Callable[[], Awaitable[bool]], guard: float) -> None:
    """Poll ``check`` until it holds; past ``guard`` seconds, TimeoutError."""
    async with asyncio.timeout(guard):
        while not await check():  # noqa: ASYNC110 - nothing tells of an expiry
            await asyncio.sleep(0.02)
