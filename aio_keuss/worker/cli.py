"""``aio-keuss worker module:function --queue jobs ...`` (or ``--pipeline module:build``):
the command line of the worker.

Exit codes: 0 after a clean stop (SIGTERM / SIGINT), 2 for bad settings (an unknown flag, a
bad value, a handler that cannot be imported, a pipeline or its file's stations that cannot,
a repeat the backend cannot run), found before connecting where they can be, 3 when the
backend cannot be reached at start, 1 for anything unexpected, 70 (``EX_SOFTWARE`` of BSD's
sysexits.h) after a stop that abandoned handlers which went on once cancelled (their
messages left reserved). A supervisor can tell "fix the unit file" (2) from "the database
is down" (3), and restart only on the latter, and sees a stop that could not end cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ..dashboard import command as dashboard_command
from ..errors import (
    ConfigError,
    InvalidInputError,
    KeussConnectionError,
    KeussError,
    NotSupportedError,
)
from ..loading import add_connection_flags, import_callable
from . import admin, loop
from .run import abandoned_handlers, left_open, pipeline_source, run_worker
from .settings import REPEAT_FORM, WorkerSettings, connection_settings, option_flags, resolve

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_ABANDONED = 70
"""A stop that abandoned handlers: 0 would tell a supervisor that all ended cleanly."""

log = logging.getLogger("aio_keuss.worker")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aio-keuss",
        description="aio-keuss: queues over the databases you already run.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser(
        "worker",
        help="consume queues with a handler until SIGTERM / SIGINT",
        description=(
            "Consume queues with HANDLER (module:function, imported with the current "
            "directory on the path) until SIGTERM or SIGINT. Every flag can also come from "
            "an AIO_KEUSS_<NAME> environment variable or a TOML file (--config); a flag "
            "beats the environment, which beats the file."
        ),
    )
    add = worker.add_argument
    add("handler", nargs="?", help="module:function called with each message")
    add(
        "--pipeline",
        help="run a pipeline's stations instead: module:attr (a Pipeline, a function of the "
        "factory returning one, or a topology dict) or a .toml file describing it",
    )
    add(
        "--replace-pipeline",
        action=argparse.BooleanOptionalAction,
        help="start --pipeline over another topology stored under its name, storing this one,"
        " instead of refusing to start (for the release that changes the pipeline; default off)",
    )
    add_connection_flags(worker)
    add("--queue", action="append", dest="queues", help="a queue to consume (repeatable)")
    add("--concurrency", help="handlers running at once, per queue (default 1)")
    add("--timeout", help="seconds a handler may run before it is cancelled and ko-ed")
    add("--grace", help="seconds running handlers get to finish on SIGTERM (default 30)")
    add("--prefetch", help="messages reserved ahead of free handlers, per queue (default 0)")
    add(
        "--result-ttl",
        help="seconds the queues keep what the handler returned, for push_and_wait (default 0:"
        " none kept)",
    )
    add("--log-level", help="debug, info (default), warning, error")
    add("--health-port", help="serve GET /healthz and /metrics on this port")
    add("--health-host", help="the address they are served on (default 127.0.0.1)")
    add(
        "--repeat",
        action="append",
        dest="repeats",
        metavar=f"'{REPEAT_FORM}'",
        help="push PAYLOAD_JSON (default null) to QUEUE on a schedule, as repeat KEY (each "
        "occurrence once however many workers run it): SCHEDULE is every=SECONDS, a nickname "
        "such as @daily, or the five fields of a cron expression; ZONE an IANA time zone "
        "(default UTC). Repeatable; with no HANDLER and no --queue the worker only schedules",
    )
    admin.add_commands(commands)
    dashboard_command.add_parser(commands)
    return parser


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    options = option_flags(args.option)
    return {
        "config": args.config,
        "handler": args.handler,
        "pipeline": args.pipeline,
        "replace_pipeline": args.replace_pipeline,
        "backend": args.backend,
        "url": args.url,
        "queues": args.queues,
        "concurrency": args.concurrency,
        "timeout": args.timeout,
        "grace": args.grace,
        "prefetch": args.prefetch,
        "result_ttl": args.result_ttl,
        "log_level": args.log_level,
        "health_port": args.health_port,
        "health_host": args.health_host,
        "repeats": args.repeats,
        "options": options or None,
    }


async def _run(settings: WorkerSettings) -> None:
    pipeline = settings.pipeline
    await run_worker(
        import_callable(settings.handler) if settings.handler else None,
        settings.queues,
        pipeline=pipeline or None,
        replace_pipeline=settings.replace_pipeline,
        repeats=settings.repeats,
        backend=settings.backend,
        concurrency=settings.concurrency,
        timeout=settings.timeout,
        grace=settings.grace,
        prefetch=settings.prefetch,
        queue_options={"result_ttl": settings.result_ttl} if settings.result_ttl else None,
        health_port=settings.health_port,
        health_host=settings.health_host,
        **settings.connect_options(),
    )


def _connection(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(backend, connect options) from the flags, environment and file, as for the worker."""
    flags = {"config": args.config, "backend": args.backend, "url": args.url}
    return connection_settings(flags, args.option)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit code. A worker that abandoned handlers which went on
    after being cancelled ends the process with that code, or ``EXIT_ABANDONED`` for a stop
    that would have exited 0: in its loop (``_serving``), or here for tasks found going on
    only as the loop ended (see ``loop``)."""
    args = _parser().parse_args(argv)
    if args.command == "dashboard":
        return dashboard_command.run(args, _connection)
    if args.command != "worker":
        return admin.run(args)
    try:
        settings = resolve(_flags(args))
        # fail before logging is set up or anything opens (a pipeline file's handler that
        # cannot be imported, too: not a backend down, exit 3, if the backend is down too)
        if settings.pipeline:
            pipeline_source(settings.pipeline)
        elif settings.handler:
            import_callable(settings.handler)
    except ConfigError as exc:
        print(f"aio-keuss worker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    code = _serve(settings)
    loop.exit_if_abandoned(code or EXIT_ABANDONED)
    return code


def _serve(settings: WorkerSettings) -> int:
    """Run the worker; returns the command's exit code. A SIGINT while the worker's signal
    handlers are not in place (before it installs them, or once it removed them as it
    returns, before ``loop.exit_running`` installs its own) is Python's KeyboardInterrupt
    out of the loop: 0, but 70 after a stop that abandoned handlers (recorded before the
    worker removed its handlers), as the command exits then without it."""
    ran: list[asyncio.AbstractEventLoop] = []
    try:
        return loop.run(_serving(settings, ran))  # not asyncio.run: see that module
    except KeyboardInterrupt:
        return EXIT_ABANDONED if ran and abandoned_handlers(ran[0]) else EXIT_OK


async def _serving(settings: WorkerSettings, ran: list[asyncio.AbstractEventLoop]) -> int:
    """Run the worker in the loop (noted in ``ran``); returns the command's exit code, or
    exits the process at once (still in the loop: ``loop.exit_running``) if the worker left
    its connection open for handlers it abandoned, which run on: closing it, or ending the
    loop, would stop the extensions of their reservations while the process lives on."""
    ran.append(asyncio.get_running_loop())
    code = _exit_code(await _outcome(settings))
    if left_open():
        await loop.exit_running(code)
    return code


def _exit_code(outcome: int) -> int:
    """The command's exit code for the worker's ``outcome``, in its loop once it returned:
    ``EXIT_ABANDONED`` for a stop that would have exited 0 but abandoned handlers, whether
    they still run (the connection left open) or ended since."""
    return outcome or (EXIT_ABANDONED if abandoned_handlers() else EXIT_OK)


async def _outcome(settings: WorkerSettings) -> int:
    try:
        await _run(settings)
    except KeussConnectionError as exc:
        log.error("cannot reach the backend at start: %s", exc)
        return EXIT_UNREACHABLE
    except (ConfigError, InvalidInputError, NotSupportedError) as exc:
        # e.g. a prefetch above max_batch, a repeat on a backend without delays
        log.error("%s", exc)
        return EXIT_USAGE
    except KeussError as exc:
        log.error("worker failed: %r", exc)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
