"""Servers that are away, starting, loading or demoted: calls raise ``KeussConnectionError``
(the error callers retry on, the driver's exception as ``__cause__``), never
``BackendError``, and the same factory works again once the server is back; the stats
flusher reports an outage once, not ten times a second.

Every server stopped, restarted or reconfigured here is a private instance on its own port
(``tests/own_servers.py``; for MongoDB an nx-27017 of the test's own): the shared servers are
never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from own_servers import OwnPostgres, OwnRedis, free_port, own_mongo, own_postgres, own_redis

import aio_keuss
from aio_keuss import BackendError, KeussConnectionError

pytestmark = pytest.mark.timeout(180)

redis = pytest.importorskip("redis")
aioredis = pytest.importorskip("redis.asyncio")
redis_errors = redis.exceptions


async def _until(condition: Callable[[], Any], within: float = 60.0) -> None:
    """Wait for a condition that depends on the servers, not on timing; the bound only keeps
    a broken run from hanging."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


@asynccontextmanager
async def _factories(*urls_and_prefixes: tuple[str, str]) -> AsyncIterator[list[aio_keuss.Factory]]:
    opened: list[aio_keuss.Factory] = []
    try:
        for url, prefix in urls_and_prefixes:
            opened.append(await aio_keuss.connect("redis-oq", url=url, prefix=prefix))
        yield opened
    finally:
        for factory in opened:  # each one, whatever the others' close raised
            with contextlib.suppress(aio_keuss.KeussError):
                await factory.close()


def _both_paths(server: OwnRedis) -> tuple[tuple[str, str], tuple[str, str]]:
    """The library's own fast lane (a plain URL), and redis-py (a URL with a query option)."""
    return (server.url, "lane"), (server.url + "?socket_timeout=30", "redispy")


async def _raises_connection_error(call: Callable[[], Any], cause: type[BaseException]) -> None:
    """``call`` raises KeussConnectionError caused by ``cause``; redis-py may first report
    the connection the restart broke, which is a connection error too."""
    for _ in range(3):
        with pytest.raises(KeussConnectionError) as caught:
            await call()
        if isinstance(caught.value.__cause__, cause):
            return
    pytest.fail(f"{caught.value!r} is not caused by {cause.__name__}")


# Redis ----------------------------------------------------------------------------------


async def test_redis_loading_is_a_connection_error_until_the_data_is_loaded() -> None:
    # Keys bigger than the loading server's event interval: it answers clients between keys.
    # key-load-delay (a test setting of redis-server, in microseconds per key) makes the load
    # last as long as the test needs; it is lifted to end the load.
    with own_redis(
        "--dbfilename", "dump.rdb", "--loading-process-events-interval-bytes", "1024"
    ) as server:  # fmt: skip
        admin = aioredis.Redis.from_url(server.url)
        try:
            for start in range(0, 400, 50):
                await admin.mset({f"fill:{i}": os.urandom(2048) for i in range(start, start + 50)})
            async with _factories(*_both_paths(server)) as (lane, redispy):
                assert lane.backend.has_fast_lane  # type: ignore[attr-defined]
                assert not redispy.backend.has_fast_lane  # type: ignore[attr-defined]
                queues = [await lane.queue("q"), await redispy.queue("q")]
                for q in queues:
                    await q.push("before")
                await admin.save()
                await admin.aclose()

                server.stop()
                server.extra = (*server.extra, "--key-load-delay", "50000")  # 20 s for 400 keys
                server.start()
                admin = aioredis.Redis.from_url(server.url)
                assert (await admin.info("persistence"))["loading"] == 1
                for q in queues:
                    await _raises_connection_error(
                        lambda q=q: q.push("during"), redis_errors.BusyLoadingError
                    )
                    await _raises_connection_error(q.size, redis_errors.BusyLoadingError)
                assert (await admin.info("persistence"))["loading"] == 1  # all of it while loading

                await admin.config_set("key-load-delay", 0)
                for _ in range(3000):
                    if (await admin.info("persistence"))["loading"] == 0:
                        break
                    await asyncio.sleep(0.02)
                for q in queues:
                    await q.push("after")
                    assert await q.size() == 2  # "before" came back; "during" never ran
        finally:
            await admin.aclose()


