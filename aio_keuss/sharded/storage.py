"""The storage contract of the sharded model: the only part a database author writes.

A queue is split into shards (numbered 0 .. shards - 1). A shard is a *magazine*: records
loaded at its load pointer and fired from its fire pointer, in that order; records fired by a
reserve stay in place, stamped with their reservation deadline, until ``ok`` deletes them or
the sweeper (walking from the shard's sweep pointer) moves those past their deadline into
the shard's *sideline*, from which the shovel loads them back. Delayed records wait outside
the magazine in the shard's *schedule* and are loaded when they mature. Everything else
(routing, each consumer's rotation over the ready shards, deadletter, sizes, the leader's
loop) is :mod:`aio_keuss.sharded.store` and :mod:`aio_keuss.sharded.sweeper`, written once.

Each operation below is one atomic step of the database: on Redis one Lua script (one round
trip), over the keys of one shard (one cluster hash slot), or of one queue, or of the
prefix. Per shard the storage keeps (names as the Redis storage spells its keys and fields):

- pointers and counters: ``l`` load, ``f`` fire, ``w`` sweep, ``sl`` / ``sf`` sideline load
  and fire, ``q`` next schedule sequence, ``r`` fired and not acknowledged, ``n`` swept
  ever, ``v`` shoveled ever, ``e`` expired ever;
- a record per message of the magazine (keyed by its pointer), of the sideline (by its
  sideline pointer) and of the schedule (by its sequence): id, payload, headers, tries,
  mature time, reservation deadline once fired, end of life (message TTL), and its place in
  the shard's order (the pointer it was loaded at, kept by a put-back);
- an index id -> where its record is (pointer, sideline, schedule), so ``ok`` / ``ko`` and
  the dedup check find a record without a scan; and explicit ids -> end of their dedup
  window.

A shard's *version* is ``l + q + b`` (``b``: records put back before the fire pointer, ever):
it grows with every load, every scheduled record and every put-back, and
lets the ready index tell a consumer's stale "this shard is empty" from a producer's later
"it has work" (see :meth:`ShardStorage.ready_drop`).

Times are the storage's own clock (a server's, where there is one), float seconds since the
epoch. The storage checks nothing the generic layer checked already (names, counts, bounds).

On Aerospike (IgnisMQ's storage; Aerospike's documentation describes records, bins,
``operate()``, map operations, record TTLs and transactions) the layout would be: a record
per message keyed by queue / shard / pointer (bins: id, payload, headers, tries, mature,
deadline, end of life); a *magazine record* per shard whose bins are the pointers and
counters, each pointer taken by one ``operate()`` (increment and read, atomic on that
record) so two writers never get the same one; the id index, dedup windows and schedule as
map bins of the magazine record (a sorted map for the schedule); the ready index, the
consumers, the metadata record and the leader lease one record each, with map bins, record
TTLs and generation-checked writes. Aerospike's ``operate()`` is atomic on one record; a
step here that changes several records needs a multi-record transaction where the server
offers them, or its writes ordered: take the pointer first, then write the message records,
so that a crash in between leaves a gap the walks pass over or a message delivered again,
never one lost or held by two. Each method below says what it needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..contract import Ack, Entry, Extend, Nack, Stored
from ..types import KoResult

MetaRecord = Mapping[str, str]
"""A queue's metadata record: field name -> text, encoded and read by
:mod:`aio_keuss.sharded.meta`; the storage stores the text as it is."""


@dataclass(slots=True)
class Loaded:
    """What :meth:`ShardStorage.load` did on one shard."""

    flags: list[bool]
    """Per entry, whether it was stored (false: refused as a duplicate)."""
    version: int
    """The shard's version after the load."""
    announce: bool
    """True when the magazine was empty and this load put a record in it: the caller then
    adds the shard to the ready index (a load into a non-empty magazine needs not, whoever
    loaded its first record did)."""
    scheduled: float | None
    """Earliest mature time this load scheduled (None: it scheduled nothing)."""


@dataclass(slots=True)
class Fired:
    """What :meth:`ShardStorage.fire` took from one shard."""

    messages: list[Stored]
    left: int
    """Records left in the magazine past the fire pointer (0 or less: it is empty)."""
    version: int
    next_scheduled: float | None
    """Mature time of the shard's next scheduled record (None: none)."""


