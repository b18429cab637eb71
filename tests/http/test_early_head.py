"""A stream whose plan expects its first token soon gets its response head at once (the client reads it while
the engine computes); one expected late, or with no prediction, keeps the head, and the retry elsewhere,
until its first body bytes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from kvroute.policies.base import Policy, RoutePlan, RouteRequest, WorkerView

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, dies_after_headers_server, raw_server, serve_worker

STREAM = {"model": "m1", "prompt": "hello", "stream": True}
EVENT = b'data: {"choices":[{"index":0,"text":"hi"}]}\n\n'


class Predicting(Policy):
    """The workers in turn (sorted by id; ``first`` first when given), every plan predicting the same time
    to first token."""

    name = "predicting"

    def __init__(self, ttft_s: float | None, first: str | None = None) -> None:
        super().__init__()
        self.ttft_s = ttft_s
        self.first = first
        self.sent = 0

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        ids = sorted(w.id for w in workers)
        worker = self.first if self.sent == 0 and self.first in ids else ids[self.sent % len(ids)]
        self.sent += 1
        return RoutePlan(prefill=worker, decode=worker, predicted_ttft_s=self.ttft_s, policy=self.name, reason="t")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@contextlib.asynccontextmanager
async def first_token_on(release: asyncio.Event) -> AsyncIterator[str]:
    """A worker that answers a stream's head at once and its first token only once ``release`` is set."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            await writer.drain()
            await release.wait()
            writer.write(chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    async with raw_server(handle) as url:
        yield url


#: The app behind each URL :func:`only` yields.
ROUTERS: dict[str, Any] = {}


@contextlib.asynccontextmanager
async def only(worker: str, policy: Policy) -> AsyncIterator[str]:
    """A router in front of ``worker`` alone (a raw server: no health route, so it is marked up by hand)."""
    async with run_router(
        [{"url": worker, "models": ["m1"]}], impl=policy, early_head_ttft_s=0.1, health_interval_s=60
    ) as (url, app):
        app.state.kvroute.registry.get(worker.removeprefix("http://")).healthy = True
        ROUTERS[url] = app
        try:
            yield url
        finally:
            del ROUTERS[url]


@pytest.mark.parametrize(("predicted_s", "head_first"), [(0.01, True), (1.0, False), (None, False)])
async def test_the_head_comes_before_the_first_token_when_that_token_is_expected_soon(
    client: httpx.AsyncClient, predicted_s: float | None, head_first: bool
) -> None:
    release = asyncio.Event()
    async with (
        first_token_on(release) as worker,
        only(worker, Predicting(predicted_s)) as url,
    ):
        opening = asyncio.ensure_future(
            client.send(client.build_request("POST", url + "/v1/completions", json=STREAM), stream=True)
        )
        done, _ = await asyncio.wait({opening}, timeout=2.0)
        release.set()
        response = await opening
        body = await response.aread()
    assert bool(done) is head_first
    assert response.status_code == 200 and body == EVENT + b"data: [DONE]\n\n"


async def test_an_early_head_times_the_first_token_not_the_head(client: httpx.AsyncClient) -> None:
    """What the router learns (its TTFT histogram, receipts, the calibration) is the first body bytes' time."""
    release = asyncio.Event()
    async with (
        first_token_on(release) as worker,
        only(worker, Predicting(0.01)) as url,
    ):
        async with client.stream("POST", url + "/v1/completions", json=STREAM) as response:
            await asyncio.sleep(0.3)  # the head is in; the engine "computes"
            release.set()
            assert await response.aread() == EVENT + b"data: [DONE]\n\n"
        registry = ROUTERS[url].state.kvroute.metrics.registry
        labels = {"model": "m1"}
        for _ in range(100):  # the report runs once the last byte went out
            if registry.get_sample_value("kvroute_time_to_first_byte_seconds_count", labels):
                break
            await asyncio.sleep(0.01)
        assert registry.get_sample_value("kvroute_time_to_first_byte_seconds_count", labels) == 1
        assert registry.get_sample_value("kvroute_time_to_first_byte_seconds_sum", labels) >= 0.3


@pytest.mark.parametrize("predicted_s", [0.01, 1.0])
async def test_only_a_held_head_is_retried_elsewhere_when_its_worker_dies_before_the_first_token(
    client: httpx.AsyncClient, predicted_s: float
) -> None:
    """The trade-off, both ways: a held head is retried on the next worker (one good stream); an early head
    was already the client's, so the stream ends with vLLM's in-stream error event."""
    good = FakeWorker("good")
    async with dies_after_headers_server() as bad, serve_worker(good):
        workers = [{"url": bad, "models": ["m1"]}, good.url]
        dying = bad.removeprefix("http://")
        policy = Predicting(predicted_s, first=dying)  # the first plan goes to the dying worker
        async with run_router(workers, impl=policy, early_head_ttft_s=0.1, health_interval_s=60) as (url, app):
            app.state.kvroute.registry.get(dying).healthy = True
            r = await client.post(url + "/v1/completions", json=STREAM)
    assert r.status_code == 200
    if predicted_s < 0.1:
        assert b'"error"' in r.content and b"[DONE]" not in r.content
    else:
        assert b'"worker":"good"' in r.content and b"[DONE]" in r.content and b'"error"' not in r.content


@contextlib.asynccontextmanager
async def stalls_after_its_head() -> AsyncIterator[str]:
    """A worker that answers a stream's head and then nothing, its connection open (a stuck engine)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(30)
        writer.close()

    async with raw_server(handle) as url:
        yield url


async def test_an_early_head_whose_worker_stalls_ends_with_an_error_event_after_the_first_byte_timeout(
    client: httpx.AsyncClient,
) -> None:
    async with (
        stalls_after_its_head() as worker,
        run_router(
            [{"url": worker, "models": ["m1"]}],
            impl=Predicting(0.01),
            early_head_ttft_s=0.1,
            first_byte_timeout_s=0.3,
            health_interval_s=60,
        ) as (url, app),
    ):
        wid = worker.removeprefix("http://")
        app.state.kvroute.registry.get(wid).healthy = True
        r = await client.post(url + "/v1/completions", json=STREAM)
        errors = app.state.kvroute.metrics.registry.get_sample_value(
            "kvroute_upstream_errors_total", {"worker": wid, "kind": "stalled"}
        )
    assert r.status_code == 200
    assert b'"error"' in r.content and b"stalled" in r.content and b"[DONE]" not in r.content
    assert errors == 1
