"""The coalescer: a call that finds a free slot runs at once in its own task; calls that find
every slot busy share the next batch; results of cancelled callers are handed back."""

from __future__ import annotations

import asyncio

import pytest

from aio_keuss.coalesce import GIVE_UP, MIN_SHARE, Coalescer, RunToEnd, SideBySide, to_the_end


async def test_first_call_runs_at_once_and_the_rest_share_the_next_batch() -> None:
    batches: list[list[int]] = []

    async def run(requests: list[int]) -> list[int]:
        batches.append(requests)
        await asyncio.sleep(0.01)
        return [r * 10 for r in requests]

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=100)
    results = await asyncio.gather(*(coalescer.submit(i) for i in range(50)))
    assert results == [i * 10 for i in range(50)]
    assert batches == [[0], list(range(1, 50))]


async def test_free_slots_run_calls_side_by_side() -> None:
    batches: list[list[int]] = []

    async def run(requests: list[int]) -> list[int]:
        batches.append(requests)
        await asyncio.sleep(0.01)
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=100, concurrency=3)
    assert await asyncio.gather(*(coalescer.submit(i) for i in range(5))) == list(range(5))
    assert batches == [[0], [1], [2], [3, 4]]


async def test_max_batch_splits_and_calls_during_flight_form_the_next_batch() -> None:
    batches: list[list[int]] = []

    async def run(requests: list[int]) -> list[int]:
        batches.append(requests)
        await asyncio.sleep(0.01)
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=4)
    first = asyncio.gather(*(coalescer.submit(i) for i in range(6)))
    await asyncio.sleep(0.001)
    second = asyncio.gather(*(coalescer.submit(i) for i in range(6, 8)))
    await asyncio.gather(first, second)
    assert batches == [[0], [1, 2, 3, 4], [5, 6, 7]]


async def test_lone_call_runs_on_the_next_loop_iteration() -> None:
    async def run(requests: list[int]) -> list[int]:
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=10)
    passes = 0

    async def count_loop_passes() -> None:
        nonlocal passes
        while True:
            await asyncio.sleep(0)
            passes += 1

    counter = asyncio.create_task(count_loop_passes())
    await asyncio.sleep(0)  # the counter is running
    start = passes
    assert await coalescer.submit(7) == 7
    counter.cancel()
    assert passes - start <= 2  # not delayed to wait for company (counted, not timed)


async def test_cancelled_after_the_work_hands_the_result_to_on_orphan() -> None:
    orphans: list[tuple[int, int]] = []
    release = asyncio.Event()

    async def run(requests: list[int]) -> list[int]:
        await release.wait()
        return [r + 100 for r in requests]

    coalescer: Coalescer[int, int] = Coalescer(
        run, max_batch=10, on_orphan=lambda req, res: orphans.append((req, res))
    )
    kept = asyncio.create_task(coalescer.submit(1))
    dropped = asyncio.create_task(coalescer.submit(2))
    await asyncio.sleep(0.01)
    dropped.cancel()
    release.set()
    assert await kept == 101
    with pytest.raises(asyncio.CancelledError):
        await dropped
    await coalescer.wait_idle()
    assert orphans == [(2, 102)]


async def test_cancelled_before_sending_is_never_sent() -> None:
    seen: list[list[int]] = []

    release = asyncio.Event()

    async def run(requests: list[int]) -> list[int]:
        seen.append(requests)
        if requests == [0]:
            await release.wait()
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=10)
    busy = asyncio.create_task(coalescer.submit(0))
    await asyncio.sleep(0)  # runs in its own task, holding the only slot
    task = asyncio.create_task(coalescer.submit(1))
    await asyncio.sleep(0)  # queued behind it
    task.cancel()
    release.set()
    assert await busy == 0
    assert await coalescer.submit(2) == 2
    assert seen == [[0], [2]]


