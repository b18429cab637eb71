"""The index agrees with the engine: predicted cached tokens == vLLM's ``cached_tokens``, exactly.

Also: a subscriber (router) restart rebuilds through the replay endpoint, and a vLLM restart (seq back
to 0, empty cache) purges that worker's entries before the index converges again.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from kvroute.indexer.backend import IndexBackend
from kvroute.indexer.memory import MemoryIndex

from .indexed import IndexedPool
from .kvwire import wait_for
from .servers import BLOCK_SIZE, NUM_BLOCKS, VllmServer
from .workload import ReferenceTokenizer, chat, complete, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900, func_only=True)]


@dataclass
class History:
    """What the workload sent to one worker, so probes can extend it."""

    system: str = ""
    distinct: list[str] = field(default_factory=list)
    continued: list[str] = field(default_factory=list)
    conversation: list[dict[str, str]] = field(default_factory=list)


async def mixed_workload(
    server: VllmServer, http: httpx.AsyncClient, rng: random.Random, distinct: int = 2 * NUM_BLOCKS // 5
) -> History:
    """Shared prefixes, distinct prompts (by default twice the cache: evictions), decode blocks, chat."""
    hist = History(system="you are a careful agent with tools. " + prompt_words(rng, 110))
    hist.conversation = [{"role": "system", "content": hist.system}]
    for i in range(distinct):
        distinct = prompt_words(rng, 110)
        hist.distinct.append(distinct)
        answer = await complete(http, server.url, distinct, max_tokens=40 if i % 4 == 0 else 1)
        if i % 4 == 0:
            hist.continued.append(distinct + answer.text)
        if i % 3 == 0:
            question = hist.system + " question: " + prompt_words(rng, 20)
            await complete(http, server.url, question, max_tokens=1)
        if i % 5 == 0:
            hist.conversation.append({"role": "user", "content": prompt_words(rng, 30)})
            answer = await chat(http, server.url, hist.conversation, max_tokens=24)
            hist.conversation.append({"role": "assistant", "content": answer.text})
    return hist


async def probe_all(
    pool: IndexedPool, server: VllmServer, hist: History, http: httpx.AsyncClient, rng: random.Random
) -> None:
    """Fresh probes that hit, partly hit and miss the worker's cache, through both endpoints."""
    new = prompt_words(rng, 12)
    await pool.probe(server, http, rng, prompt=hist.system + " question: " + new)
    await pool.probe(server, http, rng, prompt=hist.distinct[0] + " " + new)  # long evicted
    await pool.probe(server, http, rng, prompt=hist.distinct[-1] + " " + new)  # recent
    await pool.probe(server, http, rng, prompt=hist.continued[-1] + " " + new)  # decode-filled blocks
    await pool.probe(server, http, rng, messages=[*hist.conversation, {"role": "user", "content": new}])
    await pool.probe(
        server, http, rng, messages=[{"role": "system", "content": hist.system}, {"role": "user", "content": new}]
    )
    # Exact block multiples: sent twice as token ids, the second time vLLM must recompute one block.
    ids = [rng.randrange(10, 1000) for _ in range(3 * BLOCK_SIZE)]
    await pool.probe(server, http, rng, prompt=ids)
    await pool.probe(server, http, rng, prompt=ids)
    await pool.probe(server, http, rng, prompt=[*ids, 5])


@pytest.fixture
async def memory_backend() -> AsyncIterator[IndexBackend]:
    backend = MemoryIndex()
    yield backend
    await backend.close()


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[IndexBackend]:
    if request.param == "memory":
        backend: IndexBackend = MemoryIndex()
    else:
        from kvroute.indexer.redis_index import RedisIndex

        backend = RedisIndex(request.getfixturevalue("redis_url"), prefix="kvr-vllm")
    yield backend
    await backend.close()


@pytest.fixture
async def indexed(
    vllm_pool: list[VllmServer], backend: IndexBackend, reference_tokenizer: ReferenceTokenizer
) -> AsyncIterator[IndexedPool]:
    pool = IndexedPool(vllm_pool, backend, reference_tokenizer)
    yield pool
    await pool.stop()


