"""Tokenizer objects named by import path, for engines whose tokenizer is not a ``tokenizer.json``."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvroute.indexer.keys import PrefixIndex, TokenIds, memo_budget
from kvroute.router.chat_prompt import ChatPrompt, TokenizeError, conversation
from kvroute.router.local_tokens import DEFAULT_CACHE_BYTES, counters
from kvroute.router.prompt_head import PromptHead, estimated_tokens, uncached_head_cut


class PluginTokenizer:
    """A tokenizer object named by import path (``python:package.module:Factory``) for engines whose
    tokenizer is not a ``tokenizer.json`` (a custom engine, the simulated workers). The factory builds an
    object with ``encode(text)`` and ``encode_chat(messages, add_generation_prompt=True)``, and optionally
    ``encode_ids(text)``, the same ids as an ``array("I")`` (what the cache keeps: no conversion).

    When the object also says how a text's ids follow from a prefix's (``extend(prefix, prefix_count,
    text) -> (keep, tail_ids) | None``: the first ``keep`` ids of the prefix's, then ``tail_ids``), its
    results are cached by text prefix (bounded in bytes); with ``render_chat(messages,
    add_generation_prompt)`` too, chat requests are rendered and take the same cache (``encode_chat`` must
    then be ``encode(render_chat(...))``). A text that does not extend a cached one whole (an edit in the
    middle, a truncation) is encoded from scratch. And with ``stable_count(prefix, prefix_count) -> int`` (how
    many of a prefix's ids every text extending it keeps), a long text the cache covers little of is handed
    out as its head first (:mod:`~kvroute.router.prompt_head`)."""

    PREFIX = "python:"

    def __init__(self, spec: str, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        import importlib

        target = spec[len(self.PREFIX) :]
        module_name, _, attr = target.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise TokenizeError(f"cannot load tokenizer {spec!r}: {exc}") from None
        try:
            self.impl = factory()
        except Exception as exc:  # a plugin's own failure is a tokenizer that did not load, not a router error
            raise TokenizeError(f"cannot load tokenizer {spec!r}: {type(exc).__name__}: {exc}") from None
        #: ``encode_ids`` when the object has it (ids as an ``array("I")``: kept without conversion).
        self._encode = getattr(self.impl, "encode_ids", None) or self.impl.encode
        self._extend = getattr(self.impl, "extend", None)
        self._render = getattr(self.impl, "render_chat", None) if self._extend is not None else None
        self._stable = getattr(self.impl, "stable_count", None) if self._extend is not None else None
        #: Cached ids are handed out as they are (callers treat token lists as read-only).
        self._cache: PrefixIndex[str, TokenIds] = PrefixIndex(
            cache_bytes if self._extend is not None else 0, unit=1, first=64, step=16384
        )
        self.counters = counters()

    def stats(self) -> dict[str, int]:
        """The prefix cache's counters and size (all zero for an object without ``extend``)."""
        cache = self._cache
        return {**self.counters, "entries": len(cache), "bytes": cache.bytes, "max_bytes": cache.max_bytes}

    def encode(self, text: str) -> Sequence[int]:
        """Ids of ``text``, from the longest cached text it extends when the object can say how."""
        cache = self._cache
        if cache.max_bytes <= 0 or self._extend is None:
            return TokenIds(self._encode(text))
        probe = cache.probe(text)
        hit = cache.get(text, probe)
        if hit is not None:
            self.counters["hits"] += 1
            self.counters["tokens_reused"] += len(hit)
            return hit
        found = cache.longest(text, probe)
        grown = None
        if found is not None and found[2] == len(found[0]):
            base_text, base, _, ident = found
            grown = self._extend(base_text, len(base), text)
        if grown is not None:
            keep, tail = grown
            ids = TokenIds.extended(base, keep, tail)
            self.counters["prefix_hits"] += 1
            self.counters["tokens_reused"] += keep
            self.counters["tokens_encoded"] += len(tail)
            cache.drop(ident)  # superseded: the new text extends it
        else:
            ids = TokenIds.cached(self._encode(text))
            self.counters["misses"] += 1
            self.counters["tokens_encoded"] += len(ids)
        nbytes = sys.getsizeof(text) + 80 + 4 * len(ids) + 2 * memo_budget(len(ids))  # its memo, the base's
        cache.put(text, ids, nbytes, probe)
        return ids

    async def prompt_tokens(self, prompt: str) -> Sequence[int]:
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string")
        return self.encode(prompt)

    async def prompt_head(self, prompt: str) -> PromptHead | Sequence[int]:
        """A completion prompt's head when the cache covers little of it, else its tokens."""
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string")
        return self._head_or_whole(prompt)

    async def chat_prompt_head(self, prompt: ChatPrompt) -> PromptHead | Sequence[int]:
        """:meth:`prompt_head` for a chat request rendered here (else its tokens, :meth:`chat_prompt_tokens`)."""
        if self._render is None:
            return await self.chat_prompt_tokens(prompt)
        messages = conversation(prompt.messages, "string")
        return self._head_or_whole(self._rendered(messages, prompt.add_generation_prompt))

    def _head_or_whole(self, text: str) -> PromptHead | Sequence[int]:
        stable = self._stable
        if stable is None or (cut := uncached_head_cut(self._cache, text)) is None:
            return self.encode(text)
        head = text[:cut]
        ids = self.encode(head)
        keep = stable(head, len(ids))
        self.counters["heads"] += 1
        return PromptHead(ids[:keep], estimated_tokens(len(text), keep, cut), lambda: self._whole(text))

    def _rendered(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        """The object's own render of a chat (only called when it has ``render_chat``)."""
        assert self._render is not None
        try:
            text: str = self._render(messages, add_generation_prompt)
        except (ValueError, TypeError) as exc:
            raise TokenizeError(f"chat template: {exc}") from None
        return text

    async def _whole(self, text: str) -> Sequence[int]:
        return self.encode(text)

    @property
    def merges_inline_system(self) -> bool | None:
        """The object says (``merges_inline_system``); else its engine keeps them in place."""
        return bool(getattr(self.impl, "merges_inline_system", False))

    async def chat_prompt_tokens(self, prompt: ChatPrompt) -> Sequence[int]:
        """The object sees the conversation vLLM would build (text parts of any kind as one string, no
        ``None`` content) and ``add_generation_prompt``: what such engines render."""
        messages = conversation(prompt.messages, "string")
        return await self.chat_tokens(messages, add_generation_prompt=prompt.add_generation_prompt)

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Sequence[int]:
        if self._render is not None:
            return self.encode(self._rendered(messages, add_generation_prompt))
        try:
            return list(self.impl.encode_chat(messages, add_generation_prompt=add_generation_prompt))
        except (ValueError, TypeError) as exc:
            raise TokenizeError(f"chat template: {exc}") from None
