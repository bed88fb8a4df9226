"""Cancelling a message, waiting or running (saq's and arq's ``job.abort()``, procrastinate's
``cancel_job(abort=True)``): the request's encoding, and the holder's side.

``Queue.cancel`` removes a waiting message where it can; a message under a reservation is
asked to stop instead: a request is left in the backend's result store, under the queue's
cancel space (:func:`aio_keuss.results.cancel_space`), for a while that outlives any
reservation of it, and a "cancel" signal names it to every process. A consumer holding it
(running its handler, prefetched, or in a batch) cancels the handler's task, then ok-s
the message: it is done for good, not retried.

Signals are hints. A consumer of a queue with ``result_ttl`` also looks the requests of
every id it holds up, in one round trip, every quarter of ``reserve_delay`` while its
handlers run (so a lost signal costs at most that); after the signal transport was away
it looks once, whatever the queue. Ids it heard named but did not hold are remembered for
as long as a request lives, so one it takes later (a fetch under way as the signal came)
is not run (once the request is read back: it may have been used up meanwhile). A request
that reached its message is used up (overwritten with :data:`USED`) once the message is
done: stopped, or ok-ed after a handler that went on when asked to stop or had returned as
the request came (its ok on its way), or deadlettered by the ko of a handler that had
failed as the request came (that ko held for the retry backoff too, where the backend has
no delays), or popped (no reserve) and done with, its handler returned, failed or cut
short by a stop, so that an explicit id pushed again past its ``dedup_window`` is a new
message nothing stops; ``Queue.cancel`` uses up its own request when the message finished
before the request landed. Marks are kept per delivery, not per id: one consumer may hold
an id twice (a lapsed reservation delivered again while the first delivery's ok was on its
way), and the older delivery's refused ok must not drop the newer's mark.

The cancel's second look may find the message held with its ok (or a ko that deadletters
it) on its way, and that ok land before the signal reaches its consumer: the consumer then
hears of a request for an id it no longer holds. It remembers the ids it took last (as
many as it remembers heard ids), and for one of those it holds no more in any way, uses
the request up then (where the store tells whether a message is in the queue: with
peek, or the sharded backends' look).

A use-up never overwrites a request meant for a later message of the same id (pushed
again past its ``dedup_window``, and cancelled): each request's body carries a nonce, so
none is like another, and a use-up reads the request, then writes :data:`USED` over it
only while it is still that body (``ResultStore.replace``, a compare-and-set). A request
is written only once its cancel found its message in the queue, so one read while no
message of its id is in the queue reached a message that is done; a use-up after an ok
the consumer did not see the request before looks the id up between the read and the
write, and leaves the request where a message of the id is in the queue again (it may be
that message's). A request is then left standing only where the id was pushed again in
that moment (it lapses, see :func:`request_ttl`), or where no look tells.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any

import orjson

from .errors import InvalidInputError
from .message import Message, check_text
from .signal import Signal

log = logging.getLogger("aio_keuss.consumer")

MAX_REASON_CHARS = 1000
"""Longest reason a cancel takes (it is kept in the failure result)."""
POLL_SHARE = 1 / 4
"""Share of ``reserve_delay`` between two looks at the requests of the ids held."""
REQUEST_MARGIN = 60.0
"""Seconds a request outlives twice the ``reserve_delay`` (see :func:`request_ttl`)."""
MAX_HEARD = 4096
"""Ids heard named and not held a consumer remembers at most (the oldest are forgotten)."""


def check_reason(reason: object) -> str | None:
    """A cancel's reason: None, or a str of valid UTF-8 of at most :data:`MAX_REASON_CHARS`
    characters."""
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise InvalidInputError(f"reason must be a str or None, not {type(reason).__name__}")
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidInputError(
            f"reason must be at most {MAX_REASON_CHARS} characters, not {len(reason)}"
        )
    return check_text(reason, "reason")  # the request and the failure kept are JSON


def cancelled_text(reason: str | None) -> str:
    """The error of a cancelled message's failure result."""
    return f"cancelled: {reason}" if reason else "cancelled"


def encode_request(reason: str | None) -> bytes:
    """A request's body: its reason and a nonce, as a JSON object, never empty. The nonce
    makes every request's body its own, so that whoever uses a request up can write over
    that one request only, never over a later one left for the same id with the same
    reason (see ``ResultStore.replace``)."""
    return orjson.dumps({"reason": reason, "nonce": secrets.token_hex(8)})


USED = b"false"
"""What a request is overwritten with once its message is done: used up, so that an
explicit id pushed again later (past its ``dedup_window``) is a new message no look at the
requests stops. (A request's body is a reason or ``null``, never ``false``.)"""


def decode_request(body: bytes) -> str | None:
    """A request's reason; one this library did not write has none. A bare JSON string is
    the reason too (the form of requests written before they carried a nonce)."""
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    reason = request.get("reason") if isinstance(request, dict) else request
    return reason if isinstance(reason, str) else None


def request_ttl(reserve_delay: float) -> float:
    """How long a request is kept: past the end of any reservation its message has now
    (within ``reserve_delay``, by ok, ko or lapse), and of the one a redelivery after a
    lapse takes, so that whoever holds it then still finds it."""
    return reserve_delay * 2 + REQUEST_MARGIN


