"""``aio-keuss dashboard --backend ... --url ... [--port 8080]``: the dashboard as a command.

This module imports nothing outside the standard library and the core at import time, so
the command line works without the ``dashboard`` extra; aiohttp is imported when the
command runs, and its absence is a usage error naming the extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, InvalidInputError, KeussConnectionError, KeussError
from ..factory import connect
from ..loading import add_connection_flags
from .security import TOKEN_ENV, check_bind

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""The names ``--log-level`` takes, as the worker's: the levels of Python's logging module."""

log = logging.getLogger("aio_keuss.dashboard")


def add_parser(commands: Any) -> None:
    """Add the ``dashboard`` subcommand to the ``aio-keuss`` parser."""
    parser = commands.add_parser(
        "dashboard",
        help="serve a web page to watch and administer the queues of a backend",
        description=(
            "Serve a web page listing the queues of a backend with their sizes, rates and "
            "paused state, their messages (peek), the deadletter queue (requeue) and stored "
            "pipelines. Binds to 127.0.0.1; any other address needs a token (--token or "
            f"{TOKEN_ENV}), which a browser gives once as /?token=..."
        ),
    )
    add_connection_flags(parser)
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    add("--port", type=int, default=8080, help="port (default 8080; 0 takes a free one)")
    add("--token", default=None, help=f"access token (better: the {TOKEN_ENV} variable)")
    add(
        "--deadletter-queue",
        default=None,  # the connection's deadletter option may name it (see Board)
        help="the deadletter queue's name (default: the one the connection's deadletter "
        "option names, else __deadletter__)",
    )
    add("--sample-seconds", type=float, default=5.0, help="seconds between rate samples")
    add("--log-level", default="info", help="debug, info (default), warning, error")


Connection = Callable[[argparse.Namespace], tuple[str, dict[str, Any]]]
"""(backend name, connect options) from the parsed flags: the console script resolves them
with the environment and a config file exactly as for the worker."""


async def _serve(
    args: argparse.Namespace, token: str | None, backend: str, options: dict[str, Any]
) -> None:
    from .server import Dashboard  # needs aiohttp, checked in run()

    async with connect(backend, **options) as factory:
        dashboard = Dashboard(
            factory,
            host=args.host,
            port=args.port,
            token=token,
            deadletter=args.deadletter_queue,
            sample_every=args.sample_seconds,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with dashboard:
            print(f"aio-keuss dashboard: serving {dashboard.url}", flush=True)
            await stop.wait()


def run(args: argparse.Namespace, connection: Connection) -> int:
    """Run the parsed ``dashboard`` command; returns its exit code."""
    token = args.token or os.environ.get(TOKEN_ENV) or None
    try:
        check_bind(args.host, token)
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], not {args.port}")
        if not 0.2 <= args.sample_seconds <= 3600:
            raise ConfigError("--sample-seconds must be in [0.2, 3600]")
        if str(args.log_level).lower() not in LOG_LEVELS:  # else a traceback from logging
            raise ConfigError(
                f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {args.log_level!r}"
            )
        backend, options = connection(args)
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise ConfigError(
                "the dashboard needs aiohttp: pip install 'aio-keuss[dashboard]'"
            ) from None
    except ConfigError as exc:
        print(f"aio-keuss dashboard: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(args, token, backend, options))
    except KeussConnectionError as exc:
        log.error("cannot reach the backend: %s", exc)
        return EXIT_UNREACHABLE
    except (ConfigError, InvalidInputError) as exc:  # e.g. --deadletter-queue 'bad name'
        log.error("%s", exc)
        return EXIT_USAGE
    except (KeussError, OSError) as exc:  # OSError: the port is taken
        log.error("dashboard failed: %r", exc)
        return EXIT_FAILED
    return EXIT_OK
