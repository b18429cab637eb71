"""A worker whose admission control refuses (vLLM >= 0.32 answers 503 "retry on another instance" when its
queue limits are reached; 429 from gateways in front of it) before any byte: the request goes to the next
worker, never twice to the same one; the refusing worker counts as full for a moment; only when every
worker refuses does the client see the refusal."""

from __future__ import annotations

import httpx

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, serve_worker

COMPLETION = {"model": "m1", "prompt": "hello"}


async def test_refused_requests_go_to_a_worker_with_room(client: httpx.AsyncClient) -> None:
    full, free = FakeWorker("full", refusing=True), FakeWorker("free")
    async with serve_worker(full), serve_worker(free), run_router([full.url, free.url]) as (url, _app):
        answers = [await client.post(url + "/v1/completions", json=COMPLETION) for _ in range(8)]
        assert [a.status_code for a in answers] == [200] * 8
        assert {a.json()["worker"] for a in answers} == {"free"}
        metrics = (await client.get(url + "/metrics")).text
    wid = full.url.removeprefix("http://")
    assert f'kvroute_admission_rejections_total{{status="503",worker="{wid}"}} 1.0' in metrics
    # After one refusal the full worker was left alone for its cool-down: round robin sent it nothing more.
    assert len([s for s in full.seen if s["path"] == "/v1/completions"]) == 1


async def test_when_every_worker_refuses_the_client_gets_the_refusal(client: httpx.AsyncClient) -> None:
    a, b = FakeWorker("a", refusing=True), FakeWorker("b", refusing=True)
    async with serve_worker(a), serve_worker(b), run_router([a.url, b.url], retry_attempts=3) as (url, _app):
        r = await client.post(url + "/v1/completions", json=COMPLETION)
    assert r.status_code == 503 and "retry on another instance" in r.json()["error"]["message"]
    tried = [s["path"] for s in a.seen + b.seen if s["path"] == "/v1/completions"]
    assert len(tried) == 3  # bounded: retry_attempts in all, both workers tried before any second try
    assert len([s for s in a.seen if s["path"] == "/v1/completions"]) >= 1
    assert len([s for s in b.seen if s["path"] == "/v1/completions"]) >= 1
