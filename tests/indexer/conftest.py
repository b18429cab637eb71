"""Fixtures of the indexer tests: each backend (memory, Redis on the private server, Redis Cluster), an indexer,
a Redis of the test's own (to stop and start), a ZMQ context."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator

import pytest
import zmq.asyncio
from kvroute.indexer.backend import IndexBackend
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.redis_index import RedisIndex
from kvroute.indexer.service import KVIndexer

from tests.conftest import RedisServer


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[IndexBackend]:
    if request.param == "memory":
        yield MemoryIndex()
        return
    cluster = request.param == "redis-cluster"
    url = request.getfixturevalue("cluster_url" if cluster else "redis_url")
    index = RedisIndex(url, prefix="t", cluster=cluster)
    yield index
    await index.close()


@pytest.fixture
async def indexer(backend: IndexBackend) -> KVIndexer:
    idx = KVIndexer(backend)
    idx.register_worker("a", "m")
    idx.register_worker("b", "m")
    return idx


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis this test may stop and start (not the session's shared one)."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)
