"""What every route of a simulated worker's HTTP API shares: JSON and vLLM-style error responses, the
request body and its common fields (model, prompt, chat messages, stream, salt, KV-transfer params,
session), parsed and checked as vLLM does, with a 4xx :class:`ApiError` for bad input."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from kvroute.sim.engine import EngineRequest
from kvroute.sim.errors import ApiError, error_body
from kvroute.sim.kvparams import KVParamsError, parse_kv_params
from kvroute.sim.tokenizer import VOCAB_SIZE
from starlette.requests import Request
from starlette.responses import Response

if TYPE_CHECKING:
    from kvroute.sim.worker import SimWorker

#: One logger for the whole API (its name as before the split), whichever module logs.
log = logging.getLogger("kvroute.sim.api")

MAX_BODY_BYTES = 64 * 1024 * 1024
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: vLLM's headers (``vllm/entrypoints/generate/base/serving.py``): the data-parallel rank a router picked,
#: and the session of the request (after the body's ``session_id``, before ``vllm_xargs.session_id``).
DP_RANK_HEADER = "X-data-parallel-rank"
SESSION_ID_HEADER = "X-Session-ID"


def json_response(data: object, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


def error_response(
    status: int,
    message: str,
    type_: str = "BadRequestError",
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """vLLM's (OpenAI-style) error response."""
    return json_response(error_body(status, message, type_, param), status, headers)


def internal_message(exc: BaseException) -> str:
    return f"Internal error in the simulated engine: {type(exc).__name__}: {exc}"[:500]


async def read_body(request: Request) -> dict[str, Any]:
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


def int_field(body: Mapping[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    """An optional integer field; bools are refused (JSON ``true`` is not a count)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError(400, f"{key} must be an integer >= {minimum}, got {value!r}.", param=key)
    return value


def prompt_tokens(prompt: object, worker: SimWorker) -> list[int]:
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


def check_model(body: Mapping[str, Any], worker: SimWorker) -> None:
    model = body.get("model")
    if model is not None and model != worker.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def engine_request(
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


def chat_prompt(body: Mapping[str, Any], messages: object, worker: SimWorker) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.", param="messages")
    try:
        return worker.tokenizer.encode_chat(messages, bool(body.get("add_generation_prompt", True)))
    except (ValueError, TypeError) as exc:
        raise ApiError(400, str(exc), param="messages") from None


def chat_max_tokens(body: Mapping[str, Any], worker: SimWorker) -> int:
    value = int_field(body, "max_completion_tokens", None, 1) or int_field(
        body, "max_tokens", worker.opts.default_chat_max_tokens, 1
    )
    assert value is not None
    return value


def str_or_uuid(value: object) -> str:
    return value if isinstance(value, str) and value else uuid.uuid4().hex
