"""Spark integration: push partitions from executors, and the ``aio_keuss`` data source.

Executors reach queues through :mod:`aio_keuss.sync`: ONE factory per executor (Python worker)
process, cached here by backend and options, so the many tasks a reused worker runs share one
connection pool and one event-loop thread.

Spark retries failed tasks and may run a task twice at once (speculation), so every push is
idempotent: each message id is derived from a stable key -- the column you name, or the job
key plus partition id plus row index -- and pushed with ``ids=``; the backend drops a second
push of an id within its ``dedup_window`` (default one hour). Row order inside a partition
must then be deterministic between attempts, which holds for files, ``range`` and sorted data
(not for the output of a non-deterministic shuffle: name an ``id_column`` there).

    df.foreachPartition(push_partitions(backend="redis-oq", queue="jobs",
                                        url="redis://127.0.0.1:6379/0"))

    aio_keuss.spark.register(spark)
    df.write.format("aio_keuss").option("backend", "redis-oq").option("queue", "jobs") \\
        .option("url", "redis://127.0.0.1:6379/0").mode("append").save()
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import decimal
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import orjson

from .. import sync
from ..errors import ConfigError, InvalidIdError, InvalidInputError, InvalidPayloadError
from ..message import Headers, NewMessage, Payload, check_priority
from ..options import brief
from ..queue import Queue
from .spec import COLUMN_OPTIONS, WriteSpec, new_job_key, parse_positive_int

# -- the executor-side factory cache ------------------------------------------------------

_cache_lock = threading.Lock()
_factories: dict[tuple[int, str, str], sync.SyncFactory] = {}


def _forget_after_fork() -> None:
    global _cache_lock
    _cache_lock = threading.Lock()
    _factories.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def executor_factory(backend: str, options: Mapping[str, Any]) -> sync.SyncFactory:
    """This process's factory for ``backend`` + ``options``, opened on first use and kept
    for the life of the process (closed at exit by :mod:`aio_keuss.sync`)."""
    key = (os.getpid(), backend, repr(sorted(options.items())))
    factory = _factories.get(key)
    if factory is not None and not factory.closed:
        return factory
    with _cache_lock:
        factory = _factories.get(key)
        if factory is None or factory.closed:
            factory = _factories[key] = sync.connect(backend, **options)
        return factory


def executor_queue(backend: str, queue: str, options: Mapping[str, Any]) -> sync.SyncQueue:
    return executor_factory(backend, options).queue(queue)


def close_executor_factories() -> None:
    """Close the cached factories now (tests; a driver that wants its loop thread gone)."""
    with _cache_lock:
        factories = list(_factories.values())
        _factories.clear()
    for factory in factories:
        factory.close()


# -- rows to messages -----------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """What Spark hands out but JSON lacks: timestamps and dates become ISO-8601 text,
    decimals text (no precision lost), maps (lists of pairs from Arrow) dicts."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if value and all(isinstance(item, tuple) and len(item) == 2 for item in value):
            return {str(k): _plain(v) for k, v in value}
        return [_plain(item) for item in value]
    if isinstance(value, _dt.datetime | _dt.date | _dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytearray):
        return bytes(value)
    if hasattr(value, "asDict"):  # a pyspark Row
        return _plain(value.asDict(recursive=True))
    return value


def _as_dict(row: Any) -> dict[str, Any]:
    if isinstance(row, dict):
        return row
    if hasattr(row, "asDict"):
        result: dict[str, Any] = row.asDict(recursive=True)
        return result
    if isinstance(row, Mapping):
        return dict(row)
    raise InvalidInputError(f"cannot read a {type(row).__name__} as a row of named columns")


