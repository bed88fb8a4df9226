"""The SQL of the sqlite backend, kept in files beside this module rather than in Python
strings, so it reads (and diffs) as SQL.

- ``queries.sql``: every statement, each after a ``-- name: <name>`` line.
- ``migrations/NNN_<what>.sql``: the schema, one numbered step per file, applied in order by
  the connection (a step is never edited once it has shipped: a fix is a new step).

The files are read once per process.
"""

from __future__ import annotations

import re
import sqlite3
from functools import cache
from importlib import resources

_STEP = re.compile(r"(\d+)_\w+\.sql")


def _trimmed(body: str) -> str:
    """A block without the comment and blank lines around its statement."""
    lines = body.splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("--")):
        del lines[0]
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("--")):
        del lines[-1]
    return "\n".join(lines)


@cache
def queries() -> dict[str, str]:
    """The statements of ``queries.sql`` by name."""
    text = resources.files(__package__).joinpath("queries.sql").read_text("utf-8")
    found: dict[str, str] = {}
    for block in text.split("\n-- name: ")[1:]:
        name, _, body = block.partition("\n")
        found[name.strip()] = _trimmed(body)
    return found


def statements(script: str) -> list[str]:
    """The statements of a migration step, one by one. A step runs inside the migrating
    transaction, so it cannot go through ``executescript``, which commits first (Python's
    sqlite3 documentation); ``sqlite3.complete_statement`` tells where each one ends."""
    found: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statement = _trimmed(pending)
            if statement:
                found.append(statement)
            pending = ""
    if _trimmed(pending):
        raise RuntimeError(f"a migration step ends in an incomplete statement: {pending!r}")
    return found


@cache
def migrations() -> tuple[tuple[int, tuple[str, ...]], ...]:
    """(version, statements) of every step in ``migrations/``, in order of version."""
    steps: dict[int, tuple[str, ...]] = {}
    for item in resources.files(__package__).joinpath("migrations").iterdir():
        found = _STEP.fullmatch(item.name)
        if found is None:
            continue
        version = int(found[1])
        if version in steps:
            raise RuntimeError(f"two migration steps numbered {version}")
        steps[version] = tuple(statements(item.read_text("utf-8")))
    return tuple(sorted(steps.items()))
