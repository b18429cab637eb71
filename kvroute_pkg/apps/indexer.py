"""``kvroute indexer``: the stand-alone event consumer (subscribers -> a shared Redis index).

Large deployments run one of these next to many router replicas that read the same Redis
(``index.subscribe: false`` on the routers). The index and the subscriber come from the same factories
as ``kvroute serve``'s (:mod:`kvroute.apps.build`); this process adds the worker model discovery a
router gets from its registry, and, when asked for a port, /metrics and the index admin API.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

from kvroute.apps.build import make_indexer, make_maintenance, make_subscriber, spec_for
from kvroute.config import RouterConfig
from kvroute.indexer.backend import IndexBackend
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber

log = logging.getLogger("kvroute.indexer")

#: How often a worker whose model is unknown is asked for its /v1/models again.
DISCOVERY_RETRY_S = 5.0


async def discover_model(url: str, timeout_s: float = 2.0) -> str | None:
    """The first model a worker serves, from its ``/v1/models`` (None when it does not answer)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(f"{url}/v1/models")
            response.raise_for_status()
            data = response.json().get("data") or []
            return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
        return None


def build_from_config(
    config: RouterConfig, backend: IndexBackend | None = None, subscribe: bool | None = None
) -> tuple[KVIndexer, EventSubscriber | None]:
    """The indexer and its subscriber for a ``RouterConfig`` (workers with a known model added now).

    ``subscribe`` defaults to ``config.index.subscribe``; without it the indexer only reads a shared
    index that another process keeps (the subscriber is None). Workers without ``models`` are added
    by :func:`add_discovered_workers` once they answer. Call ``await subscriber.start()`` to run it.
    """
    index_cfg = config.index
    indexer = make_indexer(config, backend)
    if not (index_cfg.subscribe if subscribe is None else subscribe):
        return indexer, None
    subscriber = make_subscriber(config, indexer)
    for worker in config.workers:
        if worker.kv_events is None and not index_cfg.events_bind:
            log.warning(
                "worker %s has no kv_events endpoint and index.events_bind is not set: "
                "its KV events cannot be received",
                worker.worker_id,
            )
            continue
        if worker.models:
            first = worker.models[0]  # an adapter's events are its base model's
            subscriber.add_worker(spec_for(worker, config.adapter_bases().get(first, first)))
    return indexer, subscriber


async def add_discovered_workers(config: RouterConfig, subscriber: EventSubscriber) -> None:
    """Keep asking workers configured without ``models`` for their model, and subscribe when known."""
    pending = [w for w in config.workers if not w.models and (w.kv_events or config.index.events_bind)]
    while pending:
        for worker in list(pending):
            model = await discover_model(worker.url)
            if model is not None:
                subscriber.add_worker(spec_for(worker, model))
                log.info("worker %s serves %s: subscribed", worker.worker_id, model)
                pending.remove(worker)
        if pending:
            await asyncio.sleep(DISCOVERY_RETRY_S)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "indexer",
        help="consume KV events into a shared Redis index (for many router replicas)",
        description="Subscribe to every configured worker's KV events and keep the prefix index in Redis, "
        "where router replicas (index.backend: redis, index.subscribe: false) read it.",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML config file (default: $KVROUTE_CONFIG)")
    parser.add_argument("--redis-url", help="Redis URL (default: index.redis_url)")
    parser.add_argument("--redis-prefix", help="key prefix (default: index.redis_prefix)")
    parser.add_argument(
        "--backend",
        choices=["redis", "memory"],
        default="redis",
        help="memory is for trying things out: nobody else can read it",
    )
    parser.add_argument(
        "--bind", metavar="ENDPOINT", help="bind one SUB socket here for workers that connect (index.events_bind)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address of the metrics/admin port")
    parser.add_argument(
        "--port", type=int, default=0, help="serve /metrics, /health and /admin/ (index inspection) here; 0 = off"
    )
    parser.add_argument("--admin-token", help="bearer token for /admin/index (default: admin_token)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvroute.config import ConfigError, load_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    index_over = {
        k: v
        for k, v in {
            "backend": args.backend,
            "redis_url": args.redis_url,
            "redis_prefix": args.redis_prefix,
            "events_bind": args.bind,
        }.items()
        if v is not None
    }
    try:
        base = load_config(args.config)
        config = load_config(
            args.config, {"index": {**base.index.model_dump(), **index_over}, "admin_token": args.admin_token}
        )
    except ConfigError as exc:
        print(f"kvroute indexer: {exc}", file=sys.stderr)
        return 2
    if not config.workers:
        print("kvroute indexer: no workers configured (config file 'workers')", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(config, args.host, args.port))
    except KeyboardInterrupt:
        return 0


async def _serve(config: RouterConfig, host: str, port: int) -> int:
    try:
        indexer, subscriber = build_from_config(config, subscribe=True)
    except ValueError as exc:
        print(f"kvroute indexer: {exc}", file=sys.stderr)
        return 2
    assert subscriber is not None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if not await indexer.backend.ping():
        log.error(
            "index backend %s is not reachable yet: events are kept locally and written once it is",
            indexer.backend.name,
        )
        indexer.mark_backend_down("not reachable at start")
    maintenance = make_maintenance(config, indexer)
    await maintenance.start()
    await subscriber.start()
    if subscriber.bound_endpoint:
        log.info("listening for connecting workers on %s", subscriber.bound_endpoint)
    discovery = asyncio.create_task(add_discovered_workers(config, subscriber))
    server = _http_server(indexer, config.admin_token, host, port) if port else None
    serving = asyncio.create_task(server.serve()) if server is not None else None
    log.info("kvroute indexer running: %d workers, backend %s", len(indexer.workers()), indexer.backend.name)
    await stop.wait()
    log.info("stopping")
    discovery.cancel()
    if server is not None and serving is not None:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await serving
    with contextlib.suppress(asyncio.CancelledError):
        await discovery
    await subscriber.stop()
    await maintenance.stop()
    await indexer.backend.close()
    return 0


def _http_server(indexer: KVIndexer, token: str | None, host: str, port: int) -> Any:
    """/metrics, /health and the index admin API on one small FastAPI app."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse
    from kvroute.router.index_admin import index_admin_router
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(title="kvroute indexer", version="0.1.0")
    app.include_router(index_admin_router(indexer, token=token), prefix="/admin")

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest().decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "backend_ok": indexer.backend_ok}

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
