"""The OpenAI-compatible HTTP API of one simulated worker, shaped like vLLM's (Starlette, no FastAPI:
it is lighter, and 16 workers share one process).

Every error is vLLM's OpenAI-style JSON body with the status it uses: bad input is a 4xx raised before
anything is sent, an unknown path or method is the HTTP status in that shape, and a fault inside the sim
is a JSON 500 (non-streaming) or, once a stream has started, vLLM's in-band ``data: {"error": ...}``
event followed by ``data: [DONE]``; a client never sees a plain-text error or a cut stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import orjson
from kvroute.sim.engine import EngineError, EngineRequest, drain
from kvroute.sim.kvparams import KVParamsError, parse_kv_params
from kvroute.sim.output import output_text
from kvroute.sim.tokenizer import VOCAB_SIZE
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

if TYPE_CHECKING:
    from kvroute.sim.worker import SimWorker

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ApiError(Exception):
    """Bad input found while parsing, answered as vLLM's JSON error with this status (never a 500)."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _json(data: object, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


def error_body(status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> dict[str, Any]:
    """vLLM's (OpenAI-style) error object, also the payload of an in-band streaming error."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(
    status: int,
    message: str,
    type_: str = "BadRequestError",
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """vLLM's (OpenAI-style) error response."""
    return _json(error_body(status, message, type_, param), status, headers)


def _internal(exc: BaseException) -> str:
    return f"Internal error in the simulated engine: {type(exc).__name__}: {exc}"[:500]


async def _http_error(request: Request, exc: Exception) -> Response:
    """Routing errors (unknown path 404, wrong method 405) in the JSON shape, typed by the HTTP phrase as
    vLLM's handler does, instead of Starlette's plain text."""
    if not isinstance(exc, HTTPException):
        return await _server_error(request, exc)
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "Error"
    return error_response(exc.status_code, str(exc.detail), phrase, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    """Last resort for a fault the handlers did not catch: a JSON 500, never Starlette's plain text."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, _internal(exc), "InternalServerError")


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, "Request body too large.", "RequestEntityTooLarge")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def _int(body: dict[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    """An optional integer field; bools are refused (JSON ``true`` is not a count)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError(400, f"{key} must be an integer >= {minimum}, got {value!r}.", param=key)
    return value


def _prompt_tokens(prompt: object, worker: SimWorker) -> list[int]:
    """``prompt`` as vLLM accepts it for one sequence: text, token ids, or a batch of one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return worker.tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 or t >= VOCAB_SIZE for t in prompt):
            raise ApiError(400, f"Token ids must be in [0, {VOCAB_SIZE}).", param="prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "Batched prompts are not supported by the simulator; send one prompt.", param="prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids.", param="prompt")


def _request(body: dict[str, Any], http: Request, worker: SimWorker, *, chat: bool) -> EngineRequest:
    model = body.get("model")
    if model is not None and model != worker.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    if _int(body, "n", 1, 1) != 1:
        raise ApiError(400, "n > 1 is not supported by the simulator.", param="n")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list.", param="messages")
        try:
            prompt = worker.tokenizer.encode_chat(messages, bool(body.get("add_generation_prompt", True)))
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc), param="messages") from None
        max_tokens = _int(body, "max_completion_tokens", None, 1) or _int(
            body, "max_tokens", worker.opts.default_chat_max_tokens, 1
        )
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required.", param="prompt")
        prompt = _prompt_tokens(body["prompt"], worker)
        max_tokens = _int(body, "max_tokens", worker.opts.default_max_tokens, 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean.", param="stream")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "cache_salt must be a non-empty string.", param="cache_salt")
    try:
        kv = parse_kv_params(body.get("kv_transfer_params"))
    except KVParamsError as exc:
        raise ApiError(400, str(exc), param="kv_transfer_params") from None
    request_id = http.headers.get("x-request-id") or uuid.uuid4().hex
    assert max_tokens is not None
    return EngineRequest(
        request_id=request_id, prompt=prompt, max_tokens=max_tokens, stream=stream, kv=kv, cache_salt=salt
    )


def _usage(req: EngineRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": len(req.prompt),
        "total_tokens": len(req.prompt) + req.output_tokens,
        "completion_tokens": req.output_tokens,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


class OpenAIHandlers:
    """Route handlers bound to one worker."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        worker = self.worker
        arrival = asyncio.get_running_loop().time()
        if not worker.healthy:
            return error_response(503, "The engine is not healthy.", "ServiceUnavailableError")
        try:
            body = await _body(request)
            req = _request(body, request, worker, chat=chat)
            req.arrival = arrival
            worker.engine.validate(req)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        except EngineError as exc:
            return error_response(400, str(exc))
        body_id = ("chatcmpl-" if chat else "cmpl-") + req.request_id
        created = int(time.time())
        if req.stream:
            include_usage = False
            options = body.get("stream_options")
            if isinstance(options, dict):
                include_usage = bool(options.get("include_usage"))
            stream = self._stream(req, body_id, created, chat, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"X-Request-Id": req.request_id})
        try:
            await drain(worker.engine.generate(req))
        except EngineError as exc:
            return error_response(400, str(exc))
        except Exception as exc:  # a sim fault: JSON 500 as vLLM's serving layer answers, the worker lives on
            log.exception("request %s failed", req.request_id)
            return error_response(500, _internal(exc), "InternalServerError")
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
        return _json(
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
        self, req: EngineRequest, body_id: str, created: int, chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        worker = self.worker
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": body_id, "object": obj, "created": created, "model": worker.model}
        gen = worker.engine.generate(req)
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
                yield _sse({**head, "choices": [choice]})
            end: dict[str, object] = {"logprobs": None, "finish_reason": "length", "stop_reason": None}
            last = {"index": 0, "delta": {}, **end} if chat else {"index": 0, "text": "", **end}
            yield _sse({**head, "choices": [last]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(req)})
        except Exception as exc:  # the 200 is on the wire: report in-band as vLLM does, then end cleanly
            log.exception("stream %s failed", req.request_id)
            yield _sse(error_body(500, _internal(exc), "InternalServerError"))
        finally:
            await gen.aclose()
        yield b"data: [DONE]\n\n"

    async def models(self, request: Request) -> Response:
        worker = self.worker
        card = {
            "id": worker.model,
            "object": "model",
            "created": worker.created,
            "owned_by": "vllm",
            "root": worker.model,
            "parent": None,
            "max_model_len": worker.opts.preset.max_model_len,
            "permission": [],
        }
        return _json({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if self.worker.healthy:
            return Response(status_code=200)
        return error_response(503, "The engine is not healthy.", "ServiceUnavailableError")

    async def kv_event_sources(self, request: Request) -> Response:
        """vLLM >= 0.32's discovery route: ``{"sources": [...]}``, one entry per DP rank, sorted by rank."""
        sources = sorted(self.worker.kv_event_sources(), key=lambda s: s["data_parallel_rank"])
        return _json({"sources": sources})

    async def tokenize(self, request: Request) -> Response:
        worker = self.worker
        try:
            body = await _body(request)
            model = body.get("model")
            if model is not None and model != worker.model:
                raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list):
                    raise ApiError(400, "messages must be a list.", param="messages")
                try:
                    gen_prompt = bool(body.get("add_generation_prompt", True))
                    tokens = worker.tokenizer.encode_chat(messages, gen_prompt)
                except (ValueError, TypeError) as exc:
                    raise ApiError(400, str(exc), param="messages") from None
            elif isinstance(body.get("prompt"), str):
                tokens = worker.tokenizer.encode(body["prompt"])
            else:
                raise ApiError(400, "Either prompt (a string) or messages is required.")
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        return _json(
            {
                "count": len(tokens),
                "max_model_len": worker.opts.preset.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def metrics(self, request: Request) -> Response:
        return Response(self.worker.engine.metrics.render(), media_type=PROMETHEUS_TYPE)

    async def reset_prefix_cache(self, request: Request) -> Response:
        if not self.worker.engine.reset_prefix_cache():
            return error_response(
                409, "Failed to reset prefix cache: blocks are in use by running requests.", "ConflictError"
            )
        return Response(status_code=200)

    async def state(self, request: Request) -> Response:
        return _json({**self.worker.engine.state(), **self.worker.describe()})

    async def set_health(self, request: Request) -> Response:
        try:
            body = await _body(request)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type)
        healthy = body.get("healthy")
        if not isinstance(healthy, bool):
            return error_response(400, "healthy must be a boolean.", param="healthy")
        self.worker.healthy = healthy
        return _json({"healthy": healthy})

    async def version(self, request: Request) -> Response:
        return _json({"version": "0.11.0+kvroute-sim"})


def _sse(data: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def build_app(worker: SimWorker) -> Starlette:
    h = OpenAIHandlers(worker)
    return Starlette(
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        routes=[
            Route("/v1/completions", h.completions, methods=["POST"]),
            Route("/v1/chat/completions", h.chat, methods=["POST"]),
            Route("/v1/models", h.models, methods=["GET"]),
            Route("/health", h.health, methods=["GET"]),
            Route("/tokenize", h.tokenize, methods=["POST"]),
            Route("/metrics", h.metrics, methods=["GET"]),
            Route("/version", h.version, methods=["GET"]),
            Route("/reset_prefix_cache", h.reset_prefix_cache, methods=["POST"]),
            Route("/kv_event_sources", h.kv_event_sources, methods=["GET"]),
            Route("/sim/state", h.state, methods=["GET"]),
            Route("/sim/health", h.set_health, methods=["POST"]),
        ],
    )
