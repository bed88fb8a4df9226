"""``queue.repeat(key, payload, every=... | cron=...)``: a push that recurs on a schedule.

What BullMQ's repeatable jobs (``repeat: {pattern | every}``), saq's ``CronJob``, arq's
``cron`` and procrastinate's periodic tasks offer, built from two things every queue with
explicit ids and delays already has, so that any number of processes may run the same
repeat without a leader or a lock:

- Occurrence ``t`` is pushed as a delayed message whose id is ``f"{key}@{ms}"`` (``ms``: ``t``
  in whole milliseconds since the epoch). Every process computes the same instants (see
  :mod:`aio_keuss.cron`), hence the same ids, and the queue drops a second push of an id
  within its ``dedup_window``, even after the first was consumed: each occurrence is
  delivered once however many processes push it.
- The repeater keeps the NEXT occurrence already queued: it pushes the first one after now
  when it starts, then sleeps until that time and pushes the one after. A process that dies
  leaves its next occurrence queued, so a restart within a period loses nothing. On a queue
  whose messages expire a set time after their push (the sharded backends' ``message_ttl``)
  an occurrence queued a period ahead would end before its time, never delivered: there it
  is pushed no sooner than half that TTL before its time (a process dying before then
  leaves it to the other processes running the repeat, or to a restart before its time).

Every push of occurrence ``t`` is made between the occurrence before it and ``t`` itself (a
push that keeps failing is given up at ``t``, the occurrence skipped; a repeater woken past
``t`` skips it, counting it in ``missed`` and logging a warning), so the dedup holds as
long as ``dedup_window`` outlasts the longest gap between two occurrences; ``repeat()`` logs a
warning when it does not. Occurrences that fell due while no repeater ran are not made up,
as with cron: a repeat is a schedule of future pushes, not a ledger of past ones.

A repeater is a background task like a consumer: it rides out outages (each failed push is
retried with the consumers' jittered backoff, the outage logged once), ``stop()`` ends it and
may be called any number of times, and the queue's ``close()`` stops the repeaters it
started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .consumer import Outage, State, StoppedOnExit, retry_backoff
from .cron import Every, Schedule, every, parse_cron, zone
from .errors import ClosedError, InvalidHeadersError, InvalidInputError
from .message import (
    Headers,
    Payload,
    check_id,
    check_priority,
    encode_headers,
    encode_payload,
    to_datetime,
)
from .options import check_queue_name

log = logging.getLogger("aio_keuss.repeat")

KEY_HEADER = "repeat"
"""Header naming the repeat an occurrence comes from (its key)."""
SCHEDULED_HEADER = "scheduled"
"""Header with the occurrence's time, ISO-8601 UTC text."""
LONGEST_NAP = 60.0
"""Longest single sleep while waiting for an occurrence: the wall clock is read again after
it, so a clock stepped by NTP or a suspended machine delays an occurrence by at most this."""
DEDUP_MARGIN = 60.0
"""Seconds of clock skew and round trip that ``dedup_window`` should leave above the longest
gap between occurrences (see :meth:`RepeatPlan.dedup_warning`)."""

TTL_LEAD = 0.5
"""On a queue whose messages live ``message_ttl`` seconds from their push, an occurrence is
pushed at most this share of it before its time (rather than up to a whole period before,
when it would end unseen): it then has the rest of its life to be taken once due."""

clock: Callable[[], float] = time.time
"""The wall clock occurrences are read on (seconds since the epoch): a module global, read at
each use, so that a test can step it past occurrences (a late wake, a suspended machine)
instead of waiting for, or provoking, one."""

Push = Callable[[float, Headers, str], Awaitable[Any]]
"""Pushes the repeat's payload with a delay, headers and id (``Queue.push``, bound)."""


