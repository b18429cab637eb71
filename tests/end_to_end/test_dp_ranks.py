"""A data-parallel worker (one HTTP port, N engine ranks, each with its own cache and event port): the index
knows which rank holds a prefix, and the router steers the request there with ``X-data-parallel-rank``."""

from __future__ import annotations

import httpx

from tests.end_to_end.conftest import eventually, routed_fleet, words


async def test_requests_go_to_the_rank_that_holds_their_prefix(client: httpx.AsyncClient) -> None:
    async with routed_fleet(1, fleet_options={"dp_size": 2}) as (fleet, url, _app):
        prompts = [words(300, f"dp{i}") for i in range(6)]
        for prompt in prompts:
            first = await client.post(url + "/v1/completions", json={"model": fleet.model, "prompt": prompt})
            assert first.status_code == 200

        async def indexed() -> bool:
            holders = set()
            for prompt in prompts:
                found = await client.post(url + "/admin/index/lookup", json={"model": fleet.model, "prompt": prompt})
                holders |= {row["worker"] for row in found.json()["matches"] if row["blocks"]}
            return len(holders) == 2  # both ranks hold some of the prompts, told apart by the index

        await eventually(indexed, timeout=20, what="both ranks' blocks indexed")
        hits = []
        for prompt in prompts:
            again = await client.post(
                url + "/v1/completions",
                json={"model": fleet.model, "prompt": prompt},
                headers={"X-Data-Parallel-Rank": "0"},  # a client cannot choose: the router decides
            )
            hits.append(again.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        # Every repeated prompt found its prefix: on whichever rank computed it the first time.
        assert all(h >= 256 for h in hits), hits
