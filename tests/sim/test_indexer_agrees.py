"""The project's own indexer, fed the sim's events through the replay socket, sees exactly the sim's cache."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import zmq
import zmq.asyncio
from kvroute.indexer.events import REPLAY_END_SEQ
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.service import KVIndexer

from tests.sim.conftest import words


async def _replay_into(indexer: KVIndexer, worker: Any) -> int:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker.replay_endpoint)
    await sock.send_multipart([b"", struct.pack(">Q", 0)])
    applied = 0
    try:
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), 10)
            topic, seq, payload = frames[1:]
            if seq == REPLAY_END_SEQ:
                return applied
            handled = await indexer.handle_message(worker.worker_id, [topic, seq, payload], replay=True)
            assert handled.outcome == "applied", handled
            applied += 1
    finally:
        sock.close()


async def test_index_matches_the_sim_cache_per_tier(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(2, preset_overrides={"gpu_blocks": 16, "cpu_blocks": 32})
    w0, w1 = fleet.workers
    prompts = [words(100, "a"), words(90, "b"), words(120, "c"), words(60, "d")]
    for i, prompt in enumerate(prompts):  # w0 overflows its 16 GPU blocks: evictions + CPU offload
        r = await client.post(f"{w0.url}/v1/completions", json={"prompt": prompt, "max_tokens": 20})
        assert r.status_code == 200
        if i == 0:
            r = await client.post(f"{w1.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    await asyncio.sleep(0)  # let the last step's batch flush
    indexer = KVIndexer(MemoryIndex())
    for w in fleet.workers:
        indexer.register_worker(w.worker_id, fleet.model)
        assert await _replay_into(indexer, w) > 0
    for prompt in prompts:
        tokens = w0.tokenizer.encode(prompt)
        result = await indexer.lookup_tokens(fleet.model, tokens)
        for w in fleet.workers:
            n_gpu, n_cpu = w.engine.cache.match(w.engine.cache.block_hashes(tokens))
            match = result.matches.get(w.worker_id)
            got = (match.gpu, match.cpu) if match else (0, 0)
            assert got == (n_gpu, n_cpu), (w.worker_id, prompt[:10])
    assert w0.engine.cache.cpu  # the scenario really exercised the CPU tier
