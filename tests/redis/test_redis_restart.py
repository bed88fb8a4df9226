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

import pytest
from backends import new_token
from own_servers import own_redis

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
