"""Incremental tokenization and incremental block keys equal the from-scratch results, whatever the growth.

Random sessions of prompts that grow, get edited in the middle, truncated or repeated, through the local
``tokenizers`` path (a BPE built here), its chat template and the simulated workers' built-in tokenizer,
then through the key-chain cache; and neither cache ever holds more than its configured bytes.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvroute.indexer.keys import KeyChainCache, PrefixIndex, TokenIds, pack_tokens, request_keys, token_bytes
from kvroute.router.tokens import LocalTokenizer, PluginTokenizer
from kvroute.sim.tokenizer import encode_chat, tokenize

from tests.router.test_tokens import build_model_folder

#: Pieces that stress the pre-tokenizer around cuts: spaces, runs of them, newlines, tabs, specials,
#: multi-byte characters (several byte-level tokens per character) and digits.
PIECES = [
    *"ab cé\n\t!<|>_",
    " ",
    "  ",
    "    ",
    "\n\n",
    "fox",
    " dog",
    " the quick brown fox",
    " jumps over the lazy dog.",
    "12345",
    "日本語",
    "🦊",
    "<|im_end|>",
    "<|im_start|>",
    "<s>",
]
TEXT = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)

#: One step of a session: append, edit in the middle, truncate, or repeat the previous text.
STEP = st.one_of(
    st.tuples(st.just("append"), TEXT, st.integers(0, 0)),
    st.tuples(st.just("edit"), TEXT, st.integers(0, 10_000)),
    st.tuples(st.just("truncate"), st.just(""), st.integers(0, 10_000)),
    st.tuples(st.just("repeat"), st.just(""), st.integers(0, 0)),
)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def apply(text: str, step: tuple[str, str, int]) -> str:
    kind, piece, at = step
    if kind == "append":
        return text + piece
    if kind == "edit":
        i = at % (len(text) + 1)
        return text[:i] + piece + text[i + 1 :]
    if kind == "truncate":
        return text[: at % (len(text) + 1)]
    return text


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("model"))


def scratch_prompt(tok: LocalTokenizer, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=True).ids


@SETTINGS
@given(
    start=st.lists(st.sampled_from(PIECES), min_size=20, max_size=200).map("".join), steps=st.lists(STEP, max_size=12)
)
def test_local_prompts_equal_full_encodes(model_folder: Path, start: str, steps: list[tuple[str, str, int]]) -> None:
    tok = LocalTokenizer(model_folder)
    text = start
    for step in [("repeat", "", 0), *steps]:
        text = apply(text, step)
        got = tok.encode_prompt(text)
        assert got == scratch_prompt(tok, text)
        assert isinstance(got, TokenIds) and token_bytes(got) == pack_tokens(got.tolist())
        assert tok.encode_raw(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_local_long_growth_reuses_and_stays_exact(model_folder: Path) -> None:
    """A prompt of thousands of tokens growing by a sentence: each turn encodes only its tail."""
    tok = LocalTokenizer(model_folder)
    text = "You are a helpful assistant." * 200
    for turn in range(12):
        text += f" The quick brown fox {turn} jumps over the lazy dog.\n\n" * 3
        assert tok.encode_prompt(text) == scratch_prompt(tok, text)
    stats = tok.stats()
    assert stats["prefix_hits"] == 11 and stats["misses"] == 1 and stats["fallbacks"] == 0
    assert stats["tokens_encoded"] < 2 * len(scratch_prompt(tok, text))
    # An edit near the start reuses nothing after it; a truncation re-encodes only past its cut.
    edited = "X" + text[1:]
    assert tok.encode_prompt(edited) == scratch_prompt(tok, edited)
    assert tok.encode_prompt(text[: len(text) // 2]) == scratch_prompt(tok, text[: len(text) // 2])


@SETTINGS
@given(
    start=st.lists(st.sampled_from(PIECES), min_size=20, max_size=200).map("".join), steps=st.lists(STEP, max_size=8)
)
def test_async_prompts_encode_long_texts_off_the_loop_and_equal_full_encodes(
    model_folder: Path, start: str, steps: list[tuple[str, str, int]]
) -> None:
    """The async API runs the same steps as the sync one, its long encodes in a worker thread."""
    tok = LocalTokenizer(model_folder)
    tok.OFFLOOP_CHARS = 24  # most encodes here go off the loop

    async def run() -> None:
        text = start
        for step in [("repeat", "", 0), *steps]:
            text = apply(text, step)
            assert await tok.prompt_tokens(text) == scratch_prompt(tok, text)
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
            assert tok.template is not None
            rendered = tok.template.render(messages, add_generation_prompt=True)
            assert await tok.chat_tokens(messages) == tok.tokenizer.encode(rendered, add_special_tokens=False).ids

    asyncio.run(run())
    assert tok.stats()["encoded_off_loop"] > 0


@SETTINGS
@given(contents=st.lists(TEXT, min_size=1, max_size=12), size=st.integers(1, 80))
def test_a_text_encoded_in_pieces_between_special_tokens_equals_it_whole(
    model_folder: Path, contents: list[str], size: int
) -> None:
    """The off-loop encode cuts a long text before special tokens and encodes the pieces in parallel: the
    same ids and character starts as one encode, whatever the pieces hold (specials, spaces around them)."""
    tok = LocalTokenizer(model_folder)
    assert tok.template is not None
    tok.OFFLOOP_CHARS = size  # cut wherever a special token allows
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    for text in (tok.template.render(messages, add_generation_prompt=True), "".join(contents)):
        pieces = tok._pieces(text)
        assert "".join(pieces) == text
        assert tok._encode_released(text) == tok._encode(text)


def test_a_long_chat_is_encoded_in_several_pieces(model_folder: Path) -> None:
    tok = LocalTokenizer(model_folder)
    assert tok.template is not None
    tok.OFFLOOP_CHARS = 256
    messages = [{"role": "user", "content": f"message {i}: the quick brown fox jumps. " * 20} for i in range(10)]
    text = tok.template.render(messages, add_generation_prompt=True)
    pieces = tok._pieces(text)
    assert len(pieces) > 1 and all(p.startswith(("<|im_start|>", "<|im_end|>")) for p in pieces[1:])
    assert tok._encode_released(text) == tok._encode(text)


async def test_a_long_encode_leaves_the_event_loop_free(model_folder: Path) -> None:
    """While a long prompt is encoded (the tokenizer holds no GIL in the worker thread), the event loop
    goes on: here it runs this test's own code, which lets the encode finish."""
    tok = LocalTokenizer(model_folder)
    entered, proceed = threading.Event(), threading.Event()
    encode = tok._encode_released

    def gated(text: str) -> tuple[list[int], list[int]]:
        entered.set()
        assert proceed.wait(30), "the event loop never ran while the encode was in flight"
        return encode(text)

    tok._encode_released = gated  # type: ignore[method-assign]
    text = "The quick brown fox jumps over the lazy dog. " * 200
    task = asyncio.create_task(tok.prompt_tokens(text))
    while not entered.is_set():
        await asyncio.sleep(0.001)
    assert not task.done()  # the encode is in flight, and this coroutine runs
    proceed.set()
    assert await task == scratch_prompt(tok, text)
    # Short texts stay on the loop: no thread hop for a tail of a few words.
    await tok.prompt_tokens(text + " and a short tail")
    assert tok.stats()["encoded_off_loop"] == 1


