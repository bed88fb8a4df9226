"""A Spark streaming job moving a queue into Parquet files, at-least-once.

    .venv/bin/python examples/stream_to_parquet.py --backend redis-oq \\
        --url redis://127.0.0.1:6379/0 --out /tmp/orders-parquet --seconds 30
    .venv/bin/python examples/stream_to_parquet.py --backend postgres \\
        --url postgresql://postgres@127.0.0.1:5432/test --out /tmp/orders-parquet

The source reserves up to ``--batch`` messages per micro-batch on the driver and
acknowledges them only once the micro-batch is committed to the Parquet sink, extending
their reservations meanwhile (so a slow micro-batch does not let them lapse): a crash or a
stop loses nothing. A stop gives back what it held at once; a crash's reservations come back
after ``reserve_delay``; either way they are read again on restart from the same checkpoint.
Stop with Ctrl-C or after ``--seconds``; run it again to resume.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from aio_keuss import spark as keuss_spark


def main() -> None:
    parser = argparse.ArgumentParser(description="stream a queue into Parquet")
    parser.add_argument("--backend", default="redis-oq")
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--queue", default="orders")
    parser.add_argument("--out", default="/tmp/aio-keuss-parquet")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--trigger", default="2 seconds")
    parser.add_argument("--reserve-delay", type=float, default=120.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("aio-keuss-stream")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    keuss_spark.register(spark)

    messages = (
        spark.readStream.format("aio_keuss")
        .option("backend", args.backend)
        .option("url", args.url)
        .option("queue", args.queue)
        .option("reserve_delay", str(args.reserve_delay))
        .option("max_rows_per_batch", str(args.batch))
        .load()
    )
    orders = messages.select(
        "id",
        "tries",
        "mature",
        F.from_json("payload", "order_id string, customer long, amount double, tier string").alias(
            "order"
        ),
    ).select("id", "tries", "mature", "order.*")
    query = (
        orders.writeStream.format("parquet")
        .option("path", args.out)
        .option("checkpointLocation", args.checkpoint or args.out + "-checkpoint")
        .trigger(processingTime=args.trigger)
        .start()
    )
    try:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and query.isActive:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        query.stop()
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    print(f"moved {rows} messages into {args.out} (this run)")
    spark.stop()


if __name__ == "__main__":
    main()
