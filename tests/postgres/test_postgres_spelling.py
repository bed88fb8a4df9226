"""Small batches sent with their arrays written out as scalar parameters: every written-out
form is the statement it stands for (same parameters' types in order, same result
columns), and a statement answers the same whichever form carries it."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import POSTGRES_URL, _drop_postgres_schema, new_token

import aio_keuss
from aio_keuss.postgres.spelling import SPELLED_OUT_ROWS, spelling
from aio_keuss.postgres.sql import queries

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.timeout(180)

PAIRS = (
    "SELECT $1::int4 AS k, t.a, t.b, t.n"
    " FROM unnest($2::text[], $3::int4[]) WITH ORDINALITY AS t(a, b, n)"
)


@pytest.fixture
async def factory() -> AsyncIterator[aio_keuss.Factory]:
    schema = f"akt_{new_token()}"
    try:
        opened = await aio_keuss.connect("postgres", url=POSTGRES_URL, schema=schema)
    except aio_keuss.KeussConnectionError:
        pytest.skip(f"no PostgreSQL at {POSTGRES_URL}")
    try:
        yield opened
    finally:
        await opened.close()
        await _drop_postgres_schema({"url": POSTGRES_URL, "schema": schema})


def test_array_parameters_are_written_out_and_the_others_renumbered() -> None:
    written = spelling("SELECT $1::int4, x FROM unnest($2::text[], $3::int4[]) WHERE y = $4")
    assert written is not None
    assert written.arrays == (False, True, True, False)
    assert written.forms[1] == (
        "SELECT $1::int4, x FROM unnest(ARRAY[$2::text, $3::text], ARRAY[$4::int4, $5::int4])"
        " WHERE y = $6"
    )
    assert written.apply((7, ["a", "b"], [1, None], "z")) == (
        written.forms[1],
        [7, "a", "b", 1, None, "z"],
    )


@pytest.mark.parametrize(
    "args",
    [
        (0, [], []),  # nothing to write out
        (0, ["a"] * (SPELLED_OUT_ROWS + 1), [1] * (SPELLED_OUT_ROWS + 1)),  # too many
        (0, ["a", "b"], [1]),  # unequal lengths
        (0, ("a",), [1]),  # not lists
        (0, ["a"], None),
        (0, ["a"]),  # too few arguments: the statement as written reports it
    ],
)
def test_what_is_not_small_lists_of_one_length_goes_as_written(args: tuple[Any, ...]) -> None:
    written = spelling("SELECT $1::int4 FROM unnest($2::text[], $3::int4[])")
    assert written is not None
    assert written.apply(args) is None


def test_a_statement_using_an_array_parameter_without_its_cast_is_not_written_out() -> None:
    assert spelling("SELECT $1::text FROM t") is None  # no arrays
    assert spelling("SELECT x FROM unnest($1::text[]) WHERE cardinality($1) > 0") is None


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        # a string literal, a quoted identifier, comments, a dollar-quoted string: text the
        # server does not read as parameters, kept as it is
        (
            "SELECT '$2::text[] $3', x FROM unnest($1::text[]) AS x WHERE x <> $2",
            "SELECT '$2::text[] $3', x FROM unnest(ARRAY[$1::text, $2::text]) AS x WHERE x <> $3",
        ),
        (
            "SELECT E'\\'$2', x AS \"a$2\" FROM unnest($1::text[]) AS x WHERE x <> $2",
            "SELECT E'\\'$2', x AS \"a$2\" FROM unnest(ARRAY[$1::text, $2::text]) AS x"
            " WHERE x <> $3",
        ),
        (
            "SELECT x -- $2::text[]\nFROM unnest($1::text[]) /* $2 */ AS x WHERE x <> $2",
            "SELECT x -- $2::text[]\nFROM unnest(ARRAY[$1::text, $2::text]) /* $2 */ AS x"
            " WHERE x <> $3",
        ),
        (
            "SELECT $$ $2 $$, $q$ $2::text[] $q$, x FROM unnest($1::text[]) AS x WHERE x <> $2",
            "SELECT $$ $2 $$, $q$ $2::text[] $q$, x FROM unnest(ARRAY[$1::text, $2::text]) AS x"
            " WHERE x <> $3",
        ),
        # an unquoted identifier may hold $ and digits (PostgreSQL manual, "Identifiers and
        # Key Words"): not a parameter
        (
            "SELECT x AS a$2 FROM unnest($1::text[]) AS x WHERE x <> $2",
            "SELECT x AS a$2 FROM unnest(ARRAY[$1::text, $2::text]) AS x WHERE x <> $3",
        ),
    ],
)
def test_only_the_parameters_the_server_reads_are_rewritten(query: str, expected: str) -> None:
    written = spelling(query)
    assert written is not None
    assert written.arrays == (True, False)
    assert written.forms[1] == expected


@pytest.mark.parametrize(
    "query",
    [
        "SELECT $1::text[][]",  # two dimensions: not one ARRAY[...] of scalars
        "SELECT $1::text[] [1]",
        "SELECT cardinality($1::text[]), $1::text[][]",
    ],
)
def test_an_array_cast_followed_by_more_brackets_is_not_written_out(query: str) -> None:
    assert spelling(query) is None


async def test_every_written_out_form_is_its_statement(factory: aio_keuss.Factory) -> None:
    """Prepared on the server: the parameters' types, in the order the arguments are laid
    out, and the result columns are those of the statement as written."""
    db: Any = factory.backend
    spelled = 0
    async with db.pool.acquire() as connection:
        for name, statement in queries(db.quoted_schema).items():
            written = spelling(statement)
            if written is None:
                # one taking an array parameter is written out, unless it uses one without
                # its cast: that a batch of a few would pay the array encoding again
                assert not re.search(r"\$\d+::\w+\[\]", statement), name
                continue
            prepared = await connection.prepare(statement)
            params = [t.name for t in prepared.get_parameters()]
            columns = [(a.name, a.type.name) for a in prepared.get_attributes()]
            for rows, form in enumerate(written.forms, start=1):
                laid_out: list[str] = []  # an array's elements in its place: text[] -> text, ...
                for param, is_array in zip(params, written.arrays, strict=True):
                    laid_out += [param.removesuffix("[]")] * rows if is_array else [param]
                prepared_form = await connection.prepare(form)
                assert [t.name for t in prepared_form.get_parameters()] == laid_out, name
                columns_form = [(a.name, a.type.name) for a in prepared_form.get_attributes()]
                assert columns_form == columns, name
            spelled += 1
    assert spelled >= 20  # the statements of batches (23 today)


@pytest.mark.parametrize("size", range(SPELLED_OUT_ROWS + 3))
async def test_a_statement_answers_alike_in_either_form(
    factory: aio_keuss.Factory, size: int
) -> None:
    db: Any = factory.backend
    texts = [f"t{i}" if i % 3 else None for i in range(size)]
    numbers = [i if i % 2 else None for i in range(size)]
    rows = await db.fetch(PAIRS, 7, texts, numbers)
    assert [tuple(r) for r in rows] == [
        (7, a, b, n) for n, (a, b) in enumerate(zip(texts, numbers, strict=True), start=1)
    ]
