"""How a thread's run-queue wait, as the kernel counts it, decides whether the machine is busy:
thresholds with hysteresis, windows too idle to judge by, counters that cannot be read.

The counters are written to a file of the test's own in the kernel's format (nanoseconds run,
nanoseconds waited, time slices), so no test depends on how busy this machine is."""

from __future__ import annotations

import math
import threading
from pathlib import Path

from aio_keuss import cpu

MS = 1_000_000  # nanoseconds


class Counters:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.ran = self.waited = 0
        self.write()

    def write(self) -> None:
        self.path.write_text(f"{self.ran} {self.waited} 7\n")

    def add(self, ran_ms: int, waited_ms: int) -> None:
        self.ran += ran_ms * MS
        self.waited += waited_ms * MS
        self.write()


def _reading(tmp_path: Path, *, settled: bool = True) -> tuple[cpu.CpuWait, Counters]:
    """A reading and its counters; ``settled``: past its early readings, quiet ones."""
    counters = Counters(tmp_path / "schedstat")
    reading = cpu.CpuWait(str(counters.path))
    if settled:
        for _ in range(cpu.EARLY_READINGS):
            assert _next(reading, counters, 49, 1) is False
    return reading, counters


def _next(reading: cpu.CpuWait, counters: Counters, ran_ms: int, waited_ms: int) -> bool:
    counters.add(ran_ms, waited_ms)
    return reading.sample(reading.next_check)


def test_a_thread_that_waits_as_long_as_it_runs_is_contended(tmp_path: Path) -> None:
    reading, counters = _reading(tmp_path)
    assert reading.contended is False
    assert cpu.READINGS_TO_SWITCH == 2
    assert _next(reading, counters, 100, 100) is False  # one of two cores taken by another
    assert _next(reading, counters, 100, 100) is True  # and still: the machine is busy
    assert reading.contended is True


def test_one_burst_of_waiting_does_not_switch(tmp_path: Path) -> None:
    reading, counters = _reading(tmp_path)
    for _ in range(3):
        assert _next(reading, counters, 190, 4) is False
        assert _next(reading, counters, 100, 100) is False
    assert _next(reading, counters, 100, 100) is True
    assert _next(reading, counters, 190, 4) is True  # nor one quiet reading back
    assert _next(reading, counters, 100, 100) is True
    assert _next(reading, counters, 190, 4) is True
    assert _next(reading, counters, 190, 4) is False


def test_a_share_between_the_thresholds_keeps_the_mode(tmp_path: Path) -> None:
    reading, counters = _reading(tmp_path)
    share = (cpu.ENTER_SHARE + cpu.LEAVE_SHARE) / 2
    between = (round(100 * (1 - share)), round(100 * share))
    for _ in range(3):
        assert _next(reading, counters, *between) is False  # not enough to count as busy
    _next(reading, counters, 100, 100)
    assert _next(reading, counters, 100, 100) is True
    for _ in range(3):
        assert _next(reading, counters, *between) is True  # nor to count as quiet again


def test_nothing_is_read_before_the_next_check(tmp_path: Path) -> None:
    reading, counters = _reading(tmp_path)
    _next(reading, counters, 100, 100)
    due = reading.next_check
    counters.add(100, 100)
    assert reading.sample(due - cpu.CHECK_EVERY / 2) is False
    assert reading.next_check == due
    assert reading.sample(due) is True
    assert reading.next_check == due + cpu.CHECK_EVERY


def test_an_idle_window_is_added_to_the_next(tmp_path: Path) -> None:
    """A few milliseconds of demand say nothing; they are judged with what follows."""
    reading, counters = _reading(tmp_path)
    assert _next(reading, counters, 100, 100) is False  # one busy reading of two
    assert _next(reading, counters, 1, 9) is False  # 90 % waiting, but of 10 ms: no reading
    assert _next(reading, counters, 30, 0) is False  # with the 10 ms: 9 of 40, 22 %: quiet
    assert _next(reading, counters, 100, 100) is False  # so this busy one is the first again
    assert _next(reading, counters, 100, 100) is True


