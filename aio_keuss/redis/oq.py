"""redis-oq: an ordered queue on Redis, every primitive one Lua script.

Keys of a queue ``q`` (all tagged ``{q}``, so one cluster slot holds the whole queue):

- ``due``: ZSET id -> mature time (float seconds, server clock). A reserved message's score
  is its reservation deadline, so an expired reservation simply becomes mature again.
- ``msg``: HASH id -> the message's record, its tries, headers and payload in one value (see
  ``record``): a script reads or deletes a message with one call into Redis, a batch of
  them with one variadic HMGET / HDEL. Each call a script makes costs the server about a
  microsecond, the larger part of a one-message script's time.
- ``held``: SET of reserved ids.
- ``aside``: ZSET id -> the end of its set-aside, for a message a cluster deadletter is
  copying into the deadletter queue (see Move and deadletter below): not waiting meanwhile,
  so no amend makes it ready. Emptied by the deadletter's last step.
- ``d``: ZSET id -> dedup expiry for ids the user chose; purged lazily on the next such push,
  so an id stays refused for the dedup window even after its message was consumed.
- ``due:<p>``: for a message of priority p other than 0, what ``due`` is for those of 0;
  ``levels``: ZSET of the p whose ``due:<p>`` is not empty (member p, score p). A take
  walks the levels above 0 highest first, then ``due``, then those below 0; a script that
  finds a message by id finds its level in its record (see ``record``). While ``levels``
  lists any, ``msg`` has a field ``''`` (no id is empty), which a take reads with the
  records of due's head: a queue without priorities has none of these and pays no call
  more, but a HEXISTS when due has nothing ready.

Queues written before 2026-11-29 kept a message in five keys (see ``_TAKE_OVER``), which
this layout takes over when a queue is opened and whenever a take finds nothing ready (what
an older process pushes during a rolling upgrade). An older process does not see the
messages taken over (the keys' names differ), so its consumers find nothing once the
queue's messages were moved: upgrade consumers first, or all processes together.

Every script reads the server clock (``TIME``), so clients with skewed clocks agree on what is
mature. A reservation deadline is the server's *now* + ``reserve_delay`` (Keuss added the
delay to the old score, so a message older than the delay could be reserved twice), and an
extension's is the server's *now* + its seconds, written over the same score.

Move and deadletter: on a single Redis one script moves the message into the other queue's
keys (the same Lua body for ``Queue.move`` and for the ko that deadletters). On Redis Cluster
a script can only touch keys of one hash slot, and each queue has its own slot unless the
factory is opened with ``hash_tag=...`` (then every queue's keys carry that tag and share
one slot). Without it, ``move`` is refused and deadletter is done in three steps: the ko
script hands back what must move and sets the message aside (no longer held, so a racing
ok, ko or move of the same reservation finds nothing, as after a one-script deadletter;
due 60 s from the ko, its try counted, so it is not handed out again meanwhile), it is
inserted into the deadletter queue, then deleted from the source unless it was taken again
since. A crash between the steps leaves a duplicate (the message comes back after the 60 s,
as a ko with that delay would), never a loss.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from ..coalesce import Finishing
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
    OneCommit,
    OneInsert,
    OneTake,
    Peeked,
    PeekPage,
    Store,
    Stored,
    bulk_columns,
    bulk_head,
    deadletter_tag,
    moved_id,
)
from ..errors import NotSupportedError
from ..message import EMPTY_HEADERS, UNDECODABLE, encode_headers, encode_payload
from ..types import Capabilities, KoResult, Sizes
from .backend import RedisBackend
from .connection import GIVE_BACK_REPLAY, Script
from .headers_lua import WITH_HEADERS

log = logging.getLogger("aio_keuss.redis_oq")

if TYPE_CHECKING:
    from ..options import QueueOptions

# Queues written before 2026-11-29 kept a message in five keys, z (mature time), p (payload),
# h (headers, when any), t (tries, when > 0) and r (reserved ids): each part cost a script a
# call into Redis. ``take_over`` moves a bounded part of what it finds there to this layout
# (KEYS[1..3]: due, msg, held; the old keys are named beside them), and tells whether there
# was any and whether some is left. A store runs it when it opens a queue, and a take that
# finds nothing ready runs it too, so that what a process of an older release pushes during
# a rolling upgrade is taken over (the new keys' names keep such a process away from the
# messages moved: it would delete a message it could not read). It frees before it adds: at
# maxmemory (noeviction) Redis refuses a script whose first write may grow memory.
_TAKE_OVER = """
-- A message's record (see the prelude), from its parts ('{}': no headers; p: its priority,
-- nil or 0 for none).
local function new_record(tries, headers, payload, p)
  if headers == '{}' then headers = '' end
  if p and p ~= 0 then tries = tries .. ';' .. p end
  return tries .. ':' .. #headers .. ':' .. headers .. payload
