"""``/v1/messages`` (Anthropic Messages) as the chat request vLLM turns it into, for exact tokens.

vLLM (0.32, ``AnthropicServingMessages.to_chat_completion_request``) serves the Messages API by
converting the body to a chat completion and rendering that with the model's chat template:

* ``system`` (a string, or text blocks without Claude Code's billing-header block) becomes one leading
  system message, its parts joined with nothing between them; inline ``system`` messages stay where they
  are, unless the template refuses a system message after the first — then they are merged into the
  leading one (``merge_inline_system``, a property of the template);
* text blocks become text parts (one text block: a plain string), ``thinking`` blocks the assistant's
  ``reasoning``, ``tool_use`` blocks ``tool_calls`` (arguments as JSON), a user's ``tool_result`` blocks
  ``tool`` messages placed before that user message (an assistant's become ``Tool result: ...`` text), a
  user message left without content is dropped;
* ``tools`` become function tools (``input_schema`` as ``parameters``, ``"type": "object"`` added when
  missing); ``output_config.effort`` is the ``reasoning_effort``.

What the router cannot reproduce exactly is :class:`~kvroute.router.chat_prompt.Unrenderable` (images,
``thinking: {"type": "disabled"}`` whose effort the engine probes at start, tool additions/removals, a
``tool_use`` without an id — vLLM makes one from the clock). A malformed body is a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvroute.router.chat_prompt import BILLING_HEADER, ChatPrompt, Unrenderable, engine_tool
from kvroute.router.errors import ApiError, bad_request

#: Block types vLLM 0.32 accepts (``AnthropicContentBlock.type``).
BLOCK_TYPES = frozenset(
    {
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    }
)
ROLES = frozenset({"user", "assistant", "system"})


def _bad(field: str, message: str) -> ApiError:
    return bad_request(f"`{field}` {message}", "invalid_messages")


def _check_blocks(value: Any, field: str) -> None:
    """Content blocks: objects with a known string ``type`` and the field types vLLM's model has."""
    if not isinstance(value, list):
        raise _bad(field, "must be a string or a list of content blocks")
    for j, block in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(where, "must be an object with a string `type`")
        for key in ("text", "id", "tool_use_id", "name", "thinking", "signature", "data", "tool_name"):
            if block.get(key) is not None and not isinstance(block[key], str):
                raise _bad(f"{where}.{key}", "must be a string")
        for key in ("input", "source"):
            if block.get(key) is not None and not isinstance(block[key], dict):
                raise _bad(f"{where}.{key}", "must be an object")
        content = block.get("content")
        if content is not None and not (
            isinstance(content, str) or (isinstance(content, list) and all(isinstance(c, dict) for c in content))
        ):
            raise _bad(f"{where}.content", "must be a string or a list of objects")


def _tool_changes(blocks: list[dict[str, Any]]) -> bool:
    return any(b["type"] in ("tool_addition", "tool_removal") for b in blocks)


def check_messages_body(body: Mapping[str, Any]) -> None:
    """The shapes vLLM's ``AnthropicMessagesRequest`` validates, as 400s naming the field."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "is required and must be a non-empty list")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"messages[{i}]", "must be an object with a `role` of user, assistant or system")
        content: Any = message.get("content")
        if not isinstance(content, str):
            _check_blocks(content, f"messages[{i}].content")
            if message["role"] != "system" and _tool_changes(content):
                raise _bad(
                    f"messages[{i}].content", "may hold tool_addition/tool_removal blocks only in system messages"
                )
    system: Any = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks(system, "system")
        if _tool_changes(system):
            raise _bad("system", "may not hold tool_addition/tool_removal blocks")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request("`max_tokens` is required: an integer >= 1", "invalid_max_tokens")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("`tools` must be a list of objects", "invalid_tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("input_schema"), dict):
                raise bad_request(f"`tools[{i}]` must be an object with an `input_schema` object", "invalid_tools")
    for name in ("thinking", "output_config", "chat_template_kwargs", "tool_choice", "metadata"):
        value = body.get(name)
        if value is not None and not isinstance(value, dict):
            raise bad_request(f"`{name}` must be an object", f"invalid_{name}")
    effort = (body.get("output_config") or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("`output_config.effort` must be a string", "invalid_output_config")


def _system_text(content: Any) -> str | None:
    """A system message's text without billing-header blocks (``None``: nothing left)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [
        b["text"] for b in content if b["type"] == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def _tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """A user's tool_result: one ``tool`` message (text items joined by newlines)."""
    content = block.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        kinds = {item.get("type") for item in content}
        if "image" in kinds:
            raise Unrenderable("multimodal", "a tool_result holds an image")
        if "tool_reference" in kinds:
            raise Unrenderable("tool_reference", "a tool_result holds tool references")
        text = "\n".join(str(item.get("text", "")) for item in content if item.get("type") == "text")
    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text})


def _message(message: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """One user or assistant message (``_convert_messages`` / ``_convert_message_content``)."""
    role, content = message["role"], message["content"]
    msg: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        kind = block["type"]
        if kind not in BLOCK_TYPES:
            raise Unrenderable("block_type", f"content block type {kind!r}")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            raise Unrenderable("multimodal", "an image block")
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            if not block.get("id"):
                raise Unrenderable("tool_use_id", "a tool_use block without an id (the engine makes one up)")
            function = {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind == "tool_result":
            if role == "user":
                _tool_result(block, out)
            else:
                result = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {str(result) if result else ''}"})
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if parts:
        msg["content"] = parts[0]["text"] if len(parts) == 1 else parts
    if not (role == "user" and "content" not in msg):
        out.append(msg)


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        schema = dict(tool["input_schema"])
        if "type" not in schema:
            schema["type"] = "object"
        name, description = tool.get("name"), tool.get("description")
        out.append(engine_tool(name, description, schema, tool.get("strict"), tool.get("defer_loading"), f"tools[{i}]"))
    return out


def has_inline_system(body: Mapping[str, Any]) -> bool:
    """Whether the conversation depends on the template's ``merge_inline_system``."""
    return any(m.get("role") == "system" for m in body["messages"])


def messages_prompt(body: Mapping[str, Any], *, merge_inline_system: bool) -> ChatPrompt:
    """The chat prompt vLLM renders for a (checked) Messages body."""
    thinking = body.get("thinking")
    if thinking is not None and thinking.get("type") == "disabled":
        raise Unrenderable("thinking_disabled", "the engine probes its template for the effort it then uses")
    messages: list[dict[str, Any]] = body["messages"]
    if any(
        m["role"] == "system" and not isinstance(m["content"], str) and _tool_changes(m["content"]) for m in messages
    ):
        raise Unrenderable("tool_changes", "tool additions or removals change the tools the template sees")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    parts: list[str] = []
    if isinstance(system, str) and system:
        parts.append(system)
    elif isinstance(system, list):
        parts.extend(
            b["text"]
            for b in system
            if b["type"] == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
        )
    if merge_inline_system:
        parts.extend(t for m in messages if m["role"] == "system" and (t := _system_text(m["content"])))
    if parts:
        out.append({"role": "system", "content": "".join(parts)})
    for message in messages:
        if message["role"] == "system":
            if not merge_inline_system and (text := _system_text(message["content"])):
                out.append({"role": "system", "content": text})
            continue
        _message(message, out)
    effort = (body.get("output_config") or {}).get("effort")
    kwargs = body.get("chat_template_kwargs")
    return ChatPrompt(out, tools=_tools(body), reasoning_effort=effort, chat_template_kwargs=kwargs)
