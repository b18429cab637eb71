"""The worker registry: vLLM metrics parsed (ranks summed), health hysteresis, LoRA adapters' base models."""

from __future__ import annotations

from kvroute.config import WorkerConfig
from kvroute.router.metrics import RouterMetrics
from kvroute.router.registry import WorkerRegistry, parse_vllm_metrics
from kvroute.router.transport import HttpxTransport
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.http.upstream import serve


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


async def test_base_of_adapters_configured_and_discovered() -> None:
    """An adapter's base comes from the config, else from the ``parent`` of its /v1/models card (as vLLM
    lists adapters); a base model, or a name nobody lists, has none."""

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        data = [{"id": "base", "parent": None}, {"id": "adapter", "parent": "base"}, {"id": "odd", "parent": 7}]
        return JSONResponse({"object": "list", "data": data})

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models)])
    transport = HttpxTransport(1, 1)
    async with serve(app) as url:
        registry = WorkerRegistry([WorkerConfig(url=url)], transport, RouterMetrics(), adapters={"pinned": "base"})
        assert registry.base_of("adapter") is None  # not discovered yet
        await registry.probe_all()
        assert registry.knows_model("adapter")
        assert registry.base_of("adapter") == "base"
        assert registry.base_of("pinned") == "base"
        assert registry.base_of("base") is None
        assert registry.base_of("odd") is None
        assert registry.base_of("nobody") is None
        registry.adapters = {}  # a reload without the pinned adapter
        assert registry.base_of("pinned") is None
    await transport.aclose()
