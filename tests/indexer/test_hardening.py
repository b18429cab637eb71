"""The hardening issue's indexer items, each against real sockets: a hostile publisher, a slow peer, real
Redis where a backend is involved (docs/indexer.md 'Hardening', docs/security.md 'Events')."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from kvroute.indexer.backend import IndexBackend, IndexOp
from kvroute.indexer.events import encode_batch, encode_seq
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec
from prometheus_client import CollectorRegistry

from .fakevllm import Chain, Publisher, count, eventually

PROMPT = list(range(900, 900 + 16 * 8))


async def blocks_of(indexer: KVIndexer, worker: str, tokens: list[int] = PROMPT) -> int:
    match = (await indexer.lookup_tokens("m", tokens)).matches.get(worker)
    return match.blocks if match else 0


async def _eq(coro: Any, value: int) -> bool:
    return bool(await coro == value)


@pytest.fixture
async def rig(backend: IndexBackend, zctx: zmq.asyncio.Context) -> AsyncIterator[tuple[KVIndexer, dict[str, Any]]]:
    indexer = KVIndexer(backend, metrics=IndexerMetrics(CollectorRegistry()))
    made: dict[str, Any] = {"pubs": [], "subs": [], "ctx": zctx}
    yield indexer, made
    for sub in made["subs"]:
        await sub.stop()
    for pub in made["pubs"]:
        await pub.close()


def subscriber(indexer: KVIndexer, made: dict[str, Any], **kw: Any) -> EventSubscriber:
    kw.setdefault("bind", "tcp://127.0.0.1:*")
    sub = EventSubscriber(indexer, grace_s=30, replay_timeout_s=1.0, ctx=made["ctx"], **kw)
    made["subs"].append(sub)
    return sub


def publisher(made: dict[str, Any], **kw: Any) -> Publisher:
    pub = Publisher(made["ctx"], **kw)
    made["pubs"].append(pub)
    return pub


# ---- item 7: losses without recovery --------------------------------------------------------------


async def test_forged_backwards_seq_is_checked_against_the_replay_buffer(rig) -> None:  # type: ignore[no-untyped-def]
    """A hostile publisher on a worker's topic sends seq 0: the engine's buffer does not hold that batch,
    so nothing is purged; the worker's real events go on being applied (index == engine)."""
    indexer, made = rig
    sub = subscriber(indexer, made)
    await sub.start()
    real = publisher(made, topic="a", connect=sub.bound_endpoint)
    sub.add_worker(WorkerSpec("a", "m", topic="a", replay=real.replay_endpoint))
    hostile = publisher(made, topic="a", connect=sub.bound_endpoint)
    await real.wait_subscribed()
    await hostile.wait_subscribed()
    chain = Chain()
    for i in range(4):
        await real.publish([chain.store(PROMPT[: (i + 2) * 16], start_block=0 if i == 0 else i + 1)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 5))
    await hostile.send_raw([b"a", encode_seq(0), encode_batch(time.time() + 100, [], 0)])
    await eventually(lambda: count(indexer, "kvroute_index_dropped_total", worker="a", reason="unconfirmed_seq") == 1)
    await real.publish([chain.store(PROMPT[:112], start_block=5)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 7))
    assert count(indexer, "kvroute_index_purges_total", worker="a", reason="engine_restart") == 0
    # A forged jump forward: the replay answers without it, so it is not the engine's either.
    await hostile.send_raw([b"a", encode_seq(10_000), encode_batch(time.time(), [], 0)])
    await eventually(lambda: count(indexer, "kvroute_index_dropped_total", worker="a", reason="unconfirmed_seq") == 2)
    await real.publish([chain.store(PROMPT, start_block=7)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 8))
    assert indexer.indexed_blocks("a") == 8
    row = next(w for w in (await indexer.stats())["workers"] if w["id"] == "a")
    assert row["purges"] == 0


async def test_restarted_engine_is_relearnt_from_its_replay_buffer(rig) -> None:  # type: ignore[no-untyped-def]
    """Item 10b: the engine restarts and its first batches are lost while we reconnect; the first batch
    that arrives has a lower seq. Purge, then replay from 0: every block of the new engine is known, the
    later stores whose parents were in the lost batches are not dropped as unknown_parent."""
    indexer, made = rig
    sub = subscriber(indexer, made, bind=None)
    pub = publisher(made)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await sub.start()
    await pub.wait_subscribed()
    old = Chain(seed=1)
    for i in range(6):
        await pub.publish([old.store(PROMPT[: (i + 1) * 16], start_block=i)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 6))
    pub.restart()
    new = Chain(seed=2)
    await pub.publish([new.store(PROMPT[:16])], lose=True)  # lost during the reconnection
    await pub.publish([new.store(PROMPT[:32], start_block=1)], lose=True)
    await pub.publish([new.store(PROMPT[:48], start_block=2)])  # seq 2 < 5: back in time
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 3))
    await pub.publish([new.store(PROMPT[:64], start_block=3)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 4))
    assert count(indexer, "kvroute_index_dropped_total", worker="a", reason="unknown_parent") == 0
    assert count(indexer, "kvroute_index_resyncs_total", worker="a", reason="engine_restart") == 1
    assert pub.replay_requests[-1] == 0


