"""Coalescing: concurrent calls on one queue share round trips.

With ``run_in_caller`` (stores whose round trips pipeline, or that answer from memory), a
call that finds a free slot (fewer than ``concurrency`` batches in flight, nobody queued)
runs its own request at once, in the caller's task: nothing waits for company, the command
is on the wire in the same loop iteration, and the reply wakes the caller directly. With a
few clients this pipelines their round trips instead of serialising them. Calls that find
every slot busy queue up; the next slot to free takes all of them (up to ``max_batch``) as
one batch, run by a task. Without it (stores where each call costs a durable commit) every
call goes through a batch task, started on the next loop iteration, by which time the
calls of every task ready in this one have joined it. A batch task goes on while its
callers keep asking as soon as they are answered (a producer's loop): their next calls form
its next batch, sent on the iteration they are made in, one sooner than a new task would.

Crowding: once a batch carries more than ``CROWDED`` callers, callers outnumber the slots.
A free slot is then worth more to the batch the next callers form than to one caller
alone, so a lone call runs in its caller only while nothing is in flight; and, with
``run_in_caller`` (round trips that pipeline), the callers queued are shared out over the
free slots, ``MIN_SHARE`` at least to a batch, rather than all sent in the first one.
Without that, 32 clients on four slots settled into one batch of 29 and three one-caller
round trips, each of those a ``write()`` and a reply of its own (32 clients on redis-oq and
redis-reliable, interleaved runs: push +19 to +32 %, pop +23 to +60 %, reserve + ok +30 %;
3 clients, PostgreSQL and the memory store unchanged). A share that would leave fewer
than ``MIN_SHARE`` behind takes them too: 32 clients were shared as 10, 10, 10 and 2, and
the rounds after mostly cycled through batches of 10, 8, 7, 4 and 3 (6.4 callers a round
trip); with it most runs settle into three batches (10.6 a round trip, with 10-15 % less
client and Redis CPU a message on 32-client reserve + ok), the others into that cycle.

Cancellation: a queued request cancelled before its batch starts is dropped; one whose
caller is cancelled after the store did the work has its result handed to ``on_orphan``,
so a queue can put popped or reserved messages back instead of losing them. A request run
in the caller's task is only allowed with ``on_orphan`` when the store is *uninterruptible*
(its primitives await only replies that refuse cancellation, see ``Store.uninterruptible``):
the caller's cancellation then waits for the reply, the work completes, and the result goes
to ``on_orphan`` just the same. On such a store a batch task's own cancellation waits for
the reply too, and hands every result on.

What ``on_orphan`` returns to do (a put-back's round trip) is awaited by the task whose
cancellation orphaned the result, before that task ends, never left to a task of its own:
``asyncio.run`` cancels every task left when its main coroutine ends and then runs the loop
only until those tasks have ended (Python's asyncio documentation, "Runners"), so a task
started meanwhile, or cancelled before its first step, would never send the put-back, and
messages a store had already taken would be lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

CROWDED = 2
"""A batch of more callers than this means they crowd the slots (see the module's docstring)."""
MIN_SHARE = 10
"""The fewest callers a crowd is split into batches of: smaller batches cost more round trips
than the slots they fill are worth."""

Req = TypeVar("Req")
Res = TypeVar("Res")
T = TypeVar("T")

LATE_REPLIES: list[Callable[[asyncio.Future[Any]], asyncio.Future[Any] | None]] = []
"""Where a store whose one-message calls (see ``OneCall``) reply with plain futures, which
do not refuse cancellation, finds the future that gets the reply of one cancelled with its
caller, and refuses cancellation (see :func:`settled`); None for a future it does not know."""

OneCall = tuple[Callable[[], "asyncio.Future[Any] | None"], Callable[[Any], T]]
"""A store's own one-request call, as (send, read): ``send()`` puts the request on the wire
at once and returns the future of its reply, which refuses cancellation, or whose
cancellation with its caller is followed by :func:`settled` (or None: it cannot now);
``read(reply)`` is the request's result."""


class Coalescer(Generic[Req, Res]):
    def __init__(
        self,
        run: Callable[[list[Req]], Coroutine[Any, Any, list[Res]]],
        *,
        max_batch: int,
        weight: Callable[[Req], int] = lambda _: 1,
        size: Callable[[Req], int] | None = None,
        max_size: int = 0,
        concurrency: int = 1,
        on_orphan: Callable[[Req, Res], Coroutine[Any, Any, None] | None] | None = None,
        run_in_caller: bool = True,
        uninterruptible: bool = False,
    ) -> None:
        self._run_batch = run
        self._max_batch = max_batch
        self._weight = weight
        # A second bound, in bytes, where the store has one per call: a batch is split
        # between callers, so a call that fails fails only its own callers (a larger
        # request goes alone; the store splits it, and its failure is its caller's).
        self._size = size
        self._max_size = max_size
        self._concurrency = concurrency
        self._on_orphan = on_orphan
        self._uninterruptible = uninterruptible
        self._inline = run_in_caller and (on_orphan is None or uninterruptible)
        # Crowds are spread over the slots only where round trips pipeline: where each call
        # is a durable commit, fewer and larger batches are what counts.
        self._spread = run_in_caller
        self._pending: deque[tuple[Req, asyncio.Future[Res]]] = deque()
        self._running = 0
        self._scheduled = False
        self._crowded = False  # the last batch carried more than CROWDED callers
        self._tasks: set[asyncio.Task[None]] = set()
        self._inline_done: asyncio.Event | None = None  # set for wait_idle when one ends
        self._backs = 0  # hand-backs under way (see ``hand_back``), which a close waits for
        self._back_tasks: set[asyncio.Task[None]] = set()  # those running in tasks
        # The loop, looked up once: on Python 3.11 ``asyncio.get_running_loop()`` costs a
        # getpid() system call (its fork check), which a call per request would pay.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, request: Req, one: OneCall[Res] | None = None) -> Res:
        """The result of ``request``, run with others' in a batch or alone (see the
        module's docstring). ``one``: the store's own (send, read) for this request (see
        ``Store.one_take``), used where the request runs alone in the caller's task."""
        free = not self._running if self._crowded else self._running < self._concurrency
        reply: asyncio.Future[Any] | None = None
        if one is not None and self._inline and free and not self._pending:
            # ``send_one``, inline: a pop's or a reserve's every call passes here
            self._running += 1
            try:
                reply = one[0]()
            except BaseException:
                self._ran_inline()
                raise
            if reply is None:
                self._running -= 1  # nothing was queued meanwhile: no batch to start
        if reply is not None and one is not None:
            # The reply refuses cancellation: a cancellation lands once it is in, and what
            # it took is handed back as a batch's would be. Awaited here, with no coroutine
            # between the caller and the reply (what ``RunToEnd`` does for a batch, at a
            # fraction of the cost).
            try:
                raw = await reply
            except asyncio.CancelledError as cancelled:
                reply = await settled(reply)
                self._ran_inline()
                if replied(reply):
                    try:
                        result = one[1](reply.result())
                    except Exception:  # unreadable: the caller still ends cancelled
                        raise cancelled from None
                    await self.hand_back(request, result)
                raise
            except BaseException:
                self._ran_inline()
                raise
            self._ran_inline()
            return one[1](raw)
        if self._inline and free and not self._pending:
            # In the caller's task, here rather than in a coroutine of its own: one frame
            # fewer on the hot path of every call that finds a free slot.
            self._running += 1
            if self._on_orphan is None:  # nothing to hand back: a plain await is enough
                try:
                    (result,) = await self._run_batch([request])
                    return result
                finally:
                    self._ran_inline()
            work = RunToEnd(self._run_batch([request]))
            try:
                (result,) = await work
            finally:
                self._ran_inline()
            if work.held is not None:  # cancelled once the reply was in: the work is done
                await self.hand_back(request, result)
                raise work.held
            return result
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[Res] = loop.create_future()
        self._pending.append((request, future))
        self._schedule()
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled after the batch already produced our result: hand it on.
            if future.done() and not future.cancelled() and future.exception() is None:
                await self.hand_back(request, future.result())
            raise

    def send_one(
        self, send: Callable[..., asyncio.Future[Any] | None], *args: Any
    ) -> asyncio.Future[Any] | None:
        """For a one-message call the store sends itself (``Store.one_take``, ``one_commit``,
        ``one_insert``): where a call would run in its caller's task now, take the slot and
        ``send(*args)``; the reply future, to await, then call :meth:`ran_one`. None: no
        free slot, or nothing sent; ``submit`` the call instead."""
        free = not self._running if self._crowded else self._running < self._concurrency
        if not (self._inline and free and not self._pending):
            return None
        self._running += 1
        try:
            reply = send(*args)
        except BaseException:
            self._ran_inline()
            raise
        if reply is None:
            self._running -= 1  # nothing was queued meanwhile: no batch to start
        return reply

    async def wait_idle(self) -> None:
        """Wait for the batches in flight, run by tasks or by callers, and the hand-backs
        under way (used on close)."""
        while self._tasks or self._running or self._backs:
            if self._tasks:
                # Not gather: cancelled (a close cancelled), gather would cancel the batches
                # themselves, whose callers were not (an interruptible store's round trip,
                # cut short once the server had done it, lost what it took).
                await asyncio.wait(self._tasks)
                # A task cancelled before its first step never ran the ``finally`` that
                # removes it.
                self._tasks = {task for task in self._tasks if not task.done()}
            else:
                self._inline_done = asyncio.Event()
                await self._inline_done.wait()

    def cancel_batches(self) -> None:
        """Cancel the batch tasks in flight, and the hand-backs running in tasks: for a
        close that gave up waiting for them (the connection closes next, and on PostgreSQL
        its pool's close waits for every statement to end)."""
        for task in (*self._tasks, *self._back_tasks):
            task.cancel(GIVE_UP)  # a task awaiting ``to_the_end`` work passes it on

    def _ran_inline(self) -> None:
        """A call run in its caller's task has ended: the slot is free."""
        self._running -= 1
        if self._pending:
            self._schedule()
        if self._inline_done is not None:
            self._inline_done.set()

    ran_one = _ran_inline
    """For a call :meth:`send_one` sent, once its reply is in (or given up on)."""

    def _handed_back(self, task: asyncio.Task[None] | None = None) -> None:
        self._backs -= 1
        if task is not None:
            self._back_tasks.discard(task)
        if self._inline_done is not None:
            self._inline_done.set()

    def _schedule(self) -> None:
        # The batch task's first step runs on the next loop iteration, by which time every
        # task that was ready in this one has added its request.
        if not self._scheduled and self._pending and self._running < self._concurrency:
            self._scheduled = True
            self._running += 1
            # The task leaves ``_tasks`` itself when it ends (cheaper than a done callback,
            # which would cost a loop callback per batch).
            loop = self._loop or asyncio.get_running_loop()
            self._tasks.add(loop.create_task(self._run()))

    def _take_batch(self) -> list[tuple[Req, asyncio.Future[Res]]]:
        batch: list[tuple[Req, asyncio.Future[Res]]] = []
        total = 0
        size, nbytes = self._size, 0
        # This batch's share of the callers queued: the slots free beside its own take the
        # rest, each started now (see "Crowding" in the module's docstring).
        slots = self._concurrency - self._running + 1 if self._spread else 1
        share = max(MIN_SHARE, -(-len(self._pending) // slots)) if slots > 1 else len(self._pending)
        if len(self._pending) - share < MIN_SHARE:
            # what this share would leave is too few for a batch of its own: take it too
            share = len(self._pending)
        while self._pending and len(batch) < share:
            request, future = self._pending[0]
            if future.done():  # cancelled before it was sent: nothing to do
                self._pending.popleft()
                continue
            weight = self._weight(request)
            if batch and total + weight > self._max_batch:
                break
            if size is not None:
                more = size(request)
                if batch and nbytes + more > self._max_size:
                    break
                nbytes += more
            self._pending.popleft()
            batch.append((request, future))
            total += weight
        if self._pending and self._spread:  # the other shares start now, in free slots
            self._schedule()
        return batch

    async def _run(self) -> None:
        self._scheduled = False
        try:
            batch = self._take_batch()
            while batch:
                await self._send(batch)
                # The callers just answered often call again at once (a producer's loop):
                # they run on the next loop iteration, and so does this task, after them
                # (the loop runs callbacks in order), taking what they asked as its next
                # batch: the same batch a new task would take, an iteration sooner and
                # without making one. Meanwhile ``_scheduled`` keeps them from starting one.
                self._scheduled = True
                try:
                    await asyncio.sleep(0)
                finally:
                    self._scheduled = False
                batch = self._take_batch()
        finally:
            self._running -= 1
            self._tasks.discard(asyncio.current_task())
            self._schedule()

    async def _send(self, batch: list[tuple[Req, asyncio.Future[Res]]]) -> None:
        self._crowded = len(batch) > CROWDED
        requests = [request for request, _ in batch]
        # This task is cancelled only as the loop ends (``asyncio.run`` cancels every task
        # left). Where the store's work cannot be interrupted it is done by the time the
        # cancellation lands: its results are handed on, not dropped with the callers.
        work: RunToEnd[list[Res]] | None = None
        try:
            if self._on_orphan is not None:
                # (on a store that can be interrupted, a cancellation is held only where
                # the store awaits a task of ``to_the_end``, or a future already done)
                work = RunToEnd(self._run_batch(requests))
                results = await work
            else:
                results = await self._run_batch(requests)
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # cancelled (loop shutting down) or interpreter exit
            for _, future in batch:
                future.cancel()
            raise
        orphans: list[tuple[Req, Res]] = []
        for (request, future), result in zip(batch, results, strict=True):
            if future.done():
                orphans.append((request, result))
            else:
                future.set_result(result)
        cancelled: asyncio.CancelledError | None = None
        for request, result in orphans:
            try:  # its caller is gone: nobody else hands it back
                await self.hand_back(request, result)
            except asyncio.CancelledError as exc:  # the next ones are still handed back
                cancelled = exc
        if work is not None:
            work.raise_held()
        if cancelled is not None:
            raise cancelled

    def on_orphan_work(self, request: Req, result: Res) -> Coroutine[Any, Any, None] | None:
        """What ``on_orphan`` returns to do for a result nobody will receive, not started:
        for a caller that cannot await it (its coroutine is being closed)."""
        return None if self._on_orphan is None else self._on_orphan(request, result)

    async def hand_back(self, request: Req, result: Res) -> None:
        """Do what ``on_orphan`` returns for a result nobody will receive, in the task whose
        cancellation orphaned it (see "Cancellation" in the module's docstring).

        On an uninterruptible store the work runs here, step by step: its first step sends
        the request in this very step, and a cancellation that lands meanwhile waits for the
        reply that refuses it, then is raised. Elsewhere a cancellation would interrupt it
        midway, so it runs as a task of its own, shielded: this task still waits for it,
        and should it be cancelled again, the hand-back goes on without it. The work is
        not to raise (a queue logs what failed): the caller ends with its cancellation."""
        back = self.on_orphan_work(request, result)
        if back is None:
            return
        # Counted until the work ends, for a close to wait for (``wait_idle``): closed under
        # it, the connection would lose the put-back, or never get its connection back.
        self._backs += 1
        if self._uninterruptible:
            try:
                # a turn it gives the loop (the memory store's insert) is no reply to wait
                # for: a cancellation there, interrupting it, lost what it put back
                work = RunToEnd(back, turns=True)
                await work
            finally:
                self._handed_back()
            work.raise_held()
            return
        loop = self._loop or asyncio.get_running_loop()
        task = loop.create_task(back)
        self._back_tasks.add(task)
        task.add_done_callback(self._handed_back)
        await asyncio.shield(task)


async def settled(reply: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """A one-message call's reply future (see ``OneCall``) once a cancellation came out of
    awaiting it, as one that refuses cancellation would stand: in, given up or failed. A
    plain future (which costs its awaiter less, see ``LATE_REPLIES``) was cancelled with
    its caller while the command ran: the future its store swapped in gets the reply, and
    is awaited here (cancelled again meanwhile or not: it refuses, up to its grace), so that
    the caller's cancellation lands once the reply is in, as with one that refuses. Any
    other future is returned as it is."""
    if not reply.cancelled():
        return reply
    for late_reply in LATE_REPLIES:
        late = late_reply(reply)
        if late is not None:
            # failed, given up or cancelled again: the caller's to judge (see ``replied``)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await late
            return late
    return reply


def replied(reply: asyncio.Future[Any]) -> bool:
    """Whether a reply that refuses cancellation came in (a cancellation of its awaiter
    then landed after the store had done the work), rather than failing or being given up
    on."""
    return reply.done() and not reply.cancelled() and reply.exception() is None


class Uncancellable(asyncio.Future[None]):
    """Marks the end of work shared by several callers (a lease, a state write), for them to
    await directly: a caller's cancellation cannot cancel it for the others, and under
    :class:`RunToEnd` it takes effect once the work is done, like a reply that refuses to
    be cancelled. Its owner always completes it."""

    def cancel(self, msg: Any | None = None) -> bool:
        return False


class RunToEnd(Generic[T]):
    """Awaits a coroutine in the current task, step by step, so that a cancellation thrown
    in while the awaited future already holds its result (a reply that refused to be
    cancelled) does not interrupt the work: it is held in ``held`` and the coroutine goes on
    to the end. Any other cancellation interrupts as usual.

    With ``turns``, a cancellation thrown in at a bare yield (``asyncio.sleep(0)``: a turn
    given to the loop, which nothing waits on) is held too, and the coroutine resumed: for
    work that must not stop once begun (a hand-back), on a store where nothing else is
    awaited.

    The awaiter does what must follow the work (counts, signals, hand-backs), then calls
    :meth:`raise_held`. Should the work fail after a cancellation was held, the awaiter gets
    the cancellation instead of the failure: its task was cancelled and must end so, or
    ``asyncio.timeout`` and task groups, which count on the cancellation coming back to
    them, would see an ordinary error and leave the task's cancel request standing."""

    __slots__ = ("_coro", "_turns", "held")

    def __init__(self, coro: Coroutine[Any, Any, T], *, turns: bool = False) -> None:
        self._coro = coro
        self._turns = turns
        self.held: asyncio.CancelledError | None = None

    def __await__(self) -> Generator[Any, None, T]:
        coro = self._coro
        error: BaseException | None = None
        while True:
            try:
                step = coro.send(None) if error is None else coro.throw(error)
            except StopIteration as stop:
                value: T = stop.value
                return value
            except Exception:
                if self.held is not None:
                    raise self.held from None
                raise
            error = None
            try:
                yield step
            except asyncio.CancelledError as exc:
                if isinstance(step, asyncio.Future) and step.done() and not step.cancelled():
                    self.held = exc
                elif step is None and self._turns:
                    self.held = self.held or exc
                else:
                    error = exc
            except BaseException as exc:  # pragma: no cover - only cancellation is thrown in
                error = exc

    def raise_held(self) -> None:
        """Raise the cancellation held while the work ran to its end, if there was one."""
        if self.held is not None:
            raise self.held


TO_THE_END_GRACE = 10.0
"""How long the work of ``to_the_end`` may go on once cancelled."""

GIVE_UP = "aio_keuss: given up"
"""The message of a cancellation that ``to_the_end`` work obeys at once: a close past its
grace gives up the batches it waited for (asyncio hands a cancellation's message on to
the task a cancelled task awaits)."""


class _ToTheEnd(asyncio.Task[T]):
    """A task that a cancellation does not interrupt: it takes effect when the work has
    ended, or after ``TO_THE_END_GRACE`` seconds. Its awaiter (which asyncio cancels by
    cancelling the task it waits on) then gets the cancellation once the result is in, and
    ``RunToEnd`` holds it there, as for a reply that refuses cancellation."""

    _grace: asyncio.TimerHandle | None = None

    def cancel(self, msg: Any | None = None) -> bool:
        if msg == GIVE_UP:
            return super().cancel(msg)
        if not self.done() and self._grace is None:
            self._grace = self.get_loop().call_later(TO_THE_END_GRACE, self._give_up, msg)
            self.add_done_callback(_ToTheEnd._ended)  # the timer would keep it for 10 s
        return False

    def _ended(self) -> None:
        if self._grace is not None:
            self._grace.cancel()

    def _give_up(self, msg: Any | None) -> None:
        super().cancel(msg)


def to_the_end(work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """``work`` as a task that runs to its end whatever its awaiter does: for a statement
    that takes messages out of a database (a pop's ``DELETE``, a reserve's ``UPDATE``),
    whose effect stands once it is sent, so that an interrupted wait would lose what it
    took. ``asyncio.run`` cancels every task left as the loop ends and runs the loop until
    they have ended (Python's asyncio documentation, "Runners"): this one ends with its
    result, and the batch that awaited it hands that back."""
    return _ToTheEnd(work, loop=asyncio.get_running_loop())


FINISH_WAIT = 10.0
"""Longest a store's close waits for the work of its :class:`Finishing`."""


class _Finish(_ToTheEnd[T]):
    """``to_the_end`` work that a close's give-up does not cut at once either: like any
    other cancellation, it takes effect when the work has ended, or after
    ``TO_THE_END_GRACE`` seconds."""

    def cancel(self, msg: Any | None = None) -> bool:
        return super().cancel(None if msg == GIVE_UP else msg)


class Finishing:
    """Work a store sees to its end once begun, whoever awaited it: the later steps of a
    move done in steps (a copy there, then a delete here), where no transaction makes it
    one. A close past its grace gives up the queue's round trips (it cancels the batches
    awaiting them) and closes the store: cut between those steps, a message was left in
    both queues. Each runs in a task that no cancellation cuts short before
    ``TO_THE_END_GRACE`` (its awaiter's then lands once it has ended, as ``RunToEnd``
    holds it), and the store's close waits for it, ``FINISH_WAIT`` seconds at most."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def run(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = _Finish(work, loop=asyncio.get_running_loop())
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # seen: its awaiter may be gone (the loop ended)

    async def wait(self, queue: str, given_up: str) -> None:
        """Wait for the work begun, ``FINISH_WAIT`` seconds at most; what is left is logged
        as ``<count> <given_up>`` (what it is, and what becomes of its messages)."""
        if not self._tasks:
            return
        _, late = await asyncio.wait(set(self._tasks), timeout=FINISH_WAIT)
        if late:
            log.warning("queue %r: %d %s", queue, len(late), given_up)


RECANCEL_PERIOD = 0.5
"""How long a cancelled task is given to end before it is cancelled again."""


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` until it has ended, and wait for that.

    Its outcome is not raised (a failure is marked as seen, so asyncio does not log it at
    exit); the caller's own cancellation still propagates.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=RECANCEL_PERIOD)
    if not task.cancelled():
        task.exception()


class SideBySide(Generic[T]):
    """Awaits several coroutines in the current task, side by side: each is started (run
    to its first suspension) before any is awaited, so where each first awaits the reply to
    a request it has just sent, every request is on the wire before the first reply is
    awaited, as with ``asyncio.gather``, but with no task per coroutine. Then each is driven
    to its end in turn, its steps yielded to the task as they are: under :class:`RunToEnd` a
    cancellation that arrives during a reply that refuses it is held like any other, and
    the work of every coroutine completes.

    An exception thrown into a step goes to the coroutine that awaited it. A failure of one
    coroutine is raised once the others have ended (their results are then lost, as with
    gather); a cancellation or any other BaseException closes the others at once."""

    __slots__ = ("_coros",)

    def __init__(self, coros: list[Coroutine[Any, Any, T]]) -> None:
        self._coros = coros

    def __await__(self) -> Generator[Any, None, list[T]]:
        coros = self._coros
        results: list[Any] = [None] * len(coros)
        failure: Exception | None = None
        started: list[tuple[int, Any]] = []
        for i, coro in enumerate(coros):
            try:
                started.append((i, coro.send(None)))
            except StopIteration as stop:
                results[i] = stop.value
            except Exception as exc:
                failure = failure or exc
            except BaseException:
                _close(coros, i + 1)
                for j, _ in started:
                    coros[j].close()
                raise
        for k, (i, step) in enumerate(started):
            coro = coros[i]
            while True:
                error: BaseException | None = None
                try:
                    yield step
                except BaseException as exc:  # thrown in: the awaiting coroutine's to handle
                    error = exc
                try:
                    step = coro.send(None) if error is None else coro.throw(error)
                except StopIteration as stop:
                    results[i] = stop.value
                    break
                except Exception as exc:
                    failure = failure or exc
                    break
                except BaseException:
                    for j, _ in started[k + 1 :]:
                        coros[j].close()
                    raise
        if failure is not None:
            raise failure
        done: list[T] = results
        return done


def _close(coros: list[Coroutine[Any, Any, Any]], start: int) -> None:
    """Close coroutines never started, so none warns that it was never awaited."""
    for coro in coros[start:]:
        coro.close()