def _json_value(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise InvalidPayloadError(f"{what} is not JSON text: {exc}: {value[:80]!r}") from exc
    if isinstance(value, list) and value and isinstance(value[0], tuple):
        return dict(value)  # an Arrow map
    if hasattr(value, "asDict"):
        return value.asDict(recursive=True)
    return value


def _headers_value(value: Any, what: str) -> Any:
    """A headers column's value: JSON object text as it is; a struct or map (a dict here)
    without its null fields, which are no header (as ``to_json`` of the struct omits them),
    its timestamps and decimals text, as in a payload (a header is a str, int, float or
    bool: those failed the task at the first row holding one)."""
    if isinstance(value, str):
        return _json_value(value, what) or None
    headers = _json_value(value, what)
    if isinstance(headers, dict):
        headers = {str(k): _plain(v) for k, v in headers.items() if v is not None}
    return headers or None


def _seconds(value: Any) -> Any:
    """A delay column's value: null is no delay; a DECIMAL (what Spark SQL makes of a literal
    such as 0.5) is taken as its float; anything else goes to the queue's own check."""
    if value is None:
        return 0.0
    if isinstance(value, decimal.Decimal):
        return float(value)
    return value


def _priorities(values: list[Any], first: int) -> list[int]:
    """A priority column's values (rows from ``first`` on): null is 0; anything but an int
    in range is refused naming its row, before the batch is pushed (the queue's own check
    would name no row)."""
    for offset, value in enumerate(values):
        if value is None:
            continue
        try:
            check_priority(value)
        except InvalidInputError as exc:
            raise InvalidInputError(
                f"row {first + offset} has {brief(value)} in priority_column: {exc}"
            ) from None
    return [0 if value is None else value for value in values]


@dataclass(slots=True)
class _Batch:
    payloads: list[Payload] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    headers: list[Headers | None] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)
    priorities: list[int] = field(default_factory=list)
    encoded: bool = False
    """``payloads`` are the blobs ``encode_payload`` would make (see :func:`_payload_blobs`)."""


IN_FLIGHT = 3
"""Batches a task has on the wire while it prepares the next: the rows of batch k+1 become
messages while the backend stores batch k. Three match the inserts a postgres queue runs
at once (on as many connections); a Redis server is busy with one, the others wait in
its socket."""


