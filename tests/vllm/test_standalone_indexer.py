"""``kvroute indexer`` (its own process) keeps a Redis index of the real pool that router replicas read.

Two views are checked against vLLM's ``cached_tokens``: the indexer's admin lookup, and a reader
process-side ``KVIndexer`` over the same Redis (what a router with ``index.subscribe: false`` does).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from kvroute.indexer.redis_index import RedisIndex
from kvroute.indexer.service import KVIndexer

from .indexed import IndexedPool
from .router_proc import make_router, router_config
from .servers import BLOCK_SIZE, MODEL_NAME, VllmServer, free_port
from .workload import ReferenceTokenizer, complete, engine_cached, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600, func_only=True)]

PREFIX = "kvr-vllm-standalone"


@pytest.fixture
def standalone_indexer(vllm_pool: list[VllmServer], tiny_model: Path, tmp_path: Path, redis_url: str) -> Iterator[str]:
    """``python -m kvroute.apps.cli indexer --config ...`` with its admin port; yields that port's URL."""
    config = router_config(vllm_pool, tiny_model, free_port(), "round_robin")
    config["index"].update(backend="redis", redis_url=redis_url, redis_prefix=PREFIX)
    path = tmp_path / "indexer.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = tmp_path / "indexer.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute.apps.cli", "indexer", "--config", str(path), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"kvroute indexer exited:\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"kvroute indexer not up:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class ReaderPool(IndexedPool):
    """Predictions from Redis as a router replica reads it; barriers through the indexer's admin API."""

    admin: str = ""
    http: httpx.AsyncClient | None = None

    async def matched_blocks(self, worker: str, tokens: list[int], cache_salt: str | None = None) -> int:
        assert self.indexer is not None and self.http is not None
        result = await self.indexer.lookup_tokens(MODEL_NAME, tokens, cache_salt=cache_salt)
        match = result.matches.get(worker)
        reader = 0 if match is None else match.blocks
        resp = await self.http.post(
            f"{self.admin}/admin/index/lookup",
            json={"model": MODEL_NAME, "token_ids": tokens, "cache_salt": cache_salt},
        )
        assert resp.status_code == 200, resp.text
        admin = next((row["blocks"] for row in resp.json()["matches"] if row["worker"] == worker), 0)
        assert admin == reader, f"the indexer's admin view ({admin}) and the Redis reader ({reader}) differ"
        return reader


@pytest.fixture
async def reader(
    vllm_pool: list[VllmServer],
    standalone_indexer: str,
    redis_url: str,
    reference_tokenizer: ReferenceTokenizer,
    http: httpx.AsyncClient,
) -> AsyncIterator[ReaderPool]:
    backend = RedisIndex(redis_url, prefix=PREFIX)
    pool = ReaderPool(vllm_pool, backend, reference_tokenizer)
    pool.indexer = KVIndexer(backend, block_sizes={MODEL_NAME: BLOCK_SIZE})
    pool.admin, pool.http = standalone_indexer, http
    yield pool
    await backend.close()


async def test_standalone_indexer_predicts_exactly(
    reader: ReaderPool, vllm_pool: list[VllmServer], http: httpx.AsyncClient, rng: random.Random
) -> None:
    for server in vllm_pool:
        await reader.sync(server, http, rng)  # the indexer is connected to this worker
    for server in vllm_pool:
        system = prompt_words(rng, 120)
        prompts = [prompt_words(rng, 110) for _ in range(2 * 64 // 5)]
        for i, prompt in enumerate(prompts):
            await complete(http, server.url, prompt, max_tokens=24 if i % 3 == 0 else 1)
            if i % 4 == 0:
                await complete(http, server.url, system + " " + prompt_words(rng, 10))
        await reader.probe(server, http, rng, prompt=system + " " + prompt_words(rng, 10))
        await reader.probe(server, http, rng, prompt=prompts[0] + " x")
        await reader.probe(server, http, rng, prompt=prompts[-1] + " y")
        await reader.probe(
            server,
            http,
            rng,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": prompt_words(rng, 9)}],
        )
        await reader.probe(
            server,
            http,
            rng,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": prompt_words(rng, 9)}],
        )
    reader.assert_all_exact()
    assert any(p.cached > 0 for p in reader.probes)


async def test_router_replica_routes_by_the_shared_index(
    reader: ReaderPool,
    vllm_pool: list[VllmServer],
    tiny_model: Path,
    tmp_path: Path,
    redis_url: str,
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """kvroute serve with ``index.subscribe: false`` routes by what the stand-alone indexer wrote."""
    replica = make_router(
        vllm_pool,
        tiny_model,
        tmp_path,
        index={
            "backend": "redis",
            "redis_url": redis_url,
            "redis_prefix": PREFIX,
            "subscribe": False,
            "events_bind": None,
        },
    )
    replica.start()
    try:
        for server in [*vllm_pool, *reversed(vllm_pool)]:
            await reader.sync(server, http, rng)  # the indexer has everything this worker did so far
            prompt = prompt_words(rng, 200)
            blocks = len(reference_tokenizer.completion(prompt)) // BLOCK_SIZE
            await complete(http, server.url, prompt)
            await reader.sync(server, http, rng)
            probe = prompt + " " + prompt_words(rng, 8)
            resp = await http.post(
                f"{replica.url}/v1/completions",
                headers={"X-KVRoute-Debug": "1"},
                json={"model": MODEL_NAME, "prompt": probe, "max_tokens": 1, "temperature": 0},
            )
            assert resp.status_code == 200, resp.text
            plan = json.loads(resp.headers["x-kvroute-plan"])
            assert plan["prefill"] == server.name, plan
            expected = engine_cached(len(reference_tokenizer.completion(probe)), blocks)
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == expected > 0
            assert plan["predicted_cached_tokens"] == expected, plan
    finally:
        replica.stop()
