"""Tokenizers load when the router starts, not on a model's first request; one that fails to load is
reported and the router starts anyway (that model's requests route without the index)."""

from __future__ import annotations

import logging

import httpx
import pytest
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.router.chat_prompt import TokenizeError
from kvroute.router.tokens import Tokenizers

from tests.http.upstream import FakeWorker, serve, serve_worker


class CountingTokenizer:
    """A plugin tokenizer (``python:tests.http.test_warmup:CountingTokenizer``) that counts its builds."""

    built = 0

    def __init__(self) -> None:
        type(self).built += 1

    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(" ".join(m["content"] for m in messages))


class BrokenTokenizer:
    def __init__(self) -> None:
        raise ValueError("no vocabulary")


COUNTING = "python:tests.http.test_warmup:CountingTokenizer"
BROKEN = "python:tests.http.test_warmup:BrokenTokenizer"


def tokenizers(local: dict[str, str], client: httpx.AsyncClient) -> Tokenizers:
    return Tokenizers(client, lambda model: [], {name: (spec, None) for name, spec in local.items()})


async def test_preload_builds_each_configured_tokenizer_once_before_any_request(client: httpx.AsyncClient) -> None:
    CountingTokenizer.built = 0
    toks = tokenizers({"a": COUNTING, "b": COUNTING}, client)
    assert await toks.preload() == {}
    assert CountingTokenizer.built == 2
    assert list(await toks.tokens_for_body("a", {"prompt": "one three"})) == [3, 5]
    assert await toks.preload() == {}  # already loaded: nothing is built again
    assert CountingTokenizer.built == 2


async def test_preload_reports_what_failed_and_requests_still_get_a_tokenize_error(
    client: httpx.AsyncClient,
) -> None:
    toks = tokenizers({"plugin": BROKEN, "file": "/nonexistent/tokenizer.json", "good": COUNTING}, client)
    failed = await toks.preload()
    assert set(failed) == {"plugin", "file"}
    assert "ValueError: no vocabulary" in failed["plugin"]
    assert "cannot load tokenizer" in failed["file"]
    with pytest.raises(TokenizeError):
        await toks.tokens_for_body("file", {"prompt": "x"})
    assert list(await toks.tokens_for_body("good", {"prompt": "ab"})) == [2]


async def test_the_router_loads_tokenizers_at_startup_and_serves_with_a_broken_one(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    CountingTokenizer.built = 0
    w = FakeWorker("w", models=["good", "broken"])
    models = [
        {"name": "good", "block_size": 16, "tokenizer": COUNTING},
        {"name": "broken", "block_size": 16, "tokenizer": BROKEN},
    ]
    async with serve_worker(w):
        config = RouterConfig.model_validate({"workers": [{"url": w.url}], "models": models})
        with caplog.at_level(logging.WARNING, logger="kvroute.warmup"):
            async with serve(build_app(config), lifespan="on") as url:
                assert CountingTokenizer.built == 1  # before the first request
                assert any("broken" in r.getMessage() and "no vocabulary" in r.getMessage() for r in caplog.records)
                for model in ("good", "broken"):
                    r = await client.post(url + "/v1/completions", json={"model": model, "prompt": "hello there"})
                    assert r.status_code == 200, r.text
                assert CountingTokenizer.built == 1