def test_counters_that_went_back_start_a_new_window(tmp_path: Path) -> None:
    """A process forked from a loop's thread inherits its reading but has counters of its
    own, smaller: they are the new baseline, not a window of negative demand that would
    never reach ``MIN_DEMAND``."""
    reading, counters = _reading(tmp_path)
    counters.add(5000, 0)
    reading.sample(reading.next_check)
    counters.ran, counters.waited = 0, 0
    counters.write()
    assert _next(reading, counters, 0, 0) is False  # the baseline is taken again
    assert _next(reading, counters, 100, 100) is True  # counted (early again: one is enough)


def test_counters_that_cannot_be_read_mean_never_contended(tmp_path: Path) -> None:
    missing = cpu.CpuWait(str(tmp_path / "absent"))
    assert missing.next_check == math.inf and missing.contended is False  # never tried again
    reading, counters = _reading(tmp_path)
    counters.path.write_text("not numbers\n")
    assert reading.sample(reading.next_check) is False


def test_a_read_that_fails_on_a_busy_machine_does_not_freeze_the_mode(tmp_path: Path) -> None:
    """Found in review: a failed read stopped the readings, leaving a busy thread's
    connections gathering for the life of the thread."""
    reading, counters = _reading(tmp_path)
    _next(reading, counters, 100, 100)
    assert _next(reading, counters, 100, 100) is True
    counters.path.rename(tmp_path / "gone")  # one read fails (as open() would with EMFILE)
    assert reading.sample(reading.next_check) is False
    (tmp_path / "gone").rename(counters.path)
    assert reading.next_check < math.inf  # read again, as usual
    assert _next(reading, counters, 190, 1) is False
    _next(reading, counters, 100, 100)
    assert _next(reading, counters, 100, 100) is True


def test_after_a_fork_the_parents_half_made_switch_does_not_count(tmp_path: Path) -> None:
    """Found in review: the parent's first reading of two counted for the child. The child
    starts its own early readings, as a new process does."""
    reading, counters = _reading(tmp_path)
    assert _next(reading, counters, 100, 100) is False  # the parent's first busy reading
    counters.ran, counters.waited = 0, 0  # the child's own counters
    counters.write()
    now = reading.next_check
    reading.sample(now)  # a new baseline
    assert reading.next_check == now + cpu.EARLY_CHECK_EVERY
    assert _next(reading, counters, 45, 5) is False  # quiet: the parent's half switch is gone
    assert _next(reading, counters, 25, 25) is True  # early: one busy reading is enough


def test_early_readings_come_often_and_one_switches(tmp_path: Path) -> None:
    """A process that sets to work at once is judged within a tenth of a second, not half a
    second or more: its first ``EARLY_READINGS`` readings are ``EARLY_CHECK_EVERY`` apart,
    and one of them is enough to switch."""
    reading, counters = _reading(tmp_path, settled=False)
    start = reading.next_check
    assert _next(reading, counters, 25, 25) is True
    assert reading.next_check == start + cpu.EARLY_CHECK_EVERY
    assert _next(reading, counters, 49, 1) is False
    for _ in range(cpu.EARLY_READINGS - 2):
        assert _next(reading, counters, 49, 1) is False
    now = reading.next_check
    assert _next(reading, counters, 100, 100) is False  # settled: two readings again
    assert reading.next_check == now + cpu.CHECK_EVERY
    assert _next(reading, counters, 100, 100) is True


def test_a_fixed_mode_never_reads() -> None:
    for contended in (True, False):
        fixed = cpu.CpuWait.fixed(contended)
        assert fixed.next_check == math.inf
        assert fixed.sample(1e12) is contended


def test_each_thread_has_its_own_reading() -> None:
    here = cpu.this_thread()
    assert cpu.this_thread() is here
    found: list[cpu.CpuWait] = []
    thread = threading.Thread(target=lambda: found.append(cpu.this_thread()))
    thread.start()
    thread.join()
    assert found and found[0] is not here
