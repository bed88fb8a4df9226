"""Where the outcome of a finished message is kept for a while, for whoever waits for it.

A queue opened with ``result_ttl`` keeps, for that many seconds, what its handler returned
(or why the message failed for good) under the message's id, in the backend's own
database, so another process can wait for it (arq's ``Job.result``, saq's ``Queue.apply``,
BullMQ's ``Job.waitUntilFinished``). The queue layer encodes and decodes results and
decides when one is written; a store only keeps bytes by (queue, id) until they expire, in
batch-shaped calls of one round trip each.
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

CANCEL_SPACE = ":"
"""What the result-store name of a queue's cancel requests starts with (see
:func:`cancel_space`)."""


def cancel_space(queue: str) -> str:
    """The result-store name under which ``Queue.cancel`` leaves the requests to stop
    messages of ``queue``: ``":" + queue``, which no queue can take (a queue name cannot start
    with ``:``, see ``options.check_queue_name``), so a request never reads as a result."""
    return CANCEL_SPACE + queue


LEAVE_SPACE = "-"
"""What the result-store name of a queue's leave notes starts with (see :func:`leave_space`)."""


def leave_space(queue: str) -> str:
    """The result-store name under which a remove of a message of ``queue`` notes, just
    before it, that a failure result may follow its message's leaving: ``"-" + queue``,
    which no queue can take either (nor a cancel space), so a note never reads as a result
    or a request."""
    return LEAVE_SPACE + queue


def space_queue(name: str) -> str:
    """The queue a result-store name belongs to: itself, or the queue of a cancel space or
    of a leave space."""
    return name[1:] if name.startswith((CANCEL_SPACE, LEAVE_SPACE)) else name


class ResultStore(ABC):
    """Results by (queue, id), each kept ``ttl`` seconds from when it was put.

    A result put again under the same id replaces the first (a message delivered twice
    under at-least-once ends with the outcome of its last run) and starts its ``ttl``
    anew. Expiry is on the database's clock where it has one. An expired result is never
    returned; when its storage is reclaimed is the store's business, but it must not grow
    without bound while results keep being put.
    """

    max_body_bytes: int | None = None
    """Longest body a put takes (None: no bound short of the database's own). The queue
    layer refuses a longer one before it is put, where it would fail the whole put it
    shares with the results of other messages."""

    async def open(self) -> None:
        """Make what the store needs (a table, an index); called once before first use."""

    async def close(self) -> None:
        """Release what ``open`` made; the database connection is the backend's."""

    @abstractmethod
    async def put(self, queue: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        """Store each ``(id, body)`` of ``queue``, kept ``ttl`` seconds (> 0), in one round
        trip; each result is written whole or not at all."""

    @abstractmethod
    async def get(self, queue: str, ids: Sequence[str]) -> list[bytes | None]:
        """The unexpired body of each id of ``queue`` (None where there is none), in order,
        in one round trip."""

    async def replace(
        self, queue: str, swaps: Sequence[tuple[str, bytes, bytes]], ttl: float
    ) -> None:
        """For each ``(id, old, new)`` of ``queue``: where the unexpired body of ``id`` is
        ``old``, it becomes ``new``, kept ``ttl`` seconds; any other body (or none) is left
        as it is. A compare-and-set, in one round trip: the cancel requests are used up
        with it, so that a request written in between (for a later message of the same id)
        is never overwritten. Each store does it atomically; this default, for a store that
        does not, reads and then puts, so that a body written between the two is lost."""
        if not swaps:
            return
        found = await self.get(queue, [message_id for message_id, _, _ in swaps])
        same = [(i, new) for (i, old, new), body in zip(swaps, found, strict=True) if body == old]
        await self.put(queue, same, ttl)


class MemoryResults(ResultStore):
    """Results kept in this process (the memory backends): a dict, and a heap of expiry
    times so that every put reclaims what has expired, in time logarithmic in the count."""

    def __init__(self) -> None:
        self._bodies: dict[tuple[str, str], tuple[float, bytes]] = {}
        self._expiries: list[tuple[float, tuple[str, str]]] = []

    async def put(self, queue: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        self._put(queue, results, ttl)

    def _put(self, queue: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        now = time.monotonic()
        self._reclaim(now)
        expires = now + ttl
        for message_id, body in results:
            key = (queue, message_id)
            self._bodies[key] = (expires, body)
            heapq.heappush(self._expiries, (expires, key))

    async def get(self, queue: str, ids: Sequence[str]) -> list[bytes | None]:
        now = time.monotonic()
        found: list[bytes | None] = []
        for message_id in ids:
            kept = self._bodies.get((queue, message_id))
            found.append(kept[1] if kept is not None and kept[0] > now else None)
        return found

    async def replace(
        self, queue: str, swaps: Sequence[tuple[str, bytes, bytes]], ttl: float
    ) -> None:
        """Atomic: no await between the look and the write."""
        now = time.monotonic()
        bodies = self._bodies
        self._put(
            queue,
            [
                (message_id, new)
                for message_id, old, new in swaps
                if (kept := bodies.get((queue, message_id))) is not None
                and kept[0] > now
                and kept[1] == old
            ],
            ttl,
        )

    def _reclaim(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expires, key = heapq.heappop(expiries)
            kept = self._bodies.get(key)
            if kept is not None and kept[0] == expires:  # not put again since
                del self._bodies[key]