async def test_redis_replica_without_its_primary_is_a_connection_error() -> None:
    """MASTERDOWN: a replica that lost its primary, with ``replica-serve-stale-data no``."""
    with own_redis() as server:
        admin = aioredis.Redis.from_url(server.url)
        try:
            async with _factories(*_both_paths(server)) as factories:
                queues = [await f.queue("q") for f in factories]
                for q in queues:
                    await q.push("before")
                await admin.config_set("replica-serve-stale-data", "no")
                await admin.replicaof("127.0.0.1", free_port())  # nothing listens there
                for q in queues:
                    await _raises_connection_error(
                        lambda q=q: q.push("during"), redis_errors.MasterDownError
                    )
                    await _raises_connection_error(
                        lambda q=q: q.pop(timeout=0), redis_errors.MasterDownError
                    )
                await admin.replicaof("NO", "ONE")
                for q in queues:
                    await q.push("after")
                    assert await q.size() == 2
        finally:
            await admin.aclose()


async def test_redis_primary_demoted_by_a_failover_is_a_connection_error() -> None:
    """READONLY: the server became a replica. The fast lane also drops its connection, so
    the retry connects again (to whatever primary the address leads to by then)."""
    with own_redis() as server, own_redis() as other:
        admin = aioredis.Redis.from_url(server.url)
        try:
            async with _factories(*_both_paths(server)) as (lane, redispy):
                queues = [await lane.queue("q"), await redispy.queue("q")]
                for q in queues:
                    await q.push("before")
                client_id = await lane.backend.execute("CLIENT", "ID")  # type: ignore[attr-defined]
                await admin.replicaof("127.0.0.1", other.port)
                for q in queues:  # a push always writes (a pop of nothing may not)
                    await _raises_connection_error(
                        lambda q=q: q.push("during"), redis_errors.ReadOnlyError
                    )
                await admin.replicaof("NO", "ONE")
                reconnected = await lane.backend.execute("CLIENT", "ID")  # type: ignore[attr-defined]
                assert reconnected != client_id
                for q in queues:
                    await q.push("after")
                    assert await q.size() >= 1  # "before" too unless the sync emptied it
        finally:
            await admin.aclose()


async def _serve_every_slot(admin: Any) -> None:
    await admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    for _ in range(3000):
        if b"cluster_state:ok" in await admin.execute_command("CLUSTER", "INFO"):
            return
        await asyncio.sleep(0.02)


async def test_redis_cluster_slot_not_served_is_a_connection_error() -> None:
    """CLUSTERDOWN: a one-node cluster whose slots are taken away answers keyed commands so
    (to a client that does not speak cluster, hence both paths)."""
    # Its own bus port: the default, port + 10000, may not exist for a high free port.
    bus = str(free_port())
    cluster = ("--cluster-enabled", "yes", "--cluster-port", bus, "--cluster-node-timeout", "1000")
    with own_redis(*cluster) as server:
        admin = aioredis.Redis.from_url(server.url)
        try:
            await _serve_every_slot(admin)
            async with _factories(*_both_paths(server)) as factories:
                queues = [await f.queue("q") for f in factories]
                for q in queues:
                    await q.push("before")
                await admin.execute_command("CLUSTER", "DELSLOTSRANGE", 0, 16383)
                for q in queues:
                    await _raises_connection_error(
                        lambda q=q: q.push("during"), redis_errors.ClusterDownError
                    )
                    await _raises_connection_error(q.size, redis_errors.ClusterDownError)
                await _serve_every_slot(admin)
                for q in queues:
                    await q.push("after")
                    assert await q.size() == 2
        finally:
            await admin.aclose()


async def test_redis_cluster_unreachable_is_a_connection_error() -> None:
    """redis-py's cluster client reports it with its own exception type, not a RedisError."""
    with pytest.raises(KeussConnectionError):
        await aio_keuss.connect("redis-oq", url=f"redis://127.0.0.1:{free_port()}/0", cluster=True)


_NOT_READY_REPLIES = [
    "LOADING Redis is loading the dataset in memory",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "CLUSTERDOWN The cluster is down",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "READONLY You can't write against a read only replica.",
    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    "NOREPLICAS Not enough good replicas to write.",
    "ERR max number of clients reached",
]
_OTHER_REPLIES = [
    "ERR unknown command",
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "OOM command not allowed when used memory > 'maxmemory'.",
    "MISCONF Redis is configured to save RDB snapshots, but it's unable to persist to disk.",
    "BUSYGROUP Consumer Group name already exists",
    "NOPERM this user has no permissions",
]


