"""Every KV event real vLLM publishes decodes with ``kvroute.indexer.events``; zero decode errors."""

from __future__ import annotations

import random

import httpx
import msgspec
import pytest
from kvroute.indexer.events import BlockRemoved, BlockStored, EventBatch, decode_batch

from .kvwire import EventTap, RawBatch, replay
from .servers import BLOCK_SIZE, NUM_BLOCKS, VllmServer
from .workload import ReferenceTokenizer, complete, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600, func_only=True)]


def decode_all(batches: list[RawBatch], topic: str) -> list[EventBatch]:
    """Decode every batch, failing on the first error (the test's point is that none fails)."""
    out = []
    for raw in batches:
        assert raw.topic == topic.encode()
        out.append(decode_batch(raw.payload))
    return out


def check_stored(event: BlockStored) -> None:
    """The shape the indexer relies on: full blocks of real tokens, GPU medium, no extra keys."""
    assert event.block_size == BLOCK_SIZE
    assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE
    assert event.medium == "GPU"
    assert event.lora_name is None
    assert event.extra_keys is None or all(not extra for extra in event.extra_keys)


@pytest.mark.parametrize("which", ["a", "b"])
async def test_live_events_decode(
    which: str,
    vllm_pool: list[VllmServer],
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """Live frames (SUB bound for the connect-mode server, connected for the bind-mode one) decode."""
    server = next(s for s in vllm_pool if s.name == which)
    async with EventTap(server) as tap:
        # A SUB misses what is published before the PUB is connected (ZMQ slow joiner):
        # send distinct prompts until one batch arrives, then collect the rest.
        for _ in range(30):
            prompt = prompt_words(rng, 90)
            await complete(http, server.url, prompt, max_tokens=40)
            if await tap.receive(2.0) is not None:
                break
        else:
            raise AssertionError(f"no live event from {server.name} after 30 requests")
        await tap.drain(quiet=1.5)
        batches = decode_all(tap.batches, server.topic)
    seqs = [b.seq for b in tap.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"live sequence has holes: {seqs}"
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored, "no BlockStored in the live stream"
    for event in stored:
        check_stored(event)
    # The last prompt's blocks: its prefill announcement carries exactly the engine's prompt tokens.
    tokens = reference_tokenizer.completion(prompt)
    full = len(tokens) // BLOCK_SIZE * BLOCK_SIZE
    assert any(e.token_ids == tokens[:full] and e.parent_block_hash is None for e in stored)


@pytest.mark.parametrize("which", ["a", "b"])
async def test_every_published_event_decodes(
    which: str, vllm_pool: list[VllmServer], http: httpx.AsyncClient, rng: random.Random
) -> None:
    """Force evictions, then replay the server's whole history from seq 0: all of it decodes."""
    server = next(s for s in vllm_pool if s.name == which)
    # Twice the cache in distinct prompts: LRU evictions must happen (BlockRemoved events).
    for _ in range(2 * NUM_BLOCKS // 5):
        await complete(http, server.url, prompt_words(rng, 120), max_tokens=2)
    history = await replay(server, 0)
    assert history, "replay returned nothing"
    assert [b.seq for b in history] == list(range(len(history))), "replay from 0 is not contiguous"
    batches = decode_all(history, server.topic)
    assert all(b.skipped == 0 for b in batches), "vLLM sent an event type we do not know"
    kinds = {type(e).__name__ for b in batches for e in b.events}
    assert {"BlockStored", "BlockRemoved"} <= kinds, kinds
    known: set[int | bytes] = set()
    for batch in batches:
        assert batch.dp_rank == 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                check_stored(event)
                assert event.parent_block_hash is None or event.parent_block_hash in known, (
                    "a stored block's parent was never announced"
                )
                known.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):  # a run of them decodes as one (the indexer folds it)
                assert event.medium == "GPU"
                assert all(h in known for h in event.block_hashes), "removal of a block never stored"
    # On the wire, the GPU pool announces each evicted block alone (what the decoder's folding is for).
    wire = [e for raw in history for e in msgspec.msgpack.decode(raw.payload)[1]]
    removals = [e for e in wire if e["type"] == "BlockRemoved"]
    assert removals and all(len(e["block_hashes"]) == 1 for e in removals), "the GPU pool removes one block per event"


async def test_replay_from_the_middle(worker_a: VllmServer, http: httpx.AsyncClient, rng: random.Random) -> None:
    """A replay from seq n returns exactly the batches n.. (what a subscriber uses after a gap)."""
    await complete(http, worker_a.url, prompt_words(rng, 90), max_tokens=40)
    full = await replay(worker_a, 0)
    start = len(full) // 2
    tail = await replay(worker_a, start)
    assert [b.seq for b in tail][: len(full) - start] == [b.seq for b in full[start:]]
    assert [b.payload for b in tail][: len(full) - start] == [b.payload for b in full[start:]]
