"""Small vLLM-like workers on 127.0.0.1 (aiohttp): ``/health``, ``/v1/models``, ``/metrics`` and a
``/kv_event_sources`` whose answer each test sets (a vLLM-shaped one by default, or hostile bytes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


def vllm_sources(
    host: str = "*", base_port: int = 5557, ranks: int = 1, replay_base: int | None = 5567, topic: str = "kv-events"
) -> dict[str, Any]:
    """What vLLM >= 0.32 answers on /kv_event_sources: {"sources": [...]} sorted by rank."""
    return {
        "sources": [
            {
                "data_parallel_rank": rank,
                "endpoint": f"tcp://{host}:{base_port + rank}",
                "replay_endpoint": None if replay_base is None else f"tcp://{host}:{replay_base + rank}",
                "topic": topic,
            }
            for rank in range(ranks)
        ]
    }


@dataclass
class Worker:
    name: str
    #: JSON-able answer, raw bytes, or None for "no such route" (404, like vLLM < 0.32).
    sources: Any = field(default_factory=vllm_sources)
    sources_status: int = 200
    sources_delay_s: float = 0.0
    healthy: bool = True
    url: str = ""
    port: int = 0
    hits: dict[str, int] = field(default_factory=dict)

    async def _health(self, request: web.Request) -> web.Response:
        self.hits["/health"] = self.hits.get("/health", 0) + 1
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m1", "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="# nothing\n", content_type="text/plain")

    async def _sources(self, request: web.Request) -> web.StreamResponse:
        self.hits["/kv_event_sources"] = self.hits.get("/kv_event_sources", 0) + 1
        if self.sources_delay_s:
            await asyncio.sleep(self.sources_delay_s)
        if self.sources is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        body = self.sources if isinstance(self.sources, bytes) else orjson.dumps(self.sources)
        return web.Response(status=self.sources_status, body=body, content_type="application/json")


@contextlib.asynccontextmanager
async def serve_worker(worker: Worker) -> AsyncIterator[Worker]:
    app = web.Application()
    app.router.add_get("/health", worker._health)
    app.router.add_get("/v1/models", worker._models)
    app.router.add_get("/metrics", worker._metrics)
    app.router.add_get("/kv_event_sources", worker._sources)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    worker.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    worker.url = f"http://127.0.0.1:{worker.port}"
    try:
        yield worker
    finally:
        await runner.cleanup()
