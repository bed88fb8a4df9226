"""mongo and mongo-history: Keuss's MongoDB models, one collection per queue.

A message is one document ``{_id: id, payload: Binary, headers: Binary (JSON), mature: float
epoch seconds, tries: int, reserved: bool}`` with an index on ``mature``; see
:mod:`aio_keuss.mongo.connection` for the collection layout, why one collection per queue, and
why times come from the client's clock. A message pushed with a priority also has ``raised``
or ``lowered`` (see ``BY_PRIORITY``), and its queue a second index, by which its takes sort
(see :meth:`MongoStore._order`).

``tries`` counts the deliveries that did not end in ok *including a running reservation*: a
reserve does ``$inc: {tries: 1}`` unconditionally and hands the consumer the value from before,
so a reservation that expires has already been counted and the next reserve needs no
conditional arithmetic (pipeline updates, which not every server speaks). A ko with a try
keeps the count, a ko without one (``Nack.count_try`` false) takes it back, and a holder's
ok / ko / move is accepted only while ``tries`` is still its own count + 1 and ``owner`` the
token its reserve wrote (the stale-holder guard; a give-back took a try back, so the count
alone matched the next reservation, another consumer's, too).

Operations (``now`` = client clock; "live" = not yet consumed):

- push: ``insert_many(ordered=False)``; duplicate-key errors are the refusals. An id the user
  chose is first claimed in ``<prefix>_dedup_<queue>`` (insert, or take over an expired entry
  atomically), so an id consumed within the dedup window stays refused; the claim is pending
  until the insert is done, then settled (a third round trip), so that a pusher dying
  between the two does not leave its id refused with no message stored. Messages of one
  batch get mature times one microsecond apart, which keeps their order on the ``mature``
  index.
- pop / reserve of one: ``find_one_and_update`` on ``mature <= now`` sorted by ``mature``,
  setting a per-call ``owner`` token, so that a message whose reply was lost can be found
  again. A reserve is that one round trip; a mongo-history pop too (marked processed); a
  mongo pop claims the message with a short lease, then deletes it (two round trips: a
  ``find_one_and_delete`` whose reply was lost left nothing to find it by).
- pop / reserve of n (a coalesced batch): *claim*: find up to n candidates, then ONE
  ``update_many`` over their ids, still conditioned on ``mature <= now`` and setting a
  per-batch ``owner`` token, so documents another consumer took meanwhile are simply not ours;
  when fewer than n were modified, the ones carrying our token are read back. A reserve's claim
  is the reservation itself (``mature = now + reserve_delay``); a pop claims with a short lease
  and then deletes what it claimed, so a consumer dying in between loses nothing: the message
  comes back after the lease. A pop of either size hands over only what that delete removed
  (see ``MongoStore._delete_claimed``).
- ok: delete (n > 1: one ``update_many`` claims what the acks' guards match, under a per-batch
  token, then one ``delete_many`` of what carries it; after a short claim, which carry it, by
  id: see :meth:`MongoStore._commit_many`).
- ko: update (reserved false, mature = now + delay); past ``max_ko`` a deadletter move.
- remove: delete unless under an active reservation (``reserved and mature > now``).
- amend: one ``update_one`` per message, all sent at once, each under remove's rule (see
  :meth:`MongoStore.amend`).
- sizes: one ``$group`` aggregation; next mature: the first document on the ``mature`` index.

A document another program inserted is read tolerantly (see :func:`_payload` and
:func:`_headers`); one without a number ``mature`` matches no query. A count of ``tries``
that is not one of ours (a fraction, a Decimal128, NaN, negative, past ``MAX_TRIES``) is
read as a sane one (see :func:`_tries`) and stored so when the message is reserved. One
without a str ``_id`` or with ``tries`` of no numeric type is not supported: a filter on
their BSON types in every query made the test server (nx-27017) sixty times slower on a
pop, so none is applied.

Deadletter: on a replica set / mongos (``transactions``) the move is one transaction; elsewhere
it is ordered so that nothing is lost: the source is first re-claimed for a lease (a crash now
means the message comes back to its queue), then inserted into the deadletter queue, then
deleted (a crash now means one duplicate, never a loss). The claim writes its token as
``mover``, leaving the holder's ``owner``: while it runs the holder's ok or ko is refused
(the move took the reservation first), and once a move that failed past its claim gave it
back (or it lapsed) they act on the message again.

mongo-history (:class:`MongoHistoryStore`) keeps consumed messages: pop, ok, remove and the
source side of a deadletter move set ``processed`` (a date) and push ``mature`` to
:data:`FAR_FUTURE`, out of every query's way; a TTL index on ``processed`` expires them after
``history_ttl`` seconds. A new message whose id belongs to a processed one moves that record
aside (``_id`` ``<id>~<processed time>``) rather than being refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import operator
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from time import monotonic
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import orjson
from bson import json_util
from bson.decimal128 import Decimal128
from pymongo import ASCENDING, ReturnDocument
from pymongo import errors as mongo_errors

from ..coalesce import Finishing, to_the_end
from ..contract import (
    Ack,
    Amend,
    Cursor,
    DeadletterPlan,
    Entry,
    Extend,
    Fetched,
    Held,
    Move,
    Nack,
    Peeked,
    PeekPage,
    Store,
    Stored,
    deadletter_tag,
    moved_id,
)
from ..errors import ConfigError
from ..message import EMPTY_HEADERS, MAX_PRIORITY, MAX_TRIES, MIN_PRIORITY, merge_headers
from ..types import Capabilities, KoResult, Sizes
from .backend import MongoBackend
from .connection import (
    BY_PRIORITY,
    DUPLICATE_KEY,
    Collection,
    Document,
    MongoOptions,
    translated,
)

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession

    from ..options import QueueOptions

T = TypeVar("T")
V = TypeVar("V", float, datetime)

FAR_FUTURE = 253402300799.0
"""9999-12-31T23:59:59Z: the mature time of consumed history records (seed: ``$INFINITE``)."""
LIVE: Document = {"mature": {"$lt": FAR_FUTURE}}
CLAIM_LEASE = 30.0
"""How long a pop's or a deadletter move's claim holds a message before it comes back."""
TIE_STEP = 1e-6
"""Mature-time step between the messages of one insert batch (keeps their order)."""
CLAIM_ATTEMPTS = 3
LATE_RESERVE = 0.5
"""Seconds a reserve may take (or half its ``reserve_delay``, when shorter) before its
reservations are started again from its reply."""
LATE_POP = CLAIM_LEASE / 2
"""Seconds a pop's claim may take before it is checked, and renewed, before the delete: past
its lease another consumer may have taken the message."""
DEDUP_LEASE = 30.0
"""How long a push's claim of an id stays *pending* (its message not yet known stored) before
another push of that id may take the pusher for dead (see ``MongoStore._contend``)."""
CONTEND_PAUSE = (0.01, 0.25)
"""First and longest pause between two looks at an id another push holds pending."""
MOVE_NAMES = 50
"""Names a moved message may try in its destination before the move is refused."""
BY_MATURE = [("mature", ASCENDING)]


def _date(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)


def _epoch(when: datetime | str) -> float:
    """A stored date as epoch seconds (a naive one is UTC: the driver's default codec)."""
    if isinstance(when, str):  # some servers speaking the protocol hand dates back as text
        when = datetime.fromisoformat(when)
    return when.replace(tzinfo=UTC).timestamp() if when.tzinfo is None else when.timestamp()


def _as_stored(timestamp: float) -> float:
    """``timestamp`` as a date field written from it reads back: BSON dates hold whole
    milliseconds, and the driver truncates. A time compared with a stored one (a record's
    processed time) must be so too: to the microsecond, the start of a push read as later
    than a consumption in the same millisecond after it."""
    when = _date(timestamp)
    return _epoch(when.replace(microsecond=when.microsecond // 1000 * 1000))


def _ms_date(timestamp: float) -> datetime:
    """A time as MongoDB stores dates: whole milliseconds (so a cursor matches its record)."""
    return datetime.fromtimestamp(min(round(timestamp, 3), FAR_FUTURE), UTC)


def _near(value: V, margin: Any) -> Document:
    """Within ``margin`` of ``value``: a value as written, found again. Not an equality:
    some servers speaking the protocol keep 15 significant digits of a double (nx-27017),
    so a time written as 1795970268.2163913 reads 1795970268.21639."""
    return {"$gte": value - margin, "$lte": value + margin}


def _as_text(value: Any) -> bytes:
    """A stored value that is not bytes, as its JSON text (Extended JSON for BSON types)."""
    try:
        return json_util.dumps(value).encode()
    except Exception:  # pragma: no cover - json_util writes every type BSON decodes to
        return orjson.dumps(repr(value))


def _payload(doc: Document) -> bytes:
    """A document's payload blob, ours a BSON binary. One another program inserted may hold
    anything, or nothing: its JSON text, or empty bytes, neither of which starts with a
    payload's tag, so that the queue layer delivers it as those bytes, marked
    ``x-undecodable``. (``bytes(...)`` of a str raised, once the batch was taken: a pop's
    messages were lost, a reserve's left reserved to nobody.)"""
    value = doc.get("payload", b"")
    return bytes(value) if isinstance(value, bytes) else _as_text(value)


def _headers(doc: Document) -> bytes:
    """A document's header text, ours a BSON binary of a JSON object. Another program's may
    be missing or null (no headers), text (as it is: a JSON object reads), a sub-document
    (its JSON text: it reads), or else (its JSON text, which is not an object: delivered
    as ``x-raw-headers``, marked ``x-undecodable``)."""
    value = doc.get("headers")
    if value is None:
        return EMPTY_HEADERS
    if isinstance(value, bytes):
        return bytes(value)
    return value.encode() if isinstance(value, str) else _as_text(value)


def _canonical(tries: Any) -> bool:
    """Whether a stored count is one this library writes: an int in [0, MAX_TRIES]."""
    return isinstance(tries, int) and not isinstance(tries, bool) and 0 <= tries <= MAX_TRIES


def _tries(value: Any) -> int:
    """A stored count of tries as the int a message carries. Another program (or an older
    version) may have written a fraction, a Decimal128, NaN, an infinity, a negative count
    or one past ``MAX_TRIES`` (which ok and ko refuse as input); ``int()`` of NaN or of a
    Decimal128 raised once the message was taken, and a fraction never matched a holder's
    guard again. Such a count reads as the nearest int in [0, MAX_TRIES], rounded down; one
    that tells no number (NaN, not a number at all) as 0, the count of a message never
    delivered. A take stores the count so read (:meth:`MongoStore._mend_tries`)."""
    if isinstance(value, Decimal128):
        value = value.to_decimal()
    if isinstance(value, Decimal):
        if value.is_nan():  # (a signalling NaN would raise in float())
            return 0
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return 0
    return int(min(max(value, 0), MAX_TRIES))


def _priority_fields(priority: int) -> Document:
    """How a priority is stored (see ``BY_PRIORITY``): nothing for 0."""
    if priority > 0:
        return {"raised": priority}
    return {"lowered": -priority} if priority < 0 else {}


def _priority(doc: Document) -> int:
    """A document's priority; 0 where it has none, or one this library did not write. Read
    for every message taken: one without a priority, a plain queue's every one, costs two
    key lookups and no loop."""
    if "raised" not in doc and "lowered" not in doc:
        return 0
    for field, sign, most in (("raised", 1, MAX_PRIORITY), ("lowered", -1, -MIN_PRIORITY)):
        value = doc.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return sign * min(value, most)
    return 0


def _rank(doc: Document) -> tuple[int, float]:
    """Where a taken document goes in its batch: ``BY_PRIORITY``'s order."""
    return -_priority(doc), float(doc["mature"])


def _waiting(message_id: str, now: float, scheduled_only: bool = False) -> Document:
    """A live message not under an active reservation: :meth:`MongoStore.remove`'s rule, a
    lapsed reservation counting as waiting; with ``scheduled_only``, one still maturing.
    ``$and``, not sibling fields: see :meth:`MongoStore.remove`."""
    mature: Document = {"$gt": now, **LIVE["mature"]} if scheduled_only else LIVE["mature"]
    free = {"$or": [{"reserved": False}, {"mature": {"$lte": now}}]}
    return {"$and": [{"_id": message_id, "mature": mature}, free]}


def _kept(timestamp: float) -> float:
    """``timestamp`` cut (never rounded up) to 15 significant digits, as a server that keeps
    no more of a double stores it (nx-27017, see :func:`_near`): what is written is read
    back as it was, so a promote's mature time, ``now``, reads as no later than ``now``.
    Rounded up (half of the times), the next request of the call (a promote's
    ``scheduled_only``) found the message promoted still scheduled. The cut costs at most
    10 microseconds of a time of today; a server that keeps the whole double loses
    nothing more. The product with the scale can itself round up to the next whole number
    (about one time in 270): then the cut is one step lower."""
    if timestamp <= 0:
        return timestamp
    scale = 10.0 ** (14 - math.floor(math.log10(timestamp)))
    steps = math.floor(timestamp * scale)
    kept = steps / scale
    return kept if kept <= timestamp else (steps - 1) / scale


def _amended(amend: Amend, now: float) -> Document:
    """The update of an amend: its mature time ``now + delay`` (when given) and its
    priority as a push stores it (see ``BY_PRIORITY``: the other field, or both for 0,
    removed). A message whose reservation lapsed is waiting again: ``reserved`` false and
    no ``owner``, so that its lapsed holder's late ok, ko or renewal (guarded by both), or
    a mongo pop's delete after its claim lapsed (guarded by the token), no longer acts on
    it, and a new mature time ahead does not read as a reservation. Its count stays: the
    lapsed try was counted when it was reserved."""
    changed: Document = {"reserved": False}
    removed: Document = {"owner": ""}
    if amend.delay is not None:
        changed["mature"] = _kept(now + amend.delay)
    if amend.priority is not None:
        fields = _priority_fields(amend.priority)
        changed.update(fields)
        removed.update({f: "" for f in ("raised", "lowered") if f not in fields})
    return {"$set": changed, "$unset": removed}


def _stored(doc: Document, token: str | None = None) -> Stored:
    tries = _tries(doc["tries"])
    return Stored(
        doc["_id"],
        _payload(doc),
        _headers(doc),
        tries,
        float(doc["mature"]),
        token=token,
        priority=_priority(doc),
    )


def _guard(message_id: str, tries: int | None, token: str | None = None) -> Document:
    """Still reserved, by the holder that was handed ``tries`` and the reservation's
    ``owner`` token (each when known). The count alone matched another holder's
    reservation: a give-back takes its try back, so the next reserve of the message hands
    out the very count the first holder had, and that holder's give-back landing again
    (retried after a lost reply), or its late ok, released or deleted the new one."""
    guard: Document = {"_id": message_id, "reserved": True}
    if tries is not None:
        guard["tries"] = tries + 1
    if token is not None:
        guard["owner"] = token
    return guard


def _as_read(doc: Document) -> Document:
    """The reservation ``doc`` was read under, as a filter: unchanged since the read."""
    held: Document = {"_id": doc["_id"], "reserved": True, "tries": doc["tries"]}
    if "owner" in doc:
        held["owner"] = doc["owner"]
    return held


def _ok_claim_free(now: float) -> Document:
    """Not under a batch ok's running claim (``acker`` written, ``owner`` moved aside, its
    lease ahead): see :func:`_yielding`."""
    return {
        "$or": [
            {"acker": {"$exists": False}},
            {"owner": {"$exists": True}},
            {"mature": {"$lte": now}},
        ]
    }


def _under_claim(doc: Document) -> bool:
    """Whether a document read is claimed by a batch ok (``acker`` written, ``owner`` moved
    aside), its lease running or not: an extension never leaves one so (see
    :meth:`MongoStore.extend`), so one read back at the extension's end was refused, and its
    end is the claim's lease."""
    return "acker" in doc and "owner" not in doc


def _yielding(guard: Document, now: float) -> Document:
    """``guard`` of an ok, ko, move or extend naming no reservation (no ``owner``: by bare id),
    kept off a message a batch ok of its holder has claimed while that claim runs. A
    delete reports only how many it removed (MongoDB manual, the ``delete`` command's
    ``n``): a bare-id call ending a claimed message before the batch's delete left the
    batch two gone for one deleted, and it answered False for both, the one it ended
    too. The holder's ok came first and ends the message; the bare-id call is refused
    (False, ``MISSING``, not moved), so exactly one caller is told it ended it. A lapsed
    claim (its process died) yields to nothing. A guard naming the owner never matches
    a claimed message (the claim moved ``owner`` aside), and is left as it is."""
    if "owner" in guard:
        return guard
    return {"$and": [guard, _ok_claim_free(now)]}


def _not_moving(now: float) -> Document:
    """Not under a move's running claim (see :func:`_unclaimed`)."""
    return {"$or": [{"moving": {"$exists": False}}, {"moving": {"$lte": now}}]}


def _unclaimed(guard: Document, now: float) -> Document:
    """``guard``, unless a move (or deadletter) has claimed the message and its claim still
    runs. Without transactions a move is claim, insert, delete; the claim leaves the
    message reserved with the holder's count and owner (its holder's guard still matches
    it), so without this a second move of the same held message (``move_many([m, m])``,
    two moves to two queues at once) claimed it again and inserted a second copy, and the
    holder's own ok or ko sent at once (from another task) ended or gave back the message
    the move then copied on: told done, and moved too. The move took the reservation
    first; the other call is refused, as where a move is one atomic step. A claim that
    lapsed (its mover died) does not keep the message from being ended, or moved once it
    is delivered again; a move whose copy failed gives its claim back at once (see
    :meth:`MongoStore._copy_then_delete`). ``$and``, not sibling fields: see
    :meth:`MongoStore.remove`."""
    if "owner" in guard:
        return {"$and": [guard, _not_moving(now)]}
    return {"$and": [guard, _not_moving(now), _ok_claim_free(now)]}  # see _yielding


def _move_claim(token: str, now: float) -> Document:
    """A move's claim of a held message: for ``CLAIM_LEASE`` seconds, under ``token`` (as
    ``mover``: the holder's ``owner`` stays, so that its ok or ko acts again once a move
    that failed past its claim gave it back or it lapsed, see :func:`_unclaimed`). A
    batch ok's lapsed claim (its process died or stalled before the delete) taken by a
    move by bare id loses its ``acker``: left with the lease ahead it read as claimed
    again (see :func:`_yielding`), and that batch's late delete, which asks for it,
    ended the message the move was copying on."""
    lease_end = now + CLAIM_LEASE
    return {
        "$set": {"mature": lease_end, "mover": token, "moving": lease_end},
        "$unset": {"acker": ""},
    }


def _claimed(message_id: str, token: str, doc: Document) -> Document:
    """The message a move claimed under ``token``, still under the reservation ``doc`` was
    read under: a claim that lapsed leaves ``mover``, and the next reserve writes an owner
    of its own, which this no longer matches."""
    owner = doc.get("owner", {"$exists": False})
    return {"_id": message_id, "mover": token, "owner": owner}


Holding = tuple[int, str | None]
"""A held message's count, and the owner token an ok gave for it (None: any)."""


def _by_tries(held: dict[str, Holding]) -> Document:
    """One filter over held messages, each with its own count and owner: one clause per
    count and owner (a reserve of many writes one token over its batch)."""
    groups: dict[Holding, list[str]] = {}
    for message_id, holding in held.items():
        groups.setdefault(holding, []).append(message_id)
    clauses = [_guard_many(ids, tries, owner) for (tries, owner), ids in groups.items()]
    return clauses[0] if len(clauses) == 1 else {"$or": clauses}


def _names(tries: int | None, token: str | None, stored: int, owner: object) -> bool:
    """Whether a reservation stored with the count ``stored`` (as :func:`_tries` reads it)
    and ``owner`` is the one its holder was handed ``tries`` and ``token`` for (each when
    known): what :func:`_guard` matches, for a document already read."""
    return (tries is None or stored == tries + 1) and (token is None or owner == token)


def _guard_many(ids: list[str], tries: int, owner: str | None) -> Document:
    clause: Document = {"_id": {"$in": ids}, "tries": tries, "reserved": True}
    if owner is not None:
        clause["owner"] = owner
    return clause


def _claimed_for(message_id: str, tries: int | None, token: str) -> Document:
    """The message a batch ok claimed for the reservation ``tries`` and ``token`` name,
    and has not ended (its delete failed, its reply was lost, or it has not landed yet):
    still reserved with that count, the token moved aside as ``acked_owner`` and no
    ``owner`` since (a reserve of it once the claim's lease lapsed writes one, and a
    give-back or amend clears ``reserved``). The same ok sent again ends it: refused, the
    message came back after the lease and was delivered again though handled."""
    clause: Document = {"_id": message_id, "reserved": True}
    if tries is not None:
        clause["tries"] = tries + 1
    clause.update({"acked_owner": token, "owner": {"$exists": False}})
    return clause


def _ok_guard(message_id: str, tries: int | None, token: str | None, now: float) -> Document:
    """What an ok of one reservation may end: :func:`_guard`, or the message a batch ok
    claimed for that same reservation (see :func:`_claimed_for`); not while a move has
    claimed it (see :func:`_unclaimed`). Without a token the guard names no owner, and
    yields to a batch ok's running claim too (see :func:`_yielding`)."""
    guard = _guard(message_id, tries, token)
    if token is None:
        return _unclaimed(guard, now)
    either = {"$or": [guard, _claimed_for(message_id, tries, token)]}
    return {"$and": [either, _not_moving(now)]}


def _acked(acks: Sequence[Ack], now: float, mark: str | None = None) -> Document | None:
    """One filter over the reservations a batch ok names, each ack's :func:`_guard` (off a
    move's running claim, see :func:`_unclaimed`): one clause per count and token (the
    acks of one reserve share its token). With ``mark``, instead, what
    :func:`_claimed_for` matches of the acks with a token, and not yet claimed under
    ``mark``; None when no ack has a token."""
    groups: dict[tuple[int | None, str | None], list[str]] = {}
    for ack in acks:
        ids = groups.setdefault((ack.tries, ack.token), [])
        if ack.id not in ids:
            ids.append(ack.id)
    clauses = []
    for (tries, token), ids in groups.items():
        named: Any = ids[0] if len(ids) == 1 else {"$in": ids}
        if mark is None:
            clauses.append(_unclaimed({**_guard(ids[0], tries, token), "_id": named}, now))
        elif token is not None:
            claimed = {**_claimed_for(ids[0], tries, token), "_id": named, "acker": {"$ne": mark}}
            clauses.append({"$and": [claimed, _not_moving(now)]})
    if not clauses:
        return None
    return clauses[0] if len(clauses) == 1 else {"$or": clauses}


def _dup_indexes(exc: mongo_errors.BulkWriteError) -> set[int]:
    """Indexes refused as duplicates; any other write error is re-raised."""
    refused = set()
    for error in exc.details.get("writeErrors", []):
        if error.get("code") != DUPLICATE_KEY:
            raise exc
        refused.add(int(error["index"]))
    return refused


def _state_filter(state: str, now: float) -> Document:
    """Live messages in a peek state (consumed history records are never live)."""
    if state == "ready":
        return {"mature": {"$lte": now}}
    if state == "all":
        return LIVE
    return {"mature": {"$gt": now, "$lt": FAR_FUTURE}, "reserved": state == "reserved"}


def _peeked(doc: Document, now: float) -> Peeked:
    """A live message as peek shows it; a reserve counted its try up front (see the module
    docstring), so a held one shows the count its holder was given, and a ready one (a
    lapsed reservation too: its try is counted) the count its next delivery is given."""
    mature = float(doc["mature"])
    tries = _tries(doc["tries"]) - (1 if doc.get("reserved") and mature > now else 0)
    stored = Stored(doc["_id"], _payload(doc), _headers(doc), tries, mature)
    stored.priority = _priority(doc)
    if mature <= now:
        return Peeked(stored, "ready", mature)
    return Peeked(stored, "reserved" if doc.get("reserved") else "scheduled", mature)


def _processed(doc: Document) -> Peeked:
    """A consumed record of mongo-history, its mature time taken to be when it ended."""
    when = _epoch(doc["processed"])
    message_id: str = doc.get("id") or doc["_id"]  # an archived record keeps its id aside
    stored = Stored(message_id, _payload(doc), _headers(doc), _tries(doc["tries"]), when)
    stored.priority = _priority(doc)
    return Peeked(stored, "processed", when)


async def _walk(
    coll: Collection, where: Document, field: str, after: tuple[Any, str] | None, limit: int
) -> list[Document]:
    """Up to ``limit`` documents matching ``where`` past ``after`` in (``field``, _id) order.

    Only ranges of the index on ``field`` are read, in its order (an ``$or`` over the
    cursor, or a sort on two keys, made the server sort the rest of the collection for each
    page). Equal values come back from that index in no particular order, so a group of
    ties is read on its own, sorted by _id: the rest of the cursor's group first, then the
    group at the edge of a full page, whole (small: the messages of one insert batch are
    a microsecond apart; a condition on _id made some servers scan that index).
    ``where`` puts operators (a dict) on ``field``, or nothing; filters stay flat, without
    ``$and``, which some servers speaking the protocol answer by a full scan."""
    hint = [(field, ASCENDING)]
    others = {k: v for k, v in where.items() if k != field}
    bounds: Document = where.get(field, {})

    async def group(value: Any, past_id: str | None, most: int) -> list[Document]:
        if not _within(value, bounds):  # a cursor's time outside them: none of its ties
            return []
        found = await coll.find({**others, field: value}, hint=hint).to_list()
        found.sort(key=lambda d: d["_id"])
        if past_id is not None:
            found = [d for d in found if d["_id"] > past_id]
        return found[:most]

    docs: list[Document] = []
    beyond: Document = where
    if after is not None:
        docs = await group(after[0], after[1], limit)
        if len(docs) == limit:
            return docs
        # past the cursor and within the bounds: a scheduled walk's "$gt": now stays
        lower = max(after[0], bounds["$gt"]) if "$gt" in bounds else after[0]
        beyond = {**others, field: {**bounds, "$gt": lower}}
    most = limit - len(docs)
    rest = await coll.find(beyond, sort=hint, limit=most, hint=hint).to_list()
    rest.sort(key=lambda d: (d[field], d["_id"]))
    if len(rest) == most:
        edge = rest[-1][field]
        rest = [d for d in rest if d[field] != edge] + await group(edge, None, limit)
    return (docs + rest)[:limit]


_COMPARE = {"$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le}


def _within(value: Any, bounds: Document) -> bool:
    """Whether ``value`` meets the comparison operators of a :func:`_walk` field. Times as
    epoch seconds only (``mature``): a stored date may come back as text or naive."""
    if not isinstance(value, float | int):
        return True
    return all(_COMPARE[op](value, bound) for op, bound in bounds.items())


def _given_up() -> bool:
    """Whether the task running a claim was cancelled itself (a close past its grace gives
    up the work it waited for), rather than pymongo's tasks under it."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


async def _again_if_cut(op: Callable[[], Awaitable[T]]) -> T:
    """``op()``, run again if pymongo's own tasks were cancelled under it: ``asyncio.run``
    cancels every task of the loop as it ends (Python's asyncio documentation, "Runners"),
    pymongo's per-read tasks too, while the claim's task (see ``to_the_end``) runs on to
    give back what it took. Only for ``op`` that is harmless to repeat."""
    try:
        return await op()
    except asyncio.CancelledError:
        if _given_up():
            raise
        return await op()


class MongoStore(Store):
    """One queue = one collection. Overridden by :class:`MongoHistoryStore` in how consumed
    messages end (:meth:`_consumed`) and how an id collision is resolved (:meth:`_make_room`)."""

    batch_concurrency: ClassVar[int] = 2
    max_message_bytes = 16 * 2**20 - 8 * 2**10
    """A message is one document, which MongoDB holds up to 16 MiB of BSON (MongoDB manual,
    "MongoDB Limits and Thresholds", "BSON Document Size"); 8 KiB are left for the rest of
    it (field names, an id of up to 1,000 characters as a move or the history renames it,
    times, counts, a claim's token). A larger one is refused before anything is written:
    PyMongo raised DocumentTooLarge as it was sent, and a move had claimed the message by
    then."""
    max_insert_bytes = 40_000_000
    """Below the server's ``maxMessageSizeBytes`` (48,000,000, decimal: PyMongo's
    ``MAX_MESSAGE_SIZE``): PyMongo sends a larger ``insert_many`` as several messages, and
    one failing after others went in would fail every caller of a coalesced batch, those
    stored included (see ``Store.max_insert_bytes``). The bound counts payloads and headers
    only; the 8 MB left cover the rest of each document (field names, id, times: about 100
    bytes and the id each) for ``max_batch`` documents of ids up to 1,000 characters."""

    def __init__(self, name: str, options: QueueOptions, backend: MongoBackend) -> None:
        super().__init__(name, options)
        self._backend = backend
        self._coll = backend.queue_collection(name)
        self._dedup = backend.dedup_collection(name)
        self._owed: dict[str, tuple[list[str], float]] = {}
        """Token -> ids it claimed, of failed inserts whose claims could not be given back."""
        self._unsettled: dict[str, list[str]] = {}
        """Token -> ids it claimed, of stored messages whose claims could not be settled."""
        self._moving = Finishing()
        """Moves past their claim, without a transaction: copying there, then deleting here."""

    # variant hooks ------------------------------------------------------------------------

    def _consumed(self, now: float, held: bool = False, mark: str | None = None) -> Document | None:
        """The update that ends a consumed message; None = delete it (mongo). ``held``: it
        ends under a reservation (ok, move, deadletter), whose try the count includes.
        ``mark``: a token the record keeps, to tell what one call ended (see
        :meth:`MongoHistoryStore._commit_many`)."""
        return None

    async def _make_room(
        self, coll: Collection, docs: list[Document], revive: set[str]
    ) -> tuple[set[str], set[str]]:
        """History only: free ids held by consumed records. Returns (ids freed for a new
        insert, ids whose record was replaced in place by a put-back in ``revive``)."""
        return set(), set()

    async def _finish(
        self,
        filter: Document,
        now: float,
        session: AsyncClientSession | None = None,
        *,
        held: bool = False,
        mark: str | None = None,
    ) -> int:
        """End every message matching ``filter`` (delete, or mark processed); how many.
        ``held``: ``filter`` matches reserved messages only; ``mark``: see
        :meth:`_consumed`."""
        update = self._consumed(now, held, mark)
        if update is None:
            deleted = await self._coll.delete_many(filter, session=session)
            return deleted.deleted_count
        updated = await self._coll.update_many(filter, update, session=session)
        return updated.modified_count

    # inserting ----------------------------------------------------------------------------

    @translated
    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        if not entries:
            return []
        now = time.time()
        flags = [True] * len(entries)
        if not any(e.dedup for e in entries):
            return await self._insert_entries(entries, flags, now)
        # The claims and the insert are separate round trips: when the insert fails, a
        # claim left behind would make the retry of this (unacknowledged) push a silent
        # no-op, and the message would never be stored. So this call's claims (tagged with
        # its token) are given back before the error is raised -- but not those of messages
        # the insert stored before it failed (a batch goes in several server messages):
        # their retry must stay refused, or once consumed they would be stored twice.
        # A process that dies between the two gives nothing back: its claims stay pending,
        # and a push of those ids takes them over once their lease ends (``_contend``).
        token = os.urandom(8).hex()
        if self._owed:
            await self._give_back_owed()
        if self._unsettled:
            await self._settle_unsettled()
        try:
            claimed, held = await self._claim_ids(entries, flags, now, token)
            if held:  # what this push holds goes in first (see ``_insert_held_last``)
                flags, claimed = await self._insert_held_last(
                    entries, flags, now, token, claimed, held
                )
            else:
                flags = await self._insert_entries(entries, flags, now)
        except BaseException:
            claimed_ids = list({e.id for e in entries if e.dedup})
            await asyncio.shield(self._give_back(claimed_ids, token, now))
            raise
        await self._settle(claimed, token)
        return flags

    async def _insert_held_last(
        self,
        entries: Sequence[Entry],
        flags: list[bool],
        now: float,
        token: str,
        claimed: list[str],
        held: set[str],
    ) -> tuple[list[bool], list[str]]:
        """Insert and settle the entries whose ids this push claimed, then wait for those
        another push holds pending (``held``), and insert those this one gets. Waiting with
        its own claims pending, a push and a twin pushing the same ids (a Spark task's
        speculative twin), each of which claimed some of them first, waited for each other
        until their leases ran out. ``claimed``: the ids claimed at once. Returns the flags,
        and the ids claimed after the wait (not settled yet)."""
        later = {i for i, e in enumerate(entries) if flags[i] and e.dedup and e.id in held}
        first = [flag and i not in later for i, flag in enumerate(flags)]
        first = await self._insert_entries(entries, first, now)
        await self._settle(claimed, token)
        refused, _ = await self._contend(list(held), token, wait=True)
        second = [i in later and e.id not in refused for i, e in enumerate(entries)]
        second = await self._insert_entries(entries, second, now)
        flags = [second[i] if i in later else flag for i, flag in enumerate(first)]
        return flags, [i for i in held if i not in refused]

    async def _settle(self, claimed: list[str], token: str) -> None:
        """Mark this push's claims settled: their messages are stored (or were refused as
        live), so a later push of those ids is refused at once, consumed or not. When that
        fails the messages are in all the same: the push succeeded, and the claims are
        settled by the next insert with ids of its own here. Until then, and for good if
        this process dies first, they look pending; past their lease a push of one of those
        ids stores it again if it was consumed meanwhile (a duplicate, never a loss)."""
        if not claimed:
            return
        try:
            await self._dedup.update_many(
                {"_id": {"$in": claimed}, "by": token}, {"$unset": {"pending": ""}}
            )
        except Exception:
            self._unsettled[token] = claimed

    async def _settle_unsettled(self) -> None:
        for token in list(self._unsettled):
            claimed = self._unsettled.pop(token, None)  # None: another insert took it
            if claimed is not None:
                await self._settle(claimed, token)

    async def _give_back(self, claimed: list[str], token: str, since: float) -> None:
        """Give back the claims of a failed insert whose messages are not in the queue. If
        that cannot be read, all of them: a retry may then store again one that went in
        (at least once), rather than refuse one that never did (lost). The same holds, on
        mongo, for a message that went in, lost its reply and was consumed (deleted) before
        this read: nothing is left to tell it from one that never went in, short of a
        transaction around claim and insert (mongo-history keeps its record, which tells).
        When the give-back itself fails (the connection is still down), the claims are owed:
        the next insert with ids of its own on this queue gives them back first (see
        ``_give_back_owed``)."""
        try:
            await self._give_back_now(claimed, token, since)
        except Exception:
            self._owed[token] = (claimed, since)

    async def _give_back_owed(self) -> None:
        """Give back the claims failed inserts could not give back, before claiming anew.
        Left behind, a claim made the caller's retry of its (unacknowledged) push a silent
        no-op: the id was taken for a duplicate and the message was never stored. Raises
        (the caller retries) while they cannot be given back."""
        for token, (claimed, since) in list(self._owed.items()):
            await self._give_back_now(claimed, token, since)
            self._owed.pop(token, None)

    async def _give_back_now(self, claimed: list[str], token: str, since: float) -> None:
        """Delete the claims of what did not go in; settle those of what did: live, or,
        where consumed records are kept (mongo-history), consumed since the claims were made
        at ``since`` (a consumer may take a message between the insert that failed and this
        look; read as never stored, its retry stored it again)."""
        landed: list[str] = []
        with contextlib.suppress(Exception):
            found = await self._landed(dict.fromkeys(claimed, _as_stored(since)))
            landed = [message_id for message_id in claimed if message_id in found]
            claimed = [message_id for message_id in claimed if message_id not in found]
        if claimed:
            await self._dedup.delete_many({"_id": {"$in": claimed}, "by": token})
        await self._settle(landed, token)

    async def _insert_entries(
        self, entries: Sequence[Entry], flags: list[bool], now: float
    ) -> list[bool]:
        docs: list[Document] = []
        where: list[int] = []
        prioritized = False
        for i, entry in enumerate(entries):
            if flags[i]:
                mature = entry.mature
                if mature is None:
                    mature = now + entry.delay + i * TIE_STEP
                doc = {
                    "_id": entry.id,
                    "payload": entry.payload,
                    "headers": entry.headers,
                    "mature": mature,
                    "tries": entry.tries,
                    "reserved": False,
                }
                if entry.priority:  # (a plain push builds its document as before priorities)
                    doc.update(_priority_fields(entry.priority))
                    prioritized = True
                docs.append(doc)
                where.append(i)
        if prioritized:  # its index first: then its takes see them
            await self._backend.ensure_priority(self.name)
        if docs:
            # a popped message put back (its consumer was cancelled) has a mature time
            put_back = {e.id for e in entries if e.mature is not None and not e.dedup}
            inserted = await self._insert_docs(self._coll, docs, put_back)
            for i, ok in zip(where, inserted, strict=True):
                flags[i] = ok
        return flags

    async def _claim_ids(
        self, entries: Sequence[Entry], flags: list[bool], now: float, token: str
    ) -> tuple[list[str], set[str]]:
        """Claim user-chosen ids in the dedup collection, marked with the caller's ``token``
        and *pending* until the insert is done (see ``_settle``). Refused entries get a false
        flag; returns the ids claimed, and those other pushes hold pending (not waited for
        here: see ``_insert_held_last``)."""
        first: dict[str, int] = {}
        for i, entry in enumerate(entries):
            if entry.dedup:
                if entry.id in first:
                    flags[i] = False  # the same id twice in one batch: the first one wins
                else:
                    first[entry.id] = i
        ids = list(first)
        try:
            await self._dedup.insert_many(
                [self._id_claim(i, now, token) for i in ids], ordered=False
            )
            return ids, set()
        except mongo_errors.BulkWriteError as exc:
            taken = [ids[k] for k in sorted(_dup_indexes(exc))]
        refused, held = await self._contend(taken, token, wait=False)
        for message_id in refused:
            flags[first[message_id]] = False
        return [i for i in ids if i not in refused and i not in held], held

    def _id_claim(self, message_id: str, now: float, token: str) -> Document:
        return {
            "_id": message_id,
            "expires": _date(now + self.options.dedup_window),
            "by": token,
            "since": _date(now),
            "pending": _date(now + DEDUP_LEASE),
        }

    async def _contend(
        self, taken: list[str], token: str, *, wait: bool
    ) -> tuple[set[str], set[str]]:
        """Resolve ids another claim holds (see Returns below). A settled claim refuses
        the id (its message was stored). An expired one (the TTL monitor runs only once a
        minute), or a pending one past its lease whose message is not in the queue (its
        pusher died between claim and insert, or gave it back), is taken over: deleted,
        then inserted anew, of concurrent contenders exactly one insert succeeding. (Not an
        update: dates are only ever written by inserts, which every server stores as
        dates.) One still pending within its lease is waited for: refusing it would lose the
        message if its pusher then died, as a Spark task's speculative twin does. Returns the
        ids refused, and (unless ``wait``) those still held pending by another push.

        A claim's lease end is its pusher's clock plus ``DEDUP_LEASE``: from a pusher whose
        clock ran ahead, it held every push of the id that much longer (a day ahead, a day).
        So a pending claim is waited for at most ``DEDUP_LEASE`` from when this call first
        met it, on this process's monotonic clock, whatever its lease end says; and its
        message is looked for as consumed since that meeting at the latest."""
        refused: set[str] = set()
        pause, longest = CONTEND_PAUSE
        met: dict[tuple[str, str], tuple[float, float]] = {}  # (id, by) -> when first seen
        while taken:
            now = time.time()
            clock = monotonic()
            found = {doc["_id"]: doc async for doc in self._dedup.find({"_id": {"$in": taken}})}
            free: dict[str, Document | None] = {}  # id -> the filter of what to delete first
            stale: dict[str, float] = {}  # id -> when its pending claim was made
            held: list[str] = []
            for message_id in taken:
                doc = found.get(message_id)
                if doc is None:  # given back meanwhile
                    free[message_id] = None
                elif doc.get("by") == token:  # ours, written by a retried insert_many
                    continue
                elif _epoch(doc["expires"]) <= now:
                    free[message_id] = {"_id": message_id, "expires": {"$lte": _date(now)}}
                elif "pending" not in doc:
                    refused.add(message_id)
                else:
                    first = (clock, _as_stored(now))
                    seen, seen_at = met.setdefault((message_id, doc["by"]), first)
                    if _epoch(doc["pending"]) > now and clock - seen < DEDUP_LEASE:
                        held.append(message_id)
                    else:
                        stale[message_id] = min(_epoch(doc["since"]), seen_at)
            if stale:
                landed = await self._landed(stale)
                refused.update(landed)
                for message_id in stale.keys() - landed:
                    # still that push's, still pending (its lease end may lie ahead of now)
                    free[message_id] = {
                        "_id": message_id,
                        "by": found[message_id]["by"],
                        "pending": {"$exists": True},
                    }
            won = await asyncio.gather(
                *(self._take_over(i, f, now, token) for i, f in free.items())
            )
            lost = [i for i, ok in zip(free, won, strict=True) if not ok]
            if held and not wait and not lost:
                return refused, set(held)
            taken = held + lost
            if held and wait:
                await asyncio.sleep(pause)
                pause = min(pause * 2, longest)
        return refused, set()

    async def _take_over(
        self, message_id: str, stale: Document | None, now: float, token: str
    ) -> bool:
        if stale is not None:
            await self._dedup.delete_one(stale)
        try:
            await self._dedup.insert_one(self._id_claim(message_id, now, token))
            return True
        except mongo_errors.DuplicateKeyError:
            return False  # another contender's: looked at again

    async def _landed(self, since: dict[str, float]) -> set[str]:
        """Of ids claimed at ``since[id]``, those whose message is in the queue: live, or,
        where consumed messages are kept (mongo-history), consumed after the claim."""
        cursor = self._coll.find({"_id": {"$in": list(since)}}, {"_id": 1, "processed": 1})
        return {
            doc["_id"]
            async for doc in cursor
            if "processed" not in doc or _epoch(doc["processed"]) >= since[doc["_id"]]
        }

    async def _insert_docs(
        self, coll: Collection, docs: list[Document], revive: set[str] | None = None
    ) -> list[bool]:
        """insert_many(ordered=False); false where the id is taken by a live message."""
        try:
            await coll.insert_many(docs, ordered=False)
            return [True] * len(docs)
        except mongo_errors.BulkWriteError as exc:
            refused = sorted(_dup_indexes(exc))
        flags = [k not in refused for k in range(len(docs))]
        freed, revived = await self._make_room(coll, [docs[k] for k in refused], revive or set())
        retry = []
        for k in refused:
            if docs[k]["_id"] in revived:
                flags[k] = True
            elif docs[k]["_id"] in freed:
                retry.append(k)
        if retry:
            again = await self._insert_docs(coll, [docs[k] for k in retry])
            for k, ok in zip(retry, again, strict=True):
                flags[k] = ok
        return flags

    # consuming ----------------------------------------------------------------------------

    @translated
    async def get(self, n: int) -> Fetched:
        # Run to the end whatever the caller does: a claim or delete the server ran while
        # the wait was cancelled would lose the messages it took (see ``to_the_end``).
        return await to_the_end(self._get(n))

    async def _get(self, n: int) -> Fetched:
        now = time.time()
        consumed = self._consumed(now)
        if n == 1:
            docs = await self._pop_one(now, consumed)
        elif consumed is None:
            lease = {"$set": {"mature": now + CLAIM_LEASE, "reserved": True}}
            docs, token = await self._claim(n, now, lease)
            docs = await self._renew(docs, token, now, LATE_POP, CLAIM_LEASE)
            docs = await self._delete_claimed(docs, token)
        else:
            docs, _ = await self._claim(n, now, consumed)
        return await self._fetched(docs, n)

    async def _pop_one(self, now: float, consumed: Document | None) -> list[Document]:
        """The earliest mature message, taken by a pop of one alone (no batch).

        Taken under a token of this pop's, so that it can be found again when the reply
        that hands it over is lost (see :meth:`_take_one`). mongo claims it for a lease
        then deletes it: a findAndModify remove leaves nothing on the server to find the
        message by once it ran, and a pop cut then (``asyncio.run`` ending) lost it; a
        claim cut leaves it claimed, read back and handed on, or back after the lease.
        mongo-history marks it processed in the one findAndModify: the record stays, and
        is read back by its processed time and the token."""
        token = os.urandom(8).hex()
        if consumed is None:
            lease_end = now + CLAIM_LEASE
            change = {"$set": {"mature": lease_end, "reserved": True, "owner": token}}
            mark: Document = {"mature": _near(lease_end, 1.0), "owner": token}
        else:
            change = {**consumed, "$set": {**consumed["$set"], "owner": token}}
            processed: datetime = consumed["$set"]["processed"]
            mark = {"processed": _near(processed, timedelta(seconds=1)), "owner": token}
        doc = await self._take_one(now, change, mark)
        if doc is None:
            return []
        if consumed is None:
            docs = await self._renew([doc], token, now, LATE_POP, CLAIM_LEASE)
            return await self._delete_claimed(docs, token)
        return [doc]

    async def _delete_claimed(self, docs: list[Document], token: str) -> list[Document]:
        """Of ``docs``, claimed by a pop under ``token``, those its delete removed: the pop
        hands over only those. What it claimed may be taken before the delete lands: by a
        consumer whose clock runs ``CLAIM_LEASE`` ahead (the claim looks lapsed to it; so
        does one the pop delays past its lease) and that reserves it (a new owner), or by
        an ok by id (its guard is ``reserved`` alone), a ko by id and then a reserve, or
        a remove once the claim lapsed. Handed over too, it was delivered twice (a pop is
        at-most-once). One a move claimed is left to the move.

        A delete tells how many documents it removed, never which (MongoDB manual, the
        ``delete`` command's output ``n``): all claimed, the common case, costs nothing
        more. Fewer, and the live ones are someone else's; the gone ones are all ours when
        as many are gone as were deleted, and when more are, which are ours is unknown, so
        none is handed over (at most once: lost rather than delivered twice). A delete
        whose reply was cut under this task (see :func:`_again_if_cut`) is sent again; the
        first may have removed them, so every gone one counts as ours then."""
        if not docs:
            return []
        ids = [doc["_id"] for doc in docs]
        delete = self._coll.delete_one if len(ids) == 1 else self._coll.delete_many
        claimed: Document = {"_id": ids[0] if len(ids) == 1 else {"$in": ids}, "owner": token}
        # not one a move (by id) claimed from under this pop: that claim leaves ``owner``,
        # and deleted here between the move's copy and its delete, the message was handed
        # over while its copy stood in the other queue
        mine = _unclaimed(claimed, time.time())
        cut = False
        try:
            deleted = (await delete(mine)).deleted_count
        except asyncio.CancelledError:
            if _given_up():
                raise
            cut = True
            deleted = (await delete(mine)).deleted_count
        if deleted == len(ids):
            return docs
        if deleted == 0 and not cut:
            return []
        where = {"_id": {"$in": ids}}
        found = await _again_if_cut(lambda: self._coll.find(where, {"_id": 1}).to_list())
        gone = set(ids) - {doc["_id"] for doc in found}
        if not cut and len(gone) != deleted:
            return []
        return [doc for doc in docs if doc["_id"] in gone]

    async def _take_one(self, now: float, change: Document, mark: Document) -> Document | None:
        """The earliest mature message changed by ``change``, as it was before (one
        findAndModify). ``change`` sets the caller's token, and ``mark`` (a narrow range of
        an indexed field, and the token) finds the message once changed: when PyMongo's task
        reading the reply is cancelled under this one (``asyncio.run`` ending, see
        :func:`_again_if_cut`), whether the change ran is unknown, and the message is read
        back by ``mark``, its counts taken back by what ``change`` added and its mature time
        then the take's (it was due by then; the one it had is overwritten)."""
        try:
            return await self._coll.find_one_and_update(
                {"mature": {"$lte": now}},
                change,
                sort=await self._order(),
                return_document=ReturnDocument.BEFORE,
            )
        except asyncio.CancelledError:
            if _given_up():
                raise
        doc = await _again_if_cut(lambda: self._coll.find_one(mark))
        if doc is None:
            return None
        added: dict[str, int] = change.get("$inc", {})
        before = {k: doc[k] - step for k, step in added.items() if _canonical(doc[k])}
        return {**doc, "mature": now, **before}

    @translated
    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        return await to_the_end(self._reserve(n, reserve_delay))

    async def _reserve(self, n: int, reserve_delay: float) -> Fetched:
        now = time.time()
        until = now + reserve_delay
        update: Document = {"$set": {"mature": until, "reserved": True}, "$inc": {"tries": 1}}
        if n == 1:
            # under a token, as a lone pop: a reservation whose reply was cut is found
            # again and given back, not left held until reserve_delay
            token = os.urandom(8).hex()
            change = {**update, "$set": {**update["$set"], "owner": token}}
            mark = {"mature": _near(until, 1.0), "owner": token}
            doc = await self._take_one(now, change, mark)
            docs = [] if doc is None else [doc]
        else:
            docs, token = await self._claim(n, now, update)
        await self._mend_tries(docs, token)
        # late past half of a reserve_delay shorter than LATE_RESERVE too: by the reply,
        # the reservation may have lapsed and the message been taken (one of 0 lapses at
        # once whatever is done)
        if reserve_delay > 0:
            late = min(LATE_RESERVE, reserve_delay / 2)
            docs = await self._renew(docs, token, now, late, reserve_delay)
        return await self._fetched(docs, n, token)

    async def _mend_tries(self, docs: list[Document], token: str) -> None:
        """Store the count of the messages just reserved (under ``token``) whose stored
        count was not one of ours (see :func:`_tries`) as the count read + 1, as a reserve
        of one of ours leaves it: the holder's guard (its count + 1) then matches, and ok,
        ko and the next reserve count from there. One more round trip, for those only."""
        for doc in docs:
            if not _canonical(doc["tries"]):
                mine = {"_id": doc["_id"], "owner": token}
                fixed = {"$set": {"tries": _tries(doc["tries"]) + 1}}
                await _again_if_cut(lambda: self._coll.update_one(mine, fixed))  # noqa: B023

    async def _renew(
        self, docs: list[Document], token: str, started: float, late: float, hold: float
    ) -> list[Document]:
        """``docs`` as taken, unless the call that took them (at ``started``) took more than
        ``late`` seconds: then their reservations (or a pop's claims) start again from now,
        for ``hold`` seconds. Their end was computed from the client's clock at the call's start
        (MongoDB has no cheap server time), and a reserve slowed by a reconnect or a busy
        pool handed its holder what was left of ``reserve_delay``, so that another consumer
        could take the message while the first one still worked on it. Those another
        consumer took meanwhile (their reservation lapsed before the reply came) are not
        handed over: they are that consumer's."""
        if not docs or time.time() - started <= late:
            return docs
        ids = [doc["_id"] for doc in docs]
        mine = {"_id": {"$in": ids}, "owner": token, "reserved": True}
        renewed = {"$set": {"mature": time.time() + hold}}
        result = await _again_if_cut(lambda: self._coll.update_many(mine, renewed))
        if result.matched_count == len(docs):
            return docs
        found = await _again_if_cut(lambda: self._coll.find(mine, {"_id": 1}).to_list())
        ours = {doc["_id"] for doc in found}
        return [doc for doc in docs if doc["_id"] in ours]

    async def _claim(self, n: int, now: float, update: Document) -> tuple[list[Document], str]:
        """Up to ``n`` mature messages, earliest first, each changed by ``update`` exactly
        once and for this batch only; returned as they were before the change."""
        token = os.urandom(8).hex()
        update = {**update, "$set": {**update["$set"], "owner": token}}
        due = {"mature": {"$lte": now}}
        ready = due
        order = await self._order()
        mine: list[Document] = []
        for _ in range(CLAIM_ATTEMPTS):  # others may snatch candidates; try a few times
            wanted = n - len(mine)
            # (repeated if cut: a read, and a later attempt's cut would lose what the
            # earlier ones claimed)
            candidates = await _again_if_cut(
                lambda: self._coll.find(ready, sort=order, limit=wanted).to_list()  # noqa: B023
            )
            if not candidates:
                break
            ids = [d["_id"] for d in candidates]
            # Not already ours: a claim run again (below) must not change what the first
            # run changed, and with a ``reserve_delay`` of 0 that still matches ``due``
            # (mature = now). ``$nin``, not ``$ne``: nx-27017's ``$ne`` skips documents
            # without the field.
            claim = {"_id": {"$in": ids}, **due, "owner": {"$nin": [token]}}
            modified: int | None
            try:
                modified = (await self._coll.update_many(claim, update)).modified_count
            except asyncio.CancelledError:
                if _given_up():
                    raise
                # Whether the claim ran is unknown. Running it again changes nothing it
                # changed (those carry our token); our token tells ours.
                await self._coll.update_many(claim, update)
                modified = None
            if modified == len(candidates):
                mine.extend(candidates)
            elif modified is None or modified:
                read_back = {"_id": {"$in": ids}, "owner": token}
                found = await _again_if_cut(
                    lambda: self._coll.find(read_back, {"_id": 1}).to_list()  # noqa: B023
                )
                ours = {d["_id"] for d in found}
                mine.extend(d for d in candidates if d["_id"] in ours)
            if len(mine) == n or len(candidates) < wanted:
                break
        mine.sort(key=_rank)
        return mine, token

    async def _order(self) -> list[tuple[str, int]]:
        """The take's sort: by mature time, or ``BY_PRIORITY`` once the queue has
        priorities. Not ``BY_PRIORITY`` always: a server that cannot sort on a compound
        index (nx-27017, whose SQLite sorts every ready document for it) took a plain
        queue's message 25 times slower with it, at 20,000 ready."""
        return BY_PRIORITY if await self._backend.prioritized(self.name) else BY_MATURE

    async def _fetched(self, docs: list[Document], n: int, token: str | None = None) -> Fetched:
        # The wait loop reads next_mature only when a request got nothing: a full batch
        # spares the extra round trip. Repeated if cut: the messages are taken by now, and
        # a CancelledError here would end the batch without them.
        next_mature = None if len(docs) == n else await _again_if_cut(self._next_mature)
        return Fetched([_stored(d, token) for d in docs], next_mature)

    # acknowledging ------------------------------------------------------------------------

    @translated
    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        if not acks:
            return []
        now = time.time()
        if len(acks) == 1:
            ack = acks[0]
            guard = _ok_guard(ack.id, ack.tries, ack.token, now)
            return [await self._finish(guard, now, held=True) == 1]
        return await self._commit_many(acks, now)

    async def _commit_many(self, acks: Sequence[Ack], now: float) -> list[bool]:
        """A batch ok (several callers' acks in one call), each caller told whether its own
        ok ended its message, whatever else ended the batch's other messages meanwhile: the
        same holder's ok sent again after a cancellation (in this process or another),
        another consumer's once a reservation lapsed, a remove. A delete reports how many
        documents it removed, never which (MongoDB manual, the ``delete`` command's output
        ``n``), and leaves nothing to read back; so the batch first *claims* what it may
        end, one ``update_many`` whose filter is each ack's guard: it writes the batch's
        token as ``acker``, moves ``owner`` aside (to ``acked_owner``), so that no
        holder's ok, ko, move or renewal matches any more, and starts a claim lease
        (``mature``), so that no reserve, pop or remove takes a lapsed one. Then it deletes
        what carries its token. Two round trips, as the read and the delete they replace;
        a third, a read of what carries the token, only when the claim counted fewer than
        the batch's ids (some were ended, or taken, before it) or an id came twice (which
        ack named it is told by its owner and count before the claim). A process dying
        between the claim and the delete leaves its messages to come back at the lease's
        end, as an ok never sent would. While the claim runs, an ok, ko, move or extend
        by bare id yields to it (see :func:`_yielding`): only the same reservation's ok sent
        again (see below) can end a claimed message before that delete, and a holder
        is then told True by both (see :meth:`_gone_here`). Once the claim lapsed, a ko
        by bare id may give the message back: the delete, which asks for it still
        reserved, leaves it.

        A claim whose delete failed (or whose reply was lost) is finished by the same ok
        sent again, the consumer's retry or its caller's (:func:`_claimed_for`): only when
        the claim fell short of the batch's ids, a second update, of those claimed for
        the same reservations, that takes them over under this batch's token."""
        mark = os.urandom(8).hex()
        ids = list({a.id: None for a in acks})
        update: Document = {
            "$set": {"acker": mark, "mature": now + CLAIM_LEASE},
            "$rename": {"owner": "acked_owner"},
        }
        guards = _acked(acks, now)
        assert guards is not None
        claimed = (await self._coll.update_many(guards, update)).modified_count
        if claimed < len(ids) and (again := _acked(acks, now, mark)) is not None:
            # claimed before for the same reservations, not ended (see _claimed_for): a
            # second update, as ``$rename`` of a missing ``owner`` must not touch
            # ``acked_owner`` (MongoDB leaves it; nx-27017 writes null there)
            renewed = {"$set": update["$set"]}
            claimed += (await self._coll.update_many(again, renewed)).modified_count
        if not claimed:
            return [False] * len(acks)
        before: dict[str, Holding | None] = dict.fromkeys(ids)
        if claimed != len(ids) or len(ids) < len(acks):
            mine = {"_id": {"$in": ids}, "acker": mark}
            cursor = self._coll.find(mine, {"tries": 1, "acked_owner": 1})
            before = {
                d["_id"]: (_tries(d["tries"]), d.get("acked_owner")) for d in await cursor.to_list()
            }
        # still reserved: a ko by bare id landing after the claim gave the message back
        ending = {
            "_id": {"$in": list(before)},
            "acker": mark,
            "owner": {"$exists": False},
            "reserved": True,
        }
        ended = await self._finish(ending, now, held=True)
        if ended == len(before):
            ours = set(before)
        else:
            ours = await self._gone_here(list(before), ended, now)
        results: list[bool] = []
        for ack in acks:
            held = before.get(ack.id)
            ok = ack.id in ours and (held is None or _names(ack.tries, ack.token, *held))
            if ok:
                ours.discard(ack.id)  # (one ack per message is the one that ended it)
            results.append(ok)
        return results

    async def _gone_here(self, ids: list[str], ended: int, claimed_at: float) -> set[str]:
        """Which of ``ids``, claimed by a batch ok at ``claimed_at``, its holders may be
        told it ended when its delete counted ``ended``, fewer: one still live was taken
        once the claim's lease lapsed (or given back by a ko once it had), not ended here.
        As many gone as ended here are all ours. More: while the claim runs, only its
        own delete and the same reservations' oks sent again end a claimed message
        (calls by bare id yield to it, see :func:`_yielding`), so each gone one was ended
        for the holder that asked, by this call or by its own retry: all are answered
        True (they answered False, the ones this delete ended too). Once the claim may
        have lapsed (``LATE_POP`` after it, the margin a pop allows for other clients'
        clocks), another consumer may have taken and ended one, and which are ours is
        unknown: none is answered True (two consumers told they ended one message)."""
        cursor = self._coll.find({"_id": {"$in": ids}, **LIVE}, {"_id": 1})
        gone = set(ids) - {doc["_id"] for doc in await cursor.to_list()}
        if len(gone) == ended or time.time() < claimed_at + LATE_POP:
            return gone
        return set()

    @translated
    async def extend(self, extends: Sequence[Extend]) -> list[bool]:
        """One update per length asked for (a consumer's renewals all ask for its
        ``reserve_delay``): each guard as ok's. A message under its holder's own move claim
        is extended too (refused, the holder's renewals took it for one another consumer
        took; should the mover die between copy and delete, the copy left here comes back
        at the extended end rather than the claim's). A batch ok's claim whose lease lapsed
        (its process died before the delete) is extended as the reservation it ended: the
        claim's ``acker`` goes, so the message no longer reads as claimed (see
        :func:`_yielding`) and that batch's late delete leaves it. Every message it extends
        gets the very same end, which tells them when the update matched fewer than asked:
        one read of those, only then (within half a second of it, see :func:`_near`), but
        for a claim read back, whose lease may end there too (see :func:`_under_claim`)."""
        if not extends:
            return []
        now = time.time()
        by_length: dict[float, list[Extend]] = {}
        for extend in extends:
            by_length.setdefault(extend.seconds, []).append(extend)
        extended: dict[float, list[Document] | None] = {}  # None: every guard matched

        async def one_length(seconds: float, group: list[Extend]) -> None:
            until = now + seconds
            # by bare id: not a batch ok's claim, whose lease (mature) this would rewrite
            guards = [_yielding(_guard(e.id, e.tries, e.token), now) for e in group]
            held = guards[0] if len(guards) == 1 else {"$or": guards}
            # a lapsed claim (its batch died before its delete) extended by bare id is held
            # as a reservation: left ``acker`` with the lease ahead, it read as claimed again
            extension = {"$set": {"mature": until}, "$unset": {"acker": ""}}
            updated = await self._coll.update_many(held, extension)
            if updated.matched_count == len(group):
                extended[seconds] = None
                return
            ids = list({e.id for e in group})
            mine = {"_id": {"$in": ids}, "mature": _near(until, 0.5), "reserved": True}
            shown = {"tries": 1, "owner": 1, "acker": 1}
            extended[seconds] = await self._coll.find(mine, shown).to_list()

        await asyncio.gather(*(one_length(s, g) for s, g in by_length.items()))
        results = []
        for extend in extends:
            docs = extended[extend.seconds]
            results.append(
                docs is None
                or any(
                    d["_id"] == extend.id
                    and _names(extend.tries, extend.token, _tries(d["tries"]), d.get("owner"))
                    and not _under_claim(d)
                    for d in docs
                )
            )
        return results

    @translated
    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        if not nacks:
            return []
        # to its end, once begun: a give-back first reads the server's time, and a close
        # cancelled during that round trip counted the give-back as sent while none of its
        # updates had left (the reservations then held until reserve_delay ran out)
        return await to_the_end(self._rollback(nacks, deadletter))

    async def _rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        now = time.time()
        by_id: dict[str, list[int]] = {}
        for k, nack in enumerate(nacks):
            by_id.setdefault(nack.id, []).append(k)
        results = [KoResult.MISSING] * len(nacks)
        back = await self._given_back_at(now) if any(not n.count_try for n in nacks) else now

        async def in_turn(positions: list[int]) -> None:
            """Requests naming one id, in order, until one acts: a stale holder's ko in the
            same batch fails its guard and must not stand for the holder's."""
            for k in positions:
                at = now if nacks[k].count_try else back
                results[k] = await self._rollback_one(nacks[k], deadletter, at)
                if results[k] is not KoResult.MISSING:
                    return

        await asyncio.gather(*(in_turn(positions) for positions in by_id.values()))
        return results

    async def _given_back_at(self, now: float) -> float:
        """When a reservation given back unseen (no try counted) is due again: ``now``, or
        the server's time when this clock is ahead of it. A give-back means "at once", and
        at a clock a day ahead it kept the message from every other consumer for a day.
        Only give-backs pay this round trip (a close, a cancelled reserve); the server's
        time is the ``localTime`` of its ``hello`` reply (MongoDB manual, "hello")."""
        try:
            hello = await self._backend.client.admin.command("hello")
        except mongo_errors.PyMongoError:
            # a server without hello (before 4.4.2), or a failed read: the give-back itself
            # still goes (its own failure is reported)
            return now
        server = hello.get("localTime")
        return min(now, _epoch(server)) if isinstance(server, datetime | str) else now

    async def _rollback_one(self, nack: Nack, plan: DeadletterPlan | None, now: float) -> KoResult:
        held = _guard(nack.id, nack.tries, nack.token)
        guard = _unclaimed(held, now)  # not what a move of it took first
        update: Document = {"$set": {"reserved": False, "mature": now + nack.delay}}
        if not nack.count_try:
            update["$inc"] = {"tries": -1}  # gone back unseen: the delivery does not count
        if plan is None or not nack.count_try:
            released = await self._coll.update_one(guard, update)
            return KoResult.ROLLED_BACK if released.matched_count else KoResult.MISSING
        # stored tries = failed deliveries, this one included
        if nack.tries is None or nack.tries + 1 <= plan.max_ko:
            counted = {**held, "tries": held.get("tries", {"$lte": plan.max_ko})}
            released = await self._coll.update_one(_unclaimed(counted, now), update)
            if released.matched_count:
                return KoResult.ROLLED_BACK
        doc = await self._coll.find_one(guard)
        if doc is None or _tries(doc["tries"]) <= plan.max_ko:
            return KoResult.MISSING
        return await self._deadletter(doc, plan, now)

    async def _deadletter(self, doc: Document, plan: DeadletterPlan, now: float) -> KoResult:
        failed = _tries(doc["tries"])
        headers = plan.headers(failed, now)
        move = Move(doc["_id"], None, plan.queue, None, headers, 0.0, deadletter_tag(failed))
        moved = await self._move_doc(doc, move, now)
        return KoResult.MISSING if moved is None else KoResult.DEADLETTERED

    @translated
    async def move(self, moves: Sequence[Move]) -> list[str | None]:
        now = time.time()

        async def one(move: Move) -> str | None:
            guard = _guard(move.id, move.tries, move.token)
            if self._backend.transactions:
                doc = await self._coll.find_one(_yielding(guard, now))
                return None if doc is None else await self._move_doc(doc, move, now)
            # Without transactions the claim is taken with the read: one round trip.
            token = os.urandom(8).hex()
            doc = await self._coll.find_one_and_update(
                _unclaimed(guard, now), _move_claim(token, now)
            )
            return None if doc is None else await self._move_doc(doc, move, now, token)

        return list(await asyncio.gather(*(one(m) for m in moves)))

    async def _move_doc(
        self, doc: Document, move: Move, now: float, claimed: str | None = None
    ) -> str | None:
        """The one move body (``Queue.move`` and deadletter): the held message ``doc`` leaves
        this collection for the other queue's, under the first free name of the rule every
        backend follows (``<id>``, ``<id>.<tag>``, ``<id>.<tag>.2``, ...). In a transaction
        where the server has them; else claimed here, inserted there, then deleted here: a
        crash in between leaves a duplicate (the claim lapses), never a loss. None when it
        was no longer held. ``claimed``: the token of a claim the caller already holds."""
        headers = _headers(doc)
        moved: Document = {
            "payload": _payload(doc) if move.payload is None else move.payload,
            "headers": merge_headers(headers, move.headers) if move.headers else headers,
            "mature": now + move.delay,
            "tries": 0,
            "reserved": False,
            **_priority_fields(_priority(doc)),
        }
        names = [moved_id(doc["_id"], move.tag, clash) for clash in range(MOVE_NAMES)]
        try:
            await self._backend.ensure_indexes(move.queue)
            if _priority(doc):
                await self._backend.ensure_priority(move.queue)
        except Exception:
            if claimed is not None:  # nothing copied yet: see _copy_then_delete
                await self._give_claim_back(_claimed(doc["_id"], claimed, doc))
            raise
        target = self._backend.queue_collection(move.queue)
        held = _as_read(doc)
        if self._backend.transactions:
            # a batch ok may have claimed a message read with no owner since: see _yielding
            yielding = _yielding(held, now)
            return await self._move_in_transaction(yielding, target, moved, names, now)
        token = claimed
        if token is None:
            token = os.urandom(8).hex()
            claim = await self._coll.update_one(_unclaimed(held, now), _move_claim(token, now))
            if not claim.matched_count:
                return None
        # cut between the copy and the delete, the message would be in both queues,
        # delivered again here once the claim lapsed
        mine = _claimed(doc["_id"], token, doc)
        return await self._moving.run(
            self._copy_then_delete(mine, move.queue, target, moved, names, now)
        )

    async def _copy_then_delete(
        self,
        mine: Document,
        queue: str,
        target: Collection,
        moved: Document,
        names: list[str],
        now: float,
    ) -> str:
        """Copy there, then delete here what is still under this move's claim ``mine``. A
        copy the server refused gives the claim back, so that the holder's ok or ko acts on
        its message at once (they yield to a running claim, see :func:`_unclaimed`); one
        that may have landed (its reply lost) keeps it, to lapse: its holder's ok would end
        a message that then stood in the other queue. A delete that found nothing to end
        gives up the claim too (one more round trip, then only): another consumer
        reserved the message once its end passed (the holder's renewal rewrites
        ``mature``, not ``moving``), and kept, the running claim refused that consumer's
        ok and sent the message round once more (the copy landed: a duplicate already)."""
        try:
            for name in names:
                if (await self._insert_docs(target, [{"_id": name, **moved}]))[0]:
                    break
            else:  # pragma: no cover - MOVE_NAMES earlier lives of one id
                raise ConfigError(f"no free id for {mine['_id']!r} in {queue!r}")
        except (ConfigError, mongo_errors.DocumentTooLarge, mongo_errors.OperationFailure) as exc:
            if not isinstance(exc, mongo_errors.WriteConcernError):
                await self._give_claim_back(mine)
            raise
        if not await self._finish(mine, now, held=True):
            # the copy landed all the same: a failure here fails no move, the claim lapses
            await self._give_claim_back({"_id": mine["_id"], "mover": mine["mover"]})
        return name

    async def _give_claim_back(self, mine: Document) -> None:
        """Give back the move claim ``mine`` (a move that failed with nothing copied, or
        whose message another consumer holds by now, see :meth:`_copy_then_delete`): the
        holder's ok or ko, which yield to a running claim (see :func:`_unclaimed`), act on
        the message at once again, rather than once the claim's lease ends. When this fails
        too, the claim lapses."""
        with contextlib.suppress(mongo_errors.PyMongoError):
            await self._coll.update_one(mine, {"$unset": {"mover": "", "moving": ""}})

    @translated
    async def close(self) -> None:
        """Let the moves claimed here end before the backend closes the connection. Bounded
        (see ``Finishing``): one whose server does not answer may leave its message in both
        queues, as a crash between its copy and its delete would."""
        await self._moving.wait(
            self.name,
            "moves given up between copy and delete: their messages may come back here once"
            f" their claims lapse ({CLAIM_LEASE:g} s)",
        )

    async def _move_in_transaction(
        self,
        held: Document,
        target: Collection,
        moved: Document,
        names: list[str],
        now: float,
    ) -> str | None:
        async def move(session: AsyncClientSession) -> str | None:
            if not await self._finish(held, now, session, held=True):
                await session.abort_transaction()
                return None
            cursor = target.find({"_id": {"$in": names}}, {"_id": 1}, session=session)
            taken = {d["_id"] for d in await cursor.to_list()}
            name = next(n for n in names if n not in taken)
            await target.insert_one({"_id": name, **moved}, session=session)
            return name

        async with self._backend.client.start_session() as session:
            result: str | None = await session.with_transaction(move)
        return result

    # administering ------------------------------------------------------------------------

    @translated
    async def remove(self, ids: Sequence[str]) -> list[bool]:
        now = time.time()
        free = {"$or": [{"reserved": False}, {"mature": {"$lte": now}}]}
        counts = await asyncio.gather(
            # ``$and``, not sibling fields: nx-27017 ignores a filter's other fields next
            # to a top-level ``$or`` in writes (it would remove another message).
            *(self._finish({"$and": [{"_id": i, **LIVE}, free]}, now) for i in ids)
        )
        return [count == 1 for count in counts]

    @translated
    async def amend(self, amends: Sequence[Amend]) -> list[bool]:
        """Each amend is one ``update_one`` whose filter is the rule of :meth:`remove` (live,
        and not reserved or its reservation lapsed: a lapsed one counts as waiting) and, with
        ``scheduled_only``, ``mature > now``; the server applies a filter and its update to
        one document atomically (MongoDB manual, "Atomicity and Transactions"), so an amend
        and a reserve racing for a message do not both get it: the reserve's take needs
        ``mature <= now`` and leaves it reserved, which this filter then refuses. True when
        the filter matched (``matched_count``: an amend that changes nothing, a priority it
        already has, is still True).

        All the updates are sent at once (``asyncio.gather``, as :meth:`remove` does): one
        round trip's wait, whatever their number. Not one ``bulk_write``: its result counts
        the documents matched and modified, never which (MongoDB manual, the ``update``
        command's output ``n`` and ``nModified``); only MongoDB 8.0's client ``bulkWrite``
        with ``verboseResults`` tells each, which older servers and those merely speaking
        the protocol lack. A marker set by the bulk update and read back costs a second
        round trip and leaves a field to clean; ``findAndModify`` per message costs the
        same commands as ``update_one`` and sends each document back, unused here.

        Times come from the client's clock, as every time of this backend (see
        :mod:`aio_keuss.mongo.connection`): one ``now`` for the whole call, as the other
        stores read one clock per call, so that every request judges a reservation lapsed
        or a message scheduled against that same instant. A new mature time is written as
        :func:`_kept` makes it, so that the next request of the call reads back the time
        written (see there). Amends of one message in one call are applied in their order,
        each after the one before (a round trip more for each repeat): sent at once, they
        landed in any order. A priority other than 0 makes
        the queue's index of ``BY_PRIORITY`` first, as a prioritized push does (only the
        first time: ``ensure_priority`` remembers it)."""
        if not amends:
            return []
        if any(a.priority for a in amends):  # its index first: then its takes see them
            await self._backend.ensure_priority(self.name)
        now = time.time()
        done = [False] * len(amends)
        calls: dict[str, list[int]] = {}
        for i, amend in enumerate(amends):
            calls.setdefault(amend.id, []).append(i)

        async def in_turn(indexes: list[int]) -> None:
            for i in indexes:
                done[i] = await self._amend_one(amends[i], now)

        await asyncio.gather(*(in_turn(indexes) for indexes in calls.values()))
        return done

    async def _amend_one(self, amend: Amend, now: float) -> bool:
        where = _waiting(amend.id, now, amend.scheduled_only)
        result = await self._coll.update_one(where, _amended(amend, now))
        return result.matched_count == 1

    # looking without taking -------------------------------------------------------------

    @translated
    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        now = time.time()
        docs = await _walk(self._coll, _state_filter(state, now), "mature", after, limit)
        cursor = (float(docs[-1]["mature"]), docs[-1]["_id"]) if len(docs) == limit else None
        return PeekPage([_peeked(d, now) for d in docs], cursor)

    @translated
    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        now = time.time()
        where = {"_id": {"$in": list(ids)}}
        found = {d["_id"]: d for d in await self._coll.find(where).to_list()}
        rows: list[Peeked | None] = []
        for message_id in ids:
            doc = found.get(message_id)
            if doc is None or not isinstance(doc.get("mature"), int | float):
                rows.append(None)  # (no mature time: another program's, never delivered)
            else:
                rows.append(_processed(doc) if "processed" in doc else _peeked(doc, now))
        return rows

    @translated
    async def hold(self, ids: Sequence[str], reserve_delay: float) -> list[Held | None]:
        now = time.time()
        # a token of its own, as every take: a late reserve or pop that held the message
        # before renews (and hands over) only what still carries its token (``_renew``);
        # and the move that follows asks for it, since a pop's claim of the message once
        # the hold lapsed keeps the count the hold left
        token = os.urandom(8).hex()
        taken = {"mature": now + reserve_delay, "reserved": True, "owner": token}
        update = {"$set": taken, "$inc": {"tries": 1}}
        free = {"$or": [{"reserved": False}, {"mature": {"$lte": now}}]}

        async def one(message_id: str) -> Held | None:
            doc = await self._coll.find_one_and_update(
                {"$and": [{"_id": message_id, **LIVE}, free]},
                update,
                return_document=ReturnDocument.BEFORE,
            )
            if doc is None:
                return None
            await self._mend_tries([doc], token)
            return Held(_tries(doc["tries"]), token)

        return list(await asyncio.gather(*(one(i) for i in ids)))

    @translated
    async def history(
        self, since: float, until: float, after: Cursor | None, limit: int
    ) -> PeekPage:
        if type(self)._consumed is MongoStore._consumed:
            return await super().history(since, until, after, limit)
        where = {"processed": {"$gte": _ms_date(since), "$lt": _ms_date(until)}}
        past = None if after is None else (_ms_date(after[0]), after[1])
        docs = await _walk(self._coll, where, "processed", past, limit)
        rows = [_processed(d) for d in docs]
        cursor = (rows[-1].at, docs[-1]["_id"]) if len(docs) == limit else None
        return PeekPage(rows, cursor)

    @translated
    async def sizes(self) -> Sizes:
        now = time.time()
        pipeline: list[Document] = [
            {"$match": LIVE},
            {
                "$group": {
                    "_id": None,
                    "total": {"$sum": 1},
                    "ready": {"$sum": {"$cond": [{"$lte": ["$mature", now]}, 1, 0]}},
                    "reserved": {
                        "$sum": {
                            "$cond": [{"$and": [{"$gt": ["$mature", now]}, "$reserved"]}, 1, 0]
                        }
                    },
                }
            },
        ]
        rows = await (await self._coll.aggregate(pipeline)).to_list()
        if not rows:
            return Sizes(0, 0, 0, 0)
        total, ready, reserved = (int(rows[0][k]) for k in ("total", "ready", "reserved"))
        return Sizes(ready, total, total - ready - reserved, reserved)

    @translated
    async def next_mature(self) -> float | None:
        return await self._next_mature()

    async def _next_mature(self) -> float | None:
        doc = await self._coll.find_one(LIVE, {"mature": 1}, sort=BY_MATURE)
        return None if doc is None else float(doc["mature"])


class MongoHistoryStore(MongoStore):
    """Consumed messages stay, marked ``processed``, until the TTL index expires them."""

    def _consumed(self, now: float, held: bool = False, mark: str | None = None) -> Document | None:
        """Marked processed. A reserve counted its try up front: a message ended under a
        reservation gives it back, so that its record shows what its holder was given
        (as a pop's shows what the pop was given). ``mark`` is kept as ``ended_by``."""
        ended: Document = {"processed": _date(now), "mature": FAR_FUTURE, "reserved": False}
        if mark is not None:
            ended["ended_by"] = mark
        done: Document = {"$set": ended}
        return {**done, "$inc": {"tries": -1}} if held else done

    async def _commit_many(self, acks: Sequence[Ack], now: float) -> list[bool]:
        """A batch ok: one read of the holders' counts and owners, then one update marking
        processed the messages still so held, each record keeping the batch's token as
        ``ended_by``. Should something else end one of them between the read and the
        update (the same holder's ok sent again, another consumer's once a reservation
        lapsed; a move that claimed one, see :func:`_unclaimed`, keeps it from this
        update), the update counts fewer, and the records marked with the token are
        exactly those this batch ended: one more read, after a short count only. A record
        moved aside since (its id pushed again, see :meth:`_make_room`) is not found by
        its id, and is answered False."""
        ids = list({a.id: None for a in acks})
        where = {"_id": {"$in": ids}, "reserved": True}
        cursor = self._coll.find(where, {"tries": 1, "owner": 1})
        stored = {d["_id"]: (_tries(d["tries"]), d.get("owner")) for d in await cursor.to_list()}
        held: dict[str, Holding] = {}
        results = []
        for ack in acks:
            found = stored.get(ack.id)
            ok = (
                found is not None
                and ack.id not in held
                and _names(ack.tries, ack.token, found[0], found[1])
            )
            if ok and found is not None:
                held[ack.id] = (found[0], ack.token)
            results.append(ok)
        if held:
            mark = os.urandom(8).hex()
            ending = {"$and": [_by_tries(held), _not_moving(now)]}  # see _unclaimed
            ended = await self._finish(ending, now, held=True, mark=mark)
            if ended != len(held):
                marked = {"_id": {"$in": list(held)}, "ended_by": mark}
                found_ids = await self._coll.find(marked, {"_id": 1}).to_list()
                ours = {doc["_id"] for doc in found_ids}
                results = [done and ack.id in ours for done, ack in zip(results, acks, strict=True)]
        return results

    async def _make_room(
        self, coll: Collection, docs: list[Document], revive: set[str]
    ) -> tuple[set[str], set[str]]:
        if not docs:
            return set(), set()
        wanted = {d["_id"]: d for d in docs}
        cursor = coll.find({"_id": {"$in": list(wanted)}, "processed": {"$exists": True}})
        freed: set[str] = set()
        revived: set[str] = set()
        for record in await cursor.to_list():
            old_id = record["_id"]
            consumed = {"_id": old_id, "processed": {"$exists": True}}
            if old_id in revive:  # it was never really consumed: back in place
                doc = wanted[old_id]  # same payload and headers as the record's
                back = {k: doc[k] for k in ("mature", "tries", "reserved")}
                replaced = await coll.update_one(
                    consumed, {"$set": back, "$unset": {"processed": "", "ended_by": ""}}
                )
                if replaced.matched_count:
                    revived.add(old_id)
                continue
            when = record["processed"]
            stamp = when.isoformat() if isinstance(when, datetime) else str(when)
            with contextlib.suppress(mongo_errors.DuplicateKeyError):  # archived already
                await coll.insert_one({**record, "_id": f"{old_id}~{stamp}", "id": old_id})
            # deleted by us or by a concurrent insert: either way the id is free again
            await coll.delete_one(consumed)
            freed.add(old_id)
        return freed, revived


class MongoQueueBackend(MongoBackend):
    """``mongo``: consumed messages are deleted."""

    name = "mongo"
    capabilities: Capabilities = Capabilities(
        move=True, peek=True, hold=True, extend=True, priority=True, reschedule=True
    )
    store_class: ClassVar[type[MongoStore]] = MongoStore

    async def store(self, queue: str, options: QueueOptions) -> Store:
        await self.ensure_indexes(queue)
        return self.store_class(queue, options, self)


@dataclass(frozen=True)
class MongoHistoryOptions(MongoOptions):
    """The MongoDB options, and ``history_ttl``: seconds a consumed message is kept."""

    history_ttl: float = 7 * 86400.0

    def __post_init__(self) -> None:
        super().__post_init__()
        ttl = self.history_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < 2**31:
            raise ConfigError(f"history_ttl must be a positive number of seconds, not {ttl!r}")


class MongoHistoryBackend(MongoQueueBackend):
    """``mongo-history``: consumed messages are kept ``history_ttl`` seconds (default 7 days),
    marked ``processed``; ``prefix`` defaults to ``keuss_history``."""

    name = "mongo-history"
    capabilities: Capabilities = Capabilities(
        move=True,
        peek=True,
        hold=True,
        history=True,
        extend=True,
        priority=True,
        reschedule=True,
    )
    default_prefix = "keuss_history"
    store_class = MongoHistoryStore
    options_type: ClassVar[type[MongoOptions]] = MongoHistoryOptions
    options: ClassVar[dict[str, Any]] = MongoHistoryOptions.defaults()

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        assert isinstance(self.config, MongoHistoryOptions)
        self.history_ttl = int(self.config.history_ttl) or 1

    async def _extra_indexes(self, queue: str) -> None:
        coll = self.queue_collection(queue)
        try:
            await coll.create_index([("processed", ASCENDING)], expireAfterSeconds=self.history_ttl)
        except mongo_errors.OperationFailure as exc:
            if exc.code not in (85, 86):  # IndexOptionsConflict: the TTL changed
                raise
            await self.db.command(
                "collMod",
                coll.name,
                index={"keyPattern": {"processed": 1}, "expireAfterSeconds": self.history_ttl},
            )
