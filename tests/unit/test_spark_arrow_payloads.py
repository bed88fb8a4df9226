"""The Spark writer's Arrow payloads: what it encodes from the columns a batch at a time must
be, byte for byte, what the queue makes of the rows' dicts; what it cannot (floats,
timestamps, maps, strings that need escaping...) goes the row way, and the messages come
out the same either way."""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")

import aio_keuss  # noqa: E402
from aio_keuss import spark as keuss_spark  # noqa: E402
from aio_keuss.message import encode_payload  # noqa: E402
from aio_keuss.spark.executor import _payload_blobs, _rows_of  # noqa: E402


def _batch(**columns: Any) -> Any:
    return pa.RecordBatch.from_pydict(columns)


def _raw_strings(data: bytes, ends: list[int], kind: Any = None) -> Any:
    """A string column of ``data`` cut at ``ends``, its bytes unchecked: what Spark hands over
    for a string it never validated (``CAST(binary AS STRING)``)."""
    kind = pa.string() if kind is None else kind
    width = pa.int64() if pa.types.is_large_string(kind) else pa.int32()
    offsets = pa.array([0, *ends], width).buffers()[1]
    return pa.Array.from_buffers(kind, len(ends), [None, offsets, pa.py_buffer(data)])


ENCODED = {
    "ints": _batch(
        a=pa.array([0, -1, 2**63 - 1, -(2**63), None], pa.int64()),
        b=pa.array([1, 2, 3, None, 5], pa.int8()),
        c=pa.array([2**64 - 1, 0, None, 7, 8], pa.uint64()),
    ),
    "strings": _batch(
        s=pa.array(["", "é", "x\u2028y", "\U0001f600", "a/b'c"]),
        t=pa.array(["x", None, "z", "", "\x7f"]),
    ),
    "large strings beside others": _batch(
        s=pa.array(["a", "b", None], pa.large_string()),
        n=pa.array([1, None, 3], pa.int32()),
        u=pa.array(["p", "q", "r"], pa.string()),
    ),
    "bools and nulls": _batch(
        b=pa.array([True, False, None]),
        z=pa.array([None, None, None], pa.null()),
        k=pa.array([None, None, None], pa.null()),
    ),
    "keys that need escaping": _batch(**{'a"b': pa.array([1, 2]), "c\\d\n": pa.array(["x", "y"])}),
    "one column": _batch(only=pa.array(["v", "w"])),
    "a slice": _batch(s=pa.array(["q", "r", "s", "t"]), n=pa.array([1, 2, 3, 4])).slice(1, 2),
}


@pytest.mark.parametrize("name", ENCODED)
def test_encoded_columns_are_the_blobs_of_the_rows(name: str) -> None:
    batch = ENCODED[name]
    blobs = _payload_blobs(batch)
    assert blobs is not None
    assert blobs == [encode_payload(row) for row in batch.to_pylist()]


LEFT_TO_ROWS = {
    "a quote": _batch(s=pa.array(['say "hi"', "b"])),
    "a backslash": _batch(s=pa.array(["a\\b", "b"])),
    "a newline": _batch(s=pa.array(["a\nb", "b"])),
    "a NUL": _batch(s=pa.array(["a\x00b", "b"])),
    "floats": _batch(f=pa.array([1.5, 2.0])),
    "timestamps": _batch(t=pa.array([dt.datetime(2026, 1, 1)], pa.timestamp("us"))),
    "a map": _batch(m=pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64()))),
    "a list": _batch(values=pa.array([[1, 2]])),
    "a struct": _batch(s=pa.array([{"x": 1}])),
    "binary": _batch(b=pa.array([b"x"], pa.binary())),
    "dictionary strings": _batch(d=pa.array(["a", "b"]).dictionary_encode()),
    "two columns of one name": pa.RecordBatch.from_arrays(
        [pa.array([1]), pa.array([2])], names=["x", "x"]
    ),
    "no rows": _batch(s=pa.array([], pa.string())),
    "only nulls": _batch(z=pa.array([None, None], pa.null())),
    "a table": pa.Table.from_pydict({"s": pa.array(["a", "b"])}),
    "bytes that are not UTF-8": _batch(s=_raw_strings(b"\xff\xfeok", [2, 4])),
    "large, not UTF-8": _batch(s=_raw_strings(b"ok\xc3", [2, 3], pa.large_string())),
    "a character split between two values": _batch(s=_raw_strings(b"\xc3\xa9", [1, 2])),
}


