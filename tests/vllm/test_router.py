"""kvroute serve + the kvaware policy in front of real vLLM: prefix affinity and oracle-level hits.

The router is started as a user would (``python -m kvroute.apps.cli serve --config``), with debug headers
on so each answer names the chosen worker (``X-KVRoute-Plan``). The oracle is the tier's own mirror
of every engine's cache (:mod:`tests.vllm.mirror`), not kvroute's index.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .kvwire import wait_for
from .mirror import Oracle
from .router_proc import RouterProcess, make_router
from .servers import BLOCK_SIZE, MODEL_NAME, NUM_BLOCKS, VllmServer
from .workload import ReferenceTokenizer, chat, complete, engine_cached, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900, func_only=True)]

DEBUG = {"X-KVRoute-Debug": "1"}


@pytest.fixture
def router(vllm_pool: list[VllmServer], tiny_model: Path, tmp_path: Path) -> Iterator[RouterProcess]:
    # A negative control at a shell: KVROUTE_VLLM_TIER_POLICY=round_robin makes the oracle test fail.
    policy = os.environ.get("KVROUTE_VLLM_TIER_POLICY", "kvaware")
    proc = make_router(vllm_pool, tiny_model, tmp_path, policy=policy)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


async def index_lookup(http: httpx.AsyncClient, router: RouterProcess, tokens: list[int]) -> dict[str, int]:
    """Blocks per worker in the router's index (its admin API); skips while the router has no index."""
    body = {"model": MODEL_NAME, "token_ids": tokens}
    resp = await http.post(f"{router.url}/admin/index/lookup", json=body)
    if resp.status_code == 404:
        pytest.skip(
            "kvroute serve does not expose its index yet (POST /admin/index/lookup is 404): "
            "the router's index wiring is not there"
        )
    assert resp.status_code == 200, resp.text
    return {row["worker"]: row["blocks"] for row in resp.json()["matches"]}


