"""Messages, and the one codec every backend stores them with.

A payload is stored as a single blob whose first byte says how to read the rest: ``J`` for
orjson, ``B`` for raw bytes. That keeps bytes payloads bytes (JSON has no bytes type) and lets
a store treat every payload as an opaque blob. Headers are stored as a JSON object text so a
store can append the deadletter headers without decoding them (see ``append_headers``).

What round-trips, and what is refused. A payload comes back exactly as it went in, types
included, or is refused with :class:`InvalidPayloadError` before anything is written:

* round-trip: ``dict`` (str keys), ``list``, ``str``, ``int`` (from -2**63 to 2**64 - 1),
  finite ``float``, ``bool``, ``None``, nested any way, and ``bytes`` as the whole payload;
* refused: NaN and infinite floats, anywhere (JSON has no form for them: they would come back
  as ``None``); ``tuple`` (would come back a list), ``uuid.UUID`` (a str), ``Enum`` members
  (their value), ``bytearray`` / ``memoryview`` even as the whole payload (bytes), subclasses
  of the JSON types (the plain type), ``set``, datetimes, dataclasses and other objects; dict
  keys other than ``str``; ints beyond 64 bits; strings with lone surrogates (not UTF-8);
  ``bytes`` nested in a dict or list (JSON has no bytes type: encode them, e.g. base64, or
  send the bytes as the whole payload); containers nested 255 or more deep (orjson's limit).

Headers: a dict of ``str`` keys to ``str``, ``int`` (64-bit), finite ``float`` or ``bool``
values, exact types (an ``IntEnum`` or ``str`` subclass value is refused), else
:class:`InvalidHeadersError`.

What another program wrote, or corruption, can still be read back: :func:`decode_message`
raises on it, and :func:`salvage_message` then hands the message over as stored, marked
:data:`UNDECODABLE`, rather than failing the batch it came in (which is already taken).

The common case costs one ``orjson.dumps`` plus, for a dict or list, a check of the types of
its values done in C (``frozenset.issuperset`` over ``map(type, ...)``); NaN and infinities,
which orjson writes as ``null``, are looked for only when the output contains ``null``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from itertools import chain, compress, repeat
from typing import Any, Final, cast
from uuid import UUID

import orjson

from .errors import InvalidHeadersError, InvalidIdError, InvalidInputError, InvalidPayloadError
from .options import brief

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
"""Longest id a push may choose."""
MAX_KNOWN_ID_LENGTH = 1000
"""Longest id ``ok``, ``ko``, ``remove``, ``find``, ``requeue``... accept: a message moved
into a queue that already holds its id is renamed ``<id>.<tag>`` (``.mv``, ``.dl<n>``,
``.rq``, then ``.2``, ``.3``...), so the ids the library hands out may be longer than the
ones pushed, and every one of them must still be acknowledged."""
MAX_TRIES = 2**31 - 1
"""Largest ``tries`` a message can carry: PostgreSQL stores it as an ``integer``."""
EMPTY_HEADERS = b"{}"
UNDECODABLE = "x-undecodable"
"""The header of a message delivered although part of its stored form could not be read
(written by another program, or corrupted): why, e.g. ``payload: <error>``. Delivering it
as it is, rather than failing the batch it came in, loses nothing: a handler that cannot
use it fails it, and it ends in the deadletter queue like any poison message."""
RAW_HEADERS = "x-raw-headers"
"""With :data:`UNDECODABLE`, the stored headers that could not be read, as text (bytes that
are not UTF-8 replaced): they replace the headers, which had no usable form."""
# What comes back as itself from JSON (floats only when finite): anything else orjson
# accepts (tuple, UUID, Enum, Fragment) would come back as something else.
_LEAVES: frozenset[type] = frozenset({str, int, float, bool, type(None)})
_LEAVES_BUT_FLOAT: frozenset[type] = frozenset({str, int, bool, type(None)})
_HEADER_VALUES: frozenset[type] = frozenset({str, int, float, bool})

Payload = Any
Headers = dict[str, str | int | float | bool]


class Unchanged(enum.Enum):
    """The type of :data:`UNCHANGED`."""

    UNCHANGED = "unchanged"


UNCHANGED: Final = Unchanged.UNCHANGED
"""The default payload of ``Queue.move``: the message keeps its own (``None`` is a payload)."""


class _Delivered:
    """Where a delivered :class:`Message` keeps its mature time as stored (seconds) until
    ``mature`` is first read: outside the dataclass's fields, so not part of its value."""

    __slots__ = ("_mature_at",)


@dataclass(slots=True, frozen=True)
class Message(_Delivered):
    """A message as a consumer receives it.

    ``tries`` counts earlier deliveries that did not end in ``ok``; ``mature`` is when it
    became (or becomes) deliverable, as an aware UTC datetime; ``priority`` the one it was
    pushed with (0 unless the backend has ``capabilities.priority``).
    """

    id: str
    payload: Payload
    headers: Headers = field(default_factory=dict)
    tries: int = 0
    mature: datetime = field(default_factory=lambda: datetime.now(UTC))
    priority: int = 0
    _token: str | None = field(default=None, init=False, repr=False, compare=False)
    """The store's name of the reservation that delivered it (see ``Stored.token``), handed
    back with its ok / ko / move / give-back so that only that reservation is acted on.
    Not part of the value: a Message built by hand has none, and is guarded by ``tries``."""


@dataclass(slots=True, frozen=True)
class NewMessage:
    """One message of ``Queue.push_each``, with the options ``push`` takes: a batch whose
    messages differ in delay, headers, id or priority (BullMQ's ``addBulk``)."""

    payload: Payload
    delay: float = 0.0
    headers: Headers | None = None
    id: str | None = None
    priority: int = 0


def encode_payload(payload: Payload) -> bytes:
    """Serialize a payload, raising :class:`InvalidPayloadError` for what would not round-trip
    (the rules are in this module's docstring)."""
    kind = type(payload)
    if kind is bytes:
        blob: bytes = _BYTES_TAG + payload
        return blob
    try:
        text = orjson.dumps(payload, default=_unserializable, option=_DUMPS_OPTIONS)
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        reason: object = exc.__cause__ or exc
        if str(reason) == "Dict key must be str":
            reason = "dict keys must be str (another key type would come back as a str)"
        raise InvalidPayloadError(f"payload cannot be stored: {reason}") from exc
    # orjson also serializes tuples, UUIDs, Enum members and Fragments, and writes NaN and
    # infinities as null: what is not a plain leaf must be found. ``float`` is a plain leaf
    # unless the output has a ``null`` (which may be a NaN or an infinity). ``find``, not
    # ``in``: ``bytes.__contains__`` first tries its argument as an int, at a cost.
    if kind is dict:
        leaves = _LEAVES_BUT_FLOAT if text.find(b"null") >= 0 else _LEAVES
        if not leaves.issuperset(map(type, payload.values())):  # in C; the common case
            _check_tree(payload.values(), leaves)
    elif kind is list:
        leaves = _LEAVES_BUT_FLOAT if text.find(b"null") >= 0 else _LEAVES
        if not leaves.issuperset(map(type, payload)):
            _check_tree(payload, leaves)
    elif kind not in _LEAVES or (kind is float and not math.isfinite(payload)):
        raise InvalidPayloadError(f"payload cannot be stored: {_refusal(payload)}")
    return _JSON_TAG + text


def _check_tree(items: Iterable[Any], leaves: frozenset[type]) -> None:
    """Refuse the first item (or nested item) that would not come back as itself. orjson
    accepted the payload, so nesting is under 255 deep: no recursion limit is reached."""
    for item in items:
        kind = type(item)
        if kind in leaves:
            continue
        if kind is dict:
            if not leaves.issuperset(map(type, item.values())):
                _check_tree(item.values(), leaves)
        elif kind is list:
            if not leaves.issuperset(map(type, item)):
                _check_tree(item, leaves)
        elif kind is not float or not math.isfinite(item):
            raise InvalidPayloadError(f"payload cannot be stored: {_refusal(item)}")


