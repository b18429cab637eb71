"""Shared fixtures: a private redis-server on a free port, a private Redis Cluster, free ports, small helpers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.redis_cluster import LocalCluster


#: Test folders whose files share session fixtures too costly to build twice (the real-vLLM tier's servers).
ONE_WORKER_FOLDERS = ("tests/vllm/",)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs the suite on two pytest-xdist workers: each file's tests on one worker (a module's
    fixtures are built once), and the real-vLLM tier's files all on one, where its servers start once for
    the session. Units go out largest first (xdist's default order), so that tier starts at once."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((folder for folder in ONE_WORKER_FOLDERS if path.startswith(folder)), path)

    return FileScheduling(config, log)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_runs(count: int, length: int) -> list[int]:
    """``count`` base ports, each the start of ``length`` consecutive free ports, no two runs overlapping
    (data-parallel ranks bind port + rank: independent free ports can collide with each other's + 1)."""
    held: list[socket.socket] = []
    bases: list[int] = []
    try:
        while len(bases) < count:
            base = free_port()
            run: list[socket.socket] = []
            try:
                for port in range(base, base + length):
                    sock = socket.socket()
                    run.append(sock)
                    sock.bind(("127.0.0.1", port))
            except OSError:
                for sock in run:
                    sock.close()
                continue
            held += run  # kept bound until every run is chosen, so the next cannot overlap it
            bases.append(base)
        return bases
    finally:
        for sock in held:
            sock.close()


class RedisServer:
    """A private redis-server process the tests own (never the machine's shared instance)."""

    def __init__(self) -> None:
        if not shutil.which("redis-server"):
            pytest.fail("redis-server is not installed (make test installs it)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvroute-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()  # a SIGSTOPped server would not act on SIGTERM
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def freeze(self) -> None:
        """SIGSTOP: the kernel still accepts connections and data, the server answers nothing (half-open)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database on the session's private Redis for each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A private 3-master Redis Cluster (tests/redis_cluster.py), started once for the session."""
    from tests.redis_cluster import LocalCluster

    cluster = LocalCluster(masters=3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> str:
    """The session cluster's seed URL, every master flushed for this test."""
    redis_cluster.flushall()
    return redis_cluster.url