class _Pusher:
    """Turns rows into messages and pushes them in batches through the sync shim, a whole
    list of rows at a time (no Python call per row where the payload is the row itself)."""

    def __init__(self, spec: WriteSpec, id_base: str | None) -> None:
        self.spec = spec
        self.id_base = id_base
        self.queue = executor_queue(spec.backend, spec.queue, spec.options)
        self.index = 0
        self.pushed = 0
        self._pending: deque[tuple[Future[Any], _Batch]] = deque()
        self._rest: list[Any] = []
        self._rest_blobs: list[bytes] = []
        self._rest_keys: list[Any] | None = None
        self._make_plain = False
        meta = (spec.headers_column, spec.delay_column, spec.priority_column)
        self._per_message = any(c is not None for c in meta)
        self._meta = {c for c in meta if c is not None}

    def add_many(self, rows: list[Any]) -> None:
        """Push ``rows`` (dicts, or Rows), ``batch_size`` to a push: what is left over waits
        for the next rows (Arrow batches need not be multiples of ``batch_size``)."""
        size = self.spec.batch_size
        self._send_rest_blobs()
        if self._rest:
            rows = self._rest + rows
        end = len(rows) - len(rows) % size
        for start in range(0, end, size):
            self._send(self._batch(rows[start : start + size]))
        self._rest = rows[end:]

    def add_encoded(self, blobs: list[bytes], keys: list[Any] | None) -> None:
        """:meth:`add_many` of rows already encoded (see :func:`_payload_blobs`), ``keys``
        their ``id_column`` values. What is left over of rows of the other kind goes first,
        in a batch of its own, so that rows keep their order and index."""
        size = self.spec.batch_size
        if self._rest:
            rest, self._rest = self._rest, []
            self._send(self._batch(rest))
        if self._rest_blobs:
            blobs = self._rest_blobs + blobs
            if keys is not None and self._rest_keys is not None:
                keys = self._rest_keys + keys
        end = len(blobs) - len(blobs) % size
        for start in range(0, end, size):
            some = None if keys is None else keys[start : start + size]
            self._send(self._encoded_batch(blobs[start : start + size], some))
        self._rest_blobs = blobs[end:]
        self._rest_keys = None if keys is None else keys[end:]

    def _send_rest_blobs(self) -> None:
        if self._rest_blobs:
            blobs, self._rest_blobs = self._rest_blobs, []
            self._send(self._encoded_batch(blobs, self._rest_keys))

    def _encoded_batch(self, blobs: list[bytes], keys: list[Any] | None) -> _Batch:
        batch = _Batch(payloads=blobs, encoded=True)
        if keys is not None:
            batch.ids = self._column_ids(keys)
        elif self.id_base is not None:
            batch.ids = self._index_ids(len(blobs))
        self.index += len(blobs)
        return batch

    def _column_ids(self, keys: list[Any]) -> list[str]:
        """The ids of rows from ``self.index`` on, from their ``id_column`` values."""
        for offset, key in enumerate(keys):
            if key is None or key == "":
                raise InvalidIdError(f"row {self.index + offset} has no value in id_column")
            if key != key:  # every NaN would be the id "nan": one message for them all
                raise InvalidIdError(f"row {self.index + offset} has NaN in id_column")
        prefix = self.spec.id_prefix
        return [f"{prefix}{key}" for key in keys]

    def _index_ids(self, count: int) -> list[str]:
        """The ids of ``count`` rows from ``self.index`` on, from the id base."""
        base = self.id_base
        return [f"{base}:{i}" for i in range(self.index, self.index + count)]

    def _batch(self, rows: list[Any]) -> _Batch:
        spec = self.spec
        if not all(type(row) is dict for row in rows):
            rows = [row if isinstance(row, dict) else _as_dict(row) for row in rows]
        try:
            return self._batch_of(rows)
        except KeyError as exc:  # a named column a row lacks (push_rows, push_partitions)
            for what in COLUMN_OPTIONS:
                if exc.args and getattr(spec, what) == exc.args[0]:
                    raise ConfigError(
                        f"{what} {exc.args[0]!r} is not a column of every row (rows from"
                        f" {self.index} on); the first has: {', '.join(map(str, rows[0]))}"
                    ) from exc
            raise

    def _batch_of(self, rows: list[dict[str, Any]]) -> _Batch:
        spec = self.spec
        batch = _Batch()
        if spec.payload_column is not None:
            column = spec.payload_column
            batch.payloads = [_json_value(row[column], column) for row in rows]
        elif self._meta:
            meta = self._meta
            batch.payloads = [{k: v for k, v in row.items() if k not in meta} for row in rows]
        else:
            batch.payloads = rows
        if self._make_plain:
            batch.payloads = [_plain(p) for p in batch.payloads]
        if spec.id_column is not None:
            column = spec.id_column
            batch.ids = self._column_ids([row[column] for row in rows])
        elif self.id_base is not None:
            batch.ids = self._index_ids(len(rows))
        if self._per_message:
            if spec.headers_column is not None:
                column = spec.headers_column
                batch.headers = [_headers_value(row[column], column) for row in rows]
            else:
                batch.headers = [None] * len(rows)
            if spec.delay_column is not None:
                column = spec.delay_column
                batch.delays = [_seconds(row[column]) for row in rows]
            else:
                batch.delays = [0.0] * len(rows)
            if spec.priority_column is not None:
                column = spec.priority_column
                batch.priorities = _priorities([row[column] for row in rows], self.index)
            else:  # the option's, every row's (a headers or delay column sends rows here)
                batch.priorities = [spec.priority] * len(rows)
        self.index += len(rows)
        return batch

    def _send(self, batch: _Batch) -> None:
        if not batch.payloads:
            return
        self._pending.append((self._start(batch), batch))
        while len(self._pending) > IN_FLIGHT:
            self._settle(*self._pending.popleft())

    def _start(self, batch: _Batch) -> Future[Any]:
        if batch.encoded:
            return self.queue.call_soon(_push_encoded, batch, self.spec.priority)
        if not self._per_message:
            if self.spec.priority:
                return self.queue.call_soon(_push_many_at, batch, self.spec.priority)
            return self.queue.call_soon(_push_many, batch)
        return self.queue.call_soon(_push_each, batch)

    def _settle(self, future: Future[Any], batch: _Batch) -> None:
        try:
            future.result()
        except InvalidPayloadError:
            if batch.encoded:  # JSON-native columns: made plain they would be the same
                raise
            # Timestamps, decimals... made plain only when needed: the fast path stays lean.
            # Bad input is refused before anything is written, so pushing again is safe.
            # The columns stay what they are: later batches are made plain before sending.
            self._make_plain = True
            batch.payloads = [_plain(p) for p in batch.payloads]
            self._start(batch).result()
        self.pushed += len(batch.payloads)

    def finish(self) -> int:
        """Wait for every batch on the wire; the first failure is raised once all are
        done (a retried task pushes the same ids again: nothing doubles)."""
        failure: BaseException | None = None
        try:
            self._send_rest_blobs()
            if self._rest:
                rest, self._rest = self._rest, []
                self._send(self._batch(rest))
        except BaseException as exc:
            failure = exc
        while self._pending:
            future, batch = self._pending.popleft()
            try:
                self._settle(future, batch)
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return self.pushed

    def abandon(self) -> None:
        """The rows failed (the task dies): let what is on the wire land before raising,
        so no push of this attempt outlives it unobserved."""
        while self._pending:
            future, _ = self._pending.popleft()
            with contextlib.suppress(BaseException):
                future.result()


