"""Per-source ground truth (``vllm:prompt_tokens_cached_by_source``) agrees with each answer's
``usage.prompt_tokens_details.cached_tokens``, tier by tier; ``max_load_tokens`` caps the loads."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sim.conftest import words
from tests.sim.test_transfers import NIXL_PREFILL, cached, complete, metric, peer, sent_bytes

SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


async def by_source(client: Any, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    return {s: metric(text, "vllm:prompt_tokens_cached_by_source_total", source=s) for s in SOURCES}


async def test_every_source_is_exported_from_zero(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    w = fleet[0]
    text = (await client.get(f"{w.url}/metrics")).text
    assert "# TYPE vllm:prompt_tokens_cached_by_source counter" in text or "vllm:prompt_tokens_cached_by_source" in text
    for source in SOURCES:  # vLLM pre-creates every (engine, source) series
        line = f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="{w.model}",source="{source}"}} 0.0'
        assert line in text
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="{w.model}",source="{source}"}}' in text


async def test_device_hits_sum_to_cached_tokens(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    w = fleet[0]
    answers = [await complete(client, w.url, words(100)) for _ in range(3)]
    assert [cached(a) for a in answers] == [0, 96, 96]
    got = await by_source(client, w.url)
    assert got == {"device": 192, "host": 0, "p2p": 0, "disk": 0, "external_unspecified": 0}
    text = (await client.get(f"{w.url}/metrics")).text
    assert metric(text, "vllm:prefix_cache_hits_total") == got["device"]
    assert metric(text, "vllm:prompt_tokens_cached_total") == 192
    computed = metric(text, "vllm:prompt_tokens_by_source_total", source="local_compute")
    local = metric(text, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert computed + local == metric(text, "vllm:prompt_tokens_total") == 300 and local == 192


async def test_cpu_tier_hits_are_host(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, preset_overrides={"gpu_blocks": 8, "cpu_blocks": 16})
    w = fleet[0]
    for tag in ("a-", "b-", "c-"):  # each evicts the one before it into the CPU tier
        await complete(client, w.url, words(65, tag), max_tokens=1)
    before = await by_source(client, w.url)
    again = await complete(client, w.url, words(65, "a-"), max_tokens=1)
    after = await by_source(client, w.url)
    delta = {s: after[s] - before[s] for s in SOURCES}
    assert delta["host"] > 0 and delta["device"] + delta["host"] == cached(again) == 64
    assert delta["p2p"] == delta["disk"] == delta["external_unspecified"] == 0
    text = (await client.get(f"{w.url}/metrics")).text
    external = metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert external == after["host"]  # the CPU tier is a connector: "external" in vLLM's breakdown


async def test_fetched_blocks_are_p2p(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(2)
    a, b = fleet.workers
    prompt = words(200)
    await complete(client, a.url, prompt)
    answer = await complete(client, b.url, prompt, {"remote_kv_source": peer(a)})
    assert cached(answer) == 192
    assert await by_source(client, b.url) == {"device": 0, "host": 0, "p2p": 192, "disk": 0, "external_unspecified": 0}
    # NIXL pull P/D counts as p2p too (vLLM's NixlConnector reports CacheHitSource.P2P).
    fleet2 = await make_fleet(2, roles=["prefill", "decode"])
    p, d = fleet2.workers
    params = (await complete(client, p.url, words(100, "n-"), dict(NIXL_PREFILL), max_tokens=1))["kv_transfer_params"]
    dec = await complete(client, d.url, words(100, "n-"), params, max_tokens=2)
    assert (await by_source(client, d.url))["p2p"] == cached(dec) == 96


# -- max_load_tokens -------------------------------------------------------------------------------------


async def _offloaded(make_fleet: Any, client: Any) -> tuple[Any, str, int, int]:
    """A worker whose CPU tier holds most of prompt ``a-``: (worker, prompt, GPU blocks, CPU blocks)."""
    fleet = await make_fleet(1, preset_overrides={"gpu_blocks": 8, "cpu_blocks": 16})
    w = fleet[0]
    for tag in ("a-", "b-", "c-"):
        await complete(client, w.url, words(65, tag), max_tokens=1)
    prompt = words(65, "a-")
    hashes = w.engine.cache.block_hashes(w.tokenizer.encode(prompt))
    n_gpu, n_cpu = w.engine.cache.match(hashes[:4])
    assert n_cpu >= 2
    return w, prompt, n_gpu, n_cpu


@pytest.mark.parametrize("cap_blocks", [0, 1, 2])
async def test_max_load_tokens_caps_cpu_tier_loads(make_fleet: Any, client: Any, cap_blocks: int) -> None:
    w, prompt, n_gpu, n_cpu = await _offloaded(make_fleet, client)
    before = await by_source(client, w.url)
    cap = cap_blocks * 16 + 5  # rounded down to whole blocks, as vLLM rounds to its chunks
    answer = await complete(client, w.url, prompt, {"max_load_tokens": cap}, max_tokens=1)
    after = await by_source(client, w.url)
    assert cached(answer) == (n_gpu + min(n_cpu, cap_blocks)) * 16
    assert after["host"] - before["host"] == min(n_cpu, cap_blocks) * 16


@pytest.mark.parametrize("junk", ["32", -1, True, 1.5, [1]])
async def test_invalid_max_load_tokens_is_ignored_as_vllm_does(make_fleet: Any, client: Any, junk: object) -> None:
    w, prompt, n_gpu, n_cpu = await _offloaded(make_fleet, client)
    answer = await complete(client, w.url, prompt, {"max_load_tokens": junk}, max_tokens=1)
    assert cached(answer) == (n_gpu + n_cpu) * 16  # no cap, no 400


async def test_max_load_tokens_caps_p2p_fetches_but_not_nixl(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(2)
    a, b = fleet.workers
    prompt = words(200)
    await complete(client, a.url, prompt)
    answer = await complete(client, b.url, prompt, {"remote_kv_source": peer(a), "max_load_tokens": 64})
    assert cached(answer) == 64 and (await by_source(client, b.url))["p2p"] == 64
    assert await sent_bytes(client, a.url, "p2p") == 4 * a.opts.preset.bytes_per_block
    # NixlConnector P/D is another connector: max_load_tokens does not apply to its pull.
    fleet2 = await make_fleet(2, roles=["prefill", "decode"])
    p, d = fleet2.workers
    params = (await complete(client, p.url, words(100, "n-"), dict(NIXL_PREFILL), max_tokens=1))["kv_transfer_params"]
    dec = await complete(client, d.url, words(100, "n-"), {**params, "max_load_tokens": 16}, max_tokens=2)
    assert cached(dec) == 96
