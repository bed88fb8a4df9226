"""``GET /healthz`` and ``GET /metrics`` for an orchestrator and a Prometheus scraper.

A deliberately small HTTP/1.1 server on asyncio's streams (one request per connection,
``Connection: close``): two read-only endpoints do not justify a web framework as a
dependency. ``/healthz`` answers 200 while every consumer and repeater runs and 503 while
one reconnects or has stopped, which is what a Kubernetes liveness or readiness probe, or
a load balancer's health check, looks at (the status code; the JSON body is for people).
``/metrics`` shows each consumer's handler counters, then, while metrics are enabled
(:mod:`aio_keuss.observe`: the worker enables them when it serves this endpoint), every
queue's counters, sizes and delivery latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable, Sequence

import orjson

from .. import observe
from ..consumer import Consumer
from ..errors import ConfigError, KeussError
from ..metrics import prometheus_text
from ..repeat import Repeater

log = logging.getLogger("aio_keuss.worker")

MAX_REQUEST_HEAD = 8192
"""Bytes of request line and headers read at most; a longer head gets 431."""
READ_TIMEOUT = 10.0

_REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def health(consumers: Sequence[Consumer], repeaters: Sequence[Repeater] = ()) -> tuple[int, bytes]:
    """(status code, JSON body) of ``/healthz``. A repeater that cannot push counts as a
    consumer that cannot take: either way the backend is out of reach from this process."""
    statuses = [c.status() for c in consumers]
    states = [s.state for s in statuses] + [r.state for r in repeaters]
    healthy = bool(states) and all(state == "running" for state in states)
    body = {
        "status": "ok" if healthy else "unavailable",
        "consumers": [
            {
                "queue": s.queue,
                "state": s.state,
                "concurrency": s.concurrency,
                "in_flight": s.in_flight,
                "handled": s.handled,
                "failed": s.failed,
                "timed_out": s.timed_out,
                "cancelled": s.cancelled,
                "retried": s.retried,
                "deadlettered": s.deadlettered,
                "extended": s.extended,
                "lapsed": s.lapsed,
                "reconnecting_for": s.reconnecting_for,
                "last_error": None if s.last_error is None else repr(s.last_error),
                "last_error_at": s.last_error_at,
            }
            for s in statuses
        ],
        "repeats": [
            {
                "queue": r.queue,
                "key": r.key,
                "state": r.state,
                "pushed": r.pushed,
                "missed": r.missed,
                "next_at": None if r.next_at is None else r.next_at.isoformat(),
                "last_error": None if r.last_error is None else repr(r.last_error),
            }
            for r in repeaters
        ],
    }
    return (200 if healthy else 503), orjson.dumps(body)


class HealthServer:
    """Serves the endpoints for the consumers ``consumers()`` (and the repeaters
    ``repeaters()``) return at request time."""

    def __init__(
        self,
        consumers: Callable[[], Sequence[Consumer]],
        host: str,
        port: int,
        *,
        repeaters: Callable[[], Sequence[Repeater]] = lambda: (),
    ):
        self._consumers = consumers
        self._repeaters = repeaters
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen. An address no host here has (it does not resolve, or is not ours) is a
        :class:`ConfigError`, a setting to fix (exit 2); anything else, a port still held by
        the process being replaced among them, a :class:`KeussError` (exit 1). A blank
        host is refused too: asyncio listens on every interface for ``""``, which a blank
        ``AIO_KEUSS_HEALTH_HOST=`` would have opened to the network unasked."""
        if not self.host.strip():
            raise ConfigError(
                f"health host {self.host!r} is blank: give an address (127.0.0.1 is the"
                " default; 0.0.0.0 for every interface)"
            )
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as exc:
            why = f"cannot serve the health endpoint on {self.host}:{self.port}: {exc}"
            if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(why) from exc
            raise KeussError(why) from exc
        bound = self._server.sockets[0].getsockname()
        self.port = bound[1]  # the one the system chose for port 0
        log.info("health endpoint on http://%s:%d/healthz and /metrics", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = b""
        try:
            try:
                async with asyncio.timeout(READ_TIMEOUT):
                    head = await reader.readuntil(b"\r\n\r\n")
            except ConnectionError:  # reset by the client (some TCP probes do): it went away
                writer.close()
                return
            # outside the try above: a ConnectionError raised while answering (a
            # KeussConnectionError is one) is no client going away, and is logged below
            status, content_type, body = await self._answer(head)
        except asyncio.LimitOverrunError:
            status, content_type, body = 431, "text/plain", b"request head too large\n"
        except (TimeoutError, asyncio.IncompleteReadError):
            status, content_type, body = 408, "text/plain", b""
        except Exception:  # a bug of ours must not take the worker down
            log.exception("health endpoint failed")
            writer.close()
            return
        try:
            writer.write(
                (
                    f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                    f"Content-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\n"
                    "Cache-Control: no-store\r\n"
                    "Connection: close\r\n\r\n"
                ).encode()
                + (b"" if head.startswith(b"HEAD ") else body)
            )
            await writer.drain()
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            writer.close()

    async def _answer(self, head: bytes) -> tuple[int, str, bytes]:
        if len(head) > MAX_REQUEST_HEAD:
            return 431, "text/plain", b"request head too large\n"
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3:
            return 405, "text/plain", b"bad request line\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, "text/plain", b"GET only\n"
        if target == b"/healthz":
            status, body = health(self._consumers(), self._repeaters())
            return status, "application/json", body
        if target == b"/metrics":
            text = prometheus_text(c.metrics() for c in self._consumers())
            registry = observe.active
            if registry is not None:  # the consumers above show their handler durations
                text += await registry.prometheus_text(handlers=False)
            return 200, "text/plain; version=0.0.4; charset=utf-8", text.encode()
        return 404, "text/plain", b"try /healthz or /metrics\n"
