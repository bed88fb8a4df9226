"""CPU per row of a Spark write's task, without Spark: what ``bench.spark_write`` times.

    .venv/bin/python -m bench.spark_cpu --backend redis-oq --rows 100000
    .venv/bin/python -m bench.spark_cpu --profile 25          # cProfile, top 25 by own time
    .venv/bin/python -m bench.spark_cpu --callgrind           # client instructions per row
    .venv/bin/python -m bench.spark_cpu --server-callgrind    # Redis's instructions per row

``bench.spark_write`` gives rows/s of a whole ``local[2]`` job, which on a shared machine
spreads widely from run to run and mixes the JVM's work, the Python workers' and the
server's. This runs what one write task's Python worker runs (the data source's ``write``
minus Spark's TaskContext) in one process: the rows of ``bench.spark_write``'s DataFrame
(``id``, ``name``, ``value``) as Arrow record batches of ``spark.sql.execution.arrow.
maxRecordsPerBatch`` rows (10,000, Spark's default), idempotent ids of a job key and the
partition, ``batch_size`` rows a push. A warm-up partition into a queue of its own connects
and loads the scripts first. It reports, per row:

- the process's CPU time (``time.process_time``: the task's thread and the sync shim's loop
  thread, which packs and sends), and the task thread's own (``time.thread_time``);
- for Redis backends, the server's: ``INFO commandstats`` microseconds of the EVALSHA calls
  and of all commands, and ``INFO cpu`` (user + sys) of the server process. Those count every
  client of the server: give ``--url`` a server of your own (``--own-redis`` starts one on a
  free port and stops it after) when others use the shared one.

``--profile N`` runs the partition under cProfile in both threads and prints the N
functions of most own time, merged. ``--callgrind`` counts the instructions of the client
process over the timed partition (every thread) as ``bench.instructions`` does, with
``valgrind --tool=callgrind --instr-atstart=no``; the count repeats within about half a per
cent whatever else the machine runs, where CPU times wander by several per cent.
``--server-callgrind`` starts a redis-server of its own under callgrind and counts its
instructions over the timed partition (``callgrind_control -z`` before it, ``-d`` after):
what a change to the scripts saves the server, to about half a per cent (a Debian
redis-server has no symbols, so the count is a total, not a breakdown).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import json
import os
import pstats
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ARROW_BATCH = 10_000
"""Spark's ``spark.sql.execution.arrow.maxRecordsPerBatch`` default: rows an Arrow batch
hands the writer."""
RESULT_MARK = "bench.spark_cpu result: "


def arrow_batches(first: int, rows: int, size: int = ARROW_BATCH) -> list[Any]:
    """``spark.range`` rows ``first`` .. ``first + rows - 1`` with bench.spark_write's
    columns, as Spark's Arrow writer hands them over (made before the clock starts)."""
    import pyarrow as pa  # type: ignore[import-untyped]

    batches = []
    for start in range(first, first + rows, size):
        ids = list(range(start, min(start + size, first + rows)))
        batches.append(
            pa.RecordBatch.from_pydict(
                {
                    "id": pa.array(ids, pa.int64()),
                    "name": pa.array([f"name-{i}" for i in ids], pa.string()),
                    "value": pa.array([i * 2 for i in ids], pa.int64()),
                }
            )
        )
    return batches


