"""/v1/messages and /v1/responses routed with exact keys through the full router, in front of simulated
workers that serve both surfaces as vLLM does (rendered with the chat template, KV events, usage).

What could fail: a conversion that differs from the engine's (the predicted cached tokens would not be
what the engine reports), a surface still passed through by load (the plan would not name the holder),
usage read in the wrong shape (no checked prediction), a stream whose usage is missed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.sim.fleet import SimFleet

from tests.end_to_end.conftest import FAST, eventually, routed_fleet, words
from tests.end_to_end.test_end_to_end import FixedPlan, indexed_blocks, metric
from tests.http.upstream import serve

DEBUG = {"x-kvroute-debug": "1"}
SYSTEM = words(200, "sys")


def messages_body(model: str, turns: list[str], **extra: Any) -> dict[str, Any]:
    """An Anthropic body: the long system prompt as a text block, then alternating user/assistant turns."""
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": [{"type": "text", "text": text}]}
        for i, text in enumerate(turns)
    ]
    return {
        "model": model,
        "max_tokens": 4,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": messages,
        **extra,
    }


def responses_body(model: str, turns: list[str], **extra: Any) -> dict[str, Any]:
    """A Responses body: the long prompt as ``instructions``, the turns as input messages."""
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        if i % 2 == 0
        else {"role": "assistant", "content": text}
        for i, text in enumerate(turns)
    ]
    return {"model": model, "max_output_tokens": 4, "instructions": SYSTEM, "input": items, **extra}


SURFACES = {
    "/v1/messages": (messages_body, lambda usage: usage.get("cache_read_input_tokens")),
    "/v1/responses": (responses_body, lambda usage: usage["input_tokens_details"]["cached_tokens"]),
}


def stream_usage(text: str) -> dict[str, Any]:
    """The last usage in an SSE answer: a message_delta's, or the final Responses event's ``response``."""
    usage: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith("data: ") and '"usage"' in line:
            event = orjson.loads(line[6:])
            found = event.get("usage") or (event.get("response") or {}).get("usage")
            if isinstance(found, dict):
                usage = found
    return usage


async def routed(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The router's plan for ``body`` and the cached tokens the engine reported (JSON or SSE)."""
    r = await client.post(url + path, json=body, headers=DEBUG)
    assert r.status_code == 200, r.text[:300]
    plan = orjson.loads(r.headers["x-kvroute-plan"])
    usage = stream_usage(r.text) if body.get("stream") else r.json()["usage"]
    return plan, int(SURFACES[path][1](usage) or 0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(SURFACES))
async def test_a_repeated_prefix_goes_to_the_worker_holding_it(
    path: str, stream: bool, client: httpx.AsyncClient
) -> None:
    async with routed_fleet(3, debug_headers=True) as (fleet, url, _):
        build = SURFACES[path][0]
        holder = fleet[2]
        warm = await client.post(holder.url + path, json=build(fleet.model, [words(40, "first")]))
        assert warm.status_code == 200, warm.text[:300]
        await eventually(lambda: indexed_blocks(client, url, holder.worker_id), what="the holder's blocks")
        for turn in range(3):
            turns = [words(40, "first"), "ok fine", words(10, f"next{turn}")]
            plan, cached = await routed(client, url, path, build(fleet.model, turns, stream=stream))
            assert plan["prefill"] == holder.worker_id, plan
            assert plan["predicted_cached_tokens"] == cached >= 224, (plan, cached)
        metrics = (await client.get(f"{url}/metrics")).text
        surface = path.rsplit("/", 1)[1]
        assert metric(metrics, "kvroute_prediction_fidelity_total", surface=surface, outcome="exact") == 3
        assert metric(metrics, "kvroute_prediction_fidelity_total", surface=surface, outcome="over") == 0
        assert metric(metrics, "kvroute_unrendered_requests_total") == 0


