"""The Redis index on a real local Redis Cluster: models spread over the masters, a second replica reads
them, stats and purges span every node, and a model's slot moving (ASK, then MOVED) is followed."""

from __future__ import annotations

import asyncio

import pytest
from kvroute.apps.build import make_backend
from kvroute.config import IndexConfig, RouterConfig
from kvroute.indexer.backend import IndexUnavailable
from kvroute.indexer.keys import request_keys
from kvroute.indexer.redis_index import RedisIndex, key_names
from kvroute.indexer.service import KVIndexer
from pydantic import ValidationError

from tests.conftest import free_port
from tests.redis_cluster import ClusterNode, LocalCluster

from .fakevllm import Chain, frames

PROMPT = list(range(300, 300 + 16 * 8))


def models_on_distinct_masters(cluster: LocalCluster, n: int = 3) -> list[str]:
    """Model names whose hash tags land on ``n`` different masters."""
    by_owner: dict[int, str] = {}
    for i in range(500):
        model = f"model-{i}"
        by_owner.setdefault(cluster.owner(f"kvr:{{{model}}}:owners").port, model)
        if len(by_owner) == n:
            return list(by_owner.values())
    raise AssertionError("no models on distinct masters")


def keys_in_slot(node: ClusterNode, slot: int) -> int:
    with node.client() as c:
        return int(c.execute_command("CLUSTER COUNTKEYSINSLOT", slot))


async def test_models_spread_over_masters_and_a_second_replica_reads_them(
    redis_cluster: LocalCluster, cluster_url: str
) -> None:
    models = models_on_distinct_masters(redis_cluster)
    writer = KVIndexer(RedisIndex(cluster_url, cluster=True))
    # A second router replica, seeded from another node: it must find the whole cluster by itself.
    reader = KVIndexer(RedisIndex(f"redis://127.0.0.1:{redis_cluster.nodes[-1].port}", cluster=True))
    try:
        for i, model in enumerate(models):
            writer.register_worker(f"w{i}", model)
        chain = Chain()
        async with writer.batched():  # one flush: a pipeline whose writes go to three masters
            for i in range(len(models)):
                await writer.handle_message(f"w{i}", frames([chain.store(PROMPT[: 16 * (i + 2)])], 0))
        assert writer.backend_ok

        masters = redis_cluster.masters_now()
        for model in models:
            slot = redis_cluster.keyslot(f"kvr:{{{model}}}:owners")
            owner = redis_cluster.owner_of_slot(slot)
            # Every key of the model (block values included) sits on its slot's master, none elsewhere.
            assert keys_in_slot(owner, slot) >= 5
            assert all(keys_in_slot(other, slot) == 0 for other in masters if other is not owner)
        assert len({redis_cluster.owner(f"kvr:{{{m}}}:owners").port for m in models}) == 3

        for i, model in enumerate(models):
            result = await reader.lookup_tokens(model, PROMPT)
            assert result.block_size == 16
            assert {w: m.blocks for w, m in result.matches.items()} == {f"w{i}": i + 2}

        stats = await reader.stats()
        assert sorted((w["id"], w["blocks"], w.get("source")) for w in stats["workers"]) == [
            ("w0", 2, "backend"),
            ("w1", 3, "backend"),
            ("w2", 4, "backend"),
        ]
        # A purge from the replica that does not follow the worker reaches the worker's model's master.
        await reader.purge_worker("w1")
        assert (await reader.lookup_tokens(models[1], PROMPT)).matches == {}
        assert (await writer.lookup_tokens(models[2], PROMPT)).matches["w2"].blocks == 4
    finally:
        await writer.backend.close()
        await reader.backend.close()


