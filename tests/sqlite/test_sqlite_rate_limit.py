"""The SQLite rate limiter (``aio_keuss.sqlite.limiter``): one row of ``rates`` per queue,
its times on SQLite's clock, gone once idle (its own row, and idle rows of other queues),
and the table added to a file of the previous schema by its migration step. Each test on a
database file of its own in pytest's ``tmp_path``."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path

import pytest

import aio_keuss
from aio_keuss.contract import RateRule
from aio_keuss.sqlite.sql import migrations

pytestmark = pytest.mark.timeout(60)


def _rows(path: Path) -> dict[str, tuple[float, float]]:
    with contextlib.closing(sqlite3.connect(path)) as raw:
        found = raw.execute("SELECT queue, tat, held_until FROM rates").fetchall()
    return {queue: (tat, until) for queue, tat, until in found}


async def test_the_limiter_is_one_row_on_sqlites_clock_gone_once_idle(tmp_path: Path) -> None:
    path = tmp_path / "queues.db"
    async with aio_keuss.connect("sqlite", path=str(path)) as factory:
        q = await factory.queue("jobs", rate_limit=5, rate_period=3600)
        await q.push("x")
        before = time.time()
        assert (await q.pop(timeout=30)) is not None
        after = time.time()
        (tat, until) = _rows(path)["jobs"]
        assert until == 0.0
        # one grant of five an hour: 720 s on from SQLite's now, which holds whole
        # milliseconds (julianday), within the wall-clock times taken around the take
        now = tat - 720.0
        assert before - 0.002 <= now <= after
        assert now * 1000 == pytest.approx(round(now * 1000), abs=1e-3)
        # given back, the state is that of an idle limiter: none, the row gone
        await factory.backend.rate_take("jobs", RateRule(5, 3600.0, 5), -1, 0.0)
        assert "jobs" not in _rows(path)


async def test_a_hold_is_kept_on_the_row_until_it_ends(tmp_path: Path) -> None:
    path = tmp_path / "queues.db"
    async with aio_keuss.connect("sqlite", path=str(path)) as factory:
        rule = RateRule(100, 1.0, 100)
        grant = await factory.backend.rate_take("held", rule, 0, 120.0)
        assert grant.granted == 0 and grant.wait == pytest.approx(120.0, abs=0.01)
        again = await factory.backend.rate_take("held", rule, 10, 0.0)
        assert again.granted == 0 and 119.0 < again.wait <= 120.0
        (tat, until) = _rows(path)["held"]
        assert 119.0 < until - tat <= 120.0  # tat: the later step's clock


async def test_a_new_limiter_row_clears_those_of_idle_queues(tmp_path: Path) -> None:
    """Rows whose two times are past (queues no step has asked since) are deleted by the
    next step that makes a row, found by the index on the later time."""
    path = tmp_path / "queues.db"
    async with aio_keuss.connect("sqlite", path=str(path)) as factory:
        rule = RateRule(1, 3600.0, 1)
        await factory.backend.rate_take("busy", rule, 1, 0.0)
        with contextlib.closing(sqlite3.connect(path)) as raw:
            raw.executemany(
                "INSERT INTO rates (queue, tat, held_until) VALUES (?, ?, ?)",
                [(f"idle-{n}", 1000.0 + n, 2000.0 - n) for n in range(5)],
            )
            raw.commit()
            plan = raw.execute(
                "EXPLAIN QUERY PLAN " + factory.backend.sql["rate_purge"], (0.0,)
            ).fetchall()
        assert any("rates_by_expiry" in step[-1] for step in plan)
        assert (await factory.backend.rate_take("busy", rule, 1, 0.0)).granted == 0
        assert len(_rows(path)) == 6  # a step on a row already there deletes nothing else
        await factory.backend.rate_take("fresh", rule, 1, 0.0)
        assert set(_rows(path)) == {"busy", "fresh"}


async def test_a_file_of_the_previous_schema_gets_the_rates_table(tmp_path: Path) -> None:
    path = tmp_path / "queues.db"
    async with aio_keuss.connect("sqlite", path=str(path)) as factory:
        await (await factory.queue("jobs")).push("kept")
    with contextlib.closing(sqlite3.connect(path)) as old:  # as step 003 left it
        old.execute("DROP TABLE rates")
        old.execute("PRAGMA user_version = 3")
        old.commit()
    async with aio_keuss.connect("sqlite", path=str(path)) as factory:
        q = await factory.queue("jobs", rate_limit=1, rate_period=3600)
        message = await q.pop(timeout=30)
        assert message is not None and message.payload == "kept"
        assert "jobs" in _rows(path)
    with contextlib.closing(sqlite3.connect(path)) as migrated:
        assert migrated.execute("PRAGMA user_version").fetchone()[0] == migrations()[-1][0]


async def test_a_file_of_the_previous_schema_gets_the_refusal_count_and_keeps_its_limiters(
    tmp_path: Path,
) -> None:
    """Step 006 adds the limiter's count of refused takes to ``rates``: a limiter row
    written before reads as none refused, and is stepped on as it was (its grant spent)."""
    path = tmp_path / "queues.db"
    rule = RateRule(1, 3600.0, 1)
    async with aio_keuss.connect("sqlite", path=str(path)) as factory:
        assert (await factory.backend.rate_take("jobs", rule, 1, 0.0)).granted == 1
    with contextlib.closing(sqlite3.connect(path)) as old:  # as step 005 left it
        old.execute("ALTER TABLE rates DROP COLUMN refused")
        old.execute("PRAGMA user_version = 5")
        old.commit()
    async with aio_keuss.connect("sqlite", path=str(path)) as factory:
        refused = await factory.backend.rate_take("jobs", rule, 1, 0.0)
        assert (refused.granted, refused.refused) == (0, 1)
    with contextlib.closing(sqlite3.connect(path)) as migrated:
        assert migrated.execute("PRAGMA user_version").fetchone()[0] == migrations()[-1][0]
