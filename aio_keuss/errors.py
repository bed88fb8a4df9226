"""One error hierarchy for the whole library.

Callers catch :class:`KeussError` (or one of its branches) and never a driver's own
exception: backends translate driver failures with :func:`translate_errors`, keeping the
original as ``__cause__`` so nothing is hidden from a debugger.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class KeussError(Exception):
    """Root of every error this library raises."""


class ConfigError(KeussError, ValueError):
    """A backend name, option name or option value is not acceptable."""


class MissingDependencyError(ConfigError, ImportError):
    """An optional driver is not installed; the message names the extra to install."""

    def __init__(self, extra: str, module: str) -> None:
        super().__init__(
            f"the {extra!r} backend needs the {module!r} package: pip install 'aio-keuss[{extra}]'"
        )
        self.extra = extra


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


class BackendError(KeussError):
    """The server answered with an error the library did not expect."""


class ClosedError(KeussError):
    """The factory or queue was closed; open a new one to go on."""


@contextmanager
def translate_errors(
    connection_errors: tuple[type[BaseException], ...],
    backend_errors: tuple[type[BaseException], ...] = (),
) -> Iterator[None]:
    """Turn a driver's exceptions into ours, keeping the original as ``__cause__``.

    Our own errors and cancellation pass through untouched, so a backend can wrap a whole
    primitive without thinking about what it raises itself.
    """
    try:
        yield
    except KeussError:
        raise
    except connection_errors as exc:
        raise KeussConnectionError(f"{type(exc).__name__}: {exc}") from exc
    except backend_errors as exc:
        raise BackendError(f"{type(exc).__name__}: {exc}") from exc
