"""A long new prompt's head: its tokens are the whole prompt's first ones, for every source that gives one.

The sizes are cut down here (a head of 160 characters once 400 are new) so the property tests' texts, built
from pieces that stress the pre-tokenizer around a cut (runs of spaces, newlines, specials, multi-byte
characters, digits), cross them often.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvroute.router import prompt_head
from kvroute.router.prompt_head import PromptHead, head_cut
from kvroute.router.tokens import ChatPrompt, LocalTokenizer, PluginTokenizer
from kvroute.sim.tokenizer import encode_chat, tokenize

from tests.router.test_incremental import PIECES
from tests.router.test_tokens import build_model_folder

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LONG_TEXT = st.lists(st.sampled_from(PIECES), min_size=30, max_size=300).map("".join)
BUILTIN = "python:kvroute.sim.tokenizer:BuiltinTokenizer"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("model"))


@pytest.fixture(autouse=True)
def small_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt_head, "HEAD_CHARS", 160)
    monkeypatch.setattr(prompt_head, "MIN_REST_CHARS", 400)


def check(got: PromptHead | Sequence[int], whole: list[int]) -> bool:
    """``got`` is the whole prompt's tokens, or a head of them whose rest gives them all; True for a head."""
    if not isinstance(got, PromptHead):
        assert list(got) == whole
        return False
    assert list(got.tokens) == whole[: len(got.tokens)]
    assert list(asyncio.run(got.rest())) == whole
    return True


def test_the_head_ends_before_a_space_after_a_non_space() -> None:
    text = "word " * 200
    cut = head_cut(text, 0)
    assert cut is not None and 80 < cut <= 160 and text[cut] == " " and text[cut - 1] != " "
    assert head_cut(text, len(text) - 300) is None  # too little past the cached part
    assert head_cut(" " * 500, 0) is None  # no space after a non-space: no head


@SETTINGS
@given(text=LONG_TEXT)
def test_local_heads_are_the_whole_prompts_first_tokens(model_folder: Path, text: str) -> None:
    tok = LocalTokenizer(model_folder)
    whole = tok.tokenizer.encode(text, add_special_tokens=True).ids
    check(asyncio.run(tok.prompt_head(text)), whole)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert tok.template is not None
    rendered = tok.template.render(messages, add_generation_prompt=True)
    chat = ChatPrompt(messages=messages)
    check(asyncio.run(tok.chat_prompt_head(chat)), tok.tokenizer.encode(rendered, add_special_tokens=False).ids)


def test_a_long_new_local_prompt_comes_as_its_head_once(model_folder: Path) -> None:
    tok = LocalTokenizer(model_folder)
    text = "The quick brown fox jumps over the lazy dog. " * 60
    whole = tok.tokenizer.encode(text, add_special_tokens=True).ids
    got = asyncio.run(tok.prompt_head(text))
    assert check(got, whole)
    assert isinstance(got, PromptHead) and len(got.tokens) >= 8
    assert 0.8 * len(whole) <= got.estimated_total <= 1.25 * len(whole)
    assert tok.stats()["heads"] == 1
    # Encoded whole now (its rest reused the head's tokens): the same text again is not cut.
    assert not check(asyncio.run(tok.prompt_head(text)), whole)
    assert tok.stats()["prefix_hits"] == 1
    # Short prompts are never cut.
    assert not check(asyncio.run(tok.prompt_head("a short prompt")), tok.tokenizer.encode("a short prompt").ids)


@SETTINGS
@given(text=LONG_TEXT)
def test_builtin_heads_are_the_whole_prompts_first_tokens(text: str) -> None:
    tok = PluginTokenizer(BUILTIN)
    check(asyncio.run(tok.prompt_head(text)), tokenize(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    check(asyncio.run(tok.chat_prompt_head(ChatPrompt(messages=messages))), encode_chat(messages))


def test_a_long_new_builtin_chat_comes_as_its_head_and_grows_from_its_rest() -> None:
    tok = PluginTokenizer(BUILTIN)
    messages = [{"role": "system", "content": " ".join(f"w{i}" for i in range(800))}]
    got = asyncio.run(tok.chat_prompt_head(ChatPrompt(messages=messages)))
    assert check(got, encode_chat(messages))
    messages += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "one more question"}]
    assert not check(asyncio.run(tok.chat_prompt_head(ChatPrompt(messages=messages))), encode_chat(messages))
    stats = tok.stats()
    assert stats["heads"] == 1 and stats["prefix_hits"] == 2  # the rest from the head, the next turn from it


def test_a_plugin_that_cannot_say_which_ids_stay_gives_no_head() -> None:
    tok = PluginTokenizer(BUILTIN)
    tok._stable = None
    text = "word " * 200
    assert not check(asyncio.run(tok.prompt_head(text)), tokenize(text))


def test_a_long_new_tool_output_in_a_cached_chat_comes_as_a_head_past_the_cached_turns(model_folder: Path) -> None:
    """An agent step appending a long tool output to a conversation the cache holds: the head is the cached
    turns' tokens plus the output's first characters, and the rest follows."""
    tok = LocalTokenizer(model_folder)
    assert tok.template is not None
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 10},
        {"role": "user", "content": "Read it."},
    ]
    first = asyncio.run(tok.chat_prompt_head(ChatPrompt(messages=messages)))
    assert not isinstance(first, PromptHead)  # short: encoded whole, and cached
    messages += [
        {"role": "assistant", "content": "Reading the file."},
        {"role": "user", "content": "def tokenize(text): return text.split()\n" * 40},
    ]
    rendered = tok.template.render(messages, add_generation_prompt=True)
    whole = tok.tokenizer.encode(rendered, add_special_tokens=False).ids
    got = asyncio.run(tok.chat_prompt_head(ChatPrompt(messages=messages)))
    assert check(got, whole)
    assert isinstance(got, PromptHead) and len(first) < len(got.tokens) < len(whole)
