"""The fast lane's ways of writing, each forced with ``write_mode`` (``auto`` picks ``first`` or
``gather`` by how busy the machine's cores are, see the README's Redis section): every command
written as it is sent (``each``), the first of a loop iteration at once and the rest of it in
one write at its end (``first``), or all of them in that write (``gather``). All must deliver
the same results in the same order, survive a lost connection and a lost script cache, and a
switch from one to another must not reorder what is already on its way."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token

import aio_keuss
from aio_keuss import cpu
from aio_keuss.redis import connection as redis_connection
from aio_keuss.redis.connection import Script

Open = Callable[..., Awaitable[aio_keuss.Factory]]
MODES = ["each", "first", "gather"]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    token = f"akw-{new_token()}"
    yield token
    await _drop_redis_prefix({"url": REDIS_URL, "prefix": token})


@pytest.fixture
async def open_factory(prefix: str) -> AsyncIterator[Open]:
    opened: list[aio_keuss.Factory] = []

    async def _open(backend: str, **options: Any) -> aio_keuss.Factory:
        factory = await aio_keuss.connect(backend, url=REDIS_URL, prefix=prefix, **options)
        opened.append(factory)
        return factory

    yield _open
    for factory in opened:
        await factory.close()


def _protocol(factory: aio_keuss.Factory) -> Any:
    return factory.backend._lane._protocol  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ["redis-oq", "redis-reliable", "redis-list"])
async def test_many_concurrent_callers_get_each_message_once(
    open_factory: Open, backend: str, mode: str
) -> None:
    factory = await open_factory(backend, write_mode=mode)
    assert factory.backend.has_fast_lane  # type: ignore[attr-defined]
    q = await factory.queue("q")
    await asyncio.gather(*(q.push({"n": n}) for n in range(150)))
    await q.push_many([{"n": n} for n in range(150, 300)])
    seen: list[int] = []

    async def consumer() -> None:
        while True:
            if backend == "redis-list":
                message = await q.pop(timeout=0.2)
            else:
                message = await q.reserve(timeout=0.2)
            if message is None:
                return
            seen.append(message.payload["n"])
            if backend != "redis-list":
                assert await q.ok(message)

    await asyncio.gather(*(consumer() for _ in range(12)))
    assert sorted(seen) == list(range(300))
    assert await q.size() == 0


async def test_a_switch_of_mode_keeps_commands_in_order(open_factory: Open) -> None:
    """Commands gathered and not yet written stay ahead of one sent after the machine
    turned quiet: replies are matched to callers by order alone."""
    factory = await open_factory("redis-oq", write_mode="gather")
    backend: Any = factory.backend
    assert await backend.execute("ECHO", "warm") == b"warm"
    protocol = _protocol(factory)
    first = backend.execute("ECHO", "a")
    second = backend.execute("ECHO", "b")
    protocol._cpu = cpu.CpuWait.fixed(False)  # as if a reading found the cores free
    third = backend.execute("ECHO", "c")
    assert await asyncio.gather(first, second, third) == [b"a", b"b", b"c"]
    assert await backend.execute("ECHO", "d") == b"d"  # now written at once


async def test_first_writes_an_iterations_first_command_at_once_and_gathers_the_rest(
    open_factory: Open,
) -> None:
    factory = await open_factory("redis-oq", write_mode="first")
    backend: Any = factory.backend
    assert await backend.execute("ECHO", "warm") == b"warm"
    protocol = _protocol(factory)
    sent = [backend.execute("ECHO", str(n)) for n in range(4)]
    assert len(protocol._gathered) == 3  # the first is on the wire already
    assert await asyncio.gather(*sent) == [b"0", b"1", b"2", b"3"]
    assert protocol._gathered == [] and not protocol._flush_due
    alone = backend.execute("ECHO", "next")  # a new iteration: written at once again
    assert protocol._gathered == []
    assert await alone == b"next"


@pytest.mark.parametrize("mode", ["first", "gather"])
async def test_gathered_commands_of_an_aborted_connection_fail_as_connection_errors(
    open_factory: Open, mode: str
) -> None:
    """Nothing gathered is written to a connection aborted before the iteration's write: its
    callers get a connection error (not a reply meant for another), and the next call
    connects again, on a protocol of its own (the old one's flush writes nothing)."""
    factory = await open_factory("redis-oq", write_mode=mode)
    backend: Any = factory.backend
    assert await backend.execute("ECHO", "warm") == b"warm"
    old = _protocol(factory)
    assert not old._gathered
    pending = [backend.execute("ECHO", str(n)) for n in range(3)]
    old.transport.abort()
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(r, aio_keuss.KeussConnectionError) for r in results), results
    again = [backend.execute("ECHO", str(n)) for n in range(3)]
    assert await asyncio.gather(*again) == [b"0", b"1", b"2"]
    assert not old._flush_due and old._gathered == []
    q = await factory.queue("q")
    await q.push("after")
    message = await q.reserve(timeout=5)
    assert message is not None and await q.ok(message)


