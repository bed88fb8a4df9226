"""aio-keuss: asyncio-native queues over the databases you already run.

async with aio_keuss.connect("memory") as factory:
    q = await factory.queue("jobs")
    await q.push({"a": 1})
    msg = await q.reserve(timeout=5)
    await q.ok(msg)
"""

from importlib import metadata as _metadata

from .consumer import Consumer, ConsumerStatus
from .errors import (
    BackendError,
    ClosedError,
    ConfigError,
    ConsumerFailedError,
    HandlerTimeoutError,
    InvalidDelayError,
    InvalidHeadersError,
    InvalidIdError,
    InvalidInputError,
    InvalidPayloadError,
    InvalidQueueNameError,
    JobFailedError,
    KeussConnectionError,
    KeussError,
    LoopThreadError,
    MissingDependencyError,
    NotSupportedError,
    PipelineError,
    RateLimited,
    ResultMissingError,
    ResultTimeoutError,
    TooManyConsumersError,
)
from .factory import Factory, connect
from .message import MAX_PRIORITY, MIN_PRIORITY, UNCHANGED, Message, NewMessage
from .observe import disable as disable_metrics
from .observe import enable as enable_metrics
from .otel import enable_opentelemetry
from .outcomes import NO_RESULT
from .queue import Queue
from .registry import backend_names
from .repeat import Repeat, Repeater
from .types import CancelResult, Capabilities, JobResult, KoResult, MessageView, Page, Sizes, State
from .worker import run_worker

try:
    __version__ = _metadata.version("aio-keuss")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = [
    "BackendError",
    "Capabilities",
    "ClosedError",
    "LoopThreadError",
    "ConfigError",
    "ConsumerFailedError",
    "Consumer",
    "ConsumerStatus",
    "Factory",
    "HandlerTimeoutError",
    "InvalidDelayError",
    "InvalidHeadersError",
    "InvalidIdError",
    "InvalidInputError",
    "InvalidPayloadError",
    "InvalidQueueNameError",
    "JobFailedError",
    "JobResult",
    "KeussConnectionError",
    "KeussError",
    "KoResult",
    "CancelResult",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "Message",
    "NewMessage",
    "MessageView",
    "MissingDependencyError",
    "NotSupportedError",
    "PipelineError",
    "Page",
    "Queue",
    "RateLimited",
    "ResultMissingError",
    "ResultTimeoutError",
    "NO_RESULT",
    "Repeat",
    "Repeater",
    "Sizes",
    "State",
    "TooManyConsumersError",
    "UNCHANGED",
    "__version__",
    "backend_names",
    "connect",
    "disable_metrics",
    "enable_metrics",
    "enable_opentelemetry",
    "run_worker",
]
