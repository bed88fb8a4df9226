"""An idle factory costs next to no CPU, on every backend.

Idle: a queue is open, a consumer waits on it, nothing happens. What the factory may still do
then (a signal listener waiting on the server, consumers' poll timers) must stay under 1 % of
one CPU. The measure is CPU time (``time.process_time``), not wall time, so a busy machine
does not inflate it; the test servers run in processes of their own (nx-27017 too, see
``mongo_server.py``), so their work is not counted. The factory is left idle for a couple of
seconds before measuring: on a MongoDB server that does not wait on getMore (such as
nx-27017) the signal listener polls, less and less often the longer nothing happens.

Every backend's factory runs in a process of its own and is measured by that process's CPU
time alone (``idle_probe.py``); the processes start together, so the backends share one
settle and measuring window instead of waiting through one each (about a minute of the
suite's wall time). One test per backend still reports that backend's result.

The sharded backends run with their shipped sweeper timings here: the suite's other tests
make the sweeper pass four times a second so that lapsed reservations come back quickly,
which is not idle as a user gets it (each pass is a wake-up and a few round trips).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from backends import BackendCase

# one worker of pytest-xdist runs them all, on one shared measure
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("idle")]

PROBE = Path(__file__).parent.parent / "idle_probe.py"
BOUND = 0.01
"""Share of one CPU; typical values are 0 to 0.3 %."""


@pytest.fixture(scope="module")
def idle_usage(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The probe's result for every usable backend this run selected, measured at once."""
    ids: list[str] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is not request.module or callspec is None:
            continue
        case: BackendCase = callspec.params["case"]
        if case.id not in ids and case.available() is None:
            ids.append(case.id)
    done = subprocess.run(
        [sys.executable, str(PROBE), *ids], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    results: dict[str, Any] = json.loads(done.stdout)
    return results


def test_an_idle_factory_uses_under_one_percent_of_a_cpu(
    case: BackendCase, idle_usage: dict[str, Any]
) -> None:
    usage = idle_usage[case.id]
    assert "error" not in usage, usage["error"]
    assert usage["warmed"]  # connections, scripts, indexes: all in place
    assert usage["waiting"]  # the consumer still waited: nothing happened
    used, measured = usage["used"], usage["measured"]
    assert used < BOUND * measured, f"idle factory used {used / measured:.2%} of a CPU"