@dataclass(slots=True)
class Doomed:
    """A reservation a rollback found past ``max_ko``: set aside (no longer held, so a
    racing ``ok`` or ``ko`` of it finds nothing; scheduled ``DEADLETTER_HOLD`` seconds
    later, its try counted, so that it comes back if the caller dies before the last step),
    for the caller to copy into the deadletter queue and then drop with
    :meth:`ShardStorage.drop_doomed`."""

    id: str
    payload: bytes
    headers: bytes
    tries: int
    """Its tries counted, the ko's included (what the copy's ``x-dl-tries`` says)."""
    aside: str
    """Where the rollback set it aside (opaque to the caller; Redis: its index entry
    ``z<seq>``), so that the drop deletes that record and no later one of the id."""


DEADLETTER_HOLD = 60.0
"""Seconds a record ko-ed past max_ko is set aside while its deadletter copy is written: a
caller dying between the two steps leaves it to come back then (a duplicate, never a loss),
its try counted once."""


@dataclass(slots=True)
class RolledBack:
    """What :meth:`ShardStorage.rollback` did on one shard."""

    results: list[KoResult]
    """Per nack: MISSING (not held as guarded), ROLLED_BACK (reloaded or scheduled) or
    DEADLETTERED (past ``max_ko``: listed in ``doomed``, set aside)."""
    doomed: list[Doomed]
    version: int
    reloaded: bool
    """True when a record went back into the magazine (the caller announces the shard)."""
    scheduled: float | None
    """Earliest mature time this rollback scheduled, a set-aside record's included (None:
    none)."""


@dataclass(slots=True)
class ShardSizes:
    """A shard's counts and pointers, after its expired head was purged."""

    ready: int
    """In the magazine past the fire pointer, plus scheduled records already mature."""
    fired: int
    """Fired by a reserve and neither acknowledged nor swept."""
    sidelined: int
    load: int
    swept: int
    shoveled: int
    sweep: int
    fire: int
    expired: int
    scheduled: int
    """Scheduled and not mature yet."""
    next_scheduled: float | None


@dataclass(slots=True)
class Deadlines:
    """What :meth:`ShardStorage.next_deadline` read of a shard's reservations."""

    earliest: float | None
    """The earliest end among the reservations read (None: none read)."""
    whole: bool
    """Whether every reservation was read; if not, others may end earlier."""


@dataclass(slots=True)
class SweepStep:
    """One bounded sweep step on one shard."""

    moved: int
    """Records moved to the sideline (their reservation deadline passed)."""
    left: int
    """Fired records left to look at past the sweep pointer."""
    in_magazine: int
    """Records past the fire pointer (the sweeper announces the shard when > 0)."""
    version: int
    stopped: bool
    """True when reservations still within their deadline are held stepped over (noted by
    the storage, looked at again once their deadline passes): the shard is not idle."""
    sidelined: int
    """Records in the sideline after the step (the shovel's work)."""
    next_scheduled: float | None


@dataclass(slots=True)
class ShovelStep:
    """One bounded shovel step on one shard."""

    moved: int
    """Sideline records handled: loaded back, or deleted as past their end of life."""
    left: int
    """Records left in the sideline."""
    version: int


@dataclass(slots=True)
class ReadyMark:
    """A shard's entry in the ready index, as a producer announces it (``due`` None: now)
    or as a consumer reports it emptied (``due``: its next scheduled record, None: none)."""

    shard: int
    version: int
    due: float | None = None


@dataclass(slots=True)
class ReadyHead:
    """The ready index as a consumer reads it."""

    due: list[int]
    """Shards due now, earliest first."""
    earliest: float | None
    """Earliest due time in the index (None: the index is empty), on this process's clock
    (``time.time()``): the wait loop sleeps toward it, so a storage on a server's clock
    gives it as the server's time from now, added to ours."""