@pytest.mark.parametrize("name", LEFT_TO_ROWS)
def test_what_arrow_cannot_write_as_orjson_does_is_left_to_the_rows(name: str) -> None:
    assert _payload_blobs(LEFT_TO_ROWS[name]) is None


_TEXTS = ["", "a", "é", "\U0001f600", "x\u2028y", "\x7f", "a/b'c", "\xa0", "\ufeff", "日本", "\x85"]
_ESCAPED = ['q"', "b\\s", "n\n", "\x00", "\x1f", "\t"]
_NAMES = ["a", "", "é", 'q"', "b\\", "\n", "\x7f", "\u2028", "\U0001f600", "null", ",", "}"]
_INTS = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(),
         pa.uint64()]  # fmt: skip


def _random_column(rng: random.Random, n: int) -> Any:
    """A column of a type the Arrow way may take, with values at its edges, nulls (or
    none), text that needs escaping now and then, and null slots over bytes that would."""
    kind = rng.choice(["int", "bool", "null", "string", "large_string", "null_over_bytes", "raw"])
    nulls = rng.choice([0.0, 0.3, 1.0])

    def maybe(value: Any) -> Any:
        return None if rng.random() < nulls else value

    if kind == "int":
        width = rng.choice(_INTS)
        bits = width.bit_width
        lo, hi = (0, 2**bits - 1)
        if pa.types.is_signed_integer(width):
            lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        values = [rng.choice([lo, hi, 0, rng.randint(lo, hi)]) for _ in range(n)]
        return pa.array(list(map(maybe, values)), width)
    if kind == "bool":
        return pa.array([maybe(rng.random() < 0.5) for _ in range(n)], pa.bool_())
    if kind == "null":
        return pa.nulls(n, rng.choice([pa.null(), pa.int64(), pa.string(), pa.bool_()]))
    text_type = pa.large_string() if kind == "large_string" else pa.string()
    if kind == "raw":  # bytes as Spark may hand them over, UTF-8 or not
        data = bytes(rng.choices(b"ab\xc3\xa9\xf0\x9f\x98\x80\xff", k=rng.randint(0, 2 * n)))
        ends = sorted(rng.choices(range(len(data) + 1), k=n))
        return _raw_strings(data, [*ends[:-1], len(data)] if ends else [])
    pool = _TEXTS + (_ESCAPED if rng.random() < 0.3 else [])
    values = ["".join(rng.choices(pool, k=rng.randint(0, 3))) for _ in range(n)]
    if kind != "null_over_bytes":
        return pa.array([maybe(v) for v in values], text_type)
    full = pa.array([*values, 'x"y'], text_type).slice(0, n)  # a quote past the last value
    valid = pa.array([rng.random() >= nulls for _ in range(n)] or [True]).buffers()[1]
    return pa.Array.from_buffers(text_type, n, [valid, *full.buffers()[1:]], offset=full.offset)


def test_random_batches_are_encoded_as_their_rows_or_left_to_them() -> None:
    """Random schemas and values (a fixed seed), whole or sliced: whatever the Arrow way
    encodes is byte for byte ``encode_payload`` of each row ``to_pylist`` makes."""
    rng = random.Random(20261201)
    encoded = 0
    for _ in range(1500):
        n = rng.randint(0, 9)
        names = [rng.choice(_NAMES) for _ in range(rng.randint(1, 4))]
        batch = pa.RecordBatch.from_arrays([_random_column(rng, n) for _ in names], names=names)
        if n and rng.random() < 0.5:
            start = rng.randint(0, n)
            batch = batch.slice(start, rng.randint(0, n - start))
        blobs = _payload_blobs(batch)
        if blobs is not None:
            encoded += 1
            assert blobs == [encode_payload(row) for row in batch.to_pylist()], batch.schema
    assert encoded > 400  # the Arrow way was tried, not only left to the rows


def _drain(queue: Any) -> list[tuple[str, Any]]:
    taken: list[tuple[str, Any]] = []
    while batch := queue.pop_many(1000, timeout=0):
        taken += [(m.id, m.payload) for m in batch]
    return taken


