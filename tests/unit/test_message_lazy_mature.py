"""A delivered message's ``mature`` is made a datetime when first read: everything public
about it is what the eagerly built message had."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from datetime import UTC, datetime

import pytest

from aio_keuss.message import Message, decode_message, encode_payload

WHEN = 1764623737.123456


def delivered(mature: float = WHEN) -> Message:
    return decode_message("m1", encode_payload({"x": 1}), b'{"h": 1}', 2, mature, "tok", 3)


def built() -> Message:
    return Message("m1", {"x": 1}, {"h": 1}, 2, datetime.fromtimestamp(WHEN, UTC), priority=3)


def test_same_value_type_repr_and_equality() -> None:
    message, hand = delivered(), built()
    assert message.mature == hand.mature
    assert type(message.mature) is datetime and message.mature.tzinfo is UTC
    assert message.mature is message.mature  # made once
    assert repr(delivered()) == repr(hand)
    assert delivered() == hand and hand == delivered()
    assert dataclasses.asdict(delivered()) == {**dataclasses.asdict(hand), "_token": "tok"}
    assert dataclasses.replace(delivered()) == hand


@pytest.mark.parametrize(
    "duplicate", [copy.copy, copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))]
)
def test_copies_carry_the_time(duplicate: object) -> None:
    assert callable(duplicate)
    twin = duplicate(delivered())
    assert twin == built() and twin.mature == built().mature


def test_still_frozen() -> None:
    message = delivered()
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.mature = datetime.now(UTC)  # type: ignore[misc]


@pytest.mark.parametrize("mature", [float("nan"), float("inf"), 1e20, -1e20])
def test_a_time_datetime_refuses_still_fails_the_decoding(mature: float) -> None:
    with pytest.raises((ValueError, OverflowError)):
        delivered(mature)


def test_the_ends_of_the_range() -> None:
    for mature in (-62135596800.0, 253402300799.0, 0.0, -1.5):
        assert delivered(mature).mature == datetime.fromtimestamp(mature, UTC)
