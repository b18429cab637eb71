"""Requests to a real vLLM server and the test's own reference tokenization.

Why a reference tokenizer in the tests: kvroute's prediction is only right when its tokens are the
engine's. The reference here is deliberately plain (``tokenizers`` + the folder's Jinja chat
template) so a mismatch with ``/tokenize`` points at the engine's conventions, not at our code.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .servers import BLOCK_SIZE, MODEL_NAME, VllmServer

#: Words the tiny tokenizer was trained on look like these; random ones make prompts distinct.
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "pa", "do", "fe", "gi", "ha", "ju"]


def prompt_words(rng: random.Random, count: int) -> str:
    """``count`` random pseudo-words: a prompt no other test sends (given a test-specific seed)."""
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count))


@dataclass(slots=True)
class Answer:
    """What one request returned: prompt/cached token counts and the generated text."""

    prompt_tokens: int
    cached_tokens: int
    text: str
    body: dict[str, Any]


def _answer(body: dict[str, Any], chat: bool) -> Answer:
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return Answer(int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0), text or "", body)


async def complete(
    client: httpx.AsyncClient, base: str, prompt: str | list[int], max_tokens: int = 1, **extra: Any
) -> Answer:
    """One non-streaming /v1/completions call at temperature 0."""
    payload = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = await client.post(f"{base}/v1/completions", json=payload)
    assert resp.status_code == 200, f"{base} answered {resp.status_code}: {resp.text[:500]}"
    return _answer(resp.json(), chat=False)


async def chat(
    client: httpx.AsyncClient, base: str, messages: list[dict[str, str]], max_tokens: int = 1, **extra: Any
) -> Answer:
    """One non-streaming /v1/chat/completions call at temperature 0."""
    payload = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = await client.post(f"{base}/v1/chat/completions", json=payload)
    assert resp.status_code == 200, f"{base} answered {resp.status_code}: {resp.text[:500]}"
    return _answer(resp.json(), chat=True)


async def engine_tokens(
    client: httpx.AsyncClient,
    server: VllmServer,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
) -> list[int]:
    """The token ids the engine uses, from its ``POST /tokenize``."""
    body: dict[str, Any] = {"model": MODEL_NAME}
    if messages is not None:
        body.update(messages=messages, add_generation_prompt=True)
    else:
        body["prompt"] = prompt
    resp = await client.post(f"{server.url}/tokenize", json=body)
    assert resp.status_code == 200, resp.text[:500]
    return list(resp.json()["tokens"])


def engine_cached(prompt_len: int, matched_blocks: int, block_size: int = BLOCK_SIZE) -> int:
    """What vLLM reports as cached for a prompt whose first ``matched_blocks`` blocks are cached.

    vLLM always recomputes at least the last prompt token (it needs its logits), so a fully cached
    prompt of exactly k blocks reports k-1 blocks.
    """
    usable = (prompt_len - 1) // block_size
    return min(matched_blocks, usable) * block_size


class ReferenceTokenizer:
    """The model folder's ``tokenizer.json`` plus its chat template, rendered with Jinja2."""

    def __init__(self, model_dir: Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text()
        if not template:
            raise ValueError(f"{model_dir} has no chat template")
        self.bos_token = config.get("bos_token") or ""
        self.eos_token = config.get("eos_token") or ""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(template)

    def completion(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
        )

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The rendered text already holds the BOS: vLLM encodes chat prompts without special tokens.
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids
