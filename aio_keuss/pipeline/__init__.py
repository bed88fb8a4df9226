"""Pipelines: stations that hand messages from queue to queue in one atomic step.

Keuss's "queues fit for ETL pipelines" (its pipeline articles and pl-mongo backend), on every
backend that can move a message between queues atomically (``capabilities.move``)::

    pipeline = (
        factory.pipeline("orders")
        .choice("incoming", ["valid", "rejected"], validate)
        .link("valid", "enriched", enrich)
        .sink("enriched", store)
    )
    async with pipeline.run(concurrency=8):
        ...
"""

from .builder import Pipeline, PipelineRun, check_pipeline_name
from .links import ChoiceLink, DirectLink, Link, Sink, StationSettings
from .steps import Drop, Forward, Step
from .topology import from_dict, load

__all__ = [
    "ChoiceLink",
    "DirectLink",
    "Drop",
    "Forward",
    "Link",
    "Pipeline",
    "PipelineRun",
    "Sink",
    "StationSettings",
    "Step",
    "check_pipeline_name",
    "from_dict",
    "load",
]
