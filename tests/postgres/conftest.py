"""The schema each PostgreSQL test runs in: its own, dropped after it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from backends import POSTGRES_URL, new_token

asyncpg = pytest.importorskip("asyncpg")


async def _connected(attempts: int) -> object | None:
    for attempt in range(attempts):
        try:
            return await asyncpg.connect(POSTGRES_URL, timeout=3)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            if attempt + 1 < attempts:
                await asyncio.sleep(0.2)
    return None


@pytest.fixture
async def schema() -> AsyncIterator[str]:
    """A fresh schema name (created by the code under test), skipped without a server; its
    drop waits up to 10 s for a server a restart test may leave still starting up."""
    connection = await _connected(1)
    if connection is None:
        pytest.skip(f"no PostgreSQL at {POSTGRES_URL}")
    await connection.close()  # type: ignore[attr-defined]
    name = f"akt_{new_token()}"
    yield name
    connection = await _connected(50)
    if connection is None:
        return
    try:
        await connection.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')  # type: ignore[attr-defined]
    finally:
        await connection.close()  # type: ignore[attr-defined]
