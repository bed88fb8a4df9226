"""The Lua scripts of ``redis-sharded``: one per operation, each over the keys of one shard
(or of the queue's ready index), so each runs in one Redis Cluster hash slot.

Shard keys (hash tag ``{queue#shard}``), ``<base>`` being ``prefix:{queue#shard}:``::

    <base>m          HASH  l load pointer, f fire pointer, w sweep pointer, r fired and not
                           yet acknowledged, n swept ever, sl / sf sideline load / fire
                           pointers, v shoveled ever, e expired (message TTL) ever, q scheduled
                           ever (the next scheduled record's seq), b put back before the
                           fire pointer ever (a cancelled pop's records), c the sweep's
                           HSCAN cursor over ix
    <base>r:<ptr>    HASH  one record per message of the magazine: i id, p payload,
                           h headers, t tries, m mature, x reservation deadline once fired,
                           e end of life (message TTL; absent: none), o its place in the
                           shard's order when put back before the fire pointer (the
                           pointer it was loaded at; absent: <ptr>)
    <base>s:<ptr>    HASH  a record of the sideline magazine (swept, waiting for the shovel)
    <base>t:<n>      HASH  a record leaving its slot within one ROLLBACK (never left behind)
    <base>q:<seq>    HASH  a scheduled record (pushed or ko-ed with a delay, or set aside by
                           a ko past max_ko while its deadletter copy is written), not yet
                           loaded;
                           <seq> zero-padded to 20 digits (older records: unpadded)
    <base>z          ZSET  seq -> mature time of the scheduled records
    <base>ix         HASH  id -> pointer of its record ('s<ptr>' while sidelined, older
                           versions wrote 's', looked for in the sideline (see legacy);
                           'z<seq>' while scheduled). An entry whose record now has another
                           id, or none, is stale, and dropped where it is met: a push of its
                           id, a refused ok / ko, the sweep's look over a slice of the index
                           each step (see current)
    <base>d          ZSET  id -> end of its dedup window (explicit ids only)
    <base>k          ZSET  pointer -> deadline of the reservations the sweep stepped over
                           (within their deadline when it passed them), looked at again
                           once that deadline passes

Queue keys (hash tag ``{queue}``): ``meta`` HASH the metadata record, ``shards`` STRING its
shard count, kept past the record (see META), ``consumers`` ZSET consumer -> end of its lease,
``ready`` ZSET shard -> since when it has had records to fire (or, with only scheduled
records, when the first matures), ``stamps`` HASH shard -> the highest version a producer
announced there (what lets a consumer drop a shard it emptied without losing a producer's
announcement that raced with it). A shard's version is ``l + q + b``: it grows with every
load, every scheduled record and every put-back.

Scheduled records are loaded into the magazine when they mature, by the next fire on their
shard (up to 1,000 at a time): a magazine is FIFO, so a delay waits outside it.

Pointers are Lua numbers (doubles): exact up to 2**53, and printed without an exponent
below 1e14 records per shard.
"""

from __future__ import annotations

from ..message import RAW_HEADERS, UNDECODABLE
from ..sharded.storage import DEADLETTER_HOLD
from .connection import Script

