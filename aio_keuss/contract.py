"""The contract between the generic queue layer and a database.

A :class:`Backend` is one per factory: it owns the connection (pool, client) and hands out a
:class:`Store` per queue. A Store offers *atomic, batch-shaped primitives only*: no waiting,
no stats, no signalling, no retry policy. Everything else lives once in :mod:`aio_keuss.queue`.

Adding a database means writing one module with a Backend and a Store subclass, registering
its name in :mod:`aio_keuss.registry`, and adding it to ``tests/backends.py`` so the
conformance suite runs against it. Rate limits (``Capabilities.rate_limit``) are a
backend's, not a store's: one small atomic step on one row / key / document per queue
(:meth:`Backend.rate_take`, :func:`rate_step`), which the queue layer asks before each take.

Times are float seconds since the epoch (UTC), taken from the store's own clock: a store that
lives on a server should use the server's clock so several clients agree on what is mature.
"""

from __future__ import annotations

import asyncio
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import TYPE_CHECKING, Any, ClassVar, overload

from .errors import InvalidInputError, NotSupportedError
from .message import Headers, to_datetime
from .types import Capabilities, KoResult, Sizes

if TYPE_CHECKING:
    from .options import QueueOptions
    from .results import ResultStore
    from .signal import SignalBus
    from .stats import StatsStore


PUSH_TURN = 16
"""Messages a store that never suspends inserts between two yields to the event loop."""


class LoopTurns:
    """Turns given to the event loop by a store whose insert awaits nothing (the memory
    store; buckets with ``ack_on_buffer``). Without them a producer loop (``while True: await
    q.push(x)``) holds the loop for ever: no timer fires, every other task starves. A loop
    pass per push costs about a fifth of a lone producer's rate; one per ``PUSH_TURN``
    messages is lost in the noise, and one pass is all the other tasks need to run."""

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since = 0

    def due(self, count: int) -> bool:
        """Count ``count`` messages about to be inserted; True when the caller should yield
        (``await asyncio.sleep(0)``) first, so a push cancelled there inserted nothing."""
        self._since += count
        if self._since < PUSH_TURN:
            return False
        self._since = 0
        return True

    def reset(self) -> None:
        """The caller suspended anyway: the count starts again."""
        self._since = 0


@dataclass(slots=True)
class Entry:
    """A message to insert.

    ``dedup`` is set when the id came from the user: the store then refuses the entry while
    a message with that id is queued or was pushed within the queue's dedup window.
    ``mature`` (absolute) overrides ``delay``; it is used to put back a popped message whose
    caller was cancelled, keeping its place in the queue, ``expires`` the end of life it
    had there and ``place`` where the store had it (see :attr:`Stored.expires` and
    :attr:`Stored.place`).

    A store may replace ``id`` of an entry without ``dedup`` during ``insert`` (a bucket store
    encodes bucket and slot in it); the queue layer reads the ids back after the insert.

    ``priority`` is non-zero only for a store with ``capabilities.priority`` (the queue
    layer refuses it elsewhere): of the messages mature, the store hands out the highest
    priority first, and keeps it through reservations, ko's, moves and the deadletter.
    """

    id: str
    payload: bytes
    headers: bytes
    delay: float = 0.0
    tries: int = 0
    dedup: bool = False
    mature: float | None = None
    expires: float | None = None
    place: int | None = None
    priority: int = 0


class BulkLoad(Sequence[Entry]):
    """The entries of one ``push_many(..., ids=...)`` (a Spark write): every id the user's,
    one headers and one delay for all, none a put-back. Kept as its columns (:attr:`ids`,
    :attr:`payloads`): a store sending the batch as columns takes them as they are, and the
    :class:`Entry` objects are made only if something asks for them (a store that inserts
    entry by entry, a batch coalesced with others). Making them cost more client time than
    the rest of a bulk load's queue layer (14 % of a Spark write task's instructions,
    counted with callgrind), and a store that sends columns never looks at them. A slice is
    a bulk load of the sliced columns (``max_batch`` pieces stay columns)."""

    __slots__ = ("_entries", "delay", "headers", "ids", "payloads", "priority")

    def __init__(
        self,
        ids: list[str],
        payloads: list[bytes],
        headers: bytes,
        delay: float,
        priority: int = 0,
    ):
        self.ids = ids
        self.payloads = payloads
        self.headers = headers
        self.delay = delay
        self.priority = priority
        self._entries: list[Entry] | None = None

    @property
    def entries(self) -> list[Entry]:
        """The entries, made once (a store may change what it is handed: it is kept)."""
        if self._entries is None:
            entries: Iterable[Entry] = map(
                Entry,
                self.ids,
                self.payloads,
                repeat(self.headers),
                repeat(self.delay),
                repeat(0),
                repeat(True),
            )
            if self.priority:
                entries = (_prioritized(entry, self.priority) for entry in entries)
            self._entries = list(entries)
        return self._entries

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> Entry: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Entry]: ...

    def __getitem__(self, index: int | slice) -> Entry | Sequence[Entry]:
        if isinstance(index, slice):
            if self._entries is not None:
                return self._entries[index]
            return BulkLoad(
                self.ids[index], self.payloads[index], self.headers, self.delay, self.priority
            )
        return self.entries[index]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def __repr__(self) -> str:
        return f"<BulkLoad of {len(self.ids)} entries>"


