"""vLLM sends one ``BlockRemoved`` per evicted block; the decoder folds a run of them from one tier into one
event. The index and its counters must end exactly where applying them one by one leaves them."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.indexer.events import BlockRemoved, BlockStored, decode_batch, encode_batch
from kvroute.indexer.fastdecode import decode_batch_fast
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.service import KVIndexer
from prometheus_client import CollectorRegistry

from .fakevllm import Chain, frames

PROMPT = list(range(100, 100 + 16 * 8))


def test_consecutive_removals_of_one_tier_decode_as_one_event() -> None:
    events = [
        BlockRemoved(block_hashes=[1]),
        BlockRemoved(block_hashes=[2, 3]),
        BlockRemoved(block_hashes=[4], medium="cpu"),
        BlockRemoved(block_hashes=[5], medium="CPU"),
        BlockStored(block_hashes=[9], token_ids=list(range(16)), block_size=16),
        BlockRemoved(block_hashes=[6]),
        BlockRemoved(block_hashes=[7], group_idx=1),
    ]
    for decode in (decode_batch_fast, decode_batch):
        batch = decode(encode_batch(time.time(), events))
        assert [(type(e).__name__, getattr(e, "medium", None)) for e in batch.events] == [
            ("BlockRemoved", "GPU"),
            ("BlockRemoved", "CPU"),
            ("BlockStored", "GPU"),
            ("BlockRemoved", "GPU"),
            ("BlockRemoved", "GPU"),
        ]
        assert [e.block_hashes for e in batch.events] == [[1, 2, 3], [4, 5], [9], [6], [7]]
        assert batch.folds == {0: 2, 1: 2}


async def _indexer_after(messages: list[list[bytes]]) -> tuple[KVIndexer, CollectorRegistry]:
    registry = CollectorRegistry()
    indexer = KVIndexer(MemoryIndex(), metrics=IndexerMetrics(registry))
    indexer.register_worker("w", "m")
    for message in messages:
        await indexer.handle_message("w", message)
    return indexer, registry


@settings(max_examples=60, deadline=None)
@given(
    removals=st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["GPU", "CPU"])), max_size=20),
    cpu_blocks=st.integers(0, 8),
)
async def test_a_folded_run_leaves_the_index_and_counters_as_one_by_one(
    removals: list[tuple[int, str]], cpu_blocks: int
) -> None:
    chain = Chain()
    stores = (
        [chain.store(PROMPT), chain.store(PROMPT[: cpu_blocks * 16], medium="CPU")]
        if cpu_blocks
        else [chain.store(PROMPT)]
    )
    removes = [chain.remove(PROMPT, [block], medium=medium) for block, medium in removals]
    together, reg_a = await _indexer_after([frames(stores, 0), frames(removes, 1)])
    apart, reg_b = await _indexer_after([frames(stores, 0), *(frames([r], 1 + i) for i, r in enumerate(removes))])
    a = await together.lookup_tokens("m", PROMPT)
    b = await apart.lookup_tokens("m", PROMPT)
    assert a.matches == b.matches
    for name in ("kvroute_index_events_received_total", "kvroute_index_events_applied_total"):
        labels = {"worker": "w", "type": "BlockRemoved"}
        assert reg_a.get_sample_value(name, labels) == reg_b.get_sample_value(name, labels) == (len(removes) or None)
    labels = {"worker": "w"}
    assert reg_a.get_sample_value("kvroute_index_blocks", labels) == reg_b.get_sample_value(
        "kvroute_index_blocks", labels
    )
