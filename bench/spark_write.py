"""Spark ``df.write.format("aio_keuss")`` throughput, rows/s, on ``local[2]``.

    .venv/bin/python -m bench.spark_write --backend redis-oq --rows 200000
    .venv/bin/python -m bench.spark_write --backend postgres --rows 100000
    .venv/bin/python -m bench.spark_write --backend redis-list --rows 200000  # not idempotent

The DataFrame is cached and counted first, and a warm-up write of 20,000 rows of the same
columns, cached too, starts the Python workers and lets the JVM compile the plan's code, so
the timed writes measure the data source and the backend, not Spark's start-up. ``--reps``
timed writes (3 by default), each into a queue of its own (the rows of earlier ones stay, as
in a queue that grows); prints each and the median: backend, rows, seconds, rows/s
(``--json``: one JSON record a line, ``run`` naming the rep or the median). ``--set
OPTION=VALUE`` passes a data source option (``--set write_mode=each``).

``--cpu`` adds, for each timed write, the CPU time (user + system, from ``/proc/<pid>/stat``,
see proc(5)) every process spent during it, per row, grouped as ``redis`` (the server:
also every other client's work on a shared one), ``java`` (Spark's JVM), ``python`` (Spark's
Python workers and daemons) and ``other`` (the rest of the machine): on a shared machine
rows/s wander, and this tells which of them ate the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

REDIS_URL = os.environ.get("AK_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("AK_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def backend_options(backend: str, token: str) -> dict[str, Any]:
    if "postgres" in backend:
        return {"url": POSTGRES_URL, "schema": f"bench_{token}"}
    return {"url": REDIS_URL, "prefix": f"bench-{token}"}


async def cleanup(backend: str, options: dict[str, Any]) -> None:
    if "postgres" in backend:
        import asyncpg

        connection = await asyncpg.connect(options["url"])
        try:
            await connection.execute(f'DROP SCHEMA IF EXISTS "{options["schema"]}" CASCADE')
        finally:
            await connection.close()
        return
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(options["url"])
    try:
        keys = [k async for k in client.scan_iter(match=options["prefix"] + ":*", count=1000)]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
    finally:
        await client.aclose()


def cpu_ticks() -> dict[int, tuple[int, str]]:
    """Every process's user + system clock ticks so far, and what it runs (Linux only)."""
    found: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = stat.read()
            with open(f"/proc/{name}/cmdline", "rb") as cmdline:
                command = cmdline.read(200).replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        rest = fields[fields.rindex(")") + 2 :].split()  # fields 3 on; utime, stime: 14, 15
        found[int(name)] = (int(rest[11]) + int(rest[12]), command)
    return found


def cpu_by_group(before: dict[int, tuple[int, str]], rows: int) -> dict[str, float]:
    """Microseconds of CPU a row since ``before``, by group (see the module's docstring)."""
    tick = os.sysconf("SC_CLK_TCK")
    groups: dict[str, float] = {"redis": 0.0, "java": 0.0, "python": 0.0, "other": 0.0}
    for pid, (ticks, command) in cpu_ticks().items():
        spent = ticks - before.get(pid, (0, ""))[0]
        if spent <= 0:
            continue
        if "redis-server" in command:
            group = "redis"
        elif "java" in command:
            group = "java"
        elif "pyspark" in command:
            group = "python"
        else:
            group = "other"
        groups[group] += spent / tick / rows * 1e6
    return {name: round(value, 2) for name, value in groups.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="redis-oq")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="CPU us a row, by process group")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="a data source option, e.g. --set write_mode=each",
    )
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from aio_keuss import spark as keuss_spark

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("aio-keuss-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    keuss_spark.register(spark)
    token = uuid.uuid4().hex[:10]
    options = backend_options(args.backend, token)
    extra = {"batch_size": args.batch_size}
    for setting in args.set:
        name, _, value = setting.partition("=")
        extra[name] = value
    if args.backend == "redis-list":
        extra["idempotent"] = "false"  # redis-list cannot deduplicate ids
    columns = ("id", "concat('name-', id) AS name", "id * 2 AS value")
    df = spark.range(args.rows, numPartitions=args.partitions).selectExpr(*columns).cache()
    df.count()

    def write(frame: Any, queue: str) -> float:
        writer = frame.write.format("aio_keuss").mode("append")
        for key, value in {"backend": args.backend, "queue": queue, **options, **extra}.items():
            writer = writer.option(key, str(value))
        started = time.perf_counter()
        writer.save()
        return time.perf_counter() - started

    def report(label: str, seconds: float, cpu: dict[str, float] | None = None) -> None:
        rate = args.rows / seconds
        if args.json:
            row = {"backend": args.backend, "rows": args.rows, "seconds": seconds}
            extra_fields = {} if cpu is None else {"cpu_us_per_row": cpu}
            print(json.dumps({**row, "rows_per_s": rate, "run": label, **extra_fields}))
        else:
            shares = (
                ""
                if cpu is None
                else "  CPU us/row " + " ".join(f"{name} {value}" for name, value in cpu.items())
            )
            print(
                f"{args.backend:<12} {label:<6} rows {args.rows:>8,}  {seconds:6.2f} s"
                f"  {rate:>10,.0f} rows/s{shares}",
                flush=True,
            )

    times: list[float] = []
    try:
        warmup = spark.range(20_000, numPartitions=args.partitions).selectExpr(*columns).cache()
        warmup.count()  # cached like the timed frame, so the warm-up runs the same plan
        write(warmup, "warmup")
        for rep in range(1, args.reps + 1):
            before = cpu_ticks() if args.cpu else {}
            times.append(write(df, f"bench{rep}"))
            report(f"rep {rep}", times[-1], cpu_by_group(before, args.rows) if args.cpu else None)
    finally:
        spark.stop()
        keuss_spark.close_executor_factories()
        asyncio.run(cleanup(args.backend, options))
    report("median", statistics.median(times))


if __name__ == "__main__":
    main()