def _prioritized(entry: Entry, priority: int) -> Entry:
    entry.priority = priority
    return entry


def bulk_columns(entries: Sequence[Entry]) -> tuple[list[str], list[bytes]] | None:
    """The ids and payloads of entries that differ only in those, every id the user's, none
    a put-back nor given a priority (a :class:`BulkLoad`, or several coalesced that are
    alike); else None. A store may send such a batch as two columns rather than one record
    per entry, with the headers and delay of :func:`bulk_head`."""
    if type(entries) is BulkLoad:
        return (entries.ids, entries.payloads) if entries and not entries.priority else None
    if not entries:
        return None
    first = entries[0]
    headers, delay = first.headers, first.delay
    if all(
        e.dedup
        and e.mature is None
        and e.tries == 0
        and e.priority == 0
        and e.delay == delay
        and e.headers == headers
        for e in entries
    ):
        return [e.id for e in entries], [e.payload for e in entries]
    return None


def bulk_head(entries: Sequence[Entry]) -> tuple[bytes, float]:
    """The headers and delay every entry of a batch :func:`bulk_columns` took shares (read
    from a :class:`BulkLoad` without making its entries)."""
    if type(entries) is BulkLoad:
        return entries.headers, entries.delay
    return entries[0].headers, entries[0].delay


@dataclass(slots=True)
class Stored:
    """A message as a store hands it out: payload and headers still encoded."""

    id: str
    payload: bytes
    headers: bytes
    tries: int
    mature: float
    expires: float | None = None
    """End of life (absolute), where the store gives messages one (a message TTL counted
    from the push): a put-back keeps it."""
    place: int | None = None
    """Where the store had it, where a put-back needs it to go back to its place: a
    sharded shard's order number of the record (None elsewhere)."""
    token: str | None = None
    """What names this one reservation, where the store has such a thing (a reserve's own
    random mark); None elsewhere. Opaque to the queue layer, which hands it back with the
    holder's :class:`Ack`, :class:`Nack` or :class:`Move`: the count of tries alone does
    not tell two reservations apart once a give-back took a try back."""
    priority: int = 0
    """What it was pushed with (0 where the store has no ``capabilities.priority``)."""


Cursor = tuple[float, str]


def check_seq_cursor(cursor: Cursor | None) -> Cursor | None:
    """``Store.check_cursor`` for a store whose cursor is (sort time, sequence number): the
    second part the decimal digits of a 64-bit sequence number (a rowid, a bigint)."""
    if cursor is not None:
        seq = cursor[1]
        if not (seq.isascii() and seq.isdigit() and int(seq) < 2**63):
            raise InvalidInputError(f"not a cursor from browse / history here: {cursor!r}")
    return cursor


"""Where a walk over a queue stands: (sort time, tie-breaker) of the last message it saw.
Stores walk a queue in the order of their own index: the sort time is the mature time, or
the reservation deadline of a reserved message; the tie-breaker is the id, or whatever the
store orders equal times by (a sequence number, a position in a list)."""


@dataclass(slots=True)
class Peeked:
    """A message a store shows without handing it out.

    ``state`` is one of :class:`aio_keuss.types.State`'s values; ``at`` the mature time,
    reservation deadline or processed time that goes with it.
    """

    message: Stored
    state: str
    at: float


