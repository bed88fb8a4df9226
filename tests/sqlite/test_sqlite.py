"""SQLite-specific behaviour: several processes and factories on one file, wake-ups across
processes, what survives a close, the file refused before anything is written to it, the
event loop free while another process holds the write lock, and ``:memory:``.

Each test works on a database file of its own in pytest's ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

import aio_keuss
from aio_keuss.sqlite.connection import (
    APPLICATION_ID,
    CHECKPOINT_BYTES,
    SqliteOptions,
    path_from_url,
)
from aio_keuss.sqlite.stats import SqliteStats

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

Open = Callable[..., Awaitable[aio_keuss.Factory]]


@pytest.fixture
def database(tmp_path: Path) -> str:
    return str(tmp_path / "queues.db")


@pytest.fixture
async def open_factory(database: str) -> AsyncIterator[Open]:
    """Factories on the test's file, closed after the test."""
    opened: list[aio_keuss.Factory] = []

    async def _open(**options: Any) -> aio_keuss.Factory:
        options.setdefault("path", database)
        factory = await aio_keuss.connect("sqlite", **options)
        opened.append(factory)
        return factory

    yield _open
    for factory in opened:
        with contextlib.suppress(aio_keuss.KeussError):
            await factory.close()


# consumers in other OS processes ----------------------------------------------------------

_CONSUMER = r"""
import asyncio, json, sys, time
import aio_keuss

async def main(path, mode, quiet):
    async with aio_keuss.connect("sqlite", path=path, poll_interval=30.0) as factory:
        q = await factory.queue("jobs")
        print("ready", flush=True)
        if mode == "wake":
            message = await q.reserve(timeout=20)
            print(json.dumps({"latency": time.time() - message.payload}), flush=True)
            await q.ok(message)
            return
        ids = []
        if mode == "paced":  # a first batch, then on when told (see the test)
            batch = await q.reserve_many(20, timeout=30)
            assert all(await asyncio.gather(*(q.ok(m) for m in batch))), "an ok failed"
            ids.extend(m.id for m in batch)
            print("took", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
        while True:
            batch = await q.reserve_many(20, timeout=quiet)
            if not batch:
                break
            assert all(await asyncio.gather(*(q.ok(m) for m in batch))), "an ok failed"
            ids.extend(m.id for m in batch)
        print(json.dumps({"ids": ids}), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


async def _spawn(path: str, mode: str, quiet: float = 1.5) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CONSUMER,
        path,
        mode,
        str(quiet),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    assert line.strip() == b"ready", line
    return process


async def _result(process: asyncio.subprocess.Process) -> dict[str, Any]:
    out, _ = await asyncio.wait_for(process.communicate(), 90)
    assert process.returncode == 0
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def test_two_processes_never_get_the_same_message(open_factory: Open, database: str) -> None:
    """Consumers in two processes and one here, on one file: every message is handed to
    exactly one of them (a reserve's select and update run under the file's write lock).
    Each other process takes a first batch, then all three go on together: waiting a fixed
    quiet time for its first one instead, a process started late on a busy machine found
    the others had taken everything."""
    factory = await open_factory()
    q = await factory.queue("jobs")
    workers = [await _spawn(database, "paced"), await _spawn(database, "paced")]
    pushed: list[str] = []
    for start in range(0, 2000, 100):
        pushed += await q.push_many([{"n": n} for n in range(start, start + 100)])
    for worker in workers:
        assert worker.stdout is not None and worker.stdin is not None
        assert (await asyncio.wait_for(worker.stdout.readline(), 60)).strip() == b"took"
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write(b"go\n")
        await worker.stdin.drain()
    mine: list[str] = []
    while batch := await q.reserve_many(10, timeout=1.0):
        assert all([await q.ok(m) for m in batch])
        mine.extend(m.id for m in batch)
    theirs = [(await _result(w))["ids"] for w in workers]
    taken = mine + theirs[0] + theirs[1]
    assert sorted(taken) == sorted(pushed)  # each exactly once
    assert all(theirs), "both other processes got messages"
    assert (await q.sizes()).total == 0


async def test_two_factories_in_one_process_share_exactly_once(open_factory: Open) -> None:
    """Two factories on one file have a connection (and a thread) each: they share the
    queue as two processes would."""
    first, second = await open_factory(), await open_factory()
    q1, q2 = await first.queue("jobs"), await second.queue("jobs")
    pushed = set(await q1.push_many(list(range(500))))

    async def drain(q: aio_keuss.Queue) -> list[str]:
        got: list[str] = []
        while batch := await q.reserve_many(7, timeout=0.5):
            assert all(await asyncio.gather(*(q.ok(m) for m in batch)))
            got.extend(m.id for m in batch)
        return got

    a, b = await asyncio.gather(drain(q1), drain(q2))
    assert len(a) + len(b) == len(pushed) and set(a) | set(b) == pushed


async def test_a_consumer_in_another_process_wakes_on_a_push(
    open_factory: Open, database: str
) -> None:
    """Its poll interval is 30 s: only the signal (a row it reads when PRAGMA data_version
    changes) can wake it that soon."""
    factory = await open_factory()
    q = await factory.queue("jobs")
    worker = await _spawn(database, "wake")
    await asyncio.sleep(0.5)  # it is waiting by now
    await q.push(time.time())
    latency = (await _result(worker))["latency"]
    assert latency < 15.0  # woken by a look at the file, not polled (30 s); generous bound


async def test_a_factory_in_this_process_wakes_on_another_factorys_push(
    open_factory: Open,
) -> None:
    consumer, producer = await open_factory(poll_interval=30.0), await open_factory()
    waiting = asyncio.create_task((await consumer.queue("jobs")).pop(timeout=20))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    await (await producer.queue("jobs")).push("hello")
    message = await waiting
    assert message is not None and message.payload == "hello"
    assert time.monotonic() - started < 15.0  # woken, not polled: the poll interval is 30 s


# durability -------------------------------------------------------------------------------


async def test_what_was_acknowledged_survives_closing_and_reopening(open_factory: Open) -> None:
    factory = await open_factory()
    q = await factory.queue("jobs")
    kept = await q.push({"keep": True}, headers={"h": 1})
    done = await q.push("done")
    retried = await q.push("retried")
    delayed = await q.push("later", delay=3600)
    first = await q.reserve(timeout=1)
    assert first is not None and first.id == kept
    assert await q.ko(first)  # back in the queue, one try spent
    for message in [await q.reserve(timeout=1), await q.reserve(timeout=1)]:
        assert message is not None
        if message.id == done:
            assert await q.ok(message)
        else:
            assert message.id == retried
            assert await q.ko(message)
    await factory.close()

    again = await open_factory()
    q = await again.queue("jobs")
    assert await q.sizes() == aio_keuss.Sizes(size=2, total=3, scheduled=1, reserved=0)
    left = {m.id: m for m in await q.pop_many(10, timeout=0)}
    assert set(left) == {kept, retried}
    assert left[kept].payload == {"keep": True} and left[kept].headers == {"h": 1}
    assert left[kept].tries == 1
    assert await q.remove(delayed)
    assert (await q.stats())["commit"] == 1


_PUSHER = r"""
import asyncio, sys
import aio_keuss