CHAT_CONTENT = st.lists(st.sampled_from(PIECES), max_size=25).map("".join)


@SETTINGS
@given(
    contents=st.lists(CHAT_CONTENT, min_size=1, max_size=8),
    edit=st.integers(0, 100),
    cut=st.integers(0, 100),
)
def test_chat_growth_edits_and_truncations_equal_full_renders(
    model_folder: Path, contents: list[str], edit: int, cut: int
) -> None:
    tok = LocalTokenizer(model_folder)
    assert tok.template is not None

    def full(messages: list[dict[str, str]], gen: bool = True) -> list[int]:
        assert tok.template is not None
        return tok.tokenizer.encode(
            tok.template.render(messages, add_generation_prompt=gen), add_special_tokens=False
        ).ids

    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for i, content in enumerate(contents):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
        assert tok.encode_chat(messages) == full(messages)
        assert tok.encode_chat(messages, add_generation_prompt=False) == full(messages, False)
    edited = [dict(m) for m in messages]
    k = edit % len(edited)
    edited[k]["content"] = "edited " + edited[k]["content"][::-1]
    assert tok.encode_chat(edited) == full(edited)
    short = messages[: 1 + cut % len(messages)]
    assert tok.encode_chat(short) == full(short)


SIM_WORD = st.sampled_from(["a", "b", "fox", "dog", "日本", "x1", "", " ", "  ", "\n", "\t", "é"])
SIM_TEXT = st.lists(SIM_WORD, max_size=30).map("".join)


@SETTINGS
@given(start=SIM_TEXT, steps=st.lists(st.one_of(st.tuples(st.just("append"), SIM_TEXT, st.just(0)), STEP), max_size=12))
def test_sim_builtin_prompts_equal_full_tokenizations(start: str, steps: list[tuple[str, str, int]]) -> None:
    tok = PluginTokenizer("python:kvroute.sim.tokenizer:BuiltinTokenizer")
    text = start * 5
    for step in [("repeat", "", 0), *steps]:
        text = apply(text, step)
        got = tok.encode(text)
        assert got == tokenize(text)
        assert isinstance(got, TokenIds) and token_bytes(got) == pack_tokens(got.tolist())


