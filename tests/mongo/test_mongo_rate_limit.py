"""The MongoDB rate limiter (``aio_keuss.mongo.limiter``): one document per queue in
``<prefix>_rates``, its times on the client's clock, an ``expires`` date under a TTL index,
gone once given back idle; racing steps of two clients lose none. Runs on the server of
``tests/mongo_server.py``, each test in a database of its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import new_token
from mongo_server import MONGO_URL, start_mongo

import aio_keuss
from aio_keuss.contract import RateRule
from aio_keuss.mongo.limiter import EXPIRY_SLACK

pymongo = pytest.importorskip("pymongo")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def database() -> str:
    reason = start_mongo()
    if reason:
        pytest.skip(reason)
    return f"akt_{new_token()}"


@pytest.fixture
async def client(database: str) -> AsyncIterator[Any]:
    client = pymongo.AsyncMongoClient(MONGO_URL, tz_aware=True)
    yield client
    await client.drop_database(database)
    await client.close()


@pytest.mark.parametrize("backend", ["mongo", "mongo-history", "bucket-mongo"])
async def test_the_limiter_is_one_document_that_expires_once_idle(
    database: str, client: Any, backend: str
) -> None:
    async with aio_keuss.connect(backend, url=MONGO_URL, database=database) as factory:
        assert factory.capabilities.rate_limit
        q = await factory.queue("jobs", rate_limit=5, rate_period=3600)
        await q.push("x")
        assert (await q.pop(timeout=30)) is not None
        rates = client[database][factory.backend.collection("rates").name]
        docs = await rates.find({}).to_list()
        assert [doc["_id"] for doc in docs] == ["jobs"]
        (doc,) = docs
        # one grant of five an hour: the state matters for 720 s, on this client's clock
        assert doc["t"] == pytest.approx(time.time() + 720, abs=60)
        assert doc["u"] == 0.0
        assert doc["expires"].timestamp() == pytest.approx(doc["t"] + EXPIRY_SLACK, abs=0.01)
        indexes = await rates.index_information()
        assert any(
            ix.get("expireAfterSeconds") == 0 and [k for k, _ in ix["key"]] == ["expires"]
            for ix in indexes.values()
        )
        # given back, the state is that of an idle limiter: none, the document gone
        await factory.backend.rate_take("jobs", RateRule(5, 3600.0, 5), -1, 0.0)
        assert await rates.count_documents({}) == 0


async def test_a_hold_is_kept_in_the_document_until_it_ends(database: str, client: Any) -> None:
    async with aio_keuss.connect("mongo", url=MONGO_URL, database=database) as factory:
        rule = RateRule(100, 1.0, 100)
        grant = await factory.backend.rate_take("held", rule, 0, 120.0)
        assert grant.granted == 0 and grant.wait == pytest.approx(120.0, abs=0.01)
        again = await factory.backend.rate_take("held", rule, 10, 0.0)
        assert again.granted == 0 and 0 < again.wait <= 120.0
        rates = client[database][factory.backend.collection("rates").name]
        doc = await rates.find_one({"_id": "held"})
        assert doc is not None and doc["u"] == pytest.approx(time.time() + 120, abs=60)


async def test_racing_steps_of_two_clients_lose_none(database: str) -> None:
    """Each step is a compare-and-set: of 60 racing takes of one grant, from two factories
    (two clients), exactly the limit's ten are granted, and ten given back come back."""
    rule = RateRule(10, 3600.0, 10)
    async with (
        aio_keuss.connect("mongo", url=MONGO_URL, database=database) as first,
        aio_keuss.connect("mongo", url=MONGO_URL, database=database) as second,
    ):
        takes = [f.backend.rate_take("race", rule, 1, 0.0) for f in (first, second) * 30]
        grants = await asyncio.gather(*takes)
        assert sum(g.granted for g in grants) == 10
        gives = [f.backend.rate_take("race", rule, -1, 0.0) for f in (first, second) * 5]
        await asyncio.gather(*gives)
        after = await first.backend.rate_take("race", rule, 20, 0.0)
        assert after.granted == 10


async def test_many_racing_takers_of_two_clients_never_exceed_the_limit(database: str) -> None:
    """300 takes of 1 to 3 grants at once, half through each of two factories (two
    ``AsyncMongoClient`` instances), then 40 give-backs and 120 takes racing: the grants
    are counted, not timed (one grant each 720 s, so none falls due during the test).
    The takes get exactly the burst, never more; the give-backs are none of them lost."""
    rule = RateRule(50, 36000.0, 50)
    async with (
        aio_keuss.connect("mongo", url=MONGO_URL, database=database) as first,
        aio_keuss.connect("mongo", url=MONGO_URL, database=database) as second,
    ):
        assert first.backend.client is not second.backend.client  # type: ignore[attr-defined]
        sides = (first, second)
        takes = [sides[k % 2].backend.rate_take("many", rule, 1 + k % 3, 0.0) for k in range(300)]
        grants = await asyncio.gather(*takes)
        assert sum(g.granted for g in grants) == 50
        gives = [f.backend.rate_take("many", rule, -1, 0.0) for f in sides * 20]
        await asyncio.gather(*gives)
        retakes = [f.backend.rate_take("many", rule, 1, 0.0) for f in sides * 60]
        again = await asyncio.gather(*retakes)
        assert sum(g.granted for g in again) == 40