async def main(path):
    factory = await aio_keuss.connect("sqlite", path=path)
    q = await factory.queue("jobs", reserve_delay=3.0)
    for n in range(200):
        print(await q.push(n), flush=True)
    message = await q.reserve(timeout=1)
    print("reserved", message.id, flush=True)
    await asyncio.sleep(60)  # killed here, the factory never closed

asyncio.run(main(sys.argv[1]))
"""


async def test_what_a_killed_process_acknowledged_is_there_after_it(
    open_factory: Open, database: str
) -> None:
    """SIGKILL, no close: every push that returned is in the file (its commit is in the
    WAL, which the next connection recovers), and the message the process held comes back
    when its reservation ends."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _PUSHER,
        database,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert process.stdout is not None
    acknowledged: list[str] = []
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().split()
        if line[0] == "reserved":
            held = line[1]
            break
        acknowledged.append(line[0])
    process.kill()
    await process.wait()
    q = await (await open_factory()).queue("jobs")
    assert await q.sizes() == aio_keuss.Sizes(size=199, total=200, scheduled=0, reserved=1)
    got = [m.id for m in await q.pop_many(500, timeout=0)]
    assert held not in got and sorted(got) == sorted(set(acknowledged) - {held})
    again = await q.reserve(timeout=10)  # once the killed process's 3 s have passed
    assert again is not None and again.id == held and again.tries == 1


# bad files: refused before anything is written ------------------------------------------


def _exists(path: str) -> bool:
    return Path(path).exists()


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.parametrize(
    "options",
    [
        {"path": "/no/such/directory/queues.db"},
        {"url": "sqlite:////no/such/directory/queues.db"},
        {"path": 17},
        {"path": ""},
        {},
    ],
)
async def test_a_path_that_cannot_be_a_database_is_a_config_error(
    options: dict[str, Any],
) -> None:
    with pytest.raises(aio_keuss.ConfigError):
        await (await aio_keuss.connect("sqlite", **options)).close()
    assert not _exists("/no/such/directory")


async def test_a_path_ending_with_a_separator_is_refused(tmp_path: Path) -> None:
    """``queues/`` means a directory: SQLite made a file ``queues`` of it."""
    with pytest.raises(aio_keuss.ConfigError, match="directory"):
        await (await aio_keuss.connect("sqlite", path=f"{tmp_path / 'queues'}/")).close()
    assert _files(tmp_path) == {}


@pytest.mark.parametrize("seconds", [2_147_484, 1e9])
def test_a_busy_timeout_past_what_sqlite_takes_is_refused(seconds: float) -> None:
    """SQLite's busy timeout is an int of milliseconds: past it, the wrapped value turned
    the busy handler off and every write met a lock failed at once."""
    with pytest.raises(aio_keuss.ConfigError, match="busy_timeout"):
        SqliteOptions.parse({"path": ":memory:", "busy_timeout": seconds})
    SqliteOptions.parse({"path": ":memory:", "busy_timeout": 2_147_483})


@pytest.mark.parametrize("seconds", [1e-9, 0.0005])
def test_a_signal_poll_that_would_spin_the_thread_is_refused(seconds: float) -> None:
    """The database thread wakes for every look, idle or not: a signal_poll of a
    nanosecond kept a CPU core busy for an idle factory."""
    with pytest.raises(aio_keuss.ConfigError, match="signal_poll"):
        SqliteOptions.parse({"path": ":memory:", "signal_poll": seconds})
    SqliteOptions.parse({"path": ":memory:", "signal_poll": 0.001})


def test_a_path_the_file_system_cannot_encode_is_refused_before_opening() -> None:
    """A lone surrogate has no bytes in the file system's encoding: refused with the
    options, before a thread or a file is made for it."""
    with pytest.raises(aio_keuss.ConfigError, match="cannot be a file name"):
        SqliteOptions.parse({"path": "/tmp/queues-\ud800.db"})


async def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(aio_keuss.ConfigError, match="directory"):
        await (await aio_keuss.connect("sqlite", path=tmp_path)).close()
    assert _files(tmp_path) == {}


_OPEN_READ_ONLY = r"""
import asyncio, sys
import aio_keuss

async def main(path):
    try:
        factory = await aio_keuss.connect("sqlite", path=path)
    except aio_keuss.ConfigError as exc:
        print("refused:", exc)
        return
    async with factory:
        try:
            await factory.queue("jobs")
        except aio_keuss.KeussError as exc:
            print(f"opened, then {type(exc).__name__}: {exc}")
            return
        print("opened and written")

asyncio.run(main(sys.argv[1]))
"""


