"""A TCP proxy that drops connections silently, for the signal listeners' liveness tests."""

from __future__ import annotations

import asyncio

import aio_keuss


class BlackHole:
    """A TCP proxy to a server; :meth:`swallow` makes the connections that sent ``marker``
    (LISTEN, SUBSCRIBE) forward nothing more, in either direction, without closing them:
    a connection a NAT or firewall dropped silently (no FIN, no RST)."""

    def __init__(self, host: str, port: int, marker: bytes) -> None:
        self.target = (host, port)
        self.marker = marker
        self.listeners: list[dict[str, bool]] = []
        self.port = 0
        self.down = False  # see ``cut``
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        self._writers.append(writer)
        to_reader, to_writer = await asyncio.open_connection(*self.target)
        state = {"listen": False, "hole": False}
        self.listeners.append(state)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
            while data := await src.read(65536):
                if up and self.marker in data:
                    state["listen"] = True
                if not state["hole"]:
                    dst.write(data)
                    await dst.drain()

        tasks = [
            asyncio.ensure_future(pipe(reader, to_writer, True)),
            asyncio.ensure_future(pipe(to_reader, writer, False)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            writer.transport.abort()
            to_writer.transport.abort()

    def swallow(self) -> int:
        held = [s for s in self.listeners if s["listen"]]
        for state in held:
            state["hole"] = True
        return len(held)

    def cut(self) -> None:
        """The server goes down: every connection through here is reset, and so is each new
        one at once, until :meth:`restore` (a server that stopped, then started again)."""
        self.down = True
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    def restore(self) -> None:
        self.down = False

    def close(self) -> None:
        self.server.close()


async def assert_a_silent_drop_is_survived(
    hole: BlackHole, consumer_factory: aio_keuss.Factory, producer: aio_keuss.Factory
) -> None:
    """The consumer factory's listener (through ``hole``) is dropped silently: a push from
    ``producer`` must still wake a consumer there soon, by a new listener, not its poll."""
    qc = await consumer_factory.queue("silent")
    qp = await producer.queue("silent")
    assert hole.swallow() == 1  # the listener's connection: open, but dead
    await asyncio.sleep(3.0)  # several liveness checks
    # its timeout comes before its 30 s poll: only a new listener's wake-up gets it the message
    waiting = asyncio.ensure_future(qc.pop(timeout=20))
    await asyncio.sleep(0.2)
    await qp.push("after the drop")
    message = await asyncio.wait_for(waiting, 25)
    assert message is not None and message.payload == "after the drop"
    await asyncio.wait_for(consumer_factory.close(), 10)


class Silent(asyncio.Protocol):
    """A server that accepts connections and never answers (nor closes them): a database
    host whose server hangs, so a client's connect waits for as long as it is let to.
    ``accepted`` is set once a client got in."""

    def __init__(self) -> None:
        self.accepted = asyncio.Event()
        self.port = 0
        self._transports: list[asyncio.BaseTransport] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: self, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transports.append(transport)
        self.accepted.set()

    def close(self) -> None:
        self.server.close()
        for transport in self._transports:
            transport.close()
