"""``kvaware`` is the default policy; with no KV events from any worker it routes by load and says so."""

from __future__ import annotations

import httpx
from kvroute.config import RouterConfig

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, serve_worker


def test_kvaware_is_the_default_policy() -> None:
    assert RouterConfig.model_validate({}).policy == "kvaware"


async def test_without_kv_events_kvaware_routes_by_load_and_says_so(client: httpx.AsyncClient) -> None:
    async with serve_worker(FakeWorker("w1")) as w1, serve_worker(FakeWorker("w2")) as w2:
        # No policy named: the config's default. The fixture's round_robin default is overridden back.
        async with run_router([w1.url, w2.url], policy=RouterConfig().policy) as (url, _app):
            answers = [
                await client.post(url + "/v1/completions", json={"model": "m1", "prompt": f"hello {i}"})
                for i in range(4)
            ]
            assert all(r.status_code == 200 for r in answers)
            explained = (
                await client.post(url + "/admin/route/explain", json={"model": "m1", "prompt": "hello"})
            ).json()
            assert explained["policy"] == "kvaware"
            assert explained["index"]["routing"].startswith("load_only")
            assert sorted(explained["index"]["load_only"]) == sorted(
                u.removeprefix("http://") for u in (w1.url, w2.url)
            )
            metrics = (await client.get(url + "/metrics")).text
            assert "kvroute_kv_event_sources 0.0" in metrics
            assert "kvroute_workers_without_kv_events 2.0" in metrics
        # Both workers answered: load, not a (non-existent) cache, decided.
        assert {a.json()["worker"] for a in answers} <= {"w1", "w2"}
        assert sum(1 for s in w1.seen + w2.seen if s["path"] != "/tokenize") == 4
