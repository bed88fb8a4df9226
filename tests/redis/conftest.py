"""Fixtures every Redis-specific module shares: a key prefix of the test's own, whose keys are
deleted afterwards, and factories opened under it and closed at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token

import aio_keuss

Open = Callable[..., Awaitable[aio_keuss.Factory]]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"akr-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


@pytest.fixture
async def open_factory(prefix: str) -> AsyncIterator[Open]:
    """``await open_factory(backend="redis-oq", **options)`` on the test server (``url``
    may be given), under the test's prefix."""
    opened: list[aio_keuss.Factory] = []

    async def _open(backend: str = "redis-oq", **options: Any) -> aio_keuss.Factory:
        options.setdefault("url", REDIS_URL)
        factory = await aio_keuss.connect(backend, prefix=prefix, **options)
        opened.append(factory)
        return factory

    yield _open
    for factory in opened:
        await factory.close()
