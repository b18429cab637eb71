"""Several router replicas reading one Redis index that a separate indexer keeps."""

from __future__ import annotations

import httpx
import orjson
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.indexer.redis_index import RedisIndex
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec
from kvroute.sim.fleet import SimFleet

from tests.end_to_end.conftest import FAST, eventually, words
from tests.http.upstream import serve


async def test_replicas_route_by_a_shared_redis_index(redis_url: str) -> None:
    async with SimFleet(2, "tiny", time_scale=FAST) as fleet, httpx.AsyncClient(timeout=30) as client:
        # The stand-alone indexer's parts: subscribers writing to Redis.
        writer = KVIndexer(RedisIndex(redis_url))
        subscriber = EventSubscriber(writer)
        for worker in fleet.workers:
            subscriber.add_worker(
                WorkerSpec(worker.worker_id, fleet.model, worker.events_endpoint, replay=worker.replay_endpoint)
            )
        await subscriber.start()
        try:
            config = fleet.serve_config(
                policy="kvaware",
                debug_headers=True,
                health_interval_s=0.2,
                index={"backend": "redis", "redis_url": redis_url, "subscribe": False},
            )
            replicas = [build_app(RouterConfig.model_validate(config)) for _ in range(2)]
            holder = fleet[1]
            prompt = words(160, "shared")
            await client.post(
                f"{holder.url}/v1/completions", json={"model": fleet.model, "prompt": prompt, "max_tokens": 2}
            )

            async def indexed() -> bool:
                stats = await writer.stats()
                return any(w["worker"] == holder.worker_id and w["blocks"] >= 10 for w in stats["workers"])

            await eventually(indexed)
            for app in replicas:
                async with serve(app, lifespan="on") as url:
                    r = await client.post(
                        f"{url}/v1/completions",
                        headers={"x-kvroute-debug": "1"},
                        json={"model": fleet.model, "prompt": prompt, "max_tokens": 2},
                    )
                    assert r.status_code == 200
                    plan = orjson.loads(r.headers["x-kvroute-plan"])
                    assert plan["prefill"] == holder.worker_id
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 144
        finally:
            await subscriber.stop()
            await writer.backend.close()
