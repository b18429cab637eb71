"""What the registry's scrape makes of an engine's page: an engine restart (its monotonic counters went
back) sets the worker's index entries aside until its next events, as vLLM publishes nothing about its lost
cache until it steps; the running count is read against the requests the router had in flight then."""

from __future__ import annotations

from collections.abc import Callable

from kvroute.config import WorkerConfig
from kvroute.indexer.events import BlockStored
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.service import KVIndexer
from kvroute.router.metrics import RouterMetrics
from kvroute.router.registry import WorkerLoad, WorkerRegistry, counters_went_back
from kvroute.router.transport import HttpxTransport
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from tests.http.upstream import serve
from tests.indexer.fakevllm import Chain, frames

PROMPT = list(range(300, 300 + 64))


def page(queries: float, device: float) -> str:
    return "\n".join(
        [
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}',
            "# TYPE vllm:prompt_tokens_cached_by_source counter",
            f'vllm:prompt_tokens_cached_by_source_total{{engine="0",source="device"}} {device}',
            "",
        ]
    )


def test_counters_went_back() -> None:
    before = WorkerLoad(prefix_queries=100.0, prefix_hits=40.0, cached_by_source={"device": 40.0})
    assert not counters_went_back(before, WorkerLoad(prefix_queries=120.0, prefix_hits=40.0, cached_by_source={}))
    assert counters_went_back(before, WorkerLoad(prefix_queries=5.0, prefix_hits=40.0))
    assert counters_went_back(before, WorkerLoad(prefix_queries=100.0, prefix_hits=0.0))
    assert counters_went_back(
        before, WorkerLoad(prefix_queries=100.0, prefix_hits=40.0, cached_by_source={"device": 1.0})
    )


def engine_app(page: Callable[[], str]) -> Starlette:
    """An engine's ``/health`` and its ``/metrics`` page as ``page()`` returns it at each scrape."""

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(page())

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[Route("/metrics", metrics), Route("/health", health)])


async def test_a_restarted_engines_entries_are_doubted_until_its_next_events() -> None:
    counters = {"queries": 100.0, "device": 64.0}
    app = engine_app(lambda: page(counters["queries"], counters["device"]))
    transport = HttpxTransport(1, 1)
    async with serve(app) as url:
        registry = WorkerRegistry([WorkerConfig(url=url, id="w", models=["m"])], transport, RouterMetrics())
        metrics_registry = CollectorRegistry()
        indexer = KVIndexer(MemoryIndex(), metrics=IndexerMetrics(metrics_registry))
        indexer.register_worker("w", "m")
        registry.cache_listeners.append(indexer.doubt_worker)  # as build_state wires them
        chain = Chain()
        await indexer.handle_message("w", frames([chain.store(PROMPT)], 0))
        await registry.probe_all()
        await registry.scrape_all()
        counters["queries"] += 50
        await registry.scrape_all()  # counters grow: nothing lost
        assert set((await indexer.lookup_tokens("m", PROMPT)).matches) == {"w"}
        counters.update(queries=3.0, device=0.0)  # the engine came back with counters from zero
        await registry.scrape_all()
        assert (await indexer.lookup_tokens("m", PROMPT)).matches == {}
        sample = metrics_registry.get_sample_value(
            "kvroute_index_doubts_total", {"worker": "w", "reason": "engine_restarted"}
        )
        assert sample == 1
        # Its first batch (sequence 0 again: the index purges on the restart) brings the new truth.
        fresh = Chain(seed=9)
        stored: BlockStored = fresh.store(PROMPT[:32])
        await indexer.handle_message("w", frames([stored], 0))
        match = (await indexer.lookup_tokens("m", PROMPT)).matches["w"]
        assert match.blocks == 2
    await transport.aclose()


async def test_a_scrape_is_read_against_the_requests_in_flight_when_it_was_taken() -> None:
    """Four requests in flight when the engine reported four running: none foreign, and still none once
    three of them finished (the page not scraped again yet); the next scrape shows one of another client."""
    running = {"n": 4.0}
    app = engine_app(
        lambda: f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine="0"}} {running["n"]}\n'
    )
    transport = HttpxTransport(1, 1)
    async with serve(app) as url:
        registry = WorkerRegistry([WorkerConfig(url=url, id="w", models=["m"])], transport, RouterMetrics())
        await registry.probe_all()
        for _ in range(4):
            registry.acquire("w")
        await registry.scrape_all()
        (view,) = registry.views("m")
        assert (view.running, view.scraped_inflight, view.foreign, view.load) == (4, 4, 0, 4)
        for _ in range(3):
            registry.release("w")
        (view,) = registry.views("m")
        assert (view.inflight, view.foreign, view.load) == (1, 0, 1)
        running["n"] = 2.0
        await registry.scrape_all()
        (view,) = registry.views("m")
        assert (view.scraped_inflight, view.foreign, view.load) == (1, 1, 2)
    await transport.aclose()
