"""The project's indexer, fed a vLLM 0.33-style sim's events through its replay socket, predicts exactly the
cached tokens the engine then serves: with lookahead hashing (EAGLE) and for a hybrid model whose
sliding-window group cuts a full-attention hit down."""

from __future__ import annotations

from typing import Any

from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.service import KVIndexer
from prometheus_client import CollectorRegistry

from tests.sim.conftest import words
from tests.sim.test_indexer_agrees import _replay_into
from tests.sim.test_transfers import cached, complete


async def indexed(worker: Any, model: str) -> KVIndexer:
    """A fresh indexer that has read every batch the worker published so far."""
    indexer = KVIndexer(MemoryIndex(), metrics=IndexerMetrics(CollectorRegistry()))
    indexer.register_worker(worker.worker_id, model)
    assert await _replay_into(indexer, worker) > 0
    return indexer


async def predicted(indexer: KVIndexer, worker: Any, model: str, prompt: str) -> int:
    """Cached tokens the index predicts for ``prompt`` on ``worker`` (vLLM computes the last prompt token)."""
    tokens = worker.tokenizer.encode(prompt)
    match = (await indexer.lookup_tokens(model, tokens)).matches.get(worker.worker_id)
    size = worker.opts.preset.block_size
    return min(match.blocks, (len(tokens) - 1) // size) * size if match else 0


async def test_lookahead_engine_served_what_the_index_predicted(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, hash_lookahead_tokens=1)
    w = fleet[0]
    base = words(100)
    await complete(client, w.url, base)
    head = base.split()
    cases = [
        " ".join(head[:48] + words(52, "x").split()),  # token 48 differs: block 2's hash covers it
        " ".join(head[:64]),  # ends on a block boundary: its last block's lookahead token is missing
        " ".join(head[:65]),
        base,
    ]
    served = []
    for prompt in cases:
        indexer = await indexed(w, fleet.model)
        expected = await predicted(indexer, w, fleet.model, prompt)
        served.append(cached(await complete(client, w.url, prompt)))
        assert expected == served[-1], prompt[:40]
    assert served == [32, 48, 64, 96]


async def test_hybrid_engine_served_what_the_index_predicted(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, hybrid_sliding_window=32)
    w = fleet[0]
    swa = w.engine.cache.swa
    assert swa is not None
    swa.capacity = 8  # a small sliding-window pool: a prompt's out-of-window blocks go first
    first = words(100)
    await complete(client, w.url, first)
    await complete(client, w.url, words(100, "other-"))
    shared = " ".join(first.split()[:64]) + " tail"
    indexer = await indexed(w, fleet.model)
    tokens = w.tokenizer.encode(shared)
    plain = await indexer.lookup_keys(fleet.model, (await indexer.lookup_tokens(fleet.model, tokens)).keys)
    assert plain[w.worker_id].blocks == 4  # full attention alone holds 4 blocks of it ...
    assert await predicted(indexer, w, fleet.model, shared) == 0  # ... but their window went
    served = []
    for prompt in (shared, first, words(100, "other-"), words(40, "new-")):
        indexer = await indexed(w, fleet.model)
        expected = await predicted(indexer, w, fleet.model, prompt)
        served.append(cached(await complete(client, w.url, prompt)))
        assert expected == served[-1], prompt[:40]
    assert served[0] == 0 and served[1] == 96