def _open_read_only(path: Path) -> str:
    """What a process that may read ``path`` but not write it makes of it (the last line
    of the script above). As root, whom file modes do not stop, the file is bound read-only
    over itself in a mount namespace of the child's own (``unshare``, mount(8) "bind
    mounts"): a read-only file system refuses root a write too."""
    python = [sys.executable, "-c", _OPEN_READ_ONLY, str(path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if os.geteuid() != 0:
        path.chmod(0o444)
        command = python
    else:
        bind = f'mount --bind {path} {path} && mount -o remount,bind,ro {path} && exec "$@"'
        command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", bind, "-"]
        probe = subprocess.run([*command, "true"], capture_output=True, check=False)
        if probe.returncode != 0:
            pytest.skip(f"no read-only bind mount here: {probe.stderr.decode().strip()}")
        command += python
    try:
        done = subprocess.run(command, capture_output=True, env=env, timeout=60, check=False)
    finally:
        path.chmod(0o644)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip().splitlines()[-1]


async def test_a_file_it_may_not_write_is_refused_at_connect(
    open_factory: Open, database: str
) -> None:
    """SQLite opens a file it may not write read-only without a word (sqlite3_open_v2:
    "or reading only if the file is write protected by the operating system"): the
    connect succeeded, and the first write (opening a queue, which records its options)
    failed. It is refused at connect, as a file that is not a database is."""
    async with await open_factory() as factory:
        await (await factory.queue("jobs")).push("kept")
    outcome = _open_read_only(Path(database))
    assert outcome.startswith("refused:"), outcome
    assert "read-only" in outcome, outcome
    async with await open_factory() as factory:  # left as it was
        assert await (await factory.queue("jobs")).pop(timeout=0) is not None


async def test_a_file_that_is_not_a_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"not a database, " * 512)
    before = _files(tmp_path)
    with pytest.raises(aio_keuss.ConfigError):
        await (await aio_keuss.connect("sqlite", path=str(path))).close()
    assert _files(tmp_path) == before


@pytest.mark.parametrize(
    "pragma",
    # the last leaves both marks at 0, as most programs do: a schema is not ours to take
    ["application_id = 1234", "user_version = 3", "user_version = 0"],
)
async def test_a_database_of_another_program_is_refused_untouched(
    tmp_path: Path, pragma: str
) -> None:
    path = tmp_path / "theirs.db"
    with contextlib.closing(sqlite3.connect(path)) as theirs:
        theirs.execute("CREATE TABLE t (x)")
        theirs.execute(f"PRAGMA {pragma}")
        theirs.commit()
    before = _files(tmp_path)
    with pytest.raises(aio_keuss.ConfigError, match="another program"):
        await (await aio_keuss.connect("sqlite", path=str(path))).close()
    assert _files(tmp_path) == before


async def test_a_schema_from_a_newer_release_is_refused(open_factory: Open, database: str) -> None:
    await (await open_factory()).close()
    with contextlib.closing(sqlite3.connect(database)) as raw:
        raw.execute("PRAGMA user_version = 999")
        raw.commit()
        assert raw.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    with pytest.raises(aio_keuss.ConfigError, match="newer aio-keuss"):
        await open_factory()


async def test_a_new_file_migrated_by_another_while_it_is_checked_is_taken(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes opening a new file at once: the check read the file's marks and its
    tables in separate statements, so one that read the marks before the other's migration
    committed and the tables after it took the file for another program's (ConfigError;
    two in six processes opening a new file at once). The other's whole open is run here
    between the check's first read and its second."""
    from aio_keuss.sqlite import connection

    with contextlib.closing(sqlite3.connect(database)) as empty:  # WAL: readers don't block it
        empty.execute("PRAGMA journal_mode = WAL")
    connect = connection._Thread._connect
    raced: list[str] = []

    def other_opens(statement: str) -> None:
        if statement == "PRAGMA user_version" and not raced:
            raced.append(statement)
            with contextlib.closing(sqlite3.connect(database, isolation_level=None)) as other:
                connection._setup(other, SqliteOptions.parse({"path": database}), False)

    def racing(self: Any) -> Any:
        opened = connect(self)
        if isinstance(opened, sqlite3.Connection):
            opened.set_trace_callback(other_opens)
        return opened

    monkeypatch.setattr(connection._Thread, "_connect", racing)
    async with aio_keuss.connect("sqlite", path=database, signal="local") as factory:
        await (await factory.queue("q")).push("here")
    assert raced
    monkeypatch.undo()
    async with aio_keuss.connect("sqlite", path=database) as factory:
        assert (await (await factory.queue("q")).sizes()).size == 1


@pytest.mark.parametrize(
    "url,path",
    [
        ("sqlite:///queues.db", "queues.db"),
        ("sqlite:///data/queues.db", "data/queues.db"),
        ("sqlite:////var/lib/queues.db", "/var/lib/queues.db"),
        ("SQLITE:////var/lib/queues.db", "/var/lib/queues.db"),
        ("sqlite://", ":memory:"),
        ("sqlite:///", ":memory:"),
        ("sqlite:///:memory:", ":memory:"),
    ],
)
def test_urls_are_read_as_sqlalchemy_reads_them(url: str, path: str) -> None:
    assert path_from_url(url) == path


@pytest.mark.parametrize(
    "url,path",
    [
        ("sqlite:///my%20queues.db", "my queues.db"),
        ("sqlite:////var/lib/a%23b%3Fc.db", "/var/lib/a#b?c.db"),
        ("sqlite:////var/lib/100%25.db", "/var/lib/100%.db"),
        ("sqlite:////var/lib/caf%C3%A9/q.db", "/var/lib/café/q.db"),
        ("sqlite:////var/l%69b/%71.db", "/var/lib/q.db"),  # unreserved, escaped or not
        ("sqlite:////var/lib/café.db", "/var/lib/café.db"),  # an IRI's letters as they are
        ("sqlite:///%3Amemory%3A", ":memory:"),
    ],
)
def test_url_escapes_are_decoded(url: str, path: str) -> None:
    """RFC 3986 and SQLite's own URI filenames decode ``%HH``: the file is the decoded
    name, not one with the escapes in it."""
    assert path_from_url(url) == path


@pytest.mark.parametrize(
    "name",
    [
        "a%.db",  # a '%' alone
        "a%2.db",  # one hex digit
        "a%zz.db",  # not hex
        "a%C3.db",  # a UTF-8 sequence cut short
        "a%FF.db",  # never UTF-8
        "a%00.db",  # NUL: no file name holds one
        "a%2Fb.db",  # an escaped separator is data, not a separator (RFC 3986, 2.2)
        "a%2fb.db",
        "a%20\ud800.db",  # a lone surrogate beside an escape: it has no UTF-8
    ],
)
async def test_a_bad_escape_in_a_url_is_refused_before_anything_is_written(
    tmp_path: Path, name: str
) -> None:
    url = f"sqlite:///{tmp_path}/{name}"
    with pytest.raises(aio_keuss.ConfigError, match="url"):
        SqliteOptions.parse({"url": url})
    with pytest.raises(aio_keuss.ConfigError, match="url"):
        await (await aio_keuss.connect("sqlite", url=url)).close()
    assert _files(tmp_path) == {}


async def test_a_url_with_escapes_opens_the_file_it_names(tmp_path: Path) -> None:
    """``%20`` and ``%23`` are a space and a ``#`` of the file's name: the queue is in
    ``my queues#1.db``, and no file with ``%`` in its name is made."""
    url = f"sqlite:///{tmp_path}/my%20queues%231.db"
    async with aio_keuss.connect("sqlite", url=url) as factory:
        await (await factory.queue("q")).push("here")
    async with aio_keuss.connect("sqlite", path=str(tmp_path / "my queues#1.db")) as factory:
        message = await (await factory.queue("q")).pop(timeout=0)
        assert message is not None and message.payload == "here"
    assert not [name for name in _files(tmp_path) if "%" in name]


async def test_a_relative_url_names_a_file_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    async with aio_keuss.connect("sqlite", url="sqlite:///here.db") as factory:
        await (await factory.queue("q")).push(1)
    assert (tmp_path / "here.db").is_file()


@pytest.mark.parametrize("name", ["file:queues.db", "file:q.db?mode=ro", "file:q.db?mode=memory"])
@pytest.mark.parametrize("option", ["path", "url"])
async def test_a_relative_name_starting_with_file_colon_is_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, option: str
) -> None:
    """SQLite built with SQLITE_USE_URI (this one, Debian's) reads a name starting with
    ``file:`` as a URI though sqlite3 did not ask for one: ``file:queues.db`` opened
    ``queues.db``, ``?mode=ro`` opened it read-only, ``?mode=memory`` a database in memory
    (which then failed to go to WAL). ``path=`` is a file name, taken as it is."""
    monkeypatch.chdir(tmp_path)
    url = "sqlite:///" + name.replace("?", "%3F")
    options = {"path": name} if option == "path" else {"url": url}
    async with aio_keuss.connect("sqlite", **options) as factory:
        await (await factory.queue("q")).push("here")
    assert set(_files(tmp_path)) == {name}
    async with aio_keuss.connect("sqlite", path=str(tmp_path / name)) as factory:
        message = await (await factory.queue("q")).pop(timeout=0)
        assert message is not None and message.payload == "here"


