"""Redis going away in the middle of a run: lookups fail clearly, ingestion goes on, the index heals."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import zmq.asyncio
from kvroute.indexer.backend import IndexUnavailable
from kvroute.indexer.redis_index import RedisIndex
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec
from prometheus_client import REGISTRY

from tests.conftest import RedisServer

from .fakevllm import Chain, Publisher, eventually

PROMPT = list(range(300, 300 + 16 * 8))


# This test once hung under CI load after the index had healed: sub.stop() cancelled the worker loop in the
# loop iteration where its Redis write had just been sent, Python 3.11's asyncio.wait_for (redis-py's send
# path) dropped the cancel, and the loop went back to waiting for ZMQ messages while stop() awaited it.
# Reproduced deterministically by test_stop_in_the_iteration_a_redis_command_was_sent below; fixed in
# kvroute.tasks. The bound stays so that any new hang fails with a traceback.
async def test_redis_restart_mid_run(own_redis: RedisServer, zctx: zmq.asyncio.Context) -> None:
    async with asyncio.timeout(90):
        await _redis_restart_mid_run(own_redis, zctx)


async def _redis_restart_mid_run(own_redis: RedisServer, zctx: zmq.asyncio.Context) -> None:
    backend = RedisIndex(own_redis.url, timeout_s=0.5)
    indexer = KVIndexer(backend)
    sub = EventSubscriber(indexer, ctx=zctx, grace_s=30)
    pub = Publisher(zctx)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await sub.start()
    chain = Chain()

    async def blocks() -> int:
        result = await indexer.lookup_tokens("m", PROMPT)
        return result.matches["a"].blocks if "a" in result.matches else 0

    try:
        await pub.wait_subscribed()
        await pub.publish([chain.store(PROMPT[:64])])
        await eventually(lambda: _is(blocks(), 4))

        own_redis.stop()
        with pytest.raises(IndexUnavailable):
            await indexer.lookup_tokens("m", PROMPT)
        # Events keep flowing while Redis is down; the subscriber keeps the local view exact.
        await pub.publish([chain.store(PROMPT, start_block=4)])
        await pub.publish([chain.remove(PROMPT, [7])])

        async def caught_up() -> bool:
            return indexer.expected_seq("a") == 3

        await eventually(caught_up)
        assert not indexer.backend_ok
        assert REGISTRY.get_sample_value("kvroute_index_backend_up", {"backend": "redis"}) == 0
        stats = await indexer.stats()
        assert stats["backend_ok"] is False

        # Redis returns empty (no persistence): the watchdog rewrites every worker from its local view.
        own_redis.start()
        await eventually(lambda: indexer.backend_ok, timeout=15)
        assert await blocks() == 7
        await pub.publish([chain.remove(PROMPT, [3])])
        await eventually(lambda: _is(blocks(), 3))
    finally:
        await sub.stop()
        await pub.close()
        await backend.close()


async def _is(coro, value) -> bool:  # type: ignore[no-untyped-def]
    return await coro == value


async def test_unreachable_redis_raises_index_unavailable() -> None:
    from tests.conftest import free_port

    backend = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.3)
    indexer = KVIndexer(backend, block_sizes={"m": 16})
    indexer.register_worker("a", "m")
    with pytest.raises(IndexUnavailable):
        await indexer.lookup_tokens("m", PROMPT)
    assert not await backend.ping()
    # Stats still answer (from the local view) and say the backend is down.
    stats = await indexer.stats()
    assert stats["backend_ok"] is False
    await backend.close()


async def test_reader_replica_learns_block_size_from_the_writer(redis_url: str) -> None:
    """A router replica reading a shared index never sees events: the writer publishes block sizes."""
    writer = KVIndexer(RedisIndex(redis_url, prefix="shared"))
    writer.register_worker("a", "m")
    reader = KVIndexer(RedisIndex(redis_url, prefix="shared"))
    assert (await reader.lookup_tokens("m", PROMPT)).block_size is None
    from .fakevllm import frames

    await writer.handle_message("a", frames([Chain().store(PROMPT[:64])], 0))
    reader.model_info("m").next_ask = 0.0  # do not wait for the 5 s re-ask interval
    result = await reader.lookup_tokens("m", PROMPT)
    assert result.block_size == 16 and result.matches["a"].blocks == 4
    stats = await reader.stats()
    assert [(w["id"], w["blocks"], w.get("source")) for w in stats["workers"]] == [("a", 4, "backend")]
    await writer.backend.close()
    await reader.backend.close()


async def test_ttl_safety_net_and_refresh(redis_url: str) -> None:
    """Stored blocks carry the TTL; a refresh renews it; a block nobody holds any more is deleted."""
    import redis.asyncio as aioredis
    from kvroute.indexer.keys import request_keys
    from kvroute.indexer.redis_index import key_names

    from .fakevllm import frames

    backend = RedisIndex(redis_url, prefix="ttl", ttl_s=100)
    indexer = KVIndexer(backend)
    indexer.register_worker("a", "m")
    chain = Chain()
    await indexer.handle_message("a", frames([chain.store(PROMPT[:32])], 0))
    prefix = b"ttl:{m}:b:"
    names = [key_names(prefix, [k]) for k in request_keys(PROMPT[:32], 16, "m")]
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert 90 < await client.ttl(names[0]) <= 100
        await client.expire(names[0], 5)
        await indexer.refresh()
        assert await client.ttl(names[0]) > 90
        await indexer.handle_message("a", frames([chain.remove(PROMPT, [1])], 1))
        assert await client.exists(names[1]) == 0 and await client.exists(names[0]) == 1
    finally:
        await client.aclose()
        await backend.close()


async def test_stop_in_the_iteration_a_redis_command_was_sent(
    redis_url: str, zctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restart test's hang, made deterministic: stop() starts in the loop iteration where redis-py has
    just written the worker's command. On Python 3.11 wait_for then returns the command's result and drops
    stop()'s cancel; the worker loop must still end, and stop() return."""
    import redis.asyncio.connection as rconn

    send = getattr(rconn.Connection, "_send_packed_command", None)
    if send is None:
        pytest.skip("redis-py no longer has Connection._send_packed_command")
    backend = RedisIndex(redis_url, prefix="stop", timeout_s=2.0)
    indexer = KVIndexer(backend)
    sub = EventSubscriber(indexer, ctx=zctx, grace_s=30)
    pub = Publisher(zctx)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    stopping: list[asyncio.Task[None]] = []

    async def send_then_stop(self: Any, command: Sequence[bytes]) -> None:
        await send(self, command)
        if not stopping:  # the worker's first write (nothing else talks to Redis here)
            stopping.append(asyncio.get_running_loop().create_task(sub.stop()))

    await sub.start()
    upkeep = indexer.maintenance.task if indexer.maintenance is not None else None
    tasks = [t for ts in sub._tasks.values() for t in ts] + [t for t in (upkeep,) if t is not None]
    try:
        await pub.wait_subscribed()
        monkeypatch.setattr(rconn.Connection, "_send_packed_command", send_then_stop)
        await pub.publish([Chain().store(PROMPT[:64])])
        await eventually(lambda: stopping)
        done, _ = await asyncio.wait(stopping, timeout=8)
        assert done, "sub.stop() hung: a task survived its cancellation"
        assert all(task.done() for task in tasks)
    finally:
        monkeypatch.undo()
        for task in tasks:
            task.cancel()
        await pub.close()
        await backend.close()