@pytest.mark.parametrize("reply", _NOT_READY_REPLIES + _OTHER_REPLIES)
async def test_redis_error_replies_are_classified_alike_on_both_paths(reply: str) -> None:
    """Every reply a server sends when it is not ready is a connection error on the fast lane
    and through redis-py alike; the rest are backend errors. The replies are real: a script
    answers them with ``redis.error_reply``."""
    expected = KeussConnectionError if reply in _NOT_READY_REPLIES else BackendError
    with own_redis() as server:
        async with _factories(*_both_paths(server)) as factories:
            for factory in factories:
                backend: Any = factory.backend
                with pytest.raises(expected) as caught:  # the connection translates
                    await backend.execute(
                        "EVAL", "return redis.error_reply(ARGV[1])", 0, reply
                    )  # fmt: skip
                assert reply.split(" ", 1)[1] in str(caught.value)
                assert caught.value.__cause__ is not None
                await backend.execute("PING")  # the connection is still usable


# PostgreSQL -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_postgres_stopped_under_load_raises_connection_errors_then_works(mode: str) -> None:
    """Stopped with calls in flight and the pool holding connections (``fast``: 57P01 to the
    sessions; ``immediate``: no goodbye), then started again."""
    with own_postgres() as server:
        factory = await aio_keuss.connect("postgres", url=server.url, max_pool_size=4)
        try:
            q = await factory.queue("q")
            errors: list[aio_keuss.KeussError] = []
            done = [0]
            stop = asyncio.Event()

            async def work() -> None:
                while not stop.is_set():
                    try:
                        await q.push("x")
                        message = await q.reserve(timeout=0)
                        if message is not None:
                            await q.ok(message)
                        done[0] += 1
                    except aio_keuss.KeussError as exc:
                        errors.append(exc)
                        await asyncio.sleep(0.01)

            workers = [asyncio.create_task(work()) for _ in range(8)]
            try:
                await _until(lambda: done[0] >= 50)
                await asyncio.to_thread(server.stop, mode)
                await _until(lambda: len(errors) >= 20)  # every worker keeps failing
                await asyncio.to_thread(server.start)
                recovered = done[0]
                await _until(lambda: done[0] >= recovered + 20)
            finally:
                stop.set()
                await asyncio.gather(*workers)
            wrong = [e for e in errors if not isinstance(e, KeussConnectionError)]
            assert not wrong, [f"{type(e).__name__}: {e}" for e in wrong]
            assert all(e.__cause__ is not None for e in errors)
            await q.push("after")
            assert await q.total_size() >= 1
        finally:
            await factory.close()


async def test_postgres_bad_connection_setting_is_a_config_error_not_a_lost_connection() -> None:
    """asyncpg reports a connection parameter it cannot use as an InterfaceError, like a lost
    connection; it must not tell the caller to retry."""
    from backends import POSTGRES_URL

    url = POSTGRES_URL + ("&" if "?" in POSTGRES_URL else "?") + "sslmode=bogus"
    with pytest.raises(aio_keuss.ConfigError) as caught:
        await aio_keuss.connect("postgres", url=url)
    assert not isinstance(caught.value, KeussConnectionError)
    assert "sslmode" in str(caught.value)


# MongoDB --------------------------------------------------------------------------------


async def test_mongo_server_away_is_a_connection_error_then_works() -> None:
    pytest.importorskip("pymongo")
    with own_mongo() as server:
        factory = await aio_keuss.connect(
            "mongo", url=server.url, database="outage", server_selection_timeout=2.0
        )
        try:
            q = await factory.queue("q")
            await q.push("before")
            await asyncio.to_thread(server.stop)
            with pytest.raises(KeussConnectionError):
                await q.push("during")
            with pytest.raises(KeussConnectionError):
                await q.pop(timeout=0)
            await asyncio.to_thread(server.start)
            for _ in range(30):  # what the README tells callers to do
                try:
                    await q.push("after")
                    break
                except KeussConnectionError:
                    await asyncio.sleep(0.1)
            message = await q.pop(timeout=5)
            assert message is not None and message.payload == "after"
        finally:
            await factory.close()


