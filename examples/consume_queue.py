"""An asyncio consumer processing the queue ``examples/spark_etl.py`` filled.

    .venv/bin/python examples/consume_queue.py --backend redis-oq --url redis://127.0.0.1:6379/0
    .venv/bin/python examples/consume_queue.py --backend postgres \\
        --url postgresql://postgres@127.0.0.1:5432/test --concurrency 16

Runs ``q.consume(handler, concurrency=N)`` (reserve -> handler -> ok; an exception -> ko
with backoff) until the queue has been empty for ``--idle`` seconds, then stops cleanly:
in-flight handlers finish, nothing is lost.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

import aio_keuss


async def main() -> None:
    parser = argparse.ArgumentParser(description="consume a queue with q.consume()")
    parser.add_argument("--backend", default="redis-oq")
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--queue", default="orders")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--idle", type=float, default=2.0)
    args = parser.parse_args()

    tiers: Counter[str] = Counter()
    total = 0.0

    async def handle(message: aio_keuss.Message) -> None:
        nonlocal total
        order = message.payload
        tiers[order.get("tier", "?")] += 1
        total += float(order.get("amount", 0))

    async with aio_keuss.connect(args.backend, url=args.url) as factory:
        queue = await factory.queue(args.queue)
        started = time.perf_counter()
        async with queue.consume(handle, concurrency=args.concurrency):
            while True:
                await asyncio.sleep(args.idle)
                if await queue.total_size() == 0:
                    break
        elapsed = time.perf_counter() - started
    done = sum(tiers.values())
    print(f"processed {done} messages in {elapsed:.1f} s: {dict(tiers)}, total {total:,.2f}")


if __name__ == "__main__":
    asyncio.run(main())