async def test_errors_reach_every_caller_of_the_batch() -> None:
    async def run(requests: list[int]) -> list[int]:
        raise RuntimeError("server gone")

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=10)
    results = await asyncio.gather(*(coalescer.submit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)


class _Refusing(asyncio.Future[int]):
    """Like the Redis fast lane's replies: a cancellation waits for the result."""

    def cancel(self, msg: object | None = None) -> bool:
        return False


async def test_uninterruptible_call_cancelled_in_flight_completes_and_is_handed_back() -> None:
    orphans: list[tuple[int, int]] = []
    reply = _Refusing()
    finished: list[int] = []

    async def run(requests: list[int]) -> list[int]:
        value = await reply
        finished.append(value)  # the work after the reply still runs
        return [value]

    coalescer: Coalescer[int, int] = Coalescer(
        run,
        max_batch=10,
        on_orphan=lambda req, res: orphans.append((req, res)),
        uninterruptible=True,
    )
    task = asyncio.create_task(coalescer.submit(1))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # waits for the reply
    reply.set_result(42)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [42]
    assert orphans == [(1, 42)]
    await coalescer.wait_idle()


async def test_a_batch_task_cancelled_in_flight_hands_back_before_it_ends() -> None:
    """The loop ending (``asyncio.run`` cancels every task left, then waits only for them):
    the batch task's reply refuses the cancellation, and what its cancelled callers were to
    get is handed back in the batch task itself, awaited before it ends. A hand-back left
    to a task of its own would not run once the loop is gone."""
    replies = [_Refusing(), _Refusing()]
    handed: list[tuple[int, int]] = []
    back = asyncio.Event()

    async def run(requests: list[int]) -> list[int]:
        value = await replies[0] if requests == [0] else await replies[1]
        return [value + r for r in requests]

    async def hand_back(request: int, result: int) -> None:
        await back.wait()  # a round trip
        handed.append((request, result))

    coalescer: Coalescer[int, int] = Coalescer(
        run, max_batch=10, on_orphan=hand_back, uninterruptible=True
    )
    first = asyncio.create_task(coalescer.submit(0))  # runs in its own task
    await asyncio.sleep(0)
    callers = [asyncio.create_task(coalescer.submit(i)) for i in (1, 2)]  # queued
    await asyncio.sleep(0)
    replies[0].set_result(100)
    assert await first == 100
    await asyncio.sleep(0)  # the batch of 1 and 2 is sent, by a task
    (batch,) = coalescer._tasks
    for task in (*callers, batch):  # as asyncio.run does
        task.cancel()
    await asyncio.sleep(0.01)
    assert not batch.done()  # waits for its reply
    replies[1].set_result(200)
    await asyncio.sleep(0.01)
    assert not batch.done()  # and for the hand-backs
    back.set()
    results = await asyncio.gather(*callers, batch, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert sorted(handed) == [(1, 201), (2, 202)]


async def test_a_cancelled_caller_ends_once_its_result_is_handed_back() -> None:
    """A caller cancelled once its batch answered: its cancellation is raised after the
    hand-back is done, not while it is still to be sent."""
    handed: list[int] = []
    back = asyncio.Event()
    release = asyncio.Event()

    async def run(requests: list[int]) -> list[int]:
        await release.wait()
        return requests

    async def hand_back(request: int, result: int) -> None:
        await back.wait()
        handed.append(result)

    coalescer: Coalescer[int, int] = Coalescer(
        run, max_batch=10, on_orphan=hand_back, run_in_caller=False
    )
    caller = asyncio.create_task(coalescer.submit(7))
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.sleep(0)  # the batch answered: the caller's result is set
    caller.cancel()
    await asyncio.sleep(0.01)
    assert not caller.done()
    back.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert handed == [7]
    await coalescer.wait_idle()


async def test_cancellation_of_an_ordinary_await_interrupts_the_call() -> None:
    orphans: list[tuple[int, int]] = []

    async def run(requests: list[int]) -> list[int]:
        await asyncio.sleep(10)
        return requests

    coalescer: Coalescer[int, int] = Coalescer(
        run,
        max_batch=10,
        on_orphan=lambda req, res: orphans.append((req, res)),
        uninterruptible=True,
    )
    task = asyncio.create_task(coalescer.submit(1))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert orphans == []
    await coalescer.wait_idle()


async def test_with_on_orphan_and_interruptible_store_calls_go_through_a_task() -> None:
    batches: list[list[int]] = []

    async def run(requests: list[int]) -> list[int]:
        batches.append(requests)
        await asyncio.sleep(0.01)
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=10, on_orphan=lambda *_: None)
    assert await asyncio.gather(*(coalescer.submit(i) for i in range(3))) == [0, 1, 2]
    assert batches == [[0, 1, 2]]


async def test_wait_idle_waits_for_calls_run_by_their_callers() -> None:
    release = asyncio.Event()

    async def run(requests: list[int]) -> list[int]:
        await release.wait()
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=10)
    call = asyncio.create_task(coalescer.submit(5))
    await asyncio.sleep(0)
    idle = asyncio.create_task(coalescer.wait_idle())
    await asyncio.sleep(0.01)
    assert not idle.done()
    release.set()
    await idle
    assert await call == 5


