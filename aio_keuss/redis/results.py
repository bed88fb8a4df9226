"""Results in Redis: one STRING per result, ``prefix:{queue}:result:<id>``, that Redis
expires by itself (``SET ... PX``, Redis manual "SET").

The key carries the queue's hash tag like the queue's other keys, so every result of one
queue lives in one cluster hash slot: a put of many of them is one script (a Lua script's
keys must share a slot on a cluster, Redis Cluster specification "Hash tags") and a get
one MGET, on a single Redis and on a cluster alike. Queue names hold no braces (they are
checked), so the queue's part of the key ends at the first ``}`` and the id is all that
follows ``:result:``: no queue and id can make the key of another pair, whatever
characters the id holds (``q1`` + ``a:b`` is ``{q1}:result:a:b``, ``q1:a`` + ``b`` is
``{q1:a}:result:b``).

Expiry is Redis's, on its clock: an expired key is never returned, and its memory is
reclaimed by Redis's own expiry (on access and by its periodic sampling), so nothing here
sweeps. Errors leave as the rest of the package's do, through the connection's choke
point (:meth:`RedisConnection.execute`, :meth:`RedisConnection.run_script`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..options import check_queue_name
from ..results import ResultStore, space_queue
from .connection import Script

if TYPE_CHECKING:
    from .connection import RedisConnection


# KEYS: the results' keys. ARGV: milliseconds to keep them, then one body per key. A
# script is one command, so a batch is one round trip whichever client carries it; each
# SET writes its result whole.
_PUT = Script("""
local ms = ARGV[1]
for i = 1, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 1], 'PX', ms) end
return #KEYS
""")

# KEYS: the results' keys. ARGV: milliseconds to keep them, then per key the body it must
# hold and the body it then takes. Redis runs a script whole, nothing in between (Redis
# manual, "Scripting with Lua"): a compare-and-set. A missing key's GET is false, never
# equal to a body.
_REPLACE = Script("""
local ms = ARGV[1]
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[2 * i] then
    redis.call('SET', KEYS[i], ARGV[2 * i + 1], 'PX', ms)
  end
end
return #KEYS
""")


def milliseconds(ttl: float) -> int:
    """``ttl`` seconds as the whole milliseconds ``PX`` takes, rounded up (a result is
    kept at least as long as asked) and at least 1 (``PX 0`` is refused by Redis). An int,
    never a float: Redis refuses ``1e+12`` as "not an integer"."""
    return max(1, math.ceil(ttl * 1000))


class RedisResults(ResultStore):
    """Every Redis backend's result store, on the connection the backend shares."""

    def __init__(self, backend: RedisConnection) -> None:
        self._backend = backend

    def _keys(self, queue: str, ids: Sequence[str]) -> list[str]:
        check_queue_name(space_queue(queue))  # a queue's results, or its cancel requests
        head = self._backend.key(queue, "result") + ":"
        return [head + message_id for message_id in ids]

    async def put(self, queue: str, results: Sequence[tuple[str, bytes]], ttl: float) -> None:
        if not results:
            return
        ms = milliseconds(ttl)
        keys = self._keys(queue, [message_id for message_id, _ in results])
        if len(keys) == 1:  # one ok's result: a plain SET, no script to run
            await self._backend.execute("SET", keys[0], results[0][1], "PX", ms)
            return
        await self._backend.run_script(_PUT, keys, [ms, *(body for _, body in results)])

    async def replace(
        self, queue: str, swaps: Sequence[tuple[str, bytes, bytes]], ttl: float
    ) -> None:
        if not swaps:
            return
        keys = self._keys(queue, [message_id for message_id, _, _ in swaps])
        bodies = [body for _, old, new in swaps for body in (old, new)]
        await self._backend.run_script(_REPLACE, keys, [milliseconds(ttl), *bodies])

    async def get(self, queue: str, ids: Sequence[str]) -> list[bytes | None]:
        if not ids:
            return []
        found: list[bytes | None] = list(
            await self._backend.execute("MGET", *self._keys(queue, ids))
        )
        return found
