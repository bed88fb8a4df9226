"""bucket-redis: the bucket store (``bucket.py``) over Redis; this file holds only its atomic
bucket operations, each one Lua script (one round trip, atomic on the server).

Keys of a queue ``q`` (all tagged ``{q}``, so one cluster slot holds the whole queue):

- ``bz``: ZSET bucket id -> score (free: earliest mature time; leased: lease deadline).
- ``bb``: HASH bucket id -> message blob (written once).
- ``bs``: HASH bucket id -> slot state blob.
- ``bo``: HASH bucket id -> owner (lease token; ``""`` when free).
- ``br``: HASH bucket id -> remaining (slots not done).
- ``bn``: HASH bucket id -> the number of the last state write of its lease (see
  ``StateWrite.seq``); absent (0) while free and once leased, so it holds leased buckets
  only. A queue written by an earlier release has no such hash: every bucket reads 0.

Columns as hashes (rather than a hash per bucket) keep the key count flat and let a script
reach any bucket's field with one HGET. Times come from the caller (see ``bucket.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, ClassVar

from ..buckets.settings import bucket_backend_options
from ..buckets.storage import (
    BucketStorage,
    Census,
    Lease,
    LeasedBucket,
    NewBucket,
    Outcome,
    StateWrite,
)
from ..buckets.store import BucketBackend
from .backend import RedisBackend
from .connection import Script

# KEYS: bz, bb, bs, bo, br, bn. ARGV: (id, score, count, blob, state) per bucket. A bucket
# whose id is stored already is left as it is: a deadletter copy written again, or a retry
# (written over, a bucket leased meanwhile was freed under its holder).
_INSERT = Script("""
for i = 1, #ARGV, 5 do
  local id = ARGV[i]
  if redis.call('HEXISTS', KEYS[2], id) == 0 then
    redis.call('HSET', KEYS[2], id, ARGV[i + 3])
    redis.call('HSET', KEYS[3], id, ARGV[i + 4])
    redis.call('HSET', KEYS[4], id, '')
    redis.call('HSET', KEYS[5], id, ARGV[i + 2])
    redis.call('ZADD', KEYS[1], ARGV[i + 1], id)
  end
