"""Results of finished messages, as the queue layer keeps them: their encoding (once, for
every store), their writes (coalesced, then announced), and the waits for them.

A result body is a small JSON head (orjson) ``{"ok", "error", "finished"}`` (``finished``:
epoch seconds), then, for a success, a newline and the value in the payload encoding
(``message.encode_payload``): the value round-trips as a payload does, bytes as bytes,
and JSON never holds a raw newline, so the first one ends the head. Stores keep bodies as
opaque bytes (see :mod:`aio_keuss.results`).

Waiting never busy-polls: the waits of one queue share one task, which looks up every id
waited for in one ``get``, then sleeps until a "result" signal names one of them (or names
none: too many, or a resync after the signal transport was away), a new wait begins, or
the queue's ``poll_interval`` passes, the bound on what a lost signal costs (as for
consumers).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Final

import orjson

from .coalesce import Coalescer
from .errors import ClosedError, InvalidPayloadError
from .message import decode_payload, encode_payload
from .results import ResultStore
from .signal import Signal, SignalBus
from .types import JobResult

log = logging.getLogger("aio_keuss.queue")

MAX_ERROR_CHARS = 1000
"""Longest error text a failure result keeps (a handler's exception can be long)."""


class NoResult(enum.Enum):
    """The type of :data:`NO_RESULT`."""

    NO_RESULT = "no result"


NO_RESULT: Final = NoResult.NO_RESULT
"""The default ``result`` of ``Queue.ok``: nothing is kept (``None`` is a result)."""

StoreGetter = Callable[[], Awaitable[ResultStore]]
"""The factory's result store, made and opened the first time it is asked for."""

Unstorable = Callable[[str, str], bytes]
"""What a consumer keeps instead of a result too large for the store: ``(id, why)`` -> a
failure's body (the work is done: the message is ok-ed all the same)."""

_UNREAD: Final = -1
"""``ResultWrites``'s bound before it has asked the store for it."""


def error_text(text: str) -> str:
    """An error as a failure result keeps it: bounded."""
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return text[: MAX_ERROR_CHARS - 3] + "..."


def exception_text(exc: BaseException) -> str:
    """``"ExcType: message"`` of a handler's final failure; never raises (an exception's
    ``__str__`` may)."""
    try:
        said = str(exc)
        # kept as JSON, which is UTF-8: a lone surrogate (a name decoded with
        # ``surrogateescape``) is written as its escape rather than failing the final ko
        said = said.encode("utf-8", "backslashreplace").decode()
    except Exception:
        said = "(its message could not be read)"
    return error_text(f"{type(exc).__name__}: {said}" if said else type(exc).__name__)


def encode_success(value: Any, finished: float | None = None) -> bytes:
    """The body of a success; ``InvalidPayloadError`` (before anything is written) for a
    value the payload encoding refuses."""
    blob = encode_payload(value)
    return _head(True, None, finished) + b"\n" + blob


def encode_failure(error: str, finished: float | None = None) -> bytes:
    """The body of a failure."""
    return _head(False, error_text(error), finished)


def _head(ok: bool, error: str | None, finished: float | None) -> bytes:
    when = time.time() if finished is None else finished
    return orjson.dumps({"ok": ok, "error": error, "finished": when})


def decode_result(queue: str, message_id: str, body: bytes) -> JobResult:
    """A kept body read back. One this library did not write (another program's, or
    corrupted) is a failure saying so, with a warning: never an exception to the waiter,
    who would otherwise wait again for what will never read."""
    try:
        head, newline, blob = bytes(body).partition(b"\n")
        fields = orjson.loads(head)
        ok, error, finished = fields["ok"], fields["error"], fields["finished"]
        if (
            not isinstance(ok, bool)
            or not (error is None or isinstance(error, str))
            or isinstance(finished, bool)
            or not isinstance(finished, int | float)
            or ok != bool(newline)
        ):
            raise ValueError("not a result this library wrote")
        value = decode_payload(blob) if ok else None
        return JobResult(message_id, ok, value, error, datetime.fromtimestamp(finished, UTC))
    except Exception as exc:
        log.warning("queue %r: result of %r could not be read: %r", queue, message_id, exc)
        reason = error_text(f"result could not be read: {exc}")
        return JobResult(message_id, False, None, reason, datetime.now(UTC))


class ResultWrites:
    """The result puts of one queue: those of concurrent oks share a round trip, and each
    batch, once kept, is announced to the waiters of every process."""

    def __init__(
        self,
        queue: str,
        store: StoreGetter,
        ttl: float,
        signal: SignalBus,
        *,
        max_batch: int,
        concurrency: int,
        run_in_caller: bool,
    ) -> None:
        self._queue = queue
        self._store = store
        self._ttl = ttl
        self._signal = signal
        self._max_batch = max_batch
        self._most: int | None = _UNREAD  # the store's max_body_bytes, once read
        self._puts: Coalescer[list[tuple[str, bytes]], None] = Coalescer(
            self._put_batch,
            max_batch=max_batch,
            weight=len,
            concurrency=concurrency,
            run_in_caller=run_in_caller,
        )

    async def put(
        self, results: list[tuple[str, bytes]], unstorable: Unstorable | None = None
    ) -> None:
        """Keep ``(id, body)`` results, in puts of at most ``max_batch``; returns once they
        are kept (raises if any is not). A body longer than the store keeps is refused
        with ``InvalidPayloadError`` before anything is put, or, given ``unstorable``,
        replaced by what that returns: one too long would fail the store's whole put,
        shared with the results of other callers."""
        if results:
            results = await self._bounded(results, unstorable)
        size = self._max_batch
        if len(results) <= size:
            if results:
                await self._puts.submit(results)
            return
        chunks = [results[i : i + size] for i in range(0, len(results), size)]
        await asyncio.gather(*(self._puts.submit(chunk) for chunk in chunks))

    async def _bounded(
        self, results: list[tuple[str, bytes]], unstorable: Unstorable | None
    ) -> list[tuple[str, bytes]]:
        """``results`` within the store's ``max_body_bytes`` (see :meth:`put`)."""
        most = self._most
        if most == _UNREAD:
            most = self._most = (await self._store()).max_body_bytes
        if most is None or all(len(body) <= most for _, body in results):
            return results
        bounded: list[tuple[str, bytes]] = []
        for message_id, body in results:
            if len(body) > most:
                why = f"{len(body)} bytes encoded, more than the {most} this backend keeps"
                if unstorable is None:
                    raise InvalidPayloadError(f"result of {message_id!r} not storable: {why}")
                body = unstorable(message_id, why)
            bounded.append((message_id, body))
        return bounded

    async def _put_batch(self, requests: list[list[tuple[str, bytes]]]) -> list[None]:
        results = requests[0] if len(requests) == 1 else [r for req in requests for r in req]
        store = await self._store()
        await store.put(self._queue, results, self._ttl)
        self._signal.results(self._queue, [message_id for message_id, _ in results])
        return [None] * len(requests)

    async def wait_idle(self) -> None:
        await self._puts.wait_idle()


class ResultWaits:
    """The waits for results of one queue in this process, sharing one task and its round
    trips (see the module's docstring)."""

    def __init__(
        self, queue: str, store: StoreGetter, signal: SignalBus, poll: float, max_batch: int
    ) -> None:
        self._queue = queue
        self._store = store
        self._poll = poll
        self._max_batch = max_batch
        self._waiting: dict[str, list[asyncio.Future[bytes]]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._begun = 0  # looks the task began, and of those, the ones that ended
        self._ended = 0
        self._closed = False
        self._unsubscribe = signal.subscribe_results(queue, self._on_signal)

    async def look(self, ids: Sequence[str]) -> list[bytes | None]:
        """The kept bodies of ``ids``, in round trips of at most ``max_batch`` ids."""
        store = await self._store()
        size = self._max_batch
        if len(ids) <= size:
            return await store.get(self._queue, ids)
        found: list[bytes | None] = []
        for start in range(0, len(ids), size):
            found += await store.get(self._queue, ids[start : start + size])
        return found

    async def wait(self, message_id: str, timeout: float | None) -> bytes | None:
        """The body of ``message_id`` once it is kept; None when ``timeout`` passes first."""
        if self._closed:
            raise ClosedError(f"queue {self._queue!r} is closed")
        waiter: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(message_id, []).append(waiter)
        self._wake.set()  # the task looks again, this id with the others
        first = self._begun + 1  # the first look of the task that includes this id
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            done, _ = await asyncio.wait((waiter,), timeout=timeout)
            if done:
                return waiter.result()
            if self._ended < first:
                # A timeout shorter than a round trip: none looked for it yet, and a
                # result already kept would read None, where a look finds it.
                (body,) = await self.look([message_id])
                return body
            return None
        finally:
            self._drop(message_id, waiter)

    def _drop(self, message_id: str, waiter: asyncio.Future[bytes]) -> None:
        waiter.cancel()  # a no-op once it has its outcome
        waiters = self._waiting.get(message_id)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)
        if not waiters:
            del self._waiting[message_id]

    def _on_signal(self, signal: Signal) -> None:
        ids = signal.ids
        if ids is None or any(message_id in self._waiting for message_id in ids):
            self._wake.set()

    async def _run(self) -> None:
        try:
            while self._waiting:
                self._wake.clear()  # what is announced from now on is looked at again
                ids = list(self._waiting)
                self._begun += 1
                try:
                    bodies = await self.look(ids)
                except Exception as exc:
                    self._fail(ids, exc)
                    continue
                finally:
                    self._ended = self._begun
                for message_id, body in zip(ids, bodies, strict=True):
                    if body is not None:
                        for waiter in self._waiting.pop(message_id, ()):
                            if not waiter.done():
                                waiter.set_result(body)
                if not self._waiting:
                    break
                if not self._wake.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._poll):
                            await self._wake.wait()
        finally:
            self._task = None

    def _fail(self, ids: list[str], exc: Exception) -> None:
        """A look-up failed: its waiters get the error, as any call's caller would."""
        for message_id in ids:
            for waiter in self._waiting.pop(message_id, ()):
                if not waiter.done():
                    waiter.set_exception(exc)

    async def close(self) -> None:
        """Every wait still under way ends with a ClosedError."""
        self._closed = True
        self._unsubscribe()
        error = ClosedError(f"queue {self._queue!r} is closed")
        self._fail(list(self._waiting), error)
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
