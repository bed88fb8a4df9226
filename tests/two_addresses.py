"""A host name of two addresses, for the connect failures a name like ``localhost`` (::1
and 127.0.0.1 on many machines) brings: asyncio tries each address, and when all fail it
raises one ``OSError`` listing them, with no errno (``loop.create_connection`` in Python's
asyncio documentation)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

TWO_ADDRESSES = "two-addresses.ak.test"
"""Resolves to the IPv6 then the IPv4 loopback address once :func:`resolving_to_both`
ran (``.test`` is reserved for testing, RFC 2606)."""


def resolving_to_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TWO_ADDRESSES`` made to resolve so, through the resolver asyncio calls: this
    machine's ``localhost`` may have one address only. The connections made are real; a
    server of ``own_servers`` listens on 127.0.0.1 only, so ::1 refuses."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host != TWO_ADDRESSES:
            return real(host, *args, **kwargs)
        return [*real("::1", *args, **kwargs), *real("127.0.0.1", *args, **kwargs)]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