end
return #ARGV / 5
""")

# ARGV: token, now, deadline, want, max_buckets, n_ids, ids..., excluded ids... (never
# taken, nor the lowest score left: those the leasing store still has in memory).
# Returns {{id, blob, state, previous owner}, ...}, lowest score left (or nil).
_LEASE = Script("""
-- first, a write that cannot grow memory (no bucket id is ''): at maxmemory (noeviction)
-- Redis refuses a script whose first write may (HSET), and consumers must drain a full Redis
redis.call('HDEL', KEYS[4], '')
local token, now, deadline = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local want, max_buckets, n_ids = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local skip, n_skip = {}, 0
for i = 7 + n_ids, #ARGV do skip[ARGV[i]] = true; n_skip = n_skip + 1 end
local picked = {}
if n_ids > 0 then
  for i = 1, n_ids do
    local id = ARGV[6 + i]
    local score = redis.call('ZSCORE', KEYS[1], id)
    if score then
      local owner = redis.call('HGET', KEYS[4], id)
      if (not owner) or owner == '' or tonumber(score) <= now then
        picked[#picked + 1] = id
      end
    end
  end
else
  local candidates = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2],
                                'LIMIT', 0, max_buckets + n_skip)
  local total = 0
  for _, id in ipairs(candidates) do
    if #picked >= max_buckets or (total >= want and #picked > 0) then break end
    if not skip[id] then
      picked[#picked + 1] = id
      total = total + tonumber(redis.call('HGET', KEYS[5], id) or '0')
    end
  end
end
local out = {}
for _, id in ipairs(picked) do
  local owner = redis.call('HGET', KEYS[4], id) or ''
  redis.call('HSET', KEYS[4], id, token)
  redis.call('HDEL', KEYS[6], id)  -- this lease's writes count from 0
  redis.call('ZADD', KEYS[1], deadline, id)
  out[#out + 1] = {id, redis.call('HGET', KEYS[2], id), redis.call('HGET', KEYS[3], id), owner}
end
local first = redis.call('ZRANGE', KEYS[1], 0, n_skip, 'WITHSCORES')
for i = 1, #first, 2 do
  if not skip[first[i]] then return {out, first[i + 1]} end
end
return {out, false}
""")

# ARGV: (id, mode, score, remaining, state or '', owner, seq) per write. Mode k / r / d.
# Each applies only while the bucket's owner is still the token of the lease it was made
# under and its seq is past the stored one. Returns per write 1 (written, or this one was
# already: its seq is the stored one), 2 (superseded by a later write of the lease), 0 (lost).
_WRITE = Script("""
redis.call('HDEL', KEYS[4], '')  -- first, a write that cannot grow memory (see _LEASE)
local result = {}
for i = 1, #ARGV, 7 do
  local id, mode, seq = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 6])
  local stored = tonumber(redis.call('HGET', KEYS[6], id) or '0')
  if redis.call('HGET', KEYS[4], id) ~= ARGV[i + 5] then
    result[#result + 1] = 0
  elseif stored >= seq then
    result[#result + 1] = stored == seq and 1 or 2
  else
    if mode == 'd' then
      redis.call('ZREM', KEYS[1], id)
      redis.call('HDEL', KEYS[2], id)
      redis.call('HDEL', KEYS[3], id)
      redis.call('HDEL', KEYS[4], id)
      redis.call('HDEL', KEYS[5], id)
      redis.call('HDEL', KEYS[6], id)
    else
      if ARGV[i + 4] ~= '' then redis.call('HSET', KEYS[3], id, ARGV[i + 4]) end
      redis.call('HSET', KEYS[5], id, ARGV[i + 3])
      redis.call('ZADD', KEYS[1], ARGV[i + 2], id)
      if mode == 'r' then
        redis.call('HSET', KEYS[4], id, '')
        redis.call('HDEL', KEYS[6], id)  -- free: no write of any lease matches it now
      else
        redis.call('HSET', KEYS[6], id, ARGV[i + 6])
      end
    end
    result[#result + 1] = 1
  end
end
return result
""")

_OUTCOMES = {0: Outcome.LOST, 1: Outcome.WRITTEN, 2: Outcome.SUPERSEDED}

# ARGV: now, excluded ids... Returns {ready, scheduled, reserved, lowest score or nil}.
_CENSUS = Script("""
local now = tonumber(ARGV[1])
local skip = {}
for i = 2, #ARGV do skip[ARGV[i]] = true end
local all = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local ready, scheduled, reserved, low = 0, 0, 0, nil
for i = 1, #all, 2 do
  local id = all[i]
  if not skip[id] then
    local score = tonumber(all[i + 1])
    local remaining = tonumber(redis.call('HGET', KEYS[5], id) or '0')
    if score <= now then
      ready = ready + remaining
    elseif (redis.call('HGET', KEYS[4], id) or '') == '' then
      scheduled = scheduled + remaining
    else
      reserved = reserved + remaining
    end
    if low == nil or score < low then low = score end
  end
end
return {ready, scheduled, reserved, low and string.format('%.17g', low) or false}
""")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


class RedisBucketStorage(BucketStorage):
    def __init__(self, backend: RedisBackend) -> None:
        self._backend = backend

    @property
    def uninterruptible(self) -> bool:  # type: ignore[override]
        return self._backend.has_fast_lane

    def _keys(self, queue: str) -> list[str]:
        key = self._backend.key
        return [key(queue, part) for part in ("bz", "bb", "bs", "bo", "br", "bn")]

    async def insert_buckets(self, queue: str, buckets: Sequence[NewBucket]) -> None:
        args: list[Any] = []
        for b in buckets:
            args += [b.id, repr(b.score), b.count, b.blob, b.state]
        await self._backend.run_script(_INSERT, self._keys(queue), args)

    async def lease(
        self,
        queue: str,
        token: str,
        now: float,
        deadline: float,
        want: int,
        max_buckets: int,
        ids: Sequence[str] | None = None,
        exclude: Collection[str] = (),
    ) -> Lease:
        given = list(ids or ())
        args = [token, repr(now), repr(deadline), want, max_buckets, len(given), *given]
        args += exclude
        rows, low = await self._backend.run_script(_LEASE, self._keys(queue), args)
        buckets = [LeasedBucket(_text(r[0]), r[1], r[2], _text(r[3])) for r in rows]
        return Lease(buckets, _float(low))

    async def write(self, queue: str, writes: Sequence[StateWrite]) -> list[Outcome]:
        args: list[Any] = []
        for w in writes:
            args += [w.id, w.mode, repr(w.score), w.remaining, w.state or b"", w.owner, w.seq]
        codes = await self._backend.run_script(_WRITE, self._keys(queue), args)
        return [_OUTCOMES[int(c)] for c in codes]

    async def census(self, queue: str, exclude: Collection[str], now: float) -> Census:
        ready, scheduled, reserved, low = await self._backend.run_script(
            _CENSUS, self._keys(queue), [repr(now), *exclude]
        )
        return Census(int(ready), int(scheduled), int(reserved), _float(low))


class RedisBucketBackend(BucketBackend, RedisBackend):
    """``bucket-redis``: the Redis options (url, client, prefix, cluster) plus the bucket
    options of :data:`aio_keuss.buckets.settings.BUCKET_OPTIONS` (seconds)."""

    name = "bucket-redis"
    # Leases and state writes are fenced (a token per lease, a sequence number per write):
    # run again, a write is refused or finds itself done, and a lease takes only buckets
    # still free, which nobody then holds until it lapses. An insert leaves a bucket id
    # already stored as it is (a leased one is not freed under its holder), but one whose
    # messages were all acknowledged is deleted, and a push run again then writes it anew.
    replay_hazard = (
        "a push sent again after its messages were consumed and their bucket deleted "
        "writes them anew: they are delivered again"
    )
    options: ClassVar[dict[str, Any]] = bucket_backend_options(RedisBackend.options)

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.use_storage(RedisBucketStorage(self))
