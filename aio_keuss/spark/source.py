"""The ``aio_keuss`` PySpark data source (pyspark >= 4.0 Python Data Source API).

Register it with ``aio_keuss.spark.register(spark)``, then:

- ``df.write.format("aio_keuss")`` pushes rows (idempotent ids per job, see
  :mod:`aio_keuss.spark`);
- ``df.writeStream.format("aio_keuss")`` does the same per micro-batch, ids derived from the
  query id (stable across restarts from a checkpoint), the batch id, the partition and the
  row index, so a batch replayed after a restart does not duplicate;
- ``spark.readStream.format("aio_keuss")`` reserves messages on the driver, hands them to
  the tasks inside the input partitions, and acknowledges (``ok``) them only in
  ``commit(end)``, after the micro-batch reached the sink: at-least-once, nothing lost by a
  crash. While it holds them the driver extends their reservations (where the backend can,
  ``capabilities.extend``), so a micro-batch may run longer than ``reserve_delay``; those of a
  driver that dies come back once ``reserve_delay`` has passed, those of a stopped query at
  once (or, the server not answering within ``stop_timeout`` seconds, default 10, once they
  expire: a stop does not wait on a dead connection for ever). Without ``extend``, keep
  ``reserve_delay`` well above the longest micro-batch (trigger interval + processing time);
- ``spark.read.format("aio_keuss")`` takes what is ready now: with ``read_mode=reserve``
  (the default where the backend can reserve) each task reserves a chunk, yields its rows and
  oks the chunk once Spark has taken all of them from the reader. The Python Data Source API
  tells a batch reader nothing about the end of its task, so a task that fails while reading
  gets its messages back (after ``reserve_delay``), but one that fails later in the same task
  (a UDF, the sink) does not, and a ``limit`` may leave rows taken that never reach the job.
  With ``read_mode=pop`` messages are popped (at-most-once). Either way reading consumes:
  cache or write the DataFrame once rather than evaluating it twice; for at-least-once into
  a sink, read with ``readStream``, which oks only at commit.

Read schema: ``id string, payload string (JSON), headers string (JSON object), tries int,
mature timestamp, priority int, payload_bytes binary`` (bytes payloads land in
``payload_bytes``; ``priority`` is 0 where the backend has no priorities).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    MapType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from .. import sync
from ..errors import ConfigError, InvalidInputError
from ..message import Message
from ..options import check_queue_name
from ..types import Capabilities
from .executor import executor_factory, push_arrow_batches, push_rows
from .spec import (
    FORMAT,
    READ_OPTIONS,
    READ_SCHEMA,
    WRITE_OPTIONS,
    MessageRow,
    WriteSpec,
    connect_options,
    message_row,
    new_job_key,
    parse_positive_float,
    parse_positive_int,
    required,
)

try:  # pyspark >= 4.1: Trigger.AvailableNow asks the reader itself for each batch
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - pyspark 4.0

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        """Absent before pyspark 4.1 (Spark then wraps the reader itself)."""


try:  # pyspark >= 4.1: Arrow batches straight from the JVM
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamWriterBase
except ImportError:  # pragma: no cover - pyspark 4.0
    from pyspark.sql.datasource import (  # type: ignore[assignment]
        DataSourceStreamWriter as _StreamWriterBase,
    )

__all__ = ["KeussDataSource"]

BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"

RENEWALS_PER_DELAY = 4
"""A stream reader extends what it holds every ``reserve_delay / RENEWALS_PER_DELAY``: a
round that fails, or a driver stalled for a while, still leaves most of the reservation."""

STOP_TIMEOUT = 10.0
"""Seconds a stream reader's ``stop`` waits, by default (option ``stop_timeout``), for each of
the renewal round in flight, the give-back of what it holds and the close of its connection,
before it abandons that step: a server that answers nothing would hold Spark's stop of the
query for ever."""

log = logging.getLogger(__name__)


@dataclass
class PushedMessage(WriterCommitMessage):
    """What a write task reports to the driver."""

    partition: int
    attempt: int
    count: int


def _push(spec: WriteSpec, items: Iterator[Any], id_base: str | None) -> int:
    """Arrow record batches (pyspark >= 4.1 hands the Arrow writers nothing else) go in
    whole; Rows (the row-based writers of pyspark 4.0) are gathered into batches."""
    first = next(items, None)
    if first is None:
        return 0
    if hasattr(first, "to_pylist"):
        return push_arrow_batches(spec, itertools.chain((first,), items), id_base)
    return push_rows(spec, itertools.chain((first,), items), id_base)


def _check_connect(spec: WriteSpec | ReadSpec) -> Capabilities:
    """Open (and close) a factory on the driver for each query, so an unknown option, bad
    URL or unreachable server fails it before any task writes or reads (once per option
    set, a server gone since an earlier query of the driver passed, and every task failed).
    Returns what the opened factory can do: options may take a capability away (a Redis
    cluster has no ``move``), which the backend's class does not tell."""
    with sync.connect(spec.backend, **spec.options) as factory:
        factory.queue(spec.queue)
        return factory.capabilities