_MONGO_NOT_READY = {
    "ShutdownInProgress": 91,
    "InterruptedAtShutdown": 11600,
    "PrimarySteppedDown": 189,
    "NotWritablePrimary": 10107,
    "InterruptedDueToReplStateChange": 11602,
    "HostUnreachable": 6,
    "NetworkTimeout": 89,
}


def _mongo_failures() -> list[tuple[str, BaseException, type[BaseException]]]:
    """Driver exceptions as PyMongo builds them from a server's reply."""
    errors = pytest.importorskip("pymongo.errors")
    retry = KeussConnectionError
    cases: list[tuple[str, BaseException, type[BaseException]]] = []
    for name, code in _MONGO_NOT_READY.items():
        reply = {"ok": 0, "code": code, "codeName": name, "errmsg": name}
        in_bulk = {"writeErrors": [], "writeConcernErrors": [{"code": code, "errmsg": name}]}
        cases += [
            (f"command {name}", errors.OperationFailure(name, code, reply), retry),
            (f"write concern {name}", errors.WriteConcernError(name, code, reply), retry),
            (f"bulk {name}", errors.BulkWriteError(in_bulk), retry),
        ]
    labelled = {"ok": 0, "code": 12345, "errorLabels": ["RetryableWriteError"]}
    duplicate = {"writeErrors": [{"index": 0, "code": 11000, "errmsg": "dup"}]}
    cases += [
        ("labelled retryable", errors.OperationFailure("x", 12345, labelled), retry),
        ("auto reconnect", errors.AutoReconnect("gone"), retry),
        ("not primary", errors.NotPrimaryError("node is recovering", {"ok": 0}), retry),
        ("server selection", errors.ServerSelectionTimeoutError("no server"), retry),
        ("duplicates", errors.BulkWriteError(duplicate), BackendError),
        ("bad value", errors.OperationFailure("bad", 2, {"ok": 0, "code": 2}), BackendError),
        ("wtimeout", errors.WTimeoutError("slow", 64, {"code": 64}), BackendError),
    ]
    return cases


async def test_mongo_not_ready_replies_are_connection_errors() -> None:
    """How the server's "not primary / recovering / shutting down" codes reach the caller,
    wherever PyMongo puts them: a failed command, a write concern error, a bulk write's
    details. (No test server here can be made to answer them.)"""
    from aio_keuss.mongo.connection import translated

    for label, exc, expected in _mongo_failures():

        @translated
        async def fails(exc: Exception = exc) -> None:
            raise exc

        with pytest.raises(expected) as caught:
            await fails()
        assert caught.value.__cause__ is exc, label


# The stats flusher during an outage --------------------------------------------------------


@asynccontextmanager
async def _stopped(server: OwnRedis | OwnPostgres) -> AsyncIterator[None]:
    await asyncio.to_thread(server.stop)
    try:
        yield
    finally:
        await asyncio.to_thread(server.start)