def _unserializable(value: object) -> Any:
    """orjson's ``default`` hook: whatever it cannot serialize itself is refused, with why."""
    raise TypeError(_refusal(value))


def _refusal(value: object) -> str:
    """Why ``value`` cannot be stored so that it comes back the same."""
    kind = type(value).__qualname__
    if isinstance(value, Enum):
        return f"{value!r}: an Enum member would come back as its value; store .value"
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"{value!r}: NaN and infinite floats have no JSON form (they come back None)"
        return f"a {kind} (float subclass) would come back as a plain float"
    if type(value) is bytes:
        return (
            "bytes nested in a dict or list (JSON has no bytes type): bytes round-trip only as"
            " the whole payload; encode nested ones first (e.g. base64)"
        )
    if isinstance(value, bytes | bytearray | memoryview):
        return f"a {kind} would come back as bytes; pass bytes(...) as the whole payload"
    if isinstance(value, UUID):
        return "a UUID would come back as a str; store str(uuid)"
    if isinstance(value, tuple):
        return "a tuple would come back as a list; store a list"
    if isinstance(value, set | frozenset):
        return f"a {kind} has no JSON form; store a list"
    for base in (dict, list, str, int):
        if isinstance(value, base):
            return f"a {kind} ({base.__name__} subclass) would come back as a plain {base.__name__}"
    return f"a {kind} has no exact JSON form"


def encode_payloads(payloads: Sequence[Payload]) -> list[bytes]:
    """:func:`encode_payload` of each, in order: the same blobs, the same refusals (raised
    for the first payload refused, before anything is written).

    A batch of dicts (what a DataFrame's rows make) is serialized by ``orjson.dumps``
    mapped over them, with no Python frame per payload, then checked as a whole, a level of
    nesting at a time: the types of every value of every payload in one pass in C, then
    those of what the lists and dicts among them hold, and so on. Serialized first: what
    orjson takes holds no cycle and is under 255 levels deep, so the walk visits no more
    items than the texts have values; walked first, a list holding itself twice doubled at
    each level (2**k items at level k: all memory taken before the depth bound). Only if
    some output holds a ``null`` (a ``None``, or a NaN or an infinity, which orjson writes
    as ``null``) while the batch has floats are those payloads looked at again. Any other
    batch, or one that orjson or the pass finds something in that is refused, goes one by
    one, which says what and why."""
    if len(payloads) < _BATCH_AT_LEAST or set(map(type, payloads)) != _ONLY_DICTS:
        return [encode_payload(payload) for payload in payloads]
    try:
        texts = list(map(orjson.dumps, payloads, _UNSERIALIZABLE, _OPTIONS))
    except TypeError:  # a key that is not a str, an int beyond 64 bits, a cycle, too deep...
        return [encode_payload(payload) for payload in payloads]
    has_float = False
    values: Iterable[Any] = chain.from_iterable(map(dict.values, payloads))
    for _ in range(_DEEPEST):  # past orjson's depth (which it refused): one by one
        level = list(values)
        kinds = list(map(type, level))
        found = set(kinds)
        has_float = has_float or float in found
        if _LEAVES.issuperset(found):
            break
        if not _LEAVES_AND_CONTAINERS.issuperset(found):
            return [encode_payload(payload) for payload in payloads]
        lists = compress(level, map(_IS_LIST, kinds))
        dicts = compress(level, map(_IS_DICT, kinds))
        values = chain(chain.from_iterable(lists), chain.from_iterable(map(dict.values, dicts)))
    else:
        return [encode_payload(payload) for payload in payloads]
    if has_float and b"".join(texts).find(b"null") >= 0:
        for payload, text in zip(payloads, texts, strict=True):
            if text.find(b"null") >= 0:
                _check_tree(payload.values(), _LEAVES_BUT_FLOAT)
    return list(map(_JSON_TAG.__add__, texts))


