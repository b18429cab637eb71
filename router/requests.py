"""One client request, parsed once into a typed, framework-free :class:`ParsedRequest`.

:func:`parse_request` is the single entry of the request flow, shared by the HTTP app, the Endpoint
Picker (which sees the request as Envoy headers and body chunks) and ``/admin/route/explain``: the
same checks, the same sanitizing, the same answer to "what does this request ask for".

The body is parsed once with orjson and only the fields the router needs are checked (``model``,
``stream``, the prompt, messages or input); for the generation routes (completions, chat, Anthropic
Messages, Responses) :func:`~kvroute.router.surfaces.read_prompt` also reads what the engine will render,
once, into ``ParsedRequest.prompt``. The raw bytes are kept: when nothing has to be rewritten they go to
the worker untouched. What the client may not choose goes here, on every path that reaches a worker:
its ``kv_transfer_params`` (stripped, or the request refused) and ``conversation_id`` (a router field).
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from kvroute.router.conversations import CONVERSATION_HEADER, ConversationError, validate_conversation_id
from kvroute.router.errors import ApiError, bad_request
from kvroute.router.kv_params import KVParamsError, sanitize_client_body
from kvroute.router.paths import CONTROL_PATHS, canonical_path, proxied
from kvroute.router.surfaces import CHAT as CHAT
from kvroute.router.surfaces import COMPLETIONS as COMPLETIONS
from kvroute.router.surfaces import MESSAGES as MESSAGES
from kvroute.router.surfaces import RESPONSES as RESPONSES
from kvroute.router.surfaces import SurfacePrompt, read_prompt

RawHeaders = Sequence[tuple[bytes, bytes]]
ClientParamsMode = Literal["strip", "refuse"]

#: The routes whose prompt the router reads (tokens, index lookup, conversation reuse).
GENERATION_ROUTES = frozenset({COMPLETIONS, CHAT, MESSAGES, RESPONSES})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
#: Never forwarded to a worker (RFC 9110 §7.6.1 hop-by-hop, plus what the client library recomputes).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
#: The client headers a worker gets: what vLLM's OpenAI and Anthropic surfaces read (content negotiation,
#: the API key, sessions), and tracing context. Anything else — the router's own controls
#: (``x-kvroute-*``, ``x-conversation-id``), a data-parallel rank the client would like to choose, headers
#: a vLLM plugin might trust — is the router's decision, not the client's (``forward_headers`` adds more).
FORWARDED_HEADERS = frozenset(
    {
        "content-type",
        "accept",
        "accept-encoding",
        "accept-language",
        "authorization",
        "user-agent",
        "x-api-key",
        "anthropic-version",
        "anthropic-beta",
        "openai-organization",
        "openai-project",
        "x-session-id",
        "traceparent",
        "tracestate",
        "baggage",
    }
)
_UNSAFE_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(slots=True)
class ParsedRequest:
    """Everything the flow needs to know about one client request; built by :func:`parse_request`."""

    request_id: str
    method: str
    #: Path (and query) to call on the worker.
    path: str
    #: Metrics label: a generation route, or "other" (never the raw path).
    route: str
    #: Headers for the worker: hop-by-hop removed, our X-Request-Id, identity encoding unless asked.
    headers: list[tuple[str, str]]
    #: The bytes to forward: the client's own, or re-encoded when a client field had to go.
    body: bytes
    #: The parsed JSON body (None for bodies that are not a JSON object).
    json: dict[str, Any] | None
    model: str | None
    stream: bool
    latency_class: str = "interactive"
    #: The client asked for the plan summary header (honoured only when the router allows it).
    wants_debug: bool = False
    conversation_id: str | None = None
    #: How many client ``kv_transfer_params`` keys were stripped (counted by the flow).
    stripped_client_params: int = 0
    started: float = field(default_factory=time.perf_counter)
    #: Workers already tried for this request (a retry goes elsewhere).
    tried: set[str] = field(default_factory=set)
    #: What the engine will render for a generation route (read once, at parse time).
    prompt: SurfacePrompt | None = None

    @property
    def generation(self) -> bool:
        return self.route in GENERATION_ROUTES and self.json is not None

    @property
    def max_tokens(self) -> int | None:
        data = self.json or {}
        value = data.get("max_completion_tokens", data.get("max_output_tokens", data.get("max_tokens")))
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def _new_id_source() -> None:
    global _id_prefix, _id_counter
    _id_prefix, _id_counter = secrets.token_hex(10), itertools.count()


_id_prefix, _id_counter = "", itertools.count()
_new_id_source()
os.register_at_fork(after_in_child=_new_id_source)  # a pre-forked child never repeats its parent's ids


def new_request_id() -> str:
    """32 hex digits, like ``uuid4().hex``: a random per-process prefix (80 bits, drawn again in a forked
    child) and a counter, so minting one costs no ``urandom`` call per request."""
    return f"{_id_prefix}{next(_id_counter) & 0xFFFFFFFFFFFF:012x}"


def request_id_from(raw: RawHeaders) -> str:
    """The client's X-Request-Id when it is sane (it ends up in logs and in vLLM), else a new one."""
    for key, value in raw:
        if key == b"x-request-id":
            given = value.decode("latin-1")
            return given if _REQUEST_ID.match(given) else new_request_id()
    return new_request_id()


