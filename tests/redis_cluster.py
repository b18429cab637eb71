"""A private, local Redis Cluster the tests own: N masters (and replicas) on free ports in a temp dir.

Built with ``redis-cli --cluster create`` like an operator would; a node can be killed (kill -9) to
exercise failover. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import redis

from tests.conftest import free_port


@dataclass
class ClusterNode:
    """One redis-server process of the cluster."""

    port: int
    bus_port: int
    proc: subprocess.Popen[bytes] | None = None

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, ``cluster-node-timeout`` of ``node_timeout_ms``."""

    masters: int = 3
    replicas: int = 0
    node_timeout_ms: int = 1000
    dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="kvroute-cluster-"))
    nodes: list[ClusterNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A seed node URL (the first master): the client discovers the others."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self) -> None:
        """Start the nodes, join them into a cluster, wait until it is ok (all stopped again on failure)."""
        for tool in ("redis-server", "redis-cli"):
            if not shutil.which(tool):
                pytest.fail(f"{tool} is not installed (make test installs it)")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        used: set[int] = set()
        for _ in range(self.masters * (1 + self.replicas)):
            port, bus = _two_free_ports(used)
            node = ClusterNode(port, bus)
            node.proc = subprocess.Popen(
                [
                    "redis-server",
                    "--port", str(port),
                    "--cluster-port", str(bus),
                    "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    "--cluster-replica-validity-factor", "0",  # any replica may take over (a test's data is fresh)
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", self.dir,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            self.nodes.append(node)
        for node in self.nodes:
            _wait(lambda n=node: _pings(n), 10, f"redis node {node.port} to start")
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
        _wait(self.healthy, 30, "the cluster to be ok on every node")

    def healthy(self) -> bool:
        """Every live node says cluster_state:ok and every live replica is in sync with its master."""
        for node in self.nodes:
            if not node.alive():
                continue
            try:
                with node.client() as c:
                    if c.cluster("INFO")["cluster_state"] != "ok":
                        return False
                    info = c.info("replication")
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        return False
            except redis.RedisError:
                return False
        return True

    def keyslot(self, key: str | bytes) -> int:
        with self.live()[0].client() as c:
            return int(c.cluster("KEYSLOT", key))

    def owner(self, key: str | bytes) -> ClusterNode:
        """The master serving ``key``'s slot, as a live node sees it."""
        return self.owner_of_slot(self.keyslot(key))

    def by_port(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive()]

    def masters_now(self) -> list[ClusterNode]:
        out = []
        for node in self.live():
            with node.client() as c:
                if c.info("replication")["role"] == "master":
                    out.append(node)
        return out

    def flushall(self) -> None:
        for node in self.masters_now():
            with node.client() as c:
                c.flushall()

    def start_migration(self, slot: int, source: ClusterNode, target: ClusterNode) -> None:
        """Mark ``slot`` as moving from ``source`` to ``target`` (keys then move with :meth:`migrate_keys`)."""
        with source.client() as src, target.client() as dst:
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", _node_id(src))
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", _node_id(dst))

    def migrate_keys(self, source: ClusterNode, target: ClusterNode, keys: list[bytes]) -> None:
        with source.client() as src:
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)

    def finish_migration(self, slot: int, source: ClusterNode, target: ClusterNode) -> None:
        """Move the slot's remaining keys, then give the slot to ``target`` on every master (as
        ``redis-cli --cluster reshard`` does)."""
        with source.client() as src:
            for _ in range(10_000):  # bounded: 100 keys a round
                # Split command name: redis-py's "CLUSTER GETKEYSINSLOT" reply callback decodes (binary) names.
                keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
                if not keys:
                    break
                self.migrate_keys(source, target, keys)
        with target.client() as dst:
            target_id = _node_id(dst)
        for node in [target, source, *(n for n in self.masters_now() if n not in (target, source))]:
            with node.client() as c:
                c.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        _wait(lambda: self.owner_of_slot(slot) is target, 10, f"slot {slot} to move")

    def owner_of_slot(self, slot: int) -> ClusterNode:
        with self.live()[0].client() as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):  # raw reply, no callback
                if start <= slot <= end:
                    return self.by_port(int(master[1]))
        raise AssertionError(f"slot {slot} is not served")

    def kill(self, node: ClusterNode) -> None:
        """kill -9: no goodbye to the cluster, connections reset."""
        assert node.proc is not None
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=10)

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive():
                assert node.proc is not None
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(timeout=10)
                if node.proc.poll() is None:
                    node.proc.kill()
                    node.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _two_free_ports(used: set[int]) -> tuple[int, int]:
    ports = []
    while len(ports) < 2:
        port = free_port()
        if port not in used:
            used.add(port)
            ports.append(port)
    return ports[0], ports[1]


def _pings(node: ClusterNode) -> bool:
    try:
        with node.client(0.2) as c:
            return bool(c.ping())
    except redis.RedisError:
        return False


def _node_id(client: redis.Redis) -> str:
    value = client.execute_command("CLUSTER MYID")
    return value.decode() if isinstance(value, bytes) else str(value)


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)
