"""The full router (index + policy + rewriting) against simulated vLLM workers, over real sockets."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.policies.base import Policy, RoutePlan, RouteRequest, WorkerView

from tests.end_to_end.conftest import eventually, routed_fleet, words
from tests.http.upstream import serve


def completion(model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 4, **extra}


async def indexed_blocks(client: httpx.AsyncClient, url: str, worker_id: str) -> int:
    stats = (await client.get(f"{url}/admin/index/stats")).json()
    return sum(w["blocks"] for w in stats["workers"] if w["worker"] == worker_id)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample's values whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith(name + "_created"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


async def test_request_goes_where_its_prefix_lives(client: httpx.AsyncClient) -> None:
    async with routed_fleet(3, debug_headers=True) as (fleet, url, _):
        holder = fleet[2]
        prompt = words(200, "shared")
        warm = await client.post(f"{holder.url}/v1/completions", json=completion(fleet.model, prompt))
        assert warm.status_code == 200
        await eventually(lambda: indexed_blocks(client, url, holder.worker_id))
        for _ in range(3):
            r = await client.post(
                f"{url}/v1/completions",
                json=completion(fleet.model, prompt + " next"),
                headers={"x-kvroute-debug": "1"},
            )
            assert r.status_code == 200
            plan = orjson.loads(r.headers["x-kvroute-plan"])
            assert plan["prefill"] == holder.worker_id
            assert plan["predicted_cached_tokens"] >= 192
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192
        metrics = (await client.get(f"{url}/metrics")).text
        assert metric(metrics, "kvroute_stale_decisions_total") == 0
        assert metric(metrics, "kvroute_checked_decisions_total") == 3


async def test_explain_and_index_lookup_show_the_holder(client: httpx.AsyncClient) -> None:
    async with routed_fleet(2) as (fleet, url, _):
        holder = fleet[1]
        prompt = words(100, "x")
        await client.post(f"{holder.url}/v1/completions", json=completion(fleet.model, prompt))
        await eventually(lambda: indexed_blocks(client, url, holder.worker_id))
        explained = await client.post(f"{url}/admin/route/explain", json={"model": fleet.model, "prompt": prompt})
        assert explained.status_code == 200
        body = explained.json()
        assert body["plan"]["prefill"] == holder.worker_id
        assert len(body["plan"]["candidates"]) >= 2
        assert body["facts"]["matches"][holder.worker_id]["blocks"] == 100 // 16
        looked = await client.post(f"{url}/admin/index/lookup", json={"model": fleet.model, "prompt": prompt})
        assert looked.status_code == 200
        assert holder.worker_id in str(looked.json())


async def test_client_routing_fields_never_reach_the_worker(client: httpx.AsyncClient) -> None:
    # remote_prefiller + remote_kv_source is a combination the engine refuses (400): it only passes
    # because the router strips what clients put in kv_transfer_params.
    hostile = {
        "remote_prefiller": {"kv_request_id": "x", "remote_host": "10.1.2.3", "remote_port": 1},
        "remote_kv_source": {"kv_request_id": "y", "remote_host": "10.1.2.3", "remote_port": 2},
    }
    async with routed_fleet(2) as (fleet, url, _):
        direct = await client.post(
            f"{fleet[0].url}/v1/completions", json=completion(fleet.model, "hello", kv_transfer_params=hostile)
        )
        assert direct.status_code == 400
        routed = await client.post(
            f"{url}/v1/completions", json=completion(fleet.model, "hello", kv_transfer_params=hostile)
        )
        assert routed.status_code == 200
        metrics = (await client.get(f"{url}/metrics")).text
        assert metric(metrics, "kvroute_client_kv_params_removed_total") >= 2


async def test_refuse_mode_rejects_client_routing_fields(client: httpx.AsyncClient) -> None:
    async with routed_fleet(1, pool={"client_kv_params": "refuse"}) as (fleet, url, _):
        r = await client.post(
            f"{url}/v1/completions",
            json=completion(fleet.model, "hi", kv_transfer_params={"remote_kv_source": {"remote_host": "evil"}}),
        )
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "kv_transfer_params_not_allowed"
        ok = await client.post(f"{url}/v1/completions", json=completion(fleet.model, "hi"))
        assert ok.status_code == 200


class FixedPlan(Policy):
    """A test policy: always the same plan (to drive one protocol path deterministically)."""

    name = "fixed"

    def __init__(self, prefill: int, decode: int, source: int | None = None) -> None:
        super().__init__()
        self.idx = (prefill, decode, source)

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        ids = sorted(w.id for w in workers)
        p, d, s = self.idx
        return RoutePlan(
            prefill=ids[p], decode=ids[d], kv_source=ids[s] if s is not None else None, policy=self.name, reason="test"
        )


async def test_p2p_source_serves_the_cached_prefix(client: httpx.AsyncClient) -> None:
    async with routed_fleet(2, pool={"kv_protocol": "p2p"}) as (fleet, url, app):
        ids = sorted(w.worker_id for w in fleet.workers)
        source = next(w for w in fleet.workers if w.worker_id == ids[0])
        prompt = words(160, "peer")
        await client.post(f"{source.url}/v1/completions", json=completion(fleet.model, prompt))
        flow = app.state.kvroute.flow
        flow.policy = FixedPlan(prefill=1, decode=1, source=0)
        r = await client.post(f"{url}/v1/completions", json=completion(fleet.model, prompt))
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 144
        assert source.stats()["kv_bytes_sent"] > 0


class BusyHolder(Policy):
    """The real ``kvaware`` policy, shown one worker as 20 requests deep (a hot holder)."""

    name = "kvaware"
    needs_index = True

    def __init__(self, inner: Policy, busy: str) -> None:
        super().__init__()
        self.inner, self.busy = inner, busy

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        views = [dataclasses.replace(w, inflight=20) if w.id == self.busy else w for w in workers]
        return self.inner.choose(request, views)


async def test_kvaware_fetches_from_a_busy_holder_and_the_engine_serves_it(client: httpx.AsyncClient) -> None:
    """End to end: the cost model names the holder as ``remote_kv_source`` for an interactive request, the
    request it writes allows the REMOTE tier, and the engine really pulls the blocks from the peer.
    (The router is told prefill is slow, so that fetching clearly pays at this test's time scale.)"""
    slow = {"sim-tiny": {"prefill_tokens_per_s": 2000.0}}
    async with routed_fleet(
        2,
        pool={"kv_protocol": "p2p"},
        policy="kvaware",
        debug_headers=True,
        policy_options={"models": slow},
        fleet_options={"preset_overrides": {"gpu_blocks": 512}},
    ) as (fleet, url, app):
        holder = fleet.workers[0]
        prompt = words(1500, "hot")
        await client.post(f"{holder.url}/v1/completions", json=completion(fleet.model, prompt))

        async def indexed() -> bool:
            return await indexed_blocks(client, url, holder.worker_id) >= 80

        await eventually(indexed, what="the holder's blocks in the index")
        flow = app.state.kvroute.flow
        flow.policy = BusyHolder(flow.policy, holder.worker_id)
        r = await client.post(
            f"{url}/v1/completions", json=completion(fleet.model, prompt), headers={"X-KVRoute-Debug": "1"}
        )
        assert r.status_code == 200
        other = fleet.workers[1]
        plan = orjson.loads(r.headers["x-kvroute-plan"])
        assert (plan["prefill"], plan["kv_source"]) == (other.worker_id, holder.worker_id)
        assert {"medium": "CPU", "locality": "REMOTE"} in plan["kv_load_tiers"]
        assert other.stats()["kv_bytes_received"] > 0 and holder.stats()["kv_bytes_sent"] > 0
        # An interactive request may load what the plan priced in, no more (vLLM's max_load_tokens).
        loads = sum(n for tier, n in plan["predicted_by_tier"].items() if tier != "GPU")
        assert plan["max_load_tokens"] == loads > 0
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == plan["predicted_cached_tokens"]


async def test_a_prefix_still_being_computed_is_no_peers_source(client: httpx.AsyncClient) -> None:
    """A request sent while its prefix is being computed on a busy worker (known to the router only from
    routing it there) is not planned as a P2P fetch from that worker: the blocks are not there yet, and
    the fetch would wait out the whole prefill (once computed, it is: the test above)."""
    slow = {"sim-tiny": {"prefill_tokens_per_s": 2000.0}}  # the router's belief: fetching pays
    async with routed_fleet(
        2,
        pool={"kv_protocol": "p2p"},
        policy="kvaware",
        debug_headers=True,
        policy_options={"models": slow},
        # The engines' truth: the first prompt's prefill takes ~1 s of real time.
        fleet_options={"preset_overrides": {"gpu_blocks": 512, "prefill_tokens_per_s": 15.0}},
    ) as (fleet, url, app):
        first, second = fleet.workers
        flow = app.state.kvroute.flow
        kvaware = flow.policy
        prompt = words(1500, "computing")
        flow.policy = BusyHolder(kvaware, second.worker_id)  # the first request goes to `first`
        computing = asyncio.create_task(client.post(f"{url}/v1/completions", json=completion(fleet.model, prompt)))
        await eventually(lambda: len(flow.facts.routed) > 0, what="the first request routed")
        flow.policy = BusyHolder(kvaware, first.worker_id)  # the holder is busy: a fetch would look good
        r = await client.post(
            f"{url}/v1/completions", json=completion(fleet.model, prompt), headers={"X-KVRoute-Debug": "1"}
        )
        assert r.status_code == 200
        plan = orjson.loads(r.headers["x-kvroute-plan"])
        # Decided from the routed note, i.e. while the first request had not answered yet.
        assert metric((await client.get(f"{url}/metrics")).text, "kvroute_routed_prefix_hits_total") >= 1
        assert plan["kv_source"] is None, plan
        assert (await computing).status_code == 200


async def test_p2p_disaggregated_legs(client: httpx.AsyncClient) -> None:
    async with routed_fleet(2, roles=["prefill", "decode"], pool={"kv_protocol": "p2p"}) as (fleet, url, app):
        ids = sorted(w.worker_id for w in fleet.workers)
        prefill_idx = ids.index(next(w.worker_id for w in fleet.workers if w.opts.role == "prefill"))
        app.state.kvroute.flow.policy = FixedPlan(prefill=prefill_idx, decode=1 - prefill_idx)
        for stream in (False, True):
            r = await client.post(
                f"{url}/v1/completions", json=completion(fleet.model, words(100, f"pd{stream}"), stream=stream)
            )
            assert r.status_code == 200
            if stream:
                assert r.text.rstrip().endswith("data: [DONE]")
        prefiller = next(w for w in fleet.workers if w.opts.role == "prefill")
        decoder = next(w for w in fleet.workers if w.opts.role == "decode")
        assert prefiller.stats()["requests"] >= 2
        assert decoder.stats()["kv_bytes_received"] > 0


async def test_nixl_pull_and_conversation_reuse(client: httpx.AsyncClient) -> None:
    async with routed_fleet(2, roles=["prefill", "decode"], policy="round_robin", pool={"kv_protocol": "nixl"}) as (
        fleet,
        url,
        _,
    ):
        history = [{"role": "user", "content": words(300, "turn")}]
        first = await client.post(
            f"{url}/v1/chat/completions",
            json={"model": fleet.model, "messages": history, "max_tokens": 8, "conversation_id": "c1"},
        )
        assert first.status_code == 200
        assert "conversation_id" not in first.text
        decoder = next(w for w in fleet.workers if w.opts.role == "decode")
        assert decoder.stats()["kv_bytes_received"] > 0  # the decode leg pulled the prefill's blocks
        history += [
            {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": words(40, "more")},
        ]
        second = await client.post(
            f"{url}/v1/chat/completions",
            json={"model": fleet.model, "messages": history, "max_tokens": 8},
            headers={"x-conversation-id": "c1"},
        )
        assert second.status_code == 200
        metrics = (await client.get(f"{url}/metrics")).text
        assert metric(metrics, "kvroute_conversation_reuse_total", outcome="stored") >= 1
        assert metric(metrics, "kvroute_conversation_reuse_total", outcome="taken") >= 1


async def test_prefill_leg_failure_falls_back_to_local(client: httpx.AsyncClient) -> None:
    async with routed_fleet(2, roles=["prefill", "decode"], pool={"kv_protocol": "nixl"}, policy="round_robin") as (
        fleet,
        url,
        _,
    ):
        prefiller = next(w for w in fleet.workers if w.opts.role == "prefill")
        await prefiller.stop()  # the prefill leg is refused: the decoder recomputes locally
        r = await client.post(f"{url}/v1/completions", json=completion(fleet.model, words(50)))
        assert r.status_code == 200
        metrics = (await client.get(f"{url}/metrics")).text
        assert metric(metrics, "kvroute_kv_fallbacks_total", reason="prefill_leg") >= 1


async def test_a_restarted_router_rebuilds_its_index_through_replay(client: httpx.AsyncClient) -> None:
    async with routed_fleet(2) as (fleet, url, _):
        holder = fleet[0]
        await client.post(f"{holder.url}/v1/completions", json=completion(fleet.model, words(160, "old")))
        await eventually(lambda: indexed_blocks(client, url, holder.worker_id))
        # A second router starting over workers that already hold blocks (as after a restart): the first
        # live event it sees triggers a replay from the start of the worker's buffer.
        config = fleet.serve_config(policy="kvaware", health_interval_s=0.2)
        async with serve(build_app(RouterConfig.model_validate(config)), lifespan="on") as fresh:
            await client.post(f"{holder.url}/v1/completions", json=completion(fleet.model, words(40, "new")))

            async def rebuilt() -> bool:
                return await indexed_blocks(client, fresh, holder.worker_id) >= 160 // 16 + 40 // 16

            await eventually(rebuilt)
