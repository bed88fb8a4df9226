"""Spark on ``local[2,4]`` (two cores, up to four attempts per task) against real servers:
idempotent writes across task retries and stream replays, and a streaming read that loses
nothing across a stop and a restart from its checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import pickle
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from backends import CASES, REDIS_URL, BackendCase, _drop_redis_prefix, new_token

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark import TaskContext  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

import aio_keuss  # noqa: E402
from aio_keuss import spark as keuss_spark  # noqa: E402
from aio_keuss import sync  # noqa: E402

SPARK_IDS = ("redis-oq", "postgres")
# one worker of pytest-xdist runs them all, on one JVM started once
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("spark")]


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    if shutil.which("java") is None:
        pytest.skip("no java on PATH (tests/services.sh installs it)")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    # A SparkContext made in the main thread installs a SIGINT handler of its own (it cancels
    # Spark's jobs), and it stayed for every later test of this pytest worker: the sync
    # shim's Ctrl-C tests then saw no KeyboardInterrupt. Python's is put back below.
    sigint = signal.getsignal(signal.SIGINT)
    session = (
        SparkSession.builder.master("local[2,4]")
        .appName("aio-keuss-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.driver.memory", "1g")
        # The tests' jobs are short: the JVM's second JIT tier (C2) and its parallel GC
        # threads only compete with the jobs for the machine's two cores. C1 alone and the
        # serial GC start the session and the first job of each kind seconds sooner (120 s for
        # this file against 141 s, one core busy); Spark's semantics depend on neither.
        .config(
            "spark.driver.extraJavaOptions",
            "-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:+UseSerialGC",
        )
        .getOrCreate()
    )
    signal.signal(signal.SIGINT, sigint)
    session.sparkContext.setLogLevel("ERROR")
    keuss_spark.register(session)
    yield session
    session.stop()
    keuss_spark.close_executor_factories()


@pytest.fixture(params=[c for c in CASES if c.id in SPARK_IDS], ids=lambda c: c.id)
def target(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    case: BackendCase = request.param
    reason = case.available()
    if reason:
        pytest.skip(reason)
    opts = case.options(new_token())
    yield case.name, opts
    keuss_spark.close_executor_factories()
    if case.cleanup is not None:
        asyncio.run(case.cleanup(opts))


def _writer(df: Any, backend: str, opts: dict[str, Any], queue: str, **extra: Any) -> Any:
    writer = df.write.format("aio_keuss").mode("append")
    for key, value in {"backend": backend, "queue": queue, **opts, **extra}.items():
        writer = writer.option(key, str(value))
    return writer


def _drain(backend: str, opts: dict[str, Any], queue: str) -> list[Any]:
    """Every payload in ``queue``, popped."""
    payloads: list[Any] = []
    with sync.connect(backend, **opts) as factory:
        q = factory.queue(queue)
        while True:
            got = q.pop_many(1000, timeout=0)
            if not got:
                break
            payloads.extend(m.payload for m in got)
        assert q.total_size() == 0
    return payloads


def test_df_write_100k_rows_arrive_exactly_once(
    spark: SparkSession, target: tuple[str, dict[str, Any]]
) -> None:
    backend, opts = target
    rows = 100_000
    df = spark.range(rows, numPartitions=4).selectExpr("id", "concat('row-', id) AS name")
    started = time.perf_counter()
    _writer(df, backend, opts, "bulk").save()
    elapsed = time.perf_counter() - started
    payloads = _drain(backend, opts, "bulk")
    assert len(payloads) == rows
    assert {p["id"] for p in payloads} == set(range(rows))
    assert payloads[0]["name"] == f"row-{payloads[0]['id']}"
    print(f"\n{backend}: df.write {rows} rows in {elapsed:.2f}s = {rows / elapsed:,.0f} rows/s")


def test_retried_task_pushes_each_row_once(
    spark: SparkSession, target: tuple[str, dict[str, Any]]
) -> None:
    """The first attempt of every task pushes half its rows, then fails; Spark retries it
    (local[2,4]) and the retry's pushes of the same rows are deduplicated by id."""
    backend, opts = target
    per_partition, partitions = 1000, 4
    push = keuss_spark.push_partitions(backend, "retried", batch_size=100, **opts)

    def failing_first_attempt(rows: Iterator[Any]) -> None:
        context = TaskContext.get()
        assert context is not None
        first = context.attemptNumber() == 0

        def rows_then_crash() -> Iterator[Any]:
            for index, row in enumerate(rows):
                if first and index == per_partition // 2:
                    raise RuntimeError("first attempt dies half way")
                yield row

        push(rows_then_crash())

    df = spark.range(per_partition * partitions, numPartitions=partitions)
    df.foreachPartition(failing_first_attempt)
    payloads = _drain(backend, opts, "retried")
    assert sorted(p["id"] for p in payloads) == list(range(per_partition * partitions))

    # The data source path too: a JSON payload column, ids from a column.
    json_df = spark.range(2000, numPartitions=2).selectExpr(
        "concat('k-', id) AS key", "to_json(named_struct('n', id)) AS body"
    )
    for _ in range(2):  # the whole job twice: same ids, no second copy
        _writer(json_df, backend, opts, "keyed", payload_column="body", id_column="key").save()
    payloads = _drain(backend, opts, "keyed")
    assert sorted(p["n"] for p in payloads) == list(range(2000))


def test_rerun_of_a_job_with_batches_in_flight_pushes_each_row_once(
    spark: SparkSession, target: tuple[str, dict[str, Any]]
) -> None:
    """Small batches keep several pushes of a task on the wire at once; a timestamp column
    sends each batch back once to be made plain. Run twice with one job_key: same ids, so
    the second run adds nothing, and every row of the first is there once."""
    backend, opts = target
    rows = 3000
    df = spark.range(rows, numPartitions=3).selectExpr(
        "id", "timestamp_seconds(id) AS at", "concat('r-', id) AS name"
    )
    for _ in range(2):
        _writer(df, backend, opts, "rerun", batch_size=100, job_key="job-7").save()
    payloads = _drain(backend, opts, "rerun")
    assert sorted(p["id"] for p in payloads) == list(range(rows))
    assert all(p["name"] == f"r-{p['id']}" and isinstance(p["at"], str) for p in payloads)


def test_arrow_batches_of_any_size_are_pushed_once(target: tuple[str, dict[str, Any]]) -> None:
    """The executor's path without Spark: record batches of odd sizes are regrouped into
    pushes of ``batch_size``, row indexes (and so ids) run on across them, and pushing the
    same batches again with the same id base adds nothing."""
    import pyarrow as pa

    backend, opts = target
    sizes = [7, 250, 1, 0, 742, 100]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    batches = [
        pa.RecordBatch.from_pydict({"n": list(range(start, start + size))})
        for start, size in zip(starts, sizes, strict=True)
    ]
    spec = keuss_spark.WriteSpec(backend=backend, queue="arrow", options=opts, batch_size=100)
    for _ in range(2):
        assert keuss_spark.push_arrow_batches(spec, batches, "job:0") == sum(sizes)
    payloads = _drain(backend, opts, "arrow")
    assert sorted(p["n"] for p in payloads) == list(range(sum(sizes)))


def test_maps_arrive_as_objects_even_empty_and_per_message_rows_once(
    target: tuple[str, dict[str, Any]],
) -> None:
    """Arrow gives a map as a list of pairs: an empty one arrived as a JSON array (a batch
    of only empty maps too). And with a headers column, rows pushed one by one were pushed
    again, made plain, when one of the batch needed it (a timestamp): without idempotent
    ids some arrived twice. The executor's path, without Spark."""
    import datetime as dt

    import pyarrow as pa

    backend, opts = target
    kind = pa.map_(pa.string(), pa.int64())
    batches = [
        pa.RecordBatch.from_pydict({"n": [0, 1], "m": pa.array([[("a", 1)], []], type=kind)}),
        pa.RecordBatch.from_pydict({"n": [2], "m": pa.array([[]], type=kind)}),
    ]
    spec = keuss_spark.WriteSpec(backend=backend, queue="maps", options=opts)
    assert keuss_spark.push_arrow_batches(spec, batches, "job:0") == 3
    got = sorted(_drain(backend, opts, "maps"), key=lambda p: p["n"])
    assert got == [{"n": 0, "m": {"a": 1}}, {"n": 1, "m": {}}, {"n": 2, "m": {}}]

    spec = keuss_spark.WriteSpec(
        backend=backend, queue="each", options=opts, headers_column="h", idempotent=False
    )
    rows = [{"n": i, "h": None, "t": dt.datetime(2024, 1, 1) if i % 2 else None} for i in range(4)]
    assert keuss_spark.push_rows(spec, rows, None) == 4
    assert sorted(p["n"] for p in _drain(backend, opts, "each")) == [0, 1, 2, 3]


