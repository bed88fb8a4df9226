"""The MongoDB server of the test suite.

``AK_MONGO_URL`` points at a real mongod when set (the tests that need one, e.g. the capped
signal transport or transactions, run only then). Otherwise the suite uses whatever listens
on 127.0.0.1:27017, and when nothing does it starts ``nx-27017`` (a SQLite-backed server
speaking the MongoDB wire protocol, installed by the ``mongo`` test extra) once per session
and stops it when the interpreter exits. ``AK_NX_PORT`` moves that port (27017 by default), so
test runs in parallel checkouts each have a server of their own that no other run stops.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REAL_MONGO_URL = os.environ.get("AK_MONGO_URL")
HOST, PORT = "127.0.0.1", int(os.environ.get("AK_NX_PORT", "27017"))
MONGO_URL = REAL_MONGO_URL or f"mongodb://{HOST}:{PORT}"

_started: subprocess.Popen[bytes] | None = None


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _executable() -> str | None:
    beside = Path(sys.executable).parent / "nx-27017"
    if beside.exists():
        return str(beside)
    return shutil.which("nx-27017")


def _stop() -> None:
    if _started is not None and _started.poll() is None:
        _started.terminate()
        try:
            _started.wait(5)
        except subprocess.TimeoutExpired:
            _started.kill()


def start_mongo() -> str | None:
    """Make sure a server answers at MONGO_URL; returns a skip reason or None."""
    global _started
    if REAL_MONGO_URL is not None:
        return None  # the user's server: the tests report if it is unreachable
    if _port_open(HOST, PORT):
        return None
    command = _executable()
    if command is None:
        return f"no MongoDB on {HOST}:{PORT} and nx-27017 is not installed"
    logs = Path(tempfile.gettempdir()) / f"aio-keuss-nx-27017-{os.getpid()}"
    log = open(f"{logs}.log", "wb")  # noqa: SIM115 - owned by the server process
    _started = subprocess.Popen(
        [
            command,
            "--host", HOST,
            "-p", str(PORT),
            "--db", "memory",
            "--log-file", f"{logs}.server.log",
            "--pid-file", f"{logs}.pid",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    atexit.register(_stop)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if _port_open(HOST, PORT):
            return None
        if _started.poll() is not None:
            return f"nx-27017 exited with code {_started.returncode} (see {logs}.log)"
        time.sleep(0.05)
    return f"nx-27017 did not open port {PORT} within 15 s"
