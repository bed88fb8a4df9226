"""Whether the event loop's thread has to wait for a CPU, read from the kernel's own accounting.

Linux counts, for every thread, the time it ran and the time it was runnable but waited on a
run queue for a CPU (``/proc/<pid>/task/<tid>/schedstat``, fields 1 and 2; see the kernel's
*Scheduler Statistics* documentation). On a machine with cores to spare that wait stays near
zero; when other processes keep the cores busy it grows to about as long as the thread runs.

The Redis fast lane writes differently in the two cases (its ``write_mode``). Writing the
first command of a loop iteration at once lets Redis work on it while the client runs the
rest of the iteration: the best on a quiet machine, where each side has a core. When the
cores are taken, every write wakes Redis on a CPU someone else wants, and one write for all
the commands of the iteration does the same work for a fraction of the wake-ups and system
calls. Measured side by side on two cores with one kept busy (3 clients on redis-oq), that
took push and pop from 21,000 to about 34,000 msgs/s; on the quiet machine it halved them,
since client and server then took turns, each idle while the other worked.

Where the file cannot be read (another system, a kernel without scheduler statistics) the
thread is taken as never waiting and the file is not tried again; a reading that fails
later (too many open files) counts as quiet, and the next one is tried as usual.
"""

from __future__ import annotations

import math
import threading
import time

SCHEDSTAT = "/proc/thread-self/schedstat"
CHECK_EVERY = 0.2
"""Seconds between two readings: a mode follows the machine within a second or less."""
EARLY_CHECK_EVERY = 0.05
"""Seconds between the first ``EARLY_READINGS`` readings: a process that starts working at
once (a batch job, a benchmark's first 10,000 pushes) would otherwise spend its first half
second or more in the quiet machine's mode. Such a window still holds tens of milliseconds
of the thread's demand when it is busy, more than ``MIN_DEMAND``."""
EARLY_READINGS = 20
"""How many readings are taken ``EARLY_CHECK_EVERY`` apart (a second's worth)."""
ENTER_SHARE = 0.3
"""Share of the time the thread wanted a CPU that it spent waiting for one, from which the
machine counts as busy (about 0.5 with one of two cores taken, under 0.05 on a quiet one)."""
LEAVE_SHARE = 0.12
"""The share under which a busy machine counts as quiet again: lower than ``ENTER_SHARE``
so that a share near the threshold does not switch modes at every reading."""
READINGS_TO_SWITCH = 2
"""Readings in a row that must agree before the mode changes, once past the early ones: a
burst of another process (a quarter of a second at 27 % was seen on a quiet machine) does
not switch it. An early reading switches alone: a wrong switch in the first second costs a
reading's worth of the other mode, a late one the whole start of a job."""
MIN_DEMAND = 0.02
"""Seconds of running plus waiting a window needs before it counts: an idle thread's few
microseconds say nothing about the machine, and the mode stays as it was."""


class CpuWait:
    """``contended``: whether this thread recently waited for a CPU for a good share of the
    time it wanted one. ``sample(now)`` is cheap to call often: it reads the kernel's
    counters at most every ``CHECK_EVERY`` seconds (``next_check``), and never where they
    cannot be read."""

    __slots__ = ("_against", "_early", "_path", "_ran", "_waited", "contended", "next_check")

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self.contended = False
        self._against = 0
        self._early = EARLY_READINGS
        self._path = path
        reading = self._read()
        if reading is None:
            self.next_check = math.inf
            self._ran = self._waited = 0
        else:
            self._ran, self._waited = reading
            self.next_check = time.monotonic() + EARLY_CHECK_EVERY

    @classmethod
    def fixed(cls, contended: bool) -> CpuWait:
        """One that never reads the counters: a ``write_mode`` other than ``auto``."""
        forced = cls(path="")  # no counters there: never read
        forced.contended = contended
        return forced

    def sample(self, now: float) -> bool:
        """Read the counters if ``next_check`` has come; returns ``contended``."""
        if now < self.next_check:
            return self.contended
        reading = self._read()
        if reading is not None and (reading[0] < self._ran or reading[1] < self._waited):
            # Counters smaller than the last: a process forked from this one, which starts
            # anew from them, early readings included.
            self._ran, self._waited = reading
            self._against, self._early = 0, EARLY_READINGS
            self.next_check = now + EARLY_CHECK_EVERY
            return self.contended
        early = self._early > 0
        self._early -= early
        self.next_check = now + (EARLY_CHECK_EVERY if self._early > 0 else CHECK_EVERY)
        if reading is None:  # a read that failed (too many open files...): as if quiet,
            self.contended, self._against = False, 0  # what unreadable counters mean
            return False
        ran, waited = reading
        ran_now, waited_now = ran - self._ran, waited - self._waited
        demand = ran_now + waited_now
        if demand < MIN_DEMAND * 1e9:
            return self.contended  # too little to judge by; the window goes on
        self._ran, self._waited = ran, waited
        share = waited_now / demand
        if (share >= (LEAVE_SHARE if self.contended else ENTER_SHARE)) == self.contended:
            self._against = 0
        else:
            self._against += 1
            if self._against >= (1 if early else READINGS_TO_SWITCH):
                self.contended, self._against = not self.contended, 0
        return self.contended

    def _read(self) -> tuple[int, int] | None:
        try:
            with open(self._path, "rb") as counters:
                fields = counters.read().split()
            return int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):
            return None


_threads = threading.local()


def this_thread() -> CpuWait:
    """The reading of the calling thread (an event loop's), shared by its connections."""
    found: CpuWait | None = getattr(_threads, "cpu_wait", None)
    if found is None:
        found = _threads.cpu_wait = CpuWait()
    return found
