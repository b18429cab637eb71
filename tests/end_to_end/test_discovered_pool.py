"""A pool that comes and goes: simulated vLLM workers run as "pods" of the Kubernetes API stand-in (no real
cluster is available here; tests/discovery/kube_apiserver.py speaks the real list+watch wire format). Pods
join (ready), leave (unready, deleted) while clients keep sending: no request fails, and every worker that
is in the pool is routed by KV cache (its events learnt from /kv_event_sources)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.sim.fleet import SimFleet

from tests.discovery.kube_apiserver import KubeApiServer, make_pod
from tests.discovery.test_kubernetes import write_kubeconfig
from tests.end_to_end.conftest import FAST, eventually, words
from tests.http.upstream import serve


def pod_for(name: str, url: str) -> dict[str, object]:
    parts = urlsplit(url)
    return make_pod(name, ip=parts.hostname or "127.0.0.1", port=parts.port or 80, labels={"app": "vllm"})


async def test_pods_join_and_leave_under_traffic_with_no_failed_request(tmp_path: Path) -> None:
    fleet = SimFleet(3, "tiny", time_scale=FAST)
    apiserver = KubeApiServer(token="s3cret")
    await apiserver.start()
    try:
        async with fleet:
            urls = fleet.urls
            apiserver.add(pod_for("vllm-0", urls[0]))
            apiserver.add(pod_for("vllm-1", urls[1]))
            config = RouterConfig.model_validate(
                {
                    "health_interval_s": 0.2,
                    "metrics_interval_s": 0.2,
                    "discovery": {
                        "kubernetes": {
                            "selector": "app=vllm",
                            "port_name": "http",
                            "kubeconfig": write_kubeconfig(tmp_path, apiserver.url),
                        },
                        "grace_s": 0.5,
                    },
                }
            )
            app = build_app(config)
            async with serve(app, lifespan="on") as url, httpx.AsyncClient(timeout=30) as client:

                async def pool() -> set[str]:
                    listed = (await client.get(url + "/admin/workers")).json()["workers"]
                    return {w["id"] for w in listed if w["healthy"]}

                async def sources() -> float:
                    text = (await client.get(url + "/metrics")).text
                    line = next(li for li in text.splitlines() if li.startswith("kvroute_kv_event_sources "))
                    return float(line.split()[1])

                await eventually(lambda: _eq(pool(), {"vllm-0", "vllm-1"}), timeout=20, what="two pods joined")
                await eventually(lambda: _ge(sources(), 2), timeout=20, what="two pods subscribed")
                answers: list[int] = []
                stop = asyncio.Event()

                async def client_loop(i: int) -> None:
                    n = 0
                    while not stop.is_set():
                        body = {"model": fleet.model, "prompt": words(80, f"c{i}t{n % 3}"), "max_tokens": 2}
                        r = await client.post(url + "/v1/completions", json=body)
                        answers.append(r.status_code)
                        n += 1

                loops = [asyncio.create_task(client_loop(i)) for i in range(4)]
                await asyncio.sleep(0.5)
                apiserver.add(pod_for("vllm-2", urls[2]))  # scale up
                await eventually(lambda: _eq(pool(), {"vllm-0", "vllm-1", "vllm-2"}), timeout=20, what="joined")
                await asyncio.sleep(0.5)
                apiserver.update("vllm-0", ready=False)  # a rolling update: unready, then gone
                await eventually(lambda: _eq(pool(), {"vllm-1", "vllm-2"}), timeout=20, what="unready pod left")
                apiserver.delete("vllm-0")
                apiserver.terminate("vllm-1")  # terminating: leaves although its process still answers
                await eventually(lambda: _eq(pool(), {"vllm-2"}), timeout=20, what="terminating pod left")
                await asyncio.sleep(0.5)
                stop.set()
                await asyncio.gather(*loops)
                assert len(answers) > 20 and set(answers) == {200}, sorted(set(answers))
                # The pods that left were unsubscribed (and purged); the one in the pool is routed by KV cache.
                await eventually(lambda: _eq_n(sources(), 1), timeout=20, what="one subscription left")
    finally:
        await apiserver.stop()


async def _eq(value: object, expected: set[str]) -> bool:
    return await value == expected  # type: ignore[misc]


async def _ge(value: object, floor: float) -> bool:
    return await value >= floor  # type: ignore[misc]


async def _eq_n(value: object, expected: float) -> bool:
    return await value == expected  # type: ignore[misc]