@pytest.mark.parametrize("backend", ["redis-oq", "postgres"])
async def test_stats_flusher_reports_an_outage_once(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aio_keuss.stats")
    own = own_redis if backend == "redis-oq" else own_postgres
    with own() as server:
        factory = await aio_keuss.connect(backend, url=server.url)
        try:
            q = await factory.queue("q")
            store = factory.stats_store

            def records(level: int) -> list[logging.LogRecord]:
                return [
                    r for r in caplog.records if r.name == "aio_keuss.stats" and r.levelno == level
                ]

            async with _stopped(server):
                store.incr("q", "put", 5)  # buffered while the server is away
                await _until(lambda: len(records(logging.DEBUG)) >= 10)  # ten failed retries
                assert len(records(logging.WARNING)) == 1
                assert not records(logging.INFO)
            await _until(lambda: records(logging.INFO))  # flushing works again
            assert len(records(logging.WARNING)) == 1
            assert len(records(logging.INFO)) == 1
            assert "works again" in records(logging.INFO)[0].getMessage()
            assert (await q.stats())["put"] >= 5  # kept, then written once the server was back
        finally:
            await factory.close()


# The signal listener when the server goes as the factory closes ------------------------------


async def test_a_listener_whose_driver_swallows_the_cancellation_still_stops() -> None:
    """redis-py, reconnecting when ``close`` cancels the listener as the server goes away,
    can raise its ConnectionError instead of the cancellation; a listener that took that for
    one more outage to retry would never stop, and ``close`` would wait for it forever. (A
    scripted transport: the moment is not one a real server can be made to hit every time.)"""
    from aio_keuss.signal import SignalBus

    class SwallowingBus(SignalBus):
        async def _listen(self, ready: Callable[[], None]) -> None:
            ready()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise KeussConnectionError("Connection closed by server.") from None

    bus = SwallowingBus(debounce=0.0)
    await bus.open()
    async with asyncio.timeout(10):
        await bus.close()


async def test_redis_cluster_tryagain_past_redis_pys_retries_is_a_connection_error() -> None:
    """redis-py's cluster client retries TRYAGAIN (a slot being resharded) 16 times, then
    raises ClusterError("TTL exhausted.") without the reply as its cause: still a slot that
    cannot be served right now, so KeussConnectionError as the README's table says."""
    import redis_cluster

    reason = redis_cluster.start_redis_cluster()
    if reason:
        pytest.skip(reason)
    async with aio_keuss.connect(
        "redis-oq", url=redis_cluster.CLUSTER_URL, cluster=True, prefix="akt-tryagain"
    ) as factory:
        backend: Any = factory.backend
        with pytest.raises(KeussConnectionError):
            await backend.execute(
                "EVAL", "return redis.error_reply(ARGV[1])", 1, "akt-tryagain:{q}:z",
                "TRYAGAIN Multiple keys request during rehashing of slot",
            )  # fmt: skip
        await backend.execute("PING")


async def test_a_factory_closed_with_its_server_away_raises_a_typed_error() -> None:
    """The stats increments a close flushes cannot be written: close raises the
    KeussConnectionError of that write, not the store's internal PartlyWritten (no
    aio_keuss error), and the increments stay buffered."""
    with own_redis() as server:
        factory = await aio_keuss.connect("redis-oq", url=server.url, prefix="away")
        q = await factory.queue("q")
        await q.push(1)  # a counted event, buffered until the next flush
        server.stop(kill=True)
        with pytest.raises(KeussConnectionError):
            await factory.close()


async def test_postgres_take_reports_a_connect_that_failed_after_it_stopped_waiting() -> None:
    """A take waits for a connection for a short while only; the connect it stopped waiting
    for goes on, and may fail when no take is waiting for it (a server that does not answer
    fails a connect only at the pool's ``timeout``). That failure is the next take's to
    report: a consumer polling a server that cannot be reached looked again and again,
    answered nothing each time and never saw the error its backoff and health check go by.
    The server here accepts connections and answers none (its postmaster stopped), after its
    sessions were ended."""
    asyncpg = pytest.importorskip("asyncpg")
    with own_postgres() as server:
        pool = await asyncpg.create_pool(server.url, min_size=1, max_size=4, timeout=0.5)
        factory = await aio_keuss.connect("postgres", pool=pool, schema="take_unreachable")
        killer = await asyncpg.connect(server.url)
        pid_file = Path(server.dir, "data", "postmaster.pid")
        postmaster = int((await asyncio.to_thread(pid_file.read_text)).split("\n", 1)[0])
        try:
            q = await factory.queue("q")
            await q.push("x")  # a working connection would take it
            os.kill(postmaster, signal.SIGSTOP)
            try:
                await killer.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
                )
                # The ended sessions may first fail a take or two; then a take finds none
                # in time, and its connect fails (past the pool's timeout) while we wait.
                for _ in range(100):
                    with contextlib.suppress(KeussConnectionError):
                        if await q.pop(timeout=0) is None:
                            break
                else:
                    pytest.fail("no take went to the pool for a connection")
                await asyncio.sleep(1.0)  # longer than the connect's timeout, as a backoff
                reported: list[BaseException] = []
                for _ in range(5):
                    try:
                        assert await q.pop(timeout=0) is None
                    except KeussConnectionError as exc:
                        reported.append(exc)
                        break
                    await asyncio.sleep(1.0)
                assert reported, "every take answered nothing, the failed connects unreported"
                assert reported[0].__cause__ is not None
            finally:
                os.kill(postmaster, signal.SIGCONT)
        finally:
            await killer.close()
            await factory.close()
            await pool.close()
