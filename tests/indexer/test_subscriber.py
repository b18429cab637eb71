"""Real ZMQ: publishers speaking vLLM's wire format, the subscriber in both modes, gaps and replays."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio
from kvroute.indexer.backend import IndexBackend
from kvroute.indexer.events import AllBlocksCleared, BlockStored
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec, rank_endpoint
from prometheus_client import CollectorRegistry

from .fakevllm import Chain, Publisher, count, eventually

PROMPT = list(range(500, 500 + 16 * 8))


@pytest.fixture
async def setup(backend: IndexBackend, zctx: zmq.asyncio.Context) -> AsyncIterator[tuple]:
    indexer = KVIndexer(backend, metrics=IndexerMetrics(CollectorRegistry()))  # counted per test
    sub = EventSubscriber(indexer, grace_s=0.3, replay_timeout_s=2.0, ctx=zctx, bind="tcp://127.0.0.1:*")
    pubs: list[Publisher] = []
    yield indexer, sub, pubs
    await sub.stop()
    for pub in pubs:
        await pub.close()


async def blocks_of(indexer: KVIndexer, worker: str, tokens=PROMPT) -> int:  # type: ignore[no-untyped-def]
    result = await indexer.lookup_tokens("m", tokens)
    match = result.matches.get(worker)
    return match.blocks if match else 0


async def test_connect_mode_several_workers(setup, zctx) -> None:  # type: ignore[no-untyped-def]
    indexer, sub, pubs = setup
    chains = {}
    for name in ("a", "b"):
        pub = Publisher(zctx, topic="kv")
        pubs.append(pub)
        sub.add_worker(WorkerSpec(name, "m", endpoint=pub.endpoint, topic="kv", replay=pub.replay_endpoint))
        chains[name] = Chain(seed=len(name) + ord(name))
    await sub.start()
    for pub in pubs:
        await pub.wait_subscribed()
    a, b = pubs
    await a.publish([chains["a"].store(PROMPT[:64])])
    await b.publish([chains["b"].store(PROMPT[:32])])
    await a.publish([chains["a"].store(PROMPT, start_block=4)], form="array")
    await eventually(lambda: blocks_of(indexer, "a"), 10)
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 8))
    await eventually(lambda: _eq(blocks_of(indexer, "b"), 2))
    await a.publish([chains["a"].remove(PROMPT, [4])])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 4))


async def _eq(coro, value) -> bool:  # type: ignore[no-untyped-def]
    return await coro == value


async def test_bound_socket_topics_name_workers(setup, zctx) -> None:  # type: ignore[no-untyped-def]
    indexer, sub, pubs = setup
    sub.add_worker(WorkerSpec("a", "m", topic="worker-a"))
    sub.add_worker(WorkerSpec("b", "m", topic="worker-b"))
    with pytest.raises(ValueError, match="distinct topics"):
        sub.add_worker(WorkerSpec("c", "m", topic="worker-a"))
    await sub.start()
    assert sub.bound_endpoint is not None
    pa = Publisher(zctx, topic="worker-a", connect=sub.bound_endpoint)
    pb = Publisher(zctx, topic="worker-b", connect=sub.bound_endpoint)
    stranger = Publisher(zctx, topic="nobody", connect=sub.bound_endpoint)
    pubs += [pa, pb, stranger]
    for pub in (pa, pb, stranger):
        await pub.wait_subscribed()
    ca, cb = Chain(seed=1), Chain(seed=2)
    await stranger.publish([Chain(seed=3).store(PROMPT)])
    await pa.publish([ca.store(PROMPT[:48])])
    await pb.publish([cb.store(PROMPT)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 3))
    await eventually(lambda: _eq(blocks_of(indexer, "b"), 8))
    result = await indexer.lookup_tokens("m", PROMPT)
    assert set(result.matches) == {"a", "b"}


@pytest.mark.parametrize("old_style", [False, True])
async def test_gap_is_filled_by_replay(setup, zctx, old_style: bool) -> None:  # type: ignore[no-untyped-def]
    indexer, sub, pubs = setup
    pub = Publisher(zctx)
    pub.old_style_replay = old_style
    pubs.append(pub)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await sub.start()
    await pub.wait_subscribed()
    chain = Chain()
    await pub.publish([chain.store(PROMPT[:16])])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 1))
    await pub.publish([chain.store(PROMPT[:32], start_block=1)], lose=True)
    await pub.publish([chain.store(PROMPT[:48], start_block=2)], lose=True)
    await pub.publish([chain.store(PROMPT[:64], start_block=3)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 4))
    # The first replay is the catch-up at subscribe time (from 0), the second fills the gap.
    assert pub.replay_requests == [0, 1]
    stats = await indexer.stats()
    row = next(w for w in stats["workers"] if w["id"] == "a")
    assert row["gaps"] == 1 and row["replays"] == 2 and row["purges"] == 0
    # After the replay the live stream goes on normally.
    await pub.publish([chain.store(PROMPT[:80], start_block=4)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 5))


@pytest.mark.parametrize(
    ("damage", "asked"),
    [
        # The tail dropped, end marker included: asked again from where the index got to when it goes silent.
        ({"replay_cut": 5}, [0, 5]),
        # Batches dropped from the middle (a send queue full for a moment), the rest and the end marker sent:
        # the batches after the hole chain on blocks never learnt; asked again from the hole.
        ({"replay_holes": {3, 4}}, [0, 3]),
    ],
    ids=["cut_short", "with_a_hole"],
)
async def test_a_damaged_replay_is_asked_again_from_where_the_index_stopped(  # type: ignore[no-untyped-def]
    setup, zctx, damage, asked
) -> None:
    """An engine's ROUTER drops what its send queue cannot hold instead of waiting: whatever part of a
    replay it dropped, the subscriber learns everything, instead of a partial index (timed out, or "ok"
    with the batches after a hole dropped as unknown parents)."""
    indexer, sub, pubs = setup
    pub = Publisher(zctx)
    for name, value in damage.items():
        setattr(pub, name, value)
    pubs.append(pub)
    chain = Chain()
    for k in range(1, 9):  # sent before anyone listened: only the catch-up replay can learn them
        await pub.publish([chain.store(PROMPT[: 16 * k], start_block=k - 1)], lose=True)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await sub.start()
    await pub.wait_subscribed()
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 8), 10)
    await eventually(lambda: sub._feeds["a"].job is None, 10)
    assert pub.replay_requests == asked  # the second answer came whole, with its end marker
    assert count(indexer, "kvroute_index_replay_resumes_total", worker="a") == 1
    assert count(indexer, "kvroute_index_replays_total", worker="a", outcome="ok") == 1
    assert count(indexer, "kvroute_index_replays_total", worker="a", outcome="timeout") == 0
    assert count(indexer, "kvroute_index_dropped_total", worker="a", reason="unknown_parent") == 0


async def test_a_replay_longer_than_the_engines_send_queue_arrives_whole(setup, zctx) -> None:  # type: ignore[no-untyped-def]
    """vLLM answers a replay with its whole buffer (up to 10,000 batches) in one loop on a ROUTER, whose send
    queue holds 1,000 and drops the rest: the DEALER's receive queue takes them as fast as they come, and
    what is dropped all the same is asked for again, so the catch-up ends with the whole index."""
    indexer, sub, pubs = setup
    pub = Publisher(zctx)
    pubs.append(pub)
    batches, per_batch = 3_000, 64  # ~5 KB a batch, 15 MB in all: more than the kernel's socket buffers hold
    rng = random.Random(7)
    tokens = [rng.randrange(150_000) for _ in range(16 * per_batch * batches)]
    for k in range(batches):  # a chain: the index knows a batch's blocks only if it learnt every batch before
        first = k * per_batch
        hashes = list(range(first + 1, first + per_batch + 1))
        span = tokens[16 * first : 16 * (first + per_batch)]
        block = BlockStored(block_hashes=hashes, parent_block_hash=first or None, token_ids=span, block_size=16)
        await pub.publish([block], lose=True)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await sub.start()
    await pub.wait_subscribed()
    await eventually(lambda: count(indexer, "kvroute_index_replays_total", worker="a", outcome="ok") == 1, 60)
    # Redis takes the burst at its end, or from the local view if that write failed (a loaded machine):
    # the blocks arrive there a little after the replay's end, all of them.
    expected = batches * per_batch

    async def all_blocks() -> bool:
        return await blocks_of(indexer, "a", tokens) == expected

    await eventually(all_blocks, 60, what=f"{expected} blocks in the index")
    # Asked from 0, and whole. On a quiet machine in one answer (the receive queue takes it as fast as it
    # comes); on a loaded one the engine's ROUTER may still drop some of it while the router is starved of
    # CPU, and the subscriber asks again from where the index got to (the tests above): either way, ahead.
    assert pub.replay_requests[0] == 0
    assert all(0 < seq <= batches for seq in pub.replay_requests[1:])


async def test_replay_older_than_buffer_starts_afresh(setup, zctx) -> None:  # type: ignore[no-untyped-def]
    indexer, sub, pubs = setup
    pub = Publisher(zctx, buffer_steps=2)
    pubs.append(pub)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await sub.start()
    await pub.wait_subscribed()
    chain = Chain()
    await pub.publish([chain.store(PROMPT)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 8))
    other = [7] * 64
    await pub.publish([chain.remove(PROMPT, [0])], lose=True)  # this removal is lost for good
    await pub.publish([chain.store([1] * 16)], lose=True)
    await pub.publish([chain.store(other)], lose=True)
    await pub.publish([chain.store([2] * 32)])
    await eventually(lambda: _eq(blocks_of(indexer, "a", other), 4))
    # The lost removal cannot be known, so everything from before the gap was purged.
    assert await blocks_of(indexer, "a") == 0
    row = next(w for w in (await indexer.stats())["workers"] if w["id"] == "a")
    assert row["purges"] == 1


async def test_engine_restart_and_worker_gone(setup, zctx) -> None:  # type: ignore[no-untyped-def]
    indexer, sub, pubs = setup
    pub = Publisher(zctx)
    pubs.append(pub)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await sub.start()
    await pub.wait_subscribed()
    chain = Chain()
    for i in range(3):
        await pub.publish([chain.store(PROMPT[: (i + 1) * 32], start_block=2 * i)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 6))
    pub.restart()
    fresh = Chain(seed=5)
    await pub.publish([fresh.store(PROMPT[:16])])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 1))
    # The engine goes away: its connection drops, and after the grace period it is purged.
    port = int(pub.endpoint.rsplit(":", 1)[1])
    await pub.close()
    pubs.remove(pub)
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 0))
    # It comes back on the same port: subscribed again, indexed again (ZMQ reconnects by itself).
    back = Publisher(zctx, port=port)
    pubs.append(back)
    await back.wait_subscribed()
    await back.publish([Chain(seed=6).store(PROMPT[:32])])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 2))


async def test_data_parallel_ranks_on_consecutive_ports(setup, zctx) -> None:  # type: ignore[no-untyped-def]
    indexer, sub, pubs = setup
    r0 = Publisher(zctx)
    port = int(r0.endpoint.rsplit(":", 1)[1])
    try:
        r1 = Publisher(zctx, port=port + 1, dp_rank=1)
    except zmq.ZMQError:
        pytest.skip("port + 1 is taken on this machine")
    pubs += [r0, r1]
    sub.add_worker(WorkerSpec("w", "m", endpoint=r0.endpoint, dp_size=2))
    await sub.start()
    await r0.wait_subscribed()
    await r1.wait_subscribed()
    await r0.publish([Chain(seed=1).store(PROMPT[:32])])
    await r1.publish([Chain(seed=2).store(PROMPT)])
    await eventually(lambda: _eq(blocks_of(indexer, "w#1"), 8))
    await eventually(lambda: _eq(blocks_of(indexer, "w"), 2))
    await r1.publish([AllBlocksCleared()])
    await eventually(lambda: _eq(blocks_of(indexer, "w#1"), 0))
    assert await blocks_of(indexer, "w") == 2


async def test_remove_worker_stops_listening(setup, zctx) -> None:  # type: ignore[no-untyped-def]
    indexer, sub, pubs = setup
    pub = Publisher(zctx)
    pubs.append(pub)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint))
    with pytest.raises(ValueError, match="already"):
        sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint))
    await sub.start()
    await pub.wait_subscribed()
    await pub.publish([Chain().store(PROMPT)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 8))
    await sub.remove_worker("a")
    assert await blocks_of(indexer, "a") == 0
    assert "a" not in indexer.workers()


def test_rank_endpoint() -> None:
    assert rank_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert rank_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    with pytest.raises(ValueError):
        rank_endpoint("ipc:///tmp/kv", 1)
