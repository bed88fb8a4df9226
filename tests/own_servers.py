"""Private Redis and PostgreSQL servers for tests that stop, restart or kill a server.

The shared servers on 6379 / 5432 are never restarted by a test: a test that needs an outage
starts its own instance here, on a free port, in a temporary directory, and it is stopped and
removed when the test ends. The binaries come from the same Debian packages ``services.sh``
installs (``redis-server``; PostgreSQL's ``initdb`` / ``pg_ctl``).
"""

from __future__ import annotations

import contextlib
import fcntl
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

_PORT_LOCKS = Path(tempfile.gettempdir()) / "aio-keuss-ports"
_reserved: dict[int, int] = {}
"""The ports this process holds, to the descriptor of the lock file that reserves each."""


def _port_pool() -> range:
    """Ports outside the kernel's ephemeral range (Linux's ``ip_local_port_range``), so no
    ``bind(("", 0))`` nor outgoing connection of any process is handed one of them."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low, high = (int(part) for part in text.split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default; IANA's dynamic range starts at 49152
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    if low - 10000 >= 1000:
        return range(10000, low)
    return range(1024, 65536)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ... under pytest-xdist
    return int(worker[2:]) if worker[2:].isdigit() else 0


_next: list[int] = []
"""Where this process's search for a port resumes."""