async def test_follows_ask_and_moved_while_a_model_slot_moves(redis_cluster: LocalCluster, cluster_url: str) -> None:
    model, other_model = models_on_distinct_masters(redis_cluster, 2)
    backend = RedisIndex(cluster_url, cluster=True, timeout_s=1.0)
    indexer = KVIndexer(backend)
    indexer.register_worker("a", model)
    indexer.register_worker("b", other_model)
    chain = Chain()
    await indexer.handle_message("a", frames([chain.store(PROMPT[:64])], 0))
    assert (await indexer.lookup_tokens(model, PROMPT)).matches["a"].blocks == 4

    slot = redis_cluster.keyslot(f"kvr:{{{model}}}:owners")
    source = redis_cluster.owner_of_slot(slot)
    target = next(n for n in redis_cluster.masters_now() if n is not source)
    first = request_keys(PROMPT[:16], 16, model)[0]
    redis_cluster.start_migration(slot, source, target)
    try:
        # The first block's key moves ahead of the others: the source answers ASK for it.
        redis_cluster.migrate_keys(source, target, [key_names(f"kvr:{{{model}}}:b:".encode(), [first])])
        assert await backend.block_workers(model, first) == {"a": 1}
        # A lookup script cannot reach keys split over two nodes: a clear IndexUnavailable, never a crash.
        with pytest.raises(IndexUnavailable):
            await backend.lookup(model, request_keys(PROMPT, 16, model))
    finally:
        redis_cluster.finish_migration(slot, source, target)
    owners_key = f"kvr:{{{model}}}:owners"
    # The client still maps the slot to the source: its next calls meet MOVED and follow it.
    assert backend.redis.get_node_from_key(owners_key).port == source.port  # type: ignore[union-attr]
    assert (await indexer.lookup_tokens(model, PROMPT)).matches["a"].blocks == 4
    assert backend.redis.get_node_from_key(owners_key).port == target.port  # type: ignore[union-attr]
    async with indexer.batched():  # a pipeline over both models, after the move
        await indexer.handle_message("a", frames([chain.store(PROMPT, start_block=4)], 1))
        await indexer.handle_message("b", frames([chain.store(PROMPT[:32])], 0))
    assert indexer.backend_ok
    assert (await indexer.lookup_tokens(model, PROMPT)).matches["a"].blocks == 8
    assert (await indexer.lookup_tokens(other_model, PROMPT)).matches["b"].blocks == 2
    assert keys_in_slot(target, slot) >= 9 and keys_in_slot(source, slot) == 0
    await backend.close()


async def test_a_client_reset_under_concurrent_lookups_costs_only_lookups(cluster_url: str) -> None:
    """redis-py closes a cluster client's connections itself (on CLUSTERDOWN, during a failover) while other
    commands may be connecting; those fail with whatever the half-closed connection raises (an
    AttributeError, first seen in the failover test). Each must be an IndexUnavailable, never a crash."""
    backend = RedisIndex(cluster_url, cluster=True, timeout_s=1.0)
    failed = 0
    for round_ in range(20):
        assert await backend.lookup("m", [1, 2, 3]) == {}  # connected, slot map read
        lookups = [asyncio.create_task(backend.lookup("m", [1, 2, 3])) for _ in range(40)]
        for _ in range(round_ % 5):  # close at different points of the connections' handshakes
            await asyncio.sleep(0)
        await backend.redis.aclose()
        for outcome in await asyncio.gather(*lookups, return_exceptions=True):
            assert outcome == {} or isinstance(outcome, IndexUnavailable), repr(outcome)
            failed += isinstance(outcome, IndexUnavailable)
    assert failed  # the resets did hit calls in flight
    await backend.close()


async def test_an_unreachable_cluster_is_index_unavailable() -> None:
    backend = RedisIndex(f"redis://127.0.0.1:{free_port()}", cluster=True, timeout_s=0.3)
    with pytest.raises(IndexUnavailable):
        await backend.lookup("m", [1, 2, 3])
    with pytest.raises(IndexUnavailable):
        await backend.worker_stats()
    assert not await backend.ping()
    await backend.close()


async def test_cluster_settings_are_checked_at_load() -> None:
    with pytest.raises(ValidationError, match="database 0 only"):
        IndexConfig(backend="redis", redis_cluster=True, redis_url="redis://cache:6379/3")
    with pytest.raises(ValidationError, match=r"redis://host:port"):
        IndexConfig(backend="redis", redis_cluster=True, redis_url="unix:///run/redis.sock")
    with pytest.raises(ValidationError, match="no braces"):
        IndexConfig(backend="redis", redis_cluster=True, redis_url="redis://cache:6379", redis_prefix="k{v}r")
    assert IndexConfig(backend="redis", redis_url="redis://cache:6379/3").redis_cluster is False
    config = RouterConfig.model_validate(
        {"index": {"backend": "redis", "redis_url": "rediss://cache:7000/0", "redis_cluster": True}}
    )
    backend = make_backend(config)
    assert isinstance(backend, RedisIndex) and backend.cluster
    await backend.close()