_BATCH_AT_LEAST = 8
"""Below this many payloads the batch pass costs more than it saves."""
_ONLY_DICTS = {dict}
_LEAVES_AND_CONTAINERS = _LEAVES | {list, dict}
_DEEPEST = 256
"""Levels of nesting the batch pass walks: orjson refuses more than 255."""
_IS_LIST = {list}.__contains__
_IS_DICT = {dict}.__contains__
_UNSERIALIZABLE = repeat(_unserializable)
_OPTIONS = repeat(_DUMPS_OPTIONS)
"""orjson's arguments as endless columns: ``map`` passes them by position, which costs less
than a ``partial`` with keywords (a dict of them made on every call)."""


_SLICE_BELOW = 4096
"""Payloads shorter than this are decoded from a copy without their tag byte: copying a
small blob costs less than making a memoryview of it; larger ones are not copied."""


def decode_payload(blob: bytes) -> Payload:
    """A payload from its stored blob; ``ValueError`` for one not written by
    :func:`encode_payload` (another program's, or corrupted). The tag is checked, not
    assumed: an untagged ``42`` would otherwise be read as ``2``."""
    tag = blob[:1]
    if tag == _JSON_TAG:
        if len(blob) < _SLICE_BELOW:
            return orjson.loads(blob[1:])
        return orjson.loads(memoryview(blob)[1:])
    if tag == _BYTES_TAG:
        return bytes(blob[1:])
    raise ValueError(f"no payload tag (starts with {bytes(blob[:8])!r})")


def encode_headers(headers: Headers | None) -> bytes:
    """Validate and serialize headers: str keys, scalar values, nothing nested."""
    if headers is None or (isinstance(headers, dict) and not headers):
        return EMPTY_HEADERS
    if not isinstance(headers, dict):
        raise InvalidHeadersError(f"headers must be a dict, not {type(headers).__name__}")
    for key, value in headers.items():
        if type(key) is not str:  # a str subclass (StrEnum) would come back a plain str
            raise InvalidHeadersError(f"header keys must be str, got {type(key).__qualname__}")
        kind = type(value)
        if kind not in _HEADER_VALUES:  # exact: an IntEnum would come back a plain int
            raise InvalidHeadersError(
                f"header {key!r} must be a str, int, float or bool, not {kind.__qualname__}"
            )
        if kind is float and not math.isfinite(cast(float, value)):
            raise InvalidHeadersError(
                f"header {key!r} is {value!r}: NaN and infinite floats have no JSON form"
            )
    try:
        return orjson.dumps(headers)
    except TypeError as exc:  # an int beyond 64 bits, a lone surrogate
        raise InvalidHeadersError(f"headers cannot be stored: {exc}") from exc


def decode_headers(blob: bytes | str) -> Headers:
    """Headers from their stored text; ``ValueError`` for text that is not a JSON object
    (another program's, or corrupted), which would otherwise reach the caller as a list.
    Empty text (or whitespace only), which another program may store for none, is no
    headers."""
    if blob == EMPTY_HEADERS or blob == "{}" or not blob:
        return {}
    try:
        decoded: Headers = orjson.loads(blob)
    except orjson.JSONDecodeError:
        if not blob.strip():  # looked at only here: not a cost of every message
            return {}
        raise
    if type(decoded) is not dict:
        raise ValueError(f"not a JSON object but a {type(decoded).__name__}")
    return decoded


_JSON_SPACE = b" \t\n\r"  # the whitespace JSON allows between tokens (RFC 8259, section 2)


def append_headers(encoded: bytes, extra: Headers) -> bytes:
    """Add keys to an encoded header object; on a repeated key the added value wins on decode.
    Empty stored headers (another program's "none"; ours are ``{}``) take a new object, and
    so does an object of whitespace only (``{ }``); whitespace another program left after
    the closing brace is cut first, or the brace cut would be a space's."""
    addition = orjson.dumps(extra)[1:-1]
    if encoded == EMPTY_HEADERS or not encoded:
        return b"{" + addition + b"}"
    if encoded[-1:] != b"}":
        encoded = encoded.rstrip(_JSON_SPACE)
    body = encoded[:-1]
    if not body.strip(_JSON_SPACE + b"{"):
        return b"{" + addition + b"}"
    return body + b"," + addition + b"}"