async def test_reconciliation_heals_a_divergence(rig) -> None:  # type: ignore[no-untyped-def]
    """A permanent divergence (here: the index lost a rank's blocks behind the subscriber's back) is found
    by comparing with the engine's own count and healed by purge + replay from 0."""
    indexer, made = rig
    engine_count = {"n": 0}

    async def engine_blocks(worker_id: str, dp_rank: int) -> int | None:
        return engine_count["n"]

    sub = subscriber(indexer, made, bind=None, engine_blocks=engine_blocks, reconcile_s=3600, reconcile_tolerance=1)
    pub = publisher(made)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
    await sub.start()
    await pub.wait_subscribed()
    chain = Chain()
    for i in range(8):
        await pub.publish([chain.store(PROMPT[: (i + 1) * 16], start_block=i)])
    engine_count["n"] = 8
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 8))
    await sub.reconcile()
    assert count(indexer, "kvroute_index_reconciliations_total", worker="a", outcome="ok") == 1
    await indexer.purge_worker("a", "admin")  # the divergence (a forged AllBlocksCleared would do the same)
    await sub.reconcile()  # one check apart is not enough: events may be in flight
    assert await blocks_of(indexer, "a") == 0
    await sub.reconcile()
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 8))
    assert count(indexer, "kvroute_index_reconciliations_total", worker="a", outcome="resynced") == 1
    await pub.publish([chain.remove(PROMPT, [7])])  # the live stream goes on after the resync
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 7))


# ---- item 8: head-of-line blocking ----------------------------------------------------------------


async def _trickling_replay(router: zmq.asyncio.Socket, topic: bytes) -> None:
    """A replay ROUTER that answers one batch every 0.3 s and never ends."""
    ident, _, _start = await router.recv_multipart()
    seq = 100
    while True:
        await router.send_multipart([ident, b"", topic, encode_seq(seq), encode_batch(time.time(), [], 0)])
        seq += 1
        await asyncio.sleep(0.3)


async def test_a_slow_replay_never_delays_other_workers(rig) -> None:  # type: ignore[no-untyped-def]
    indexer, made = rig
    zctx = made["ctx"]
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    slow_task = asyncio.create_task(_trickling_replay(router, b"slow"))
    sub = subscriber(indexer, made, replay_max_s=3.0)
    sub.add_worker(WorkerSpec("slow", "m", topic="slow", replay=f"tcp://127.0.0.1:{port}"))
    sub.add_worker(WorkerSpec("a", "m", topic="a"))
    try:
        await sub.start()
        slow = publisher(made, topic="slow", connect=sub.bound_endpoint)
        real = publisher(made, topic="a", connect=sub.bound_endpoint)
        await slow.wait_subscribed()
        await real.wait_subscribed()
        slow.seq = 50  # first message of a running worker: a catch-up replay, which trickles
        await slow.publish([])
        await eventually(lambda: sub._feeds["slow"].job is not None)
        chain = Chain()
        await real.publish([chain.store(PROMPT)])
        t0 = time.monotonic()
        await eventually(lambda: _eq(blocks_of(indexer, "a"), 8))
        assert sub._feeds["slow"].job is not None  # still trickling, and "a" was indexed meanwhile
        assert time.monotonic() - t0 < 2.0
        # The slow replay is bounded in time all the same.
        await eventually(lambda: sub._feeds["slow"].job is None, 10)
        assert count(indexer, "kvroute_index_replays_total", worker="slow", outcome="timeout") == 1
    finally:
        slow_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await slow_task
        router.close(0)


async def test_unknown_dp_ranks_are_dropped_without_entities(rig) -> None:  # type: ignore[no-untyped-def]
    indexer, made = rig
    sub = subscriber(indexer, made)
    sub.add_worker(WorkerSpec("a", "m", topic="a", replay="tcp://127.0.0.1:9"))  # nothing answers there
    await sub.start()
    hostile = publisher(made, topic="a", connect=sub.bound_endpoint)
    await hostile.wait_subscribed()
    for rank in range(1, 11):
        await hostile.send_raw([b"a", encode_seq(7), encode_batch(time.time(), [], rank)])
    await eventually(lambda: count(indexer, "kvroute_index_dropped_total", worker="a", reason="unknown_rank") == 10)
    assert [e for e in indexer.registry.entities if e.startswith("a#")] == []
    assert count(indexer, "kvroute_index_replays_total", worker="a#1", outcome="timeout") == 0