# SideBySide: several coroutines in the caller's task --------------------------------------


async def test_side_by_side_starts_every_coroutine_before_awaiting_any() -> None:
    sent: list[int] = []
    replies = [_Refusing(), _Refusing()]

    async def step(k: int) -> int:
        sent.append(k)  # the request is on the wire before the first await
        return await replies[k] * 10

    together = asyncio.ensure_future(SideBySide([step(0), step(1)]))
    await asyncio.sleep(0)
    assert sent == [0, 1]
    replies[1].set_result(2)  # replies may come in any order
    replies[0].set_result(1)
    assert await together == [10, 20]


async def test_side_by_side_under_an_uninterruptible_call_completes_every_step() -> None:
    orphans: list[tuple[int, list[int]]] = []
    replies = [_Refusing(), _Refusing()]
    finished: list[int] = []

    async def step(k: int) -> int:
        value = await replies[k]
        finished.append(value)
        return value

    async def run(requests: list[int]) -> list[list[int]]:
        return [await SideBySide([step(0), step(1)])]

    coalescer: Coalescer[int, list[int]] = Coalescer(
        run,
        max_batch=10,
        on_orphan=lambda req, res: orphans.append((req, res)),
        uninterruptible=True,
    )
    task = asyncio.create_task(coalescer.submit(1))
    await asyncio.sleep(0)
    task.cancel()
    replies[0].set_result(1)
    await asyncio.sleep(0)
    assert not task.done()  # the second step's reply is still awaited
    replies[1].set_result(2)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [1, 2]
    assert orphans == [(1, [1, 2])]
    await coalescer.wait_idle()


async def test_side_by_side_raises_a_failure_once_the_others_ended() -> None:
    reply = _Refusing()
    finished: list[int] = []

    async def failing() -> int:
        await asyncio.sleep(0)
        raise ValueError("no")

    async def slow() -> int:
        value = await reply
        finished.append(value)
        return value

    together = asyncio.ensure_future(SideBySide([failing(), slow()]))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not together.done()
    reply.set_result(7)
    with pytest.raises(ValueError, match="no"):
        await together
    assert finished == [7]


async def test_side_by_side_cancelled_in_an_ordinary_await_closes_the_others() -> None:
    ended: list[str] = []

    async def step(name: str) -> int:
        try:
            await asyncio.sleep(10)
        finally:
            ended.append(name)
        return 0

    together = asyncio.ensure_future(SideBySide([step("a"), step("b")]))
    await asyncio.sleep(0)
    together.cancel()
    with pytest.raises(asyncio.CancelledError):
        await together
    assert ended == ["a", "b"]


async def test_callers_asking_again_at_once_share_batches_run_by_one_task() -> None:
    """Three producers in a loop, batched by a task (as on PostgreSQL): each batch's
    callers ask again as soon as they are answered, and the same task takes their next
    requests as its next batch instead of ending and starting another."""
    batches: list[list[int]] = []
    runners: set[asyncio.Task[None] | None] = set()

    async def run(requests: list[int]) -> list[int]:
        batches.append(requests)
        runners.add(asyncio.current_task())  # type: ignore[arg-type]
        await asyncio.sleep(0.001)
        return requests

    coalescer: Coalescer[int, int] = Coalescer(
        run, max_batch=10, concurrency=3, run_in_caller=False
    )

    async def producer(base: int) -> list[int]:
        return [await coalescer.submit(base + i) for i in range(5)]

    results = await asyncio.gather(*(producer(base) for base in (0, 100, 200)))
    assert results == [[base + i for i in range(5)] for base in (0, 100, 200)]
    assert batches == [[i, 100 + i, 200 + i] for i in range(5)]
    assert len(runners) == 1
    await coalescer.wait_idle()
    assert not coalescer._tasks