@dataclass(frozen=True, slots=True)
class RepeatPlan:
    """What ``repeat()`` was asked, checked: the key, the schedule and the user's headers."""

    key: str
    schedule: Schedule
    headers: Headers

    @staticmethod
    def make(key: object, every_s: object, cron: object, tz: object, headers: object) -> RepeatPlan:
        """Check everything but the payload and the backend (the queue does those), raising
        a typed error before anything is written."""
        if not isinstance(key, str) or not key:
            raise InvalidInputError(f"repeat key must be a non-empty str, not {key!r:.80}")
        if (every_s is None) == (cron is None):
            raise InvalidInputError("repeat takes exactly one of every= (seconds) and cron=")
        schedule: Schedule
        if cron is not None:
            schedule = parse_cron(cron, tz)
        else:
            zone(tz)  # checked all the same: a typo should not wait for a switch to cron
            schedule = every(every_s)
        if headers is None:
            headers = {}
        elif not isinstance(headers, dict):
            raise InvalidHeadersError(f"headers must be a dict, not {type(headers).__name__}")
        taken = sorted({KEY_HEADER, SCHEDULED_HEADER} & set(headers))
        if taken:
            raise InvalidHeadersError(
                f"headers {taken} are set by repeat() on each occurrence; use other names"
            )
        return RepeatPlan(key, schedule, dict(headers))

    def message_id(self, t: float) -> str:
        return occurrence_id(self.key, t)

    def headers_at(self, t: float) -> Headers:
        # the millisecond of the id (rounded), not ``t`` truncated by isoformat
        scheduled = to_datetime(round(t * 1000) / 1000)
        return {
            **self.headers,
            KEY_HEADER: self.key,
            SCHEDULED_HEADER: scheduled.isoformat(timespec="milliseconds"),
        }

    def dedup_warning(self, dedup_window: float, now: float) -> str | None:
        """Why several processes could push an occurrence twice, or None: a push of an
        occurrence is made up to one gap before it, and a second push after its message
        was consumed is dropped only while the first push's id is remembered."""
        gap = self.schedule.longest_gap(now)
        if gap + DEDUP_MARGIN <= dedup_window:
            return None
        return (
            f"repeat {self.key!r}: occurrences are up to {gap:g} s apart but the queue's"
            f" dedup_window is {dedup_window:g} s: several processes running this repeat"
            f" could push an occurrence twice; open the queue with dedup_window >="
            f" {gap + DEDUP_MARGIN:g} to rule it out"
        )


@dataclass(frozen=True)
class Repeat:
    """A repeat to run, not yet running: ``Queue.repeat``'s arguments and the queue they go
    to, for ``run_worker(repeats=...)`` (the worker's counterpart of arq's ``cron_jobs``,
    BullMQ's repeatable jobs, procrastinate's periodic tasks).

    A description rather than a started :class:`Repeater`, because a worker must check all
    of them before it connects: a typo in a cron expression should stop a deploy at once,
    not surface after the worker has started consuming (or, for a schedule that fires once
    a month, weeks later)."""

    queue: str
    key: str
    payload: Payload = None
    every: float | None = None
    cron: str | None = None
    headers: Headers | None = None
    tz: str = "UTC"
    priority: int = 0

    def check(self) -> RepeatPlan:
        """Raise what ``Queue.repeat`` raises for this input, without a queue: everything
        but what only the backend knows (explicit ids and delays, a message size limit)."""
        check_queue_name(self.queue)
        plan = RepeatPlan.make(self.key, self.every, self.cron, self.tz, self.headers)
        first = plan.schedule.next_after(clock())
        # in the order a push checks them, so input bad twice raises what q.repeat raises
        encode_headers(plan.headers_at(first))
        encode_payload(self.payload)
        check_id(plan.message_id(first))
        check_priority(self.priority)
        return plan


def occurrence_id(key: str, t: float) -> str:
    """The message id of occurrence ``t`` of repeat ``key``: the same in every process."""
    return f"{key}@{round(t * 1000)}"


