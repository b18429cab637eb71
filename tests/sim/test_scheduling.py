"""Admission and robustness: the concurrency limit queues requests, a dropped stream frees its blocks."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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


#: 200 prompt tokens take 0.5 s to prefill: long enough to send a second request meanwhile.
SLOW_PREFILL = {"prefill_tokens_per_s": 400.0, "attention_coeff_s": 0.0, "gpu_blocks": 1024}


async def test_a_request_reuses_the_blocks_another_is_still_prefilling(make_fleet: Any, client: Any) -> None:
    # vLLM caches a block when it schedules it: a request admitted during another's prefill reuses its blocks.
    fleet = await make_fleet(1, time_scale=1.0, preset_overrides=SLOW_PREFILL)
    w = fleet[0]
    shared = words(192, "shared-")
    url = f"{w.url}/v1/completions"
    first = asyncio.create_task(client.post(url, json={"prompt": shared + " " + words(8, "a-"), "max_tokens": 1}))
    await _until(lambda: w.engine.running == 1)
    second = await client.post(url, json={"prompt": shared + " " + words(8, "b-"), "max_tokens": 1})
    assert second.status_code == 200
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert first.done(), "the second request's prefill runs after the one computing its prefix"
    assert (await first).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    text = (await client.get(f"{w.url}/metrics")).text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-tiny"} 192.0' in text


async def test_blocks_whose_prefill_is_abandoned_are_computed_by_the_request_waiting_for_them(
    make_fleet: Any, client: Any
) -> None:
    fleet = await make_fleet(1, time_scale=1.0, preset_overrides=SLOW_PREFILL)
    w = fleet[0]
    shared = words(192, "shared-")
    url = f"{w.url}/v1/completions"
    async with httpx.AsyncClient(timeout=10) as first_client:
        first = asyncio.create_task(
            first_client.post(url, json={"prompt": shared + " " + words(8, "a-"), "max_tokens": 1, "stream": True})
        )
        await _until(lambda: w.engine.running == 1)
        second = asyncio.create_task(client.post(url, json={"prompt": shared + " " + words(8, "b-"), "max_tokens": 1}))
        await _until(lambda: w.engine.running == 2)
        first.cancel()  # the first client hangs up during its prefill
        with contextlib.suppress(asyncio.CancelledError):
            await first
    answer = await second
    assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    await _until(lambda: w.engine.running == 0)
    assert w.engine.pending == {} and w.engine.cache.usage() == 0


async def _stream_gaps(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], started: asyncio.Event
) -> list[float]:
    """Seconds between a stream's consecutive chunks (``started`` is set at its first token)."""
    loop = asyncio.get_running_loop()
    stamps: list[float] = []
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(loop.time())
                started.set()
    return [b - a for a, b in itertools.pairwise(stamps)]


async def _stall_seconds(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    line = next(ln for ln in text.splitlines() if ln.startswith("kvroute_sim:decode_stall_seconds_total"))
    return float(line.split()[-1])


async def test_a_prefill_stalls_the_streams_decoding_on_its_worker_only(make_fleet: Any, client: Any) -> None:
    # vLLM steps a worker's decodes together with its prefills: a 0.5 s prefill holds back the next token of
    # every stream decoding there (what P/D disaggregation is for), and no stream on another worker.
    fleet = await make_fleet(2, time_scale=1.0, preset_overrides=SLOW_PREFILL)
    here, there = fleet[0], fleet[1]
    decode = {"prompt": words(4, "d-"), "max_tokens": 3000}  # ~3 s of 1 ms steps
    started = asyncio.Event()
    stream = asyncio.create_task(_stream_gaps(client, f"{here.url}/v1/completions", decode, started))
    await asyncio.wait_for(started.wait(), 10)
    same = await client.post(f"{here.url}/v1/completions", json={"prompt": words(200, "y-"), "max_tokens": 1})
    assert same.status_code == 200
    stalled = await _stall_seconds(client, here.url)
    assert 0.0 < stalled <= 0.5 + 1e-6
    elsewhere = await client.post(f"{there.url}/v1/completions", json={"prompt": words(200, "x-"), "max_tokens": 1})
    assert elsewhere.status_code == 200
    assert not stream.done(), "the stream outlasts both prefills"
    assert await _stall_seconds(client, here.url) == stalled
    gaps = await stream
    # The prefill of 200 tokens at 400 tokens/s is modelled as 0.5 s: no token of the stream comes meanwhile.
    assert max(gaps) >= 0.45
    assert await _stall_seconds(client, there.url) == 0.0
