"""The worker registry: vLLM metrics parsed (ranks summed), health hysteresis, LoRA adapters' base models."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.config import WorkerConfig
from kvroute.router.metrics import RouterMetrics
from kvroute.router.registry import WorkerRegistry, parse_vllm_metrics, read_lines
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


#: Families of an engine's page: those the scrape reads and look-alikes it must not (a longer name with
#: a read one as its prefix, a histogram), each with its TYPE.
_FAMILIES = [
    ("vllm:num_requests_running", "gauge", ""),
    ("vllm:num_requests_running_max", "gauge", ""),
    ("vllm:kv_cache_usage_perc", "gauge", ""),
    ("vllm:gpu_cache_usage_perc", "gauge", ""),
    ("vllm:prefix_cache_queries", "counter", "_total"),
    ("vllm:prefix_cache_hits", "counter", "_total"),
    ("vllm:prefix_cache_hits_by_tier", "counter", "_total"),
    ("vllm:prompt_tokens_cached_by_source", "counter", "_total"),
    ("vllm:cache_config_info", "gauge", ""),
    ("vllm:time_to_first_token_seconds", "histogram", "_bucket"),
    ("vllm:num_requests_waiting", "gauge", ""),
]
_LABEL_VALUES = st.text(alphabet='ab 01{},="\\\n\t#', max_size=6)


@st.composite
def metric_pages(draw: st.DrawFn) -> str:
    """A Prometheus text page: families in any order, samples with label values holding the characters
    a line filter could trip on (braces, spaces, quotes, escapes, '#'), comments, blank lines."""
    lines: list[str] = []
    for name, kind, suffix in draw(st.lists(st.sampled_from(_FAMILIES), max_size=8, unique=True)):
        if draw(st.booleans()):
            lines.append(f"# HELP {name}{suffix if kind == 'counter' and draw(st.booleans()) else ''} some help text")
        lines.append(f"# TYPE {name} {kind}")
        for _ in range(draw(st.integers(0, 3))):
            labels = {
                "engine": draw(st.sampled_from(["0", "1"])),
                "source": draw(st.sampled_from(["device", "host", "p2p"])),
                "block_size": draw(st.sampled_from(["16", "32", "x"])),
                "num_gpu_blocks": draw(st.sampled_from(["100", "4000"])),
                "note": draw(_LABEL_VALUES),
            }
            if kind == "histogram":
                labels["le"] = "+Inf"
            text = ",".join(
                f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34)).replace(chr(10), "")}"'
                for k, v in labels.items()
            )
            value = draw(st.integers(0, 10**6))
            lines.append(f"{name}{suffix}{{{text}}} {value}.0" if draw(st.booleans()) else f"{name}{suffix} {value}")
        if draw(st.booleans()):
            lines.append("# a comment")
        if draw(st.booleans()):
            lines.append("")
    return "\n".join(lines) + "\n"


def _fields(load: object) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(load).items() if k != "scraped_at"}  # type: ignore[call-overload]


@settings(max_examples=300, deadline=None)
@given(metric_pages())
def test_the_filtered_page_reads_as_the_whole_page(page: str) -> None:
    """Parsing only the lines :func:`read_lines` keeps gives what parsing every line gives."""
    try:
        whole = parse_vllm_metrics(page, whole_page=True)
    except ValueError:  # a page the parser refuses whole (duplicate sample names in one family...)
        return
    assert _fields(parse_vllm_metrics(page)) == _fields(whole)


def test_read_lines_keeps_only_the_read_families() -> None:
    page = (
        "# HELP vllm:num_requests_running Requests running.\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 2.0\n'
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{le="0.3"} 1.0\n'
        'vllm:num_requests_running_max{engine="0"} 9.0\n'
    )
    assert read_lines(page).splitlines() == page.splitlines()[:3]


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