async def test_what_only_one_engine_knows_is_routed_by_load_and_counted(client: httpx.AsyncClient) -> None:
    async with routed_fleet(2) as (fleet, url, _):
        stateful = responses_body(fleet.model, ["hello"], previous_response_id="resp_abc")
        r = await client.post(url + "/v1/responses", json=stateful)
        assert r.status_code == 400  # the simulated engine keeps no responses; the router did not refuse it
        assert "previous_response_id" in r.text
        disabled = messages_body(fleet.model, ["hello"], thinking={"type": "disabled"})
        assert (await client.post(url + "/v1/messages", json=disabled)).status_code == 200
        metrics = (await client.get(f"{url}/metrics")).text
        assert (
            metric(metrics, "kvroute_unrendered_requests_total", surface="responses", reason="previous_response_id")
            == 1
        )
        assert metric(metrics, "kvroute_unrendered_requests_total", surface="messages", reason="thinking_disabled") == 1
        assert metric(metrics, "kvroute_checked_decisions_total") == 0


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/messages", {"messages": "hi", "max_tokens": 4}, "messages"),
        ("/v1/messages", {"messages": [{"role": "robot", "content": "x"}], "max_tokens": 4}, "messages[0]"),
        ("/v1/messages", {"messages": [{"role": "user", "content": [{"text": "x"}]}], "max_tokens": 4}, "content[0]"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "tools": [{}]}, "tools[0]"),
        ("/v1/responses", {"input": 7}, "input"),
        ("/v1/responses", {"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        ("/v1/responses", {"input": "x", "instructions": ["a"]}, "instructions"),
        ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
async def test_malformed_bodies_are_400s_naming_the_field(
    path: str, body: dict[str, Any], field: str, client: httpx.AsyncClient
) -> None:
    async with routed_fleet(1) as (fleet, url, _):
        r = await client.post(url + path, json={"model": fleet.model, **body})
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert field in error["message"] and error["type"] == "invalid_request_error", error
        assert fleet[0].stats()["requests"] == 0  # refused at the edge, never forwarded


@pytest.mark.parametrize("path", sorted(SURFACES))
async def test_p2p_plans_carry_kv_transfer_params_where_the_engine_reads_them(
    path: str, client: httpx.AsyncClient
) -> None:
    """A peer fetch (one leg) and a prefill/decode split (two legs) on each surface: the engine pulls the
    blocks, and the prefill leg stops after one token (the surface's own output limit)."""
    async with routed_fleet(2, pool={"kv_protocol": "p2p"}) as (fleet, url, app):
        build = SURFACES[path][0]
        ids = sorted(w.worker_id for w in fleet.workers)
        source, other = (next(w for w in fleet.workers if w.worker_id == i) for i in ids)
        turns = [words(160, "peer")]
        assert (await client.post(source.url + path, json=build(fleet.model, turns))).status_code == 200
        flow = app.state.kvroute.flow
        flow.policy = FixedPlan(prefill=1, decode=1, source=0)
        r = await client.post(url + path, json=build(fleet.model, turns))
        assert r.status_code == 200, r.text[:300]
        assert int(SURFACES[path][1](r.json()["usage"]) or 0) >= 144
        assert source.stats()["kv_bytes_sent"] > 0 and other.stats()["kv_bytes_received"] > 0
        flow.policy = FixedPlan(prefill=0, decode=1)
        before = generated(source)
        r = await client.post(url + path, json=build(fleet.model, [words(80, "split")], stream=True))
        assert r.status_code == 200, r.text[:300]
        assert generated(source) - before == 1
        assert other.stats()["kv_bytes_received"] > 0


def generated(worker: Any) -> float:
    return float(worker.families.sample("vllm:generation_tokens_total"))


@contextlib.asynccontextmanager
async def render_routed(n: int) -> AsyncIterator[tuple[SimFleet, str]]:
    """Workers with their render routes on, and a router told to tokenize through them."""
    fleet = SimFleet(n, "tiny", time_scale=FAST, enable_scale_out=True)
    async with fleet:
        config = fleet.serve_config(health_interval_s=0.2, metrics_interval_s=0.2, debug_headers=True)
        config["models"] = [{**fleet.model_config(), "tokenizer": "render"}]
        async with serve(build_app(RouterConfig.model_validate(config)), lifespan="on") as url:
            yield fleet, url


@pytest.mark.parametrize("path", ["/v1/chat/completions", *sorted(SURFACES)])
async def test_render_mode_gives_the_engine_tokens_on_every_surface(path: str, client: httpx.AsyncClient) -> None:
    async with render_routed(2) as (fleet, url):
        if path == "/v1/chat/completions":
            turns = [words(40, "first")]
            body = {"model": fleet.model, "max_tokens": 4, "messages": [{"role": "system", "content": SYSTEM}]}
            body["messages"] += [{"role": "user", "content": t} for t in turns]
        else:
            body = SURFACES[path][0](fleet.model, [words(40, "first")])
        holder = fleet[1]
        assert (await client.post(holder.url + path, json=body)).status_code == 200
        await eventually(lambda: indexed_blocks(client, url, holder.worker_id), what="the holder's blocks")
        r = await client.post(url + path, json=body, headers=DEBUG)
        assert r.status_code == 200, r.text[:300]
        plan = orjson.loads(r.headers["x-kvroute-plan"])
        usage = r.json()["usage"]
        reported = (
            usage["prompt_tokens_details"]["cached_tokens"]
            if path == "/v1/chat/completions"
            else SURFACES[path][1](usage)
        )
        assert plan["prefill"] == holder.worker_id and plan["predicted_cached_tokens"] == reported > 0, plan
        metrics = (await client.get(f"{url}/metrics")).text
        assert metric(metrics, "kvroute_prefix_cache_events_total", cache="tokens", event="misses") >= 1
        assert metric(metrics, "kvroute_render_failures_total") == 0


async def test_a_worker_with_render_off_is_benched_and_the_others_render(client: httpx.AsyncClient) -> None:
    async with render_routed(2) as (fleet, url):
        fleet[0].opts.enable_scale_out = False  # answers its render routes 403, as vLLM without the flag
        for i in range(4):
            body = messages_body(fleet.model, [words(30, f"m{i}")])
            r = await client.post(url + "/v1/messages", json=body, headers=DEBUG)
            assert r.status_code == 200, r.text[:300]
        metrics = (await client.get(f"{url}/metrics")).text
        assert metric(metrics, "kvroute_render_failures_total", reason="disabled") == 1
        assert metric(metrics, "kvroute_unrendered_requests_total") == 0
        assert metric(metrics, "kvroute_kv_fallbacks_total", reason="tokenizer") == 0


async def test_explain_dry_runs_a_messages_body(client: httpx.AsyncClient) -> None:
    async with routed_fleet(2) as (fleet, url, _):
        holder = fleet[1]
        body = messages_body(fleet.model, [words(40, "first")])
        assert (await client.post(holder.url + "/v1/messages", json=body)).status_code == 200
        await eventually(lambda: indexed_blocks(client, url, holder.worker_id), what="the holder's blocks")
        explained = await client.post(f"{url}/admin/route/explain", json={**body, "route": "/v1/messages"})
        assert explained.status_code == 200, explained.text[:300]
        assert explained.json()["plan"]["prefill"] == holder.worker_id
        # <|system|> + 200 words + <|end|>, <|user|> + 40 words + <|end|>, <|assistant|>: 245 tokens
        assert explained.json()["facts"]["matches"][holder.worker_id]["blocks"] == 245 // 16
        wrong = await client.post(f"{url}/admin/route/explain", json={**body, "route": "/v1/embeddings"})
        assert wrong.status_code == 400
