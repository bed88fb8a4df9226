from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from backends import CASES, BackendCase, new_token
from mongo_server import start_mongo
from redis_cluster import start_redis_cluster

import aio_keuss

Connect = Callable[..., Awaitable[aio_keuss.Factory]]

# Started in the background by a shell without job control (``make test &`` in a script, a CI
# step), the suite inherits SIGINT ignored -- bash ignores it for asynchronous commands -- and
# Python then installs no KeyboardInterrupt handler, in pytest-xdist's workers and in every
# program a test starts. The tests of Ctrl-C handling need Python's own, as a terminal gives.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

try:  # The test server's autovacuum is off (the suite vacuums before it runs): that the
    # library says so once, at the first open, is tested on its own; elsewhere it would be
    # a warning of the machine's in tests that check what a close or a repeat logs.
    from aio_keuss.postgres import connection as _pg_connection

    _pg_connection.warned_no_autovacuum = True
except ImportError:  # asyncpg not installed
    pass


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the controller starts the servers the suite starts itself, once,
    before any worker: workers starting them at once would race for their ports, and the
    one that started MongoDB would stop it on exit while another still used it."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        start_mongo()
        start_redis_cluster()


XDIST_GROUPS = {
    "tests/acceptance/test_spark.py": "spark",
    "tests/conformance/test_idle.py": "idle",
    "tests/redis/test_redis_sharded_migration.py": "slot-migration",
}
"""The modules whose tests one worker runs together (``--dist loadgroup``), by the name of
their ``xdist_group`` mark. pytest-xdist 3.8 groups by a suffix it writes into each item's
nodeid, which pytest 9 no longer reads (an item's nodeid comes from ``Item._id``): the marks
alone grouped nothing, so the Spark tests ran on both workers, each starting a JVM of its
own, and both ran the idle probe. The scheduler below groups by module instead; collection
checks that every marked test is in the module of its group, so the two cannot drift."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``, with the groups of XDIST_GROUPS."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = XDIST_GROUPS.get(nodeid.partition("::")[0])
            return group if group is not None else super()._split_scope(nodeid)

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the tests of a case outside the modules it is limited to."""
    for item in items:
        for mark in item.iter_markers("xdist_group"):
            module = item.nodeid.partition("::")[0]
            assert XDIST_GROUPS.get(module) == mark.args[0], f"{module}: see XDIST_GROUPS"
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("case") if callspec is not None else None
        modules = backend.modules if isinstance(backend, BackendCase) else None
        module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
        (dropped if modules is not None and module not in modules else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def usable_case(request: pytest.FixtureRequest) -> BackendCase:
    """The parametrized case of a ``case`` fixture, skipped when its backend is unusable."""
    backend: BackendCase = request.param
    reason = backend.available()
    if reason:
        pytest.skip(reason)
    return backend


@pytest.fixture(params=CASES, ids=lambda case: case.id)
def case(request: pytest.FixtureRequest) -> BackendCase:
    return usable_case(request)


@pytest.fixture
async def connect(case: BackendCase) -> AsyncIterator[Connect]:
    """Open factories on the case's backend, all sharing one test's keys; closed after."""
    options = case.options(new_token())
    opened: list[aio_keuss.Factory] = []

    async def _connect(**extra: Any) -> aio_keuss.Factory:
        factory = await aio_keuss.connect(case.name, **{**options, **extra})
        opened.append(factory)
        return factory

    yield _connect
    for factory in opened:
        await factory.close()
    if case.cleanup is not None:
        await case.cleanup(options)


@pytest.fixture
async def factory(connect: Connect) -> aio_keuss.Factory:
    return await connect(poll_interval=5.0)


@pytest.fixture
async def queue(factory: aio_keuss.Factory) -> aio_keuss.Queue:
    return await factory.queue("q1")


def needs(holder: aio_keuss.Factory | aio_keuss.Queue, *capabilities: str) -> None:
    """Skip when the backend does not claim a capability the test exercises."""
    missing = [c for c in capabilities if not getattr(holder.capabilities, c)]
    if missing:
        pytest.skip(f"this backend lacks {', '.join(missing)}")


async def sizes_of(q: aio_keuss.Queue) -> tuple[int, int, int, int]:
    """(size, total, scheduled, reserved) of a queue."""
    s = await q.sizes()
    return s.size, s.total, s.scheduled, s.reserved


async def drain_all(q: aio_keuss.Queue) -> list[aio_keuss.Message]:
    """Pop everything ready now."""
    got: list[aio_keuss.Message] = []
    while True:
        batch = await q.pop_many(500, timeout=0)
        if not batch:
            return got
        got.extend(batch)


def needs_reserve(queue: aio_keuss.Queue) -> None:
    """Skip where the backend has no reserve."""
    needs(queue, "reserve")
