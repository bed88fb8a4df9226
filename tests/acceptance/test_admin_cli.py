"""The admin commands of ``aio-keuss``, run as subprocesses against real servers: their
tables for people, their JSON for scripts, and their exit codes."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from backends import (
    POSTGRES_URL,
    REDIS_URL,
    _drop_mongo_database,
    _drop_postgres_schema,
    _drop_redis_prefix,
    new_token,
)
from mongo_server import MONGO_URL, start_mongo
from own_servers import free_port

import aio_keuss

pytestmark = pytest.mark.timeout(180)


@dataclass
class Cli:
    """The command line of one test's backend, and the same backend for the library."""

    backend: str
    options: dict[str, Any]

    def flags(self) -> list[str]:
        found = ["--backend", self.backend]
        for key, value in self.options.items():
            if key == "url":
                found += ["--url", value]
            else:
                found += ["--option", f"{key}={value}"]
        return found

    async def run(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "aio_keuss", *args, *self.flags()]
        return await asyncio.to_thread(
            subprocess.run,
            command,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ},
        )

    async def json(self, *args: str, stdin: str = "") -> Any:
        done = await self.run(*args, "--json", stdin=stdin)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def connect(self, **extra: Any) -> Any:
        return aio_keuss.connect(self.backend, **{**self.options, **extra})


@pytest.fixture
async def redis_cli() -> AsyncIterator[Cli]:
    options = {"url": REDIS_URL, "prefix": f"akt-{new_token()}"}
    yield Cli("redis-oq", options)
    await _drop_redis_prefix(options)


@pytest.fixture
async def postgres_cli() -> AsyncIterator[Cli]:
    options = {"url": POSTGRES_URL, "schema": f"akt_{new_token()}"}
    yield Cli("postgres", options)
    await _drop_postgres_schema(options)


@pytest.fixture
async def history_cli() -> AsyncIterator[Cli]:
    reason = start_mongo()
    if reason:
        pytest.skip(reason)
    options = {"url": MONGO_URL, "database": f"akt_{new_token()}"}
    yield Cli("mongo-history", options)
    await _drop_mongo_database(options)


async def test_push_peek_find_info_list_as_tables_and_json(redis_cli: Cli) -> None:
    cli = redis_cli
    one = await cli.json("push", "jobs", '{"n": 1}', "--header", "origin=cli")
    many = await cli.json("push", "jobs", stdin='{"n": 2}\n\n[3, 4]\n"five"\n')
    ids = one["ids"] + many["ids"]
    assert len(ids) == 4

    peeked = await cli.json("peek", "jobs", "-n", "3")
    assert [item["id"] for item in peeked["items"]] == ids[:3]
    assert peeked["items"][0]["payload"] == {"n": 1}
    assert peeked["items"][0]["headers"] == {"origin": "cli"}
    assert peeked["items"][0]["state"] == "ready" and peeked["cursor"] is not None
    rest = await cli.json("peek", "jobs", "--after", peeked["cursor"], "-n", "10")
    assert [item["id"] for item in rest["items"]] == ids[3:] and rest["cursor"] is None

    table = await cli.run("peek", "jobs", "--state", "all", "-n", "10")
    assert table.returncode == 0
    header, *lines = table.stdout.splitlines()
    assert header.split() == [
        "ID",
        "QUEUE",
        "STATE",
        "AT",
        "TRIES",
        "PRIORITY",
        "HEADERS",
        "PAYLOAD",
    ]
    assert [line.split()[0] for line in lines] == ids

    found = await cli.json("find", "jobs", ids[1])
    assert (found["id"], found["state"], found["payload"]) == (ids[1], "ready", {"n": 2})
    missing = await cli.run("find", "jobs", "nowhere", "--json")
    assert missing.returncode == 4 and json.loads(missing.stdout) is None

    info = await cli.json("info", "jobs")
    assert (info["queue"], info["size"], info["total"], info["paused"]) == ("jobs", 4, 4, False)
    assert info["stats"]["put"] == 4 and info["options"]["max_batch"] > 0
    assert info["next_mature"] is not None
    listed = await cli.json("list")
    assert [(r["queue"], r["total"]) for r in listed] == [("jobs", 4)]
    table = await cli.run("list")
    assert table.stdout.split()[:6] == ["QUEUE", "SIZE", "SCHEDULED", "RESERVED", "TOTAL", "PAUSED"]
    assert table.stdout.splitlines()[1].split() == ["jobs", "4", "0", "0", "4", "false"]


