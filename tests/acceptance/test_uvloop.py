"""Every backend works under uvloop, the event loop uvicorn (and so FastAPI) often runs on."""

from __future__ import annotations

from typing import Any

import pytest
from backends import BackendCase, new_token

import aio_keuss

uvloop = pytest.importorskip("uvloop")


def test_push_pop_reserve_under_uvloop(case: BackendCase) -> None:
    options = case.options(new_token())

    async def scenario() -> list[Any]:
        async with aio_keuss.connect(case.name, **options) as factory:
            q = await factory.queue("uv")
            await q.push_many([1, 2, 3])
            got = [m.payload for m in await q.pop_many(2, timeout=5)]
            if factory.capabilities.reserve:
                message = await q.reserve(timeout=5)
                assert message is not None and await q.ok(message)
                got.append(message.payload)
            else:
                got += [m.payload for m in await q.pop_many(1, timeout=5)]
            return got

    try:
        assert sorted(uvloop.run(scenario())) == [1, 2, 3]
    finally:
        if case.cleanup is not None:
            uvloop.run(case.cleanup(options))
