"""The mature time a MongoDB amend writes is cut to what a server keeping 15 significant
digits of a double stores, and never later than the time it was cut from: the next request
of the call compares that stored time with the same instant (``mature > now``).

Pure arithmetic, no server."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("pymongo")

from aio_keuss.mongo.store import _kept


@pytest.mark.parametrize(
    "timestamp",
    [
        # times whose product with the scale rounds up to the next integer
        1795970690.1069999,
        1795970313.3880599,
        1795970563.3631399,
        1795970574.2135499,
    ],
)
def test_a_time_whose_scaled_product_rounds_up_is_still_cut_down(timestamp: float) -> None:
    kept = _kept(timestamp)
    assert kept <= timestamp
    assert float(f"{kept:.15g}") == kept


def test_cut_times_are_never_later_and_keep_15_digits() -> None:
    draw = random.Random(17)
    for _ in range(200_000):
        timestamp = 1_700_000_000 + draw.random() * 200_000_000
        kept = _kept(timestamp)
        assert kept <= timestamp
        assert timestamp - kept < 1e-4
        assert float(f"{kept:.15g}") == kept
