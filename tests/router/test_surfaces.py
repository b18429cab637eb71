"""/v1/messages and /v1/responses bodies into the chat prompt vLLM 0.32 renders, usage in each surface's
shape, and prefill-only legs per surface. Expected values follow vLLM's conversion code; the real-engine
tier (tests/vllm/test_surfaces.py) checks the resulting tokens against a live server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from kvroute.router.chat_prompt import Unrenderable
from kvroute.router.errors import ApiError
from kvroute.router.kv_params import prefill_only
from kvroute.router.requests import parse_request
from kvroute.router.surfaces import CHAT, COMPLETIONS, MESSAGES, RESPONSES, merged_prompt, read_prompt, usage_counts
from kvroute.router.tokens import LocalTokenizer, Tokenizers


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    prompt = read_prompt(MESSAGES, {"model": "m", "max_tokens": 4, **body})
    assert prompt.unrenderable is None and prompt.chat is not None
    return prompt.chat.messages


def test_anthropic_system_blocks_text_thinking_and_tools() -> None:
    out = messages(
        {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cch=9"},
                {"type": "text", "text": "one "},
                {"type": "text", "text": "two"},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "redacted_thinking", "data": "zz"},
                        {"type": "text", "text": "let me"},
                        {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
                        },
                        {"type": "tool_result", "tool_use_id": "t2", "content": "plain"},
                    ],
                },
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "done"}]},
            ],
        }
    )
    assert out == [
        {"role": "system", "content": "one two"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "reasoning": "hm",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}}],
            "content": "let me",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"},
        {"role": "tool", "tool_call_id": "t2", "content": "plain"},
        {"role": "assistant", "content": "Tool result: done"},
    ]  # the user message left with only tool results is dropped


def test_anthropic_inline_system_messages_stay_or_merge_as_the_template_wants() -> None:
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": "lead ",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
            {"role": "user", "content": "go"},
        ],
    }
    prompt = read_prompt(MESSAGES, body)
    assert prompt.inline_system and prompt.chat is not None
    assert [m["role"] for m in prompt.chat.messages] == ["system", "user", "system", "user"]
    assert merged_prompt(body).messages == [
        {"role": "system", "content": "lead reminder"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "go"},
    ]


def test_anthropic_options_tools_and_what_cannot_be_rendered_here() -> None:
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "input_schema": {"properties": {}}, "strict": True}],
        "output_config": {"effort": "low"},
        "chat_template_kwargs": {"persona": "p"},
    }
    chat = read_prompt(MESSAGES, body).chat
    assert chat is not None and chat.reasoning_effort == "low" and chat.chat_template_kwargs == {"persona": "p"}
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": None,
                "parameters": {"properties": {}, "type": "object"},
                "strict": True,
            },
        }
    ]
    cases = {
        "thinking_disabled": {"thinking": {"type": "disabled"}},
        "multimodal": {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}]},
        "tool_use_id": {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]},
        "block_type": {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
        "tool_changes": {"messages": [{"role": "system", "content": [{"type": "tool_removal", "tool": {}}]}]},
    }
    for reason, change in cases.items():
        prompt = read_prompt(MESSAGES, {**body, **change})
        assert prompt.unrenderable is not None and prompt.unrenderable.reason == reason, reason


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": []}]}, "messages[0]"),  # an unhashable role: a 400, never a TypeError
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_addition"}]}]}, "messages[0].content"),
        ({"system": [{"type": "tool_removal"}]}, "system"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"tools": [{"name": "f"}]}, "tools[0]"),
        ({"thinking": "on"}, "thinking"),
        ({"output_config": {"effort": 1}}, "output_config.effort"),
    ],
)
def test_anthropic_bad_shapes_are_400s_naming_the_field(change: dict[str, Any], field: str) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **change}
    with pytest.raises(ApiError) as info:
        read_prompt(MESSAGES, body)
    assert info.value.status == 400 and f"`{field}`" in info.value.message


def responses(body: dict[str, Any]) -> Any:
    prompt = read_prompt(RESPONSES, {"model": "m", **body})
    assert prompt.unrenderable is None and prompt.load_only is None and prompt.chat is not None
    return prompt.chat


def test_responses_items_join_the_assistant_turn_they_belong_to() -> None:
    chat = responses(
        {
            "instructions": "be kind",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "sum"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "m",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "ans"}],
                },
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                {"role": "developer", "content": "dev"},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": None}, {"type": "web_search"}],
            "reasoning": {"effort": "low"},
        }
    )
    assert chat.messages == [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {
            "role": "assistant",
            "reasoning": "sum",
            "tool_calls": [
                {"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"},
                {"id": "c2", "function": {"name": "g", "arguments": "{}"}, "type": "function"},
            ],
            "content": "ans",
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "developer", "content": "dev"},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "f", "description": None, "parameters": None}}]
    assert chat.reasoning_effort == "low" and chat.add_generation_prompt and not chat.continue_final_message
    assert chat.add_special_tokens  # vLLM encodes Responses prompts with the tokenizer's special tokens


def test_responses_partial_answers_are_continued_and_strings_are_user_turns() -> None:
    partial = {
        "type": "message",
        "role": "assistant",
        "status": "incomplete",
        "content": [{"type": "output_text", "text": "so"}],
    }
    chat = responses({"input": [{"role": "user", "content": "q"}, partial]})
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.messages[-1] == {"role": "assistant", "content": "so"}
    assert responses({"input": "hello"}).messages == [{"role": "user", "content": "hello"}]
    assert responses({"input": "hello", "tools": []}).tools is None


def test_responses_state_kept_by_one_engine_is_routed_by_load() -> None:
    for change, reason in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt_template"),
        ({"background": True}, "background"),
        ({"model": None}, "no_model"),
    ]:
        assert read_prompt(RESPONSES, {"model": "m", "input": "x", **change}).load_only == reason
    custom = read_prompt(RESPONSES, {"model": "m", "input": "x", "tools": [{"type": "custom", "name": "c"}]})
    assert custom.unrenderable is not None and custom.unrenderable.reason == "custom_tool"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"input": None}, "input"),
        ({"input": ["x"]}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        (
            {"input": [{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "e"}]},
            "input[0].encrypted_content",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"input": "x", "instructions": 1}, "instructions"),
        ({"input": "x", "tools": [1]}, "tools"),
        ({"input": "x", "reasoning": {"effort": 2}}, "reasoning.effort"),
    ],
)
def test_responses_bad_shapes_are_400s_naming_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as info:
        read_prompt(RESPONSES, {"model": "m", **change})
    assert info.value.status == 400 and f"`{field}`" in info.value.message


def test_chat_options_are_read_and_checked() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "documents": [{"title": "t", "text": "x"}],
        "chat_template_kwargs": {"a": 1},
        "reasoning_effort": "low",
    }
    chat = read_prompt(CHAT, body).chat
    assert chat is not None and chat.continue_final_message and not chat.add_generation_prompt
    assert chat.documents == body["documents"] and chat.chat_template_kwargs == {"a": 1}
    for change in (
        {"add_generation_prompt": True},
        {"chat_template_kwargs": "a"},
        {"documents": ["x"]},
        {"add_generation_prompt": "no"},
    ):
        with pytest.raises(ApiError):
            read_prompt(CHAT, {**body, **change})
    truncated = read_prompt(COMPLETIONS, {"model": "m", "prompt": "x", "truncate_prompt_tokens": 5})
    assert truncated.unrenderable is not None and truncated.unrenderable.reason == "truncate_prompt_tokens"


def test_parse_request_reads_every_surface_once() -> None:
    body = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "conversation_id": "c"}'
    parsed = parse_request("POST", "/v1/messages", [], body)
    assert parsed.generation and parsed.prompt is not None and parsed.prompt.surface == "messages"
    assert parsed.conversation_id == "c" and b"conversation_id" not in parsed.body
    assert parsed.max_tokens == 4
    resp = parse_request("POST", "/v1/responses", [], b'{"input": "x", "max_output_tokens": 9}')
    assert resp.model is None and resp.max_tokens == 9 and resp.prompt is not None and resp.prompt.load_only
    with pytest.raises(ApiError):
        parse_request("POST", "/v1/messages", [], b'{"model": "m", "messages": []}')


def test_usage_in_each_surface_shape() -> None:
    anthropic = {
        "input_tokens": 10,
        "output_tokens": 3,
        "cache_read_input_tokens": 64,
        "cache_creation_input_tokens": 6,
    }
    assert usage_counts(MESSAGES, anthropic) == (80, 64, 3)
    assert usage_counts(MESSAGES, {"input_tokens": 10, "output_tokens": 0}) == (10, None, 0)
    responses_usage = {"input_tokens": 90, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 2}
    assert usage_counts(RESPONSES, responses_usage) == (90, 32, 2)
    chat = {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": True}}
    assert usage_counts(CHAT, chat) == (5, None, 1)
    assert usage_counts(CHAT, None) == (None, None, None)


def test_prefill_only_legs_stop_after_one_token_on_each_surface() -> None:
    assert prefill_only({"max_output_tokens": 50, "stream": True}, RESPONSES) == {
        "max_output_tokens": 1,
        "stream": False,
        "store": False,
    }
    thinking = {"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 2048}, "stream": True}
    assert prefill_only(thinking, MESSAGES) == {"max_tokens": 1, "stream": False}
    kept = {"max_tokens": 9, "thinking": {"type": "disabled"}}
    assert prefill_only(kept, MESSAGES)["thinking"] == {"type": "disabled"}  # it changes the prompt: kept
    assert prefill_only({"max_tokens": 9, "stream_options": {}, "min_tokens": 2}) == {"max_tokens": 1, "stream": False}


def test_unrenderable_carries_a_metric_label() -> None:
    exc = Unrenderable("multimodal", "an image")
    assert exc.reason == "multimodal" and "an image" in str(exc)


async def test_inline_system_messages_go_where_the_workers_template_puts_them(tmp_path: Path) -> None:
    from tests.router.test_tokens import CHATML, build_model_folder

    folder = build_model_folder(tmp_path / "model")
    guarded = tmp_path / "guarded.jinja"
    guarded.write_text(
        CHATML.replace(
            "{% for m in messages %}",
            "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
            "{{ raise_exception('system first') }}{% endif %}",
        )
    )
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": "lead",
        "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "later"}],
    }
    async with httpx.AsyncClient() as client:
        merging = Tokenizers(client, lambda m: [], {"m": (str(folder), str(guarded))})
        local = merging.source("m")
        assert isinstance(local, LocalTokenizer) and local.merges_inline_system
        assert await merging.tokens_for_request("m", MESSAGES, body) == local.encode_chat_prompt(merged_prompt(body))
        keeping = Tokenizers(client, lambda m: [], {"m": (str(folder), None)})
        kept = await keeping.tokens_for_request("m", MESSAGES, body)
        assert kept == LocalTokenizer(folder).encode_chat(
            [
                {"role": "system", "content": "lead"},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "later"},
            ]
        )
        remote = Tokenizers(client, lambda m: ["http://127.0.0.1:9"])  # never asked: the answer is not knowable
        with pytest.raises(Unrenderable) as info:
            await remote.tokens_for_request("m", MESSAGES, body)
        assert info.value.reason == "inline_system"
