"""``consume()`` and ``async for`` through server outages, handler failure logs, and
reservations given back when a factory closes.

Outages are made on private servers (``own_servers``, and a private nx-27017 here), never on
the shared ones. Deadlines are generous bounds on hangs, not measures of speed: a test waits
for a state or a count, and fails only if it never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from backends import REDIS_URL, _drop_redis_prefix, new_token
from conftest import Connect, needs
from own_servers import own_mongo, own_postgres, own_redis
from two_addresses import TWO_ADDRESSES, resolving_to_both

import aio_keuss
import aio_keuss.consumer as consumer_module
from aio_keuss import Message

pytestmark = pytest.mark.timeout(240)

OUTAGE_LOGGER = "aio_keuss.consumer"
DEADLINE = 90.0


async def eventually(check: Callable[[], bool], what: str, seconds: float = DEADLINE) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        await asyncio.sleep(0.05)


def _records(caplog: pytest.LogCaptureFixture, level: int, queue: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == OUTAGE_LOGGER and r.levelno == level and repr(queue) in r.getMessage()
    ]


@contextlib.contextmanager
def own_server(kind: str) -> Iterator[Any]:
    """A private server for ``kind`` ("redis", "postgres" or "mongo")."""
    if kind == "redis":
        with own_redis() as redis_server:
            yield redis_server
    elif kind == "postgres":
        try:
            server_cm = own_postgres()
            postgres_server = server_cm.__enter__()
        except RuntimeError as exc:
            pytest.skip(str(exc))
        try:
            yield postgres_server
        finally:
            server_cm.__exit__(None, None, None)
    else:
        with own_mongo() as mongo_server:
            yield mongo_server


def _options(kind: str, url: str) -> dict[str, Any]:
    token = new_token()
    if kind == "redis":
        return {"url": url, "prefix": f"akt-{token}"}
    if kind == "postgres":
        return {"url": url, "schema": f"akt_{token}"}
    return {"url": url, "database": f"akt_{token}", "server_selection_timeout": 2.0}


OUTAGE_CASES = [
    pytest.param("redis-oq", "redis", id="redis-oq"),
    pytest.param("postgres", "postgres", id="postgres"),
    pytest.param("mongo", "mongo", id="mongo"),
]


# item 5: consumers survive outages ------------------------------------------------------


@pytest.mark.parametrize(("backend", "kind"), OUTAGE_CASES)
async def test_consume_survives_a_server_restart(
    backend: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Restart the server under consume(concurrency=4): the workers report the outage once,
    go to "reconnecting", come back to "running" by themselves and handle later pushes."""
    caplog.set_level(logging.DEBUG, logger="aio_keuss")
    with own_server(kind) as server:
        # A short poll interval makes idle workers touch the server during the outage, so
        # the test sees them notice it without pushing anything meanwhile.
        factory = await aio_keuss.connect(backend, poll_interval=0.2, **_options(kind, server.url))
        try:
            q = await factory.queue("jobs")
            handled: list[Any] = []

            async def handler(message: Message) -> None:
                handled.append(message.payload)

            consumer = q.consume(handler, concurrency=4, retry_delay=0.05)
            assert consumer.state == "running"
            await q.push_many(list(range(5)))
            await eventually(lambda: len(handled) == 5, "the first messages")

            for outage in range(2):  # two outages: one warning and one info line each
                await asyncio.to_thread(server.stop)
                await eventually(lambda: consumer.state == "reconnecting", "reconnecting")
                status = consumer.status()
                assert status.state == "reconnecting"
                assert isinstance(status.last_error, aio_keuss.KeussError)
                assert isinstance(consumer.last_error, aio_keuss.KeussConnectionError)
                await asyncio.to_thread(server.start)
                await eventually(lambda: consumer.state == "running", "running again")
                payloads = [f"after-{outage}-{i}" for i in range(10)]
                await push_retrying(q, payloads)
                await eventually(
                    lambda p=payloads: set(p) <= set(handled),
                    "messages after the restart",
                )
                assert all(not task.done() for task in consumer._workers)
                assert len(_records(caplog, logging.WARNING, "jobs")) == outage + 1
                assert len(_records(caplog, logging.INFO, "jobs")) == outage + 1
            assert consumer.handled == consumer.processed == len(handled)
            assert consumer.failed == 0
            await consumer.stop()
            assert consumer.state == "stopped"
        finally:
            await factory.close()