_PRELUDE = (
    f"""
local UNDECODABLE, RAW_HEADERS = {UNDECODABLE!r}, {RAW_HEADERS!r}
"""
    + """
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.17g', x) end
-- At maxmemory with the noeviction policy Redis refuses a script whose first write is a
-- command that may grow memory (HSET, ZADD, HINCRBY, ...), and lets one that has written run
-- to its end (Redis manual, "Scripting with Lua": "maxmemory"). A fire, a ko, a sweep or a
-- shovel grows memory by a few bytes at most, and the oks that follow free the messages: so
-- those scripts begin with this, a write that cannot grow memory (HDEL of a field no shard
-- hash has), and consumers still fire, and drain, a Redis that is full. A push (INSERT) does
-- not: it is refused there.
local function first_write() redis.call('HDEL', KEYS[1], '') end
local function ptr(x) return string.format('%d', x) end
-- A number as the client reads it (Python's float), else false.
local function number(s)
  return s and string.match(s, '^%-?%d[%d.eE+-]*$') and tonumber(s) or false
end
-- A record past its end of life (message TTL) is deleted wherever a script meets it.
local function dead(e, now)
  e = number(e)
  return e and e <= now
end
local function drop(key, id)
  redis.call('DEL', key)
  redis.call('HDEL', KEYS[2], id)
end
-- An id its consumer can name (ok and ko refuse one that is not printable UTF-8 of 1 to
-- 1000 characters): printable ASCII, the usual case, told with one match; else strict
-- UTF-8 without the control characters and the no-break space a match can tell.
local function usable(id)
  if string.find(id, '^[!-~]+$') then return #id <= 1000 end
  local n, i, len = 0, 1, #id
  if len == 0 then return false end
  while i <= len do
    local c = string.byte(id, i)
    local k, lo, hi = 0, 0x80, 0xbf
    if c < 0x80 then
      if c <= 0x20 or c == 0x7f then return false end
    elseif c >= 0xc2 and c <= 0xdf then
      k = 1
      if c == 0xc2 then lo = 0xa1 end  -- U+0080 to U+00A0: C1 controls, no-break space
    elseif c >= 0xe0 and c <= 0xef then
      k = 2
      if c == 0xe0 then lo = 0xa0 elseif c == 0xed then hi = 0x9f end  -- overlong, surrogates
    elseif c >= 0xf0 and c <= 0xf4 then
      k = 3
      if c == 0xf0 then lo = 0x90 elseif c == 0xf4 then hi = 0x8f end  -- overlong, > U+10FFFF
    else
      return false
    end
    for j = 1, k do
      local d = string.byte(id, i + j)
      if not d or d < lo or d > hi then return false end
      lo, hi = 0x80, 0xbf
    end
    i, n = i + k + 1, n + 1
  end
  return n <= 1000
end
-- A new id for a record whose own cannot be named: in the queue's form (ending in
-- ~<shard>, so ok and ko find its shard), unique in the shard.
local function new_id(at)
  local shard = string.match(ARGV[1], '#(%d+)}:$')
  local stem = 'undecodable-' .. ptr(server_now() * 1000000) .. '-' .. at
  local id, k = stem .. '~' .. shard, 0
  while redis.call('HEXISTS', KEYS[2], id) == 1 do
    k = k + 1
    id = stem .. '-' .. k .. '~' .. shard
  end
  return id
end
-- A record's fields (HMGET ``...``). A key of another type there (another program's, or
-- corrupted) failed the script that read it, so every fetch of its shard, for ever: it is
-- ``adopt``ed first. The read is a pcall, not one more call: the usual record costs nothing.
local function adopt(key, lapsed)
  local kind, bytes, note = redis.call('TYPE', key)['ok'], nil, ''
  if kind == 'string' then
    bytes = redis.call('GET', key)
  else
    bytes, note = redis.call('DUMP', key), ' (its DUMP serialization)'
  end
  local at = string.sub(key, #ARGV[1] + 1)
  local place = string.sub(at, 3)
  local entry = ({r = place, s = 's' .. place, q = 'z' .. place})[string.sub(at, 1, 1)]
  local id = new_id(place)
  redis.call('DEL', key)
  redis.call('HSET', key, 'i', id, 'p', 'B' .. bytes, 't', '0', 'm', fmt(server_now()),
    'h', cjson.encode({[UNDECODABLE] = 'record: a ' .. kind .. ', not a hash' .. note}))
  if lapsed then redis.call('HSET', key, 'x', '0') end  -- held by no one: swept back
  if entry then redis.call('HSET', KEYS[2], id, entry) end
end
local function read(key, lapsed, ...)
  local rec = redis.pcall('HMGET', key, ...)
  if rec.err then
    adopt(key, lapsed)
    rec = redis.call('HMGET', key, ...)
  end
  return rec
end
-- A record's payload and headers fields, whole, as a payload of bytes (tag B) marked as the
-- client marks what it cannot read, its stored headers beside the mark.
local function whole(p, h, bad)
  local marks = {[UNDECODABLE] = 'record: ' .. bad}
  if h and h ~= '' and h ~= '{}' then marks[RAW_HEADERS] = h end
  return 'B' .. (p or ''), cjson.encode(marks)
end
-- A record (see the module docstring) read as FIRE reads it, {i, p, h, t, m, e, o}, when it
-- is not in our framing (another program's, or corrupted: a field missing, or not a number
-- where one belongs, or an id its consumer cannot name): the record ``framed`` makes of
-- it, which it becomes when a reserve fires it (``hold``), so it is the same on every
-- delivery and the other scripts meet only ours. Its payload and headers ``whole``; the
-- tries, mature time, end of life and place it still tells, else 0, now, none, unknown.
-- An id that is missing ('') or not ``usable`` is replaced by a ``new_id``, in the index
-- too: an id that is not UTF-8 failed the client's whole batch (for a pop, lost: its
-- records were deleted), and one its consumer cannot name could never be acknowledged.
-- Written while held, tries that cannot be read count as 0 (``tries_of``), an end of life
-- as none (``dead``) and a reservation deadline as passed (SWEEP).
local function tries_of(t) return t and string.match(t, '^%d+$') and tonumber(t) or 0 end
local function shown(id)
  return string.gsub(string.sub(id, 1, 100), '[^!-~]',
    function(c) return string.format('\\x%02x', string.byte(c)) end)
end
local function framed(rec, now, key, hold)
  local i, p, h, t, m, e, o = rec[1], rec[2], rec[3], rec[4], rec[5], rec[6], rec[7]
  if p and h and not e and not o and t and string.find(t, '^%d+$') and number(m)
      and string.find(i, '^[!-~]+$') and #i <= 1000 then
    return rec  -- ours, the usual case, told apart with the fewest string matches
  end
  local named = i ~= '' and usable(i)
  local tries, place = t and string.match(t, '^%d+$'), o and string.match(o, '^%-?%d+$')
  local bad = (i == '' and 'no id') or (not named and 'id not usable: ' .. shown(i))
    or (not p and 'no payload') or (not h and 'no headers')
    or (not tries and (t and 'tries not a number' or 'no tries'))
    or (not number(m) and (m and 'mature time not a number' or 'no mature time'))
    or (e and not number(e) and 'end of life not a number')
    or (o and not place and 'place not a number')
  if not bad then return rec end
  local payload, marks = whole(p, h, 'not in our framing (' .. bad .. ')')
  local out = {i, payload, marks, tries or '0', number(m) and m or fmt(now),
    number(e) and e or false, place or false}
  if not named then
    local at = string.sub(key, #ARGV[1] + 3)
    out[1] = new_id(at)
    if i ~= '' and redis.call('HGET', KEYS[2], i) == at then redis.call('HDEL', KEYS[2], i) end
    if hold then redis.call('HSET', key, 'i', out[1]); redis.call('HSET', KEYS[2], out[1], at) end
  end
  if hold then
    redis.call('HSET', key, 'p', out[2], 'h', out[3], 't', out[4], 'm', out[5])
    if e and not out[6] then redis.call('HDEL', key, 'e') end
    if o and not out[7] then redis.call('HDEL', key, 'o') end
  end
  return out
end
-- A record that lost its id where it waited (another program deleted the field): held, in
-- the sideline or in the schedule, the scripts moving it on (SWEEP, SHOVEL, promote) passed
-- it over, left there for ever. It is framed, as FIRE frames one, under a new id (its
-- index entry is set by the step moving it), and its id returned; false if ``key`` holds no
-- record. Its lost id's entry cannot be found from it: ``queued`` finds it stale.
local function renamed(key, now)
  if redis.call('EXISTS', key) == 0 then return false end
  local rec = redis.call('HMGET', key, 'i', 'p', 'h', 't', 'm', 'e', 'o')
  rec[1] = ''
  return framed(rec, now, key, true)[1]
end
local function meta(fields)
  local got = redis.call('HMGET', KEYS[1], unpack(fields))
  for k = 1, #got do got[k] = tonumber(got[k] or 0) end
  return got
end
-- Sideline records an older version's entry ('s', no pointer) is looked for among, from the
-- sideline's fire pointer, at most: the sideline is FIFO, so a record swept before this
-- version ran is among its first; past the bound the entry counts as queued until the
-- shovel has moved the sideline on.
local LEGACY_LOOK = 1000
-- Whether the entry 's' of ``id`` names a sideline record bearing that id. None there (it
-- lost its id and the shovel moved it on under a new one, ``renamed``): the entry is
-- stale, dropped. One whose record is there needs no rewrite: the shovel that moves the
-- record writes its entry anew.
local function legacy(base, id)
  local m = meta({'sl', 'sf'})
  local stop = math.min(m[1], m[2] + LEGACY_LOOK)
  for at = m[2], stop - 1 do
    if redis.pcall('HGET', base .. 's:' .. ptr(at), 'i') == id then return true end
  end
  if stop < m[1] then return true end
  redis.call('HDEL', KEYS[2], id)
  return false
end
-- Whether the index entry ``at`` of ``id`` is current: it names a record bearing that id. A
-- record renamed (see ``renamed``) leaves its lost id's entry behind, naming a record of
-- another id, and one deleted by another program (or evicted, or lost in a failover) an
-- entry naming none: such an entry is stale, and dropped wherever it is met (a push of its
-- id, a refused ok / ko, the sweep's look over the index), so the id can be pushed again
-- and the index does not keep it for ever. One naming a key of another type counts
-- (``adopt`` renames it when met).
-- The key of the record an index entry ``at`` (other than a legacy 's') names, and its
-- kind: 's' a slot of the ring, 'z' a scheduled record, else a record held aside.
local function entry_key(base, at)
  local kind, rest = string.sub(at, 1, 1), string.sub(at, 2)
  if kind == 's' then return base .. 's:' .. rest, kind end
  if kind == 'z' then return base .. 'q:' .. rest, kind end
  return base .. 'r:' .. at, kind
end
local function current(base, id, at)
  if at == 's' then return legacy(base, id) end
  local key = entry_key(base, at)
  local named = redis.pcall('HGET', key, 'i')
  if type(named) == 'table' and named.err or named == id then return true end
  redis.call('HDEL', KEYS[2], id)
  return false
end
-- Whether the record of ``id`` may still get a result, and so refuses a push of it (INSERT,
-- QUEUED): its index entry, if ``current``, but for a record past its end of life that no
-- one holds (not in the magazine with a reservation deadline, as COMMIT's guard reads it),
-- never to be delivered: for such a one, false and its entry (for ``bury``). An older
-- version's entry ('s', no pointer) counts as it stands, and so does a key of another type.
local function standing(base, id, now)
  local at = redis.call('HGET', KEYS[2], id)
  if not at or not current(base, id, at) then return false end
  if at == 's' then return true end
  local key, kind = entry_key(base, at)
  local rec = redis.pcall('HMGET', key, 'x', 'e')
  if rec.err or not dead(rec[2], now) then return true end
  if kind ~= 's' and kind ~= 'z' and rec[1] then return true end  -- held
  return false, at
end
-- Delete the record of ``id`` its entry ``at`` names, one ``standing`` found past its end of
-- life and held by no one, counted expired: in the step of the push taking its id, so that
-- nothing of it is left to fire, shovel or load, nor for a step meeting it later to drop the
-- new record's entry. A magazine or sideline slot is left empty, as an acknowledged one is
-- (the walks pass over it; counted as the dead record was until its pointer passes it).
local function bury(base, id, at)
  local key, kind = entry_key(base, at)
  redis.call('DEL', key)
  redis.call('HDEL', KEYS[2], id)
  if kind == 'z' then redis.call('ZREM', KEYS[4], string.sub(at, 2)) end
  redis.call('HINCRBY', KEYS[1], 'e', 1)
end
-- Put a record aside until ``due``: it waits in the shard's schedule (KEYS[4] = z).
-- Its name in the schedule is the sequence number zero-padded to a fixed width, so records
-- due at the same time load in the order they were scheduled (a ZSET orders equal scores
-- by member text: unpadded, 10 would come before 9). Names an older version wrote without
-- padding still load: the member is the key's suffix either way.
local function schedule(key, base, id, due)
  local q = tonumber(redis.call('HINCRBY', KEYS[1], 'q', 1)) - 1
  local name = string.format('%020d', q)
  redis.call('RENAME', key, base .. 'q:' .. name)
  redis.call('ZADD', KEYS[4], fmt(due), name)
  redis.call('HSET', KEYS[2], id, 'z' .. name)
  return 'z' .. name
end
-- Load the matured scheduled records (at most ``most``) at the load pointer. One past its
-- end of life is deleted instead, counted expired: loaded behind live records, it counted
-- as ready until the fire pointer reached it (FIRE and SIZES both promote).
local function promote(base, now, most)
  local due = redis.call('ZRANGE', KEYS[4], '-inf', fmt(now), 'BYSCORE', 'LIMIT', 0, most)
  if #due == 0 then return end
  local l = meta({'l'})[1]
  local expired = 0
  for _, q in ipairs(due) do
    local key = base .. 'q:' .. q
    local rec = read(key, false, 'i', 'e')
    local id = rec[1] or renamed(key, now)
    if id and rec[1] and dead(rec[2], now) then
      drop(key, id)
      expired = expired + 1
    elseif id then
      redis.call('RENAME', key, base .. 'r:' .. ptr(l))
      redis.call('HSET', KEYS[2], id, ptr(l))
      l = l + 1
    end
  end
  redis.call('ZREM', KEYS[4], unpack(due))
  redis.call('HSET', KEYS[1], 'l', ptr(l))
  if expired > 0 then redis.call('HINCRBY', KEYS[1], 'e', expired) end
end
-- The shard's version (see the module docstring) and its next mature time ('' = none).
local function version()
  local m = meta({'l', 'q', 'b'})
  return m[1] + m[2] + m[3]
end
local function next_due()
  local head = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
  return head[2] or ''
end
"""
)


