"""The `make demo` job: producers and consumers in one process on the embedded memory backend.

Shows delayed messages, a ko with retry (a flaky handler), and a poison message that ends in
the deadletter queue, then prints a summary table.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aio_keuss

ORDERS = 20_000
DELAYED = 200
FLAKY_EVERY = 500


async def main() -> None:
    async with aio_keuss.connect("memory", deadletter={"max_ko": 2}, poll_interval=1.0) as factory:
        orders = await factory.queue("orders")
        deadletter = await factory.queue("__deadletter__")
        done = asyncio.Event()
        consumed = 0
        retried = 0
        attempts: dict[int, int] = {}

        async def handle(message: aio_keuss.Message) -> None:
            nonlocal consumed, retried
            order = message.payload
            if order["kind"] == "poison":
                raise ValueError("this order can never be processed")
            if order["kind"] == "flaky" and message.tries == 0:
                retried += 1
                raise ConnectionError("transient failure, will be retried")
            attempts[order["n"]] = message.tries
            consumed += 1
            if consumed == ORDERS + DELAYED:
                done.set()

        start = time.perf_counter()

        async def produce(first: int, count: int) -> None:
            for n in range(first, first + count, 100):
                batch = [
                    {"n": i, "kind": "flaky" if i % FLAKY_EVERY == 0 else "plain"}
                    for i in range(n, min(n + 100, first + count))
                ]
                await orders.push_many(batch)

        async with orders.consume(handle, concurrency=8, retry_delay=0.05):
            producers = [produce(i * ORDERS // 4, ORDERS // 4) for i in range(4)]
            delayed = [
                orders.push({"n": ORDERS + i, "kind": "plain"}, delay=0.2 + i / 1000)
                for i in range(DELAYED)
            ]
            await asyncio.gather(*producers, *delayed)
            await orders.push({"n": -1, "kind": "poison"}, headers={"customer": "acme"})
            await asyncio.wait_for(done.wait(), 60)
            dead = await deadletter.pop(timeout=10)
        elapsed = time.perf_counter() - start

        stats = await orders.stats()
        dead_line = "none"
        if dead is not None:
            dead_line = (
                f"payload={dead.payload} from={dead.headers['x-dl-from-queue']} "
                f"tries={dead.headers['x-dl-tries']}"
            )
        rows = [
            ("messages pushed", f"{stats['put']:,}"),
            ("  of which delayed", f"{DELAYED:,}"),
            ("messages consumed (ok)", f"{stats['commit']:,}"),
            ("retried after ko", f"{retried:,}"),
            ("deadlettered", f"{stats['deadletter']:,}"),
            ("deadletter message", dead_line),
            ("left in queue", f"{await orders.total_size():,}"),
            ("elapsed", f"{elapsed:.2f} s"),
            ("throughput", f"{stats['commit'] / elapsed:,.0f} msgs/s"),
        ]
        width = max(len(name) for name, _ in rows)
        print("\naio-keuss demo (backend: memory)")
        print("-" * (width + 40))
        for name, value in rows:
            print(f"{name:<{width}}  {value}")
        print("-" * (width + 40))


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)  # the demo's failures are on purpose
    asyncio.run(main())
