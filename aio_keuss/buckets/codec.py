"""How a bucket is stored: every message in one blob written once, and a fixed-width state
column per slot that can be patched in place (little endian, one ``array`` copy a column)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

AVAILABLE, DONE, HANDED_OUT, DEADLETTERING = 0, 1, 2, 3
"""Slot states. DEADLETTERING: on its way to the deadletter queue, stored so before the copy
is written, so that whoever holds the bucket next neither delivers it again nor loses it
(it writes the copy, under the same id, into the queue the state names, and marks the slot
done)."""

_LITTLE = sys.byteorder == "little"
U32 = "I" if array("I").itemsize == 4 else "L"


def _to_le(values: array[Any]) -> bytes:
    if _LITTLE:
        return values.tobytes()
    swapped = array(values.typecode, values)  # pragma: no cover - big-endian hosts
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


def _from_le(typecode: str, data: bytes | memoryview) -> array[Any]:
    values = array(typecode)
    values.frombytes(data)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        values.byteswap()
    return values


def encode_blob(payloads: Sequence[bytes], headers: Sequence[bytes]) -> bytes:
    """Frame the messages of one bucket (see the module docstring)."""
    count = len(payloads)
    lengths = array(U32, [count])
    lengths.extend(len(p) for p in payloads)
    lengths.extend(len(h) for h in headers)
    return b"".join((_to_le(lengths), *payloads, *headers))


def decode_blob(blob: bytes) -> tuple[int, list[int], list[int]]:
    """(count, payload offsets, headers offsets): slot i's payload is
    ``blob[p[i]:p[i+1]]`` and its headers ``blob[h[i]:h[i+1]]``."""
    (count,) = _from_le(U32, blob[:4])
    lengths = _from_le(U32, blob[4 : 4 + 8 * count])
    start = 4 + 8 * count
    payload_offsets = list(accumulate(lengths[:count], initial=start))
    header_offsets = list(accumulate(lengths[count:], initial=payload_offsets[-1]))
    return count, payload_offsets, header_offsets


def encode_state(states: bytes | bytearray, tries: array[int], mature: array[float]) -> bytes:
    return b"".join((bytes(states), _to_le(tries), _to_le(mature)))


def decode_state(blob: bytes, count: int) -> tuple[bytearray, array[int], array[float]]:
    view = memoryview(blob)
    states = bytearray(view[:count])
    tries = _from_le(U32, view[count : 5 * count])
    mature = _from_le("d", view[5 * count : 13 * count])
    return states, tries, mature


def encode_targets(targets: Mapping[int, str]) -> bytes:
    """The deadletter queue of each slot on its way there, after the fixed-width columns
    (``<slot> <queue>`` lines; queue names hold neither): the next holder copies into the
    queue the move began with, whatever its own deadletter option. A reader of the columns
    alone (an earlier release) never sees it."""
    return "".join(f"{slot} {queue}\n" for slot, queue in sorted(targets.items())).encode()


def decode_targets(blob: bytes, count: int) -> dict[int, str]:
    """What :func:`encode_targets` wrote past the columns (none in a state stored without)."""
    targets: dict[int, str] = {}
    for line in bytes(memoryview(blob)[13 * count :]).decode("ascii", "replace").splitlines():
        slot, _, queue = line.partition(" ")
        if slot.isdigit() and queue:
            targets[int(slot)] = queue
    return targets
