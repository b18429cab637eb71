"""``POST /admin/route/explain``: a dry run of the routing decision, every candidate with its costs.

The body goes through the same :func:`~kvroute.router.requests.parse_request` and
:meth:`~kvroute.router.flow.RequestFlow.decide` as a real request, with ``dry_run``: the policy's
``explain`` changes no state, and the conversation store's single-use entry is not taken.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from kvroute.router.admin import require_admin_read, state_of
from kvroute.router.errors import ApiError
from kvroute.router.requests import CHAT, COMPLETIONS, GENERATION_ROUTES, RESPONSES, parse_request
from pydantic import BaseModel, ConfigDict


class ExplainBody(BaseModel):
    """A generation request body, exactly as a client would send it; ``route`` names the surface when
    the body alone does not (``/v1/messages`` bodies look like chat ones)."""

    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    input: str | list[dict[str, Any]] | None = None
    route: str | None = None


def explain_router() -> APIRouter:
    router = APIRouter(tags=["routing"])

    @router.post(
        "/route/explain",
        dependencies=[Depends(require_admin_read)],
        summary="Dry-run the routing decision: every candidate plan, its cost breakdown, the choice",
    )
    async def explain(body: ExplainBody, request: Request) -> dict[str, Any]:
        state = state_of(request)
        data = body.model_dump(exclude_none=True)
        path = data.pop("route", None) or (
            CHAT if "messages" in data else RESPONSES if "input" in data else COMPLETIONS
        )
        if path not in GENERATION_ROUTES:
            raise ApiError(400, f"`route` must be one of {sorted(GENERATION_ROUTES)}", "invalid_route")
        if "prompt" not in data and "messages" not in data and "input" not in data:
            raise ApiError(400, "give `prompt`, `messages` or `input`", "missing_prompt")
        parsed = parse_request(
            "POST",
            path,
            request.scope["headers"],
            orjson.dumps(data),
            client_kv_params=state.config.pool.client_kv_params,
            request_id="explain",
        )
        decision = await state.flow.decide(parsed, dry_run=True)
        facts = decision.facts.route
        return {
            "policy": state.policy.name,
            "facts": {
                "prompt_tokens": facts.prompt_tokens,
                "block_size": facts.block_size,
                "matches": {
                    w: {
                        "blocks": m.blocks,
                        "gpu": m.gpu,
                        "cpu": m.cpu,
                        "storage": m.storage,
                        "remote": m.remote,
                        "pending": m.pending,
                    }
                    for w, m in facts.matches.items()
                },
                "latency_class": facts.latency_class,
            },
            "workers": [
                {"id": v.id, "role": v.role, "load": v.load, "inflight": v.inflight, "kv_usage": v.kv_usage}
                for v in state.registry.views(parsed.model)
            ],
            "index": state.routing_basis(),
            "plan": decision.plan.to_dict(),
        }

    return router