async def routed(
    http: httpx.AsyncClient, router: RouterProcess, body: dict[str, Any], path: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Send through the router; return vLLM's answer and the router's plan."""
    resp = await http.post(f"{router.url}{path}", json={"model": MODEL_NAME, "temperature": 0, **body}, headers=DEBUG)
    assert resp.status_code == 200, resp.text[:500]
    plan = resp.headers.get("x-kvroute-plan")
    assert plan, "no X-KVRoute-Plan header: debug_headers is on in the config"
    return resp.json(), json.loads(plan)


def cached_of(answer: dict[str, Any]) -> int:
    return int(((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def place_prefix(
    http: httpx.AsyncClient,
    router: RouterProcess,
    server: VllmServer,
    tokenizer: ReferenceTokenizer,
    rng: random.Random,
) -> str:
    """Send a fresh prompt straight to one worker and wait until the router's index shows it there."""
    for _ in range(10):
        prompt = prompt_words(rng, 200)
        tokens = tokenizer.completion(prompt)
        await complete(http, server.url, prompt)
        try:
            await wait_for(lambda t=tokens: _holds(http, router, server.name, t), 10.0, what="prefix")
            return prompt
        except AssertionError:
            continue  # the router's SUB may have connected after that batch: try a new prompt
    raise AssertionError(f"the router's index never showed a prefix placed on {server.name}")


async def _holds(http: httpx.AsyncClient, router: RouterProcess, worker: str, tokens: list[int]) -> bool:
    return (await index_lookup(http, router, tokens)).get(worker, 0) >= len(tokens) // BLOCK_SIZE


async def test_proxy_against_real_vllm(
    vllm_pool: list[VllmServer],
    tiny_model: Path,
    tmp_path: Path,
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """Without any index: kvroute serve proxies real vLLM (JSON, SSE with usage, /tokenize, /v1/models)."""
    proc = make_router(vllm_pool, tiny_model, tmp_path, policy="round_robin")
    proc.start()
    try:
        models = (await http.get(f"{proc.url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        messages = [{"role": "user", "content": prompt_words(rng, 40)}]
        resp = await http.post(
            f"{proc.url}/tokenize", json={"model": MODEL_NAME, "messages": messages, "add_generation_prompt": True}
        )
        assert resp.status_code == 200 and resp.json()["tokens"] == reference_tokenizer.chat(messages)
        body = {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chunks = []
        async with http.stream("POST", f"{proc.url}/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
        assert chunks[-1] == "[DONE]"
        usage = json.loads(chunks[-2])["usage"]
        assert usage["prompt_tokens"] == len(reference_tokenizer.chat(messages))
        assert "cached_tokens" in usage["prompt_tokens_details"]
        text = "".join(
            json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if json.loads(c)["choices"]
        )
        direct = await chat(http, vllm_pool[0].url, messages, max_tokens=8)
        assert text == direct.text  # temperature 0: the same answer through the router
    finally:
        proc.stop()


async def test_oracle_is_exact(
    vllm_pool: list[VllmServer], http: httpx.AsyncClient, rng: random.Random, reference_tokenizer: ReferenceTokenizer
) -> None:
    """The tier's oracle itself matches the engine (copies of a recomputed block included)."""
    server = vllm_pool[0]
    oracle = Oracle([server])
    ids = [rng.randrange(10, 1000) for _ in range(3 * BLOCK_SIZE)]
    await complete(http, server.url, ids)
    await complete(http, server.url, ids)  # a second copy of the last block
    shortfalls = []
    for _ in range(NUM_BLOCKS // 3):  # about 1.5 caches of traffic: the older copy gets evicted
        await complete(http, server.url, prompt_words(rng, 100), max_tokens=1)
        for prompt in ([*ids, rng.randrange(10, 1000)], prompt_words(rng, 5)):
            await oracle.catch_up()
            tokens = prompt if isinstance(prompt, list) else reference_tokenizer.completion(prompt)
            expected = oracle.per_worker(tokens)[server.name]
            answer = await complete(http, server.url, prompt)
            if answer.cached_tokens != expected:
                shortfalls.append((expected, answer.cached_tokens))
    assert not shortfalls, shortfalls


async def test_prefix_goes_to_its_worker(
    router: RouterProcess,
    vllm_pool: list[VllmServer],
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """A prompt whose prefix lives on one worker goes there, and vLLM reports the predicted hit."""
    for server in [*vllm_pool, *reversed(vllm_pool)]:
        prompt = await place_prefix(http, router, server, reference_tokenizer, rng)
        tokens = reference_tokenizer.completion(prompt)
        probe = prompt + " " + prompt_words(rng, 10)
        answer, plan = await routed(http, router, {"prompt": probe, "max_tokens": 1}, "/v1/completions")
        assert plan["prefill"] == server.name, plan
        expected = engine_cached(len(reference_tokenizer.completion(probe)), len(tokens) // BLOCK_SIZE)
        assert cached_of(answer) == expected > 0
        assert plan["predicted_cached_tokens"] == expected, plan


async def test_chat_prefix_goes_to_its_worker(
    router: RouterProcess,
    vllm_pool: list[VllmServer],
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """The same through /v1/chat/completions: the router's chat tokens match the engine's blocks."""
    for server in vllm_pool:
        messages = [
            {"role": "system", "content": prompt_words(rng, 150)},
            {"role": "user", "content": prompt_words(rng, 20)},
        ]
        tokens = reference_tokenizer.chat(messages)
        await chat(http, server.url, messages, max_tokens=8)
        await wait_for(lambda t=tokens, s=server: _holds(http, router, s.name, t), 30.0, what="chat prefix")
        follow = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
        body = {"messages": follow, "max_tokens": 1}
        answer, plan = await routed(http, router, body, "/v1/chat/completions")
        assert plan["prefill"] == server.name, plan
        assert cached_of(answer) >= len(tokens) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE > 0


async def test_agentic_turns_reach_the_oracle(
    router: RouterProcess,
    vllm_pool: list[VllmServer],
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """Interleaved agent sessions (shared tool preamble, growing histories): per request, the cached
    tokens vLLM reports are within one block of the best any worker held just before it was sent."""
    await place_prefix(http, router, vllm_pool[0], reference_tokenizer, rng)  # index connected
    oracle = Oracle(vllm_pool)
    tools = "tools: read_file write_file run_tests search. " + prompt_words(rng, 80)
    sessions = [[{"role": "system", "content": tools + " session " + str(i)}] for i in range(3)]
    shortfalls = []
    total_cached = total_oracle = requests = 0
    for turn in range(6):
        order = list(range(len(sessions)))
        rng.shuffle(order)  # an odd count in a shuffled order: no policy sticks to a session by chance
        for i in order:
            messages = sessions[i]
            messages.append({"role": "user", "content": f"step {turn}: " + prompt_words(rng, 30)})
            await oracle.catch_up()
            best = oracle.best(reference_tokenizer.chat(messages))
            answer, plan = await routed(http, router, {"messages": messages, "max_tokens": 16}, "/v1/chat/completions")
            cached = cached_of(answer)
            requests += 1
            total_cached += cached
            total_oracle += best
            if cached < best - BLOCK_SIZE:
                shortfalls.append(
                    (turn, i, plan["prefill"], cached, best, oracle.per_worker(reference_tokenizer.chat(messages)))
                )
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    print(f"cached {total_cached} / oracle {total_oracle}")
    assert total_oracle > 0
    assert not shortfalls, f"requests more than one block below the oracle: {shortfalls}"
    assert total_cached >= total_oracle - BLOCK_SIZE * requests


async def test_router_restart_rebuilds_through_replay(
    router: RouterProcess,
    vllm_pool: list[VllmServer],
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """A router restarted mid-run learns, through the replay endpoint, what the engines cached before
    and while it was away."""
    prompts = {s.name: await place_prefix(http, router, s, reference_tokenizer, rng) for s in vllm_pool}
    router.stop()
    missed = {}
    for server in vllm_pool:  # cached while no router listens
        missed[server.name] = prompt_words(rng, 200)
        await complete(http, server.url, missed[server.name])
    router.start()
    for server in vllm_pool:
        # Traffic goes on (straight to the worker): its first batch makes the router catch up from
        # the replay buffer. An idle worker's history is only fetched once it publishes again.
        await place_prefix(http, router, server, reference_tokenizer, rng)
        for prompt in (prompts[server.name], missed[server.name]):
            tokens = reference_tokenizer.completion(prompt)
            await wait_for(
                lambda t=tokens, s=server: _holds(http, router, s.name, t),
                15.0,
                what=f"{server.name}'s blocks rebuilt after the router restart",
            )


async def _device_cached(http: httpx.AsyncClient, server: VllmServer) -> float:
    """The engine's own ground truth: ``vllm:prompt_tokens_cached_by_source_total{source="device"}``."""
    text = (await http.get(f"{server.url}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_cached_by_source_total{") and 'source="device"' in line
    )


async def test_per_source_ground_truth_equals_the_prediction(
    router: RouterProcess,
    vllm_pool: list[VllmServer],
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """vLLM's per-source counter moves by exactly the GPU hit kvroute predicted for the routed request."""
    server = vllm_pool[0]
    prompt = await place_prefix(http, router, server, reference_tokenizer, rng)
    before = await _device_cached(http, server)
    probe = prompt + " " + prompt_words(rng, 10)
    answer, plan = await routed(http, router, {"prompt": probe, "max_tokens": 1}, "/v1/completions")
    assert plan["prefill"] == server.name, plan
    after = before
    for _ in range(100):  # the counter is updated when the engine logs its stats
        after = await _device_cached(http, server)
        if after > before:
            break
        await asyncio.sleep(0.1)
    assert after - before == cached_of(answer) == plan["predicted_by_tier"].get("GPU", 0) > 0, plan