async def test_purge_asks_first_and_pop_takes(redis_cli: Cli) -> None:
    cli = redis_cli
    await cli.json("push", "jobs", stdin="1\n2\n3\n")
    declined = await cli.run("purge", "jobs", stdin="n\n")
    assert declined.returncode == 6 and "not confirmed" in declined.stderr
    popped = await cli.json("pop", "jobs")
    assert [m["payload"] for m in popped] == [1]
    confirmed = await cli.run("purge", "jobs", "--json", stdin="y\n")
    assert confirmed.returncode == 0, confirmed.stderr
    assert json.loads(confirmed.stdout) == {"queue": "jobs", "removed": 2}
    empty = await cli.run("pop", "jobs", "--json")
    assert empty.returncode == 4 and json.loads(empty.stdout) == []
    assert (await cli.json("purge", "jobs", "--yes"))["removed"] == 0


async def test_a_purge_interrupted_at_its_question_ends_at_once(redis_cli: Cli) -> None:
    """Ctrl-C at purge's question ends the command at once (exit 1, nothing removed): the
    question read stdin on the event loop's thread, where Python retries a read a signal
    interrupts, so the Ctrl-C waited for an Enter (or an end of input) to be seen. Stdin
    stays open here, as at a terminal nobody answers."""
    cli = redis_cli
    await cli.json("push", "jobs", "1")
    command = [sys.executable, "-m", "aio_keuss", "purge", "jobs", *cli.flags()]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None and process.stdout is not None
    asked = b""
    while b"[y/N]" not in asked:
        part = await process.stderr.read(100)
        assert part, asked
        asked += part
    process.send_signal(signal.SIGINT)
    try:  # a bound for a hung command, not a measure: it exits at once, or never
        rest = await asyncio.wait_for(process.stderr.read(), 60)
        await asyncio.wait_for(process.wait(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    said = (asked + rest).decode()
    assert process.returncode == 1, said
    assert "interrupted" in said and "nothing removed" in said, said
    assert await process.stdout.read() == b""
    assert (await cli.json("info", "jobs"))["total"] == 1


async def test_pause_resume_and_stats_watch(redis_cli: Cli) -> None:
    cli = redis_cli
    await cli.json("push", "jobs", "1")
    assert (await cli.json("pause", "jobs"))["paused"] is True
    assert (await cli.json("info", "jobs"))["paused"] is True
    assert (await cli.json("resume", "jobs"))["paused"] is False
    watched = await cli.run("stats", "--watch", "0.05", "--count", "2")
    assert watched.returncode == 0
    assert watched.stdout.count("-- ") == 2 and watched.stdout.count("QUEUE") == 2
    rows = await cli.json("stats", "jobs")
    assert rows[0]["queue"] == "jobs" and rows[0]["put"] == 1 and rows[0]["size"] == 1


async def test_requeue_and_move_on_postgres(postgres_cli: Cli) -> None:
    cli = postgres_cli
    async with cli.connect(deadletter={"max_ko": 0}) as factory:
        q = await factory.queue("jobs")
        ids = await q.push_many([1, 2, 3])
        for _ in ids:
            held = await q.reserve(timeout=5)
            assert held is not None
            await q.ko(held)
    dead = await cli.json("peek", "__deadletter__", "-n", "10")
    assert sorted(i["id"] for i in dead["items"]) == sorted(ids)
    assert dead["items"][0]["headers"]["x-dl-from-queue"] == "jobs"

    one = await cli.json("requeue", "__deadletter__", ids[0])
    assert one == {"moved": {ids[0]: ids[0]}}
    moved = await cli.json("move", "__deadletter__", "elsewhere", ids[1])
    assert moved == {"moved": {ids[1]: ids[1]}}
    gone = await cli.run("move", "__deadletter__", "elsewhere", ids[1], "--json")
    assert gone.returncode == 4 and json.loads(gone.stdout) == {"moved": {}}
    rest = await cli.json("requeue", "__deadletter__", "--origin", "jobs")
    assert rest == {"moved": {ids[2]: ids[2]}}
    listed = {r["queue"]: r["total"] for r in await cli.json("list")}
    assert listed == {"__deadletter__": 0, "jobs": 2, "elsewhere": 1}
    found = await cli.json("find", "jobs", ids[0])
    assert found["tries"] == 0 and found["state"] == "ready"


async def test_move_keeps_a_scheduled_message_scheduled_on_redis(redis_cli: Cli) -> None:
    await _move_keeps_a_scheduled_message_scheduled(redis_cli)


async def test_move_keeps_a_scheduled_message_scheduled_on_postgres(postgres_cli: Cli) -> None:
    await _move_keeps_a_scheduled_message_scheduled(postgres_cli)


async def _move_keeps_a_scheduled_message_scheduled(cli: Cli) -> None:
    """``move`` of a message pushed with a delay and not yet due made it ready at once in
    the target queue: its delay was lost. It stays scheduled there, due when it was."""
    async with cli.connect() as factory:
        q = await factory.queue("jobs")
        later = await q.push({"n": 1}, delay=3600)
    moved = await cli.json("move", "jobs", "elsewhere", later)
    assert moved == {"moved": {later: later}}
    found = await cli.json("find", "elsewhere", later)
    assert found["state"] == "scheduled", found
    popped = await cli.run("pop", "elsewhere")
    assert popped.returncode == 4, popped.stdout  # nothing due


async def test_a_bad_postgres_url_query_is_usage(postgres_cli: Cli) -> None:
    """A URL query asyncpg ignored (``?port=`` beside a host), or a server setting the
    server refuses at connect (``?bogus=1``: asyncpg sends what it does not know as one),
    is bad usage (exit 2), not a failure (1), and the password stays hidden."""
    for query in ("port=abc", "bogus=1"):
        url = f"{POSTGRES_URL}?{query}".replace("@", ":s3cret@", 1)
        bad = Cli("postgres", {**postgres_cli.options, "url": url})
        done = await bad.run("info", "jobs")
        assert done.returncode == 2, (query, done.returncode, done.stderr)
        assert query.partition("=")[0] in done.stderr and "s3cret" not in done.stderr


async def test_history_and_replay_on_mongo_history(history_cli: Cli) -> None:
    cli = history_cli
    pushed = (await cli.json("push", "done", stdin="1\n2\n"))["ids"]
    assert len(await cli.json("pop", "done", "-n", "2")) == 2
    kept = await cli.json("history", "done", "--since", "2020-01-01T00:00:00")
    assert sorted(i["id"] for i in kept["items"]) == sorted(pushed)
    assert all(i["state"] == "processed" for i in kept["items"])
    table = await cli.run("history", "done")
    assert table.returncode == 0 and "processed" in table.stdout
    copies = (await cli.json("replay", "done", pushed[0], "--to", "again"))["ids"]
    assert len(copies) == 1
    again = await cli.json("pop", "again")
    assert again[0]["headers"]["x-replay-of"] == pushed[0]
    found = await cli.json("find", "done", pushed[1])
    assert found["state"] == "processed"


async def test_pipelines_show_topology_and_sizes(redis_cli: Cli) -> None:
    cli = redis_cli
    async with cli.connect() as factory:
        await (await factory.queue("in")).push(1)
        topology = {"name": "etl", "stations": [], "queues": ["in", "out"]}
        await factory.stats_store.save_pipeline("etl", topology)
    shown = await cli.json("pipelines")
    assert shown["etl"]["queues"] == ["in", "out"]
    assert shown["etl"]["sizes"]["in"]["total"] == 1
    table = await cli.run("pipelines")
    assert [line.split()[:2] for line in table.stdout.splitlines()[1:]] == [
        ["etl", "in"],
        ["etl", "out"],
    ]


async def test_a_stored_pipeline_is_removed_so_a_changed_one_can_start(redis_cli: Cli) -> None:
    """A worker refuses to start a pipeline whose stored topology differs; an operator
    without code of their own forgets the stored one from the command line."""
    cli = redis_cli
    async with cli.connect() as factory:
        await factory.stats_store.save_pipeline("etl", {"name": "etl", "stations": []})
    removed = await cli.run("remove-pipeline", "etl")
    assert removed.returncode == 0, removed.stderr
    assert await cli.json("pipelines") == {}
    assert (await cli.run("remove-pipeline", "etl")).returncode == 4  # not found


async def test_push_with_a_priority_comes_out_first_and_shows_it(redis_cli: Cli) -> None:
    cli = redis_cli
    await cli.json("push", "jobs", '"plain"')
    urgent = await cli.json("push", "jobs", '"urgent"', "--priority", "9")
    found = await cli.json("find", "jobs", urgent["ids"][0])
    assert found["priority"] == 9
    popped = await cli.json("pop", "jobs")
    assert [(m["payload"], m["priority"]) for m in popped] == [("urgent", 9)]
    out_of_range = await cli.run("push", "jobs", '"x"', "--priority", "40000")
    assert out_of_range.returncode == 2 and "priority" in out_of_range.stderr
    plain_list = Cli("redis-list", cli.options)
    refused = await plain_list.run("push", "other", '"x"', "--priority", "1")
    assert refused.returncode == 5 and "priority" in refused.stderr
    assert [r["queue"] for r in await cli.json("list")] == ["jobs"]  # nothing else written


async def test_exit_codes_scripts_can_trust(redis_cli: Cli) -> None:
    cli = redis_cli
    bad_json = await cli.run("push", "jobs", "{nope")
    assert bad_json.returncode == 2 and "not JSON" in bad_json.stderr
    bad_flag = await cli.run("peek", "jobs", "-n", "0")
    assert bad_flag.returncode == 2
    # a watch every 0 s would ask the backend for its stats in a loop with no pause
    no_pause = await cli.run("stats", "jobs", "--watch", "0", "--count", "2")
    assert no_pause.returncode == 2 and "--watch" in no_pause.stderr, no_pause.stderr
    unsupported = await cli.run("history", "jobs")
    assert unsupported.returncode == 5 and "has no history" in unsupported.stderr
    assert (await cli.json("list")) == []  # nothing was written by the failures
    away = Cli("redis-oq", {"url": f"redis://127.0.0.1:{free_port()}/0", "prefix": "x"})
    unreachable = await away.run("list")
    assert unreachable.returncode == 3, unreachable.stderr


async def test_looking_at_a_mistyped_name_or_a_refused_write_records_no_queue(
    redis_cli: Cli,
) -> None:
    """Commands that only look or take answer 4 for a queue the backend does not know (they
    opened it, which recorded it, so a typo showed up in ``list`` and the dashboard); a
    refused push and a declined purge leave no queue behind either."""
    cli = redis_cli
    for args in (("info", "typo"), ("peek", "typo"), ("find", "typo", "x"), ("pop", "typo")):
        done = await cli.run(*args)
        assert done.returncode == 4 and "typo" in done.stderr, (args, done.stderr)
    assert (await cli.run("purge", "typo", stdin="n\n")).returncode == 4
    assert (await cli.run("push", "typo", "NaN")).returncode == 2
    assert (await cli.run("push", "typo", "[" * 100_000)).returncode == 2  # was a traceback
    assert (await cli.run("info", "bad name!")).returncode == 2
    assert (await cli.json("list")) == []


async def test_tables_show_control_characters_as_escapes(redis_cli: Cli) -> None:
    """A payload cannot drive the terminal that shows it (clear it, retitle it, forge a
    row): what a terminal would obey is printed as an escape."""
    cli = redis_cli
    payload = "\x1b[2J\x1b]0;PWNED\x07\nfake row"
    assert (await cli.run("push", "jobs", json.dumps(payload))).returncode == 0
    shown = await cli.run("peek", "jobs")
    assert shown.returncode == 0
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    assert "\\x1b[2J" in shown.stdout and "\\nfake row" in shown.stdout
    assert len(shown.stdout.strip().splitlines()) == 2  # the header and one row


async def test_the_cursor_hint_is_one_shell_word_shown_as_escapes(
    history_cli: Cli, tmp_path: Path
) -> None:
    """The "more after --after CURSOR" line is meant to be copied into the next command,
    and was printed raw: a cursor holds a "|" (a shell pipe), and on MongoDB and Redis the
    id it ends with, which may be any characters another program stored (quotes, "$(...)",
    a line break, terminal escapes, a bidi override). It is now one word the shell reads
    back as the cursor, with what a terminal would obey or hide written as escapes."""
    cli = history_cli
    first, second = (await cli.json("push", "jobs", stdin="1\n2\n"))["ids"]
    odd = "it's $(touch pwned) `x`\\\x1b]0;title\x07\nrow\u202eevil\x85\U0001f600|"
    pymongo = importlib.import_module("pymongo")
    client = pymongo.AsyncMongoClient(cli.options["url"])
    try:  # stored under another id, as another program may have
        database = client[cli.options["database"]]
        for name in await database.list_collection_names():
            doc = await database[name].find_one({"_id": first})
            if doc is not None:
                await database[name].insert_one({**doc, "_id": odd})
                await database[name].delete_one({"_id": first})
    finally:
        await client.close()
    cursor = (await cli.json("peek", "jobs", "-n", "1"))["cursor"]
    assert cursor is not None and cursor.endswith("|" + odd)
    shown = await cli.run("peek", "jobs", "-n", "1")
    assert shown.returncode == 0, shown.stderr
    assert not any(c in shown.stdout for c in "\x1b\x07\u202e\x85")
    hints = [line for line in shown.stdout.splitlines() if line.startswith("more after")]
    assert len(hints) == 1 and len(shown.stdout.splitlines()) == 3, shown.stdout
    word = hints[0].removeprefix("more after --after ")
    read_back = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", f"printf %s {word}"],
        capture_output=True,
        cwd=tmp_path,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
        timeout=60,
    )
    assert read_back.returncode == 0, read_back.stderr
    assert read_back.stdout.decode() == cursor
    assert os.listdir(tmp_path) == []  # nothing in it was run
    rest = await cli.json("peek", "jobs", "--after", cursor)
    assert [item["id"] for item in rest["items"]] == [second]


async def test_a_refused_move_requeue_or_replay_records_no_target_queue(
    postgres_cli: Cli,
) -> None:
    """Exit 2 is "bad usage ...; nothing was written": move / requeue / replay opened (and
    so recorded) their target queue before checking the ids and times they were given."""
    cli = Cli(postgres_cli.backend, {**postgres_cli.options, "history": "true"})
    assert (await cli.run("push", "jobs", "1")).returncode == 0
    bad_id = "x" * 1001  # longer than any id a store holds
    for args in (
        ("move", "jobs", "t1", bad_id),
        ("move", "jobs", "jobs", "x"),  # into itself: usage, not "gone or held" (4)
        ("requeue", "jobs", bad_id, "--origin", "t2"),
        ("replay", "jobs", "--since", "garbage", "--to", "t3"),
        ("replay", "jobs", bad_id, "--to", "t4"),
        ("replay", "jobs", "--since", "1e20", "--to", "t5"),
        ("replay", "jobs", "--to", "t6"),
    ):
        done = await cli.run(*args)
        assert done.returncode == 2, (args, done.returncode, done.stderr)
    assert [row["queue"] for row in await cli.json("list")] == ["jobs"]


async def test_a_push_refused_for_its_id_or_delay_records_no_queue(redis_cli: Cli) -> None:
    """Exit 2 and 5 say "nothing was written": a push whose --id is malformed, or whose --id
    or --delay the backend cannot do, opened (and so recorded) its queue first."""
    cli = redis_cli
    assert (await cli.run("push", "t1", "1", "--id", "bad id")).returncode == 2
    plain = Cli("redis-list", cli.options)  # no delays, no idempotent ids
    for args in (("push", "t2", "1", "--delay", "5"), ("push", "t3", "1", "--id", "x")):
        done = await plain.run(*args)
        assert done.returncode == 5, (args, done.returncode, done.stderr)
    assert (await cli.json("list")) == [] and (await plain.json("list")) == []


async def test_a_push_of_no_lines_pushes_nothing_and_records_no_queue(redis_cli: Cli) -> None:
    """An empty stdin (an empty file, a filter that matched nothing) pushes nothing: it
    opened the queue first, and so recorded a name nobody pushed into (a typo among them)
    in ``list`` and the dashboard."""
    cli = redis_cli
    for stdin in ("", "\n  \n"):
        assert await cli.json("push", "typo", stdin=stdin) == {"ids": []}
    assert (await cli.run("push", "bad name!", stdin="")).returncode == 2
    assert (await cli.json("list")) == []


# promote, reschedule, priority ---------------------------------------------------------------


async def test_promote_reschedule_and_priority_change_a_waiting_message(redis_cli: Cli) -> None:
    cli = redis_cli
    (later,) = (await cli.json("push", "jobs", '"later"', "--delay", "3600"))["ids"]
    done = await cli.json("promote", "jobs", later)
    assert done == {"queue": "jobs", "id": later, "changed": True}
    again = await cli.run("promote", "jobs", later)
    assert again.returncode == 4 and "not waiting" in again.stderr  # ready already
    assert (await cli.json("reschedule", "jobs", later, "--delay", "3600"))["changed"]
    assert (await cli.json("find", "jobs", later))["state"] == "scheduled"
    assert (await cli.json("priority", "jobs", later, "7"))["changed"]
    assert (await cli.json("find", "jobs", later))["priority"] == 7
    missing = await cli.run("reschedule", "jobs", "no-such-id", "--delay", "0")
    assert missing.returncode == 4


async def test_promote_reschedule_and_priority_refuse_before_writing(redis_cli: Cli) -> None:
    cli = redis_cli
    plain_list = Cli("redis-list", cli.options)
    for args in (
        ("promote", "jobs", "x"),
        ("reschedule", "jobs", "x", "--delay", "1"),
        ("priority", "jobs", "x", "1"),
    ):
        refused = await plain_list.run(*args)
        assert refused.returncode == 5 and "reschedule" in refused.stderr, (args, refused.stderr)
    assert (await cli.run("reschedule", "jobs", "x", "--delay", "-1")).returncode == 2
    assert (await cli.run("reschedule", "jobs", "x")).returncode == 2  # --delay is required
    assert (await cli.run("priority", "jobs", "x", "40000")).returncode == 2
    assert (await cli.run("promote", "jobs", "a\x01b" * 400)).returncode == 2
    assert (await cli.json("list")) == []  # nothing was written by the failures


async def test_result_on_redis(redis_cli: Cli) -> None:
    await _result_prints_a_kept_result_or_exits_4(redis_cli)


async def test_result_on_postgres(postgres_cli: Cli) -> None:
    await _result_prints_a_kept_result_or_exits_4(postgres_cli)


async def _result_prints_a_kept_result_or_exits_4(cli: Cli) -> None:
    """``result``: exit 5 where the backend keeps none, else the result, or exit 4."""
    async with cli.connect() as factory:
        if not factory.capabilities.results:
            missing = await cli.run("result", "jobs", "some-id")
            assert missing.returncode == 5, missing.stderr  # not supported
            return
        q = await factory.queue("jobs", result_ttl=600)
        message_id = await q.push({"n": 1})
        message = await q.reserve(timeout=30)
        assert message is not None
        await q.ok(message, result={"total": 3})
    shown = await cli.json("result", "jobs", message_id)
    assert (shown["id"], shown["ok"], shown["value"]) == (message_id, True, {"total": 3})
    assert shown["error"] is None and shown["finished"]
    missing = await cli.run("result", "jobs", "nowhere", "--json", "--wait", "0.1")
    assert missing.returncode == 4 and json.loads(missing.stdout) is None


@pytest.fixture(params=["redis-oq", "postgres"])
async def sql_or_redis_cli(request: pytest.FixtureRequest) -> AsyncIterator[Cli]:
    if request.param == "redis-oq":
        options = {"url": REDIS_URL, "prefix": f"akt-{new_token()}"}
        yield Cli("redis-oq", options)
        await _drop_redis_prefix(options)
    else:
        options = {"url": POSTGRES_URL, "schema": f"akt_{new_token()}"}
        yield Cli("postgres", options)
        await _drop_postgres_schema(options)


async def test_a_queue_whose_recorded_options_fail_to_apply_is_still_looked_at(
    sql_or_redis_cli: Cli,
) -> None:
    """Options a newer release recorded that this one refuses (or ones written by hand):
    the commands opened every queue with its recorded options, so one such queue made
    ``list`` and ``stats`` fail for every queue, and ``info`` / ``peek`` of it, exit 2 as
    if the command were misused. Now such a queue is opened with the defaults, as the
    dashboard does, and its record left as it was (a note on stderr says so)."""
    cli = sql_or_redis_cli
    async with cli.connect() as app:
        jobs = await app.queue("jobs", max_batch=7)
        await jobs.push({"n": 1})
        await (await app.queue("other")).push({"n": 2})
        refused = {**(await app.list())["jobs"], "max_batch": 0}
        await app.stats_store.save_options("jobs", refused)
    listed = await cli.run("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [(row["queue"], row["size"]) for row in json.loads(listed.stdout)] == [
        ("jobs", 1),
        ("other", 1),
    ]
    assert "'jobs'" in listed.stderr and "defaults" in listed.stderr
    stats = await cli.json("stats")
    assert [row["queue"] for row in stats] == ["jobs", "other"]
    peeked = await cli.json("peek", "jobs")
    assert [item["payload"] for item in peeked["items"]] == [{"n": 1}]
    async with cli.connect() as app:
        assert (await app.list())["jobs"]["max_batch"] == 0  # left as recorded


async def test_looking_at_a_queue_keeps_options_this_release_does_not_know(
    sql_or_redis_cli: Cli,
) -> None:
    """The commands open a queue with the options recorded for it "so looking at a queue
    never changes them", but the open recorded them again, whole: a name this release does
    not know (one a newer release recorded) was dropped from the record by a mere ``list``
    or ``info``. A queue the backend knows is now opened without being recorded again."""
    cli = sql_or_redis_cli
    async with cli.connect() as app:
        jobs = await app.queue("jobs", max_batch=7)
        await jobs.push({"n": 1})
        newer = {**(await app.list())["jobs"], "newer_option": 5}
        await app.stats_store.save_options("jobs", newer)
    for command in (["list"], ["info", "jobs"], ["peek", "jobs"], ["stats"], ["push", "jobs", "2"]):
        done = await cli.run(*command)
        assert done.returncode == 0, (command, done.stderr)
        async with cli.connect() as app:
            assert (await app.list())["jobs"] == newer, command