async def test_sim_builtin_chat_grows_incrementally() -> None:
    tok = PluginTokenizer("python:kvroute.sim.tokenizer:BuiltinTokenizer")
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 50}]
    for turn in range(6):
        messages.append({"role": "user", "content": f"question {turn} the quick brown fox"})
        assert await tok.chat_tokens(messages) == encode_chat(messages)
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    assert tok.stats()["prefix_hits"] >= 5


@settings(max_examples=60, deadline=None)
@given(
    start=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=400),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["append", "edit", "truncate", "repeat"]),
            st.lists(st.integers(0, 2**32 - 1), max_size=80),
            st.integers(0, 10_000),
        ),
        max_size=12,
    ),
    block=st.sampled_from([1, 4, 16]),
    salt=st.sampled_from([None, "tenant"]),
    lora=st.sampled_from([None, "adapter"]),
    max_bytes=st.sampled_from([0, 4_000, 40_000, 1 << 20]),
    as_array=st.booleans(),
)
def test_incremental_keys_equal_from_scratch(
    start: list[int],
    steps: list[tuple[str, list[int], int]],
    block: int,
    salt: str | None,
    lora: str | None,
    max_bytes: int,
    as_array: bool,
) -> None:
    cache = KeyChainCache(max_bytes)
    tokens = list(start)
    for kind, piece, at in [("repeat", [], 0), *steps]:
        i = at % (len(tokens) + 1)
        if kind == "append":
            tokens = tokens + piece
        elif kind == "edit":
            tokens = tokens[:i] + piece + tokens[i + 1 :]
        elif kind == "truncate":
            tokens = tokens[:i]
        given_tokens = TokenIds(tokens) if as_array else tokens
        got = cache.keys(given_tokens, block, "m", lora_name=lora, cache_salt=salt)
        assert got == request_keys(tokens, block, "m", lora_name=lora, cache_salt=salt)
        # Another context never borrows this one's chain.
        assert cache.keys(tokens, block, "other", cache_salt=salt) == request_keys(
            tokens, block, "other", cache_salt=salt
        )
        assert cache.size_bytes <= cache.max_bytes


def test_key_cache_hashes_only_new_blocks() -> None:
    cache = KeyChainCache()
    tokens = list(range(100_000, 100_000 + 16 * 2048))
    cache.keys(tokens, 16, "m")
    grown = tokens + list(range(7, 7 + 200))
    assert cache.keys(grown, 16, "m") == request_keys(grown, 16, "m")
    stats = cache.stats()
    assert stats["prefix_hits"] == 1 and stats["blocks_hashed"] == 2048 + (2048 * 16 + 200) // 16 - 2048
    assert stats["entries"] == 1  # the prefix's entry was superseded


def test_token_ids_are_their_own_bytes_and_hold_no_int_objects() -> None:
    tokens = TokenIds([1, 2, 3, 4])
    tokens.append(5)  # the array is the bytes the keys hash: nothing can go stale
    assert KeyChainCache().keys(tokens, 1, "m") == request_keys([1, 2, 3, 4, 5], 1, "m")
    assert tokens == [1, 2, 3, 4, 5] and tokens == (1, 2, 3, 4, 5) and tokens != [1, 2, 3, 4]
    big = TokenIds(range(300, 30_300))
    # What the garbage collector visits: the type and the slots, never one object per id.
    assert len(gc.get_referents(big)) <= 4
    assert TokenIds.extended(big, 10, [7, 8]) == [*range(300, 310), 7, 8]


@SETTINGS
@given(texts=st.lists(st.lists(st.sampled_from(PIECES), min_size=30, max_size=300).map("".join), max_size=12))
def test_tokenizer_caches_stay_within_their_bytes(model_folder: Path, texts: list[str]) -> None:
    local = LocalTokenizer(model_folder, cache_bytes=60_000)
    sim = PluginTokenizer("python:kvroute.sim.tokenizer:BuiltinTokenizer", cache_bytes=20_000)
    grown = ""
    for text in texts:
        grown += text
        for t in (text, grown):
            assert local.encode_prompt(t) == scratch_prompt(local, t)
            assert sim.encode(t) == tokenize(t)
            assert local.stats()["bytes"] <= 60_000 and sim.stats()["bytes"] <= 20_000
    assert LocalTokenizer(model_folder, cache_bytes=0).encode_prompt("abc") == scratch_prompt(local, "abc")


