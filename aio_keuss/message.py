"""Messages, and the one codec every backend stores them with.

A payload is stored as a single blob whose first byte says how to read the rest: ``J`` for
orjson, ``B`` for raw bytes. That keeps bytes payloads bytes (JSON has no bytes type) and lets
a store treat every payload as an opaque blob. Headers are stored as a JSON object text so a
store can append the deadletter headers without decoding them (see ``append_headers``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from .errors import InvalidHeadersError, InvalidIdError, InvalidPayloadError

_JSON_TAG = b"J"
_BYTES_TAG = b"B"
# Types orjson would otherwise turn into strings silently: a datetime would come back as a
# str, breaking the promise that payloads round-trip exactly. Passed through, they fail.
_DUMPS_OPTIONS = (
    orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)
MAX_ID_LENGTH = 200
EMPTY_HEADERS = b"{}"

Payload = Any
Headers = dict[str, str | int | float | bool]


@dataclass(slots=True, frozen=True)
class Message:
    """A message as a consumer receives it.

    ``tries`` counts earlier deliveries that did not end in ``ok``; ``mature`` is when it
    became (or becomes) deliverable, as an aware UTC datetime.
    """

    id: str
    payload: Payload
    headers: Headers = field(default_factory=dict)
    tries: int = 0
    mature: datetime = field(default_factory=lambda: datetime.now(UTC))


def encode_payload(payload: Payload) -> bytes:
    """Serialize a payload, raising :class:`InvalidPayloadError` for what would not round-trip."""
    if isinstance(payload, bytes):
        return _BYTES_TAG + payload
    if isinstance(payload, bytearray | memoryview):
        return _BYTES_TAG + bytes(payload)
    try:
        return _JSON_TAG + orjson.dumps(payload, option=_DUMPS_OPTIONS)
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise InvalidPayloadError(f"payload cannot be serialized: {exc}") from exc


def decode_payload(blob: bytes) -> Payload:
    if blob[:1] == _BYTES_TAG:
        return bytes(blob[1:])
    return orjson.loads(memoryview(blob)[1:])


def encode_headers(headers: Headers | None) -> bytes:
    """Validate and serialize headers: str keys, scalar values, nothing nested."""
    if headers is None or (isinstance(headers, dict) and not headers):
        return EMPTY_HEADERS
    if not isinstance(headers, dict):
        raise InvalidHeadersError(f"headers must be a dict, not {type(headers).__name__}")
    for key, value in headers.items():
        if not isinstance(key, str):
            raise InvalidHeadersError(f"header keys must be str, got {key!r}")
        if not isinstance(value, str | int | float | bool):
            raise InvalidHeadersError(
                f"header {key!r} must be a str, int, float or bool, not {type(value).__name__}"
            )
    try:
        return orjson.dumps(headers)
    except TypeError as exc:  # an int beyond 64 bits
        raise InvalidHeadersError(f"headers cannot be serialized: {exc}") from exc


def decode_headers(blob: bytes | str) -> Headers:
    if blob == EMPTY_HEADERS or blob == "{}":
        return {}
    decoded: Headers = orjson.loads(blob)
    return decoded


def append_headers(encoded: bytes, extra: Headers) -> bytes:
    """Add keys to an encoded header object; on a repeated key the added value wins on decode."""
    addition = orjson.dumps(extra)[1:-1]
    if encoded == EMPTY_HEADERS:
        return b"{" + addition + b"}"
    return encoded[:-1] + b"," + addition + b"}"


def check_id(message_id: object) -> str:
    """Return the id if it is well formed, else raise :class:`InvalidIdError`.

    Ids end up as Redis keys, SQL values and Mongo ``_id``: printable, no whitespace, bounded.
    """
    if not isinstance(message_id, str):
        raise InvalidIdError(f"message ids are str, not {type(message_id).__name__}")
    if not message_id or len(message_id) > MAX_ID_LENGTH:
        raise InvalidIdError(f"message ids have 1 to {MAX_ID_LENGTH} characters")
    if not message_id.isprintable() or " " in message_id:
        raise InvalidIdError(f"message id {message_id!r} has whitespace or control characters")
    return message_id


def to_datetime(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)
