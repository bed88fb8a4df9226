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

import re
from functools import cache
from importlib import resources

_STEP = re.compile(r"(\d+)_\w+\.sql")


def _trimmed(body: str) -> str:
    """A block without the comment and blank lines around its statement (the comments stay
    in the file; the server need not parse them on every prepare)."""
    lines = body.splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("--")):
        del lines[0]
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("--")):
        del lines[-1]
    return "\n".join(lines)


@cache
def _blocks() -> dict[str, str]:
    text = resources.files(__package__).joinpath("queries.sql").read_text("utf-8")
    found: dict[str, str] = {}
    for block in text.split("\n-- name: ")[1:]:
        name, _, body = block.partition("\n")
        found[name.strip()] = _trimmed(body)
    return found


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
    steps: dict[int, str] = {}
    for item in resources.files(__package__).joinpath("migrations").iterdir():
        found = _STEP.fullmatch(item.name)
        if found is None:
            continue
        version = int(found[1])
        if version in steps:
            raise RuntimeError(f"two migration steps numbered {version}")
        steps[version] = item.read_text("utf-8")
    return tuple(sorted(steps.items()))