@dataclass(frozen=True, slots=True)
class Held:
    """What :meth:`Store.hold` hands its holder for one message: what a reserve would hand
    out, the ``tries`` and, where the store has one, the reservation's :attr:`Stored.token`,
    both presented again with the :class:`Move` (or :class:`Ack`) that follows. The count
    alone did not tell the hold from another consumer's take of the message once the hold
    had lapsed (a take that counts no try, a give-back that took its try back)."""

    tries: int
    token: str | None = None


@dataclass(slots=True)
class PeekPage:
    """Up to ``limit`` messages past a cursor, and the cursor after them (None: the walk is
    over). A store may return fewer than ``limit`` (even none) with a cursor, when it bounds
    how much it scans per call (filtering by state over a mixed index); the caller goes on."""

    rows: list[Peeked]
    cursor: Cursor | None


@dataclass(slots=True)
class Fetched:
    """The result of a get / reserve.

    ``next_mature`` is the earliest mature time among what is left, active reservations
    included (their mature time is their deadline), so the wait loop can sleep exactly until
    something could become deliverable without another round trip.
    """

    messages: list[Stored]
    next_mature: float | None


FinishedDeadletters = Callable[[str, int, list[str]], None]
"""Told of deadletter moves a store finished by itself: (deadletter queue, count, the ids
of the messages moved); see ``Store.on_finished_deadletter``."""

OneTake = tuple[
    Callable[[], "asyncio.Future[Any] | None"],
    Callable[[Any], tuple[list[Stored], float | None]],
]
"""A store's one-message get or reserve: see ``Store.one_take``."""
OneCommit = tuple[Callable[[str, int | None], "asyncio.Future[Any] | None"], Callable[[Any], bool]]
"""A store's one-message commit: see ``Store.one_commit``."""
OneInsert = tuple[Callable[["Entry"], "asyncio.Future[Any] | None"], Callable[[Any], bool]]
"""A store's one-message insert: see ``Store.one_insert``."""


@dataclass(slots=True)
class Ack:
    """Commit of a reservation.

    ``tries`` is what the holder was given; when set, the store commits only if the message
    is still reserved with that same count, so a consumer whose reservation expired and was
    handed to someone else cannot delete the other consumer's message. ``token`` is the
    :attr:`Stored.token` of the reservation, where the store gave one: when set, the store
    commits only that reservation. A give-back takes its try back, so the next reservation,
    another consumer's, has the count the first holder had: only the token tells a late or
    repeated request of the first holder from one of the second.
    """

    id: str
    tries: int | None = None
    token: str | None = None


@dataclass(slots=True)
class Nack:
    """Rollback of a reservation. ``count_try`` is false when the message goes back unseen
    (its consumer was cancelled before it got it), so it costs no try. Guarded as
    :class:`Ack` is, ``token`` included."""

    id: str
    tries: int | None
    delay: float
    count_try: bool = True
    token: str | None = None


@dataclass(slots=True)
class Extend:
    """Push the end of a reservation its holder still has to ``seconds`` from now.

    The guard is the one of :class:`Ack`: with ``tries`` set, only while the message is
    still reserved with that count, so a holder whose reservation lapsed and was handed to
    another consumer cannot take it back. A reservation that lapsed but that nobody took
    since is still the holder's, and is extended (the message was not delivered again)."""

    id: str
    tries: int | None
    seconds: float
    token: str | None = None
    """The reservation's :attr:`Stored.token`, as for :class:`Ack`."""


@dataclass(slots=True)
class Move:
    """Take a held message out of this queue and put it into ``queue``, atomically.

    The guard is the one of :class:`Ack`: with ``tries`` set, only while the message is
    still reserved with that count (and under ``token``, when set). In ``queue`` it starts
    over (tries 0), due after ``delay``, with ``payload`` instead of its own when given
    (already encoded), and the ``headers`` merged into its own, each key stored once (a
    repeated key takes the new value; appended, they grew with every pass of a cycle).
    Its id is kept unless ``queue`` already holds one like it; then
    :func:`moved_id` names it, with ``tag``.
    """

    id: str
    tries: int | None
    queue: str
    payload: bytes | None = None
    headers: Headers = field(default_factory=dict)
    delay: float = 0.0
    tag: str = "mv"
    token: str | None = None


@dataclass(frozen=True, slots=True)
class Amend:
    """Change a waiting message where it stands (BullMQ's ``promote``, ``changeDelay``,
    ``changePriority``): one that is in its queue and not under an active reservation (the
    rule of :meth:`Store.remove`). Its id, payload, headers and tries stay.

    ``delay``: it matures ``delay`` seconds from now, on the store's clock (None: its
    mature time stays). With ``scheduled_only`` the change applies only to a message whose
    mature time is still ahead (a promote: ``delay`` 0 makes it ready now). ``priority``:
    its new priority (None: it stays); within its priority it keeps its place by mature
    time and push order, as if pushed with it."""

    id: str
    delay: float | None = None
    priority: int | None = None
    scheduled_only: bool = False