class ShardStorage(ABC):
    """The atomic operations of the sharded model on one database (one per backend).

    Per-shard operations take the queue and the shard; each is atomic on that shard (one
    Redis script), and none needs atomicity across shards or with the queue-wide records: the
    generic layer orders its steps so that a process dying between two leaves a duplicate or
    a stale hint the sweeper repairs, never a loss.
    """

    uninterruptible: bool = False
    """True when every operation awaits nothing but replies that refuse cancellation (see
    ``Store.uninterruptible``), sent as soon as the operation's coroutine first runs. The
    store then runs fetches in the caller's task and starts the operations on several shards
    side by side in that task (every request sent before the first reply is awaited)."""

    run_in_caller: bool = False
    """True when round trips pipeline (one connection) or answer from memory: a call that
    finds a free slot runs in its caller's task (see ``Store.run_in_caller``)."""

    # per shard ---------------------------------------------------------------------------

    @abstractmethod
    async def load(
        self,
        queue: str,
        shard: int,
        entries: Sequence[Entry],
        dedup_window: float,
        message_ttl: float | None,
        *,
        front: bool = False,
    ) -> Loaded:
        """Store ``entries`` in order, atomically on the shard.

        An entry with ``dedup`` (an explicit id) is refused while its id has a record in the
        shard (magazine, sideline or schedule) that :meth:`queued` counts, or within the
        dedup window of an earlier push of that id (expired windows are purged first); an
        accepted one opens a window of ``dedup_window`` seconds. An entry with ``mature``
        set (a put-back) is refused while its id has such a record, and is loaded now
        whatever its ``delay``, keeping its ``mature`` and ``tries``, and ``expires`` as its
        end of life when given (a TTL counts from the push, not from a put-back). Any other
        entry's id is unique by construction. A record past its end of life that no one
        holds refuses nothing by itself (whether a push goes in must not hang on when a
        step meets and deletes it): an entry accepted over it deletes it in this step,
        counted expired, so that nothing of it is left to fire, shovel or count, nor for a
        step meeting it later to drop the new record's index entry.

        An accepted entry with ``delay`` > 0 goes to the schedule, mature at now + delay;
        the others are loaded at the load pointer, which advances by one each. With
        ``message_ttl`` each record ends its life at now + ``message_ttl``.

        With ``front`` (the queue layer's put-backs, not a deadletter copy) the entries with
        ``mature`` go back where they were fired from, before the others of their shard (a
        cancelled pop's caller never saw them, so one key's order must hold): in the free
        slots just before the fire pointer, the fire pointer moving back over them, and the
        sweep pointer too if it was past; ordered by ``place`` (as fired; None: before any)
        among themselves and the put-backs already there, which move down to make room, so
        the put-backs of several cancelled callers, each its own call in any order, come out
        in the order they were fired. Those there is no room for (a reservation still held
        just behind the fire pointer) are loaded at the load pointer, the latest places
        first, and take a new place there (as a ko or the shovel's reloads do). A put-back
        raises the shard's version as a load does.

        Needs: two loads never get the same pointer; the duplicate check and the index
        entry of an id are one step (on Aerospike, a create-only map put or record write),
        and so are the delete of a dead record it replaces and the new record's entry.
        """

    @abstractmethod
    async def queued(self, queue: str, shard: int, ids: Sequence[str]) -> list[bool]:
        """Whether each id has a record in the shard (magazine, sideline or schedule; fired
        and not yet committed counts), as the duplicate check of :meth:`load` reads it, that
        a result may still come for: not one past its end of life (message TTL) that no one
        holds, which is never delivered (deleted where a step meets it, or by a push of its
        id). One held stays counted past its end: its holder may still commit it. A stale
        index entry met on the way may be dropped, nothing else written.

        Needs: the id index of :meth:`load` and the record an entry names (its end of life,
        whether held), read in one step."""

    @abstractmethod
    async def fire(self, queue: str, shard: int, n: int, reserve_delay: float | None) -> Fired:
        """Take up to ``n`` records from the fire pointer, atomically on the shard.

        First load the matured scheduled records (up to 1,000). Records past their end of
        life are deleted on the way (at most ``n`` + 1,000 looked at). With ``reserve_delay``
        each record taken stays in place, stamped with its deadline (now + reserve_delay) and
        counted as fired; without (a pop) it is deleted. Each message handed out carries its
        end of life (``Stored.expires``) and its place (``Stored.place``), which a put-back
        gives back. The fire pointer
        advances past everything looked at.

        Needs: two fires never take the same record (the pointer advance is the claim); a
        reserved record is stamped before it is handed out, so that whatever happens to
        its holder the sweeper finds it."""

    @abstractmethod
    async def commit(self, queue: str, shard: int, acks: Sequence[Ack]) -> list[bool]:
        """Delete each record fired by a reserve and still held (in the magazine, stamped,
        with ``tries`` as given when set); per ack whether it was. Atomic on the shard.

        Needs: check-and-delete per record (on Aerospike, a generation-checked delete), so
        a holder whose record was swept and fired again deletes nothing."""

    @abstractmethod
    async def extend(self, queue: str, shard: int, extends: Sequence[Extend]) -> list[bool]:
        """Move the deadline of each record still held (the guard of :meth:`commit`: one
        past its deadline that the sweep has not moved yet is still held) to now + its
        ``seconds``, nearer or later; per extend whether it was held. Atomic on the shard.
        Nothing else changes: tries, place, pointers, counters.

        Needs: the guard and the deadline's write as one step (on Aerospike, a
        generation-checked write), and the shard's note of a reservation the sweep stepped
        over moved to the new deadline in the same step: the walk never comes back to a
        record it passed, so one whose end came nearer would otherwise be found only at
        the end noted first."""

    @abstractmethod
    async def rollback(
        self, queue: str, shard: int, nacks: Sequence[Nack], max_ko: int | None
    ) -> RolledBack:
        """Release held records (the guard of :meth:`commit`), atomically on the shard.

        A nack that counts a try raises the record's tries; if that passes ``max_ko`` the
        record is set aside and returned as :class:`Doomed`: it leaves the magazine (no
        longer held: a later ``ok`` / ``ko`` of the same reservation, in this call or
        another, finds nothing, as if it were gone already) for the schedule, with its new
        tries, mature ``DEADLETTER_HOLD`` seconds later. Otherwise its stamp is removed
        and it is reloaded at the load pointer (a new place), or with ``delay`` > 0
        scheduled at now + delay (its mature time set to that). A release at no try
        (``count_try`` false, no delay: its holder never saw it) goes back to its place
        instead, as a put-back of :meth:`load` with ``front`` does: in the free slots just
        before the fire pointer, ordered by place with the other releases of the call and
        the put-backs already there; those there is no room for (a reservation still held
        just behind) are reloaded at the load pointer. The slots of all the call's records
        leaving the magazine count as free, and those reloaded at the load pointer go in
        the nacks' order.

        Needs: the guard of :meth:`commit`, and the record leaves its place and enters the
        magazine (a new pointer) or the schedule in one step, or at least in an order that
        leaves a copy rather than none."""

    @abstractmethod
    async def drop_doomed(self, queue: str, shard: int, doomed: Sequence[Doomed]) -> list[bool]:
        """The deadletter's last step, once the copies are in the deadletter queue: delete
        each record still set aside as :meth:`rollback` returned it (its id's index entry
        still ``aside``, its tries still ``tries``); per record whether it was. One that
        came back meanwhile (the caller took longer than ``DEADLETTER_HOLD``: matured,
        fired again) stays: a duplicate, never a loss. Atomic on the shard.

        Needs: check-and-delete per record, as :meth:`commit`."""

    @abstractmethod
    async def sizes(self, queue: str, shard: int) -> ShardSizes:
        """Purge the magazine's expired head (up to 1,000 records past their end of life at
        the fire pointer), then count. Atomic on the shard; besides the purge, a read of
        the magazine record's counters and of the schedule."""

    @abstractmethod
    async def next_deadline(self, queue: str, shard: int, most: int) -> Deadlines:
        """The earliest end of the shard's reservations, read without changing anything:
        those of the records fired past the sweep pointer (at most ``most`` looked at), and
        of those the sweep stepped over, from the note it keeps of them (its earliest held
        one, at most ``most`` entries looked at). An extension moves a stepped-over
        reservation's note (see :meth:`extend`), so its new end is what is read.

        Needs: a read of the fired records past the sweep pointer, and of the note in
        deadline order (on Aerospike, a sorted map bin read by rank)."""

    @abstractmethod
    async def sweep(self, queue: str, shard: int, batch: int) -> SweepStep:
        """One sweep step, atomic on the shard: purge the expired head (up to ``batch``);
        look again at up to ``batch`` reservations stepped over by earlier steps whose
        deadline has passed since (each still held moves to the sideline; one whose slot
        holds a later reservation meanwhile, fired again after a release, is noted again);
        then walk at most ``batch`` fired records from the sweep pointer: a record gone
        (acknowledged, or fired by a pop) is passed over, one past its deadline moves to the
        sideline (so its stale holder's ``ok`` / ``ko`` find nothing held; one past its end
        of life is deleted instead), and one still within its deadline is noted with its
        deadline and stepped over: the pointer never stops at a long reservation, so lapsed
        ones behind it, however far, come back. The sweep pointer, the fired count and the
        swept / expired counters advance in the same step, so two sweepers overlapping never
        move a record twice.

        Needs: the pointer advance and the moves as one step, or each move claimed by the
        sideline pointer taken first and the magazine record's delete generation-checked
        (a leader that stalled past its lease may overlap with its successor)."""

    @abstractmethod
    async def shovel(self, queue: str, shard: int, batch: int) -> ShovelStep:
        """Move up to ``batch`` sideline records back to the load pointer, each with one
        more try and no stamp (those past their end of life are deleted), atomically on the
        shard: a record is never half-moved.

        Needs: as :meth:`sweep`, with the sideline fire pointer as the claim."""

    # per queue ---------------------------------------------------------------------------

    @abstractmethod
    async def ready_add(self, queue: str, marks: Sequence[ReadyMark]) -> None:
        """Producers' announcements, atomic on the queue's index: each shard is due from
        ``due`` (None: now) on, unless it is due earlier already; and its stamp (the highest
        version announced) rises to ``version``.

        Needs: per shard, the due time and the stamp in one step (one ``operate()`` of map
        operations on the index record)."""

    @abstractmethod
    async def ready_drop(self, queue: str, marks: Sequence[ReadyMark]) -> None:
        """A consumer's report of shards it found empty at ``version``, atomic on the
        index: unless a higher version was announced since, each leaves the index
        (``due`` None) or waits in it until ``due`` (its next scheduled record).

        Needs: the stamp compared and the entry changed in one step, so an announcement
        racing with the drop is never lost."""

    @abstractmethod
    async def ready_head(self, queue: str) -> ReadyHead:
        """The shards due now and the index's earliest due time, in one read."""

    @abstractmethod
    async def stamps(self, queue: str) -> dict[int, int]:
        """The index's stamps: per shard, the highest version announced (shards never
        announced left out), in one read. Every step that gives a shard work announces it
        (a load into an empty magazine, a schedule, a reload), so the sweeper passes over a
        shard it found with nothing to do while its stamp stays as it was."""

    @abstractmethod
    async def enrol(self, queue: str, token: str, lease: float, most: int) -> bool:
        """Enrol or renew consumer ``token`` for ``lease`` seconds, after forgetting those
        whose lease ended; false (and nothing written) when the queue already has ``most``
        others. Atomic on the queue's consumer set (on Aerospike, a map of token -> lease
        end in one record: purge, count and put by one ``operate()`` or a generation-checked
        write)."""

    @abstractmethod
    async def leave(self, queue: str, token: str) -> None:
        """Forget consumer ``token`` at once."""

    @abstractmethod
    async def touch(self, queue: str, record: MetaRecord, life: float | None) -> MetaRecord:
        """Write ``record`` as the queue's metadata record if it has none (the first
        writer's settings are the queue's), set its ``active`` to ``"true"`` and ``seen``
        to now (whole seconds), and make it live ``life`` more seconds (None: leave its
        life as it is), atomically; then list the queue, with its stored ``shards``, for the
        sweeper. Returns the stored ``shards``, ``message_ttl`` and ``max_consumers``
        fields (a missing one left out).

        Needs: write-if-missing atomic (a create-only write), so two first writers agree;
        the listing may follow in a second step."""

    @abstractmethod
    async def read_meta(self, queue: str) -> MetaRecord | None:
        """The queue's metadata record; None once its life ended or if never written."""

    @abstractmethod
    async def listed(self) -> dict[str, int]:
        """The queues listed for the sweeper, with their shard counts."""

    @abstractmethod
    async def unlist(self, queue: str) -> None:
        """Take a queue off the sweeper's list (its data stays)."""

    # per backend (prefix) ----------------------------------------------------------------

    @abstractmethod
    async def lease(self, token: str, ttl: float) -> bool:
        """Take the leader lease if free (or expired), or renew it if ``token`` holds it,
        for ``ttl`` seconds; whether ``token`` holds it after. Atomic (on Aerospike, a
        create-only write of a record with that TTL, renewed by a write checked against
        the holder's generation)."""

    @abstractmethod
    async def release(self, token: str) -> None:
        """Give the lease up if ``token`` holds it, so another takes over at once."""