async def run_and_probe(pool: IndexedPool, http: httpx.AsyncClient, rng: random.Random) -> None:
    histories = await asyncio.gather(*(mixed_workload(s, http, rng) for s in pool.servers))
    for server, hist in zip(pool.servers, histories, strict=True):
        await probe_all(pool, server, hist, http, rng)


async def test_index_agrees_with_engine(indexed: IndexedPool, http: httpx.AsyncClient, rng: random.Random) -> None:
    """A fresh probe on each worker: predicted == reported cached tokens, after evictions and chat."""
    await indexed.start()
    for server in indexed.servers:
        await indexed.sync(server, http, rng)  # connected before the workload (late start: see below)
    await run_and_probe(indexed, http, rng)
    indexed.assert_all_exact()
    assert any(p.cached > 0 for p in indexed.probes), "no probe hit the cache: the check proves nothing"
    assert any(p.predicted == 0 for p in indexed.probes if p.kind != "token ids"), "nothing was evicted"
    stats = await indexed.stats()
    for worker in stats["workers"]:
        assert worker.get("dropped", 0) == 0, f"the indexer dropped messages from {worker['id']}"


async def test_cache_salt_isolates_tenants(
    vllm_pool: list[VllmServer],
    memory_backend: IndexBackend,
    reference_tokenizer: ReferenceTokenizer,
    http: httpx.AsyncClient,
    rng: random.Random,
) -> None:
    """A tenant's ``cache_salt`` keys its blocks (vLLM puts it in block 0's extra keys; so do we)."""
    server = vllm_pool[1]
    pool = IndexedPool([server], memory_backend, reference_tokenizer)
    await pool.start()
    try:
        await pool.sync(server, http, rng)
        shared = prompt_words(rng, 150)
        await complete(http, server.url, shared, cache_salt="tenant-1")
        for salt in ("tenant-1", "tenant-2", None):
            await pool.probe(server, http, rng, prompt=shared + " " + prompt_words(rng, 5), cache_salt=salt)
        await pool.probe(server, http, rng, messages=[{"role": "user", "content": shared}], cache_salt="t-3")
        await pool.probe(server, http, rng, messages=[{"role": "user", "content": shared + " more"}], cache_salt="t-3")
        pool.assert_all_exact()
        hits = [p.cached for p in pool.probes]
        assert hits[0] > 0 and hits[1] == 0 and hits[2] == 0 and hits[4] > 0, pool.probes
    finally:
        await pool.stop()


