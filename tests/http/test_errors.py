"""Every error status the router produces, in OpenAI's shape, and the service survives all of them."""

from __future__ import annotations

import httpx

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, free_port, serve_worker

COMPLETION = {"model": "m1", "prompt": "hello"}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if code is not None:
        assert err["code"] == code


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", "invalid_json"),
    ("/v1/completions", b"", "invalid_json"),
    ("/v1/completions", b"[1, 2]", "invalid_json"),
    ("/v1/completions", b'{"prompt": "x"}', "invalid_model"),
    ("/v1/completions", b'{"model": 3, "prompt": "x"}', "invalid_model"),
    ("/v1/completions", b'{"model": "m1"}', "invalid_prompt"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "stream": "yes"}', "invalid_stream"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "max_tokens": -1}', "invalid_max_tokens"),
    ("/v1/chat/completions", b'{"model": "m1"}', "invalid_messages"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": ["hi"]}', "invalid_messages"),
    ("/v1/chat/completions", b"\xff\xfe", "invalid_json"),
]


async def test_bad_requests_are_400(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    async with run_router([w1.url]) as (url, _app):
        for path, content, code in BAD_REQUESTS:
            r = await client.post(url + path, content=content, headers={"content-type": "application/json"})
            assert_openai_error(r, 400, code)
            assert r.headers["x-request-id"]
        # Still serving afterwards, and nothing bad reached the worker.
        assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
    assert len(w1.seen) == 1


async def test_unknown_model_is_404(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    async with run_router([w1.url]) as (url, _app):
        r = await client.post(url + "/v1/completions", json={**COMPLETION, "model": "gpt-99"})
    assert_openai_error(r, 404, "model_not_found")
    assert "gpt-99" in r.json()["error"]["message"]


async def test_body_over_limit_is_413(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    async with run_router([w1.url], max_body_bytes=1000) as (url, _app):
        big = {**COMPLETION, "prompt": "x" * 2000}
        assert_openai_error(await client.post(url + "/v1/completions", json=big), 413, "request_too_large")

        async def chunked():  # no Content-Length: the limit is enforced while reading
            for _ in range(5):
                yield b" " * 400

        r = await client.post(url + "/v1/completions", content=chunked())
        assert_openai_error(r, 413)
        assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200


async def test_no_healthy_worker_is_503(client: httpx.AsyncClient) -> None:
    w = FakeWorker("sick")
    async with serve_worker(w):
        w.healthy = False
        # Configured model: known even though the only worker is down.
        async with run_router([{"url": w.url, "models": ["m1"]}]) as (url, _app):
            r = await client.post(url + "/v1/completions", json=COMPLETION)
            assert_openai_error(r, 503, "no_healthy_worker")
            ready = await client.get(url + "/ready")
            assert ready.status_code == 503 and ready.json()["models_without_healthy_worker"] == ["m1"]
            assert (await client.get(url + "/health")).status_code == 200


async def test_all_workers_refusing_is_502(client: httpx.AsyncClient, http_client: str) -> None:
    w = FakeWorker("w")
    async with serve_worker(w):
        dead = f"http://127.0.0.1:{free_port()}"
        # Both look healthy to the registry (probes are slow); connections are refused on the hot path.
        twin = dead.replace("127.0.0.1", "localhost")
        specs = [{"url": dead, "models": ["m1"]}, {"url": twin, "models": ["m1"]}]
        async with run_router(specs, health_interval_s=60, http_client=http_client) as (url, app):
            for state in app.state.kvroute.registry.all():
                state.healthy = True
            r = await client.post(url + "/v1/completions", json=COMPLETION)
            assert_openai_error(r, 502, "upstream_error")


async def test_upstream_timeout_is_504(client: httpx.AsyncClient, http_client: str) -> None:
    w = FakeWorker("slow", delay_s=5)
    async with serve_worker(w), run_router([w.url], read_timeout_s=0.3, http_client=http_client) as (url, _app):
        r = await client.post(url + "/v1/completions", json=COMPLETION)
        assert_openai_error(r, 504, "upstream_timeout")
        w.delay_s = 0
        assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200


async def test_upstream_error_status_passes_through(two_workers, client: httpx.AsyncClient) -> None:
    """A worker's own 4xx (e.g. vLLM refusing a parameter) is its answer: passed back, not retried."""
    w1, _ = two_workers
    async with run_router([w1.url]) as (url, _app):
        r = await client.post(url + "/v1/embeddings", json=COMPLETION)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}  # the worker's own answer
    assert [s["path"] for s in w1.seen] == ["/v1/embeddings"]  # once: a 4xx is not retried elsewhere


async def test_router_without_workers(client: httpx.AsyncClient) -> None:
    async with run_router([]) as (url, _app):
        assert (await client.get(url + "/v1/models")).json() == {"object": "list", "data": []}
        assert (await client.get(url + "/ready")).status_code == 503
        r = await client.post(url + "/v1/completions", json=COMPLETION)
        assert_openai_error(r, 404, "model_not_found")
        # A passthrough path without a model and no worker at all: 503, not a crash.
        assert_openai_error(await client.get(url + "/version"), 503, "no_healthy_worker")


async def test_unsafe_request_id_is_replaced(two_workers, client: httpx.AsyncClient) -> None:
    w1, _ = two_workers
    async with run_router([w1.url]) as (url, _app):
        r = await client.post(url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "a b\tc"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] != "a b\tc" and len(r.headers["x-request-id"]) == 32
    assert w1.seen[-1]["headers"]["x-request-id"] == r.headers["x-request-id"]
