"""Option and argument validation, done once before anything reaches a store."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any, Self

from .errors import ConfigError, InvalidDelayError, InvalidQueueNameError

_QUEUE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}")
_CREDENTIALS = re.compile(r"//[^/?#]*@")
_QUERY_PASSWORD = re.compile(r"([?&](?:ssl)?password=)[^&#]*", re.IGNORECASE)

MAX_SECONDS = 1e9
"""Longest delay, timeout or duration accepted anywhere (about 31.7 years); see
:func:`check_seconds`."""
_MAX_WHOLE_SECONDS = int(MAX_SECONDS)
MAX_COUNT = 2**31 - 1
"""Largest count option (``max_batch``, deadletter ``max_ko``, ``failed_max``): counts meet
PostgreSQL ``integer`` columns and parameters, which hold up to 2**31 - 1."""


def brief(value: object) -> str:
    """``repr`` for error messages, short and safe: an int of more than 4,300 digits makes
    ``repr`` itself raise (Python's integer string conversion limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def without_password(url: str) -> str:
    """A connection URL fit for an error message: its password (``//user:secret@``, and a
    ``?password=`` or ``?sslpassword=`` query parameter, as PostgreSQL and Redis URLs take
    one) masked."""
    return _QUERY_PASSWORD.sub(r"\1***", _CREDENTIALS.sub("//***@", url, count=1))


def check_queue_name(name: object) -> str:
    """Names become Redis key parts, SQL values and collection names: keep them plain."""
    if not isinstance(name, str) or not _QUEUE_NAME.fullmatch(name):
        raise InvalidQueueNameError(
            f"invalid queue name {brief(name)}: 1-128 characters of letters, digits and _ . : -,"
            " not starting with . : -"
        )
    return name


def check_seconds(value: object, what: str) -> float:
    """A delay, timeout or duration: a number of seconds in [0, :data:`MAX_SECONDS`].

    The bound, 1e9 s (about 31.7 years), keeps every time a store computes from it (now +
    delay, a reservation deadline, a dedup expiry) well inside what each one holds: Python's
    ``datetime`` and MongoDB dates stop at year 9999, and redis-reliable hands Redis
    ``PX`` milliseconds through a Lua number, which Lua prints in exponent form once it is
    large (Lua 5.1's number format is ``%.14g``) and Redis then refuses as "not an integer":
    a ``dedup_window`` of 1e17 s made every push with an id fail. A longer delay would be
    stored and then break every later ``next_mature_t()``, so it is refused before anything
    is written. The comparison is exact for ints too big for a float (10**400 is refused,
    not an ``OverflowError``); NaN and infinities fail it as well.
    """
    # The usual cases first, by exact type: a float, or an int (``timeout=10``) compared
    # with an int bound. An int taken through the ``isinstance`` checks below and compared
    # with the float bound cost twice as many instructions (callgrind: some 1,300 more per
    # call, 2 % of all a pop's client work per message).
    if type(value) is float and 0.0 <= value <= MAX_SECONDS:
        return value
    if type(value) is int and 0 <= value <= _MAX_WHOLE_SECONDS:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidDelayError(f"{what} must be a number of seconds, not {brief(value)}")
    if not 0 <= value <= MAX_SECONDS:  # int or float compared exactly: no OverflowError
        raise InvalidDelayError(
            f"{what} must be a number of seconds in [0, {MAX_SECONDS:,.0f}], not {brief(value)}"
        )
    return float(value)


def check_count(value: object, what: str, least: int = 1) -> int:
    """A count option: an int (not a bool) in [``least``, :data:`MAX_COUNT`]."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_COUNT:
        raise ConfigError(f"{what} must be an int in [{least}, {MAX_COUNT}], not {brief(value)}")
    return value


def check_bool(value: object, what: str) -> bool:
    """A flag option: True or False, not a truthy stand-in (``"false"`` is truthy)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{what} must be a bool, not {brief(value)}")
    return value


def check_int(value: object, what: str, least: int, most: int) -> int:
    """An int option (not a bool) in [``least``, ``most``]."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ConfigError(f"{what} must be an int in [{least}, {most}], not {brief(value)}")
    return value


def check_str(value: object, what: str) -> str:
    """A non-empty str option."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} must be a non-empty str, not {brief(value)}")
    return value


def check_option_seconds(value: object, what: str) -> float:
    """A duration option: :func:`check_seconds`, refused as a ConfigError (a connect option,
    not a call's delay)."""
    try:
        return check_seconds(value, what)
    except InvalidDelayError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class BackendOptions:
    """The base of a backend's typed ``connect`` options.

    A subclass is a frozen dataclass: its fields are the option names with their defaults,
    and its ``__post_init__`` validates each with the checks above, so a bad value raises a
    ConfigError naming the option before anything connects. The backend class names it in
    ``options_type`` and reads ``self.config``; its ``options`` mapping (names and defaults,
    which the factory uses to refuse unknown names) comes from :meth:`defaults`.
    """

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Self:
        """Defaults overridden by ``raw``; an unknown name is a ConfigError."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**raw)

    @classmethod
    def parse_own(cls, raw: Mapping[str, Any]) -> Self:
        """Like :meth:`parse`, taking only this class's names from ``raw``: a backend's
        options mix those of its connection with those of its role (a bucket backend's
        bucket settings, say), each part checked by its own class."""
        names = {f.name for f in fields(cls)}
        return cls.parse({k: v for k, v in raw.items() if k in names})

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Option names and their defaults."""
        found: dict[str, Any] = {}
        for f in fields(cls):
            if f.default is not MISSING:
                found[f.name] = f.default
            elif f.default_factory is not MISSING:
                found[f.name] = f.default_factory()
        return found


