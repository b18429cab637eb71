"""Retries, client disconnects and workers going down and coming back."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from kvroute.apps.http_protocol import guarded_protocol

from tests.http.conftest import run_router
from tests.http.upstream import (
    FakeWorker,
    broken_stream_server,
    dies_after_headers_server,
    free_port,
    hangup_server,
    serve_worker,
)
from tests.polling import eventually as wait_for

COMPLETION = {"model": "m1", "prompt": "hello"}


def metric(app, name: str, **labels: str) -> float:
    value = app.state.kvroute.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0


async def test_refused_connection_is_retried_on_another_worker(client: httpx.AsyncClient, http_client: str) -> None:
    w = FakeWorker("alive")
    dead = f"http://127.0.0.1:{free_port()}"
    async with (
        serve_worker(w),
        run_router([{"url": dead, "models": ["m1"]}, w.url], health_interval_s=60, http_client=http_client) as (
            url,
            app,
        ),
    ):
        app.state.kvroute.registry.get(dead.removeprefix("http://")).healthy = True  # as if it just died
        answers = [await client.post(url + "/v1/completions", json=COMPLETION) for _ in range(4)]
        assert all(r.status_code == 200 and r.json()["worker"] == "alive" for r in answers)
        assert metric(app, "kvroute_retries_total") >= 1
        assert metric(app, "kvroute_upstream_errors_total", worker=dead.removeprefix("http://"), kind="connect") >= 1
        # Passive health: failed connections count like failed probes, so the dead worker is marked down.
        assert app.state.kvroute.registry.get(dead.removeprefix("http://")).healthy is False


async def test_hangup_before_answer_is_retried(client: httpx.AsyncClient, http_client: str) -> None:
    w = FakeWorker("alive")
    async with (
        serve_worker(w),
        hangup_server() as bad,
        run_router([{"url": bad, "models": ["m1"]}, w.url], health_interval_s=60, http_client=http_client) as (
            url,
            app,
        ),
    ):
        app.state.kvroute.registry.get(bad.removeprefix("http://")).healthy = True
        for stream in (False, True):
            for _ in range(2):
                r = await client.post(url + "/v1/completions", json={**COMPLETION, "stream": stream})
                assert r.status_code == 200
                assert b"alive" in r.content
        assert metric(app, "kvroute_retries_total") >= 2


#: The server's side of a hang-up: uvicorn's own protocol (the app watches ``receive``), or kvroute serve's
#: (its disconnect callbacks).
SERVERS = {"uvicorn": "httptools", "kvroute": guarded_protocol(10.0, 0)}


@pytest.mark.parametrize("server", sorted(SERVERS))
async def test_client_disconnect_cancels_streaming_upstream(http_client: str, server: str) -> None:
    w = FakeWorker("slow", chunks=200, chunk_delay_s=0.05)
    async with serve_worker(w), run_router([w.url], http=SERVERS[server], http_client=http_client) as (url, app):
        async with (
            httpx.AsyncClient(timeout=10, trust_env=False) as c,
            c.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}) as r,
        ):
            async for chunk in r.aiter_raw():
                assert chunk.startswith(b"data: ")
                break  # hang up after the first chunk
        await asyncio.wait_for(w.aborted.wait(), 10)
        state = app.state.kvroute.registry.get(w.url.removeprefix("http://"))
        await wait_for(lambda: state.inflight == 0)


@pytest.mark.parametrize("server", sorted(SERVERS))
async def test_client_disconnect_cancels_non_streaming_upstream(http_client: str, server: str) -> None:
    w = FakeWorker("slow", delay_s=30)
    async with serve_worker(w), run_router([w.url], http=SERVERS[server], http_client=http_client) as (url, app):
        c = httpx.AsyncClient(timeout=10, trust_env=False)
        task = asyncio.create_task(c.post(url + "/v1/completions", json=COMPLETION))
        await asyncio.wait_for(w.started.wait(), 10)
        task.cancel()  # closes the client's connection mid-request
        await c.aclose()
        await asyncio.wait_for(w.aborted.wait(), 10)
        state = app.state.kvroute.registry.get(w.url.removeprefix("http://"))
        await wait_for(lambda: state.inflight == 0)
        assert metric(app, "kvroute_worker_inflight", worker=state.id) == 0


async def test_worker_down_and_back(client: httpx.AsyncClient) -> None:
    a, b = FakeWorker("a"), FakeWorker("b")
    async with (
        serve_worker(a),
        serve_worker(b),
        run_router([a.url, b.url], health_interval_s=0.05, unhealthy_after=2, healthy_after=2) as (url, app),
    ):
        registry = app.state.kvroute.registry
        sa = registry.get(a.url.removeprefix("http://"))
        assert sa.healthy is True
        a.healthy = False
        await wait_for(lambda: sa.healthy is False)
        assert metric(app, "kvroute_worker_healthy", worker=sa.id) == 0
        workers = {(await client.post(url + "/v1/completions", json=COMPLETION)).json()["worker"] for _ in range(4)}
        assert workers == {"b"}
        assert (await client.get(url + "/ready")).status_code == 200  # b still serves m1
        a.healthy = True
        await wait_for(lambda: sa.healthy is True)
        workers = {(await client.post(url + "/v1/completions", json=COMPLETION)).json()["worker"] for _ in range(4)}
        assert workers == {"a", "b"}


async def test_worker_failing_mid_stream_ends_with_an_error_event(client: httpx.AsyncClient, http_client: str) -> None:
    async with (
        broken_stream_server() as bad,
        run_router([{"url": bad, "models": ["m1"]}], health_interval_s=60, http_client=http_client) as (url, app),
    ):
        wid = bad.removeprefix("http://")
        app.state.kvroute.registry.get(wid).healthy = True
        r = await client.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
        assert r.status_code == 200
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[0] == b'data: {"choices":[{"text":"partial"}]}'
        assert events[-1].startswith(b'data: {"error"') and b"[DONE]" not in r.content
        assert metric(app, "kvroute_upstream_errors_total", worker=wid, kind="protocol") == 1
        # The router is still serving.
        assert (await client.get(url + "/health")).status_code == 200


@pytest.mark.parametrize("empty_chunk", [False, True])
async def test_a_worker_dying_after_its_headers_is_retried_before_any_byte(
    client: httpx.AsyncClient, http_client: str, empty_chunk: bool
) -> None:
    """Killed between its status line and its first body byte: the client's 200 was not sent yet, so the
    request goes to another worker and the client sees one whole, good stream."""
    good = FakeWorker("good")
    async with dies_after_headers_server(empty_chunk=empty_chunk) as bad, serve_worker(good):  # noqa: SIM117
        async with run_router(
            [{"url": bad, "models": ["m1"]}, good.url], health_interval_s=60, http_client=http_client
        ) as (url, app):
            wid = bad.removeprefix("http://")
            app.state.kvroute.registry.get(wid).healthy = True
            answers = [
                await client.post(url + "/v1/completions", json={**COMPLETION, "stream": True}) for _ in range(4)
            ]
    for r in answers:
        assert r.status_code == 200 and b'"worker":"good"' in r.content and b"[DONE]" in r.content
        assert b'"error"' not in r.content