STREAM_CHECK_INTERVAL = 60.0
"""Seconds a stream writer's connect check stands for its later micro-batches."""

_stream_checks_lock = threading.Lock()
_stream_checks: dict[str, tuple[float, Capabilities]] = {}


def _check_stream_connect(spec: WriteSpec, options: Mapping[str, Any]) -> Capabilities:
    """The connect check of a streaming write: Spark makes the stream writer on the driver
    twice per micro-batch (to plan the write, then to commit it, each in a Python worker
    of the driver that lives on across micro-batches), and a factory opened and closed each
    time cost a small micro-batch a fifth of its time. Nothing Spark hands the
    writer names the query but its options (with ``checkpointLocation`` when given as one),
    so the check is kept per option set for ``STREAM_CHECK_INTERVAL`` seconds: a stream's
    first micro-batch checks, a server gone since fails a later one's tasks, as it would
    mid-batch. Batch reads and writes check each query (``_check_connect``)."""
    key = repr((spec.backend, sorted((str(k).lower(), str(v)) for k, v in options.items())))
    now = time.monotonic()
    with _stream_checks_lock:
        known = _stream_checks.get(key)
    if known is not None and now - known[0] < STREAM_CHECK_INTERVAL:
        return known[1]
    capabilities = _check_connect(spec)
    with _stream_checks_lock:
        _stream_checks[key] = (time.monotonic(), capabilities)
    return capabilities


def _context() -> TaskContext:
    context = TaskContext.get()
    if context is None:
        raise ConfigError("aio_keuss: not running inside a Spark task")
    return context


class KeussBatchWriter(DataSourceArrowWriter):
    def __init__(self, spec: WriteSpec) -> None:
        self.spec = spec

    def write(self, iterator: Iterator[Any]) -> PushedMessage:
        context = _context()
        partition = context.partitionId()
        count = _push(self.spec, iterator, f"{self.spec.job_key}:{partition}")
        return PushedMessage(partition, context.attemptNumber(), count)


class KeussStreamWriter(_StreamWriterBase):
    def __init__(self, spec: WriteSpec) -> None:
        self.spec = spec

    def write(self, iterator: Iterator[Any]) -> PushedMessage:
        context = _context()
        partition = context.partitionId()
        batch_id = context.getLocalProperty(BATCH_ID_PROPERTY)
        job_key = self.spec.job_key or context.getLocalProperty(QUERY_ID_PROPERTY)
        id_base = None
        if self.spec.idempotent and self.spec.id_column is None:
            if batch_id is None or job_key is None:
                raise ConfigError(
                    "aio_keuss: Spark did not tell this task its micro-batch; name an"
                    " id_column (or set idempotent=false)"
                )
            id_base = f"{job_key}:{batch_id}:{partition}"
        count = _push(self.spec, iterator, id_base)
        return PushedMessage(partition, context.attemptNumber(), count)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: every push was acknowledged by the backend in ``write``."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Pushes cannot be taken back; the replay of this batch dedupes by id."""


