"""Passthrough: what the worker answers is what the client gets, for JSON and SSE, on the right worker."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx
import orjson
from kvroute.policies import Policy, RouteOutcome, RoutePlan, RouteRequest, WorkerView

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, serve_worker

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m1", "prompt": "hello", "max_tokens": 3}


class Recording(Policy):
    """First healthy worker; records outcomes so tests can check what the router reported."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: list[RouteOutcome] = []

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        w = sorted(workers, key=lambda v: v.id)[0]
        return RoutePlan(prefill=w.id, decode=w.id, policy=self.name)

    def observe(self, outcome: RouteOutcome) -> None:
        self.outcomes.append(outcome)


async def test_non_streaming_passthrough_is_byte_for_byte(
    two_workers, client: httpx.AsyncClient, http_client: str
) -> None:
    w1, _ = two_workers
    async with run_router([w1.url], http_client=http_client) as (url, _app):
        direct = await client.post(w1.url + "/v1/completions", json=COMPLETION)
        routed = await client.post(url + "/v1/completions", json=COMPLETION)
    assert routed.status_code == 200
    assert routed.content == direct.content
    assert routed.headers["content-type"] == "application/json"
    # A request id was generated, sent upstream and returned.
    rid = routed.headers["x-request-id"]
    assert rid and routed.headers["x-seen-request-id"] == rid


async def test_client_request_id_is_kept(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    async with run_router([w1.url]) as (url, _app):
        r = await client.post(url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert w1.seen[-1]["headers"]["x-request-id"] == "abc-123"
    assert r.json()["choices"][0]["message"]["content"] == "hello from w1"


async def test_streaming_passthrough_is_byte_for_byte(two_workers, client: httpx.AsyncClient, http_client: str) -> None:
    w1, _ = two_workers
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with run_router([w1.url], http_client=http_client) as (url, _app):
        direct = await client.post(w1.url + "/v1/chat/completions", json=body)
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as routed:
            assert routed.status_code == 200
            assert routed.headers["content-type"].startswith("text/event-stream")
            raw = b"".join([chunk async for chunk in routed.aiter_raw()])
    assert raw == direct.content
    assert raw.endswith(b"data: [DONE]\n\n")
    assert raw.count(b"data: ") == w1.chunks + 2


async def test_outcome_reports_usage_for_json_and_sse(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    policy = Recording()
    async with run_router([w1.url], impl=policy) as (url, _app):
        await client.post(url + "/v1/completions", json=COMPLETION)
        await client.post(
            url + "/v1/completions", json={**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
        )
        await client.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
    plain, streamed, no_usage = policy.outcomes
    assert (plain.prompt_tokens, plain.cached_tokens, plain.ttft_s, plain.ok) == (10, 4, None, True)
    assert (streamed.prompt_tokens, streamed.cached_tokens, streamed.ok) == (12, 8, True)
    assert streamed.ttft_s is not None and streamed.ttft_s > 0
    assert no_usage.cached_tokens is None and no_usage.ok
    assert plain.plan.prefill == w1.url.removeprefix("http://")


async def test_a_failing_report_after_the_answer_costs_the_client_nothing(two_workers) -> None:
    """The report runs after the answer went out: the answer is whole, and the kept-alive connection
    serves the next request (one raw connection: a closed one would not answer the second request)."""
    w1, _ = two_workers
    reports: list[object] = []

    def failing_report(decision: object, result: object, prefill_leg_s: float | None = None) -> None:  # a bug
        reports.append(result)
        raise RuntimeError("report failed")

    body = orjson.dumps(COMPLETION)
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with run_router([w1.url]) as (url, app):
        app.state.kvroute.flow.report = failing_report
        host, _, port = url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for _ in range(3):
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200 ")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                assert orjson.loads(await asyncio.wait_for(reader.readexactly(length), 10))["choices"]
        finally:
            writer.close()
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            stream = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
            streamed = await client.post(url + "/v1/completions", json=stream)
    assert streamed.status_code == 200 and streamed.content.endswith(b"data: [DONE]\n\n")
    assert len(reports) == 4  # every report ran (and failed)


async def test_models_union_and_routing_by_model(client: httpx.AsyncClient) -> None:
    a = FakeWorker("a", models=["m1", "shared"])
    b = FakeWorker("b", models=["m2", "shared"])
    async with serve_worker(a), serve_worker(b), run_router([a.url, b.url]) as (url, _app):
        models = (await client.get(url + "/v1/models")).json()
        ids = sorted(m["id"] for m in models["data"])
        assert ids == ["m1", "m2", "shared"]
        assert all(m.get("max_model_len") == 4096 for m in models["data"])  # the workers' cards are kept
        for _ in range(4):
            r1 = await client.post(url + "/v1/completions", json={**COMPLETION, "model": "m1"})
            r2 = await client.post(url + "/v1/completions", json={**COMPLETION, "model": "m2"})
            assert r1.json()["worker"] == "a"
            assert r2.json()["worker"] == "b"
        shared = {
            (await client.post(url + "/v1/completions", json={**COMPLETION, "model": "shared"})).json()["worker"]
            for _ in range(4)
        }
        assert shared == {"a", "b"}  # round robin over both


async def test_configured_models_need_no_discovery(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    async with run_router([{"url": w1.url, "models": ["alias"]}]) as (url, _app):
        r = await client.post(url + "/v1/completions", json={**COMPLETION, "model": "alias"})
        assert r.status_code == 200
        assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 404


async def test_other_paths_pass_through(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    async with run_router([w1.url]) as (url, _app):
        r = await client.post(url + "/tokenize", json={"model": "m1", "prompt": "hello"})
        assert r.status_code == 200 and r.json()["worker"] == "w1"
        assert w1.seen[-1]["body"] == {"model": "m1", "prompt": "hello"}
        missing = await client.post(url + "/tokenize", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404
        # A proxied path the worker does not have: the worker's own 404 comes back unchanged.
        r = await client.get(url + "/v1/responses/resp_1")
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        # A path that is no inference endpoint never reaches a worker: the router's own 404.
        r = await client.get(url + "/v1/unknown")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_proxied"
        # Engine-control endpoints are not proxied.
        seen = len(w1.seen)
        r = await client.post(url + "/reset_prefix_cache")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_proxied"
        assert len(w1.seen) == seen


async def test_least_load_policy_by_name(two_workers, client: httpx.AsyncClient) -> None:
    w1, w2 = two_workers
    w1.running, w1.waiting = 5, 5  # scraped from /metrics
    async with run_router([w1.url, w2.url], policy="least_load") as (url, app):
        state = app.state.kvroute
        assert state.registry.get(w1.url.removeprefix("http://")).load.waiting == 5
        workers = {(await client.post(url + "/v1/completions", json=COMPLETION)).json()["worker"] for _ in range(3)}
    assert workers == {"w2"}


async def test_debug_header_shows_plan(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    async with run_router([w1.url], debug_headers=True) as (url, _app):
        r = await client.post(url + "/v1/completions", json=COMPLETION, headers={"X-KVRoute-Debug": "1"})
        plain = await client.post(url + "/v1/completions", json=COMPLETION)
    plan = orjson.loads(r.headers["x-kvroute-plan"])
    assert plan["policy"] == "round_robin" and plan["prefill"] == w1.url.removeprefix("http://")
    assert "x-kvroute-plan" not in plain.headers
