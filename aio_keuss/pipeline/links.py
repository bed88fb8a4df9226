"""Links: a station's input queue, its handler, and where the handler may send messages.

Three shapes, as in Keuss's pipelines: a :class:`DirectLink` forwards to one queue, a
:class:`ChoiceLink` to the one of several its handler picks, a :class:`Sink` ends the
journey. Each checks what its handler returned and turns it into a :class:`Settlement`,
raising :class:`~aio_keuss.errors.PipelineError` (naming the station) for anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..consumer import Handler
from ..errors import InvalidInputError, PipelineError
from ..options import check_queue_name
from .steps import ACKNOWLEDGE, Forward, Settlement, _Drop, describe


@dataclass(frozen=True, slots=True)
class StationSettings:
    """How a station consumes its input; None takes the pipeline run's value."""

    concurrency: int | None = None
    timeout: float | None = None
    prefetch: int | None = None
    retry_delay: float | None = None
    max_retry_delay: float | None = None

    def given(self) -> dict[str, Any]:
        return {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if getattr(self, name) is not None
        }


STATION_SETTINGS = frozenset(StationSettings.__dataclass_fields__)


def station_settings(
    settings: StationSettings | None, given: dict[str, Any], station: str
) -> StationSettings:
    """A station's settings: ``settings``, or the keywords ``given`` (those of the builder's
    ``link`` / ``choice`` / ``sink``, taken by the stations built by hand too), not both.
    Anything else is a :class:`PipelineError` naming the station, before anything is stored
    (a dict given as ``settings`` failed with an AttributeError once the run began)."""
    unknown = set(given) - STATION_SETTINGS
    if unknown:
        raise PipelineError(
            f"station {station!r}: unknown setting(s) {sorted(unknown)}; "
            f"known: {sorted(STATION_SETTINGS)}"
        )
    if settings is None:
        return StationSettings(**given)
    if not isinstance(settings, StationSettings):
        raise PipelineError(
            f"station {station!r}: settings must be a StationSettings, not {settings!r}"
        )
    if given:
        raise PipelineError(f"station {station!r}: settings given twice (settings= and {given})")
    return settings


@dataclass(frozen=True)
class Link:
    """A station: consumes ``source`` with ``handler``. ``name`` defaults to the source."""

    source: str
    handler: Handler
    destinations: tuple[str, ...] = ()
    name: str = ""
    settings: StationSettings = field(default_factory=StationSettings)
    handler_spec: str | None = None
    """``module:function`` when the handler was named that way (kept with the topology)."""

    kind = "link"

    def __post_init__(self) -> None:
        try:
            check_queue_name(self.source)
            for destination in self.destinations:
                check_queue_name(destination)
        except InvalidInputError as exc:
            raise PipelineError(f"station {self.name or self.source!r}: {exc}") from exc
        # None or "" is no name given; not any falsy name (0, [], False)
        if self.name is None or (isinstance(self.name, str) and not self.name):
            object.__setattr__(self, "name", self.source)
        if not isinstance(self.name, str) or not self.name.isprintable():
            # stored in the topology (a PostgreSQL jsonb refuses \u0000, a lone surrogate
            # is no JSON at all): refused here, as a pipeline's own name is
            raise PipelineError(
                f"a station name must be a str of printable characters, not {self.name!r}"
            )
        if not callable(self.handler):
            raise PipelineError(f"station {self.name!r}: handler must be callable")
        if not isinstance(self.settings, StationSettings):
            raise PipelineError(
                f"station {self.name!r}: settings must be a StationSettings, not {self.settings!r}"
            )
        spec = self.handler_spec
        if spec is not None and (not isinstance(spec, str) or not all(spec.partition(":")[::2])):
            # stored with the topology, which from_dict imports it from
            raise PipelineError(
                f"station {self.name!r}: handler_spec must be 'module:function', not {spec!r}"
            )
        if self.source in self.destinations:
            raise PipelineError(
                f"station {self.name!r}: {self.source!r} is its own input; "
                "a message that should come back is ko-ed, not forwarded"
            )
        if len(set(self.destinations)) != len(self.destinations):
            raise PipelineError(f"station {self.name!r}: a destination is named twice")

    def settle(self, result: Any) -> Settlement:
        """What to do with the message, from what the handler returned."""
        raise NotImplementedError

    def _refuse(self, result: Any, expected: str) -> PipelineError:
        return PipelineError(
            f"station {self.name!r}: its handler returned {describe(result)}; expected {expected}"
        )

    def _forward(self, step: Forward, destination: str) -> Settlement:
        return Settlement(destination, step.payload, step.headers, step.delay)


