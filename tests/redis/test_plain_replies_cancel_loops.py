"""One-message calls cancelled at every await point, in loops (real Redis).

A pop's, a reserve's, an ok's and a push's reply is a plain future cancelled with its caller
while the command still runs (see ``coalesce.settled``). Here callers are cancelled after a
random number of loop iterations (0: before the command's reply could be in, more: while
it is in flight, or once it is in), several at once, and the messages are counted: every
message pushed comes out exactly once, none lost, none handed to two holders.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token

import aio_keuss
from aio_keuss.redis import connection as redis_connection

pytestmark = pytest.mark.timeout(120)

ROUNDS = 300
CALLERS = 4
MESSAGES = 200


@pytest.fixture
async def factory(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    prefix = f"akcancel{new_token()}"
    factory = await aio_keuss.connect(request.param, url=REDIS_URL, prefix=prefix, reserve_delay=60)
    try:
        yield factory
    finally:
        await factory.close()
        await _drop_redis_prefix({"url": REDIS_URL, "prefix": prefix})


async def _cancelled_after(call: Any, turns: int) -> Any:
    """The call's result, or None when the cancellation after ``turns`` iterations landed
    first (the call then ended cancelled)."""
    task = asyncio.ensure_future(call)
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


def _nothing_parked() -> bool:
    """No reply of a cancelled call left parked for nobody (kept as long as its connection)."""
    return not any(protocol._parked for protocol in list(redis_connection._PROTOCOLS))


async def _drain(take: Any) -> list[Any]:
    out = []
    while (message := await take(timeout=0)) is not None:
        out.append(message)
    return out


@pytest.mark.parametrize("factory", ["redis-list", "redis-oq", "redis-reliable"], indirect=True)
async def test_pops_cancelled_anywhere_lose_no_message(factory: Any) -> None:
    q = await factory.queue("q")
    pushed = [f"m{i}" for i in range(MESSAGES)]
    for payload in pushed:
        await q.push(payload)
    rng = random.Random(7)
    got: list[str] = []

    async def caller() -> None:
        for _ in range(ROUNDS // CALLERS):
            message = await _cancelled_after(q.pop(timeout=0), rng.randrange(6))
            if message is not None:
                got.append(message.payload)

    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    got += [m.payload for m in await _drain(q.pop)]
    assert sorted(got) == sorted(pushed)
    assert _nothing_parked()


@pytest.mark.parametrize("factory", ["redis-oq", "redis-reliable"], indirect=True)
async def test_reserves_and_oks_cancelled_anywhere_lose_or_double_no_message(
    factory: Any,
) -> None:
    q = await factory.queue("q")
    pushed = [f"m{i}" for i in range(MESSAGES)]
    for payload in pushed:
        await q.push(payload)
    rng = random.Random(11)
    held: set[str] = set()  # ids handed out to a holder that got them
    done: list[str] = []

    async def settle(message: Any) -> None:
        # an ok cancelled anywhere: done or not, the next ok says which, truthfully
        if not await _cancelled_after(q.ok(message), rng.randrange(6)) and not await q.ok(
            message
        ):  # the cancelled one was done: the message is gone
            assert await q.find(message.id) is None
        done.append(message.id)

    async def caller() -> None:
        for _ in range(ROUNDS // CALLERS):
            message = await _cancelled_after(q.reserve(timeout=0), rng.randrange(6))
            if message is not None:
                assert message.id not in held, "handed to two holders"
                held.add(message.id)
                await settle(message)

    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    for message in await _drain(q.reserve):
        assert message.id not in held, "handed to two holders"
        held.add(message.id)
        assert await q.ok(message)
        done.append(message.id)
    assert len(done) == len(set(done)) == MESSAGES
    assert await q.size() == 0
    assert _nothing_parked()


@pytest.mark.parametrize("factory", ["redis-list", "redis-oq", "redis-reliable"], indirect=True)
async def test_pushes_cancelled_anywhere_are_written_once_or_not(factory: Any) -> None:
    q = await factory.queue("q")
    rng = random.Random(13)
    sure: set[str] = set()  # pushes that returned
    tried: set[str] = set()
    counter = iter(range(10**6))

    async def caller() -> None:
        for _ in range(ROUNDS // CALLERS):
            n = next(counter)
            tried.add(f"m{n}")
            if await _cancelled_after(q.push(f"m{n}"), rng.randrange(6)) is not None:
                sure.add(f"m{n}")

    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    out = [m.payload for m in await _drain(q.pop)]
    assert len(out) == len(set(out))  # none written twice
    assert sure <= set(out) <= tried
    assert _nothing_parked()
