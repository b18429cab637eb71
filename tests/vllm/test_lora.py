"""LoRA end to end: kvroute in front of a real vLLM serving a tiny adapter, next to one that does not.

vLLM keys an adapter's blocks with the base model's tokens plus the adapter's name (and path) as extra
keys, and publishes them under the base model with ``lora_name`` and per-block ``extra_keys``. These
tests prove kvroute reproduces that: an adapter request's predicted cached tokens are what the engine
reports, base-model blocks never count for it (nor its blocks for the base), the index holds the
adapter's blocks under the keys its requests compute, and only a worker serving the adapter gets its
requests. The router learns which names are adapters from the workers' ``/v1/models`` (an adapter's
card names its ``parent``), or from ``models[].base_model`` where the workers' models are pinned.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kvroute.indexer.events import BlockStored, decode_batch
from kvroute.indexer.keys import chain_keys, request_keys, root_key

from .kvwire import replay, wait_for
from .router_proc import RouterProcess, make_router
from .servers import (
    BLOCK_SIZE,
    LORA_NAME,
    MODEL_NAME,
    VllmServer,
    ensure_lora,
    make_lora_server,
)
from .workload import ReferenceTokenizer, complete, engine_cached, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900, func_only=True)]

DEBUG = {"X-KVRoute-Debug": "1"}


@pytest.fixture(scope="module")
def tiny_lora(vllm_python: Path, tiny_model: Path) -> Path:
    """Folder of the tiny rank-8 adapter (q_proj / v_proj), built with peft."""
    return ensure_lora(vllm_python, tiny_model)


@pytest.fixture(scope="module")
def lora_server(
    vllm_python: Path, tiny_model: Path, tiny_lora: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A real vLLM serving the base model and the adapter (``--enable-lora --lora-modules``)."""
    server = make_lora_server(vllm_python, tiny_model, tiny_lora, tmp_path_factory.mktemp("vllm-lora-logs"))
    try:
        server.start()
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def start_router(
    lora: VllmServer, base_only: VllmServer, model_dir: Path, workdir: Path, *, configured: bool
) -> RouterProcess:
    """kvroute serve in front of both engines. ``configured``: the LoRA worker's models are pinned and the
    adapter named in ``models[].base_model``; otherwise they are discovered from its /v1/models."""
    proc = make_router([lora, base_only], model_dir, workdir)
    config = yaml.safe_load(proc.config_path.read_text())
    worker = next(w for w in config["workers"] if w["id"] == lora.name)
    if configured:
        worker["models"] = [LORA_NAME, MODEL_NAME]  # the adapter first: its events are still the base's
        config["models"].append({"name": LORA_NAME, "base_model": MODEL_NAME})
    else:
        del worker["models"]
    proc.config_path.write_text(yaml.safe_dump(config))
    proc.start()
    return proc


@pytest.fixture
def router(lora_server: VllmServer, worker_b: VllmServer, tiny_model: Path, tmp_path: Path) -> Iterator[RouterProcess]:
    proc = start_router(lora_server, worker_b, tiny_model, tmp_path, configured=False)
    try:
        yield proc
    finally:
        proc.stop()