def server_counters(url: str) -> dict[str, float]:
    """EVALSHA / all commands' microseconds and calls, and the server's CPU seconds."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
        cpu = client.info("cpu")
    finally:
        client.close()
    evalsha = stats.get("cmdstat_evalsha", {})
    return {
        "evalsha_usec": float(evalsha.get("usec", 0)),
        "evalsha_calls": float(evalsha.get("calls", 0)),
        "all_usec": float(sum(s.get("usec", 0) for s in stats.values())),
        "cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
    }


def remove_prefix(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()


@contextlib.contextmanager
def own_redis(wrapper: Sequence[str] = (), pids: list[int] | None = None) -> Iterator[str]:
    """A redis-server of this run's own on a free port (no persistence), stopped after;
    ``wrapper``: what runs it (valgrind); its process id is appended to ``pids``."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="akcpu-redis-") as directory:
        server = subprocess.Popen(
            [*wrapper, binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", directory],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        if pids is not None:
            pids.append(server.pid)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            import redis

            for _ in range(1200):
                try:
                    redis.Redis.from_url(url).ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            yield url
        finally:
            server.terminate()
            server.wait(timeout=30)


def run(args: argparse.Namespace, start: Callable[[], None], stop: Callable[[], None]) -> dict:
    """The timed partition (and its warm-up); the measures, per row."""
    from aio_keuss import spark as keuss_spark
    from aio_keuss.spark.source import _push
    from aio_keuss.spark.spec import WriteSpec

    token = uuid.uuid4().hex[:10]
    prefix = f"akcpu-{token}"
    raw = {
        "backend": args.backend,
        "queue": "warmup",
        "url": args.url,
        "prefix": prefix,
        "batch_size": str(args.batch_size),
        **dict(setting.split("=", 1) for setting in args.set),
    }
    warm = WriteSpec.from_options(raw).with_job_key(uuid.uuid4().hex[:16])
    timed = WriteSpec.from_options({**raw, "queue": "timed"}).with_job_key(warm.job_key or "")
    warmup = arrow_batches(0, min(args.rows, 20_000))
    batches = arrow_batches(args.rows * args.partition, args.rows)
    try:
        _push(warm, iter(warmup), f"{warm.job_key}:9")
        factory = keuss_spark.executor_factory(timed.backend, timed.options)
        profiles: list[cProfile.Profile] = []
        if args.profile:
            loop_profile = cProfile.Profile()

            async def enable() -> None:
                loop_profile.enable()

            factory.call(enable)
            profiles = [cProfile.Profile(), loop_profile]
        before = server_counters(args.url) if args.backend.startswith("redis") else {}
        cpu, own, wall = time.process_time(), time.thread_time(), time.perf_counter()
        if getattr(args, "server_zero", None):
            args.server_zero()
        start()
        if profiles:
            profiles[0].enable()
        count = _push(timed, iter(batches), f"{timed.job_key}:{args.partition}")
        if profiles:
            profiles[0].disable()
        stop()
        if getattr(args, "server_dump", None):
            args.server_dump()
        cpu, own = time.process_time() - cpu, time.thread_time() - own
        wall = time.perf_counter() - wall
        after = server_counters(args.url) if args.backend.startswith("redis") else {}
        if profiles:

            async def disable() -> None:
                loop_profile.disable()

            factory.call(disable)
        if count != args.rows:
            raise RuntimeError(f"pushed {count} rows of {args.rows}")
        result: dict[str, Any] = {
            "rows": args.rows,
            "client_cpu_us_per_row": cpu / args.rows * 1e6,
            "task_thread_cpu_us_per_row": own / args.rows * 1e6,
            "wall_rows_per_s": args.rows / wall,
        }
        if before:
            calls = after["evalsha_calls"] - before["evalsha_calls"]
            result.update(
                evalsha_calls=calls,
                evalsha_us_per_row=(after["evalsha_usec"] - before["evalsha_usec"]) / args.rows,
                commands_us_per_row=(after["all_usec"] - before["all_usec"]) / args.rows,
                server_cpu_us_per_row=(after["cpu"] - before["cpu"]) / args.rows * 1e6,
            )
        if profiles:
            merged = pstats.Stats(profiles[0])
            merged.add(profiles[1])
            merged.sort_stats("tottime").print_stats(args.profile)
        return result
    finally:
        keuss_spark.close_executor_factories()
        if args.backend.startswith("redis"):
            remove_prefix(args.url, prefix)


def callgrind(args: argparse.Namespace) -> dict:
    """This run again in a child under callgrind, counting the timed partition only."""
    from bench.instructions import build_helper, callgrind_total

    helper = build_helper()
    with tempfile.TemporaryDirectory(prefix="akcpu-cg-") as directory:
        out = Path(directory) / "run.cg"
        child = [a for a in sys.argv[1:] if a not in ("--callgrind", "--own-redis")]
        command = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out}", sys.executable, "-m", "bench.spark_cpu",
            *child, "--url", args.url, "--helper", str(helper),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"the child failed under callgrind:\n{done.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(lines[-1][len(RESULT_MARK) :])
        result["client_instructions_per_row"] = callgrind_total(Path(f"{out}.1")) / args.rows
        if args.dumps:
            shutil.copy(f"{out}.1", args.dumps)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.spark_cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backend", default="redis-oq")
    parser.add_argument("--url", default=os.environ.get("AK_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--own-redis", action="store_true", help="start a server of its own")
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the timed partition")
    parser.add_argument("--partition", type=int, default=1, help="which partition's rows")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument(
        "--server-callgrind",
        action="store_true",
        help="run a redis-server of its own under callgrind: its instructions per row",
    )
    parser.add_argument("--dumps", help="with --callgrind: keep the dump at this path")
    parser.add_argument("--helper", help=argparse.SUPPRESS)  # the callgrind child's
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.server_callgrind:
            # the server's instructions over the timed partition only: zeroed before it,
            # dumped after (callgrind_control, Valgrind manual, "Callgrind")
            dumps = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="akcpu-sv-")))
            out = dumps / "server.cg"
            wrapper = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
            pids: list[int] = []
            args.url = stack.enter_context(own_redis(wrapper, pids))

            def server(flag: str) -> None:
                subprocess.run(["callgrind_control", flag, str(pids[0])], capture_output=True)

            args.server_zero = lambda: server("-z")
            args.server_dump = lambda: server("-d")
            args.server_out = out
        elif args.own_redis:
            args.url = stack.enter_context(own_redis())
        if args.callgrind:
            result = callgrind(args)
        else:
            start: Callable[[], None] = lambda: None  # noqa: E731
            stop: Callable[[], None] = lambda: None  # noqa: E731
            if args.helper:
                library = ctypes.CDLL(args.helper)
                start, stop = library.counting_start, library.counting_stop
            result = run(args, start, stop)
        if args.server_callgrind:
            from bench.instructions import callgrind_total

            dump = Path(f"{args.server_out}.1")
            result["server_instructions_per_row"] = callgrind_total(dump) / args.rows
            if args.dumps:
                shutil.copy(dump, args.dumps + ".server")
    if args.helper:
        print(RESULT_MARK + json.dumps(result), flush=True)
    else:
        print(json.dumps({"backend": args.backend, **result}, indent=1))


if __name__ == "__main__":
    main()