def test_a_bad_delay_or_headers_in_one_row_fails_before_any_row_is_written(
    target: tuple[str, dict[str, Any]],
) -> None:
    """Rows with a delay or headers column are pushed one by one: only their payloads were
    checked before, so the rows before one with a refused delay (negative, or any delay on a
    backend without delays) or bad headers were written, then the task failed, and Spark's
    retry wrote them again (without idempotent ids: twice). The executor's path, without
    Spark."""
    backend, opts = target
    rows = [{"n": i, "d": 0.0, "h": None} for i in range(3)]
    bad_rows = [
        ([*rows, {"n": 3, "d": -1.0, "h": None}], "d", aio_keuss.InvalidDelayError),
        ([*rows, {"n": 3, "d": 0.0, "h": {"k": [1]}}], "d", aio_keuss.InvalidHeadersError),
    ]
    for bad, delay_column, error in bad_rows:
        spec = keuss_spark.WriteSpec(
            backend=backend,
            queue="bad",
            options=opts,
            delay_column=delay_column,
            headers_column="h",
            idempotent=False,
        )
        with pytest.raises(error):
            keuss_spark.push_rows(spec, bad, None)
    with pytest.raises(aio_keuss.NotSupportedError):  # redis-list: no delays
        spec = keuss_spark.WriteSpec(
            backend="redis-list",
            queue="bad",
            options={"url": REDIS_URL, "prefix": opts.get("prefix", f"akt-{new_token()}")},
            delay_column="d",
            idempotent=False,
        )
        keuss_spark.push_rows(spec, [*rows[:2], {"n": 2, "d": 5.0}], None)
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("bad").total_size() == 0
    with sync.connect("redis-list", **spec.options) as factory:
        assert factory.queue("bad").total_size() == 0
    asyncio.run(_drop_redis_prefix(spec.options))


def test_a_nan_in_the_id_column_is_refused_before_any_row_is_written(
    target: tuple[str, dict[str, Any]],
) -> None:
    """A NaN key made the id "nan": every such row of the job, whatever its payload, became
    one message, the others dropped as its duplicates."""
    backend, opts = target
    spec = keuss_spark.WriteSpec(
        backend=backend, queue="nan", options=opts, id_column="k", payload_column="v"
    )
    rows = [{"k": 1.5, "v": 0}, {"k": math.nan, "v": 1}, {"k": math.nan, "v": 2}]
    with pytest.raises(aio_keuss.InvalidIdError, match="NaN"):
        keuss_spark.push_rows(spec, rows, None)
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("nan").total_size() == 0


def test_bad_options_fail_before_writing(
    spark: SparkSession, target: tuple[str, dict[str, Any]]
) -> None:
    backend, opts = target
    df = spark.range(10)
    with pytest.raises(Exception, match="payload_column"):
        _writer(df, backend, opts, "bad", payload_column="nope").save()
    with pytest.raises(Exception, match="no_such_option"):
        _writer(df, backend, opts, "bad", no_such_option="1").save()
    with pytest.raises(aio_keuss.ConfigError):
        keuss_spark.push_partitions("redis-list", "q", url="redis://127.0.0.1:6379/0")
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("bad").total_size() == 0


def test_bad_read_options_fail_on_the_driver(target: tuple[str, dict[str, Any]]) -> None:
    """The reader checks connect options on the driver, as the writer does (they reached the
    executors unchecked, and failed there)."""
    from aio_keuss.spark.source import KeussDataSource

    backend, opts = target
    good = {"backend": backend, "queue": "read-bad", **{k: str(v) for k, v in opts.items()}}
    bad_ones: list[dict[str, str]] = [
        {"no_such_option": "1"},
        {"reserve_delay": "nan"},
        {"max_batch": "0"},
        *({"stop_timeout": value} for value in ("0", "-1", "nan", "inf", "soon")),
    ]
    for bad in bad_ones:
        source = KeussDataSource({**good, **bad})
        with pytest.raises(aio_keuss.ConfigError):
            source.reader(None)  # type: ignore[arg-type]
        with pytest.raises(aio_keuss.ConfigError):
            source.streamReader(None)  # type: ignore[arg-type]
    KeussDataSource(good).reader(None)  # type: ignore[arg-type]


def test_a_server_gone_since_an_earlier_query_fails_the_next_on_the_driver() -> None:
    """The driver's connect check was made once per option set: a read or write after the
    server went away (or a query on the second day of a long-lived driver) passed it, and
    every task then failed connecting, after the job started. Each query checks again."""
    from own_servers import own_redis

    from aio_keuss.spark.source import KeussDataSource

    with own_redis() as server:
        options = {"backend": "redis-oq", "queue": "gone", "url": server.url, "prefix": "akt-g"}
        KeussDataSource(options).reader(None)  # type: ignore[arg-type]
        KeussDataSource(options).writer(_columns(), False)
        server.stop()
        with pytest.raises(aio_keuss.KeussConnectionError):
            KeussDataSource(options).reader(None)  # type: ignore[arg-type]
        with pytest.raises(aio_keuss.KeussConnectionError):
            KeussDataSource(options).writer(_columns(), False)


def test_a_streaming_write_checks_the_connection_once_not_per_micro_batch() -> None:
    """Spark makes the stream writer on the driver twice per micro-batch (to plan its write,
    then to commit it): checking per call opened and closed a factory twice per micro-batch
    (20-120 ms of a small one). A stream checks it when its writer is first made; the
    schema and options are still checked per call, and batch writes still connect each."""
    import redis
    from own_servers import own_redis

    from aio_keuss.spark.source import KeussDataSource

    with own_redis() as server:
        client = redis.Redis.from_url(server.url)

        def connections() -> int:
            return int(client.info("stats")["total_connections_received"])

        options = {"backend": "redis-oq", "queue": "once", "url": server.url, "prefix": "akt-o"}
        options["checkpointLocation"] = f"/tmp/akt-once-{new_token()}"
        before = connections()
        for _ in range(3):  # micro-batches
            KeussDataSource(options).streamWriter(_columns(), False)
            KeussDataSource(options).streamWriter(_columns(), False)
        once = connections() - before
        assert once >= 1
        with pytest.raises(aio_keuss.ConfigError):  # still checked per call, no connection
            KeussDataSource({**options, "priority_column": "nope"}).streamWriter(_columns(), False)
        for _ in range(3):
            KeussDataSource(options).streamWriter(_columns(), False)
        assert connections() - before == once
        KeussDataSource(options).writer(_columns(), False)  # a batch write connects each time
        assert connections() - before > once
        client.close()


def test_a_bad_queue_name_fails_a_read_on_the_driver_after_a_good_read(
    target: tuple[str, dict[str, Any]],
) -> None:
    """The driver's connect check is done once per connect options, whatever the queue: a
    read of an invalid queue name after any read or write with the same options was
    accepted, and failed in every task on the executors instead."""
    from aio_keuss.spark.source import KeussDataSource

    backend, opts = target
    good = {"backend": backend, "queue": "read-good", **{k: str(v) for k, v in opts.items()}}
    KeussDataSource(good).reader(None)  # type: ignore[arg-type]
    bad = KeussDataSource({**good, "queue": "no such name!"})
    with pytest.raises(aio_keuss.ConfigError, match="queue name"):
        bad.reader(None)  # type: ignore[arg-type]
    with pytest.raises(aio_keuss.ConfigError, match="queue name"):
        bad.streamReader(None)  # type: ignore[arg-type]


