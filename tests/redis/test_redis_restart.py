"""The first command after a Redis restart, on a connection the old server closed.

redis-py's pool checks, before handing out a pooled connection, that the server has not
closed it, and opens a new one if it has. redis-py 8.1's asyncio pool skips that check
while maintenance notifications are on, which RESP3 (its default) turns on by default
(redis-py issue #4252): the command was written on the closed connection and failed with
"Connection closed by server", which cannot tell that it never ran (a stop's put-back of
popped messages was then dropped). The backends build their redis-py clients with the
notifications off, so the check runs again.

Each test restarts a private server (``own_servers``); the shared one is never touched.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from backends import REDIS_URL, new_token
from own_servers import own_redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

import aio_keuss
from aio_keuss.redis import connection as redis_connection
from aio_keuss.redis.list import RedisListBackend

pytestmark = pytest.mark.timeout(120)

PATHS = pytest.mark.parametrize("query", ["", "?socket_keepalive=true"], ids=["lane", "redispy"])
"""The library's own connection, and redis-py, which a query option in the URL makes it use."""


@PATHS
async def test_the_first_command_after_a_restart_runs(query: str) -> None:
    """Nothing else uses the backend meanwhile, so its one pooled connection is the one the
    old server closed; the loop runs during the restart (the own connection sees the close)."""
    with own_redis() as server:
        backend = RedisListBackend({"url": server.url + query, "prefix": f"rs-{new_token()}"})
        try:
            await backend.open()
            assert backend.has_fast_lane is (query == "")
            await asyncio.to_thread(server.stop)
            await asyncio.to_thread(server.start)  # emptied
            await backend.execute("RPUSH", f"{backend.prefix}:list", "x")
            assert await backend.execute("LLEN", f"{backend.prefix}:list") == 1
        finally:
            await backend.close()


def _users_client(url: str, **kwargs: Any) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kwargs)


async def test_a_users_client_that_skips_the_check_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The library never changes a client it was given: it says what the notifications
    risk there, and how to turn them off."""
    client = _users_client(REDIS_URL)
    try:
        if not redis_connection.skips_closed_check(client):
            pytest.skip(f"redis-py {redis.__version__} checks pooled connections")
        with caplog.at_level(logging.WARNING, logger="aio_keuss"):
            async with aio_keuss.connect("redis-list", client=client, prefix=f"rs-{new_token()}"):
                pass
        warnings = [r for r in caplog.records if "MaintNotificationsConfig" in r.getMessage()]
        assert len(warnings) == 1, caplog.text
        assert client.connection_pool.maint_notifications_enabled()  # untouched
    finally:
        await client.aclose()


async def test_a_users_client_made_as_the_warning_says_survives_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Made so, a client of the user's is not warned about and sends the first command
    after a restart on a new connection."""
    config = importlib.import_module("redis.maint_notifications").MaintNotificationsConfig
    with own_redis() as server:
        client = _users_client(server.url, maint_notifications_config=config(enabled=False))
        try:
            with caplog.at_level(logging.WARNING, logger="aio_keuss"):
                backend = RedisListBackend({"client": client, "prefix": f"rs-{new_token()}"})
            assert "MaintNotificationsConfig" not in caplog.text
            await backend.open()
            await asyncio.to_thread(server.stop)
            await asyncio.to_thread(server.start)  # emptied
            await backend.execute("RPUSH", f"{backend.prefix}:list", "x")
            assert await backend.execute("LLEN", f"{backend.prefix}:list") == 1
            await backend.close()
        finally:
            await client.aclose()
