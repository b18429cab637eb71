"""Exact engine tokens: a locally built BPE + chat template, and a real /tokenize server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.router.tokens import LocalTokenizer, RemoteTokenizer, TokenizeError, Tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tests.conftest import free_port

PIECES = [*"ab cé\n\t!<|>_", "<|im_end|>", "<|im_start|>", "<s>", "  ", "fox", "dog"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "You are a helpful assistant.",
    "The quick brown fox jumps over the lazy dog.",
    "def tokenize(text): return text.split()",
    "Quelle heure est-il ? Il est midi.",
    "KV cache aware routing for vLLM workers",
    "numbers 12345 67890 and symbols !@#$%",
] * 20


def build_model_folder(folder: Path) -> Path:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": "<s>", "eos_token": {"content": "<|im_end|>"}})
    )
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("model"))


@pytest.fixture
def local(model_folder: Path) -> LocalTokenizer:
    return LocalTokenizer(model_folder)


def full_chat(tok: LocalTokenizer, messages: list[dict[str, str]]) -> list[int]:
    assert tok.template is not None
    return tok.tokenizer.encode(tok.template.render(messages), add_special_tokens=False).ids


def test_chat_tokens_match_a_full_encode(local: LocalTokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Quelle heure est-il ?"},
    ]
    ids = local.encode_chat(messages)
    assert ids == full_chat(local, messages)
    assert ids[0] == local.tokenizer.token_to_id("<|im_start|>")


def test_growing_conversation_reuses_the_cached_prefix_exactly(local: LocalTokenizer) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(8):
        messages.append({"role": "user", "content": f"question {turn}: the quick brown fox {turn * 7}"})
        assert local.encode_chat(messages) == full_chat(local, messages)
        messages.append({"role": "assistant", "content": f"answer {turn} jumps over the lazy dog"})
    assert local.stats()["prefix_hits"] >= 6


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.lists(st.sampled_from(PIECES), max_size=12).map("".join), min_size=1, max_size=5))
def test_prefix_cache_is_exact_on_arbitrary_text(model_folder: Path, parts: list[str]) -> None:
    tok = LocalTokenizer(model_folder)
    messages: list[dict[str, str]] = []
    for part in parts:
        messages.append({"role": "user", "content": part})
        assert tok.encode_chat(messages) == full_chat(tok, messages)
        prompt = "<|im_start|>".join(m["content"] for m in messages)
        assert tok.encode_prompt(prompt) == tok.tokenizer.encode(prompt, add_special_tokens=True).ids


def test_prompt_tokens_include_the_post_processor_bos(local: LocalTokenizer) -> None:
    ids = local.encode_prompt("The quick brown fox")
    assert ids[0] == local.tokenizer.token_to_id("<s>")
    assert ids == local.tokenizer.encode("The quick brown fox", add_special_tokens=True).ids


def test_template_errors_and_missing_files_are_clear(tmp_path: Path, model_folder: Path) -> None:
    broken = tmp_path / "t.jinja"
    broken.write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(TokenizeError, match="no system role"):
        LocalTokenizer(model_folder, chat_template=broken).encode_chat([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizeError, match="cannot load tokenizer"):
        LocalTokenizer(tmp_path)
    with pytest.raises(TokenizeError):
        LocalTokenizer(model_folder).encode_chat("not a list")  # type: ignore[arg-type]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((model_folder / "tokenizer.json").read_text())
    with pytest.raises(TokenizeError, match="no chat template"):
        LocalTokenizer(bare).encode_chat([{"role": "user", "content": "x"}])


# -- the worker's /tokenize over real HTTP ---------------------------------------------------------------


def tokenize_app(tok: LocalTokenizer, calls: list[dict[str, object]]) -> FastAPI:
    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> object:
        body = await request.json()
        calls.append(body)
        if body.get("prompt") == "boom":
            return PlainTextResponse("engine exploded", status_code=500)
        if body.get("prompt") == "garbage":
            return JSONResponse({"tokens": ["a"]})
        if "messages" in body:
            gen = body.get("add_generation_prompt", True)
            ids = tok.encode_chat(body["messages"], add_generation_prompt=gen)
        else:
            ids = tok.encode_prompt(body["prompt"])
        return {"tokens": list(ids), "count": len(ids), "max_model_len": 4096}

    return app


@pytest.fixture
async def server(local: LocalTokenizer) -> AsyncIterator[tuple[str, list[dict[str, object]]]]:
    calls: list[dict[str, object]] = []
    port = free_port()
    srv = uvicorn.Server(
        uvicorn.Config(tokenize_app(local, calls), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}", calls
    srv.should_exit = True
    await task


async def test_remote_tokenize_prompt_and_messages(
    server: tuple[str, list[dict[str, object]]], local: LocalTokenizer
) -> None:
    url, calls = server
    async with httpx.AsyncClient() as client:
        remote = RemoteTokenizer(client, lambda: [url], "m")
        messages = [{"role": "user", "content": "hello there"}]
        assert await remote.chat_tokens(messages) == local.encode_chat(messages)
        assert await remote.prompt_tokens("lazy dog") == local.encode_prompt("lazy dog")
        assert await remote.chat_tokens(messages) == local.encode_chat(messages)  # from the cache
    assert len(calls) == 2
    assert calls[0] == {"model": "m", "messages": messages, "add_generation_prompt": True}


async def test_remote_errors_are_tokenize_errors(server: tuple[str, list[dict[str, object]]]) -> None:
    url, _ = server
    async with httpx.AsyncClient() as client:
        remote = RemoteTokenizer(client, lambda: [url], "m")
        with pytest.raises(TokenizeError, match="500"):
            await remote.prompt_tokens("boom")
        with pytest.raises(TokenizeError, match="malformed"):
            await remote.prompt_tokens("garbage")
        dead = RemoteTokenizer(client, lambda: [f"http://127.0.0.1:{free_port()}"], "m")
        with pytest.raises(TokenizeError, match="failed"):
            await dead.prompt_tokens("x")


async def test_per_model_sources(
    server: tuple[str, list[dict[str, object]]], model_folder: Path, local: LocalTokenizer
) -> None:
    url, calls = server
    models_cfg = [
        SimpleNamespace(name="local-model", tokenizer=str(model_folder), chat_template=None),
        SimpleNamespace(name="remote-model", tokenizer=None, chat_template=None),
    ]
    async with httpx.AsyncClient() as client:
        toks = Tokenizers.from_models(models_cfg, client, lambda m: [url] if m == "remote-model" else [])
        body = {"messages": [{"role": "user", "content": "hi"}]}
        assert isinstance(toks.source("local-model"), LocalTokenizer)
        assert await toks.tokens_for_body("local-model", body) == local.encode_chat(body["messages"])
        assert await toks.tokens_for_body("remote-model", body) == local.encode_chat(body["messages"])
        assert await toks.tokens_for_body("remote-model", {"prompt": [5, 6, 7]}) == [5, 6, 7]
        with pytest.raises(TokenizeError):
            await toks.tokens_for_body("remote-model", {"prompt": 12})
        with pytest.raises(TokenizeError, match="no worker"):
            toks.source("unknown")
    assert len(calls) == 1


async def test_remote_tokenizer_spreads_and_fails_over(server: tuple[str, list[dict[str, object]]]) -> None:
    """A dead or stalled worker costs nothing: the next healthy one answers; calls rotate over workers."""
    url, calls = server
    stalled = await asyncio.start_server(lambda r, w: asyncio.sleep(30), "127.0.0.1", 0)  # accepts, never answers
    stalled_url = f"http://127.0.0.1:{stalled.sockets[0].getsockname()[1]}"
    dead_url = f"http://127.0.0.1:{free_port()}"
    try:
        async with httpx.AsyncClient() as client:
            remote = RemoteTokenizer(client, lambda: [dead_url, stalled_url, url], "m", timeout_s=0.3)
            for i in range(3):
                assert await remote.prompt_tokens(f"prompt {i}")
        assert len(calls) == 3  # every call reached the one worker that answers
    finally:
        stalled.close()
    async with httpx.AsyncClient() as client:
        nobody = RemoteTokenizer(client, lambda: [], "m")
        with pytest.raises(TokenizeError, match="no healthy worker"):
            await nobody.prompt_tokens("x")
