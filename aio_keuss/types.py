"""Public result types: what a backend can do, and what ko and sizes answer."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do; the queue layer refuses the rest before writing anything."""

    pop: bool = True
    reserve: bool = True
    delay: bool = True
    remove: bool = True
    idempotent: bool = True
    """push with an explicit ``id`` is deduplicated within the dedup window."""
    reservation_expiry: bool = True
    """a reservation neither ok-ed nor ko-ed within ``reserve_delay`` is delivered again
    (redis-reliable instead recovers the reservations of consumers that died)."""
    shared: bool = True
    """other processes see the same queues (false for the in-process memory backend)."""
    move: bool = False
    """a held message can be moved to another queue of the backend in one atomic step
    (``Queue.move``)."""
    fifo: bool = True
    """messages of a queue come out in the order they were pushed (mature time first where
    there are delays); a sharded queue keeps that order only within a shard."""


class KoResult(enum.IntEnum):
    """Outcome of a ko; falsy only when nothing was done."""

    MISSING = 0
    ROLLED_BACK = 1
    DEADLETTERED = 2


@dataclass(frozen=True, slots=True)
class Sizes:
    """``total == size + scheduled + reserved``.

    size: deliverable now (expired reservations included); scheduled: waiting for their
    mature time; reserved: held by a consumer whose reservation has not expired.
    """

    size: int
    total: int
    scheduled: int
    reserved: int
