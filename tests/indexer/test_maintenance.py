"""The index's upkeep is the indexer's: purges of gone workers, backend recovery and TTL refresh run from
``KVIndexer.start_maintenance()`` with no subscriber at all; a subscriber only starts it for callers that
did not (and then stops it), and leaves one the indexer's owner started alone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest
import zmq.asyncio
from kvroute.indexer.backend import IndexBackend, IndexOp
from kvroute.indexer.keys import request_keys
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.redis_index import RedisIndex, key_names
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec
from prometheus_client import CollectorRegistry

from tests.conftest import RedisServer

from .fakevllm import Chain, Publisher, eventually, frames

PROMPT = list(range(900, 900 + 16 * 8))


def isolated(backend: IndexBackend) -> tuple[KVIndexer, CollectorRegistry]:
    """An indexer counting on a registry of its own (so the test reads exactly its numbers)."""
    registry = CollectorRegistry()
    return KVIndexer(backend, metrics=IndexerMetrics(registry)), registry


async def blocks(indexer: KVIndexer, worker: str) -> int:
    match = (await indexer.lookup_tokens("m", PROMPT)).matches.get(worker)
    return match.blocks if match else 0


async def test_purges_a_worker_down_past_the_grace_period(backend: IndexBackend) -> None:
    indexer, registry = isolated(backend)
    for worker, seed in (("a", 1), ("b", 2)):
        indexer.register_worker(worker, "m")
        await indexer.handle_message(worker, frames([Chain(seed=seed).store(PROMPT[:64])], 5))
    indexer.mark_down("a")
    indexer.mark_down("b")
    indexer.mark_up("b")  # back before the grace period ended: keeps its blocks
    maintenance = indexer.start_maintenance(grace_s=0.2)
    assert indexer.start_maintenance(grace_s=99) is maintenance  # already running: unchanged
    try:
        await eventually(lambda: _is(blocks(indexer, "a"), 0))
        assert indexer.expected_seq("a") is None  # its next message is a new baseline
        assert indexer.expected_seq("b") == 6
        purged = {"worker": "a", "reason": "worker_gone"}
        assert registry.get_sample_value("kvroute_index_purges_total", purged) == 1
        for _ in range(3):  # a few more rounds: purged once, and b untouched
            await asyncio.sleep(maintenance.interval_s)
        assert registry.get_sample_value("kvroute_index_purges_total", purged) == 1
        assert await blocks(indexer, "b") == 4
    finally:
        await indexer.stop_maintenance()
    assert maintenance.task is None and indexer.maintenance is None


async def test_heals_a_restarted_redis_without_a_subscriber(own_redis: RedisServer) -> None:
    backend = RedisIndex(own_redis.url, timeout_s=0.5)
    indexer, registry = isolated(backend)
    indexer.register_worker("a", "m")
    chain = Chain()
    await indexer.handle_message("a", frames([chain.store(PROMPT[:64])], 0))
    maintenance = indexer.start_maintenance(grace_s=30)
    try:
        own_redis.stop()
        await indexer.handle_message("a", frames([chain.store(PROMPT, start_block=4)], 1))
        assert not indexer.backend_ok
        assert registry.get_sample_value("kvroute_index_backend_up", {"backend": "redis"}) == 0
        own_redis.start()  # empty: no persistence
        await eventually(lambda: indexer.backend_ok, timeout=15)
        assert await blocks(indexer, "a") == 8
        assert registry.get_sample_value("kvroute_index_backend_up", {"backend": "redis"}) == 1
        assert maintenance.running
    finally:
        await indexer.stop_maintenance()
        await backend.close()


async def test_refreshes_ttls_of_long_lived_blocks(redis_url: str) -> None:
    import redis.asyncio as aioredis

    backend = RedisIndex(redis_url, prefix="mttl", ttl_s=100)
    indexer, _ = isolated(backend)
    indexer.register_worker("a", "m")
    await indexer.handle_message("a", frames([Chain().store(PROMPT[:32])], 0))
    name = key_names(b"mttl:{m}:b:", request_keys(PROMPT[:32], 16, "m")[:1])
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.expire(name, 5)
        indexer.start_maintenance(grace_s=30, refresh_s=0.2)

        async def renewed() -> bool:
            return int(await client.ttl(name)) > 90

        await eventually(renewed)
    finally:
        await indexer.stop_maintenance()
        await client.aclose()
        await backend.close()


class FailingOncePurge(MemoryIndex):
    """A purge that fails with an unexpected error once (a bug, not IndexUnavailable)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    async def purge_worker(self, worker_id: str) -> None:
        if not self.failures:
            self.failures += 1
            raise RuntimeError("boom")
        await super().purge_worker(worker_id)


