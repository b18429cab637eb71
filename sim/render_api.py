"""The scale-out render routes (``/v1/*/render``, only with ``--enable-scale-out``, else 403): the
``GenerateRequest`` a completions, chat, Messages or Responses request becomes; no admission, no engine."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from kvroute.sim import surfaces
from kvroute.sim.errors import ApiError
from kvroute.sim.http_common import (
    chat_max_tokens,
    chat_prompt,
    check_model,
    engine_request,
    error_response,
    int_field,
    json_response,
    prompt_tokens,
    read_body,
    str_or_uuid,
)
from kvroute.sim.surface_api import responses_request
from starlette.requests import Request
from starlette.responses import Response

if TYPE_CHECKING:
    from kvroute.sim.worker import SimWorker

#: A render route's own logic: the checked body in, the JSON payload out (a 4xx :class:`ApiError` for bad input).
_Render = Callable[["RenderHandlers", dict[str, Any], Request], object]
_Route = Callable[["RenderHandlers", Request], Coroutine[Any, Any, Response]]


def _render_route(render: _Render) -> _Route:
    """What every render route shares, so each keeps only its own logic: 403 without ``--enable-scale-out``,
    the JSON body read and its model checked, an :class:`ApiError` turned into vLLM's error response."""

    @functools.wraps(render)
    async def route(self: RenderHandlers, request: Request) -> Response:
        if not self.worker.opts.enable_scale_out:
            return error_response(403, surfaces.SCALE_OUT_DISABLED, "PermissionDeniedError")
        try:
            body = await read_body(request)
            check_model(body, self.worker)
            return json_response(render(self, body, request))
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)

    return route


def _base_id(body: Mapping[str, Any], request: Request) -> str:
    return request.headers.get("x-request-id") or str_or_uuid(body.get("request_id"))


class RenderHandlers:
    """The render routes bound to one worker."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker

    @_render_route
    def render_completions(self, body: dict[str, Any], request: Request) -> list[dict[str, Any]]:
        """``/v1/completions/render``: one ``GenerateRequest`` per prompt (a list), no admission check."""
        worker = self.worker
        if "prompt" not in body:
            raise ApiError(400, "prompt is required.", param="prompt")
        raw = body["prompt"]
        batch = raw if isinstance(raw, list) and raw and all(isinstance(p, str | list) for p in raw) else [raw]
        prompts = [prompt_tokens(p, worker) for p in batch]
        if any(not p for p in prompts):
            raise ApiError(400, "No token_ids rendered", param="prompt")
        max_tokens = int_field(body, "max_tokens", worker.opts.default_max_tokens, 1)
        assert max_tokens is not None
        req = engine_request(body, request, prompt=prompts[0], max_tokens=max_tokens, request_id="")
        base_id = f"cmpl-{_base_id(body, request)}"
        return [
            surfaces.generate_request(
                body,
                request_id=base_id if len(prompts) == 1 else f"{base_id}-{i}",
                token_ids=tokens,
                max_tokens=req.max_tokens,
                parse_context=None,
                stream=req.stream,
            )
            for i, tokens in enumerate(prompts)
        ]

    @_render_route
    def render_chat(self, body: dict[str, Any], request: Request) -> dict[str, Any]:
        """``/v1/chat/completions/render``: the ``GenerateRequest`` the chat request becomes."""
        prompt = chat_prompt(body, body.get("messages"), self.worker)
        return self._render_chat(body, request, prompt, chat_max_tokens(body, self.worker))

    def _render_chat(
        self, body: Mapping[str, Any], request: Request, prompt: list[int], max_tokens: int
    ) -> dict[str, Any]:
        req = engine_request(body, request, prompt=prompt, max_tokens=max_tokens, request_id="")
        return surfaces.generate_request(
            body,
            request_id=f"chatcmpl-{_base_id(body, request)}",
            token_ids=prompt,
            max_tokens=max_tokens,
            parse_context=surfaces.chat_parse_context(body),
            stream=req.stream,
        )

    @_render_route
    def render_messages(self, body: dict[str, Any], request: Request) -> dict[str, Any]:
        """``/v1/messages/render``: the Messages request converted to chat, then rendered as chat is."""
        prompt = chat_prompt(body, surfaces.anthropic_chat_messages(body), self.worker)
        return self._render_chat(body, request, prompt, surfaces.anthropic_max_tokens(body))

    @_render_route
    def render_responses(self, body: dict[str, Any], request: Request) -> dict[str, Any]:
        """``/v1/responses/render``: ``request_id`` is the response id, no parse context."""
        req, response_id = responses_request(body, request, self.worker)
        return surfaces.generate_request(
            body,
            request_id=response_id,
            token_ids=req.prompt,
            max_tokens=req.max_tokens,
            parse_context=None,
            stream=req.stream,
        )
