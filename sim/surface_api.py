"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) and the OpenAI Responses
API (``/v1/responses``) of one worker: requests converted by :mod:`kvroute.sim.surfaces` to chat, run
through the same admission, rank and engine as chat, answered in each surface's own shape."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any

from kvroute.sim import surfaces
from kvroute.sim.admission import REJECTION_TYPE, AdmissionRejected
from kvroute.sim.engine import EngineError, EngineRequest
from kvroute.sim.errors import ApiError, anthropic_error_body
from kvroute.sim.flight import Flight, GenerationHandlers
from kvroute.sim.http_common import (
    chat_prompt,
    check_model,
    engine_request,
    error_response,
    int_field,
    internal_message,
    json_response,
    log,
    read_body,
)
from kvroute.sim.output import output_text
from starlette.requests import Request
from starlette.responses import Response

if TYPE_CHECKING:
    from kvroute.sim.worker import SimWorker


class MessagesHandlers(GenerationHandlers):
    """``/v1/messages`` and ``/v1/messages/count_tokens``."""

    async def messages(self, request: Request) -> Response:
        """vLLM serves ``/v1/messages`` by converting it to a chat completion: same template, same tokens,
        same cache. Errors in Anthropic's shape (``overloaded_error`` for a full server)."""
        worker = self.worker
        arrival = asyncio.get_running_loop().time()
        if not worker.healthy:
            return json_response(anthropic_error_body(503, "The engine is not healthy."), 503)
        try:
            body = await read_body(request)
            check_model(body, worker)
            messages = surfaces.anthropic_chat_messages(body)
            prompt = chat_prompt(body, messages, worker)
            max_tokens = surfaces.anthropic_max_tokens(body)
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            req = engine_request(
                body, request, prompt=prompt, max_tokens=max_tokens, request_id=request_id, session_field=False
            )
            req.arrival = arrival
            flight = self._admit(request, req)
        except ApiError as exc:
            return json_response(anthropic_error_body(exc.status, exc.message), exc.status)
        except AdmissionRejected as exc:
            return json_response(anthropic_error_body(503, exc.message), 503)
        msg_id = "chatcmpl-" + req.request_id
        if req.stream:
            return self._streaming(flight, self._messages_stream(flight, req, msg_id), {"X-Request-Id": request_id})
        try:
            await self._run(flight, req)
        except EngineError as exc:
            return json_response(anthropic_error_body(400, str(exc)), 400)
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            return json_response(anthropic_error_body(500, internal_message(exc)), 500)
        usage = surfaces.anthropic_usage(
            len(req.prompt), req.output_tokens, req.cached_tokens, req.cache_created_tokens
        )
        text = output_text(len(req.prompt), 0, req.output_tokens)
        return json_response(surfaces.anthropic_message(msg_id, worker.model, text, usage, req.kv_params_out))

    async def _messages_stream(self, flight: Flight, req: EngineRequest, msg_id: str) -> AsyncGenerator[bytes, None]:
        sse = surfaces.anthropic_sse
        gen = self._tokens(flight, req)
        sent = 0
        open_block = False
        try:
            async for produced in gen:
                if sent == 0:
                    yield sse("message_start", surfaces.anthropic_start(msg_id, self.worker.model, len(req.prompt)))
                    block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
                    yield sse("content_block_start", block)
                    open_block = True
                delta = {"type": "text_delta", "text": output_text(len(req.prompt), sent, produced)}
                yield sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
                sent += produced
            yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            open_block = False
            usage = surfaces.anthropic_usage(
                len(req.prompt), req.output_tokens, req.cached_tokens, req.cache_created_tokens
            )
            stop = {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None}}
            yield sse("message_delta", {**stop, "usage": usage})
            yield sse("message_stop", {"type": "message_stop"})
        except Exception as exc:  # in-band, as vLLM's converter: close the open block, then an error event
            log.exception("stream %s failed", req.request_id)
            if open_block:
                yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            error = anthropic_error_body(500, internal_message(exc))
            yield sse("error", {"type": "error", "error": {"type": "api_error", "message": error["error"]["message"]}})
        finally:
            await gen.aclose()

    async def count_tokens(self, request: Request) -> Response:
        """``/v1/messages/count_tokens``: ``{"input_tokens": N}`` of the rendered conversation."""
        worker = self.worker
        try:
            body = await read_body(request)
            check_model(body, worker)
            prompt = chat_prompt(body, surfaces.anthropic_chat_messages(body), worker)
        except ApiError as exc:
            return json_response(anthropic_error_body(exc.status, exc.message), exc.status)
        return json_response({"input_tokens": len(prompt)})


