"""``redis-reliable``: the "reliable queue" pattern of the Redis manual (LMOVE / RPOPLPUSH)
— every operation O(1) per message.

Storage model (all keys of queue ``q`` share the hash tag ``{q}``, see
:meth:`RedisBackend.key`; ``<base>`` below is ``prefix:{q}:``)::

    <base>pending               LIST  ids waiting; LPUSH at the left, consumed at the right
    <base>processing:<cid>      LIST  ids reserved by consumer <cid> (one per Store object)
    <base>msg:<id>              HASH  p=payload, h=headers, t=tries, m=mature (first queued),
                                      x=1 while a cluster deadletter sets it aside
    <base>dedup:<id>            STRING  "1" with a TTL of dedup_window: explicit ids seen
    <base>failed                LIST  ids moved to the deadletter queue (newest left, capped)
    <base>processed             INT   commits (ok) ever made
    <base>failed-count          INT   messages ever deadlettered
    <base>consumers             SET   consumer ids that may hold a processing list
    <base>heartbeat:<cid>       STRING  exists while consumer <cid> is alive (TTL heartbeat_ttl)

Why this shape: the pending list is only ever touched at its two ends (LPUSH, RPOP, LMOVE),
bodies are reached by key, so push / pop / reserve cost the same with a million messages
waiting as with none. A reservation is a LMOVE of the id from ``pending`` into the
consumer's own ``processing`` list; ``ok`` / ``ko`` search only that consumer's in-flight
list (LREM from its old end, where the earliest reservations are), never the backlog.

Reservations do not expire one by one (``Capabilities.reservation_expiry`` is false and
``reserve_delay`` is ignored). Instead each consumer keeps a heartbeat key alive; when a
consumer dies (process killed, network gone) its heartbeat expires, and any other consumer's
recovery task moves the dead consumer's processing list back to ``pending`` with one more
try on each message (that delivery failed). Recovered messages wait at the consuming end,
because they are the oldest. A consumer that is merely slow (event loop blocked longer than
``heartbeat_ttl``) loses its reservations the same way: its late ``ok`` / ``ko`` then find
the id missing from its processing list (or the tries changed) and return false, so a
message is never acknowledged by a stale holder. A live consumer also gives back what sits
in its own list that none of its callers holds (a reserve whose reply was lost, an ok / ko
that failed in an outage), else that message would stay reserved as long as it lives.

Every primitive is one Lua script call (EVALSHA, by redis-py's ``register_script``), so
each batch is atomic and one round trip. The scripts are all in this file, next to the
method that runs them.

Deadletter: a ko whose failed-delivery count exceeds ``max_ko`` moves the body to the
deadletter queue (its own keys, same prefix) with tries 0 and the ``x-dl-*`` headers, pushes
the id to this queue's ``failed`` list (capped at ``failed_max`` entries, a log like the
seed's failed list) and increments ``failed-count``. Outside Redis Cluster that is one
script, atomic. On a cluster the two queues live in different slots, so it is done in
three steps that keep the message in the consumer's processing list until its copy is in
the deadletter queue, set aside (body field ``x``, its try counted) so that a racing ok, ko
or move of it finds nothing, as after the one-script move: a crash in between may leave a
duplicate there (recovery gives it back, that try not counted again), never a loss.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from ..coalesce import Finishing, stop_task
from ..contract import (
    Ack,
    Cursor,
    DeadletterPlan,
    Entry,
    Fetched,
    Move,
    Nack,
    OneCommit,
    OneInsert,
    OneTake,
    Peeked,
    PeekPage,
    Store,
    Stored,
    deadletter_tag,
    moved_id,
    position_cursor,
)
from ..errors import ConfigError, NotSupportedError
from ..message import merge_headers
from ..options import check_count
from ..types import Capabilities, KoResult, Sizes
from .backend import RedisBackend
from .connection import RedisOptions, Script
from .headers_lua import WITH_HEADERS

if TYPE_CHECKING:
    from ..options import QueueOptions

log = logging.getLogger("aio_keuss.redis_reliable")

PEEK_PAGE = 2000
"""Messages one peek script call reads at most (a larger page takes several calls)."""

RECOVER_STEP = 1000
"""Most messages one recovery script call moves, so Redis is never blocked for long."""

LAPSE_SHARE = 5 / 6
"""Share of ``heartbeat_ttl`` past the last heartbeat refresh after which a consumer counts
its reservations as possibly lost (its heartbeat may have expired and another consumer's
recovery taken them): refreshed every third of it, a live consumer is past that only when
two refreshes in a row failed (an outage) or its event loop was blocked as long."""

# -- Lua -------------------------------------------------------------------------------------
# Conventions: ARGV[1] is the queue's key base ``prefix:{q}:``; bodies are base..'msg:'..id.
# Keys built inside a script carry the same hash tag as the declared KEYS, so they live in
# the same cluster slot. ``now`` comes from the server clock (TIME) so clients agree.

_NOW = """
local function now()
  local t = redis.call('TIME')
  return t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
end
"""

# The one move body (Queue.move and deadletter), for a message already taken off the
# processing list: its body moves under the destination base (``dst``), renamed by the rule
# of every backend if the id is taken there (<id>, <id>.<tag>, <id>.<tag>.2, ...), with
# ``payload`` (nil: its own) and ``added`` header text ('' = none) merged into its stored
# headers (see ``with_headers``), tries 0, and its id
# goes to the end of the destination's pending list.
_MOVE_TO = (
    WITH_HEADERS
    + """