async def test_a_caller_coming_back_later_gets_a_batch_of_its_own() -> None:
    """A caller that asks again only a few loop iterations after its answer finds the
    batch task gone, and its request starts another."""
    batches: list[list[int]] = []

    async def run(requests: list[int]) -> list[int]:
        batches.append(requests)
        return requests

    coalescer: Coalescer[int, int] = Coalescer(run, max_batch=10, run_in_caller=False)
    assert await coalescer.submit(1) == 1
    for _ in range(3):
        await asyncio.sleep(0)
    assert await coalescer.submit(2) == 2
    assert batches == [[1], [2]]
    await coalescer.wait_idle()
    assert not coalescer._tasks and coalescer._running == 0


async def test_work_failing_after_a_held_cancellation_ends_the_caller_cancelled() -> None:
    """The caller was cancelled while a reply that refuses cancellation was awaited; the
    work then failed. The caller must end cancelled, not with the failure: an
    ``asyncio.timeout`` around it counts on getting its cancellation back."""
    reply = _Refusing()

    async def work() -> int:
        await reply
        raise RuntimeError("the store refused")

    async def caller() -> int:
        run = RunToEnd(work())
        value = await run
        run.raise_held()
        return value

    task = asyncio.create_task(caller())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    reply.set_result(1)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_timeout_around_work_failing_after_it_fired_raises_timeout_error() -> None:
    reply = _Refusing()

    async def work() -> int:
        await reply
        raise RuntimeError("the store refused")

    async def caller() -> None:
        async with asyncio.timeout(0):
            run = RunToEnd(work())
            asyncio.get_running_loop().call_soon(reply.set_result, 1)
            await run

    with pytest.raises(TimeoutError):
        await caller()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_work_run_to_its_end_raises_the_held_cancellation_once_done() -> None:
    reply = _Refusing()
    done: list[str] = []

    async def work() -> int:
        value = await reply
        done.append("after the reply")
        return value

    async def caller() -> int:
        run = RunToEnd(work())
        value = await run
        done.append("the caller's own follow-up")
        run.raise_held()
        return value

    task = asyncio.create_task(caller())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    reply.set_result(7)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done == ["after the reply", "the caller's own follow-up"]


