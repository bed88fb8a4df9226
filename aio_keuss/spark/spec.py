"""What a Spark job asks for: the data source's options, parsed and checked once.

Spark hands a data source its options as strings; these are turned back into the types
``aio_keuss.connect`` takes, and checked on the driver, so a bad option fails the job before
any executor starts. Read side: the schema of the rows a queue is read into.
"""

from __future__ import annotations

import datetime as _dt
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from ..errors import ConfigError, InvalidInputError, NotSupportedError
from ..message import Message, check_priority
from ..options import QUEUE_OPTION_NAMES, QueueOptions, check_queue_name
from ..registry import load_backend

FORMAT = "aio_keuss"

# Options the Spark layer consumes itself; every other option goes to ``aio_keuss.connect``.
WRITE_OPTIONS = frozenset(
    {
        "backend",
        "queue",
        "payload_column",
        "headers_column",
        "delay_column",
        "priority_column",
        "priority",
        "id_column",
        "id_prefix",
        "job_key",
        "batch_size",
        "idempotent",
    }
)
READ_OPTIONS = frozenset(
    {
        "backend",
        "queue",
        "read_mode",
        "max_rows",
        "max_rows_per_batch",
        "num_partitions",
        "stop_timeout",
    }
)
# The write options naming a column of the rows.
COLUMN_OPTIONS = (
    "payload_column",
    "headers_column",
    "delay_column",
    "priority_column",
    "id_column",
)
# Spark options are strings: these connect options are converted back to numbers, counts
# (max_batch, rate_limit, rate_burst: connect refuses a float) to ints, seconds to floats.
# The bucket backends' optional seconds default to None, which tells no type.
_INT_OPTIONS = frozenset(
    name for name, default in QueueOptions().as_dict().items() if isinstance(default, int)
)
_FLOAT_OPTIONS = frozenset(QUEUE_OPTION_NAMES - _INT_OPTIONS) | {
    "signal_debounce",
    "reject_delta_factor",
    "reject_timeout_grace",
}
_JSON_OPTIONS = frozenset({"deadletter"})
# Options Spark itself adds to a data source's options.
_SPARK_OWN = frozenset({"path", "checkpointlocation", "queryname"})


# -- options -----------------------------------------------------------------------------


def parse_bool(value: object, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"true", "1", "yes"}:
        return True
    if text in {"false", "0", "no"}:
        return False
    raise ConfigError(f"option {name!r} must be true or false, not {value!r}")


def parse_positive_int(value: object, name: str) -> int:
    try:
        number = int(str(value)) if not isinstance(value, int) else value
    except ValueError:
        number = 0
    if isinstance(value, bool) or number < 1:
        raise ConfigError(f"option {name!r} must be a positive integer, not {value!r}")
    return number


def parse_positive_float(value: object, name: str) -> float:
    try:
        number = float(str(value)) if not isinstance(value, int | float) else float(value)
    except ValueError:
        number = 0.0
    if isinstance(value, bool) or not 0.0 < number < float("inf"):
        raise ConfigError(f"option {name!r} must be a positive number of seconds, not {value!r}")
    return number


def parse_priority(value: object, name: str = "priority") -> int:
    """A priority given as an option (Spark's are strings): an int the queue takes."""
    try:
        number = int(str(value).strip()) if isinstance(value, str) else value
        return check_priority(number)
    except (ValueError, InvalidInputError) as exc:
        raise ConfigError(f"option {name!r}: {exc}") from exc


def connect_options(
    raw: Mapping[str, Any], own: frozenset[str], backend: str | None = None
) -> dict[str, Any]:
    """The ``aio_keuss.connect`` options among ``raw`` (Spark's are strings: typed back).

    ``backend``'s own options are typed back by the type of their default (a flag such as
    ``history`` or ``cluster``, a count such as ``shards`` or ``max_pool_size``, seconds such
    as ``history_ttl``): Spark turns ``.option("history", True)`` into ``"true"``, which
    ``connect`` would refuse, so no Spark read or write could set them."""
    typed: Mapping[str, Any] = {} if backend is None else load_backend(backend).options
    result: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.lower()
        if name in own or name in _SPARK_OWN:
            continue
        if isinstance(value, str):
            default = typed.get(name)
            try:
                if name in _FLOAT_OPTIONS:
                    value = float(value)
                elif name in _INT_OPTIONS:
                    value = int(value)
                elif name in _JSON_OPTIONS:
                    value = orjson.loads(value)
                elif isinstance(default, bool):
                    value = parse_bool(value, name)
                elif isinstance(default, int):
                    value = int(value)
                elif isinstance(default, float):
                    value = float(value)
            except (ValueError, orjson.JSONDecodeError) as exc:
                raise ConfigError(f"option {name!r}: cannot read {value!r}: {exc}") from exc
        result[name] = value
    return result


def required(raw: Mapping[str, Any], name: str) -> str:
    value = raw.get(name)
    if value is None or str(value) == "":
        raise ConfigError(f"the aio_keuss data source needs option {name!r}")
    return str(value)


