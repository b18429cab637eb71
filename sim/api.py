"""The HTTP API of one simulated worker, shaped like vLLM 0.32-0.33's (Starlette, no FastAPI: it is
lighter, and 16 workers share one process): OpenAI completions and chat, the Anthropic Messages API,
the OpenAI Responses API (:mod:`kvroute.sim.surfaces`), the scale-out render routes, tokenize, metrics,
discovery. Every generation surface goes through the same admission control, data-parallel rank
choice and engine, so one conversation hits the same KV cache whichever surface carries it.

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
from collections.abc import AsyncGenerator, Callable, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import orjson
from kvroute.sim import surfaces
from kvroute.sim.admission import REJECTION_TYPE, AdmissionRejected
from kvroute.sim.engine import EngineError, EngineRequest
from kvroute.sim.errors import ApiError, anthropic_error_body, error_body
from kvroute.sim.kvparams import KVParamsError, parse_kv_params
from kvroute.sim.output import output_text
from kvroute.sim.tokenizer import VOCAB_SIZE
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

if TYPE_CHECKING:
    from kvroute.sim.admission import Ticket
    from kvroute.sim.worker import SimRank, SimWorker

__all__ = ["ApiError", "build_app", "error_body", "error_response"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: vLLM's headers (``vllm/entrypoints/generate/base/serving.py``): the data-parallel rank a router picked,
#: and the session of the request (after the body's ``session_id``, before ``vllm_xargs.session_id``).
DP_RANK_HEADER = "X-data-parallel-rank"
SESSION_ID_HEADER = "X-Session-ID"


def _json(data: object, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


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


def _int(body: Mapping[str, Any], key: str, default: int | None, minimum: int) -> int | None:
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


def _session_id(body: Mapping[str, Any], http: Request, *, field: bool = True) -> str | None:
    """vLLM's ``_get_session_id``: the body's ``session_id``, else ``X-Session-ID``, else
    ``vllm_xargs.session_id``; empty values do not count. ``field=False`` for a surface without the field."""
    value = body.get("session_id") if field else None
    if value is not None and not isinstance(value, str):
        raise ApiError(400, "session_id must be a string.", param="session_id")
    if value:
        return value
    if header := http.headers.get(SESSION_ID_HEADER):
        return header
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        xvalue = xargs.get("session_id")
        if isinstance(xvalue, str) and xvalue:
            return xvalue
    return None


def _report_reused(body: Mapping[str, Any]) -> bool:
    xargs = body.get("vllm_xargs")
    return isinstance(xargs, dict) and xargs.get("kv_cache_report_mode") == "full"


def _check_model(body: Mapping[str, Any], worker: SimWorker) -> None:
    model = body.get("model")
    if model is not None and model != worker.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def _engine_request(
    body: Mapping[str, Any],
    http: Request,
    *,
    prompt: list[int],
    max_tokens: int,
    request_id: str,
    session_field: bool = True,
) -> EngineRequest:
    """The fields every generation surface shares: stream, salt, KV-transfer params, session."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean.", param="stream")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "cache_salt must be a non-empty string.", param="cache_salt")
    try:
        kv = parse_kv_params(body.get("kv_transfer_params"))
    except KVParamsError as exc:
        raise ApiError(400, str(exc), param="kv_transfer_params") from None
    return EngineRequest(
        request_id=request_id,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=stream,
        kv=kv,
        cache_salt=salt,
        session_id=_session_id(body, http, field=session_field),
        report_reused=_report_reused(body),
    )


def _chat_prompt(body: Mapping[str, Any], messages: object, worker: SimWorker) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.", param="messages")
    try:
        return worker.tokenizer.encode_chat(messages, bool(body.get("add_generation_prompt", True)))
    except (ValueError, TypeError) as exc:
        raise ApiError(400, str(exc), param="messages") from None


def _chat_max_tokens(body: Mapping[str, Any], worker: SimWorker) -> int:
    value = _int(body, "max_completion_tokens", None, 1) or _int(
        body, "max_tokens", worker.opts.default_chat_max_tokens, 1
    )
    assert value is not None
    return value


def _request(body: dict[str, Any], http: Request, worker: SimWorker, *, chat: bool) -> EngineRequest:
    _check_model(body, worker)
    if _int(body, "n", 1, 1) != 1:
        raise ApiError(400, "n > 1 is not supported by the simulator.", param="n")
    if chat:
        prompt = _chat_prompt(body, body.get("messages"), worker)
        max_tokens = _chat_max_tokens(body, worker)
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required.", param="prompt")
        prompt = _prompt_tokens(body["prompt"], worker)
        value = _int(body, "max_tokens", worker.opts.default_max_tokens, 1)
        assert value is not None
        max_tokens = value
    request_id = http.headers.get("x-request-id") or uuid.uuid4().hex
    return _engine_request(body, http, prompt=prompt, max_tokens=max_tokens, request_id=request_id)


