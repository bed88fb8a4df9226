"""``aio-keuss list | info | peek | find | push | pop | move | requeue | purge | promote |
reschedule | priority | pause | resume | history | replay | stats | pipelines |
remove-pipeline``: look into queues and
repair them from a shell, on the same console script as the worker.

Every command takes the worker's connection settings (``--backend``, ``--url``,
``--option KEY=VALUE``, ``--config``, and the ``AIO_KEUSS_*`` environment variables), prints
a table for people, or JSON with ``--json`` for scripts (one document on stdout; errors go
to stderr), and exits with a code a script can trust:

====  ===================================================================================
0     done
1     failed (a backend error, or interrupted; nothing is known about what was done)
2     bad usage: an unknown flag, a bad value, invalid JSON; nothing was written
3     the backend cannot be reached
4     not found: ``find`` of a message that is nowhere, ``pop`` of an empty queue, a queue
      the backend does not know (only commands that write into a queue create it)
5     the backend cannot do this (``NotSupportedError``); nothing was written
6     ``purge`` was not confirmed; nothing was written
====  ===================================================================================

``promote QUEUE ID``, ``reschedule QUEUE ID --delay S`` and ``priority QUEUE ID P`` change
a waiting message where it stands (``Queue.promote``, ``reschedule``, ``change_priority``):
exit 4 when it is not waiting (gone, under an active reservation, or for ``promote`` ready
already), 5 where the backend has no ``reschedule``.

``cancel QUEUE ID [--reason TEXT]`` cancels a message (``Queue.cancel``) and says what it
did: ``removed`` (it was waiting) or ``requested`` (its holder is asked to stop it), exit
0; exit 4 when there was nothing to cancel, 5 where the backend can neither remove nor
keep requests.

Opening a queue records its options in the backend; these commands open a queue with the
options recorded there already, so looking at a queue never changes them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import shlex
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from ..cancels import check_reason
from ..errors import (
    ConfigError,
    InvalidInputError,
    KeussConnectionError,
    KeussError,
    NotSupportedError,
)
from ..factory import Factory, connect
from ..loading import add_connection_flags
from ..message import (
    Message,
    check_id,
    check_known_id,
    check_priority,
    encode_headers,
    encode_payload,
    visible,
)
from ..options import QUEUE_OPTION_NAMES, check_queue_name
from ..queue import Queue
from ..types import CancelResult, MessageView, Page
from ..visibility import check_replay, check_requeue
from .settings import connection_settings, option_value

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_NOT_FOUND, EXIT_NOT_SUPPORTED, EXIT_DECLINED = 4, 5, 6
DEADLETTER = "__deadletter__"

Command = Callable[[Factory, argparse.Namespace, "Output"], Awaitable[int]]


# output -------------------------------------------------------------------------------


class Output:
    """A table for people, or one JSON document for scripts."""

    def __init__(self, as_json: bool, stream: TextIO) -> None:
        self.as_json = as_json
        self.stream = stream

    def emit(self, doc: Any, rows: list[dict[str, Any]] | None = None) -> None:
        """Print ``doc`` as JSON, or ``rows`` (default: ``doc``) as a table."""
        if self.as_json:
            self.stream.write(json.dumps(doc, default=_json_default, sort_keys=False) + "\n")
            return
        shown = doc if rows is None else rows
        if isinstance(shown, list):
            self.stream.write(_table(shown))
        elif isinstance(shown, dict):
            width = max((len(k) for k in shown), default=0)
            for key, value in shown.items():
                self.stream.write(f"{key.ljust(width)}  {_cell(value)}\n")
        else:
            self.stream.write(f"{shown}\n")

    def note(self, text: str) -> None:
        """A line for people only (a cursor, a count): on stderr with --json."""
        print(text, file=sys.stderr if self.as_json else self.stream)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    raise TypeError(f"{type(value).__name__} is not JSON")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat(timespec="milliseconds")
    if isinstance(value, str):
        return visible(value)
    text = json.dumps(value, default=_json_default, separators=(",", ":"))
    return text if len(text) <= 60 else text[:57] + "..."


def _shell_word(text: str) -> str:
    """``text`` as one word a shell reads back as ``text``, for a hint a person copies into
    the next command: a cursor holds a ``|`` (a pipe), and may end with an id another
    program stored (quotes, ``$(...)``, line breaks, terminal escapes, bidi overrides).
    Printable text is single-quoted (``shlex.quote``). Text with characters a terminal would
    obey or hide takes the ``$'...'`` form with those as escapes (``\\xHH``, ``\\uHHHH``,
    ``\\UHHHHHHHH``, always of full width so that no following character joins one):
    visible on the screen, the same value once pasted into bash (Bash Reference Manual,
    "ANSI-C Quoting"; ``\\u`` and ``\\U`` in a UTF-8 locale) or zsh (zsh manual,
    "Quoting")."""
    if text.isprintable():
        return shlex.quote(text)
    parts = []
    for char in text:
        if char in "\\'":
            parts.append("\\" + char)
        elif char.isprintable():
            parts.append(char)
        elif char < "\x80":
            parts.append(f"\\x{ord(char):02x}")
        elif char <= "\uffff":
            parts.append(f"\\u{ord(char):04x}")
        else:
            parts.append(f"\\U{ord(char):08x}")
    return "$'" + "".join(parts) + "'"


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)\n"
    columns = list(rows[0])
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _message(message: Message) -> dict[str, Any]:
    return {
        "id": message.id,
        "tries": message.tries,
        "priority": message.priority,
        "mature": message.mature,
        "headers": message.headers,
        "payload": message.payload,
    }


def _view(found: MessageView) -> dict[str, Any]:
    return {
        "id": found.message.id,
        "queue": found.queue,
        "state": str(found.state),
        "at": found.at,
        "tries": found.message.tries,
        "priority": found.message.priority,
        "headers": found.message.headers,
        "payload": found.message.payload,
    }


# helpers ------------------------------------------------------------------------------


class _NoSuchQueue(KeussError):
    """A command that only looks or takes named a queue the backend does not know."""


async def _open(
    factory: Factory,
    name: str,
    *,
    create: bool = False,
    known: Mapping[str, Mapping[str, Any]] | None = None,
) -> Queue:
    """The queue, opened with the options recorded for it (so they stay as they are).
    Opening records a queue in the backend: only a command that writes into it (``create``)
    may open one the backend does not know; the others answer not found and leave no
    record of a mistyped name. Recorded options this release refuses leave the queue
    opened with the defaults, its record as it was. ``known``: the backend's listing, read
    already by a command opening every queue of it (read here, once per queue, the listing
    of N queues was read N times)."""
    check_queue_name(name)  # a bad name is bad usage, not a missing queue (nor options)
    if known is None:
        known = await factory.list()
    if name not in known and not create:
        raise _NoSuchQueue(f"no queue named {name!r} on this backend")
    if name not in known:
        return await factory.queue(name)  # a command writing into it: recorded
    options = {k: v for k, v in known[name].items() if k in QUEUE_OPTION_NAMES}
    try:
        # not recorded again: the record may hold options a newer release added
        return await factory._recorded(name, options)
    except (ConfigError, InvalidInputError, NotSupportedError) as exc:
        # options this release refuses (a newer one recorded them, or a hand did): opened
        # with the defaults, unrecorded, as the dashboard does, rather than failing every
        # command that reads the queue (list and stats among them) as bad usage
        _note(
            f"queue {name!r} opened with the defaults, its recorded options left as they are: {exc}"
        )
        return await factory._sibling(name)


def _openable(known: Mapping[str, Any]) -> list[str]:
    """The listed queues a command over all of them opens, sorted. One recorded under a
    name this release refuses (a newer release allowed it, or a hand wrote it) cannot be
    opened at all: it is left out, with a note, rather than failing the command for every
    queue as bad usage."""
    names = []
    for name in sorted(known):
        try:
            names.append(check_queue_name(name))
        except InvalidInputError as exc:
            _note(f"queue {name!r} left out: {exc}")
    return names


def _note(text: str) -> None:
    """Say ``text`` on stderr, once per process (not at every round of stats --watch)."""
    if text not in _said:
        _said.add(text)
        print(f"aio-keuss: {text}", file=sys.stderr)


_said: set[str] = set()
"""The notes :func:`_note` said in this process."""


def _require(factory: Factory, *capabilities: str) -> None:
    """Refuse before a queue is opened (opening one records it in the backend)."""
    for name in capabilities:
        if not getattr(factory.capabilities, name):
            raise NotSupportedError(f"backend {factory.backend_name!r} has no {name}")


def _time(text: str | None) -> float | None:
    """``--since`` / ``--until``: ISO 8601 (UTC unless it says otherwise) or epoch seconds."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInputError(f"not a time (ISO 8601 or epoch seconds): {text!r}") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidInputError(f"{what} is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidInputError(f"{what} is nested deeper than JSON is read here") from None