async def test_frozen_redis_fails_within_the_timeout(own_redis: RedisServer) -> None:
    """A Redis that stops answering (SIGSTOP: connections stay open, nothing comes back) must fail each call
    within the configured timeout (IndexUnavailable), never block it; the index heals once it answers."""
    from .fakevllm import frames

    backend = RedisIndex(own_redis.url, timeout_s=0.3)
    indexer = KVIndexer(backend)
    indexer.register_worker("a", "m")
    chain = Chain()
    await indexer.handle_message("a", frames([chain.store(PROMPT[:64])], 0))
    assert (await indexer.lookup_tokens("m", PROMPT)).matches["a"].blocks == 4
    own_redis.freeze()
    try:
        # Every call below is bounded by timeout_s (0.3 s); 10 s only turns a hang into a failure here.
        async with asyncio.timeout(10):
            with pytest.raises(IndexUnavailable, match="Timeout"):
                await indexer.lookup_tokens("m", PROMPT)
        async with asyncio.timeout(10):  # a write: the local view goes on, the backend is marked down
            assert (
                await indexer.handle_message("a", frames([chain.store(PROMPT, start_block=4)], 1))
            ).outcome == "applied"
        assert not indexer.backend_ok
        async with asyncio.timeout(10):  # a new connection: the kernel accepts it, the server never answers
            assert not await RedisIndex(own_redis.url, timeout_s=0.3).ping()
        async with asyncio.timeout(10):
            assert (await indexer.stats())["backend_ok"] is False
    finally:
        own_redis.resume()
    assert await indexer.recover(force=True)
    assert (await indexer.lookup_tokens("m", PROMPT)).matches["a"].blocks == 8
    own_redis.freeze()
    try:
        async with asyncio.timeout(10):  # closing on a frozen server neither hangs nor raises
            await backend.close()
    finally:
        own_redis.resume()