def _usage(req: EngineRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": len(req.prompt),
        "total_tokens": len(req.prompt) + req.output_tokens,
        "completion_tokens": req.output_tokens,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


def _sse(data: Mapping[str, object]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class _Flight:
    """One admitted generation: its admission ticket and its rank's in-flight count, released once."""

    __slots__ = ("done", "rank", "ticket")

    def __init__(self, rank: SimRank, ticket: Ticket) -> None:
        self.rank, self.ticket, self.done = rank, ticket, False
        rank.inflight += 1

    def first_token(self) -> None:
        self.ticket.first_token()

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.ticket.release()
            self.rank.inflight -= 1


class _Body:
    """A streaming body that gives its flight back when it ends, fails, is closed, or is dropped unread
    (a client gone before the first chunk: Starlette never starts the generator, whose ``finally`` would
    then never run)."""

    def __init__(self, gen: AsyncGenerator[bytes, None], release: Callable[[], None]) -> None:
        self._gen, self._release = gen, release

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._gen.__anext__()
        except BaseException:
            self._release()
            raise

    async def aclose(self) -> None:
        self._release()
        await self._gen.aclose()

    def __del__(self) -> None:
        self._release()


class OpenAIHandlers:
    """Route handlers bound to one worker."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker

    # -- admission, rank, engine ------------------------------------------------------------------------

    def _rank(self, request: Request) -> SimRank:
        """vLLM's ``_get_data_parallel_rank`` + ``process_inputs``: a header that is not an integer is
        ignored, one out of ``[0, dp_size)`` is a 400; no header = the load balancer's choice."""
        worker = self.worker
        raw = request.headers.get(DP_RANK_HEADER)
        rank: int | None = None
        if raw is not None:
            try:
                rank = int(raw)
            except ValueError:
                rank = None
        if rank is not None:
            if not 0 <= rank < worker.dp_size:
                raise ApiError(400, f"data_parallel_rank {rank} is out of range [0, {worker.dp_size}).")
            return worker.ranks[rank]
        return worker.ranks[worker.balance() if worker.dp_size > 1 else 0]

    def _admit(self, request: Request, req: EngineRequest) -> _Flight:
        """Admission control (503), the engine's own checks (400), the rank (400): raised before anything
        is sent, in vLLM's order; then the request counts until its flight is released."""
        worker = self.worker
        worker.admission.check()
        try:
            worker.engine.validate(req)  # every rank runs the same model and cache size
        except EngineError as exc:
            raise ApiError(400, str(exc)) from None
        rank = self._rank(request)
        return _Flight(rank, worker.admission.admit(len(req.prompt)))

    async def _tokens(self, flight: _Flight, req: EngineRequest) -> AsyncGenerator[int, None]:
        """The engine's output counts; marks the end of prefill and releases the flight at the end."""
        gen = flight.rank.engine.generate(req)
        try:
            async for produced in gen:
                flight.first_token()
                yield produced
        finally:
            flight.release()
            await gen.aclose()

    async def _run(self, flight: _Flight, req: EngineRequest) -> None:
        """A non-streaming generation to its end (closed even when it fails: slot, blocks, flight)."""
        tokens = self._tokens(flight, req)
        try:
            async for _ in tokens:
                pass
        finally:
            await tokens.aclose()

    def _streaming(self, flight: _Flight, gen: AsyncGenerator[bytes, None], headers: Mapping[str, str]) -> Response:
        return StreamingResponse(_Body(gen, flight.release), media_type="text/event-stream", headers=headers)

    # -- OpenAI completions and chat --------------------------------------------------------------------

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
            stream = self._stream(flight, req, body_id, created, chat, include_usage)
            return self._streaming(flight, stream, {"X-Request-Id": req.request_id})
        try:
            await self._run(flight, req)
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
        self, flight: _Flight, req: EngineRequest, body_id: str, created: int, chat: bool, include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
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

    # -- Anthropic Messages (/v1/messages) --------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        """vLLM serves ``/v1/messages`` by converting it to a chat completion: same template, same tokens,
        same cache. Errors in Anthropic's shape (``overloaded_error`` for a full server)."""
        worker = self.worker
        arrival = asyncio.get_running_loop().time()
        if not worker.healthy:
            return _json(anthropic_error_body(503, "The engine is not healthy."), 503)
        try:
            body = await _body(request)
            _check_model(body, worker)
            messages = surfaces.anthropic_chat_messages(body)
            prompt = _chat_prompt(body, messages, worker)
            max_tokens = surfaces.anthropic_max_tokens(body)
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            req = _engine_request(
                body, request, prompt=prompt, max_tokens=max_tokens, request_id=request_id, session_field=False
            )
            req.arrival = arrival
            flight = self._admit(request, req)
        except ApiError as exc:
            return _json(anthropic_error_body(exc.status, exc.message), exc.status)
        except AdmissionRejected as exc:
            return _json(anthropic_error_body(503, exc.message), 503)
        msg_id = "chatcmpl-" + req.request_id
        if req.stream:
            return self._streaming(flight, self._messages_stream(flight, req, msg_id), {"X-Request-Id": request_id})
        try:
            await self._run(flight, req)
        except EngineError as exc:
            return _json(anthropic_error_body(400, str(exc)), 400)
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            return _json(anthropic_error_body(500, _internal(exc)), 500)
        usage = surfaces.anthropic_usage(
            len(req.prompt), req.output_tokens, req.cached_tokens, req.cache_created_tokens
        )
        text = output_text(len(req.prompt), 0, req.output_tokens)
        return _json(surfaces.anthropic_message(msg_id, worker.model, text, usage, req.kv_params_out))

    async def _messages_stream(self, flight: _Flight, req: EngineRequest, msg_id: str) -> AsyncGenerator[bytes, None]:
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
            error = anthropic_error_body(500, _internal(exc))
            yield sse("error", {"type": "error", "error": {"type": "api_error", "message": error["error"]["message"]}})
        finally:
            await gen.aclose()

    async def count_tokens(self, request: Request) -> Response:
        """``/v1/messages/count_tokens``: ``{"input_tokens": N}`` of the rendered conversation."""
        worker = self.worker
        try:
            body = await _body(request)
            _check_model(body, worker)
            prompt = _chat_prompt(body, surfaces.anthropic_chat_messages(body), worker)
        except ApiError as exc:
            return _json(anthropic_error_body(exc.status, exc.message), exc.status)
        return _json({"input_tokens": len(prompt)})

    # -- OpenAI Responses (/v1/responses) ---------------------------------------------------------------

    def _responses_request(self, body: dict[str, Any], request: Request) -> tuple[EngineRequest, str]:
        worker = self.worker
        _check_model(body, worker)
        if body.get("previous_response_id") is not None:
            raise ApiError(
                400,
                "previous_response_id is not supported by the simulator.",
                "invalid_request_error",
                "previous_response_id",
            )
        if body.get("background"):
            raise ApiError(400, "background responses are not supported by the simulator.", param="background")
        prompt = _chat_prompt(body, surfaces.responses_chat_messages(body), worker)
        value = _int(body, "max_output_tokens", worker.opts.default_chat_max_tokens, 1)
        assert value is not None
        response_id = surfaces.response_id(body)
        return _engine_request(body, request, prompt=prompt, max_tokens=value, request_id=response_id), response_id

    async def responses(self, request: Request) -> Response:
        worker = self.worker
        arrival = asyncio.get_running_loop().time()
        if not worker.healthy:
            return error_response(503, "The engine is not healthy.", "ServiceUnavailableError")
        try:
            body = await _body(request)
            req, response_id = self._responses_request(body, request)
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
            return error_response(500, _internal(exc), "InternalServerError")
        text = output_text(len(req.prompt), 0, req.output_tokens)
        item = surfaces.output_message(f"msg_{surfaces.random_uuid()}", text, "incomplete")
        return _json(self._response(body, req, response_id, created, [item], "incomplete"))

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
        self, flight: _Flight, req: EngineRequest, body: Mapping[str, Any], response_id: str, created: int
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
            yield event({"type": "error", "code": "500", "message": _internal(exc), "param": None})
        finally:
            await gen.aclose()

    # -- scale-out render (/v1/*/render) ----------------------------------------------------------------

    def _scale_out_disabled(self) -> Response:
        return error_response(403, surfaces.SCALE_OUT_DISABLED, "PermissionDeniedError")

    async def render_completions(self, request: Request) -> Response:
        """``/v1/completions/render``: one ``GenerateRequest`` per prompt (a list), no admission check."""
        worker = self.worker
        if not worker.opts.enable_scale_out:
            return self._scale_out_disabled()
        try:
            body = await _body(request)
            _check_model(body, worker)
            if "prompt" not in body:
                raise ApiError(400, "prompt is required.", param="prompt")
            raw = body["prompt"]
            batch = raw if isinstance(raw, list) and raw and all(isinstance(p, str | list) for p in raw) else [raw]
            prompts = [_prompt_tokens(p, worker) for p in batch]
            if any(not p for p in prompts):
                raise ApiError(400, "No token_ids rendered", param="prompt")
            max_tokens = _int(body, "max_tokens", worker.opts.default_max_tokens, 1)
            assert max_tokens is not None
            req = _engine_request(body, request, prompt=prompts[0], max_tokens=max_tokens, request_id="")
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        base = request.headers.get("x-request-id") or _str_or_uuid(body.get("request_id"))
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
        return _json(out)

    async def render_chat(self, request: Request) -> Response:
        """``/v1/chat/completions/render``: the ``GenerateRequest`` the chat request becomes."""
        worker = self.worker
        if not worker.opts.enable_scale_out:
            return self._scale_out_disabled()
        try:
            body = await _body(request)
            _check_model(body, worker)
            prompt = _chat_prompt(body, body.get("messages"), worker)
            return _json(self._render_chat(body, request, prompt, _chat_max_tokens(body, worker)))
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)

    def _render_chat(
        self, body: Mapping[str, Any], request: Request, prompt: list[int], max_tokens: int
    ) -> dict[str, Any]:
        req = _engine_request(body, request, prompt=prompt, max_tokens=max_tokens, request_id="")
        base = request.headers.get("x-request-id") or _str_or_uuid(body.get("request_id"))
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
            body = await _body(request)
            _check_model(body, worker)
            prompt = _chat_prompt(body, surfaces.anthropic_chat_messages(body), worker)
            return _json(self._render_chat(body, request, prompt, surfaces.anthropic_max_tokens(body)))
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)

    async def render_responses(self, request: Request) -> Response:
        """``/v1/responses/render``: ``request_id`` is the response id, no parse context."""
        worker = self.worker
        if not worker.opts.enable_scale_out:
            return self._scale_out_disabled()
        try:
            body = await _body(request)
            req, response_id = self._responses_request(body, request)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        return _json(
            surfaces.generate_request(
                body,
                request_id=response_id,
                token_ids=req.prompt,
                max_tokens=req.max_tokens,
                parse_context=None,
                stream=req.stream,
            )
        )

    # -- the rest ---------------------------------------------------------------------------------------
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
        """vLLM 0.32/0.33's discovery route as released (``serve/instrumentator/basic.py``): the engine client's
        ``dict[int, KVEventsConfig]``, JSON-encoded as rank -> the rank's resolved publisher config."""
        sources = sorted(self.worker.kv_event_sources(), key=lambda s: s["data_parallel_rank"])
        return _json(
            {
                str(s["data_parallel_rank"]): {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": s["endpoint"],
                    "replay_endpoint": s["replay_endpoint"],
                    "buffer_steps": 10_000,
                    "hwm": 100_000,
                    "max_queue_size": 100_000,
                    "topic": s["topic"],
                }
                for s in sources
            }
        )

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
        if not all([r.engine.reset_prefix_cache() for r in self.worker.ranks]):  # vLLM resets every rank
            return error_response(
                409, "Failed to reset prefix cache: blocks are in use by running requests.", "ConflictError"
            )
        return Response(status_code=200)

    async def state(self, request: Request) -> Response:
        worker = self.worker
        state = {**worker.engine.state(), **worker.describe()}
        if worker.dp_size > 1:
            state["ranks"] = [r.engine.state() for r in worker.ranks]
        return _json(state)

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


def _str_or_uuid(value: object) -> str:
    return value if isinstance(value, str) and value else uuid.uuid4().hex


def build_app(worker: SimWorker) -> Starlette:
    h = OpenAIHandlers(worker)
    return Starlette(
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        routes=[
            Route("/v1/completions", h.completions, methods=["POST"]),
            Route("/v1/chat/completions", h.chat, methods=["POST"]),
            Route("/v1/messages", h.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", h.count_tokens, methods=["POST"]),
            Route("/v1/responses", h.responses, methods=["POST"]),
            Route("/v1/completions/render", h.render_completions, methods=["POST"]),
            Route("/v1/chat/completions/render", h.render_chat, methods=["POST"]),
            Route("/v1/messages/render", h.render_messages, methods=["POST"]),
            Route("/v1/responses/render", h.render_responses, methods=["POST"]),
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