def merge_headers(encoded: bytes, extra: Headers) -> bytes:
    """The encoded headers with ``extra`` merged in, each key once: a repeated key takes the
    added value, in the place the key had (as :func:`append_headers`' text decodes). A move
    appended instead, so a message moved round a cyclic pipeline carried stored headers
    growing with every pass. Stored headers that are no JSON object (another program's, or
    empty) take :func:`append_headers`; a key an earlier release repeated is kept once, with
    its last value (the one a decode read)."""
    try:
        stored = orjson.loads(encoded)
    except orjson.JSONDecodeError:
        return append_headers(encoded, extra)
    if not isinstance(stored, dict):
        return append_headers(encoded, extra)
    return orjson.dumps({**stored, **extra})


def check_id(message_id: object, longest: int = MAX_ID_LENGTH) -> str:
    """Return the id if it is well formed, else raise :class:`InvalidIdError`. ``longest``:
    :data:`MAX_ID_LENGTH` for an id a push chooses, :data:`MAX_KNOWN_ID_LENGTH` for one
    that names a message already stored (it may carry a rename's suffix).

    Ids end up as Redis keys, SQL values and Mongo ``_id``: printable, no whitespace, bounded,
    valid UTF-8. ``str.isprintable`` is False for control characters (NUL included), format
    characters and lone surrogates (Unicode categories C* and Z* but the space), so what it
    lets through always encodes as UTF-8.
    """
    if not isinstance(message_id, str):
        raise InvalidIdError(f"message ids are str, not {type(message_id).__name__}")
    if not message_id or len(message_id) > longest:
        raise InvalidIdError(f"message ids have 1 to {longest} characters")
    if not message_id.isprintable() or " " in message_id:
        raise InvalidIdError(
            f"message id {message_id!r} has whitespace, control characters or lone surrogates"
        )
    return message_id


def visible(text: str, keep: str = "") -> str:
    """``text`` with what a terminal or a page would obey or hide rather than show (line
    breaks, escape sequences, other control characters, and format characters such as the
    bidirectional overrides and isolates U+202A-U+202E, U+2066-U+2069, which reorder what
    follows on screen: Unicode Standard Annex #9, CVE-2021-42574) written as Python escapes
    (``\\n``, ``\\u202e``): an id, header or payload another program stored can neither
    forge a line of what an operator reads nor show other characters than it holds.
    Characters in ``keep`` stay as they are."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def check_known_id(message_id: object) -> str:
    """Return the id of a stored message as ``ok``, ``ko``, ``move``, ``find``,
    ``remove``, ``requeue`` and ``replay`` take it, else raise :class:`InvalidIdError`: a
    str of 1 to :data:`MAX_KNOWN_ID_LENGTH` characters that is valid UTF-8 and holds no NUL.

    Looser than :func:`check_id`, which a push's id must pass: whatever id a store hands
    out must be acknowledgeable. Which characters are printable depends on the Unicode
    version of the Python that asks (Python 3.11 knows Unicode 14.0, 3.13 knows 15.1: a
    character added since is unassigned, so not printable, on the older one), so an id a
    newer Python pushed would be refused by the ``ok`` of an older one, and its message
    never acknowledged; so would an id another program stored (a space, a zero-width
    character)."""
    if type(message_id) is str and 0 < len(message_id) <= MAX_KNOWN_ID_LENGTH:
        if message_id.isprintable():  # the common case: nothing more to look at
            return message_id
        if "\x00" not in message_id:
            try:
                message_id.encode("utf-8")
            except UnicodeEncodeError:
                pass
            else:
                return message_id
        raise InvalidIdError(f"message id {message_id!r} has a NUL or lone surrogates")
    if not isinstance(message_id, str):
        raise InvalidIdError(f"message ids are str, not {type(message_id).__name__}")
    if not message_id or len(message_id) > MAX_KNOWN_ID_LENGTH:
        raise InvalidIdError(f"message ids have 1 to {MAX_KNOWN_ID_LENGTH} characters")
    # A str subclass: checked as the str it holds, and returned as given, as check_id does
    # (the push that took it did so). Not ``str(message_id)``: that is whatever its
    # ``__str__`` says (a str-mixed Enum's name on Python 3.11), and ok named another id.
    check_known_id(str.__str__(message_id))
    return message_id


def check_text(value: object, what: str) -> str:
    """A text kept as JSON (a ko's ``error``, a cancel's ``reason``): a ``str`` of valid
    UTF-8, refused before anything is sent. JSON text is UTF-8 (RFC 8259, section 8.1), so a
    str with a lone surrogate could only fail once its message had been acted on."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be a str or None, not {type(value).__name__}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{what} must be valid UTF-8: {exc.reason}") from None
    return value