@dataclass(frozen=True)
class WriteSpec:
    """Everything an executor needs to turn rows into messages; small and picklable."""

    backend: str
    queue: str
    options: dict[str, Any] = field(default_factory=dict)
    payload_column: str | None = None
    headers_column: str | None = None
    delay_column: str | None = None
    id_column: str | None = None
    id_prefix: str = ""
    job_key: str | None = None
    batch_size: int = 1000
    idempotent: bool = True
    priority_column: str | None = None
    priority: int = 0

    @property
    def prioritized(self) -> bool:
        """Rows go in with a priority: only a backend with ``capabilities.priority`` takes
        them (checked on the driver, with the capabilities the opened factory has)."""
        return self.priority_column is not None or self.priority != 0

    @classmethod
    def from_options(cls, raw: Mapping[str, Any]) -> WriteSpec:
        """Parse data source options (strings) and check them; raises ConfigError."""
        lowered = {key.lower(): value for key, value in raw.items()}

        def column(name: str) -> str | None:
            value = lowered.get(name)
            return None if value in (None, "") else str(value)

        spec = cls(
            backend=required(lowered, "backend"),
            queue=required(lowered, "queue"),
            options=connect_options(
                lowered, WRITE_OPTIONS | READ_OPTIONS, required(lowered, "backend")
            ),
            payload_column=column("payload_column"),
            headers_column=column("headers_column"),
            delay_column=column("delay_column"),
            id_column=column("id_column"),
            id_prefix=str(lowered.get("id_prefix") or ""),
            job_key=column("job_key"),
            batch_size=parse_positive_int(lowered.get("batch_size", 1000), "batch_size"),
            idempotent=parse_bool(lowered.get("idempotent", True), "idempotent"),
            priority_column=column("priority_column"),
            priority=parse_priority(lowered.get("priority") or 0),
        )
        spec.check()
        return spec

    def check(self, columns: Sequence[str] | None = None) -> None:
        """Refuse, before anything is written, what would fail (or duplicate) on executors."""
        backend_class = load_backend(self.backend)  # ConfigError for an unknown backend
        try:
            check_queue_name(self.queue)
        except InvalidInputError as exc:
            raise ConfigError(str(exc)) from exc
        if self.idempotent and not backend_class.capabilities.idempotent:
            raise ConfigError(
                f"backend {self.backend!r} cannot deduplicate message ids, so a retried Spark"
                " task would push its rows twice; set option idempotent=false to accept that"
            )
        if self.idempotent and self.options.get("dedup_window") == 0:
            raise ConfigError(
                "dedup_window=0 keeps no id once its message is consumed, so a retried Spark"
                " task could push its rows twice;"
                " give a window longer than the job or set option idempotent=false"
            )
        if not self.idempotent and self.id_column is not None:
            raise ConfigError("id_column needs idempotent pushes; drop idempotent=false")
        if self.delay_column is not None and not backend_class.capabilities.delay:
            raise ConfigError(f"backend {self.backend!r} has no delay: drop delay_column")
        parse_priority(self.priority)  # push_partitions' argument, or a spec made by hand
        if self.priority_column is not None and self.priority != 0:
            raise ConfigError("give priority_column or priority, not both")
        self.check_priority(backend_class.capabilities.priority)
        if columns is not None:
            for what in COLUMN_OPTIONS:
                name = getattr(self, what)
                if name is not None and name not in columns:
                    raise ConfigError(
                        f"{what} {name!r} is not a column; columns: {', '.join(columns)}"
                    )
        if self.job_key is not None:
            _check_id_part(self.job_key, "job_key")
        if self.id_prefix:
            _check_id_part(self.id_prefix, "id_prefix")

    def check_priority(self, capable: bool) -> None:
        """Refuse priorities where the backend has none, before any task writes: the queue
        would refuse every batch of every task (``NotSupportedError``) after the driver
        started the job."""
        if self.prioritized and not capable:
            what = "priority_column" if self.priority_column is not None else "priority"
            raise NotSupportedError(
                f"backend {self.backend!r} has no priorities (capabilities.priority): drop {what}"
            )

    def with_job_key(self, job_key: str) -> WriteSpec:
        return self if self.job_key is not None else replace(self, job_key=job_key)


def _check_id_part(value: str, what: str) -> None:
    if len(value) > 100 or not value.isprintable() or " " in value:
        raise ConfigError(f"{what} must be up to 100 printable characters without spaces")


def new_job_key() -> str:
    """A key for one job, made once on the driver, so every attempt of a task agrees."""
    return uuid.uuid4().hex[:16]


# -- messages to rows ----------------------------------------------------------------------

READ_SCHEMA = (
    "id string, payload string, headers string, tries int, mature timestamp, priority int,"
    " payload_bytes binary"
)
"""``payload`` is the payload as JSON text; a bytes payload is in ``payload_bytes`` instead
(``payload`` null). ``headers`` is a JSON object text. ``priority`` is the one the message
was pushed with (0 where the backend has no priorities)."""

MessageRow = tuple[str, str | None, str, int, _dt.datetime, int, bytes | None]


def message_row(message: Message) -> MessageRow:
    payload = message.payload
    headers = orjson.dumps(message.headers).decode() if message.headers else "{}"
    if isinstance(payload, bytes):
        return (
            message.id,
            None,
            headers,
            message.tries,
            message.mature,
            message.priority,
            payload,
        )
    return (
        message.id,
        orjson.dumps(payload).decode(),
        headers,
        message.tries,
        message.mature,
        message.priority,
        None,
    )
