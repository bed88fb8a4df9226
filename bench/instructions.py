"""`make bench-instructions`: client instructions per message, counted by callgrind.

Timed rows on a shared machine spread by up to 1.8x from one run to the next, which hides
the few per cent a change to the client adds or saves. Valgrind's callgrind counts the
instructions the client process executes ("Ir", Valgrind manual, "Callgrind: a call-graph
generating cache and branch prediction profiler"), and that count repeats within about half
a per cent whatever else the machine runs. It is not a rate: the servers' work, waits and
the machine's load are outside it. It says whether a change adds client work per message.

Each row runs in a child ``python`` under ``valgrind --tool=callgrind --instr-atstart=no``:
nothing is counted until the child switches instrumentation on with a client request
(``CALLGRIND_START_INSTRUMENTATION`` from ``valgrind/callgrind.h``, compiled here into a
tiny shared library and called through ctypes), so start-up, imports, connecting and
filling the queue are left out; it switches it off and dumps the count after the row. The
rows have bench's shapes (``python -m bench``): its payload, N clients each waiting for its
call before the next, ``consume`` with a prefetch of 10, on uvloop when installed. Redis
runs with ``write_mode="first"`` (what ``auto`` picks on a quiet machine) so that the count
does not follow the machine's load. Every child uses a key prefix, schema, database or file
of its own, removed after.

``--base REV`` (or ``--tree PATH``) counts another version of the library beside this
checkout's, each run of each row one after the other, and gives head / base.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROWS = ("push", "pop", "reserve+ok", "consume")
BACKENDS = (
    "memory",
    "redis-list",
    "redis-oq",
    "redis-reliable",
    "postgres",
    "sqlite",
    "mongo",
)
REPO = Path(__file__).resolve().parent.parent
HELPER_SOURCE = """\
#include <valgrind/callgrind.h>
void counting_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void counting_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT("counted"); }
"""
# The child's last stdout line starts with this, so that whatever else gets printed is no harm.
RESULT_MARK = "bench.instructions result: "


@dataclass
class Count:
    """One row of one backend in one tree: instructions per message of each run."""

    backend: str
    row: str
    tree: str
    messages: int
    clients: int
    per_message: list[float] = field(default_factory=list)
    ratio: float | None = None

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.per_message) if self.per_message else None


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- the child: one row, run under callgrind ------------------------------------------


async def run_clients(clients: int, total: int, work: Callable[[int], Awaitable[int]]) -> None:
    """Split ``total`` over ``clients`` tasks, as bench does, and check the sum."""
    shares = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    done = await asyncio.gather(*(work(share) for share in shares))
    if sum(done) != total:
        raise RuntimeError(f"expected {total} messages, handled {sum(done)}")


async def counted_row(
    q: Any, spec: dict[str, Any], start: Callable[[], None], stop: Callable[[], None]
) -> None:
    """Fill the queue (not counted), then count the row between ``start`` and ``stop``.
    Rows whose calls coalesce or batch by what is ready in a loop iteration (postgres's
    consume, for one) depend a little on the servers' timing, which is why a row is
    counted over thousands of messages and more than once."""
    row, total, clients = spec["row"], spec["messages"], spec["clients"]
    payload = spec["payload"]
    if row != "push":
        await q.push_many([payload] * total)

    async def push(share: int) -> int:
        for _ in range(share):
            await q.push(payload)
        return share

    async def pop(share: int) -> int:
        for _ in range(share):
            if await q.pop(timeout=60) is None:
                raise RuntimeError("pop timed out")
        return share

    async def reserve_ok(share: int) -> int:
        for _ in range(share):
            message = await q.reserve(timeout=60)
            if message is None or not await q.ok(message):
                raise RuntimeError("reserve timed out or ok failed")
        return share

    if row == "consume":
        done = asyncio.Event()
        handled = 0

        async def handler(message: Any) -> None:
            nonlocal handled
            handled += 1
            if handled == total:
                done.set()

        start()
        async with q.consume(handler, clients, prefetch=spec["prefetch"]):
            await asyncio.wait_for(done.wait(), timeout=3600)
        stop()
        return
    work = {"push": push, "pop": pop, "reserve+ok": reserve_ok}[row]
    if row == "push":
        # One push per client first, not counted: the other rows' fill opens the connections
        # and prepares the statements before their count starts, and so does this.
        await run_clients(clients, clients, push)
    start()
    await run_clients(clients, total, work)
    stop()


async def remove_own(backend: str, options: dict[str, Any]) -> None:
    """Remove what the child made: its prefix's keys, its schema or its database (the sqlite
    file goes with the parent's temporary directory)."""
    url = str(options.get("url", ""))
    if backend.startswith("redis"):
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        try:
            keys = [k async for k in client.scan_iter(match=f"{options['prefix']}:*", count=1000)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
    elif backend == "postgres":
        import asyncpg

        connection = await asyncpg.connect(url)
        try:
            await connection.execute(f'DROP SCHEMA IF EXISTS "{options["schema"]}" CASCADE')
        finally:
            await connection.close()
    elif backend == "mongo":
        from pymongo import AsyncMongoClient

        mongo: AsyncMongoClient[Any] = AsyncMongoClient(url)
        try:
            await mongo.drop_database(options["database"])
        finally:
            await mongo.close()


async def child_main(spec: dict[str, Any]) -> None:
    """One row on a fresh queue, in a queue named alike in every child (the prefix, schema,
    database or file is the child's own)."""
    import aio_keuss

    helper = ctypes.CDLL(spec["helper"]) if spec.get("helper") else None
    start: Callable[[], None] = helper.counting_start if helper else lambda: None
    stop: Callable[[], None] = helper.counting_stop if helper else lambda: None
    backend, options = spec["backend"], spec["options"]
    try:
        async with aio_keuss.connect(backend, **options) as factory:
            q = await factory.queue("counted")
            await counted_row(q, spec, start, stop)
    finally:
        await remove_own(backend, options)


def child(spec: dict[str, Any]) -> None:
    """Run in the child: uvloop as bench runs when installed, else asyncio's loop. Reports
    which library it imported, so that the parent can tell the tree it meant was counted."""
    import aio_keuss

    try:
        import uvloop
    except ImportError:
        asyncio.run(child_main(spec))
        loop = "asyncio"
    else:
        uvloop.run(child_main(spec))
        loop = "uvloop"
    library = str(Path(aio_keuss.__file__).resolve().parent)
    print(RESULT_MARK + json.dumps({"library": library, "loop": loop}), flush=True)


# --- the parent: the helper, the children, the table ----------------------------------


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "aio-keuss-bench"


def build_helper(directory: Path | None = None) -> Path:
    """Compile the client-request helper once per source text. A missing valgrind, gcc or
    callgrind.h stops the run with what to install rather than with counts of zero."""
    if shutil.which("valgrind") is None:
        raise SystemExit(
            "valgrind is not installed (Debian: apt-get install valgrind; "
            "`make bench-instructions` installs it)"
        )
    if shutil.which("gcc") is None:
        raise SystemExit("gcc is not installed; it compiles the callgrind client-request helper")
    directory = directory or cache_dir()
    digest = hashlib.sha256(HELPER_SOURCE.encode()).hexdigest()[:12]
    library = directory / f"counting-{digest}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / f"counting-{digest}.c"
    source.write_text(HELPER_SOURCE)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    built = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-o", str(partial), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        if "callgrind.h" in built.stderr:
            raise SystemExit(
                "valgrind/callgrind.h is missing (Debian's valgrind package installs it)"
            )
        raise SystemExit(f"gcc failed to build the callgrind helper:\n{built.stderr}")
    partial.replace(library)
    return library


def backend_options(backend: str, run: str, scratch: Path, url: str | None) -> dict[str, Any]:
    """Options for one child: the local test servers (or ``url``) and names of its own."""
    if backend.startswith("redis"):
        return {
            "url": url or "redis://127.0.0.1:6379/0",
            "prefix": f"akinstr{run}",
            "write_mode": "first",
        }
    if backend == "postgres":
        return {
            "url": url or "postgresql://postgres@127.0.0.1:5432/test",
            "schema": f"akinstr_{run}",
        }
    if backend == "mongo":
        return {"url": url or mongo_url(), "database": f"akinstr_{run}"}
    if backend == "sqlite":
        return {"path": str(scratch / f"akinstr-{run}.db")}
    return {}


def mongo_url() -> str:
    """The test suite's MongoDB: nx-27017 is started (at ``AK_NX_PORT``) when nothing answers
    there, and stopped when this process exits, as bench does."""
    sys.path.insert(0, str(REPO / "tests"))
    from mongo_server import MONGO_URL, start_mongo

    reason = start_mongo()
    if reason is not None:
        raise SystemExit(reason)
    return str(MONGO_URL)


def callgrind_total(dump: Path) -> int:
    """The Ir of a callgrind dump: its ``totals:`` line, else ``summary:`` (the format
    allows either; Valgrind manual, "Callgrind Format Specification")."""
    summary = None
    for line in dump.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
        if line.startswith("summary:"):
            summary = int(line.split()[1])
    if summary is None:
        raise RuntimeError(f"no totals or summary line in {dump}")
    return summary


def count_once(
    spec: dict[str, Any], tree: Path, dumps: Path, tag: str
) -> tuple[int, dict[str, Any]]:
    """Run one row in a child under callgrind; returns its instructions and its report."""
    out = dumps / f"{tag}.cg"
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        json.dumps(spec),
    ]
    # The script is run by path, so this checkout's counting code drives whichever library
    # PYTHONPATH puts first: the tree being counted.
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    results = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not results:
        raise SystemExit(
            f"{spec['backend']} {spec['row']} failed under callgrind:\n{done.stderr[-4000:]}"
        )
    report: dict[str, Any] = json.loads(results[-1][len(RESULT_MARK) :])
    # The request's dump is the first (OUT.1); the one at exit (OUT) counts nothing.
    return callgrind_total(Path(f"{out}.1")), report


