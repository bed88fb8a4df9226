"""A web dashboard over one factory: queues with sizes, rates and paused state, a peek into
each, the deadletter queue with requeue, pause / resume, and stored pipelines as graphs.

``aio-keuss dashboard --backend redis-oq --url redis://...`` serves it; in a program::

    from aio_keuss.dashboard import Dashboard

    async with aio_keuss.connect("memory") as factory, Dashboard(factory, port=8080):
        ...

Needs the ``dashboard`` extra (aiohttp), imported only when :class:`Dashboard` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server import Dashboard, serve

__all__ = ["Dashboard", "serve"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
