"""Counters, the paused flag and queue options, shared by every process of a backend.

Counting is on the hot path, so increments are buffered here, once, and a background task
hands them to the database every ``flush_interval`` seconds (and on close); a subclass only
writes a batch of increments. Stores that live in this process apply them at once.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

log = logging.getLogger("aio_keuss.stats")

COUNTERS = ("put", "get", "reserve", "commit", "rollback", "deadletter")

Increments = dict[str, dict[str, int]]


class StatsStore(ABC):
    flush_interval: float | None = 0.1
    """Seconds between flushes of buffered increments; None for a store that never buffers."""

    def __init__(self) -> None:
        self._buffer: defaultdict[str, defaultdict[str, int]] = defaultdict(
            lambda: defaultdict(int)
        )
        self._flusher: asyncio.Task[None] | None = None
        self._closing = False

    async def open(self) -> None:
        if self.flush_interval is not None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_forever())

    async def close(self) -> None:
        self._closing = True
        if self._flusher is not None:
            self._flusher.cancel()
            # Bounded: a driver that swallows the cancellation must not hang close().
            await asyncio.wait({self._flusher}, timeout=2.0)
            self._flusher = None
        await self.flush()

    def incr(self, queue: str, counter: str, n: int = 1) -> None:
        """Count ``n`` events; buffered until the next flush (a local store overrides this)."""
        if n:
            self._buffer[queue][counter] += n

    async def counters(self, queue: str) -> dict[str, int]:
        """Stored counters plus what is still buffered, every known counter present."""
        stored = await self._load_counters(queue)
        result = dict.fromkeys(COUNTERS, 0)
        for source in (stored, self._buffer.get(queue, {})):
            for name, value in source.items():
                result[name] = result.get(name, 0) + value
        return result

    async def flush(self) -> None:
        if not self._buffer:
            return
        batch: Increments = {q: dict(c) for q, c in self._buffer.items()}
        self._buffer.clear()
        try:
            await self._apply(batch)
        except Exception:
            self._merge_back(batch)
            raise

    async def _flush_forever(self) -> None:
        assert self.flush_interval is not None
        while not self._closing:
            await asyncio.sleep(self.flush_interval)
            try:
                await self.flush()
            except Exception as exc:  # kept buffered; the next flush tries again
                log.warning("stats flush failed: %s", exc)

    def _merge_back(self, batch: Increments) -> None:
        for queue, counters in batch.items():
            for name, value in counters.items():
                self._buffer[queue][name] += value

    # what a database provides ---------------------------------------------------------

    @abstractmethod
    async def _apply(self, increments: Increments) -> None:
        """Add a batch of increments: {queue: {counter: n}}."""

    @abstractmethod
    async def _load_counters(self, queue: str) -> dict[str, int]: ...

    @abstractmethod
    async def reset(self, queue: str) -> None:
        """Zero a queue's counters."""

    @abstractmethod
    async def set_paused(self, queue: str, paused: bool) -> None: ...

    @abstractmethod
    async def is_paused(self, queue: str) -> bool: ...

    @abstractmethod
    async def save_options(self, queue: str, options: dict[str, Any]) -> None:
        """Record a queue and its options so ``factory.list()`` finds it from any process."""

    @abstractmethod
    async def queues(self) -> dict[str, dict[str, Any]]:
        """Every recorded queue with its options."""
