"""The router's extension points, as the composition root offers them: a policy plugin (it sees the request
flow's facts and observes outcomes), extra services with a lifetime inside the app's (the EPP's gRPC server
is one), and the admin routes the root mounts (bearer-token protected)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import httpx
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.policies import Policy, RoutePlan, RouteRequest, WorkerView
from kvroute.policies.base import RouteOutcome
from kvroute.router.state import RouterState

from tests.http.upstream import FakeWorker, serve, serve_worker


class Facts(Policy):
    """A plugin policy that asks for the index: the flow tokenizes (the worker's /tokenize) and looks up."""

    name = "facts"
    needs_index = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[RouteRequest] = []
        self.outcomes: list[RouteOutcome] = []

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        self.seen.append(request)
        w = workers[0]
        return RoutePlan(prefill=w.id, decode=w.id, policy=self.name, predicted_cached_tokens=3)

    def explain(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        w = workers[0]
        return RoutePlan(prefill=w.id, decode=w.id, policy=self.name, predicted_cached_tokens=3)

    def observe(self, outcome: RouteOutcome) -> None:
        self.outcomes.append(outcome)


class Recorder:
    """An extra service: records when the app starts and stops it, and what it saw of the state."""

    def __init__(self, state: RouterState, events: list[str]) -> None:
        self.state = state
        self.events = events

    async def start(self) -> None:
        # Core services (the registry's probes) are already running when an extra one starts.
        self.events.append(f"start:{len(self.state.registry)}")

    async def stop(self) -> None:
        self.events.append("stop")


@contextlib.asynccontextmanager
async def app_with(workers: list[str], policy: Policy, events: list[str]) -> AsyncIterator[tuple[str, object]]:
    config = RouterConfig.model_validate(
        {"workers": [{"url": u} for u in workers], "admin_token": "t", "models": [{"name": "m1", "block_size": 32}]}
    )
    app = build_app(config, policy=policy, extra_services=[lambda state: Recorder(state, events)])
    async with serve(app, lifespan="on") as url:
        assert events == ["start:1"]
        yield url, app
    assert events == ["start:1", "stop"]


async def test_plugin_policy_sees_the_flow_facts_and_outcomes(client: httpx.AsyncClient) -> None:
    w = FakeWorker("w")
    policy = Facts()
    events: list[str] = []
    async with serve_worker(w), app_with([w.url], policy, events) as (url, _app):
        r = await client.post(url + "/v1/completions", json={"model": "m1", "prompt": "hello"})
        assert r.status_code == 200
        stats = await client.get(url + "/admin/index/stats", headers={"Authorization": "Bearer t"})
        assert stats.status_code == 200 and "workers" in stats.json()
        assert (await client.get(url + "/admin/index/stats")).status_code == 401
        explained = await client.post(
            url + "/admin/route/explain", json={"model": "m1", "prompt": "hello"}, headers={"Authorization": "Bearer t"}
        )
        assert explained.status_code == 200 and explained.json()["plan"]["predicted_cached_tokens"] == 3
    seen = policy.seen[0]
    # The prompt was tokenized by the worker's /tokenize and the block size comes from the model's config.
    assert any(s["path"] == "/tokenize" for s in w.seen)
    assert seen.prompt_tokens == 3 and seen.block_size == 32
    assert len(policy.seen) == 1  # explain is a dry run: choose() was not called for it
    assert policy.outcomes[0].plan.predicted_cached_tokens == 3 and policy.outcomes[0].cached_tokens == 4
