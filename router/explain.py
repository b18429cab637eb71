"""``POST /admin/route/explain``: a dry run of the routing decision, every candidate with its costs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from kvroute.policies.base import NoWorkerError
from kvroute.router.admin import require_admin, state_of
from kvroute.router.errors import ApiError, model_not_found, no_healthy_worker
from kvroute.router.parsing import check_generation
from kvroute.router.pipeline import RequestContext
from pydantic import BaseModel, ConfigDict


class ExplainBody(BaseModel):
    """A completion or chat request body, exactly as a client would send it."""

    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None


def explain_router() -> APIRouter:
    router = APIRouter(tags=["routing"])

    @router.post(
        "/route/explain",
        dependencies=[Depends(require_admin)],
        summary="Dry-run the routing decision: every candidate plan, its cost breakdown, the choice",
    )
    async def explain(body: ExplainBody, request: Request) -> dict[str, Any]:
        state = state_of(request)
        data = body.model_dump(exclude_none=True)
        kind = "chat" if "messages" in data else "completion"
        if "prompt" not in data and "messages" not in data:
            raise ApiError(400, "give `prompt` or `messages`", "missing_prompt")
        model, _ = check_generation(data, kind)
        if not state.registry.knows_model(model):
            raise model_not_found(model)
        views = state.registry.views(model)
        if not views:
            raise no_healthy_worker(model)
        route = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        ctx = RequestContext("explain", "POST", route, route, [], b"", data, model, False)
        ctx.extra["dry_run"] = True
        pipeline = state.pipeline
        facts = await pipeline.gather_facts(ctx, pipeline.policy)
        dry_run = getattr(pipeline.policy, "explain", None)
        try:
            plan = dry_run(facts, views) if dry_run is not None else pipeline.policy.choose(facts, views)
        except NoWorkerError as exc:
            raise ApiError(503, str(exc), "no_healthy_worker") from None
        return {
            "policy": pipeline.policy.name,
            "facts": {
                "prompt_tokens": facts.prompt_tokens,
                "block_size": facts.block_size,
                "matches": {
                    w: {"blocks": m.blocks, "gpu": m.gpu, "cpu": m.cpu, "storage": m.storage, "remote": m.remote}
                    for w, m in facts.matches.items()
                },
                "latency_class": facts.latency_class,
            },
            "workers": [
                {"id": v.id, "role": v.role, "load": v.load, "inflight": v.inflight, "kv_usage": v.kv_usage}
                for v in views
            ],
            "plan": plan.to_dict(),
        }

    return router