# Put records back where they were fired from: a cancelled pop's put-backs (INSERT with
# front) and reservations released at no try (ROLLBACK). ``backs`` is a list of {id, place
# (its place in the shard's order; nil = unknown, before any other), land = a function
# writing the record at the key it is given}, out of the magazine. They go into the free
# slots just before the fire pointer, which moves back over them (the sweep pointer too, if
# past), the earliest places first (ties: the order given), in order of place with the
# put-backs already just past the fire pointer whose place is earlier, which move down
# (renamed in order: new slots never pass old ones, each lands on a free one). Each placed
# one gets its o (-1 for an unknown place, as memory keeps it) and index entry and is
# marked ``placed``; ``backs`` is left sorted by place. Returns how many were placed (0: no
# room, a reservation held just behind).
_PUT_BACK = """
local function put_back(base, backs)
  local m = meta({'l', 'f', 'w'})
  local l, f = m[1], m[2]
  local room = 0
  while room < #backs and f - room - 1 >= 0
      and redis.call('EXISTS', base .. 'r:' .. ptr(f - room - 1)) == 0 do
    room = room + 1
  end
  if room == 0 then return 0 end
  local function place_of(b) return b.place or -1 end
  for k, b in ipairs(backs) do b.n = k end
  table.sort(backs, function(a, b)
    local pa, pb = place_of(a), place_of(b)
    if pa ~= pb then return pa < pb end
    return a.n < b.n
  end)
  local top = place_of(backs[room])
  local ahead, at = {}, f
  while at < l do
    local rec = read(base .. 'r:' .. ptr(at), false, 'i', 'o')
    if not rec[1] then break end
    local place = tonumber(rec[2]) or at
    if place >= top then break end
    ahead[#ahead + 1] = {at, place, rec[1]}
    at = at + 1
  end
  local slot, a, c = f - room, 1, 1
  redis.call('HSET', KEYS[1], 'f', ptr(slot))
  if m[3] > slot then redis.call('HSET', KEYS[1], 'w', ptr(slot)) end
  redis.call('HINCRBY', KEYS[1], 'b', room)
  while a <= #ahead or c <= room do
    if c > room or (a <= #ahead and ahead[a][2] <= place_of(backs[c])) then
      local old = ahead[a]
      if old[1] ~= slot then
        redis.call('RENAME', base .. 'r:' .. ptr(old[1]), base .. 'r:' .. ptr(slot))
        redis.call('HSET', base .. 'r:' .. ptr(slot), 'o', ptr(old[2]))
        redis.call('HSET', KEYS[2], old[3], ptr(slot))
      end
      a = a + 1
    else
      local b, key = backs[c], base .. 'r:' .. ptr(slot)
      b.land(key)
      -- an unknown place is kept as -1 (before any), not left to default to the slot
      redis.call('HSET', key, 'o', ptr(place_of(b)))
      redis.call('HSET', KEYS[2], b.id, ptr(slot))
      b.placed = true
      c = c + 1
    end
    slot = slot + 1
  end
  return room
end
"""

