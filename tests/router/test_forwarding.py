"""What passes between a worker and the client: usage sniffed from SSE and JSON, headers filtered both ways."""

from __future__ import annotations

import orjson
from kvroute.router.forwarding import UsageSniffer, response_headers, usage_of
from kvroute.router.requests import upstream_headers

USAGE = {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 5}}


def test_sniffer_finds_usage_across_chunk_boundaries() -> None:
    stream = (
        b'data: {"choices":[{"text":"a"}],"usage":null}\n\n'
        + b"data: "
        + orjson.dumps({"choices": [], "usage": USAGE})
        + b"\n\ndata: [DONE]\n\n"
    )
    for size in (1, 3, 7, len(stream)):
        sniffer = UsageSniffer()
        for i in range(0, len(stream), size):
            sniffer.feed(stream[i : i + size])
        assert sniffer.usage == USAGE, size


def test_sniffer_ignores_garbage_and_null_usage() -> None:
    sniffer = UsageSniffer()
    sniffer.feed(b'data: {"usage": null}\n\ndata: {"usage": {broken\n\n: comment\n\n')
    assert sniffer.usage is None


def test_usage_of_json_bodies() -> None:
    assert usage_of(orjson.dumps({"usage": USAGE})) == USAGE
    assert usage_of(b"not json") is None
    assert usage_of(b'{"choices": []}') is None
    assert usage_of(b'["usage"]') is None


def test_header_filtering() -> None:
    raw = [
        (b"Host", b"router"),
        (b"Connection", b"keep-alive"),
        (b"Content-Length", b"5"),
        (b"Authorization", b"Bearer k"),
        (b"X-Request-Id", b"client"),
        (b"Content-Type", b"application/json"),
    ]
    sent = dict(upstream_headers(raw, "rid"))
    assert sent == {
        "x-request-id": "rid",
        "authorization": "Bearer k",
        "content-type": "application/json",
        "accept-encoding": "identity",
    }
    back = response_headers(
        [
            ("Content-Type", "text/event-stream"),
            ("Transfer-Encoding", "chunked"),
            ("Server", "uvicorn"),
            ("X-Custom", "1"),
        ],
        "rid",
    )
    assert back == [(b"x-request-id", b"rid"), (b"content-type", b"text/event-stream"), (b"x-custom", b"1")]


def test_redirects_to_a_worker_do_not_leak_its_address() -> None:
    back = dict(
        response_headers(
            [("Location", "http://10.0.0.5:8000/v1/completions"), ("Content-Location", "http://elsewhere/x")],
            "rid",
            "http://10.0.0.5:8000",
        )
    )
    assert back[b"location"] == b"/v1/completions"
    assert back[b"content-location"] == b"http://elsewhere/x"
