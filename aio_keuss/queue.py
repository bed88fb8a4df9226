"""The generic queue layer, written once for every backend.

Read top to bottom: validation of what comes in, the coalesced primitives, the consumer wait
loop, then acknowledgement, administration and shutdown. A :class:`Store` only answers
batch-shaped atomic primitives; everything about waiting, signalling, counting, pausing and
deadlettering happens here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import sys
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from datetime import datetime
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeVar, cast

from . import observe, visibility
from .cancels import (
    USED,
    cancelled_text,
    check_reason,
    decode_request,
    encode_request,
    request_ttl,
)
from .coalesce import Coalescer, RunToEnd, replied, settled, to_the_end
from .consumer import (
    BatchHandler,
    Consumer,
    Handler,
    HandlerFailures,
    Outage,
    Settle,
    check_settings,
    in_handler,
    refused,
    retry_backoff,
)
from .contract import (
    MAX_RENAMES,
    MOVE_TAG,
    PUT_BACK_TAG,
    Ack,
    Amend,
    BulkLoad,
    DeadletterPlan,
    Entry,
    Extend,
    Fetched,
    Move,
    Nack,
    OneTake,
    RateGrant,
    Store,
    Stored,
    moved_id,
)
from .errors import (
    ClosedError,
    ConfigError,
    InvalidDelayError,
    InvalidIdError,
    InvalidInputError,
    InvalidPayloadError,
    JobFailedError,
    KeussConnectionError,
    KeussError,
    NotSupportedError,
    ResultMissingError,
    ResultTimeoutError,
)
from .ids import new_id
from .message import (
    EMPTY_HEADERS,
    MAX_KNOWN_ID_LENGTH,
    MAX_TRIES,
    UNCHANGED,
    UNDECODABLE,
    Headers,
    Message,
    NewMessage,
    Payload,
    Unchanged,
    check_id,
    check_ids,
    check_known_id,
    check_priority,
    check_text,
    check_tries,
    decode_message,
    decode_payload,
    encode_headers,
    encode_payload,
    encode_payloads,
    salvage_message,
    to_datetime,
)
from .options import (
    MAX_SECONDS,
    DeadletterOptions,
    QueueOptions,
    check_queue_name,
    check_seconds,
    check_timeout,
)
from .outcomes import (
    NO_RESULT,
    ResultWaits,
    ResultWrites,
    StoreGetter,
    Unstorable,
    decode_result,
    encode_failure,
    encode_success,
)
from .repeat import Repeater, RepeatPlan
from .results import cancel_space, leave_space
from .types import CancelResult, Capabilities, JobResult, KoResult, MessageView, Page, Sizes
from .visibility import SiblingQueue
from .wakeups import Wakeups

if TYPE_CHECKING:
    from .signal import Signal, SignalBus
    from .stats import StatsStore

log = logging.getLogger("aio_keuss.queue")

MIN_WAIT = 0.005
"""Shortest sleep of the wait loop: it never spins, even when a store reports a mature time
in the past (clock skew between client and server) without handing anything out."""

CLOCK_SLACK = 1.0
"""Seconds ahead of now a message's mature time still counts as "ready now"."""


CANCELLED_CLOSE_GRACE = 10.0
"""Seconds a cancelled close still spends finishing: waiting for the round trips in flight,
giving back the reservations nobody acknowledged (see ``Queue._close``)."""

GATHER_SHARE = 0.5
"""Share of ``reserve_delay`` a gathering of reservations may last at most (see
``Queue._fill``), once its first message is in."""

HELD_CHECK = 1024
"""Reservations held unacknowledged between two checks for expired ones (see ``_rotate_held``)."""

LEAVE_GRACE = 5.0
"""Seconds a duplicate ``push_and_wait`` still waits for the result of an earlier message it
found gone with none kept, before ``ResultMissingError``: a remove, a cancel that removes, or
a ko that deadletters keeps the failure just after the message left (see ``Queue._joined``),
one round trip of theirs later, normally; longer where they noted it on its way (see
``LEAVE_NOTE_TTL``)."""

LEAVE_NOTE_TTL = 60.0
"""Seconds the note a remove leaves before removing (see ``Queue._note_leaving``) is kept:
while it is, a duplicate ``push_and_wait`` that found the message gone with no failure kept
goes on waiting for that failure past ``LEAVE_GRACE``; a remover that died (or stalls
longer) holds its joiners that long at most."""

LEAVING = b"leaving"
"""The body of a leave note (see ``leave_space``)."""

FetchResult = tuple[list[Stored], float | None]
Limiter = Callable[[int, float, float], Awaitable[RateGrant]]
"""A rate-limited queue's ``Backend.rate_take`` with its name and rule: (count, hold, end)."""
Held = tuple[int, str | None]
"""A reservation handed out here: the tries and the store's token it was given."""


Items = TypeVar("Items", bound=Sequence[Any])
Done = TypeVar("Done")


