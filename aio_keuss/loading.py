"""Objects named ``module:attr`` in settings, imported as ``python -m`` would find them, and
the TOML files such settings come from.

The worker command and declarative pipelines name handlers this way (as uvicorn names its
application and Celery its tasks), so no code is ever evaluated from a string.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tomllib
from typing import Any

from .errors import ConfigError


def import_object(
    spec: str, what: str = "handler", *, error: type[ConfigError] = ConfigError
) -> Any:
    """The object named ``module:attr`` (``attr`` may be dotted), imported with the current
    directory on the path. ``what`` names it in the error (an ``error``), which says what
    could not be imported."""
    if not isinstance(spec, str):
        raise error(f"{what} must be a 'module:attr' string, not {spec!r}")
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{what} must be module:function, like myapp.jobs:handle, not {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
            raise error(f"{what} {spec!r}: no module named {exc.name!r}") from exc
        raise error(f"{what} {spec!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:  # the module itself raised (a syntax error, a bad setting...)
        raise error(f"{what} {spec!r}: importing {module_name!r} raised {exc!r}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise error(
                f"{what} {spec!r}: {getattr(target, '__name__', target)!r} has no attribute"
                f" {part!r}"
            ) from None
    return target


def read_toml(path: str, what: str, *, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """The tables of a TOML file; ``what`` names the file in the ``error`` raised when it
    cannot be read or parsed."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise error(f"{what} {path!r}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{what} {path!r}: {exc}") from exc


def import_callable(
    spec: str, what: str = "handler", *, error: type[ConfigError] = ConfigError
) -> Any:
    """:func:`import_object`, refusing what cannot be called."""
    target = import_object(spec, what, error=error)
    if not callable(target):
        raise error(f"{what} {spec!r} is not callable: {target!r}")
    return target


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every command of the console script takes to reach a backend (the worker,
    the admin commands, the dashboard), resolved with ``AIO_KEUSS_*`` and a config file."""
    add = parser.add_argument
    add("--backend", help="backend name (default: memory)")
    add("--url", help="the backend's URL")
    add(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend option, e.g. prefix=myapp or schema=jobs (value as JSON when it parses)",
    )
    add("--config", help="a TOML file of settings (top level or [worker])")
