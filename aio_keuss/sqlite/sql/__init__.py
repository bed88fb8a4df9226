"""The SQL of the sqlite backend, kept in files beside this module rather than in Python
strings, so it reads (and diffs) as SQL.

- ``queries.sql``: every statement, each after a ``-- name: <name>`` line.
- ``migrations/NNN_<what>.sql``: the schema, one numbered step per file, applied in order by
  the connection (a step is never edited once it has shipped: a fix is a new step).

The files are read once per process.
"""

from __future__ import annotations

import sqlite3
from functools import cache

from ...sqlfiles import named_blocks, numbered_steps, trimmed


@cache
def queries() -> dict[str, str]:
    """The statements of ``queries.sql`` by name."""
    return named_blocks(__package__)


def statements(script: str) -> list[str]:
    """The statements of a migration step, one by one. A step runs inside the migrating
    transaction, so it cannot go through ``executescript``, which commits first (Python's
    sqlite3 documentation); ``sqlite3.complete_statement`` tells where each one ends."""
    found: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statement = trimmed(pending)
            if statement:
                found.append(statement)
            pending = ""
    if trimmed(pending):
        raise RuntimeError(f"a migration step ends in an incomplete statement: {pending!r}")
    return found


@cache
def migrations() -> tuple[tuple[int, tuple[str, ...]], ...]:
    """(version, statements) of every step in ``migrations/``, in order of version."""
    return tuple(
        (version, tuple(statements(text))) for version, text in numbered_steps(__package__)
    )