def upstream_headers(
    raw: RawHeaders, request_id: str, allowed: frozenset[str] = FORWARDED_HEADERS
) -> list[tuple[str, str]]:
    """The client headers the router forwards (``allowed``), with our X-Request-Id, and no compression
    unless the client asked. A value with control characters (CR, LF, NUL...) is dropped, never passed on."""
    out = [("x-request-id", request_id)]
    encoding = False
    for key, value in raw:
        name = key.decode("latin-1").lower()
        if name not in allowed:
            continue
        text = value.decode("latin-1")
        if _UNSAFE_VALUE.search(text):
            continue
        if name == "accept-encoding":
            encoding = True
        out.append((name, text))
    if not encoding:
        # Otherwise the HTTP client adds "gzip, deflate" and we could no longer read usage from the body.
        out.append(("accept-encoding", "identity"))
    return out


def parse_request(
    method: str,
    path: str,
    raw_headers: RawHeaders,
    body: bytes,
    *,
    client_kv_params: ClientParamsMode = "strip",
    request_id: str | None = None,
    forward_headers: frozenset[str] = FORWARDED_HEADERS,
    query: str = "",
) -> ParsedRequest:
    """Check and parse one request. ``path`` is the (percent-decoded) path without its query, which comes
    apart in ``query``: a ``?`` inside ``path`` is a character of the path, not a separator. The path is
    canonicalized, checked against the proxied allowlist and forwarded in that form. Raises
    :class:`ApiError` for client mistakes."""
    bare = canonical_path(path)
    if bare in CONTROL_PATHS:
        raise ApiError(
            404,
            f"{bare} is an engine-control endpoint and is not proxied; call the worker directly",
            "not_proxied",
            "not_found_error",
        )
    if not proxied(method, bare):
        raise ApiError(404, f"{method} {bare} is not an endpoint kvroute proxies", "not_proxied", "not_found_error")
    path = bare + "?" + query if query else bare
    request_id = request_id or request_id_from(raw_headers)
    wanted = {k: v.decode("latin-1") for k, v in raw_headers if k in _READ_HEADERS}
    data: dict[str, Any] | None
    model: str | None
    prompt: SurfacePrompt | None = None
    if bare in GENERATION_ROUTES:
        data = parse_json_object(body)
        model, stream = check_generation(data, bare)
        prompt = read_prompt(bare, data)
        route = bare
    else:
        data, model, stream = sniff_passthrough(body)
        route = "other"
    request = ParsedRequest(
        request_id=request_id,
        method=method,
        path=path,
        route=route,
        headers=upstream_headers(raw_headers, request_id, forward_headers),
        body=body,
        json=data,
        model=model,
        stream=stream,
        latency_class=wanted.get(b"x-kvroute-latency-class", "interactive"),
        wants_debug=wanted.get(b"x-kvroute-debug") == "1",
        prompt=prompt,
    )
    if data is not None:
        _take_client_fields(request, data, wanted, client_kv_params)
    return request


