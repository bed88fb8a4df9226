"""`make bench BACKEND=name`: Keuss's published scenarios plus concurrency, bulk and latency.

Runs on uvloop (libuv, the loop Keuss runs on under Node) when it is installed, else on
asyncio's own loop; ``--loop asyncio`` forces the latter.

Rows (msgs/s): push, pop, and push then reserve+ok with 3 concurrent clients (Keuss's table,
100,000 messages), ``consume`` with as many workers and a prefetch of 10, the same with 32
clients, bulk push_many / reserve_many of 1,000, and the
push -> consume latency (p50 / p99) at a low rate. On backends that move atomically, a
3-station pipeline with no-op handlers (``pipeline.run``, 3 and 32 workers per station),
beside the same flow done by hand with ``consume`` handlers that push to the next queue
(reserve + push + ok, not atomic). Each row runs on fresh queues. Progress
goes to stderr; the table (or, with --json, one JSON record per row) to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_keuss
from aio_keuss.pipeline import Forward

# Keuss 2.0.6 on this machine kind, from ../shared/PERFORMANCE.md: push, pop, reserve+commit.
KEUSS: dict[str, tuple[int | None, int | None, int | None]] = {
    "redis-list": (33_842, 27_631, None),
    "redis-oq": (22_722, 23_705, 8_024),
    "postgres": (4_232, 2_513, 1_464),
    "mongo": (6_250, 3_333, 1_960),
    "bucket-mongo": (33_333, 16_666, 25_000),
    "bucket-redis": (33_333, 16_666, 25_000),
    "bucket-postgres": (33_333, 16_666, 25_000),
}
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "redis-list": {"url": "redis://127.0.0.1:6379/0", "prefix": "akbench"},
    "redis-oq": {"url": "redis://127.0.0.1:6379/0", "prefix": "akbench"},
    "redis-reliable": {"url": "redis://127.0.0.1:6379/0", "prefix": "akbench"},
    "redis-sharded": {"url": "redis://127.0.0.1:6379/0", "prefix": "akbench-sharded"},
    "postgres": {"url": "postgresql://postgres@127.0.0.1:5432/test", "schema": "akbench"},
    "bucket-redis": {"url": "redis://127.0.0.1:6379/0", "prefix": "akbench"},
    "bucket-postgres": {"url": "postgresql://postgres@127.0.0.1:5432/test", "schema": "akbench"},
    "mongo": {"url": "mongodb://127.0.0.1:27017", "database": "akbench"},
    "mongo-history": {"url": "mongodb://127.0.0.1:27017", "database": "akbench"},
    "bucket-mongo": {"url": "mongodb://127.0.0.1:27017", "database": "akbench"},
    "sqlite": {"path": os.path.join(tempfile.gettempdir(), "akbench.db")},
}
PIPELINE_MESSAGES = 10_000
PREFETCH = 10
PAYLOAD = {"id": 0, "user": "someone@example.com", "items": [1, 2, 3], "note": "x" * 120}


@dataclass
class Row:
    backend: str
    scenario: str
    clients: int
    messages: int
    seconds: float
    rate: float
    keuss: int | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    loop: str = "asyncio"


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def run_clients(clients: int, total: int, work: Callable[[int], Awaitable[int]]) -> float:
    """Split ``total`` over ``clients`` tasks; each calls ``work(share)``; returns seconds."""
    shares = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    start = time.perf_counter()
    done = await asyncio.gather(*(work(share) for share in shares))
    elapsed = time.perf_counter() - start
    if sum(done) != total:
        raise RuntimeError(f"expected {total} messages, handled {sum(done)}")
    return elapsed


class Bench:
    def __init__(self, backend: str, options: dict[str, Any], messages: int, loop: str) -> None:
        self.backend = backend
        self.loop = loop
        self.options = options
        self.messages = messages
        self.rows: list[Row] = []
        self._queue_no = 0
        self._run = os.urandom(3).hex()

    async def fresh_queue(self, factory: aio_keuss.Factory) -> aio_keuss.Queue:
        self._queue_no += 1
        return await factory.queue(f"bench-{self._run}-{self._queue_no}")

    async def start_fresh(self) -> None:
        """Drop the bench's own PostgreSQL schema before a run, as the peers' tables are
        made anew for theirs (Keuss: a schema of its own, dropped after each run; pgbench: a
        table made for the row). PostgreSQL keeps a deleted row's index entries until
        VACUUM (manual, "Routine Vacuuming"), so on a server with autovacuum off a schema
        left by earlier runs slowed pops several times over (a million dead rows: 1,150
        pops/s at 3 clients against 6,057 once vacuumed). Only the bench's default schema,
        never one given with ``--set schema=...``."""
        schema, url = self.options.get("schema"), str(self.options.get("url", ""))
        if not url.startswith("postgres") or schema != DEFAULT_OPTIONS.get(self.backend, {}).get(
            "schema"
        ):
            return
        import asyncpg

        connection = await asyncpg.connect(url)
        try:
            await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await connection.close()

    async def clean_up(self) -> None:
        """Delete what this run's queues left in Redis once emptied: each one's stats hash
        (and redis-reliable's processed counter), and its entry in the queue registry.
        There is no call in the library that forgets a queue, so it is done here by key:
        every key of a queue carries its name, ``bench-<run>-<n>``."""
        prefix, url = self.options.get("prefix"), self.options.get("url", "")
        if not prefix or not str(url).startswith(("redis://", "unix://")):
            return
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import RedisCluster

        mine = f"bench-{self._run}-"
        cluster = bool(self.options.get("cluster"))
        client = (RedisCluster if cluster else aioredis.Redis).from_url(url)
        try:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*{mine}*", count=1000)]
            for key in keys:
                await client.delete(key)
            registry = f"{prefix}:queues"
            names = [
                n
                for n in await client.hkeys(registry)
                if (n.decode() if isinstance(n, bytes) else n).startswith(mine)
            ]
            if names:
                await client.hdel(registry, *names)
        finally:
            await client.aclose()

    def record(
        self,
        scenario: str,
        clients: int,
        messages: int,
        seconds: float,
        keuss: int | None = None,
        **extra: Any,
    ) -> None:
        row = Row(
            self.backend,
            scenario,
            clients,
            messages,
            round(seconds, 3),
            round(messages / seconds),
            keuss,
            loop=self.loop,
            **extra,
        )
        self.rows.append(row)
        progress(f"  {scenario:<24} clients={clients:<3} {row.rate:>10,.0f} msgs/s")

    async def run(self, client_counts: list[int], latency_messages: int, only: str) -> None:
        keuss = KEUSS.get(self.backend, (None, None, None))
        async with aio_keuss.connect(self.backend, **self.options) as factory:
            caps = factory.capabilities
            for clients in client_counts if only in ("all", "throughput") else ():
                progress(f"{self.backend}: {self.messages:,} messages, {clients} clients")
                q = await self.fresh_queue(factory)
                await self.push(q, clients, "push", keuss[0] if clients == 3 else None)
                if caps.pop:
                    await self.pop(q, clients, keuss[1] if clients == 3 else None)
                if caps.reserve:
                    q = await self.fresh_queue(factory)
                    await q.push_many([PAYLOAD] * self.messages)
                    await self.reserve_ok(q, clients, keuss[2] if clients == 3 else None)
                    q = await self.fresh_queue(factory)
                    await q.push_many([PAYLOAD] * self.messages)
                    await self.consume(q, clients, keuss[2] if clients == 3 else None)
            if only == "all" and caps.priority:
                progress(f"{self.backend}: {self.messages:,} messages over 4 priorities, 3 clients")
                await self.prioritized(await self.fresh_queue(factory))
            if only == "all":
                progress(f"{self.backend}: bulk, batches of 1,000")
                await self.bulk(factory, caps)
                progress(f"{self.backend}: latency at a low rate")
                await self.latency(factory, caps, latency_messages)
            if caps.move and only != "throughput":
                for clients in client_counts:
                    progress(f"{self.backend}: 3-station pipeline, {clients} workers each")
                    await self.pipeline(factory, clients, atomic=True)
                    await self.pipeline(factory, clients, atomic=False)

    async def push(self, q: aio_keuss.Queue, clients: int, name: str, keuss: int | None) -> None:
        async def work(share: int) -> int:
            for _ in range(share):
                await q.push(PAYLOAD)
            return share

        self.record(
            name, clients, self.messages, await run_clients(clients, self.messages, work), keuss
        )

    async def pop(self, q: aio_keuss.Queue, clients: int, keuss: int | None) -> None:
        async def work(share: int) -> int:
            for _ in range(share):
                if await q.pop(timeout=10) is None:
                    raise RuntimeError("pop timed out")
            return share

        self.record(
            "pop", clients, self.messages, await run_clients(clients, self.messages, work), keuss
        )

    async def prioritized(self, q: aio_keuss.Queue) -> None:
        """What priorities cost: the push and reserve+ok rows with messages spread over
        four levels (0 to 3), to compare with the plain rows above."""

        async def work(share: int) -> int:
            for n in range(share):
                await q.push(PAYLOAD, priority=n % 4)
            return share

        seconds = await run_clients(3, self.messages, work)
        self.record("push, 4 levels", 3, self.messages, seconds)
        if q.capabilities.reserve:
            await self.reserve_ok(q, 3, None, name="reserve+ok, 4 levels")

    async def reserve_ok(
        self, q: aio_keuss.Queue, clients: int, keuss: int | None, name: str = "reserve+ok"
    ) -> None:
        async def work(share: int) -> int:
            for _ in range(share):
                message = await q.reserve(timeout=10)
                if message is None or not await q.ok(message):
                    raise RuntimeError("reserve timed out or ok failed")
            return share

        seconds = await run_clients(clients, self.messages, work)
        self.record(name, clients, self.messages, seconds, keuss)

    async def consume(self, q: aio_keuss.Queue, clients: int, keuss: int | None) -> None:
        """``consume`` with ``clients`` workers and a prefetch of 10 (reserve -> no-op
        handler -> ok), against Keuss's reserve+commit."""
        done = asyncio.Event()
        handled = 0

        async def handler(message: aio_keuss.Message) -> None:
            nonlocal handled
            handled += 1
            if handled == self.messages:
                done.set()

        start = time.perf_counter()
        async with q.consume(handler, clients, prefetch=PREFETCH):
            await asyncio.wait_for(done.wait(), timeout=max(60.0, self.messages / 100))
            seconds = time.perf_counter() - start
        self.record(f"consume prefetch={PREFETCH}", clients, self.messages, seconds, keuss)

    async def bulk(self, factory: aio_keuss.Factory, caps: aio_keuss.Capabilities) -> None:
        q = await self.fresh_queue(factory)
        batch = [PAYLOAD] * 1000

        async def push_work(share: int) -> int:
            for start in range(0, share, 1000):
                await q.push_many(batch[: min(1000, share - start)])
            return share

        self.record(
            "bulk push_many", 3, self.messages, await run_clients(3, self.messages, push_work)
        )

        async def take_work(share: int) -> int:
            got = 0
            while got < share:
                if caps.reserve:
                    messages = await q.reserve_many(min(1000, share - got), timeout=10)
                    await asyncio.gather(*(q.ok(m) for m in messages))
                else:
                    messages = await q.pop_many(min(1000, share - got), timeout=10)
                if not messages:
                    raise RuntimeError("bulk take timed out")
                got += len(messages)
            return got

        name = "bulk reserve_many+ok" if caps.reserve else "bulk pop_many"
        self.record(name, 3, self.messages, await run_clients(3, self.messages, take_work))

    async def latency(
        self, factory: aio_keuss.Factory, caps: aio_keuss.Capabilities, count: int
    ) -> None:
        q = await self.fresh_queue(factory)
        sent: dict[int, float] = {}
        delays: list[float] = []

        async def consume() -> None:
            while len(delays) < count:
                message = await (q.reserve(timeout=10) if caps.reserve else q.pop(timeout=10))
                if message is None:
                    raise RuntimeError("latency consumer timed out")
                delays.append(time.perf_counter() - sent[message.payload])
                if caps.reserve:
                    await q.ok(message)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        start = time.perf_counter()
        for i in range(count):
            sent[i] = time.perf_counter()
            await q.push(i)
            await asyncio.sleep(0.002)  # a low rate: a few hundred per second
        await consumer
        seconds = time.perf_counter() - start
        cuts = statistics.quantiles(delays, n=100)
        self.record(
            "push->consume latency",
            1,
            count,
            seconds,
            p50_ms=round(cuts[49] * 1000, 3),
            p99_ms=round(cuts[98] * 1000, 3),
        )

    async def pipeline(self, factory: aio_keuss.Factory, workers: int, atomic: bool) -> None:
        """Messages/s through three stations into a fourth queue, timed from the start of
        the stations until the last message arrives (the producer pushed them before)."""
        total = min(self.messages, PIPELINE_MESSAGES)
        queues = [await self.fresh_queue(factory) for _ in range(4)]
        await queues[0].push_many([PAYLOAD] * total)

        async def forward(message: aio_keuss.Message) -> Forward:
            return Forward()

        def by_hand(next_queue: aio_keuss.Queue) -> Callable[[aio_keuss.Message], Awaitable[None]]:
            async def handler(message: aio_keuss.Message) -> None:
                await next_queue.push(message.payload)  # the consumer oks after this

            return handler

        start = time.perf_counter()
        if atomic:
            pipeline = factory.pipeline(f"bench-{self._run}-{self._queue_no}")
            for source, destination in itertools.pairwise(queues):
                pipeline.link(source.name, destination.name, forward)
            running: Any = await pipeline.run(workers).start()
        else:
            running = [
                source.consume(by_hand(destination), workers)
                for source, destination in itertools.pairwise(queues)
            ]
        while await queues[3].size() < total:  # noqa: ASYNC110 (the server's count is the truth)
            await asyncio.sleep(0.01)
        seconds = time.perf_counter() - start
        for stopping in running.consumers if atomic else running:
            await stopping.stop()
        name = "pipeline 3 moves" if atomic else "pipeline 3 push+ok"
        self.record(name, workers, total, seconds)


def print_table(rows: list[Row], loop: str) -> None:
    print(
        f"\naio-keuss bench — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.node()} ({os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{loop} event loop)"
    )
    header = (
        f"| {'backend':<15} | {'scenario':<22} | {'clients':>7} | {'msgs':>8} | "
        f"{'msgs/s':>9} | {'Keuss':>7} | {'p50 ms':>7} | {'p99 ms':>7} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for r in rows:
        keuss = f"{r.keuss:,}" if r.keuss else ""
        p50 = f"{r.p50_ms:.2f}" if r.p50_ms is not None else ""
        p99 = f"{r.p99_ms:.2f}" if r.p99_ms is not None else ""
        print(
            f"| {r.backend:<15} | {r.scenario:<22} | {r.clients:>7} | {r.messages:>8,} | "
            f"{r.rate:>9,.0f} | {keuss:>7} | {p50:>7} | {p99:>7} |"
        )


def parse_option(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--set takes OPTION=VALUE, not {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--backend", default="memory", help="backend name(s), comma-separated")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--clients", default="3,32", help="client counts, comma-separated")
    parser.add_argument("--latency-messages", type=int, default=2_000)
    parser.add_argument("--url", help="server URL (default: the local test servers)")
    parser.add_argument("--json", action="store_true", help="one JSON record per row")
    parser.add_argument(
        "--only",
        choices=("all", "pipeline", "throughput"),
        default="all",
        help="run only these rows (throughput: push, pop, reserve+ok; what bench.peers compares)",
    )
    parser.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="event loop: auto = uvloop (libuv, like Node's) when installed, else asyncio's",
    )
    parser.add_argument(
        "--metrics",
        choices=("off", "on", "otel"),
        default="off",
        help="off: metrics disabled (the default: their cost when nobody asked for them);"
        " on: aio_keuss.enable_metrics(); otel: enable_opentelemetry with the SDK's"
        " MeterProvider and an in-memory reader (recording cost, no export)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="a backend option (VALUE as JSON, else a string), e.g. --set ack_on_buffer=true",
    )
    return parser.parse_args()


def loop_name(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def ensure_test_mongo() -> None:
    """The MongoDB backends default to the local test server: start nx-27017 as the test
    suite does when nothing answers on 127.0.0.1:27017 (stopped when the bench exits)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from mongo_server import start_mongo

    reason = start_mongo()
    if reason is not None:
        raise SystemExit(reason)


def enable_metrics(choice: str) -> None:
    if choice == "on":
        aio_keuss.enable_metrics()
    elif choice == "otel":
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        aio_keuss.enable_opentelemetry(MeterProvider(metric_readers=[InMemoryMetricReader()]))


async def main(args: argparse.Namespace, loop: str) -> None:
    enable_metrics(args.metrics)
    if not args.url and any("mongo" in b for b in args.backend.split(",")):
        ensure_test_mongo()
    rows: list[Row] = []
    for backend in args.backend.split(","):
        options = dict(DEFAULT_OPTIONS.get(backend, {}))
        if args.url:
            options["url"] = args.url
        options.update(parse_option(text) for text in args.set)
        bench = Bench(backend, options, args.messages, loop)
        clients = [int(c) for c in args.clients.split(",")]
        await bench.start_fresh()
        try:
            await bench.run(clients, args.latency_messages, args.only)
        finally:
            await bench.clean_up()
        rows.extend(bench.rows)
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
    else:
        print_table(rows, loop)


if __name__ == "__main__":
    arguments = parse_args()
    chosen = loop_name(arguments.loop)
    if chosen == "uvloop":
        import uvloop

        uvloop.run(main(arguments, chosen))
    else:
        asyncio.run(main(arguments, chosen))
