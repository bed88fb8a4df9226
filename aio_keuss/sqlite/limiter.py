"""A queue's rate limiter in SQLite: ``contract.rate_step`` on one row of ``rates``.

The row, keyed by the queue's name, holds the limiter's count of refused takes
(``refused``) and its two times (``tat``, ``held_until``) in epoch seconds on SQLite's
clock (``julianday('now')``, to the millisecond: SQLite keeps no finer time, and
``unixepoch('subsec')`` needs 3.42). Every process sharing the file runs
on the machine that holds it, so they share that clock whatever else they do.

The step is one write transaction (``BEGIN IMMEDIATE``, see :mod:`.connection`): one
statement reads the clock and the row, :func:`~aio_keuss.contract.rate_step` itself
computes the grant, and the new state is written back, all while this connection holds the
file's only write lock, so no other process's step comes between the read and the write.
Running the reference step rather than a port of it in SQL leaves nothing to drift from it.
A state whose two times are past is the same as none: its row is deleted, and a step that
makes a row deletes other such rows (queues idle since), so idle queues leave nothing.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

from ..contract import RateGrant, RateRule, RateState, rate_step

if TYPE_CHECKING:
    from .connection import SqliteConnection


async def rate_take(
    db: SqliteConnection, queue: str, rule: RateRule, count: int, hold: float, end: float
) -> RateGrant:
    """``Backend.rate_take`` on ``db``'s file (see the module's docstring)."""
    sql = db.sql

    def step(c: sqlite3.Connection) -> RateGrant:
        now, tat, until, refused = c.execute(sql["rate_state"], (queue,)).fetchone()
        state = RateState() if tat is None else RateState(tat, until, refused)
        new, grant = rate_step(state, now, rule, count, hold, end)
        if max(new.tat, new.until) > now:
            if new != state:
                c.execute(sql["rate_save"], (queue, new.tat, new.until, new.refused))
            if tat is None:
                c.execute(sql["rate_purge"], (now,))
        elif tat is not None:
            c.execute(sql["rate_forget"], (queue,))
        return grant

    return await db.write(step)
