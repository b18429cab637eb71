"""The chat template and the conversation as vLLM 0.32 builds them (the real-engine tier checks the same
against a live server: tests/vllm/test_surfaces.py). Each expectation here is what vLLM's renderer
hands the template, or what transformers renders, for that input."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.router.chat_prompt import (
    ChatPrompt,
    ContentFormat,
    TokenizeError,
    Unrenderable,
    chat_tools,
    conversation,
    developer_as_system,
)
from kvroute.router.chat_template import ChatTemplate
from kvroute.router.errors import ApiError
from kvroute.router.template_format import detect_content_format

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PARTS = (
    "{% for m in messages %}<|{{ m.role }}|>{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}{% endfor %}"
)


def test_continue_final_message_drops_the_end_of_turn_tail() -> None:
    template = ChatTemplate(CHATML)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the"}]
    prompt = ChatPrompt(messages, add_generation_prompt=False, continue_final_message=True)
    assert template.render_prompt(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure, the"
    full = template.render_prompt(ChatPrompt(messages, add_generation_prompt=False))
    assert full.endswith("Sure, the<|im_end|>\n")
    trimmed = ChatTemplate(CHATML.replace("{{ m['content'] }}", "{{ m['content'] | trim }}"))
    spaced = [messages[0], {"role": "assistant", "content": "Sure, the  "}]
    text = trimmed.render_prompt(ChatPrompt(spaced, add_generation_prompt=False, continue_final_message=True))
    assert text.endswith("assistant\nSure, the")
    with pytest.raises(TokenizeError):  # the engine refuses both together too
        template.render_prompt(ChatPrompt(messages, add_generation_prompt=True, continue_final_message=True))


def test_request_options_override_template_kwargs_and_unset_values_do_not() -> None:
    prompt = ChatPrompt(
        [],
        add_generation_prompt=True,
        documents=[{"title": "t", "text": "x"}],
        reasoning_effort="none",
        chat_template_kwargs={"add_generation_prompt": False, "gone": None, "auto": "auto", "persona": "p"},
    )
    assert prompt.template_kwargs() == {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "documents": [{"title": "t", "text": "x"}],
        "reasoning_effort": "none",
        "enable_thinking": False,
        "persona": "p",
    }
    kept = ChatPrompt([], reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert kept.template_kwargs()["enable_thinking"] is False
    tools = ChatPrompt([], tools=[], chat_template_kwargs={"tools": [{"x": 1}]})
    assert tools.template_kwargs()["tools"] == [{"x": 1}]  # the request's kwargs win over its tools, as in vLLM
    with pytest.raises(Unrenderable, match="tokenize"):
        ChatPrompt([], chat_template_kwargs={"tokenize": True}).template_kwargs()


def test_tools_reach_the_template_as_the_engine_dumps_them() -> None:
    tools = chat_tools(
        [
            {"type": "function", "function": {"name": "f", "extra": 1}},
            {"function": {"name": "g", "parameters": {"type": "object"}, "strict": True}, "defer_loading": True},
        ]
    )
    assert tools == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {
            "type": "function",
            "function": {
                "name": "g",
                "description": None,
                "parameters": {"type": "object"},
                "strict": True,
                "defer_loading": True,
            },
            "defer_loading": True,
        },
    ]
    assert list(tools[1]["function"]) == ["name", "description", "parameters", "strict", "defer_loading"]
    for bad in ([{"type": "function"}], [{"function": {"name": 3}}], "f", [{"function": {"name": "f", "strict": 1}}]):
        with pytest.raises(ApiError) as info:
            chat_tools(bad)
        assert info.value.status == 400 and "tools" in info.value.message


def test_the_conversation_vllm_builds_for_a_string_template() -> None:
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1\nrules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, "c"]},
        {"role": "user", "content": [{"type": "text", "text": None}, {"type": "refusal", "refusal": "no"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "think",
            "extra": "dropped",
            "name": "bot",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"k": [1, 2]}'}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "3", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
            ],
        },
        {"role": "assistant", "content": "x", "tool_calls": []},
        {"role": "tool", "tool_call_id": "1", "content": "42"},
    ]
    out = conversation(messages, "string")
    assert out[0] == {"role": "system", "content": "rules"}
    assert out[1] == {"role": "user", "content": "a\nb\nc"}
    assert out[2] == {"role": "user", "content": "no"}
    assert out[3]["content"] == "" and out[3]["name"] == "bot" and "extra" not in out[3]
    assert out[3]["reasoning"] == out[3]["reasoning_content"] == "think"
    assert [c["function"]["arguments"] for c in out[3]["tool_calls"]] == [{"k": [1, 2]}, {}, {}]
    assert messages[3]["tool_calls"][0]["function"]["arguments"] == '{"k": [1, 2]}'  # the client's body untouched
    assert "tool_calls" not in out[4]
    assert out[5] == {"role": "tool", "content": "42", "tool_call_id": "1"}


class _Message(Mapping[str, Any]):
    """A message that is a mapping but not a dict: :func:`conversation` takes its general path."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = fields

    def __getitem__(self, key: str) -> Any:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


