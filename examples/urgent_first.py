"""Priorities and a rate limit on one queue: password resets go before newsletters, and the
mail provider is never sent more than 20 messages a second, however many workers run.

    python examples/urgent_first.py                      # the embedded memory backend
    python examples/urgent_first.py redis-oq redis://127.0.0.1:6379/0

Every worker process opening the queue with the same ``rate_limit`` shares the one limit
(on a shared backend); a handler that hears "slow down" from the provider raises
``RateLimited`` and every worker pauses.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter

import aio_keuss

RESET, NEWSLETTER = 10, -10  # higher first; 0 is every other message


async def main(backend: str, url: str | None) -> None:
    options = {"url": url, "prefix": "urgent-first"} if url else {}
    async with aio_keuss.connect(backend, **options) as factory:
        mail = await factory.queue("mail", rate_limit=20, rate_period=1.0)
        await mail.purge()
        await mail.push_many([{"to": f"reader{i}"} for i in range(30)], priority=NEWSLETTER)
        await mail.push_many([{"to": f"user{i}", "reset": True} for i in range(5)], priority=RESET)
        order: list[int] = []
        done = asyncio.Event()

        async def send(message: aio_keuss.Message) -> None:
            order.append(message.priority)  # a real handler would call the provider here
            if len(order) == 35:
                done.set()

        async with mail.consume(send, concurrency=4):
            await done.wait()
        print("sent, in order of priority:", Counter(order))
        assert order[:5] == [RESET] * 5, order  # the resets went first
        print(f"{len(order)} delivered, at most 20 a second")


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(args[0] if args else "memory", args[1] if len(args) > 1 else None))