def test_flag_and_count_options_given_as_spark_strings_reach_connect(
    target: tuple[str, dict[str, Any]],
) -> None:
    """Spark hands options over as strings: a backend's flags and counts (``history``,
    ``durable_acks``, ``max_pool_size``, ``cluster``...) reached ``connect`` as text and were
    refused, so no read or write through the data source could set them."""
    from aio_keuss.spark.source import KeussDataSource, ReadSpec

    backend, opts = target
    typed: dict[str, Any] = (
        {"history": True, "durable_acks": False, "max_pool_size": 3, "history_ttl": 60.0}
        if backend == "postgres"
        else {"cluster": False}
    )
    strings = {"backend": backend, "queue": "typed", **opts}
    strings.update({key: str(value).lower() for key, value in typed.items()})
    strings = {key: str(value) for key, value in strings.items()}
    assert keuss_spark.WriteSpec.from_options(strings).options == {**opts, **typed}
    assert ReadSpec.from_options(strings).options == {**opts, **typed}
    KeussDataSource(strings).reader(None)  # type: ignore[arg-type]  # connects on the driver
    with pytest.raises(aio_keuss.ConfigError):
        keuss_spark.WriteSpec.from_options({**strings, next(iter(typed)): "maybe"})


def test_rate_limit_options_given_as_spark_strings_reach_connect_as_counts(
    target: tuple[str, dict[str, Any]],
) -> None:
    """``rate_limit`` and ``rate_burst`` are counts: Spark's strings were made floats, which
    ``connect`` refuses (``rate_limit must be an int``), so no read or write through the
    data source could limit its queue's deliveries. The limit reaches the queue."""
    from aio_keuss.spark.source import KeussDataSource, ReadSpec

    backend, opts = target
    strings = {"backend": backend, "queue": "limited", **opts}
    strings.update({"rate_limit": "100", "rate_burst": "5", "rate_period": "2"})
    strings = {key: str(value) for key, value in strings.items()}
    limits = {"rate_limit": 100, "rate_burst": 5, "rate_period": 2.0}
    assert keuss_spark.WriteSpec.from_options(strings).options == {**opts, **limits}
    spec = ReadSpec.from_options(strings)
    assert spec.options == {**opts, **limits}
    assert all(type(spec.options[key]) is type(value) for key, value in limits.items())
    KeussDataSource(strings).reader(None)  # type: ignore[arg-type]  # connects on the driver
    with sync.connect(backend, **spec.options) as factory:
        options = factory.queue("limited").queue.options
        assert (options.rate_limit, options.rate_burst, options.rate_period) == (100, 5, 2.0)
    with pytest.raises(aio_keuss.ConfigError, match="rate_limit"):
        ReadSpec.from_options({**strings, "rate_limit": "1.5"})


