"""A TCP proxy, run in threads of its own, that can hold back a server's replies.

For tests that must hold a reply while the event loop under test ends: the proxy's threads
do not belong to that loop, so ``asyncio.run`` cancelling every task leaves them running.
Requests always go through; while the gate is shut, what the server sends waits in the
proxy (the command ran, its reply is not yet delivered), as when a client stops reading its
socket, for clients (pymongo's) that resume reading on every call of their own.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class ReplyGate:
    """Forwards 127.0.0.1:``port`` to ``target``; :meth:`shut` holds the replies of every
    connection, :meth:`open` delivers them and lets the rest through."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._open = threading.Event()
        self._open.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = []
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def shut(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def cut(self) -> None:
        """Close every connection made so far, both ways: a reply held back is never
        delivered (the server did the work; the client sees its connection lost)."""
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            server = socket.create_connection(self.target)
            self._sockets += (client, server)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, gated: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if gated:
                    self._open.wait()
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