MOVE_TAG = "mv"
"""The tag of a message renamed by :meth:`Store.move` called from ``Queue.move``."""
PUT_BACK_TAG = "pb"
"""The tag of a popped message put back (its caller never got it) whose id was taken
meanwhile: past its dedup window, pushed again."""
MAX_RENAMES = 100
"""Names a put-back tries (``<id>.pb`` to ``<id>.pb.100``) before it gives up."""


def deadletter_tag(failed_deliveries: int) -> str:
    """The tag of a deadlettered message: ``dl`` and its failed-delivery count."""
    return f"dl{failed_deliveries}"


def position_cursor(cursor: Cursor | None, sections: tuple[str, ...]) -> Cursor | None:
    """Check a cursor that is a position in a list (``(offset, section)``, as the list-based
    Redis stores walk), so that a made-up one cannot send a script counting from a
    fraction (the queue layer has bounded it: every whole number up to there is exact)."""
    if cursor is None:
        return None
    offset, section = cursor
    if not offset.is_integer() or section not in sections:
        raise InvalidInputError(f"not a cursor from browse / history of this queue: {cursor!r}")
    return cursor


def moved_id(message_id: str, tag: str, clash: int) -> str:
    """The id a moved message takes in a queue that already holds ``clash`` messages
    named like it: its own id first, then ``<id>.<tag>``, then ``<id>.<tag>.2``,
    ``<id>.<tag>.3``, ... Every store follows this rule, in Python, Lua or SQL, so a
    message deadlettered in three lives is named the same on every backend."""
    if clash == 0:
        return message_id
    if clash == 1:
        return f"{message_id}.{tag}"
    return f"{message_id}.{tag}.{clash}"


@dataclass(frozen=True, slots=True)
class DeadletterPlan:
    """Policy values the queue layer hands a store so it can deadletter in its rollback.

    A ko whose failed-delivery count (stored tries + 1) exceeds ``max_ko`` is a
    :class:`Move` of the message to ``queue`` with the headers from :meth:`headers` and the
    tag from :func:`deadletter_tag`: a store deadletters through the same body as its
    :meth:`Store.move`, in the same atomic step as the rollback of the others.
    """

    max_ko: int
    queue: str
    from_queue: str

    def headers(self, failed_deliveries: int, now: float) -> Headers:
        return {
            "x-dl-from-queue": self.from_queue,
            "x-dl-t": to_datetime(now).isoformat(),
            "x-dl-tries": failed_deliveries,
        }