# bad input: refused before anything is written -------------------------------------------


@pytest.mark.parametrize("grown", ["payload", "headers"])
async def test_a_move_past_the_largest_row_is_refused_as_a_push_is(
    open_factory: Open, monkeypatch: pytest.MonkeyPatch, grown: str
) -> None:
    """A push larger than a row holds is refused (InvalidPayloadError) before anything is
    written, but a move's new payload or added headers were not checked: SQLite refused the
    row (BackendError, "string or blob too big") past 1e9 bytes, and past 2 GiB sqlite3's
    binding raised a bare OverflowError. Here the bound is lowered to keep the test small."""
    from aio_keuss.sqlite.store import SqliteStore

    monkeypatch.setattr(SqliteStore, "max_message_bytes", 1000)
    factory = await open_factory()
    q = await factory.queue("jobs")
    with pytest.raises(aio_keuss.InvalidPayloadError):
        await q.push("x" * 2000)
    await q.push("small")
    message = await q.reserve(timeout=0)
    assert message is not None
    big: dict[str, Any] = (
        {"payload": "x" * 2000} if grown == "payload" else {"headers": {"h": "x" * 2000}}
    )
    with pytest.raises(aio_keuss.InvalidPayloadError):
        await q.move(message, "other", **big)
    assert (await q.sizes()).reserved == 1
    assert (await (await factory.queue("other")).sizes()).total == 0
    assert await q.ok(message)


# the event loop and the write lock --------------------------------------------------------


