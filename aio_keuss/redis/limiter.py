"""A queue's rate limiter in Redis: ``contract.rate_step`` in one Lua script on one HASH.

The key, ``prefix:{queue}:rate``, carries the queue's hash tag like its other keys (so on a
cluster it lives on the queue's node), and holds ``t`` (GCRA's theoretical arrival time)
and ``u`` (held until), in epoch microseconds by the server's ``TIME`` (every client shares
one clock, whatever their own say), and ``r``, the count of takes refused
(``RateState.refused``). It expires once both are past
(a state then the same as none), so an idle queue's limiter leaves nothing behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..contract import RateGrant, RateRule
from .connection import Script

if TYPE_CHECKING:
    from .connection import RedisConnection


# KEYS: the limiter HASH. ARGV: interval (us), burst, count, hold (us), end (us: a
# give-back's, RateGrant.end). Returns {granted, wait (us), tat (us, as text), refused}. Times are
# integers of microseconds carried as Lua numbers (doubles: exact up to 2**53, centuries
# past now), written with %d: Lua's own tostring keeps 14 digits, and Redis turns a number
# a script returns into an integer, truncating it. First a write that
# cannot grow memory (HDEL): at maxmemory (noeviction) Redis refuses a script whose first
# write may, and consumers draining a full Redis must not be. The grant count follows
# rate_step exactly, the same slack included.
_TAKE = Script("""
redis.call('HDEL', KEYS[1], '')
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local count = tonumber(ARGV[3])
local hold = tonumber(ARGV[4])
local ends = tonumber(ARGV[5])
local state = redis.call('HMGET', KEYS[1], 't', 'u', 'r')
local tat = math.max(tonumber(state[1] or '0'), now)
local untl = tonumber(state[2] or '0')
local refused = tonumber(state[3] or '0')
if hold > 0 then untl = math.max(untl, now + hold) end
local granted = 0
if count > 0 and now >= untl then
  local due = math.floor((now + burst * interval - tat) / interval + 1e-6)
  granted = math.max(0, math.min(count, due))
  tat = tat + granted * interval
elseif count < 0 then
  tat = math.max(tat - math.min(-count * interval, math.max(0, ends - now)), now)
end
if granted < count then refused = refused + 1 end
local wait = math.max(0, untl - now, tat - (burst - 1) * interval - now)
tat = math.ceil(tat)
local last = math.max(tat, untl)
if last > now then
  redis.call('HSET', KEYS[1], 't', string.format('%d', tat),
    'u', string.format('%d', math.ceil(untl)), 'r', refused)
  redis.call('PEXPIRE', KEYS[1], math.ceil((last - now) / 1000) + 1000)
else
  redis.call('DEL', KEYS[1])
end
return {granted, math.ceil(wait), string.format('%d', tat), refused}
""")


async def rate_take(
    backend: RedisConnection, queue: str, rule: RateRule, count: int, hold: float, end: float
) -> RateGrant:
    """``Backend.rate_take`` on ``backend``'s Redis (see the module's docstring)."""
    interval = rule.interval * 1e6
    reply = await backend.run_script(
        _TAKE,
        [backend.key(queue, "rate")],
        [repr(interval), rule.burst, count, round(hold * 1e6), _END if end > _END else end * 1e6],
    )
    granted, wait, tat, refused = reply
    return RateGrant(int(granted), int(wait) / 1e6, int(tat) / 1e6, int(refused))


_END = 1e300
"""A give-back's end with none known (infinite): all of it ahead (Lua reads no 'inf')."""