def responses_request(body: dict[str, Any], request: Request, worker: SimWorker) -> tuple[EngineRequest, str]:
    """A Responses request checked and converted (shared with ``/v1/responses/render``)."""
    check_model(body, worker)
    if body.get("previous_response_id") is not None:
        raise ApiError(
            400,
            "previous_response_id is not supported by the simulator.",
            "invalid_request_error",
            "previous_response_id",
        )
    if body.get("background"):
        raise ApiError(400, "background responses are not supported by the simulator.", param="background")
    prompt = chat_prompt(body, surfaces.responses_chat_messages(body), worker)
    value = int_field(body, "max_output_tokens", worker.opts.default_chat_max_tokens, 1)
    assert value is not None
    response_id = surfaces.response_id(body)
    return engine_request(body, request, prompt=prompt, max_tokens=value, request_id=response_id), response_id


class ResponsesHandlers(GenerationHandlers):
    """``/v1/responses``."""

    async def responses(self, request: Request) -> Response:
        worker = self.worker
        arrival = asyncio.get_running_loop().time()
        if not worker.healthy:
            return error_response(503, "The engine is not healthy.", "ServiceUnavailableError")
        try:
            body = await read_body(request)
            req, response_id = responses_request(body, request, self.worker)
            req.arrival = arrival
            flight = self._admit(request, req)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        except AdmissionRejected as exc:
            return error_response(503, exc.message, REJECTION_TYPE)
        created = surfaces.now()
        if req.stream:
            stream = self._responses_stream(flight, req, body, response_id, created)
            return self._streaming(flight, stream, {"X-Request-Id": req.request_id})
        try:
            await self._run(flight, req)
        except EngineError as exc:
            return error_response(400, str(exc))
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            return error_response(500, internal_message(exc), "InternalServerError")
        text = output_text(len(req.prompt), 0, req.output_tokens)
        item = surfaces.output_message(f"msg_{surfaces.random_uuid()}", text, "incomplete")
        return json_response(self._response(body, req, response_id, created, [item], "incomplete"))

    def _response(
        self,
        body: Mapping[str, Any],
        req: EngineRequest,
        response_id: str,
        created: int,
        output: list[dict[str, Any]],
        status: str,
        *,
        final: bool = True,
    ) -> dict[str, Any]:
        usage = (
            surfaces.responses_usage(len(req.prompt), req.output_tokens, req.cached_tokens, req.cache_created_tokens)
            if final
            else None
        )
        return surfaces.responses_object(
            body,
            response_id=response_id,
            created_at=created,
            model=self.worker.model,
            max_output_tokens=req.max_tokens,
            output=output,
            status=status,
            usage=usage,
            kv_transfer_params=req.kv_params_out if final else None,
        )

    async def _responses_stream(
        self, flight: Flight, req: EngineRequest, body: Mapping[str, Any], response_id: str, created: int
    ) -> AsyncGenerator[bytes, None]:
        seq = 0

        def event(data: dict[str, Any]) -> bytes:
            nonlocal seq
            data["sequence_number"] = seq
            seq += 1
            return surfaces.responses_sse(data)

        initial = self._response(body, req, response_id, created, [], "in_progress", final=False)
        yield event({"type": "response.created", "response": initial})
        yield event({"type": "response.in_progress", "response": initial})
        gen = self._tokens(flight, req)
        item_id = f"msg_{surfaces.random_uuid()}"
        sent = 0
        texts: list[str] = []
        try:
            async for produced in gen:
                if sent == 0:
                    added = {
                        "id": item_id,
                        "content": [],
                        "role": "assistant",
                        "status": "in_progress",
                        "type": "message",
                    }
                    yield event({"type": "response.output_item.added", "output_index": 0, "item": added})
                    part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
                    yield event(
                        {
                            "type": "response.content_part.added",
                            "output_index": 0,
                            "item_id": item_id,
                            "content_index": 0,
                            "part": part,
                        }
                    )
                delta = output_text(len(req.prompt), sent, produced)
                texts.append(delta)
                sent += produced
                yield event(
                    {
                        "type": "response.output_text.delta",
                        "content_index": 0,
                        "output_index": 0,
                        "item_id": item_id,
                        "delta": delta,
                        "logprobs": [],
                    }
                )
            text = "".join(texts)
            yield event(
                {
                    "type": "response.output_text.done",
                    "output_index": 0,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                    "item_id": item_id,
                }
            )
            done_part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
            yield event(
                {
                    "type": "response.content_part.done",
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": done_part,
                }
            )
            item = surfaces.output_message(item_id, text, "incomplete")
            yield event({"type": "response.output_item.done", "output_index": 0, "item": item})
            final = self._response(body, req, response_id, created, [item], "incomplete")
            yield event({"type": "response.incomplete", "response": final})
        except Exception as exc:  # in-band: an error event (OpenAI's ``error`` streaming event)
            log.exception("stream %s failed", req.request_id)
            yield event({"type": "error", "code": "500", "message": internal_message(exc), "param": None})
        finally:
            await gen.aclose()