def check_timeout(value: object) -> float | None:
    """``None`` means wait for ever (still polling behind the scenes)."""
    return None if value is None else check_seconds(value, "timeout")


@dataclass(frozen=True, slots=True)
class QueueOptions:
    """Per-queue behaviour; every field may also be given to ``connect`` as a default.

    reserve_delay: seconds a reservation lasts before the message is delivered again.
    poll_interval: longest a waiting consumer sleeps without a signal (lost-event bound).
    dedup_window: seconds an explicit message id keeps a second push with it out.
    max_batch: most items one coalesced round trip carries, and most one ``pop_many`` /
        ``reserve_many`` returns (IgnisMQ's maxBatchSize).
    max_wait_time: seconds ``pop_many`` / ``reserve_many`` (and ``consume(batch=...)``) go on
        gathering, once a first message is in, until the batch is full (IgnisMQ's
        maxWaitTime); 0 returns what is ready at once. Reservations are gathered for half
        of ``reserve_delay`` at most, so that none lapses before the batch is handed over.
    rate_limit: deliveries (pops and reservations) of the queue, counted over every process
        sharing the backend, per ``rate_period`` seconds (BullMQ's worker ``limiter``); 0, the
        default, for none. A token bucket (GCRA) on the backend's clock: a steady
        ``rate_limit`` per ``rate_period``, bursts of at most ``rate_burst`` (0: as many as
        ``rate_limit``; 1 spaces deliveries evenly).
    result_ttl: seconds what a handler returned (or why a message failed for good) is kept
        for ``Queue.result`` / ``Queue.push_and_wait`` (arq's ``Job.result``, BullMQ's
        ``returnvalue``); 0, the default, keeps none and costs nothing. Needs
        ``capabilities.results``.
    """

    reserve_delay: float = 120.0
    poll_interval: float = 15.0
    dedup_window: float = 3600.0
    max_batch: int = 1000
    max_wait_time: float = 0.0
    rate_limit: int = 0
    rate_period: float = 1.0
    rate_burst: int = 0
    result_ttl: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def updated(self, overrides: dict[str, Any]) -> QueueOptions:
        """Return a copy with ``overrides`` validated and applied."""
        known = {f.name for f in fields(QueueOptions)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"unknown queue option(s): {', '.join(sorted(map(str, unknown)))}")
        checked: dict[str, Any] = {}
        for key, value in overrides.items():
            if key == "max_batch":
                checked[key] = check_count(value, "max_batch")
            elif key in _RATE_COUNTS:
                checked[key] = check_count(value, key, least=0)
            else:
                try:
                    checked[key] = check_seconds(value, key)
                except InvalidDelayError as exc:
                    raise ConfigError(str(exc)) from exc
        if checked.get("poll_interval", self.poll_interval) <= 0:
            raise ConfigError("poll_interval must be > 0")
        if checked.get("rate_limit") == 0 and "rate_burst" not in checked:
            # a queue opting out of a connect default: the default's burst goes with it
            checked["rate_burst"] = 0
        made = replace(self, **checked)
        if made.rate_period <= 0:
            raise ConfigError("rate_period must be > 0")
        if made.rate_burst and not made.rate_limit:
            raise ConfigError("rate_burst needs a rate_limit")
        if made.rate_limit and made.rate_burst * made.rate_period > MAX_SECONDS * made.rate_limit:
            # the farthest a limiter's time runs ahead of now (a burst's worth of intervals):
            # kept within what every time of a store holds (see check_seconds)
            raise ConfigError(
                f"rate_burst * rate_period / rate_limit must be at most {MAX_SECONDS:,.0f} s"
            )
        return made


_RATE_COUNTS = frozenset({"rate_limit", "rate_burst"})


QUEUE_OPTION_NAMES = frozenset(f.name for f in fields(QueueOptions))


DEFAULT_DEADLETTER_QUEUE = "__deadletter__"


@dataclass(frozen=True, slots=True)
class DeadletterOptions:
    """A ko past ``max_ko`` kos moves the message to ``queue`` (in the same backend)."""

    max_ko: int
    queue: str = DEFAULT_DEADLETTER_QUEUE

    @classmethod
    def parse(cls, value: object) -> DeadletterOptions | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ConfigError(
                "deadletter must be a dict like {'max_ko': 3, 'queue': '__deadletter__'}"
            )
        unknown = set(value) - {"max_ko", "queue"}
        if unknown:
            raise ConfigError(f"unknown deadletter option(s): {', '.join(sorted(unknown))}")
        max_ko = check_count(value.get("max_ko"), "deadletter max_ko", least=0)
        queue = value.get("queue", DEFAULT_DEADLETTER_QUEUE)
        try:
            check_queue_name(queue)
        except InvalidQueueNameError as exc:
            raise ConfigError(str(exc)) from exc
        return cls(max_ko=max_ko, queue=queue)
