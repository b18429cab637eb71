"""vLLM 0.33's other surfaces over real HTTP: the render routes, the Anthropic Messages API and the OpenAI
Responses API, all on the same engine, so one conversation reaches the same KV cache on every surface."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from kvroute.sim.surfaces import SCALE_OUT_DISABLED
from kvroute.sim.tokenizer import encode_chat, tokenize

from tests.sim.conftest import words

RENDER_ROUTES = ("/v1/completions/render", "/v1/chat/completions/render", "/v1/messages/render", "/v1/responses/render")
GENERATE_REQUEST_FIELDS = [
    "request_id",
    "token_ids",
    "token_offsets",
    "features",
    "content_parts",
    "sampling_params",
    "model",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "return_token_ids",
    "output_mode",
    "parse_context",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "ec_transfer_params",
]


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``event: X`` / ``data: {...}`` pairs (Anthropic's and the Responses API's framing)."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = chunk.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
        out.append((lines[0][len("event: ") :], orjson.loads(lines[1][len("data: ") :])))
    return out


def conversation(tag: str = "") -> tuple[str, list[dict[str, str]]]:
    system, user = words(40, f"sys{tag}-"), words(30, f"user{tag}-")
    return system, [{"role": "system", "content": system}, {"role": "user", "content": user}]


# -- render ----------------------------------------------------------------------------------------------


async def test_render_routes_are_off_without_enable_scale_out(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    for route in RENDER_ROUTES:
        r = await client.post(f"{fleet[0].url}{route}", json={"prompt": "a"})
        assert r.status_code == 403
        assert r.json() == {
            "error": {"message": SCALE_OUT_DISABLED, "type": "PermissionDeniedError", "param": None, "code": 403}
        }


async def test_chat_render_is_what_the_engine_runs(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, enable_scale_out=True)
    w = fleet[0]
    _, messages = conversation()
    kv = {"max_load_tokens": 64}
    body = {"messages": messages, "max_tokens": 7, "cache_salt": "t1", "kv_transfer_params": kv, "temperature": 0.5}
    r = await client.post(f"{w.url}/v1/chat/completions/render", json=body, headers={"X-Request-Id": "abc"})
    assert r.status_code == 200
    rendered = r.json()
    assert list(rendered) == GENERATE_REQUEST_FIELDS
    assert rendered["request_id"] == "chatcmpl-abc" and rendered["output_mode"] == "tokens"
    tokens = (await client.post(f"{w.url}/tokenize", json={"messages": messages})).json()["tokens"]
    assert rendered["token_ids"] == tokens == encode_chat(messages)
    sampling = rendered["sampling_params"]
    assert sampling["max_tokens"] == 7 and sampling["output_kind"] == 2 and sampling["temperature"] == 0.5
    assert "kv_transfer_params" not in sampling.get("extra_args", {})  # hoisted to the top level
    assert rendered["kv_transfer_params"] == kv and rendered["cache_salt"] == "t1"
    assert rendered["parse_context"]["tool_choice"] == "none" and rendered["stream"] is False
    answer = (await client.post(f"{w.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1})).json()
    assert answer["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    streamed = (await client.post(f"{w.url}/v1/chat/completions/render", json={**body, "stream": True})).json()
    assert streamed["sampling_params"]["output_kind"] == 1 and streamed["stream"] is True


async def test_completion_render_returns_one_request_per_prompt(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, enable_scale_out=True)
    w = fleet[0]
    one = await client.post(f"{w.url}/v1/completions/render", json={"prompt": "a b c"}, headers={"X-Request-Id": "q"})
    [rendered] = one.json()
    assert rendered["request_id"] == "cmpl-q" and rendered["token_ids"] == tokenize("a b c")
    assert rendered["parse_context"] is None and "max_tokens" not in rendered["sampling_params"]  # 16: default
    batch = await client.post(
        f"{w.url}/v1/completions/render", json={"prompt": ["a b", [300, 301]]}, headers={"X-Request-Id": "q"}
    )
    assert [(g["request_id"], g["token_ids"]) for g in batch.json()] == [
        ("cmpl-q-0", tokenize("a b")),
        ("cmpl-q-1", [300, 301]),
    ]
    assert (
        await client.post(f"{w.url}/v1/completions/render", json={"model": "nope", "prompt": "a"})
    ).status_code == 404


async def test_messages_and_responses_render_like_their_chat(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, enable_scale_out=True)
    w = fleet[0]
    system, messages = conversation()
    anthropic = {"model": w.model, "max_tokens": 5, "system": system, "messages": messages[1:]}
    rendered = (await client.post(f"{w.url}/v1/messages/render", json=anthropic)).json()
    assert rendered["token_ids"] == encode_chat(messages) and rendered["request_id"].startswith("chatcmpl-")
    responses = {"instructions": system, "input": messages[1]["content"], "max_output_tokens": 5}
    rendered = (await client.post(f"{w.url}/v1/responses/render", json={**responses, "request_id": "resp_1"})).json()
    assert rendered["token_ids"] == encode_chat(messages) and rendered["request_id"] == "resp_1"


async def test_render_is_not_subject_to_admission(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, enable_scale_out=True, max_num_queued_reqs=0)
    w = fleet[0]
    assert (await client.post(f"{w.url}/v1/completions", json={"prompt": "a"})).status_code == 503
    assert (await client.post(f"{w.url}/v1/completions/render", json={"prompt": "a"})).status_code == 200


# -- Anthropic Messages ---------------------------------------------------------------------------------


async def test_messages_answer_and_usage_with_cache_fields(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    w = fleet[0]
    system, messages = conversation()
    # The conversation first goes through chat completions: /v1/messages reaches the same KV cache.
    await client.post(f"{w.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    body = {"model": w.model, "max_tokens": 4, "system": [{"type": "text", "text": system}], "messages": messages[1:]}
    r = await client.post(f"{w.url}/v1/messages", json=body, headers={"X-Request-Id": "m1"})
    assert r.status_code == 200
    answer = r.json()
    prompt = len(encode_chat(messages))
    assert answer["id"] == "chatcmpl-m1" and answer["type"] == "message" and answer["role"] == "assistant"
    assert answer["model"] == w.model and answer["stop_reason"] == "max_tokens" and "stop_sequence" not in answer
    assert answer["content"][0]["type"] == "text" and len(answer["content"][0]["text"].split()) == 4
    usage = answer["usage"]
    read = (prompt - 1) // 16 * 16
    assert usage["cache_read_input_tokens"] == read and usage["output_tokens"] == 4
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] == prompt
    assert "kv_transfer_params" not in answer  # None is dropped (exclude_none)
    # A fresh prompt writes the cache: the written tokens move from input to cache_creation.
    fresh = {
        "model": w.model,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": words(50, "new-")}]}],
    }
    usage = (await client.post(f"{w.url}/v1/messages", json=fresh)).json()["usage"]
    assert usage["cache_read_input_tokens"] == 0 and usage["cache_creation_input_tokens"] > 0


async def test_messages_stream_events(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    w = fleet[0]
    _, messages = conversation("s")
    body = {"model": w.model, "max_tokens": 6, "messages": messages, "stream": True}
    await client.post(f"{w.url}/v1/messages", json={**body, "stream": False})
    r = await client.post(f"{w.url}/v1/messages", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    events = sse_events(r.text)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": len(encode_chat(messages)), "output_tokens": 0}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert len(text.split()) == 6
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6 and delta["usage"]["cache_read_input_tokens"] > 0


async def test_messages_errors_are_anthropic_shaped(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    w = fleet[0]
    msgs = [{"role": "user", "content": "hi"}]
    r = await client.post(f"{w.url}/v1/messages", json={"model": w.model, "messages": msgs})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = await client.post(f"{w.url}/v1/messages", json={"model": "nope", "max_tokens": 1, "messages": msgs})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    count = await client.post(f"{w.url}/v1/messages/count_tokens", json={"model": w.model, "messages": msgs})
    assert count.json() == {"input_tokens": len(encode_chat(msgs))}


# -- OpenAI Responses -----------------------------------------------------------------------------------


async def test_responses_answer_shares_the_chat_cache(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    w = fleet[0]
    system, messages = conversation("r")
    await client.post(f"{w.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    body = {"model": w.model, "instructions": system, "input": messages[1]["content"], "max_output_tokens": 5}
    r = await client.post(f"{w.url}/v1/responses", json={**body, "request_id": "resp_x"})
    assert r.status_code == 200
    out = r.json()
    prompt = len(encode_chat(messages))
    assert out["id"] == "resp_x" and out["object"] == "response" and out["model"] == w.model
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["max_output_tokens"] == 5 and out["instructions"] == system
    [item] = out["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    assert item["content"][0]["type"] == "output_text" and len(item["content"][0]["text"].split()) == 5
    usage = out["usage"]
    assert usage["input_tokens"] == prompt and usage["output_tokens"] == 5 and usage["total_tokens"] == prompt + 5
    assert usage["input_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16
    assert out["kv_transfer_params"] is None
    # A list input of messages renders the same way.
    listed = {
        **body,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": messages[1]["content"]}]}
        ],
    }
    again = (await client.post(f"{w.url}/v1/responses", json=listed)).json()
    assert again["usage"]["input_tokens"] == prompt and again["id"].startswith("resp_")


async def test_responses_stream_events(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    w = fleet[0]
    body = {"input": words(30), "max_output_tokens": 4, "stream": True}
    r = await client.post(f"{w.url}/v1/responses", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["usage"] is None
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert events[-4][1]["text"] == text and len(text.split()) == 4
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 4


@pytest.mark.parametrize(
    "body",
    [{"input": "a", "previous_response_id": "resp_1"}, {"input": 3}, {"input": []}, {"input": "a", "model": "nope"}],
)
async def test_responses_bad_input(make_fleet: Any, client: Any, body: dict[str, Any]) -> None:
    fleet = await make_fleet(1)
    r = await client.post(f"{fleet[0].url}/v1/responses", json=body)
    assert r.status_code in (400, 404) and set(r.json()["error"]) == {"message", "type", "param", "code"}
