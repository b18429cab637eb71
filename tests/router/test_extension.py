"""The seams later parts plug into: a Pipeline subclass (facts, executor), extra admin routers, hooks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import httpx
from fastapi import APIRouter, Depends, Request
from kvroute.config import RouterConfig
from kvroute.policies import Policy, RoutePlan, RouteRequest, WorkerView
from kvroute.policies.base import RouteOutcome
from kvroute.router.admin import require_admin
from kvroute.router.app import create_app
from kvroute.router.pipeline import AggregatedExecutor, Pipeline, RequestContext

from tests.router.upstream import FakeWorker, serve, serve_worker


class Facts(Policy):
    name = "facts"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[RouteRequest] = []
        self.outcomes: list[RouteOutcome] = []

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        self.seen.append(request)
        w = workers[0]
        return RoutePlan(prefill=w.id, decode=w.id, policy=self.name, predicted_cached_tokens=3)

    def observe(self, outcome: RouteOutcome) -> None:
        self.outcomes.append(outcome)


class RewritingExecutor(AggregatedExecutor):
    """Stands for a later executor that rewrites the body (kv_transfer_params) before forwarding."""

    async def execute(self, pipeline, ctx: RequestContext, plan: RoutePlan):
        import orjson

        assert ctx.json is not None
        ctx.json["kv_transfer_params"] = {"marker": plan.prefill}
        ctx.body = orjson.dumps(ctx.json)
        return await super().execute(pipeline, ctx, plan)


class EnrichedPipeline(Pipeline):
    async def gather_facts(self, ctx: RequestContext, policy: Policy) -> RouteRequest:
        facts = await super().gather_facts(ctx, policy)
        facts.prompt_tokens = len(str(ctx.json.get("prompt", ""))) if ctx.json else None
        assert self.config is not None
        facts.block_size = self.config.model_config_for(facts.model).block_size or 16
        return facts

    def executor_for(self, ctx: RequestContext, plan: RoutePlan):
        return RewritingExecutor() if ctx.extra.get("rewrite", True) else self.executor


@contextlib.asynccontextmanager
async def app_with(workers: list[str], policy: Policy) -> AsyncIterator[tuple[str, object]]:
    extra = APIRouter(dependencies=[Depends(require_admin)])

    @extra.get("/index/stats")
    async def stats(request: Request) -> dict[str, int]:
        return {"workers": len(request.app.state.kvroute.registry)}

    config = RouterConfig.model_validate(
        {"workers": [{"url": u} for u in workers], "admin_token": "t", "models": [{"name": "m1", "block_size": 32}]}
    )
    app = create_app(config, policy=policy, pipeline_cls=EnrichedPipeline, admin_routers=[extra])
    events: list[str] = []

    async def started(state) -> None:
        events.append("start")

    async def stopped(state) -> None:
        events.append("stop")

    app.state.kvroute.on_startup.append(started)
    app.state.kvroute.on_shutdown.append(stopped)
    async with serve(app, lifespan="on") as url:
        assert events == ["start"]
        yield url, app
    assert events == ["start", "stop"]


async def test_pipeline_subclass_executor_and_admin_router(client: httpx.AsyncClient) -> None:
    w = FakeWorker("w")
    policy = Facts()
    async with serve_worker(w), app_with([w.url], policy) as (url, _app):
        r = await client.post(url + "/v1/completions", json={"model": "m1", "prompt": "hello"})
        assert r.status_code == 200
        stats = await client.get(url + "/admin/index/stats", headers={"Authorization": "Bearer t"})
        assert stats.json() == {"workers": 1}
        assert (await client.get(url + "/admin/index/stats")).status_code == 401
    assert policy.seen[0].prompt_tokens == 5 and policy.seen[0].block_size == 32
    assert w.seen[-1]["body"]["kv_transfer_params"] == {"marker": w.url.removeprefix("http://")}
    assert policy.outcomes[0].plan.predicted_cached_tokens == 3 and policy.outcomes[0].cached_tokens == 4
