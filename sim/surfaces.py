"""vLLM 0.33's other API surfaces, as pure request converters and response builders: the Anthropic
Messages API (``/v1/messages``), the OpenAI Responses API (``/v1/responses``) and the scale-out render
routes (``/v1/*/render``). Every prompt becomes chat messages rendered by the worker's one chat template,
so the same conversation reaches the same KV cache whichever surface carries it.

Sources read (vLLM 0.33.0 wheel):

- ``vllm/entrypoints/anthropic/{api_router,protocol,serving}.py``: request fields, the conversion to a
  chat request (``system`` first, text blocks, tool results), ``_build_anthropic_usage`` (``input_tokens
  = prompt - cache_read - cache_creation``), the SSE sequence (``message_start``, ``content_block_*``,
  ``message_delta``, ``message_stop``; ``event:`` lines, no ``[DONE]``), ``exclude_none`` dumps.
- ``vllm/entrypoints/openai/responses/{api_router,protocol,serving,streaming_events,utils}.py``:
  ``construct_input_messages`` (``instructions`` as the system message), ``ResponsesResponse.from_request``,
  ``ResponseUsage`` / ``InputTokensDetails``, status ``incomplete`` on ``length``, the event sequence.
- ``vllm/entrypoints/scale_out/{factories.py,render/*,token_in_token_out/protocol.py}``: the routes exist
  only with ``--enable-scale-out`` (else 403); the answer is a ``GenerateRequest`` (a list of them for
  completions), ``sampling_params`` dumped with msgspec's ``omit_defaults``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
from kvroute.sim.errors import ApiError

# -- shared ---------------------------------------------------------------------------------------------


def random_uuid() -> str:
    return uuid.uuid4().hex


def _text_of(content: object, what: str) -> str:
    """Text of an Anthropic / Responses content value: a string or a list of blocks with ``text``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, Mapping) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif isinstance(block, str):
                parts.append(block)
        return " ".join(parts)
    if content is None:
        return ""
    raise ApiError(400, f"{what} must be a string or a list of content blocks.", param=what)


