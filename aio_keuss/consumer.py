"""``queue.consume(handler)``: workers that reserve, run a handler and acknowledge.

Made to be started in a web framework's lifespan and stopped cleanly: ``stop()`` stops taking
new messages, lets in-flight handlers finish (for ``grace`` seconds), and a handler still
running after that is cancelled and its message released at once, costing no try. Nothing a
worker held is lost. On a backend without reserve the workers pop (at-most-once).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .errors import ClosedError, InvalidInputError
from .message import Message

if TYPE_CHECKING:
    from .queue import Queue

log = logging.getLogger("aio_keuss.consumer")

Handler = Callable[[Message], Awaitable[Any] | Any]


class Consumer:
    def __init__(
        self,
        queue: Queue,
        handler: Handler,
        concurrency: int,
        retry_delay: float,
        max_retry_delay: float,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise InvalidInputError(f"concurrency must be a positive int, not {concurrency!r}")
        if not callable(handler):
            raise InvalidInputError("handler must be callable")
        self.queue = queue
        self._handler = handler
        self._retry_delay = retry_delay
        self._max_retry_delay = max_retry_delay
        self._reserve = queue.capabilities.reserve
        self._stopping = False
        self._waiting: set[asyncio.Task[None]] = set()
        self.processed = 0
        self.failed = 0
        loop = asyncio.get_running_loop()
        self._workers = [loop.create_task(self._work()) for _ in range(concurrency)]

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def wait(self) -> None:
        """Run until stopped (or the queue closes)."""
        await asyncio.gather(*self._workers, return_exceptions=True)

    async def stop(self, grace: float | None = 30.0) -> None:
        """Stop taking messages; wait ``grace`` seconds for running handlers, then cancel them
        (their messages go back at once)."""
        self._stopping = True
        for task in self._waiting:  # waiting for a message: cancelling loses nothing
            task.cancel()
        _, late = await asyncio.wait(self._workers, timeout=grace)
        for task in late:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self.queue._consumers.discard(self)

    async def _work(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        queue = self.queue
        while not self._stopping:
            self._waiting.add(task)
            try:
                message = await (queue.reserve() if self._reserve else queue.pop())
            except asyncio.CancelledError:
                if self._stopping:
                    return
                raise
            except ClosedError:
                return
            finally:
                self._waiting.discard(task)
            if message is None:  # only on drain or close, as there is no timeout
                return
            try:
                await self._handle(message)
            except ClosedError:
                return

    async def _handle(self, message: Message) -> None:
        try:
            result = self._handler(message)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            if self._reserve:
                await asyncio.shield(self.queue._release(message))
            raise
        except Exception as exc:
            self.failed += 1
            log.warning(
                "handler failed on message %s (tries %d): %r",
                message.id,
                message.tries,
                exc,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            if self._reserve:
                delay = min(self._retry_delay * 2**message.tries, self._max_retry_delay)
                await self.queue.ko(message, delay=delay if self.queue.capabilities.delay else None)
            return
        self.processed += 1
        if self._reserve:
            await self.queue.ok(message)
