"""A long new prompt's head: enough to decide where it goes before the rest of it is tokenized.

A prompt's KV is reused from its start only. When no worker holds (nor was just sent) every block of the
prompt's first ``HEAD_CHARS`` characters, none holds anything past them, and the decision taken on the
head's blocks is the one the whole prompt's would give. Tokenizing the rest before deciding only delays
the request: ~1.5 µs a token with a real model's tokenizer (25 ms for a new 16k-token document), and the
engine tokenizes the prompt again anyway. So a token source whose prefix cache covers little of a long
text hands out its head's tokens first (:class:`PromptHead`); the router looks them up and either decides
at once (the rest is encoded after the request went out, for the next turn's prefix cache) or, when a
worker holds the whole head, encodes the rest and decides on the whole prompt.

The head is cut just before a space that follows a non-space: no pre-tokenizer in use (GPT-2, Llama 3,
Qwen, o200k regexes, Metaspace, whitespace splitting) joins a non-space and the space after it into one
piece, so the head's pieces are the whole text's; a source keeps only the tokens no continuation can
change (the local tokenizer also drops those within a few characters of the cut). The router checks each
head against the whole prompt's tokens once they are in (``kvroute_prompt_heads_total{outcome="mismatch"}``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.indexer.keys import PrefixIndex

#: Characters of a head past the longest cached prefix (~500 tokens of a real model's tokenizer: 30 blocks of 16).
HEAD_CHARS = 2048
#: A text is decided on its head only with at least this many characters past its longest cached prefix
#: (~4k tokens, ~6 ms of encoding with a real tokenizer); shorter ones are encoded whole at once.
MIN_REST_CHARS = 16384


@dataclass(slots=True)
class PromptHead:
    """A prompt's first tokens, exact, and a way to the whole prompt's."""

    tokens: Sequence[int]
    #: The whole prompt's tokens, estimated from the head's characters per token (the cost model's size).
    estimated_total: int
    #: The whole prompt's tokens (reusing the head's from the prefix cache); fills the cache for later turns.
    rest: Callable[[], Awaitable[Sequence[int]]]


def head_cut(text: str, shared: int) -> int | None:
    """Where the head of ``text`` ends: just before a space that follows a non-space, at most ``HEAD_CHARS``
    past the ``shared`` characters a cached text holds; None when the text is too short past them to be
    worth it, or there is no such space in the head's second half."""
    if len(text) - shared < MIN_REST_CHARS:
        return None
    low, cut = shared + HEAD_CHARS // 2, shared + HEAD_CHARS
    while True:
        cut = text.rfind(" ", low, cut)
        if cut <= low:
            return None
        if not text[cut - 1].isspace():
            return cut


def uncached_head_cut(cache: PrefixIndex[str, Any], text: str) -> int | None:
    """:func:`head_cut` of ``text`` past the longest text a tokenizer's prefix ``cache`` holds; None when the
    cache is off, holds ``text`` itself, or holds all but a little of it (then the whole is encoded at once)."""
    if cache.max_bytes <= 0:
        return None
    probe = cache.probe(text)
    if cache.get(text, probe) is not None:
        return None
    found = cache.longest(text, probe)
    return head_cut(text, found[2] if found is not None else 0)


def estimated_tokens(total_chars: int, head_tokens: int, head_chars: int) -> int:
    """The whole text's tokens at the head's characters per token."""
    return max(head_tokens, round(total_chars * head_tokens / max(1, head_chars)))
