"""Chat options, /v1/messages and /v1/responses: the router's tokens are the real engine's.

For each request shape the engine's own evidence is taken three ways: the ids its render route
produces for that very request (``/v1/*/render``, the servers run with ``--enable-scale-out``), the
prompt tokens it reports when serving it, and — for chat — its ``/tokenize`` (through the router's
remote tokenizer). The router's local tokenizer (the model folder) must equal all of them. The tiny
model's template gives every option something to change (tests/vllm/make_tiny_model.py).

Then through ``kvroute serve``: a repeated prefix on /v1/messages and /v1/responses goes to the worker
holding it, and the cached tokens the router predicts are the ones the engine reports.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kvroute.router.chat_prompt import Unrenderable
from kvroute.router.surfaces import CHAT, MESSAGES, RESPONSES, read_prompt, usage_counts
from kvroute.router.tokens import LocalTokenizer, RemoteTokenizer, RenderTokenizer, Tokenizers

from .kvwire import wait_for
from .router_proc import make_router
from .servers import BLOCK_SIZE, MODEL_NAME, VllmServer
from .workload import prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900, func_only=True)]

DEBUG = {"X-KVRoute-Debug": "1"}
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}


def chat_cases(rng: random.Random) -> dict[str, dict[str, Any]]:
    """Chat bodies whose options each change the rendered prompt."""
    user = {"role": "user", "content": prompt_words(rng, 30)}
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "/x"}'}}
    return {
        "continue_final_message": {
            "messages": [user, {"role": "assistant", "content": "the answer starts " + prompt_words(rng, 5)}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        "no_generation_prompt": {"messages": [user], "add_generation_prompt": False},
        "chat_template_kwargs": {"messages": [user], "chat_template_kwargs": {"persona": prompt_words(rng, 4)}},
        "tools": {"messages": [user], "tools": [TOOL], "tool_choice": "none"},
        "documents": {"messages": [user], "documents": [{"title": "doc", "text": prompt_words(rng, 12)}]},
        "reasoning_effort": {"messages": [user], "reasoning_effort": "low"},
        "developer_role": {"messages": [{"role": "developer", "content": "be brief"}, user]},
        "text_parts": {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b c"}]}]
        },
        "tool_calls": {
            "messages": [
                user,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": prompt_words(rng, 8)},
            ],
            "tools": [TOOL],
            "tool_choice": "none",
        },
        "billing_header": {
            "messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nkeep"}, user]
        },
    }


def messages_cases(rng: random.Random) -> dict[str, dict[str, Any]]:
    """Anthropic bodies through every conversion the router mirrors."""
    text = prompt_words(rng, 20)
    return {
        "system_string": {"system": prompt_words(rng, 20), "messages": [{"role": "user", "content": text}]},
        "system_blocks": {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cch=42"},
                {"type": "text", "text": prompt_words(rng, 10)},
                {"type": "text", "text": prompt_words(rng, 10)},
            ],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        },
        "thinking_and_tools": {
            "tools": [{"name": "read_file", "description": "read", "input_schema": {"properties": {}}}],
            "tool_choice": {"type": "none"},
            "messages": [
                {"role": "user", "content": text},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "let me look", "signature": "s"},
                        {"type": "text", "text": "reading"},
                        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "/x"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "42"}]},
                        {"type": "text", "text": "and now?"},
                    ],
                },
            ],
        },
        "inline_system": {
            "messages": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": "ok"},
                {"role": "system", "content": "reminder " + prompt_words(rng, 5)},
                {"role": "user", "content": "go on"},
            ]
        },
        "effort_and_kwargs": {
            "messages": [{"role": "user", "content": text}],
            "output_config": {"effort": "low"},
            "chat_template_kwargs": {"persona": "terse"},
        },
        "assistant_tool_result": {
            "messages": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "done"}]},
                {"role": "user", "content": "thanks"},
            ]
        },
    }


def responses_cases(rng: random.Random) -> dict[str, dict[str, Any]]:
    """Responses bodies: instructions, items of each kind, a continued partial answer."""
    text = prompt_words(rng, 20)
    return {
        "string_input": {"instructions": prompt_words(rng, 15), "input": text},
        "input_text_parts": {
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]
        },
        "function_call_round": {
            "tools": [{"type": "function", "name": "read_file", "parameters": {"type": "object"}, "strict": False}],
            "tool_choice": "none",
            "input": [
                {"role": "user", "content": text},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "hm"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": '{"path": "/x"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ],
        },
        "previous_output": {
            "input": [
                {"role": "user", "content": text},
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "earlier answer", "annotations": []}],
                },
                {"role": "developer", "content": "answer in one word"},
                {"role": "user", "content": "again"},
            ]
        },
        "continued": {
            "input": [
                {"role": "user", "content": text},
                {
                    "type": "message",
                    "id": "msg_2",
                    "role": "assistant",
                    "status": "incomplete",
                    "content": [{"type": "output_text", "text": "so far " + prompt_words(rng, 4), "annotations": []}],
                },
            ]
        },
        "effort_and_kwargs": {
            "input": text,
            "reasoning": {"effort": "low"},
            "chat_template_kwargs": {"persona": "terse"},
        },
    }


async def render_ids(http: httpx.AsyncClient, server: VllmServer, route: str, body: dict[str, Any]) -> list[int]:
    resp = await http.post(f"{server.url}{route}/render", json={"model": MODEL_NAME, **body})
    assert resp.status_code == 200, f"render {route}: {resp.status_code} {resp.text[:400]}"
    answer = resp.json()
    return list((answer[0] if isinstance(answer, list) else answer)["token_ids"])


async def served_prompt_tokens(http: httpx.AsyncClient, server: VllmServer, route: str, body: dict[str, Any]) -> int:
    """What the engine reports as prompt tokens when it serves ``body`` (one output token)."""
    limit = {"max_output_tokens": 1} if route == RESPONSES else {"max_tokens": 1}
    resp = await http.post(f"{server.url}{route}", json={"model": MODEL_NAME, "temperature": 0, **limit, **body})
    assert resp.status_code == 200, f"{route}: {resp.status_code} {resp.text[:400]}"
    prompt, _, _ = usage_counts(route, resp.json().get("usage"))
    assert prompt is not None, resp.text[:400]
    return prompt


def sources(tiny_model: Path, http: httpx.AsyncClient, server: VllmServer) -> dict[str, Tokenizers]:
    urls = lambda model: [server.url]  # noqa: E731
    return {
        "local": Tokenizers(http, urls, {MODEL_NAME: (str(tiny_model), None)}),
        "remote": Tokenizers(http, urls),
        "render": Tokenizers(http, urls, {MODEL_NAME: ("render", None)}),
    }


async def check_surface(
    route: str, cases: dict[str, dict[str, Any]], tiny_model: Path, server: VllmServer, http: httpx.AsyncClient
) -> None:
    by_source = sources(tiny_model, http, server)
    problems = []
    for name, case in cases.items():
        body = {"model": MODEL_NAME, **({"max_tokens": 1} if route == MESSAGES else {}), **case}
        engine = await render_ids(http, server, route, case | ({"max_tokens": 1} if route == MESSAGES else {}))
        served = await served_prompt_tokens(http, server, route, case)
        if served != len(engine):
            problems.append((name, "render vs served", len(engine), served))
        for source, tokenizers in by_source.items():
            try:
                ours = await tokenizers.tokens_for_request(MODEL_NAME, route, body, read_prompt(route, body))
            except Unrenderable as exc:
                # Only the remote tokenizer may not know where inline system messages go.
                if not (source == "remote" and exc.reason == "inline_system"):
                    problems.append((name, source, "unrenderable", exc.reason))
                continue
            if list(ours) != engine:
                problems.append((name, source, len(ours), len(engine)))
    assert not problems, problems


async def test_chat_options_match_the_engine(
    tiny_model: Path, worker_a: VllmServer, http: httpx.AsyncClient, rng: random.Random
) -> None:
    """continue_final_message (the end-of-turn tail dropped), add_generation_prompt false,
    chat_template_kwargs, tools, documents, reasoning_effort, the developer role, text parts, tool calls."""
    await check_surface(CHAT, chat_cases(rng), tiny_model, worker_a, http)
    local = LocalTokenizer(tiny_model)
    remote = RemoteTokenizer(http, lambda: [worker_a.url], MODEL_NAME)
    case = chat_cases(rng)["continue_final_message"]
    tokenize = await http.post(f"{worker_a.url}/tokenize", json={"model": MODEL_NAME, **case})
    prompt = read_prompt(CHAT, {"model": MODEL_NAME, **case}).chat
    assert prompt is not None
    assert (
        await local.chat_prompt_tokens(prompt) == await remote.chat_prompt_tokens(prompt) == tokenize.json()["tokens"]
    )


async def test_messages_match_the_engine(
    tiny_model: Path, worker_b: VllmServer, http: httpx.AsyncClient, rng: random.Random
) -> None:
    """/v1/messages: system text and blocks, the billing header, thinking, tool use and results,
    inline system messages, effort and template kwargs — and count_tokens agrees."""
    cases = messages_cases(rng)
    await check_surface(MESSAGES, cases, tiny_model, worker_b, http)
    body = {"model": MODEL_NAME, **cases["thinking_and_tools"]}
    counted = await http.post(f"{worker_b.url}/v1/messages/count_tokens", json=body)
    local = sources(tiny_model, http, worker_b)["local"]
    ours = await local.tokens_for_request(MODEL_NAME, MESSAGES, {**body, "max_tokens": 1})
    assert counted.status_code == 200 and counted.json()["input_tokens"] == len(ours)


async def test_responses_match_the_engine(
    tiny_model: Path, worker_a: VllmServer, http: httpx.AsyncClient, rng: random.Random
) -> None:
    """/v1/responses: instructions, input_text parts, reasoning and function-call items, an assistant
    output message, the developer role, a continued partial answer, effort and template kwargs."""
    await check_surface(RESPONSES, responses_cases(rng), tiny_model, worker_a, http)


async def test_render_tokenizer_gives_the_engine_tokens_and_caches_exact_bodies(
    worker_b: VllmServer, http: httpx.AsyncClient, rng: random.Random
) -> None:
    render = RenderTokenizer(http, lambda: [worker_b.url], MODEL_NAME)
    prompt = prompt_words(rng, 30)
    tokenize = await http.post(f"{worker_b.url}/tokenize", json={"model": MODEL_NAME, "prompt": prompt})
    assert await render.prompt_tokens(prompt) == tokenize.json()["tokens"]
    assert await render.prompt_tokens(prompt) == tokenize.json()["tokens"]
    assert render.stats()["hits"] == 1 and render.stats()["misses"] == 1 and render.stats()["failures"] == 0


@pytest.mark.parametrize("tokenizer", ["local", "render"])
async def test_repeated_prefix_predicted_as_the_engine_serves_it(
    tokenizer: str,
    vllm_pool: list[VllmServer],
    tiny_model: Path,
    tmp_path: Path,
    http: httpx.AsyncClient,
    rng: random.Random,
) -> None:
    """Through kvroute serve: a long prefix placed on one worker by /v1/messages (and /v1/responses) is
    routed back there, and the predicted cached tokens are exactly the engine's reported ones."""
    proc = make_router(vllm_pool, tiny_model, tmp_path, policy="kvaware")
    if tokenizer == "render":
        config = yaml.safe_load(proc.config_path.read_text())
        config["models"][0]["tokenizer"] = "render"
        proc.config_path.write_text(yaml.safe_dump(config))
    proc.start()
    local = sources(tiny_model, http, vllm_pool[0])["local"]
    try:
        for server, route in [(vllm_pool[0], MESSAGES), (vllm_pool[1], RESPONSES), (vllm_pool[1], MESSAGES)]:
            body, tokens = await place(http, proc.url, server, route, local, rng)
            more = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
            key = "messages" if route == MESSAGES else "input"
            follow = {**body, key: [*body[key], *more]}
            for stream in (False, True):
                plan, reported = await routed(http, proc.url, route, {**follow, "stream": stream})
                assert plan["prefill"] == server.name, plan
                assert plan["predicted_cached_tokens"] == reported >= (len(tokens) // BLOCK_SIZE - 1) * BLOCK_SIZE
        metrics = (await http.get(f"{proc.url}/metrics")).text
        fidelity = {}  # (surface, outcome) -> count; label order differs between exposition modes
        for line in metrics.splitlines():
            if line.startswith("kvroute_prediction_fidelity_total{"):
                labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
                fidelity[(labels["surface"].strip('"'), labels["outcome"].strip('"'))] = float(line.rsplit(" ", 1)[1])
        assert fidelity == {("messages", "exact"): 4.0, ("responses", "exact"): 2.0}, fidelity
    finally:
        proc.stop()


async def place(
    http: httpx.AsyncClient, url: str, server: VllmServer, route: str, local: Tokenizers, rng: random.Random
) -> tuple[dict[str, Any], Sequence[int]]:
    """Serve a fresh long prompt on ``server`` directly until the router's index shows it there (its SUB
    may connect after the first batch)."""
    for _ in range(10):
        system, first = prompt_words(rng, 160), [{"role": "user", "content": prompt_words(rng, 20)}]
        body: dict[str, Any] = (
            {"system": system, "max_tokens": 1, "messages": first}
            if route == MESSAGES
            else {"instructions": system, "max_output_tokens": 1, "input": first}
        )
        resp = await http.post(f"{server.url}{route}", json={"model": MODEL_NAME, "temperature": 0, **body})
        assert resp.status_code == 200, resp.text[:400]
        tokens = await local.tokens_for_request(MODEL_NAME, route, {"model": MODEL_NAME, **body})
        try:
            await wait_for(lambda t=tokens: _holds(http, url, server.name, t), 10.0, what="the prefix")
            return body, tokens
        except AssertionError:
            continue
    raise AssertionError(f"the router's index never showed a prefix placed on {server.name}")


async def _holds(http: httpx.AsyncClient, url: str, worker: str, tokens: Sequence[int]) -> bool:
    body = {"model": MODEL_NAME, "token_ids": list(tokens)}  # a tokenizer's ids are an array: JSON wants a list
    resp = await http.post(f"{url}/admin/index/lookup", json=body)
    matches = {row["worker"]: row["blocks"] for row in resp.json()["matches"]} if resp.status_code == 200 else {}
    return matches.get(worker, 0) >= len(tokens) // BLOCK_SIZE


async def routed(http: httpx.AsyncClient, url: str, route: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The router's plan and the cached tokens the engine reported (the last usage of a stream)."""
    resp = await http.post(f"{url}{route}", json={"model": MODEL_NAME, "temperature": 0, **body}, headers=DEBUG)
    assert resp.status_code == 200, resp.text[:400]
    plan = json.loads(resp.headers["x-kvroute-plan"])
    if body.get("stream"):
        usage: dict[str, Any] | None = None
        for line in resp.text.splitlines():
            if line.startswith("data: ") and '"usage"' in line:
                event = json.loads(line[6:])
                found = event.get("usage") or (event.get("response") or {}).get("usage")
                usage = found if isinstance(found, dict) else usage
    else:
        usage = resp.json().get("usage")
    _, cached, _ = usage_counts(route, usage)
    assert cached is not None, resp.text[-600:]
    return plan, cached
