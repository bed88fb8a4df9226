"""A Spark job that generates orders, transforms them and pushes them into a queue.

    .venv/bin/python examples/spark_etl.py --backend redis-oq --url redis://127.0.0.1:6379/0
    .venv/bin/python examples/spark_etl.py --backend postgres \\
        --url postgresql://postgres@127.0.0.1:5432/test --rows 50000

Each row becomes one message (payload: the row as a dict), with its id taken from the
``order_id`` column: running the job twice within the queue's dedup window (one hour by
default) does not queue anything twice, and a retried Spark task never duplicates a row.
Then consume them with ``examples/consume_queue.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from aio_keuss import spark as keuss_spark


def main() -> None:
    parser = argparse.ArgumentParser(description="generate, transform, push into a queue")
    parser.add_argument("--backend", default="redis-oq")
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--queue", default="orders")
    parser.add_argument("--rows", type=int, default=10_000)
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("aio-keuss-etl")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    keuss_spark.register(spark)

    orders = spark.range(args.rows).select(
        F.concat(F.lit("order-"), F.col("id")).alias("order_id"),
        (F.col("id") % 97).alias("customer"),
        (F.rand(seed=7) * 100).alias("amount"),
    )
    enriched = (
        orders.where(F.col("amount") > 5)
        .withColumn("amount", F.round("amount", 2))
        .withColumn("tier", F.when(F.col("amount") > 80, "gold").otherwise("standard"))
    )
    (
        enriched.write.format("aio_keuss")
        .option("backend", args.backend)
        .option("url", args.url)
        .option("queue", args.queue)
        .option("id_column", "order_id")
        .mode("append")
        .save()
    )
    print(f"pushed {enriched.count()} orders into {args.queue!r} ({args.backend})")
    spark.stop()


if __name__ == "__main__":
    main()