class _HeldReplies:
    """A store whose every batch waits until the test answers it: the batches show how the
    callers queued meanwhile were shared out."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.replies: list[asyncio.Future[None]] = []

    async def run(self, requests: list[int]) -> list[int]:
        self.batches.append(requests)
        reply = asyncio.get_running_loop().create_future()
        self.replies.append(reply)
        await reply
        return requests

    def answer_all(self) -> None:
        for reply in self.replies:
            if not reply.done():
                reply.set_result(None)


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_crowd_is_shared_out_over_the_free_slots() -> None:
    """32 clients on four slots settled into one batch of 29 and three one-caller round
    trips. Once a batch carries a crowd, the callers queued are shared out over the free
    slots (MIN_SHARE at least each), and callers no longer take free slots one by one while
    anything is in flight."""
    store = _HeldReplies()
    batches = store.batches
    coalescer: Coalescer[int, int] = Coalescer(store.run, max_batch=100, concurrency=4)
    first = [asyncio.create_task(coalescer.submit(i)) for i in range(4)]  # four lone calls
    await _turns(1)
    crowd = [asyncio.create_task(coalescer.submit(i)) for i in range(4, 34)]
    await _turns(1)
    assert [len(b) for b in batches] == [1, 1, 1, 1]
    store.answer_all()
    await asyncio.gather(*first)
    await _turns(5)
    assert [len(b) for b in batches[4:]] == [MIN_SHARE] * 3  # side by side, not 30 in one
    # Callers asking in one loop iteration while the crowd is in flight share one batch,
    # instead of each taking a free slot alone.
    more = [asyncio.create_task(coalescer.submit(i)) for i in range(100, 105)]
    await _turns(3)
    assert batches[7:] == [list(range(100, 105))]
    store.answer_all()
    assert await asyncio.gather(*crowd) == list(range(4, 34))
    assert await asyncio.gather(*more) == list(range(100, 105))
    await coalescer.wait_idle()


async def test_a_share_leaves_no_crowd_too_small_for_a_batch_of_its_own() -> None:
    """32 callers on four slots were shared out as 10, 10, 10 and 2, and the batches of the
    next rounds, formed as callers came back, cycled through 10, 8, 7, 4 and 3: 6.4 callers
    a round trip where 11 fit. A share that would leave fewer than MIN_SHARE callers takes
    them too: 10, 10 and 12."""
    store = _HeldReplies()
    coalescer: Coalescer[int, int] = Coalescer(store.run, max_batch=100, concurrency=4)
    first = [asyncio.create_task(coalescer.submit(i)) for i in range(-4, 0)]  # slots full
    await _turns(1)
    crowd = [asyncio.create_task(coalescer.submit(i)) for i in range(1, 33)]
    await _turns(1)
    store.answer_all()
    await asyncio.gather(*first)
    await _turns(5)
    shares = [len(b) for b in store.batches[4:]]
    assert shares == [MIN_SHARE, MIN_SHARE, 32 - 2 * MIN_SHARE]
    store.answer_all()
    assert await asyncio.gather(*crowd) == list(range(1, 33))
    await coalescer.wait_idle()


async def test_where_each_call_is_a_commit_a_crowd_goes_in_one_batch() -> None:
    batches: list[list[int]] = []

    async def run(requests: list[int]) -> list[int]:
        batches.append(requests)
        await asyncio.sleep(0.01)
        return requests

    coalescer: Coalescer[int, int] = Coalescer(
        run, max_batch=100, concurrency=4, run_in_caller=False
    )
    assert await asyncio.gather(*(coalescer.submit(i) for i in range(30))) == list(range(30))
    assert batches == [list(range(30))]


@pytest.mark.parametrize("readable", [True, False])
async def test_a_one_call_cancelled_in_flight_hands_back_what_its_reply_holds(
    readable: bool,
) -> None:
    """A store's own one-request call (``submit(request, one)``): awaited with nothing
    between, a cancellation lands once the reply is in, and what the reply holds goes to
    ``on_orphan``; a reply that cannot be read still ends the caller cancelled, not with the
    read's error (as a batch run to its end does)."""
    orphans: list[tuple[int, int]] = []
    reply = _Refusing()

    def read(raw: int) -> int:
        if not readable:
            raise ValueError("unreadable")
        return raw + 1

    async def run(requests: list[int]) -> list[int]:
        raise AssertionError("the batch path is not taken")

    coalescer: Coalescer[int, int] = Coalescer(
        run,
        max_batch=10,
        on_orphan=lambda req, res: orphans.append((req, res)),
        uninterruptible=True,
    )
    task = asyncio.create_task(coalescer.submit(1, (lambda: reply, read)))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # waits for the reply
    reply.set_result(41)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert orphans == ([(1, 42)] if readable else [])
    await coalescer.wait_idle()


async def test_to_the_end_work_finishes_though_cancelled_and_then_raises() -> None:
    """A cancellation waits for the work's end: its awaiter gets the cancellation once the
    result is in (held there by ``RunToEnd``), and the grace timer it set is cancelled
    with the work's end rather than left on the loop."""
    release = asyncio.Event()

    async def work() -> str:
        await release.wait()
        return "rows"

    task = to_the_end(work())
    await asyncio.sleep(0)
    assert task.cancel() is False
    await asyncio.sleep(0)
    assert not task.done()
    release.set()
    assert await task == "rows"
    assert task._grace is not None and task._grace.cancelled()  # type: ignore[attr-defined]


async def test_to_the_end_work_obeys_a_give_up_at_once() -> None:
    async def work() -> None:
        await asyncio.Event().wait()

    task = to_the_end(work())
    await asyncio.sleep(0)
    task.cancel(GIVE_UP)
    with pytest.raises(asyncio.CancelledError):
        await task