async def push_retrying(q: aio_keuss.Queue, payloads: list[Any]) -> None:
    """Push once the server answers again (the producer's own retry, not the consumer's)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            await q.push_many(payloads)
            return
        except aio_keuss.KeussConnectionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_async_for_survives_a_redis_restart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aio_keuss")
    with own_redis() as server:
        factory = await aio_keuss.connect(
            "redis-oq", poll_interval=0.2, **_options("redis", server.url)
        )
        try:
            q = await factory.queue("iter")
            seen: list[Any] = []

            async def iterate() -> None:
                async for message in q:
                    seen.append(message.payload)
                    await q.ok(message)

            task = asyncio.create_task(iterate())
            await q.push("before")
            await eventually(lambda: seen == ["before"], "the first message")
            await asyncio.to_thread(server.stop)
            await eventually(
                lambda: len(_records(caplog, logging.WARNING, "iter")) == 1, "the outage warning"
            )
            assert not task.done()
            await asyncio.to_thread(server.start)
            await push_retrying(q, ["after"])
            await eventually(lambda: seen == ["before", "after"], "a message after the restart")
            assert not task.done()
            assert len(_records(caplog, logging.WARNING, "iter")) == 1
            await q.drain()
            await asyncio.wait_for(task, DEADLINE)
        finally:
            await factory.close()


async def test_ok_failing_after_the_handler_ran_does_not_kill_the_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server goes away while the handler runs: its ok fails, the worker logs it, waits
    for the server and goes on with the next messages."""
    caplog.set_level(logging.INFO, logger="aio_keuss")
    with own_redis() as server:
        factory = await aio_keuss.connect(
            "redis-oq", poll_interval=0.2, **_options("redis", server.url)
        )
        try:
            q = await factory.queue("acks")
            handled: list[Any] = []

            async def handler(message: Message) -> None:
                if message.payload == "stop the server":
                    await asyncio.to_thread(server.stop)
                handled.append(message.payload)

            consumer = q.consume(handler, concurrency=1)
            await q.push("stop the server")
            await eventually(lambda: consumer.state == "reconnecting", "the failed ok")
            assert handled == ["stop the server"]
            await asyncio.to_thread(server.start)
            await push_retrying(q, ["next"])
            await eventually(lambda: "next" in handled, "the message after the restart")
            assert consumer.state == "running"
            assert all(not task.done() for task in consumer._workers)
            warnings = _records(caplog, logging.WARNING, "acks")
            assert len(warnings) == 1 and "ok" in warnings[0].getMessage()
            await consumer.stop()
        finally:
            await factory.close()