def supported(backend: str, row: str) -> bool:
    """Whether the backend has the row's call (redis-list has no reserve, for one)."""
    from aio_keuss.registry import load_backend

    caps = load_backend(backend).capabilities
    return {"push": True, "pop": caps.pop}.get(row, caps.reserve)


def measure(args: argparse.Namespace, trees: dict[str, Path]) -> list[Count]:
    """Every run of every row, the trees one after the other within each run."""
    from bench.__main__ import PAYLOAD, PREFETCH

    helper = build_helper()
    backends, rows = split(args.backend, BACKENDS), split(args.rows, ROWS)
    counts: dict[tuple[str, str, str], Count] = {}
    loops: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="akinstr-") as name:
        scratch = Path(name)
        for backend in backends:
            for row in rows:
                if not supported(backend, row):
                    progress(f"{backend}: no {row}, skipped")
                    continue
                for run_no in range(1, args.runs + 1):
                    for label, tree in trees.items():
                        run = os.urandom(3).hex()
                        spec = {
                            "backend": backend,
                            "row": row,
                            "messages": args.messages,
                            "clients": args.clients,
                            "prefetch": PREFETCH,
                            "payload": PAYLOAD,
                            "helper": str(helper),
                            "options": backend_options(backend, run, scratch, args.url),
                        }
                        tag = f"{label}-{backend}-{row.replace('+', '')}-{run_no}"
                        total, report = count_once(spec, tree, args.dumps or scratch, tag)
                        expected = (tree / "aio_keuss").resolve()
                        if Path(report["library"]) != expected:
                            raise SystemExit(
                                f"the child counted {report['library']}, not {expected}"
                            )
                        loops.add(report["loop"])
                        key = (backend, row, label)
                        count = counts.setdefault(
                            key, Count(backend, row, label, args.messages, args.clients)
                        )
                        count.per_message.append(total / args.messages)
                        progress(
                            f"  {backend:<15} {row:<10} {label:<4} run {run_no}: "
                            f"{total / args.messages:,.0f} instructions/message"
                        )
    args.loop_seen = ",".join(sorted(loops))
    return with_ratios(list(counts.values()))


