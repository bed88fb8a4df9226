"""What a station's handler returns: where its message goes next.

A station reserves a message from its input queue, runs the handler, and settles the message
from the handler's answer in one atomic step (Keuss calls these "queues fit for ETL
pipelines": the hand-over to the next queue and the commit on the input cannot be torn
apart by a crash). An exception instead means "try again later": the message is ko-ed with
the consumer's backoff and deadlettered past ``max_ko``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from ..message import UNCHANGED, Headers, Payload, Unchanged


@dataclass(frozen=True, slots=True)
class Forward:
    """Hand the message to the next queue.

    ``to``: for a :class:`~aio_keuss.pipeline.ChoiceLink`, one of its destinations by name
    or by index; a :class:`~aio_keuss.pipeline.DirectLink` has one (``to`` may name it or be
    left out). ``payload`` replaces the message's payload when given; ``headers`` are merged
    into its own; ``delay`` makes it due that many seconds later in the next queue.
    """

    to: str | int | None = None
    payload: Payload | Unchanged = UNCHANGED
    headers: Headers | None = None
    delay: float = 0.0


class _Drop:
    """The message ends here: acknowledged, moved nowhere."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Drop"

    def __reduce__(self) -> str:
        return "Drop"


Drop: Final = _Drop()
"""Return this from a station to end the message's journey (it is acknowledged)."""

Step = Forward | _Drop
"""What a station's handler returns."""


@dataclass(frozen=True, slots=True)
class Settlement:
    """A handler's answer, checked against its station: move to ``destination`` (None: ok)."""

    destination: str | None
    payload: Payload | Unchanged = UNCHANGED
    headers: Headers | None = None
    delay: float = 0.0


ACKNOWLEDGE: Final = Settlement(None)


def describe(result: Any) -> str:
    """A short account of an unexpected result for an error message."""
    text = repr(result)
    return text if len(text) <= 80 else text[:77] + "..."