# KEYS: m ix d z. ARGV: base, dedup window, message TTL ('' = none), front ('1': entries with
# a mature time are put-backs of a cancelled pop, loaded back where they were fired from by
# put_back; those with no room there, a held reservation just behind, go to the load
# pointer), then 9 per entry: id, payload, headers,
# tries, check ('' = an id the queue made: unique by construction; 'c' = refused while its
# id's record is ``standing``; 'd' = also refused within the dedup window), mature ('' =
# now), delay (seconds; > 0: scheduled), end of life ('' = now + TTL; a put-back keeps its
# own), place (a put-back's place in the shard's order as fired; '' = unknown, before any
# other). A record of the id past its end of life that no one holds refuses nothing by
# itself (a push goes in or not whether or not a step deleted it yet): an entry accepted
# over it deletes it here (``bury``).
# Reply: {version after, 1 if the caller must announce the shard (its magazine was empty and
# got a record: whoever loaded the first record of a non-empty one announced it already),
# earliest mature time scheduled by this call ('' = none), then 1 / 0 per entry}.
_INSERT = (
    _PUT_BACK
    + """
local base, window, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local front = ARGV[4] == '1'
local now = server_now()
local m = meta({'l', 'f', 'w'})
local l = m[1]
local out, purged, loaded, soonest = {0, 0, ''}, false, false, nil
local accepted, seen, backs = {}, {}, {}
local function write(key, i)
  local mature = ARGV[i + 5]
  if mature == '' then mature = fmt(now) end
  redis.call('HSET', key, 'i', ARGV[i], 'p', ARGV[i + 1], 'h', ARGV[i + 2], 't', ARGV[i + 3],
    'm', mature)
  if ARGV[i + 7] ~= '' then
    redis.call('HSET', key, 'e', ARGV[i + 7])
  elseif ttl then
    redis.call('HSET', key, 'e', fmt(now + ttl))
  end
end
for i = 5, #ARGV, 9 do
  local id, check = ARGV[i], ARGV[i + 4]
  local fresh, stands, dead_at = true, false, nil
  if check ~= '' then
    if not seen[id] then stands, dead_at = standing(base, id, now) end
    if seen[id] or stands then
      fresh = false
    elseif check == 'd' then
      if not purged then
        redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
        purged = true
      end
      fresh = not redis.call('ZSCORE', KEYS[3], id)
    end
  end
  if fresh then
    seen[id] = true
    if dead_at then bury(base, id, dead_at) end
    if check == 'd' then redis.call('ZADD', KEYS[3], fmt(now + window), id) end
    local one = {id = id, i = i}
    if front and ARGV[i + 5] ~= '' then
      one.place = tonumber(ARGV[i + 8])
      one.land = function(key) write(key, i) end
      backs[#backs + 1] = one
    end
    accepted[#accepted + 1] = one
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if #backs > 0 and put_back(base, backs) > 0 then loaded = true end
for _, one in ipairs(accepted) do
  if not one.placed then
    local i = one.i
    local key = base .. 'r:' .. ptr(l)
    write(key, i)
    local delay = tonumber(ARGV[i + 6])
    if delay > 0 then
      redis.call('HSET', key, 'm', fmt(now + delay))
      schedule(key, base, ARGV[i], now + delay)
      if not soonest or now + delay < soonest then soonest = now + delay end
    else
      redis.call('HSET', KEYS[2], ARGV[i], ptr(l))
      l = l + 1
      loaded = true
    end
  end
end
redis.call('HSET', KEYS[1], 'l', ptr(l))
out[1] = version()
if loaded and m[1] == m[2] then out[2] = 1 end
if soonest then out[3] = fmt(soonest) end
return out
"""
)

# KEYS: m ix - z. ARGV: base, n, reserve delay ('' = pop: the record is deleted as it is
# fired). Matured scheduled records are loaded first. Records past their end of life are
# deleted on the way (at most n + 1000 looked at).
# Reply: {left in the magazine, version, next mature scheduled ('' = none), then id p h t m
# e (end of life, nil = none) o (place in the shard's order) per message}.
_FIRE = """
local base, n, delay = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local now = server_now()
first_write()
promote(base, now, 1000)
local m = meta({'l', 'f', 'r', 'e'})
local l, f, r, expired = m[1], m[2], m[3], 0
local out = {0, 0, ''}
local taken, deadline, stop = 0, nil, math.min(l, f + n + 1000)
if delay ~= '' then deadline = fmt(now + tonumber(delay)) end
while taken < n and f < stop do
  local key = base .. 'r:' .. ptr(f)
  local rec = read(key, false, 'i', 'p', 'h', 't', 'm', 'e', 'o')
  -- a record without an id (not a slot left empty) is delivered under a new one (framed)
  if not rec[1] and redis.call('EXISTS', key) == 1 then rec[1] = '' end
  if rec[1] and dead(rec[6], now) then
    drop(key, rec[1])
    expired = expired + 1
  elseif rec[1] then
    rec = framed(rec, now, key, deadline)
    if deadline then
      redis.call('HSET', key, 'x', deadline)
      r = r + 1
    else
      redis.call('DEL', key)
      redis.call('HDEL', KEYS[2], rec[1])
    end
    for k = 1, 6 do out[#out + 1] = rec[k] end
    out[#out + 1] = rec[7] or ptr(f)
    taken = taken + 1
  end
  f = f + 1
end
if f > m[2] then redis.call('HSET', KEYS[1], 'f', ptr(f), 'r', ptr(r), 'e', ptr(m[4] + expired)) end
out[1] = l - f
out[2] = version()
out[3] = next_due()
return out
"""