async def routed(
    http: httpx.AsyncClient, router: RouterProcess, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Send through the router; return vLLM's answer and the router's plan."""
    resp = await http.post(f"{router.url}{path}", json={"temperature": 0, "max_tokens": 1, **body}, headers=DEBUG)
    assert resp.status_code == 200, resp.text[:500]
    plan = resp.headers.get("x-kvroute-plan")
    assert plan, "no X-KVRoute-Plan header: debug_headers is on in the config"
    return resp.json(), json.loads(plan)


def cached_of(answer: dict[str, Any]) -> int:
    return int(((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def lookup(http: httpx.AsyncClient, router: RouterProcess, body: dict[str, Any]) -> dict[str, Any]:
    """The router's admin index lookup (``model`` + ``token_ids`` | ``prompt`` | ``messages``)."""
    resp = await http.post(f"{router.url}/admin/index/lookup", json=body)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


async def blocks_on(http: httpx.AsyncClient, router: RouterProcess, body: dict[str, Any]) -> dict[str, int]:
    return {row["worker"]: row["blocks"] for row in (await lookup(http, router, body))["matches"]}


async def wait_indexed(
    http: httpx.AsyncClient, router: RouterProcess, worker: str, body: dict[str, Any], blocks: int
) -> bool:
    """Whether the index shows ``blocks`` blocks of ``body``'s prompt on ``worker`` within a few seconds."""
    try:
        await wait_for(
            lambda: _holds(http, router, worker, body, blocks), 10.0, what=f"{blocks} blocks indexed on {worker}"
        )
    except AssertionError:
        return False
    return True


async def _holds(http: httpx.AsyncClient, router: RouterProcess, worker: str, body: dict[str, Any], n: int) -> bool:
    return (await blocks_on(http, router, body)).get(worker, 0) >= n


async def place_adapter_prompt(
    http: httpx.AsyncClient,
    router: RouterProcess,
    lora: VllmServer,
    tokenizer: ReferenceTokenizer,
    rng: random.Random,
    words: int = 200,
) -> str:
    """A fresh adapter prompt sent through the router (nothing cached: predicted 0, engine 0), then seen in
    the index on the LoRA worker. Retried with a new prompt while the router's SUB is still joining."""
    for _ in range(10):
        prompt = prompt_words(rng, words)
        answer, plan = await routed(http, router, {"model": LORA_NAME, "prompt": prompt})
        assert plan["prefill"] == lora.name, plan
        assert plan["predicted_cached_tokens"] == cached_of(answer) == 0, plan
        tokens = tokenizer.completion(prompt)
        if await wait_indexed(
            http, router, lora.name, {"model": LORA_NAME, "token_ids": tokens}, len(tokens) // BLOCK_SIZE
        ):
            return prompt
    raise AssertionError("the router's index never showed the adapter's blocks")


async def place_base_prompt(
    http: httpx.AsyncClient,
    router: RouterProcess,
    server: VllmServer,
    tokenizer: ReferenceTokenizer,
    rng: random.Random,
) -> str:
    """A fresh base-model prompt sent straight to ``server``, then seen in the router's index there."""
    for _ in range(10):
        prompt = prompt_words(rng, 200)
        await complete(http, server.url, prompt)
        tokens = tokenizer.completion(prompt)
        if await wait_indexed(
            http, router, server.name, {"model": MODEL_NAME, "token_ids": tokens}, len(tokens) // BLOCK_SIZE
        ):
            return prompt
    raise AssertionError(f"the router's index never showed a base prompt on {server.name}")


async def test_engine_serves_the_adapter(lora_server: VllmServer, http: httpx.AsyncClient, rng: random.Random) -> None:
    """The CPU build serves the adapter (listed with its parent) and applies it: the text differs."""
    cards = {m["id"]: m for m in (await http.get(f"{lora_server.url}/v1/models")).json()["data"]}
    assert cards[LORA_NAME]["parent"] == MODEL_NAME and cards[MODEL_NAME]["parent"] is None
    prompt = prompt_words(rng, 60)
    base = await complete(http, lora_server.url, prompt, max_tokens=8)
    adapted = await complete(http, lora_server.url, prompt, max_tokens=8, model=LORA_NAME)
    assert adapted.text != base.text
    assert adapted.cached_tokens == 0  # the base request's blocks are not the adapter's


async def test_repeated_adapter_prompt_predicted_equals_engine(
    router: RouterProcess,
    lora_server: VllmServer,
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """A repeated long adapter prompt: kvroute's predicted cached tokens are the engine's, exactly."""
    prompt = await place_adapter_prompt(http, router, lora_server, reference_tokenizer, rng)
    blocks = len(reference_tokenizer.completion(prompt)) // BLOCK_SIZE
    for probe in (prompt, prompt + " " + prompt_words(rng, 10)):
        answer, plan = await routed(http, router, {"model": LORA_NAME, "prompt": probe})
        assert plan["prefill"] == lora_server.name, plan
        expected = engine_cached(len(reference_tokenizer.completion(probe)), blocks)
        assert plan["predicted_cached_tokens"] == cached_of(answer) == expected > 0, plan
    # The fidelity probe has the adapter surface of its own, and it saw these predictions exact.
    text = (await http.get(f"{router.url}/metrics")).text
    exact = [
        line
        for line in text.splitlines()
        if line.startswith("kvroute_prediction_fidelity_total{")
        and 'surface="completions+lora"' in line
        and 'outcome="exact"' in line
    ]
    assert exact and float(exact[0].rsplit(" ", 1)[1]) >= 2, exact


async def test_base_blocks_never_count_for_the_adapter(
    router: RouterProcess,
    lora_server: VllmServer,
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """A prompt cached for the base model on the LoRA worker: the adapter's request is predicted 0 and the
    engine agrees; the base model's own repeat still hits there."""
    prompt = await place_base_prompt(http, router, lora_server, reference_tokenizer, rng)
    tokens = reference_tokenizer.completion(prompt)
    assert (await blocks_on(http, router, {"model": LORA_NAME, "token_ids": tokens})).get(lora_server.name, 0) == 0
    answer, plan = await routed(http, router, {"model": LORA_NAME, "prompt": prompt})
    assert plan["prefill"] == lora_server.name, plan
    assert plan["predicted_cached_tokens"] == cached_of(answer) == 0, plan
    answer, plan = await routed(http, router, {"model": MODEL_NAME, "prompt": prompt})
    assert plan["prefill"] == lora_server.name, plan
    expected = engine_cached(len(tokens), len(tokens) // BLOCK_SIZE)
    assert plan["predicted_cached_tokens"] == cached_of(answer) == expected > 0, plan


async def test_index_keys_of_adapter_events_are_the_requests_keys(
    router: RouterProcess,
    lora_server: VllmServer,
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """The engine's events carry the adapter's identity; the keys kvroute computes from them are the ones
    an adapter request computes, the index holds them on the LoRA worker, and not as base blocks."""
    prompt = await place_adapter_prompt(http, router, lora_server, reference_tokenizer, rng)
    tokens = reference_tokenizer.completion(prompt)
    blocks = len(tokens) // BLOCK_SIZE
    expected = request_keys(tokens, BLOCK_SIZE, MODEL_NAME, lora_name=LORA_NAME)
    assert expected != request_keys(tokens, BLOCK_SIZE, MODEL_NAME)

    # The engine's own events for this prompt: adapter name on the event and on every block.
    stored = [
        e
        for raw in await replay(lora_server)
        for e in decode_batch(raw.payload).events
        if isinstance(e, BlockStored) and e.parent_block_hash is None and e.token_ids == tokens[: blocks * BLOCK_SIZE]
    ]
    assert stored, "no BlockStored event for the adapter prompt in the replay buffer"
    event = stored[-1]
    assert event.lora_name == LORA_NAME
    assert event.extra_keys is not None and [list(x) for x in event.extra_keys] == [[LORA_NAME]] * blocks
    assert chain_keys(event.token_ids, BLOCK_SIZE, root_key(MODEL_NAME), event.extra_keys) == expected

    adapter = await lookup(http, router, {"model": LORA_NAME, "token_ids": tokens})
    assert adapter["lora_name"] == LORA_NAME
    assert adapter["first_keys_hex"] == [f"0x{k:016x}" for k in expected[:4]]
    assert {row["worker"]: row["blocks"] for row in adapter["matches"]}.get(lora_server.name) == blocks
    holders = (await http.get(f"{router.url}/admin/index/blocks/{expected[0]}", params={"model": MODEL_NAME})).json()
    assert lora_server.name in holders["workers"]
    # The same tokens as base-model blocks: nowhere.
    assert (await blocks_on(http, router, {"model": MODEL_NAME, "token_ids": tokens})).get(lora_server.name, 0) == 0


async def test_adapter_requests_go_only_to_workers_serving_it(
    router: RouterProcess,
    lora_server: VllmServer,
    worker_b: VllmServer,
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """``b`` holds a prompt's base blocks and does not serve the adapter: the adapter request goes to the
    LoRA worker (predicted 0, engine 0) while the base request follows the blocks to ``b``."""
    models = {m["id"]: m for m in (await http.get(f"{router.url}/v1/models")).json()["data"]}
    assert models[LORA_NAME]["parent"] == MODEL_NAME
    prompt = await place_base_prompt(http, router, worker_b, reference_tokenizer, rng)
    answer, plan = await routed(http, router, {"model": LORA_NAME, "prompt": prompt})
    assert plan["prefill"] == lora_server.name, plan
    assert plan["predicted_cached_tokens"] == cached_of(answer) == 0, plan
    for _ in range(4):  # fresh adapter prompts: never the worker without the adapter
        _, plan = await routed(http, router, {"model": LORA_NAME, "prompt": prompt_words(rng, 40)})
        assert plan["prefill"] == lora_server.name, plan
    answer, plan = await routed(http, router, {"model": MODEL_NAME, "prompt": prompt})
    assert plan["prefill"] == worker_b.name, plan
    assert plan["predicted_cached_tokens"] == cached_of(answer) > 0, plan


async def test_adapter_chat_with_cache_salt(
    router: RouterProcess,
    lora_server: VllmServer,
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """Adapter name and tenant salt together on block 0, in vLLM's order: the salted adapter chat's next
    turn is predicted as served; another tenant's identical chat is predicted 0 and the engine agrees."""
    messages = [{"role": "system", "content": prompt_words(rng, 150)}, {"role": "user", "content": "go"}]
    tokens = reference_tokenizer.chat(messages)
    body = {"model": LORA_NAME, "messages": messages, "cache_salt": "tenant-a"}
    for _ in range(10):
        await routed(http, router, body, "/v1/chat/completions")
        indexed = {"model": LORA_NAME, "token_ids": tokens, "cache_salt": "tenant-a"}
        if await wait_indexed(http, router, lora_server.name, indexed, len(tokens) // BLOCK_SIZE):
            break
        messages[0]["content"] = prompt_words(rng, 150)  # the router's SUB was still joining: a new chat
        tokens = reference_tokenizer.chat(messages)
    else:
        raise AssertionError("the salted adapter chat never showed in the index")
    follow = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    answer, plan = await routed(http, router, {**body, "messages": follow}, "/v1/chat/completions")
    expected = engine_cached(len(reference_tokenizer.chat(follow)), len(tokens) // BLOCK_SIZE)
    assert plan["predicted_cached_tokens"] == cached_of(answer) == expected > 0, plan
    other = {**body, "cache_salt": "tenant-b"}
    answer, plan = await routed(http, router, other, "/v1/chat/completions")
    assert plan["predicted_cached_tokens"] == cached_of(answer) == 0, plan


async def test_configured_adapter_with_pinned_models(
    lora_server: VllmServer,
    worker_b: VllmServer,
    tiny_model: Path,
    tmp_path: Path,
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """Workers' models pinned in the config (no /v1/models cards): ``models[].base_model`` names the
    adapter's base, and the adapter's repeat is predicted exactly as the engine serves it."""
    proc = start_router(lora_server, worker_b, tiny_model, tmp_path, configured=True)
    try:
        prompt = await place_adapter_prompt(http, proc, lora_server, reference_tokenizer, rng)
        probe = prompt + " " + prompt_words(rng, 10)
        answer, plan = await routed(http, proc, {"model": LORA_NAME, "prompt": probe})
        blocks = len(reference_tokenizer.completion(prompt)) // BLOCK_SIZE
        expected = engine_cached(len(reference_tokenizer.completion(probe)), blocks)
        assert plan["prefill"] == lora_server.name, plan
        assert plan["predicted_cached_tokens"] == cached_of(answer) == expected > 0, plan
    finally:
        proc.stop()
