"""Per-source ground truth: the engines' ``vllm:prompt_tokens_cached_by_source`` is scraped and exported next
to kvroute's prediction per source, so an operator sees predicted against served on one dashboard."""

from __future__ import annotations

import httpx

from tests.end_to_end.conftest import eventually, routed_fleet, words


def samples(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            source = next(p.split("=")[1].strip('"') for p in labels.split(",") if p.startswith("source="))
            out[source] = out.get(source, 0.0) + float(value)
    return out


async def test_predicted_and_served_cached_tokens_per_source(client: httpx.AsyncClient) -> None:
    async with routed_fleet(2) as (fleet, url, _app):
        prompts = [words(400, f"gt{i}") for i in range(3)]
        served = 0
        for prompt in prompts:
            await client.post(url + "/v1/completions", json={"model": fleet.model, "prompt": prompt})

        async def indexed() -> bool:
            for prompt in prompts:
                found = await client.post(url + "/admin/index/lookup", json={"model": fleet.model, "prompt": prompt})
                if not any(row["blocks"] for row in found.json()["matches"]):
                    return False
            return True

        await eventually(indexed, timeout=20, what="the prompts indexed")
        for prompt in prompts:
            r = await client.post(url + "/v1/completions", json={"model": fleet.model, "prompt": prompt})
            served += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert served > 0

        async def scraped() -> dict[str, float]:
            engine = samples((await client.get(url + "/metrics")).text, "kvroute_engine_cached_tokens_by_source")
            return engine if sum(engine.values()) >= served else {}

        engine = await eventually(scraped, timeout=20, what="the engines' per-source counters scraped")
        predicted = samples(
            (await client.get(url + "/metrics")).text, "kvroute_predicted_cached_tokens_by_source_total"
        )
    assert engine.get("device", 0) == served  # a GPU-only fleet: every hit from the device
    assert predicted.get("device", 0) == served  # and the router predicted exactly that


async def test_prefix_cache_series_count_a_growing_conversation(client: httpx.AsyncClient) -> None:
    """An agent's next step repeats its history: the decision path reuses tokens and block keys, and says so."""
    async with routed_fleet(2) as (fleet, url, _app):
        history = words(500, "agent")
        for step in range(4):
            history += " " + words(40, f"step{step}x")
            r = await client.post(url + "/v1/completions", json={"model": fleet.model, "prompt": history})
            assert r.status_code == 200
        text = (await client.get(url + "/metrics")).text
    reused = {
        line.split("event=")[1].split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('kvroute_prefix_cache_events_total{cache="block_keys"')
    }
    assert reused["blocks_reused"] > 0 and reused["prefix_hits"] >= 3
    assert 'kvroute_prefix_cache_bytes{cache="block_keys",model="*"}' in text
