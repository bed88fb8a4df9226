"""Reading what the OpenTelemetry SDK collected, for the metrics tests."""

from __future__ import annotations

from typing import Any


def otel_points(reader: Any) -> dict[str, list[Any]]:
    """Data points of every instrument a reader collects now, by instrument name."""
    found: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def point(points: list[Any], **attributes: str) -> Any:
    """The data point with exactly these attributes."""
    for found in points:
        if dict(found.attributes) == attributes:
            return found
    raise AssertionError(f"no point with {attributes} in {points}")