class DirectLink(Link):
    """``source`` -> ``destination``: the handler returns :class:`Forward` (``to`` left out
    or naming the destination) or :data:`Drop`. Settings as keywords (``concurrency=``...),
    as the builder's ``link`` takes them, or as ``settings``."""

    kind = "direct"

    def __init__(
        self,
        source: str,
        destination: str,
        handler: Handler,
        *,
        name: str = "",
        settings: StationSettings | None = None,
        handler_spec: str | None = None,
        **given: Any,
    ) -> None:
        settings = station_settings(settings, given, name or source)
        super().__init__(source, handler, (destination,), name, settings, handler_spec)

    def settle(self, result: Any) -> Settlement:
        if isinstance(result, _Drop):
            return ACKNOWLEDGE
        if isinstance(result, Forward):
            (destination,) = self.destinations
            to = result.to
            if to is None or to == destination or (type(to) is int and to == 0):
                return self._forward(result, destination)
            raise PipelineError(
                f"station {self.name!r}: forwarded to {result.to!r}, but it leads only to "
                f"{destination!r}"
            )
        raise self._refuse(result, "Forward(...) or Drop")


class ChoiceLink(Link):
    """``source`` -> one of ``destinations``: the handler returns ``Forward(to=...)`` naming
    one by name or index, or :data:`Drop`."""

    kind = "choice"

    def __init__(
        self,
        source: str,
        destinations: Sequence[str],
        handler: Handler,
        *,
        name: str = "",
        settings: StationSettings | None = None,
        handler_spec: str | None = None,
        **given: Any,
    ) -> None:
        if isinstance(destinations, str) or not destinations:
            raise PipelineError(
                f"station {name or source!r}: a choice takes a non-empty list of destinations"
            )
        super().__init__(
            source,
            handler,
            tuple(destinations),
            name,
            station_settings(settings, given, name or source),
            handler_spec,
        )

    def settle(self, result: Any) -> Settlement:
        if isinstance(result, _Drop):
            return ACKNOWLEDGE
        if not isinstance(result, Forward):
            raise self._refuse(result, "Forward(to=...) or Drop")
        to = result.to
        if isinstance(to, str) and to in self.destinations:
            return self._forward(result, to)
        if isinstance(to, int) and not isinstance(to, bool) and 0 <= to < len(self.destinations):
            return self._forward(result, self.destinations[to])
        raise PipelineError(
            f"station {self.name!r}: forwarded to {to!r}, which is not one of its "
            f"destinations {list(self.destinations)}"
        )


class Sink(Link):
    """``source`` -> nowhere: the message ends here once the handler returns (None or
    :data:`Drop`); it is acknowledged."""

    kind = "sink"

    def __init__(
        self,
        source: str,
        handler: Handler,
        *,
        name: str = "",
        settings: StationSettings | None = None,
        handler_spec: str | None = None,
        **given: Any,
    ) -> None:
        settings = station_settings(settings, given, name or source)
        super().__init__(source, handler, (), name, settings, handler_spec)

    def settle(self, result: Any) -> Settlement:
        if result is None or isinstance(result, _Drop):
            return ACKNOWLEDGE
        raise self._refuse(result, "None or Drop (a sink forwards nothing)")
