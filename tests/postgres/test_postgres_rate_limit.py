"""The PostgreSQL rate limiter (``PostgresBackend.rate_take``): one row of ``rate_limits``
per queue, stepped by one upsert on the server's clock, shared by every backend and
process on the schema. Against the server of AK_POSTGRES_URL, each test in its own
schema."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest
from backends import POSTGRES_URL

import aio_keuss
from aio_keuss.contract import RateRule

pytestmark = pytest.mark.timeout(120)


async def _row(schema: str, queue: str) -> tuple[Any, float]:
    """The limiter's row of ``queue`` and the server's clock, read together."""
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        row = await connection.fetchrow(
            f"SELECT *, extract(epoch from clock_timestamp())::float8 AS server_now"
            f' FROM "{schema}".rate_limits WHERE queue = $1',
            queue,
        )
        count = await connection.fetchval(f'SELECT count(*) FROM "{schema}".rate_limits')
    finally:
        await connection.close()
    assert count == 1
    return row, row["server_now"]


@pytest.mark.parametrize("backend", ["postgres", "bucket-postgres"])
async def test_the_limiter_is_one_row_of_the_queue_on_the_servers_clock(
    schema: str, backend: str
) -> None:
    async with aio_keuss.connect(backend, url=POSTGRES_URL, schema=schema) as factory:
        q = await factory.queue("jobs", rate_limit=5, rate_period=3600)
        await q.push("x")
        assert (await q.pop(timeout=30)) is not None
        row, server_now = await _row(schema, "jobs")
        # one grant of five an hour spent: the next is due 720 s on, by the server's clock
        assert row["tat"] == pytest.approx(row["stepped"] + 720, abs=1e-3)
        assert row["stepped"] == pytest.approx(server_now, abs=60)
        assert row["held_until"] == 0
        # given back, the state is that of an idle limiter: the next grant due now
        grant = await factory.backend.rate_take("jobs", RateRule(5, 3600.0, 5), -1, 0.0)
        assert grant.wait == 0
        row, _ = await _row(schema, "jobs")
        assert row["tat"] == row["stepped"]


async def test_a_hold_is_kept_in_the_row_until_it_ends(schema: str) -> None:
    async with aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema) as factory:
        rule = RateRule(100, 1.0, 100)
        grant = await factory.backend.rate_take("held", rule, 0, 120.0)
        assert grant.granted == 0 and grant.wait == pytest.approx(120.0, abs=1e-3)
        again = await factory.backend.rate_take("held", rule, 10, 0.0)
        assert again.granted == 0 and 119.0 < again.wait <= 120.0
        row, server_now = await _row(schema, "held")
        assert row["held_until"] == pytest.approx(server_now + 120, abs=60)


async def test_concurrent_steps_of_two_factories_share_the_row_and_never_over_grant(
    schema: str,
) -> None:
    """The first steps race to insert the row (the losers update it under its lock), and
    every later one takes its turn on it: ten grants an hour are granted ten times in all,
    however many ask at once."""
    rule = RateRule(10, 3600.0, 10)
    async with (
        aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema) as one,
        aio_keuss.connect("bucket-postgres", url=POSTGRES_URL, schema=schema) as two,
    ):
        grants = await asyncio.gather(
            *(f.backend.rate_take("shared", rule, 1, 0.0) for _ in range(20) for f in (one, two))
        )
        assert sum(g.granted for g in grants) == 10
        # the refused were told when the next grant falls due: within the hour
        assert all(0 < g.wait <= 360.0 for g in grants if not g.granted)
        row, _ = await _row(schema, "shared")
        assert row["tat"] == pytest.approx(row["stepped"] + 3600, abs=60)


async def _limiters(schema: str) -> dict[str, float]:
    """Each limiter row's later time, less the server's clock: > 0 while it is ahead."""
    connection = await asyncpg.connect(POSTGRES_URL)
    try:
        rows = await connection.fetch(
            "SELECT queue, greatest(tat, held_until)"
            " - extract(epoch from clock_timestamp())::float8 AS ahead"
            f' FROM "{schema}".rate_limits'
        )
    finally:
        await connection.close()
    return {r["queue"]: r["ahead"] for r in rows}


@pytest.mark.parametrize("backend", ["postgres", "bucket-postgres"])
async def test_rows_whose_times_have_passed_are_reclaimed(schema: str, backend: str) -> None:
    """An idle queue's row stayed for ever (one per queue ever limited: queues named per
    tenant or per day pile up). A row whose times are past is the same as none; a client
    stepping a limiter drops such rows, a bounded batch at a time, and leaves those still
    ahead."""
    options = {"url": POSTGRES_URL, "schema": schema}
    async with aio_keuss.connect(backend, **options) as factory:
        await factory.queue("idle", rate_limit=5, rate_period=3600)  # makes the schema
    connection = await asyncpg.connect(POSTGRES_URL)
    try:  # rows left by queues idle for a day: more than one reclaim batch
        await connection.execute(
            f'INSERT INTO "{schema}".rate_limits (queue, tat, held_until, stepped, granted)'
            " SELECT 'idle' || g, $1::float8, $1::float8 - 60, $1::float8 - 60, 1"
            " FROM generate_series(1, 2500) g",
            time.time() - 86400,
        )
    finally:
        await connection.close()
    async with aio_keuss.connect(backend, **options) as factory:
        busy = await factory.queue("busy", rate_limit=5, rate_period=3600)
        await busy.push("y")
        assert (await busy.pop(timeout=30)) is not None
        for _ in range(1200):  # polled, 60 s at most: a hang guard
            if len(await _limiters(schema)) == 1:
                break
            await asyncio.sleep(0.05)
        assert list(await _limiters(schema)) == ["busy"]  # ahead by an hour: kept