@pytest.mark.parametrize("id_column", [None, "n"])
def test_encoded_and_row_batches_mixed_keep_order_ids_and_payloads(
    id_column: str | None,
) -> None:
    """Batches of both kinds in one partition, of sizes not multiples of ``batch_size``:
    every row once, in order, with the id of its index (or column) and its row as payload."""
    plain = [_batch(n=pa.array(range(k, k + 7)), s=pa.array([f"r{i}" for i in range(k, k + 7)]))
             for k in (0, 14)]  # fmt: skip
    escaped = _batch(n=pa.array(range(7, 14)), s=pa.array([f'q"{i}' for i in range(7, 14)]))
    batches = [plain[0], escaped, plain[1]]
    assert _payload_blobs(escaped) is None and _payload_blobs(plain[0]) is not None
    spec = keuss_spark.WriteSpec(
        backend="memory", queue="mixed", batch_size=5, id_column=id_column, id_prefix="p-"
    )
    try:
        assert keuss_spark.push_arrow_batches(spec, batches, "job:3") == 21
        queue = keuss_spark.executor_queue("memory", "mixed", {})
        taken = _drain(queue)
    finally:
        keuss_spark.close_executor_factories()
    rows = [row for batch in batches for row in _rows_of(batch)]
    ids = [f"job:3:{i}" if id_column is None else f"p-{i}" for i in range(21)]
    assert sorted(taken) == sorted(zip(ids, rows, strict=True))
    assert [payload for _, payload in taken] == rows


def test_an_encoded_batch_refused_by_the_store_fails_with_the_store_error() -> None:
    """A blob too large for the store is refused as the row would be: the task fails with
    InvalidPayloadError, and nothing of the batch is written."""
    big = _batch(s=pa.array(["x" * 2000, "y"]))
    assert _payload_blobs(big) is not None
    spec = keuss_spark.WriteSpec(backend="memory", queue="big", batch_size=5)
    try:
        queue = keuss_spark.executor_queue("memory", "big", {})
        store = queue.queue._store
        store.max_message_bytes = 1000
        with pytest.raises(aio_keuss.InvalidPayloadError):
            keuss_spark.push_arrow_batches(spec, [big], "job:0")
        assert _drain(queue) == []
    finally:
        keuss_spark.close_executor_factories()


def test_an_id_column_the_batch_lacks_is_a_config_error_naming_the_option() -> None:
    spec = keuss_spark.WriteSpec(backend="memory", queue="lacking", id_column="key")
    try:
        with pytest.raises(aio_keuss.ConfigError, match="id_column 'key'"):
            keuss_spark.push_arrow_batches(spec, [_batch(n=pa.array([1, 2]))], "job:0")
    finally:
        keuss_spark.close_executor_factories()


def test_a_string_that_is_not_utf8_fails_the_write_and_writes_nothing() -> None:
    """As the row way always did (Arrow cannot make it a str): a message no consumer could
    decode is never written."""
    batch = _batch(n=pa.array([1, 2]), s=_raw_strings(b"ok\xff", [2, 3]))
    spec = keuss_spark.WriteSpec(backend="memory", queue="not-utf8", batch_size=5)
    try:
        with pytest.raises(UnicodeDecodeError):
            keuss_spark.push_arrow_batches(spec, [batch], "job:0")
        assert _drain(keuss_spark.executor_queue("memory", "not-utf8", {})) == []
    finally:
        keuss_spark.close_executor_factories()


def test_rows_past_what_a_string_array_holds_are_joined_as_large_strings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch whose columns together hold more than a string array's 2 GiB (each column
    under it, as Spark sends them) is joined in large strings, not failed with Arrow's
    capacity error. Arrow's own error is raised here for any join into a string array, as
    for such a batch (measured: two 1.1 GB columns); the batch's data stays small."""
    pc = pytest.importorskip("pyarrow.compute")
    join = pc.binary_join_element_wise

    def capped(*strings: Any, **options: Any) -> Any:
        if any(getattr(s, "type", None) == pa.string() for s in strings):
            raise pa.ArrowCapacityError("array cannot contain more than 2147483646 bytes")
        return join(*strings, **options)

    monkeypatch.setattr(pc, "binary_join_element_wise", capped)
    batch = _batch(s=pa.array(["a", None, "é"]), t=pa.array(["x", "y", "z"]), n=pa.array([1, 2, 3]))
    blobs = _payload_blobs(batch)
    assert blobs == [encode_payload(row) for row in batch.to_pylist()]