def check_ids(message_ids: Sequence[object], longest: int = MAX_ID_LENGTH) -> list[str]:
    """:func:`check_id` of each, in order, raising for the first one refused. A batch of
    plain str ids is checked as a whole: the rules hold for every id exactly when they hold
    for the ids joined (``isprintable`` and the space are per character), so a few calls in C
    serve the batch (a bulk load, a Spark write, sends thousands). ASCII text (generated ids
    are) is printable and free of spaces exactly when deleting the bytes ``!`` to ``~`` from
    it leaves nothing, at half the cost of ``isprintable``'s look-ups in Unicode's tables."""
    if set(map(type, message_ids)) == _ONLY_STR:
        ids = cast("list[str]", list(message_ids))
        joined = "".join(ids)
        lengths = list(map(len, ids))
        if joined.isascii():
            plain = not joined.encode().translate(None, _PRINTABLE_ASCII_BUT_SPACE)
        else:
            plain = joined.isprintable() and " " not in joined
        if plain and 0 < min(lengths) <= max(lengths) <= longest:
            return ids
    return [check_id(message_id, longest) for message_id in message_ids]


_ONLY_STR = {str}
_PRINTABLE_ASCII_BUT_SPACE = bytes(range(0x21, 0x7F))


def check_tries(tries: object) -> int:
    """The ``tries`` of a hand-built :class:`Message` given to ``ok`` / ``ko``: an int in
    [0, :data:`MAX_TRIES`] (never a bool), else :class:`InvalidInputError`."""
    if type(tries) is not int or not 0 <= tries <= MAX_TRIES:
        raise InvalidInputError(
            f"message tries must be an int in [0, {MAX_TRIES}], not {brief(tries)}"
        )
    return tries


MIN_PRIORITY = -(2**15)
MAX_PRIORITY = 2**15 - 1
"""The priorities a push may give: a 16-bit signed integer, which every database stores
as it is (PostgreSQL's ``smallint``) and a Redis sorted-set score holds exactly."""


def check_priority(priority: object) -> int:
    """A push's ``priority``: an int in [:data:`MIN_PRIORITY`, :data:`MAX_PRIORITY`] (never
    a bool, which would pass for 0 or 1 by accident), else :class:`InvalidInputError`."""
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidInputError(
            f"priority must be an int in [{MIN_PRIORITY}, {MAX_PRIORITY}], not {brief(priority)}"
        )
    return priority


def to_datetime(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)


_new_object = object.__new__
_from_timestamp = datetime.fromtimestamp
_set_id, _set_payload, _set_headers, _set_tries, _set_mature, _set_priority, _set_token = (
    Message.__dict__[name].__set__
    for name in ("id", "payload", "headers", "tries", "mature", "priority", "_token")
)
_get_mature = Message.__dict__["mature"].__get__
_get_mature_at = _Delivered.__dict__["_mature_at"].__get__
_set_mature_at = _Delivered.__dict__["_mature_at"].__set__
# Mature times ``datetime.fromtimestamp(t, UTC)`` surely takes (years 1 to 9999, a second
# short of each end): one outside them is made a datetime at once, so that one it refuses
# fails the decoding as it did, and is salvaged.
_LAZY_FROM = -62135596800.0 + 1
_LAZY_UNTIL = 253402300799.0 - 1


