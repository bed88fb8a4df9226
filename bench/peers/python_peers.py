"""The Python job queues' side of `make bench-peers`, run in bench/peers/.venv.

For one peer (saq, arq, procrastinate) and one backend: enqueue N no-op jobs from C concurrent
tasks (each waits for its enqueue before the next one, like aio-keuss's push clients), then
start that peer's own worker at concurrency C and time it until the N-th job has run. The
worker acknowledges each job its own way (saq and arq mark it done, procrastinate is asked to
delete it on success), which is what aio-keuss's reserve+ok row does. One JSON row per
measurement goes to stdout; every queue, key and schema made here is removed at the end.

usage: python python_peers.py --peer saq --backend redis --clients 3,32 --messages 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

REDIS_URL = "redis://127.0.0.1:6379/0"
POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
PAYLOAD = {"id": 0, "user": "someone@example.com", "items": [1, 2, 3], "note": "x" * 120}
RUN = os.urandom(3).hex()
# arq's worker sleeps poll_delay (0.5 s by default) between reads of its queue; with that
# default a 3-job worker ran about 30 jobs/s here, bounded by the sleep. 5 ms measures its
# machinery instead (https://arq-docs.helpmanual.io/).
ARQ_POLL_DELAY = 0.005


class Counter:
    """Counts the jobs the worker ran and wakes the timer at the N-th."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.done = asyncio.Event()

    def hit(self) -> None:
        self.count += 1
        if self.count >= self.target:
            self.done.set()


COUNTER = Counter(0)
SCHEMAS_APPLIED: list[str] = []


async def run_clients(clients: int, total: int, step: Callable[[int], Awaitable[Any]]) -> float:
    shares = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]

    async def loop(share: int, base: int) -> None:
        for i in range(share):
            await step(base + i)

    bases = [sum(shares[:i]) for i in range(clients)]
    start = time.perf_counter()
    await asyncio.gather(*(loop(s, b) for s, b in zip(shares, bases, strict=True)))
    return time.perf_counter() - start


STOP_TIMEOUT = 30.0
"""Seconds a cancelled worker is given to end."""


async def timed_worker(start: Callable[[], Awaitable[Any]], timeout: float) -> float:
    """Runs ``start()`` as a task until the counter reaches its target, then cancels it (each
    peer's worker shuts down on cancellation); returns the seconds to the N-th job."""
    began = time.perf_counter()
    task = asyncio.create_task(start())
    waiter = asyncio.create_task(COUNTER.done.wait())
    await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    seconds = time.perf_counter() - began
    waiter.cancel()
    task.cancel()
    # A peer's worker that does not end when cancelled (saq's PostgreSQL worker once hung
    # there for the whole 900 s a system gets) must not stall the sitting.
    await asyncio.wait({task}, timeout=STOP_TIMEOUT)
    if not task.done():  # asyncio.run would wait for it at exit: leave at once
        print("the worker did not stop when cancelled", file=sys.stderr, flush=True)
        os._exit(3)
    if not COUNTER.done.is_set():
        raise RuntimeError(f"worker handled {COUNTER.count} of {COUNTER.target} jobs")
    return seconds


def postgres_url(schema: str) -> str:
    return f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"


async def with_schema(schema: str, create: bool) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
        if create:
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        else:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def delete_redis_keys(pattern: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=pattern, count=1000)]
    for at in range(0, len(keys), 1000):
        await client.delete(*keys[at : at + 1000])
    await client.aclose()


# ---- saq -------------------------------------------------------------------------------------


async def saq_noop(ctx: Any, **kwargs: Any) -> None:
    COUNTER.hit()