def test_stream_write_replayed_batch_does_not_duplicate(
    spark: SparkSession, target: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    backend, opts = target
    source = tmp_path / "in"
    spark.range(3000, numPartitions=3).selectExpr("id", "id * 10 AS v").write.parquet(str(source))
    checkpoint = tmp_path / "checkpoint"

    def run() -> None:
        stream = spark.readStream.schema("id long, v long").parquet(str(source))
        writer = stream.writeStream.format("aio_keuss")
        writer = writer.option("checkpointLocation", str(checkpoint))
        for key, value in {"backend": backend, "queue": "streamed", **opts}.items():
            writer = writer.option(key, str(value))
        writer.trigger(availableNow=True).start().awaitTermination(120)

    run()
    # A crash after the sink wrote batch 0 but before Spark recorded it: replayed on restart.
    commit = checkpoint / "commits" / "0"
    assert commit.exists()
    commit.unlink()
    (commit.parent / ".0.crc").unlink(missing_ok=True)
    run()
    assert commit.exists()
    payloads = _drain(backend, opts, "streamed")
    assert sorted(p["id"] for p in payloads) == list(range(3000))


def test_stream_read_loses_nothing_across_restart(
    spark: SparkSession, target: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    backend, opts = target
    total = 3000
    with sync.connect(backend, **opts) as factory:
        factory.queue("in").push_many([{"n": n} for n in range(total)])
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def start() -> Any:
        reader = spark.readStream.format("aio_keuss")
        options = {"backend": backend, "queue": "in", "max_rows_per_batch": 500, **opts}
        # Reservations of the stopped run come back after reserve_delay: short here, to
        # keep the test short; above the longest micro-batch in real use.
        options["reserve_delay"] = 8
        for key, value in options.items():
            reader = reader.option(key, str(value))
        return (
            reader.load()
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime="200 milliseconds")
            .start()
        )

    def rows_read(query: Any) -> int:
        return sum(p["numInputRows"] for p in query.recentProgress)

    query = start()
    deadline = time.monotonic() + 90
    while rows_read(query) < 1000 and time.monotonic() < deadline:
        time.sleep(0.2)
    query.stop()
    first = rows_read(query)
    assert 0 < first < total, first

    query = start()  # same checkpoint
    with sync.connect(backend, **opts) as factory:
        q = factory.queue("in")
        while q.total_size() > 0 and time.monotonic() < deadline:
            time.sleep(0.3)
        time.sleep(1.0)  # the last batch's commit (ok) follows its sink commit
        left = q.total_size()
    query.stop()
    assert left == 0
    ids = [row["payload"] for row in spark.read.parquet(str(out)).collect()]
    numbers = {orjson.loads(p)["n"] for p in ids}
    assert numbers == set(range(total))  # nothing lost (at-least-once: a replay may repeat)


def test_stream_read_available_now_takes_what_is_ready_and_acknowledges_it(
    spark: SparkSession, target: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """``trigger(availableNow=True)``: Spark wrapped the reader and asked it for one batch
    (``max_rows_per_batch``) only, whose messages were then never acknowledged: the run
    ended with the rest still ready and that batch reserved, to come back after
    ``reserve_delay`` and reach the sink again on a later run."""
    backend, opts = target
    total = 50
    with sync.connect(backend, **opts) as factory:
        factory.queue("now").push_many([{"n": n} for n in range(total)])
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def run() -> int:
        reader = spark.readStream.format("aio_keuss")
        options = {"backend": backend, "queue": "now", "max_rows_per_batch": 20, **opts}
        options["reserve_delay"] = 600  # nothing may come back by expiring in this test
        for key, value in options.items():
            reader = reader.option(key, str(value))
        query = (
            reader.load()
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        assert query.awaitTermination(120)
        return sum(p["numInputRows"] for p in query.recentProgress)

    assert run() == total
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("now").sizes() == aio_keuss.Sizes(0, 0, 0, 0)
    assert run() == 0
    payloads = [row["payload"] for row in spark.read.parquet(str(out)).collect()]
    assert sorted(orjson.loads(p)["n"] for p in payloads) == list(range(total))


def test_a_stopped_stream_gives_back_its_reservations_costing_no_try(
    target: tuple[str, dict[str, Any]],
) -> None:
    """A stream's ``stop`` gave back what it held with ``ko``, which counts a try: every stop
    and restart of a query (a deploy) cost its pending messages one, and past the
    deadletter's ``max_ko`` a message that never failed left the queue for the deadletter
    queue. The reader's own calls, without Spark."""
    from aio_keuss.spark.source import KeussStreamReader, ReadSpec

    backend, opts = target
    opts = {**opts, "deadletter": {"max_ko": 1}}
    with sync.connect(backend, **opts) as factory:
        factory.queue("held").push({"n": 1})
    strings = {k: v if isinstance(v, str) else orjson.dumps(v).decode() for k, v in opts.items()}
    for _ in range(3):  # three runs stopped while their batch was pending
        reader = KeussStreamReader(
            ReadSpec.from_options({"backend": backend, "queue": "held", **strings})
        )
        end = reader.latestOffset(reader.initialOffset(), None)
        assert end["seq"] == 1
        reader.stop()
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("__deadletter__").total_size() == 0
        msg = factory.queue("held").pop(timeout=0)
        assert msg is not None and msg.payload == {"n": 1} and msg.tries == 0


def test_a_stream_keeps_its_pending_reservations_alive_until_commit(
    target: tuple[str, dict[str, Any]],
) -> None:
    """A micro-batch that ran longer than ``reserve_delay`` let the reservations the reader
    held for it lapse: another consumer (or this stream's next batch) got the messages
    again, and the sink saw them twice. The reader now extends what it holds from the
    driver until ``commit``. Its own calls, without Spark, as the data source makes it."""
    from aio_keuss.spark.source import RENEWALS_PER_DELAY, KeussDataSource

    backend, opts = target
    delay = 2.0
    with sync.connect(backend, **opts) as factory:
        factory.queue("kept").push_many([{"n": n} for n in range(5)])
    strings = {k: v if isinstance(v, str) else orjson.dumps(v).decode() for k, v in opts.items()}
    source = KeussDataSource(
        {"backend": backend, "queue": "kept", **strings, "reserve_delay": str(delay)}
    )
    reader = source.streamReader(None)  # type: ignore[arg-type]

    def wait_until(done: Any) -> None:
        deadline = time.monotonic() + 120
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done()

    end = reader.latestOffset(reader.initialOffset(), None)
    assert end["seq"] == 1
    # Each round waits its share of reserve_delay first: so many rounds outlast three of them.
    rounds = 3 * RENEWALS_PER_DELAY + 1
    wait_until(lambda: reader.renewals >= rounds)
    # Spark pickles the reader for the executors while its thread runs: the copy neither
    # carries the thread nor ever starts one.
    copy = pickle.loads(pickle.dumps(reader))
    assert copy.renewer is None and not copy.renews
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("kept").reserve_many(10, timeout=0) == []
    assert reader.lapsed == 0 and reader.extended >= 5 * rounds
    thread = reader.renewer
    assert thread is not None and thread.is_alive()
    reader.commit(end)  # every one still ours: ok-ed, none left
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("kept").sizes() == aio_keuss.Sizes(0, 0, 0, 0)
    thread.join(60)  # nothing pending: the thread ends
    assert not thread.is_alive() and reader.renewer is None

    with sync.connect(backend, **opts) as factory:
        factory.queue("kept").push({"n": 5})
    end = reader.latestOffset(end, None)
    assert end["seq"] == 2
    thread = reader.renewer
    assert thread is not None and thread.is_alive()
    reader.stop()  # gives the message back and ends the thread
    assert not thread.is_alive() and reader.renewer is None
    with sync.connect(backend, **opts) as factory:
        msg = factory.queue("kept").pop(timeout=0)
        assert msg is not None and msg.payload == {"n": 5}


def _wait_until(done: Any, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done()


def _stream_reader(
    backend: str, opts: dict[str, Any], queue: str, delay: float, **extra: str
) -> Any:
    """A stream reader as the data source makes it for Spark's driver, not started by Spark."""
    from aio_keuss.spark.source import KeussDataSource

    strings = {k: v if isinstance(v, str) else orjson.dumps(v).decode() for k, v in opts.items()}
    source = KeussDataSource(
        {"backend": backend, "queue": queue, **strings, "reserve_delay": str(delay), **extra}
    )
    return source.streamReader(None)  # type: ignore[arg-type]


def _in_extension(thread: threading.Thread) -> bool:
    """Whether ``thread`` is waiting for the answer of an ``extend_many``."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code is sync.SyncQueue.extend_many.__code__:
            return True
        frame = frame.f_back
    return False


def _gated(opts: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A :class:`ReplyGate` in front of the server of ``opts``, and ``opts`` going through it."""
    from urllib.parse import urlsplit, urlunsplit

    from reply_gate import ReplyGate

    parts = urlsplit(opts["url"])
    gate = ReplyGate(parts.hostname or "127.0.0.1", parts.port or 0)
    user = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    url = urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{gate.port}"))
    return gate, {**opts, "url": url}


def test_a_failed_renewal_round_is_logged_counted_and_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The backend unreachable while a micro-batch is pending: each round raises. The
    renewer must not die of it (nothing would extend the batch any more, nor would a new
    renewer start while the dead one is still noted): it logs, counts and tries again
    every round, and extends once the server is back."""
    from own_servers import own_redis

    caplog.set_level(logging.WARNING, logger="aio_keuss.spark.source")
    # The data outlives the restart: the reservations are still there when it is back.
    with own_redis("--appendonly", "yes", "--appendfsync", "always") as server:
        opts = {"url": server.url, "prefix": f"akt-{new_token()}"}
        with sync.connect("redis-oq", **opts) as factory:
            factory.queue("kept").push_many([{"n": n} for n in range(5)])
        reader = _stream_reader("redis-oq", opts, "kept", 2.0)
        try:
            end = reader.latestOffset(reader.initialOffset(), None)
            _wait_until(lambda: reader.renewals >= 1)
            thread = reader.renewer
            assert thread is not None
            server.stop()
            _wait_until(lambda: reader.failed >= 2)  # tried again while still away
            assert thread.is_alive() and reader.renewer is thread
            failures = [r for r in caplog.records if "extending the 5 reservations" in r.message]
            assert len(failures) >= 2
            with reader._lock:  # a round's counts change together, under the lock
                answered, extended, failed = reader.renewals, reader.extended, reader.failed
            server.start()
            _wait_until(lambda: reader.renewals > answered)
            # Nobody else reserves here: a lapsed reservation still answers True.
            assert reader.lapsed == 0 and reader.extended > extended
            assert reader.failed >= failed and reader.renewer is thread
            reader.commit(end)
            thread.join(60)
            assert not thread.is_alive() and reader.renewer is None
            with sync.connect("redis-oq", **opts) as factory:
                assert factory.queue("kept").sizes() == aio_keuss.Sizes(0, 0, 0, 0)
            reader.stop()
        finally:
            # a failure above may leave the server away: its refusal would hide that failure
            with contextlib.suppress(aio_keuss.KeussConnectionError):
                reader.stop()


def test_a_pending_message_another_consumer_took_is_logged_counted_and_not_extended_again(
    target: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """The driver stalled past ``reserve_delay`` (a long GC pause: no round ran) and another
    consumer reserved some of the pending messages. Those are logged and counted once, and
    not extended again (each further try would answer False, and count it again); the rest
    stay the reader's, and the other consumer's reservations are left alone."""
    backend, opts = target
    caplog.set_level(logging.WARNING, logger="aio_keuss.spark.source")
    with sync.connect(backend, **opts) as factory:
        factory.queue("taken").push_many([{"n": n} for n in range(5)])
    reader = _stream_reader(backend, opts, "taken", 1.0)
    try:
        end = reader.latestOffset(reader.initialOffset(), None)
        _wait_until(lambda: reader.renewals >= 1)
        thread = reader.renewer
        assert thread is not None
        with sync.connect(backend, **opts) as factory:
            other = factory.queue("taken", reserve_delay=600.0)
            taken: list[Any] = []
            with reader._lock:  # the renewer cannot start (or finish) a round meanwhile
                deadline = time.monotonic() + 60
                while len(taken) < 2 and time.monotonic() < deadline:
                    taken += other.reserve_many(2 - len(taken), timeout=0)
                    time.sleep(0.05)
            assert len(taken) == 2
            _wait_until(lambda: reader.lapsed >= 2)
            with reader._lock:
                answered, extended = reader.renewals, reader.extended
            _wait_until(lambda: reader.renewals >= answered + 2)
            with reader._lock:
                more_rounds, more_extended = reader.renewals - answered, reader.extended - extended
                assert reader.lapsed == 2  # the taken ones were not tried again
            assert more_extended == 3 * more_rounds  # only the three still the reader's
            lost = [r.getMessage() for r in caplog.records]
            lost = [text for text in lost if "another consumer took it" in text]
            assert len(lost) == 2 and all(any(m.id in text for text in lost) for m in taken)
            assert thread.is_alive()
            assert other.extend_many(taken) == [True, True]  # the reader left them alone
            reader.commit(end)  # oks its three; the two taken stay the other's
            assert sum(other.ok(m) for m in taken) == 2
            assert other.sizes() == aio_keuss.Sizes(0, 0, 0, 0)
        thread.join(60)
        assert not thread.is_alive() and reader.renewer is None
    finally:
        reader.stop()


def test_commit_or_stop_during_a_renewal_round_leaks_nothing(
    target: tuple[str, dict[str, Any]],
) -> None:
    """Spark's thread commits (or stops) while the renewer waits for an extension's answer.
    An extension answered after the ok is not a message lost to another consumer; the
    thread ends once the round is answered, and ``stop`` gives back what was pending."""
    backend, opts = target
    gate, through = _gated(opts)
    with sync.connect(backend, **opts) as factory:
        factory.queue("inflight").push_many([{"n": n} for n in range(5)])
    reader = _stream_reader(backend, through, "inflight", 2.0)
    try:

        def held_round() -> threading.Thread:
            """Shut the gate just after a round was answered: the next one is held."""
            thread: threading.Thread | None = reader.renewer
            assert thread is not None
            answered = reader.renewals
            _wait_until(lambda: reader.renewals > answered)
            gate.shut()
            _wait_until(lambda: _in_extension(thread))
            return thread

        end = reader.latestOffset(reader.initialOffset(), None)
        thread = held_round()
        committing = threading.Thread(target=reader.commit, args=(end,))
        committing.start()
        _wait_until(lambda: bool(reader._acking))  # commit has begun, its ok is held too
        with reader._lock:
            extended = reader.extended
        gate.open()
        committing.join(60)
        thread.join(60)
        assert not committing.is_alive() and not thread.is_alive() and reader.renewer is None
        # The held round's answers came for messages being ok-ed: neither kept nor lost.
        assert reader.extended == extended and reader.lapsed == 0
        with sync.connect(backend, **opts) as factory:
            assert factory.queue("inflight").sizes() == aio_keuss.Sizes(0, 0, 0, 0)
            factory.queue("inflight").push_many([{"n": n} for n in range(5, 8)])

        end = reader.latestOffset(end, None)
        thread = held_round()
        stopping = threading.Thread(target=reader.stop)
        stopping.start()
        _wait_until(lambda: reader._stopping)  # stop waits for the round in flight
        gate.open()
        stopping.join(60)
        assert not stopping.is_alive() and not thread.is_alive() and reader.renewer is None
        assert reader.lapsed == 0
        assert not [t for t in threading.enumerate() if t.name == thread.name]
        with sync.connect(backend, **opts) as factory:
            back = factory.queue("inflight").pop_many(10, timeout=0)
            assert sorted(m.payload["n"] for m in back) == [5, 6, 7]
            assert all(m.tries == 0 for m in back)
    finally:
        gate.open()
        reader.stop()
        gate.cut()


def test_a_stop_while_the_server_answers_nothing_returns_and_loses_nothing(
    target: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """The server stopped answering (a black-holed connection) while a renewal round was
    out: ``stop`` waited for that round without end, and a Spark query's stop hung with it.
    It gives the round ``stop_timeout`` seconds, then abandons it, and the give-back after
    it, with a warning: nothing was acknowledged, so the messages come back once their
    reservations expire. No reply gets through the gate until ``stop`` has returned."""
    backend, opts = target
    caplog.set_level(logging.WARNING, logger="aio_keuss.spark.source")
    gate, through = _gated(opts)
    with sync.connect(backend, **opts) as factory:
        factory.queue("silent").push_many([{"n": n} for n in range(5)])
    reader = _stream_reader(backend, through, "silent", 2.0, stop_timeout="0.5")
    stopping = threading.Thread(target=reader.stop, daemon=True)
    try:
        reader.latestOffset(reader.initialOffset(), None)
        thread = reader.renewer
        assert thread is not None
        _wait_until(lambda: reader.renewals >= 1)
        gate.shut()  # from now on the server answers nothing
        _wait_until(lambda: _in_extension(thread))
        stopping.start()
        stopping.join(120)  # a guard against the hang only: no reply comes before it returns
        assert not stopping.is_alive()
        given_up = [r.getMessage() for r in caplog.records if "stop" in r.getMessage()]
        assert any("abandoned" in text for text in given_up)
        assert reader.renewer is None
    finally:
        gate.open()
    stopping.join(120)
    thread.join(120)  # answered at last (or cut by the close): the renewer ends
    assert not thread.is_alive()
    with sync.connect(backend, **opts) as factory:
        queue, back = factory.queue("silent"), []
        deadline = time.monotonic() + 120
        while len(back) < 5 and time.monotonic() < deadline:  # given back, or expired
            back += queue.pop_many(5, timeout=1)
        assert sorted(m.payload["n"] for m in back) == list(range(5))
    reader.stop()  # a second stop: nothing left to do
    gate.cut()


def test_a_stream_reader_stop_is_refused_on_the_loop_thread_before_anything_changes(
    target: tuple[str, dict[str, Any]],
) -> None:
    """Spark stops a reader from its own thread. Called by a coroutine on the sync shim's
    loop thread, ``stop`` would wait there for that very thread (the renewal round, the
    give-back): it is refused before anything changes, and a stop from another thread then
    gives back what is pending, as ever."""
    from aio_keuss.spark.source import STOP_TIMEOUT, ReadSpec

    backend, opts = target
    with sync.connect(backend, **opts) as factory:
        factory.queue("looped").push_many([{"n": n} for n in range(3)])
    reader = _stream_reader(backend, opts, "looped", 30.0)
    assert reader.spec.stop_timeout == STOP_TIMEOUT
    strings = {"backend": backend, "queue": "q", **{k: str(v) for k, v in opts.items()}}
    assert ReadSpec.from_options({**strings, "stop_timeout": "2.5"}).stop_timeout == 2.5
    try:
        end = reader.latestOffset(reader.initialOffset(), None)
        assert end["seq"] == 1
        thread = reader.renewer

        async def stop_here() -> None:
            reader.stop()

        with sync.connect(backend, **opts) as factory, pytest.raises(aio_keuss.LoopThreadError):
            factory.call(stop_here)
        assert reader.renewer is thread and reader._queue is not None and reader._pending
        reader.stop()
        assert not reader._pending and reader._queue is None
        with sync.connect(backend, **opts) as factory:
            back = factory.queue("looped").pop_many(10, timeout=0)
            assert sorted(m.payload["n"] for m in back) == [0, 1, 2]
    finally:
        reader.stop()


def test_idempotent_writes_refuse_a_dedup_window_of_zero(
    target: tuple[str, dict[str, Any]],
) -> None:
    """``dedup_window=0`` keeps no id once its message is consumed: the "idempotent" write
    was accepted, and rows pushed again under the same ids by a retried task after a
    consumer took the first attempt's were stored twice (seen on redis-oq and postgres).
    Refused before anything is written, as a backend without idempotent ids is;
    ``idempotent=false`` says duplicates are accepted."""
    backend, opts = target
    strings = {"backend": backend, "queue": "window", **opts, "dedup_window": "0"}
    with pytest.raises(aio_keuss.ConfigError, match="dedup_window"):
        keuss_spark.WriteSpec.from_options(strings)
    with pytest.raises(aio_keuss.ConfigError, match="dedup_window"):
        keuss_spark.push_partitions(backend, "window", dedup_window=0, **opts)
    spec = keuss_spark.WriteSpec.from_options({**strings, "idempotent": "false"})
    assert keuss_spark.push_rows(spec, [{"n": 1}], None) == 1
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("window").total_size() == 1


def test_a_named_column_missing_from_the_rows_is_a_config_error(
    target: tuple[str, dict[str, Any]],
) -> None:
    """``push_rows`` / ``push_partitions`` (which cannot check the columns on the driver, as
    the data source does) met a row without the id, payload, headers or delay column with a
    bare KeyError. A ConfigError naming the option, before anything is written."""
    backend, opts = target
    rows = [{"n": n} for n in range(3)]
    for option in ("id_column", "payload_column", "headers_column", "delay_column"):
        spec = keuss_spark.WriteSpec(backend=backend, queue="columns", options=opts)
        spec = dataclasses.replace(spec, **{option: "absent"})
        with pytest.raises(aio_keuss.ConfigError, match=f"{option} 'absent'"):
            keuss_spark.push_rows(spec, rows, "job:0")
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("columns").total_size() == 0


def test_optional_seconds_of_the_bucket_backends_reach_connect_as_numbers() -> None:
    """``reject_delta_factor`` and ``reject_timeout_grace`` default to None, so they were not
    typed back from Spark's strings and ``connect`` refused them: no read or write through
    the data source could set them on a bucket backend."""
    from aio_keuss.spark.source import ReadSpec

    options = {"url": REDIS_URL, "prefix": f"akt-{new_token()}"}
    strings = {"backend": "bucket-redis", "queue": "typed", **options}
    strings.update({"reject_delta_factor": "0.5", "reject_timeout_grace": "5"})
    typed = {**options, "reject_delta_factor": 0.5, "reject_timeout_grace": 5.0}
    try:
        assert ReadSpec.from_options(strings).options == typed
        with sync.connect("bucket-redis", **ReadSpec.from_options(strings).options) as factory:
            factory.queue("typed")
    finally:
        asyncio.run(_drop_redis_prefix(options))


# -- priorities ------------------------------------------------------------------------------


@pytest.fixture(params=[c for c in CASES if c.id in ("memory", *SPARK_IDS)], ids=lambda c: c.id)
def pusher_target(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    """The executor's path without Spark: the memory store too, whose queues live in this
    process (in the factory the executor caches), which no Spark task could share."""
    case: BackendCase = request.param
    reason = case.available()
    if reason:
        pytest.skip(reason)
    opts = case.options(new_token())
    yield case.name, opts
    keuss_spark.close_executor_factories()
    if case.cleanup is not None:
        asyncio.run(case.cleanup(opts))


def _prioritized(backend: str, opts: dict[str, Any]) -> None:
    with sync.connect(backend, **opts) as factory:
        if not factory.capabilities.priority:
            pytest.skip(f"{backend} has no capabilities.priority yet")


def _taken(backend: str, opts: dict[str, Any], queue: str) -> list[Any]:
    """Every message of ``queue``, reserved one at a time and ok-ed, in the order handed out;
    through the executor's cached factory (the one a memory queue lives in)."""
    q = keuss_spark.executor_queue(backend, queue, opts)
    taken = []
    while (message := q.reserve(timeout=0)) is not None:
        assert q.ok(message)
        taken.append(message)
    return taken


def _columns(**more: Any) -> Any:
    """A write's schema: ``n bigint`` and ``more`` (names to Spark types)."""
    from pyspark.sql.types import LongType, StructField, StructType

    fields = {"n": LongType(), **more}
    return StructType([StructField(name, kind) for name, kind in fields.items()])


def test_priority_options_are_parsed_and_checked_before_anything_is_written() -> None:
    """``priority`` must be an int in range; ``priority_column`` and ``priority`` are one or
    the other; both refused as options, before any connection."""
    base = {"backend": "memory", "queue": "opts"}
    spec = keuss_spark.WriteSpec.from_options({**base, "priority": " -7 "})
    assert spec.priority == -7 and spec.prioritized
    spec = keuss_spark.WriteSpec.from_options({**base, "priority_column": "p"})
    assert spec.priority_column == "p" and spec.priority == 0 and spec.prioritized
    assert not keuss_spark.WriteSpec.from_options({**base, "priority": "0"}).prioritized
    for bad in ("high", "1.5", "32768", "-32769", "true"):
        with pytest.raises(aio_keuss.ConfigError, match="priority"):
            keuss_spark.WriteSpec.from_options({**base, "priority": bad})
    with pytest.raises(aio_keuss.ConfigError, match="not both"):
        keuss_spark.WriteSpec.from_options({**base, "priority": "2", "priority_column": "p"})
    for wrong in (True, 1 << 16, 2.0):
        with pytest.raises(aio_keuss.ConfigError, match="priority"):
            keuss_spark.push_partitions("memory", "opts", priority=wrong, idempotent=False)
    assert {"priority", "priority_column"} <= keuss_spark.WRITE_OPTIONS


def test_priorities_are_refused_on_the_driver_where_the_backend_has_none(
    target: tuple[str, dict[str, Any]],
) -> None:
    """A backend without ``capabilities.priority`` would refuse every batch of every task,
    once the job had started: the driver refuses the option first, with the opened
    factory's capabilities, and nothing is written. ``priority=0`` is no priority."""
    from pyspark.sql.types import IntegerType

    from aio_keuss.spark.source import KeussDataSource, _check_connect

    backend, opts = target
    with sync.connect(backend, **opts) as factory:
        if factory.capabilities.priority:
            pytest.skip(f"{backend} has priorities: nothing to refuse")
        capabilities = factory.capabilities
    strings = {"backend": backend, "queue": "refused", **{k: str(v) for k, v in opts.items()}}
    # The driver checks what the opened factory can do (options may take a capability away)
    assert _check_connect(keuss_spark.WriteSpec.from_options(strings)) == capabilities
    schema = _columns(p=IntegerType())
    for option in ({"priority_column": "p"}, {"priority": "3"}):
        with pytest.raises(aio_keuss.NotSupportedError, match="priorit"):
            keuss_spark.WriteSpec.from_options({**strings, **option})
        with pytest.raises(aio_keuss.NotSupportedError, match="priorit"):
            KeussDataSource({**strings, **option}).writer(schema, False)
        with pytest.raises(aio_keuss.NotSupportedError, match="priorit"):
            KeussDataSource({**strings, **option}).streamWriter(schema, False)
    with pytest.raises(aio_keuss.NotSupportedError):
        keuss_spark.push_partitions(backend, "refused", priority_column="p", **opts)
    KeussDataSource({**strings, "priority": "0"}).writer(schema, False)
    with sync.connect(backend, **opts) as factory:
        assert factory.queue("refused").total_size() == 0


def test_priorities_are_refused_on_the_driver_by_redis_list() -> None:
    """The refusal above where the Spark backends have priorities: redis-list has none."""
    from pyspark.sql.types import IntegerType

    from aio_keuss.registry import load_backend
    from aio_keuss.spark.source import KeussDataSource

    if load_backend("redis-list").capabilities.priority:
        pytest.skip("redis-list has priorities: nothing to refuse")
    options = {"url": REDIS_URL, "prefix": f"akt-{new_token()}"}
    strings = {"backend": "redis-list", "queue": "refused", "idempotent": "false", **options}
    try:
        for option in ({"priority_column": "p"}, {"priority": "-1"}):
            with pytest.raises(aio_keuss.NotSupportedError, match="priorit"):
                KeussDataSource({**strings, **option}).writer(_columns(p=IntegerType()), False)
        with sync.connect("redis-list", **options) as factory:
            assert factory.queue("refused").total_size() == 0
    finally:
        asyncio.run(_drop_redis_prefix(options))


def test_a_priority_column_must_be_an_integer_column() -> None:
    """A double or string column would fail every task at its first row: the driver refuses
    it (on memory, which has priorities; no task runs here)."""
    from pyspark.sql import types

    from aio_keuss.spark.source import KeussDataSource

    options = {"backend": "memory", "queue": "typed", "priority_column": "p"}
    for kind in (types.DoubleType(), types.StringType(), types.DecimalType(4, 0)):
        with pytest.raises(aio_keuss.ConfigError, match="not an integer column"):
            KeussDataSource(options).writer(_columns(p=kind), False)
    with pytest.raises(aio_keuss.ConfigError, match="priority_column 'p' is not a column"):
        KeussDataSource(options).writer(_columns(), False)
    for kind in (types.ByteType(), types.ShortType(), types.IntegerType(), types.LongType()):
        KeussDataSource(options).writer(_columns(p=kind), False)


def test_delay_and_headers_columns_of_a_type_no_row_could_hold_are_refused_on_the_driver() -> None:
    """A delay column of text, timestamps or booleans, or a headers column of numbers,
    arrays or bytes, failed every task at its first non-null row (InvalidDelayError,
    InvalidHeadersError), after the job started: the driver refuses them (on memory; no
    task runs here). A column of nulls only is no delay, no headers."""
    from pyspark.sql import types

    from aio_keuss.spark.source import KeussDataSource

    delay = {"backend": "memory", "queue": "typed", "delay_column": "d"}
    for kind in (types.StringType(), types.TimestampType(), types.BooleanType()):
        with pytest.raises(aio_keuss.ConfigError, match="delay_column 'd' is"):
            KeussDataSource(delay).writer(_columns(d=kind), False)
    for kind in (
        types.IntegerType(),
        types.LongType(),
        types.DoubleType(),
        types.FloatType(),
        types.DecimalType(6, 3),
        types.NullType(),
    ):
        KeussDataSource(delay).writer(_columns(d=kind), False)
    headers = {"backend": "memory", "queue": "typed", "headers_column": "h"}
    for kind in (types.LongType(), types.ArrayType(types.StringType()), types.BinaryType()):
        with pytest.raises(aio_keuss.ConfigError, match="headers_column 'h' is"):
            KeussDataSource(headers).writer(_columns(h=kind), False)
    nested = [types.ArrayType(types.StringType()), types.BinaryType(), types.StructType([])]
    for inner in nested:  # a header is one value
        for kind in (
            types.StructType(
                [types.StructField("k", types.StringType()), types.StructField("x", inner)]
            ),
            types.MapType(types.StringType(), inner),
        ):
            with pytest.raises(aio_keuss.ConfigError, match="headers_column 'h' is"):
                KeussDataSource(headers).writer(_columns(h=kind), False)
    for kind in (
        types.StringType(),
        types.MapType(types.StringType(), types.StringType()),
        types.StructType(
            [
                types.StructField("k", types.StringType()),
                types.StructField("t", types.TimestampType()),
                types.StructField("d", types.DecimalType(6, 2)),
            ]
        ),
        types.NullType(),
    ):
        KeussDataSource(headers).writer(_columns(h=kind), False)


def test_binary_inside_a_json_payload_is_refused_on_the_driver() -> None:
    """A binary column in the row made the payload, or a field of a struct payload column,
    that cannot be null failed every task at its first row (JSON has no bytes:
    InvalidPayloadError), after the job started: the driver refuses it, naming the column
    (on memory; no task runs here). One that may be null (or in an array or map, which may
    be empty) may hold no bytes in any row, and passes. A binary payload column is a bytes
    payload; a binary column taken as the delay's, headers' or priority's is no part of the
    payload."""
    from pyspark.sql import types

    from aio_keuss.spark.source import KeussDataSource

    def schema(name: str, kind: Any, nullable: bool) -> Any:
        return types.StructType(
            [types.StructField("n", types.LongType()), types.StructField(name, kind, nullable)]
        )

    binary = types.BinaryType()
    always = {
        "b": binary,
        "s": types.StructType([types.StructField("k", binary, False)]),
    }
    maybe = {
        "s": types.StructType([types.StructField("k", binary)]),
        "a": types.ArrayType(binary, False),
        "m": types.MapType(types.StringType(), binary, False),
    }
    whole_row = {"backend": "memory", "queue": "typed"}
    for name, kind in always.items():
        with pytest.raises(aio_keuss.ConfigError, match=f"column {name!r}"):
            KeussDataSource(whole_row).writer(schema(name, kind, False), False)
        KeussDataSource(whole_row).writer(schema(name, kind, True), False)
        if name != "b":
            as_payload = {**whole_row, "payload_column": name}
            with pytest.raises(aio_keuss.ConfigError, match=f"column {name!r}"):
                KeussDataSource(as_payload).writer(schema(name, kind, False), False)
    for name, kind in maybe.items():
        KeussDataSource(whole_row).writer(schema(name, kind, False), False)
        as_payload = {**whole_row, "payload_column": name}
        KeussDataSource(as_payload).writer(schema(name, kind, False), False)
    as_bytes = {**whole_row, "payload_column": "b"}
    KeussDataSource(as_bytes).writer(schema("b", binary, False), False)
    KeussDataSource({**whole_row, "payload_column": "n", "id_column": "b"}).writer(
        schema("b", binary, False), False
    )


def test_rows_read_from_a_queue_are_written_whole_into_another(
    spark: SparkSession, target: tuple[str, dict[str, Any]]
) -> None:
    """A DataFrame read from a queue, written whole (each row the payload) into another
    queue: its ``payload_bytes`` column is binary but null for every JSON message, and the
    write worked until the driver refused any binary column inside a JSON payload. A binary
    column that may be null passes the driver (a task fails at its first bytes value)."""
    backend, opts = target
    with sync.connect(backend, **opts) as factory:
        factory.queue("src").push_many([{"n": n} for n in range(5)])
    read = spark.read.format("aio_keuss").option("backend", backend).option("queue", "src")
    for key, value in opts.items():
        read = read.option(key, str(value))
    rows = read.load().cache()
    assert rows.count() == 5
    _writer(rows, backend, opts, "audit").save()
    payloads = _drain(backend, opts, "audit")
    assert sorted(orjson.loads(p["payload"])["n"] for p in payloads) == list(range(5))
    assert all(p["payload_bytes"] is None for p in payloads)
    rows.unpersist()


def test_columns_of_one_name_are_refused_on_the_driver() -> None:
    """Two columns of one name (a join, or ``SELECT id AS a, x AS a``) failed every attempt
    of every task (Spark cannot make the Arrow batch: DUPLICATED_FIELD_NAME_IN_ARROW_STRUCT;
    rows made into dicts would keep one of them), after the job started: the driver refuses
    them, naming the column (on memory; no task runs here)."""
    from pyspark.sql.types import ArrayType, LongType, StructField, StructType

    from aio_keuss.spark.source import KeussDataSource

    schema = StructType([StructField(name, LongType()) for name in ("a", "b", "a")])
    inner = StructType([StructField(name, LongType()) for name in ("x", "x")])
    nested = StructType([StructField("b", LongType()), StructField("s", ArrayType(inner))])
    for extra in ({}, {"payload_column": "b"}):
        options = {"backend": "memory", "queue": "dup", **extra}
        for columns, name in ((schema, "'a'"), (nested, "'x'")):
            with pytest.raises(aio_keuss.ConfigError, match=name):
                KeussDataSource(options).writer(columns, False)
            with pytest.raises(aio_keuss.ConfigError, match=name):
                KeussDataSource(options).streamWriter(columns, False)


def test_an_id_column_whose_values_make_no_id_is_refused_on_the_driver() -> None:
    """An id is text without spaces: the text of a timestamp ("2026-01-01 00:00:00+00:00"),
    a struct, a map or an array of two has one, so an id_column of those types failed every
    task at its first row (InvalidIdError), after the job started: the driver refuses it
    (on memory; no task runs here)."""
    from pyspark.sql import types

    from aio_keuss.spark.source import KeussDataSource

    options = {"backend": "memory", "queue": "ids", "id_column": "k", "payload_column": "n"}
    for kind in (
        types.TimestampType(),
        types.TimestampNTZType(),
        types.StructType([types.StructField("a", types.LongType())]),
        types.ArrayType(types.LongType()),
        types.MapType(types.StringType(), types.LongType()),
    ):
        with pytest.raises(aio_keuss.ConfigError, match="id_column 'k' is"):
            KeussDataSource(options).writer(_columns(k=kind), False)
    for kind in (
        types.StringType(),
        types.LongType(),
        types.DecimalType(8, 2),
        types.DoubleType(),
        types.DateType(),
        types.BooleanType(),
    ):
        KeussDataSource(options).writer(_columns(k=kind), False)


def test_rows_without_priorities_keep_the_push_many_path(
    pusher_target: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows without a priority go in by one ``push_many`` a batch, as before priorities:
    no per-row priority is made, and neither ``push_each`` nor the check of a priority
    column runs."""
    from aio_keuss.spark import executor

    backend, opts = pusher_target

    def never(*args: Any) -> Any:
        raise AssertionError("not on the fast path")

    monkeypatch.setattr(executor, "_push_each", never)
    monkeypatch.setattr(executor, "_push_many_at", never)
    monkeypatch.setattr(executor, "_priorities", never)
    spec = keuss_spark.WriteSpec(backend=backend, queue="fast", options=opts, batch_size=10)
    pusher = executor._pusher(spec, "job:0")
    assert not pusher._per_message and pusher._batch([{"n": 0}]).priorities == []
    assert keuss_spark.push_rows(spec, [{"n": n} for n in range(25)], "job:0") == 25
    taken = _taken(backend, opts, "fast")
    assert sorted(m.payload["n"] for m in taken) == list(range(25))
    assert all(m.priority == 0 for m in taken)


def test_rows_with_priorities_come_out_highest_first(
    pusher_target: tuple[str, dict[str, Any]],
) -> None:
    """A priority column (null: 0) goes in by ``push_each``, the column left out of the
    payload; ``priority`` by ``push_many``. Ids stay idempotent: pushed again, nothing
    doubles."""
    import pyarrow as pa

    backend, opts = pusher_target
    _prioritized(backend, opts)
    spec = keuss_spark.WriteSpec(
        backend=backend, queue="ranked", options=opts, priority_column="p", batch_size=3
    )
    rows = [{"n": n, "p": p} for n, p in enumerate([0, 5, None, -2, 5, 32767, -32768])]
    for _ in range(2):
        assert keuss_spark.push_rows(spec, rows, "job:0") == len(rows)
    taken = _taken(backend, opts, "ranked")
    assert [m.priority for m in taken] == [32767, 5, 5, 0, 0, -2, -32768]
    # rows of one batch (3 here) keep their order; a task's batches go in side by side
    # (up to three on the wire), so 1 and 4, of two batches, come in either order
    numbers = [m.payload["n"] for m in taken]
    assert numbers[0] == 5 and set(numbers[1:3]) == {1, 4} and numbers[3:] == [0, 2, 3, 6]
    assert all(set(m.payload) == {"n"} for m in taken)

    plain = keuss_spark.WriteSpec(backend=backend, queue="mixed", options=opts)
    high = dataclasses.replace(plain, priority=9)
    assert keuss_spark.push_rows(plain, [{"n": n} for n in range(3)], "plain:0") == 3
    batches = [pa.RecordBatch.from_pydict({"n": [3, 4]})]
    assert keuss_spark.push_arrow_batches(high, batches, "high:0") == 2
    taken = _taken(backend, opts, "mixed")
    assert [(m.payload["n"], m.priority) for m in taken] == [(3, 9), (4, 9), (0, 0), (1, 0), (2, 0)]


def test_the_priority_option_holds_beside_a_headers_or_delay_column(
    pusher_target: tuple[str, dict[str, Any]],
) -> None:
    """``priority`` with a headers or delay column: rows go by ``push_each`` then, each with
    that priority (they went in at 0, the option dropped)."""
    backend, opts = pusher_target
    _prioritized(backend, opts)
    spec = keuss_spark.WriteSpec(backend=backend, queue="meta", options=opts)
    assert keuss_spark.push_rows(spec, [{"n": 0}], "plain:0") == 1
    for column in ("headers_column", "delay_column"):
        high = dataclasses.replace(spec, priority=7, **{column: "m"})
        value: Any = {"k": "v"} if column == "headers_column" else 0.0
        assert keuss_spark.push_rows(high, [{"n": 1, "m": value}], f"{column}:0") == 1
    taken = _taken(backend, opts, "meta")
    assert [(m.payload["n"], m.priority) for m in taken] == [(1, 7), (1, 7), (0, 0)]


def test_a_struct_or_map_headers_column_keeps_its_nulls_timestamps_and_decimals(
    pusher_target: tuple[str, dict[str, Any]],
) -> None:
    """A struct (or map) headers column with a null field, a timestamp or a decimal failed the
    task at its first such row (InvalidHeadersError: a header is a str, int, float or bool),
    where the same struct through to_json() went in: its null fields omitted. Now a null is
    no header, and timestamps and decimals are text, as in a payload. The executor's path
    (rows as Arrow and Spark's Rows give them), without Spark."""
    import datetime as dt
    import decimal

    from pyspark.sql import Row

    backend, opts = pusher_target
    spec = keuss_spark.WriteSpec(
        backend=backend, queue="heads", options=opts, headers_column="h", batch_size=2
    )
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    given = {"a": None, "b": 1, "t": when, "d": decimal.Decimal("1.10"), "s": "x"}
    rows: list[Any] = [
        {"n": 0, "h": given},
        {"n": 1, "h": {"only": None}},
        Row(n=2, h=Row(**given)),
        {"n": 3, "h": None},
    ]
    assert keuss_spark.push_rows(spec, rows, "heads:0") == 4
    expected = {"b": 1, "t": "2026-01-02T03:04:05+00:00", "d": "1.10", "s": "x"}
    taken = sorted(_taken(backend, opts, "heads"), key=lambda m: m.payload["n"])
    assert [m.headers for m in taken] == [expected, {}, expected, {}]


def test_a_bad_priority_in_one_row_fails_before_its_batch_is_written(
    pusher_target: tuple[str, dict[str, Any]],
) -> None:
    """A value out of range or not an integer fails the task with InvalidInputError naming
    the row, before any row of its batch is written."""
    backend, opts = pusher_target
    _prioritized(backend, opts)
    spec = keuss_spark.WriteSpec(
        backend=backend, queue="badp", options=opts, priority_column="p", idempotent=False
    )
    good = [{"n": n, "p": n} for n in range(3)]
    for bad in (32768, -32769, 1.5, "2", True):
        with pytest.raises(aio_keuss.InvalidInputError, match=r"row 3 has .* in priority_column"):
            keuss_spark.push_rows(spec, [*good, {"n": 3, "p": bad}], None)
    assert keuss_spark.executor_queue(backend, "badp", opts).total_size() == 0


def test_the_read_schema_has_a_priority_column_after_mature(
    spark: SparkSession, target: tuple[str, dict[str, Any]]
) -> None:
    """Batch and stream reads show each message's priority (0 where the backend has none),
    in the column documented: after ``mature``, before ``payload_bytes``."""
    from aio_keuss.spark.source import KeussStreamReader, ReadSpec

    backend, opts = target
    with sync.connect(backend, **opts) as factory:
        capable = factory.capabilities.priority
        q = factory.queue("cols")
        q.push_many([{"n": 0}, {"n": 1}])
        q.push(b"raw", priority=4 if capable else 0)
    strings = {"backend": backend, "queue": "cols", **{k: str(v) for k, v in opts.items()}}
    reader = KeussStreamReader(ReadSpec.from_options(strings))
    try:
        end = reader.latestOffset(reader.initialOffset(), None)
        rows = [row for p in reader.partitions(reader.initialOffset(), end) for row in p.value]
        reader.commit(end)
    finally:
        reader.stop()
    raw = (4 if capable else 0, b"raw")
    assert sorted((row[5], row[6] or b"") for row in rows) == sorted([(0, b""), (0, b""), raw])
    assert sorted(orjson.loads(row[1])["n"] for row in rows if row[1] is not None) == [0, 1]

    with sync.connect(backend, **opts) as factory:
        factory.queue("cols").push_many([{"n": 2}, {"n": 3}])
    read = spark.read.format("aio_keuss")
    for key, value in strings.items():
        read = read.option(key, value)
    df = read.load()
    assert df.columns == [
        "id",
        "payload",
        "headers",
        "tries",
        "mature",
        "priority",
        "payload_bytes",
    ]
    assert dict(df.dtypes)["priority"] == "int"
    got = sorted((orjson.loads(r["payload"])["n"], r["priority"]) for r in df.collect())
    assert got == [(2, 0), (3, 0)]


def test_df_write_with_priorities_is_read_highest_first(
    spark: SparkSession, target: tuple[str, dict[str, Any]]
) -> None:
    """Through Spark: a priority column and a priority option, each row once, handed out
    highest first and read back with its priority."""
    backend, opts = target
    _prioritized(backend, opts)
    df = spark.range(40, numPartitions=2).selectExpr(
        "id", "CASE WHEN id % 4 = 0 THEN NULL ELSE CAST(id % 4 AS SMALLINT) END AS p"
    )
    _writer(df, backend, opts, "ranked", priority_column="p", batch_size=7).save()
    low = spark.range(5).selectExpr("id + 100 AS id")
    _writer(low, backend, opts, "ranked", priority=-1).save()
    with sync.connect(backend, **opts) as factory:
        q = factory.queue("ranked")
        taken = []
        while (m := q.pop(timeout=0)) is not None:
            taken.append((m.priority, m.payload))
    assert [p for p, _ in taken] == sorted((p for p, _ in taken), reverse=True)
    assert sorted(payload["id"] for _, payload in taken) == [*range(40), *range(100, 105)]
    assert all(set(payload) == {"id"} for _, payload in taken)
    assert all(p == (-1 if x["id"] >= 100 else x["id"] % 4) for p, x in taken)
