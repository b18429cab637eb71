"""Fixtures for the discovery tests: the Kubernetes API stand-in, a loopback DNS server, small workers,
a real WorkerRegistry as the sink."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from kvroute.config import WorkerConfig
from kvroute.router.metrics import RouterMetrics
from kvroute.router.registry import WorkerRegistry
from kvroute.router.transport import HttpxTransport, Transport

from tests.discovery.dns_server import LoopbackDns
from tests.discovery.kube_apiserver import KubeApiServer


@pytest.fixture(autouse=True)
def _discovery_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.discovery")


@pytest.fixture
async def apiserver() -> AsyncIterator[KubeApiServer]:
    server = KubeApiServer(token="s3cret")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def loopback_dns() -> Iterator[LoopbackDns]:
    with LoopbackDns() as dns:
        yield dns


@pytest.fixture
async def transport() -> AsyncIterator[Transport]:
    t = HttpxTransport(connect_timeout=1.0, read_timeout=5.0)
    yield t
    await t.aclose()


@pytest.fixture
async def registry(transport: Transport) -> AsyncIterator[WorkerRegistry]:
    """A real registry (no background probes: the tests look at membership, adds probe once)."""
    reg = WorkerRegistry([], transport, RouterMetrics(), probe_timeout_s=1.0)
    yield reg
    await reg.stop()


class RecordingSink:
    """A WorkerSink that only records (for the reconciler's rules, where no worker needs to exist)."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerConfig] = {}
        self.log: list[tuple[str, str]] = []
        self.refuse: set[str] = set()

    async def add(self, worker: WorkerConfig) -> None:
        if worker.worker_id in self.refuse:
            raise ValueError(f"refused {worker.worker_id}")
        assert worker.worker_id not in self.workers, f"{worker.worker_id} added twice"
        self.workers[worker.worker_id] = worker
        self.log.append(("add", worker.worker_id))

    async def remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.log.append(("remove", worker_id))


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


def sample(registry: Any, name: str, labels: dict[str, str] | None = None) -> float:
    value = registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else float(value)
