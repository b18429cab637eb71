"""Secure by default: without an admin token nothing can change the pool; with one, run-time workers must
pass the allowlist and are never metadata addresses; /metrics can be protected."""

from __future__ import annotations

import httpx
import pytest
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.router.admin_auth import worker_refusal

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, serve_worker

AUTH = {"Authorization": "Bearer s3cret"}


async def test_without_a_token_mutating_admin_routes_are_disabled(client: httpx.AsyncClient) -> None:
    a, evil = FakeWorker("a"), FakeWorker("evil")
    async with serve_worker(a), serve_worker(evil), run_router([a.url]) as (url, _app):
        r = await client.post(url + "/admin/workers", json={"url": evil.url})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_token_required"
        wid = a.url.removeprefix("http://")
        assert (await client.delete(url + f"/admin/workers/{wid}")).status_code == 403
        assert (await client.request("DELETE", url + "/admin/workers", json={"url": a.url})).status_code == 403
        assert (await client.delete(url + f"/admin/index/workers/{wid}")).status_code == 403
        # Nothing changed: the real worker still serves, the fake one never joined.
        listed = (await client.get(url + "/admin/workers")).json()["workers"]
        assert [w["url"] for w in listed] == [a.url]
        assert (await client.post(url + "/v1/completions", json={"model": "m1", "prompt": "x"})).json()["worker"] == "a"


async def test_without_a_token_remote_clients_cannot_read_admin() -> None:
    """A client that is not on the loopback interface (an in-process ASGI call with a remote peer address)."""
    app = build_app(RouterConfig.model_validate({"workers": []}))
    remote = httpx.ASGITransport(app=app, client=("10.1.2.3", 5555))
    local = httpx.ASGITransport(app=app, client=("127.0.0.1", 5555))
    async with httpx.AsyncClient(transport=remote, base_url="http://r") as far:
        r = await far.get("/admin/workers")
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_loopback_only"
        assert (await far.get("/admin/index/stats")).status_code == 403
    async with httpx.AsyncClient(transport=local, base_url="http://r") as near:
        assert (await near.get("/admin/workers")).status_code == 200


async def test_run_time_workers_pass_the_allowlist(client: httpx.AsyncClient) -> None:
    a, b = FakeWorker("a"), FakeWorker("b")
    async with serve_worker(a), serve_worker(b):
        async with run_router([a.url], admin_token="s3cret", admin_worker_allowlist=["127.0.0.0/8"]) as (url, _):
            for target in ("http://169.254.169.254/", "http://[fe80::1]:80", "http://metadata.google.internal"):
                r = await client.post(url + "/admin/workers", json={"url": target}, headers=AUTH)
                assert r.status_code == 403 and r.json()["error"]["code"] == "worker_not_allowed", target
            r = await client.post(url + "/admin/workers", json={"url": "http://10.9.9.9:8000"}, headers=AUTH)
            assert r.status_code == 403 and "allowlist" in r.json()["error"]["message"]
            r = await client.post(url + "/admin/workers", json={"url": b.url, "id": "bee"}, headers=AUTH)
            assert r.status_code == 201
        # Without an allowlist any host may be added, but never a link-local (metadata) one.
        async with run_router([a.url], admin_token="s3cret") as (url, _):
            r = await client.post(url + "/admin/workers", json={"url": "http://169.254.169.254"}, headers=AUTH)
            assert r.status_code == 403


@pytest.mark.parametrize(
    ("url", "allowlist", "refused"),
    [
        ("http://10.0.0.5:8000", [], False),
        ("http://169.254.169.254", [], True),
        ("http://169.254.169.254", ["169.254.0.0/16"], False),
        ("http://vllm-0.vllm.svc.cluster.local:8000", [".svc.cluster.local"], False),
        ("http://evil.example.com", [".svc.cluster.local", "10.0.0.0/8"], True),
        ("http://10.1.2.3", [".svc.cluster.local", "10.0.0.0/8"], False),
        ("http://0.0.0.0:8000", [], True),
    ],
)
def test_worker_refusal(url: str, allowlist: list[str], refused: bool) -> None:
    assert (worker_refusal(url, allowlist) is not None) is refused


async def test_metrics_token(client: httpx.AsyncClient) -> None:
    async with run_router([], metrics_token="m") as (url, _):
        assert (await client.get(url + "/metrics")).status_code == 401
        ok = await client.get(url + "/metrics", headers={"Authorization": "Bearer m"})
        assert ok.status_code == 200 and "kvroute_requests_total" in ok.text
