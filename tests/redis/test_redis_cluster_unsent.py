"""``KeussConnectionError.ran_nothing`` through redis-py's cluster client: a command cut
after the node ran it must not say it ran nothing, whatever redis-py does next. Releases
of redis-py before 6.0 retry a command at the cluster level (``cluster_error_retry_attempts``,
3 by default) whatever ``retry`` says; the retry after a node was stopped fails to connect,
and that last error was taken for a command never sent (a stop's put-back retried on it
would store its messages twice).

The cluster is the test's own (three primaries, no replicas, a node timeout long enough
that no failover happens during the test); the shared one is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
from own_servers import OwnRedis, free_port, release_port
from test_redis_unsent import DEADLINE, _blocked

from aio_keuss.consumer import refused
from aio_keuss.errors import KeussConnectionError
from aio_keuss.redis.list import RedisListBackend

pytestmark = pytest.mark.timeout(180)


def _cluster_ok(port: int) -> bool:
    info = redis.Redis(port=port).execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


@contextlib.contextmanager
def _own_cluster() -> Iterator[list[OwnRedis]]:
    """Three primaries of the test's own, every slot served."""
    buses = [free_port() for _ in range(3)]  # its own: port + 10000 may pass 65535
    servers = [
        OwnRedis(
            "--cluster-enabled", "yes", "--cluster-port", str(bus),
            "--cluster-node-timeout", "120000",
        )
        for bus in buses
    ]  # fmt: skip
    try:
        for server in servers:
            server.start()
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in servers),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + DEADLINE
        while not all(_cluster_ok(s.port) for s in servers):
            assert time.monotonic() < deadline, "the cluster never reached cluster_state:ok"
            time.sleep(0.1)
        yield servers
    finally:
        for server in servers:
            server.cleanup()
        for bus in buses:
            release_port(bus)


def _key_served_by(port: int) -> str:
    """A key of a slot the node at ``port`` serves (it answers rather than redirects)."""
    node = redis.Redis(port=port)
    for i in range(10_000):
        key = f"rnc:k{i}"
        try:
            node.execute_command("EXISTS", key)
        except redis.exceptions.ResponseError:  # MOVED: another node's slot
            continue
        return key
    raise AssertionError("no key of the node's slots")


async def test_a_cluster_command_cut_after_it_ran_did_not_run_nothing() -> None:
    """A BLPOP the node runs when it stops (on another node than the URL's, so that the
    topology is loaded again from the others, which still name the stopped one): its reply
    is lost, it did run."""
    with _own_cluster() as servers:
        stopped = servers[1]
        key = _key_served_by(stopped.port)
        backend = RedisListBackend({"url": servers[0].url, "prefix": "rnc", "cluster": True})
        try:
            waiting = asyncio.ensure_future(backend.execute("BLPOP", key, 0))
            await _blocked(stopped.port)
            await asyncio.to_thread(stopped.stop)
            with pytest.raises(KeussConnectionError) as sent:
                await asyncio.wait_for(waiting, DEADLINE)
            assert not sent.value.ran_nothing, sent.value
            assert not refused(sent.value), sent.value  # what a put-back is retried on
        finally:
            await backend.close()
