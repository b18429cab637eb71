"""What reaches a worker: one canonical path from an allowlist, no client routing fields, only allowed headers.

Real router, real fake worker (it records every request on any path), real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvroute.router.paths import CONTROL_PATHS, canonical_path, proxied

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, serve_worker
from tests.threaded import in_thread

EVIL_PARAMS = {
    "remote_host": "169.254.169.254",
    "remote_port": 80,
    "remote_kv_source": {"kv_request_id": "x", "remote_host": "169.254.169.254", "remote_port": 80},
    "do_remote_prefill": True,
}


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("/v1/completions", "/v1/completions"),
        ("/v1/./completions", "/v1/completions"),
        ("/v1/x/../completions", "/v1/completions"),
        ("//v1//completions/", "/v1/completions"),
        ("/./reset_prefix_cache", "/reset_prefix_cache"),
        ("/v1/../reset_prefix_cache", "/reset_prefix_cache"),
        ("/%2e/reset_prefix_cache", "/reset_prefix_cache"),
        ("/%72eset_prefix_cache", "/reset_prefix_cache"),
        ("/../../../etc/passwd", "/etc/passwd"),
        ("/v1/completions%3F", "/v1/completions%3F"),  # a reserved character stays encoded: not a known path
        ("/", "/"),
    ],
)
def test_canonical_path(raw: str, canonical: str) -> None:
    assert canonical_path(raw) == canonical


def test_allowlist_refuses_control_and_unknown_paths() -> None:
    assert proxied("POST", "/v1/completions") and proxied("GET", "/v1/responses/resp_123")
    assert proxied("POST", "/v1/responses/resp_123/cancel") and not proxied("DELETE", "/v1/completions")
    for path in CONTROL_PATHS:
        assert not proxied("POST", path) and not proxied("GET", path)


def spellings(path: str) -> list[str]:
    """Ways a client can write ``path`` that a careless router would treat as another path."""
    name = path.lstrip("/")
    first, rest = name[0], name[1:]
    return [
        path,
        "/" + path,
        "/." + path,
        "/v1/.." + path,
        "/x/y/../.." + path,
        path + "/",
        "/%2e" + path,
        "/%2E%2E" + path,
        f"/%{ord(first):02x}{rest}",
        path.replace("/", "//"),
    ]


def _head(method: str, target: str, body: bytes) -> bytes:
    return (
        f"{method} {target} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def raw_request(port: int, method: str, target: str, body: bytes = b"{}") -> int:
    """Send a request line as written (httpx would normalize the path), return the status code."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_head(method, target, body))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


async def araw_request(port: int, method: str, target: str, body: bytes = b"{}") -> int:
    """:func:`raw_request` for a test whose event loop also runs the router."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head(method, target, body))
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return int(answer.split(b" ", 2)[1])


async def test_no_spelling_of_a_control_path_reaches_a_worker() -> None:
    worker = FakeWorker("w")
    async with serve_worker(worker), run_router([worker.url]) as (url, _app):
        port = int(url.rsplit(":", 1)[1])
        tried = 0
        for path in sorted(CONTROL_PATHS):
            for target in spellings(path):
                for method in ("POST", "GET"):
                    assert await araw_request(port, method, target) == 404, (method, target)
                    tried += 1
        assert tried > 300
    assert [s["path"] for s in worker.seen] == []


async def test_generation_spellings_are_routed_as_generation_and_forwarded_canonical() -> None:
    worker = FakeWorker("w")
    async with serve_worker(worker), run_router([worker.url]) as (url, _app):
        port = int(url.rsplit(":", 1)[1])
        body = b'{"model": "m1", "prompt": "x", "kv_transfer_params": {"remote_host": "169.254.169.254"}}'
        for target in spellings("/v1/completions"):
            assert await araw_request(port, "POST", target, body) == 200, target
        assert await araw_request(port, "POST", "/v1/completions%3F", body) == 404
    assert {s["path"] for s in worker.seen} == {"/v1/completions"}
    assert all("kv_transfer_params" not in s["body"] for s in worker.seen)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(
        ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings", "/tokenize"]
    ),
    prefix=st.sampled_from(["", "/.", "/v1/..", "/"]),
    params=st.one_of(
        st.just(EVIL_PARAMS),
        st.dictionaries(st.sampled_from(sorted(EVIL_PARAMS)), st.sampled_from(list(EVIL_PARAMS.values()))),
        st.just("not an object"),
    ),
    stream=st.booleans(),
)
def test_client_routing_fields_never_reach_a_worker_on_any_path(
    path: str, prefix: str, params: object, stream: bool, routed: tuple[str, FakeWorker]
) -> None:
    url, worker = routed
    port = int(url.rsplit(":", 1)[1])
    body: dict[str, object] = {"model": "m1", "kv_transfer_params": params, "stream": stream}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    import orjson

    before = len(worker.seen)
    raw_request(port, "POST", prefix + path, orjson.dumps(body))
    for seen in worker.seen[before:]:
        sent = orjson.loads(seen["raw"]) if seen.get("raw") else seen.get("body") or {}
        assert "kv_transfer_params" not in sent, (path, seen["path"])


@contextlib.asynccontextmanager
async def _router_and_worker() -> AsyncIterator[tuple[str, FakeWorker]]:
    worker = FakeWorker("w")
    async with serve_worker(worker), run_router([worker.url]) as (url, _app):
        yield url, worker


@pytest.fixture(scope="module")
def routed() -> Iterator[tuple[str, FakeWorker]]:
    """One router and worker for the property test (hypothesis runs its examples in this thread)."""
    with in_thread(_router_and_worker) as value:
        yield value


async def test_headers_forwarded_only_from_the_allowlist(client: httpx.AsyncClient) -> None:
    worker = FakeWorker("w")
    async with serve_worker(worker), run_router([worker.url], forward_headers=["X-Tenant"]) as (url, _app):
        r = await client.post(
            url + "/v1/completions",
            json={"model": "m1", "prompt": "x"},
            headers={
                "Authorization": "Bearer key",
                "traceparent": "00-abc-def-01",
                "X-Tenant": "t1",
                "X-Data-Parallel-Rank": "3",
                "X-KVRoute-Latency-Class": "batch",
                "X-Conversation-Id": "c1",
                "X-Forwarded-Host": "evil",
                "X-Request-Id": "bad\tid",
            },
        )
        assert r.status_code == 200
    sent = worker.seen[-1]["headers"]
    assert sent["authorization"] == "Bearer key" and sent["traceparent"] == "00-abc-def-01"
    assert sent["x-tenant"] == "t1"  # named by forward_headers
    for name in ("x-data-parallel-rank", "x-kvroute-latency-class", "x-conversation-id", "x-forwarded-host"):
        assert name not in sent
    assert sent["x-request-id"] != "bad\tid" and "\t" not in sent["x-request-id"]
