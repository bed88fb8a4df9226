"""Option and argument validation, done once before anything reaches a store."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .errors import ConfigError, InvalidDelayError, InvalidQueueNameError

_QUEUE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}")


def check_queue_name(name: object) -> str:
    """Names become Redis key parts, SQL values and collection names: keep them plain."""
    if not isinstance(name, str) or not _QUEUE_NAME.fullmatch(name):
        raise InvalidQueueNameError(
            f"invalid queue name {name!r}: 1-128 characters of letters, digits and _ . : -,"
            " not starting with . : -"
        )
    return name


def check_seconds(value: object, what: str) -> float:
    """A delay or duration: a finite, non-negative number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidDelayError(f"{what} must be a number of seconds, not {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidDelayError(f"{what} must be finite and >= 0, not {value!r}")
    return seconds


def check_timeout(value: object) -> float | None:
    """``None`` means wait for ever (still polling behind the scenes)."""
    return None if value is None else check_seconds(value, "timeout")


@dataclass(frozen=True, slots=True)
class QueueOptions:
    """Per-queue behaviour; every field may also be given to ``connect`` as a default.

    reserve_delay: seconds a reservation lasts before the message is delivered again.
    poll_interval: longest a waiting consumer sleeps without a signal (lost-event bound).
    dedup_window: seconds an explicit message id keeps a second push with it out.
    max_batch: most items one coalesced round trip carries.
    """

    reserve_delay: float = 120.0
    poll_interval: float = 15.0
    dedup_window: float = 3600.0
    max_batch: int = 1000

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def updated(self, overrides: dict[str, Any]) -> QueueOptions:
        """Return a copy with ``overrides`` validated and applied."""
        known = {f.name for f in fields(QueueOptions)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"unknown queue option(s): {', '.join(sorted(unknown))}")
        checked: dict[str, Any] = {}
        for key, value in overrides.items():
            if key == "max_batch":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ConfigError(f"max_batch must be a positive int, not {value!r}")
                checked[key] = value
            else:
                try:
                    checked[key] = check_seconds(value, key)
                except InvalidDelayError as exc:
                    raise ConfigError(str(exc)) from exc
        if checked.get("poll_interval", self.poll_interval) <= 0:
            raise ConfigError("poll_interval must be > 0")
        return replace(self, **checked)


QUEUE_OPTION_NAMES = frozenset(f.name for f in fields(QueueOptions))


@dataclass(frozen=True, slots=True)
class DeadletterOptions:
    """A ko past ``max_ko`` kos moves the message to ``queue`` (in the same backend)."""

    max_ko: int
    queue: str = "__deadletter__"

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
        max_ko = value.get("max_ko")
        if isinstance(max_ko, bool) or not isinstance(max_ko, int) or max_ko < 0:
            raise ConfigError(f"deadletter max_ko must be an int >= 0, not {max_ko!r}")
        queue = value.get("queue", "__deadletter__")
        try:
            check_queue_name(queue)
        except InvalidQueueNameError as exc:
            raise ConfigError(str(exc)) from exc
        return cls(max_ko=max_ko, queue=queue)
