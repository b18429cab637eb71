"""``kvroute serve --worker URL --worker URL`` on a simulated fleet routes by KV cache with no other setting:
the router asks each worker's ``GET /kv_event_sources`` where it publishes, subscribes, and routes a repeated
prompt to the worker that holds it."""

from __future__ import annotations

import httpx
from kvroute.apps.build import build_app
from kvroute.apps.serve import overrides_from
from kvroute.config import load_config
from kvroute.sim.fleet import SimFleet

from tests.end_to_end.conftest import FAST, eventually, words
from tests.http.upstream import serve


def flags(urls: list[str]) -> object:
    import argparse

    args = argparse.Namespace(
        worker=urls,
        policy=None,
        host=None,
        port=None,
        admin_token=None,
        http_client=None,
        max_body_bytes=None,
        log_level=None,
    )
    return args


async def test_workers_given_by_url_only_are_routed_by_kv_cache(client: httpx.AsyncClient) -> None:
    fleet = SimFleet(2, "tiny", time_scale=FAST)
    async with fleet:
        config = load_config(None, overrides_from(flags(fleet.urls)), environ={})  # type: ignore[arg-type]
        assert config.policy == "kvaware" and all(w.kv_events is None for w in config.workers)
        app = build_app(config)
        async with serve(app, lifespan="on") as url:

            async def subscribed() -> bool:
                metrics = (await client.get(url + "/metrics")).text
                return "kvroute_kv_event_sources 2.0" in metrics

            await eventually(subscribed, timeout=20, what="both workers subscribed")
            prompt = words(600, "shared")
            first = await client.post(url + "/v1/completions", json={"model": fleet.model, "prompt": prompt})
            assert first.status_code == 200

            async def indexed() -> bool:
                lookup = await client.post(url + "/admin/index/lookup", json={"model": fleet.model, "prompt": prompt})
                return any(row["blocks"] > 0 for row in lookup.json()["matches"])

            await eventually(indexed, timeout=20, what="the prompt indexed")
            explained = (
                await client.post(url + "/admin/route/explain", json={"model": fleet.model, "prompt": prompt})
            ).json()
            assert explained["index"]["routing"] == "kv_cache"
            assert explained["plan"]["predicted_cached_tokens"] > 0
            second = await client.post(url + "/v1/completions", json={"model": fleet.model, "prompt": prompt})
            cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= explained["plan"]["predicted_cached_tokens"] - 16 > 0
