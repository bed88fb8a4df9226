"""TCP keepalive for the connections the library makes itself.

A connection left idle (a producer between bursts, a connection held for reuse) can be
forgotten by a NAT gateway or load balancer on the way: Azure's load balancer after 4
minutes by default, AWS's NAT gateway after 350 seconds. Many drop such a connection
silently, with no reset: the next command is retransmitted into nothing (about 15 minutes
on Linux, ``tcp_retries2``) and a reply awaited when the server's host died never comes
(the kernel's keepalive, when on at all, starts after two hours). Probes every minute keep
the middlebox's entry alive, and a peer that stopped answering them is given up in about
90 seconds, which callers see as a lost connection (``KeussConnectionError``): a consumer
then reconnects with backoff, as after any outage (Linux ``tcp(7)``: ``TCP_KEEPIDLE``,
``TCP_KEEPINTVL``, ``TCP_KEEPCNT``, ``TCP_USER_TIMEOUT``). Probes are answered by the peer's
kernel, so a server that is slow or busy is never given up for it.
"""

from __future__ import annotations

import socket

IDLE = 60
"""Seconds of silence on a connection before its first probe."""
INTERVAL = 10
"""Seconds between probes that go unanswered."""
COUNT = 3
"""Unanswered probes after which the connection is given up."""
USER_TIMEOUT_MS = (IDLE + INTERVAL * COUNT) * 1000
"""Milliseconds data sent may stay unacknowledged before the connection is given up (Linux
only): the same bound for a command sent into a dead path as for a reply awaited from a
dead peer."""


def socket_options() -> dict[int, int]:
    """The TCP-level options this platform has, as ``{option: value}`` (redis-py's
    ``socket_keepalive_options`` takes them so). ``SO_KEEPALIVE`` itself is separate."""
    wanted = (
        ("TCP_KEEPIDLE", IDLE),
        ("TCP_KEEPALIVE", IDLE),  # macOS's name for the idle time
        ("TCP_KEEPINTVL", INTERVAL),
        ("TCP_KEEPCNT", COUNT),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    )
    return {
        option: value
        for name, value in wanted
        if (option := getattr(socket, name, None)) is not None
    }


def keep_alive(sock: socket.socket | None) -> None:
    """Turn keepalive on for a TCP socket (``None`` or a Unix socket: nothing to do). A
    platform refusing an option keeps its own default for that one."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    except OSError:
        return
    for option, value in socket_options().items():
        try:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
        except OSError:
            continue