async def _ask(question: str) -> str:
    """Print ``question`` on stderr and wait for one line of stdin without blocking the
    event loop. Read on the loop's thread, the line held a Ctrl-C until it came: Python
    retries a read that a signal interrupts once the handler returns (PEP 475), and the
    handler asyncio.run installs only cancels the main task, which cannot happen while
    its thread sits in that read. Read in a thread of its own, the wait is an await a
    Ctrl-C cancels at once. The thread is a daemon (a process that ends does not wait for
    an answer) and reads the descriptor, not ``sys.stdin``, whose buffer lock it would
    hold at interpreter shutdown."""
    print(question, end="", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[str] = loop.create_future()

    def settle(line: str) -> None:
        if not answered.done():
            answered.set_result(line)

    def read() -> None:
        line = _read_line()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, line)

    threading.Thread(target=read, name="aio-keuss-question", daemon=True).start()
    return await answered


def _read_line() -> str:
    """One line of stdin ("" at its end), read a byte at a time so that nothing past the
    line is taken from a pipe."""
    stdin = sys.stdin
    if stdin is None:
        return ""
    try:
        fd = stdin.fileno()
    except (OSError, ValueError):  # replaced by an object without a descriptor
        return stdin.readline()
    line = b""
    while not line.endswith(b"\n"):
        try:
            part = os.read(fd, 1)
        except OSError:
            break
        if not part:
            break
        line += part
    return line.decode(errors="replace")