def with_ratios(counts: list[Count]) -> list[Count]:
    """head / base of the means, on the head's entry, when both were counted."""
    means = {(c.backend, c.row, c.tree): c.mean for c in counts}
    for c in counts:
        base = means.get((c.backend, c.row, "base"))
        if c.tree == "head" and base and c.mean is not None:
            c.ratio = c.mean / base
    return counts


def format_table(counts: Sequence[Count], runs: int) -> str:
    """A Markdown table like bench's: one line per backend, row and tree."""
    compare = any(c.tree == "base" for c in counts)
    run_cells = [f"run {n}" for n in range(1, runs + 1)]
    head = ["backend", "row", *(["tree"] if compare else []), *run_cells, "mean"]
    if compare:
        head.append("head/base")
    lines = []
    for c in counts:
        cells = [c.backend, c.row, *([c.tree] if compare else [])]
        cells += [f"{v:,.0f}" for v in c.per_message] + [""] * (runs - len(c.per_message))
        cells.append(f"{c.mean:,.0f}" if c.mean is not None else "")
        if compare:
            cells.append(f"{c.ratio:.4f}" if c.ratio is not None else "")
        lines.append(cells)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]

    labels = 3 if compare else 2  # the first columns are names, the others numbers

    def render(cells: list[str]) -> str:
        text = [
            cell.ljust(width) if i < labels else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(text) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([render(head), rule, *(render(line) for line in lines)])


def split(text: str, known: Sequence[str]) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise SystemExit(f"unknown {', '.join(unknown) or 'empty list'}; choose from {known}")
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--backend", default="memory", help=f"comma-separated, of {BACKENDS}")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    parser.add_argument("--messages", type=int, default=2000, help="messages per row")
    parser.add_argument("--clients", type=int, default=3, help="concurrent clients")
    parser.add_argument("--runs", type=int, default=2, help="children per row and tree")
    parser.add_argument("--url", help="server URL (default: the local test servers)")
    parser.add_argument("--json", action="store_true", help="one JSON record per line")
    parser.add_argument(
        "--dumps",
        type=Path,
        help="keep the callgrind dumps here (TAG.cg.1 is the row's) for callgrind_annotate",
    )
    other = parser.add_mutually_exclusive_group()
    other.add_argument("--tree", type=Path, help="another checkout to count beside this one")
    other.add_argument("--base", help="a git revision of this repository to count beside it")
    args = parser.parse_args(argv)
    split(args.backend, BACKENDS)
    split(args.rows, ROWS)
    if args.messages < 1 or args.clients < 1 or args.runs < 1:
        parser.error("--messages, --clients and --runs must be at least 1")
    if args.tree is not None and not (args.tree / "aio_keuss" / "__init__.py").is_file():
        parser.error(f"--tree {args.tree} holds no aio_keuss package")
    return args


def archive(rev: str, into: Path) -> Path:
    """``git archive REV aio_keuss bench`` unpacked: that revision's library, importable."""
    packed = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev, "aio_keuss", "bench"],
        capture_output=True,
        check=False,
    )
    if packed.returncode != 0:
        raise SystemExit(f"git archive {rev} failed: {packed.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=packed.stdout, check=True)
    return into


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dumps is not None:
        args.dumps.mkdir(parents=True, exist_ok=True)
        args.dumps = args.dumps.resolve()
    with tempfile.TemporaryDirectory(prefix="akinstr-base-") as base_dir:
        trees: dict[str, Path] = {}
        if args.base:
            trees["base"] = archive(args.base, Path(base_dir))
        elif args.tree is not None:
            trees["base"] = args.tree.resolve()
        trees["head"] = REPO
        counts = measure(args, trees)
    if args.json:
        for count in counts:
            print(json.dumps({**asdict(count), "mean": count.mean, "loop": args.loop_seen}))
    else:
        print(
            f"\nclient instructions per message (callgrind Ir; {args.messages:,} messages, "
            f"{args.clients} clients, {args.loop_seen} event loop)"
        )
        print(format_table(counts, args.runs))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
