"""Small batches sent as scalar parameters: a statement's array parameters written out.

Every statement of a batch takes its columns as array parameters (``$2::text[]``), so that a
batch of any size costs one prepared statement. asyncpg's array encoder asks of the array,
and of every element, whether it is itself an array, each time through
``isinstance(obj, collections.abc.Iterable)`` and ``Sized`` (asyncpg, ``codecs/array.pyx``),
and an ABC's ``__instancecheck__`` is a Python call: pushes of three concurrent callers (one
to three messages a statement) spent a sixth of their client instructions there, counted by
callgrind. Scalar parameters are encoded without any of that.

So a statement called with arrays of one to ``SPELLED_OUT_ROWS`` elements (the batches of a
few concurrent callers) is sent in a form where each array parameter is an ``ARRAY[...]``
constructor of that many scalar parameters of its element type: ``$2::text[]`` with two
elements becomes ``ARRAY[$2::text, $3::text]``, the later parameters renumbered. An array
constructor makes the same one-dimensional array, lower bound 1, NULL elements kept
(PostgreSQL manual, "Array Constructors"), so the statement does what it did. Each form is
a prepared statement of its own; a larger batch, or arrays of unequal lengths, use the
statement as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

SPELLED_OUT_ROWS = 4
"""The largest batch sent as scalar parameters: each size is one more prepared statement on
each connection (asyncpg caches 100 by default), and the batches of a few callers are
what pays the array encoding most per message."""

_TOKEN = re.compile(
    r"""
    '(?:[^']|'')*'                  # a string constant ('' a quote in it)
    | [eE]'(?:[^'\\]|\\.|'')*'      # an escape string constant (\' a quote in it)
    | "(?:[^"]|"")*"                # a quoted identifier
    | --[^\n]*                      # a comment
    | /\*[\s\S]*?\*/
    | \$(?P<tag>(?:[^\W\d]\w*)?)\$[\s\S]*?\$(?P=tag)\$  # a dollar-quoted string constant
    | [^\W\d][\w$]*                 # an identifier or key word: may hold $ and digits
    | \$(?P<number>\d+)(?:::(?P<type>\w+)(?P<array>\[\](?!\s*\[))?)?  # a parameter
    """,
    re.VERBOSE,
)
"""What the server reads as a parameter (``$n``, its cast when it is a simple ``::type`` or
``::type[]``), and what it does not: the constants, quoted identifiers, comments and
identifiers a ``$`` and digits may appear in (PostgreSQL manual, "Lexical Structure"), each
matched whole so that nothing inside it is taken for a parameter. A cast to an array of more
dimensions (``::text[][]``) is not an array parameter: an ``ARRAY[...]`` of scalars would
not be its value."""


@dataclass(frozen=True)
class Spelling:
    """How to write out one statement's arrays: which arguments are arrays, and the
    statement for each batch size from 1 to ``SPELLED_OUT_ROWS``."""

    arrays: tuple[bool, ...]  # per argument: an array parameter, written out
    forms: tuple[str, ...]  # forms[k - 1]: for arrays of k elements
    first_array: int  # the position of the first array argument

    def apply(self, args: tuple[Any, ...]) -> tuple[str, list[Any]] | None:
        """The form for ``args`` and its arguments, the arrays' elements in their places;
        None when the arrays are not all lists of one length within the forms' sizes (or
        the arguments are not as many as the parameters: the statement as written then
        fails as it would have)."""
        first = args[self.first_array] if len(args) == len(self.arrays) else None
        if type(first) is not list or not 0 < len(first) <= SPELLED_OUT_ROWS:
            return None
        rows = len(first)
        flat: list[Any] = []
        for arg, is_array in zip(args, self.arrays, strict=True):
            if not is_array:
                flat.append(arg)
            elif type(arg) is list and len(arg) == rows:
                flat.extend(arg)
            else:
                return None
        return self.forms[rows - 1], flat


@lru_cache(maxsize=512)
def spelling(query: str) -> Spelling | None:
    """The spelling of ``query``, None for one without array parameters, or one whose
    array parameter appears anywhere without its ``::type[]`` cast (which a written-out
    form could not give its elements' type)."""
    found = [m for m in _TOKEN.finditer(query) if m["number"]]
    if not found:
        return None
    count = max(int(m["number"]) for m in found)
    arrays = {int(m["number"]) for m in found if m["array"]}
    if not arrays or any(int(m["number"]) in arrays and not m["array"] for m in found):
        return None
    forms = tuple(
        _written_out(query, count, arrays, rows) for rows in range(1, SPELLED_OUT_ROWS + 1)
    )
    flags = tuple(n in arrays for n in range(1, count + 1))
    return Spelling(flags, forms, flags.index(True))


def _written_out(query: str, count: int, arrays: set[int], rows: int) -> str:
    """``query`` with each array parameter an ARRAY[...] of ``rows`` scalar parameters."""
    first: dict[int, int] = {}  # old number -> its first new number
    number = 1
    for old in range(1, count + 1):
        first[old] = number
        number += rows if old in arrays else 1

    def replace(match: re.Match[str]) -> str:
        if not match["number"]:
            return match[0]  # not a parameter: kept as it is
        old = int(match["number"])
        new = first[old]
        if old not in arrays:
            return f"${new}" + match[0][len(match["number"]) + 1 :]
        return "ARRAY[" + ", ".join(f"${new + i}::{match['type']}" for i in range(rows)) + "]"

    return _TOKEN.sub(replace, query)
