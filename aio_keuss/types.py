"""Public result types: what a backend can do, and what ko, sizes, peek and find answer."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .message import Message


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
    peek: bool = False
    """messages can be looked at without being taken (``peek``, ``browse``, ``find``,
    ``purge``): reads only, so consumers are not disturbed."""
    hold: bool = False
    """given messages can be reserved by id, which with ``move`` makes ``requeue``."""
    history: bool = False
    """consumed messages are kept for a while (``history``, ``replay``)."""
    extend: bool = False
    """a reservation can be made longer by its holder (``Queue.extend``), which
    ``consume`` does for handlers that run long."""
    fifo: bool = True
    """messages of a queue come out in the order they were pushed (mature time first where
    there are delays); a sharded queue keeps that order only within a shard."""
    priority: bool = False
    """a push may give a ``priority``: of the messages ready, the highest priority comes
    out first, and the order above holds among messages of one priority."""
    rate_limit: bool = False
    """a queue may limit its deliveries (``rate_limit`` per ``rate_period``) over every
    process sharing the backend, on a limiter kept in the database (see ``Backend.rate_take``)."""
    reschedule: bool = False
    """a waiting message can be changed where it stands: made ready now (``promote``),
    given a new mature time (``reschedule``) or, with ``priority``, a new priority
    (``change_priority``); see ``Store.amend``."""
    results: bool = False
    """a queue may keep what its handlers returned, or why a message failed for good, for
    ``result_ttl`` seconds, readable from any process (``Queue.result``,
    ``Queue.push_and_wait``; see ``Backend.result_store``)."""


class CancelResult(enum.IntEnum):
    """Outcome of ``Queue.cancel``; falsy only when nothing was found to cancel."""

    MISSING = 0
    """Nothing to cancel was found, and no request was left."""
    REMOVED = 1
    """It was waiting: removed, as ``remove`` does."""
    REQUESTED = 2
    """It is under a reservation (or may be: a backend that cannot look, or one without
    reserve, whose popped messages are out of the store while they run, says so for any
    id it does not remove): its holder is asked to stop it."""


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


class State(enum.StrEnum):
    """Where a message is, as ``peek`` and ``find`` say."""

    READY = "ready"
    """deliverable now (an expired reservation included)."""
    SCHEDULED = "scheduled"
    """waiting for its mature time."""
    RESERVED = "reserved"
    """held by a consumer until its reservation deadline."""
    PROCESSED = "processed"
    """consumed, kept by a history backend."""


PEEK_STATES = frozenset({"ready", "scheduled", "reserved", "all"})


@dataclass(frozen=True, slots=True)
class MessageView:
    """A message seen without being taken.

    ``at`` depends on ``state``: the mature time (ready, scheduled), the reservation deadline
    (reserved), or when it was consumed (processed). ``queue`` is the queue it was found in
    (``find`` also looks in the deadletter queue).
    """

    queue: str
    state: State
    at: datetime
    message: Message


@dataclass(frozen=True, slots=True)
class Page:
    """One page of ``browse`` / ``history``: ``cursor`` continues after it (pass it as
    ``after``), None when there is nothing more."""

    items: list[MessageView]
    cursor: str | None


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a message ended, as kept for ``result_ttl`` seconds on a queue opened with one:
    ``ok`` with what its handler returned (``value``), or not, with why (``error``: the
    handler's last exception, a ko's reason, ``"removed"``). ``finished``: when it was
    recorded (aware, UTC)."""

    id: str
    ok: bool
    value: Any
    error: str | None
    finished: datetime