# -- reading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadSpec:
    backend: str
    queue: str
    options: dict[str, Any]
    read_mode: str
    max_rows: int | None
    max_rows_per_batch: int
    num_partitions: int
    stop_timeout: float = STOP_TIMEOUT

    @classmethod
    def from_options(cls, raw: Mapping[str, Any]) -> ReadSpec:
        from ..registry import load_backend

        lowered = {key.lower(): value for key, value in raw.items()}
        backend = required(lowered, "backend")
        capabilities = load_backend(backend).capabilities
        mode = str(lowered.get("read_mode") or ("reserve" if capabilities.reserve else "pop"))
        if mode not in ("reserve", "pop"):
            raise ConfigError(f"read_mode must be 'reserve' or 'pop', not {mode!r}")
        if mode == "reserve" and not capabilities.reserve:
            raise ConfigError(f"backend {backend!r} cannot reserve: use read_mode=pop")
        max_rows = lowered.get("max_rows")
        queue = required(lowered, "queue")
        try:  # here, not only by the driver's connect check, which a stream's write keeps a while
            check_queue_name(queue)
        except InvalidInputError as exc:
            raise ConfigError(str(exc)) from exc
        return cls(
            backend=backend,
            queue=queue,
            options=connect_options(lowered, WRITE_OPTIONS | READ_OPTIONS, backend),
            read_mode=mode,
            max_rows=None if max_rows in (None, "") else parse_positive_int(max_rows, "max_rows"),
            max_rows_per_batch=parse_positive_int(
                lowered.get("max_rows_per_batch", 10_000), "max_rows_per_batch"
            ),
            num_partitions=parse_positive_int(lowered.get("num_partitions", 2), "num_partitions"),
            stop_timeout=parse_positive_float(
                lowered.get("stop_timeout", STOP_TIMEOUT), "stop_timeout"
            ),
        )

    def queue_(self) -> sync.SyncQueue:
        return executor_factory(self.backend, self.options).queue(self.queue)


async def _ok_all(queue: Any, messages: Sequence[Message]) -> int:
    """ok many at once: the queue coalesces them into batch commits."""
    import asyncio

    results = await asyncio.gather(*(queue.ok(message) for message in messages))
    return sum(results)


async def _release_all(queue: Any, messages: Sequence[Message]) -> None:
    """Give reservations back at no try, as a stopped consumer does: a ``ko`` would count
    one, and past the deadletter's ``max_ko`` move a message that never failed there."""
    await queue._release_all(messages)


def _ok(queue: sync.SyncQueue, messages: Sequence[Message]) -> int:
    if not messages:
        return 0
    return queue.call(_ok_all, messages)


class KeussBatchReader(DataSourceReader):
    """Each partition takes an equal share of ``max_rows`` (all that is ready by default)."""

    def __init__(self, spec: ReadSpec) -> None:
        self.spec = spec

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(i) for i in range(self.spec.num_partitions)]

    def read(self, partition: InputPartition) -> Iterator[MessageRow]:
        spec = self.spec
        queue = spec.queue_()
        chunk = queue.queue.options.max_batch
        limit = None
        if spec.max_rows is not None:
            share, extra = divmod(spec.max_rows, spec.num_partitions)
            limit = share + (1 if partition.value < extra else 0)
        taken = 0
        while limit is None or taken < limit:
            n = chunk if limit is None else min(chunk, limit - taken)
            if spec.read_mode == "pop":
                messages = queue.pop_many(n, timeout=0)
            else:
                messages = queue.reserve_many(n, timeout=0)
            if not messages:
                return
            taken += len(messages)
            for message in messages:
                yield message_row(message)
            if spec.read_mode == "reserve":  # Spark consumed the chunk's rows: done with them
                _ok(queue, messages)


class KeussStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Runs on the driver (one long-lived Python process per query), except ``read``.

    Offsets are ``{"run": <this reader's token>, "seq": n}``: the messages of offset n were
    reserved by this reader in ``latestOffset`` and are kept here until ``commit`` oks them.
    A batch replayed after a restart names another run's offset: it is planned empty, and
    its messages, never acknowledged, come back when their reservations expire.

    ``Trigger.AvailableNow``: the reader takes it on itself (``prepareForTriggerAvailableNow``)
    rather than let Spark wrap it. Spark's wrapper asks ``latestOffset`` once, for one batch of
    ``max_rows_per_batch``, and then never again: the rest stayed in the queue and that batch
    was never acknowledged (no later ``latestOffset`` to commit it in), so it came back after
    ``reserve_delay`` and went through the sink again, on every run. Here the run goes on,
    batch by batch, through what was ready when it started, and the ``latestOffset`` that
    finds nothing more acknowledges the last batch before the query ends.
    """

    def __init__(self, spec: ReadSpec) -> None:
        self.spec = spec
        self.run = uuid.uuid4().hex[:12]
        self._seq = 0
        self._pending: dict[int, list[Message]] = {}
        """Changed on Spark's thread only, and then under ``_lock``: the renewer reads it."""
        self._queue: sync.SyncQueue | None = None
        self._budget: int | None = None
        """Under ``Trigger.AvailableNow``: how many more messages this run may take (those
        ready when it started; what arrives later waits for the next run)."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        """Wakes the renewer before its time: stopped, or nothing pending any more."""
        self._stopping = False
        self._lost: set[int] = set()
        """Pending messages (by identity) another consumer took: not extended again."""
        self._acking: set[int] = set()
        """Batches ``commit`` is acknowledging: an extension answered False for one of their
        messages means it was ok-ed meanwhile, not taken by another consumer."""
        self.renews = True
        """False in the copies Spark unpickles on the executors: they never start a renewer."""
        self.renewer: threading.Thread | None = None
        """The driver's thread extending the pending reservations, while there are any. A
        thread that is no longer this one (abandoned by ``stop``) ends after its round."""
        self.renewals = 0
        """Rounds of extensions answered."""
        self.failed = 0
        """Rounds of extensions that raised (the backend away): tried again the next round."""
        self.extended = 0
        """Reservations extended so far."""
        self.lapsed = 0
        """Pending messages found taken by another consumer (delivered twice)."""

    def __getstate__(self) -> dict[str, Any]:
        # Pickled to the executors for ``read``: only the spec travels, not the connection,
        # nor the renewer, its lock or its timer (a lock does not pickle anyway).
        return {"spec": self.spec, "run": self.run}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"])  # type: ignore[misc]
        self.run = state["run"]
        self.renews = False  # an executor's copy: it only reads its partition

    def _q(self) -> sync.SyncQueue:
        if self._queue is None:
            self._factory = sync.connect(self.spec.backend, **self.spec.options)
            self._queue = self._factory.queue(self.spec.queue)
        return self._queue

    def initialOffset(self) -> dict[str, Any]:
        return {"run": "", "seq": 0}

    def prepareForTriggerAvailableNow(self) -> None:
        self._budget = self._q().size()

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadMaxRows

        return ReadMaxRows(self.spec.max_rows_per_batch)

    def latestOffset(self, start: dict[str, Any], limit: Any) -> dict[str, Any]:
        """Reserve the next batch now; an empty queue answers ``start`` (no batch).

        ``start`` is the end of the previous batch, which the engine asks past only once
        that batch is in its commit log: its messages are acknowledged here already, as
        Spark calls ``commit`` only when it plans a further batch -- an idle stream would
        otherwise hold its last batch until the reservations expired and came back.
        """
        self.commit(start)
        wanted = self.spec.max_rows_per_batch
        max_rows = getattr(limit, "max_rows", None)
        if isinstance(max_rows, int):
            wanted = min(wanted, max_rows)
        if self._budget is not None:
            wanted = min(wanted, self._budget)
        queue = self._q()
        chunk = queue.queue.options.max_batch
        reserved: list[Message] = []
        while len(reserved) < wanted:
            got = queue.reserve_many(min(chunk, wanted - len(reserved)), timeout=0)
            if not got:
                break
            reserved.extend(got)
        if not reserved:
            return start
        if self._budget is not None:
            self._budget -= len(reserved)
        self._seq = max(self._seq, int(start.get("seq", 0))) + 1
        with self._lock:
            self._pending[self._seq] = reserved
            self._start_renewer(queue)
        return {"run": self.run, "seq": self._seq}

    def _start_renewer(self, queue: sync.SyncQueue) -> None:
        """Keep the pending reservations alive until ``commit`` (the batch may outlast
        ``reserve_delay``: a long sink, a slow trigger), as ``consume`` does for running
        handlers. One thread on the driver, only while something is pending. Under
        ``_lock``."""
        if self.renewer is not None or not self.renews or not queue.capabilities.extend:
            return
        every = queue.queue.options.reserve_delay / RENEWALS_PER_DELAY
        self.renewer = threading.Thread(
            target=self._renew_loop,
            args=(queue, every),
            name=f"aio-keuss-spark-renew-{self.run}",
            daemon=True,  # a driver ending without stop(): its reservations lapse, as a crash's
        )
        self.renewer.start()

    def _renew_loop(self, queue: sync.SyncQueue, every: float) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                self._wake.wait_for(
                    lambda: self._stopping or not self._pending or self.renewer is not me, every
                )
                if self._stopping or not self._pending or self.renewer is not me:
                    if self.renewer is me:
                        self.renewer = None  # the next batch reserved starts another
                    return
                due = [
                    m
                    for seq in sorted(self._pending)
                    if seq not in self._acking
                    for m in self._pending[seq]
                    if id(m) not in self._lost
                ]
            if due:
                self._renew(queue, due, every)

    def _renew(self, queue: sync.SyncQueue, due: list[Message], every: float) -> None:
        try:
            kept = queue.extend_many(due)
        except Exception as exc:  # an outage: tried again next round, the reservation lasts
            with self._lock:
                if self.renewer is not threading.current_thread():
                    return  # abandoned by stop: its connection closed under the round
                self.failed += 1
            log.warning(
                "queue %r: extending the %d reservations of a pending micro-batch failed"
                " (tried again in %.3g s): %s",
                queue.name,
                len(due),
                every,
                exc,
            )
            return
        with self._lock:
            if self.renewer is not threading.current_thread():
                return  # abandoned by stop, which gave back or left to lapse what it held
            held = {
                id(m)
                for seq, batch in self._pending.items()
                if seq not in self._acking
                for m in batch
            }
            for message, ours in zip(due, kept, strict=True):
                if id(message) not in held:
                    continue  # committed or given back while the extension was out
                if ours:
                    self.extended += 1
                    continue
                self._lost.add(id(message))
                self.lapsed += 1
                log.warning(
                    "queue %r: message %s: its reservation lapsed while its micro-batch was"
                    " pending and another consumer took it (%.3g s reserve_delay): it may"
                    " reach the sink twice",
                    queue.name,
                    message.id,
                    queue.queue.options.reserve_delay,
                )
            self.renewals += 1

    def _forget(self, seqs: list[int]) -> None:
        """Drop acknowledged or given back batches; wakes the renewer to end when none is
        left. Under ``_lock``."""
        for seq in seqs:
            self._lost.difference_update(id(m) for m in self._pending.pop(seq))
        if not self._pending:
            self._wake.notify_all()

    def _stop_renewer(self) -> None:
        """End the renewer, giving the round it may have out ``stop_timeout`` seconds: past
        them it is abandoned (the thread ends when the round does, or when the close cuts
        its connection) rather than waited for without end."""
        with self._lock:
            renewer = self.renewer
            self._stopping = True
            self._wake.notify_all()
        if renewer is not None:
            renewer.join(self.spec.stop_timeout)  # at most one extension still out
        with self._lock:
            self._stopping = False
            if renewer is None or not renewer.is_alive():
                return
            if self.renewer is renewer:
                self.renewer = None  # ends once its round does, touching nothing more
        self._abandoned("the renewal round in flight")

    def _abandoned(self, what: str) -> None:
        log.warning(
            "queue %r: stopping the stream reader: %s did not end within stop_timeout"
            " (%.3g s), abandoned; the reservations not given back come back when they"
            " expire (reserve_delay)",
            self.spec.queue,
            what,
            self.spec.stop_timeout,
        )

    def _within(self, future: Future[Any], what: str) -> None:
        """Wait ``stop_timeout`` seconds for ``future``; past them cancel it (its task on the
        loop thread) and warn. Its own failure is raised."""
        try:
            future.result(self.spec.stop_timeout)
        except FutureTimeoutError:
            future.cancel()
            self._abandoned(what)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        if end.get("run") != self.run:
            return []  # planned by an earlier run: its reservations will expire, then return
        low = int(start.get("seq", 0)) if start.get("run") == self.run else 0
        messages = [
            m
            for seq in sorted(self._pending)
            if low < seq <= int(end["seq"])
            for m in self._pending[seq]
        ]
        n = max(1, min(self.spec.num_partitions, len(messages)))
        rows = [message_row(m) for m in messages]
        return [InputPartition(rows[i::n]) for i in range(n) if rows[i::n]]

    def read(self, partition: InputPartition) -> Iterator[MessageRow]:
        yield from partition.value

    def commit(self, end: dict[str, Any]) -> None:
        """The batch up to ``end`` is in the sink: now, and only now, the messages go."""
        if end.get("run") != self.run:
            return
        done = [seq for seq in self._pending if seq <= int(end["seq"])]
        messages = [m for seq in sorted(done) for m in self._pending[seq]]
        with self._lock:
            self._acking.update(done)
        try:
            _ok(self._q(), messages)
        except BaseException:
            with self._lock:  # still pending (Spark retries the commit): extended again
                self._acking.difference_update(done)
            raise
        with self._lock:
            self._acking.difference_update(done)
            self._forget(done)

    def stop(self) -> None:
        """Give back what was reserved and not committed, at once rather than after
        ``reserve_delay`` (it may have reached the sink: at-least-once), costing no try.

        Each step -- the renewal round in flight, the give-back, the close of the
        connection -- waits at most ``stop_timeout`` seconds: a server that stopped
        answering (a connection a firewall dropped silently) held them, and Spark's stop of
        the query with them, for ever. Past it the step is abandoned with a warning; what
        was not given back was never acknowledged, and comes back when its reservations
        expire. A close cut short still takes up to the grace of a cancelled close
        (``CANCELLED_CLOSE_GRACE``) to close its connections.

        Spark calls it on its own thread, as it does the reader's other calls. Called from
        the loop thread of :mod:`aio_keuss.sync` it would wait for that very thread: it is
        refused there (``LoopThreadError``) before anything changes."""
        sync._runtime.refuse_on_loop_thread("stop of a stream reader")
        self._stop_renewer()
        queue = self._queue
        if queue is None:
            return
        try:
            pending = [m for seq in sorted(self._pending) for m in self._pending[seq]]
            if pending:
                self._within(queue.call_soon(_release_all, pending), "the give-back")
        finally:
            with self._lock:  # given back, or left to expire: none of them is ours any more
                self._forget(list(self._pending))
            self._queue = None
            factory = self._factory
            try:
                self._within(factory.call_soon(factory.factory.close), "the close")
            finally:
                factory.close()  # the loop thread's count; waits out a close cut short


def _check_integral(schema: StructType, column: str | None) -> None:
    """A priority column holds integers: another type (a double, a string) would fail every
    task at its first row, after the job started."""
    from pyspark.sql.types import IntegralType

    if column is not None and not isinstance(schema[column].dataType, IntegralType):
        raise ConfigError(
            f"priority_column {column!r} is {schema[column].dataType.simpleString()},"
            " not an integer column (tinyint, smallint, int, bigint)"
        )


_NOT_A_HEADER: tuple[type, ...] = (ArrayType, BinaryType, MapType, StructType)
_NOT_AN_ID: tuple[type, ...] = (
    ArrayType,
    MapType,
    StructType,
    TimestampType,
    TimestampNTZType,
)


def _check_meta_types(schema: StructType, spec: WriteSpec) -> None:
    """A delay column holds numbers, a headers column JSON text, structs or maps (or nulls
    only), an id column values whose text has no space: another type (a delay as text or
    timestamps, headers as numbers, ids of timestamps) would fail every task at its first
    non-null row, after the job started."""
    from pyspark.sql.types import NullType, NumericType, StringType

    wanted: tuple[tuple[str | None, str, tuple[type, ...], str], ...] = (
        (spec.delay_column, "delay_column", (NumericType, NullType), "a number column"),
        (
            spec.headers_column,
            "headers_column",
            (StringType, StructType, MapType, NullType),
            "a string (JSON object text), struct or map column",
        ),
    )
    for column, what, kinds, expected in wanted:
        if column is not None and not isinstance(schema[column].dataType, kinds):
            raise ConfigError(
                f"{what} {column!r} is {schema[column].dataType.simpleString()}, not {expected}"
            )
    if spec.id_column is not None:
        key = schema[spec.id_column].dataType
        if isinstance(key, _NOT_AN_ID):  # their text has a space; an id has none
            raise ConfigError(
                f"id_column {spec.id_column!r} is {key.simpleString()}: its values' text is"
                " no message id (it holds spaces); name a string, number or date column"
            )
    if spec.headers_column is None:
        return
    kind = schema[spec.headers_column].dataType
    values = []
    if isinstance(kind, StructType):
        values = [field.dataType for field in kind.fields]
    elif isinstance(kind, MapType):
        values = [kind.valueType]
    for value in values:  # a header is one value: a struct, array, map or bytes is none
        if isinstance(value, _NOT_A_HEADER):
            raise ConfigError(
                f"headers_column {spec.headers_column!r} is {kind.simpleString()}: a header is"
                f" text, a number, a boolean, a date or a timestamp, not {value.simpleString()}"
            )


def _named_twice(kind: Any) -> list[str]:
    """The names two fields of one struct share, at any depth of ``kind``."""
    if isinstance(kind, StructType):
        counts = Counter(kind.fieldNames())
        twice = sorted(name for name, count in counts.items() if count > 1)
        return twice + [n for field in kind.fields for n in _named_twice(field.dataType)]
    if isinstance(kind, ArrayType):
        return _named_twice(kind.elementType)
    if isinstance(kind, MapType):
        return _named_twice(kind.keyType) + _named_twice(kind.valueType)
    return []


def _bytes_in_every_row(kind: Any) -> bool:
    """Whether every non-null value of ``kind`` holds bytes: a binary, or a struct with a
    field that cannot be null holding them. An array or map may be empty, so none does."""
    from pyspark.sql.types import BinaryType, StructType

    if isinstance(kind, BinaryType):
        return True
    if isinstance(kind, StructType):
        return any(not f.nullable and _bytes_in_every_row(f.dataType) for f in kind.fields)
    return False


def _check_no_binary_in_json(schema: StructType, spec: WriteSpec) -> None:
    """JSON has no bytes: a binary value inside a payload made of the row, or of a struct
    column, fails every task at its first row (the queue refuses the payload), after the job
    started, where the schema says no row can be without one. A binary that may be null is
    let through (a DataFrame read from a queue has a ``payload_bytes`` column, null for every
    JSON message: written whole into another queue, it worked): a task fails at its first
    bytes value then. A binary payload column is a bytes payload."""
    if spec.payload_column is not None:
        field = schema[spec.payload_column]
        fields = [] if _is_binary(field.dataType) else [field]
    else:
        meta = {spec.headers_column, spec.delay_column, spec.priority_column}
        fields = [f for f in schema.fields if f.name not in meta]
    for field in fields:
        if not field.nullable and _bytes_in_every_row(field.dataType):
            raise ConfigError(
                f"column {field.name!r} is {field.dataType.simpleString()}, never null: JSON"
                " has no bytes, so no payload holding it can be stored; encode it first"
                " (base64(...)), or name a binary column as payload_column (a bytes payload)"
            )


def _is_binary(kind: Any) -> bool:
    from pyspark.sql.types import BinaryType

    return isinstance(kind, BinaryType)


class KeussDataSource(DataSource):
    """``format("aio_keuss")``; options: ``backend``, ``queue``, the backend's connect
    options (``url``, ``prefix``, ``schema``, ``reserve_delay``...) and those of the
    writer / reader (see :mod:`aio_keuss.spark` and this module)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return READ_SCHEMA

    def _write_spec(self, schema: StructType, streaming: bool = False) -> WriteSpec:
        """The write's options and schema checked (each call), then its connection: each
        batch query, a stream once per ``STREAM_CHECK_INTERVAL``."""
        spec = WriteSpec.from_options(self.options)
        twice = _named_twice(schema)
        if twice:  # Spark cannot make their Arrow batches: every task would fail
            raise ConfigError(
                f"columns {', '.join(map(repr, twice))} are named twice: give each column"
                " of a write a name of its own"
            )
        spec.check(schema.fieldNames())
        _check_integral(schema, spec.priority_column)
        _check_meta_types(schema, spec)
        _check_no_binary_in_json(schema, spec)
        check = _check_stream_connect(spec, self.options) if streaming else _check_connect(spec)
        spec.check_priority(check.priority)
        return spec

    def writer(self, schema: StructType, overwrite: bool) -> KeussBatchWriter:
        if overwrite:
            raise ConfigError("a queue can only be appended to: use mode('append')")
        return KeussBatchWriter(self._write_spec(schema).with_job_key(new_job_key()))

    def streamWriter(self, schema: StructType, overwrite: bool) -> KeussStreamWriter:
        return KeussStreamWriter(self._write_spec(schema, streaming=True))

    def _read_spec(self) -> ReadSpec:
        spec = ReadSpec.from_options(self.options)
        _check_connect(spec)
        return spec

    def reader(self, schema: StructType) -> KeussBatchReader:
        return KeussBatchReader(self._read_spec())

    def streamReader(self, schema: StructType) -> KeussStreamReader:
        spec = self._read_spec()
        if spec.read_mode != "reserve":
            raise ConfigError("streaming reads need a backend with reserve (at-least-once)")
        return KeussStreamReader(spec)