async def test_a_failing_round_does_not_end_the_upkeep(caplog: pytest.LogCaptureFixture) -> None:
    backend = FailingOncePurge()
    indexer, _ = isolated(backend)
    indexer.register_worker("a", "m")
    await indexer.handle_message("a", frames([Chain().store(PROMPT[:64])], 0))
    indexer.mark_down("a")
    caplog.set_level(logging.ERROR, logger="kvroute.indexer")
    maintenance = indexer.start_maintenance(grace_s=0.2)
    try:
        await eventually(lambda: _is(blocks(indexer, "a"), 0))
        assert backend.failures == 1 and maintenance.running
        assert "indexer watchdog failed; retrying" in caplog.text
    finally:
        await indexer.stop_maintenance()


async def test_subscriber_leaves_the_indexers_maintenance_alone(zctx: zmq.asyncio.Context) -> None:
    """The composition root starts the upkeep; the subscriber neither replaces nor stops it, and a worker
    whose stream disconnects is still purged after the indexer's grace period."""
    indexer, _ = isolated(MemoryIndex())
    maintenance = indexer.start_maintenance(grace_s=0.3)
    sub = EventSubscriber(indexer, ctx=zctx, grace_s=99)
    pub: Publisher | None = Publisher(zctx)
    assert pub is not None
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint))
    try:
        await sub.start()
        assert indexer.maintenance is maintenance and maintenance.grace_s == 0.3
        await pub.wait_subscribed()
        await pub.publish([Chain().store(PROMPT)])
        await eventually(lambda: _is(blocks(indexer, "a"), 8))
        await pub.close()  # the engine goes away: the monitor marks it down, the upkeep purges it
        pub = None
        await eventually(lambda: _is(blocks(indexer, "a"), 0))
        await sub.stop()
        assert maintenance.running and indexer.maintenance is maintenance
    finally:
        await sub.stop()
        await indexer.stop_maintenance()
        if pub is not None:
            await pub.close()


async def test_an_arranged_maintenance_is_a_service_the_subscriber_leaves_alone(zctx: zmq.asyncio.Context) -> None:
    """make_maintenance(): what a composition root adds to its app's services; started after the subscriber
    (services start in order), it still is the only upkeep."""
    indexer, _ = isolated(MemoryIndex())
    maintenance = indexer.make_maintenance(grace_s=0.5, refresh_s=60.0)
    assert indexer.maintenance is maintenance and not maintenance.running
    sub = EventSubscriber(indexer, ctx=zctx, grace_s=99)
    await sub.start()
    assert indexer.maintenance is maintenance and not maintenance.running  # not replaced, not started
    await maintenance.start()
    assert maintenance.running
    assert indexer.start_maintenance(grace_s=1.0) is maintenance and maintenance.grace_s == 0.5
    await sub.stop()
    assert maintenance.running
    await maintenance.stop()
    assert not maintenance.running


async def test_subscriber_starts_and_stops_it_for_older_callers(zctx: zmq.asyncio.Context) -> None:
    indexer, _ = isolated(MemoryIndex())
    sub = EventSubscriber(indexer, ctx=zctx, grace_s=0.4, refresh_s=7.0)
    await sub.start()
    maintenance = indexer.maintenance
    assert maintenance is not None and maintenance.running
    assert (maintenance.grace_s, maintenance.refresh_s) == (0.4, 7.0)
    await sub.stop()
    assert not maintenance.running and indexer.maintenance is None
    await sub.start()  # a restarted subscriber starts it again
    assert indexer.maintenance is not None and indexer.maintenance.running
    await sub.stop()
    assert indexer.maintenance is None


class Recording(MemoryIndex):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    async def apply(self, model: str, worker_id: str, ops: Sequence[IndexOp]) -> None:
        self.writes.append(worker_id)
        await super().apply(model, worker_id, ops)


async def test_one_round_in_order() -> None:
    """tick(): purge the gone, then recover a failed backend, then refresh once it is due."""
    backend = Recording()
    indexer, _ = isolated(backend)
    indexer.register_worker("a", "m")
    indexer.register_worker("b", "m")
    await indexer.handle_message("a", frames([Chain(seed=1).store(PROMPT[:32])], 0))
    await indexer.handle_message("b", frames([Chain(seed=2).store(PROMPT[:32])], 0))
    indexer.mark_down("a")
    indexer.mark_backend_down("test")
    indexer.mirror.next_recover = 0.0
    maintenance = indexer.start_maintenance(grace_s=0.0, refresh_s=3600)
    await indexer.stop_maintenance()  # drive the rounds by hand
    backend.writes.clear()
    await maintenance.tick()
    assert indexer.backend_ok
    assert await blocks(indexer, "a") == 0 and await blocks(indexer, "b") == 2
    assert sorted(backend.writes) == ["a", "b"]  # the recovery rewrote both (a empty)
    backend.writes.clear()
    await maintenance.tick()  # healthy, nobody gone, the next refresh an hour away: nothing to write
    assert backend.writes == []
    maintenance._next_refresh = 0.0  # due now
    await maintenance.tick()
    assert backend.writes == ["b"]  # a holds nothing to re-store


async def _is(coro, value) -> bool:  # type: ignore[no-untyped-def]
    return await coro == value