# ---- item 9: stats are O(workers) -----------------------------------------------------------------


class _NoScan(dict):  # type: ignore[type-arg]
    """A block table whose walk fails the test: stats must come from counters."""

    def values(self):  # type: ignore[no-untyped-def]
        raise AssertionError("stats walked the blocks")

    def items(self):  # type: ignore[no-untyped-def]
        raise AssertionError("stats walked the blocks")


async def test_stats_come_from_maintained_counters(backend: IndexBackend) -> None:
    indexer = KVIndexer(backend, metrics=IndexerMetrics(CollectorRegistry()))
    indexer.register_worker("a", "m")
    chain = Chain()
    from .fakevllm import frames

    await indexer.handle_message("a", frames([chain.store(PROMPT)], 0))
    await indexer.handle_message("a", frames([chain.store(PROMPT[:48], medium="CPU", placeholder=True)], 1))
    await indexer.handle_message("a", frames([chain.remove(PROMPT, [7, 6]), chain.remove(PROMPT, [0], "CPU")], 2))
    ent = indexer.registry.entities["a"]
    ent.state.bits = _NoScan(ent.state.bits)
    if isinstance(backend, MemoryIndex):
        for table in backend._models.values():
            table.held = {w: _NoScan(h) for w, h in table.held.items()}
    stats = await indexer.stats()
    row = next(w for w in stats["workers"] if w["id"] == "a")
    assert row["blocks"] == 6 and row["by_tier"] == {"GPU": 6, "CPU": 2}
    info = await indexer.worker_info("a")
    assert info is not None and info["blocks"] == 6
    if isinstance(backend, MemoryIndex):
        (ws,) = await backend.worker_stats()
        assert ws.blocks == 6 and ws.by_tier == {"GPU": 6, "CPU": 2}
    await indexer.handle_message("a", frames([chain.store([5] * 32)], 3))
    await indexer.purge_worker("a")
    assert (await indexer.worker_info("a"))["blocks"] == 0  # type: ignore[index]


# ---- item 10: memory ------------------------------------------------------------------------------


async def test_oversized_frame_is_refused_before_decoding(rig) -> None:  # type: ignore[no-untyped-def]
    indexer, made = rig
    sub = subscriber(indexer, made, bind=None, max_frame_bytes=1 << 20)
    pub = publisher(made)
    sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint))
    await sub.start()
    await pub.wait_subscribed()
    await pub.send_raw([b"", encode_seq(0), b"\x00" * (4 << 20)])
    # ZMQ drops the connection without handing the frame over (nothing allocated, nothing decoded).
    await eventually(lambda: count(indexer, "kvroute_index_stream_disconnects_total", worker="a") >= 1)
    assert count(indexer, "kvroute_index_dropped_total", worker="a", reason="internal_error") == 0
    chain = Chain()

    async def indexed_after_reconnect() -> bool:  # the SUB reconnects by itself, within its 1 s backoff cap
        await pub.publish([chain.store(PROMPT)])
        await asyncio.sleep(0.1)
        return await blocks_of(indexer, "a") == 8

    await eventually(indexed_after_reconnect, 10)


async def test_memory_backend_capacity_evicts_oldest() -> None:
    index = MemoryIndex(max_blocks=100)
    indexer = KVIndexer(index, metrics=IndexerMetrics(CollectorRegistry()))
    index.apply_sync("m", "a", [IndexOp("store", list(range(100)), 1)])
    index.apply_sync("m", "a", [IndexOp("store", [0], 2)])  # stored again: refreshed, evicted last
    index.apply_sync("m", "b", [IndexOp("store", list(range(1000, 1050)), 1)])
    assert index.total_blocks() <= 100
    assert count(indexer, "kvroute_index_evicted_blocks_total", backend="memory") == index.evicted_blocks >= 50
    assert await index.block_workers("m", 0) == {"a": 3}
    assert await index.block_workers("m", 1) == {}
    stats = {s.worker_id: s for s in await index.worker_stats()}
    assert stats["a"].blocks == len(index._models["m"].held["a"]) == stats["a"].by_tier["GPU"]
    assert stats["b"].blocks == 50
    match = index.lookup_sync("m", list(range(1000, 1050)))
    assert match["b"].blocks == 50


# ---- item 10d: hostile payloads, log amplification ------------------------------------------------


