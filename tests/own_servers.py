"""Private Redis and PostgreSQL servers for tests that stop, restart or kill a server.

The shared servers on 6379 / 5432 are never restarted by a test: a test that needs an outage
starts its own instance here, on a free port, in a temporary directory, and it is stopped and
removed when the test ends. The binaries come from the same Debian packages ``services.sh``
installs (``redis-server``; PostgreSQL's ``initdb`` / ``pg_ctl``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_port(port: int, up: bool, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                reachable = True
        except OSError:
            reachable = False
        if reachable == up:
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not go {'up' if up else 'down'} in {seconds} s")


class OwnRedis:
    """A ``redis-server`` of the test's own; ``stop()`` / ``start()`` make an outage.

    ``extra`` are more ``--option value`` arguments (e.g. persistence for a restart that
    must load data back); ``env`` more environment variables (e.g. a locale).
    """

    def __init__(self, *extra: str, env: dict[str, str] | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="ak-redis-")
        self.extra = extra
        self.env = None if env is None else {**os.environ, **env}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", self.dir,
                "--save", "",
                "--appendonly", "no",
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.env,
        )  # fmt: skip
        _wait_port(self.port, up=True)

    def stop(self, kill: bool = False) -> None:
        if self.process is None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        self.process.wait(timeout=30)
        self.process = None
        _wait_port(self.port, up=False)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(kill=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _postgres_bin(tool: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    return found[-1] if found else shutil.which(tool)


class OwnPostgres:
    """A PostgreSQL cluster of the test's own (``initdb`` in a temporary directory, trust
    authentication, database ``test``); ``stop()`` / ``start()`` make an outage. As root the
    server runs as the ``postgres`` user, since PostgreSQL refuses to run as root."""

    def __init__(self) -> None:
        initdb, self._pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
        if initdb is None or self._pg_ctl is None:
            raise RuntimeError("PostgreSQL's initdb / pg_ctl are not installed")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="ak-pg-")
        self._data = os.path.join(self.dir, "data")
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(initdb, "-D", self._data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
        with open(os.path.join(self._data, "postgresql.conf"), "a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\nfsync = off\n"
            )
        self._running = False

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/test"

    def _run(self, *command: str) -> None:
        if os.geteuid() == 0:
            command = ("runuser", "-u", "postgres", "--", *command)
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        log = os.path.join(self.dir, "log")
        assert self._pg_ctl is not None
        self._run(self._pg_ctl, "-D", self._data, "-l", log, "-w", "-t", "60", "start")
        self._running = True
        psql = _postgres_bin("psql") or "psql"
        command = [psql, "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"]
        created = subprocess.run(
            [*command, "-c", "create database test"], capture_output=True, timeout=60, check=False
        )
        assert created.returncode == 0 or b"already exists" in created.stderr, created.stderr

    def stop(self, mode: str = "fast") -> None:
        if not self._running:
            return
        assert self._pg_ctl is not None
        self._run(self._pg_ctl, "-D", self._data, "-m", mode, "-w", "-t", "60", "stop")
        self._running = False
        _wait_port(self.port, up=False)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(mode="immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def own_redis(*extra: str, env: dict[str, str] | None = None) -> Iterator[OwnRedis]:
    server = OwnRedis(*extra, env=env)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


COLLATING_LOCALES = ("en_US.UTF-8", "en_US.utf8", "de_DE.UTF-8", "de_DE.utf8", "fr_FR.utf8")
"""Locales whose collation is not byte order (case folded first, punctuation ignored)."""


def collating_locale(directory: str) -> dict[str, str] | str:
    """Environment giving a child process a locale that does not collate in byte order:
    an installed one, else en_US.UTF-8 compiled into ``directory`` by glibc's ``localedef``
    from the ``locales`` package's sources (``LOCPATH`` then points the child at it, so
    nothing is installed). A string says why there is none."""
    installed: set[str] = set()
    if shutil.which("locale") is not None:
        listed = subprocess.run(["locale", "-a"], capture_output=True, text=True, check=False)
        installed = set(listed.stdout.split())
    for name in COLLATING_LOCALES:
        if name in installed:
            return {"LC_ALL": name}
    if shutil.which("localedef") is None:
        return f"no collating locale installed ({', '.join(sorted(installed))}) and no localedef"
    made = subprocess.run(
        ["localedef", "-i", "en_US", "-f", "UTF-8", os.path.join(directory, "en_US.UTF-8")],
        capture_output=True,
        text=True,
        check=False,
    )
    if not os.path.isdir(os.path.join(directory, "en_US.UTF-8")):
        return (
            f"no collating locale installed ({', '.join(sorted(installed))}), and localedef"
            f" could not make en_US.UTF-8 (the locales package?): {made.stderr.strip()[-200:]}"
        )
    return {"LOCPATH": directory, "LC_ALL": "en_US.UTF-8"}


@contextlib.contextmanager
def own_postgres() -> Iterator[OwnPostgres]:
    server = OwnPostgres()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


def _nx_command() -> str | None:
    beside = Path(sys.executable).parent / "nx-27017"
    return str(beside) if beside.exists() else shutil.which("nx-27017")


class OwnMongo:
    """An nx-27017 (the MongoDB wire-protocol server the suite uses) of the test's own, with
    its data in memory: ``stop()`` / ``start()`` make an outage, and a restart empties it."""

    def __init__(self) -> None:
        command = _nx_command()
        if command is None:
            raise RuntimeError("nx-27017 is not installed")
        self.command = command
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="ak-mongo-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.command, "--host", "127.0.0.1", "-p", str(self.port), "--db", "memory",
                "--log-file", os.path.join(self.dir, "log"),
                "--pid-file", os.path.join(self.dir, "pid"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_port(self.port, up=True)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)
        self.process = None
        _wait_port(self.port, up=False)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def own_mongo() -> Iterator[OwnMongo]:
    """A private nx-27017; the test is skipped where it is not installed."""
    if _nx_command() is None:
        import pytest

        pytest.skip("nx-27017 is not installed")
    server = OwnMongo()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
