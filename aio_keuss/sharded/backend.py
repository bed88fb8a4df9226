"""The backend side of the sharded model: one store per queue over the backend's storage, the
queue's metadata record on first use, and the leader's sweeper."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..contract import Backend, Store
from ..errors import ConfigError
from ..types import Capabilities
from . import meta
from .settings import CAPABILITIES, ShardedOptions
from .store import ShardedStore

if TYPE_CHECKING:
    from ..options import QueueOptions
    from ..signal import SignalBus
    from .storage import ShardStorage
    from .sweeper import Sweeper


class ShardedBackend(Backend):
    """Put before a database's :class:`Backend` in the bases (``class X(ShardedBackend,
    DatabaseBackend)``): its ``open`` / ``close`` / ``signal_bus`` wrap the database's.
    The database backend's ``__init__`` checks :class:`ShardedOptions` (``parse_own`` of
    its options, before it makes anything) and calls :meth:`use_storage`; its ``options``
    add ``ShardedOptions.defaults()`` to its own."""

    capabilities: Capabilities = CAPABILITIES
    sharded: ShardedOptions
    storage: ShardStorage
    bus: SignalBus | None = None

    def use_storage(self, storage: ShardStorage, sharded: ShardedOptions, explicit: bool) -> None:
        """Install the storage; ``explicit``: the user chose ``shards`` (so a queue created
        with another count is refused rather than adopted)."""
        self.storage = storage
        self.sharded = sharded
        self._stores: dict[str, ShardedStore] = {}
        self._sweeper: Sweeper | None = None
        self._explicit_shards = explicit

    def signal_bus(self, debounce: float) -> SignalBus:
        self.bus = super().signal_bus(debounce)
        return self.bus

    async def open(self) -> None:
        await super().open()
        if self.sharded.sweeper:
            from .sweeper import Sweeper

            self._sweeper = Sweeper(self.storage, self.sharded, self._shoveled)
            self._sweeper.start()

    def _shoveled(self, queue: str, count: int) -> None:
        if self.bus is not None:
            self.bus.insert(queue, time.time(), count)

    async def close(self) -> None:
        if self._sweeper is not None:
            await self._sweeper.stop()
        await super().close()

    async def store(self, queue: str, options: QueueOptions) -> Store:
        """A store of its own for each queue object opened, with that queue's options, and
        from then on the one :meth:`store_of` finds. A queue may open again under one name:
        the factory reopens one it opened by itself with the defaults once the user asks
        for it with options of their own (its claim). Handed the store of the first open,
        the reopened queue would push with that open's ``dedup_window`` and renew its
        consumer place by that open's ``poll_interval``, whatever it was opened with."""
        store = await self._new_store(queue, options)
        self._stores[queue] = store
        return store

    async def store_of(self, queue: str, options: QueueOptions) -> ShardedStore:
        """The store of ``queue`` (the deadletter queue a rollback copies into), made with
        ``options`` if no queue object of it was opened yet."""
        found = self._stores.get(queue)
        if found is not None:
            return found
        store = await self._new_store(queue, options)
        return self._stores.setdefault(queue, store)  # a queue's own store opened meanwhile

    async def _new_store(self, queue: str, options: QueueOptions) -> ShardedStore:
        """A store of ``queue``, writing its metadata record on first use."""
        wanted = self.sharded.shards
        record = meta.record(wanted, options, self.sharded)
        adopted = meta.Adopted.of(await self.storage.touch(queue, record, meta.life(self.sharded)))
        if adopted.shards != wanted and self._explicit_shards:
            raise ConfigError(
                f"queue {queue!r} was created with {adopted.shards} shards, not {wanted}"
            )
        return ShardedStore(queue, options, self.storage, self.sharded, adopted, self.store_of)

    async def queue_info(self, queue: str) -> dict[str, Any] | None:
        """The queue's metadata record (None once it expired or was never written)."""
        fields = await self.storage.read_meta(queue)
        return meta.decode(fields) if fields else None