class Store(ABC):
    """Atomic primitives over one queue. Every method takes and returns a batch."""

    batch_concurrency: ClassVar[int] = 1
    """How many coalesced batches of one kind may be in flight at once on this store."""

    run_in_caller: bool = False
    """True when a call that finds a free slot should run at once in its caller's task (see
    ``coalesce.py``): right where round trips pipeline on one connection or the answer comes
    from memory; wrong where every call costs a durable commit, which batching shares
    (PostgreSQL, MongoDB)."""

    uninterruptible: bool = False
    """True when the primitives await nothing but replies that refuse cancellation (or
    nothing at all): a cancelled caller's pop / reserve then still completes, and the queue
    puts back what it took, so it may run in the caller's own task (see ``coalesce.py``)."""

    max_message_bytes: int | None = None
    """Most bytes (encoded payload and headers) one message may have in this store, or None
    for no bound of its own. The queue refuses a larger one with ``InvalidPayloadError``
    before anything is written (a store that packs many messages in one storage unit has a
    bound the database sets on that unit)."""

    max_insert_bytes: int | None = None
    """Most payload and header bytes one ``insert`` should carry, or None for no bound: the
    queue then hands concurrent pushes to the store in several calls, split between callers,
    so that a call failing fails only the callers in it (a store that splits a larger batch
    itself would fail every caller of the batch, those it had stored included, and their
    retry would store them twice). One push larger than this still goes in one call. Moves
    carrying new payloads are bounded the same way."""

    message_ttl: float | None = None
    """Seconds a message lives from its push where the store ends messages of its own accord
    (the sharded backends' ``message_ttl``), or None: it is never delivered past that, even
    if its delay kept it scheduled until then, so a repeat pushes its occurrences late
    enough to outlive their time."""

    def __init__(self, name: str, options: QueueOptions) -> None:
        self.name = name
        self.options = options

    @abstractmethod
    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        """Insert in order; one flag per entry, false where the dedup window refused it."""

    async def get(self, n: int) -> Fetched:
        """Remove and return up to ``n`` mature messages, earliest mature first (pop)."""
        raise NotSupportedError(f"{type(self).__name__} has no pop")

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        """Reserve up to ``n`` mature messages until now + ``reserve_delay`` (store clock).

        A message whose earlier reservation expired counts that delivery as a try.
        """
        raise NotSupportedError(f"{type(self).__name__} has no reserve")

    def one_take(self, reserve_delay: float | None) -> OneTake | None:
        """Optional: a one-message get (``reserve_delay`` None) or reserve the queue can
        send without a coroutine around it, made once per queue, as (send, read). ``send()``
        sends the request at once and returns the future of its reply, or None when it
        cannot send now (not connected yet: the queue then calls ``get`` / ``reserve``);
        ``read(reply)`` is what ``get(1)`` / ``reserve(1, ...)`` would have returned, as
        ``(messages, next_mature)``. None here: the store has no such call.

        Only for an ``uninterruptible`` store whose reply futures refuse cancellation, or
        are plain futures whose store gives, once one is cancelled with its caller, the
        future that gets its reply (``coalesce.LATE_REPLIES``; a plain future costs its
        awaiter less): the queue awaits the future directly, and a caller cancelled before
        or once the reply is in still has what was taken put back. No coroutine then runs
        between a pop and its reply, a cost a busy queue otherwise pays on every message."""
        return None

    def one_commit(self) -> OneCommit | None:
        """Optional, as :meth:`one_take`: (send, read) of the commit of one reservation;
        ``send(id, tries)`` is ``commit([Ack(id, tries)])`` sent at once, ``read(reply)``
        the flag ``commit`` would give it. Never used for a reservation with a
        :attr:`Stored.token` (the call carries none): those go through :meth:`commit`."""
        return None

    def one_insert(self) -> OneInsert | None:
        """Optional, as :meth:`one_take`: (send, read) of the insert of one entry (a push);
        ``send(entry)`` returns None also for an entry the store inserts otherwise, and
        ``read(reply)`` is the flag ``insert`` would give it."""
        return None

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        """Delete reserved messages; false for unknown, unreserved or stale ones."""
        raise NotSupportedError(f"{type(self).__name__} has no reserve")

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        """Release reservations after their delay, or move them to the deadletter queue."""
        raise NotSupportedError(f"{type(self).__name__} has no reserve")

    def lost_since(self, taken: float) -> bool:
        """Optional, where reservations do not expire one by one (``reservation_expiry``
        false) but all of a consumer's at once (its heartbeat lapsed): whether those taken
        at ``taken`` (``time.monotonic()``, when the reserve was sent) may have been lost
        since, to be delivered to another consumer. A consumer then gives back, rather than
        starts, what it prefetched then. False here: nothing lapses but by expiry."""
        return False

    async def extend(self, extends: Sequence[Extend]) -> list[bool]:
        """Optional (``Capabilities.extend``): reservations their holders still hold last
        until now + each one's ``seconds``; false for unknown, unreserved or stale ones.
        What a consumer's handler that runs longer than ``reserve_delay`` needs, so that
        its message is not delivered to a second consumer meanwhile (as BullMQ renews a
        job's lock, or SQS's ChangeMessageVisibility extends a receipt)."""
        raise NotSupportedError(f"{type(self).__name__} cannot extend a reservation")

    def on_visible(self, listener: Callable[[float], None]) -> None:
        """For stores that acknowledge inserts before other processes can see them
        (``ack_on_buffer``): ``listener(earliest mature)`` is called once they can, so the
        queue signals other processes then. Others ignore it: an acknowledged insert is
        visible everywhere, and the queue signals at acknowledgement."""

    def on_deadletter(self, plan: DeadletterPlan | None) -> None:
        """The queue's deadletter policy, told once: for stores that may have to finish a
        deadletter move another process began (see the bucket stores), with no ko of
        their own to carry it. Others ignore it: each ko brings the plan it needs."""

    def on_finished_deadletter(self, listener: FinishedDeadletters) -> None:
        """For stores that finish deadletter moves another process began (see
        :meth:`on_deadletter`): ``listener(deadletter queue, count, ids)`` (the ids of the
        messages moved, whose failure a queue keeping results keeps) once such copies are
        written and their slots marked, so the queue counts and signals them as it does
        after a ko that deadlettered (no ko of its own answers for them). Others ignore it."""

    def on_orphaned_insert(self, listener: Callable[[int, float], None]) -> None:
        """For stores whose insert a cancelled caller may leave while its messages are still
        written (a write shared by several callers goes on without the one cancelled):
        ``listener(count, earliest mature)`` once they are, so the queue counts and signals
        them as it does when an insert returns. Others ignore it: their insert either ran
        to its end (the queue counts it then) or was interrupted with the caller."""

    def default_ko_delay(self, tries: int | None) -> float:
        """Delay of a ko that gave none (``tries``: the holder's count, if known). Immediate
        here; bucket stores use Keuss's ``reject_delta_base + reject_delta_factor * tries``."""
        return 0.0

    async def remove(self, ids: Sequence[str]) -> list[bool]:
        """Delete messages that are not under an active reservation."""
        raise NotSupportedError(f"{type(self).__name__} has no remove")

    async def amend(self, amends: Sequence[Amend]) -> list[bool]:
        """Optional (``Capabilities.reschedule``): apply each :class:`Amend`, atomically per
        message, in one round trip; True for each message that was waiting (and, with
        ``scheduled_only``, scheduled) and is now changed."""
        raise NotSupportedError(f"{type(self).__name__} cannot change waiting messages")

    async def move(self, moves: Sequence[Move]) -> list[str | None]:
        """Move held messages to other queues of this backend, each atomically (see
        :class:`Move`): per move, the id the message now has there, or None when it was not
        held (as guarded) and nothing was done. A store that cannot do it atomically keeps
        this default and its backend leaves ``Capabilities.move`` false."""
        raise NotSupportedError(f"{type(self).__name__} has no move")

    # looking without taking (Capabilities.peek / hold / history) ----------------------

    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        """Messages in ``state`` (``ready``, ``scheduled``, ``reserved`` or ``all``) past
        ``after`` in (sort time, id) order, at most ``limit``, changing nothing. A message
        that changes state during a walk may be seen twice or not at all; each row is true
        at the moment it was read."""
        raise NotSupportedError(f"{type(self).__name__} cannot peek")

    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        """Where each message is (a processed one too, on a history store), None if gone."""
        raise NotSupportedError(f"{type(self).__name__} cannot peek")

    tells_queued: bool = False
    """True when :meth:`queued` answers though the store cannot :meth:`locate` (no
    ``Capabilities.peek``): it can tell a message still in the queue from one gone, without
    showing it. Where there is peek, :meth:`queued` answers from :meth:`locate`."""

    async def queued(self, ids: Sequence[str]) -> list[bool]:
        """Whether each message is still in the queue, not processed (a cancel request may
        still reach it, a result may still come for it), in one round trip."""
        return [row is not None and row.state != "processed" for row in await self.locate(ids)]

    async def hold(self, ids: Sequence[str], reserve_delay: float) -> list[Held | None]:
        """Reserve these messages, if not under an active reservation, until now +
        ``reserve_delay``: per id what a holder presents to :meth:`move` / :meth:`commit`
        (what :meth:`reserve` would hand out: tries, and token), or None when it is missing
        or held."""
        raise NotSupportedError(f"{type(self).__name__} cannot hold by id")

    async def history(
        self, since: float, until: float, after: Cursor | None, limit: int
    ) -> PeekPage:
        """Consumed messages kept by a history store, processed in [since, until), in
        (processed time, id) order past ``after``."""
        raise NotSupportedError(f"{type(self).__name__} keeps no history")

    def check_cursor(self, cursor: Cursor | None) -> Cursor | None:
        """Refuse, with :class:`InvalidInputError`, a cursor this store's :meth:`peek` or
        :meth:`history` never returned and would misread. The queue layer has already
        checked what every store needs (a time in range, a UTF-8 str); a (sort time, id)
        cursor needs nothing more, a store whose cursor means something else says so."""
        return cursor

    @abstractmethod
    async def sizes(self) -> Sizes: ...

    @abstractmethod
    async def next_mature(self) -> float | None:
        """Earliest mature time in the queue, active reservations included."""

    async def flush(self) -> None:
        """Write out anything buffered (bucket stores); others have nothing to do."""

    def keep_reserved(self, ids: Iterable[str]) -> None:
        """Before ``close``: the reservations of ``ids`` are still held by handlers that run
        on (abandoned by their consumer's stop). A store whose close gives back what it
        holds must leave these to come back when they expire, as a crash would: given back
        at once, another consumer would handle them while those handlers still run. The
        others keep every reservation through their close anyway."""

    async def close(self) -> None:
        """Release per-queue resources; the backend owns the connection."""


