"""A chat request as vLLM's renderer sees it: the conversation its parser builds and the template kwargs
it merges, before any template runs.

Why so literal: the router's block keys are only right when its prompt is the engine's, byte for byte.
vLLM (0.32) does not hand the client's messages to the template as they are. It first builds a
*conversation* (text parts joined with ``\\n`` for a "string" template, kept as ``{"type": "text"}``
parts for an "openai" one, ``None`` content as empty, tool-call arguments parsed into objects, Claude
Code's billing header line dropped from system text, only the keys it knows kept), and merges the
request's options into the template kwargs (``add_generation_prompt``, ``continue_final_message``,
``documents``, ``reasoning_effort`` over ``chat_template_kwargs``, unset values dropped). Tools reach the
template as its pydantic models dump them (:func:`engine_tool`).

What cannot be rendered here exactly (images and other media, unknown part shapes, a request's own
``chat_template``) raises :class:`Unrenderable` with a short reason: the request is then routed by load,
counted, never guessed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvroute.router.errors import ApiError

ContentFormat = Literal["string", "openai"]


#: Text parts vLLM reads as text (``text`` key, or ``thinking`` for thinking parts).
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
#: Keys that make a part media whatever its type (images, audio, video, embeddings).
_MEDIA_KEYS = frozenset(
    {
        "image_url",
        "image_pil",
        "image_embeds",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "video_url",
        "video_embeds",
        "prompt_embeds",
        "input_image",
        "file",
    }
)
BILLING_HEADER = "x-anthropic-billing-header"
#: transformers' apply_chat_template arguments: as template kwargs they would change how it renders.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class TokenizeError(RuntimeError):
    """Tokens could not be obtained (bad input, missing files, worker error); the message says which."""


class Unrenderable(TokenizeError):
    """The request holds something the router cannot render exactly; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"cannot render exactly ({reason}){': ' + detail if detail else ''}")
        self.reason = reason


@dataclass(slots=True)
class ChatPrompt:
    """A chat request as the engine's renderer takes it: OpenAI chat messages plus every option that
    reaches the template. ``tools`` are already the engine's tool dicts (:func:`engine_tool`)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: A template sent with the request (only an engine started with --trust-request-chat-template uses it).
    chat_template: str | None = None
    add_special_tokens: bool = False

    def option_kwargs(self) -> dict[str, Any]:
        """The request-level options as template kwargs, over the client's ``chat_template_kwargs``
        (vLLM's ``build_chat_params``: an unset option never overrides)."""
        user = dict(self.chat_template_kwargs or {})
        extra: dict[str, Any] = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "documents": self.documents,
            "reasoning_effort": self.reasoning_effort,
        }
        if self.reasoning_effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = self.reasoning_effort != "none"
        return _merge(user, extra)

    def template_kwargs(self) -> dict[str, Any]:
        """Everything the template is called with besides the conversation (``with_defaults``: the tools
        under the request's kwargs, unset values dropped once more)."""
        kwargs = self.option_kwargs()
        if bad := sorted(_RESERVED_KWARGS & kwargs.keys()):
            raise Unrenderable("template_kwargs", f"chat_template_kwargs sets {bad}")
        return _merge({"tools": self.tools} if self.tools is not None else {}, kwargs)