_MESSAGE_FIELDS = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "other"])},
    optional={
        "content": st.one_of(st.none(), st.text(max_size=4), st.just([{"type": "text", "text": "p"}])),
        "name": st.sampled_from(["n", 3]),
        "tool_call_id": st.just("1"),
        "extra": st.just("dropped"),
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_MESSAGE_FIELDS, max_size=6), st.sampled_from(["string", "openai"]))
def test_the_plain_message_shortcut_builds_what_the_general_path_builds(
    fields: list[dict[str, Any]], fmt: ContentFormat
) -> None:
    try:
        general = conversation([_Message(f) for f in fields], fmt)
    except TokenizeError as exc:
        with pytest.raises(type(exc)):
            conversation(fields, fmt)
        return
    assert conversation(fields, fmt) == general


def test_the_conversation_for_an_openai_template_keeps_parts() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "tool",
            "tool_call_id": "1",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
    ]
    assert conversation(messages, "openai") == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "tool", "content": "a\nb", "tool_call_id": "1"},
    ]
    template = ChatTemplate(PARTS)
    assert template.content_format == "openai"
    assert template.render_prompt(ChatPrompt([{"role": "user", "content": "x"}])) == "<|user|>[x]"
    with pytest.raises(Unrenderable) as info:
        conversation([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}], "openai")
    assert info.value.reason == "content_part"


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://x"}},
        {"type": "input_image", "image_url": "http://x"},
        {"image_url": "http://x"},
        {"type": "input_audio", "input_audio": {}},
    ],
)
def test_media_cannot_be_rendered_here(part: dict[str, object]) -> None:
    with pytest.raises(Unrenderable) as info:
        conversation([{"role": "user", "content": [part]}], "string")
    assert info.value.reason == "multimodal"


def test_developer_messages_become_system_for_templates_without_the_role() -> None:
    messages = [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "B", "tools": None},
    ]
    assert developer_as_system(conversation(messages, "string")) == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "u"},
    ]
    first = [{"role": "developer", "content": "B"}, {"role": "user", "content": "u"}]
    assert developer_as_system(conversation(first, "string"))[0] == {"role": "system", "content": "B"}
    rendered = ChatTemplate(CHATML).render_prompt(ChatPrompt(messages))
    assert rendered.startswith("<|im_start|>system\nA\n\nB<|im_end|>\n<|im_start|>user\nu")
    knows = ChatTemplate(CHATML + "{# developer #}{% if false %}'developer'{% endif %}")
    assert "<|im_start|>developer\nB" in knows.render_prompt(ChatPrompt(messages))


@pytest.mark.parametrize(
    ("source", "fmt"),
    [
        (CHATML, "string"),
        (PARTS, "openai"),
        (
            "{% for m in messages %}{% set c = m.content %}{% for p in content %}{{ p }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(x) %}{% for p in x %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m['content']) }}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for a, b in m['content'] %}{{ a }}{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %", "string"),
    ],
)
def test_content_format_is_detected_as_vllm_detects_it(source: str, fmt: str) -> None:
    assert detect_content_format(source) == fmt


def test_template_properties_vllm_probes() -> None:
    guarded = CHATML.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('x') }}{% endif %}",
    )
    assert ChatTemplate(guarded).merges_inline_system
    assert not ChatTemplate(CHATML).merges_inline_system
    named = ChatTemplate(CHATML, tool_use="TOOLS {{ tools | tojson(separators=(',', ':')) }}")
    assert named.render_prompt(ChatPrompt([{"role": "user", "content": "x"}], tools=[])) == "TOOLS []"
    assert named.render_prompt(ChatPrompt([{"role": "user", "content": "x"}])).startswith("<|im_start|>user")
    tagged = ChatTemplate("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    assert tagged.render_prompt(ChatPrompt([{"role": "user", "content": "x"}])) == "x"
    with pytest.raises(Unrenderable) as info:
        ChatTemplate(CHATML).render_prompt(ChatPrompt([{"role": "user", "content": "x"}], chat_template="{{ 1 }}"))
    assert info.value.reason == "chat_template"
