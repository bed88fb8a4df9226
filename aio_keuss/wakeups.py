"""Waking the consumers of one queue: as many as the new messages need, not all of them.

Waking every sleeping consumer on each push (a "thundering herd") costs one reserve round
trip per consumer for one message: with 64 consumers asleep, 63 come back empty. Instead a
signal says how many messages it announces (when it knows) and wakes sleeping consumers, the
longest-sleeping first, until what they asked for covers that count. Liveness does not rest
on that count being right:

- a consumer whose fetch came back empty goes to sleep only if no announcement was left to
  the consumers fetching (:attr:`Wakeups.announced` did not move: more messages came than
  sleepers to take them, or an unknown number); else it fetches again at once;
- a consumer that took messages and learned from the same round trip that more are ready
  wakes one more sleeper ("passing the baton"), so a backlog pulls sleepers in;
- a consumer woken that leaves without fetching (cancelled) hands its wake-up on;
- a signal that does not know its count (another process on an older release, a bucket
  becoming visible), a resume, a drain or a close wakes everyone, as before;
- and the poll interval still bounds what a lost signal costs.

Only sleeping consumers are in line, so a busy consumer pays nothing for any of this.
"""

from __future__ import annotations

import asyncio


class Waiter:
    """One sleeping consumer's place in line."""

    __slots__ = ("_future", "wanted", "woken")

    def __init__(self, wanted: int, loop: asyncio.AbstractEventLoop) -> None:
        self.wanted = wanted
        self.woken = False
        self._future: asyncio.Future[None] = loop.create_future()

    def wake(self) -> None:
        self.woken = True
        if not self._future.done():
            self._future.set_result(None)

    async def wait(self, timeout: float) -> bool:
        """Sleep until woken (True) or ``timeout`` seconds (False)."""
        try:
            async with asyncio.timeout(timeout):
                await self._future
        except TimeoutError:
            return self.woken
        return True


class Wakeups:
    """The consumers sleeping on one queue, the longest-sleeping first."""

    __slots__ = ("_line", "_loop", "announced", "sleepers")

    def __init__(self) -> None:
        self._line: dict[Waiter, None] = {}  # insertion-ordered
        self.sleepers = self._line  # read only: falsy when nobody sleeps, at no call
        # Looked up once: on Python 3.11 asyncio.get_running_loop() costs a getpid() call.
        self._loop: asyncio.AbstractEventLoop | None = None
        self.announced = 0
        """Announcements so far: a consumer compares it before and after a fetch."""

    def __len__(self) -> int:
        return len(self._line)

    async def sleep(self, wanted: int, timeout: float) -> bool:
        """Sleep in line until woken (True) or ``timeout`` seconds (False); ``wanted``: how
        many messages the consumer will ask for when it wakes."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        waiter = Waiter(wanted, loop)
        self._line[waiter] = None
        try:
            return await waiter.wait(timeout)
        except BaseException:
            self._line.pop(waiter, None)
            if waiter.woken:  # woken, but it will not fetch: the next in line will
                self.announce(wanted)
            raise
        finally:
            self._line.pop(waiter, None)

    def announce(self, count: int | None) -> None:
        """New messages (``count`` of them; None: unknown), a resume, a drain or a close:
        sleepers wake to cover ``count``; what they cannot cover (too few asleep, or an
        unknown count) is left to the consumers fetching now, who then look again."""
        if not self._line:  # nobody asleep, as on every push of a busy queue: no call
            if count is None or count > 0:
                self.announced += 1
        elif self.wake(count):
            self.announced += 1

    def wake(self, count: int | None) -> bool:
        """Wake sleepers until what they asked for covers ``count`` messages (None: all of
        them); whether some of ``count`` is left uncovered."""
        if count is None:
            for waiter in self._line:
                waiter.wake()
            return True
        for waiter in self._line:  # waking does not change the line: no copy needed
            if count <= 0:
                return False
            if not waiter.woken:
                waiter.wake()
                count -= waiter.wanted
        return count > 0
