"""The scale-out render routes (``/v1/*/render``, only with ``--enable-scale-out``, else 403): the
``GenerateRequest`` a completions, chat, Messages or Responses request becomes; no admission, no engine."""

from __future__ import annotations

from collections.abc import Mapping
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


class RenderHandlers:
    """The render routes bound to one worker."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker

    def _scale_out_disabled(self) -> Response:
        return error_response(403, surfaces.SCALE_OUT_DISABLED, "PermissionDeniedError")

    async def render_completions(self, request: Request) -> Response:
        """``/v1/completions/render``: one ``GenerateRequest`` per prompt (a list), no admission check."""
        worker = self.worker
        if not worker.opts.enable_scale_out:
            return self._scale_out_disabled()
        try:
            body = await read_body(request)
            check_model(body, worker)
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
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        base = request.headers.get("x-request-id") or str_or_uuid(body.get("request_id"))
        base_id = f"cmpl-{base}"
        out = [
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
        return json_response(out)

    async def render_chat(self, request: Request) -> Response:
        """``/v1/chat/completions/render``: the ``GenerateRequest`` the chat request becomes."""
        worker = self.worker
        if not worker.opts.enable_scale_out:
            return self._scale_out_disabled()
        try:
            body = await read_body(request)
            check_model(body, worker)
            prompt = chat_prompt(body, body.get("messages"), worker)
            return json_response(self._render_chat(body, request, prompt, chat_max_tokens(body, worker)))
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)

    def _render_chat(
        self, body: Mapping[str, Any], request: Request, prompt: list[int], max_tokens: int
    ) -> dict[str, Any]:
        req = engine_request(body, request, prompt=prompt, max_tokens=max_tokens, request_id="")
        base = request.headers.get("x-request-id") or str_or_uuid(body.get("request_id"))
        return surfaces.generate_request(
            body,
            request_id=f"chatcmpl-{base}",
            token_ids=prompt,
            max_tokens=max_tokens,
            parse_context=surfaces.chat_parse_context(body),
            stream=req.stream,
        )

    async def render_messages(self, request: Request) -> Response:
        """``/v1/messages/render``: the Messages request converted to chat, then rendered as chat is."""
        worker = self.worker
        if not worker.opts.enable_scale_out:
            return self._scale_out_disabled()
        try:
            body = await read_body(request)
            check_model(body, worker)
            prompt = chat_prompt(body, surfaces.anthropic_chat_messages(body), worker)
            return json_response(self._render_chat(body, request, prompt, surfaces.anthropic_max_tokens(body)))
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)

    async def render_responses(self, request: Request) -> Response:
        """``/v1/responses/render``: ``request_id`` is the response id, no parse context."""
        worker = self.worker
        if not worker.opts.enable_scale_out:
            return self._scale_out_disabled()
        try:
            body = await read_body(request)
            req, response_id = responses_request(body, request, self.worker)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        return json_response(
            surfaces.generate_request(
                body,
                request_id=response_id,
                token_ids=req.prompt,
                max_tokens=req.max_tokens,
                parse_context=None,
                stream=req.stream,
            )
        )