RATE_SLACK = 1e-6
"""Seconds of rounding a limiter forgives: a grant that falls due at a time computed from
the limiter's own answer is granted then, not a float's rounding later."""


@dataclass(frozen=True, slots=True)
class RateRule:
    """A queue's rate limit, as its options give it: ``limit`` grants per ``period``
    seconds, at most ``burst`` at once."""

    limit: int
    period: float
    burst: int

    @property
    def interval(self) -> float:
        """Seconds between two grants at the steady rate (GCRA's emission interval)."""
        return self.period / self.limit


@dataclass(frozen=True, slots=True)
class RateState:
    """What a backend keeps per rate-limited queue (one row, key or document).

    ``tat``: GCRA's theoretical arrival time, epoch seconds on the backend's clock: a
    grant is due while ``now >= tat - (burst - 1) * interval``. ``until``: deliveries are
    held until then (a handler's :class:`aio_keuss.RateLimited`). A state whose both times
    are past is the same as none: a backend may let it expire then. ``refused``: how many
    takes it refused (granted fewer than asked) since it was made, which tells a take that
    gives grants back whether another was refused since it took them (see
    :attr:`RateGrant.refused`); it restarts from 0 with a state expired, when no take is out.
    """

    tat: float = 0.0
    until: float = 0.0
    refused: int = 0


