"""A promote whose caller is cancelled after the database did it, before its reply came
back: consumers of other processes must still be woken, as for a push (its signal), or
they sleep until their poll interval while the message is ready.

MongoDB's calls are interruptible (PyMongo gives up the wait on a cancellation), so the
write stands while its caller never learns it. The reply is held back
by a TCP proxy (``ReplyGate``) so that the cancellation lands exactly there. Time bounds
are hang guards only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from backends import _drop_mongo_database, new_token
from mongo_server import MONGO_URL, start_mongo
from reply_gate import ReplyGate

import aio_keuss

pytestmark = pytest.mark.timeout(120)

HANG_GUARD = 60.0
LATER = 3600.0
"""A delay no test outlives (longer than the consumer's poll interval too)."""


def _through(url: str, gate: ReplyGate) -> str:
    parts = urlsplit(url)
    credentials = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{credentials}127.0.0.1:{gate.port}"))


def _mongo() -> tuple[str, dict[str, Any], Callable[[ReplyGate], dict[str, Any]]]:
    reason = start_mongo()
    if reason:
        pytest.skip(reason)
    options = {"url": MONGO_URL, "database": f"akt_{new_token()}"}

    def gated(gate: ReplyGate) -> dict[str, Any]:
        return {**options, "url": _through(MONGO_URL, gate) + "/?directConnection=true"}

    return "mongo", options, gated


@pytest.fixture
async def backend() -> AsyncIterator[tuple[str, dict[str, Any], dict[str, Any], ReplyGate]]:
    name, direct, gated = _mongo()
    host, port = urlsplit(direct["url"]).hostname, urlsplit(direct["url"]).port
    gate = ReplyGate(host or "127.0.0.1", port or 27017)
    try:
        yield name, direct, gated(gate), gate
    finally:
        gate.open()
        await _drop_mongo_database(direct)


async def _cancelled_once_done(
    gate: ReplyGate, call: Coroutine[Any, Any, Any], done: Callable[[], Awaitable[bool]]
) -> None:
    """Run ``call`` with its replies held at ``gate``, cancel it once ``done`` sees that the
    server did it (its reply still held), then let the replies through: the call ends
    cancelled."""
    gate.shut()
    task = asyncio.create_task(call)
    for _ in range(6000):  # the server did it; its reply is held
        if await done():
            break
        await asyncio.sleep(0.01)
    task.cancel()
    gate.open()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_promote_cancelled_once_done_still_wakes_other_processes(
    backend: tuple[str, dict[str, Any], dict[str, Any], ReplyGate],
) -> None:
    name, direct, gated, gate = backend
    async with (
        aio_keuss.connect(name, **direct, poll_interval=300.0) as consuming,
        aio_keuss.connect(name, **gated, poll_interval=300.0) as promoting,
    ):
        consumer, promoter = await consuming.queue("jobs"), await promoting.queue("jobs")
        message_id = await promoter.push("x", delay=LATER)
        waiter = asyncio.create_task(consumer.pop(timeout=None))  # woken by a signal only
        # connections opened now, as in the remove case below: one the promote would open
        # while the gate is shut (its push's signal still holding the first) never gets its
        # handshake's reply, and the promote never reaches the server
        await asyncio.gather(*(promoter.sizes() for _ in range(4)))
        await asyncio.sleep(0.3)  # it took nothing and sleeps (an order, not a bound)

        async def promoted() -> bool:
            return bool((await consumer.sizes()).size)

        await _cancelled_once_done(gate, promoter.promote(message_id), promoted)
        got = await asyncio.wait_for(waiter, HANG_GUARD)
        assert got is not None and got.id == message_id


async def test_a_remove_cancelled_once_done_still_keeps_its_failure(
    backend: tuple[str, dict[str, Any], dict[str, Any], ReplyGate],
) -> None:
    """The same for a remove on a queue keeping results: its waiters are told the message
    will never finish (its failure result), else they wait for ever."""
    name, direct, gated, gate = backend
    async with (
        aio_keuss.connect(name, **direct, poll_interval=300.0) as reading,
        aio_keuss.connect(name, **gated, poll_interval=300.0) as removing,
    ):
        reader = await reading.queue("jobs", result_ttl=600)
        remover = await removing.queue("jobs", result_ttl=600)
        message_id = await remover.push("x", delay=LATER)
        waiter = asyncio.create_task(reader.result(message_id, timeout=None))
        # connections opened now, so that the remove finds one in the pool: one opened
        # while the gate is shut never gets its handshake's reply
        await asyncio.gather(*(remover.sizes() for _ in range(4)))

        async def removed() -> bool:
            return not (await reader.sizes()).total

        await _cancelled_once_done(gate, remover.remove(message_id), removed)
        got = await asyncio.wait_for(waiter, HANG_GUARD)
        assert got is not None and not got.ok and got.error == "removed"