async def bench_saq(backend: str, clients: int, messages: int) -> tuple[float, float]:
    from saq import Queue, Worker

    name = f"akpeers-saq-{RUN}-{clients}"
    if backend == "redis":
        queue = Queue.from_url(REDIS_URL, name=name)
    else:
        queue = Queue.from_url(postgres_url("akpeers_saq"), name=name)
    await queue.connect()
    try:
        enqueue = await run_clients(
            clients, messages, lambda i: queue.enqueue("saq_noop", payload=PAYLOAD)
        )
        worker = Worker(queue, functions=[saq_noop], concurrency=clients)
        worker.SIGNALS = []  # the bench stops it, not a signal
        process = await timed_worker(worker.start, 600)
    finally:
        await queue.disconnect()
    return enqueue, process


# ---- arq -------------------------------------------------------------------------------------


async def arq_noop(ctx: Any, payload: Any) -> None:
    COUNTER.hit()


async def bench_arq(backend: str, clients: int, messages: int) -> tuple[float, float]:
    from arq import Worker
    from arq.connections import RedisSettings, create_pool

    if backend != "redis":
        raise SystemExit("arq runs on Redis only")
    name = f"akpeers:arq:{RUN}:{clients}"
    pool = await create_pool(RedisSettings(host="127.0.0.1", port=6379), default_queue_name=name)
    try:
        enqueue = await run_clients(
            clients,
            messages,
            lambda i: pool.enqueue_job("arq_noop", PAYLOAD, _job_id=f"akpeers-{RUN}-{clients}-{i}"),
        )
        worker = Worker(
            functions=[arq_noop],
            redis_pool=pool,
            queue_name=name,
            max_jobs=clients,
            handle_signals=False,
            keep_result=0,
            poll_delay=ARQ_POLL_DELAY,
        )
        process = await timed_worker(worker.main, 600)
        # let the last jobs' bookkeeping finish: arq's close cancels jobs still running
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        await worker.close()
    finally:
        await pool.aclose()
    return enqueue, process


# ---- procrastinate ---------------------------------------------------------------------------


async def bench_procrastinate(backend: str, clients: int, messages: int) -> tuple[float, float]:
    import procrastinate

    if backend != "postgres":
        raise SystemExit("procrastinate runs on PostgreSQL only")
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=postgres_url("akpeers_procrastinate"))
    )
    name = f"akpeers_{RUN}_{clients}"

    @app.task(name="noop", queue=name)
    async def noop(payload: Any) -> None:
        COUNTER.hit()

    async with app.open_async():
        if not SCHEMAS_APPLIED:  # once per run: the schema is dropped at the end
            await app.schema_manager.apply_schema_async()
            SCHEMAS_APPLIED.append(name)
        enqueue = await run_clients(clients, messages, lambda i: noop.defer_async(payload=PAYLOAD))
        process = await timed_worker(
            lambda: app.run_worker_async(
                queues=[name],
                concurrency=clients,
                wait=True,
                install_signal_handlers=False,
                delete_jobs="successful",
            ),
            600,
        )
    return enqueue, process


PEERS = {"saq": bench_saq, "arq": bench_arq, "procrastinate": bench_procrastinate}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peer", choices=sorted(PEERS), required=True)
    parser.add_argument("--backend", choices=("redis", "postgres"), required=True)
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[3])
    parser.add_argument("--messages", type=int, default=2000)
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    global COUNTER
    schema = f"akpeers_{args.peer}"
    if args.backend == "postgres":
        await with_schema(schema, create=True)
    try:
        for clients in args.clients:
            COUNTER = Counter(args.messages)
            enqueue, process = await PEERS[args.peer](args.backend, clients, args.messages)
            for scenario, seconds in (("enqueue", enqueue), ("process", process)):
                row = {
                    "system": args.peer,
                    "backend": args.backend,
                    "scenario": scenario,
                    "clients": clients,
                    "messages": args.messages,
                    "seconds": round(seconds, 3),
                    "rate": round(args.messages / seconds),
                }
                print(json.dumps(row), flush=True)
    finally:
        if args.backend == "postgres":
            await with_schema(schema, create=False)
        else:
            await delete_redis_keys(f"saq:*akpeers-saq-{RUN}*")
            await delete_redis_keys(f"*akpeers*{RUN}*")


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)  # the workers' shutdown chatter is no result
    asyncio.run(main(parse_args()))