async def test_the_event_loop_runs_while_another_process_holds_the_write_lock(
    open_factory: Open, database: str
) -> None:
    """A push waits (on the database thread) for a writer of another connection, up to the
    busy timeout, then fails with a typed connection error; the loop ticks on meanwhile,
    and the queue works again once the lock is let go."""
    factory = await open_factory(busy_timeout=0.5)
    q = await factory.queue("jobs")
    await q.push("warm-up")
    other = sqlite3.connect(database, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(aio_keuss.KeussConnectionError, match="locked"):
            await q.push("blocked")
        ticker.cancel()
        assert ticks >= 20  # the loop ran through the 0.5 s wait
    finally:
        other.execute("ROLLBACK")
        other.close()
    await q.push("after")
    assert [m.payload for m in await q.pop_many(10, timeout=0)] == ["warm-up", "after"]


# writes sharing a commit ---------------------------------------------------------------------


async def test_writes_queued_together_share_a_commit_and_fail_alone(open_factory: Open) -> None:
    """Writes queued behind each other on the database thread run in one transaction, each
    in a savepoint: the one that fails is undone and answered with its error, the others
    are kept."""
    backend = (await open_factory()).backend
    insert = "INSERT INTO stats (queue, counter, value) VALUES (?, 'x', 1)"

    def good(name: str) -> Callable[[sqlite3.Connection], int]:
        return lambda c: c.execute(insert, (name,)).rowcount

    def bad(c: sqlite3.Connection) -> int:
        c.execute(insert, ("bad",))
        raise ValueError("boom")

    busy = asyncio.ensure_future(backend.read(lambda c: time.sleep(0.3)))  # they queue up
    await asyncio.sleep(0.05)
    outcomes = await asyncio.gather(
        backend.write(good("a")),
        backend.write(bad),
        backend.write(good("b")),
        return_exceptions=True,
    )
    await busy
    assert outcomes[0] == 1 and outcomes[2] == 1
    assert isinstance(outcomes[1], ValueError)
    kept = await backend.read(lambda c: c.execute("SELECT queue FROM stats ORDER BY 1").fetchall())
    assert kept == [("a",), ("b",)]


# looking without taking ------------------------------------------------------------------


async def test_a_peek_walks_only_the_messages_of_its_state(open_factory: Open) -> None:
    """Scheduled and reserved messages are all past now, ready ones all at or before it: a
    peek of one state walks only that part of each priority's stretch of the index. Filtered
    row by row instead, a peek of the reserved ones read every ready message first (0.3 s
    a million here) and a peek of the ready ones every scheduled one after them, on the
    factory's one database thread, so every pop, push and ok of the factory waited. The
    work is counted in SQLite's virtual machine steps (a progress handler), not in time:
    fewer steps than the backlog it skips has messages."""
    factory = await open_factory(signal="local", stats="memory", reserve_delay=600.0)
    backend = factory.backend
    backlog, later = await factory.queue("backlog"), await factory.queue("later")
    size = 3000
    await backlog.push("held")
    await backlog.push("due later", delay=3600)
    await backlog.push_many(["ready"] * size)
    held = await backlog.reserve(timeout=0)
    assert held is not None and held.payload == "held"
    await later.push("ready")
    await later.push_many(["scheduled"] * size, delay=3600)
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    async def cost(q: aio_keuss.Queue, state: str) -> tuple[int, list[Any]]:
        nonlocal steps
        await backend.read(lambda c: c.set_progress_handler(count, 1))
        steps = 0
        try:
            found = [view.message.payload for view in await q.peek(10, state=state)]
        finally:
            await backend.read(lambda c: c.set_progress_handler(None, 1))
        return steps, found

    reserved_steps, reserved = await cost(backlog, "reserved")
    scheduled_steps, scheduled = await cost(backlog, "scheduled")
    ready_steps, ready = await cost(later, "ready")
    assert (reserved, scheduled, ready) == (["held"], ["due later"], ["ready"])
    assert max(reserved_steps, scheduled_steps, ready_steps) < size, (
        reserved_steps,
        scheduled_steps,
        ready_steps,
    )
    page = await backlog.page(state="reserved", limit=1)  # the cursor goes on from there
    assert [view.message.payload for view in page.items] == ["held"]
    assert page.cursor is not None
    rest = await backlog.page(state="reserved", after=page.cursor, limit=1)
    assert rest.items == [] and rest.cursor is None


# priorities ---------------------------------------------------------------------------------


async def test_a_file_of_the_schema_before_priorities_opens_with_its_messages_at_0(
    open_factory: Open, database: str, tmp_path: Path
) -> None:
    """A file the previous release made (schema version 2: no priority column, the
    (queue, mature, seq) index) is migrated on open: its messages read as priority 0, keep
    their order among themselves, and go after a message pushed with a priority."""
    from aio_keuss.sqlite.sql import migrations

    # messages as this release encodes them, copied into a file of the old schema
    source = str(tmp_path / "source.db")
    async with aio_keuss.connect("sqlite", path=source, signal="local") as factory:
        q = await factory.queue("jobs")
        for n in range(3):
            await q.push({"n": n}, headers={"old": "yes"})
    with contextlib.closing(sqlite3.connect(source)) as made:
        rows = made.execute(
            "SELECT queue, id, mature, payload, headers FROM messages ORDER BY seq"
        ).fetchall()
    with contextlib.closing(sqlite3.connect(database, isolation_level=None)) as old:
        for step, statements in migrations():
            if step <= 2:
                for statement in statements:
                    old.execute(statement)
        old.execute("PRAGMA user_version = 2")
        old.execute(f"PRAGMA application_id = {APPLICATION_ID:d}")
        old.executemany(
            "INSERT INTO messages (queue, id, mature, payload, headers) VALUES (?, ?, ?, ?, ?)",
            rows,
        )
        assert "priority" not in {r[1] for r in old.execute("PRAGMA table_info(messages)")}

    factory = await open_factory(signal="local")
    q = await factory.queue("jobs")
    assert [view.message.priority for view in await q.peek(5)] == [0, 0, 0]
    await q.push("urgent", priority=1)
    taken = await q.reserve_many(10, timeout=0)
    assert [(m.payload, m.priority) for m in taken] == [
        ("urgent", 1),
        ({"n": 0}, 0),
        ({"n": 1}, 0),
        ({"n": 2}, 0),
    ]
    assert all(m.headers == {"old": "yes"} for m in taken[1:])
    with contextlib.closing(sqlite3.connect(database)) as migrated:
        assert migrated.execute("PRAGMA user_version").fetchone()[0] == migrations()[-1][0]
        indexes = {r[1] for r in migrated.execute("PRAGMA index_list(messages)")}
        assert "messages_by_priority" in indexes and "messages_by_mature" not in indexes


async def test_the_take_steps_over_a_priority_of_unready_messages_in_one_seek(
    open_factory: Open,
) -> None:
    """Thousands of reserved messages of a high priority and thousands delayed of a higher
    one: a take of the one ready message below them, and the next mature time it answers,
    cost a seek or two a priority, not a row each of those (counted in SQLite's virtual
    machine steps, not in time, as the peek test does)."""
    factory = await open_factory(signal="local", stats="memory", reserve_delay=600.0)
    backend = factory.backend
    q = await factory.queue("mixed")
    size = 3000
    await q.push_many(["held"] * size, priority=5)
    while await q.size():
        await q.reserve_many(1000, timeout=0)
    await q.push_many(["later"] * size, priority=9, delay=3600)
    await q.push("plain")
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    await backend.read(lambda c: c.set_progress_handler(count, 1))
    try:
        taken = await q.reserve_many(10, timeout=0)
        next_mature = await q.next_mature_t()
    finally:
        await backend.read(lambda c: c.set_progress_handler(None, 1))
    assert [m.payload for m in taken] == ["plain"]
    assert next_mature is not None
    assert steps < size, steps


async def test_a_peek_lists_every_priority_in_mature_order_page_by_page(
    open_factory: Open,
) -> None:
    """Peek keeps its (mature, seq) order and cursor: the priorities are walked one by one
    and merged, so a page is the first messages of the queue whatever their priority."""
    factory = await open_factory(signal="local")
    q = await factory.queue("peeked")
    pushed = []
    for n, priority in enumerate([0, 3, -1, 3, 0, 7, -1, 0]):
        await q.push(n, priority=priority)
        pushed.append((n, priority))
    seen: list[tuple[int, int]] = []
    after = None
    while True:
        page = await q.page(limit=3, after=after)
        seen += [(v.message.payload, v.message.priority) for v in page.items]
        if page.cursor is None:
            break
        after = page.cursor
    assert seen == pushed


async def test_a_peek_sees_one_state_of_the_file_across_its_priorities(
    open_factory: Open, database: str
) -> None:
    """A peek walks the queue's priorities one statement each: another process changing a
    message's priority between two walks made one page list it twice (seen in its old
    priority's walk, then in its new one's), or not at all the other way round. The other
    process is played here by a connection of its own that commits the change as the
    second walk starts (SQLite's trace callback: before that statement reads anything)."""
    factory = await open_factory(signal="local", stats="memory")
    backend = factory.backend
    q = await factory.queue("peeked")
    moved = await q.push("moved", priority=5)
    await q.push("stays", priority=0)
    other = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    walks = 0

    def trace(statement: str) -> None:
        nonlocal walks
        if "WHEN 'scheduled'" in statement:  # a walk of one priority (query "peek")
            walks += 1
            if walks == 2:  # the walk of priority 0 begins: the change commits first
                other.execute("UPDATE messages SET priority = 0 WHERE id = ?", (moved,))

    await backend.read(lambda c: c.set_trace_callback(trace))
    try:
        views = await q.peek(10)
    finally:
        await backend.read(lambda c: c.set_trace_callback(None))
        other.close()
    assert walks == 2
    ids = [view.message.id for view in views]
    assert sorted(ids) == sorted(set(ids)), ids  # no message twice in one page
    assert len(ids) == 2, ids


def test_the_queries_of_the_take_and_the_peek_search_the_index() -> None:
    """What SQLite plans for them (EXPLAIN QUERY PLAN): searches of the (queue, priority,
    mature, seq) index, never a scan of the table nor a sort."""
    from aio_keuss.sqlite.sql import migrations, queries

    with contextlib.closing(sqlite3.connect(":memory:")) as c:
        for _, statements in migrations():
            for statement in statements:
                c.execute(statement)
        for name in ("level_below", "mature", "next_mature", "peek"):
            sql = queries()[name]
            arity = max(int(n) for n in re.findall(r"\?(\d+)", sql))  # all numbered
            plan = [r[3] for r in c.execute("EXPLAIN QUERY PLAN " + sql, [None] * arity)]
            # the walk of the priorities (next_mature) reads its own rows: "level"
            searches = [s for s in plan if "messages" in s or s.startswith("SCAN")]
            assert searches and all(
                re.match(r"SEARCH messages USING (COVERING )?INDEX messages_by_priority", s)
                or s in ("SCAN CONSTANT ROW", "SCAN level")
                for s in searches
            ), (name, plan)
            assert not any("TEMP B-TREE" in step for step in plan), (name, plan)


# extending a reservation -------------------------------------------------------------------


async def test_an_extend_batch_naming_an_id_more_than_once_runs_as_in_order(
    open_factory: Open,
) -> None:
    """Concurrent extends coalesce into one batch that may name an id several times: each
    request whose guard holds is true (an extension leaves the guard as it found it), a
    stale holder's is false, the last one that holds sets the end, and tries stay."""
    from aio_keuss.contract import Entry, Extend
    from aio_keuss.options import QueueOptions

    backend = (await open_factory()).backend
    store = await backend.store("q", QueueOptions())
    await store.insert([Entry(i, i.encode(), b"{}") for i in "abc"])
    assert len((await store.reserve(2, 30.0)).messages) == 2  # a and b, tries 0
    asked = time.time()
    flags = await store.extend(
        [
            Extend("a", 0, 600.0),
            Extend("a", 1, 5000.0),  # a holder it never had
            Extend("a", None, 1200.0),
            Extend("b", 0, 60.0),
            Extend("c", None, 60.0),  # never reserved
            Extend("x", None, 60.0),  # unknown
            Extend("b", None, 120.0),
        ]
    )
    assert flags == [True, False, True, True, False, False, True]
    rows = await backend.read(
        lambda c: c.execute(
            "SELECT id, tries, reserved, mature FROM messages WHERE queue = 'q' ORDER BY id"
        ).fetchall()
    )
    found = {r[0]: r[1:] for r in rows}
    assert [found[i][:2] for i in "abc"] == [(0, 1), (0, 1), (0, 0)]
    assert asked + 1200 <= found["a"][2] < asked + 5000
    assert asked + 120 <= found["b"][2] < asked + 600
    assert found["c"][2] <= time.time()


async def test_a_lapsed_reservation_another_factory_did_not_take_is_extended(
    open_factory: Open, database: str
) -> None:
    """The row of a lapsed reservation still says reserved with the tries its holder was
    given (the next reserve counts the lapse): the holder's extend finds it there and keeps
    those tries, and a consumer of another factory on the file then finds nothing."""
    holder = await (await open_factory(reserve_delay=60.0, poll_interval=5.0)).queue("jobs")
    rival = await (await open_factory(reserve_delay=60.0, poll_interval=5.0)).queue("jobs")
    await holder.push("x")
    held = await holder.reserve(timeout=5)
    assert held is not None and held.tries == 0
    with contextlib.closing(sqlite3.connect(database)) as connection, connection:
        connection.execute("UPDATE messages SET mature = mature - 3600")  # it lapses
    seen = await rival.find(held.id)
    assert seen is not None and seen.state == "ready" and seen.message.tries == 1
    assert await holder.extend(held, 60) is True
    seen = await rival.find(held.id)
    assert seen is not None and seen.state == "reserved" and seen.message.tries == 0
    assert await rival.reserve(timeout=0) is None
    assert await holder.ok(held) is True
    assert await rival.total_size() == 0


# checkpoints -------------------------------------------------------------------------------


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


async def test_a_commit_is_answered_before_the_checkpoint_it_calls_for(
    open_factory: Open, database: str
) -> None:
    """A push that takes the WAL past the checkpoint threshold is answered before any page
    is copied back into the database file (in WAL mode only a checkpoint writes that
    file): SQLite's automatic checkpoint ran inside that push's COMMIT. The checkpoint
    waits for the calls queued behind the push, then runs once the thread is idle."""
    factory = await open_factory(signal="local", synchronous="normal")
    backend = factory.backend
    q = await factory.queue("jobs")
    await q.push("warm-up")
    calls = backend._thread._calls
    before = _size(database)
    started, first, second = threading.Event(), threading.Event(), threading.Event()

    async def queued(count: int) -> None:
        for _ in range(3000):
            if calls.qsize() >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"fewer than {count} calls queued")

    def hold(c: sqlite3.Connection) -> bool:
        started.set()
        return first.wait(60)

    try:
        busy = asyncio.ensure_future(backend.read(hold))
        await asyncio.to_thread(started.wait, 60)  # the thread is held: what follows queues
        pushing = asyncio.ensure_future(q.push("x" * (CHECKPOINT_BYTES + CHECKPOINT_BYTES // 4)))
        await queued(1)  # the push's write
        behind = asyncio.ensure_future(backend.read(lambda c: second.wait(60)))
        await queued(2)  # a call behind it: the thread is not idle after the push's commit
        first.set()
        await pushing
        assert _size(database) == before, "pages were copied before the push was answered"
        second.set()
        await asyncio.gather(busy, behind)
    finally:  # a failure above must not leave the thread held
        first.set()
        second.set()
    for _ in range(3000):
        if _size(database) > before + CHECKPOINT_BYTES:
            break
        await asyncio.sleep(0.01)
    assert _size(database) > before + CHECKPOINT_BYTES, "no checkpoint once the thread was idle"


async def test_the_wal_stays_bounded_and_another_process_reads_every_message(
    open_factory: Open, database: str
) -> None:
    """A long stream of writes keeps the WAL file under a bound; while another
    connection's read snapshot holds the checkpoints back the WAL has to grow, and once it
    lets go the file comes back under the bound (SQLite's automatic checkpoint left it at
    its largest size for good). A consumer in another process then gets every message."""
    factory = await open_factory(synchronous="normal")
    q = await factory.queue("jobs")
    wal, bound = database + "-wal", 3 * CHECKPOINT_BYTES
    payload = "x" * 16_000
    pushed: list[str] = []

    async def stream(megabytes: int) -> int:
        largest = 0
        for _ in range(megabytes * 4):
            pushed.extend(await q.push_many([payload] * 16))  # 256 KB a commit
            largest = max(largest, _size(wal))
        return largest

    assert await stream(16) <= bound
    reader = sqlite3.connect(database, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM messages").fetchone()  # a snapshot, held
        assert await stream(16) > bound  # the checkpoints could not copy past it
    finally:
        reader.execute("COMMIT")
        reader.close()
    await stream(16)
    assert _size(wal) <= bound
    consumer = await _spawn(database, "reserve")
    assert sorted((await _result(consumer))["ids"]) == sorted(pushed)


# fork ----------------------------------------------------------------------------------------


def _call_in_a_forked_child(backend: Any) -> int:
    """In the child: 0 when a call on the parent's backend is refused with a typed error
    (at once: it must not wait for a thread the child does not have)."""

    async def call() -> int:
        try:
            async with asyncio.timeout(5):
                await backend.read(lambda connection: 1)
        except aio_keuss.KeussConnectionError:
            await backend.close()
            return 0
        return 1

    outcome: list[int] = []
    # a thread of its own: this one's thread-local still names the parent's running loop
    runner = threading.Thread(target=lambda: outcome.append(asyncio.run(call())))
    runner.start()
    runner.join()
    return outcome[0] if outcome else 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
async def test_a_backend_forked_into_a_child_refuses_calls_there(open_factory: Open) -> None:
    factory = await open_factory()
    q = await factory.queue("jobs")
    await q.push("before")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            code = _call_in_a_forked_child(factory.backend)
        finally:
            os._exit(code)
    _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    message = await q.pop(timeout=0)  # the parent's connection is untouched
    assert message is not None and message.payload == "before"


# :memory: ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options", [{"path": ":memory:"}, {"url": "sqlite://"}, {"url": "sqlite:///:memory:"}]
)
async def test_memory_databases_belong_to_one_factory(options: dict[str, Any]) -> None:
    async with aio_keuss.connect("sqlite", **options) as first:
        assert not first.capabilities.shared
        q = await first.queue("q")
        await q.push("only here")
        async with aio_keuss.connect("sqlite", **options) as second:
            assert await (await second.queue("q")).pop(timeout=0) is None
        message = await q.pop(timeout=0)
        assert message is not None and message.payload == "only here"


# the database thread -----------------------------------------------------------------------


def _outcome_within(seconds: float, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main`` on a loop of its own in a daemon thread and return what it returned or
    raised, or fail the test if it has not ended after ``seconds``: a reply nobody answers
    holds its caller past any ``asyncio.timeout``, so the wait is kept out of the test's
    loop."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(main()))
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(seconds)
    assert outcome, f"still waiting after {seconds} s"
    return outcome[0]


def test_a_connect_that_fails_oddly_fails_the_open(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sqlite3.connect`` raising something other than a ``sqlite3.Error`` ended the
    thread before it answered the open, which then waited for ever."""

    def refuse(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        raise ValueError("cannot encode that path")

    monkeypatch.setattr(sqlite3, "connect", refuse)

    async def main() -> Any:
        return await aio_keuss.connect("sqlite", path=database)

    assert isinstance(_outcome_within(10, main), aio_keuss.ConfigError)


def test_a_failed_database_thread_answers_every_call(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the thread fail outside a call's work, the call it was serving and those
    queued or made after are answered with a connection error, not left waiting."""
    from aio_keuss.sqlite import connection

    async def main() -> list[Any]:
        factory = await aio_keuss.connect("sqlite", path=database, signal="local")
        backend = factory.backend

        def broken(self: Any, first: Any) -> list[Any]:
            raise RuntimeError("a bug on the database thread")

        monkeypatch.setattr(connection._Thread, "_group", broken)
        outcomes = list(
            await asyncio.gather(
                backend.write(lambda c: 1),
                backend.read(lambda c: 2),
                return_exceptions=True,
            )
        )
        try:
            await backend.read(lambda c: 3)
        except aio_keuss.KeussError as exc:
            outcomes.append(exc)
        await backend.close()
        return outcomes

    outcomes = _outcome_within(10, main)
    assert isinstance(outcomes, list) and len(outcomes) == 3
    assert all(isinstance(o, aio_keuss.KeussConnectionError) for o in outcomes), outcomes


def _database_threads(database: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"aio-keuss sqlite {database}"]


async def test_a_cancelled_close_still_ends_the_thread(database: str) -> None:
    """The close's own call refuses cancellation, but the cancellation came back once it
    was answered, before the thread was told to stop: it waited for calls for ever."""
    factory = await aio_keuss.connect("sqlite", path=database, signal="local")
    backend = factory.backend
    busy = asyncio.ensure_future(backend.read(lambda c: time.sleep(0.3)))
    closing = asyncio.ensure_future(backend.close())
    await asyncio.sleep(0.05)  # its call waits behind the busy one
    closing.cancel()
    await busy
    with pytest.raises(asyncio.CancelledError):
        await closing
    for _ in range(100):
        if not _database_threads(database):
            break
        await asyncio.sleep(0.02)
    assert _database_threads(database) == []
    await factory.close()


async def _queued(backend: Any, count: int) -> None:
    """Until ``count`` calls wait on the database thread's queue."""
    calls = backend._thread._calls
    for _ in range(3000):
        if calls.qsize() >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {count} calls queued")


async def test_nothing_runs_on_the_connection_after_the_close_call(
    database: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write that takes the WAL past the checkpoint threshold with the close's call queued
    behind it leaves its checkpoint for later; the thread then tried it right after the
    close's call had closed the connection, and logged "sqlite checkpoint failed" with a
    traceback ("Cannot operate on a closed database"). Another factory keeps the WAL file;
    the test's loop is held until the thread has looked, so the stop cannot come first."""
    from aio_keuss.sqlite import connection

    looked_after_close = threading.Event()
    checkpoint_if_due = connection._Thread._checkpoint_if_due

    def watched(self: Any, c: sqlite3.Connection) -> None:
        try:
            checkpoint_if_due(self, c)
        finally:
            try:
                c.execute("SELECT 1")
            except sqlite3.ProgrammingError:  # closed: this look came after the close
                looked_after_close.set()

    monkeypatch.setattr(connection._Thread, "_checkpoint_if_due", watched)
    caplog.set_level(logging.WARNING, logger="aio_keuss.sqlite")
    keeper = await aio_keuss.connect("sqlite", path=database, signal="local")
    try:
        factory = await aio_keuss.connect(
            "sqlite", path=database, signal="local", stats="memory", synchronous="normal"
        )
        backend = factory.backend
        q = await factory.queue("jobs")
        started, gate = threading.Event(), threading.Event()

        def hold(c: sqlite3.Connection) -> bool:
            started.set()
            return gate.wait(60)

        try:
            busy = asyncio.ensure_future(backend.read(hold))
            await asyncio.to_thread(started.wait, 60)  # what follows queues behind it
            pushing = asyncio.ensure_future(
                q.push("x" * (CHECKPOINT_BYTES + CHECKPOINT_BYTES // 4))
            )
            await _queued(backend, 1)  # the push's write
            closing = asyncio.ensure_future(backend.close())
            await _queued(backend, 2)  # the close's call, behind it
            gate.set()
            # the loop is held here, so the close cannot tell the thread to stop yet
            looked_after_close.wait(10)
            await asyncio.gather(busy, pushing, closing)
        finally:
            gate.set()
        await factory.close()
    finally:
        await keeper.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# stats flushes ------------------------------------------------------------------------------


class _WritesSeen:
    """The factory's backend, setting ``sent`` when a write is handed to its thread."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.sent = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def write(self, work: Callable[[sqlite3.Connection], Any]) -> Awaitable[Any]:
        self.sent.set()  # the test runs on once the caller waits for the reply
        return self._real.write(work)


@pytest.mark.parametrize("committed", [False, True], ids=["write-failed", "write-committed"])
async def test_a_stats_flush_cancelled_on_the_database_thread_lands_once(
    open_factory: Open, database: str, committed: bool
) -> None:
    """The database thread runs a write whatever becomes of its caller, and a caller
    cancelled meanwhile learns only that it was cancelled, not whether the write committed.
    A stats flush cancelled so dropped its batch: lost when the write failed (the file
    locked by another process). It is now sent again by the next flush, and lands once
    whether the cancelled write committed or not."""
    factory = await open_factory(busy_timeout=0)  # a locked file fails the write at once
    backend = _WritesSeen(factory.backend)
    store = SqliteStats(backend)  # type: ignore[arg-type]
    gate = threading.Event()
    held = asyncio.ensure_future(factory.backend.read(lambda c: gate.wait(60)))
    other = sqlite3.connect(database, isolation_level=None)
    try:
        if not committed:
            other.execute("BEGIN IMMEDIATE")  # another connection holds the write lock
        store.incr("q", "put", 7)
        flushing = asyncio.create_task(store.flush())
        await backend.sent.wait()  # the flush's write waits behind the held call
        flushing.cancel()
        gate.set()  # the thread goes on to the flush's write
        await held
        with pytest.raises(asyncio.CancelledError):
            await flushing
    finally:
        gate.set()
        if other.in_transaction:
            other.execute("ROLLBACK")
        other.close()
    await store.close()  # its last flush sends what is not known to have landed
    assert (await factory.stats_store.counters("q"))["put"] == 7  # neither lost nor twice


async def test_a_closed_factory_leaves_no_database_thread(database: str) -> None:
    """A close returns once its database thread has ended, not as soon as it was told to:
    a caller counting threads after a close (a test, a fork, an embedding host) found it
    still there."""
    for _ in range(20):
        factory = await aio_keuss.connect("sqlite", path=database)
        await (await factory.queue("jobs")).push(1)
        await factory.close()
        assert not [t for t in threading.enumerate() if t.name.startswith("aio-keuss sqlite")]


async def test_a_failed_connect_leaves_no_database_thread(tmp_path: Path) -> None:
    """A connect refused at open (here: a file that is not a database) raises once its
    database thread has ended, as a close returns once it has: the thread was told to stop
    and left running, so a caller counting threads after the refusal (a retry loop, a fork,
    a test) found one more per failed connect."""
    path = tmp_path / "notes.txt"
    path.write_bytes(b"not a database, " * 512)
    for _ in range(20):
        with pytest.raises(aio_keuss.ConfigError):
            await aio_keuss.connect("sqlite", path=str(path))
        assert not [t for t in threading.enumerate() if t.name.startswith("aio-keuss sqlite")]


def test_sizes_reads_no_row_of_what_is_ready() -> None:
    """What SQLite plans for "sizes" (EXPLAIN QUERY PLAN): the queue is counted in its index
    alone (a covering index), and rows are read only in the stretch past now of each
    priority (scheduled and reserved messages, for their reserved flag). Summing over every
    row, a sizes() read each message of a backlog from the table, several times slower than
    counting its index, on the factory's one database thread."""
    from aio_keuss.sqlite.sql import migrations, queries

    with contextlib.closing(sqlite3.connect(":memory:")) as c:
        for _, statements in migrations():
            for statement in statements:
                c.execute(statement)
        plan = [r[3] for r in c.execute("EXPLAIN QUERY PLAN " + queries()["sizes"], ["q", 1.0])]
    reads = [s for s in plan if "messages" in s]
    assert reads, plan
    assert not any(s.startswith("SCAN messages") for s in reads), plan
    for step in reads:  # a search reading rows is bounded to what is past now
        assert "COVERING INDEX" in step or "mature>?" in step, plan


async def test_sizes_of_every_state_across_priorities(open_factory: Open) -> None:
    """Ready (a lapsed reservation among them), scheduled and reserved messages at three
    priorities, counted as the states peek shows them."""
    async with await open_factory() as factory:
        q = await factory.queue("jobs", reserve_delay=100.0)
        for priority in (5, 0, -3):
            await q.push_many([1, 2, 3], priority=priority)
            await q.push(4, priority=priority, delay=100.0)
        taken = await q.reserve_many(4, timeout=0)  # the three of 5, one of 0
        assert len(taken) == 4
        assert await q.extend(taken[0], 0.001)  # lapses: ready again
        await asyncio.sleep(0.05)
        views = await q.peek(100, state="all")
        by_state = {s: sum(v.state == s for v in views) for s in ("ready", "scheduled")}
        assert by_state == {"ready": 6, "scheduled": 3}
        assert await q.size() == 6
        assert await q.sched_size() == 3
        assert await q.resv_size() == 3
        assert await q.total_size() == 12
