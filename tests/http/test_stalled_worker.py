"""A worker that hangs (accepts connections, answers nothing: a stopped process) is marked down within one
probe timeout, the requests waiting for its first bytes are retried on another worker at once, and new
requests avoid it; when it answers again it comes back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, serve_worker
from tests.polling import eventually

STREAM = {"model": "m1", "prompt": "hello", "stream": True}


@contextlib.asynccontextmanager
async def pool(a: FakeWorker, b: FakeWorker, **settings: Any) -> AsyncIterator[str]:
    """Two workers and a router in front of them (the router needs the workers' URLs, so it comes last)."""
    async with serve_worker(a), serve_worker(b), run_router([a.url, b.url], **settings) as (url, _app):
        yield url


async def test_requests_waiting_on_a_hung_worker_are_retried_elsewhere(client: httpx.AsyncClient) -> None:
    hung, good = FakeWorker("hung"), FakeWorker("good")
    # read_timeout_s far above the test's duration: only the stall detection can rescue these requests.
    async with pool(hung, good, read_timeout_s=300, connect_timeout_s=0.5) as url:
        hung.hung = True
        answers = await asyncio.gather(*(client.post(url + "/v1/completions", json=STREAM) for _ in range(6)))
        assert [a.status_code for a in answers] == [200] * 6
        assert all(b'"worker":"good"' in a.content for a in answers)
        workers = (await client.get(url + "/admin/workers")).json()["workers"]
        assert {w["url"]: w["healthy"] for w in workers} == {hung.url: False, good.url: True}
        metrics = (await client.get(url + "/metrics")).text
        wid = hung.url.removeprefix("http://")
        assert f'kvroute_upstream_errors_total{{kind="stalled",worker="{wid}"}}' in metrics
        hung.hung = False

        async def back() -> bool:
            listed = (await client.get(url + "/admin/workers")).json()["workers"]
            return all(w["healthy"] for w in listed)

        await eventually(back, timeout=20, what="the worker back after it answers again")


async def test_a_stream_without_a_first_byte_in_time_is_retried(client: httpx.AsyncClient) -> None:
    slow, good = FakeWorker("slow", delay_s=30), FakeWorker("good")
    async with pool(slow, good, first_byte_timeout_s=0.5) as url:
        answers = [await client.post(url + "/v1/completions", json=STREAM) for _ in range(2)]
        await eventually(slow.aborted.is_set, timeout=10, what="the slow worker's request cancelled")
    assert [a.status_code for a in answers] == [200, 200]
    assert all(b'"worker":"good"' in a.content for a in answers)
