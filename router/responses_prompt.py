"""``/v1/responses`` (OpenAI Responses) as the chat request vLLM renders, for exact tokens.

vLLM (0.32, ``construct_input_messages`` and ``ResponsesRequest.build_chat_params``, non-Harmony
models) renders a Responses request with the chat template: ``instructions`` as a leading system
message, a string ``input`` as one user message, and each input item in turn —

* ``function_call`` items become assistant ``tool_calls`` (joined to the assistant message before them),
  ``reasoning`` items the assistant's ``reasoning`` (its first content text, else its first summary),
  assistant output messages their first text (filling an assistant message that has none yet),
  ``function_call_output`` items ``tool`` messages, anything else with a ``role`` a chat message as is;
* a final assistant message or reasoning item still ``in_progress``/``incomplete`` is continued
  (``continue_final_message``, no generation prompt);
* function ``tools`` become chat tools (other tool types are not shown to the model);
  ``reasoning.effort`` is the ``reasoning_effort``;
* the rendered text is encoded *with* the tokenizer's special tokens (chat completions: without).

State the engine keeps (``previous_response_id``, stored ``prompt`` templates, ``background`` runs) is
never guessed: :func:`stateful_reason` names it and the request is routed by load. A malformed body is a
400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute.router.chat_prompt import ChatPrompt, Unrenderable, engine_tool
from kvroute.router.errors import ApiError, bad_request

_CONTINUED = ("in_progress", "incomplete")


def _bad(field: str, message: str) -> ApiError:
    return bad_request(f"`{field}` {message}", "invalid_input")


def check_responses_body(body: Mapping[str, Any]) -> None:
    """The shapes vLLM's ``ResponsesRequest`` validates that routing reads, as 400s naming the field."""
    raw = body.get("input")
    if not isinstance(raw, str) and not (isinstance(raw, list) and all(isinstance(i, dict) for i in raw)):
        raise _bad("input", "is required: a string or a list of input items (objects)")
    for name in ("instructions", "previous_response_id"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"`{name}` must be a string", f"invalid_{name}")
    value = body.get("max_output_tokens")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise bad_request("`max_output_tokens` must be an integer >= 1", "invalid_max_output_tokens")
    for name in ("reasoning", "chat_template_kwargs", "prompt", "text"):
        value = body.get(name)
        if value is not None and not isinstance(value, dict):
            raise bad_request(f"`{name}` must be an object", f"invalid_{name}")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad_request("`tools` must be a list of objects", "invalid_tools")
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("`reasoning.effort` must be a string", "invalid_reasoning")


def stateful_reason(body: Mapping[str, Any]) -> str | None:
    """Why the prompt depends on what one engine remembers (then: routed by load, counted)."""
    if body.get("previous_response_id") is not None:
        return "previous_response_id"
    if body.get("previous_input_messages") is not None:
        return "previous_input_messages"
    if body.get("prompt") is not None:
        return "prompt_template"
    if body.get("background"):
        return "background"
    return None


def _text_of_first(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _assistant(prev: dict[str, Any] | None) -> dict[str, Any] | None:
    return prev if prev is not None and prev.get("role") == "assistant" else None


def _item(item: dict[str, Any], i: int, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """``_construct_message_from_response_item``: a new message, or None when ``prev`` took the item."""
    kind = item.get("type")
    where = f"input[{i}]"
    assistant = _assistant(prev)
    if kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not all(isinstance(v, str) for v in (call_id, name, arguments)):
            raise _bad(where, "function_call items need string call_id, name and arguments")
        if item.get("namespace"):
            raise Unrenderable("namespace_tool", "a namespaced function call")
        call = {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}
        if assistant is not None:
            calls = assistant.get("tool_calls")
            if calls is None:
                assistant["tool_calls"] = [call]
                return None
            if isinstance(calls, list):
                assistant["tool_calls"] = [*calls, call]
                return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind in ("custom_tool_call", "custom_tool_call_output"):
        raise Unrenderable("custom_tool", f"a {kind} item")
    if kind == "reasoning":
        if not isinstance(item.get("id"), str) or not isinstance(item.get("summary"), list):
            raise _bad(where, "reasoning items need an `id` and a `summary` list")
        if item.get("encrypted_content"):
            raise _bad(f"{where}.encrypted_content", "is not supported")
        content, summary = item.get("content") or [], item["summary"]
        source = content if content else summary
        reasoning = _text_of_first(source) if source else ""
        if reasoning is None:
            raise _bad(where, "reasoning content and summary parts need a `text`")
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        text = _text_of_first(item.get("content"))
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return dict(item)
    raise _bad(where, f"has an unsupported input item type {kind!r}")


def _continues(raw: list[dict[str, Any]]) -> bool:
    """``should_continue_final_message``: the last item is a partial assistant message or reasoning."""
    if not raw:
        return False
    last = raw[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in _CONTINUED


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """``construct_tool_dicts``: function tools only (None when the request has no tools at all)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind in ("custom", "namespace"):
            raise Unrenderable("custom_tool", f"a {kind} tool")
        if kind != "function":
            continue
        out.append(
            engine_tool(
                tool.get("name"),
                tool.get("description"),
                tool.get("parameters"),
                tool.get("strict"),
                tool.get("defer_loading"),
                f"tools[{i}]",
            )
        )
    return out


def responses_prompt(body: Mapping[str, Any]) -> ChatPrompt:
    """The chat prompt vLLM renders for a (checked, stateless) Responses body."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    raw = body["input"]
    continued = False
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    else:
        for i, item in enumerate(raw):
            message = _item(item, i, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
        continued = _continues(raw)
    if not messages:
        raise _bad("input", "holds no message")
    effort = (body.get("reasoning") or {}).get("effort")
    return ChatPrompt(
        messages,
        add_generation_prompt=not continued,
        continue_final_message=continued,
        tools=_tools(body.get("tools")),
        reasoning_effort=effort,
        chat_template_kwargs=body.get("chat_template_kwargs"),
        # vLLM tokenizes a Responses prompt with the tokenizer's special tokens (its TokenizeParams
        # default), unlike chat completions: a Llama-style template's BOS comes out twice.
        add_special_tokens=True,
    )
