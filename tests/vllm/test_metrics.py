"""The router's /metrics scraper reads real vLLM's page: block size, prefix-cache counters, load gauges."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import httpx
import pytest
from kvroute.router.registry import WorkerLoad, parse_vllm_metrics

from .servers import BLOCK_SIZE, VllmServer
from .workload import complete, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300, func_only=True)]


async def scrape(http: httpx.AsyncClient, server: VllmServer) -> WorkerLoad:
    """The page as the router reads it (only the lines it needs), checked against the whole page parsed."""
    resp = await http.get(f"{server.url}/metrics")
    assert resp.status_code == 200
    load = parse_vllm_metrics(resp.text)
    whole = parse_vllm_metrics(resp.text, whole_page=True)
    assert dataclasses.replace(load, scraped_at=0.0) == dataclasses.replace(whole, scraped_at=0.0)
    return load


@pytest.mark.parametrize("which", [0, 1])
async def test_scraped_counters_follow_requests(
    which: int, vllm_pool: list[VllmServer], http: httpx.AsyncClient, rng: random.Random
) -> None:
    server = vllm_pool[which]
    before = await scrape(http, server)
    assert before.block_size == BLOCK_SIZE, "vllm:cache_config_info{block_size} not read"
    assert 0.0 <= before.kv_usage <= 1.0
    prompt = prompt_words(rng, 120)
    first = await complete(http, server.url, prompt)
    second = await complete(http, server.url, prompt)
    assert second.cached_tokens > 0
    queried = first.prompt_tokens + second.prompt_tokens
    # Counters are recorded by the API process as engine outputs arrive: give them a moment.
    for _ in range(50):
        after = await scrape(http, server)
        if after.prefix_queries - before.prefix_queries >= queried:
            break
        await asyncio.sleep(0.2)
    # Tests run one at a time, so these two requests are all the server did in between.
    assert after.prefix_queries - before.prefix_queries == queried
    assert after.prefix_hits - before.prefix_hits == first.cached_tokens + second.cached_tokens
    assert after.running == 0 and after.waiting == 0
