"""The full router in front of vLLM 0.33-style simulated workers: its predictions equal what the engines
serve with lookahead hashing (EAGLE) and with a hybrid model's sliding-window group, and a prefix-cache
reset of an idle engine, invisible until the engine's next step, is handled as the docs say."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from tests.end_to_end.conftest import eventually, routed_fleet, words


async def routed(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> tuple[int, int, str]:
    """(predicted cached tokens, cached tokens served, worker) of one request through the router."""
    r = await client.post(
        url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2},
        headers={"X-KVRoute-Debug": "1"},
    )
    assert r.status_code == 200, r.text
    plan = orjson.loads(r.headers["x-kvroute-plan"])
    return plan["predicted_cached_tokens"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], plan["prefill"]


#: The admin token the routers here are configured with (routes that change the index need one).
TOKEN = "t0ken"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


async def indexed_blocks(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> dict[str, int]:
    found = await client.post(url + "/admin/index/lookup", json={"model": model, "prompt": prompt}, headers=ADMIN)
    assert found.status_code == 200, found.text
    return {row["worker"]: row["blocks"] for row in found.json()["matches"] if row["blocks"]}


async def settle(client: httpx.AsyncClient, url: str, model: str, prompt: str, blocks: int) -> None:
    """Wait until the router's index holds ``blocks`` blocks of ``prompt`` somewhere (events are asynchronous)."""

    async def there() -> bool:
        return max((await indexed_blocks(client, url, model, prompt)).values(), default=0) >= blocks

    await eventually(there, timeout=20, what=f"{blocks} blocks of the prompt indexed")


async def run_cases(client: httpx.AsyncClient, fleet: Any, url: str, first: str, cases: list[tuple[str, int]]) -> None:
    """Send ``first``, wait for its blocks, then each case: the router predicts exactly what is served."""
    await routed(client, url, fleet.model, first)
    await settle(client, url, fleet.model, first, 5)
    for prompt, served in cases:
        predicted, got, _ = await routed(client, url, fleet.model, prompt)
        assert (predicted, got) == (served, served), prompt[:40]
        await settle(client, url, fleet.model, prompt, served // 16)


async def test_lookahead_hashing_predictions_are_exact(client: httpx.AsyncClient) -> None:
    async with routed_fleet(1, fleet_options={"hash_lookahead_tokens": 1}, debug_headers=True) as (fleet, url, _):
        base = words(100)
        head = base.split()
        await run_cases(
            client,
            fleet,
            url,
            base,
            [
                (" ".join(head[:48] + words(52, "x").split()), 32),  # token 48 differs: block 2 is not shared
                (" ".join(head[:64]), 48),  # the prompt's last block has no lookahead token: no key
                (base, 96),
            ],
        )


async def test_hybrid_model_predictions_are_exact(client: httpx.AsyncClient) -> None:
    async with routed_fleet(1, fleet_options={"hybrid_sliding_window": 32}, debug_headers=True) as (fleet, url, _):
        swa = fleet[0].engine.cache.swa
        assert swa is not None
        swa.capacity = 8  # a small sliding-window pool: a prompt's out-of-window blocks go first
        first = words(100)
        await routed(client, url, fleet.model, first)
        await settle(client, url, fleet.model, first, 6)
        await routed(client, url, fleet.model, words(100, "other-"))
        shared = " ".join(first.split()[:64]) + " tail"

        async def window_evicted() -> bool:
            return not await indexed_blocks(client, url, fleet.model, shared)

        await eventually(window_evicted, timeout=20, what="the window group's evictions indexed")
        assert await routed(client, url, fleet.model, shared) == (0, 0, fleet[0].worker_id)
        predicted, served, _ = await routed(client, url, fleet.model, first)
        assert predicted == served == 96


async def test_a_reset_of_an_idle_engine_reaches_the_index_at_its_next_step(client: httpx.AsyncClient) -> None:
    async with routed_fleet(1, debug_headers=True, admin_token=TOKEN) as (fleet, url, _):
        worker = fleet[0]
        prompt = words(200)
        await routed(client, url, fleet.model, prompt)
        await settle(client, url, fleet.model, prompt, 12)
        refused = await client.post(url + "/reset_prefix_cache")
        assert refused.status_code >= 400  # kvroute never proxies engine control paths
        # The operator resets the engine directly: it holds nothing now, but publishes nothing until it steps.
        assert (await client.post(worker.url + "/reset_prefix_cache")).status_code == 200
        assert not worker.engine.cache.gpu and worker.engine.cache.clear_pending
        assert (await indexed_blocks(client, url, fleet.model, prompt)) == {worker.worker_id: 12}
        # The operator's word to kvroute: the admin purge drops what the index believed.
        purged = await client.delete(url + f"/admin/index/workers/{worker.worker_id}", headers=ADMIN)
        assert purged.status_code == 200, purged.text
        assert await indexed_blocks(client, url, fleet.model, prompt) == {}
        assert await routed(client, url, fleet.model, prompt) == (0, 0, worker.worker_id)
        await settle(client, url, fleet.model, prompt, 12)  # the step's AllBlocksCleared, then its blocks
        predicted, served, _ = await routed(client, url, fleet.model, prompt)
        assert predicted == served == 192
