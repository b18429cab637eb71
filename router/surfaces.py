"""The generation surfaces whose prompts the router reads, each read once at the edge.

``/v1/completions`` carries a prompt; ``/v1/chat/completions``, ``/v1/messages`` (Anthropic) and
``/v1/responses`` (OpenAI Responses) carry conversations that vLLM renders with the model's chat
template. :func:`read_prompt` checks the fields routing reads (a 400 naming the field) and turns the
body into a :class:`SurfacePrompt`: the :class:`~kvroute.router.chat_prompt.ChatPrompt` the engine will
render, or why it cannot be known here — something a tokenizer cannot reproduce (an image; a local
render may fail where an engine's ``/render`` succeeds), or state one engine keeps (a previous response):
then the request is routed by load, and counted.

Each surface reports usage in its own shape; :func:`usage_counts` reads prompt, cached and completion
tokens from any of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.router.anthropic_prompt import check_messages_body, has_inline_system, messages_prompt
from kvroute.router.chat_prompt import ChatPrompt, Unrenderable, chat_tools
from kvroute.router.errors import bad_request
from kvroute.router.responses_prompt import check_responses_body, responses_prompt, stateful_reason

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
#: The fidelity probe's and the fallback counter's label per route.
SURFACE_NAMES = {COMPLETIONS: "completions", CHAT: "chat", MESSAGES: "messages", RESPONSES: "responses"}


@dataclass(slots=True)
class SurfacePrompt:
    """What one generation request asks the engine to render."""

    route: str
    #: The chat prompt (None for completions). For /v1/messages, inline system messages stay in place.
    chat: ChatPrompt | None = None
    #: Why no local or ``/tokenize`` rendering can be exact (an engine's ``/render`` may still be).
    unrenderable: Unrenderable | None = None
    #: Why no tokenizer can know the prompt at all (state kept by one engine, no model): routed by load.
    load_only: str | None = None
    #: /v1/messages with inline system messages: where they go depends on the template.
    inline_system: bool = False

    @property
    def surface(self) -> str:
        return SURFACE_NAMES.get(self.route, "other")


def _optional(body: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise bad_request(f"`{name}` must be {what}", f"invalid_{name}")
    return value


def chat_prompt(body: Mapping[str, Any]) -> ChatPrompt:
    """A chat completion's prompt with every option vLLM renders it with (checked: 400 naming the field)."""
    generation = _optional(body, "add_generation_prompt", bool, "a boolean")
    continued = _optional(body, "continue_final_message", bool, "a boolean")
    if generation and continued:
        raise bad_request(
            "`continue_final_message` and `add_generation_prompt` cannot both be true", "invalid_add_generation_prompt"
        )
    documents = _optional(body, "documents", list, "a list of objects")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise bad_request("`documents` must be a list of objects", "invalid_documents")
    prompt = ChatPrompt(
        body["messages"],
        add_generation_prompt=True if generation is None else generation,
        continue_final_message=bool(continued),
        tools=chat_tools(body.get("tools")),
        documents=documents,
        reasoning_effort=_optional(body, "reasoning_effort", str, "a string"),
        chat_template_kwargs=_optional(body, "chat_template_kwargs", dict, "an object"),
        chat_template=_optional(body, "chat_template", str, "a string"),
        add_special_tokens=bool(_optional(body, "add_special_tokens", bool, "a boolean")),
    )
    if body.get("truncate_prompt_tokens") is not None:
        raise Unrenderable("truncate_prompt_tokens", "the engine truncates the prompt")
    return prompt


def read_prompt(route: str, body: Mapping[str, Any]) -> SurfacePrompt:
    """Check a generation body's prompt fields and say what the engine will render (see module doc)."""
    out = SurfacePrompt(route)
    if route == MESSAGES:
        check_messages_body(body)
        out.inline_system = has_inline_system(body)
    elif route == RESPONSES:
        check_responses_body(body)
        out.load_only = stateful_reason(body) or (None if body.get("model") else "no_model")
        if out.load_only:
            return out
    try:
        if route == CHAT:
            out.chat = chat_prompt(body)
        elif route == MESSAGES:
            out.chat = messages_prompt(body, merge_inline_system=False)
        elif route == RESPONSES:
            out.chat = responses_prompt(body)
        elif body.get("truncate_prompt_tokens") is not None:
            raise Unrenderable("truncate_prompt_tokens", "the engine truncates the prompt")
    except Unrenderable as exc:
        out.unrenderable = exc
    return out


def merged_prompt(body: Mapping[str, Any]) -> ChatPrompt:
    """/v1/messages for a template that refuses inline system messages (vLLM merges them first)."""
    return messages_prompt(body, merge_inline_system=True)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_counts(route: str, usage: Mapping[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """``(prompt, cached, completion)`` tokens of an answer's usage in its surface's shape. Anthropic's
    ``input_tokens`` leaves out cache reads and writes; a missing figure is None."""
    if not usage:
        return None, None, None
    if route == MESSAGES:
        read, written, fresh = (
            _int(usage.get(k)) for k in ("cache_read_input_tokens", "cache_creation_input_tokens", "input_tokens")
        )
        prompt = None if fresh is None else fresh + (read or 0) + (written or 0)
        return prompt, read, _int(usage.get("output_tokens"))
    if route == RESPONSES:
        details = usage.get("input_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        return _int(usage.get("input_tokens")), cached, _int(usage.get("output_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return _int(usage.get("prompt_tokens")), cached, _int(usage.get("completion_tokens"))