# The guard every acknowledgement shares: the record of ``id`` if it was fired by a reserve
# and its tries are ``want`` ('' = any holder); else nil.
_HELD = """
local function held(base, id, want)
  local at = redis.call('HGET', KEYS[2], id)
  if not at then return nil end
  local kind = string.sub(at, 1, 1)
  if kind == 's' or kind == 'z' then
    current(base, id, at)  -- a stale entry met here is dropped
    return nil
  end
  local key = base .. 'r:' .. at
  -- another type there (see adopt): not held; a record of another id, or none: stale
  local rec = redis.pcall('HMGET', key, 'x', 't', 'i')
  if rec.err then return nil end
  if rec[3] ~= id then
    redis.call('HDEL', KEYS[2], id)
    return nil
  end
  if not rec[1] then return nil end
  if want ~= '' and tonumber(want) ~= tries_of(rec[2]) then return nil end
  return key, tries_of(rec[2])
end
"""

# KEYS: m ix. ARGV: base, then 2 per ack: id, tries ('' = unchecked). Reply: 1 / 0 per ack.
_COMMIT = (
    _HELD
    + """
local base = ARGV[1]
local out, done = {}, 0
for i = 2, #ARGV, 2 do
  local key = held(base, ARGV[i], ARGV[i + 1])
  if key then
    redis.call('DEL', key)
    redis.call('HDEL', KEYS[2], ARGV[i])
    done = done + 1
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if done > 0 then redis.call('HINCRBY', KEYS[1], 'r', -done) end
return out
"""
)

