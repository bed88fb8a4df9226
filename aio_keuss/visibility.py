"""Looking into a queue without disturbing its consumers, and repairing it: the generic half
of ``peek``, ``browse``, ``find``, ``purge``, ``requeue``, ``history`` and ``replay``.

Keuss counts "open the trunk, peek inside and see exactly what is in each queue, and fix
it" among the advantages of queues kept in a database. A store offers four batch-shaped
primitives for it (:meth:`Store.peek`, :meth:`Store.locate`, :meth:`Store.hold`,
:meth:`Store.history`); everything else is written once here:

- a walk over a queue of any size goes page by page behind a cursor, (sort time, id) of the
  last message seen, so memory stays constant and no snapshot is held on the server. The
  cost: a message that changes state during a walk (reserved, rolled back) moves in the
  order and may be seen twice or not at all.
- ``purge`` walks the queue and removes what is not under an active reservation, through
  the store's ``remove`` (a running consumer's message stays theirs to ok or ko).
- ``requeue`` takes deadlettered messages back to the queue they failed in: each is held by
  id (a reservation, so nobody else can take it meanwhile), then moved with the atomic
  :meth:`Store.move`, which resets its tries. A crash between the two leaves the message in
  the deadletter queue, where its reservation expires: nothing is lost.
- ``replay`` pushes copies of processed messages (new ids; ``x-replay-of`` names the
  original) into a queue; the history record stays.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import TYPE_CHECKING

from .contract import Cursor, Entry, Move, Peeked, PeekPage, Store
from .errors import InvalidInputError
from .ids import new_id
from .message import (
    MAX_KNOWN_ID_LENGTH,
    check_known_id,
    decode_headers,
    decode_message,
    merge_headers,
    salvage_message,
    to_datetime,
)
from .options import brief, check_queue_name
from .types import PEEK_STATES, MessageView, Page, State

if TYPE_CHECKING:
    from .queue import Queue

REQUEUE_TAG = "rq"
"""The tag of a message renamed by ``requeue`` (its origin holds one by that name)."""
DL_FROM = "x-dl-from-queue"
"""The deadletter header naming the queue a message failed in."""
REPLAY_OF = "x-replay-of"
"""The header naming the processed message a replayed copy was made from."""
MAX_TIME = 253402300799.0
"""9999-12-31T23:59:59Z: the open end of a history range, and the latest time a cursor holds."""
MAX_LIMIT = 1_000_000
"""Most messages one ``peek``, ``page`` or ``history`` call returns (``browse`` walks any
number, a page at a time): what a caller can hold in memory, and an int every database
takes as a limit."""
HOLD_SECONDS = 60.0
"""How long ``requeue`` holds a message between taking it and moving it: a crash in between
gives it back to the deadletter queue after this."""


# cursors ------------------------------------------------------------------------------


def encode_cursor(cursor: Cursor | None) -> str | None:
    """The public, opaque form of a cursor: ``<sort time>|<id>`` (ids have no ``|``-free
    guarantee, but the time never contains one, so the first ``|`` splits)."""
    return None if cursor is None else f"{cursor[0]!r}|{cursor[1]}"


def decode_cursor(cursor: str | None) -> Cursor | None:
    """The cursor of an earlier page, checked as far as every store reads one: a time in
    [0, :data:`MAX_TIME`] and a str that encodes as UTF-8 (a store checks the rest, see
    :meth:`Store.check_cursor`)."""
    if cursor is None:
        return None
    if not isinstance(cursor, str) or "|" not in cursor:
        raise InvalidInputError(f"not a cursor from browse / history: {brief(cursor)}")
    when, _, message_id = cursor.partition("|")
    try:
        at = float(when)
        message_id.encode()
    except (ValueError, UnicodeEncodeError):
        raise InvalidInputError(f"not a cursor from browse / history: {brief(cursor)}") from None
    if not 0.0 <= at <= MAX_TIME or len(message_id) > MAX_KNOWN_ID_LENGTH:
        raise InvalidInputError(f"not a cursor from browse / history: {brief(cursor)}")
    return at, message_id


# checks -------------------------------------------------------------------------------


def check_state(state: object) -> str:
    if not isinstance(state, str) or state not in PEEK_STATES:
        raise InvalidInputError(
            f"state must be one of {', '.join(sorted(PEEK_STATES))}, not {brief(state)}"
        )
    return state


def check_limit(limit: object, name: str = "n") -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidInputError(f"{name} must be an int in [1, {MAX_LIMIT:_}], not {brief(limit)}")
    return limit


def check_time(value: datetime | float | None, name: str, default: float) -> float:
    """A bound of a history range: an aware datetime, epoch seconds, or None (``default``)."""
    if value is None:
        return default
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidInputError(f"{name} must be an aware datetime (with a tzinfo)")
        seconds = value.timestamp()
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"{name} must be a datetime or epoch seconds, not {brief(value)}")
    else:
        seconds = value  # compared before float(): an int too big for one is refused, not
        # an OverflowError
    if not 0.0 <= seconds <= MAX_TIME + 1:  # NaN fails too; datetime.max (float: +1) is the end
        raise InvalidInputError(
            f"{name} must be between 1970-01-01 and 9999-12-31 (epoch seconds 0 to"
            f" {MAX_TIME:.0f}), not {brief(value)}"
        )
    return min(float(seconds), MAX_TIME)


# views --------------------------------------------------------------------------------


def view(queue: str, row: Peeked) -> MessageView:
    stored = row.message
    s = stored
    parts = s.id, s.payload, s.headers, s.tries, s.mature, None, s.priority
    try:
        message = decode_message(*parts)
    except Exception:  # shown as stored, so that one bad message does not hide its page
        message = salvage_message(*parts)
    return MessageView(queue, State(row.state), to_datetime(row.at), message)


def page_of(queue: str, found: PeekPage) -> Page:
    return Page([view(queue, row) for row in found.rows], encode_cursor(found.cursor))


async def rows(
    store: Store, state: str, after: Cursor | None, page_size: int
) -> AsyncIterator[Peeked]:
    """Every row of a walk, one page in memory at a time."""
    cursor = after
    while True:
        found = await store.peek(state, cursor, page_size)
        for row in found.rows:
            yield row
        if found.cursor is None:
            return
        cursor = found.cursor


async def peek(store: Store, queue: str, state: str, n: int) -> list[MessageView]:
    taken: list[MessageView] = []
    async for row in rows(store, state, None, min(n, 1000)):
        taken.append(view(queue, row))
        if len(taken) == n:
            break
    return taken


# repairs ------------------------------------------------------------------------------


async def purge(store: Store, page_size: int) -> int:
    """Remove every message not under an active reservation; how many were removed."""
    removed = 0
    cursor: Cursor | None = None
    while True:
        found = await store.peek("all", cursor, page_size)
        ids = [row.message.id for row in found.rows if row.state != State.RESERVED]
        if ids:
            removed += sum(await store.remove(ids))
        if found.cursor is None:
            return removed
        cursor = found.cursor


async def requeue(
    queue: Queue,
    ids: Sequence[str] | None,
    origin: str | None,
) -> dict[str, str]:
    """Move deadlettered messages back where they failed: those in ``ids`` (each to the
    queue its ``x-dl-from-queue`` header names, or ``origin`` if given), or, with ``ids``
    None, every one that failed in ``origin``. Returns id here -> id in its origin."""
    store = queue._store
    moved: dict[str, str] = {}
    if ids is not None:
        wanted = [check_known_id(i) for i in ids]
        for start in range(0, len(wanted), queue.options.max_batch):
            chunk = wanted[start : start + queue.options.max_batch]
            found = await store.locate(chunk)
            rows = {
                row.message.id: row
                for row in found
                if row is not None and row.state != State.RESERVED
            }
            targets = {i: origin or _origin_of(row) for i, row in rows.items()}
            moved.update(await _hold_and_move(queue, targets, rows))
        return moved
    assert origin is not None
    # The walk keeps no snapshot: a message moved back and deadlettered again while it goes
    # on (its origin's consumer failed it once more) lands past the cursor, under the name
    # it had there. It is left for the next requeue, else a requeue beside a failing
    # consumer would move the same messages round for as long as that consumer keeps up.
    done: set[str] = set()
    cursor: Cursor | None = None
    while True:
        page = await store.peek("all", cursor, queue.options.max_batch)
        rows = {
            row.message.id: row
            for row in page.rows
            if row.state != State.RESERVED
            and row.message.id not in done
            and _origin_of(row) == origin
        }
        now_moved = await _hold_and_move(queue, dict.fromkeys(rows, origin), rows)
        moved.update(now_moved)
        done.update(now_moved)
        done.update(now_moved.values())
        if page.cursor is None:
            return moved
        cursor = page.cursor


def _origin_of(row: Peeked) -> str | None:
    """The queue a deadlettered message failed in, or None when its header names none a
    queue can have (anyone may push into a deadletter queue, headers and all): such a
    message stays where it is rather than moving where nobody could reach it; so does one
    whose headers cannot be read."""
    try:
        found = decode_headers(row.message.headers).get(DL_FROM)
        return check_queue_name(found)
    except (InvalidInputError, ValueError):  # ValueError: headers that are not JSON
        return None


def _still_due_in(row: Peeked, now: float) -> float:
    """The delay that keeps a message due when it was: a scheduled one still has its time
    ahead of it; a ready one moves ready. Read before the hold, which makes the message due
    again when the hold lapses (so the hold's time is no guide)."""
    return max(0.0, row.at - now) if row.state == State.SCHEDULED else 0.0


async def _hold_and_move(
    queue: Queue, targets: dict[str, str | None], rows: dict[str, Peeked]
) -> dict[str, str]:
    """Hold each message and move it to its target, due when it was due here: a message
    pushed with a delay and moved before it was due lost its delay and went ready at once,
    which nobody moving it (the admin command ``move``) asked for."""
    plans = {i: t for i, t in targets.items() if t is not None and t != queue.name}
    if not plans:
        return {}
    for target in sorted(set(plans.values())):  # recorded before anything moves there
        await queue._open_target(target)
    ids = list(plans)
    now = time.time()
    delays = {i: _still_due_in(rows[i], now) for i in ids}
    holds = await queue._store.hold(ids, HOLD_SECONDS)
    # The move asks for the hold's token too: once the hold lapsed, another consumer's take
    # of the message can carry the very count the hold was handed.
    moves = [
        Move(
            message_id,
            held.tries,
            plans[message_id],
            delay=delays[message_id],
            tag=REQUEUE_TAG,
            token=held.token,
        )
        for message_id, held in zip(ids, holds, strict=True)
        if held is not None
    ]
    results = await queue._move_batch(moves) if moves else []
    return {m.id: new for m, new in zip(moves, results, strict=True) if new is not None}


# history ------------------------------------------------------------------------------


async def history_rows(
    store: Store, since: float, until: float, after: Cursor | None, page_size: int
) -> AsyncIterator[Peeked]:
    cursor = after
    while True:
        found = await store.history(since, until, cursor, page_size)
        for row in found.rows:
            yield row
        if found.cursor is None:
            return
        cursor = found.cursor


async def replay(
    source: Store,
    target: Queue,
    ids: Sequence[str] | None,
    since: float,
    until: float,
) -> list[str]:
    """Push copies of processed messages of ``source`` into ``target``; their new ids."""
    batch = target.options.max_batch
    copied: list[str] = []
    if ids is not None:
        # an id names one message, however often it is named: one copy each, in the
        # order first named (each naming was located and copied, so a pasted list pushed
        # a message as many times as it held its id)
        wanted = list(dict.fromkeys(check_known_id(i) for i in ids))
        for start in range(0, len(wanted), batch):
            found = await source.locate(wanted[start : start + batch])
            rows_ = [r for r in found if r is not None and r.state == State.PROCESSED]
            copied.extend(await _copy(target, rows_))
        return copied
    # The walk keeps no snapshot: a copy pushed here and consumed while it goes on is a
    # processed record past its cursor (and inside an open range). It is not copied again,
    # else a replay on a live queue would feed on its own copies for as long as a consumer
    # keeps up.
    mine: set[str] = set()
    chunk: list[Peeked] = []
    async for row in history_rows(source, since, until, None, batch):
        if row.message.id in mine:
            continue
        chunk.append(row)
        if len(chunk) == batch:
            made = await _copy(target, chunk)
            copied.extend(made)
            mine.update(made)
            chunk = []
    copied.extend(await _copy(target, chunk))
    return copied


async def _copy(target: Queue, found: list[Peeked]) -> list[str]:
    """Push copies of ``found`` into ``target``. ``x-replay-of`` is merged into the stored
    headers, each key once: appended, a copy replayed again and again (a replay of the
    replays) carried one more ``x-replay-of`` each time."""
    if not found:
        return []
    entries = [  # a copy keeps the priority, where the history kept it
        Entry(
            new_id(),
            r.message.payload,
            merge_headers(r.message.headers, {REPLAY_OF: i}),
            priority=r.message.priority,
        )
        for r in found
        for i in (r.message.id,)
    ]
    await target._insert_entries(entries)
    return [e.id for e in entries]


SiblingQueue = Callable[[str], AbstractAsyncContextManager["Queue"]]
"""How a queue reaches another queue of its factory (the deadletter queue, a replay target):
held for the call that uses it, which the factory's reopen of it waits for."""


def check_requeue(ids: Sequence[str] | None, origin: str | None) -> None:
    """The arguments of a requeue, refused before anything is opened or moved."""
    if ids is None and origin is None:
        raise InvalidInputError("requeue needs ids, origin, or both")
    if ids is not None and (isinstance(ids, str) or not isinstance(ids, Sequence)):
        raise InvalidInputError("requeue takes a sequence of ids")
    if origin is not None:
        check_queue_name(origin)


def check_replay(
    ids: Sequence[str] | None, since: datetime | float | None, until: datetime | float | None
) -> tuple[float, float]:
    """The arguments of a replay, refused before anything is opened or pushed; returns the
    range as epoch seconds."""
    if ids is not None and (isinstance(ids, str) or not isinstance(ids, Sequence)):
        raise InvalidInputError("replay takes a sequence of ids")
    if ids is not None:  # before a target queue is opened (which records it)
        for message_id in ids:
            check_known_id(message_id)
    if ids is None and since is None and until is None:
        raise InvalidInputError("replay needs ids or a since / until range")
    return check_time(since, "since", 0.0), check_time(until, "until", MAX_TIME)


def check_target(name: str | None, default: str) -> str:
    return default if name is None else check_queue_name(name)
