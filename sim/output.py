"""Deterministic filler output: one built-in token per word, so generated text re-tokenizes identically."""

from __future__ import annotations

from kvroute.sim.tokenizer import piece_id

WORDS = (
    "the",
    "cache",
    "routes",
    "every",
    "token",
    "to",
    "its",
    "past",
    "and",
    "blocks",
    "stay",
    "warm",
    "while",
    "workers",
    "share",
    "prefixes",
    "across",
    "many",
    "turns",
    "of",
    "an",
    "agent",
    "loop",
    "so",
)


def output_word(seed: int, index: int) -> str:
    return WORDS[(seed + index * 7) % len(WORDS)]


def output_token_ids(seed: int, count: int) -> list[int]:
    return [piece_id(output_word(seed, i)) for i in range(count)]


def output_text(seed: int, start: int, count: int) -> str:
    """Text of output tokens ``start .. start+count`` (a leading space on all but the very first)."""
    words = [output_word(seed, i) for i in range(start, start + count)]
    text = " ".join(words)
    return text if start == 0 else " " + text