local function move_to(id, body, dst, dst_pending, payload, added, tag, stamp)
  local b = redis.call('HMGET', body, 'p', 'h')
  redis.call('DEL', body)
  local headers = b[2]
  if added ~= '' then headers = with_headers(headers, added) end
  local target, clash = id, 0
  while redis.call('EXISTS', dst .. 'msg:' .. target) == 1 do
    clash = clash + 1
    target = id .. '.' .. tag
    if clash > 1 then target = target .. '.' .. clash end
  end
  redis.call('HSET', dst .. 'msg:' .. target, 'p', payload or b[1], 'h', headers, 't', 0,
    'm', stamp)
  redis.call('LPUSH', dst_pending, target)
  return target
end
"""
)

# KEYS: pending. ARGV: base, dedup_window_ms, then 6 per entry:
#   id, payload, headers, tries, dedup ('1'/'0'), mature ('' = now, else a put-back's time).
# A put-back (after a cancelled pop) goes to the consuming end so it is next again; a batch
# of them is pushed in reverse so the first of the batch ends up first.
_INSERT = (
    _NOW
    + """
local base, window = ARGV[1], tonumber(ARGV[2])
local stamp = now()
local out, back = {}, {}
for i = 3, #ARGV, 6 do
  local id = ARGV[i]
  local body = base .. 'msg:' .. id
  local ok = 1
  if redis.call('EXISTS', body) == 1 then
    ok = 0
  elseif ARGV[i + 4] == '1' and window > 0 then
    if not redis.call('SET', base .. 'dedup:' .. id, '1', 'NX', 'PX', window) then ok = 0 end
  end
  if ok == 1 then
    local mature = ARGV[i + 5]
    if mature == '' then
      redis.call('HSET', body, 'p', ARGV[i + 1], 'h', ARGV[i + 2], 't', ARGV[i + 3], 'm', stamp)
      redis.call('LPUSH', KEYS[1], id)
    else
      redis.call('HSET', body, 'p', ARGV[i + 1], 'h', ARGV[i + 2], 't', ARGV[i + 3], 'm', mature)
      back[#back + 1] = id
    end
  end
  out[#out + 1] = ok
end
for j = #back, 1, -1 do redis.call('RPUSH', KEYS[1], back[j]) end
return out
"""
)

# KEYS: pending. ARGV: base, n. Returns {left in pending, id, p, h, t, m, id, p, ...}.
_GET = """
local base = ARGV[1]
local ids = redis.call('RPOP', KEYS[1], tonumber(ARGV[2]))
local out = {0}
if ids then
  for _, id in ipairs(ids) do
    local body = base .. 'msg:' .. id
    local b = redis.call('HMGET', body, 'p', 'h', 't', 'm')
    if b[1] then
      redis.call('DEL', body)
      out[#out + 1] = id
      out[#out + 1] = b[1]; out[#out + 1] = b[2]; out[#out + 1] = b[3]; out[#out + 1] = b[4]
    end
  end
end
out[1] = redis.call('LLEN', KEYS[1])
return out
"""

# KEYS: pending, processing, consumers, heartbeat. ARGV: base, n, cid, heartbeat_ttl_ms.
# Registering and refreshing the heartbeat here, atomically with the LMOVEs, means a
# reservation is never in a processing list that recovery cannot see.
# The first write is one that cannot grow memory (PEXPIRE): at maxmemory (noeviction) Redis
# refuses a script whose first write may (SET, LMOVE, ...) and lets one that has written run
# to its end, and consumers must still reserve, then ok, to drain a Redis that is full.
_RESERVE = """
local base = ARGV[1]
if redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[4])) == 0 then  -- refreshed, or made
  redis.call('SET', KEYS[4], '1', 'PX', tonumber(ARGV[4]))
end
redis.call('SADD', KEYS[3], ARGV[3])
local out = {0}
for _ = 1, tonumber(ARGV[2]) do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
  if not id then break end
  local b = redis.call('HMGET', base .. 'msg:' .. id, 'p', 'h', 't', 'm')
  if b[1] then
    out[#out + 1] = id
    out[#out + 1] = b[1]; out[#out + 1] = b[2]; out[#out + 1] = b[3]; out[#out + 1] = b[4]
  else
    redis.call('LPOP', KEYS[2])  -- an id without a body: drop it (it was just put left)
  end
end
out[1] = redis.call('LLEN', KEYS[1])
return out
"""

# KEYS: processing, processed. ARGV: base, then 2 per ack: id, tries ('' = unchecked).
# Held = in this consumer's processing list with the tries its holder was given, and not set
# aside by a ko deadlettering it in three steps (field x, see _ROLLBACK).
_COMMIT = """
local base = ARGV[1]
local out, done = {}, 0
for i = 2, #ARGV, 2 do
  local id, want = ARGV[i], ARGV[i + 1]
  local body = base .. 'msg:' .. id
  local b = redis.call('HMGET', body, 't', 'x')  -- x: set aside by a deferred deadletter
  local t = not b[2] and b[1]
  if t and (want == '' or t == want) and redis.call('LREM', KEYS[1], -1, id) > 0 then
    redis.call('DEL', body)
    done = done + 1
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if done > 0 then redis.call('INCRBY', KEYS[2], done) end
return out
"""

# KEYS: pending, processing, failed, failed-count, deadletter pending (or pending again).
# ARGV: base, deadletter base ('' = no deadletter; 'defer' = cluster: report, do not move),
#   max_ko, x-dl header fragment without x-dl-tries, failed_max, then 3 per nack:
#   id, tries ('' = unchecked), count_try ('1'/'0').
# Returns one code per nack (0 missing, 1 rolled back, 2 deadlettered, 3 deadletter
# deferred), each 3 followed by its p, h, t so the caller can finish the move.
_ROLLBACK = (
    _NOW
    + _MOVE_TO
    + """
local base, dl, max_ko, fragment = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local failed_max = tonumber(ARGV[5])
local out, failed = {}, 0
local stamp, unseen = nil, {}
for i = 6, #ARGV, 3 do
  local id, want, count = ARGV[i], ARGV[i + 1], ARGV[i + 2] == '1'
  local body = base .. 'msg:' .. id
  local b = redis.call('HMGET', body, 't', 'x')
  local t = not b[2] and b[1]
  if not t or (want ~= '' and t ~= want) then
    out[#out + 1] = 0
  else
    local tries = tonumber(t)
    if count then tries = tries + 1 end
    if dl ~= '' and count and tries > max_ko then
      if dl == 'defer' then
        if redis.call('LPOS', KEYS[2], id) then  -- O(in-flight), like LREM
          local b = redis.call('HMGET', body, 'p', 'h')
          -- set aside (x), its try counted: out of its holders' hands until the last
          -- step drops it, so a racing ok, ko or move of it finds nothing; recovery
          -- after a crash gives it back without counting that try again
          redis.call('HSET', body, 't', tries, 'x', 1)
          out[#out + 1] = 3
          out[#out + 1] = b[1]; out[#out + 1] = b[2]; out[#out + 1] = tries
        else
          out[#out + 1] = 0
        end
      elseif redis.call('LREM', KEYS[2], -1, id) == 0 then
        out[#out + 1] = 0
      else
        stamp = stamp or now()
        local added = fragment .. ',"x-dl-tries":' .. tries
        move_to(id, body, dl, KEYS[5], nil, added, 'dl' .. tries, stamp)
        redis.call('LPUSH', KEYS[3], id)
        failed = failed + 1
        out[#out + 1] = 2
      end
    elseif redis.call('LREM', KEYS[2], -1, id) == 0 then
      out[#out + 1] = 0
    else
      redis.call('HSET', body, 't', tries)
      if count then
        redis.call('LPUSH', KEYS[1], id)  -- a failed delivery: retried after the others
      else
        unseen[#unseen + 1] = id  -- given back unseen: keeps its turn (below)
      end
      out[#out + 1] = 1
    end
  end
end
-- back at the consuming end, the latest first, so that they come out in the order given
for k = #unseen, 1, -1 do redis.call('RPUSH', KEYS[1], unseen[k]) end
if failed > 0 then
  redis.call('INCRBY', KEYS[4], failed)
  redis.call('LTRIM', KEYS[3], 0, failed_max - 1)
end
return out
"""
)

# KEYS: processing, then the pending list of each destination. ARGV: base, then 7 per move:
#   id, tries ('' = unchecked), destination number (1 = KEYS[2]), destination base,
#   '1' if a payload follows else '0', payload, added header text ('' = none), tag.
# Returns per move the id it has in its destination, or '' when it was not held here.
_MOVE = (
    _NOW
    + _MOVE_TO
    + """
local base, out, stamp = ARGV[1], {}, nil
for i = 2, #ARGV, 8 do
  local id, want = ARGV[i], ARGV[i + 1]
  local body = base .. 'msg:' .. id
  local b = redis.call('HMGET', body, 't', 'x')
  local t = not b[2] and b[1]
  if not t or (want ~= '' and t ~= want) or redis.call('LREM', KEYS[1], -1, id) == 0 then
    out[#out + 1] = ''
  else
    stamp = stamp or now()
    local payload = nil
    if ARGV[i + 4] == '1' then payload = ARGV[i + 5] end
    local pending = KEYS[1 + tonumber(ARGV[i + 2])]
    out[#out + 1] = move_to(id, body, ARGV[i + 3], pending, payload, ARGV[i + 6],
      ARGV[i + 7], stamp)
  end
end
return out
"""
)

# Cluster deadletter, last step. KEYS: processing, failed, failed-count. ARGV: failed_max,
# base, ids. Drops messages whose copies are now in the deadletter queue: those still set
# aside (x) in this consumer's list (one recovered meanwhile may be another's now).
_DROP_DEADLETTERED = """
local base, done = ARGV[2], 0
for i = 3, #ARGV do
  if redis.call('HEXISTS', base .. 'msg:' .. ARGV[i], 'x') == 1
      and redis.call('LREM', KEYS[1], -1, ARGV[i]) > 0 then
    redis.call('DEL', base .. 'msg:' .. ARGV[i])
    redis.call('LPUSH', KEYS[2], ARGV[i])
    done = done + 1
  end
end
if done > 0 then
  redis.call('INCRBY', KEYS[3], done)
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[1]) - 1)
end
return done
"""

# KEYS: pending, consumers. ARGV: base. Returns {LLEN pending, sum of processing LLENs}.
_SIZES = """
local reserved = 0
for _, cid in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  reserved = reserved + redis.call('LLEN', ARGV[1] .. 'processing:' .. cid)
end
return {redis.call('LLEN', KEYS[1]), reserved}
"""

# KEYS: consumers. ARGV: base. Registered consumers whose heartbeat key is gone.
_DEAD = """
local dead = {}
for _, cid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. 'heartbeat:' .. cid) == 0 then dead[#dead + 1] = cid end
end
return dead
"""

# KEYS: processing of the dead consumer, pending, consumers, its heartbeat.
# ARGV: base, cid, most to move. Moves newest-first to the consuming end of pending, so the
# oldest reservation is delivered first; each move costs one try. Returns the number moved,
# or -1 if the consumer is alive after all. Unregisters it once its list is empty. Atomic,
# so two processes recovering the same consumer cannot both move a message.
_RECOVER = """
if redis.call('EXISTS', KEYS[4]) == 1 then return -1 end
-- first, a write that cannot grow memory (a no-op: the heartbeat is gone), so a dead
-- consumer's messages come back at maxmemory too (see _RESERVE)
redis.call('PEXPIRE', KEYS[4], 1)
local base, moved = ARGV[1], 0
for _ = 1, tonumber(ARGV[3]) do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then break end
  local body = base .. 'msg:' .. id
  if redis.call('EXISTS', body) == 1 then
    -- set aside by a deferred deadletter (x): its try was counted then
    if redis.call('HDEL', body, 'x') == 0 then redis.call('HINCRBY', body, 't', 1) end
    moved = moved + 1
  else
    redis.call('RPOP', KEYS[2])  -- an id without a body: drop it
  end
end
if redis.call('LLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[3], ARGV[2]) end
return moved
"""

# KEYS: this consumer's processing list, pending. ARGV: base, then ids that no caller of
# this live consumer holds (a reserve whose reply was lost, an ok / ko that failed): each
# still there goes back to the consuming end of pending with one more try, as a dead
# consumer's would. Returns the number moved.
_RECOVER_OWN = """
local base, moved = ARGV[1], 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('LREM', KEYS[1], 1, id) == 1 then
    local body = base .. 'msg:' .. id
    if redis.call('EXISTS', body) == 1 then
      if redis.call('HDEL', body, 'x') == 0 then redis.call('HINCRBY', body, 't', 1) end
      redis.call('RPUSH', KEYS[2], id)
      moved = moved + 1
    end
  end
end
return moved
"""

# KEYS: heartbeat, consumers. ARGV: cid, heartbeat_ttl_ms. A live consumer's heartbeat,
# refreshed first by PEXPIRE, a write that cannot grow memory, so that it goes on at
# maxmemory (noeviction), where a plain SET is refused: else a live consumer would count as
# dead while Redis is full (see _RESERVE).
# Returns 0 where the heartbeat was gone (expired: recovery may have taken our list), else 1.
_BEAT = """
local alive = redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
if alive == 0 then
  redis.call('SET', KEYS[1], '1', 'PX', tonumber(ARGV[2]))
end
redis.call('SADD', KEYS[2], ARGV[1])
return alive
"""

# KEYS: processing, consumers, heartbeat. ARGV: cid. A clean close: unregister only when
# nothing is held, else leave the reservations for recovery (see RedisReliableStore.close).
_RETIRE = """
if redis.call('LLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[3])
  redis.call('SREM', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


# Looking without taking (peek, find). Ready messages are walked by position from the
# consuming end of ``pending`` (a message consumed meanwhile shifts the walk by one, so a
# walk during consumption may miss some), then the reserved ones of every consumer.

# KEYS: pending, consumers. ARGV: base, section ('p' pending, 'r' processing lists), offset,
# limit. Reply: how many ids the section gave, then id, p, h, t, m per message still there.
_PEEK = """
local base, section = ARGV[1], ARGV[2]
local offset, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local ids = {}
if section == 'p' then
  local part = redis.call('LRANGE', KEYS[1], -offset - limit, -offset - 1)
  for i = #part, 1, -1 do ids[#ids + 1] = part[i] end
else
  local cids = redis.call('SMEMBERS', KEYS[2])
  table.sort(cids)
  local all = {}
  for _, cid in ipairs(cids) do
    local held = redis.call('LRANGE', base .. 'processing:' .. cid, 0, -1)
    for i = #held, 1, -1 do all[#all + 1] = held[i] end
  end
  for i = offset + 1, math.min(offset + limit, #all) do ids[#ids + 1] = all[i] end
end
local out = {#ids}
for _, id in ipairs(ids) do
  local b = redis.call('HMGET', base .. 'msg:' .. id, 'p', 'h', 't', 'm')
  if b[1] then
    out[#out + 1] = id
    out[#out + 1] = b[1]; out[#out + 1] = b[2]; out[#out + 1] = b[3]; out[#out + 1] = b[4]
  end
end
return out
"""

# KEYS: consumers. ARGV: base, ids. Reply per id: 0 gone, 1 pending, 2 held; then, for those
# found, id, p, h, t, m.
_LOCATE = """
local base = ARGV[1]
local cids = redis.call('SMEMBERS', KEYS[1])
local where, bodies = {}, {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local b = redis.call('HMGET', base .. 'msg:' .. id, 'p', 'h', 't', 'm')
  if b[1] then
    local state = 1
    for _, cid in ipairs(cids) do
      if redis.call('LPOS', base .. 'processing:' .. cid, id) then state = 2; break end
    end
    where[#where + 1] = state
    for _, v in ipairs({id, b[1], b[2], b[3], b[4]}) do bodies[#bodies + 1] = v end
  else
    where[#where + 1] = 0
  end
end
for _, v in ipairs(bodies) do where[#where + 1] = v end
return where
"""


# The scripts of the hot path, which each store binds to its own keys.
INSERT, GET, RESERVE, COMMIT = (Script(body) for body in (_INSERT, _GET, _RESERVE, _COMMIT))


def _stored(flat: list[Any], start: int) -> list[Stored]:
    """Decode the ``id, p, h, t, m`` quintuples of a get / reserve script."""
    return [
        Stored(flat[i].decode(), flat[i + 1], flat[i + 2], int(flat[i + 3]), float(flat[i + 4]))
        for i in range(start, len(flat), 5)
    ]


def _read_got(flat: list[Any]) -> tuple[list[Stored], float | None]:
    """A get's or a reserve's reply: its messages, and whether more look ready (now). One
    message (a lone pop's or reserve's) is read without ``_stored``'s loop."""
    if len(flat) == 6:
        _, message_id, payload, headers, tries, mature = flat
        one = [Stored(message_id.decode(), payload, headers, int(tries), float(mature))]
        return one, time.time() if flat[0] else None
    return _stored(flat, 1), time.time() if flat[0] else None


def _entry_args(e: Entry) -> tuple[Any, ...]:
    """One entry's arguments to the insert script."""
    dedup, mature = "1" if e.dedup else "0", "" if e.mature is None else repr(e.mature)
    return e.id, e.payload, e.headers, e.tries, dedup, mature


def _first_is_one(flags: list[Any]) -> bool:
    return bool(flags[0] == 1)


class RedisReliableStore(Store):
    """One queue, seen by one consumer (``self.consumer``): reservations made through this
    object sit in its own processing list until ok / ko, or until recovery after its
    heartbeat stops."""

    batch_concurrency: ClassVar[int] = 4
    """Up to four calls of a kind in flight, pipelined on the fast lane, each run in its
    caller's task; more calls gather into one batch (measured at 3 clients: about twice the
    msgs/s of one batch at a time)."""

    def __init__(self, name: str, options: QueueOptions, backend: RedisReliableBackend) -> None:
        super().__init__(name, options)
        self.run_in_caller = self.uninterruptible = backend.has_fast_lane
        self._backend = backend
        self.consumer = os.urandom(8).hex()
        self._base = backend.key(name) + ":"
        self._pending = backend.key(name, "pending")
        self._processing = backend.key(name, "processing", self.consumer)
        self._heartbeat = backend.key(name, "heartbeat", self.consumer)
        self._consumers = backend.key(name, "consumers")
        self._failed = backend.key(name, "failed")
        self._failed_count = backend.key(name, "failed-count")
        self._processed = backend.key(name, "processed")
        self._window_ms = str(math.ceil(options.dedup_window * 1000))
        self._ttl = backend.heartbeat_ttl
        self._ttl_ms = str(max(1, round(self._ttl * 1000)))
        self._tasks: list[asyncio.Task[None]] = []
        self._lapse_after = self._ttl * LAPSE_SHARE
        self._refreshed = time.monotonic()
        """When the last heartbeat refresh that succeeded was sent (see ``lost_since``)."""
        self._lost_at = -math.inf
        """When a refresh was sent that found the heartbeat gone, or came after a gap of
        more than ``LAPSE_SHARE`` of it: reservations taken before may have been lost."""
        self._deferring = Finishing()
        """Cluster deadletters past their set-aside: copying there, then dropping here."""
        self._deadlettering: set[str] = set()
        """The ids of those, set aside in our processing list: no caller holds them, yet
        they are not ours to give back until their drop ends (see ``_recover_own``)."""
        # Ids handed out by reserve and not yet acknowledged, with the tries they were
        # handed out with (an ok / ko / move takes an id out when it is sent, unless it
        # names other tries: a stale holder's, refused, must not release the current one):
        # whatever else sits in our processing list no caller holds, and recovery gives it
        # back (see ``_recover_own``).
        self._out: dict[str, int] = {}
        self._unheld: set[str] = set()
        # Ids handed to a caller while a pass of ``_recover_own`` waits for its look at the
        # processing list (None between passes): one ok-ed or ko-ed before the look's reply
        # is read was in the list with no caller holding it, and must not count as unheld.
        self._taken: set[str] | None = None
        self._scripts = backend.scripts
        bind = backend.bind_script
        self._insert = bind(INSERT, [self._pending])
        self._get = bind(GET, [self._pending])
        self._reserve = bind(
            RESERVE, [self._pending, self._processing, self._consumers, self._heartbeat]
        )
        self._commit = bind(COMMIT, [self._processing, self._processed])

    # producing ---------------------------------------------------------------------------

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        args: list[Any] = [self._base, self._window_ms]
        for e in entries:
            args += _entry_args(e)
        flags = await self._insert(*args)
        return [flag == 1 for flag in flags]

    # consuming ---------------------------------------------------------------------------

    async def get(self, n: int) -> Fetched:
        return Fetched(*_read_got(await self._get(self._base, n)))

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        """LMOVE up to ``n`` ids into this consumer's processing list. ``reserve_delay`` is
        ignored: reservations end with ok / ko, or when this consumer's heartbeat stops."""
        if not self._tasks:
            self._start()
        flat = await self._reserve(self._base, n, self.consumer, self._ttl_ms)
        return Fetched(*self._read_reserved(flat))

    def _read_reserved(self, flat: list[Any]) -> tuple[list[Stored], float | None]:
        """A reserve's reply; its ids are now out with this process's callers."""
        stored, next_mature = _read_got(flat)
        out = self._out
        for message in stored:
            out[message.id] = message.tries
        if stored and (self._unheld or self._taken is not None):
            self._note_taken(stored)
        return stored, next_mature

    def _note_taken(self, stored: list[Stored]) -> None:
        """These ids reached a caller: an own recovery pass that saw one unheld saw it
        before its reply was read (or before an earlier holder's ok / ko ran), so the
        next pass must see it unheld twice more before giving it back."""
        unheld, taken = self._unheld, self._taken
        for message in stored:
            unheld.discard(message.id)
            if taken is not None:
                taken.add(message.id)

    def _release(self, message_id: str, tries: int | None) -> None:
        """An ok / ko / move of ``message_id`` is sent: no caller holds it any more, unless
        the ack names tries other than those it was handed out with (a stale holder's, which
        the script refuses while the current holder keeps it)."""
        out = self._out
        if tries is None or out.get(message_id) == tries:
            out.pop(message_id, None)

    def one_take(self, reserve_delay: float | None) -> OneTake | None:
        if not self.uninterruptible:
            return None
        if reserve_delay is None:
            return self._get.sender(self._base, 1), _read_got
        send_reserve = self._reserve.sender(self._base, 1, self.consumer, self._ttl_ms)

        def send() -> asyncio.Future[Any] | None:
            if not self._tasks:
                self._start()
            return send_reserve()

        return send, self._read_reserved

    def one_insert(self) -> OneInsert | None:
        if not self.uninterruptible:
            return None
        send, base, window = self._insert.send_now, self._base, self._window_ms

        def insert(e: Entry) -> asyncio.Future[Any] | None:
            return send(base, window, *_entry_args(e))

        return insert, _first_is_one

    def one_commit(self) -> OneCommit | None:
        if not self.uninterruptible:
            return None
        send, base, release = self._commit.send_now, self._base, self._release

        def commit(message_id: str, tries: int | None) -> asyncio.Future[Any] | None:
            release(message_id, tries)
            return send(base, message_id, "" if tries is None else tries)

        return commit, _first_is_one

    # acknowledging -----------------------------------------------------------------------

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        args: list[Any] = [self._base]
        for ack in acks:
            args += (ack.id, "" if ack.tries is None else ack.tries)
        for ack in acks:
            self._release(ack.id, ack.tries)
        flags = await self._commit(*args)
        return [flag == 1 for flag in flags]

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        """Back to pending with one more try (none if ``count_try`` is false), or past
        ``max_ko`` to the deadletter queue. Nack.delay is always 0 here (no delay capability)."""
        dl_pending = self._pending
        if deadletter is None:
            head: list[Any] = [self._base, "", 0, "", 0]
        else:
            cluster = not self._backend.one_slot
            dl_base = "defer" if cluster else self._backend.key(deadletter.queue) + ":"
            if not cluster:
                dl_pending = self._backend.key(deadletter.queue, "pending")
            fixed = deadletter.headers(0, time.time())
            fixed.pop("x-dl-tries", None)  # added by the script from the stored tries
            fragment = orjson.dumps(fixed)[1:-1]
            head = [self._base, dl_base, deadletter.max_ko, fragment, self._backend.failed_max]
        for nack in nacks:
            tries = "" if nack.tries is None else nack.tries
            head += (nack.id, tries, "1" if nack.count_try else "0")
        for nack in nacks:
            self._release(nack.id, nack.tries)
        keys = [self._pending, self._processing, self._failed, self._failed_count, dl_pending]
        codes = await self._scripts.rollback(keys, head)
        results: list[KoResult] = []
        deferred: list[tuple[int, str, bytes, bytes, int]] = []
        i = 0
        for nack in nacks:
            code = codes[i]
            if code == 3:
                deferred.append((len(results), nack.id, codes[i + 1], codes[i + 2], codes[i + 3]))
                results.append(KoResult.DEADLETTERED)
                i += 4
            else:
                results.append(KoResult(code))
                i += 1
        if deferred and deadletter is not None:
            # cut between the copy and the drop (a close past its grace gives the ko up),
            # the message would be in both queues, recovered here later
            ids = {mid for _, mid, _, _, _ in deferred}
            self._deadlettering |= ids
            steps = self._deferring.run(
                self._deadletter_across_slots(deferred, deadletter, results)
            )
            # once the steps end, not when this caller stops awaiting them (cancelled)
            steps.add_done_callback(lambda _: self._deadlettering.difference_update(ids))
            await steps
        return results

    async def move(self, moves: Sequence[Move]) -> list[str | None]:
        if not self._backend.one_slot:
            raise NotSupportedError(
                "move on Redis Cluster needs both queues in one hash slot: connect with"
                " hash_tag=... to keep this factory's queues together"
            )
        keys = [self._processing]
        destinations: dict[str, int] = {}
        args: list[Any] = [self._base]
        for move in moves:
            number = destinations.get(move.queue)
            if number is None:
                number = destinations[move.queue] = len(destinations) + 1
                keys.append(self._backend.key(move.queue, "pending"))
            args.extend(
                (
                    move.id,
                    "" if move.tries is None else move.tries,
                    number,
                    self._backend.key(move.queue) + ":",
                    "0" if move.payload is None else "1",
                    b"" if move.payload is None else move.payload,
                    orjson.dumps(move.headers)[1:-1] if move.headers else "",
                    move.tag,
                )
            )
        for move in moves:
            self._release(move.id, move.tries)
        reply = await self._scripts.move(keys, args)
        return [new_id.decode() if new_id else None for new_id in reply]

    async def _deadletter_across_slots(
        self,
        deferred: list[tuple[int, str, bytes, bytes, int]],
        plan: DeadletterPlan,
        results: list[KoResult],
    ) -> None:
        """Cluster mode: copy into the deadletter queue (its own slot), then drop here.

        The message stays in this consumer's processing list until the copy exists, so a
        crash in between recovers it (and may deadletter it twice), never loses it. The
        x-dl-* headers are merged into the stored ones, each key once, as the one-slot
        script's ``with_headers`` does (appended, a message deadlettered again and again
        carried one more set each time).
        """
        now = time.time()
        entries = [
            Entry(mid, payload, merge_headers(headers, plan.headers(tries, now)))
            for _, mid, payload, headers, tries in deferred
        ]
        dl_base = self._backend.key(plan.queue) + ":"
        dl_pending = self._backend.key(plan.queue, "pending")

        def args_of(batch: list[Entry]) -> list[Any]:
            args: list[Any] = [dl_base, "0"]
            for e in batch:
                args += (e.id, e.payload, e.headers, 0, "0", "")
            return args

        flags = await self._backend.run_script(INSERT, [dl_pending], args_of(entries))
        # already there from an earlier life of the message: renamed by the shared rule
        pending = [
            (e, deadletter_tag(d[4]))
            for e, d, flag in zip(entries, deferred, flags, strict=True)
            if flag != 1
        ]
        clash = 0
        while pending:
            clash += 1
            renamed = [
                Entry(moved_id(e.id, tag, clash), e.payload, e.headers) for e, tag in pending
            ]
            flags = await self._backend.run_script(INSERT, [dl_pending], args_of(renamed))
            pending = [p for p, flag in zip(pending, flags, strict=True) if flag != 1]
        args: list[Any] = [self._backend.failed_max, self._base]
        args += [mid for _, mid, _, _, _ in deferred]
        await self._scripts.drop_deadlettered(
            keys=[self._processing, self._failed, self._failed_count], args=args
        )

    # observing ---------------------------------------------------------------------------

    async def sizes(self) -> Sizes:
        """size = LLEN pending; reserved = the processing lists of registered consumers
        (O(consumers)); nothing is ever scheduled."""
        size, reserved = await self._scripts.sizes(
            keys=[self._pending, self._consumers], args=[self._base]
        )
        return Sizes(size, size + reserved, 0, reserved)

    async def next_mature(self) -> float | None:
        """Now if anything is pending or held, else None: there are no delays here."""
        sizes = await self.sizes()
        return time.time() if sizes.total else None

    # looking without taking --------------------------------------------------------------

    def check_cursor(self, cursor: Cursor | None) -> Cursor | None:
        return position_cursor(cursor, ("p", "r"))

    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        """Ready (``pending``, from its consuming end) then reserved (every consumer's
        processing list); nothing is ever scheduled. The cursor is a position."""
        if state == "scheduled":
            return PeekPage([], None)
        offset, section = (0, "r" if state == "reserved" else "p") if after is None else after
        if state == "reserved" and section == "p":  # a cursor of a ready / all walk
            offset, section = 0, "r"
        if state == "ready" and section == "r":  # past every ready message
            return PeekPage([], None)
        limit = min(limit, PEEK_PAGE)
        keys = [self._pending, self._consumers]
        flat = await self._scripts.peek(keys, [self._base, section, int(offset), limit])
        shown = "ready" if section == "p" else "reserved"
        rows = [Peeked(s, shown, s.mature) for s in _stored(flat, 1)]
        if flat[0] == limit:
            return PeekPage(rows, (offset + limit, section))
        if section == "p" and state == "all":
            return PeekPage(rows, (0, "r"))
        return PeekPage(rows, None)

    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        if not ids:
            return []
        flat = await self._scripts.locate([self._consumers], [self._base, *ids])
        where = flat[: len(ids)]
        bodies = iter(_stored(flat, len(ids)))
        found: list[Peeked | None] = []
        for state in where:
            if state == 0:
                found.append(None)
                continue
            stored = next(bodies)
            found.append(Peeked(stored, "ready" if state == 1 else "reserved", stored.mature))
        return found

    # heartbeat and recovery --------------------------------------------------------------

    def _start(self) -> None:
        self._refreshed = time.monotonic()  # the reserve about to be sent refreshes it
        self._tasks = [
            asyncio.create_task(self._every(self._ttl / 3, self._beat), name="keuss-heartbeat"),
            asyncio.create_task(self._every(self._ttl / 2, self.recover), name="keuss-recovery"),
        ]

    async def _every(self, period: float, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work`` every ``period`` seconds until cancelled; a failure is logged and
        retried next period (a Redis outage must not end the heartbeat for good)."""
        while True:
            await asyncio.sleep(period)
            try:
                await work()
            except Exception:
                log.warning(
                    "redis-reliable %s of %r failed", work.__name__, self.name, exc_info=True
                )

    async def _beat(self) -> None:
        """Keep this consumer alive and registered (re-registered if recovery took it)."""
        sent = time.monotonic()
        alive = await self._scripts.beat(
            [self._heartbeat, self._consumers], [self.consumer, self._ttl_ms]
        )
        if not alive or sent - self._refreshed > self._lapse_after:
            self._lost_at = max(self._lost_at, sent)
        self._refreshed = max(self._refreshed, sent)

    def lost_since(self, taken: float) -> bool:
        """Whether our heartbeat may have expired since ``taken``: another consumer's
        recovery may then have given what we reserved to another consumer. Seen once a
        refresh finds it gone or late, or while none has succeeded for ``LAPSE_SHARE`` of
        it (an outage, a blocked event loop)."""
        return taken < self._lost_at or time.monotonic() - self._refreshed > self._lapse_after

    async def recover(self) -> int:
        """Give back to ``pending`` what consumers with an expired heartbeat held, each with
        one more try. Safe to run from many processes at once: each step is one atomic
        script that re-checks the heartbeat. Returns how many messages this call moved."""
        moved = 0
        dead = await self._scripts.dead(keys=[self._consumers], args=[self._base])
        for raw in dead:
            cid = raw.decode()
            if cid == self.consumer:  # we are alive, merely late: keep our own
                continue
            keys = [
                self._backend.key(self.name, "processing", cid),
                self._pending,
                self._consumers,
                self._backend.key(self.name, "heartbeat", cid),
            ]
            while True:
                step = await self._scripts.recover(keys=keys, args=[self._base, cid, RECOVER_STEP])
                if step <= 0:
                    break
                moved += step
        if moved:
            log.info(
                "redis-reliable %r: recovered %d message(s) of dead consumers", self.name, moved
            )
        return moved + await self._recover_own()

    async def _recover_own(self) -> int:
        """Give back what sits in our own processing list held by no caller of ours: a
        reserve whose reply was lost (the server moved the ids, the caller got a connection
        error) or an ok / ko that failed. Such a message would otherwise stay reserved as
        long as this process lives, where elsewhere it comes back after ``reserve_delay``.
        An id counts once it was seen so in two passes in a row (``heartbeat_ttl`` / 2
        apart) and reached no caller in between, which leaves a reserve in flight time to
        hand its ids over: an id seen twice may be one reserved again since, its reply
        again on its way."""
        if not self._tasks:
            return 0
        taken: set[str] = set()
        self._taken = taken
        try:
            listed = await self._backend.execute("LRANGE", self._processing, 0, -1)
        finally:
            if self._taken is taken:
                self._taken = None
        unheld = {raw.decode() for raw in listed} - self._out.keys() - taken
        # a cluster deadletter between its copy and its drop: given back meanwhile, its
        # drop would find it gone and leave it in both queues
        unheld -= self._deadlettering
        due = unheld & self._unheld
        self._unheld = unheld - due
        if not due:
            return 0
        moved = int(
            await self._scripts.recover_own([self._processing, self._pending], [self._base, *due])
        )
        if moved:
            log.warning(
                "redis-reliable %r: gave back %d reserved message(s) no caller holds (a lost"
                " reserve reply or a failed ok / ko)",
                self.name,
                moved,
            )
        return moved

    async def close(self) -> None:
        """Stop the heartbeat and recovery tasks, and unregister if nothing is held.

        Reservations still held at close (the caller neither ok-ed nor ko-ed them) are left
        to recovery: they come back with one more try once the heartbeat key expires, as if
        the process had died — the same as an expired reservation elsewhere. Cluster
        deadletters begun here end first (see ``Finishing``: a server that does not answer
        may leave a message in both queues, as a crash between their steps would).
        """
        await self._deferring.wait(
            self.name,
            "deadletters given up between copy and drop: their messages come back here when"
            " recovered",
        )
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            await stop_task(task)
        if tasks:
            try:
                await self._scripts.retire(
                    keys=[self._processing, self._consumers, self._heartbeat],
                    args=[self.consumer],
                )
            except Exception as exc:  # the server is away at close: as if the process died
                log.warning(
                    "redis-reliable %r: could not unregister consumer %s on close (%r); what it"
                    " holds comes back once its heartbeat expires",
                    self.name,
                    self.consumer,
                    exc,
                )


class _Scripts:
    """The Lua scripts of this backend, by name, each run by SHA on the backend's connection
    (its pipelined fast lane when it has one)."""

    def __init__(self, backend: RedisBackend) -> None:
        def bind(source: str) -> Callable[..., Awaitable[Any]]:
            script = Script(source)

            # A plain function handing back run_script's awaitable: no frame of its own
            # around every call.
            def run(keys: Sequence[str], args: Sequence[Any]) -> Awaitable[Any]:
                return backend.run_script(script, keys, args)

            return run

        self.rollback = bind(_ROLLBACK)
        self.move = bind(_MOVE)
        self.drop_deadlettered = bind(_DROP_DEADLETTERED)
        self.sizes = bind(_SIZES)
        self.dead = bind(_DEAD)
        self.recover = bind(_RECOVER)
        self.recover_own = bind(_RECOVER_OWN)
        self.retire = bind(_RETIRE)
        self.beat = bind(_BEAT)
        self.peek = bind(_PEEK)
        self.locate = bind(_LOCATE)


@dataclass(frozen=True)
class RedisReliableOptions(RedisOptions):
    """The Redis options, and: ``heartbeat_ttl`` (seconds a consumer's heartbeat lives) and
    ``failed_max`` (deadlettered ids each queue's ``failed`` list keeps). The bound on
    ``failed_max`` matters: the scripts pass it through a Lua number to LTRIM, and Lua prints
    large numbers in exponent form, which Redis refuses as "not an integer"."""

    heartbeat_ttl: float = 30.0
    failed_max: int = 10_000

    def __post_init__(self) -> None:
        super().__post_init__()
        ttl = self.heartbeat_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0.05 <= ttl < 1e6:
            raise ConfigError(f"heartbeat_ttl must be seconds >= 0.05, not {ttl!r}")
        check_count(self.failed_max, "failed_max")


class RedisReliableBackend(RedisBackend):
    """The reliable queue of the Redis manual's LMOVE page. Options beyond the Redis ones:

    heartbeat_ttl: seconds a consumer's heartbeat lives (refreshed every third of it);
      a consumer silent that long is dead and its reservations are recovered (checked
      every half of it by every live consumer of the queue).
    failed_max: how many deadlettered ids each queue's ``failed`` list keeps.
    """

    name = "redis-reliable"
    # The guard is "in this store's processing list, with the holder's tries": another
    # process's reservation is in its own list, out of reach, but every caller of one store
    # shares its list, and a give-back counts no try.
    replay_hazard = (
        "a give-back (no try counted) sent again after another caller of the same queue "
        "object reserved the message releases that caller's reservation: a third may then "
        "take the message while the second still works on it"
    )
    capabilities: Capabilities = Capabilities(
        pop=True,
        reserve=True,
        delay=False,
        remove=False,
        idempotent=True,
        reservation_expiry=False,
        shared=True,
        move=True,
        peek=True,
    )
    options_type: ClassVar[type[RedisOptions]] = RedisReliableOptions
    options: ClassVar[dict[str, Any]] = RedisReliableOptions.defaults()

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        assert isinstance(self.config, RedisReliableOptions)
        self.heartbeat_ttl = float(self.config.heartbeat_ttl)
        self.failed_max: int = self.config.failed_max
        self.scripts = _Scripts(self)

    async def store(self, queue: str, options: QueueOptions) -> Store:
        return RedisReliableStore(queue, options, self)
