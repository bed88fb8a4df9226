"""A worker processing the orders ``examples/spark_etl.py`` queued, until it is stopped.

    .venv/bin/python examples/consume_queue.py --backend redis-oq --url redis://127.0.0.1:6379/0
    .venv/bin/python examples/consume_queue.py --backend postgres \\
        --url postgresql://postgres@127.0.0.1:5432/test --schema shop --concurrency 16 \\
        --health-port 8081

``aio_keuss.run_worker`` runs ``q.consume(handler)`` (reserve -> handler -> ok; an exception
-> ko with backoff) until SIGTERM or Ctrl-C: running handlers then get ``--grace`` seconds to
finish, and whatever is still running after that is given back to the queue at once, costing
no try. ``--prefix`` (Redis, MongoDB) and ``--schema`` (PostgreSQL) let it share a server
with other applications. The same worker without writing a script:
``aio-keuss worker myapp.jobs:handle --backend redis-oq --queue orders``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections import Counter
from typing import Any

import aio_keuss


def main() -> None:
    parser = argparse.ArgumentParser(description="consume a queue until stopped")
    parser.add_argument("--backend", default="redis-oq")
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--prefix", help="key / collection prefix (Redis, MongoDB)")
    parser.add_argument("--schema", help="schema (PostgreSQL)")
    parser.add_argument("--queue", default="orders")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, help="seconds a handler may run")
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--health-port", type=int, help="serve /healthz and /metrics here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    tiers: Counter[str] = Counter()
    total = 0.0

    async def handle(message: aio_keuss.Message) -> None:
        nonlocal total
        order = message.payload
        tiers[order.get("tier", "?")] += 1
        total += float(order.get("amount", 0))

    options: dict[str, Any] = {"url": args.url}
    if args.prefix:
        options["prefix"] = args.prefix
    if args.schema:
        options["schema"] = args.schema
    asyncio.run(
        aio_keuss.run_worker(
            handle,
            args.queue,
            backend=args.backend,
            concurrency=args.concurrency,
            timeout=args.timeout,
            grace=args.grace,
            health_port=args.health_port,
            **options,
        )
    )
    print(f"processed {sum(tiers.values())} orders: {dict(tiers)}, total {total:,.2f}")


if __name__ == "__main__":
    main()
