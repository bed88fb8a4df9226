"""Spark integration: push partitions from executors, and the ``aio_keuss`` data source.

``push_partitions`` (for ``df.foreachPartition``) and ``register`` (the data source, for
``df.write.format("aio_keuss")`` and ``spark.readStream.format("aio_keuss")``) are all most
jobs need. Only :mod:`aio_keuss.spark.source` imports PySpark, and only when ``register`` is
called, so executors that merely push need PySpark no more than the driver gives them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .executor import (
    close_executor_factories,
    executor_factory,
    executor_queue,
    push_arrow_batches,
    push_partitions,
    push_rows,
)
from .spec import FORMAT, READ_OPTIONS, WRITE_OPTIONS, WriteSpec

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register(spark: SparkSession) -> None:
    """Make ``format("aio_keuss")`` known to this session (reads, writes, streams)."""
    from .source import KeussDataSource  # the only import of PySpark

    spark.dataSource.register(KeussDataSource)


__all__ = [
    "FORMAT",
    "READ_OPTIONS",
    "WRITE_OPTIONS",
    "WriteSpec",
    "close_executor_factories",
    "executor_factory",
    "executor_queue",
    "push_arrow_batches",
    "push_partitions",
    "push_rows",
    "register",
]
