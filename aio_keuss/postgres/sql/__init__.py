"""The SQL of the PostgreSQL backends, kept in files beside this module rather than in
Python strings, so it reads (and diffs) as SQL.

- ``queries.sql``: every statement, each after a ``-- name: <name>`` line. A block named
  ``_<name>`` is a fragment, pasted where a statement says ``{_<name>}``: two statements
  that must do the same thing (a move, and the deadletter branch of a rollback) share one
  body instead of two copies that could drift apart.
- ``migrations/NNN_<what>.sql``: the schema, one numbered step per file, applied in order
  by the connection (see ``PostgresConnection.migrate``).

``{s}`` in either stands for the quoted schema name. The files are read once per process.
"""

from __future__ import annotations

from functools import cache

from ...sqlfiles import named_blocks, numbered_steps


@cache
def _blocks() -> dict[str, str]:
    return named_blocks(__package__)


@cache
def queries(schema: str, relax: str = "") -> dict[str, str]:
    """The statements of ``queries.sql`` by name, fragments pasted in, with the quoted
    ``schema`` and the durability condition ``relax`` filled in."""
    blocks = _blocks()
    fragments = {"{" + name + "}": body for name, body in blocks.items() if name[0] == "_"}
    statements: dict[str, str] = {}
    for name, body in blocks.items():
        if name[0] == "_":
            continue
        for mark, fragment in fragments.items():
            body = body.replace(mark, fragment)
        statements[name] = body.replace("{s}", schema).replace("{relax}", relax)
    return statements


@cache
def migrations() -> tuple[tuple[int, str], ...]:
    """(version, SQL) of every step in ``migrations/``, in order of version."""
    return tuple(numbered_steps(__package__))