class Queue:
    """One named queue of a factory; get it with ``await factory.queue(name)``."""

    def __init__(
        self,
        name: str,
        options: QueueOptions,
        store: Store,
        capabilities: Capabilities,
        signal: SignalBus,
        stats: StatsStore,
        deadletter: DeadletterOptions | None,
        sibling: SiblingQueue | None = None,
        limiter: Limiter | None = None,
        results: StoreGetter | None = None,
    ) -> None:
        self.name = name
        self.options = options
        self.capabilities = capabilities
        self._store = store
        self._signal = signal
        self._stats = stats
        self._deadletter = (
            DeadletterPlan(deadletter.max_ko, deadletter.queue, name)
            if deadletter is not None and deadletter.queue != name
            else None
        )
        self._sibling = sibling
        self._limiter = limiter  # None without a rate_limit: the takes never look at it
        # When the limiter grants next, on our clock, as its latest answer says (see
        # ``_ask_limiter``): till then a push cannot get a consumer anything (``_wait_for``).
        self._rate_due = 0.0
        self._rate_asked = 0  # limiter calls sent, and the last one whose answer is kept
        self._rate_heard = 0
        # a push woke a consumer the limiter had refused, which slept on (see
        # ``_sleep_rate_spent``): a grant given back wakes the sleepers then
        self._rate_missed = False
        self._rate_backs = 0  # give-backs announced to us (``_on_grant_back``)
        self._targets: set[str] = set()  # queues moved into, opened through the factory
        self._paused = False
        self._wakeups = Wakeups()
        self._due_handle: asyncio.TimerHandle | None = None  # see ``_hand_on``
        self._due_at = math.inf
        self._drains = 0
        self._closed = False
        self._closing = Closing(f"queue {name!r}")  # see ``close``
        self._background: set[asyncio.Task[Any]] = set()
        self._handovers: set[Callable[[], Awaitable[None]]] = set()
        """Calls of a blocking caller (``aio_keuss.sync``) whose result may not be in its
        hands yet: the close awaits each, which gives back what its caller did not get."""
        self._handovers_sealed = False
        """Set by the close once it has run every handover: a blocking caller interrupted
        after it took its result in hand adds one back, then reads this (see ``close``)."""
        self._pause_signals = 0  # pauses and resumes heard: a resync read older than one loses
        self._consumers: set[Consumer] = set()
        self._repeaters: set[Repeater] = set()
        self._handler_failures = HandlerFailures(name)
        # Reservations handed out here and not yet ok-ed, ko-ed or released (id -> tries
        # and the store's token), given back by ``close``. Two generations: where
        # reservations expire, one older than ``reserve_delay`` is dropped, so those nobody
        # acknowledged cannot pile up.
        self._held: dict[str, Held] = {}
        self._held_before: dict[str, Held] = {}
        self._held_check = HELD_CHECK if capabilities.reservation_expiry else sys.maxsize
        self._rotate_at = -math.inf
        batch, depth = options.max_batch, store.batch_concurrency
        in_caller, uninterruptible = store.run_in_caller, store.uninterruptible
        max_insert_bytes = store.max_insert_bytes
        self._inserts: Coalescer[Sequence[Entry], list[bool]] = Coalescer(
            self._insert_batch,
            max_batch=batch,
            weight=len,
            size=None if max_insert_bytes is None else _entry_bytes,
            max_size=max_insert_bytes or 0,
            concurrency=depth,
            run_in_caller=in_caller,
        )
        self._gets: Coalescer[int, FetchResult] = Coalescer(
            self._get_batch,
            max_batch=batch,
            weight=int,
            concurrency=depth,
            on_orphan=self._put_back_popped,
            run_in_caller=in_caller,
            uninterruptible=uninterruptible,
        )
        self._reserves: Coalescer[int, FetchResult] = Coalescer(
            self._reserve_batch,
            max_batch=batch,
            weight=int,
            concurrency=depth,
            on_orphan=self._put_back_reserved,
            run_in_caller=in_caller,
            uninterruptible=uninterruptible,
        )
        self._commits: Coalescer[list[Ack], list[bool]] = Coalescer(
            self._commit_batch,
            max_batch=batch,
            weight=len,
            concurrency=depth,
            run_in_caller=in_caller,
        )
        self._rollbacks: Coalescer[Nack, KoResult] = Coalescer(
            self._rollback_batch,
            max_batch=batch,
            concurrency=depth,
            run_in_caller=in_caller,
        )
        self._extends: Coalescer[list[Extend], list[bool]] = Coalescer(
            self._extend_batch,
            max_batch=batch,
            weight=len,
            concurrency=depth,
            run_in_caller=in_caller,
        )
        self._moves: Coalescer[Move, str | None] = Coalescer(
            self._move_batch,
            max_batch=batch,
            size=None if max_insert_bytes is None else _move_bytes,
            max_size=max_insert_bytes or 0,
            concurrency=depth,
            run_in_caller=in_caller,
        )
        # The store's one-message calls, where it has them (see ``Store.one_take``); not
        # the takes of a rate-limited queue: each asks the limiter first, in ``_limited``
        one_calls = uninterruptible and in_caller
        one_takes = one_calls and limiter is None
        self._one_get = store.one_take(None) if one_takes and capabilities.pop else None
        self._one_reserve: OneTake | None = None
        if one_takes and capabilities.reserve:
            self._one_reserve = self._holding(store.one_take(options.reserve_delay))
        self._one_commit = store.one_commit() if one_calls else None
        self._one_insert = store.one_insert() if one_calls else None
        self._result_store = results  # the factory's, made on first use; None: none kept
        self._result_waits: ResultWaits | None = None  # made by the first wait
        self._result_writes: ResultWrites | None = None  # only with a result_ttl
        if options.result_ttl and results is not None:
            self._result_writes = ResultWrites(
                name,
                results,
                options.result_ttl,
                signal,
                max_batch=batch,
                concurrency=depth,
                run_in_caller=in_caller,
            )
        # Where a duplicate push_and_wait can be (idempotent ids) and can find its message
        # gone (see ``_joined``): only there is a leave note read, one write more on a
        # remove, a cancel or a last ko (see ``_note_leaving``)
        self._notes_leaving = (
            self._result_writes is not None
            and capabilities.idempotent
            and capabilities.reserve
            and (capabilities.peek or store.tells_queued)
        )
        self._unsubscribe = signal.subscribe(name, self._on_signal)
        # Grant signals come on a route of their own, which older releases never hear
        # (see ``signal.GRANTS_ROUTE``); only a rate-limited queue has a use for them.
        self._unsubscribe_grants: Callable[[], None] | None = None
        if limiter is not None:
            self._unsubscribe_grants = signal.subscribe_grants(name, self._on_grant_signal)
        store.on_visible(lambda mature: signal.insert(name, mature))
        store.on_orphaned_insert(self._inserted_for_nobody)
        store.on_finished_deadletter(self._deadlettered)
        store.on_deadletter(self._deadletter)

    async def _open(self) -> None:
        self._paused = await self._stats.is_paused(self.name)

    def __repr__(self) -> str:
        return f"<Queue {self.name!r}>"

    # producing ------------------------------------------------------------------------

    async def push(
        self,
        payload: Payload,
        *,
        delay: float = 0.0,
        headers: Headers | None = None,
        id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue one message; returns its id (the given one, even when deduplicated). Of
        the messages ready, those of a higher ``priority`` come out first (where the backend
        has ``capabilities.priority``; 0, the default, everywhere)."""
        entry = self._entry(payload, self._delay(delay), encode_headers(headers), id, priority)
        inserts, one = self._inserts, self._one_insert
        if one is None or (reply := inserts.send_one(one[0], entry)) is None:
            await inserts.submit([entry])
            return entry.id
        # The store's one-message insert, awaited here as ``ok`` awaits its commit: once the
        # reply is in, the message is counted and signalled, this caller cancelled or not.
        try:
            await reply
        except asyncio.CancelledError:
            reply = await settled(reply)
            raise
        finally:
            self._one_inserted(reply, entry)
        return entry.id

    async def _push_queued(self, entry: Entry) -> bool:
        """:meth:`push` of a made entry, saying whether it was queued (False: its id was
        refused as a duplicate), for ``push_and_wait``. ``push`` does the same inline, one
        coroutine fewer on its hot path."""
        inserts, one = self._inserts, self._one_insert
        if one is None or (reply := inserts.send_one(one[0], entry)) is None:
            (queued,) = await inserts.submit([entry])
            return queued
        queued = False
        try:
            await reply
        except asyncio.CancelledError:
            reply = await settled(reply)
            raise
        finally:
            queued = self._one_inserted(reply, entry)
        return queued

    def _one_inserted(self, reply: asyncio.Future[Any], entry: Entry) -> bool:
        """The end of a one-message insert sent on its own (see :meth:`push`): whether the
        store took it, counted and signalled if so (its mature time)."""
        one = self._one_insert
        self._inserts.ran_one()
        if one is not None and replied(reply) and one[1](reply.result()):
            self._stats.incr(self.name, "put", 1)
            self._signal.insert(self.name, time.time() + entry.delay, 1)
            return True
        return False

    async def push_many(
        self,
        payloads: Sequence[Payload],
        *,
        delay: float = 0.0,
        headers: Headers | None = None,
        ids: Sequence[str] | None = None,
        priority: int = 0,
    ) -> list[str]:
        """Queue many messages in order with as few round trips as ``max_batch`` allows,
        all with the one ``priority`` (see :meth:`push`)."""
        self._check_open()
        if not _listed(payloads):
            raise InvalidInputError("push_many takes a sequence (list, tuple) of payloads")
        priority = self._priority(priority)
        checked = self._bulk_ids(ids, len(payloads))
        seconds = self._delay(delay)
        encoded_headers = encode_headers(headers)
        # A bulk load (a Spark write) spends its client time here: the payloads and ids are
        # checked a batch at a time, and the entries made with no Python frame per message
        # (a bulk load's only if the store asks for them: see BulkLoad).
        blobs = encode_payloads(payloads)
        return await self._push_blobs(blobs, checked, encoded_headers, seconds, priority)

    async def _push_encoded(
        self, blobs: list[bytes], *, ids: Sequence[str] | None = None, priority: int = 0
    ) -> list[str]:
        """``push_many`` of payloads already encoded, no headers, no delay: ``blobs`` are
        what ``encode_payload`` makes of payloads its checks pass, made by a caller that
        knows them to (the Spark writer's rows of JSON-native columns, encoded by Arrow a
        batch at a time). Everything else is checked as ``push_many`` checks it."""
        self._check_open()
        priority = self._priority(priority)
        checked = self._bulk_ids(ids, len(blobs))
        return await self._push_blobs(blobs, checked, EMPTY_HEADERS, 0.0, priority)

    def _bulk_ids(self, ids: Sequence[str] | None, count: int) -> list[str] | None:
        if ids is None:
            return None
        if not _listed(ids) or len(ids) != count:
            # a set or a generator would pair ids with payloads in no defined order
            raise InvalidInputError("ids must be a sequence (list, tuple) as long as payloads")
        return check_ids(ids)

    async def _push_blobs(
        self,
        blobs: list[bytes],
        checked: list[str] | None,
        encoded_headers: bytes,
        seconds: float,
        priority: int,
    ) -> list[str]:
        """The rest of ``push_many`` once its arguments are checked and its payloads
        encoded."""
        entries: Sequence[Entry]
        if checked is None:
            new_ids = [new_id() for _ in blobs]
            entries = list(map(Entry, new_ids, blobs, repeat(encoded_headers), repeat(seconds)))
            if priority:
                for entry in entries:
                    entry.priority = priority
        else:
            if checked:
                self._require("idempotent")
            entries = BulkLoad(checked, blobs, encoded_headers, seconds, priority)
        if self._store.max_message_bytes is not None:
            for blob in blobs:
                self._check_size(blob, encoded_headers)
        # Where batches run in tasks (PostgreSQL, MongoDB), chunks submitted together may run
        # side by side (another caller's request starts a second batch task) and be stamped
        # in any order: a later chunk could then come out first. One after the other there.
        await self._in_chunks(self._inserts, entries, ordered=not self._store.run_in_caller)
        if checked is not None:
            return list(checked)  # a store replaces only ids the queue made
        return [entry.id for entry in entries]

    async def _in_chunks(
        self,
        coalescer: Coalescer[Items, list[bool]],
        items: Items,
        *,
        ordered: bool = False,
    ) -> list[bool]:
        """Submit a caller's list in pieces of ``max_batch``; the flags of all, in order.
        With ``ordered``, each piece is submitted once the one before it is done. A piece is
        a slice of ``items``: a list's a list, a bulk load's a bulk load."""
        size = self.options.max_batch
        if len(items) <= size:
            return await coalescer.submit(items) if items else []
        chunks = [cast(Items, items[i : i + size]) for i in range(0, len(items), size)]
        if ordered:
            return [flag for chunk in chunks for flag in await coalescer.submit(chunk)]
        done = await asyncio.gather(*(coalescer.submit(chunk) for chunk in chunks))
        return [flag for flags in done for flag in flags]

    def _check_size(self, blob: bytes, headers: bytes) -> None:
        """Refuse a message larger than a store with a bound of its own can hold, before
        anything is written."""
        most = self._store.max_message_bytes or 0
        if len(blob) + len(headers) > most:
            raise InvalidPayloadError(
                f"message of {len(blob) + len(headers)} bytes (payload and headers encoded):"
                f" the {self.name!r} store holds at most {most}"
            )

    def _delay(self, delay: float) -> float:
        seconds = check_seconds(delay, "delay")
        if seconds > 0:
            self._require("delay")
        return seconds

    def _priority(self, priority: int) -> int:
        """A push's priority, checked; any but 0 only where the backend has them."""
        if priority == 0 and type(priority) is int:  # the usual case, at one comparison
            return 0
        checked = check_priority(priority)  # bad input first, whatever the backend can do
        if checked:
            self._require("priority")
        return checked

    def _entry(
        self,
        payload: Payload,
        delay: float,
        headers: bytes,
        message_id: str | None,
        priority: int = 0,
    ) -> Entry:
        self._check_open()
        blob = encode_payload(payload)
        if self._store.max_message_bytes is not None:
            self._check_size(blob, headers)
        if priority or type(priority) is not int:
            priority = self._priority(priority)
        if message_id is None:
            return Entry(new_id(), blob, headers, delay, priority=priority)
        checked = check_id(message_id)  # bad input first, whatever the backend can do
        self._require("idempotent")
        return Entry(checked, blob, headers, delay, dedup=True, priority=priority)

    async def _insert_batch(self, requests: list[Sequence[Entry]]) -> list[list[bool]]:
        entries: Sequence[Entry]
        if len(requests) == 1:
            entries = requests[0]
        else:
            entries = [entry for request in requests for entry in request]
        # Run to the end: a caller cancelled once the store answered (the messages are in)
        # must still count and signal them, or consumers of other processes, which only the
        # signal tells, wait for their poll interval. The cancellation is raised after. The
        # same holds for the other store calls that change what is queued.
        work = RunToEnd(self._store.insert(entries))
        flags = await work
        if all(flags):  # the usual case: nothing was a duplicate
            inserted = entries
        else:
            inserted = [entry for entry, flag in zip(entries, flags, strict=True) if flag]
        if inserted:
            self._stats.incr(self.name, "put", len(inserted))
            self._signal.insert(self.name, _earliest(inserted), len(inserted))
        work.raise_held()
        return _split(requests, flags)

    def _inserted_for_nobody(self, count: int, mature: float) -> None:
        """Messages a store wrote after their pusher was cancelled: counted and signalled
        as those of an insert that returned (see ``_insert_batch``)."""
        self._stats.incr(self.name, "put", count)
        self._signal.insert(self.name, mature, count)

    async def push_each(self, messages: Sequence[NewMessage]) -> list[str]:
        """Queue many messages, each with its own delay, headers, id and priority (a
        ``NewMessage`` each): every one is checked as ``push`` checks it before any is
        written, then they go in order with as few round trips as ``max_batch`` allows, as
        ``push_many``."""
        self._check_open()
        if not _listed(messages):
            raise InvalidInputError("push_each takes a sequence (list, tuple) of NewMessage")
        entries: list[Entry] = []
        for message in messages:
            if not isinstance(message, NewMessage):
                raise InvalidInputError(
                    f"push_each takes NewMessage items, not {type(message).__name__}"
                )
            delay = self._delay(message.delay)
            headers = encode_headers(message.headers)
            entries.append(
                self._entry(message.payload, delay, headers, message.id, message.priority)
            )
        await self._in_chunks(self._inserts, entries, ordered=not self._store.run_in_caller)
        return [entry.id for entry in entries]

    # consuming ------------------------------------------------------------------------

    async def pop(self, timeout: float | None = None) -> Message | None:
        """Take one message, at-most-once; None when ``timeout`` passes (or on drain/close)."""
        return await self._consume_one(self._gets, timeout, "pop", "get", self._one_get)

    async def _pop_kept(self, kept: dict[str, Stored], timeout: float | None) -> Message | None:
        """``pop`` for a caller that may put the message back unseen (the sync shim): what
        the store handed out is noted in ``kept`` by id, for ``_put_back_unhandled``."""
        return await self._consume_one(self._gets, timeout, "pop", "get", self._one_get, kept)

    async def _pop_many_kept(
        self, kept: dict[str, Stored], n: int, timeout: float | None, max_wait: float | None
    ) -> list[Message]:
        """``pop_many``, noting what was handed out in ``kept`` (see ``_pop_kept``)."""
        return await self._consume(
            self._gets, n, timeout, "pop", "get", max_wait=max_wait, kept=kept
        )

    async def pop_many(
        self, n: int, timeout: float | None = None, *, max_wait: float | None = None
    ) -> list[Message]:
        """Take up to ``n`` (at most ``max_batch``) messages; waits while none is ready, then
        up to ``max_wait`` seconds more (default: the queue's ``max_wait_time``) for the
        batch to fill."""
        return await self._consume(self._gets, n, timeout, "pop", "get", max_wait=max_wait)

    async def reserve(self, timeout: float | None = None) -> Message | None:
        """Reserve one message, at-least-once: ``ok`` it, ``ko`` it, or it comes back after
        ``reserve_delay`` with one more try."""
        return await self._consume_one(
            self._reserves, timeout, "reserve", "reserve", self._one_reserve
        )

    async def reserve_many(
        self, n: int, timeout: float | None = None, *, max_wait: float | None = None
    ) -> list[Message]:
        """Reserve up to ``n`` (at most ``max_batch``); waits while none is ready, then up
        to ``max_wait`` seconds more (default: the queue's ``max_wait_time``) for the batch
        to fill."""
        return await self._consume(
            self._reserves, n, timeout, "reserve", "reserve", max_wait=max_wait
        )

    async def _consume_one(
        self,
        source: Coalescer[int, FetchResult],
        timeout: float | None,
        doing: str,
        counter: str,
        one: OneTake | None,
        kept: dict[str, Stored] | None = None,
    ) -> Message | None:
        """``pop`` and ``reserve``: ``_consume`` for one message, with its first try made
        here and the wait loop entered only when nothing was ready. A busy queue's message
        then costs two coroutine frames and the batch bookkeeping fewer (redis-oq, 3
        clients: 9 % of a pop's client instructions, counted with callgrind); with the
        store's own one-message call (``one``, see ``Store.one_take``), a quarter more."""
        # A store's one-message take exists only where the queue has the capability
        if self._closed or (one is None and not getattr(self.capabilities, doing)):
            self._check_open()
            self._require(doing)
        seconds = None if timeout is None else check_seconds(timeout, "timeout")
        if self._paused:
            stored = await self._wait_for(source, 1, seconds, None, doing)
        else:
            deadline = None if seconds is None else time.monotonic() + seconds
            wakeups = self._wakeups
            drains, announced = self._drains, wakeups.announced  # taken before trying
            stored, next_mature = await source.submit(1, one)
            if stored:
                # ``_after_take`` for one message, inline (the hot path of every pop and
                # reserve): more look ready unless the next falls due later; a wake-up only
                # where someone sleeps.
                if next_mature is None or next_mature <= time.time() + CLOCK_SLACK:
                    if wakeups.sleepers:
                        wakeups.wake(1)
                else:
                    self._hand_on(next_mature)
            else:
                tried = (drains, announced, next_mature, deadline)
                stored = await self._wait_for(source, 1, seconds, None, doing, tried=tried)
        # ``_handed_out``, inline
        if not stored or (self._closed and source is self._reserves):
            return None
        self._stats.incr(self.name, counter, 1)
        if observe.active is not None:
            observe.active.delivered(self.name, stored)
        s = stored[0]
        if kept is not None:
            kept[s.id] = s
        try:
            return decode_message(
                s.id, s.payload, s.headers, s.tries, s.mature, s.token, s.priority
            )
        except Exception:
            return self._salvage(s)

    async def _consume(
        self,
        source: Coalescer[int, FetchResult],
        n: int,
        timeout: float | None,
        capability: str,
        counter: str,
        outage: Outage | None = None,
        *,
        max_wait: float | None = None,
        kept: dict[str, Stored] | None = None,
    ) -> list[Message]:
        self._check_open()
        self._require(capability)
        # type() first: pop and reserve pass an int, and this runs on every call
        if (type(n) is not int and (isinstance(n, bool) or not isinstance(n, int))) or n < 1:
            raise InvalidInputError(f"n must be a positive int, not {n!r}")
        gather = (
            self.options.max_wait_time if max_wait is None else check_seconds(max_wait, "max_wait")
        )
        if n > 1:
            n = min(n, self.options.max_batch)
        stored = await self._wait_for(source, n, check_timeout(timeout), outage, capability)
        if stored and gather and len(stored) < n:
            stored = await self._fill(source, n, stored, gather, outage, capability)
        if not self._handed_out(source, stored, counter):
            return []
        if kept is not None:
            kept.update((s.id, s) for s in stored)
        try:
            return [
                decode_message(s.id, s.payload, s.headers, s.tries, s.mature, s.token, s.priority)
                for s in stored
            ]
        except Exception:
            return [self._salvage(s) for s in stored]

    def _salvage(self, s: Stored) -> Message:
        """A message of a batch whose decoding failed. The batch is already taken (a pop's
        deleted, a reservation's held): raising would lose the pop's messages and strand
        the reservations until they expire, and a consumer would retry the same failure
        as an outage. So each message is decoded alone, and one that still fails is
        delivered as stored, marked ``x-undecodable`` (see ``message.salvage_message``)."""
        try:
            return decode_message(
                s.id, s.payload, s.headers, s.tries, s.mature, s.token, s.priority
            )
        except Exception:
            message = salvage_message(
                s.id, s.payload, s.headers, s.tries, s.mature, s.token, s.priority
            )
        log.warning(
            "queue %r: message %r delivered undecoded: %s",
            self.name,
            s.id,
            message.headers.get(UNDECODABLE),
        )
        return message

    def _after_take(self, stored: list[Stored], n: int, next_mature: float | None) -> None:
        """A take of ``n`` got ``stored``: if more look ready, the baton goes to a sleeper;
        if one falls due later, a sleeper is woken then."""
        if _more_ready(stored, n, next_mature):
            self._wakeups.wake(1)
        elif next_mature is not None:
            self._hand_on(next_mature)

    def _handed_out(
        self, source: Coalescer[int, FetchResult], stored: list[Stored], counter: str
    ) -> bool:
        """Whether what a pop or reserve took goes to its caller (counted, then)."""
        if not stored or (self._closed and source is self._reserves):
            # Reserved by a round trip a close waited for: the close gives back every
            # reservation held once those end, these too. Handed out as well, they would be
            # handed to two consumers at once. (A pop's are the caller's: nothing gives them
            # back.)
            return False
        self._stats.incr(self.name, counter, len(stored))
        if observe.active is not None:
            observe.active.delivered(self.name, stored)
        return True

    async def _fill(
        self,
        source: Coalescer[int, FetchResult],
        n: int,
        stored: list[Stored],
        seconds: float,
        outage: Outage | None,
        doing: str,
    ) -> list[Stored]:
        """Go on taking until ``n`` are in or ``seconds`` have passed. What was taken is the
        caller's: a cancellation puts it back (a pop's as it was, a reservation released at
        no try), and a failure ends the gathering with what is already in.

        Reservations that expire are delivered again, so a gathering that outlived the
        first one's ``reserve_delay`` held a message another consumer could reserve too (or
        this gathering again), before any handler saw it. The gathering of reservations
        therefore ends once half of that delay is gone, whatever ``seconds`` asks, as a
        prefetched message is handed out only while half of its reservation is left: the
        handler gets the other half."""
        deadline = time.monotonic() + seconds
        if source is self._reserves and self.capabilities.reservation_expiry:
            deadline = min(deadline, time.monotonic() + self.options.reserve_delay * GATHER_SHARE)
        try:
            while len(stored) < n:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    more = await self._wait_for(source, n - len(stored), remaining, outage, doing)
                except Exception:
                    break
                if not more:
                    break
                stored = stored + more
        except (Exception, asyncio.CancelledError):
            await source.hand_back(len(stored), (stored, None))
            raise
        except BaseException:
            # GeneratorExit (the coroutine closed, not cancelled) or KeyboardInterrupt: no
            # await is possible here, so the put-back goes to a task of its own
            back = source.on_orphan_work(len(stored), (stored, None))
            if back is not None:
                self._in_background(back)
            raise
        return stored

    async def _wait_for(
        self,
        source: Coalescer[int, FetchResult],
        n: int,
        timeout: float | None,
        outage: Outage | None = None,
        doing: str = "reserve",
        tried: tuple[int, int, float | None, float | None] | None = None,
    ) -> list[Stored]:
        """The wait loop: try, then sleep until a signal, the next mature
        time, the poll interval or the timeout, whichever comes first.

        With an ``outage`` (``consume`` and ``messages``), a failed round trip is recorded
        there and retried after a capped, jittered backoff instead of raised. ``tried``: a
        first try the caller made, which found nothing (the drain count and the
        announcements seen before it, the next mature time it learned, the deadline)."""
        # time.monotonic(), not the loop's clock: asyncio.get_running_loop() costs a getpid()
        # system call on Python 3.11, on every call of the hot path.
        if tried is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            drains = self._drains
        else:
            drains, _, _, deadline = tried
        backoff = MIN_WAIT
        failures = 0
        wakeups = self._wakeups
        one = None  # the store's one-message call, for a wait for one message
        if n == 1:
            one = self._one_reserve if source is self._reserves else self._one_get
        # A future mature time this loop learned and sleeps toward. The announcement of that
        # message woke this consumer only: if it leaves before then (a timeout, a
        # cancellation), the wake-up is handed on for that time, else the sleepers left
        # would wait out the poll interval.
        due: float | None = None
        try:
            while not self._closed and self._drains == drains:
                announced = wakeups.announced  # taken before trying: a push meanwhile is seen
                next_mature = None
                wait = self.options.poll_interval
                failed = False
                if tried is not None:  # the caller's try, as if made here
                    _, announced, next_mature, _ = tried
                    tried = None
                elif not self._paused:
                    generation = 0 if outage is None else outage.generation
                    try:
                        stored, next_mature = await source.submit(n, one)
                    except Exception as exc:
                        if outage is None:
                            raise
                        outage.failed(exc, generation, doing)  # raises what isn't worth retrying
                        stored, wait, failed = [], retry_backoff(failures), True
                        failures += 1
                    else:
                        failures, due = 0, None
                        if outage is not None:
                            outage.succeeded()
                    if stored:
                        self._after_take(stored, n, next_mature)
                        return stored
                if next_mature is not None:
                    until = next_mature - time.time()
                    if until > 0:
                        wait, backoff = min(wait, max(until, MIN_WAIT)), MIN_WAIT
                        due = next_mature
                    else:
                        wait, backoff = min(wait, backoff), backoff * 2
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    wait = min(wait, remaining)
                # (a limit spent: nothing announced can be taken before its next grant)
                spent = self._rate_spent()
                if wakeups.announced != announced and not (failed or self._paused or spent):
                    continue  # something was announced while we fetched: look again
                if spent:
                    if wakeups.announced != announced:
                        # a push came while the limiter refused us: as one heard asleep,
                        # a grant given back must wake us (``_on_grant_back``)
                        self._rate_missed = True
                    woken = await self._sleep_rate_spent(n, wait, drains)
                else:
                    woken = await wakeups.sleep(n, wait)
                if not woken and self._paused:
                    self._paused = await self._poll_paused(outage)  # a lost resume
        except (Exception, asyncio.CancelledError):  # not GeneratorExit: no loop then
            if due is not None:
                self._hand_on(due)
            raise
        if due is not None:
            self._hand_on(due)
        return []

    def _rate_spent(self) -> bool:
        """Whether the limiter grants nothing before its next grant, ``_rate_due``."""
        return self._limiter is not None and self._rate_due > time.time()

    async def _sleep_rate_spent(self, n: int, wait: float, drains: int) -> bool:
        """``Wakeups.sleep`` for a consumer the limiter refused: a push's announcement
        (another message) cannot make a grant fall due sooner, so it sleeps on until the
        limiter's next grant; a resume, a drain or a close still wake it. Woken by pushes,
        each one cost a limiter round trip that answered no again, a backlog pushed faster
        than the limit as many."""
        end = time.monotonic() + wait
        while True:
            woken = await self._wakeups.sleep(n, wait)
            if not woken or self._closed or self._drains != drains or self._paused:
                return woken
            wait = min(end - time.monotonic(), self._rate_due - time.time())
            if wait <= 0:
                return woken
            self._rate_missed = True  # a grant given back meanwhile wakes it (_on_grant_back)

    def _hand_on(self, due: float) -> None:
        """A consumer that knew something falls due at ``due`` (epoch seconds) left before
        then: wake one sleeper at that time (one timer per queue, the earliest)."""
        if self._closed or (self._due_handle is not None and self._due_at <= due):
            return
        if self._due_handle is not None:
            self._due_handle.cancel()
        self._due_at = due
        loop = asyncio.get_running_loop()
        self._due_handle = loop.call_later(max(due - time.time(), 0.0), self._fall_due)

    def _fall_due(self) -> None:
        self._due_handle, self._due_at = None, math.inf
        if not self._closed and not self._paused:
            self._wakeups.announce(1)

    async def _poll_paused(self, outage: Outage | None) -> bool:
        if outage is None:
            return await self._stats.is_paused(self.name)
        generation = outage.generation
        try:
            paused = await self._stats.is_paused(self.name)
        except Exception as exc:
            outage.failed(exc, generation, "is_paused")  # raises what is not worth retrying
            return self._paused
        outage.succeeded()
        return paused

    async def _get_batch(self, requests: list[int]) -> list[FetchResult]:
        if self._limiter is not None:
            return _share(requests, await self._limited(sum(requests), self._store.get))
        return _share(requests, await self._store.get(sum(requests)))

    async def _reserve_batch(self, requests: list[int]) -> list[FetchResult]:
        if self._limiter is None:
            fetched = await self._store.reserve(sum(requests), self.options.reserve_delay)
        else:
            fetched = await self._limited(sum(requests), self._reserve_granted)
        if fetched.messages:
            self._hold(fetched.messages)
        return _share(requests, fetched)

    def _reserve_granted(self, n: int) -> Awaitable[Fetched]:
        return self._store.reserve(n, self.options.reserve_delay)

    async def _limited(self, n: int, take: Callable[[int], Awaitable[Fetched]]) -> Fetched:
        """A take of a rate-limited queue: at most what the limiter grants of ``n``. What
        was granted but found no message goes back to the limiter (else consumers polling
        an empty queue spent the limit on nothing), before the take returns: a round trip
        more only when the queue ran short. A give-back is announced (``SignalBus.granted``)
        if the limiter refused a take since this one (its count of refusals moved,
        ``RateGrant.refused``): a consumer it refused, in any process, slept until the
        limiter's next grant (an hour away with an hourly limit), pushes or not, and the
        message pushed next waited that long though the limit allowed it. Whether a grant
        is due at once or not: held by a handler's ``RateLimited``, the give-back still
        brought the next grant from an hour away to the hold's end, and the refused
        consumer, told nothing, slept past it (told, it asks again and learns the new
        time). With nobody refused, nobody is to be told: an idle consumer's every
        poll takes a grant and gives it back, and published a signal each time. The
        announcement wakes nobody by itself (two idle consumers would
        wake each other for ever): it makes the grant due again for such a consumer, and
        wakes those that a push woke meanwhile and that slept on (see
        ``_on_grant_back``). The next mature time answered is no sooner than the limiter's
        next grant while none is due: a consumer that found nothing sleeps until then, and
        one leaving first hands that time on (``_hand_on``), as it does a message's mature time."""
        grant = await self._ask_limiter(n, 0.0)
        due = time.time() + grant.wait  # the limiter's next grant, on our clock
        if not grant.granted:
            return Fetched([], due)
        fetched = await take(grant.granted)
        unused = grant.granted - len(fetched.messages)
        if unused:  # here, not in the background: the next take must find them back
            back = await self._give_back_grants(unused, grant.end)
            if back is not None and back.refused != grant.refused:
                # a take was refused since this one: its consumer sleeps until the next
                # grant it was told of, which the give-back may have brought nearer
                self._signal.granted(self.name)
        if grant.wait <= 0 or fetched.next_mature is None:
            return fetched
        return Fetched(fetched.messages, max(fetched.next_mature, due))

    async def _ask_limiter(self, count: int, hold: float, end: float = math.inf) -> RateGrant:
        """One step of the queue's limiter, its answer's next grant kept in ``_rate_due``
        unless a later step's answer came in first (the steps of one process may answer
        out of order, on a pool of connections). Not if a give-back was announced while it
        was on its way: announcements come on another connection, so one may be heard
        before the answer of a step the limiter took before that give-back; keeping the
        answer's next grant over it, a consumer it refused slept until then (an hour away
        with an hourly limit) though the grant was back. One is due then, as the
        announcement said: refused again, the next answer tells."""
        assert self._limiter is not None
        self._rate_asked += 1
        asked = self._rate_asked
        backs = self._rate_backs
        grant = await self._limiter(count, hold, end)
        if asked > self._rate_heard:
            self._rate_heard = asked
            self._rate_due = time.time() + grant.wait if self._rate_backs == backs else 0.0
        return grant

    async def _give_back_grants(self, count: int, end: float) -> RateGrant | None:
        """``count`` grants of a take whose answer said ``end`` (see ``contract.rate_step``:
        only what is still ahead of the limiter's clock comes back): the limiter's answer,
        None where it failed."""
        try:
            return await self._ask_limiter(-count, 0.0, end)
        except Exception as exc:  # they are lost: fewer deliveries for a while, never more
            log.debug("queue %r: %d unused rate grants not given back: %r", self.name, count, exc)
            return None

    def _on_grant_back(self) -> None:
        """A take (of any process) gave back the grants it found no message for, after the
        limiter refused another take: one may be due again, or sooner than the refusal
        said. A consumer the limiter refused meanwhile takes at its next wake-up (refused
        again, it learns when the next grant falls due), not the limiter's next grant it
        was told of; one that a push woke meanwhile, and that slept on, is woken now. Only
        then: woken for nothing, two idle consumers would take and give back, and wake each
        other, for ever."""
        if self._limiter is None:
            return
        self._rate_backs += 1
        self._rate_due = 0.0
        if self._rate_missed and not self._paused:
            self._rate_missed = False
            self._wakeups.announce(None)

    async def _rate_limited(self, messages: list[Message], seconds: object) -> bool:
        """A handler raised ``RateLimited(seconds)``: every process's deliveries of this
        queue stop for ``seconds`` (the limiter held until then), and ``messages`` go back
        costing no try. False where the queue has no rate limit to hold (the consumer
        then handles it as any failure)."""
        if self._limiter is None:
            return False
        hold = check_seconds(seconds, "RateLimited seconds")
        if hold <= 0:  # a handler raising it every time would spin at no try, for ever
            raise InvalidDelayError("RateLimited takes seconds > 0")
        await self._ask_limiter(0, hold)
        if self.capabilities.reserve:
            await self._release_all(messages)
        else:
            await self._put_back_unhandled(messages)
        return True

    def _holding(self, one: OneTake | None) -> OneTake | None:
        """The store's one-message reserve, its reservations noted as ``_reserve_batch``
        notes them."""
        if one is None:
            return None
        send, read = one

        def read_reserved(reply: Any) -> FetchResult:
            reserved = read(reply)
            if reserved[0]:
                self._hold(reserved[0])
            return reserved

        return send, read_reserved

    def _hold(self, reserved: list[Stored]) -> None:
        """Note reservations handed out, for ``close`` to give back those not acknowledged."""
        held = self._held
        if len(held) >= self._held_check:  # only while many are held unacknowledged
            held = self._rotate_held()
        for stored in reserved:
            held[stored.id] = (stored.tries, stored.token)

    def _put_back_popped(self, _: int, result: FetchResult) -> Coroutine[Any, Any, None] | None:
        """A popped batch whose caller was cancelled goes back where it was (awaited by the
        cancelled task, see ``Coalescer.hand_back``)."""
        if not result[0]:
            return None
        entries = [_back_entry(s) for s in result[0]]
        return self._hand_back(self._insert_back(entries), len(entries), "popped messages")

    async def _insert_back(self, entries: list[Entry], until: float | None = None) -> None:
        """Put popped messages back in the store. One the store refuses finds its id taken:
        its dedup window over, the id was pushed again while the message was out. Dropped,
        it was lost; it goes back under the name a move would give it (``<id>.pb``, then
        ``<id>.pb.2``, ...), as every store names a moved message whose id is taken.
        ``until``: while the server refuses connections, each insert is tried again until
        then (monotonic time), nothing having been sent: popped messages whose put-back
        fails are gone for good, and a stop during a server restart would lose them."""
        originals = [entry.id for entry in entries]
        flags = await self._insert_retrying(entries, until)
        for clash in range(1, MAX_RENAMES + 1):
            if all(flags):
                return
            refused = [k for k, flag in enumerate(flags) if not flag]
            originals = [originals[k] for k in refused]
            entries = [entries[k] for k in refused]
            for entry, message_id in zip(entries, originals, strict=True):
                entry.id = moved_id(message_id, PUT_BACK_TAG, clash)
            flags = await self._insert_retrying(entries, until)
        if not all(flags):
            raise KeussError(
                f"no free name for {len(entries)} messages put back, like {entries[0].id!r}"
            )

    async def _insert_retrying(self, entries: list[Entry], until: float | None) -> list[bool]:
        """``store.insert(entries)``, tried again with backoff until ``until`` while it fails
        on a refused connection (see ``consumer.refused``: nothing was sent, so it cannot
        store them twice); one WARNING for the wait. Sound only where the insert of
        put-backs is one command (redis-list's RPUSH, the one backend that pops): a refusal
        met by a later command of several would not tell that the earlier ones did not run."""
        failures = 0
        while True:
            try:
                return await self._store.insert(entries)
            except KeussConnectionError as exc:
                left = -1.0 if until is None else until - time.monotonic()
                if left <= 0 or not refused(exc):
                    raise
                if not failures:
                    log.warning(
                        "queue %r: put back of %d popped messages refused (%s); trying again"
                        " for up to %.0f s",
                        self.name,
                        len(entries),
                        exc,
                        left,
                    )
                await asyncio.sleep(min(retry_backoff(failures), left))
                failures += 1

    def _noted(self, message_id: str) -> Held | None:
        """The reservation of ``message_id`` noted as handed out here (see ``_hold``)."""
        held = self._held.get(message_id)
        return self._held_before.get(message_id) if held is None else held

    def _still_held(self, stored: Stored) -> bool:
        """Whether this reservation is still noted as handed out here (see ``_hold``)."""
        return self._noted(stored.id) == (stored.tries, stored.token)

    def _put_back_reserved(self, _: int, result: FetchResult) -> Coroutine[Any, Any, None] | None:
        """Reserved for a cancelled caller: released at once, costing no try. Only those
        still noted as held here: one a close gave back already (a gathering ``_fill``
        cancelled after the close took its list) may be another consumer's reservation by
        now, with the very tries this one had (the give-back took its try back), and a
        second release would pass that holder's guard and take its reservation from it
        (its ok then failed, the message was delivered again while held)."""
        held = [s for s in result[0] if self._still_held(s)]
        if not held:
            return None
        nacks = [Nack(s.id, s.tries, 0.0, False, s.token) for s in held]
        self._forget(nacks)
        return self._hand_back(self._store.rollback(nacks, None), len(nacks), "reservations")

    async def _hand_back(self, work: Awaitable[Any], count: int, what: str) -> None:
        """A put-back nobody awaits the outcome of (its caller was cancelled): a failure is
        logged, not raised over the cancellation the caller ends with."""
        try:
            await self._put_back(work, count)
            await self._signal.published()
        except Exception as exc:
            # a popped message is then lost, a reservation comes back when it expires
            log.warning(
                "queue %r: could not put back %d %s taken for a cancelled caller: %r",
                self.name,
                count,
                what,
                exc,
            )

    async def _put_back_unhandled(
        self,
        messages: Sequence[Message],
        kept: Mapping[str, Stored] | None = None,
        retry_for: float = 0.0,
    ) -> None:
        """Popped for a consumer that stopped before a handler took them (a backend without
        reserve), or for a sync caller interrupted before it got them: back where they were,
        as a cancelled pop's are. ``kept``: what the store handed out, by id, noted when
        they were taken (``_pop_kept``, ``_next``): a Message carries neither the end of
        life (message TTL) nor the place a put-back must keep; one not noted there is
        rebuilt from the Message, given a new end of life. ``retry_for``: seconds an insert
        the server refused (see ``_insert_back``) is tried again for."""
        found = {} if kept is None else kept
        entries = [
            _back_entry(s)
            if (s := found.get(m.id)) is not None
            else Entry(
                m.id,
                encode_payload(m.payload),
                encode_headers(m.headers),
                tries=m.tries,
                mature=m.mature.timestamp(),
                priority=m.priority,
            )
            for m in messages
        ]
        # nobody saw them, whether or not the put-back lands: counted when taken again
        self._stats.uncount(self.name, "get", len(entries))
        until = time.monotonic() + retry_for if retry_for > 0 else None
        await self._put_back(self._insert_back(entries, until), len(entries))

    async def _release_all(self, messages: Sequence[Message], *, unseen: bool = False) -> None:
        """Give back reservations, costing no try, in as few calls as ``max_batch`` allows
        and the latest batch first: a sharded store puts a release back in its place only
        where nothing is held just behind it, so several calls at once, run in any order,
        sent some of a key's messages behind its later ones. ``unseen``: no user code got
        them (a stopped consumer's prefetch, an interrupted blocking call), so they are not
        counted as reserved; a cancelled handler's were delivered, and count.

        Each batch is no longer noted as held here once it is sent, not once it is
        answered: a release whose reply was lost (a dropped connection) may have landed, and
        the message, its try not counted, be reserved by another process with the count it
        had here. Given back once more by the close, it passed that holder's guard and was
        taken from it. Not sent, it comes back when its reservation expires.

        Only those still noted as held, as for a cancelled caller's (``_put_back_reserved``):
        a consumer cut short gives back its prefetched messages alongside the close, which
        may have given them back already."""
        if unseen:
            self._stats.uncount(self.name, "reserve", len(messages))
        nacks = [
            Nack(m.id, m.tries, 0.0, False, m._token)
            for m in messages
            if self._noted(m.id) == (m.tries, m._token)
        ]
        for batch in _latest_batches_first(nacks, self.options.max_batch):
            self._forget(batch)
            await self._put_back(self._store.rollback(batch, None), len(batch))

    def _rotate_held(self) -> dict[str, Held]:
        """Drop the older generation of held reservations once ``reserve_delay`` has passed
        since the last rotation: everything in it was reserved before that rotation, so its
        reservations have expired (and are delivered again, by this process or another)."""
        now = time.monotonic()
        if now >= self._rotate_at:
            self._held_before, self._held = self._held, {}
            self._rotate_at = now + self.options.reserve_delay
        self._held_check = len(self._held) + HELD_CHECK
        return self._held

    def _forget(self, done: Sequence[Ack] | Sequence[Nack]) -> None:
        """These reservations were acknowledged (or found gone): not ours to give back."""
        for item in done:
            self._forget_one(item.id, item.tries, item.token)

    def _forget_one(self, message_id: str, tries: int | None, token: str | None) -> None:
        """One reservation acknowledged (or found gone), unless by a stale holder (another
        ``tries`` or ``token`` than ours): our newer reservation then stands."""
        held = self._held
        noted = held.pop(message_id, None)
        if noted is None:
            self._held_before.pop(message_id, None)
        elif (token is not None and token != noted[1]) or (tries is not None and tries != noted[0]):
            held[message_id] = noted

    async def _give_back(self, busy: set[str]) -> None:
        """On close: reservations handed out here that nobody acknowledged go back at once,
        costing no try, instead of staying invisible until ``reserve_delay`` expires. Best
        effort: if the backend cannot be reached, they come back when they expire. Not the
        ``busy`` ones, whose handler still runs (it closed its own queue): given back, another
        consumer would handle them at the same time; they come back when they expire."""
        held = {**self._held_before, **self._held}
        self._held, self._held_before = {}, {}
        for message_id in busy:
            held.pop(message_id, None)
        if not held:
            return
        nacks = [Nack(i, tries, 0.0, False, token) for i, (tries, token) in held.items()]
        sent = 0
        try:
            for batch in _latest_batches_first(nacks, self.options.max_batch):
                sent += len(batch)
                await self._store.rollback(batch, None)
        except asyncio.CancelledError:
            # a cancelled close: those not sent yet are still held, for its grace to give
            # back (not those in flight: given back already, they may be another's now)
            self._held.update(list(held.items())[: len(nacks) - sent])
            raise
        except ClosedError:
            # a close that was cancelled closed the store already: a store that refuses
            # calls once closed (the bucket stores) gives back all it holds as it closes
            # (a store close that failed runs again at the end of this close)
            log.debug("queue %r: reservations given back by the store's close", self.name)
            return
        except Exception as exc:
            log.warning(
                "queue %r: could not give back %d unacknowledged reservations on close (%r); "
                "they come back when their reservations expire",
                self.name,
                len(nacks),
                exc,
            )
            return
        self._signal.insert(self.name, time.time(), len(nacks))

    async def _put_back(self, work: Awaitable[Any], count: int) -> None:
        await work
        self._signal.insert(self.name, time.time(), count)

    def __aiter__(self) -> AsyncIterator[Message]:
        return self.messages()

    async def messages(self, timeout: float | None = None) -> AsyncGenerator[Message, None]:
        """Iterate reserved messages (popped ones on a backend without reserve); the loop ends
        on drain, close, or after ``timeout`` seconds with nothing. Reserved messages must be
        ``ok``-ed or ``ko``-ed by the caller. A backend outage does not end the loop: it
        waits and retries with backoff, logging the outage once (see ``consume``)."""
        outage = Outage(self.name, "async for")
        while not self._closed:
            got = await self._next(timeout, outage)
            if not got:
                return
            yield got[0]

    async def _next(
        self,
        timeout: float | None,
        outage: Outage,
        n: int = 1,
        gather: bool = False,
        kept: dict[str, Stored] | None = None,
    ) -> list[Message]:
        """Up to ``n`` messages for ``consume`` and ``messages``: reserved (popped on a
        backend without reserve), riding out backend outages; with ``gather``, for up to
        ``max_wait_time`` until ``n`` are in (a prefetch takes what is ready). ``kept``:
        popped ones are noted there by id, for ``_put_back_unhandled``."""
        wait = None if gather else 0.0
        if self.capabilities.reserve:
            return await self._consume(
                self._reserves, n, timeout, "reserve", "reserve", outage, max_wait=wait
            )
        return await self._consume(
            self._gets, n, timeout, "pop", "get", outage, max_wait=wait, kept=kept
        )

    def consume(
        self,
        handler: Handler | BatchHandler,
        concurrency: int = 1,
        *,
        retry_delay: float = 1.0,
        max_retry_delay: float = 60.0,
        timeout: float | None = None,
        prefetch: int = 0,
        batch: int = 0,
        renew: bool = True,
    ) -> Consumer:
        """Start ``concurrency`` workers: reserve -> handler -> ok; an exception -> ko with
        exponential backoff. Stop with ``await consumer.stop()`` or ``async with``.

        ``timeout``: seconds a handler may run; past it the handler is cancelled and its
        message ko-ed like after an exception (a plain function cannot be interrupted: give
        it to a thread with ``asyncio.to_thread`` to have it timed). ``prefetch``: how many
        messages beyond those being handled may wait, reserved, in this process (fewer
        round trips for short handlers; given back, costing no try, on stop). ``batch``:
        the handler gets a list of up to ``batch`` messages, gathered for up to the queue's
        ``max_wait_time`` (IgnisMQ's maxBatchSize / maxWaitTime); all are ok-ed when it
        returns, all ko-ed when it raises. ``renew``: while a handler runs, its reservation
        is extended (:meth:`extend`) before it lapses, so that a handler running longer than
        ``reserve_delay`` does not see its message delivered to another consumer meanwhile
        (on backends that can extend one, ``capabilities.extend``); False lets it lapse.
        """
        return self._start_consumer(
            handler,
            concurrency,
            retry_delay=retry_delay,
            max_retry_delay=max_retry_delay,
            timeout=timeout,
            prefetch=prefetch,
            batch=batch,
            renew=renew,
        )

    def _start_consumer(
        self,
        handler: Handler | BatchHandler,
        concurrency: int,
        *,
        retry_delay: float = 1.0,
        max_retry_delay: float = 60.0,
        timeout: float | None = None,
        prefetch: int = 0,
        settle: Settle | None = None,
        batch: int = 0,
        renew: bool = True,
    ) -> Consumer:
        """``consume``; with ``settle``, what a handler returned decides how its message is
        acknowledged (a pipeline station moves it on instead of ``ok``)."""
        self._check_open()
        if not isinstance(renew, bool):
            raise InvalidInputError(f"renew must be True or False, not {type(renew).__name__}")
        if self._closing.under_way:
            # that close would not stop it, and the closed queue would refuse its oks
            raise ClosedError(f"queue {self.name!r} is closing")
        check_settings(
            concurrency,
            retry_delay,
            max_retry_delay,
            timeout,
            prefetch,
            batch,
            settled=settle is not None,
            max_batch=self.options.max_batch,
        )
        consumer = Consumer(
            _ConsumerLink(self),
            handler,
            concurrency,
            retry_delay,
            max_retry_delay,
            timeout,
            prefetch,
            settle,
            batch,
            renew,
        )
        self._consumers.add(consumer)
        return consumer

    def repeat(
        self,
        key: str,
        payload: Payload,
        *,
        every: float | None = None,
        cron: str | None = None,
        headers: Headers | None = None,
        tz: str = "UTC",
        priority: int = 0,
    ) -> Repeater:
        """Push ``payload`` on a schedule, ``every`` seconds (aligned to the epoch) or by a
        five-field ``cron`` expression read in ``tz``, as messages with ids
        ``f"{key}@{ms}"``: any number of processes may run the same repeat, the queue's
        dedup keeps one copy of each occurrence. Stop with ``await repeater.stop()``,
        ``async with``, or by closing the queue. Each occurrence is pushed with
        ``priority``. See :mod:`aio_keuss.repeat`."""
        self._check_open()
        if self._closing.under_way:
            raise ClosedError(f"queue {self.name!r} is closing")
        plan = RepeatPlan.make(key, every, cron, tz, headers)
        now = time.time()
        first = plan.schedule.next_after(now)
        # payload, headers, id and the idempotent capability, checked as a push checks them
        entry = self._entry(
            payload,
            0.0,
            encode_headers(plan.headers_at(first)),
            plan.message_id(first),
            priority,
        )
        # every occurrence pushes the payload checked here, not the caller's object as it is
        # then: a dict reused and changed meanwhile would change the occurrences, or stop the
        # repeater with an error this call should have raised
        payload = decode_payload(entry.payload)
        self._require("delay")
        if self.capabilities.shared:
            warning = plan.dedup_warning(self.options.dedup_window, now)
            if warning is not None:
                log.warning("queue %r: %s", self.name, warning)

        def push(delay: float, headers: Headers, message_id: str) -> Awaitable[str]:
            return self.push(
                payload, delay=delay, headers=headers, id=message_id, priority=entry.priority
            )

        repeater = Repeater(plan, self.name, push, self._repeaters.discard, self._store.message_ttl)
        self._repeaters.add(repeater)
        return repeater

    # acknowledging --------------------------------------------------------------------

    async def ok(self, message: Message | str, result: Any = NO_RESULT) -> bool:
        """Commit a reservation; True if it was reserved and is now gone. With ``result``
        (a queue with ``result_ttl``), that is kept as the message's result first: encoded
        by the payload rules (``InvalidPayloadError`` before anything is written), then
        stored, then the ok (a store that fails raises, and the ok is not done)."""
        if result is not NO_RESULT:
            return await self._ok_keeping(message, encode_success, result)
        if self._closed or not self.capabilities.reserve:
            self._check_open()
            self._require("reserve")
        # ``_target``'s checks of a Message's id and tries, inline (the hot path of every ok:
        # three Python calls fewer, about 1 % of a reserve + ok's client instructions);
        # whatever fails one of them, or is no Message, is checked there and refused.
        tries: int | None
        if (
            type(message) is Message
            and type(message_id := message.id) is str
            and 0 < len(message_id) <= MAX_KNOWN_ID_LENGTH
            and message_id.isprintable()
            and type(tries := message.tries) is int
            and 0 <= tries <= MAX_TRIES
        ):
            token = message._token
        else:
            message_id, tries, token = _target(message)
        commits, one = self._commits, self._one_commit
        if (
            one is None
            or token is not None  # (the one-message call carries no token)
            or (reply := commits.send_one(one[0], message_id, tries)) is None
        ):
            (done,) = await commits.submit([Ack(message_id, tries, token)])
            return done
        # The store's own one-message commit (see ``Store.one_commit``), awaited here:
        # its reply refuses cancellation, so once the reply is in, this caller's commit is
        # done and recorded as ``_commit_batch`` records it, cancelled meanwhile or not.
        try:
            raw = await reply
        except BaseException as error:
            if isinstance(error, asyncio.CancelledError):
                reply = await settled(reply)
            commits.ran_one()
            if replied(reply):  # a cancellation that landed once the reply was in
                self._committed_one(message_id, tries, one[1](reply.result()))
            raise
        commits.ran_one()
        return self._committed_one(message_id, tries, one[1](raw))

    def _committed_one(self, message_id: str, tries: int | None, done: bool) -> bool:
        """A one-message commit's reply is in: recorded as ``_commit_batch`` records one,
        without an ``Ack`` made for ``_forget``."""
        self._forget_one(message_id, tries, None)
        if done:
            self._stats.incr(self.name, "commit", 1)
        return done

    async def ok_many(
        self, messages: Sequence[Message | str], results: Sequence[Any] | None = None
    ) -> list[bool]:
        """Commit several reservations in as few round trips as ``max_batch`` allows (e.g.
        those of a ``reserve_many``); one flag per message, in order, as :meth:`ok` gives.
        ``results``: one per message, kept first as :meth:`ok` keeps its ``result``."""
        self._check_open()
        self._require("reserve")
        if isinstance(messages, str | Message) or not isinstance(messages, Sequence):
            raise InvalidInputError("ok_many takes a sequence (list, tuple) of messages or ids")
        acks = [Ack(*_target(m)) for m in messages]
        if results is not None:
            if not _listed(results) or len(results) != len(acks):
                raise InvalidInputError(
                    "results must be a sequence (list, tuple) as long as messages"
                )
            writes = self._writes("ok_many(results=...)")
            bodies = [encode_success(value) for value in results]  # all checked first
            await writes.put([(a.id, body) for a, body in zip(acks, bodies, strict=True)])
        return await self._in_chunks(self._commits, acks)

    async def _ok_keeping(
        self,
        message: Message | str,
        encode: Callable[[Any], bytes],
        value: Any,
        unstorable: Unstorable | None = None,
    ) -> bool:
        """``ok`` with a result: kept first (see :meth:`ok`); ``unstorable``: see
        ``ResultWrites.put``."""
        self._check_open()
        self._require("reserve")
        message_id = _target(message)[0]
        writes = self._writes("ok(result=...)")
        await writes.put([(message_id, encode(value))], unstorable)
        return await self.ok(message)

    def _writes(self, what: str) -> ResultWrites:
        """The result writes of a queue opened with a ``result_ttl``; else a ConfigError."""
        if self._result_writes is None:
            raise ConfigError(
                f"queue {self.name!r}: {what} needs the queue opened with result_ttl > 0"
            )
        return self._result_writes

    def _handled_body(self, message_id: str, value: Any) -> bytes:
        """What a consumer keeps of its handler's return value. One the payload rules
        refuse is not kept, but the message is still ok-ed (the work is done: retrying it
        would do it again), and a failure saying so is kept instead."""
        try:
            return encode_success(value)
        except InvalidPayloadError as exc:
            return self._unstorable(message_id, str(exc))

    def _unstorable(self, message_id: str, why: str) -> bytes:
        """The failure a consumer keeps for a handler's value that cannot be kept (see
        ``_handled_body``): the payload rules refuse it, or it is longer than the result
        store keeps."""
        log.warning(
            "queue %r: the handler's return value for %r is not storable: %s",
            self.name,
            message_id,
            why,
        )
        return encode_failure(f"result not storable: {why}")

    async def _ok_handled(self, message: Message, value: Any) -> bool:
        """A consumer's ok of a handled message on a queue with a ``result_ttl``: its
        handler's value kept first."""
        return await self._ok_keeping(
            message, lambda kept: self._handled_body(message.id, kept), value, self._unstorable
        )

    async def _ok_many_handled(self, messages: list[Message], values: list[Any]) -> list[bool]:
        """A consumer's ok of handled messages (see ``_ok_handled``)."""
        self._check_open()
        assert self._result_writes is not None  # (the link calls this only then)
        bodies = [
            (m.id, self._handled_body(m.id, value))
            for m, value in zip(messages, values, strict=True)
        ]
        await self._result_writes.put(bodies, self._unstorable)
        return await self.ok_many(messages)

    async def _keep_popped(self, messages: list[Message], value: Any, failure: str | None) -> None:
        """The results of popped messages a consumer handled (no ok carries them): the
        handler's value, or its failure (a popped message is not delivered again)."""
        assert self._result_writes is not None  # (the link calls this only then)
        if value is NO_RESULT:
            body = encode_failure(failure or "failed")
            kept = [(m.id, body) for m in messages]
        else:
            kept = [(m.id, self._handled_body(m.id, value)) for m in messages]
        await self._result_writes.put(kept, self._unstorable)

    async def _keep_failure(self, message_id: str, error: str) -> None:
        """A failure result for a message that will never finish (deadlettered, removed),
        so that its waiters do not wait for ever (see ``_keep_failures``)."""
        await self._keep_failures([message_id], error)

    async def _note_leaving(self, message_id: str) -> None:
        """Note, before a remove, that a failure may be kept for the message once it left:
        a duplicate ``push_and_wait`` that finds it gone with none kept waits for it while
        the note lasts (``LEAVE_NOTE_TTL``), not only ``LEAVE_GRACE`` (see ``_joined``), so
        a remover slow to keep it (a stalled process) still has its failure reach them.
        Written with the remove, as a failure cannot be (the remove may find the message
        reserved and leave it): a note that stays for nothing only makes such a joiner wait
        longer for a message that finished with no result kept. Not written, it is logged:
        the remove goes on, its joiners have the grace only. Written only where a joiner
        can read it (``_notes_leaving``): not on the bucket backends (no idempotent ids, so
        no duplicate to join), nor where a message found gone cannot be told."""
        assert self._result_store is not None  # (kept results: a store to keep them)
        try:
            store = await self._result_store()
            await store.put(leave_space(self.name), [(message_id, LEAVING)], LEAVE_NOTE_TTL)
        except Exception as exc:
            log.warning(
                "queue %r: leave note of %r not kept (%r): a duplicate push_and_wait may"
                " miss its failure",
                self.name,
                message_id,
                exc,
            )

    async def _leaving(self, message_id: str) -> bool:
        """Whether a remove noted that a failure may still be kept for the message."""
        assert self._result_store is not None
        store = await self._result_store()
        (note,) = await store.get(leave_space(self.name), [message_id])
        return note is not None

    async def _keep_failures(self, ids: Sequence[str], error: str) -> None:
        """Failure results of messages that will never finish. What failed to be kept is
        logged: the ko, remove or deadletter it follows is done and stays done."""
        writes = self._result_writes
        if writes is None:
            return
        body = encode_failure(error)
        try:
            await writes.put([(message_id, body) for message_id in ids])
        except Exception as exc:
            log.warning(
                "queue %r: failure results of %d messages (like %r) not kept (%r): their"
                " waiters wait for their timeout",
                self.name,
                len(ids),
                ids[0],
                exc,
            )

    async def ko(
        self, message: Message | str, delay: float | None = None, error: str | None = None
    ) -> KoResult:
        """Roll a reservation back (due again after ``delay``), or deadletter it past max_ko.
        On a queue with ``result_ttl``, a ko that deadletters keeps a failure result, with
        ``error`` as its reason (default: how many deliveries failed); one that may
        deadletter (past ``max_ko``, or given an id) first notes it in the result store, for
        a duplicate ``push_and_wait`` (see ``_note_leaving``)."""
        return await self._ko(message, delay, error, keep=True)

    async def _ko(
        self, message: Message | str, delay: float | None, error: str | None, *, keep: bool
    ) -> KoResult:
        """``ko``; ``keep``: a deadlettered message's failure is kept (not a pipeline
        station's: its queue's results are not its own to keep)."""
        self._check_open()
        self._require("reserve")
        message_id, tries, token = _target(message)
        if error is not None:
            check_text(error, "error")  # before the ko: kept as a failure result
        if delay is None:  # a retry polynomial of many tries must not pass the bound either
            seconds = min(self._store.default_ko_delay(tries), MAX_SECONDS)
        else:
            seconds = self._delay(delay)
        plan = self._deadletter
        if (  # a ko that may deadletter: its failure is kept once the message left
            keep
            and self._notes_leaving
            and plan is not None
            and (tries is None or tries + 1 > plan.max_ko)
        ):
            await self._note_leaving(message_id)
        outcome = await self._rollbacks.submit(Nack(message_id, tries, seconds, True, token))
        if outcome is KoResult.DEADLETTERED and keep and self._result_writes is not None:
            if error is None:
                deliveries = None if tries is None else tries + 1
                error = f"failed after {deliveries} deliveries" if deliveries else "failed for good"
            await self._keep_failure(message_id, error)
        return outcome

    async def extend(self, message: Message | str, seconds: float | None = None) -> bool:
        """Make a reservation you still hold last ``seconds`` more from now (default: the
        queue's ``reserve_delay``): True if it was still yours and now runs that long, False
        if it was ok-ed, ko-ed, or lapsed and taken by another consumer meanwhile. For work
        that takes longer than ``reserve_delay``; ``consume`` does it for its handlers."""
        return (await self.extend_many([message], seconds))[0]

    async def extend_many(
        self, messages: Sequence[Message | str], seconds: float | None = None
    ) -> list[bool]:
        """:meth:`extend` of several reservations, in as few round trips as ``max_batch``
        allows; one flag per message, in order. Every item is checked before any is sent."""
        self._check_open()
        self._require("reserve")
        self._require("extend")
        if isinstance(messages, str | Message) or not isinstance(messages, Sequence):
            raise InvalidInputError("extend_many takes a sequence (list, tuple) of messages or ids")
        span = self.options.reserve_delay if seconds is None else check_seconds(seconds, "seconds")
        if span <= 0:
            raise InvalidDelayError("an extension must be longer than 0 seconds")
        extends = [Extend(i, tries, span, token) for i, tries, token in map(_target, messages)]
        return await self._in_chunks(self._extends, extends)

    async def _extend_batch(self, requests: list[list[Extend]]) -> list[list[bool]]:
        extends = [e for request in requests for e in request]
        results = await self._store.extend(extends)
        held, before = self._held, self._held_before
        for extend, kept in zip(extends, results, strict=True):
            if not kept or extend.tries is None:
                continue
            # Ours for another span: kept in the current generation of what a close gives
            # back, but only while still noted as this very reservation. An ok, ko or
            # give-back answered while the extension was out dropped it; noted again, a
            # close would give back a reservation another consumer has since taken with
            # the same count (a give-back costs no try).
            noted = (extend.tries, extend.token)
            if held.get(extend.id) == noted:
                continue
            if before.get(extend.id) == noted:
                del before[extend.id]
                held[extend.id] = noted
        return _split(requests, results)

    async def _commit_batch(self, requests: list[list[Ack]]) -> list[list[bool]]:
        acks = requests[0] if len(requests) == 1 else [a for request in requests for a in request]
        work = RunToEnd(self._store.commit(acks))  # see _insert_batch
        results = await work
        self._forget(acks)
        self._stats.incr(self.name, "commit", sum(results))
        work.raise_held()
        return _split(requests, results)

    async def _rollback_batch(self, nacks: list[Nack]) -> list[KoResult]:
        work = RunToEnd(self._store.rollback(nacks, self._deadletter))  # see _insert_batch
        results = await work
        self._forget(nacks)
        back = [n for n, r in zip(nacks, results, strict=True) if r is KoResult.ROLLED_BACK]
        moved = results.count(KoResult.DEADLETTERED)
        now = time.time()
        if back:
            self._stats.incr(self.name, "rollback", len(back))
            self._signal.insert(self.name, now + min(n.delay for n in back), len(back))
        if moved and self._deadletter is not None:
            self._deadlettered(self._deadletter.queue, moved)
        work.raise_held()
        return results

    def _deadlettered(self, queue: str, count: int, ids: Sequence[str] = ()) -> None:
        """Messages now in deadletter queue ``queue``: counted here and there, and the
        consumers waiting on it told, in every process. A ko's, and those of a move another
        process began that this one's store finished (``Store.on_finished_deadletter``),
        whose ``ids`` no ko answers for: their failures are kept here, where the queue keeps
        results, so that their waiters do not wait for ever."""
        self._stats.incr(self.name, "deadletter", count)
        self._stats.incr(queue, "put", count)
        self._signal.insert(queue, time.time(), count)
        if ids and self._result_writes is not None and not self._closed:
            self._in_background(self._keep_failures(ids, "failed for good (deadlettered)"))

    async def move(
        self,
        message: Message | str,
        queue: str,
        *,
        payload: Payload | Unchanged = UNCHANGED,
        headers: Headers | None = None,
        delay: float = 0.0,
    ) -> str | None:
        """Move a message you hold to another queue of this backend, in one atomic step.

        It leaves this queue and enters ``queue`` as a new delivery (tries 0), due after
        ``delay``, with ``payload`` instead of its own when given and ``headers`` merged
        into its own (a key it has takes the new value, stored once). It keeps its id
        unless ``queue`` already holds one by that name; it is then
        renamed ``<id>.mv``, ``<id>.mv.2``, ... Returns the id it has in ``queue``, or None
        when it was no longer yours (acknowledged, or its reservation expired and it went to
        another consumer): then nothing moved. As with :meth:`ok`, a :class:`Message`
        guards by its tries; an id alone does not. Counted as a commit here and a put there.
        Concurrent moves from one queue share round trips, like ``ok``.
        """
        self._check_open()
        self._require("move")
        plan = self._move_plan(message, queue, payload, headers, delay)
        await self._open_target(plan.queue)
        return await self._moves.submit(plan)

    async def move_many(
        self,
        messages: Sequence[Message | str],
        queue: str,
        *,
        headers: Headers | None = None,
        delay: float = 0.0,
    ) -> list[str | None]:
        """:meth:`move` for several held messages to one queue, each keeping its payload:
        the id each has in ``queue`` (None for those no longer yours), in order. Each move
        is atomic on its own; all are checked before any is written."""
        self._check_open()
        self._require("move")
        if isinstance(messages, (str, Message)) or not isinstance(messages, Sequence):
            raise InvalidInputError("move_many takes a sequence of messages or ids")
        if not messages:  # checked all the same: bad input is refused whatever the length
            self._move_plan(None, queue, UNCHANGED, headers, delay)
            return []
        plans = [self._move_plan(m, queue, UNCHANGED, headers, delay) for m in messages]
        await self._open_target(plans[0].queue)
        return list(await asyncio.gather(*(self._moves.submit(plan) for plan in plans)))

    def _move_plan(
        self,
        message: Message | str | None,
        queue: str,
        payload: Payload | Unchanged,
        headers: Headers | None,
        delay: float,
    ) -> Move:
        """A checked move: every argument refused here, before anything is written.
        ``message`` None checks the rest only (an empty ``move_many``): the plan is not
        for submitting."""
        message_id, tries, token = ("", None, None) if message is None else _target(message)
        destination = check_queue_name(queue)
        if destination == self.name:
            raise InvalidInputError(f"move: {queue!r} is this queue; use ko to put it back")
        blob = None if payload is UNCHANGED else encode_payload(payload)
        added = encode_headers(headers)
        if self._store.max_message_bytes is not None:
            # what the moved message will hold at least: a push's bound, checked as a
            # push's (else the database refused the row, or the driver could not send it)
            self._check_size(blob or b"", added)
        seconds = self._delay(delay)
        extra = dict(headers or {})
        return Move(message_id, tries, destination, blob, extra, seconds, MOVE_TAG, token)

    async def _open_target(self, name: str) -> None:
        """Open a queue moved into through the factory (once), which records it: else its
        messages sat in a queue that ``factory.list()``, the admin commands and the
        dashboard do not know."""
        if name in self._targets or self._sibling is None:
            return
        async with self._sibling(name):
            self._targets.add(name)

    async def _submit_move(self, plan: Move) -> str | None:
        """A move checked earlier by :meth:`_move_plan` (a pipeline station checks its
        handler's answer before it settles the message)."""
        self._check_open()
        return await self._moves.submit(plan)

    async def _move_batch(self, plans: list[Move]) -> list[str | None]:
        work = RunToEnd(self._store.move(plans))  # see _insert_batch
        results = await work
        self._forget([Ack(plan.id, plan.tries, plan.token) for plan in plans])
        now = time.time()
        arrivals: dict[str, tuple[float, int]] = {}
        moved = 0
        for plan, result in zip(plans, results, strict=True):
            if result is None:
                continue
            moved += 1
            self._stats.incr(plan.queue, "put")
            due = now + plan.delay
            first, count = arrivals.get(plan.queue, (due, 0))
            arrivals[plan.queue] = (min(first, due), count + 1)
        if moved:
            self._stats.incr(self.name, "commit", moved)
            if observe.active is not None:
                observe.active.count(self.name, "move", moved)
        for destination, (due, count) in arrivals.items():
            self._signal.insert(destination, due, count)
        work.raise_held()
        return results

    async def remove(self, message: Message | str) -> bool:
        """Delete a message that is not under an active reservation."""
        self._check_open()
        self._require("remove")
        message_id = _target(message)[0]
        return await self._remove(message_id, "removed")

    async def _remove(self, message_id: str, failure: str) -> bool:
        """``remove``, keeping ``failure`` as the result of what it removed. On a queue
        keeping results both run to their end (see :meth:`_uncut`): a remove cancelled once
        the store did it still tells the message's waiters it will never finish, else they
        would wait for ever."""
        if self._result_writes is None:  # no aftermath: a cancelled wait stops it
            (removed,) = await self._store.remove([message_id])
            return removed
        work = RunToEnd(self._uncut(self._removed(message_id, failure)))
        removed = await work
        work.raise_held()
        return removed

    async def _removed(self, message_id: str, failure: str) -> bool:
        if self._notes_leaving:
            # side by side with the remove, not a round trip before it: a joiner finding the
            # message gone before the note lands looks for it again at its grace's end (see
            # ``_joined``); first, a remove waited for the note's reply before it was even
            # sent, and one whose replies a slow server held never removed anything
            noting = asyncio.ensure_future(self._note_leaving(message_id))
            try:
                (removed,) = await self._store.remove([message_id])
            finally:
                await noting  # (never raises: a note not kept is logged)
        else:
            (removed,) = await self._store.remove([message_id])
        if removed:  # its waiters are told it will never finish
            await self._keep_failure(message_id, failure)
        return removed

    # cancelling (see aio_keuss.cancels) --------------------------------------------------

    async def cancel(self, message: Message | str, reason: str | None = None) -> CancelResult:
        """Cancel a message, waiting or running (saq's and arq's ``job.abort()``).

        Waiting, it is removed (where ``capabilities.remove``): ``REMOVED``. Under a
        reservation (or popped and running), its holder is asked to stop it (needs
        ``capabilities.results``): a request is left in the backend, a signal names it to
        every process, and the consumer holding it cancels its handler's task (the handler
        sees ``CancelledError``), then ok-s it, done for good: ``REQUESTED``. ``MISSING`` when
        it is nowhere to be found and no request is left. A backend that cannot look
        (no ``capabilities.peek``) leaves the request and answers ``REQUESTED`` for any id;
        so does a backend without ``capabilities.reserve``: a popped message is out of the
        store while its handler runs, so not finding it does not mean nothing runs it (nor,
        found waiting, that nobody pops it before a removal that such a backend may lack).
        On a queue with ``result_ttl``, its failure result says ``"cancelled"`` (with
        ``": <reason>"``). ``reason``: a str of valid UTF-8 of at most 1,000 characters, or None.

        A request that reaches nothing (the id never pushed, or its message done) is kept
        for its lifetime (twice ``reserve_delay``, plus a minute), then expires. Without
        idempotent ids no later push takes the same id, so it stops nothing. A backend
        without reserve but with idempotent ids would stop a push of that explicit id made
        within that lifetime (past its ``dedup_window``): cancel only an id that may still
        run there, or push it again only once the request expired.

        A message may end (its handler returned, its ok landed) between the look that found
        it held and the request landing: then nothing holds it to use the request up, which
        would stop a later push of its id. Where the first look was made, the message is
        looked up again once the request is in (before the signal, which could otherwise
        have it stopped in between); gone, the request is used up at once and the answer is
        ``MISSING``: the message was not stopped, it finished, and no request is left.
        ``REQUESTED`` would promise a stop that cannot come. (A consumer that looks the
        requests up on its own may find the request in that moment and stop the message:
        rarely, ``MISSING`` then names a message that was stopped, as its failure result
        says.) Found still held with its handler returned and its ok on its way, the
        message's consumer, told of the request, uses it up once that ok lands, or, where
        the ok landed before the signal reached it, as it hears of the request for a
        message it no longer holds. No use-up overwrites a request left since for a later
        message of the same id (see ``aio_keuss.cancels``)."""
        self._check_open()
        message_id = _target(message)[0]
        text = check_reason(reason)
        capabilities = self.capabilities
        if not capabilities.remove and not capabilities.results:
            raise NotSupportedError(f"queue {self.name!r}: this backend cannot cancel")
        if capabilities.remove and await self._remove(message_id, cancelled_text(text)):
            return CancelResult.REMOVED
        if self._result_store is None:  # nothing can stop a running handler here
            return CancelResult.MISSING
        # only a reservation stays in the store while its handler runs: without reserve, a
        # look that finds nothing says nothing (and neither look is paid for)
        looks = capabilities.peek and capabilities.reserve
        if looks and not await self._still_queued(message_id):
            return CancelResult.MISSING
        store = await self._result_store()
        ttl = request_ttl(self.options.reserve_delay)
        space, request = cancel_space(self.name), encode_request(text)
        await store.put(space, [(message_id, request)], ttl)
        if looks and not await self._still_queued(message_id):
            # this request only: another cancel's, written since, stands for its message
            await store.replace(space, [(message_id, request, USED)], ttl)
            return CancelResult.MISSING
        self._signal.cancels(self.name, [message_id])
        return CancelResult.REQUESTED

    async def _still_queued(self, message_id: str) -> bool:
        """Whether the message is still in the queue, not processed: a cancel request may
        still reach it, a result may still come for it."""
        (queued,) = await self._store.queued([message_id])
        return queued

    async def _cancel_requests(self, ids: list[str]) -> dict[str, str | None]:
        """The reasons of the cancel requests left for ``ids`` (those with one), in round
        trips of at most ``max_batch`` ids."""
        if self._result_store is None or not ids:
            return {}
        store = await self._result_store()
        space, size, found = cancel_space(self.name), self.options.max_batch, {}
        for start in range(0, len(ids), size):
            chunk = ids[start : start + size]
            for message_id, body in zip(chunk, await store.get(space, chunk), strict=True):
                if body is not None and body != USED:
                    found[message_id] = decode_request(body)
        return found

    async def _cancelled(self, messages: list[Message], keep: bool) -> None:
        """Messages a consumer stopped, or never started, on request: their failure results
        kept (``keep``, on a queue with ``result_ttl``), their reasons read back from the
        requests, then ok-ed (popped ones have no ok), done for good."""
        writes = self._result_writes
        if keep and writes is not None:
            try:
                reasons = await self._cancel_requests([m.id for m in messages])
            except Exception as exc:  # the failure is still kept, without its reason
                log.debug("queue %r: cancel reasons not read: %r", self.name, exc)
                reasons = {}
            kept = [(m.id, encode_failure(cancelled_text(reasons.get(m.id)))) for m in messages]
            await writes.put(kept)
        done = [m.id for m in messages]
        if self.capabilities.reserve:
            flags = await self.ok_many(messages)
            done = [m.id for m, ok in zip(messages, flags, strict=True) if ok]
        await self._use_up_requests(done)

    async def _use_up_requests(self, ids: list[str], *, told_only: bool = False) -> list[str]:
        """The requests that reached ``ids`` (done for good now: stopped, or finished by a
        handler that went on when asked to stop, or heard of by the consumer that finished
        them once they were) are used up: a later push of one of these ids (past its
        ``dedup_window``) is a new message, which no consumer finding a request, or
        remembering one it heard of, must stop. Where the ok was refused (another holder
        took the message after a lapse), the caller leaves the request, for that holder to
        honour. Returns the ids whose request it found standing and wrote over (where
        still the one read).

        Never a request left for a later message of the same id: each request read is
        overwritten only if it is still that one (``ResultStore.replace``, a request's body
        being its own, see ``encode_request``), and only where no message of its id is in
        the queue once it was read. A request is written only once its cancel found its
        message in the queue, so a request read while no message of its id is there any
        more reached one that is done, whichever it was. Where one is there again (the id
        pushed again past its ``dedup_window``, between the end of the first and this
        look), the request read may be the new message's: it is left. A store that cannot
        tell whether a message is in the queue (no peek, or no reserve: a popped message
        is out of the store while it runs) has its requests used up on the read alone,
        except with ``told_only``: the request of a message heard of once it was done may
        then be a later message's as well, and is left (it lapses in its time)."""
        if self._result_store is None or not ids:
            return []
        capabilities = self.capabilities
        tells = capabilities.reserve and (capabilities.peek or self._store.tells_queued)
        if told_only and not tells:
            return []
        store = await self._result_store()
        space, ttl = cancel_space(self.name), request_ttl(self.options.reserve_delay)
        used: list[str] = []
        size = self.options.max_batch
        for start in range(0, len(ids), size):
            chunk = list(dict.fromkeys(ids[start : start + size]))
            bodies = await store.get(space, chunk)
            standing = [
                (i, body)
                for i, body in zip(chunk, bodies, strict=True)
                if body is not None and body != USED
            ]
            if standing and tells:
                queued = await self._store.queued([i for i, _ in standing])
                standing = [s for s, back in zip(standing, queued, strict=True) if not back]
            if standing:
                await store.replace(space, [(i, body, USED) for i, body in standing], ttl)
                used.extend(i for i, _ in standing)
        return used

    # changing waiting messages (promote, reschedule, change_priority) ------------------

    async def promote(self, message: Message | str) -> bool:
        """Make a scheduled message ready now (BullMQ's ``job.promote()``): True when it
        was waiting for its mature time; False when it is not here, is under an active
        reservation or was ready already. It then comes out among the ready ones by its new
        mature time, now. Needs ``capabilities.reschedule``."""
        return await self._amend(message, 0.0, None, scheduled_only=True)

    async def reschedule(self, message: Message | str, delay: float) -> bool:
        """Make a waiting message (ready or scheduled, not under an active reservation)
        mature ``delay`` seconds from now, as a push with that delay would: sooner or later
        than it was. False when it is not here or is reserved. Needs
        ``capabilities.reschedule``."""
        self._check_open()
        return await self._amend(message, check_seconds(delay, "delay"), None)

    async def change_priority(self, message: Message | str, priority: int) -> bool:
        """Give a waiting message a new priority (BullMQ's ``job.changePriority``); its
        mature time stays, and among its new priority it takes the place a push with it
        would have had. False when it is not here or is reserved. Needs
        ``capabilities.reschedule`` and ``capabilities.priority``."""
        self._check_open()
        return await self._amend(message, None, check_priority(priority))

    async def _amend(
        self,
        message: Message | str,
        delay: float | None,
        priority: int | None,
        *,
        scheduled_only: bool = False,
    ) -> bool:
        """One change, in one store call. One that gives a new mature time is signalled as
        a push with it would be (consumers of every process wake for it when it is due; a
        promote, due now, wakes one), whether it was sooner or later than before: the store
        does not say which, and a wakeup for nothing costs a take."""
        self._check_open()
        message_id = _target(message)[0]  # bad input first, whatever the backend can do
        self._require("reschedule")
        if priority is not None:
            self._require("priority")
        amend = Amend(message_id, delay, priority, scheduled_only)
        work = RunToEnd(self._uncut(self._store.amend([amend])))
        (changed,) = await work
        if changed and delay is not None:
            self._signal.insert(self.name, time.time() + delay, 1)
        work.raise_held()
        return changed

    async def _uncut(self, work: Coroutine[Any, Any, Done]) -> Done:
        """``work`` not cut short by its caller's cancellation, for writes whose aftermath
        must follow them (an amend's signal, a remove's failure result): on a store whose
        round trips a cancellation interrupts (asyncpg, PyMongo give up the wait), the
        write stands once sent while its caller never learns it, and consumers of other
        processes slept to their poll interval by a message made ready, waiters of a
        removed one for ever. Run as a task to its end, its answer comes back and
        ``RunToEnd`` holds the cancellation until the aftermath is done (a store whose
        replies refuse cancellation needs no task)."""
        if self._store.uninterruptible:
            return await work
        return await to_the_end(work)

    # results ----------------------------------------------------------------------------

    async def result(self, message: Message | str, timeout: float | None = 0.0) -> JobResult | None:
        """The kept result of a message (see ``result_ttl``), or None: ``timeout`` 0 looks
        once, more waits up to that long, None waits for ever. Woken by the result's signal
        from whichever process keeps it, else by the queue's ``poll_interval``; the waits
        of a queue share their round trips. Any queue object of a backend with
        ``capabilities.results`` may read, whatever its own ``result_ttl``."""
        self._check_open()
        message_id = _target(message)[0]
        seconds = check_timeout(timeout)
        self._require("results")
        waits = self._waits()
        if seconds == 0:
            (body,) = await waits.look([message_id])
        else:
            body = await waits.wait(message_id, seconds)
        return None if body is None else decode_result(self.name, message_id, body)

    async def push_and_wait(
        self,
        payload: Payload,
        *,
        timeout: float | None = None,
        delay: float = 0.0,
        headers: Headers | None = None,
        id: str | None = None,
        priority: int = 0,
    ) -> Any:
        """Push a message, then wait for what its handler returns (``JobFailedError`` if it
        fails for good, ``ResultTimeoutError`` past ``timeout``: the message stays queued).
        Needs ``result_ttl`` on this queue, and on the consumers' queue objects, which keep
        the results.

        An ``id`` refused as a duplicate joins the earlier message: its result is awaited.
        Where that message has finished with no result kept (none, or expired), none can
        come: ``ResultMissingError``, once a short grace (``LEAVE_GRACE`` seconds) passed
        with none kept, or longer while a remove noted that a failure is on its way (see
        ``_joined``), whatever ``timeout`` beyond it."""
        self._check_open()
        seconds = check_timeout(timeout)
        self._require("results")
        self._writes("push_and_wait")
        entry = self._entry(payload, self._delay(delay), encode_headers(headers), id, priority)
        queued = await self._push_queued(entry)
        message_id = entry.id  # read after the insert: a store may give the id it made
        if queued:  # a new message: no result can be kept yet
            body = await self._waits().wait(message_id, seconds)
        else:
            body = await self._joined(message_id, seconds)
        if body is None:
            raise ResultTimeoutError(message_id, seconds or 0.0)
        outcome = decode_result(self.name, message_id, body)
        if not outcome.ok:
            raise JobFailedError(message_id, outcome.error)
        return outcome.value

    async def _joined(self, message_id: str, timeout: float | None) -> bytes | None:
        """The result of the earlier message a duplicate push joined, as ``ResultWaits.wait``
        gives it; ``ResultMissingError`` where that message has finished with no result
        kept. Only a backend that keeps a message until its ok (reserve) and can look it up
        (peek, or a store that ``tells_queued``: the sharded ones) can tell. Hence the
        order: the result (kept: the usual join, one round trip), then where the message
        is, then, gone, the result once more.

        An ok keeps the result before it deletes the message, so one gone after an ok has
        its result kept already, if it ever will. Not so a message that left otherwise: a
        remove (or a cancel that removes) and a ko that deadletters keep its failure once
        it left (before, the message might not leave: a remove finds it reserved, a ko's
        reservation lapsed, and a failure kept would be read meanwhile as its result). So
        the second look is a wait of ``LEAVE_GRACE`` seconds, woken by the failure's signal
        (and a last look for one whose signal was lost): a message that finished with
        none kept costs its waiter that grace. A ``timeout`` that ends within the grace
        ends the wait as any other (None: ``ResultTimeoutError``), since a failure may
        still come. A remover may stall beyond the grace (a slow or paused process), so
        each notes before it removes (or before a ko that may deadletter) that a failure
        may follow (see ``_note_leaving``): a joiner that finds the message gone with none
        kept past the grace, and that note still there, waits another grace, and so on
        while the note lasts (``LEAVE_NOTE_TTL``), up to its ``timeout``. A remover that
        dies before keeping the failure (or stalls longer than the note lasts) leaves
        ``ResultMissingError`` then; a note whose remove found the message held and left
        it, later finished with no result kept, delays ``ResultMissingError`` as long.

        A message found still queued is looked for again each ``poll_interval`` while
        its result is awaited (in one wait, its looks shared: see ``_while_queued``): one
        that then finishes with none kept (an ok without a result, a consumer that keeps
        none) is told as above, not awaited for ever; one found gone, with no failure kept
        in the grace, is looked for once more, then its result, since it may be back (a
        cancelled pop puts its messages back) or even back and ok-ed.

        Elsewhere (no peek: nothing to look with; no reserve: a popped message is out of
        the store while its handler runs) the wait goes on as for any result, up to its
        timeout."""
        waits = self._waits()
        capabilities = self.capabilities
        if not (capabilities.reserve and (capabilities.peek or self._store.tells_queued)):
            return await waits.wait(message_id, timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        (body,) = await waits.look([message_id])
        if body is not None:
            return body
        queued = await self._still_queued(message_id)
        while True:
            if queued:
                body, queued = await self._while_queued(waits, message_id, deadline)
                if queued:  # its result, or the timeout's end
                    return body
            left = None if deadline is None else max(0.0, deadline - loop.time())
            grace = LEAVE_GRACE if left is None else min(LEAVE_GRACE, left)
            body = await waits.wait(message_id, grace)
            if body is not None:
                return body
            if grace >= LEAVE_GRACE:
                # where it is, then its result: an ok keeps the result before the message
                # leaves, so one back in the queue and ok-ed meanwhile has it kept by then
                queued = await self._still_queued(message_id)
            (body,) = await waits.look([message_id])  # (a failure whose signal was lost)
            if body is not None or grace < LEAVE_GRACE:
                return body
            if not queued and not await self._leaving(message_id):
                raise ResultMissingError(message_id)
            # back in the queue (a pop cancelled before its reply was handed over puts
            # its messages back): its result may come after all; or gone, with a remove
            # noted as on its way: the failure it keeps may come after all

    async def _while_queued(
        self, waits: ResultWaits, message_id: str, deadline: float | None
    ) -> tuple[bytes | None, bool]:
        """Wait for the result of a joined message found still queued, asking where it is
        each ``poll_interval``: (its body, True), or (None, True) once ``deadline`` passed,
        or (None, False) once it is found gone. One wait all along: its result is looked
        for by the queue's one waiting task, with every other wait (a new wait at each
        recheck, and a look of its own, cost two round trips more each, none shared)."""
        loop = asyncio.get_running_loop()
        left = None if deadline is None else max(0.0, deadline - loop.time())
        waiting = asyncio.ensure_future(waits.wait(message_id, left))
        recheck = self.options.poll_interval
        try:
            while True:
                done, _ = await asyncio.wait((waiting,), timeout=recheck)
                if done:
                    return waiting.result(), True
                still = await self._still_queued(message_id)
                if waiting.done():
                    return waiting.result(), True
                if not still:  # the grace's wait looks for a result kept as it left
                    return None, False
        finally:
            if not waiting.done():
                waiting.cancel()
            elif not waiting.cancelled():
                waiting.exception()  # retrieved: raised above, or dropped with the caller

    def _waits(self) -> ResultWaits:
        if self._result_waits is None:
            if self._result_store is None:
                raise NotSupportedError(f"queue {self.name!r}: this backend has no results")
            self._result_waits = ResultWaits(
                self.name,
                self._result_store,
                self._signal,
                self.options.poll_interval,
                self.options.max_batch,
            )
        return self._result_waits

    # looking inside and repairing (see aio_keuss.visibility) ---------------------------

    async def peek(self, n: int = 10, *, state: str = "ready") -> list[MessageView]:
        """The first ``n`` messages in ``state`` (``"ready"``, ``"scheduled"``,
        ``"reserved"`` or ``"all"``), in mature order (a reserved one by its deadline),
        without taking or reserving them. Needs ``Capabilities.peek``."""
        self._check_open()
        visibility.check_limit(n)
        checked = visibility.check_state(state)
        self._require("peek")
        return await visibility.peek(self._store, self.name, checked, n)

    async def page(
        self, *, state: str = "all", after: str | None = None, limit: int = 1000
    ) -> Page:
        """Up to ``limit`` messages in ``state`` past the cursor ``after`` (from an earlier
        page; None: from the start), and the cursor to go on with (None at the end). A page
        may be short, even empty, before the end: go on while its cursor is not None."""
        self._check_open()
        visibility.check_limit(limit, "limit")
        checked = visibility.check_state(state)
        cursor = self._store.check_cursor(visibility.decode_cursor(after))
        self._require("peek")
        return visibility.page_of(self.name, await self._store.peek(checked, cursor, limit))

    async def browse(
        self, *, state: str = "all", after: str | None = None, page_size: int = 1000
    ) -> AsyncIterator[MessageView]:
        """Every message in ``state``, page by page behind a cursor, so a queue of millions
        is walked in constant memory. Nothing is taken; a message that changes state during
        the walk may be seen twice or not at all."""
        self._check_open()
        visibility.check_limit(page_size, "page_size")
        checked = visibility.check_state(state)
        cursor = self._store.check_cursor(visibility.decode_cursor(after))
        self._require("peek")
        async for row in visibility.rows(self._store, checked, cursor, page_size):
            yield visibility.view(self.name, row)

    async def find(self, message: Message | str) -> MessageView | None:
        """Where a message is: in this queue (ready, scheduled, reserved: ``at`` says until
        when), else in the deadletter queue under the same id, else processed here (on a
        history backend, ``at`` says when); None when it is nowhere."""
        self._check_open()
        message_id = _target(message)[0]
        self._require("peek")
        (row,) = await self._store.locate([message_id])
        if row is not None and row.state != "processed":
            return visibility.view(self.name, row)
        if self._deadletter is not None and self._sibling is not None:
            async with self._sibling(self._deadletter.queue) as dead:
                (dead_row,) = await dead._store.locate([message_id])
            if dead_row is not None and dead_row.state != "processed":
                return visibility.view(dead.name, dead_row)
        return None if row is None else visibility.view(self.name, row)

    async def purge(self) -> int:
        """Remove every message not under an active reservation (a running consumer's stays
        theirs to ok or ko); returns how many were removed."""
        self._check_open()
        self._require("peek")
        self._require("remove")
        return await visibility.purge(self._store, self.options.max_batch)

    async def requeue(
        self, ids: Sequence[str] | None = None, *, origin: str | None = None
    ) -> dict[str, str]:
        """On a deadletter queue: move messages back to the queue they failed in, each in
        one atomic step, tries reset. Either ``ids`` (each goes to the queue named by its
        ``x-dl-from-queue`` header, or to ``origin`` when given), or ``origin`` alone: every
        message that failed there. A message under an active reservation is left alone.
        Returns id here -> id in its origin (renamed ``<id>.rq`` if taken there)."""
        self._check_open()
        visibility.check_requeue(ids, origin)
        self._require("peek")
        self._require("hold")
        self._require("move")
        return await visibility.requeue(self, ids, origin)

    async def history(
        self,
        *,
        since: datetime | float | None = None,
        until: datetime | float | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> Page:
        """Consumed messages kept by a history backend, processed in [since, until), oldest
        first, at most ``limit``; go on with the page's cursor as ``after``."""
        self._check_open()
        start = visibility.check_time(since, "since", 0.0)
        end = visibility.check_time(until, "until", visibility.MAX_TIME)
        visibility.check_limit(limit, "limit")
        cursor = self._store.check_cursor(visibility.decode_cursor(after))
        self._require("history")
        found = await self._store.history(start, end, cursor, limit)
        return visibility.page_of(self.name, found)

    async def replay(
        self,
        ids: Sequence[str] | None = None,
        *,
        since: datetime | float | None = None,
        until: datetime | float | None = None,
        to: str | None = None,
    ) -> list[str]:
        """Push copies of processed messages again: those in ``ids``, or every one processed
        in [since, until), into ``to`` (default: this queue). Copies get new ids and an
        ``x-replay-of`` header; the history stays. Returns the new ids."""
        self._check_open()
        start, end = visibility.check_replay(ids, since, until)
        target_name = visibility.check_target(to, self.name)
        self._require("history")
        if target_name == self.name:
            return await visibility.replay(self._store, self, ids, start, end)
        if self._sibling is None:
            raise NotSupportedError("replay to another queue needs a queue from a factory")
        async with self._sibling(target_name) as target:  # held till its last copy is in
            return await visibility.replay(self._store, target, ids, start, end)

    async def _insert_entries(self, entries: list[Entry]) -> None:
        """Insert prepared entries (replay), counted and signalled like pushes."""
        size = self.options.max_batch
        chunks = [entries[i : i + size] for i in range(0, len(entries), size)]
        await asyncio.gather(*(self._inserts.submit(chunk) for chunk in chunks))

    # observing and administering ------------------------------------------------------

    async def sizes(self) -> Sizes:
        self._check_open()
        return await self._store.sizes()

    async def size(self) -> int:
        """Messages deliverable now."""
        return (await self.sizes()).size

    async def total_size(self) -> int:
        return (await self.sizes()).total

    async def sched_size(self) -> int:
        """Messages waiting for their mature time."""
        return (await self.sizes()).scheduled

    async def resv_size(self) -> int:
        """Messages under an active reservation."""
        return (await self.sizes()).reserved

    async def next_mature_t(self) -> datetime | None:
        self._check_open()
        mature = await self._store.next_mature()
        return None if mature is None else to_datetime(mature)

    async def pause(self) -> None:
        """Stop deliveries in every process until ``resume``; pushes still go in."""
        self._check_open()
        await self._stats.set_paused(self.name, True)
        self._signal.paused(self.name, True)

    async def resume(self) -> None:
        self._check_open()
        await self._stats.set_paused(self.name, False)
        self._signal.paused(self.name, False)

    async def is_paused(self) -> bool:
        self._check_open()
        self._paused = await self._stats.is_paused(self.name)
        return self._paused

    async def stats(self) -> dict[str, int]:
        """Counters of every process: put, get, reserve, commit, rollback, deadletter."""
        self._check_open()
        return await self._stats.counters(self.name)

    async def drain(self) -> None:
        """Write out what is buffered, and return every waiting pop / reserve (None)."""
        self._check_open()
        await self._store.flush()
        self._drains += 1
        self._wakeups.announce(None)

    async def close(self) -> None:
        """Stop the consumers, drain, give back the reservations handed out here that nobody
        ok-ed or ko-ed (at once, costing no try), then refuse further calls; the factory
        closes its queues for you. Called by a handler of one of this queue's consumers, it
        cannot wait for that handler to end: it starts the close and returns (as
        ``consumer.stop()`` does), and the close lets every handler finish and acknowledge
        before it gives anything back. Closes called while one is under way wait for it. One
        that failed (the server away) may be called again: it runs again, each step picking
        up where the failed one stopped; so does one after a cancelled close whose store's
        close failed in its grace (the cancelled caller heard only the cancellation).
        Cancelled, it still finishes (calls in flight end, reservations go back) for up to
        ``CANCELLED_CLOSE_GRACE`` seconds, or until cancelled again."""
        await self._shut(cut_short=False)

    async def _shut(self, cut_short: bool) -> None:
        """``close``; with ``cut_short``, for a factory whose own close was cancelled before
        this one began (while the consumers stopped): all of it then runs as the rest of a
        cancelled close, bounded alike, not left to wait for round trips in flight without
        end."""
        begun = self._closing.task
        # Begun again after one cancelled before the queue counted as closed (a cancelled
        # one past that point closed the store in its grace), or one that failed (its server
        # away; or cancelled, its store's close failed in its grace): that one returned at
        # once, and the store stayed open for good.
        owner = begun is None or (begun.cancelled() and not self._closed) or self._closing.failed
        if owner:
            self._closing.begin(self._close(cut_short))
        elif not self._closing.under_way:
            return
        if self._runs_a_handler():
            self._stop_taking()  # from now on, as a stop from a handler does
            return
        await self._closing.wait(owner)

    def _runs_a_handler(self) -> bool:
        """Whether the running task is a worker of one of this queue's consumers (a handler
        calls): a close it waited for would wait for that very handler."""
        task = asyncio.current_task()
        return task is not None and any(c.runs_in(task) for c in self._consumers)

    async def _closed_by_own_close(self) -> bool:
        """Whether this queue was closed by its own ``close()``, waiting for a close under
        way to end: its factory then opens the name afresh rather than hand it out. Not
        from a consumer's handler, or a task one started, while the close is under way:
        that close may wait for the handler (this queue's; or another queue's whose handler
        waits for this queue to close), and the two waited for each other until the stop's
        grace cancelled the handlers. The closing queue is handed out then, and refuses
        calls as before; a move into it is made by the source's store.

        One whose close failed after it counted as closed (the server away during its
        store's last writes: a bucket store's write-back, its oks not written yet) is closed
        again here, and this ask fails as that close does: dropped, nothing closed it again,
        not even the factory's close, and the reservations it held and the buckets it had
        leased stayed out of every process's reach until they expired. Not opened afresh
        beside it either: nothing promises that two opens of one name share nothing a close
        shuts. So is one whose close was cancelled once it counted as closed, its store's
        close failing in the grace (see ``Closing.store_failed``). Shielded: this ask
        cancelled, the close goes on, not cut short to its grace."""
        closing = self._closing.task
        if closing is None or self._runs_a_handler():
            return False
        if not closing.done():
            if in_handler():
                return False
            with contextlib.suppress(Exception):  # its failure is its closer's to hear
                await self._closing.wait(owner=False)
        if self._closed and self._closing.failed:
            again = asyncio.ensure_future(self.close())
            try:
                await asyncio.shield(again)  # raises if it fails again
            except asyncio.CancelledError:
                # nobody waits for it now: a failure is logged as a close nobody waits for
                # (else asyncio's "Task exception was never retrieved", whenever collected)
                again.add_done_callback(functools.partial(_failure_logged, self.name))
                raise
        return self._closed

    def _stop_taking(self) -> None:
        for consumer in self._consumers:
            consumer.stop_taking()

    async def _close(self, cut_short: bool) -> None:
        if cut_short:
            # Begun by a factory's close cancelled while the consumers stopped: all of it is
            # the rest of a cancelled close, bounded alike.
            cancelled = await self._in_grace(self._close_steps())
            if cancelled is not None:
                raise cancelled
            return
        try:
            await self._close_steps()
        except asyncio.CancelledError:
            # Cancelled (a shutdown timeout, a second Ctrl-C): the consumers' cancelled stops
            # gave their messages back and the grace is over, but the rest of the close
            # still runs. The factory closes the backend as soon as this ends: a round trip
            # still in flight then lost its reply (the messages a pop had taken), the
            # reservations the user held stayed reserved until ``reserve_delay``, and a
            # store holding state of its own (a bucket store's leased buckets) kept it until
            # its lease lapsed.
            try:
                await self._in_grace(self._finish_close())
            except Exception as exc:
                # the store's close gave up too (a bucket store past its bound on a silent
                # server): raised in place of the cancellation, it swallowed the caller's
                # cancel (a TaskGroup, a shutdown timeout saw a failure where it cancelled)
                log.warning(
                    "queue %r: cancelled close: the store's close failed: %r", self.name, exc
                )
            raise

    async def _in_grace(self, rest: Coroutine[Any, Any, None]) -> asyncio.CancelledError | None:
        """Run ``rest`` of a cancelled close, then close the store. Bounded: past
        ``CANCELLED_CLOSE_GRACE`` (a server that does not answer), or cancelled again, the
        rest is given up (the cancellation that did it is returned), but the store still
        closes."""
        try:
            async with asyncio.timeout(CANCELLED_CLOSE_GRACE):
                await rest
        except (Exception, asyncio.CancelledError) as exc:
            for coalescer in self._coalescers():
                coalescer.cancel_batches()  # not waited for any more (see wait_idle)
            for task in self._background:
                task.cancel()  # nor these
            log.warning(
                "queue %r: cancelled close given up (%r): round trips in flight may"
                " lose their replies, reservations not given back come back when they"
                " expire",
                self.name,
                exc,
            )
            given_up = exc if isinstance(exc, asyncio.CancelledError) else None
        else:
            given_up = None
        try:
            await self._store.close()
        except Exception as exc:
            # the close counts as failed, cancelled or not: run again by the next one (the
            # factory's ask for the name, its close), else the store stayed open for good
            self._closing.store_failed()
            if given_up is None:
                raise
            # cancelled again: the cancellation is the answer, not the store's failure
            log.warning("queue %r: cancelled close: the store's close failed: %r", self.name, exc)
        return given_up

    async def _stop_consumers(self) -> None:
        """Stop every consumer, side by side: their in-flight handlers finish and acknowledge.
        A cancellation (a shutdown timeout, a second Ctrl-C) reaches every consumer's stop,
        each of which then gives back what it holds: one after the other, it reached only
        the stop under way, and the consumers after it were never stopped (their handlers
        ran on over the closed queue, their messages reserved until ``reserve_delay``)."""
        consumers = list(self._consumers)
        if not consumers:
            return
        stops = await asyncio.gather(*(c.stop() for c in consumers), return_exceptions=True)
        for outcome in stops:
            if isinstance(outcome, Exception):
                raise outcome

    async def _close_steps(self) -> None:
        # nothing is pushed on a schedule into a closing queue
        await asyncio.gather(*(repeater.stop() for repeater in list(self._repeaters)))
        # their in-flight handlers finish and acknowledge first (consume() is refused now)
        await self._stop_consumers()
        await self._finish_close()

    async def _finish_close(self) -> None:
        """The close once the consumers are stopped: refuse calls, let those in flight end,
        give back what nobody acknowledged, close the store. Run again by a close cancelled
        midway (see ``_close``): each step picks up where the cancelled one stopped."""
        if not self._closed:
            await self.drain()
            self._closed = True
            if self._due_handle is not None:
                self._due_handle.cancel()
                self._due_handle = None
            self._wakeups.announce(None)
            self._unsubscribe()
            if self._unsubscribe_grants is not None:
                self._unsubscribe_grants()
            if self._result_waits is not None:
                await self._result_waits.close()
        for coalescer in self._coalescers():
            await coalescer.wait_idle()
        # Before the background wait: what they give back goes there. A blocking caller
        # interrupted as its result came in gives it back through the loop thread, which
        # could be after the store closed (a popped message then lost). Each is dropped once
        # done: a close cancelled meanwhile runs it again in its grace.
        while True:
            while self._handovers:
                # a copy (one step in C): a caller's thread drops its own entry when it
                # takes its result, and a set changed between iter() and next() raises
                # RuntimeError
                settle = next(iter(self._handovers.copy()))
                await settle()
                self._handovers.discard(settle)
            if self._handovers_sealed:
                break
            # A caller interrupted after it took its result in hand, but before its call
            # returned, adds an entry back from its own thread, then reads this flag: either
            # it reads it unset, and the pass after this one runs its entry (added before
            # the flag was set), or it reads it set, and gives back elsewhere what this
            # close may not run (the two decide between them who does: ``aio_keuss.sync``).
            self._handovers_sealed = True
        while self._background:
            # Not gather: cancelled (a close cancelled), gather would cancel these too, and
            # a put-back among them would lose the messages it carries.
            done, _ = await asyncio.wait(self._background)
            for task in done:  # their failures were logged; seen, so asyncio does not again
                if not task.cancelled():
                    task.exception()
        # a consumer still here was cut short (its stop did not end, or abandoned handlers
        # that went on once cancelled): the messages its handlers hold are theirs still
        busy = {i for consumer in self._consumers for i in consumer.busy}
        await self._give_back(busy)
        if busy:
            self._store.keep_reserved(busy)
        await self._store.close()

    def _coalescers(self) -> tuple[Coalescer[Any, Any], ...]:
        return (
            self._inserts,
            self._gets,
            self._reserves,
            self._commits,
            self._rollbacks,
            self._moves,
        )

    # internals ------------------------------------------------------------------------

    def _on_signal(self, signal: Signal) -> None:
        kind = signal.kind
        if kind == "insert":  # one per push: told apart first
            count = signal.count
        elif kind == "grant":  # sent on its own route (``_on_grant_signal``), never here
            return
        else:
            count = None
            self._on_control_signal(kind)
        if not self._paused:
            self._wakeups.announce(count)

    def _on_grant_signal(self, signal: Signal) -> None:
        """A signal on the queue's grant route: a grant given back wakes only whom it
        concerns (``_on_grant_back``). The resyncs and wake-ups a transport sends every
        route after an outage are the queue route's business, heard there too."""
        if signal.kind == "grant":
            self._on_grant_back()

    def _on_control_signal(self, kind: str) -> None:
        """A signal other than an insert: a pause, a resume or a resync reads the paused
        flag again."""
        if kind == "pause" or kind == "resume":
            # Taken at once, then confirmed from the stored flag: signals of one process
            # may arrive out of order (each is published on its own), and a pause heard
            # after its resume left other processes' queues paused until a poll, or,
            # heard the other way round, consuming a paused queue until something made
            # them read the flag. The last signal's read sees the last change.
            self._pause_signals += 1
            self._paused = kind == "pause"
            if not self._closed:
                self._in_background(self._resync_paused())
        elif kind == "resync" and not self._closed:
            self._in_background(self._resync_paused())

    async def _resync_paused(self) -> None:
        """The paused flag read again, unless a pause or resume is heard meanwhile (it is
        newer): after one is heard (signals may arrive out of order), and after the signal
        listener was away (a pause or resume sent meanwhile went unheard: a lost insert
        costs a poll, a lost pause would cost for ever)."""
        heard = self._pause_signals
        try:
            paused = await self._stats.is_paused(self.name)
        except Exception as exc:  # the next reconnection, or a resume's poll, tries again
            log.debug("queue %r: paused flag not read again: %s", self.name, exc)
            return
        if heard != self._pause_signals or paused == self._paused:
            return
        self._paused = paused
        if not paused:
            self._wakeups.announce(None)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"queue {self.name!r} is closed")

    def _require(self, capability: str) -> None:
        if not getattr(self.capabilities, capability):
            raise NotSupportedError(f"queue {self.name!r}: this backend has no {capability}")

    def _in_background(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class Closing:
    """The close of a queue or a factory: begun by its first caller, joined by the others.

    The caller that began it waits on it directly: its cancellation (a shutdown timeout, a
    second Ctrl-C) cancels the close, which stops the consumers at once, as a cancelled
    ``stop`` does, rather than leave it going on in the background. Other callers wait
    shielded, and return if the close ends cancelled by the one that began it. A close
    nobody waits for (a handler began it) logs its failure."""

    def __init__(self, what: str) -> None:
        self._what = what
        self.task: asyncio.Task[None] | None = None
        self._awaited = False  # a caller waits for it (and gets its failure)
        self._store_failed = False  # see ``store_failed``

    @property
    def under_way(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def failed(self) -> bool:
        """Whether it ended raising (its server away), or cancelled once its store's close
        had failed (see :meth:`store_failed`): a close called again runs again."""
        task = self.task
        if task is None or not task.done():
            return False
        if task.cancelled():
            return self._store_failed
        return task.exception() is not None

    def store_failed(self) -> None:
        """The store's close failed in a cancelled close's grace: only logged there (the
        cancellation is what its caller hears), so the close ended cancelled and, the queue
        counting as closed, nothing ran it again; the store's unwritten state (a bucket
        store's leased buckets, its oks) stayed out of every process's reach until its
        lease lapsed."""
        self._store_failed = True

    def begin(self, close: Coroutine[Any, Any, None]) -> None:
        self._awaited = False  # (begun again after a failure: by a handler, nobody waits)
        self._store_failed = False
        self.task = asyncio.get_running_loop().create_task(close)
        self.task.add_done_callback(self._ended)

    async def wait(self, owner: bool) -> None:
        closing = self.task
        assert closing is not None
        self._awaited = True
        if owner:
            await closing
            return
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if closing.cancelled() and (task is None or not task.cancelling()):
                return  # its owner's cancellation, not ours
            raise

    def _ended(self, closing: asyncio.Task[None]) -> None:
        if closing.cancelled():
            return
        exc = closing.exception()  # retrieved: a close a handler began may be awaited by nobody
        if exc is not None and not self._awaited:
            log.warning("%s: close failed: %r", self._what, exc)


def _failure_logged(name: str, close: asyncio.Future[None]) -> None:
    """The failure of queue ``name``'s ``close`` that its asker, cancelled, does not hear: a
    WARNING, as for a close nobody waits for (see ``Closing``)."""
    if close.cancelled():
        return
    exc = close.exception()
    if exc is not None:
        log.warning("queue %r: close failed: %r", name, exc)


def _latest_batches_first(nacks: list[Nack], size: int) -> Iterator[list[Nack]]:
    """Releases in batches of ``size``, the latest batch first, each in the order taken: a
    sharded store puts a release back in its place only where nothing is held just behind
    it, so given back earliest first, a shard's batch found the next one still held and went
    to the back of its shard."""
    for end in range(len(nacks), 0, -size):
        yield nacks[max(0, end - size) : end]


def _back_entry(s: Stored) -> Entry:
    """A popped message going back where it was: its mature time, tries, end of life and
    place kept."""
    return Entry(
        s.id,
        s.payload,
        s.headers,
        tries=s.tries,
        mature=s.mature,
        expires=s.expires,
        place=s.place,
        priority=s.priority,
    )


def _more_ready(stored: list[Stored], wanted: int, next_mature: float | None) -> bool:
    """Whether, after taking ``stored``, more messages look ready: the store's next mature
    time is (about) now, or, where a store does not tell, the batch came back full.
    A message maturing within ``CLOCK_SLACK`` counts as ready (the stores give the time left
    by the server's clock, made a time on ours): at worst one more consumer wakes early."""
    if next_mature is None:
        return len(stored) == wanted
    return next_mature <= time.time() + CLOCK_SLACK


def _earliest(entries: Sequence[Entry]) -> float:
    """When the first of these inserted entries matures (a push's own, or a bulk load's,
    without a loop, nor making its entries)."""
    if type(entries) is BulkLoad:
        return time.time() + entries.delay
    if len(entries) == 1:
        first = entries[0]
        return first.mature if first.mature is not None else time.time() + first.delay
    now = time.time()
    return min(e.mature if e.mature is not None else now + e.delay for e in entries)


def _listed(value: object) -> bool:
    """A sequence of items (a list, a tuple), not text or bytes, which are sequences too; a
    set, a dict or a generator is not one (no defined order, or not items)."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


def _entry_bytes(entries: Sequence[Entry]) -> int:
    """Payload and header bytes of one push's entries (the store's insert bound)."""
    return sum(len(e.payload) + len(e.headers) for e in entries)


def _move_bytes(move: Move) -> int:
    """Bytes a move sends: its new payload (a kept payload is copied by the server)."""
    return len(move.payload) if move.payload is not None else 0


def _split(requests: Sequence[Sequence[Any]], flags: list[bool]) -> list[list[bool]]:
    """The flags of a batch made of several callers' lists, one list per caller."""
    if len(requests) == 1:
        return [flags]
    if len(flags) == len(requests):  # one item per request (push, ok): no slicing
        return [[flag] for flag in flags]
    results, start = [], 0
    for request in requests:
        results.append(flags[start : start + len(request)])
        start += len(request)
    return results


def _share(requests: list[int], fetched: Fetched) -> list[FetchResult]:
    """Hand a batch's messages to the requests in order; all see the same next mature."""
    if len(requests) == 1:  # a call of its own (a free slot's): nothing to cut
        return [(fetched.messages, fetched.next_mature)]
    results, start = [], 0
    for wanted in requests:
        results.append((fetched.messages[start : start + wanted], fetched.next_mature))
        start += wanted
    return results


def _target(message: Message | str) -> tuple[str, int | None, str | None]:
    """(id, tries, token) of what to acknowledge; tries and the store's token of the
    reservation (where it gave one) guard against a stale holder. A Message may be built by
    hand: its id and tries are checked like an id given as a str (it has no token)."""
    if isinstance(message, Message):
        return check_known_id(message.id), check_tries(message.tries), message._token
    if isinstance(message, str):
        return check_known_id(message), None, None
    raise InvalidIdError(f"expected a Message or a message id, not {type(message).__name__}")


class _ConsumerLink:
    """The queue as its consumers see it (:class:`aio_keuss.consumer.Source`)."""

    __slots__ = ("_queue", "lost_since")

    lost_since: Callable[[float], bool]
    """The store's own (``Store.lost_since``): called for every prefetched message handed
    out, with no frame of ours in between."""

    def __init__(self, queue: Queue) -> None:
        self._queue = queue
        self.lost_since = queue._store.lost_since

    @property
    def name(self) -> str:
        return self._queue.name

    @property
    def capabilities(self) -> Capabilities:
        return self._queue.capabilities

    @property
    def reserve_delay(self) -> float:
        return self._queue.options.reserve_delay

    @property
    def paused(self) -> bool:
        return self._queue._paused

    @property
    def keeps_results(self) -> bool:
        return self._queue._result_writes is not None

    async def next(
        self,
        outage: Outage,
        n: int,
        gather: bool = False,
        kept: dict[str, Stored] | None = None,
        timeout: float | None = None,
    ) -> list[Message]:
        return await self._queue._next(timeout, outage, n, gather, kept)

    def ok(self, message: Message, value: Any = NO_RESULT) -> Awaitable[bool]:
        queue = self._queue
        if value is NO_RESULT or queue._result_writes is None:  # (no frame more then)
            return queue.ok(message)
        return queue._ok_handled(message, value)

    def ok_many(
        self, messages: list[Message], values: list[Any] | None = None
    ) -> Awaitable[list[bool]]:
        queue = self._queue
        if values is None or queue._result_writes is None:
            return queue.ok_many(messages)
        return queue._ok_many_handled(messages, values)

    def ko(
        self, message: Message, delay: float | None, failure: str | None = None
    ) -> Awaitable[KoResult]:
        return self._queue._ko(message, delay, failure, keep=failure is not None)

    def keep(
        self, messages: list[Message], value: Any, failure: str | None
    ) -> Awaitable[None] | None:
        queue = self._queue
        if queue._result_writes is None or (value is NO_RESULT and failure is None):
            return None
        return queue._keep_popped(messages, value, failure)

    def extend_many(self, messages: list[Message]) -> Awaitable[list[bool]]:
        return self._queue.extend_many(messages)

    def release(self, messages: list[Message], *, unseen: bool = False) -> Awaitable[None]:
        return self._queue._release_all(messages, unseen=unseen)

    def put_back(
        self,
        messages: list[Message],
        kept: Mapping[str, Stored] | None = None,
        retry_for: float = 0.0,
    ) -> Awaitable[None]:
        return self._queue._put_back_unhandled(messages, kept, retry_for)

    def handler_failed(self, message: Message, exc: Exception) -> None:
        self._queue._handler_failures.report(message, exc)

    def rate_limited(self, messages: list[Message], seconds: object) -> Awaitable[bool]:
        return self._queue._rate_limited(messages, seconds)

    def stopped(self, consumer: Consumer) -> None:
        self._queue._consumers.discard(consumer)
        self._queue._handler_failures.flush()

    # cancelling

    @property
    def hears_cancels(self) -> bool:
        return self._queue._result_store is not None

    @property
    def polls_cancels(self) -> bool:
        return self._queue._result_writes is not None

    def subscribe_cancels(self, listener: Callable[[Signal], None]) -> Callable[[], None]:
        return self._queue._signal.subscribe_cancels(self._queue.name, listener)

    async def cancel_requests(self, ids: list[str]) -> list[str]:
        return list(await self._queue._cancel_requests(ids))

    def cancelled(self, messages: list[Message], keep: bool) -> Awaitable[None]:
        return self._queue._cancelled(messages, keep)

    def use_up(self, ids: list[str], *, told_only: bool = False) -> Awaitable[list[str]]:
        return self._queue._use_up_requests(ids, told_only=told_only)
