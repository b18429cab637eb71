"""Admission and robustness: the concurrency limit queues requests, a dropped stream frees its blocks."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.sim.conftest import words


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    """Poll until ``predicate()`` is true (a readiness wait, never a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_max_num_seqs_queues_the_rest(make_fleet: Any, client: Any) -> None:
    # tiny: 8 sequences, 1 ms decode steps; enough KV space that only the slot limit binds.
    fleet = await make_fleet(1, time_scale=1.0, preset_overrides={"gpu_blocks": 1024})
    w = fleet[0]
    tasks = [
        asyncio.create_task(
            client.post(f"{w.url}/v1/completions", json={"prompt": words(10, f"q{i}-"), "max_tokens": 500})
        )
        for i in range(11)
    ]
    await _until(lambda: w.engine.running == 8 and w.engine.waiting == 3)
    text = (await client.get(f"{w.url}/metrics")).text
    assert 'vllm:num_requests_waiting{engine="0",model_name="sim-tiny"} 3.0' in text
    assert 'vllm:num_requests_running{engine="0",model_name="sim-tiny"} 8.0' in text
    answers = await asyncio.gather(*tasks)
    assert all(a.status_code == 200 for a in answers)
    assert w.engine.running == 0 and w.engine.cache.usage() == 0


async def test_dropped_stream_releases_its_blocks(make_fleet: Any) -> None:
    fleet = await make_fleet(1, time_scale=1.0)
    w = fleet[0]
    async with httpx.AsyncClient(timeout=10) as c:
        body = {"prompt": words(100), "max_tokens": 500, "stream": True}
        async with c.stream("POST", f"{w.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # first token seen: hang up mid-answer
    await _until(lambda: w.engine.running == 0)
    assert w.engine.cache.usage() == 0 and w.engine.decoding == 0
    # The prompt's blocks stay cached (freed, not lost) and the worker keeps serving.
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(f"{w.url}/v1/completions", json={"prompt": words(100), "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
