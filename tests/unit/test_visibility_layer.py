"""The queue layer's visibility calls, pinned on a recording subclass of the real memory
store: looking calls only the read-only primitives (so consumers are not disturbed), and
each repair uses exactly the primitives it is documented to use."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aio_keuss import Queue
from aio_keuss.contract import Cursor, Held, Peeked, PeekPage
from aio_keuss.memory import MemoryBackend, MemoryStore
from aio_keuss.options import DeadletterOptions, QueueOptions
from aio_keuss.signal import LocalSignalBus
from aio_keuss.stats import MemoryStats

WATCHED = ("insert", "get", "reserve", "commit", "rollback", "move", "remove")


class RecordingStore(MemoryStore):
    """The memory store, with the name of every primitive called."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[str] = []
        for name in WATCHED:
            self._record(name)

    def _record(self, name: str) -> None:
        inner = getattr(self, name)

        async def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return await inner(*args, **kwargs)

        setattr(self, name, recorded)

    async def peek(self, state: str, after: Cursor | None, limit: int) -> PeekPage:
        self.calls.append("peek")
        return await super().peek(state, after, limit)

    async def locate(self, ids: Sequence[str]) -> list[Peeked | None]:
        self.calls.append("locate")
        return await super().locate(ids)

    async def hold(self, ids: Sequence[str], reserve_delay: float) -> list[Held | None]:
        self.calls.append("hold")
        return await super().hold(ids, reserve_delay)


def _queue(backend: MemoryBackend, name: str, **options: Any) -> tuple[Queue, RecordingStore]:
    queue_options = QueueOptions().updated(options)
    store = RecordingStore(name, queue_options, backend)
    deadletter = DeadletterOptions(max_ko=0)
    queue = Queue(
        name,
        queue_options,
        store,
        backend.capabilities,
        LocalSignalBus(),
        MemoryStats(),
        deadletter,
    )
    return queue, store


async def test_looking_calls_only_read_only_primitives() -> None:
    queue, store = _queue(MemoryBackend({}), "q", max_batch=10)
    ids = await queue.push_many(list(range(35)))
    held = await queue.reserve(timeout=0)
    store.calls.clear()
    assert len(await queue.peek(20, state="all")) == 20
    assert len([v async for v in queue.browse(page_size=10)]) == 35
    assert (await queue.page(limit=5)).cursor is not None
    found = await queue.find(ids[3])
    assert found is not None and found.message.payload == 3
    assert set(store.calls) == {"peek", "locate"}
    assert await queue.sizes() == await queue.sizes()  # nothing moved meanwhile
    assert held is not None and await queue.ok(held)


async def test_purge_removes_page_by_page() -> None:
    queue, store = _queue(MemoryBackend({}), "q", max_batch=10)
    await queue.push_many(list(range(25)))
    store.calls.clear()
    assert await queue.purge() == 25
    assert store.calls == ["peek", "remove", "peek", "remove", "peek", "remove"]


async def test_requeue_holds_then_moves() -> None:
    backend = MemoryBackend({})
    work, _ = _queue(backend, "work")
    dead, store = _queue(backend, "__deadletter__")
    mid = await work.push("x")
    held = await work.reserve(timeout=0)
    assert held is not None and await work.ko(held)
    store.calls.clear()
    assert await dead.requeue([mid, "missing"]) == {mid: mid}
    assert store.calls == ["locate", "hold", "move"]
    back = await work.reserve(timeout=0)
    assert back is not None and back.tries == 0 and back.headers["x-dl-from-queue"] == "work"


async def test_a_held_message_is_not_requeued() -> None:
    backend = MemoryBackend({})
    work, _ = _queue(backend, "work")
    dead, store = _queue(backend, "__deadletter__")
    mid = await work.push("x")
    held = await work.reserve(timeout=0)
    assert held is not None and await work.ko(held)
    taken = await dead.reserve(timeout=0)
    assert taken is not None and taken.id == mid
    store.calls.clear()
    assert await dead.requeue(origin="work") == {}
    assert "move" not in store.calls and "hold" not in store.calls
    assert await dead.ok(taken)
