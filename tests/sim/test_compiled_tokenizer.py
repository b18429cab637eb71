"""The compiled built-in tokenizer (``sim/_pieces.pyx``) gives exactly the Python reference's ids.

Random texts over ASCII, accented and CJK letters, emoji and every kind of whitespace ``str.split``
knows (Unicode's included, 0x1C-0x1F and U+0085 among them); cuts where ``str.split`` cuts; and the
dev install must have built it (the wheel build compiles it, so a fresh machine gets it too).
"""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.sim import tokenizer

SPACES = [chr(c) for c in range(tokenizer.WIDEST_SPACE + 1) if chr(c).isspace()]
LETTERS = ["a", "Z", "0", "é", "ß", "日", "本", "\U0001f600", "\u00ad", "-", "\x00", "\x7f", "\u200b"]


def test_the_installed_package_uses_the_compiled_tokenizer() -> None:
    assert tokenizer.TOKENIZER == "compiled"


def test_no_whitespace_above_the_table() -> None:
    above = [c for c in range(tokenizer.WIDEST_SPACE + 1, sys.maxunicode + 1) if chr(c).isspace()]
    assert above == []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(SPACES + LETTERS), max_size=60).map("".join))
def test_compiled_ids_equal_the_reference(text: str) -> None:
    got = tokenizer.token_array(text)
    assert got.typecode == "I"
    assert got.tolist() == tokenizer.piece_ids_python(text).tolist()
    assert got.tolist() == [tokenizer.piece_id(p) for p in text.split()]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80).filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)))
def test_any_text_cuts_where_split_cuts(text: str) -> None:
    assert tokenizer.tokenize(text) == [tokenizer.piece_id(p) for p in text.split()]


def test_ids_stay_in_the_vocabulary() -> None:
    ids = tokenizer.tokenize(" ".join(f"w{i}" for i in range(20_000)))
    assert len(ids) == 20_000
    assert min(ids) >= tokenizer.RESERVED_IDS and max(ids) < tokenizer.VOCAB_SIZE
    assert len(set(ids)) > 18_000  # spread over the vocabulary, not bunched