end
local function take_over()
  local base = string.sub(KEYS[1], 1, -4)
  local z, p, h, t, r = base .. 'z', base .. 'p', base .. 'h', base .. 't', base .. 'r'
  if redis.call('EXISTS', z, p, h, t, r) == 0 then return false end
  local cursor, moved = '0', 0
  repeat
    local page = redis.call('HSCAN', p, cursor, 'COUNT', 200)
    cursor = page[1]
    -- A hash small enough to be kept compact (hash-max-listpack-entries, which servers may
    -- set to thousands) comes whole in one page, whatever COUNT asks (Redis manual, "SCAN",
    -- "The COUNT option"): it is taken in slices of 1000 ids, so that no call below passes
    -- more values than Lua's unpack() takes (about 8000).
    local fields = page[2]
    for from = 1, #fields, 2000 do
      local ids, payloads = {}, {}
      for i = from, math.min(from + 1999, #fields), 2 do
        ids[#ids + 1] = fields[i]
        payloads[#payloads + 1] = fields[i + 1]
      end
      local scores = redis.call('ZMSCORE', z, unpack(ids))
      local headers = redis.call('HMGET', h, unpack(ids))
      local tries = redis.call('HMGET', t, unpack(ids))
      local held = redis.call('SMISMEMBER', r, unpack(ids))
      local queued = redis.call('ZMSCORE', KEYS[1], unpack(ids))
      for _, p in ipairs(redis.call('ZRANGE', base .. 'levels', 0, -1)) do
        local more = redis.call('ZMSCORE', base .. 'due:' .. p, unpack(ids))
        for k = 1, #ids do queued[k] = queued[k] or more[k] end
      end
      for _, key in ipairs({p, h, t}) do redis.call('HDEL', key, unpack(ids)) end
      redis.call('ZREM', z, unpack(ids))
      redis.call('SREM', r, unpack(ids))
      local zadd, mset, sadd, clashes = {}, {}, {}, {}
      for k = 1, #ids do
        if scores[k] then  -- a payload without its index entry was never deliverable
          local rec = new_record(tries[k] or '0', headers[k] or '{}', payloads[k])
          if queued[k] then
            clashes[#clashes + 1] = {ids[k], scores[k], rec, held[k]}
          else
            zadd[#zadd + 1] = scores[k]; zadd[#zadd + 1] = ids[k]
            mset[#mset + 1] = ids[k]; mset[#mset + 1] = rec
            if held[k] == 1 then sadd[#sadd + 1] = ids[k] end
          end
        end
      end
      if #zadd > 0 then
        redis.call('ZADD', KEYS[1], unpack(zadd))
        redis.call('HSET', KEYS[2], unpack(mset))
      end
      if #sadd > 0 then redis.call('SADD', KEYS[3], unpack(sadd)) end
      -- An id in both layouts (a user's id pushed again once its dedup window ended, by a
      -- process that looked in one layout only): overwriting the newer message would lose
      -- it, and cut its reservation short. The older one is renamed by the rule a move
      -- follows: <id>.up, <id>.up.2, ...
      for _, c in ipairs(clashes) do
        local target, n = c[1], 0
        while redis.call('HEXISTS', KEYS[2], target) == 1 do
          n = n + 1
          target = c[1] .. '.up' .. (n > 1 and ('.' .. n) or '')
        end
        redis.call('ZADD', KEYS[1], c[2], target)
        redis.call('HSET', KEYS[2], target, c[3])
        if c[4] == 1 then redis.call('SADD', KEYS[3], target) end
      end
      moved = moved + #ids
    end
  until cursor == '0' or moved >= 1000
  if cursor == '0' then redis.call('DEL', z, p, h, t, r) end
  return true, cursor ~= '0'
end
"""

# A message's record (the value of its id in msg): '<tries>:<length of headers>:<headers>
# <payload>', the headers '' when there are none; a message with a priority p other than 0
# has '<tries>;<p>:' at its head (a record without one, as earlier releases wrote all of
# them, is of priority 0). The client builds and reads records; a
# script reads one only to check or change its tries (these helpers, which the one-message
# scripts share with the prelude's), or to move it. A record not in that framing (another
# program's, or corrupted) counts as the record ``framed`` makes of it, and becomes it when
# a script first writes it (a try counted, a move): 0 tries, its bytes whole as a bytes
# payload (tag B), marked as the client marks what it cannot read. Before, a script that
# counted a try on one failed: once its reservation lapsed, every reserve of the queue
# did; and its holder's ok and ko never passed the guard.
_FRAMED = """
local ADOPTED = '{"x-undecodable":"record: not in our framing"}'
local function framed(rec)
  if string.match(rec, '^%d+:%d+:') or string.match(rec, '^%d+;%-?%d+:%d+:') then return rec end
  return '0:' .. #ADOPTED .. ':' .. ADOPTED .. 'B' .. rec
end
local function tries_of(rec) return tonumber(string.match(framed(rec), '^%d+')) end
local function prio_of(rec) return tonumber(string.match(rec, '^%d+;(%-?%d+):%d+:') or 0) end
local function with_tries(rec, tries)
  rec = framed(rec)
  return tries .. string.sub(rec, #string.match(rec, '^%d+') + 1)
end
"""

# Shared Lua helpers. Redis' Lua caps unpack() near 8000 values, so variadic commands are
# issued in chunks. KEYS[1..3] are always due, msg, held of the queue the script works on.
_PRELUDE = (
    _TAKE_OVER
    + _FRAMED
    + """
local CHUNK = 4000
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.17g', x) end
-- Push order of one insert's messages due at the same time. The ZSET orders equal scores by
-- member, which for ids of the user's is not push order (``job:0:10`` sorts before
-- ``job:0:9``). When the ids do not rise, the client sends each entry's rank in the ids'
-- byte order (ranked inserts), and every accepted message whose rank falls below the
-- previous accepted one's is due one STEP later, as is every one after it. STEP, 2^-21 s
-- (about half a microsecond), is a whole number of units in the last place of any time
-- before 2106, so the scores stay distinct and in order. The next call's TIME is later than
-- this one's last step: a script spends more than a STEP on each message it inserts.
local STEP = 2 ^ -21
local function run_chunked(cmd, key, args)
  for i = 1, #args, CHUNK do
    redis.call(cmd, key, unpack(args, i, math.min(i + CHUNK - 1, #args)))
  end
end
local function read_chunked(cmd, key, args)
  if #args <= CHUNK then  -- one call: its reply as it is, no copy
    if #args == 0 then return {} end
    return redis.call(cmd, key, unpack(args))
  end
  local out = {}
  for i = 1, #args, CHUNK do
    local part = redis.call(cmd, key, unpack(args, i, math.min(i + CHUNK - 1, #args)))
    for j = 1, #part do out[#out + 1] = part[j] end
  end
  return out
end
-- A record (see _FRAMED), taken apart to be moved.
local function unpack_record(rec)  -- tries, headers ('{}' when none), payload, priority
  rec = framed(rec)
  local i = string.find(rec, ':', 1, true)
  local j = string.find(rec, ':', i + 1, true)
  local n = tonumber(string.sub(rec, i + 1, j - 1))
  local headers = '{}'
  if n > 0 then headers = string.sub(rec, j + 1, j + n) end
  return tries_of(rec), headers, string.sub(rec, j + n + 1), prio_of(rec)
end
-- Priorities: a message of priority p other than 0 is in the ZSET due:<p> beside due (same
-- hash tag), and the ZSET levels (member p, score p) lists the p whose ZSET is not empty.
-- While it lists any, msg has a field '' (an id is never empty): a take reads it in the
-- HMGET of the records it reads anyway, so that a queue without priorities pays no call
-- more while due has something ready. ``z`` is a queue's due key.
local function level_key(z, p)
  if p == 0 then return z end
  return string.sub(z, 1, -4) .. 'due:' .. p
end
local function levels_key(z) return string.sub(z, 1, -4) .. 'levels' end
local function levels_of(z) return redis.call('ZRANGE', levels_key(z), 0, -1) end
-- Whether queue z has any level: an EXISTS, not a read of every level (up to 65,536).
local function has_levels(z) return redis.call('EXISTS', levels_key(z)) == 1 end
-- ``ids`` by the level their ``records`` name (0 for one missing): {[p] = {...}}, each id
-- after its score in ``scores`` where given (the pairs ZADD takes), else alone.
local function by_level(ids, records, scores)
  local by = {}
  for k = 1, #ids do
    local p = records[k] and prio_of(records[k]) or 0
    local some = by[p]
    if not some then some = {}; by[p] = some end
    if scores then some[#some + 1] = scores[k] end
    some[#some + 1] = ids[k]
  end
  return by
end
-- The priorities of a queue whose levels are ``lv``, in the order a take walks them:
-- those above 0 highest first, 0 (due), then those below 0.
local function walk(lv)
  local order = {}
  for i = #lv, 1, -1 do
    local p = tonumber(lv[i])
    if p > 0 then order[#order + 1] = p end
  end
  order[#order + 1] = 0
  for i = #lv, 1, -1 do
    local p = tonumber(lv[i])
    if p < 0 then order[#order + 1] = p end
  end
  return order
end
-- Once ids left level p (~= 0) of queue z: the level goes out of levels when empty, and
-- the mark in msg once levels is.
local function level_left(z, p)
  if redis.call('EXISTS', level_key(z, p)) == 0 then
    redis.call('ZREM', levels_key(z), p)
    if redis.call('EXISTS', levels_key(z)) == 0 then
      redis.call('HDEL', string.sub(z, 1, -4) .. 'msg', '')
    end
  end
end
-- Level p (~= 0) of queue z is in use: listed, and marked in msg.
local function add_level(z, p)
  redis.call('ZADD', levels_key(z), p, p)
  redis.call('HSET', string.sub(z, 1, -4) .. 'msg', '', 1)
end
-- ZADD of {score, id, ...} per priority (``by``: p -> that list), levels listed first.
local function add_by_level(z, by)
  for p, zadd in pairs(by) do
    if #zadd > 0 then
      if p ~= 0 then add_level(z, p) end
      run_chunked('ZADD', level_key(z, p), zadd)
    end
  end
end
-- Per id, whether it is queued in queue z whatever its priority (false: not queued). One
-- not in due, while there are levels, is looked up in msg, which has the record of every
-- queued message (read only for those at a level): a look-up in each level was ids x
-- levels calls' work in one script, a bulk load into a queue of many levels blocking Redis.
local function queued_of(z, ids)
  local found = read_chunked('ZMSCORE', z, ids)
  if has_levels(z) then
    local missing = {}
    for k = 1, #ids do
      if not found[k] then missing[#missing + 1] = k end
    end
    local names = {}
    for j, k in ipairs(missing) do names[j] = ids[k] end
    local records = read_chunked('HMGET', string.sub(z, 1, -4) .. 'msg', names)
    for j, k in ipairs(missing) do found[k] = records[j] end
  end
  return found
end
-- Where message id is in this queue: its ZSET, score and record (the record nil when it was
-- not read: found in due), or nil.
local function locate_one(id)
  local score = redis.call('ZSCORE', KEYS[1], id)
  if score then return KEYS[1], score end
  local rec = redis.call('HGET', KEYS[2], id)
  if not rec then return nil end
  local key = level_key(KEYS[1], prio_of(rec))
  score = redis.call('ZSCORE', key, id)
  if not score then return nil end
  return key, score, rec
end
-- At maxmemory with the noeviction policy Redis refuses a script whose first write is a
-- command that may grow memory (ZADD, SADD, HSET, ...), and lets one that has written run
-- to its end (Redis manual, "Scripting with Lua": "maxmemory"). A reserve or a ko grows
-- memory by a few bytes, and the ok that follows frees the message: so those scripts first
-- write with one that cannot grow it (SREM of the ids they hold or are about to add back),
-- and consumers still reserve, and drain, a Redis that is full.
-- The earliest score of queue z at any priority (``lv``: its levels, when read already).
local function first_mature(z, lv)
  local best = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')[2] or false
  for _, p in ipairs(lv or levels_of(z)) do
    local s = redis.call('ZRANGE', level_key(z, tonumber(p)), 0, 0, 'WITHSCORES')[2]
    if s and (not best or tonumber(s) < tonumber(best)) then best = s end
  end
  return best
end
-- Delete messages; ``held``: those of them that may be reserved (nil = all); ``records``
-- theirs, when read already. Each is taken out of due first: only when some were not there
-- (a priority's) are the records read, to find their level.
local function forget(ids, held, records)
  if #ids == 0 then return end
  local removed = 0
  for i = 1, #ids, CHUNK do
    removed = removed + redis.call('ZREM', KEYS[1], unpack(ids, i, math.min(i + CHUNK - 1, #ids)))
  end
  if removed < #ids then
    records = records or read_chunked('HMGET', KEYS[2], ids)
    local by = by_level(ids, records)
    by[0] = nil  -- taken out of due above
    for p, some in pairs(by) do
      run_chunked('ZREM', level_key(KEYS[1], p), some)
      level_left(KEYS[1], p)
    end
  end
  run_chunked('HDEL', KEYS[2], ids)
  run_chunked('SREM', KEYS[3], held or ids)
end
"""
    + WITH_HEADERS
    + """
-- The one move body (Queue.move and deadletter): take held message ``id`` out of this
-- queue into the queue whose due, msg keys are given, due at ``due``, with ``payload`` (nil:
-- its own) and ``added`` header text ('' = none) added to its headers, renamed by the rule
-- of every backend if the id is taken there: <id>, <id>.<tag>, <id>.<tag>.2, ...
local function move_to(id, dz, dm, payload, added, due, tag)
  local rec = redis.call('HGET', KEYS[2], id)
  local _, headers, own, p = unpack_record(rec)
  payload = payload or own
  headers = with_headers(headers, added)
  forget({id}, nil, {rec})
  local target, n = id, 0
  while redis.call('HEXISTS', dm, target) == 1 do  -- queued there, at any priority
    n = n + 1
    target = id .. '.' .. tag .. (n > 1 and ('.' .. n) or '')
  end
  if p ~= 0 then add_level(dz, p) end
  redis.call('ZADD', level_key(dz, p), due, target)
  redis.call('HSET', dm, target, new_record(0, headers, payload, p))
  return target
end
-- Whether ``id`` is held here with ``guard`` tries ('' = any holder).
local function is_held(id, guard)
  if redis.call('SISMEMBER', KEYS[3], id) == 0 then return false end
  return guard == '' or tonumber(guard) == tries_of(redis.call('HGET', KEYS[2], id))
end
-- A batch of guarded requests in ARGV, ``stride`` values each (id, tries held or '' for
-- any holder, then the request's own): their ids, and ``holds(k)``, whether the k-th
-- request's holder still holds its message (is_held for all of them in two reads).
local function guards_held(stride)
  local ids, guarded = {}, false
  for i = 1, #ARGV, stride do
    ids[#ids + 1] = ARGV[i]
    if ARGV[i + 1] ~= '' then guarded = true end
  end
  local held = read_chunked('SMISMEMBER', KEYS[3], ids)
  local records = {}
  if guarded then records = read_chunked('HMGET', KEYS[2], ids) end
  local function holds(k)
    local guard = ARGV[stride * (k - 1) + 2]
    return held[k] == 1 and (guard == '' or tonumber(guard) == tries_of(records[k]))
  end
  return ids, holds
end
-- The mature ids (up to n, highest priority first, then earliest), their records and mature
-- times, which of them were reserved (an expired reservation: that delivery counts as a try,
-- ``bumps``), those ids, their priorities, and the queue's levels. Due is read first, and
-- the mark of priorities with its records (see above): a queue without them pays no call
-- more, but for a HEXISTS when due has nothing ready. With them, each level is read until n
-- are found: a level whose messages are all reserved or delayed costs a read per take.
local function take_mature(n, now)
  local due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, n, 'WITHSCORES')
  local ids, matures, prios, records, marked = {}, {}, {}, nil, false
  for i = 1, #due, 2 do
    ids[#ids + 1] = due[i]
    matures[#matures + 1] = due[i + 1]
    prios[#prios + 1] = 0
  end
  if #ids > 0 then
    ids[#ids + 1] = ''
    records = read_chunked('HMGET', KEYS[2], ids)
    ids[#ids] = nil
    marked = records[#records]
    records[#records] = nil
  else
    marked = redis.call('HEXISTS', KEYS[2], '') == 1
  end
  local lv = {}
  if marked then
    lv = levels_of(KEYS[1])
    ids, matures, prios = {}, {}, {}
    for _, p in ipairs(walk(lv)) do
      local head = due  -- read already: its first n - #ids are what a read would give
      if p ~= 0 then
        head = redis.call('ZRANGE', level_key(KEYS[1], p), '-inf', now, 'BYSCORE',
          'LIMIT', 0, n - #ids, 'WITHSCORES')
      end
      for i = 1, math.min(#head, 2 * (n - #ids)), 2 do
        ids[#ids + 1] = head[i]
        matures[#matures + 1] = head[i + 1]
        prios[#prios + 1] = p
      end
      if #ids >= n then break end
    end
    if #ids > 0 then records = read_chunked('HMGET', KEYS[2], ids) end
  end
  if #ids == 0 then return ids, nil, nil, nil, nil, nil, lv end
  local held = read_chunked('SMISMEMBER', KEYS[3], ids)
  local bumps, with_held = {}, {}
  for k = 1, #ids do
    bumps[k] = held[k]
    if held[k] == 1 then with_held[#with_held + 1] = ids[k] end
  end
  return ids, records, matures, bumps, with_held, prios, lv
end
-- Reply: next mature, then ids, records, matures and bumps (k of each; a bump of 1 is a
-- try the record does not count yet). The next mature time is given as seconds from the
-- server's now (false: the queue is empty), since the client sleeps toward it on its own
-- clock, which may be off ours. When all n asked for were found, the queue layer ignores
-- the next mature time (it only looks at it when nothing was handed out), so 0 (now)
-- stands in for it there, sparing a ZRANGE: a lower bound, which is all a hint has to be.
local function fetched_reply(n, now, ids, records, matures, bumps, lv)
  local head = '0'
  if #ids < n then
    head = first_mature(KEYS[1], lv)
    if head then head = fmt(tonumber(head) - now) end
    if #ids == 0 and take_over() then head = '0' end  -- taken over: look again now
  end
  local reply = {head}
  for _, column in ipairs({ids, records, matures, bumps}) do
    for k = 1, #ids do reply[#reply + 1] = column[k] end
  end
  return reply
end
"""
)

# KEYS: due msg held d. ARGV: dedup window, delay, ranked ('' = no, the ids rise), then per
# entry: id, record (and its rank when ranked). _INSERT for a bulk load (see
# ``contract.bulk_columns``): every id the user's, so each is looked up in z and d, two
# arguments an entry instead of five, and the mature and expiry times formatted once for
# the batch (once per step when ranked). Unranked, the ids never fall (the client sends
# ranks otherwise), so a repeat sits right after its first: it is found by comparing
# neighbours, with no table of the ids seen. Reply: the positions
# (1-based) of the entries refused, none for a load all new: a reply of a flag per entry
# cost the server and the client more than the rest of the reply's handling.
_INSERT_BULK = """
local now = server_now()
local expires = fmt(now + tonumber(ARGV[1]))
local due = now + tonumber(ARGV[2])
local mature = fmt(due)
local stride = ARGV[3] == '' and 2 or 3
-- counters, not #t: the length operator searches the table on every append
local ids, n = {}, 0
for i = 4, #ARGV, stride do n = n + 1; ids[n] = ARGV[i] end
local steps, last = 0, nil
local queued = queued_of(KEYS[1], ids)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local held = read_chunked('ZMSCORE', KEYS[4], ids)
local seen, refused, r = {}, {}, 0
local zadd, dset, z, fresh = {}, {}, 0, 0
local ranked, prev = stride == 3, nil
for k = 1, n do
  local id = ids[k]
  if queued[k] or held[k] or id == prev or (ranked and seen[id]) then
    r = r + 1
    refused[r] = k
  else
    if ranked then
      seen[id] = true  -- a repeat later in this batch is refused
      local rank = tonumber(ARGV[4 + (k - 1) * 3 + 2])
      if last and rank < last then
        steps = steps + 1
        mature = fmt(due + steps * STEP)
      end
      last = rank
    end
    zadd[z + 1] = mature; zadd[z + 2] = id
    dset[z + 1] = expires; dset[z + 2] = id
    z = z + 2
    fresh = fresh + 1
  end
  prev = id
end
run_chunked('ZADD', KEYS[1], zadd)
if stride == 2 and fresh == n then
  -- the usual bulk load, all of it new: ARGV past the header is id, record, id, record...,
  -- what HSET takes, passed on without a table built of it
  for i = 4, #ARGV, CHUNK do
    redis.call('HSET', KEYS[2], unpack(ARGV, i, math.min(i + CHUNK - 1, #ARGV)))
  end
else
  local mset, m, next_refused = {}, 0, 1
  for k = 1, n do
    if refused[next_refused] == k then
      next_refused = next_refused + 1
    else
      mset[m + 1] = ids[k]; mset[m + 2] = ARGV[4 + (k - 1) * stride + 1]
      m = m + 2
    end
  end
  run_chunked('HSET', KEYS[2], mset)
end
run_chunked('ZADD', KEYS[4], dset)
return refused
"""

# KEYS: due msg held d. ARGV: dedup window, ranked ('' = no, the ids rise), then per entry: id,
# record, delay, absolute mature ('' = now + delay), check ('' = an id the queue generated,
# unique by construction, so nothing to look up; 'c' = refused while queued; 'd' = also
# refused within the dedup window), priority, and its rank when ranked. Reply: 1 / 0 per
# entry.
_INSERT = """
local now = server_now()
local window = tonumber(ARGV[1])
local stride = ARGV[2] == '' and 6 or 7
local checked, deduped = {}, {}
for i = 3, #ARGV, stride do
  local check = ARGV[i + 4]
  if check ~= '' then checked[#checked + 1] = ARGV[i] end
  if check == 'd' then deduped[#deduped + 1] = ARGV[i] end
end
local queued, held = {}, {}
if #checked > 0 then
  local scores = queued_of(KEYS[1], checked)
  for k = 1, #checked do
    if scores[k] then queued[checked[k]] = true end
  end
end
if #deduped > 0 then
  -- purge the expired, then one ZMSCORE for the batch: a ZSCORE per id costs a
  -- redis.call each, the larger part of the script's time on an idempotent bulk push
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  local scores = read_chunked('ZMSCORE', KEYS[4], deduped)
  for k = 1, #deduped do
    if scores[k] then held[deduped[k]] = true end
  end
end
local flags = {}
local by, mset, dset = {[0] = {}}, {}, {}
local steps, last = 0, nil
for i = 3, #ARGV, stride do
  local id, check = ARGV[i], ARGV[i + 4]
  local fresh = check == '' or not (queued[id] or (check == 'd' and held[id]))
  if fresh then
    if check ~= '' then queued[id] = true end  -- a repeat later in this batch is refused
    if stride == 7 then
      local rank = tonumber(ARGV[i + 6])
      if last and rank < last then steps = steps + 1 end
      last = rank
    end
    local mature = ARGV[i + 3]
    if mature == '' then mature = now + tonumber(ARGV[i + 2]) + steps * STEP end
    local p = tonumber(ARGV[i + 5])
    local zadd = by[p]
    if not zadd then zadd = {}; by[p] = zadd end
    zadd[#zadd + 1] = mature; zadd[#zadd + 1] = id
    mset[#mset + 1] = id; mset[#mset + 1] = ARGV[i + 1]
    if check == 'd' then dset[#dset + 1] = now + window; dset[#dset + 1] = id end
    flags[#flags + 1] = 1
  else
    flags[#flags + 1] = 0
  end
end
add_by_level(KEYS[1], by)
run_chunked('HSET', KEYS[2], mset)
run_chunked('ZADD', KEYS[4], dset)
return flags
"""

# KEYS: due msg held. ARGV: n.
_GET = """
local n, now = tonumber(ARGV[1]), server_now()
local ids, records, matures, bumps, held, _, lv = take_mature(n, now)
forget(ids, held, records)
return fetched_reply(n, now, ids, records, matures, bumps, lv)
"""

# KEYS: due msg held. ARGV: n, reserve delay.
_RESERVE = """
local n, now = tonumber(ARGV[1]), server_now()
local ids, records, matures, bumps, _, prios, lv = take_mature(n, now)
if #ids > 0 then
  redis.call('SREM', KEYS[3], ids[1])  -- first, a write that cannot grow memory (above)
  local deadline, by, counted = now + tonumber(ARGV[2]), {}, {}
  for k = 1, #ids do
    local zadd = by[prios[k]]
    if not zadd then zadd = {}; by[prios[k]] = zadd end
    zadd[#zadd + 1] = deadline; zadd[#zadd + 1] = ids[k]
    if bumps[k] == 1 then
      counted[#counted + 1] = ids[k]
      counted[#counted + 1] = with_tries(records[k], tries_of(records[k]) + 1)
    end
  end
  for p, zadd in pairs(by) do run_chunked('ZADD', level_key(KEYS[1], p), zadd) end
  run_chunked('SADD', KEYS[3], ids)
  run_chunked('HSET', KEYS[2], counted)
end
return fetched_reply(n, now, ids, records, matures, bumps, lv)
"""

# KEYS: due msg held. ARGV: per ack: id, tries held ('' = no guard). Reply: 1 / 0 per ack.
_COMMIT = """
local ids, holds = guards_held(2)
local gone, done, flags = {}, {}, {}
for k = 1, #ids do
  local id = ids[k]
  if not done[id] and holds(k) then
    done[id] = true
    gone[#gone + 1] = id
    flags[k] = 1
  else
    flags[k] = 0
  end
end
forget(gone, gone)
return flags
"""

# KEYS: due msg held. ARGV per extend: id, tries held ('' = no guard), seconds. Reply: 1 / 0
# per extend. The guard is _COMMIT's: held, and with the tries given when there are any (a
# lapsed reservation taken again has one more). A reservation's end is its score in due and
# nowhere else, so the ZADD is all an extension writes: a lapsed one that nobody took stays
# held, its score back in the future, and the try a retake would have counted is not.
_EXTEND = """
local now = server_now()
local ids, holds = guards_held(3)
local zadd, flags = {}, {}
for k = 1, #ids do
  if holds(k) then
    zadd[#zadd + 1] = fmt(now + tonumber(ARGV[3 * k])); zadd[#zadd + 1] = ids[k]
    flags[k] = 1
  else
    flags[k] = 0
  end
end
if #zadd > 0 then
  -- first, a write that cannot grow memory (prelude): the id goes out of held and back
  redis.call('SREM', KEYS[3], zadd[2])
  redis.call('SADD', KEYS[3], zadd[2])
  local by = {[0] = zadd}
  if has_levels(KEYS[1]) then  -- priorities: each in its level's ZSET
    local ids, scores = {}, {}
    for i = 2, #zadd, 2 do ids[#ids + 1] = zadd[i]; scores[#scores + 1] = zadd[i - 1] end
    by = by_level(ids, read_chunked('HMGET', KEYS[2], ids), scores)
  end
  for p, some in pairs(by) do  -- XX: never a due entry without its record
    local key = level_key(KEYS[1], p)
    for i = 1, #some, CHUNK do
      redis.call('ZADD', key, 'XX', unpack(some, i, math.min(i + CHUNK - 1, #some)))
    end
  end
end
return flags
"""

# KEYS: due msg held of the queue, then due msg of the deadletter queue when mode is 'move',
# the queue's ``aside`` when it is 'defer'.
# ARGV: mode ('' = no deadletter, 'move', 'defer'), max_ko, deadletter header text without
# x-dl-tries, then per nack: id, tries held ('' = no guard), delay, count try ('1' / '0').
# Reply: 0 missing / 1 rolled back / 2 deadlettered / 3 to move (defer), per nack; then for
# each 3: id, payload, new headers, tries counted (what DROP_DEFERRED is given), priority.
_ROLLBACK = """
local DEFER_HOLD = 60
local now = server_now()
local mode, max_ko, extra = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local flags, deferred = {}, {}
for i = 4, #ARGV, 4 do
  local id, guard = ARGV[i], ARGV[i + 1]
  local rec = false
  if redis.call('SISMEMBER', KEYS[3], id) == 1 then rec = redis.call('HGET', KEYS[2], id) end
  local stored = rec and tries_of(rec)
  if not rec or (guard ~= '' and tonumber(guard) ~= stored) then
    flags[#flags + 1] = 0
  else
    local counted = ARGV[i + 3] == '1'
    local tries = stored
    if counted then tries = stored + 1 end
    if mode ~= '' and counted and tries > max_ko then
      local added = extra .. ',"x-dl-tries":' .. tries
      if mode == 'move' then
        move_to(id, KEYS[4], KEYS[5], nil, added, now, 'dl' .. tries)
        flags[#flags + 1] = 2
      else
        local _, headers, payload = unpack_record(rec)
        headers = with_headers(headers, added)
        for _, v in ipairs({id, payload, headers, tries, prio_of(rec)}) do
          deferred[#deferred + 1] = v
        end
        -- Out of its holder's hands (no longer held: a racing ok, ko or move of the same
        -- reservation finds nothing, as after a one-script deadletter) and out of reach
        -- for the client's next two steps, its try counted as a ko counts it; after a
        -- crash between them it comes back then, as a ko with that delay would.
        redis.call('SREM', KEYS[3], id)  -- first, a write that cannot grow memory
        redis.call('HSET', KEYS[2], id, with_tries(rec, tries))
        redis.call('ZADD', level_key(KEYS[1], prio_of(rec)), now + DEFER_HOLD, id)
        -- no waiting message either: an amend that made it ready let a consumer take it
        -- while its copy went to the deadletter queue (see _AMEND)
        redis.call('ZADD', KEYS[4], now + DEFER_HOLD, id)
        flags[#flags + 1] = 3
      end
    else
      redis.call('SREM', KEYS[3], id)  -- first: a write that cannot grow memory
      if tries ~= stored then redis.call('HSET', KEYS[2], id, with_tries(rec, tries)) end
      redis.call('ZADD', level_key(KEYS[1], prio_of(rec)), now + tonumber(ARGV[i + 2]), id)
      flags[#flags + 1] = 1
    end
  end
end
for _, v in ipairs(deferred) do flags[#flags + 1] = v end
return flags
"""

# Cluster deadletter, last step. KEYS: due msg held aside. ARGV per message: id, tries
# counted. Deletes each message a deferred rollback set aside (not held, the tries it
# wrote), once its copy is in the deadletter queue; one taken again since (held, or ko-ed:
# other tries) stays. Either way its set-aside ends. Reply: 1 / 0 per message.
_DROP_DEFERRED = """
local gone, records, flags = {}, {}, {}
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  redis.call('ZREM', KEYS[4], id)  -- first, a write that cannot grow memory (prelude)
  local rec = redis.call('HGET', KEYS[2], id)
  if rec and redis.call('SISMEMBER', KEYS[3], id) == 0
      and tries_of(rec) == tonumber(ARGV[i + 1]) then
    gone[#gone + 1] = id
    records[#records + 1] = rec
    flags[#flags + 1] = 1
  else
    flags[#flags + 1] = 0
  end
end
forget(gone, {}, records)
return flags
"""

# KEYS: due msg held of the queue, then due msg of each destination. ARGV per move: id, tries held
# ('' = no guard), destination number (1 = KEYS[4..5]), '1' if a payload follows else '0',
# payload, added header text ('' = none), delay, tag. Reply: per move, the id it has in its
# destination, or '' when it was not held (an id is never empty).
_MOVE = """
local now = server_now()
local out = {}
for i = 1, #ARGV, 8 do
  local id = ARGV[i]
  if is_held(id, ARGV[i + 1]) then
    local d = 2 + 2 * tonumber(ARGV[i + 2])
    local payload = nil
    if ARGV[i + 3] == '1' then payload = ARGV[i + 4] end
    local due = now + tonumber(ARGV[i + 6])
    out[#out + 1] = move_to(id, KEYS[d], KEYS[d + 1], payload, ARGV[i + 5], due, ARGV[i + 7])
  else
    out[#out + 1] = ''
  end
end
return out
"""

# KEYS: due msg held. ARGV: ids. Reply: 1 / 0 per id.
_REMOVE = """
local now = server_now()
local matures = read_chunked('ZMSCORE', KEYS[1], ARGV)
if has_levels(KEYS[1]) then  -- priorities: one not in due may be in its level
  for k = 1, #ARGV do
    if not matures[k] then
      local key, score = locate_one(ARGV[k])
      if key then matures[k] = score end
    end
  end
end
local held = read_chunked('SMISMEMBER', KEYS[3], ARGV)
local gone, done, flags = {}, {}, {}
for k = 1, #ARGV do
  local id = ARGV[k]
  if matures[k] and not done[id] and not (held[k] == 1 and tonumber(matures[k]) > now) then
    done[id] = true
    gone[#gone + 1] = id
    flags[k] = 1
  else
    flags[k] = 0
  end
end
forget(gone)
return flags
"""

# KEYS: due msg held aside. ARGV per amend: id, delay ('' = its mature time stays), priority
# ('' = it stays), scheduled only ('1' / ''). Reply: 1 / 0 per amend. A message is amendable
# where _REMOVE would delete it: queued at any level, and not held with its deadline ahead,
# nor set aside by a cluster deadletter between its copy and its drop (listed in ``aside``
# until then, or for the minute a crash leaves it there: see _ROLLBACK). One
# whose reservation lapsed (held, its deadline past) is waiting there: the amend ends that
# reservation as a take would, its delivery counted as a try in its record (what peek shows
# already), so its last holder's ok / ko no longer passes the guard. The amends run in ARGV
# order, each seeing the ones before (an id given twice: the second finds the first's work).
# Its score leaves its ZSET first (a write that cannot grow memory, see the prelude), then
# goes into the ZSET of its new level, listed and marked as a prioritized push does, and the
# old level goes once empty, as after a take. Its score, unless a delay is given, stays: in
# its new level it takes its place by mature time and id, as if pushed there.
_AMEND = """
local now = server_now()
local flags = {}
-- The record with priority p (0: none), its tries, headers and payload kept.
local function with_prio(rec, p)
  rec = framed(rec)
  local tries = string.match(rec, '^%d+')
  local rest = string.sub(rec, (string.find(rec, ':', 1, true)))  -- from the first ':'
  if p ~= 0 then tries = tries .. ';' .. p end
  return tries .. rest
end
for i = 1, #ARGV, 4 do
  local id, delay, prio, only = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3] == '1'
  local key, score, rec = locate_one(id)
  local held = key and redis.call('SISMEMBER', KEYS[3], id) == 1
  local aside = key and redis.call('ZSCORE', KEYS[4], id)
  aside = aside and tonumber(aside) > now
  if not key or aside or (held and tonumber(score) > now)
      or (only and tonumber(score) <= now) then
    flags[#flags + 1] = 0
  else
    rec = rec or redis.call('HGET', KEYS[2], id)
    local old = prio_of(rec)
    local p = old
    if prio ~= '' then p = tonumber(prio) end
    if delay ~= '' then score = fmt(now + tonumber(delay)) end
    redis.call('ZREM', key, id)  -- first, a write that cannot grow memory (prelude)
    local new_rec = rec
    if held then  -- a lapsed reservation, ended: that delivery was a try
      redis.call('SREM', KEYS[3], id)
      new_rec = with_tries(new_rec, tries_of(new_rec) + 1)
    end
    if p ~= old then new_rec = with_prio(new_rec, p) end
    if p ~= 0 then add_level(KEYS[1], p) end
    redis.call('ZADD', level_key(KEYS[1], p), score, id)
    if new_rec ~= rec then redis.call('HSET', KEYS[2], id, new_rec) end
    if old ~= 0 and old ~= p then level_left(KEYS[1], old) end
    flags[#flags + 1] = 1
  end
end
return flags
"""

# KEYS: due msg held. Reply: mature now (expired reservations included), total, reserved.
_SIZES = """
local now = server_now()
local ready, total, reserved = 0, 0, 0
local lv = levels_of(KEYS[1])
for _, p in ipairs(walk(lv)) do
  local z = level_key(KEYS[1], p)
  ready = ready + redis.call('ZCOUNT', z, '-inf', now)
  total = total + redis.call('ZCARD', z)
end
-- A held id's deadline is its score in its own level, which its record names: looked up
-- there only (in every level, it was levels x reservations look-ups in this one script).
local members = redis.call('SMEMBERS', KEYS[3])
if #members > 0 then
  local by = {[0] = members}
  if #lv > 0 then
    by = by_level(members, read_chunked('HMGET', KEYS[2], members))
  end
  for p, some in pairs(by) do
    for _, deadline in ipairs(read_chunked('ZMSCORE', level_key(KEYS[1], p), some)) do
      if deadline and tonumber(deadline) > now then reserved = reserved + 1 end
    end
  end
end
return {ready, total, reserved}
"""

# KEYS: due. Reply: the earliest score at any priority, reservation deadlines included, or nil.
_NEXT_MATURE = """
return first_mature(KEYS[1])
"""

# One-message forms of insert / get / reserve / commit, for the calls that carry one (the
# common case with a few clients, whose calls run one by one). Same effects and replies as
# the batch scripts, without the prelude, the ARGV tables and the loops: about half the
# server time per message for a push (each EVALSHA is billed its Lua time as well as its
# redis.call()s, Redis manual, "INFO commandstats"). A reserved message is recognised by
# the return of SADD / SREM rather than a separate SISMEMBER.

# KEYS: due msg. ARGV: id (generated: unique), record, delay. Reply: 1.
_INSERT_ONE = """
local t = redis.call('TIME')
local mature = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], mature, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# The start of the one-message get and reserve: the first message by rank of each level in
# the walk's order (see the prelude), which is mature or not by its score (one ZRANGE by rank
# costs Redis about half of one BYSCORE with a LIMIT, measured with "INFO commandstats"), and
# when none is, the next mature time. The first look is at due, and the record of its head
# is read with the mark of priorities in msg (see the prelude): a queue without them pays
# no call more, but for a HEXISTS when due has nothing ready. Then ``key`` is the ZSET of
# message ``id``, ``p`` its priority, ``rec`` its record when read already.
_TAKE_ONE = (
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local key, id, mature, p, rec = KEYS[1], head[1], head[2], 0, nil
local marked
if id and tonumber(mature) <= now then
  local got = redis.call('HMGET', KEYS[2], id, '')
  rec, marked = got[1], got[2]
else
  id, marked = nil, redis.call('HEXISTS', KEYS[2], '') == 1
end
if marked or not id then
  local base = string.sub(KEYS[1], 1, -4)
  -- The walk: key, id, mature time, priority of the first ready; or nil, nil, the earliest
  local function first_ready()
    local lv = redis.call('ZRANGE', base .. 'levels', 0, -1)
    local order, soonest = {}, nil
    for i = #lv, 1, -1 do if tonumber(lv[i]) > 0 then order[#order + 1] = lv[i] end end
    order[#order + 1] = '0'
    for i = #lv, 1, -1 do if tonumber(lv[i]) < 0 then order[#order + 1] = lv[i] end end
    for _, level in ipairs(order) do
      local z = level == '0' and KEYS[1] or base .. 'due:' .. level
      local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
      if first[1] then
        if tonumber(first[2]) <= now then return z, first[1], first[2], tonumber(level) end
        if not soonest or tonumber(first[2]) < tonumber(soonest) then soonest = first[2] end
      end
    end
    return nil, nil, soonest
  end
  if marked then
    key, id, mature, p = first_ready()
    rec = nil
  end
  if not id then
"""
    + _TAKE_OVER
    + """
    if take_over() then  -- taken over: look again
      key, id, mature, p = first_ready()
    end
    if not id then
      return {mature and string.format('%.17g', tonumber(mature) - now) or false}
    end
  end
end
"""
)

# KEYS: due msg held. Reply as at get, for n = 1.
_GET_ONE = (
    _TAKE_ONE
    + """
rec = rec or redis.call('HGET', KEYS[2], id)
redis.call('ZREM', key, id)
redis.call('HDEL', KEYS[2], id)
if p ~= 0 and redis.call('EXISTS', key) == 0 then  -- its level is empty: see the prelude
  local levels = string.sub(KEYS[1], 1, -4) .. 'levels'
  redis.call('ZREM', levels, p)
  if redis.call('EXISTS', levels) == 0 then redis.call('HDEL', KEYS[2], '') end
end
return {'0', id, rec, mature, redis.call('SREM', KEYS[3], id)}
"""
)

# KEYS: due msg held. ARGV: reserve delay. Reply as at reserve, for n = 1.
_RESERVE_ONE = (
    _FRAMED
    + _TAKE_ONE
    + """
-- The first write cannot grow memory (SREM): at maxmemory (noeviction) Redis refuses a
-- script whose first write may, so a full Redis could not be drained by reserve and ok.
local lapsed = redis.call('SREM', KEYS[3], id)
redis.call('ZADD', key, now + tonumber(ARGV[1]), id)
redis.call('SADD', KEYS[3], id)
rec = rec or redis.call('HGET', KEYS[2], id)
if lapsed == 1 then redis.call('HSET', KEYS[2], id, with_tries(rec, tries_of(rec) + 1)) end
return {'0', id, rec, mature, lapsed}
"""
)

# KEYS: due msg held. ARGV: id, tries held ('' = no guard). Reply: 1 / 0. The reservation is
# taken off first (a write that cannot grow memory, and the test of it in one call), and
# put back when the tries show another holder's. A message not in due is of a priority,
# which its record tells (read then only, when the guard did not read it).
_COMMIT_ONE = (
    _FRAMED
    + """
local id, guard, rec = ARGV[1], ARGV[2], nil
if redis.call('SREM', KEYS[3], id) == 0 then return 0 end
if guard ~= '' then
  rec = redis.call('HGET', KEYS[2], id)
  if tonumber(guard) ~= tries_of(rec) then
    redis.call('SADD', KEYS[3], id)
    return 0
  end
end
if redis.call('ZREM', KEYS[1], id) == 0 then
  rec = rec or redis.call('HGET', KEYS[2], id)
  local p = rec and prio_of(rec) or 0
  if p ~= 0 then
    local key = string.sub(KEYS[1], 1, -4) .. 'due:' .. p
    redis.call('ZREM', key, id)
    if redis.call('EXISTS', key) == 0 then  -- its level is empty: see the prelude
      local levels = string.sub(KEYS[1], 1, -4) .. 'levels'
      redis.call('ZREM', levels, p)
      if redis.call('EXISTS', levels) == 0 then redis.call('HDEL', KEYS[2], '') end
    end
  end
end
redis.call('HDEL', KEYS[2], id)
return 1
"""
)

INSERT_ONE, GET_ONE, RESERVE_ONE, COMMIT_ONE = (
    Script(body) for body in (_INSERT_ONE, _GET_ONE, _RESERVE_ONE, _COMMIT_ONE)
)

(
    INSERT,
    INSERT_BULK,
    GET,
    RESERVE,
    COMMIT,
    EXTEND,
    ROLLBACK,
    DROP_DEFERRED,
    MOVE,
    REMOVE,
    AMEND,
    SIZES,
    NEXT_MATURE,
) = (
    Script(_PRELUDE + body)
    for body in (
        _INSERT,
        _INSERT_BULK,
        _GET,
        _RESERVE,
        _COMMIT,
        _EXTEND,
        _ROLLBACK,
        _DROP_DEFERRED,
        _MOVE,
        _REMOVE,
        _AMEND,
        _SIZES,
        _NEXT_MATURE,
    )
)


_PLAIN = b"0:0:"
"""The head of the record of a message without headers or tries (see ``record``)."""


def record(
    payload: bytes, headers: bytes = EMPTY_HEADERS, tries: int = 0, priority: int = 0
) -> bytes:
    """A message as its queue's hash ``m`` keeps it: ``<tries>:<length of headers>:`` then
    the headers (none when empty) and the payload, one value, so that a script reads or
    deletes a message with one call into Redis rather than one per part. A priority other
    than 0 follows the tries (``<tries>;<priority>:``), where a script finds its level."""
    if tries == 0 and headers == EMPTY_HEADERS and not priority:
        return _PLAIN + payload
    if headers == EMPTY_HEADERS:
        headers = b""
    if priority:
        return b"%d;%d:%d:%b%b" % (tries, priority, len(headers), headers, payload)
    return b"%d:%d:%b%b" % (tries, len(headers), headers, payload)


def _unrecord(message_id: bytes, rec: bytes, mature: bytes | float, bump: int) -> Stored:
    """A message of a reply: its id, record, mature time, and a try its record does not
    count yet (an expired reservation's, ``bump`` 1)."""
    if rec[:4] == _PLAIN:
        return Stored(message_id.decode(), rec[4:], EMPTY_HEADERS, bump, float(mature))
    tries, size, rest = rec.split(b":", 2)
    n = int(size)
    tries, _, priority = tries.partition(b";")
    return Stored(
        message_id.decode(),
        rest[n:],
        rest[:n] if n else EMPTY_HEADERS,
        int(tries) + bump,
        float(mature),
        priority=int(priority) if priority else 0,
    )


def _unrecord_all(columns: Sequence[list[Any]]) -> list[Stored]:
    """The messages of a get / reserve reply's columns (ids, records, mature times, bumps).
    Their records are already deleted (a get's) or held (a reserve's): one not in our
    framing (written into the hash by another program, or corrupted) must not fail the
    others, so each is read alone once the whole fails."""
    try:
        return [_unrecord(*row) for row in zip(*columns, strict=True)]
    except Exception:
        return [_unrecord_or_wrap(*row) for row in zip(*columns, strict=True)]


_LEADING_TRIES = re.compile(rb"(\d+)(?:;(-?\d+))?:\d+:")


def _unrecord_or_wrap(message_id: bytes, rec: bytes, mature: bytes | float, bump: int) -> Stored:
    """A record not in our framing, whole, as a bytes payload marked ``x-undecodable``,
    under its own id. Its tries are what the scripts count for it (those its framing
    still tells, else none: see the scripts' ``framed``), so that its holder's ``ok``
    or ``ko`` passes their guard."""
    try:
        return _unrecord(message_id, rec, mature, bump)
    except Exception as exc:
        reason = f"record: {exc!s}"
    name = message_id.decode(errors="replace")
    log.warning("redis-oq: the record of message %r is not in our framing: %s", name, reason)
    payload, headers = encode_payload(bytes(rec)), encode_headers({UNDECODABLE: reason})
    leading = _LEADING_TRIES.match(rec)
    tries = int(leading.group(1)) if leading else 0
    priority = int(leading.group(2)) if leading and leading.group(2) else 0
    return Stored(name, payload, headers, tries + bump, float(mature), priority=priority)


def _fetched(reply: list[Any]) -> Fetched:
    """Decode a get / reserve reply: next mature, then four columns of k values. The script
    gives the next mature time as seconds from the server's clock, made a time on ours here:
    the wait loop sleeps on our clock, so a client whose clock is off the server's still
    wakes when the message matures, not that far before or after it."""
    if len(reply) <= 5:  # none, or one message: no columns to cut
        return Fetched(*_read_one(reply))
    head = reply[0]
    next_mature = None if head is None else time.time() + float(head)
    k = (len(reply) - 1) // 4
    messages = _unrecord_all(
        (
            reply[1 : k + 1],
            reply[k + 1 : 2 * k + 1],
            reply[2 * k + 1 : 3 * k + 1],
            reply[3 * k + 1 :],
        )
    )
    return Fetched(messages, next_mature)


# Looking without taking (peek, find) and holding by id (requeue): scripts of their own,
# sharing the prelude. A walk goes in ZSET order: (score, id), the score being the mature
# time or, for a reserved message, its deadline.

# KEYS: due msg held. ARGV: state ('ready', 'scheduled', 'reserved', 'all'), cursor score ('' =
# from the start), cursor id, limit, scan budget. Reply: cursor score and id (false, false at
# the end), then per row: id, record, score, state.
_PEEK = """
-- Whether id a lies at or before id b among equal scores. The sorted set orders ties by
-- their bytes (Redis manual, "Sorted sets"), but Lua's < on strings is strcoll, which
-- follows the LC_COLLATE Redis sets from its environment at start: compare bytes instead.
local function at_or_before(a, b)
  if a == b then return true end
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local now = server_now()
local state, cscore, cid = ARGV[1], ARGV[2], ARGV[3]
local limit, budget = tonumber(ARGV[4]), tonumber(ARGV[5])
local span = limit
if state == 'scheduled' or state == 'reserved' then span = math.max(limit, budget) end
-- Up to ``count`` members of ZSET z past the cursor (and past its ready ones but for 'ready'
-- and 'all') and past the ``skip`` first of those, with their scores.
local function scan(z, count, skip)
  local start = 0
  if cscore ~= '' then
    local at = tonumber(cscore)
    local score = redis.call('ZSCORE', z, cid)
    if score and tonumber(score) == at then
      start = redis.call('ZRANK', z, cid) + 1
    else  -- the cursor's message moved or left: start among its ties, after its id
      start = redis.call('ZCOUNT', z, '-inf', '(' .. cscore)
      local done = false
      while not done do
        local part = redis.call('ZRANGE', z, start, start + 99, 'WITHSCORES')
        if #part == 0 then break end
        for i = 1, #part, 2 do
          if tonumber(part[i + 1]) == at and at_or_before(part[i], cid) then start = start + 1
          else done = true; break end
        end
      end
    end
  end
  if state ~= 'ready' and state ~= 'all' then
    start = math.max(start, redis.call('ZCOUNT', z, '-inf', now))
  end
  start = start + (skip or 0)
  return redis.call('ZRANGE', z, start, start + count - 1, 'WITHSCORES')
end
-- Of two members {id, score}, whether a comes before b in ZSET order.
local function before(a, b)
  return a[2] < b[2] or (a[2] == b[2] and a[1] ~= b[1] and at_or_before(a[1], b[1]))
end
local ids, scores, finished = {}, {}, true
local lv = levels_of(KEYS[1])
if #lv == 0 then
  local part = scan(KEYS[1], span)
  for i = 1, #part, 2 do ids[#ids + 1] = part[i]; scores[#scores + 1] = part[i + 1] end
  finished = #ids < span
else
  -- Priorities: every level's ZSET is scanned and the members merged in ZSET order, up to
  -- the earliest last member of a level that has more past it (what lies beyond it there
  -- is not read yet). The levels share the span, at least one member each: read in full
  -- at each level, a page over a few dozen busy levels read and sorted a hundred
  -- thousand members, Redis blocked meanwhile. What a first even share leaves goes on
  -- reading the level whose last member read is the earliest (the one that cuts the page
  -- short), so that levels far apart in time still fill a page. A page may yet show fewer
  -- rows than its limit, with a cursor, as one for 'scheduled' does past reserved messages.
  local order = walk(lv)
  local each = math.max(1, math.floor(span / #order))
  local all, left = {}, span
  local read, tails = {}, {}  -- per level: members read; last one when it may have more
  local function extend(i, count)
    local part = scan(level_key(KEYS[1], order[i]), count, read[i])
    for j = 1, #part, 2 do all[#all + 1] = {part[j], tonumber(part[j + 1]), part[j + 1]} end
    read[i] = read[i] + #part / 2
    left = left - #part / 2
    tails[i] = false
    if #part == 2 * count then tails[i] = all[#all] end
  end
  local function earliest()  -- the level of the horizon: its last member read is earliest
    local best = nil
    for i = 1, #order do
      if tails[i] and (not best or before(tails[i], tails[best])) then best = i end
    end
    return best
  end
  for i = 1, #order do read[i] = 0; extend(i, each) end
  local h = earliest()
  while h and left > 0 do
    extend(h, left)
    h = earliest()
  end
  local horizon = h and tails[h] or nil
  table.sort(all, before)
  finished = horizon == nil
  for _, m in ipairs(all) do
    if horizon and before(horizon, m) then break end
    ids[#ids + 1] = m[1]; scores[#scores + 1] = m[3]
  end
end
local held = {}
if #ids > 0 then held = read_chunked('SMISMEMBER', KEYS[3], ids) end
local rows, last = {}, nil
local states = {}
for k = 1, #ids do
  local s
  if tonumber(scores[k]) <= now then s = 'ready'
  elseif held[k] == 1 then s = 'reserved'
  else s = 'scheduled' end
  if state == 'ready' and s ~= 'ready' then finished = true; break end
  last = k
  states[k] = s
  if s == 'ready' and held[k] == 1 then states[k] = 'lapsed' end  -- its try not counted yet
  if state == 'all' or s == state then rows[#rows + 1] = k end
  if #rows == limit then
    if k < #ids then finished = false end  -- stopped at the limit: more lie past it
    break
  end
end
local reply
if finished or last == nil then reply = {false, false}
else reply = {scores[last], ids[last]} end
if #rows > 0 then
  local sel = {}
  for _, k in ipairs(rows) do sel[#sel + 1] = ids[k] end
  local records = read_chunked('HMGET', KEYS[2], sel)
  for j, k in ipairs(rows) do
    for _, v in ipairs({ids[k], records[j], scores[k], states[k]}) do
      reply[#reply + 1] = v
    end
  end
end
return reply
"""

# KEYS: due msg held. ARGV: ids. Reply: per id, four values as in _PEEK, or four falses.
_LOCATE = """
local now = server_now()
local reply = {}
for _, id in ipairs(ARGV) do
  local _, score, rec = locate_one(id)
  if score then
    local s = 'scheduled'
    local held = redis.call('SISMEMBER', KEYS[3], id) == 1
    if tonumber(score) <= now then s = held and 'lapsed' or 'ready'
    elseif held then s = 'reserved' end
    for _, v in ipairs({id, rec or redis.call('HGET', KEYS[2], id), score, s}) do
      reply[#reply + 1] = v
    end
  else
    for _ = 1, 4 do reply[#reply + 1] = false end
  end
end
return reply
"""

# KEYS: due msg held aside. ARGV: reserve delay, then ids. Reply: per id, the tries its
# holder presents, or -1 when it is missing, under an active reservation or set aside by a
# cluster deadletter (see _AMEND: its holder's move would leave it in both queues).
_HOLD = """
local now = server_now()
local deadline = now + tonumber(ARGV[1])
local reply = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local key, score, rec = locate_one(id)
  local held = redis.call('SISMEMBER', KEYS[3], id) == 1
  local aside = redis.call('ZSCORE', KEYS[4], id)
  aside = aside and tonumber(aside) > now
  if not score or aside or (held and tonumber(score) > now) then
    reply[#reply + 1] = -1
  else
    rec = rec or redis.call('HGET', KEYS[2], id)
    local tries = tries_of(rec)
    redis.call('SREM', KEYS[3], id)  -- first, a write that cannot grow memory (prelude)
    if held then  -- an expired reservation: that delivery was a try
      tries = tries + 1
      redis.call('HSET', KEYS[2], id, with_tries(rec, tries))
    end
    redis.call('ZADD', key, deadline, id)
    redis.call('SADD', KEYS[3], id)
    reply[#reply + 1] = tries
  end
end
return reply
"""

# KEYS: due msg held. Reply: 1 while some of the earlier layout is left, else 0.
_UPGRADE = """
local _, left = take_over()
return left and 1 or 0
"""

PEEK, LOCATE, HOLD, UPGRADE = (
    Script(_PRELUDE + body) for body in (_PEEK, _LOCATE, _HOLD, _UPGRADE)
)

PEEK_BUDGET = 2000
"""Members a peek scans per call at most (a bounded script run): a larger page is handed
out in several calls."""


def _peeked_rows(values: list[Any]) -> list[Peeked | None]:
    """Four values per row as the peek / locate scripts reply them (id false: not there)."""
    rows: list[Peeked | None] = []
    for i in range(0, len(values), 4):
        message_id, rec, score, state = values[i : i + 4]
        if not message_id:
            rows.append(None)
            continue
        # 'lapsed': ready, its reservation expired; that delivery was a try its record
        # does not count yet, and its next delivery is given it
        lapsed = state == b"lapsed"
        stored = _unrecord_or_wrap(message_id, rec, score, 1 if lapsed else 0)
        rows.append(Peeked(stored, "ready" if lapsed else state.decode(), stored.mature))
    return rows


def _read_one(reply: list[Any]) -> tuple[list[Stored], float | None]:
    """A one-message get / reserve reply (see ``Store.one_take``): the next mature time
    as ``_fetched`` reads it, then the message's id, record, mature time and bump, if one
    was ready. A message taken comes with the head ``0`` (more look ready now): read
    without parsing it as a float (about 650 client instructions), the same time."""
    head = reply[0]
    if head == b"0":
        next_mature: float | None = time.time()
    else:
        next_mature = None if head is None else time.time() + float(head)
    if len(reply) == 5:
        _, message_id, rec, mature, bump = reply
        try:
            if rec[:4] == _PLAIN:  # ``_unrecord``'s common case, without its call
                one = Stored(message_id.decode(), rec[4:], EMPTY_HEADERS, bump, float(mature))
                return [one], next_mature
            return [_unrecord(message_id, rec, mature, bump)], next_mature
        except Exception:  # taken already: see _unrecord_all
            return [_unrecord_or_wrap(*reply[1:])], next_mature
    return [], next_mature


def _plain(e: Entry) -> bool:
    """A push the one-message insert script takes: new, without an id to deduplicate, of
    priority 0."""
    return not e.dedup and e.mature is None and not e.priority


def _is_one(reply: Any) -> bool:
    return bool(reply == 1)


class RedisOQVisibility:
    """peek / locate / hold of a redis-oq queue (mixed into :class:`RedisOQStore`)."""

    _keys: list[str]
    _aside_keys: list[str]
    _run: Any

    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        cursor = ("", "") if after is None else (repr(after[0]), after[1])
        limit = min(limit, PEEK_BUDGET)
        reply = await self._run(PEEK, self._keys, [state, *cursor, limit, PEEK_BUDGET])
        rows = [row for row in _peeked_rows(reply[2:]) if row is not None]
        head = None if reply[0] is None else (float(reply[0]), reply[1].decode())
        return PeekPage(rows, head)

    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        if not ids:
            return []
        return _peeked_rows(await self._run(LOCATE, self._keys, list(ids)))

    async def hold(self, ids: Sequence[str], reserve_delay: float) -> list[Held | None]:
        if not ids:
            return []
        reply = await self._run(HOLD, self._aside_keys, [reserve_delay, *ids])
        return [None if tries < 0 else Held(int(tries)) for tries in reply]


def _ranks(ids: list[str]) -> list[int] | None:
    """None when the ids never fall in the order the ZSET gives equal scores (the bytes of
    their UTF-8: Redis manual, "Sorted sets"), so that push order needs nothing more (a
    repeat, refused, is then next to its first); else each entry's rank in that order, from
    which the insert scripts keep push order (see STEP in their prelude). Python orders str
    by code point, which is the byte order of UTF-8, and ranks spare the script a string
    comparison (Lua's follows the server's locale). Sorting ids already in order is one
    comparison each in C, a seventh of a Python-level one per pair."""
    if ids == sorted(ids):
        return None
    ranks = [0] * len(ids)
    for rank, index in enumerate(sorted(range(len(ids)), key=ids.__getitem__)):
        ranks[index] = rank
    return ranks


class RedisOQStore(RedisOQVisibility, Store):
    batch_concurrency: ClassVar[int] = 4

    def __init__(self, name: str, options: QueueOptions, backend: RedisOQBackend) -> None:
        super().__init__(name, options)
        self.run_in_caller = self.uninterruptible = backend.has_fast_lane
        self._backend = backend
        self._keys = backend.queue_keys(name)
        self._insert_keys = [*self._keys, backend.key(name, "d")]
        self._aside_keys = [*self._keys, backend.key(name, "aside")]
        """What a cluster deadletter set aside reads too (see ``_ROLLBACK``, ``_AMEND``)."""
        self._new_keys = self._keys[:2]  # what the one-message insert touches
        self._dedup_window = options.dedup_window
        self._run = backend.run_script
        # The one-message calls of push, pop, reserve and ok, packed from a prefix
        bind = backend.bind_script
        self._insert_one = bind(INSERT_ONE, self._new_keys)
        self._get_one = bind(GET_ONE, self._keys)
        self._reserve_one = bind(RESERVE_ONE, self._keys)
        self._commit_one = bind(COMMIT_ONE, self._keys)
        self._deferring = Finishing()
        """Cluster deadletters past their set-aside: copying there, then dropping here."""

    def one_insert(self) -> OneInsert | None:
        if not self._backend.has_fast_lane:
            return None
        send = self._insert_one.send_now

        def insert(e: Entry) -> asyncio.Future[Any] | None:
            return send(e.id, record(e.payload, e.headers, e.tries), e.delay) if _plain(e) else None

        return insert, _is_one

    async def insert(self, entries: Sequence[Entry]) -> list[bool]:
        if len(entries) == 1:  # a push: checked first, it is the common call
            e = entries[0]
            if _plain(e):
                await self._insert_one(e.id, record(e.payload, e.headers, e.tries), e.delay)
                return [True]
        if (columns := bulk_columns(entries)) is not None:
            ids, payloads = columns
            headers, delay = bulk_head(entries)
            ranks = _ranks(ids)
            args: list[Any] = [self._dedup_window, delay, "" if ranks is None else 1]
            head = record(b"", headers)  # every record of the batch begins alike
            records = map(head.__add__, payloads)
            if ranks is None:
                args.extend(chain.from_iterable(zip(ids, records, strict=True)))
            else:
                args.extend(chain.from_iterable(zip(ids, records, ranks, strict=True)))
            refused = await self._run(INSERT_BULK, self._insert_keys, args)
            flags = [True] * len(ids)
            for k in refused:
                flags[k - 1] = False
            return flags
        return await self._insert(entries, check_all=False)

    async def _insert(self, entries: Sequence[Entry], *, check_all: bool) -> list[bool]:
        """``check_all``: refuse ids already queued even where the queue generated them."""
        ranks = _ranks([e.id for e in entries])
        args: list[Any] = [self._dedup_window, "" if ranks is None else 1]
        extend = args.extend
        for k, e in enumerate(entries):
            if e.dedup:
                check = "d"
            elif check_all or e.mature is not None:  # a put-back: its id may be back already
                check = "c"
            else:
                check = ""
            extend(
                (
                    e.id,
                    record(e.payload, e.headers, e.tries, e.priority),
                    e.delay,
                    "" if e.mature is None else e.mature,
                    check,
                    e.priority,
                )
            )
            if ranks is not None:
                args.append(ranks[k])
        flags = await self._run(INSERT, self._insert_keys, args)
        return [flag == 1 for flag in flags]

    async def get(self, n: int) -> Fetched:
        if n == 1:
            return _fetched(await self._get_one())
        return _fetched(await self._run(GET, self._keys, [n]))

    async def reserve(self, n: int, reserve_delay: float) -> Fetched:
        if n == 1:
            return _fetched(await self._reserve_one(reserve_delay))
        return _fetched(await self._run(RESERVE, self._keys, [n, reserve_delay]))

    def one_take(self, reserve_delay: float | None) -> OneTake | None:
        if not self._backend.has_fast_lane:
            return None
        if reserve_delay is None:
            return self._get_one.sender(), _read_one
        return self._reserve_one.sender(reserve_delay), _read_one

    def one_commit(self) -> OneCommit | None:
        if not self._backend.has_fast_lane:
            return None
        send = self._commit_one.send_now

        def commit(message_id: str, tries: int | None) -> asyncio.Future[Any] | None:
            return send(message_id, "" if tries is None else tries)

        return commit, _is_one

    async def commit(self, acks: Sequence[Ack]) -> list[bool]:
        if len(acks) == 1:
            ack = acks[0]
            guard = "" if ack.tries is None else ack.tries
            return [await self._commit_one(ack.id, guard) == 1]
        args: list[Any] = []
        for ack in acks:
            args.append(ack.id)
            args.append("" if ack.tries is None else ack.tries)
        flags = await self._run(COMMIT, self._keys, args)
        return [flag == 1 for flag in flags]

    async def extend(self, extends: Sequence[Extend]) -> list[bool]:
        """One script for the batch: a queue's keys share one hash slot (``{q}``), so on a
        cluster too it is one round trip to the node that owns the queue."""
        args: list[Any] = []
        for e in extends:
            args.extend((e.id, "" if e.tries is None else e.tries, e.seconds))
        flags = await self._run(EXTEND, self._keys, args)
        return [flag == 1 for flag in flags]

    async def rollback(
        self, nacks: Sequence[Nack], deadletter: DeadletterPlan | None
    ) -> list[KoResult]:
        keys = self._keys
        if deadletter is None:
            head: list[Any] = ["", 0, ""]
        else:
            mode = "move" if self._backend.one_slot else "defer"
            if mode == "move":
                keys = keys + self._backend.queue_keys(deadletter.queue)[:2]
            else:
                keys = self._aside_keys
            extra = deadletter.headers(0, time.time())
            del extra["x-dl-tries"]  # the script appends it, counted on the server
            head = [mode, deadletter.max_ko, orjson.dumps(extra)[1:-1]]
        args = head
        for nack in nacks:
            args.extend(
                (
                    nack.id,
                    "" if nack.tries is None else nack.tries,
                    nack.delay,
                    "1" if nack.count_try else "0",
                )
            )
        reply = await self._run(ROLLBACK, keys, args)
        flags = reply[: len(nacks)]
        if deadletter is not None and len(reply) > len(nacks):
            # cut between the copy and the drop (a close past its grace gives the ko up),
            # the message would be in both queues, back here once set aside no more
            await self._deferring.run(self._move_deferred(reply[len(nacks) :], deadletter.queue))
        return [KoResult.DEADLETTERED if f >= 2 else KoResult(f) for f in flags]

    async def _move_deferred(self, rows: list[Any], queue: str) -> None:
        """Cluster deadletter: insert into the other queue first, then delete here.

        An id already in the deadletter queue (from an earlier life) gets a suffix, as a
        single-node move does.
        """
        target = RedisOQStore(queue, self.options, self._backend)
        moved = [
            (rows[i].decode(), rows[i + 1], rows[i + 2], int(rows[i + 3]), int(rows[i + 4]))
            for i in range(0, len(rows), 5)
        ]
        pending, attempt = moved, 0
        while pending:
            entries = [
                Entry(
                    moved_id(m_id, deadletter_tag(tries), attempt),
                    payload,
                    headers,
                    priority=priority,
                )
                for m_id, payload, headers, tries, priority in pending
            ]
            flags = await target._insert(entries, check_all=True)  # fixed ids: look them up
            pending = [m for m, ok in zip(pending, flags, strict=True) if not ok]
            attempt += 1
        args: list[Any] = []
        for m_id, _, _, tries, _ in moved:
            args += (m_id, tries)
        await self._run(DROP_DEFERRED, self._aside_keys, args)

    async def close(self) -> None:
        """Let the cluster deadletters begun here end before the connection closes. Bounded
        (see ``Finishing``): one whose server does not answer may leave its message in both
        queues, as a crash between its steps would."""
        await self._deferring.wait(
            self.name,
            "deadletters given up between copy and drop: their messages come back here once"
            " set aside no more",
        )

    async def move(self, moves: Sequence[Move]) -> list[str | None]:
        if not self._backend.one_slot:
            raise NotSupportedError(
                "move on Redis Cluster needs both queues in one hash slot: connect with"
                " hash_tag=... to keep this factory's queues together"
            )
        keys = list(self._keys)
        destinations: dict[str, int] = {}
        args: list[Any] = []
        for move in moves:
            number = destinations.get(move.queue)
            if number is None:
                number = destinations[move.queue] = len(destinations) + 1
                keys.extend(self._backend.queue_keys(move.queue)[:2])
            args.extend(
                (
                    move.id,
                    "" if move.tries is None else move.tries,
                    number,
                    "0" if move.payload is None else "1",
                    b"" if move.payload is None else move.payload,
                    orjson.dumps(move.headers)[1:-1] if move.headers else "",
                    move.delay,
                    move.tag,
                )
            )
        reply = await self._run(MOVE, keys, args)
        return [new_id.decode() if new_id else None for new_id in reply]

    async def remove(self, ids: Sequence[str]) -> list[bool]:
        flags = await self._run(REMOVE, self._keys, list(ids))
        return [flag == 1 for flag in flags]

    async def amend(self, amends: Sequence[Amend]) -> list[bool]:
        """One script for the batch, on the server's clock (its TIME, as every script
        here). Amendable is what :meth:`remove` deletes: queued, and not under an active
        reservation; one whose reservation lapsed is waiting, and the amend ends that
        reservation, its delivery counted as a try (the tries a peek shows already)."""
        if not amends:
            return []
        args: list[Any] = []
        for a in amends:
            args.extend(
                (
                    a.id,
                    "" if a.delay is None else a.delay,
                    "" if a.priority is None else a.priority,
                    "1" if a.scheduled_only else "",
                )
            )
        flags = await self._run(AMEND, self._aside_keys, args)
        return [flag == 1 for flag in flags]

    async def sizes(self) -> Sizes:
        ready, total, reserved = await self._run(SIZES, self._keys, ())
        return Sizes(ready, total, total - ready - reserved, reserved)

    async def next_mature(self) -> float | None:
        head = await self._run(NEXT_MATURE, self._keys[:1], ())
        return None if head is None else float(head)


class RedisOQBackend(RedisBackend):
    name = "redis-oq"
    # An ok / ko / give-back's guard is "held, with the holder's tries", and a give-back
    # counts no try: run again once another consumer reserved the message, it passes.
    replay_hazard = GIVE_BACK_REPLAY
    capabilities: Capabilities = Capabilities(
        move=True, peek=True, hold=True, extend=True, priority=True, reschedule=True
    )

    def queue_keys(self, queue: str) -> list[str]:
        return [self.key(queue, part) for part in ("due", "msg", "held")]

    async def store(self, queue: str, options: QueueOptions) -> Store:
        keys = self.queue_keys(queue)
        while await self.run_script(UPGRADE, keys, ()):  # a queue of the earlier layout
            pass
        return RedisOQStore(queue, options, self)