@pytest.mark.parametrize("mode", ["first", "gather"])
@pytest.mark.parametrize("backend", ["redis-oq", "redis-reliable"])
async def test_a_lost_script_cache_is_refilled_while_writes_are_gathered(
    open_factory: Open, backend: str, mode: str
) -> None:
    """NOSCRIPT for a whole gathered write: every command is sent again as an EVAL behind
    the others, and each caller still gets its own reply."""
    factory = await open_factory(backend, write_mode=mode)
    q = await factory.queue("q")
    await q.push("before")
    admin = factory.backend.client  # type: ignore[attr-defined]
    for _ in range(2):
        await admin.script_flush()
        await asyncio.gather(*(q.push(n) for n in range(20)))
        await admin.script_flush()
        taken = await asyncio.gather(*(q.reserve(timeout=5) for _ in range(21)))
        assert sorted(str(m.payload) for m in taken if m is not None) == sorted(
            ["before", *map(str, range(20))]
        )
        await admin.script_flush()
        assert all(await asyncio.gather(*(q.ok(m) for m in taken if m is not None)))
        assert await q.size() == 0
        await q.push("before")


async def test_an_unknown_write_mode_is_refused_before_connecting() -> None:
    with pytest.raises(aio_keuss.ConfigError, match="write_mode"):
        await aio_keuss.connect("redis-oq", url="redis://127.0.0.1:1/0", write_mode="batched")


async def test_auto_follows_this_threads_reading(open_factory: Open) -> None:
    """``auto`` shares the loop thread's reading of the kernel's counters between the
    connections of the thread."""
    first = await open_factory("redis-oq")
    second = await open_factory("redis-list")
    for factory in (first, second):
        assert await factory.backend.execute("PING") in (b"PONG", "PONG")  # type: ignore[attr-defined]
    assert _protocol(first)._cpu is _protocol(second)._cpu is cpu.this_thread()


async def test_a_close_writes_what_was_gathered(open_factory: Open, prefix: str) -> None:
    """Closing the connection flushes first: commands already sent reach the server (their
    callers are told the connection closed before the replies came)."""
    factory = await open_factory("redis-oq", write_mode="gather")
    backend: Any = factory.backend
    assert await backend.execute("ECHO", "warm") == b"warm"
    pending = [backend.execute("SET", f"{prefix}:k{n}", n) for n in range(3)]
    backend._lane.close()
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(r, aio_keuss.KeussConnectionError) for r in results), results
    assert await backend.client.get(f"{prefix}:k2") == b"2"
    assert await backend.execute("ECHO", "again") == b"again"


@pytest.mark.parametrize("mode", MODES)
async def test_replies_stay_matched_while_modes_flip_and_scripts_are_lost(
    open_factory: Open, prefix: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 callers mixing plain commands and scripts, the mode flipped at random on every
    loop iteration and the script cache flushed again and again: every caller gets its
    own reply."""
    factory = await open_factory("redis-oq", write_mode=mode)
    backend: Any = factory.backend
    assert await backend.execute("ECHO", "warm") == b"warm"
    script = Script(f"-- {prefix}\nreturn ARGV[1]")
    admin = backend.client
    chance = random.Random(7)
    resent = 0
    as_eval = redis_connection._as_eval

    def counted(packed: bytes, lost: Script) -> bytes:
        nonlocal resent
        resent += 1
        return as_eval(packed, lost)

    monkeypatch.setattr(redis_connection, "_as_eval", counted)
    done = asyncio.Event()

    async def flip() -> None:
        while not done.is_set():
            protocol = _protocol(factory)
            if protocol is not None and mode != "each":
                protocol._cpu = cpu.CpuWait.fixed(chance.random() < 0.5)
            await asyncio.sleep(0)

    async def lose_scripts() -> None:
        while not done.is_set():
            await admin.script_flush()
            await asyncio.sleep(chance.random() * 0.003)

    async def caller(number: int) -> None:
        for n in range(200):
            tag = f"{number}:{n}"
            if chance.random() < 0.5:
                assert await backend.execute("ECHO", tag) == tag.encode()
            else:
                assert await backend.run_script(script, [], [tag]) == tag.encode()
            for _ in range(chance.randrange(3)):
                await asyncio.sleep(0)

    await admin.script_flush()  # the first script call at least is sent again
    helpers = [asyncio.ensure_future(flip()), asyncio.ensure_future(lose_scripts())]
    try:
        await asyncio.gather(*(caller(number) for number in range(16)))
    finally:
        done.set()
        await asyncio.gather(*helpers)
    assert resent >= 1