Look = Callable[[list[str]], Awaitable[list[str]]]
"""The ids, of those given, that a cancel request names (one round trip)."""


class CancelWatch:
    """The cancel requests one consumer hears of, and those of the ids it holds that it
    looks up (see the module's docstring). ``stop`` is told the ids to stop; it acts on
    those it holds."""

    def __init__(
        self,
        queue: str,
        subscribe: Callable[[Callable[[Signal], None]], Callable[[], None]],
        look: Look,
        held: Callable[[], Collection[str]],
        stop: Callable[[Sequence[str]], None],
        every: float | None,
        remember: float,
    ) -> None:
        self._queue = queue
        self._look_up = look
        self._held = held
        self._stop = stop
        self._every = every
        self._remember = remember
        self._heard: OrderedDict[str, float] = OrderedDict()  # id -> forgotten at
        self._stopping: dict[asyncio.Task[Any], list[str]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._looks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._unsubscribe = subscribe(self._on_signal)

    # heard ------------------------------------------------------------------------------

    def _on_signal(self, signal: Signal) -> None:
        if self._closed:
            return
        if signal.kind == "cancel" and signal.ids is not None:
            self._note(signal.ids)
            self._stop(signal.ids)
        elif signal.kind in ("cancel", "resync"):  # some went unheard: look
            self._look_now()

    def _note(self, ids: Sequence[str]) -> None:
        heard = self._heard
        until = time.monotonic() + self._remember
        for message_id in ids:
            heard[message_id] = until
            heard.move_to_end(message_id)
        while len(heard) > MAX_HEARD:
            heard.popitem(last=False)

    @property
    def heard_any(self) -> bool:
        """Whether any id is remembered (most of the time none: :meth:`asked` is skipped).
        Those expired are dropped here, from the oldest (all are remembered for as long,
        so the order heard in is the order they expire in): once every request heard of
        has expired, messages taken are no longer looked up, whatever the size cap."""
        heard = self._heard
        if not heard:
            return False
        now = time.monotonic()
        while heard and next(iter(heard.values())) <= now:
            heard.popitem(last=False)
        return bool(heard)

    def asked(self, message_id: str) -> bool:
        """Whether ``message_id`` was named by a request heard of, not yet expired."""
        until = self._heard.get(message_id)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self._heard[message_id]
        return False

    def names_any(self, message: Message | list[Message]) -> bool:
        """Whether a request heard of names ``message`` (or one of a batch)."""
        if isinstance(message, list):
            return any(self.asked(m.id) for m in message)
        return self.asked(message.id)

    def mark(self, message_id: str) -> float | None:
        """When the request heard of for ``message_id`` is forgotten (None: none heard, or
        forgotten since): a later mark means it was heard of again."""
        return self._heard.get(message_id)

    def marks(self, ids: Sequence[str]) -> list[float | None]:
        """:meth:`mark` of each of ``ids``."""
        return [self._heard.get(i) for i in ids]

    def forget(self, ids: Iterable[str]) -> None:
        """Ids whose request is used up (their message stopped) or gone."""
        for message_id in ids:
            self._heard.pop(message_id, None)

    # the handlers' tasks ----------------------------------------------------------------

    def cancel(self, task: asyncio.Task[Any], ids: Sequence[str]) -> None:
        """Cancel the task of a running handler of ``ids`` (once)."""
        named = self._stopping.get(task)
        if named is None:
            self._stopping[task] = list(ids)
            task.cancel()
        else:
            named.extend(i for i in ids if i not in named)

    def taken(self, task: asyncio.Task[Any]) -> list[str] | None:
        """The ids whose request cancelled ``task`` (None: it was not cancelled here); the
        cancellation is withdrawn from the task's count, so that the handler's end is
        judged as if it had not been asked (a stop asked too still counts)."""
        named = self._stopping.pop(task, None)
        if named is not None:
            task.uncancel()
        return named

    # looking up -------------------------------------------------------------------------

    def wake(self) -> None:
        """A handler started: look at the requests every while, as long as handlers run."""
        if self._every is not None and self._poller is None and not self._closed:
            self._poller = asyncio.get_running_loop().create_task(self._poll(self._every))

    async def _poll(self, every: float) -> None:
        try:
            while not self._closed:
                await asyncio.sleep(every)
                if not self._held():
                    return
                await self._look()
        finally:
            self._poller = None

    def _look_now(self) -> None:
        task = asyncio.get_running_loop().create_task(self._look())
        self._looks.add(task)
        task.add_done_callback(self._looks.discard)

    async def _look(self) -> None:
        ids = list(self._held())
        if not ids:
            return
        try:
            found = await self._look_up(ids)
        except Exception as exc:  # an outage: looked again next time
            log.debug("queue %r: cancel requests not looked up: %r", self._queue, exc)
            return
        if found and not self._closed:
            self._note(found)
            self._stop(found)

    async def close(self) -> None:
        """Hear no more."""
        self._closed = True
        self._unsubscribe()
        tasks = [t for t in (self._poller, *self._looks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._heard.clear()