# KEYS: m ix - - k. ARGV: base, then 3 per extend: id, tries ('' = unchecked), seconds. Each
# record still held (the guard of COMMIT) gets the deadline now + seconds, nearer or later,
# and its note in k, if the sweep stepped over it, moves with it (ZADD XX: only an existing
# note): the walk never comes back to a record it passed, so a deadline brought nearer would
# otherwise be found only at the one noted first. It begins with a write that cannot grow
# memory (see ``first_write``): a long handler's consumer extends at maxmemory too.
# Reply: 1 / 0 per extend.
_EXTEND = (
    _HELD
    + """
local base = ARGV[1]
local now = server_now()
first_write()
local out = {}
for i = 2, #ARGV, 3 do
  local key = held(base, ARGV[i], ARGV[i + 1])
  if key then
    local deadline = fmt(now + tonumber(ARGV[i + 2]))
    redis.call('HSET', key, 'x', deadline)
    redis.call('ZADD', KEYS[5], 'XX', deadline, string.sub(key, #base + 3))
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
)

# KEYS: m ix - z k. ARGV: base, max_ko ('' = no deadletter), then 4 per nack: id, tries ('' =
# unchecked), count try ('1' / '0'), delay. A nack with a delay schedules the record. One
# without leaves its place and is loaded again at the load pointer (a new place), but for a
# release at no try (count try '0': its holder never saw it), which goes back to its place
# before the fire pointer as a cancelled pop's put-back does (see put_back); those with no
# room there go to the load pointer too, all in the nacks' order. Those leaving the magazine
# are first moved out of their slots, to <base>t:<n> (renamed away before the script ends),
# so each release finds its own slot free.
# A nack past max_ko sets the record aside for the client's deadletter copy: scheduled
# DEADLETTER_HOLD seconds later, its try counted, no longer held (see DROP_DOOMED).
# Reply: {version, 1 if something was reloaded, earliest mature scheduled ('' = none), then
# per nack 0 missing / 1 reloaded / 3 to deadletter (set aside), each 3 followed by its p,
# h, tries counted, index entry (z<seq>)}.
_ROLLBACK = (
    _HELD
    + _PUT_BACK
    + f"""
local DEADLETTER_HOLD = {DEADLETTER_HOLD!r}
"""
    + """
local base, max_ko = ARGV[1], tonumber(ARGV[2])
local now = server_now()
first_write()
local out, gone, soonest = {0, 0, ''}, 0, nil
local leaving, releases = {}, {}
for i = 3, #ARGV, 4 do
  local id = ARGV[i]
  local key, stored = held(base, id, ARGV[i + 1])
  if not key then
    out[#out + 1] = 0
  else
    local counted = ARGV[i + 2] == '1'
    local tries = stored
    if counted then tries = tries + 1 end
    if max_ko and counted and tries > max_ko then
      local rec = redis.call('HMGET', key, 'p', 'h')
      if not (rec[1] and rec[2]) then  -- deleted while held: the copy is the record whole
        local bad = rec[1] and 'no headers' or 'no payload'
        rec[1], rec[2] = whole(rec[1], rec[2], 'not in our framing (' .. bad .. ')')
      end
      -- Set aside while the client copies it into the deadletter queue: out of the
      -- magazine (held by no one, so a racing ok or ko of the same reservation finds
      -- nothing, and the sweep never meets it), its try counted, in the schedule until
      -- the hold ends; after a crash between the steps it comes back then, as a ko with
      -- that delay would.
      local due = now + DEADLETTER_HOLD
      redis.call('HDEL', key, 'x', 'o')
      redis.call('HSET', key, 't', tries, 'm', fmt(due))
      local aside = schedule(key, base, id, due)
      if not soonest or due < soonest then soonest = due end
      gone = gone + 1
      out[#out + 1] = 3
      out[#out + 1] = rec[1]; out[#out + 1] = rec[2]; out[#out + 1] = tries
      out[#out + 1] = aside
    else
      local delay = tonumber(ARGV[i + 3])
      redis.call('HSET', key, 't', tries)
      if delay > 0 then
        redis.call('HDEL', key, 'x', 'o')  -- scheduled: a new place when it loads
        redis.call('HSET', key, 'm', fmt(now + delay))
        schedule(key, base, id, now + delay)
        if not soonest or now + delay < soonest then soonest = now + delay end
      else
        local place = tonumber(redis.call('HGET', key, 'o') or string.sub(key, #base + 3))
        local temp = base .. 't:' .. ptr(#leaving)
        redis.call('RENAME', key, temp)
        redis.call('HDEL', temp, 'x')
        local one = {id = id, temp = temp}
        leaving[#leaving + 1] = one
        if not counted then
          one.place = place
          one.land = function(target) redis.call('RENAME', temp, target) end
          releases[#releases + 1] = one
        end
      end
      gone = gone + 1
      out[#out + 1] = 1
    end
  end
end
if #releases > 0 then put_back(base, releases) end
local l = meta({'l'})[1]
local back = 0
for _, one in ipairs(leaving) do
  if not one.placed then
    local target = base .. 'r:' .. ptr(l + back)
    redis.call('RENAME', one.temp, target)
    redis.call('HDEL', target, 'o')  -- reloaded at the back: a new place
    redis.call('HSET', KEYS[2], one.id, ptr(l + back))
    back = back + 1
  end
end
if back > 0 then redis.call('HSET', KEYS[1], 'l', ptr(l + back)) end
if gone > 0 then redis.call('HINCRBY', KEYS[1], 'r', -gone) end
out[1] = version()
if #leaving > 0 then out[2] = 1 end
if soonest then out[3] = fmt(soonest) end
return out
"""
)

# KEYS: m ix - z. ARGV: base, then 3 per record a ROLLBACK set aside: id, tries counted,
# index entry (z<seq>). The deadletter's last step, once the copies are in the deadletter
# queue: deletes each record still set aside as it was (its index entry and tries as given);
# one that came back meanwhile (matured and loaded, fired again) stays. Only deletes, so it
# needs no first_write. Reply: 1 / 0 per record.
_DROP_DOOMED = """
local base, out = ARGV[1], {}
for i = 2, #ARGV, 3 do
  local id, aside = ARGV[i], ARGV[i + 2]
  local name = string.sub(aside, 2)
  local key = base .. 'q:' .. name
  if string.sub(aside, 1, 1) == 'z' and redis.call('HGET', KEYS[2], id) == aside
      and tonumber(redis.pcall('HGET', key, 't')) == tonumber(ARGV[i + 1]) then
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[4], name)
    redis.call('HDEL', KEYS[2], id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# The magazine's head past its end of life: deleted and passed over, up to ``most`` records;
# returns the new fire pointer. Loads are in time order and a queue has one TTL, so expired
# records are at the head, but for those reloaded by a ko or the shovel (they keep the end
# of life of their push): such a record is deleted when it reaches the head or is fired.
_PURGE = """
local function purge(base, now, most)
  local m = meta({'l', 'f', 'e'})
  local l, f, stop = m[1], m[2], math.min(m[1], m[2] + most)
  local expired = 0
  while f < stop do
    local key = base .. 'r:' .. ptr(f)
    local rec = read(key, false, 'i', 'e')
    if rec[1] and not dead(rec[2], now) then break end
    if not rec[1] and redis.call('EXISTS', key) == 1 then break end  -- no id: FIRE's
    if rec[1] then
      drop(key, rec[1])
      expired = expired + 1
    end
    f = f + 1
  end
  if f > m[2] then redis.call('HSET', KEYS[1], 'f', ptr(f), 'e', ptr(m[3] + expired)) end
  return expired
end
"""

# KEYS: m ix - z. ARGV: base. Loads the matured scheduled records (deleting those past their
# end of life) and purges the expired head first, so expired messages (but those reloaded
# behind a live one, and scheduled ones not due yet) do not count. Reply: {ready (in the
# magazine, and scheduled but mature), fired and not acknowledged, sidelined, load pointer,
# swept ever, shoveled ever, sweep pointer, fire pointer, expired ever, scheduled (not
# mature yet), next mature scheduled ('' = none)}.
_SIZES = (
    _PURGE
    + """
local now = server_now()
first_write()
promote(ARGV[1], now, 1000)
purge(ARGV[1], now, 1000)
local m = meta({'l', 'f', 'r', 'sl', 'sf', 'n', 'v', 'w', 'e'})
local matured = redis.call('ZCOUNT', KEYS[4], '-inf', fmt(now))
local scheduled = redis.call('ZCARD', KEYS[4]) - matured
return {m[1] - m[2] + matured, m[3], m[4] - m[5], m[1], m[6], m[7], m[8], m[2], m[9],
  scheduled, next_due()}
"""
)

# KEYS: m ix - - k. ARGV: base, most records to look at. Reads, writes nothing: the
# earliest reservation deadline of the records fired past the sweep pointer (at most ``most``
# of them) and of those the sweep stepped over (k, in deadline order: EXTEND moves a note with
# its record's deadline, so the first entry still held is the earliest; at most ``most``
# entries looked at, an entry acknowledged since being passed over). A slot holding a key of
# another type counts as not held (FIRE adopts it). Reply: {1 if every reservation was
# looked at, earliest deadline ('' = none found)}.
_NEXT_DEADLINE = """
local base, most = ARGV[1], tonumber(ARGV[2])
local m = meta({'f', 'w'})
local f, w = m[1], m[2]
local function deadline(at)
  local x = redis.pcall('HGET', base .. 'r:' .. ptr(at), 'x')
  if type(x) ~= 'string' then return nil end
  return number(x) or nil
end
local best, whole = nil, 1
local stop = math.min(f, w + most)
if stop < f then whole = 0 end
for at = w, stop - 1 do
  local x = deadline(at)
  if x and (not best or x < best) then best = x end
end
local noted = redis.call('ZRANGE', KEYS[5], 0, most - 1)
local found = false
for _, at in ipairs(noted) do
  local slot = tonumber(at)
  local x = slot and slot < f and deadline(slot)
  if x then
    if not best or x < best then best = x end
    found = true
    break
  end
end
if not found and redis.call('ZCARD', KEYS[5]) > #noted then whole = 0 end
return {whole, best and fmt(best) or ''}
"""

# KEYS: m ix - z k. ARGV: base, most records to look at. First the reservations an earlier
# step stepped over (k) whose deadline has passed since: each still held there moves to the
# sideline (a slot holding a later reservation meanwhile, fired again after a release, is
# noted again with its new deadline). Then walks the fired region from the sweep pointer: an
# acknowledged record (gone) is passed over, one fired by a pop never exists, one whose
# reservation deadline passed moves to the sideline (its id marked 's', so its stale
# holder's ok / ko fail), and one still within its deadline is stepped over and noted in k
# (pointer -> deadline): the sweep pointer passes it, so however long it is held, the lapsed
# records behind it, a batch away or more, are swept. A record past its end of life is
# deleted rather than sidelined, and the magazine's expired head is purged, so the leader
# clears expired messages of idle queues too. Last, a slice of the id index is looked over
# for stale entries (see ``current``).
# Reply: {moved, records left to look at, left in the magazine, version, 1 if reservations
# within their deadline are noted in k, records in the sideline, next mature scheduled}.
_SWEEP = (
    _PURGE
    + """
local base, batch = ARGV[1], tonumber(ARGV[2])
local now = server_now()
first_write()
purge(base, now, batch)
local m = meta({'l', 'f', 'w', 'sl', 'r', 'n', 'e'})
local l, f, w, sl, r, n = m[1], m[2], m[3], m[4], m[5], m[6]
local moved, expired = 0, 0
local function lapse(key, id, e)
  if dead(e, now) then
    drop(key, id)
    expired = expired + 1
  else
    redis.call('RENAME', key, base .. 's:' .. ptr(sl))
    redis.call('HSET', KEYS[2], id, 's' .. ptr(sl))
    sl = sl + 1
    moved = moved + 1
  end
end
-- A record in the fired region (before the fire pointer) is held: one found there without
-- its id or its deadline (another program deleted the field) is taken as lapsed, under a new
-- id if it lost its own (``renamed``). A slot at or past the fire pointer holds a record put
-- back since it was noted, waiting to be fired: not held.
local function held_at(key, at)
  if at >= f then return nil end  -- not read: a key of another type is FIRE's to adopt
  local rec = read(key, true, 'i', 'x', 'e', 't', 'm')
  if rec[1] then return rec end
  -- No id: acknowledged (the slot is empty), or stripped of it. Each of our records has
  -- tries and a mature time, so one with none of the fields read counts as gone: the walk
  -- passes an acknowledged slot per message, and an EXISTS for each cost the leader a
  -- call a message.
  if rec[2] or rec[3] or rec[4] or rec[5] then rec[1] = renamed(key, now) end
  if rec[1] then return rec end
  return nil
end
for _, at in ipairs(redis.call('ZRANGE', KEYS[5], '-inf', fmt(now), 'BYSCORE', 'LIMIT', 0,
    batch)) do
  local key = base .. 'r:' .. at
  local rec = held_at(key, tonumber(at))
  if rec and (number(rec[2]) or 0) > now then  -- unreadable or missing: passed
    redis.call('ZADD', KEYS[5], rec[2], at)
  else
    if rec then lapse(key, rec[1], rec[3]) end
    redis.call('ZREM', KEYS[5], at)
  end
end
-- Deadlines need not rise in fire order (reserve_delay is each process's own): a record
-- still within its deadline is noted and stepped over, never stopped at.
local stop, at = math.min(f, w + batch), w
while at < stop do
  local key = base .. 'r:' .. ptr(at)
  local rec = held_at(key, at)
  if rec then
    if (number(rec[2]) or 0) > now then
      redis.call('ZADD', KEYS[5], rec[2], ptr(at))
    else
      lapse(key, rec[1], rec[3])
    end
  end
  at = at + 1
end
w = at
-- A slice of the id index (HSCAN from the cursor kept in m, about 100 entries; a small
-- index, kept as a listpack, is returned whole): its stale entries, which a push of their
-- id or an ok / ko would drop but whose id may never be named again, are dropped here, so
-- the index does not grow with them. One HGET per entry looked at; HSCAN returns every
-- entry present for a whole cycle at least once (Redis manual, SCAN: "Scan guarantees").
-- An older version's entry ('s') costs up to LEGACY_LOOK look-ups: one a step, at most (the
-- others wait for the next cycle, or a push of their id), so that a slice of them does not
-- hold Redis for a hundred times that.
local cursor = redis.call('HGET', KEYS[1], 'c') or '0'
local slice = redis.call('HSCAN', KEYS[2], cursor, 'COUNT', 100)
local legacies = 0
for k = 1, #slice[2], 2 do
  local at = slice[2][k + 1]
  if at ~= 's' then
    current(base, slice[2][k], at)
  elseif legacies == 0 then
    legacies = 1
    current(base, slice[2][k], at)
  end
end
if slice[1] ~= cursor then redis.call('HSET', KEYS[1], 'c', slice[1]) end
if w > m[3] or moved > 0 or expired > 0 then
  redis.call('HSET', KEYS[1], 'w', ptr(w), 'sl', ptr(sl), 'r', ptr(r - moved - expired),
    'n', ptr(n + moved), 'e', ptr(m[7] + expired))
end
local held = 0
if redis.call('EXISTS', KEYS[5]) == 1 then held = 1 end
return {moved, f - w, l - f, version(), held, sl - meta({'sf'})[1], next_due()}
"""
)

# KEYS: m ix - z. ARGV: base, most records to move. Moves sideline records back into the
# magazine at its load pointer, each with one more try (its delivery failed). The sideline
# and the magazine share the shard's hash slot, so the move is one atomic step.
# Reply: {moved, left in the sideline, version}.
_SHOVEL = """
local base, batch = ARGV[1], tonumber(ARGV[2])
local now = server_now()
first_write()
local m = meta({'l', 'sl', 'sf', 'v', 'e'})
local l, sl, sf, v = m[1], m[2], m[3], m[4]
local moved, expired = 0, 0
while sf < sl and moved + expired < batch do
  local key = base .. 's:' .. ptr(sf)
  local rec = read(key, false, 'i', 'e')
  local id = rec[1] or renamed(key, now)
  if id and dead(rec[2], now) then
    drop(key, id)
    expired = expired + 1
  elseif id then
    local target = base .. 'r:' .. ptr(l)
    redis.call('RENAME', key, target)
    redis.call('HDEL', target, 'x', 'o')
    redis.call('HSET', target, 't', tries_of(redis.call('HGET', target, 't')) + 1)
    redis.call('HSET', KEYS[2], id, ptr(l))
    l = l + 1
    moved = moved + 1
  end
  sf = sf + 1
end
if sf > m[3] then
  redis.call('HSET', KEYS[1], 'l', ptr(l), 'sf', ptr(sf), 'v', ptr(v + moved),
    'e', ptr(m[5] + expired))
end
return {moved + expired, sl - sf, version()}
"""

# KEYS: ready, stamps. ARGV: triples shard, version, due ('' = now). A producer's
# announcement: the shard has work from ``due`` on (a shard already due keeps its place).
# It begins with a write that cannot grow memory (see ``first_write`` in the prelude): a ko
# and the sweeper announce at maxmemory too, and a push announces only what it could load.
_READY_ADD = """
redis.call('HDEL', KEYS[2], '')
local t = redis.call('TIME')
local now = string.format('%.17g', tonumber(t[1]) + tonumber(t[2]) / 1000000)
for i = 1, #ARGV, 3 do
  local s, v = ARGV[i], tonumber(ARGV[i + 1])
  if v > tonumber(redis.call('HGET', KEYS[2], s) or -1) then
    redis.call('HSET', KEYS[2], s, ARGV[i + 1])
  end
  local due = ARGV[i + 2]
  if due == '' then due = now end
  redis.call('ZADD', KEYS[1], 'LT', due, s)
end
return 1
"""

# KEYS: ready, stamps. ARGV: triples shard, version seen, next mature scheduled ('' =
# none). A consumer's report of shards whose magazine it emptied: each leaves the index, or
# waits there for its next scheduled record, unless a producer announced a later version
# meanwhile. First a write that cannot grow memory (see ``first_write``).
_READY_DROP = """
redis.call('HDEL', KEYS[2], '')
local dropped = 0
for i = 1, #ARGV, 3 do
  local s = ARGV[i]
  if tonumber(redis.call('HGET', KEYS[2], s) or -1) <= tonumber(ARGV[i + 1]) then
    if ARGV[i + 2] == '' then
      dropped = dropped + redis.call('ZREM', KEYS[1], s)
    else
      redis.call('ZADD', KEYS[1], ARGV[i + 2], s)
    end
  end
end
return dropped
"""

# KEYS: ready. ARGV: none. Reply: {seconds from the server's now to the earliest due time
# ('' = empty index), then the shards due now (server clock)}. The earliest time goes to the
# wait loop, which sleeps on the client's clock: given from now, a client clock off the
# server's does not wake it that much early or late.
_READY_HEAD = """
local t = redis.call('TIME')
local seconds = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now = string.format('%.17g', seconds)
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local out = {head[2] and string.format('%.17g', tonumber(head[2]) - seconds) or ''}
for _, s in ipairs(redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE')) do
  out[#out + 1] = s
end
return out
"""

# KEYS: consumers. ARGV: token, lease ms, most consumers. Enrols (or renews) a consumer of
# the queue, after forgetting those whose lease ran out (processes that died). Reply: 1 when
# enrolled, 0 when the queue already has its most consumers.
_ENROL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1])
    and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# KEYS: lease. ARGV: token, lease ms. Renew the lease if we hold it, or take it if free.
# Reply: 1 when held by ``token`` after the call.
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('DEL', KEYS[1])  -- first, a write that cannot grow memory (see first_write)
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: token. Give the lease up on a clean close, so another takes over at once.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: queue meta, stamps, shards. ARGV: metadata TTL ms ('0' = none), then pairs field,
# value. Writes the record if there is none (its first writer's settings are the queue's),
# marks it active and seen now, and extends its life. The shard count is also kept apart
# (``shards``, no TTL): a record written again after it expired keeps the count the queue
# had if a producer ever loaded it (its data is in those shards, an explicit id's shard is
# crc32(id) % count), and at least every stamped shard's.
# Reply: the stored shards, message TTL ('' = none) and most consumers. It begins with a
# write that cannot grow memory (see ``first_write``): consumers renew it at maxmemory too.
_META = """
redis.call('HDEL', KEYS[1], '')
local t = redis.call('TIME')
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
  -- a queue opened again after it expired: its data stays in the shards it had (each one a
  -- producer ever loaded has a stamp), and routes by the count it had
  local most = tonumber(redis.call('HGET', KEYS[1], 'shards'))
  local stamped = redis.call('HKEYS', KEYS[2])
  if #stamped > 0 then most = tonumber(redis.call('GET', KEYS[3]) or most) end
  for _, s in ipairs(stamped) do
    if tonumber(s) + 1 > most then most = tonumber(s) + 1 end
  end
  redis.call('HSET', KEYS[1], 'shards', most)
end
redis.call('SET', KEYS[3], redis.call('HGET', KEYS[1], 'shards'))
redis.call('HSET', KEYS[1], 'active', 'true', 'seen', t[1])
if ARGV[1] ~= '0' then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return redis.call('HMGET', KEYS[1], 'shards', 'message_ttl', 'max_consumers')
"""

# KEYS: the sweeper's list of queues. ARGV: queue, shards. Lists the queue; first a write
# that cannot grow memory (see ``first_write``), so a consumer's renewal works at maxmemory.
_LIST = """
redis.call('HDEL', KEYS[1], '')
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# KEYS: m ix. ARGV: base, then the ids. Reply: 1 / 0 per id, whether it has a record in the
# shard a result may still come for, ``standing`` (as INSERT's duplicate check reads it; a
# stale entry met is dropped, as there): not one past its end of life that no one holds,
# never delivered (deleted where a step meets it, or by a push of its id).
_QUEUED = """
local base = ARGV[1]
local now = server_now()
local out = {}
for i = 2, #ARGV do
  out[#out + 1] = standing(base, ARGV[i], now) and 1 or 0
end
return out
"""

SHARD_SCRIPTS = tuple(
    Script(_PRELUDE + body)
    for body in (
        _INSERT,
        _FIRE,
        _COMMIT,
        _EXTEND,
        _ROLLBACK,
        _DROP_DOOMED,
        _SIZES,
        _NEXT_DEADLINE,
        _SWEEP,
        _SHOVEL,
        _QUEUED,
    )
)
"""The scripts that work on one shard (on a cluster, each guarded: see ``CLUSTER_GUARDED``)."""
(
    INSERT,
    FIRE,
    COMMIT,
    EXTEND,
    ROLLBACK,
    DROP_DOOMED,
    SIZES,
    NEXT_DEADLINE,
    SWEEP,
    SHOVEL,
    QUEUED,
) = SHARD_SCRIPTS
READY_ADD, READY_DROP, READY_HEAD, ENROL, LEASE, RELEASE, META, LIST = (
    Script(body)
    for body in (_READY_ADD, _READY_DROP, _READY_HEAD, _ENROL, _LEASE, _RELEASE, _META, _LIST)
)

# On Redis Cluster a shard script touches record keys it cannot declare (their pointers are
# found as it runs). While the shard's slot migrates, such a key may sit on the other node:
# on the migrating node the script then fails half-way (writes made before it stay), and on
# the importing node (reached by ASK) it reads the key as missing and takes the record for
# acknowledged. So on a cluster each shard script first checks that this node is neither
# migrating nor importing its slot (CLUSTER NODES marks them ``[slot->-`` / ``[slot-<-``)
# and, if it is, answers TRYAGAIN before anything is read or written: the client retries,
# as it does for a multi-key command during resharding.
_CLUSTER_GUARD = """
do
  local slot = redis.call('CLUSTER', 'KEYSLOT', KEYS[1])
  for line in string.gmatch(redis.call('CLUSTER', 'NODES'), '[^\\n]+') do
    if string.find(line, 'myself', 1, true) then
      if string.find(line, '[' .. slot .. '-', 1, true) then
        return redis.error_reply('TRYAGAIN hash slot ' .. slot .. ' is being migrated')
      end
      break
    end
  end
end
"""

CLUSTER_GUARDED: dict[Script, Script] = {
    script: Script(_CLUSTER_GUARD + script.text.decode()) for script in SHARD_SCRIPTS
}
"""The shard scripts as run on a Redis Cluster (see ``_CLUSTER_GUARD``)."""
