"""The bucket options (seconds, where Keuss used milliseconds), their checks, the engine's
constants, and bucket ids."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, InvalidDelayError
from ..options import check_seconds
from ..types import Capabilities

CAPABILITIES = Capabilities(idempotent=False, extend=True)
"""pop, reserve, delay, remove, reservation expiry and extension; no user-chosen
(idempotent) ids."""

BUCKET_OPTIONS: Mapping[str, Any] = {
    "bucket_max_size": 1024,
    "bucket_max_wait": 0.5,
    "state_flush_period": 0.5,
    "reject_delta_base": 10.0,
    "reject_delta_factor": None,
    "reject_timeout_grace": None,
    "ack_on_buffer": False,
}
"""Backend options of every bucket backend, in SECONDS (Keuss's are milliseconds).

- ``bucket_max_size``: most messages in one bucket (Keuss: 1024).
- ``bucket_max_wait``: longest a push bucket fills before it is written (Keuss: 500 ms).
- ``state_flush_period``: how often leased buckets' state is written (Keuss: 500 ms).
- ``reject_delta_base`` / ``reject_delta_factor``: retry delay ``base + factor * tries`` for a
  ko without a delay (Keuss: 10 s and reserve_delay, or 30 s). The queue layer currently
  always passes a delay (0.0 when the user gave none), so this applies only to a store call
  whose ``Nack.delay`` is None.
- ``reject_timeout_grace``: lease length; a dead holder's buckets come back after it
  (default reserve_delay * 0.8, at least ``MIN_GRACE``).
- ``ack_on_buffer``: acknowledge a push when buffered (Keuss's trade-off), not when durable.
"""

READY_KEY = -1
"""Push-bucket key of entries mature at insert time; delayed ones are keyed by 50 ms slot."""
DELAY_GRANULE = 0.05
MIN_GRACE = 0.1
IDLE_RELEASE = 5.0
"""Seconds a leased bucket with deliverable messages may sit unused before it is released
for other processes (a process that stopped consuming must not hold messages for ever)."""
COPY_RETRY_FIRST = 1.0
COPY_RETRY_MAX = 60.0
"""Seconds before a failed deadletter copy of a previous holder's move is tried again:
``COPY_RETRY_FIRST``, doubled at each failure up to ``COPY_RETRY_MAX``. Meanwhile the bucket
is kept or given back as it would be without that slot (its other messages stay deliverable,
here or elsewhere), and given back it is worth leasing again when the copy's next try is due
(not at once: every holder would lease it, fail and give it back in a loop)."""
LEASE_MAX_BUCKETS = 64
"""Most buckets one lease takes; it stops earlier once their messages cover the request."""
LEASE_AT_LEAST = 64
"""Messages a lease asks for even when the caller wants fewer: buckets written by a few
durable pushers hold a message or a handful each, and a lease round trip per handful would
halve the pop rate. Buckets held but unused go back after ``IDLE_RELEASE``."""
WRITE_MAX_BUCKETS = 16
"""Most push buckets in one insert round trip."""
PUSH_WRITERS = 4
"""Insert round trips in flight at once per store."""
PIPELINED_CALLS = 4
"""Calls of one kind in flight at once where they run in the caller's task."""
ACK_ON_BUFFER_RETRIES = 5
CLOSE_BOUND = 10.0
"""Seconds a store's close spends at most writing back (its buffer, its leased buckets).
On a server that stopped answering a write's reply never comes, and on Redis's own
connection a reply refuses cancellation until it gives up (10 s after it is cancelled): the
close, unbounded, never ended, not even once its queue's cancelled close had given up."""
BUFFERED_BUCKETS = 2 * PUSH_WRITERS
"""``ack_on_buffer``: full buckets' worth of acknowledged, unwritten messages beyond which a
push waits for a write (backpressure), so that the loss window of a crash stays about this
many buckets plus those filling (each written within ``bucket_max_wait``)."""
BUFFERED_AT_LEAST = PUSH_WRITERS * WRITE_MAX_BUCKETS
"""... and never fewer messages than this, so tiny buckets still share write round trips."""


@dataclass(frozen=True, slots=True)
class BucketSettings:
    bucket_max_size: int
    bucket_max_wait: float
    state_flush_period: float
    reject_delta_base: float
    reject_delta_factor: float | None
    reject_timeout_grace: float | None
    ack_on_buffer: bool

    @classmethod
    def parse(cls, settings: Mapping[str, Any]) -> BucketSettings:
        """Validate the bucket options of a backend's settings (ConfigError when bad)."""
        size = settings["bucket_max_size"]
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 65536:
            raise ConfigError(f"bucket_max_size must be an int in 1..65536, not {size!r}")
        ack = settings["ack_on_buffer"]
        if not isinstance(ack, bool):
            raise ConfigError(f"ack_on_buffer must be a bool, not {ack!r}")

        def seconds(key: str, optional: bool = False, positive: bool = False) -> Any:
            value = settings[key]
            if value is None and optional:
                return None
            try:
                checked = check_seconds(value, key)  # in [0, MAX_SECONDS], no OverflowError
            except InvalidDelayError as exc:
                raise ConfigError(str(exc)) from exc
            if positive and checked == 0:
                raise ConfigError(f"{key} must be > 0 seconds, not {value!r}")
            return checked

        return cls(
            bucket_max_size=size,
            bucket_max_wait=seconds("bucket_max_wait"),
            state_flush_period=seconds("state_flush_period", positive=True),
            reject_delta_base=seconds("reject_delta_base"),
            reject_delta_factor=seconds("reject_delta_factor", optional=True),
            reject_timeout_grace=seconds("reject_timeout_grace", optional=True),
            ack_on_buffer=ack,
        )


_bucket_prefix = os.urandom(4).hex()
_bucket_counter = 0


def _reseed_after_fork() -> None:
    global _bucket_prefix, _bucket_counter
    _bucket_prefix, _bucket_counter = os.urandom(4).hex(), 0


os.register_at_fork(after_in_child=_reseed_after_fork)


def new_bucket_id() -> str:
    """Time-ordered (so equal scores lease oldest first), unique across processes."""
    global _bucket_counter
    _bucket_counter += 1
    return f"{time.time_ns():016x}{_bucket_prefix}{_bucket_counter:x}"


def split_id(message_id: str) -> tuple[str, int] | None:
    """(bucket id, slot) of a message id, or None when it is not one of ours. The slot is
    as ours are written: ASCII digits, no leading zero. ``isdigit`` alone also takes other
    scripts' digits, which ``int`` reads (``-\u0663`` named slot 3, as ``-03`` did: an id
    nobody was given acknowledged a message), and superscripts, which it refuses (a
    ValueError out of ``ok``)."""
    bucket_id, dash, slot = message_id.rpartition("-")
    if not dash or not bucket_id or not slot.isascii() or not slot.isdigit():
        return None
    if len(slot) > 6 or (slot[0] == "0" and len(slot) > 1):
        return None
    return bucket_id, int(slot)


def bucket_backend_options(base: Mapping[str, Any], *, without: str = "") -> dict[str, Any]:
    """A database backend's options plus the bucket options, less one that buckets fix."""
    return {**{k: v for k, v in base.items() if k != without}, **BUCKET_OPTIONS}