async def test_backend_errors_from_reserve_are_logged_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that answers with an error (here: the queue's key holds the wrong type) is
    reported once at error level; the workers retry and recover when the key is fixed."""
    redis = pytest.importorskip("redis.asyncio")
    caplog.set_level(logging.INFO, logger="aio_keuss")
    options = _options("redis", "redis://127.0.0.1:6379/0")
    factory = await aio_keuss.connect("redis-oq", poll_interval=0.2, **options)
    client = redis.Redis.from_url(options["url"])
    try:
        q = await factory.queue("broken")
        handled: list[Any] = []
        consumer = q.consume(lambda m: handled.append(m.payload), concurrency=2)
        key = f"{options['prefix']}:{{broken}}:due"
        await client.delete(key)
        await client.set(key, "not a sorted set")
        await eventually(lambda: consumer.state == "reconnecting", "the backend error")
        assert isinstance(consumer.last_error, aio_keuss.BackendError)
        errors = _records(caplog, logging.ERROR, "broken")
        assert len(errors) == 1 and errors[0].exc_info is not None
        await client.delete(key)
        await q.push("fixed")
        await eventually(lambda: handled == ["fixed"], "a message once the key is fixed")
        assert consumer.state == "running"
        assert len(_records(caplog, logging.ERROR, "broken")) == 1
        assert len(_records(caplog, logging.INFO, "broken")) == 1
        await consumer.stop()
    finally:
        await factory.close()
        keys = [k async for k in client.scan_iter(match=options["prefix"] + ":*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


# item 14: handler failures are logged with their traceback, rate-limited ----------------


async def test_handler_failures_log_tracebacks_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A poison message retried in a loop: one traceback per interval, the rest counted in
    summary lines, so every failure is accounted for and the log is not flooded."""
    caplog.set_level(logging.INFO, logger="aio_keuss")
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("failing")

        def boom(message: Message) -> None:
            raise ValueError(f"bad payload {message.payload}")

        began = time.monotonic()
        consumer = q.consume(boom, concurrency=2, retry_delay=0.0, max_retry_delay=0.0)
        await q.push_many(list(range(10)))
        await eventually(lambda: consumer.failed >= 200, "two hundred failures")
        await consumer.stop()
        elapsed = time.monotonic() - began
    warnings = _records(caplog, logging.WARNING, "failing")
    tracebacks = [r for r in warnings if "handler failed" in r.getMessage()]
    summaries = [r for r in warnings if "more handler failures" in r.getMessage()]
    assert tracebacks and all(
        r.exc_info is not None and r.exc_info[0] is ValueError for r in tracebacks
    )
    assert all("message " in r.getMessage() and "tries" in r.getMessage() for r in tracebacks)
    # At most one traceback per interval, however slow the machine was...
    assert len(tracebacks) <= 1 + elapsed / aio_keuss.consumer.TRACEBACK_EVERY
    # ... and each failure either shown or counted in a summary (the last one at stop).
    counted = sum(r.args[1] for r in summaries)
    assert len(tracebacks) + counted == consumer.failed


async def test_handler_failure_traceback_at_warning_without_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aio_keuss")
    async with aio_keuss.connect("memory") as factory:
        q = await factory.queue("once")
        done = asyncio.Event()

        def boom(message: Message) -> None:
            if message.tries == 0:
                raise KeyError("missing field")
            done.set()

        async with q.consume(boom, retry_delay=0.0):
            msg_id = await q.push("x")
            await asyncio.wait_for(done.wait(), DEADLINE)
    (record,) = [r for r in caplog.records if "handler failed" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.exc_info is not None
    assert msg_id in record.getMessage() and "'once'" in record.getMessage()
    assert "tries 0" in record.getMessage()


# item 15: close gives back the reservations nobody acknowledged -------------------------


async def test_close_gives_back_unacknowledged_reservations(connect: Connect) -> None:
    factory = await connect(poll_interval=5.0, reserve_delay=120.0)
    needs(factory, "reserve", "shared")
    q = await factory.queue("held")
    await q.push_many(["a", "b", "c", "d", "e"])
    first = await q.reserve_many(3, timeout=10)
    assert len(first) == 3
    tries = {m.id: m.tries for m in first}
    acked = await q.reserve(timeout=10)
    assert acked is not None and await q.ok(acked.id)  # by id string: forgotten too
    koed = await q.reserve(timeout=10)
    assert koed is not None
    expected = dict(tries)
    if factory.capabilities.delay:
        assert await q.ko(koed, delay=60.0)  # not given back by close: still delayed after
    else:
        assert await q.ko(koed)  # due again at once, with the try it cost
        expected[koed.id] = koed.tries + 1
    await factory.close()

    again = await connect(poll_interval=5.0, reserve_delay=120.0)
    q2 = await again.queue("held")
    # Deliverable now, not after reserve_delay (bucket stores count a whole free bucket as
    # ready by its score, the delayed message too, hence at least).
    assert await q2.size() >= len(expected)
    back: list[Message] = []
    deadline = time.monotonic() + 30
    while len(back) < len(expected) and time.monotonic() < deadline:
        back += await q2.reserve_many(5, timeout=1)  # at once: far below reserve_delay
    assert {m.id: m.tries for m in back} == expected  # given back without costing a try
    assert await q2.reserve(timeout=0.2) is None
    if factory.capabilities.delay:
        assert (await q2.sizes()).scheduled == 1


async def test_ok_by_id_and_released_reservations_are_forgotten(connect: Connect) -> None:
    """What is acknowledged, however, is not released again at close."""
    factory = await connect(poll_interval=5.0)
    needs(factory, "reserve")
    q = await factory.queue("forget")
    await q.push_many([1, 2, 3])
    messages = await q.reserve_many(3, timeout=10)
    assert len(messages) == 3
    assert len(q._held) == 3
    assert await q.ok(messages[0].id)
    assert await q.ok(messages[1])
    assert await q.ko(messages[2].id)
    assert not q._held and not q._held_before


async def test_reservations_nobody_acknowledged_are_not_remembered_forever() -> None:
    """What is held for ``close`` stays bounded when reservations are left to expire."""
    from aio_keuss.queue import HELD_CHECK

    async with aio_keuss.connect("memory", reserve_delay=0.1) as factory:
        q = await factory.queue("leaky")
        per_round, rounds = HELD_CHECK + 100, 4
        await q.push_many(list(range(per_round * rounds)))
        for _ in range(rounds):
            taken = 0
            while taken < per_round:
                taken += len(await q.reserve_many(per_round - taken, timeout=0))
            await asyncio.sleep(0.25)  # every reservation so far has expired
        held = len(q._held) + len(q._held_before)
        assert held <= 2 * per_round < per_round * rounds


# prefetch: oks awaited in the background, all of them in before stop returns -------------


async def test_prefetch_oks_are_all_in_when_stop_returns(connect: Connect) -> None:
    factory = await connect()
    needs(factory, "reserve")
    q = await factory.queue("prefetched")
    await q.push_many(list(range(300)))
    handled: list[int] = []
    all_done = asyncio.Event()

    async def note(message: Message) -> None:
        handled.append(message.payload)
        if len(handled) == 300:
            all_done.set()

    consumer = q.consume(note, concurrency=3, prefetch=8)
    await asyncio.wait_for(all_done.wait(), DEADLINE)
    await consumer.stop()
    assert sorted(handled) == list(range(300))
    assert await q.total_size() == 0  # every ok landed: nothing left reserved
    assert (await q.stats())["commit"] == 300


async def _holding_ten_prefetched(q: Any) -> Any:
    """A consumer of eleven messages on a backend without reserve: one handler hangs on the
    first, the ten others wait popped in its prefetch buffer."""
    await q.push_many(list(range(11)))
    started = asyncio.Event()

    async def hang(message: Message) -> None:
        started.set()
        await asyncio.Event().wait()

    consumer = q.consume(hang, concurrency=1, prefetch=10)
    await asyncio.wait_for(started.wait(), DEADLINE)
    await eventually(lambda: len(consumer._buffer) == 10, "the prefetch")
    return consumer


async def _put_back_while_stopped(server: Any, url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Ten messages prefetched (popped) from ``server`` through ``url``, the server stopped,
    the consumer's stop refused meanwhile, the server started again empty: all ten are back."""
    async with aio_keuss.connect("redis-list", url=url, prefix="pb") as factory:
        q = await factory.queue("jobs")
        consumer = await _holding_ten_prefetched(q)
        await asyncio.to_thread(server.stop)
        stopping = await _stop_until_the_put_back_is_refused(consumer, caplog)
        await asyncio.to_thread(server.start)  # emptied: only what is put back is there
        await asyncio.wait_for(stopping, DEADLINE)
        assert await q.size() == 10


async def _stop_until_the_put_back_is_refused(
    consumer: Any, caplog: pytest.LogCaptureFixture
) -> asyncio.Future[Any]:
    """The consumer's stop, begun, once its put-back of the ten was refused (logged)."""
    stopping = asyncio.ensure_future(consumer.stop(0))
    await eventually(
        lambda: any("put back of 10" in r.getMessage() for r in caplog.records),
        "the refused put-back",
    )
    return stopping


async def test_popped_prefetched_messages_go_back_once_the_server_is_back_during_a_stop(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend without reserve (redis-list) pops what a consumer prefetches: a stop puts
    those back, or they are lost. Asked while the server is down (a restart under way), that
    put-back was tried once, refused, logged as "retrying with backoff", and the messages
    were gone; a refused connection sent nothing, so it is tried again within the stop's
    bound for acknowledgements (lengthened here, so that the test does not race it)."""
    monkeypatch.setattr(consumer_module, "ACK_WAIT", DEADLINE)
    caplog.set_level(logging.WARNING, logger=OUTAGE_LOGGER)
    with own_redis() as server:
        await _put_back_while_stopped(server, server.url, caplog)


async def test_popped_prefetched_messages_go_back_through_redis_py_after_a_restart() -> None:
    """As above, through redis-py (which a query option in the URL makes the backend use),
    with the server restarted before the stop. redis-py 8.1's pool handed the put-back the
    connection the old server had closed, without its check for a closed connection
    (skipped while maintenance notifications are on, their default under RESP3): the
    put-back failed with "Connection closed by server", was taken for a command that may
    have run, and the ten messages were lost. The restart blocks the loop, so that no
    other command (a stats flush, a read of the paused flag) meets the closed connection
    first and the put-back is the first command after it."""
    with own_redis() as server:
        url = server.url + "?socket_keepalive=true"
        async with aio_keuss.connect("redis-list", url=url, prefix="pb") as factory:
            assert not factory.backend.has_fast_lane  # type: ignore[attr-defined]
            q = await factory.queue("jobs")
            consumer = await _holding_ten_prefetched(q)
            server.stop()
            server.start()  # emptied: only what is put back is there
            await asyncio.wait_for(consumer.stop(0), DEADLINE)
            assert await q.size() == 10


async def test_popped_prefetched_messages_go_back_over_a_unix_socket_once_the_server_is_back(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As above, over a unix socket: a stopped server removes its socket file, so a connect
    meanwhile finds no file (ENOENT), not a refusal. Nothing was sent either way, yet the
    put-back was tried once and the messages were lost."""
    monkeypatch.setattr(consumer_module, "ACK_WAIT", DEADLINE)
    caplog.set_level(logging.WARNING, logger=OUTAGE_LOGGER)
    path = tmp_path / "redis.sock"
    with own_redis("--unixsocket", str(path), "--unixsocketperm", "700") as server:
        url = f"unix://{path}"
        async with aio_keuss.connect("redis-list", url=url, prefix="pb") as factory:
            q = await factory.queue("jobs")
            consumer = await _holding_ten_prefetched(q)
            await asyncio.to_thread(server.stop)
            assert not path.exists()
            stopping = await _stop_until_the_put_back_is_refused(consumer, caplog)
            await asyncio.to_thread(server.start)  # emptied: only what is put back is there
            await asyncio.wait_for(stopping, DEADLINE)
            assert await q.size() == 10


async def test_popped_prefetched_messages_go_back_once_the_server_serves_again(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with a server that answers but cannot serve the put-back yet: one still
    loading its data after a restart answers LOADING, one running a long script BUSY (the
    one made here: it needs no timing). Such a reply says the command was not run, so it is
    tried again too; it was tried once and the messages were lost."""
    import redis

    monkeypatch.setattr(consumer_module, "ACK_WAIT", DEADLINE)
    caplog.set_level(logging.WARNING, logger=OUTAGE_LOGGER)
    with own_redis("--busy-reply-threshold", "50") as server:
        async with aio_keuss.connect("redis-list", url=server.url, prefix="pb") as factory:
            q = await factory.queue("jobs")
            consumer = await _holding_ten_prefetched(q)
            other = redis.Redis(port=server.port)

            def busy() -> None:
                with contextlib.suppress(redis.ResponseError):  # killed
                    redis.Redis(port=server.port).eval("while true do end", 0)

            looping = asyncio.ensure_future(asyncio.to_thread(busy))

            def answers_busy() -> bool:
                try:
                    other.ping()
                except redis.ResponseError as exc:
                    return str(exc).startswith("BUSY")
                return False

            await eventually(answers_busy, "the busy server")
            stopping = await _stop_until_the_put_back_is_refused(consumer, caplog)
            await asyncio.to_thread(other.script_kill)
            await asyncio.wait_for(looping, DEADLINE)
            await asyncio.wait_for(stopping, DEADLINE)
            other.close()
            assert await q.size() == 10


async def test_popped_prefetched_messages_go_back_when_every_address_of_the_host_refused(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with a host name of two addresses (``localhost`` as ::1 and 127.0.0.1):
    asyncio tries each, and when all refuse it raises one ``OSError`` listing them, with no
    errno and no refusal in its chain. Nothing was sent, yet the put-back was not tried
    again and the messages were lost."""
    monkeypatch.setattr(consumer_module, "ACK_WAIT", DEADLINE)
    caplog.set_level(logging.WARNING, logger=OUTAGE_LOGGER)
    resolving_to_both(monkeypatch)
    with own_redis() as server:  # listening on 127.0.0.1 only: ::1 refuses
        await _put_back_while_stopped(server, f"redis://{TWO_ADDRESSES}:{server.port}/0", caplog)


async def test_redis_reliable_close_with_the_server_away_closes_every_queue() -> None:
    """README: if the server is down at close, reservations come back when they expire.
    Closing must not raise, and must still stop every queue's consumers."""

    async def handler(message: Message) -> None:
        pass

    with own_redis() as server:
        factory = await aio_keuss.connect("redis-reliable", url=server.url, prefix="rc")
        first = (await factory.queue("a")).consume(handler)
        second = (await factory.queue("b")).consume(handler)
        await asyncio.sleep(0.3)  # both have reserved once: their recovery tasks run
        await asyncio.to_thread(server.stop)
        await factory.close()
        assert first.state == "stopped" and second.state == "stopped"


async def test_an_idle_consumer_reports_an_outage_without_waiting_for_its_poll() -> None:
    """The signal bus notices a lost server at once: an idle consumer must show it
    ("reconnecting", hence /healthz 503) well before its poll_interval."""

    async def handler(message: Message) -> None:
        pass

    with own_redis() as server:
        async with aio_keuss.connect(
            "redis-oq", url=server.url, prefix="idle", poll_interval=60.0
        ) as factory:
            consumer = (await factory.queue("jobs")).consume(handler)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(server.stop)
            for _ in range(100):  # 10 s, far below the 60 s poll
                if consumer.state == "reconnecting":
                    break
                await asyncio.sleep(0.1)
            assert consumer.state == "reconnecting"
            await asyncio.to_thread(server.start)
            await consumer.stop(1)


async def test_an_early_fetch_keeps_at_most_half_a_prefetch_more_waiting() -> None:
    """With 2 to P workers the next fetch starts once P/2 are left and reserves P more (the
    README's bound: at most P wait beyond the waiting workers, P + P/2 while the next fetch
    is under way): never more, so that none waits long enough to be given back."""
    prefix = f"akt-{new_token()}"
    try:
        async with aio_keuss.connect("redis-oq", url=REDIS_URL, prefix=prefix) as factory:
            q = await factory.queue("jobs")
            await q.push_many(list(range(40)))
            gates = {k: asyncio.Event() for k in range(40)}
            started = {k: asyncio.Event() for k in range(40)}
            waiting_at: dict[int, int] = {}
            consumer: aio_keuss.Consumer | None = None

            async def handle(message: Message) -> None:
                assert consumer is not None
                waiting_at[message.payload] = len(consumer._buffer)
                started[message.payload].set()
                await gates[message.payload].wait()

            consumer = q.consume(handle, concurrency=2, prefetch=4)
            try:
                await started[0].wait()
                await started[1].wait()
                gates[0].set()  # its worker takes 2, leaving P/2 = 2
                await started[2].wait()
                gates[1].set()  # its worker fetches early, then takes 3
                await started[3].wait()
            finally:
                for gate in gates.values():
                    gate.set()
                await consumer.stop()
            assert waiting_at[3] <= 4 + 4 // 2, waiting_at
    finally:
        await _drop_redis_prefix({"url": REDIS_URL, "prefix": prefix})