# commands -----------------------------------------------------------------------------


async def _list(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    rows = []
    known = await factory.list()
    for name in _openable(known):
        q = await _open(factory, name, known=known)
        sizes = await q.sizes()
        rows.append(
            {
                "queue": name,
                "size": sizes.size,
                "scheduled": sizes.scheduled,
                "reserved": sizes.reserved,
                "total": sizes.total,
                "paused": await q.is_paused(),
            }
        )
    out.emit(rows)
    return EXIT_OK


async def _info(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    q = await _open(factory, args.queue)
    sizes = await q.sizes()
    doc = {
        "queue": q.name,
        "backend": factory.backend_name,
        "size": sizes.size,
        "scheduled": sizes.scheduled,
        "reserved": sizes.reserved,
        "total": sizes.total,
        "paused": await q.is_paused(),
        "next_mature": await q.next_mature_t(),
        "stats": await q.stats(),
        "options": q.options.as_dict(),
    }
    out.emit(doc)
    return EXIT_OK


def _emit_page(out: Output, page: Page) -> int:
    """A page of messages, and for people where the next one starts."""
    items = [_view(v) for v in page.items]
    out.emit({"items": items, "cursor": page.cursor}, items)
    if page.cursor is not None and not out.as_json:
        out.note(f"more after --after {_shell_word(page.cursor)}")
    return EXIT_OK


async def _peek(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    _require(factory, "peek")
    q = await _open(factory, args.queue)
    page = await q.page(state=args.state, after=args.after, limit=args.n)
    return _emit_page(out, page)


async def _find(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    _require(factory, "peek")
    q = await _open(factory, args.queue)
    found = await q.find(args.id)
    dead = args.deadletter
    if found is None and dead != args.queue and dead in await factory.list():
        found = await (await _open(factory, args.deadletter)).find(args.id)
    if found is None:
        out.emit(None, [])
        print(f"aio-keuss find: {args.id!r} is not in {args.queue!r}", file=sys.stderr)
        return EXIT_NOT_FOUND
    out.emit(_view(found))
    return EXIT_OK


async def _result(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    _require(factory, "results")
    check_known_id(args.id)
    q = await _open(factory, args.queue)
    found = await q.result(args.id, timeout=args.wait)
    if found is None:
        out.emit(None, [])
        print(f"aio-keuss result: no result for {args.id!r} in {args.queue!r}", file=sys.stderr)
        return EXIT_NOT_FOUND
    out.emit(
        {
            "id": found.id,
            "ok": found.ok,
            "value": found.value,
            "error": found.error,
            "finished": found.finished,
        }
    )
    return EXIT_OK


async def _push(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    if args.payload is not None:
        payloads = [_json_arg(args.payload, "the payload")]
    else:
        lines = [line for line in sys.stdin.read().splitlines() if line.strip()]
        payloads = [_json_arg(line, f"line {i}") for i, line in enumerate(lines, 1)]
    headers = {}
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"--header takes KEY=VALUE, not {item!r}")
        headers[key] = option_value(value)
    if args.id is not None and len(payloads) != 1:
        raise InvalidInputError("--id goes with one payload")
    for payload in payloads:  # refused before the queue is opened (which records it)
        encode_payload(payload)
    encode_headers(headers or None)
    if args.id is not None:
        check_id(args.id)
        _require(factory, "idempotent")
    if args.delay:
        _require(factory, "delay")
    if check_priority(args.priority):
        _require(factory, "priority")
    if not payloads:  # an empty stdin: nothing to write, so no queue to record either
        check_queue_name(args.queue)
        out.emit({"ids": []}, [])
        return EXIT_OK
    q = await _open(factory, args.queue, create=True)
    ids = await q.push_many(
        payloads,
        delay=args.delay,
        headers=headers or None,
        ids=None if args.id is None else [args.id],
        priority=args.priority,
    )
    out.emit({"ids": ids}, [{"id": i} for i in ids])
    return EXIT_OK


async def _pop(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    q = await _open(factory, args.queue)
    got = await q.pop_many(args.n, timeout=args.timeout)
    items = [_message(m) for m in got]
    out.emit(items)
    return EXIT_OK if got else EXIT_NOT_FOUND


def _check_ids(ids: Sequence[str]) -> None:
    """Ids named on the command line, refused before a target queue is opened (opening
    one records it in the backend)."""
    for message_id in ids:
        check_known_id(message_id)


async def _move(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    _require(factory, "peek", "hold", "move")
    _check_ids(args.ids)
    if check_queue_name(args.to) == args.queue:
        raise InvalidInputError(f"move: {args.to!r} is the queue the messages are in")
    q = await _open(factory, args.queue)
    await _open(factory, args.to, create=True)
    moved = await q.requeue(args.ids, origin=args.to)
    return _moved(out, moved, args.ids)


async def _requeue(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    _require(factory, "peek", "hold", "move")
    _check_ids(args.ids)
    check_requeue(args.ids or None, args.origin)
    q = await _open(factory, args.queue)
    if args.origin is not None:
        await _open(factory, args.origin, create=True)
    moved = await q.requeue(args.ids or None, origin=args.origin)
    return _moved(out, moved, args.ids)


def _moved(out: Output, moved: Mapping[str, str], asked: Sequence[str]) -> int:
    out.emit({"moved": dict(moved)}, [{"id": k, "now": v} for k, v in moved.items()])
    missing = [i for i in asked if i not in moved]
    if missing:
        print(f"aio-keuss: not moved (gone or held): {', '.join(missing)}", file=sys.stderr)
        return EXIT_NOT_FOUND
    return EXIT_OK


async def _purge(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    _require(factory, "peek", "remove")
    q = await _open(factory, args.queue)
    if not args.yes:
        total = (await q.sizes()).total
        try:
            answer = await _ask(f"purge {total} message(s) of {q.name!r}? [y/N] ")
        except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this task
            print("\naio-keuss purge: interrupted, nothing removed", file=sys.stderr)
            raise
        if answer.strip().lower() not in ("y", "yes"):
            print("aio-keuss purge: not confirmed, nothing removed", file=sys.stderr)
            return EXIT_DECLINED
    removed = await q.purge()
    out.emit({"queue": q.name, "removed": removed})
    return EXIT_OK


async def _amend(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    """promote, reschedule, priority: all checked before the queue is opened."""
    message_id = check_known_id(args.id)
    if args.command == "priority":
        check_priority(args.priority)
        _require(factory, "reschedule", "priority")
    else:
        _require(factory, "reschedule")
    q = await _open(factory, args.queue)
    if args.command == "promote":
        changed = await q.promote(message_id)
    elif args.command == "reschedule":
        changed = await q.reschedule(message_id, args.delay)
    else:
        changed = await q.change_priority(message_id, args.priority)
    out.emit({"queue": q.name, "id": message_id, "changed": changed})
    if not changed:
        print(f"aio-keuss {args.command}: {message_id!r} is not waiting", file=sys.stderr)
        return EXIT_NOT_FOUND
    return EXIT_OK


async def _pause(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    q = await _open(factory, args.queue, create=True)  # may be paused before its first push
    if args.command == "pause":
        await q.pause()
    else:
        await q.resume()
    out.emit({"queue": q.name, "paused": await q.is_paused()})
    return EXIT_OK


async def _history(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    _require(factory, "history")
    q = await _open(factory, args.queue)
    page = await q.history(
        since=_time(args.since), until=_time(args.until), limit=args.limit, after=args.after
    )
    return _emit_page(out, page)


async def _replay(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    _require(factory, "history")
    _check_ids(args.ids)
    since, until = _time(args.since), _time(args.until)
    check_replay(args.ids or None, since, until)
    q = await _open(factory, args.queue)
    if args.to is not None:
        await _open(factory, args.to, create=True)
    ids = await q.replay(args.ids or None, since=since, until=until, to=args.to)
    out.emit({"ids": ids}, [{"id": i} for i in ids])
    return EXIT_OK


async def _stats(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    rounds = 0
    while True:
        known = await factory.list()
        names = args.queues or _openable(known)
        rows = []
        for name in names:
            q = await _open(factory, name, known=known)
            sizes = await q.sizes()
            rows.append(
                {"queue": name, "size": sizes.size, "total": sizes.total, **await q.stats()}
            )
        if args.watch and not out.as_json:
            out.stream.write(f"-- {datetime.now(UTC).isoformat(timespec='seconds')}\n")
        out.emit(rows)
        out.stream.flush()
        rounds += 1
        if args.watch is None or (args.count is not None and rounds >= args.count):
            return EXIT_OK
        await asyncio.sleep(args.watch)


async def _pipelines(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    found = await factory.pipelines(sizes=True)
    rows = []
    for name, topology in found.items():
        for queue, sizes in topology.get("sizes", {}).items():
            rows.append(
                {
                    "pipeline": name,
                    "queue": queue,
                    "size": sizes.size,
                    "scheduled": sizes.scheduled,
                    "reserved": sizes.reserved,
                    "total": sizes.total,
                }
            )
        topology["sizes"] = {
            q: {"size": s.size, "scheduled": s.scheduled, "reserved": s.reserved, "total": s.total}
            for q, s in topology.get("sizes", {}).items()
        }
    out.emit(found, rows)
    return EXIT_OK


async def _remove_pipeline(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    removed = await factory.remove_pipeline(args.pipeline)
    out.emit({"pipeline": args.pipeline, "removed": removed})
    return EXIT_OK if removed else EXIT_NOT_FOUND


# the parser ---------------------------------------------------------------------------


def _connection_flags() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_connection_flags(common)
    add = common.add_argument
    add("--json", action="store_true", help="print JSON for scripts instead of a table")
    return common


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


async def _cancel(factory: Factory, args: argparse.Namespace, out: Output) -> int:
    """Checked before the queue is opened, as the amend commands are."""
    message_id = check_known_id(args.id)
    reason = check_reason(args.reason)
    capabilities = factory.capabilities
    if not capabilities.remove and not capabilities.results:
        raise NotSupportedError(f"backend {factory.backend_name!r} cannot cancel")
    q = await _open(factory, args.queue)
    outcome = await q.cancel(message_id, reason)
    out.emit({"queue": q.name, "id": message_id, "outcome": outcome.name.lower()})
    if outcome is CancelResult.MISSING:
        print(f"aio-keuss cancel: nothing to cancel for {message_id!r}", file=sys.stderr)
        return EXIT_NOT_FOUND
    return EXIT_OK


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"must be seconds >= 0, not {text}")
    return value


def _interval(text: str) -> float:
    """Seconds between two rounds of a watch: above 0 (0 would ask the backend in a loop
    with no pause)."""
    value = _seconds(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be seconds > 0, not {text}")
    return value


def add_commands(commands: Any) -> None:
    """Add the admin commands to the console script's subcommands."""
    common = [_connection_flags()]

    def command(name: str, run: Command, help: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(
            name, parents=common, help=help, description=help
        )
        parser.set_defaults(run=run)
        return parser

    command("list", _list, "queues of the backend with their sizes and paused flag")
    command("info", _info, "sizes, stats, options, paused, next mature of a queue").add_argument(
        "queue"
    )
    p = command("peek", _peek, "messages of a queue, without taking them")
    p.add_argument("queue")
    p.add_argument("-n", type=_positive, default=10, help="how many (default 10)")
    p.add_argument("--state", default="ready", choices=["ready", "scheduled", "reserved", "all"])
    p.add_argument("--after", help="the cursor a previous page printed")
    p = command("find", _find, "where a message is (exit 4 if nowhere)")
    p.add_argument("queue")
    p.add_argument("id")
    p.add_argument("--deadletter", default=DEADLETTER, help="deadletter queue to look in too")
    p = command("result", _result, "the kept result of a message (exit 4 if none)")
    p.add_argument("queue")
    p.add_argument("id")
    p.add_argument("--wait", type=_seconds, default=0.0, help="seconds to wait for it")
    p = command("push", _push, "push JSON payloads: one argument, or one per line on stdin")
    p.add_argument("queue")
    p.add_argument("payload", nargs="?", help="a JSON payload (default: read stdin)")
    p.add_argument("--delay", type=_seconds, default=0.0)
    p.add_argument("--header", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--id", help="the message id (deduplicated)")
    p.add_argument(
        "--priority", type=int, default=0, help="higher first among ready messages (default 0)"
    )
    p = command("pop", _pop, "take messages, at-most-once (exit 4 if none)")
    p.add_argument("queue")
    p.add_argument("-n", type=_positive, default=1)
    p.add_argument("--timeout", type=_seconds, default=0.0)
    p = command("move", _move, "move messages by id to another queue, tries reset")
    p.add_argument("queue")
    p.add_argument("to")
    p.add_argument("ids", nargs="+")
    p = command("requeue", _requeue, "move deadlettered messages back where they failed")
    p.add_argument("queue", help="the deadletter queue (usually __deadletter__)")
    p.add_argument("ids", nargs="*")
    p.add_argument("--origin", help="every message that failed in this queue (or: send there)")
    p = command("purge", _purge, "remove every message not under an active reservation")
    p.add_argument("queue")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    _add_amend_commands(command)
    command("pause", _pause, "stop deliveries of a queue in every process").add_argument("queue")
    command("resume", _pause, "resume deliveries of a queue").add_argument("queue")
    p = command("history", _history, "consumed messages kept by a history backend")
    p.add_argument("queue")
    p.add_argument("--since", help="ISO 8601 time or epoch seconds")
    p.add_argument("--until", help="ISO 8601 time or epoch seconds")
    p.add_argument("--limit", type=_positive, default=100)
    p.add_argument("--after", help="the cursor a previous page printed")
    p = command("replay", _replay, "push copies of processed messages again")
    p.add_argument("queue")
    p.add_argument("ids", nargs="*")
    p.add_argument("--since")
    p.add_argument("--until")
    p.add_argument("--to", help="the queue to push them into (default: the same)")
    p = command("stats", _stats, "counters and sizes of queues")
    p.add_argument("queues", nargs="*")
    p.add_argument("--watch", type=_interval, help="print again every so many seconds")
    p.add_argument("--count", type=_positive, help="with --watch: stop after so many prints")
    command("pipelines", _pipelines, "stored pipelines: topology and queue sizes")
    command(
        "remove-pipeline",
        _remove_pipeline,
        "forget a stored pipeline's topology (its queues stay), so a changed one can start",
    ).add_argument("pipeline")


def _add_amend_commands(command: Callable[[str, Command, str], argparse.ArgumentParser]) -> None:
    p = command("promote", _amend, "make a scheduled message ready now (exit 4 if not)")
    p.add_argument("queue")
    p.add_argument("id")
    p = command("reschedule", _amend, "make a waiting message mature DELAY seconds from now")
    p.add_argument("queue")
    p.add_argument("id")
    p.add_argument("--delay", type=_seconds, required=True)
    p = command("priority", _amend, "give a waiting message a new priority")
    p.add_argument("queue")
    p.add_argument("id")
    p.add_argument("priority", type=int, help="higher first among ready messages")
    p = command("cancel", _cancel, "remove a waiting message, or stop its running handler")
    p.add_argument("queue")
    p.add_argument("id")
    p.add_argument("--reason", help="kept in its failure result (at most 1,000 characters)")


def run(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    """Run an admin command; returns its exit code."""
    name = f"aio-keuss {args.command}"
    out = Output(args.json, sys.stdout)
    try:
        backend, options = connection_settings(
            {"config": args.config, "backend": args.backend, "url": args.url},
            args.option,
            environ,
        )
    except ConfigError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    finished: list[int] = []

    async def main() -> int:
        async with connect(backend, **options) as factory:
            code: int = await args.run(factory, args, out)
            finished.append(code)
            return code

    try:
        return asyncio.run(main())
    except KeussConnectionError as exc:
        print(f"{name}: cannot reach the backend: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (ConfigError, InvalidInputError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NotSupportedError as exc:
        print(f"{name}: not supported: {exc}", file=sys.stderr)
        return EXIT_NOT_SUPPORTED
    except _NoSuchQueue as exc:
        print(f"{name}: not found: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except KeussError as exc:
        print(f"{name}: failed: {exc!r}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        # asyncio.run raises it once the main task ends, even when the command ran to its
        # end (a purge answered by an end of input): that command's code stands. Else only
        # stats --watch ends this way when all went well; another command was cut short,
        # and nothing is known about what it did.
        if finished:
            return finished[0]
        watching = args.command == "stats" and args.watch is not None
        return EXIT_OK if watching else EXIT_FAILED
