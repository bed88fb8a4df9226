"""The dashboard's Board on real servers, without a browser: what reading a backend through
it leaves in that backend.

The Board opens every listed queue with the options the application recorded for it, since
opening a queue records its options. Options that fail to apply (a value a newer release
recorded that this one refuses, or one written by hand) must not be replaced by the
dashboard's defaults as it falls back to opening the queue with them: the application's
processes would reopen it with those.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import CASES, BackendCase

import aio_keuss
from aio_keuss.dashboard.board import Board  # the Board itself needs no aiohttp

pytestmark = pytest.mark.timeout(120)

BOARD_CASES = [case for case in CASES if case.id in ("redis-oq", "postgres", "mongo")]


@pytest.fixture(params=BOARD_CASES, ids=lambda case: case.id)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    case: BackendCase = request.param
    async with case.keys() as options:
        yield case.name, options


async def test_recorded_options_that_fail_to_apply_are_left_as_recorded(
    backend: tuple[str, dict[str, Any]],
) -> None:
    name, options = backend
    async with aio_keuss.connect(name, **options) as app:
        jobs = await app.queue("jobs", max_batch=7)
        await jobs.push({"n": 1})
        recorded = (await app.list())["jobs"]
        assert recorded["max_batch"] == 7
        # what this release refuses: as if recorded by one that allows it, or by hand
        refused = {**recorded, "max_batch": 0}
        await app.stats_store.save_options("jobs", refused)
    async with aio_keuss.connect(name, **options) as viewer:
        board = Board(viewer, sample_every=3600)
        state = await board.state()
        assert [row["name"] for row in state["queues"]] == ["jobs"]
        assert state["queues"][0]["size"] == 1  # shown all the same, opened with the defaults
        assert (await viewer.list())["jobs"] == refused  # and not recorded over


async def test_a_queue_closed_by_the_application_is_shown_reopened(
    backend: tuple[str, dict[str, Any]],
) -> None:
    """The board keeps the queues it opened; the application closing one of them (the same
    factory hands out one queue object per name) left the board reading the closed one,
    and every state read failed with ClosedError until the process restarted."""
    name, options = backend
    async with aio_keuss.connect(name, **options) as factory:
        jobs = await factory.queue("jobs")
        await jobs.push({"n": 1})
        board = Board(factory, sample_every=3600)
        assert [row["name"] for row in (await board.state())["queues"]] == ["jobs"]
        await jobs.close()
        state = await board.state()
        assert [row["size"] for row in state["queues"]] == [1]
        await board.sample()  # the sampler reads them too


async def test_recorded_options_this_release_does_not_know_are_kept(
    backend: tuple[str, dict[str, Any]],
) -> None:
    """Opening a listed queue with its recorded options recorded them again, whole: an
    option a newer release recorded, unknown here, was dropped from the record by the
    board's first look. A queue the board opens is now not recorded again."""
    name, options = backend
    async with aio_keuss.connect(name, **options) as app:
        jobs = await app.queue("jobs", max_batch=7)
        await jobs.push({"n": 1})
        newer = {**(await app.list())["jobs"], "newer_option": 5}
        await app.stats_store.save_options("jobs", newer)
    async with aio_keuss.connect(name, **options) as viewer:
        board = Board(viewer, sample_every=3600)
        state = await board.state()
        assert [row["size"] for row in state["queues"]] == [1]
        assert (await viewer.list())["jobs"] == newer


async def test_a_recorded_name_this_release_refuses_is_left_out(
    backend: tuple[str, dict[str, Any]],
) -> None:
    """A queue recorded under a name this release refuses (a newer release allowed it, or a
    hand wrote it) cannot be opened at all: the board's fallback to the defaults refused
    it too, so every state() failed and the board showed no queue. It is left out now."""
    name, options = backend
    async with aio_keuss.connect(name, **options) as app:
        await (await app.queue("jobs")).push({"n": 1})
        recorded = (await app.list())["jobs"]
        await app.stats_store.save_options("a queue/with space", recorded)
        board = Board(app, sample_every=3600)
        state = await board.state()
        assert [row["name"] for row in state["queues"]] == ["jobs"]
        await board.sample()  # the sampler reads them too
        assert "a queue/with space" in await app.list()  # its record left as it is
