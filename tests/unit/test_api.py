"""The public surface: every public name imports from ``aio_keuss``, and the blocking
:class:`aio_keuss.sync.SyncQueue` takes exactly the arguments of :class:`aio_keuss.Queue`."""

from __future__ import annotations

import inspect

import aio_keuss
from aio_keuss.sync import SyncQueue

ASYNC_ONLY = {
    "consume": "workers are tasks on the event loop; a sync program runs its own loop",
    "close": "the sync factory closes its queues",
    "repeat": "a repeater is a task on the event loop, as consume's workers are",
}


def _public(cls: type) -> dict[str, inspect.Signature]:
    found = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or not callable(member):
            continue
        found[name] = inspect.signature(member)
    return found


def test_sync_queue_takes_the_arguments_of_queue() -> None:
    async_api = _public(aio_keuss.Queue)
    sync_api = _public(SyncQueue)
    missing = set(async_api) - set(sync_api) - set(ASYNC_ONLY)
    assert not missing, f"SyncQueue lacks {sorted(missing)}"
    for name, signature in async_api.items():
        if name in ASYNC_ONLY:
            continue
        expected = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
        got = [(p.name, p.kind, p.default) for p in sync_api[name].parameters.values()]
        assert got == expected, f"SyncQueue.{name}{sync_api[name]} != Queue.{name}{signature}"


def test_every_public_name_imports_from_the_package() -> None:
    for name in aio_keuss.__all__:
        assert getattr(aio_keuss, name) is not None
    assert aio_keuss.__version__
