"""OpenAI completions (``/v1/completions``) and chat completions (``/v1/chat/completions``), plain and
streamed (SSE ending in ``data: [DONE]``), as vLLM 0.32-0.33 answers them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from kvroute.sim.admission import REJECTION_TYPE, AdmissionRejected
from kvroute.sim.engine import EngineError, EngineRequest
from kvroute.sim.errors import ApiError, error_body
from kvroute.sim.flight import Flight, GenerationHandlers
from kvroute.sim.hop_log import hop_log, prompt_key
from kvroute.sim.http_common import (
    chat_max_tokens,
    chat_prompt,
    check_model,
    engine_request,
    error_response,
    int_field,
    internal_message,
    json_response,
    log,
    prompt_tokens,
    read_body,
)
from kvroute.sim.output import output_text
from starlette.requests import Request
from starlette.responses import Response

if TYPE_CHECKING:
    from kvroute.sim.worker import SimWorker


def _request(body: dict[str, Any], http: Request, worker: SimWorker, *, chat: bool) -> EngineRequest:
    check_model(body, worker)
    if int_field(body, "n", 1, 1) != 1:
        raise ApiError(400, "n > 1 is not supported by the simulator.", param="n")
    if chat:
        prompt = chat_prompt(body, body.get("messages"), worker)
        max_tokens = chat_max_tokens(body, worker)
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required.", param="prompt")
        prompt = prompt_tokens(body["prompt"], worker)
        value = int_field(body, "max_tokens", worker.opts.default_max_tokens, 1)
        assert value is not None
        max_tokens = value
    request_id = http.headers.get("x-request-id") or uuid.uuid4().hex
    return engine_request(body, http, prompt=prompt, max_tokens=max_tokens, request_id=request_id)


def _usage(req: EngineRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": len(req.prompt),
        "total_tokens": len(req.prompt) + req.output_tokens,
        "completion_tokens": req.output_tokens,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


def _sse(data: Mapping[str, object]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class OpenAIHandlers(GenerationHandlers):
    """The OpenAI completions and chat routes of one worker."""

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        worker = self.worker
        arrival = asyncio.get_running_loop().time()
        reached = time.monotonic()
        if not worker.healthy:
            return error_response(503, "The engine is not healthy.", "ServiceUnavailableError")
        try:
            body = await read_body(request)
            req = _request(body, request, worker, chat=chat)
            req.arrival = arrival
            flight = self._admit(request, req)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        except AdmissionRejected as exc:
            return error_response(503, exc.message, REJECTION_TYPE)
        body_id = ("chatcmpl-" if chat else "cmpl-") + req.request_id
        created = int(time.time())
        if req.stream:
            include_usage = False
            options = body.get("stream_options")
            if isinstance(options, dict):
                include_usage = bool(options.get("include_usage"))
            hops = hop_log()
            key = (prompt_key(body), reached) if hops is not None else None
            stream = self._stream(flight, req, body_id, created, chat, include_usage, key)
            return self._streaming(flight, stream, {"X-Request-Id": req.request_id})
        try:
            await self._run(flight, req)
        except EngineError as exc:
            return error_response(400, str(exc))
        except Exception as exc:  # a sim fault: JSON 500 as vLLM's serving layer answers, the worker lives on
            log.exception("request %s failed", req.request_id)
            return error_response(500, internal_message(exc), "InternalServerError")
        text = output_text(len(req.prompt), 0, req.output_tokens)
        choice: dict[str, object]
        if chat:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        return json_response(
            {
                "id": body_id,
                "object": obj,
                "created": created,
                "model": worker.model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": _usage(req),
                "prompt_logprobs": None,
                "kv_transfer_params": req.kv_params_out,
            },
            200,
        )

    async def _stream(
        self,
        flight: Flight,
        req: EngineRequest,
        body_id: str,
        created: int,
        chat: bool,
        include_usage: bool,
        hop: tuple[int, float] | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The SSE answer; ``hop`` (key, arrival): the first token's send goes to the hop log."""
        worker = self.worker
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": body_id, "object": obj, "created": created, "model": worker.model}
        gen = self._tokens(flight, req)
        sent = 0
        try:
            async for produced in gen:
                text = output_text(len(req.prompt), sent, produced)
                if chat:
                    if sent == 0:
                        role = {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        yield _sse({**head, "choices": [role]})
                    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
                sent += produced
                # Stamped before the write: the generator resumes only when the server asks for the next
                # chunk, which may be after the client has read this one.
                written = time.monotonic()
                yield _sse({**head, "choices": [choice]})
                if hop is not None and (hops := hop_log()) is not None:  # the first token is on the wire
                    hops.write(hop[0], hop[1], written)
                    hop = None
            end: dict[str, object] = {"logprobs": None, "finish_reason": "length", "stop_reason": None}
            last = {"index": 0, "delta": {}, **end} if chat else {"index": 0, "text": "", **end}
            yield _sse({**head, "choices": [last]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(req)})
        except Exception as exc:  # the 200 is on the wire: report in-band as vLLM does, then end cleanly
            log.exception("stream %s failed", req.request_id)
            yield _sse(error_body(500, internal_message(exc), "InternalServerError"))
        finally:
            await gen.aclose()
        yield b"data: [DONE]\n\n"