class Repeater(StoppedOnExit):
    """A running repeat (see the module's docstring); made by ``Queue.repeat``."""

    def __init__(
        self,
        plan: RepeatPlan,
        queue: str,
        push: Push,
        stopped: Callable[[Repeater], None],
        message_ttl: float | None = None,
    ) -> None:
        self.key = plan.key
        self.queue = queue
        self.schedule = plan.schedule
        self._plan = plan
        self._push = push
        self._stopped = stopped
        self._lead = None if message_ttl is None else message_ttl * TTL_LEAD
        self.pushed = 0
        """Occurrences this repeater pushed (a push another process had made counts too:
        the queue dropped it as a duplicate)."""
        self.missed = 0
        """Occurrences not pushed: given up because every push of theirs failed until their
        time, or skipped by a wake past them (a loaded loop, a suspended machine)."""
        self.next_at: datetime | None = None
        """The occurrence pushed last (or being pushed): the next one to be delivered."""
        self.failure: Exception | None = None
        """The error that ended the repeater, when one not worth retrying did."""
        self._outage = Outage(queue, f"repeat {plan.key!r}")
        self._failures = 0
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._task.add_done_callback(self._ended)

    def __repr__(self) -> str:
        return f"<Repeater {self.key!r} on {self.queue!r} {self.state}>"

    @property
    def state(self) -> State:
        """One of "running", "reconnecting" (pushes fail; it retries) or "stopped"."""
        if self._stopping or self._task.done():
            return "stopped"
        return "reconnecting" if self._outage.failing else "running"

    @property
    def last_error(self) -> Exception | None:
        """The last failed push, kept after the outage ended."""
        return self._outage.last_error

    def stop(self) -> Coroutine[Any, Any, None]:
        """Stop pushing. The occurrence already queued stays queued (other processes may
        push it too; stopping one process must not take it from them): ``remove`` its id
        to drop it. Safe to call again, and to cancel (the repeater stops all the same).

        Not a coroutine function: the stop is asked for by the call itself, since an
        ``async def`` wrapped in a task (``gather``, a task group, the queue's close) and
        cancelled before its first step would never have run its body at all. The awaitable
        returned waits for the repeater to end."""
        self._stopping = True
        self._task.cancel()
        return self.wait()

    async def wait(self) -> None:
        """Until the repeater stops. Cancelling this wait leaves it running."""
        await asyncio.wait([self._task])

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._stopped(self)

    async def _run(self) -> None:
        try:
            t = self.schedule.next_after(clock())
            while True:
                if self._lead is not None:  # pushed sooner, it would end before its time
                    await _sleep_until(t - self._lead)
                    if clock() >= t:  # woken past it: skipped, as after a late wake below
                        t = await self._following(t, skipped=1)
                        continue
                if await self._push_occurrence(t):
                    await _sleep_until(t)
                t = await self._following(t)
        except ClosedError:
            log.debug("queue %r: repeat %r stops: the queue closed", self.queue, self.key)
        except Exception as exc:  # not worth retrying (a refused push): stop, loudly
            self.failure = exc
            log.exception("queue %r: repeat %r stopped", self.queue, self.key)

    async def _following(self, t: float, skipped: int = 0) -> float:
        """The occurrence to push after ``t`` (pushed, given up, or ``skipped`` already):
        the first one after now. After a late wake (a loaded loop, a long pause, a
        suspended machine) what fell due meanwhile is not made up, as with cron, but each
        occurrence so skipped counts in ``missed`` and the wake is logged once, so that a
        schedule that silently lost runs shows in the counters and the log."""
        now = clock()
        following = self.schedule.next_after(max(t, now))
        skipped += await self._between(t, following)
        if skipped:
            self.missed += skipped
            log.warning(
                "queue %r: repeat %r woke %.1f s after occurrence %s was due: %d %s skipped"
                " (not made up)",
                self.queue,
                self.key,
                now - t,
                self._plan.message_id(t),
                skipped,
                "occurrence" if skipped == 1 else "occurrences",
            )
        return following

    async def _between(self, after: float, before: float) -> int:
        """How many occurrences lie strictly between the occurrences ``after`` and
        ``before``: by division for ``every``, else walked (a few microseconds each, the
        loop given a turn now and then: a year's suspend of a minutely cron is 525,600)."""
        if isinstance(self.schedule, Every):
            return max(0, round((before - after) / self.schedule.seconds) - 1)
        count = 0
        t = self.schedule.next_after(after)
        while t < before:
            count += 1
            if count % 10_000 == 0:
                await asyncio.sleep(0)
            t = self.schedule.next_after(t)
        return count

    async def _push_occurrence(self, t: float) -> bool:
        """Push occurrence ``t``, retrying with backoff until it is in or its time has come
        (then it is skipped: a push after ``t`` could follow the consumption of a copy
        another process pushed, past what the dedup window covers)."""
        self.next_at = to_datetime(t)
        message_id, headers = self._plan.message_id(t), self._plan.headers_at(t)
        while True:
            generation = self._outage.generation
            try:
                await self._push(max(0.0, t - clock()), headers, message_id)
            except ClosedError:
                raise
            except Exception as exc:
                self._outage.failed(exc, generation, "push")  # raises what cannot heal
                pause = retry_backoff(self._failures)
                self._failures += 1
                left = t - clock()
                if left <= pause:
                    await asyncio.sleep(max(0.0, left))
                    self.missed += 1
                    log.debug(
                        "queue %r: repeat %r: occurrence %s skipped: no push got through",
                        self.queue,
                        self.key,
                        message_id,
                    )
                    return False
                await asyncio.sleep(pause)
                continue
            self._failures = 0
            self._outage.succeeded()
            self.pushed += 1
            return True


async def _sleep_until(t: float) -> None:
    """Sleep until the wall clock reads ``t`` (asyncio sleeps on the monotonic clock)."""
    while True:
        left = t - clock()
        if left <= 0:
            return
        await asyncio.sleep(min(left, LONGEST_NAP))
