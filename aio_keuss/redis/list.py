"""redis-list: one Redis LIST per queue, LPUSH in and RPOP out; the fastest, and pop only.

No reserve, no delay, no remove, no dedup: the queue layer refuses those before anything is
written. Tries are always 0.

Each list element carries the whole message, since a LIST holds nothing else::

    mature (8-byte big-endian double, client clock at push) | id length (u16) |
    headers length (u32) | id (utf-8) | headers | payload

The mature time is the pusher's clock: there is no scheduling, so it is only informative
(``Message.mature``, ``next_mature_t``). A popped message put back (its caller was cancelled)
goes back to the popping end with RPUSH, keeping its place.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import struct
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ..contract import (
    Cursor,
    Entry,
    Fetched,
    OneInsert,
    OneTake,
    Peeked,
    PeekPage,
    Store,
    Stored,
    position_cursor,
)
from ..ids import new_id
from ..message import UNDECODABLE, encode_headers, encode_payload
from ..types import Capabilities, Sizes
from .backend import RedisBackend

if TYPE_CHECKING:
    from ..options import QueueOptions

log = logging.getLogger("aio_keuss.redis_list")

_HEAD = struct.Struct(">dHI")
_HEAD_SIZE = _HEAD.size


def _pack(entry: Entry, now: float) -> bytes:
    message_id = entry.id.encode()
    mature = now if entry.mature is None else entry.mature
    return b"".join(
        (
            _HEAD.pack(mature, len(message_id), len(entry.headers)),
            message_id,
            entry.headers,
            entry.payload,
        )
    )


def _unpack(element: bytes) -> Stored:
    mature, id_length, headers_length = _HEAD.unpack_from(element)
    headers_start = _HEAD_SIZE + id_length
    payload_start = headers_start + headers_length
    if payload_start > len(element):  # lengths past its end: not one of ours
        raise ValueError(f"lengths {id_length} + {headers_length} past the end")
    return Stored(
        element[_HEAD_SIZE:headers_start].decode(),
        element[payload_start:],
        element[headers_start:payload_start],
        0,
        mature,
    )


def _unpack_all(elements: Sequence[bytes], key: str | None = None) -> list[Stored]:
    """The messages of popped (``key`` given) or peeked elements. Popped ones are gone
    from the list: one that is not in our framing (LPUSHed by another program, or
    corrupted) must not fail the others, so each is tried alone once the whole fails."""
    try:
        return [_unpack(e) for e in elements]
    except Exception:
        return [_unpack_or_wrap(e, key) for e in elements]


def _unpack_or_wrap(element: bytes, key: str | None) -> Stored:
    """An element that is not in our framing, whole, as a bytes payload under a new id
    (it has no readable one) marked ``x-undecodable``. The id names nothing to
    acknowledge: a pop needs no ``ok``, and a put-back (its caller was cancelled) writes
    it back framed, as it was delivered."""
    try:
        return _unpack(element)
    except Exception as exc:
        reason = f"element: {exc!s}"
    wrapped = Stored(
        new_id(),
        encode_payload(bytes(element)),
        encode_headers({UNDECODABLE: reason}),
        0,
        time.time(),
    )
    if key is not None:
        log.warning("list %r: element delivered undecoded as %r: %s", key, wrapped.id, reason)
    return wrapped


def _read_one(key: str, elements: list[bytes] | None) -> tuple[list[Stored], float | None]:
    """An ``RPOP key 1`` reply, as ``get(1)`` reads it."""
    if not elements:
        return [], None
    if len(elements) == 1:  # a lone pop's (always, but for a server that ignored 1)
        try:  # without ``_unpack_all``'s loop
            return [_unpack(elements[0])], time.time()
        except Exception:
            return [_unpack_or_wrap(elements[0], key)], time.time()
    return _unpack_all(elements, key), time.time()


def _inserted(_: Any) -> bool:
    return True


class RedisListStore(Store):
    batch_concurrency: ClassVar[int] = 4

    def __init__(self, name: str, options: QueueOptions, backend: RedisListBackend) -> None:
        super().__init__(name, options)
        self.run_in_caller = self.uninterruptible = backend.has_fast_lane
        self._execute = backend.execute
        self._key = backend.key(name, "list")
        self._lpush = backend.bind("LPUSH", self._key)
        self._rpop = backend.bind("RPOP", self._key)

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        now = time.time()
        fresh = [_pack(e, now) for e in entries if e.mature is None]
        # Put-backs return to the popping end, the earliest popped last pushed.
        back = [_pack(e, now) for e in reversed(entries) if e.mature is not None]
        if fresh:
            await self._lpush(*fresh)
        if back:
            await self._execute("RPUSH", self._key, *back)
        return [True] * len(entries)

    async def get(self, n: int) -> Fetched:
        elements = await self._rpop(n)
        if not elements:
            return Fetched([], None)
        # Fewer than asked means the list was empty afterwards; the wait loop only looks at
        # next_mature when nothing was handed out, so no LLEN round trip is needed.
        more = time.time() if len(elements) == n else None
        return Fetched(_unpack_all(elements, self._key), more)

    def one_take(self, reserve_delay: float | None) -> OneTake | None:
        if reserve_delay is not None or not self.uninterruptible:
            return None
        return self._rpop.sender(1), functools.partial(_read_one, self._key)

    def one_insert(self) -> OneInsert | None:
        if not self.uninterruptible:
            return None
        send = self._lpush.send_now

        def insert(e: Entry) -> asyncio.Future[Any] | None:
            return None if e.mature is not None else send(_pack(e, time.time()))

        return insert, _inserted

    def check_cursor(self, cursor: Cursor | None) -> Cursor | None:
        return position_cursor(cursor, ("",))

    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        """LRANGE from the popping end; the cursor is a position, so a walk during
        consumption is shifted by what was popped meanwhile (some may be missed)."""
        if state not in ("ready", "all"):
            return PeekPage([], None)
        offset = 0 if after is None else int(after[0])
        part = await self._execute("LRANGE", self._key, -offset - limit, -offset - 1)
        rows = [Peeked(s, "ready", s.mature) for s in _unpack_all(part[::-1])]
        return PeekPage(rows, (offset + limit, "") if len(part) == limit else None)

    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        """A scan of the whole list, a page at a time: an admin's look-up, not a hot path."""
        wanted: dict[str, Peeked | None] = dict.fromkeys(ids)
        missing = set(wanted)
        cursor: Cursor | None = None
        while missing:
            page = await self.peek("all", cursor, 1000)
            for row in page.rows:
                if row.message.id in missing:
                    wanted[row.message.id] = row
                    missing.discard(row.message.id)
            if page.cursor is None:
                break
            cursor = page.cursor
        return [wanted[i] for i in ids]

    async def sizes(self) -> Sizes:
        length: int = await self._execute("LLEN", self._key)
        return Sizes(length, length, 0, 0)

    async def next_mature(self) -> float | None:
        oldest = await self._execute("LINDEX", self._key, -1)
        if oldest is None:
            return None
        try:
            mature = float(_HEAD.unpack_from(oldest)[0])
        except struct.error:  # not one of ours (see _unpack_or_wrap): ready, as any element
            return time.time()
        return mature if math.isfinite(mature) else time.time()


class RedisListBackend(RedisBackend):
    name = "redis-list"
    # No reservations to take from anyone, but an LPUSH run twice stores its message
    # twice. (An RPOP run twice loses nothing more: the first one's reply was lost anyway.)
    replay_hazard = (
        "a push sent again stores its messages twice, and two consumers then pop the same message"
    )
    capabilities: Capabilities = Capabilities(
        reserve=False,
        delay=False,
        remove=False,
        idempotent=False,
        reservation_expiry=False,
        peek=True,
    )

    async def store(self, queue: str, options: QueueOptions) -> Store:
        return RedisListStore(queue, options, self)
