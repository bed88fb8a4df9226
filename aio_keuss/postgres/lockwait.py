"""How long a pop or reserve waits for a lock another session holds: ``TAKE_LOCK_WAIT``,
enforced by the server.

A take is a look: its caller's timeout bounds the wait for a message, and nothing a take
does needs to wait for another session in normal operation (the rows other takes hold are
skipped, ``FOR UPDATE SKIP LOCKED``). What it can meet is a lock on a whole table: a
migration's ``ALTER TABLE``, ``VACUUM FULL``, ``CLUSTER``, ``CREATE INDEX``, a ``LOCK TABLE``
left open (PostgreSQL manual, "Explicit Locking": each conflicts with the ROW EXCLUSIVE
lock a take asks for). Waited for, it held the take, and its caller, past any timeout for
as long as the other session kept it.

The server bounds that wait itself: with ``lock_timeout`` set (manual, "Client Connection
Defaults"), a statement still waiting for a lock after that long fails with SQLSTATE 55P03
(lock_not_available), and, being one statement in a transaction of its own, has changed
nothing: no reply is lost, nothing taken is to be given back, so at-most-once and
at-least-once both hold. It has to be the session's setting: a statement takes the locks
on its tables when it is bound, before any part of it runs, so a ``set_config`` in the
statement itself comes too late (measured: a take with ``set_config('lock_timeout', ...,
true)`` in its WHERE still waited for the whole of a lock).

So a connection is set (``bind``) before the first take it runs, and stays so while we hold
it: the other statements (push, ok, ko, ...) have no timeout and must wait for a lock, not
fail, so one that meets such a lock past the bound is run again on the same connection once
its setting is reset (``unbind``); failed on the lock, it had done nothing. The setting is
session state the driver does not report, so the connections set are remembered here,
until the session is reset (``RESET`` to the role's or database's own value) or ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

TAKE_LOCK_WAIT = 0.1
"""Longest a take waits for a lock, in seconds: past it the take answers "nothing now",
and a caller with a timeout looks again until that timeout, which it thus overruns by this
much at most (twice this, for a look that first waited as long for a connection: the
connection's ``TAKE_CONNECTION_WAIT``)."""

BIND = f"SET lock_timeout = '{round(TAKE_LOCK_WAIT * 1000)}ms'"
UNBIND = "RESET lock_timeout"

_bound: dict[int, weakref.ref[Any]] = {}
"""The driver's connections (not a pool's proxies, which change at each acquire) whose
session may have ``BIND`` in effect, by ``id``, each dropped as its connection goes: looked
up at every take, an ``id`` in a dict costs a sixth of a ``WeakSet``'s look-up (which makes
a weak reference each time; 0.16 against 0.92 us here)."""


def _session(connection: Any) -> Any:
    """The driver's connection under a pool's proxy (asyncpg's ``PoolConnectionProxy``
    keeps it in ``_con`` while acquired)."""
    return getattr(connection, "_con", None) or connection


def is_bound(connection: Any) -> bool:
    return id(_session(connection)) in _bound


def _forget_key(key: int) -> Callable[[weakref.ref[Any]], None]:
    def forget_gone(_: weakref.ref[Any]) -> None:
        _bound.pop(key, None)

    return forget_gone


async def bind(connection: Any) -> None:
    """Set the session's ``lock_timeout`` to ``TAKE_LOCK_WAIT``. Remembered before the
    statement is sent: cut short, the session may have it, and counts as having it (an
    ``unbind`` too many costs nothing); refused by the server, it does not."""
    session = _session(connection)
    key = id(session)
    _bound[key] = weakref.ref(session, _forget_key(key))
    try:
        await connection.execute(BIND)
    except Exception as exc:
        if getattr(exc, "sqlstate", None):  # the server's error: it set nothing
            _bound.pop(key, None)
        raise


async def unbind(connection: Any) -> None:
    """Reset the session's ``lock_timeout`` to its own default."""
    await connection.execute(UNBIND)
    forget(connection)


def forget(connection: Any) -> None:
    """The session's setting was reset (by ``unbind``; by the pool's reset on release)."""
    _bound.pop(id(_session(connection)), None)