def _str_field(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{key} must be a string.", param=key)
    return value


# -- Anthropic Messages ---------------------------------------------------------------------------------

_BILLING_HEADER = "x-anthropic-billing-header"


def anthropic_chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """vLLM's ``to_chat_completion_request`` for what the sim renders: one leading system message (the
    ``system`` field's text blocks, Claude Code's billing header dropped, joined without separator),
    then each message with its text (tool results become ``tool`` messages)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.", param="messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    parts: list[str] = []
    if isinstance(system, str):
        parts.append(system)
    elif isinstance(system, list):
        for block in system:
            if isinstance(block, Mapping) and block.get("type") == "text" and block.get("text"):
                text = str(block["text"])
                if not text.startswith(_BILLING_HEADER):
                    parts.append(text)
    elif system is not None:
        raise ApiError(400, "system must be a string or a list of text blocks.", param="system")
    if parts:
        out.append({"role": "system", "content": "".join(parts)})
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or msg.get("role") not in ("user", "assistant", "system"):
            raise ApiError(400, f"messages[{i}] needs a role of user, assistant or system.", param="messages")
        role, content = msg["role"], msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of blocks.", param="messages")
        texts: list[str] = []
        for block in content:
            if not isinstance(block, Mapping):
                raise ApiError(400, f"messages[{i}].content blocks must be objects.", param="messages")
            kind = block.get("type")
            if kind == "text" and block.get("text"):
                texts.append(str(block["text"]))
            elif kind == "tool_result":
                out.append({"role": "tool", "content": _text_of(block.get("content"), "tool_result.content")})
        if texts:
            out.append({"role": role, "content": texts[0] if len(texts) == 1 else " ".join(texts)})
    return out


def anthropic_max_tokens(body: Mapping[str, Any]) -> int:
    value = body.get("max_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, "max_tokens is required: an integer >= 1.", param="max_tokens")
    return value


def anthropic_usage(
    prompt_tokens: int, output_tokens: int, cached: int | None = None, created: int | None = None
) -> dict[str, int]:
    """``_build_anthropic_usage``: Anthropic's ``input_tokens`` excludes cache reads and writes; the cache
    fields only when the engine reported them (the final usage, not the first continuous-usage chunk)."""
    usage: dict[str, int] = {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
    if cached is not None:
        usage["input_tokens"] -= cached
    if created is not None:
        usage["input_tokens"] -= created
        usage["cache_creation_input_tokens"] = created
    if cached is not None:
        usage["cache_read_input_tokens"] = cached
    usage["input_tokens"] = max(0, usage["input_tokens"])
    return usage


def anthropic_message(
    msg_id: str, model: str, text: str, usage: dict[str, int], kv_transfer_params: dict[str, Any] | None
) -> dict[str, Any]:
    """``AnthropicMessagesResponse.model_dump(exclude_none=True)``; ``stop_reason`` ``max_tokens`` (the sim
    always generates ``max_tokens``: finish_reason ``length``)."""
    out: dict[str, Any] = {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": "max_tokens",
        "usage": usage,
    }
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def anthropic_start(msg_id: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    """``message_start``: the message with no content yet and the first chunk's usage (no cache fields)."""
    return {
        "type": "message_start",
        "message": {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        },
    }


def anthropic_sse(event: str, data: Mapping[str, Any]) -> bytes:
    """``wrap_data_with_event``: ``event: <type>\\ndata: <json>\\n\\n``."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# -- OpenAI Responses -----------------------------------------------------------------------------------


def responses_chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``construct_input_messages``: ``instructions`` as a system message, then ``input`` (a string is one
    user message; a list holds messages, ``function_call_output`` items become ``tool`` messages)."""
    out: list[dict[str, Any]] = []
    instructions = _str_field(body, "instructions")
    if instructions:
        out.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        out.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            if not isinstance(item, Mapping):
                raise ApiError(400, f"input[{i}] must be an object.", param="input")
            kind = item.get("type", "message")
            if kind == "message" and isinstance(item.get("role"), str):
                out.append({"role": item["role"], "content": _text_of(item.get("content"), "input.content")})
            elif kind == "function_call_output":
                out.append({"role": "tool", "content": _text_of(item.get("output"), "input.output")})
            elif kind not in ("reasoning", "function_call"):
                raise ApiError(400, f"input[{i}]: unsupported item type {kind!r}.", param="input")
    else:
        raise ApiError(400, "input must be a string or a non-empty list of items.", param="input")
    if not out:
        raise ApiError(400, "input has no message.", param="input")
    return out


def responses_usage(prompt_tokens: int, output_tokens: int, cached: int, created: int) -> dict[str, Any]:
    """``ResponseUsage`` of one turn (vLLM lists per-turn figures as well)."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": created,
            "input_tokens_per_turn": [prompt_tokens],
            "cached_tokens_per_turn": [cached],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [output_tokens],
            "tool_output_tokens_per_turn": [0],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    """``ResponseOutputMessage`` with one ``output_text`` part (none for an empty text, as vLLM)."""
    content: list[dict[str, Any]] = (
        [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}] if text else []
    )
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message"}


def responses_object(
    body: Mapping[str, Any],
    *,
    response_id: str,
    created_at: int,
    model: str,
    max_output_tokens: int,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``ResponsesResponse.from_request(...).model_dump(mode="json", by_alias=True)``."""
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    parallel = body.get("parallel_tool_calls")
    return {
        "id": response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": True if parallel is None else bool(parallel),
        "temperature": 1.0 if temperature is None else temperature,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": 1.0 if top_p is None else top_p,
        "background": bool(body.get("background", False)),
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": None,
        "prompt": None,
        "prompt_cache_options": None,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "prompt_cache_retention": body.get("prompt_cache_retention"),
        "reasoning": body.get("reasoning"),
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": body.get("service_tier", "auto"),
        "status": status,
        "text": body.get("text"),
        "top_logprobs": None,
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": body.get("user"),
        "presence_penalty": body.get("presence_penalty", 0.0),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def responses_sse(event: Mapping[str, Any]) -> bytes:
    """``_convert_stream_to_sse_events``: ``event: <type>\\ndata: <json>\\n\\n``."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def response_id(body: Mapping[str, Any]) -> str:
    value = _str_field(body, "request_id")
    return value or f"resp_{random_uuid()}"


def now() -> int:
    return int(time.time())


# -- render (scale-out) ---------------------------------------------------------------------------------

#: ``RequestOutputKind``: DELTA for streams, FINAL_ONLY otherwise (``to_sampling_params``).
OUTPUT_KIND_DELTA, OUTPUT_KIND_FINAL_ONLY = 1, 2
SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."

#: (name, SamplingParams default) for the request fields the sim passes through, in declaration order.
_SAMPLING_FIELDS: tuple[tuple[str, object], ...] = (
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("temperature", 1.0),
    ("top_p", 1.0),
    ("top_k", 0),
    ("min_p", 0.0),
    ("seed", None),
)


def sampling_params(body: Mapping[str, Any], max_tokens: int, stream: bool) -> dict[str, Any]:
    """``SamplingParams`` as ``msgspec.to_builtins`` dumps it (``omit_defaults``: only what differs from a
    field's default; ``__post_init__`` turns ``stop``/``stop_token_ids``/``bad_words`` into lists and sets
    ``skip_reading_prefix_cache``, so those are always there)."""
    out: dict[str, Any] = {}
    for name, default in _SAMPLING_FIELDS:
        value = body.get(name)
        if value is not None and value != default and not isinstance(value, bool):
            out[name] = value
    stop = body.get("stop")
    out["stop"] = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, list) else []
    stop_ids = body.get("stop_token_ids")
    out["stop_token_ids"] = list(dict.fromkeys(stop_ids)) if isinstance(stop_ids, list) else []
    if body.get("ignore_eos") is True:
        out["ignore_eos"] = True
    if max_tokens != 16:
        out["max_tokens"] = max_tokens
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens:
        out["min_tokens"] = min_tokens
    out["output_kind"] = OUTPUT_KIND_DELTA if stream else OUTPUT_KIND_FINAL_ONLY
    out["skip_clone"] = True
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and xargs:
        out["extra_args"] = dict(xargs)
    out["bad_words"] = []
    out["skip_reading_prefix_cache"] = False
    return out


def chat_parse_context(body: Mapping[str, Any]) -> dict[str, Any]:
    """``ParseContext`` a chat render carries (tools and their choice, reasoning, template kwargs)."""
    parallel = body.get("parallel_tool_calls")
    return {
        "tools": body.get("tools"),
        "tool_choice": body.get("tool_choice", "none"),
        "parallel_tool_calls": True if parallel is None else parallel,
        "include_reasoning": body.get("include_reasoning", True),
        "chat_template_kwargs": body.get("chat_template_kwargs") or {},
        "history_tool_call_cnt": 0,
    }


def generate_request(
    body: Mapping[str, Any],
    *,
    request_id: str,
    token_ids: list[int],
    max_tokens: int,
    parse_context: dict[str, Any] | None,
    stream: bool,
) -> dict[str, Any]:
    """One ``GenerateRequest.model_dump()`` (every field, in declaration order)."""
    options = body.get("stream_options")
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling_params(body, max_tokens, stream),
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": body.get("return_token_ids"),
        "output_mode": "tokens",
        "parse_context": parse_context,
        "stream": stream,
        "stream_options": options if stream and isinstance(options, dict) else None,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": body.get("kv_transfer_params"),
        "ec_transfer_params": None,
    }