#: vLLM's own session key (body ``session_id`` or this header): also a conversation key for the router,
#: but forwarded, never popped — the engine reads it too (and tags its KV events with it).
SESSION_HEADER = b"x-session-id"
_READ_HEADERS = frozenset(
    {b"x-kvroute-latency-class", b"x-kvroute-debug", CONVERSATION_HEADER.encode(), SESSION_HEADER}
)


def _take_client_fields(
    request: ParsedRequest, data: dict[str, Any], headers: dict[bytes, str], mode: ClientParamsMode
) -> None:
    """Clients never choose routing: their kv_transfer_params go (or the request is refused), on every
    path; ``conversation_id`` (body field or header) is the router's, popped from generation bodies."""
    changed = False
    if "kv_transfer_params" in data:
        try:
            data, removed = sanitize_client_body(data, mode)
        except KVParamsError as exc:
            raise ApiError(400, str(exc), "kv_transfer_params_not_allowed") from None
        request.stripped_client_params = len(removed) or 1
        changed = True
    if request.route in GENERATION_ROUTES:
        try:
            if "conversation_id" in data:
                if not changed:
                    data = dict(data)
                given = data.pop("conversation_id")
                changed = True
                if given is not None:
                    request.conversation_id = validate_conversation_id(given)
            if request.conversation_id is None and CONVERSATION_HEADER.encode() in headers:
                request.conversation_id = validate_conversation_id(headers[CONVERSATION_HEADER.encode()])
            if request.conversation_id is None:  # vLLM's session id keys the conversation too (kept in place)
                session = data.get("session_id", headers.get(SESSION_HEADER))
                if session is not None:
                    request.conversation_id = validate_conversation_id(session)
        except ConversationError as exc:
            raise ApiError(400, str(exc), "invalid_conversation_id") from None
    if changed:
        request.json = data
        request.body = orjson.dumps(data)


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


#: Token ids are unsigned 32-bit in vLLM's engine (and in our block keys); anything else is a client mistake.
MAX_TOKEN_ID = (1 << 32) - 1


def check_generation(data: dict[str, Any], route: str) -> tuple[str | None, bool]:
    """Check the fields every generation route reads (``route``: one of :data:`GENERATION_ROUTES`; the
    prompt's own are :func:`~kvroute.router.surfaces.read_prompt`'s), as vLLM would accept them; a
    mistake is a 400 naming the field, never a failure further down. Returns (model, stream); only a
    Responses request may leave the model to the engine."""
    model = data.get("model")
    if route == RESPONSES and model is None:
        pass
    elif not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string", "invalid_model")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "invalid_stream")
    if route == CHAT:
        _check_messages(data.get("messages"))
    elif route == COMPLETIONS:
        _check_prompt(data.get("prompt"))
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise bad_request(f"`{name}` must be a non-negative integer", f"invalid_{name}")
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("`cache_salt` must be a non-empty string", "invalid_cache_salt")
    return model, stream


def _token_ids_ok(values: list[Any]) -> bool:
    return all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in values)


def _check_prompt(prompt: Any) -> None:
    """A string, or a non-empty list of strings, of token ids, or of token-id lists (vLLM's forms)."""
    if isinstance(prompt, str):
        return
    message = "`prompt` is required: a string, a list of strings, of token ids (0..2**32-1) or of token-id lists"
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(message, "invalid_prompt")
    if all(isinstance(p, str) for p in prompt) or _token_ids_ok(prompt):
        return
    if all(isinstance(p, list) and p and _token_ids_ok(p) for p in prompt):
        return
    raise bad_request(message, "invalid_prompt")


def _check_messages(messages: Any) -> None:
    """Objects with a string ``role`` and a ``content`` that is a string, null, or a list of typed parts."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` is required and must be a non-empty list", "invalid_messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request("each item of `messages` must be an object", "invalid_messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"`messages[{i}].role` must be a non-empty string", "invalid_messages")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(
            isinstance(part, dict) and isinstance(part.get("type"), str) for part in content
        ):
            raise bad_request(
                f"`messages[{i}].content` must be a string, null, or a list of parts with a string `type`",
                "invalid_messages",
            )
        for part in content:
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise bad_request(f"`messages[{i}].content` text parts need a string `text`", "invalid_messages")


def prompt_text(body: dict[str, Any]) -> str | None:
    """The prompt as text, for text-approximate policies (chat: the messages' contents in order)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else None