@SETTINGS
@given(
    start=st.lists(st.sampled_from(PIECES), min_size=20, max_size=200).map("".join),
    steps=st.lists(STEP, max_size=12),
    contexts=st.lists(
        st.tuples(st.sampled_from([1, 4, 16]), st.sampled_from([None, "tenant"]), st.sampled_from([None, "adapter"])),
        min_size=1,
        max_size=3,
    ),
    key_bytes=st.sampled_from([0, 4_000, 1 << 20]),
)
def test_keys_continued_from_the_tokenizers_memos_equal_from_scratch(
    model_folder: Path,
    start: str,
    steps: list[tuple[str, str, int]],
    contexts: list[tuple[int, str | None, str | None]],
    key_bytes: int,
) -> None:
    """The tokenizers hand the key step the chains of the cached text a prompt extends (``KeyMemo``):
    completions (wrapped in the specials), raw chat renders and the built-in tokenizer, through growths,
    edits in the middle, truncations and repeats, in several contexts at once, always give the keys of a
    from-scratch hash."""
    local = LocalTokenizer(model_folder)
    sim = PluginTokenizer("python:kvroute.sim.tokenizer:BuiltinTokenizer")
    cache = KeyChainCache(key_bytes)
    text = start
    for step in [("repeat", "", 0), *steps]:
        text = apply(text, step)
        for tokens in (local.encode_prompt(text), local.encode_raw(text), sim.encode(text)):
            assert isinstance(tokens, TokenIds) and tokens.memo is not None
            for block, salt, lora in contexts:
                got = cache.keys(tokens, block, "m", lora_name=lora, cache_salt=salt)
                assert got == request_keys(list(tokens), block, "m", lora_name=lora, cache_salt=salt)
    again = local.encode_prompt(text)
    if key_bytes and (16, None, None) in contexts and len(again) >= 16:  # (0 turns the key cache off)
        assert isinstance(again, TokenIds) and again.memo is not None and again.memo.chains  # filled, answers


def test_a_growing_prompt_hashes_only_its_new_blocks_through_the_memo(model_folder: Path) -> None:
    """A prompt extending the previous one takes the previous one's chain from the tokenizer's memo: the
    key cache's own prefix index is not even probed (no entries), and only the new blocks are hashed."""
    sim = PluginTokenizer("python:kvroute.sim.tokenizer:BuiltinTokenizer")
    cache = KeyChainCache()
    text = " ".join(f"w{i}" for i in range(16 * 512))
    first = sim.encode(text)
    assert cache.keys(first, 16, "m") == request_keys(list(first), 16, "m")
    entries = cache.stats()["entries"]
    grown = sim.encode(text + " " + " ".join(f"n{i}" for i in range(40)))
    assert grown.base is first.memo and grown.shared == 16 * 512
    before = cache.stats()["blocks_hashed"]
    assert cache.keys(grown, 16, "m") == request_keys(list(grown), 16, "m")
    stats = cache.stats()
    assert stats["blocks_hashed"] - before == (16 * 512 + 40) // 16 - 512
    assert stats["entries"] == entries  # the memo served it: nothing new in the key cache's index
    again = sim.encode(text + " " + " ".join(f"n{i}" for i in range(40)))
    assert cache.keys(again, 16, "m") == request_keys(list(grown), 16, "m")
    assert cache.stats()["hits"] == stats["hits"] + 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(PIECES), min_size=0, max_size=400), st.integers(0, 2**64 - 1))
def test_prefix_marks_are_the_utf8_hashes_of_their_segments(pieces: list[str], seed: int) -> None:
    """An ASCII text is marked through one encoded view, any other text segment by segment: either way each
    mark is the xxh3 chain of the text's UTF-8 segments, so the same prefix marks alike in a str and bytes."""
    text = "".join(pieces)
    index: PrefixIndex[str, int] = PrefixIndex(1 << 20, unit=1, first=4, step=64)
    probe = index.probe(text, seed)
    h, prev, expected = seed, 0, []
    for pos in index.positions(len(text)):
        h = xxhash.xxh3_64_intdigest(text[prev:pos].encode("utf-8", "surrogatepass"), h)
        expected.append((pos, h))
        prev = pos
    assert probe.marks == expected
    if text.isascii():
        assert PrefixIndex(1 << 20, unit=1, first=4, step=64).probe(text.encode(), seed).marks == expected
    index.put(text, 1, 10, probe)
    longer = text + "x" * 70
    assert index.longest(longer, index.probe(longer, seed)) is not None or not index.probe(text, seed).marks
