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


def _reading(tmp_path: Path) -> tuple[cpu.CpuWait, Counters]:
    counters = Counters(tmp_path / "schedstat")
    return cpu.CpuWait(str(counters.path)), counters


def test_a_thread_that_waits_as_long_as_it_runs_is_contended(tmp_path: Path) -> None:
    reading, counters = _reading(tmp_path)
    assert reading.contended is False
    counters.add(100, 100)  # one of two cores taken by another process
    assert reading.sample(reading.next_check) is True
    assert reading.contended is True


def test_a_quiet_machine_stays_quiet(tmp_path: Path) -> None:
    reading, counters = _reading(tmp_path)
    for _ in range(3):
        counters.add(190, 4)
        assert reading.sample(reading.next_check) is False


def test_a_share_between_the_thresholds_keeps_the_mode(tmp_path: Path) -> None:
    reading, counters = _reading(tmp_path)
    share = (cpu.ENTER_SHARE + cpu.LEAVE_SHARE) / 2
    counters.add(round(100 * (1 - share)), round(100 * share))
    assert reading.sample(reading.next_check) is False  # not enough to count as busy
    counters.add(100, 100)
    assert reading.sample(reading.next_check) is True
    counters.add(round(100 * (1 - share)), round(100 * share))
    assert reading.sample(reading.next_check) is True  # nor to count as quiet again
    counters.add(195, 5)
    assert reading.sample(reading.next_check) is False


def test_nothing_is_read_before_the_next_check(tmp_path: Path) -> None:
    reading, counters = _reading(tmp_path)
    due = reading.next_check
    counters.add(100, 100)
    assert reading.sample(due - cpu.CHECK_EVERY / 2) is False
    assert reading.next_check == due
    assert reading.sample(due) is True
    assert reading.next_check == due + cpu.CHECK_EVERY


def test_an_idle_window_is_added_to_the_next(tmp_path: Path) -> None:
    """A few milliseconds of demand say nothing; they are judged with what follows."""
    reading, counters = _reading(tmp_path)
    counters.add(1, 9)  # 90 % waiting, but of 10 ms
    assert reading.sample(reading.next_check) is False
    counters.add(30, 0)  # with the window before: 9 ms of 40 waited, 22 %
    assert reading.sample(reading.next_check) is False
    counters.add(5, 5)  # with those 40 ms it would be 14 of 50, 28 %: they were judged
    assert reading.sample(reading.next_check) is False
    counters.add(5, 5)  # 10 of 20 since
    assert reading.sample(reading.next_check) is True


def test_counters_that_cannot_be_read_mean_never_contended(tmp_path: Path) -> None:
    missing = cpu.CpuWait(str(tmp_path / "absent"))
    assert missing.next_check == math.inf and missing.contended is False
    reading, counters = _reading(tmp_path)
    counters.path.write_text("not numbers\n")
    assert reading.sample(reading.next_check) is False
    assert reading.next_check == math.inf  # not tried again


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
