"""Pure pieces: the SSE usage sniffer, vLLM metrics parsing, health hysteresis, header filtering."""

from __future__ import annotations

import orjson
from kvroute.config import WorkerConfig
from kvroute.router.forwarding import UsageSniffer, response_headers, usage_of
from kvroute.router.metrics import RouterMetrics
from kvroute.router.registry import WorkerRegistry, parse_vllm_metrics
from kvroute.router.requests import upstream_headers
from kvroute.router.transport import HttpxTransport

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


def test_parse_vllm_metrics_sums_ranks_and_reads_block_size() -> None:
    text = (
        "\n".join(
            [
                "# TYPE vllm:num_requests_running gauge",
                'vllm:num_requests_running{engine="0"} 2.0',
                'vllm:num_requests_running{engine="1"} 3.0',
                "# TYPE vllm:num_requests_waiting gauge",
                'vllm:num_requests_waiting{engine="0"} 4.0',
                "# TYPE vllm:kv_cache_usage_perc gauge",
                'vllm:kv_cache_usage_perc{engine="0"} 0.2',
                'vllm:kv_cache_usage_perc{engine="1"} 0.7',
                "# TYPE vllm:prefix_cache_queries counter",
                'vllm:prefix_cache_queries_total{engine="0"} 100.0',
                'vllm:prefix_cache_queries_created{engine="0"} 1.7e9',
                "# TYPE vllm:prefix_cache_hits counter",
                'vllm:prefix_cache_hits_total{engine="0"} 40.0',
                "# TYPE vllm:cache_config_info gauge",
                'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="4096"} 1.0',
                'vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="4000"} 1.0',
                "# TYPE something_else gauge",
                "something_else 9",
            ]
        )
        + "\n"
    )
    load = parse_vllm_metrics(text)
    assert (load.running, load.waiting, load.kv_usage) == (5.0, 4.0, 0.7)
    assert (load.prefix_queries, load.prefix_hits, load.block_size) == (100.0, 40.0, 32)
    assert load.num_gpu_blocks == 4000  # the smaller engine is what limits admission


def test_health_hysteresis() -> None:
    registry = WorkerRegistry(
        [WorkerConfig(url="http://127.0.0.1:1")],
        HttpxTransport(1, 1),
        RouterMetrics(),
        unhealthy_after=3,
        healthy_after=2,
    )
    changes: list[tuple[str, bool]] = []
    registry.listeners.append(lambda wid, up: changes.append((wid, up)))
    state = registry.get("127.0.0.1:1")
    assert state is not None and state.healthy is None
    registry.record(state.id, True)  # the first answer decides at once
    assert state.healthy is True
    registry.record(state.id, False)
    registry.record(state.id, False)
    assert state.healthy is True  # two failures are not enough
    registry.record(state.id, True)
    registry.record(state.id, False)
    registry.record(state.id, False)
    registry.record(state.id, False)
    assert state.healthy is False
    registry.record(state.id, True)
    assert state.healthy is False
    registry.record(state.id, True)
    assert state.healthy is True
    assert changes == [("127.0.0.1:1", True), ("127.0.0.1:1", False), ("127.0.0.1:1", True)]


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


def test_settle_heap_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    import gc

    from kvroute.router.app import settle_heap

    before = gc.get_threshold()
    try:
        settle_heap(0)
        assert gc.get_threshold() == before
        settle_heap(50_000)
        assert gc.get_threshold()[0] == 50_000
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


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
