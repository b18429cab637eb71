"""The OpenAI API of one simulated worker, over real HTTP."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from kvroute.sim.tokenizer import encode_chat, tokenize

from tests.sim.conftest import words


def _sse(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


async def test_completion_reports_cached_tokens_and_vllm_shape(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    url = fleet[0].url
    body = {"model": fleet.model, "prompt": words(100), "max_tokens": 5}
    first = (await client.post(f"{url}/v1/completions", json=body)).json()
    second = (await client.post(f"{url}/v1/completions", json=body)).json()
    assert first["object"] == "text_completion" and first["choices"][0]["finish_reason"] == "length"
    assert len(first["choices"][0]["text"].split()) == 5
    assert first["usage"] == {
        "prompt_tokens": 100,
        "completion_tokens": 5,
        "total_tokens": 105,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 full blocks of 16
    assert "kv_transfer_params" in first and first["kv_transfer_params"] is None
    # Token-id prompts hit the same blocks as the text.
    body = {"prompt": tokenize(words(100)), "max_tokens": 1}
    ids = (await client.post(f"{url}/v1/completions", json=body)).json()
    assert ids["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


async def test_chat_streaming_chunks_and_usage(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    messages = [{"role": "user", "content": words(30)}]
    r = await client.post(
        f"{fleet[0].url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r.text)
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2] if c["choices"])
    assert len(text.split()) == 4
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == len(encode_chat(messages))
    assert usage["usage"]["completion_tokens"] == 4


async def test_completion_streaming_without_usage(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    body = {"prompt": "a b c", "max_tokens": 3, "stream": True}
    r = await client.post(f"{fleet[0].url}/v1/completions", json=body)
    chunks = _sse(r.text)
    assert chunks[-1] == "[DONE]" and all("usage" not in c for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]).split().__len__() == 3


async def test_non_streaming_chat_and_tokenize_agree(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    url = fleet[0].url
    messages = [{"role": "system", "content": "you are a tool user"}, {"role": "user", "content": "list files"}]
    tok = (await client.post(f"{url}/tokenize", json={"messages": messages})).json()
    assert tok["tokens"] == encode_chat(messages) and tok["count"] == len(tok["tokens"])
    assert (await client.post(f"{url}/tokenize", json={"prompt": "a b"})).json()["tokens"] == tokenize("a b")
    body = {"messages": messages, "max_tokens": 2}
    chat = (await client.post(f"{url}/v1/chat/completions", json=body)).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["prompt_tokens"] == tok["count"]


async def test_models_health_metrics(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    url = fleet[0].url
    models = (await client.get(f"{url}/v1/models")).json()
    assert models["data"][0]["id"] == fleet.model and models["data"][0]["max_model_len"] == 8192
    assert (await client.get(f"{url}/health")).status_code == 200
    await client.post(f"{url}/v1/completions", json={"prompt": words(40), "max_tokens": 1})
    await client.post(f"{url}/v1/completions", json={"prompt": words(40), "max_tokens": 1})
    text = (await client.get(f"{url}/metrics")).text
    for name in (
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:time_to_first_token_seconds_bucket{",
    ):
        assert name in text
    assert 'vllm:cache_config_info{block_size="16"' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-tiny"} 32.0' in text
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="sim-tiny"} 80.0' in text
    # Failure injection for router health tests.
    await client.post(f"{url}/sim/health", json={"healthy": False})
    assert (await client.get(f"{url}/health")).status_code == 503
    assert (await client.post(f"{url}/v1/completions", json={"prompt": "a"})).status_code == 503


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "Invalid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", {"model": "other", "prompt": "a"}, 404, "does not exist"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt is required"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "n": 2}, 400, "n > 1"),
        ("/v1/completions", {"prompt": [1, -5]}, 400, "Token ids"),
        ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400, "empty"),
        ("/v1/completions", {"prompt": words(9000), "max_tokens": 1}, 400, "maximum context length"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "role"),
        ("/v1/completions", {"prompt": "a", "kv_transfer_params": "x"}, 400, "kv_transfer_params"),
        ("/tokenize", {"nothing": 1}, 400, "prompt"),
    ],
)
async def test_bad_input_gives_openai_errors(
    make_fleet: Any, client: Any, path: str, body: Any, status: int, needle: str
) -> None:
    fleet = await make_fleet(1)
    url = fleet[0].url
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = await client.post(f"{url}{path}", **kwargs)
    assert r.status_code == status
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == status and error["type"]
    # The worker is still serving.
    ok = await client.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 1})
    assert ok.status_code == 200


async def test_reset_clears_the_prefix_cache(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    url = fleet[0].url
    await client.post(f"{url}/v1/completions", json={"prompt": words(40), "max_tokens": 1})
    assert (await client.post(f"{url}/reset_prefix_cache")).status_code == 200
    again = (await client.post(f"{url}/v1/completions", json={"prompt": words(40), "max_tokens": 1})).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
