"""A TCP proxy, run on an event loop in a thread of its own, that breaks connections with RST.

A sibling of ``reply_gate.py`` (which holds replies): this one resets connections, the way a
crashed middlebox, a killed server process or a network fault does, at one of three points
of a request's life:

- ``BEFORE``: the request never reaches the server (it is dropped and both ends reset);
- ``AFTER``: the request reaches the server and runs, and the connection to the client is
  reset when the server's reply comes, the reply dropped (the caller cannot know it ran);
- ``MID``: as ``AFTER``, but the first half of the reply's first chunk is delivered before
  the reset (the client's parser is left with a partial reply).

Faults are injected either on command (:meth:`arm`: the next request whose bytes contain a
marker, once or several times) or at random (:meth:`random`: each request chunk is faulted
with a given probability, the kind chosen by a seeded generator), and every injection is
recorded in :attr:`injected`. A request is what one ``recv`` of the client's side returns:
with pipelining that may be several commands, all treated alike.

The proxy runs outside the event loop under test, so a loop that ends or blocks does not
stop it, and its resets reach the client as a real ``ECONNRESET``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

BEFORE, AFTER, MID = "before", "after", "mid"
KINDS = (BEFORE, AFTER, MID)
REPLY_WAIT = 2.0
"""How long a connection doomed by ``AFTER`` / ``MID`` waits for the server's reply before
being reset all the same (a blocking command, or a request that has no reply)."""


@dataclass
class _Rule:
    kind: str
    match: bytes | None
    count: int
    skip: int = 0


@dataclass(eq=False)
class _Link:
    client: asyncio.Transport | None = None
    server: asyncio.Transport | None = None
    cut: str | None = None
    buffered: list[bytes] = field(default_factory=list)
    dead: bool = False


def _rst(transport: asyncio.Transport | None) -> None:
    """Close with a reset rather than a FIN: SO_LINGER on, with a zero timeout."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to ``host``:``target_port``, resetting connections as
    told (see the module's docstring). ``close()`` stops it."""

    def __init__(self, host: str, target_port: int) -> None:
        self.target = (host, target_port)
        self.injected: list[tuple[str, bytes]] = []
        """Each fault injected: its kind and the first bytes of the request it hit."""
        self.connections = 0
        self.replies_cut = 0
        """Replies dropped by ``AFTER`` / ``MID`` faults: each such request ran on the server."""
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._rate = 0.0
        self._kinds: tuple[str, ...] = KINDS
        self._rng = random.Random(0)
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._admitting = asyncio.Event()
        self._admitting.set()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)
        self.port: int = self._port

    # The test's side ------------------------------------------------------------------

    def arm(self, kind: str, match: bytes | None = None, count: int = 1, skip: int = 0) -> None:
        """Fault, with ``kind``, the next ``count`` requests containing ``match`` (any
        request when None), after letting ``skip`` of them through."""
        assert kind in KINDS, kind
        with self._lock:
            self._rules.append(_Rule(kind, match, count, skip))

    def random(self, rate: float, seed: int, kinds: tuple[str, ...] = KINDS) -> None:
        """Fault each request with probability ``rate``, with a kind drawn from ``kinds``;
        the draws come from a generator seeded with ``seed``."""
        with self._lock:
            self._rate, self._kinds, self._rng = rate, kinds, random.Random(seed)

    def calm(self) -> None:
        """No more faults: the armed rules and the random rate are dropped."""
        with self._lock:
            self._rate = 0.0
            self._rules.clear()

    def armed(self) -> int:
        """How many armed faults are still to be injected."""
        with self._lock:
            return sum(rule.count for rule in self._rules)

    def hold_connections(self) -> None:
        """Connections made from now on wait, accepted but not connected to the server
        (what reaches them stays unsent), until :meth:`admit`: a client that reconnects to
        send a command again is held between the fault and the replay."""
        self._loop.call_soon_threadsafe(self._admitting.clear)

    def admit(self) -> None:
        """Let the held connections (and those made from now on) reach the server."""
        self._loop.call_soon_threadsafe(self._admitting.set)

    def reset_all(self) -> None:
        """Reset every open connection now."""
        self._loop.call_soon_threadsafe(self._reset_all)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop)
        self._thread.join(10)

    # The proxy's own loop -------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            self._loop.create_server(lambda: _ClientSide(self), "127.0.0.1", 0)
        )
        self._port = self._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()
        self._loop.close()

    def _stop(self) -> None:
        self._server.close()
        self._reset_all()
        self._loop.stop()

    def _reset_all(self) -> None:
        for link in list(self._links):
            self._kill(link)

    def _kill(self, link: _Link) -> None:
        link.dead = True
        self._links.discard(link)
        _rst(link.client)
        _rst(link.server)

    def _decide(self, data: bytes) -> str | None:
        with self._lock:
            for rule in self._rules:
                if rule.match is None or rule.match in data:
                    if rule.skip:
                        rule.skip -= 1
                        continue
                    rule.count -= 1
                    if not rule.count:
                        self._rules.remove(rule)
                    kind = rule.kind
                    break
            else:
                if not self._rate or self._rng.random() >= self._rate:
                    return None
                kind = self._rng.choice(self._kinds)
            self.injected.append((kind, data[:48]))
            return kind


class _ServerSide(asyncio.Protocol):
    def __init__(self, proxy: FaultProxy, link: _Link) -> None:
        self.proxy, self.link = proxy, link

    def data_received(self, data: bytes) -> None:
        link = self.link
        if link.dead or link.client is None:
            return
        if link.cut is None:
            link.client.write(data)
            return
        if link.cut == MID and len(data) > 1:
            link.client.write(data[: len(data) // 2])
        self.proxy.replies_cut += 1
        self.proxy._kill(link)

    def connection_lost(self, exc: Exception | None) -> None:
        link = self.link
        if not link.dead and link.client is not None:
            link.dead = True
            self.proxy._links.discard(link)
            link.client.close()  # a FIN after what was written, as the server sent


class _ClientSide(asyncio.Protocol):
    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.link = _Link()

    def connection_made(self, transport: Any) -> None:
        self.link.client = transport
        self.proxy.connections += 1
        self.proxy._links.add(self.link)
        transport.pause_reading()
        self._connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        link = self.link
        await self.proxy._admitting.wait()
        if link.dead:
            return
        try:
            transport, _ = await asyncio.get_running_loop().create_connection(
                lambda: _ServerSide(self.proxy, link), *self.proxy.target
            )
        except OSError:
            self.proxy._kill(link)
            return
        link.server = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if link.dead:
            _rst(transport)
            return
        for data in link.buffered:
            self._forward(data)
        link.buffered.clear()
        if link.client is not None and not link.dead:
            link.client.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
            link.client.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.link.server is None:
            self.link.buffered.append(data)
        else:
            self._forward(data)

    def _forward(self, data: bytes) -> None:
        link, proxy = self.link, self.proxy
        if link.dead or link.cut is not None or link.server is None:
            return
        kind = proxy._decide(data)
        if kind == BEFORE:
            proxy._kill(link)
            return
        link.server.write(data)
        if kind is not None:  # AFTER / MID: the next reply is cut
            link.cut = kind
            if link.client is not None:
                link.client.pause_reading()
            asyncio.get_running_loop().call_later(REPLY_WAIT, self._give_up)

    def _give_up(self) -> None:
        if not self.link.dead:
            self.proxy._kill(self.link)

    def connection_lost(self, exc: Exception | None) -> None:
        link = self.link
        if not link.dead:
            link.dead = True
            self.proxy._links.discard(link)
            if link.server is not None:
                link.server.close()