async def test_duplicate_block_copies(
    vllm_pool: list[VllmServer],
    memory_backend: IndexBackend,
    reference_tokenizer: ReferenceTokenizer,
    http: httpx.AsyncClient,
    rng: random.Random,
) -> None:
    """vLLM can hold two copies of one block hash and sends one BlockRemoved per copy.

    A prompt sent twice whose length is a block multiple makes the engine recompute (and store again)
    its last block: a second physical copy under the same hash. When the older copy is evicted,
    vLLM announces ``BlockRemoved(hash)`` although the newer copy is still cached. An index that
    drops the hash on that removal predicts one block too few from then on; it must count copies.
    """
    server = vllm_pool[0]
    pool = IndexedPool([server], memory_backend, reference_tokenizer)
    await pool.start()
    try:
        await pool.sync(server, http, rng)
        ids = [rng.randrange(10, 1000) for _ in range(3 * BLOCK_SIZE)]
        await complete(http, server.url, ids)
        await complete(http, server.url, ids)  # the last block is stored a second time
        # Keep the newer copy hot with probes while distinct traffic evicts the older one.
        for _ in range(NUM_BLOCKS // 2):
            await complete(http, server.url, prompt_words(rng, 50), max_tokens=1)
            await pool.probe(server, http, rng, prompt=[*ids, rng.randrange(10, 1000)])
        assert all(p.cached == 3 * BLOCK_SIZE for p in pool.probes), "the engine lost the prefix"
        pool.assert_all_exact()
    finally:
        await pool.stop()


async def test_subscriber_restart_catches_up_through_replay(
    vllm_pool: list[VllmServer],
    memory_backend: IndexBackend,
    reference_tokenizer: ReferenceTokenizer,
    http: httpx.AsyncClient,
    rng: random.Random,
) -> None:
    """Subscriber down while the workers keep working; back up, a sequence gap triggers a replay."""
    pool = IndexedPool(vllm_pool, memory_backend, reference_tokenizer)
    await pool.start()
    try:
        for server in vllm_pool:
            await pool.sync(server, http, rng)
        indexer = pool.indexer
        await pool.stop()
        histories = await asyncio.gather(*(mixed_workload(s, http, rng) for s in vllm_pool))
        await pool.start(indexer)  # same state, missed batches: must replay them
        for server, hist in zip(vllm_pool, histories, strict=True):
            await probe_all(pool, server, hist, http, rng)
        pool.assert_all_exact()
        stats = await pool.stats()
        assert stats["replays"] >= 1, stats
    finally:
        await pool.stop()


async def test_fresh_router_rebuilds_through_replay(
    vllm_pool: list[VllmServer],
    memory_backend: IndexBackend,
    reference_tokenizer: ReferenceTokenizer,
    http: httpx.AsyncClient,
    rng: random.Random,
) -> None:
    """A router process started after the workers have cached things learns them from replay."""
    histories = await asyncio.gather(*(mixed_workload(s, http, rng) for s in vllm_pool))
    pool = IndexedPool(vllm_pool, memory_backend, reference_tokenizer)
    await pool.start()  # a new indexer: no state, workers mid-sequence
    try:
        for server, hist in zip(vllm_pool, histories, strict=True):
            await probe_all(pool, server, hist, http, rng)
        pool.assert_all_exact()
    finally:
        await pool.stop()


async def test_vllm_restart_purges_and_reconverges(
    vllm_pool: list[VllmServer],
    memory_backend: IndexBackend,
    reference_tokenizer: ReferenceTokenizer,
    http: httpx.AsyncClient,
    rng: random.Random,
) -> None:
    """Both engines restart (cache empty, seq 0): their old entries go, then predictions are exact."""
    pool = IndexedPool(vllm_pool, memory_backend, reference_tokenizer, grace_s=2.0)
    await pool.start()
    try:
        before = await asyncio.gather(*(mixed_workload(s, http, rng, distinct=6) for s in vllm_pool))
        for server in vllm_pool:
            await pool.sync(server, http, rng)
        old_prompt = {s.name: h.system + " question: " for s, h in zip(vllm_pool, before, strict=True)}
        for server in vllm_pool:
            tokens = reference_tokenizer.completion(old_prompt[server.name])
            assert await pool.matched_blocks(server.name, tokens) > 0
        purges_before = (await pool.stats())["purges"]

        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in vllm_pool))
        await asyncio.gather(*(asyncio.to_thread(s.start) for s in vllm_pool))
        await asyncio.gather(*(asyncio.to_thread(s.wait_healthy) for s in vllm_pool))

        # First traffic after the restart: seq 0 again. The old entries must be gone, not shadowing.
        for server in vllm_pool:
            await pool.sync(server, http, rng)
            tokens = reference_tokenizer.completion(old_prompt[server.name])
            await wait_for(
                lambda s=server, t=tokens: _zero(pool, s.name, t), 30, what=f"old entries of {server.name} purged"
            )
        assert (await pool.stats())["purges"] > purges_before
        after = await asyncio.gather(*(mixed_workload(s, http, rng) for s in vllm_pool))
        for server, hist in zip(vllm_pool, after, strict=True):
            await probe_all(pool, server, hist, http, rng)
            # The system prompt cached before the restart is not in the new engine: exact 0.
            await pool.probe(server, http, rng, prompt=before[vllm_pool.index(server)].system + " x")
        pool.assert_all_exact()
    finally:
        await pool.stop()


async def _zero(pool: IndexedPool, worker: str, tokens: list[int]) -> bool:
    return await pool.matched_blocks(worker, tokens) == 0
