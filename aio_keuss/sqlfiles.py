"""SQL kept in files beside a database package rather than in Python strings, so it reads
(and diffs) as SQL: the one reader of that layout, shared by the PostgreSQL and SQLite
packages.

- ``queries.sql``: every statement, each after a ``-- name: <name>`` line;
- ``migrations/NNN_<what>.sql``: the schema, one numbered step per file.
"""

from __future__ import annotations

import re
from importlib import resources

_STEP = re.compile(r"(\d+)_\w+\.sql")


def trimmed(body: str) -> str:
    """A block without the comment and blank lines around its statement (the comments stay
    in the file; the server need not parse them on every prepare)."""
    lines = body.splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("--")):
        del lines[0]
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("--")):
        del lines[-1]
    return "\n".join(lines)


def named_blocks(package: str) -> dict[str, str]:
    """The blocks of ``package``'s ``queries.sql`` by the name on their ``-- name:`` line."""
    text = resources.files(package).joinpath("queries.sql").read_text("utf-8")
    found: dict[str, str] = {}
    for block in text.split("\n-- name: ")[1:]:
        name, _, body = block.partition("\n")
        found[name.strip()] = trimmed(body)
    return found


def numbered_steps(package: str) -> list[tuple[int, str]]:
    """(version, text) of every step in ``package``'s ``migrations/``, in order of version;
    two steps with one number are a packaging mistake, refused."""
    steps: dict[int, str] = {}
    for item in resources.files(package).joinpath("migrations").iterdir():
        found = _STEP.fullmatch(item.name)
        if found is None:
            continue
        version = int(found[1])
        if version in steps:
            raise RuntimeError(f"two migration steps numbered {version}")
        steps[version] = item.read_text("utf-8")
    return sorted(steps.items())