async def test_deep_payload_is_malformed_and_logged_rate_limited(
    indexer: KVIndexer, caplog: pytest.LogCaptureFixture
) -> None:
    deep = b"\x93\xcb" + msgspec.msgpack.encode(1.0)[1:] + b"\x91" * 100_000 + b"\xc0" + b"\x00"
    nested: Any = 1
    for _ in range(50):
        nested = [nested]
    deep_extra = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "token_ids": [1] * 16,
                    "block_size": 16,
                    "extra_keys": [nested],
                }
            ],
            0,
        ]
    )
    before = count(indexer, "kvroute_index_dropped_total", worker="a", reason="malformed")
    with caplog.at_level(logging.WARNING, logger="kvroute.indexer"):
        for i in range(50):
            handled = await indexer.handle_message("a", [b"", encode_seq(i), deep if i % 2 else deep_extra])
            assert handled.outcome == "dropped"
    assert count(indexer, "kvroute_index_dropped_total", worker="a", reason="malformed") - before == 50
    assert count(indexer, "kvroute_index_dropped_total", worker="a", reason="internal_error") == 0
    lines = [r for r in caplog.records if "dropped a message" in r.getMessage()]
    assert len(lines) == 1 and not any(r.exc_info for r in caplog.records)


# ---- authenticated events -------------------------------------------------------------------------


async def test_topic_speaks_only_for_its_worker(rig) -> None:  # type: ignore[no-untyped-def]
    indexer, made = rig
    sub = subscriber(indexer, made)
    sub.add_worker(WorkerSpec("a", "m", topic="worker-a"))
    sub.add_worker(WorkerSpec("b", "m", topic="worker-b"))
    await sub.start()
    hostile = publisher(made, topic="worker-a-x", connect=sub.bound_endpoint)  # a prefix of a's topic
    pb = publisher(made, topic="worker-b", connect=sub.bound_endpoint)
    await hostile.wait_subscribed()
    await pb.wait_subscribed()
    await hostile.publish([Chain(seed=9).store(PROMPT)])
    await pb.publish([Chain(seed=8).store(PROMPT)])
    await eventually(lambda: _eq(blocks_of(indexer, "b"), 8))
    assert await blocks_of(indexer, "a") == 0
    assert count(indexer, "kvroute_index_dropped_total", worker="(bound)", reason="unknown_topic") == 1
    # b's own topic can only ever write b's entities, whatever the payload claims (rank 1 is not b's).
    await pb.send_raw([b"worker-b", encode_seq(1), encode_batch(time.time(), [Chain(seed=7).store(PROMPT)], 1)])
    await eventually(lambda: count(indexer, "kvroute_index_dropped_total", worker="b", reason="unknown_rank") == 1)
    assert set((await indexer.lookup_tokens("m", PROMPT)).matches) == {"b"}


async def test_ip_allowlist_on_the_bound_socket(rig) -> None:  # type: ignore[no-untyped-def]
    indexer, made = rig
    sub = subscriber(indexer, made, allow=["10.255.255.1"])
    sub.add_worker(WorkerSpec("a", "m", topic="a"))
    await sub.start()
    pub = publisher(made, topic="a", connect=sub.bound_endpoint)
    with pytest.raises(asyncio.TimeoutError):
        await pub.wait_subscribed(timeout=1.0)  # ZAP refused 127.0.0.1: no subscription ever reaches it
    await sub.stop()
    made["subs"].remove(sub)
    ok = subscriber(indexer, made, allow=["127.0.0.1"])
    await indexer.unregister_worker("a")
    ok.add_worker(WorkerSpec("a", "m", topic="a"))
    await ok.start()
    good = publisher(made, topic="a", connect=ok.bound_endpoint)
    await good.wait_subscribed()
    await good.publish([Chain().store(PROMPT)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 8))


async def test_curve_on_the_bound_socket(rig) -> None:  # type: ignore[no-untyped-def]
    indexer, made = rig
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    sub = subscriber(indexer, made, curve_secret_key=server_secret.decode(), curve_client_keys=[client_public.decode()])
    sub.add_worker(WorkerSpec("a", "m", topic="a"))
    await sub.start()
    plain = publisher(made, topic="a", connect=None)  # bound here only to own its sockets; reconnected below
    zctx = made["ctx"]
    for pub, keys in ((plain, None), (publisher(made, topic="a"), (client_public, client_secret))):
        pub.pub.close(0)
        pub.pub = zctx.socket(zmq.XPUB)
        pub.pub.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            pub.pub.curve_serverkey = server_public
            pub.pub.curve_publickey, pub.pub.curve_secretkey = keys
        pub.pub.connect(sub.bound_endpoint)
    curved = made["pubs"][-1]
    with pytest.raises(asyncio.TimeoutError):
        await plain.wait_subscribed(timeout=1.0)
    await curved.wait_subscribed()
    await curved.publish([Chain().store(PROMPT)])
    await eventually(lambda: _eq(blocks_of(indexer, "a"), 8))
