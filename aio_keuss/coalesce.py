"""Coalescing: the calls made on one queue within an event-loop tick share one round trip.

A call never waits for company: the batch is started on the next loop iteration, which
already holds every call made by tasks that were ready in this one. While a batch is in
flight (up to ``concurrency`` of them), new calls gather for the next.

Cancellation: a request cancelled before its batch starts is dropped; one whose caller is
cancelled after the store did the work has its result handed to ``on_orphan``, so a queue
can put popped or reserved messages back instead of losing them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Req = TypeVar("Req")
Res = TypeVar("Res")


class Coalescer(Generic[Req, Res]):
    def __init__(
        self,
        run: Callable[[list[Req]], Awaitable[list[Res]]],
        *,
        max_batch: int,
        weight: Callable[[Req], int] = lambda _: 1,
        concurrency: int = 1,
        on_orphan: Callable[[Req, Res], None] | None = None,
    ) -> None:
        self._run_batch = run
        self._max_batch = max_batch
        self._weight = weight
        self._concurrency = concurrency
        self._on_orphan = on_orphan
        self._pending: deque[tuple[Req, asyncio.Future[Res]]] = deque()
        self._running = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, request: Req) -> Res:
        future: asyncio.Future[Res] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self._schedule()
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled after the batch already produced our result: hand it on.
            if future.done() and not future.cancelled() and future.exception() is None:
                self._orphan(request, future.result())
            raise

    async def wait_idle(self) -> None:
        """Wait for the batches in flight (used on close)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
            # A task cancelled before its first step never ran the ``finally`` that removes it.
            self._tasks = {task for task in self._tasks if not task.done()}

    def _schedule(self) -> None:
        # The batch task's first step runs on the next loop iteration, by which time every
        # task that was ready in this one has added its request.
        if not self._scheduled and self._pending and self._running < self._concurrency:
            self._scheduled = True
            self._running += 1
            # The task leaves ``_tasks`` itself when it ends (cheaper than a done callback,
            # which would cost a loop callback per batch).
            self._tasks.add(asyncio.get_running_loop().create_task(self._run()))

    def _take_batch(self) -> list[tuple[Req, asyncio.Future[Res]]]:
        batch: list[tuple[Req, asyncio.Future[Res]]] = []
        total = 0
        while self._pending:
            request, future = self._pending[0]
            if future.done():  # cancelled before it was sent: nothing to do
                self._pending.popleft()
                continue
            weight = self._weight(request)
            if batch and total + weight > self._max_batch:
                break
            self._pending.popleft()
            batch.append((request, future))
            total += weight
        return batch

    async def _run(self) -> None:
        self._scheduled = False
        batch = self._take_batch()
        try:
            if batch:
                await self._send(batch)
        finally:
            self._running -= 1
            self._tasks.discard(asyncio.current_task())
            self._schedule()

    async def _send(self, batch: list[tuple[Req, asyncio.Future[Res]]]) -> None:
        try:
            results = await self._run_batch([request for request, _ in batch])
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        except BaseException:  # cancelled (loop shutting down) or interpreter exit
            for _, future in batch:
                future.cancel()
            raise
        else:
            for (request, future), result in zip(batch, results, strict=True):
                if future.done():
                    self._orphan(request, result)
                else:
                    future.set_result(result)

    def _orphan(self, request: Req, result: Res) -> None:
        if self._on_orphan is not None:
            self._on_orphan(request, result)
