"""Stats kept in this process: the memory backend's store, and an option for any other."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .base import Increments, StatsStore


class MemoryStats(StatsStore):
    flush_interval = None

    def __init__(self) -> None:
        super().__init__()
        self._counters: defaultdict[str, defaultdict[str, int]] = defaultdict(
            lambda: defaultdict(int)
        )
        self._paused: set[str] = set()
        self._options: dict[str, dict[str, Any]] = {}

    def incr(self, queue: str, counter: str, n: int = 1) -> None:
        self._counters[queue][counter] += n

    async def _apply(self, increments: Increments) -> None:
        for queue, counters in increments.items():
            for name, value in counters.items():
                self._counters[queue][name] += value

    async def _load_counters(self, queue: str) -> dict[str, int]:
        return dict(self._counters.get(queue, {}))

    async def _reset(self, queue: str) -> None:
        self._counters.pop(queue, None)

    async def set_paused(self, queue: str, paused: bool) -> None:
        if paused:
            self._paused.add(queue)
        else:
            self._paused.discard(queue)

    async def is_paused(self, queue: str) -> bool:
        return queue in self._paused

    async def save_options(self, queue: str, options: dict[str, Any]) -> None:
        self._options[queue] = dict(options)

    async def queues(self) -> dict[str, dict[str, Any]]:
        return {name: dict(opts) for name, opts in self._options.items()}