def _read_mature(message: Message) -> datetime:
    """``Message.mature``: a delivered message's is made a datetime when first read, not
    when it is decoded, which costs a pop or reserve that never reads it a tenth of its
    client instructions (about 3,600 of them, counted by callgrind)."""
    try:
        return cast("datetime", _get_mature(message))
    except AttributeError:
        when = _from_timestamp(_get_mature_at(message), UTC)
        _set_mature(message, when)
        return when


# The slot stays the field's storage (the dataclass's ``__init__``, ``__setstate__``,
# ``replace`` and the decoders set it); reads go through the property, so ``__eq__``,
# ``__hash__``, ``__repr__``, pickling and ``asdict`` see the datetime.
setattr(Message, "mature", property(_read_mature, _set_mature))  # noqa: B010


def decode_message(
    message_id: str,
    payload: bytes,
    headers: bytes | str,
    tries: int,
    mature: float,
    token: str | None = None,
    priority: int = 0,
) -> Message:
    """A :class:`Message` from its stored form, for every delivery. Built through its slots
    rather than the frozen dataclass's ``__init__``, which goes through
    ``object.__setattr__`` once per field: a third of the cost, on the hot path of every pop
    and reserve. The result is the same object the constructor would make. Raises on a
    stored form it cannot read, checking nothing more than decoding does: the caller
    falls back to :func:`salvage_message` for that rare message. The mature time is kept
    as stored and made a datetime when first read (see ``_read_mature``), unless it lies
    outside the years the datetime takes, where doing so now raises as it always did."""
    message = _new_object(Message)
    _set_id(message, message_id)
    _set_payload(message, decode_payload(payload))
    # no headers, the usual case, and the time, without a call each
    _set_headers(message, {} if headers == EMPTY_HEADERS else decode_headers(headers))
    _set_tries(message, tries)
    if type(mature) is float and _LAZY_FROM < mature < _LAZY_UNTIL:  # False for NaN
        _set_mature_at(message, mature)
    else:
        _set_mature(message, _from_timestamp(mature, UTC))
    _set_priority(message, priority)
    _set_token(message, token)
    return message


def salvage_message(
    message_id: str,
    payload: bytes,
    headers: bytes | str,
    tries: int,
    mature: float,
    token: str | None = None,
    priority: int = 0,
) -> Message:
    """:func:`decode_message` for a message it refused: what can be read is, and what cannot
    is handed over as stored, with :data:`UNDECODABLE` saying why. Called only after a
    failure, so that the common case pays for no check beyond the decoding itself."""
    reasons: list[str] = []
    try:
        decoded_headers = decode_headers(headers)
    except Exception as exc:  # orjson.JSONDecodeError is a ValueError; whatever else, kept
        reasons.append(f"headers: {exc}")
        raw = headers if isinstance(headers, str) else bytes(headers).decode(errors="replace")
        decoded_headers = {RAW_HEADERS: raw}
    try:
        decoded_payload = decode_payload(payload)
    except Exception as exc:
        reasons.append(f"payload: {exc}")
        decoded_payload = bytes(payload)
    try:
        when = _from_timestamp(mature, UTC)
    except Exception as exc:  # NaN, out of range: the message is deliverable now
        reasons.append(f"mature: {exc}")
        when = datetime.now(UTC)
    if reasons:
        decoded_headers[UNDECODABLE] = "; ".join(reasons)
    message = _new_object(Message)
    _set_id(message, message_id)
    _set_payload(message, decoded_payload)
    _set_headers(message, decoded_headers)
    _set_tries(message, tries)
    _set_mature(message, when)
    _set_priority(message, priority)
    _set_token(message, token)
    return message