def free_port() -> int:
    """A port nothing listens on, reserved for this process until :func:`release_port` (or
    its exit), for a server a test starts or an address it wants unanswered.

    A port that was only free when asked (``bind`` to port 0, then close) could be taken by
    another pytest-xdist worker before the server bound it; that server then failed to start
    while the test talked to the other one. Here each port is reserved by an exclusive
    ``flock`` on a file named after it, which every test process on the machine (any worker,
    any checkout) takes before using a port and the kernel releases when the process ends; the
    ports come from outside the ephemeral range, and each worker starts its search in a part
    of the pool of its own."""
    pool = _port_pool()
    if not _next:
        _next.append(pool.start + _worker_index() * len(pool) // 16 % len(pool))
    if not _PORT_LOCKS.is_dir():
        _PORT_LOCKS.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # shared by every user's runs, as /tmp is
            _PORT_LOCKS.chmod(0o1777)
    for _ in range(len(pool)):
        port = _next[0]
        _next[0] = port + 1 if port + 1 < pool.stop else pool.start
        if port in _reserved:
            continue
        try:  # read-only: flock needs no more, and another user's file opens so
            fd = os.open(_PORT_LOCKS / str(port), os.O_CREAT | os.O_RDONLY, 0o644)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if _bindable(port):
            _reserved[port] = fd
            return port
        os.close(fd)  # also releases the lock
    raise RuntimeError(f"no free port in {pool.start}-{pool.stop - 1}")


def release_port(port: int) -> None:
    """Give back a port :func:`free_port` reserved (the lock file stays: removing it would
    let two processes lock two different files of the same name)."""
    fd = _reserved.pop(port, None)
    if fd is not None:
        os.close(fd)


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


def _listener_inodes(port: int) -> set[str] | None:
    """The inodes of the sockets listening on 127.0.0.1:``port`` (``/proc/net/tcp``, see
    proc(5)); None where there is no such file."""
    try:
        table = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    local = f"0100007F:{port:04X}"
    return {f[9] for f in (line.split() for line in table) if f[1] == local and f[3] == "0A"}


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on 127.0.0.1:``port``: the port
    answering is not enough, since it may be another program's."""
    inodes = _listener_inodes(port)
    if inodes is None:  # no procfs: the port answering is all there is to go by
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return True
        return False
    sockets = {f"socket:[{inode}]" for inode in inodes}
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in sockets:
                    return True
    return False


class PortTaken(Exception):
    """The server could not bind its port: another program listens there."""


def _wait_listening(process: subprocess.Popen[bytes], port: int, log: str) -> None:
    """Wait until ``process`` listens on ``port``; PortTaken if it exited because the port
    was taken (its log says ``Address already in use``), RuntimeError if it exited else."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if _listens(process.pid, port):
            return
        if process.poll() is not None:
            said = Path(log).read_text(errors="replace")
            if "already in use" in said.lower():
                raise PortTaken(port)
            raise RuntimeError(f"the server exited with code {process.returncode}: {said[-800:]}")
        time.sleep(0.05)
    raise TimeoutError(f"the server did not listen on port {port} in 60 s")


_ATTEMPTS = 5


class _OwnServer:
    """What the servers of a test's own share: the first start moves to another port if a
    program outside the suite took this one; a restart (whose clients know the port) fails
    then. A server class gives ``port`` and ``_start`` (raising PortTaken), and
    ``_set_port`` when its settings name the port."""

    port: int
    _started: bool = False

    def start(self) -> None:
        """Start the server (see the class)."""
        for attempt in range(_ATTEMPTS):
            try:
                self._start()
            except PortTaken:
                if self._started or attempt == _ATTEMPTS - 1:
                    raise
                release_port(self.port)
                self.port = free_port()
                self._set_port()
            else:
                self._started = True
                return

    def _start(self) -> None:
        raise NotImplementedError

    def _set_port(self) -> None:
        """Settings naming the port made again after it moved (none by default)."""


"""Ports a server tries before its start fails (each taken by a program outside the suite)."""


class OwnRedis(_OwnServer):
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
        self._started = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _start(self) -> None:
        log = os.path.join(self.dir, "output")
        with open(log, "wb") as output:
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
                stdout=output,
                stderr=subprocess.STDOUT,
                env=self.env,
            )  # fmt: skip
        try:
            _wait_listening(self.process, self.port, log)
        except BaseException:
            self.stop(kill=True)
            raise

    def stop(self, kill: bool = False) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is not None:
            return  # exited on its own: it never listened, or is gone already
        if kill:
            process.kill()
        else:
            process.terminate()
        process.wait(timeout=30)
        _wait_port(self.port, up=False)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(kill=True)
        release_port(self.port)
        shutil.rmtree(self.dir, ignore_errors=True)


def _postgres_bin(tool: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    return found[-1] if found else shutil.which(tool)


class OwnPostgres(_OwnServer):
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
                f"listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\nfsync = off\n"
            )
        self._set_port()
        self._running = False
        self._started = False

    def _set_port(self) -> None:
        """The port setting; a later line of postgresql.conf overrides an earlier one."""
        with open(os.path.join(self._data, "postgresql.conf"), "a") as conf:
            conf.write(f"port = {self.port}\n")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/test"

    def _run(self, *command: str) -> None:
        if os.geteuid() == 0:
            command = ("runuser", "-u", "postgres", "--", *command)
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def _start(self) -> None:
        log = os.path.join(self.dir, "log")
        with contextlib.suppress(FileNotFoundError):
            os.remove(log)  # pg_ctl appends: an earlier start's complaint is not this one's
        assert self._pg_ctl is not None
        try:
            self._run(self._pg_ctl, "-D", self._data, "-l", log, "-w", "-t", "60", "start")
        except subprocess.CalledProcessError:
            said = Path(log).read_text(errors="replace") if os.path.exists(log) else ""
            if "already in use" in said.lower():
                raise PortTaken(self.port) from None
            raise
        self._running = True
        # pg_ctl -w waited for this data directory's postmaster to be ready, which it is
        # only once it listens: the port is its (checked all the same, as for the others).
        postmaster = Path(self._data, "postmaster.pid").read_text().split("\n", 1)[0]
        if not _listens(int(postmaster), self.port):
            raise RuntimeError(f"postmaster {postmaster} does not listen on port {self.port}")
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
        release_port(self.port)
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


class OwnMongo(_OwnServer):
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
        self._started = False

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}"

    def _start(self) -> None:
        log = os.path.join(self.dir, "output")
        with open(log, "wb") as output:
            self.process = subprocess.Popen(
                [
                    self.command, "--host", "127.0.0.1", "-p", str(self.port), "--db", "memory",
                    "--log-file", os.path.join(self.dir, "log"),
                    "--pid-file", os.path.join(self.dir, "pid"),
                ],
                stdout=output,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            _wait_listening(self.process, self.port, log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is not None:
            return  # exited on its own: it never listened, or is gone already
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
        _wait_port(self.port, up=False)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        release_port(self.port)
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
