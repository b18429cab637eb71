"""Reading and checking a client's request once, before any routing work.

The body is read with a size limit, parsed once with orjson, and only the fields the router needs are
checked (``model``, ``stream``, the prompt or messages). The raw bytes are kept: when nothing has to be
rewritten they go to the worker untouched.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import orjson
from kvroute.router.errors import ApiError, bad_request
from starlette.requests import Request

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id when it is sane (it ends up in logs and in vLLM), else a new one."""
    given = request.headers.get("x-request-id")
    if given and _REQUEST_ID.match(given):
        return given
    return uuid.uuid4().hex


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) anything over ``limit`` bytes without buffering it."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    receive = request.receive  # straight from the server: Request.stream() adds a generator per request
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(499, "client disconnected while sending the body", "client_closed")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit} bytes", "request_too_large")


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise bad_request("request body is empty; a JSON object is expected", "invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    return data


def sniff_passthrough(body: bytes) -> tuple[dict[str, Any] | None, str | None, bool]:
    """``(data, model, stream)`` of a pass-through route's body: a JSON object when it is one (else None,
    the body is forwarded as it is), its ``model`` (400 when not a string) and ``stream`` flag."""
    data: dict[str, Any] | None = None
    if body.lstrip()[:1] == b"{":
        try:
            parsed = orjson.loads(body)
            data = parsed if isinstance(parsed, dict) else None
        except orjson.JSONDecodeError:
            data = None
    model = data.get("model") if data else None
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "`model` must be a string", "invalid_model")
    return data, model or None, bool(data.get("stream")) if data else False


def check_generation(data: dict[str, Any], kind: str) -> tuple[str, bool]:
    """Check what routing depends on (``kind``: "completion" or "chat"); return (model, stream)."""
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string", "invalid_model")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "invalid_stream")
    if kind == "chat":
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("`messages` is required and must be a non-empty list", "invalid_messages")
        if not all(isinstance(m, dict) for m in messages):
            raise bad_request("each item of `messages` must be an object", "invalid_messages")
    else:
        prompt = data.get("prompt")
        if prompt is None or not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise bad_request("`prompt` is required (a string, a list of strings or of token ids)", "invalid_prompt")
    for field in ("max_tokens", "max_completion_tokens", "n"):
        value = data.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise bad_request(f"`{field}` must be a non-negative integer", f"invalid_{field}")
    return model, stream
