"""Checks on a pipeline's shape, made before any queue is opened.

Queues are the edges' ends: a station consumes one queue and may forward to others. A queue
no station consumes is an end of the pipeline (its messages wait there for whoever reads
them); a sink is an end too, and any station can end a message by returning ``Drop``, so a
cycle can be left (a retry loop through a "fix" station, say). Refused: two stations on one
input queue (they would compete for its messages), two stations of one name and, when the
pipeline is declared acyclic, any cycle.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import PipelineError
from .links import Link


def check(pipeline: str, links: Sequence[Link], acyclic: bool) -> None:
    """Raise :class:`PipelineError` naming the station when ``links`` cannot run."""
    if not links:
        raise PipelineError(f"pipeline {pipeline!r} has no stations")
    by_source: dict[str, Link] = {}
    names: set[str] = set()
    for link in links:
        if link.name in names:
            raise PipelineError(f"pipeline {pipeline!r}: two stations are named {link.name!r}")
        names.add(link.name)
        other = by_source.get(link.source)
        if other is not None:
            raise PipelineError(
                f"pipeline {pipeline!r}: stations {other.name!r} and {link.name!r} both "
                f"consume {link.source!r}"
            )
        by_source[link.source] = link
    if acyclic:
        _refuse_cycles(pipeline, by_source)


def _refuse_cycles(pipeline: str, by_source: dict[str, Link]) -> None:
    done: set[str] = set()
    for start in by_source:
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            queue, index = stack.pop()
            if index == 0:
                if queue in on_path:
                    looping = by_source[queue].name
                    raise PipelineError(
                        f"pipeline {pipeline!r} is declared acyclic, but station {looping!r} "
                        f"is on a cycle: {' -> '.join([*path[path.index(queue) :], queue])}"
                    )
                if queue in done or queue not in by_source:
                    continue
                path.append(queue)
                on_path.add(queue)
            destinations = by_source[queue].destinations
            if index < len(destinations):
                stack.append((queue, index + 1))
                stack.append((destinations[index], 0))
            else:
                path.pop()
                on_path.discard(queue)
                done.add(queue)
