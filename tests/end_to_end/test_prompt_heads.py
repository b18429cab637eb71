"""A long new prompt is decided on its head through the router, and the rest is encoded after it went out."""

from __future__ import annotations

import httpx
import orjson
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.sim.fleet import SimFleet

from tests.end_to_end.conftest import words
from tests.end_to_end.test_end_to_end import metric
from tests.http.upstream import serve
from tests.polling import eventually


async def test_a_long_new_prompt_is_decided_on_its_head_and_its_repeat_on_the_whole() -> None:
    async with SimFleet(2, "tiny") as fleet:
        config = fleet.serve_config(policy="kvaware", health_interval_s=0.2, metrics_interval_s=0.2, debug_headers=True)
        async with (
            serve(build_app(RouterConfig.model_validate(config)), lifespan="on") as url,
            httpx.AsyncClient(timeout=30) as client,
        ):
            prompt = words(900, "a-long-paragraph-of-a-new-document-")  # 900 tokens, ~33k characters nobody has seen
            body = {"model": fleet.model, "prompt": prompt, "max_tokens": 2}
            headers = {"x-kvroute-debug": "1"}

            async def scrape(name: str, **labels: str) -> float:
                return metric((await client.get(f"{url}/metrics")).text, name, **labels)

            first = await client.post(f"{url}/v1/completions", json=body, headers=headers)
            assert first.status_code == 200, first.text
            assert first.json()["usage"]["prompt_tokens"] == 900
            plan = orjson.loads(first.headers["x-kvroute-plan"])
            assert await scrape("kvroute_prompt_heads_total", outcome="decided") == 1

            # The rest was encoded after the answer's request went out: the tokenizer's cache holds it whole.
            async def rest_encoded() -> bool:
                return await scrape("kvroute_prefix_cache_events_total", event="prefix_hits") >= 1

            await eventually(rest_encoded, what="the rest encoded")

            again = await client.post(f"{url}/v1/completions", json=body, headers=headers)
            assert again.status_code == 200, again.text
            # Its head is held whole now: decided on the whole prompt, where its KV is, served from cache.
            assert await scrape("kvroute_prompt_heads_total", outcome="decided") == 1
            assert await scrape("kvroute_prefix_cache_events_total", event="hits") >= 1
            assert orjson.loads(again.headers["x-kvroute-plan"])["prefill"] == plan["prefill"]
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 850
            assert await scrape("kvroute_prompt_heads_total", outcome="mismatch") == 0
