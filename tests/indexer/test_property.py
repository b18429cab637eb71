"""Property: the same event stream gives identical lookups from the memory and the Redis backend,
and both agree with a naive reference walk over the workers' local views."""

from __future__ import annotations

import asyncio

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st
from kvroute.indexer.bitsets import classify
from kvroute.indexer.events import AllBlocksCleared
from kvroute.indexer.keys import request_keys
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.redis_index import RedisIndex
from kvroute.indexer.service import KVIndexer

from .fakevllm import Chain, frames

BS = 4
BASE = list(range(100, 100 + BS * 6))
PROMPTS = [BASE, BASE[: BS * 3] + [7] * (BS * 3), [9] * (BS * 2) + BASE[: BS * 4], BASE[: BS * 2] + [8] * BS * 4]
WORKERS = ["a", "b", "c"]
MEDIA = ["GPU", "CPU", "STORAGE"]

store = st.tuples(
    st.just("store"),
    st.sampled_from(WORKERS),
    st.integers(0, len(PROMPTS) - 1),
    st.integers(1, 6),
    st.sampled_from([0, 0, 0, 0, 1, 3]),
    st.sampled_from(["GPU", *MEDIA]),
    st.booleans(),
)
op = st.one_of(
    store,
    store,
    store,
    store,
    store,
    store,
    st.tuples(
        st.just("remove"),
        st.sampled_from(WORKERS),
        st.integers(0, len(PROMPTS) - 1),
        st.lists(st.integers(0, 5), min_size=1, max_size=3),
        st.sampled_from(MEDIA),
    ),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS)),
    st.tuples(st.just("purge"), st.sampled_from(WORKERS)),
)


def reference(indexer: KVIndexer, keys: list[int]) -> dict[str, tuple[int, ...]]:
    """A plain per-worker walk over the indexer's local views (no backend involved)."""
    out = {}
    for ent in indexer.registry.entities.values():
        counts = [0, 0, 0, 0, 0]
        for key in keys:
            bits = ent.state.bits.get(key)
            if not bits:
                break
            counts[0] += 1
            tier, remote = classify(bits)
            counts[tier + 1] += 1
            counts[4] += int(remote)
        if counts[0]:
            out[ent.id] = tuple(counts)
    return out


async def run_stream(ops: list[tuple], url: str) -> None:  # type: ignore[type-arg]
    redis_backend = RedisIndex(url, prefix="prop")
    indexers = [KVIndexer(MemoryIndex()), KVIndexer(redis_backend)]
    for idx in indexers:
        for w in WORKERS:
            idx.register_worker(w, "m")
    chains = {w: Chain(block_size=BS, seed=i) for i, w in enumerate(WORKERS)}
    seqs = dict.fromkeys(WORKERS, 0)
    try:
        for item in ops:
            kind, worker = item[0], item[1]
            if kind == "purge":
                for idx in indexers:
                    await idx.purge_worker(worker)
                continue
            chain = chains[worker]
            if kind == "store":
                _, _, p, n, start, medium, placeholder = item
                tokens = PROMPTS[p][: n * BS]
                event = chain.store(
                    tokens, min(start, n - 1), medium=medium, placeholder=placeholder and medium != "GPU"
                )
            elif kind == "remove":
                _, _, p, blocks, medium = item
                event = chain.remove(PROMPTS[p], blocks, medium)
            else:
                event = AllBlocksCleared()
            message = frames([event], seqs[worker])
            seqs[worker] += 1
            outcomes = [(await idx.handle_message(worker, message)).outcome for idx in indexers]
            assert outcomes[0] == outcomes[1]
        most = 0
        for prompt in PROMPTS:
            for cut in (BS, BS * 3, len(prompt)):
                keys = request_keys(prompt[:cut], BS, "m")
                mem, red = [await idx.lookup_keys("m", keys) for idx in indexers]
                as_tuples = [
                    {w: (m.blocks, m.gpu, m.cpu, m.storage, m.remote) for w, m in r.items()} for r in (mem, red)
                ]
                assert as_tuples[0] == as_tuples[1]
                assert as_tuples[0] == reference(indexers[0], keys)
                most = max(most, len(as_tuples[0]))
        note_event(f"most workers matching one lookup: {most}")
        mem_stats = {
            (r.worker_id, r.blocks, tuple(sorted(r.by_tier.items())))
            for r in await indexers[0].backend.worker_stats()
            if r.blocks
        }
        red_stats = {
            (r.worker_id, r.blocks, tuple(sorted(r.by_tier.items())))
            for r in await indexers[1].backend.worker_stats()
            if r.blocks
        }
        assert mem_stats == red_stats
    finally:
        await redis_backend.close()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.tuples(st.lists(store, min_size=2, max_size=8), st.lists(op, max_size=40)).map(
        lambda parts: parts[0] + parts[1]
    )
)
def test_backends_agree(redis_server, ops) -> None:  # type: ignore[no-untyped-def]
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    asyncio.run(run_stream(ops, redis_server.url))