def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: ``None`` and ``"auto"`` in ``overrides`` do not override."""
    return {**defaults, **{k: v for k, v in overrides.items() if v is not None and not _is_auto(v)}}


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


# -- tools ----------------------------------------------------------------------------------------------


def engine_tool(
    name: Any, description: Any, parameters: Any, strict: Any, defer_loading: Any, where: str
) -> dict[str, Any]:
    """One tool as vLLM hands it to the template (``ChatCompletionToolsParam.model_dump()``): keys in
    its field order, ``description`` and ``parameters`` always there, ``strict``/``defer_loading`` only
    when set. A wrong type is the client's mistake (400 naming ``where``)."""
    if not isinstance(name, str):
        raise ApiError(400, f"`{where}.name` must be a string", "invalid_tools")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"`{where}.description` must be a string", "invalid_tools")
    if parameters is not None and not isinstance(parameters, dict):
        raise ApiError(400, f"`{where}` parameters must be an object", "invalid_tools")
    for flag, value in (("strict", strict), ("defer_loading", defer_loading)):
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"`{where}.{flag}` must be a boolean", "invalid_tools")
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    if defer_loading is not None:
        function["defer_loading"] = defer_loading
    return {"type": "function", "function": function}


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A chat request's ``tools`` as the engine's tool dicts (extra keys dropped, as vLLM's models do)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "`tools` must be a list of objects", "invalid_tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise ApiError(400, f"`tools[{i}]` must be a function tool with a `function` object", "invalid_tools")
        top_defer = tool.get("defer_loading")
        defer = function.get("defer_loading")
        one = engine_tool(
            function.get("name"),
            function.get("description"),
            function.get("parameters"),
            function.get("strict"),
            defer if defer is not None else top_defer,
            f"tools[{i}].function",
        )
        if top_defer is not None:
            one["defer_loading"] = top_defer
        out.append(one)
    return out


# -- the conversation vLLM builds -----------------------------------------------------------------------


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """System text starting with Claude Code's per-request attribution line loses that line."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _part_text(part: Any, where: str) -> str | None:
    """A content part's text (None: skipped, as vLLM skips text parts without text)."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise Unrenderable("content_part", f"{where} is not an object")
    kind = part.get("type")
    if kind not in TEXT_PART_TYPES or part.get("uuid") is not None:
        typed_media = isinstance(kind, str) and kind not in TEXT_PART_TYPES and kind != "tool_reference"
        media = typed_media or bool(_MEDIA_KEYS & part.keys())
        raise Unrenderable("multimodal" if media else "content_part", f"{where} has type {kind!r}")
    value = part.get("thinking" if kind == "thinking" else "refusal" if kind == "refusal" else "text")
    if value is None and kind in ("text", "refusal"):
        return None
    if not isinstance(value, str):
        raise Unrenderable("content_part", f"{where} has no text")
    return value


def _content(role: str, content: Any, fmt: ContentFormat, where: str) -> str | list[dict[str, Any]]:
    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = list(content)
    else:
        raise Unrenderable("content", f"{where}.content is neither text nor a list of parts")
    if role == "system":
        parts = _strip_billing_header(parts)
    texts = []
    for i, part in enumerate(parts):
        text = _part_text(part, f"{where}.content[{i}]")
        if text is not None:
            texts.append(text)
    if fmt == "string":
        return "\n".join(texts)
    if any(isinstance(p, dict) and not p.keys() <= {"type", "text", "refusal", "thinking"} for p in parts):
        raise Unrenderable("content_part", f"{where} has content-part fields an 'openai' template may read")
    return [{"type": "text", "text": t} for t in texts]


def _tool_calls(calls: list[Any], where: str) -> list[Any]:
    """Assistant tool calls with their ``arguments`` as objects (JSON text parsed; anything else ``{}``)."""
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise Unrenderable("tool_calls", f"{where}.tool_calls entries must be function calls")
        arguments = function.get("arguments")
        parsed: Any = arguments
        if not arguments:
            parsed = {}
        elif isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = {}
        out.append({**call, "function": {**function, "arguments": parsed if isinstance(parsed, dict) else {}}})
    return out


#: Roles whose message, with text content and no other field, the general path below copies as it is.
_PLAIN_ROLES = frozenset({"user", "assistant"})


def conversation(messages: Sequence[Any], fmt: ContentFormat) -> list[dict[str, Any]]:
    """vLLM's ``parse_chat_messages`` for text-only messages: what the chat template iterates over."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise TokenizeError("messages must be a list of objects")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        # Most of an agent's history: a plain dict of a user or assistant role and text, nothing else.
        if type(message) is dict and len(message) == 2:
            role, content = message.get("role"), message.get("content")
            if role in _PLAIN_ROLES and type(content) is str:
                out.append(
                    {"role": role, "content": content if fmt == "string" else [{"type": "text", "text": content}]}
                )
                continue
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TokenizeError(f"messages[{i}] must be an object with a string role")
        role = message["role"]
        content = message.get("content")
        if type(content) is str and role != "system":  # the common case, without building one part per message
            value: str | list[dict[str, Any]] = content if fmt == "string" else [{"type": "text", "text": content}]
        else:
            value = _content(role, content, fmt, f"messages[{i}]")
        msg: dict[str, Any] = {"role": role, "content": value}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise Unrenderable("tool_calls", f"messages[{i}].tool_calls is not a list")
                if calls:
                    msg["tool_calls"] = _tool_calls(copy.deepcopy(calls), f"messages[{i}]")
            reasoning = message.get("reasoning")
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if fmt == "openai" and isinstance(msg["content"], list):
                msg["content"] = "\n".join(p["text"] for p in msg["content"])
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                msg[key] = message[key]
        if role == "developer":
            msg["tools"] = copy.deepcopy(message.get("tools"))
        out.append(msg)
    return out


_AS_TEXT = frozenset({"input_text", "output_text"})


def chat_schema_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with Responses' ``input_text``/``output_text`` parts as chat ``text`` parts, so a chat
    endpoint's schema (``/tokenize``) accepts them; vLLM renders both kinds alike, so the tokens are the same."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in _AS_TEXT for p in content):
            parts = [{**p, "type": "text"} if isinstance(p, dict) and p.get("type") in _AS_TEXT else p for p in content]
            message = {**message, "content": parts}
        out.append(message)
    return out


def developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that do not know the ``developer`` role: it becomes ``system``, and every system
    message is merged into one at the front (joined by a blank line) when any stands elsewhere."""
    converted = [
        {k: v for k, v in {**m, "role": "system"}.items() if k != "tools"} if m["role"] == "developer" else m
        for m in messages
    ]
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *others] if merge else converted


def prompt_of_fields(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> ChatPrompt:
    """The prompt of a chat request with just these fields (``tools`` in the client's shape); a bad
    field is a :class:`TokenizeError` (callers outside the request path: benchmarks, admin, tests)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise TokenizeError("messages must be a list of objects")
    try:
        engine_tools = chat_tools(list(tools) if tools is not None else None)
    except ApiError as exc:
        raise TokenizeError(exc.message) from None
    return ChatPrompt(
        [dict(m) if isinstance(m, Mapping) else m for m in messages],
        add_generation_prompt=add_generation_prompt,
        tools=engine_tools,
        chat_template_kwargs=dict(chat_template_kwargs) if chat_template_kwargs else None,
    )