async def _push_many(queue: Queue, batch: _Batch) -> list[str]:
    return await queue.push_many(batch.payloads, ids=batch.ids or None)


async def _push_many_at(queue: Queue, batch: _Batch, priority: int) -> list[str]:
    """Rows all of one priority (option ``priority``): one ``push_many`` as without, its
    priority checked once for the batch."""
    return await queue.push_many(batch.payloads, ids=batch.ids or None, priority=priority)


async def _push_encoded(queue: Queue, batch: _Batch, priority: int) -> list[str]:
    """Rows already encoded (see :func:`_payload_blobs`): ``push_many`` without encoding."""
    return await queue._push_encoded(batch.payloads, ids=batch.ids or None, priority=priority)


async def _push_each(queue: Queue, batch: _Batch) -> list[str]:
    """Messages with their own headers / delay / priority, through ``Queue.push_each``:
    every one is checked as a push checks it before any is written, then they go in together
    in batch round trips. A refusal must come before anything is written, as push_many's
    does: the batch is then pushed again made plain, or the task fails and Spark retries
    it, and without idempotent ids what went in would go in twice."""
    ids: Sequence[str | None] = batch.ids or [None] * len(batch.payloads)
    return await queue.push_each(
        [
            NewMessage(payload, delay, headers, message_id, priority)
            for payload, delay, headers, message_id, priority in zip(
                batch.payloads, batch.delays, batch.headers, ids, batch.priorities, strict=True
            )
        ]
    )


def _pusher(spec: WriteSpec, id_base: str | None) -> _Pusher:
    if not spec.idempotent or spec.id_column is not None:
        id_base = None
    elif id_base is None:
        raise ConfigError("idempotent pushes need an id base (job key and partition)")
    return _Pusher(spec, id_base)


def _push_lists(spec: WriteSpec, lists: Iterable[list[Any] | _Encoded], id_base: str | None) -> int:
    pusher = _pusher(spec, id_base)
    try:
        for rows in lists:
            if isinstance(rows, _Encoded):
                pusher.add_encoded(rows.blobs, rows.keys)
            else:
                pusher.add_many(rows)
    except BaseException:
        pusher.abandon()
        raise
    return pusher.finish()