@dataclass(frozen=True, slots=True)
class RateGrant:
    """A limiter's answer: ``granted`` of the count asked, and ``wait``, the seconds (by the
    backend's clock, from the call) until the next grant falls due; 0 when one is due
    already."""

    granted: int
    wait: float
    end: float = math.inf
    """The limiter's ``tat`` after the step (epoch seconds, the backend's clock): the end of
    the time its grants took up, which a give-back of them brings back (see
    :func:`rate_step`)."""
    refused: int = 0
    """The limiter's count of refused takes after the step (:attr:`RateState.refused`): a
    give-back that answers another count than its take did came after a refusal, and only
    then is there a consumer for it to tell (``Queue._limited``)."""


def rate_step(
    state: RateState,
    now: float,
    rule: RateRule,
    count: int,
    hold: float,
    end: float = math.inf,
) -> tuple[RateState, RateGrant]:
    """The one atomic step of a backend's :meth:`Backend.rate_take`, in Python: the memory
    backend runs it as it is, so does SQLite's inside a write transaction
    (``aio_keuss.sqlite.limiter``), the others port it to their database (the Redis one in
    Lua, ``aio_keuss.redis.limiter``), as one read-modify-write of the queue's state, ``now``
    read from the database's own clock within the same step.

    - ``hold > 0`` first pushes ``until`` to at least ``now + hold``;
    - ``count > 0`` takes up to ``count`` grants, none while held: each moves ``tat`` one
      interval on, from ``now`` at the earliest (an idle limiter grants a full burst);
    - ``count < 0`` gives ``-count`` unused grants back, ``end`` the one the take's answer
      gave: they took up the intervals before it, and only the part of those still ahead
      of ``now`` comes back (``tat`` moves back as much, to ``now`` at the latest: never
      before, that would lend grants the limiter never had). Given back late (a slow take
      between), the part gone by was spent: the step moved ``tat`` on since for the takes
      made meanwhile, and taking every interval off its end lent their grants a second
      time. Only ever what a take of the same caller granted.

    A take granted fewer than its ``count`` counts one refusal more (``refused``).
    """
    interval = rule.interval
    until = max(state.until, now + hold) if hold > 0 else state.until
    tat = max(state.tat, now)
    granted = 0
    refused = state.refused
    if count > 0 and now >= until:
        due = math.floor((now + rule.burst * interval - tat) / interval + RATE_SLACK)
        granted = max(0, min(count, due))
        tat += granted * interval
    elif count < 0:
        tat = max(tat - min(-count * interval, max(0.0, end - now)), now)
    if granted < count:
        refused += 1
    wait = max(0.0, until - now, tat - (rule.burst - 1) * interval - now)
    return RateState(tat, until, refused), RateGrant(granted, wait, tat, refused)


