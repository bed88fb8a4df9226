"""One error hierarchy for the whole library.

Callers catch :class:`KeussError` (or one of its branches) and never a driver's own
exception: each database package translates its driver's failures where it meets the
driver (see :func:`translating`), keeping the original as ``__cause__`` so nothing is hidden
from a debugger.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NoReturn, ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")


class KeussError(Exception):
    """Root of every error this library raises."""


class ConfigError(KeussError, ValueError):
    """A backend name, option name or option value is not acceptable."""


class MissingDependencyError(ConfigError, ImportError):
    """An optional driver is not installed; the message names the extra to install."""

    def __init__(self, extra: str, module: str, needed_by: str | None = None) -> None:
        who = needed_by or f"the {extra!r} backend"
        super().__init__(f"{who} needs the {module!r} package: pip install 'aio-keuss[{extra}]'")
        self.extra = extra
        self._made_with = (extra, module, needed_by)

    def __reduce__(self) -> tuple[type[MissingDependencyError], tuple[str, str, str | None]]:
        """Unpickled by calling the class with these (its ``args`` are the text only)."""
        return type(self), self._made_with


class InvalidInputError(KeussError, ValueError):
    """Bad input to a queue operation, raised before anything is written."""


class InvalidQueueNameError(InvalidInputError):
    """A queue name that could not be used safely as a key, table value or collection name."""


class InvalidPayloadError(InvalidInputError):
    """A payload that cannot be serialized so that it round-trips exactly."""


class InvalidHeadersError(InvalidInputError):
    """Headers that are not a dict of str keys to scalar (str, int, float, bool) values."""


class InvalidDelayError(InvalidInputError):
    """A delay or timeout that is negative, NaN, infinite or not a number."""


class InvalidIdError(InvalidInputError):
    """A message id that is not a non-empty printable string of bounded length."""


class NotSupportedError(KeussError):
    """The backend lacks a capability the call needs (reserve, delay, remove, idempotent ids)."""


class KeussConnectionError(KeussError, ConnectionError):
    """The server could not be reached or the connection was lost mid-operation."""

    ran_nothing: bool = False
    """True where the server is known not to have run the command that failed: it
    answered that it cannot serve it now (on Redis a LOADING reply while a restarted server
    loads its data, BUSY while a script runs past its time, ...), or the command was never
    sent, the connection to send it on failing to open (refused at every address of the
    host, timed out, ...). Only a call of that one command may be made again without
    running twice: of a call of several, those before it may have run."""


class BackendError(KeussError):
    """The server answered with an error the library did not expect."""


class HandlerTimeoutError(KeussError, TimeoutError):
    """A ``consume`` handler ran past its ``timeout`` and was cancelled (its message is
    ko-ed like after any other handler failure)."""


class PipelineError(ConfigError):
    """A pipeline that cannot run as described (an unknown or repeated station, a cycle
    with no way out when it was declared acyclic, a handler that cannot be imported), or a
    station whose handler returned something other than a step; the message names the
    station."""


class TooManyConsumersError(KeussError):
    """A queue already has as many consumers as it allows (the sharded backends: at most
    100 per queue across processes, ``max_consumers``); raised before anything is fetched."""


class ConsumerFailedError(KeussError):
    """A consumer's worker stopped on an error not worth retrying (a missing table, a
    refused command): ``run_worker`` stops the others and raises this, so the process
    exits 1 and its supervisor restarts it. The error is the ``__cause__``."""


class RateLimited(KeussError):
    """Raised by a ``consume`` handler whose downstream refused for now (an HTTP 429): its
    message is given back costing no try, and the queue's deliveries stop for ``seconds``
    in every process sharing the backend (BullMQ's ``worker.rateLimit`` with its
    ``RateLimitError``). Needs ``capabilities.rate_limit``; elsewhere the message is ko-ed
    as after any other failure."""

    def __init__(self, seconds: float, message: str | None = None) -> None:
        super().__init__(message or f"rate limited for {seconds} s")
        self.seconds = seconds

    def __reduce__(self) -> tuple[type[RateLimited], tuple[float, str]]:
        """Unpickled by calling the class with these (its ``args`` are the text only)."""
        return type(self), (self.seconds, str(self))


class JobFailedError(KeussError):
    """The message ``push_and_wait`` waited for failed for good (deadlettered after its last
    try, or removed): ``error`` says why, as its failure result recorded it."""

    def __init__(self, message_id: str, error: str | None) -> None:
        super().__init__(f"message {message_id!r} failed: {error or 'no reason given'}")
        self.id = message_id
        self.error = error

    def __reduce__(self) -> tuple[type[JobFailedError], tuple[str, str | None]]:
        """Unpickled by calling the class with these (its ``args`` are the text only)."""
        return type(self), (self.id, self.error)


class ResultTimeoutError(KeussError, TimeoutError):
    """``push_and_wait`` (or ``result`` with a timeout) saw no result within its timeout;
    the message itself stays queued, and its result may still come."""

    def __init__(self, message_id: str, timeout: float) -> None:
        super().__init__(f"no result for message {message_id!r} within {timeout} s")
        self.id = message_id
        self.timeout = timeout

    def __reduce__(self) -> tuple[type[ResultTimeoutError], tuple[str, float]]:
        """Unpickled by calling the class with these (its ``args`` are the text only)."""
        return type(self), (self.id, self.timeout)


class ResultMissingError(KeussError):
    """``push_and_wait`` with an ``id`` the queue refused as a duplicate (a message with
    that id is still queued, or its ``dedup_window`` is not over), where that earlier
    message has finished and no result of it is kept (it kept none, or it expired after
    ``result_ttl``): none will ever come, so waiting would be for nothing (arq's
    ``ResultNotFound``). Raised only where the backend can tell, once a short grace passed
    for a failure kept just after the message left (see ``push_and_wait``)."""

    def __init__(self, message_id: str) -> None:
        super().__init__(
            f"message {message_id!r} was pushed before and has finished, and no result of it"
            " is kept"
        )
        self.id = message_id

    def __reduce__(self) -> tuple[type[ResultMissingError], tuple[str]]:
        """Unpickled by calling the class with these (its ``args`` are the text only)."""
        return type(self), (self.id,)


class ClosedError(KeussError):
    """The factory or queue was closed; open a new one to go on."""


class LoopThreadError(KeussError, RuntimeError):
    """A blocking ``aio_keuss.sync`` call made on the shim's own event-loop thread (from a
    coroutine given to ``call``): it would wait for the loop it runs on. Await the async
    queue (``SyncQueue.queue``) there instead."""


Classify = Callable[[Exception], KeussError | None]
"""Maps a driver's exception to ours, or to None for an exception that is not the driver's."""


def translating(
    classify: Classify,
) -> Callable[[Callable[_P, Awaitable[_T]]], Callable[_P, Coroutine[Any, Any, _T]]]:
    """A decorator for coroutine functions that talk to one driver: what ``classify`` maps
    leaves as ours, raised from the driver's exception. Our own errors, cancellation and
    anything ``classify`` does not know pass through untouched, so a method may raise ours
    itself, and decorated methods may call each other."""

    def decorate(method: Callable[_P, Awaitable[_T]]) -> Callable[_P, Coroutine[Any, Any, _T]]:
        @functools.wraps(method)
        async def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            try:
                return await method(*args, **kwargs)
            except Exception as exc:
                raise_translated(exc, classify)

        return call

    return decorate


def raise_translated(exc: Exception, classify: Classify) -> NoReturn:
    """Raise what ``exc`` becomes: ours from it where ``classify`` maps it, else ``exc``
    itself (ours already, or not the driver's). For an ``except`` clause at a choke point
    that is not a coroutine function (a context manager, say)."""
    # a KeussConnectionError is an OSError, which a classifier may take for the driver's
    ours = None if isinstance(exc, KeussError) else classify(exc)
    if ours is None:
        raise exc
    raise ours from exc
