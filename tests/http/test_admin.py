"""Admin REST: listing, adding and removing workers at run time, the bearer token; /ready and /metrics."""

from __future__ import annotations

import httpx

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, serve_worker

COMPLETION = {"model": "m1", "prompt": "hello"}
AUTH = {"Authorization": "Bearer s3cret"}
M2 = {**COMPLETION, "model": "m2"}


async def test_add_and_remove_workers_at_run_time(client: httpx.AsyncClient) -> None:
    a, b = FakeWorker("a"), FakeWorker("b", models=["m2"])
    async with serve_worker(a), serve_worker(b), run_router([a.url], admin_token="s3cret") as (url, _app):
        assert (await client.get(url + "/admin/workers")).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (await client.get(url + "/admin/workers", headers=wrong)).status_code == 401
        listed = (await client.get(url + "/admin/workers", headers=AUTH)).json()["workers"]
        assert [w["models"] for w in listed] == [["m1"]] and listed[0]["healthy"] is True

        assert (await client.post(url + "/v1/completions", json=M2)).status_code == 404
        r = await client.post(url + "/admin/workers", json={"url": b.url, "id": "bee"}, headers=AUTH)
        assert r.status_code == 201, r.text
        assert r.json()["healthy"] is True and r.json()["models"] == ["m2"]  # probed and discovered at once
        r = await client.post(url + "/v1/completions", json={**COMPLETION, "model": "m2"})
        assert r.status_code == 200 and r.json()["worker"] == "b"
        models = {m["id"] for m in (await client.get(url + "/v1/models")).json()["data"]}
        assert models == {"m1", "m2"}

        dup = await client.post(url + "/admin/workers", json={"url": b.url, "id": "bee"}, headers=AUTH)
        assert dup.status_code == 409
        bad = await client.post(url + "/admin/workers", json={"url": "ftp://x"}, headers=AUTH)
        assert bad.status_code == 400 and "url" in bad.json()["error"]["message"]
        junk = await client.post(url + "/admin/workers", content=b"{oops", headers=AUTH)
        assert junk.status_code == 400

        assert (await client.delete(url + "/admin/workers/bee", headers=AUTH)).json()["removed"] == "bee"
        assert (await client.delete(url + "/admin/workers/bee", headers=AUTH)).status_code == 404
        assert (await client.post(url + "/v1/completions", json=M2)).status_code == 404
        # Remove by URL in the body.
        r = await client.request("DELETE", url + "/admin/workers", json={"url": a.url}, headers=AUTH)
        assert r.status_code == 200
        assert (await client.get(url + "/admin/workers", headers=AUTH)).json()["workers"] == []
        assert (await client.get(url + "/ready")).status_code == 503


async def test_admin_without_token_reads_from_loopback_and_has_openapi(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    async with run_router([w1.url]) as (url, _app):
        assert (await client.get(url + "/admin/workers")).status_code == 200
        spec = (await client.get(url + "/admin/openapi.json")).json()
        assert "/workers" in spec["paths"]


async def test_ready_health_and_metrics(two_workers, client: httpx.AsyncClient) -> None:
    w1, w2 = two_workers
    w1.running, w1.waiting = 3, 2
    async with run_router([w1.url, w2.url]) as (url, _app):
        assert (await client.get(url + "/health")).json() == {"status": "ok"}
        ready = await client.get(url + "/ready")
        assert ready.status_code == 200 and ready.json()["healthy_workers"] == 2
        await client.post(url + "/v1/completions", json=COMPLETION)
        await client.post(url + "/v1/completions", json={**COMPLETION, "model": "zzz"})
        await client.post(url + "/v1/chat/completions", content=b"nope")
        text = (await client.get(url + "/metrics")).text
    wid = w1.url.removeprefix("http://")
    assert 'kvroute_requests_total{model="m1",route="/v1/completions",status="200"} 1.0' in text
    assert 'kvroute_requests_total{model="unknown",route="/v1/completions",status="404"} 1.0' in text
    assert 'kvroute_requests_total{model="unknown",route="/v1/chat/completions",status="400"} 1.0' in text
    assert f'kvroute_worker_healthy{{worker="{wid}"}} 1.0' in text
    assert f'kvroute_worker_requests_waiting{{worker="{wid}"}} 2.0' in text
    assert 'kvroute_routing_decision_seconds_count{policy="round_robin"} 1.0' in text
    assert "kvroute_request_duration_seconds_bucket" in text
    assert "kvroute_worker_inflight" in text
    assert 'kvroute_cached_prompt_tokens_total{model="m1"} 4.0' in text
