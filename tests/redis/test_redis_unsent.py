"""``KeussConnectionError.ran_nothing`` for connection failures: True only where the command
was never sent (the connection to send it on failed to open), on the library's own
connection and through redis-py alike. A stop's put-back of popped messages is tried again
on it (see the consumer's acceptance tests), so a wrong True could store them twice and a
wrong False loses them.

Each test stops a private server (``own_servers``); the shared one is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from backends import REDIS_URL, new_token
from own_servers import own_redis
from two_addresses import TWO_ADDRESSES, resolving_to_both

import aio_keuss
from aio_keuss.errors import KeussConnectionError
from aio_keuss.redis import connection as redis_connection
from aio_keuss.redis.list import RedisListBackend

pytestmark = pytest.mark.timeout(120)
DEADLINE = 60.0

PATHS = pytest.mark.parametrize("query", ["", "?socket_keepalive=true"], ids=["lane", "redispy"])
"""The library's own connection, and redis-py, which a query option in the URL makes it use."""


async def _blocked(port: int) -> None:
    """Until the server at ``port`` has a client blocked in BLPOP (the command was run)."""
    watcher = aioredis.Redis(port=port)
    try:
        deadline = time.monotonic() + DEADLINE
        while (await watcher.info("clients"))["blocked_clients"] < 1:
            assert time.monotonic() < deadline, "the BLPOP never blocked"
            await asyncio.sleep(0.05)
    finally:
        await watcher.aclose()


@PATHS
async def test_only_a_command_never_sent_ran_nothing(
    monkeypatch: pytest.MonkeyPatch, query: str
) -> None:
    """A BLPOP the server runs when it stops: its reply is lost, it did run (False). Then,
    with every address of the host name refusing, a command finds no connection to be sent
    on (True): asyncio's errno-less ``OSError`` for two refusals was taken for a failure
    after sending, on either path."""
    resolving_to_both(monkeypatch)
    with own_redis() as server:
        url = f"redis://{TWO_ADDRESSES}:{server.port}/0{query}"
        async with aio_keuss.connect("redis-list", url=url, prefix="rn") as factory:
            backend = factory.backend
            assert backend.has_fast_lane is (query == "")  # type: ignore[attr-defined]
            waiting = asyncio.ensure_future(backend.execute("BLPOP", "rn:none", 0))  # type: ignore[attr-defined]
            await _blocked(server.port)
            await asyncio.to_thread(server.stop)
            with pytest.raises(KeussConnectionError) as sent:
                await asyncio.wait_for(waiting, DEADLINE)
            assert not sent.value.ran_nothing, sent.value
            with pytest.raises(KeussConnectionError) as unsent:
                await backend.execute("RPUSH", "rn:list", "x")  # type: ignore[attr-defined]
            assert "Multiple exceptions" in repr(unsent.value), unsent.value
            assert unsent.value.ran_nothing, unsent.value


@contextlib.contextmanager
def _dropping_syns() -> Iterator[int]:
    """A port whose connects time out: a listener accepting nothing, its queue full (one
    connection, with a backlog of 0), so that the kernel drops further SYNs (listen(2))."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        filler.connect(("127.0.0.1", port))
        yield port


@contextlib.asynccontextmanager
async def _unopened(url: str) -> AsyncIterator[RedisListBackend]:
    """A backend never opened (opening would connect), closed at the end."""
    backend = RedisListBackend({"url": url, "prefix": f"rn-{new_token()}"})
    try:
        yield backend
    finally:
        await backend.close()


@pytest.mark.parametrize("query", ["", "?socket_connect_timeout=1"], ids=["lane", "redispy"])
async def test_a_connect_that_timed_out_ran_nothing(
    monkeypatch: pytest.MonkeyPatch, query: str
) -> None:
    """A host that drops SYNs: the connect times out, and the command was never sent."""
    monkeypatch.setattr(redis_connection, "CONNECT_TIMEOUT", 1.0)
    with _dropping_syns() as port:
        async with _unopened(f"redis://127.0.0.1:{port}/0{query}") as backend:
            assert backend.has_fast_lane is (query == "")
            with pytest.raises(KeussConnectionError) as unsent:
                await backend.execute("RPUSH", "rn:list", "x")
            assert unsent.value.ran_nothing, unsent.value


async def test_a_reply_that_timed_out_did_not_run_nothing() -> None:
    """redis-py's ``socket_timeout`` met waiting for a reply (the BLPOP was sent and runs):
    not a failure to connect, though a timeout too."""
    async with _unopened(REDIS_URL + "?socket_timeout=1") as backend:
        with pytest.raises(KeussConnectionError) as sent:
            await backend.execute("BLPOP", f"{backend.prefix}:none", 0)
        assert not sent.value.ran_nothing, sent.value
