"""The router's tokens equal the engine's: local tokenizer (folder + chat template) and ``/tokenize``.

A mismatch here silently destroys every predicted hit, so the engine's own evidence is used three
ways: ``/tokenize``, ``usage.prompt_tokens`` and the token ids of the prefill's ``BlockStored``.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
from kvroute.indexer.events import BlockStored, decode_batch

from .kvwire import EventTap
from .servers import BLOCK_SIZE, VllmServer
from .workload import ReferenceTokenizer, chat, complete, engine_tokens, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600, func_only=True)]

#: Texts that trip tokenizers: unicode, whitespace runs, newlines, special-token look-alikes.
AWKWARD = [
    "héllo wörld — ünïcode ✓ 漢字 🙂",
    "  leading and   multiple   spaces\n\n\ttabs\r\nand CRLF  ",
    "a literal <|user|> tag and </s> inside the text <s>",
    '{"tool": "read_file", "args": {"path": "/tmp/x.py"}}',
    "",
]


def conversations(rng: random.Random) -> list[list[dict[str, str]]]:
    system = {"role": "system", "content": "you are a tool using agent. " + prompt_words(rng, 30)}
    return [
        [{"role": "user", "content": prompt_words(rng, 20)}],
        [system, {"role": "user", "content": prompt_words(rng, 40)}],
        [
            system,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": prompt_words(rng, 25)},
            {"role": "user", "content": AWKWARD[0]},
        ],
        [
            system,
            {"role": "user", "content": AWKWARD[2]},
            {"role": "assistant", "content": AWKWARD[3]},
            {"role": "user", "content": AWKWARD[1]},
        ],
    ]


async def test_completion_tokens_match(
    worker_a: VllmServer, http: httpx.AsyncClient, rng: random.Random, reference_tokenizer: ReferenceTokenizer
) -> None:
    for prompt in [*AWKWARD, prompt_words(rng, 200)]:
        engine = await engine_tokens(http, worker_a, prompt=prompt)
        assert reference_tokenizer.completion(prompt) == engine, f"completion tokens differ for {prompt!r}"
        if prompt:
            answer = await complete(http, worker_a.url, prompt)
            assert answer.prompt_tokens == len(engine)


async def test_chat_tokens_match(
    worker_b: VllmServer, http: httpx.AsyncClient, rng: random.Random, reference_tokenizer: ReferenceTokenizer
) -> None:
    for messages in conversations(rng):
        engine = await engine_tokens(http, worker_b, messages=messages)
        local = reference_tokenizer.chat(messages)
        assert local == engine, f"chat tokens differ for {messages!r}"
        answer = await chat(http, worker_b.url, messages)
        assert answer.prompt_tokens == len(engine)


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_engine_caches_the_tokens_we_compute(
    kind: str,
    worker_b: VllmServer,
    http: httpx.AsyncClient,
    rng: random.Random,
    reference_tokenizer: ReferenceTokenizer,
) -> None:
    """The prefill's BlockStored carries exactly our tokens' full blocks (the index keys them)."""
    async with EventTap(worker_b) as tap:
        for _ in range(30):
            if kind == "completion":
                prompt = prompt_words(rng, 150)
                ours = reference_tokenizer.completion(prompt)
                await complete(http, worker_b.url, prompt)
            else:
                messages = [
                    {"role": "system", "content": prompt_words(rng, 60)},
                    {"role": "user", "content": prompt_words(rng, 60)},
                ]
                ours = reference_tokenizer.chat(messages)
                await chat(http, worker_b.url, messages)
            if await tap.receive(2.0) is not None:
                break
        await tap.drain(quiet=1.0)
    full = len(ours) // BLOCK_SIZE * BLOCK_SIZE
    events = [e for raw in tap.batches for e in decode_batch(raw.payload).events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert any(e.parent_block_hash is None and e.token_ids == ours[:full] for e in stored), (
        "no BlockStored with our tokens: the engine tokenized differently"
    )


@pytest.mark.parametrize("source", ["local", "remote"])
async def test_router_tokenizer_matches_engine(
    source: str, tiny_model: Path, worker_a: VllmServer, http: httpx.AsyncClient, rng: random.Random
) -> None:
    """kvroute.router.tokens (model folder, or the worker's /tokenize) gives the engine's tokens.

    A growing agentic conversation exercises the local tokenizer's prefix-reuse cache, which must
    give exactly what a full encode (and the engine) gives.
    """
    from kvroute.router.tokens import LocalTokenizer, RemoteTokenizer

    tokenizer: LocalTokenizer | RemoteTokenizer = (
        LocalTokenizer(tiny_model) if source == "local" else RemoteTokenizer(http, lambda: [worker_a.url], "tiny")
    )
    for prompt in [*AWKWARD[:4], prompt_words(rng, 120)]:
        assert await tokenizer.prompt_tokens(prompt) == await engine_tokens(http, worker_a, prompt=prompt)
    for messages in conversations(rng):
        assert await tokenizer.chat_tokens(messages) == await engine_tokens(http, worker_a, messages=messages)
    messages = [{"role": "system", "content": prompt_words(rng, 40)}]
    for turn in range(6):
        messages.append({"role": "user", "content": prompt_words(rng, 15) + AWKWARD[turn % 4]})
        ours = await tokenizer.chat_tokens(messages)
        assert ours == await engine_tokens(http, worker_a, messages=messages), f"turn {turn}"
        answer = await chat(http, worker_a.url, messages, max_tokens=12)
        messages.append({"role": "assistant", "content": answer.text})