class LocalRates:
    """The rate limiters of a backend that lives in this process (memory, memory-sharded):
    :func:`rate_step` as it is, on this process's clock. Nothing is awaited, so each step
    is atomic on the event loop."""

    __slots__ = ("_states",)

    def __init__(self) -> None:
        self._states: dict[str, RateState] = {}

    def take(
        self, queue: str, rule: RateRule, count: int, hold: float, end: float = math.inf
    ) -> RateGrant:
        state = self._states.get(queue, RateState())
        self._states[queue], grant = rate_step(state, time.time(), rule, count, hold, end)
        return grant


class Backend(ABC):
    """One database connection per factory, and a Store per queue."""

    name: ClassVar[str]
    capabilities: Capabilities
    options: ClassVar[Mapping[str, Any]] = {}
    """Backend-specific ``connect`` options and their defaults."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A backend class that implements :meth:`rate_take` has rate limits: the capability
        is derived from the method, on the class (``connect`` reads it before making the
        backend), rather than said a second time beside it."""
        super().__init_subclass__(**kwargs)
        capabilities = getattr(cls, "capabilities", None)
        if capabilities is None:
            return
        if cls.rate_take is not Backend.rate_take:
            capabilities = replace(capabilities, rate_limit=True)
        if cls.result_store is not Backend.result_store:
            capabilities = replace(capabilities, results=True)
        cls.capabilities = capabilities

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.settings: dict[str, Any] = {**self.options, **options}

    async def open(self) -> None:
        """Connect; called once by ``connect`` before any store is made."""

    async def close(self) -> None:
        """Close what ``open`` opened (never a client the user passed in)."""

    def abandon(self) -> None:
        """A cancelled close's grace is spent: give up at once every call still waiting
        for the server, and refuse (``ClosedError``) every later one, until :meth:`close`.
        Only for a connection whose calls outlast their cancellation (Redis's own, see
        ``aio_keuss.redis.connection``): there each reply a silent server never sent kept
        its caller for its own cancel grace, one after the other, so a cancelled close
        ended minutes late. Elsewhere a cancelled call ends at once: nothing to do."""

    @abstractmethod
    async def store(self, queue: str, options: QueueOptions) -> Store:
        """Make (creating storage on first use) the store of one queue, with ``options``.
        Called once for each queue object the factory opens, and a queue may open again
        under its name with other options (a claim, see ``Factory.queue``): the store made
        must act on these, not on those of an earlier open."""

    def signal_bus(self, debounce: float) -> SignalBus:
        """The signal bus of this backend's own database; in-process by default."""
        from .signal import LocalSignalBus

        return LocalSignalBus(debounce)

    def stats_store(self) -> StatsStore:
        """The stats store of this backend's own database; in-process by default."""
        from .stats import MemoryStats

        return MemoryStats()

    def result_store(self) -> ResultStore:
        """Optional (``Capabilities.results``): the store of finished messages' results in
        this backend's own database, so that every process sharing it reads them. Made once
        per factory, when a queue first needs it; the factory opens and closes it.

        A backend whose database cannot keep them keeps this default and leaves the
        capability false: ``result_ttl`` is then refused at open."""
        raise NotSupportedError(f"{type(self).__name__} keeps no results")

    async def rate_take(
        self, queue: str, rule: RateRule, count: int, hold: float, end: float = math.inf
    ) -> RateGrant:
        """Optional (``Capabilities.rate_limit``): :func:`rate_step` on ``queue``'s limiter
        state, as one atomic read-modify-write of one row / key / document, on the
        database's clock: every process and factory sharing the database shares the
        queue's limit. A state not there yet is ``RateState()``; one whose ``tat`` and
        ``until`` are both past may be dropped (expired). Each caller brings its own
        ``rule``: the state is times only, so callers with different rules share it, each
        held to its own. The queue layer calls it before a take (``count`` > 0), after a
        take that got fewer messages than granted (``count`` < 0, the rest given back, with
        ``end`` from the take's answer, :attr:`RateGrant.end`),
        and for a handler's ``RateLimited`` (``count`` 0, ``hold`` > 0).

        A backend that cannot do it atomically keeps this default and leaves the
        capability false: a queue with a ``rate_limit`` is then refused at open."""
        raise NotSupportedError(f"{type(self).__name__} has no rate limits")