def _chunks(rows: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def push_rows(spec: WriteSpec, rows: Iterable[Any], id_base: str | None) -> int:
    """Push ``rows`` (Rows, dicts) as messages; ids are ``f"{id_base}:{row index}"`` unless
    ``spec`` names an id column or is not idempotent. Returns how many were pushed, once
    every one of them is stored."""
    return _push_lists(spec, _chunks(rows, spec.batch_size), id_base)


def push_arrow_batches(spec: WriteSpec, batches: Iterable[Any], id_base: str | None) -> int:
    """Like :func:`push_rows` for Arrow record batches: ``to_pylist`` builds the row dicts
    of a whole batch in C, several times faster than Spark's Row objects. Arrow gives a map
    as a list of (key, value) pairs, which an empty map cannot be told from an empty array
    by: columns holding a map are made dicts by their type (an empty map was ``[]``).

    Where the row is the payload and its columns are all of types whose JSON Arrow can
    write as orjson does (see :func:`_payload_blobs`), no row dict is made at all."""
    whole_rows = spec.payload_column is None and not any(
        getattr(spec, what) is not None
        for what in ("headers_column", "delay_column", "priority_column")
    )

    def lists() -> Iterator[list[dict[str, Any]] | _Encoded]:
        for batch in batches:
            blobs = None
            # (an id column the rows lack is refused the row way, naming the option)
            if whole_rows and spec.id_column in (None, *batch.schema.names):
                blobs = _payload_blobs(batch)
            if blobs is None:
                yield _rows_of(batch)
                continue
            keys = None
            if spec.id_column is not None:
                keys = batch.column(spec.id_column).to_pylist()
            yield _Encoded(blobs, keys)

    return _push_lists(spec, lists(), id_base)


@dataclass(slots=True)
class _Encoded:
    """An Arrow batch's rows as payload blobs, and their ``id_column`` values."""

    blobs: list[bytes]
    keys: list[Any] | None


_NEEDS_ESCAPE = bytes(sorted(set(range(256)) - set(range(0x20)) - set(b'"\\')))
"""Every byte but those orjson escapes in a str (the controls, quote and backslash):
``translate`` deleting these leaves only bytes that would need escaping."""


def _payload_blobs(batch: Any) -> list[bytes] | None:
    """The payload blobs (``encode_payload``'s, byte for byte) of a record batch's rows, its
    columns' JSON written by Arrow's string kernels a batch at a time; or None where orjson
    and the payload checks are needed: a column of any type but integers, booleans, nulls
    and UTF-8 strings that need no escaping (no control character, quote or backslash), or
    columns that would not make a dict of their own (none, or two of one name), or only
    columns of the null type, or a Table rather than a record batch.

    Made from the rows, each blob is ``b"J" + orjson.dumps(row)``: keys in column order,
    integers in decimal, ``true`` / ``false`` / ``null``, a str as its UTF-8 between quotes
    (orjson escapes nothing else), no spaces. to_pylist, orjson and the check that the
    payload would come back as itself were most of a Spark write task's client time;
    these columns pass that check whatever they hold."""
    import pyarrow as pa  # type: ignore[import-untyped]

    if not isinstance(batch, pa.RecordBatch):  # a Table's columns are chunked
        return None
    names = batch.schema.names
    if not names or len(set(names)) != len(names) or batch.num_rows == 0:
        return None
    # Arrow joins strings of one type: large ones if any column is (Spark's
    # useLargeVarTypes), which holds the others too
    large = any(pa.types.is_large_string(kind) for kind in batch.schema.types)
    try:
        return _joined(batch, large)
    except pa.ArrowCapacityError:
        if large:
            raise
    # the rows' JSON is more than a string array holds (2 GiB), though no column is
    return _joined(batch, True)


def _joined(batch: Any, large: bool) -> list[bytes] | None:
    """:func:`_payload_blobs` of a batch it takes, its text in large strings or not."""
    import pyarrow as pa
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    text_type = pa.large_string() if large else pa.string()
    parts: list[Any] = []
    literal = "J{"
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        kind = column.type
        literal += orjson.dumps(name).decode() + ":"
        if pa.types.is_integer(kind):
            text = pc.cast(column, text_type)
        elif pa.types.is_boolean(kind):
            text = pc.if_else(column, pa.scalar("true", text_type), pa.scalar("false", text_type))
        elif pa.types.is_null(kind):
            literal += "null,"
            continue
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            if not _plain_text(column):
                return None
            if column.type != text_type:
                column = pc.cast(column, text_type)
            if column.null_count == 0:  # the quotes go with the literals around
                parts += [literal + '"', column]
                literal = '",'
                continue
            quote = pa.scalar('"', text_type)
            text = pc.binary_join_element_wise(quote, column, quote, pa.scalar("", text_type))
        else:
            return None
        if column.null_count:
            text = pc.fill_null(text, pa.scalar("null", text_type))
        parts += [literal, text]
        literal = ","
    if not parts:  # columns all of the null type: nothing to join
        return None
    parts.append(literal[:-1] + "}")
    texts = [pa.scalar(part, text_type) if isinstance(part, str) else part for part in parts]
    joined = pc.binary_join_element_wise(*texts, pa.scalar("", text_type))
    blobs: list[bytes] = pc.cast(joined, pa.large_binary() if large else pa.binary()).to_pylist()
    return blobs


def _plain_text(column: Any) -> bool:
    """Whether every str of a string column is UTF-8 that needs no escaping in JSON. Looks
    at the bytes the column's values span (a null's may hold anything: at worst the batch
    goes the slow way).

    Arrow does not check that a string column is UTF-8, nor does Spark (``CAST(binary AS
    STRING)`` keeps any bytes): written as they are, such bytes would make a blob no
    consumer can decode, where the row way fails the write (``to_pylist`` cannot make them
    a str). ASCII is UTF-8 whatever the cuts between values; other text is checked value by
    value (Arrow's full validation), since values valid together may not be one by one (a
    character cut between two)."""
    _, offsets, data = column.buffers()
    if data is None or len(column) == 0:
        return True
    import pyarrow as pa

    spans = memoryview(offsets).cast("q" if pa.types.is_large_string(column.type) else "i")
    start, end = spans[column.offset], spans[column.offset + len(column)]
    text = bytes(memoryview(data)[start:end])
    if text.translate(None, _NEEDS_ESCAPE):
        return False
    if not text.isascii():
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:
            return False
    return True


def _rows_of(batch: Any) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = batch.to_pylist()
    for field_ in batch.schema:
        if _holds_map(field_.type):
            name, kind = field_.name, field_.type
            for row in rows:
                row[name] = _by_type(row[name], kind)
    return rows


def _holds_map(kind: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_map(kind):
        return True
    if pa.types.is_struct(kind):
        return any(_holds_map(kind.field(i).type) for i in range(kind.num_fields))
    if _is_list(kind):
        return _holds_map(kind.value_type)
    return False


def _is_list(kind: Any) -> bool:
    import pyarrow as pa

    return bool(
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    )


def _by_type(value: Any, kind: Any) -> Any:
    """``value`` as ``to_pylist`` gave it, with every map of ``kind`` made a dict."""
    import pyarrow as pa

    if value is None:
        return None
    if pa.types.is_map(kind):
        return {str(k): _by_type(v, kind.item_type) for k, v in value}
    if pa.types.is_struct(kind):
        fields = [kind.field(i) for i in range(kind.num_fields)]
        return {f.name: _by_type(value.get(f.name), f.type) for f in fields}
    if _is_list(kind):
        return [_by_type(item, kind.value_type) for item in value]
    return value


def task_partition() -> int:
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        raise ConfigError("not in a Spark task: no TaskContext to derive message ids from")
    return context.partitionId()


def push_partitions(
    backend: str,
    queue: str,
    id_column: str | None = None,
    batch_size: int = 1000,
    *,
    job_key: str | None = None,
    payload_column: str | None = None,
    headers_column: str | None = None,
    delay_column: str | None = None,
    priority_column: str | None = None,
    priority: int = 0,
    id_prefix: str = "",
    idempotent: bool = True,
    **options: Any,
) -> Callable[[Iterator[Any]], None]:
    """A function for ``df.foreachPartition`` / ``rdd.foreachPartition`` pushing each row
    (a Row or dict: its columns make the payload dict) into ``queue``.

    Ids: ``f"{id_prefix}{row[id_column]}"``, else ``f"{job_key}:{partition}:{row index}"``.
    ``job_key`` defaults to a key made here, on the driver, once: every attempt of a task
    derives the same ids. Give your own to make a re-run of the whole job idempotent too.
    ``priority_column`` (an integer column, null 0) or ``priority`` (every row's) need a
    backend with ``capabilities.priority``.
    ``options`` go to ``aio_keuss.connect`` (``url``, ``prefix``, ``schema``...).
    """
    spec = WriteSpec(
        backend=backend,
        queue=queue,
        options=dict(options),
        payload_column=payload_column,
        headers_column=headers_column,
        delay_column=delay_column,
        id_column=id_column,
        id_prefix=id_prefix,
        job_key=job_key,
        batch_size=parse_positive_int(batch_size, "batch_size"),
        idempotent=idempotent,
        priority_column=priority_column,
        priority=priority,
    )
    spec.check()
    spec = spec.with_job_key(new_job_key())

    def push_partition(rows: Iterator[Any]) -> None:
        push_rows(spec, rows, f"{spec.job_key}:{task_partition()}")

    return push_partition
