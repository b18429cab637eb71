"""A model folder's tokenizer giving exactly the tokens the engine will see, with a prefix cache.

A token mismatch silently destroys every cache hit, so the local path reproduces vLLM's own steps:
chat requests render the model's chat template (jinja2, sandboxed, HF's globals) and encode the text
without adding special tokens; completion prompts are encoded with them (the post-processor's BOS).

Growing prompts are not re-tokenized from scratch. Each result is cached (an LRU bounded in bytes:
text + ids + offsets) with its tokens' character offsets; a new text finds the cached one sharing the
longest prefix with it (:class:`~kvroute.indexer.keys.PrefixIndex`: a few xxh3 calls, then compared)
and reuses the cached tokens up to a cut inside the shared part, encoding only the rest. A cut is used
only where the split provably or checkably leaves the ids unchanged:

* at a *special token* the cached text holds inside the shared part: added special tokens are split
  off before any normalisation or pre-tokenization, so the tokens before it are a full encode's;
* elsewhere (completions without special tokens) at a token start at least ``GUARD_CHARS`` before the
  end of the shared part, preferably a space after a non-space (a piece boundary for every
  pre-tokenizer in use, whatever follows), and only if re-encoding from an earlier token start (an
  overlap of at least ``OVERLAP_TOKENS`` tokens and ``OVERLAP_CHARS`` characters) gives exactly the
  cached ids and offsets over the overlap and a token starting at the cut; otherwise the last special
  token before it, else a full encode.

Chat requests render the whole template every time (a template may treat any message by its position
or by the others: there is no sound per-message rendering without analysing it), then take the token
reuse above: the rendering of a conversation is the previous rendering plus more, up to the generation
prompt, and the generation prompt's ``<|im_start|>``-style special is where the cut falls. Edits in the
middle reuse at most the tokens before the edit; truncations re-encode from a cut before the end.

Results are :class:`~kvroute.indexer.keys.TokenIds` (``array("I")``: the bytes the key step hashes,
copied and spliced with ``memcpy``, invisible to the garbage collector).

Encoding a text is ~1.5 µs a token with a real model's tokenizer, and ``Tokenizer.encode`` holds the GIL
throughout: a new 32k-token prompt would stop the router's event loop (every stream it relays, every
other decision) for 50-110 ms. The async API (what the router calls) encodes texts of ``OFFLOOP_CHARS`` or
more in a worker thread with ``encode_batch``, which releases the GIL; the cache's logic is written once,
as steps that yield the texts to encode (:data:`Steps`), and run by a synchronous or an async driver.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import re
import sys
from array import array
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from kvroute.indexer.keys import KeyMemo, PrefixIndex, TokenIds, memo_budget
from kvroute.router.chat_prompt import ChatPrompt, TokenizeError, Unrenderable, prompt_of_fields
from kvroute.router.chat_template import ChatTemplate, load_chat_templates
from kvroute.router.prompt_head import PromptHead, estimated_tokens, uncached_head_cut


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


#: Default bound of a tokenizer's prefix cache (text + ids + offsets of every entry).
DEFAULT_CACHE_BYTES = 64 << 20

T = TypeVar("T")
#: An encoded text: its ids and each one's starting character.
Encoded = tuple[list[int], list[int]]
#: The cache's work for one request, as a generator: it yields each text to encode (no special tokens) and
#: is sent back its :data:`Encoded`; it returns the result. One logic, two drivers: everything on the
#: calling thread (:meth:`LocalTokenizer._run`), or long encodes off the event loop (``_run_async``).
Steps = Generator[str, Encoded, T]


class _Entry:
    """One cached text's tokens: ids and their character starts (``array("I")`` both), and the two forms
    handed out, each built once when first asked for: the ids as they are (``raw``) and wrapped in the
    post-processor's specials (``wrapped``), :class:`TokenIds` carrying their key memos. Callers treat
    token lists as read-only.

    ``bases``: when built from another entry, that entry's two key memos and how many ids they share."""

    __slots__ = ("bases", "ids", "raw", "starts", "wrapped")

    def __init__(self, ids: array[int], starts: array[int], bases: tuple[KeyMemo | None, KeyMemo | None, int]) -> None:
        self.ids = ids
        self.starts = starts
        self.bases = bases
        self.raw: TokenIds | None = None
        self.wrapped: TokenIds | None = None

    def memos(self) -> tuple[KeyMemo | None, KeyMemo | None]:
        """The key memos of the forms handed out so far (an entry built from this one continues them)."""
        return (self.raw.memo if self.raw else None, self.wrapped.memo if self.wrapped else None)

    def nbytes(self, text: str) -> int:
        """Memory held, counted high: the ids and starts, the two handed-out arrays, this entry's two key
        memos and the two of the entry it extended."""
        n = len(self.ids)
        memos = 4 * memo_budget(n)
        return sys.getsizeof(text) + 4 * (80 + 4 * n) + 80 + memos


NO_BASE: tuple[KeyMemo | None, KeyMemo | None, int] = (None, None, 0)
#: Cores a long encode's pieces can spread over (``encode_batch`` runs them in parallel).
CORES = os.cpu_count() or 1


def _split_points(added: Mapping[int, Any]) -> tuple[re.Pattern[str], frozenset[str]] | None:
    """A pattern matching the tokenizer's raw added tokens as it matches them (leftmost, longest first),
    and those a text may be cut before: special, not normalised, no ``lstrip``/``rstrip``/``single_word``.
    None when there are none (texts are encoded whole)."""
    raw = {t.content for t in added.values() if t.content and not t.normalized}
    safe = frozenset(
        t.content
        for t in added.values()
        if t.content and t.special and not (t.normalized or t.lstrip or t.rstrip or t.single_word)
    )
    if not safe:
        return None
    return re.compile("|".join(re.escape(c) for c in sorted(raw, key=len, reverse=True))), safe


def counters() -> dict[str, int]:
    return {
        "hits": 0,
        "prefix_hits": 0,
        "misses": 0,
        "fallbacks": 0,
        "tokens_reused": 0,
        "tokens_encoded": 0,
        "heads": 0,
    }


def _model_type(folder: Path) -> str | None:
    """``config.json``'s ``model_type`` when the folder holds one (the model decides how chat renders)."""
    try:
        value = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class LocalTokenizer:
    """``tokenizers`` + chat template from a model folder (or a tokenizer.json path), with a prefix cache
    of at most ``cache_bytes`` (0: every text is encoded from scratch)."""

    #: A cut is at least this many characters before the end of the shared part (the pre-tokenizer's
    #: lookahead and greedy pieces near the end may change once the text goes on differently).
    GUARD_CHARS = 16
    #: Re-encoded before a cut and required to agree with the cached ids and offsets.
    OVERLAP_TOKENS = 8
    OVERLAP_CHARS = 32
    #: A text to encode at least this long (~1k tokens, ~1.5 ms) is encoded in a worker thread by the async API.
    OFFLOOP_CHARS = 4096

    def __init__(
        self, path: str | Path, chat_template: str | Path | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = folder / "tokenizer.json" if path.is_dir() else path
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:
            raise TokenizeError(f"cannot load tokenizer {file}: {exc}") from None
        # vLLM encodes whole prompts: a truncation or padding saved in tokenizer.json is not applied.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        config: dict[str, Any] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizeError(f"cannot read {config_file}: {exc}") from None
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        special.update({n: _token_text(config[n]) for n in ("sep_token", "cls_token", "mask_token") if config.get(n)})
        source, tool_use = load_chat_templates(folder, chat_template, config)
        self.template = ChatTemplate(source, special, tool_use) if source else None
        #: gpt-oss models render chat as Harmony messages, not through the template.
        self.harmony = _model_type(folder) == "gpt_oss"
        added = self.tokenizer.get_added_tokens_decoder()
        specials = [t.content for t in added.values() if t.special and t.content]
        self._special_ids = frozenset(i for i, t in added.items() if t.special and t.content)
        in_template = [s for s in specials if self.template and s in self.template.source]
        #: Boundaries used for prefix reuse: special tokens the template emits (else a few of them).
        self.boundaries = in_template or specials[:32]
        self._cache: PrefixIndex[str, _Entry] = PrefixIndex(cache_bytes, unit=1, first=64, step=16384)
        self._splits = _split_points(added)
        self._pre, self._post = self._special_wrap()
        self.counters = {**counters(), "encoded_off_loop": 0}

    @property
    def cache_bytes(self) -> int:
        return self._cache.max_bytes

    def stats(self) -> dict[str, int]:
        """Counters of the prefix cache (hits, prefix hits, misses, failed overlap checks, tokens reused
        and encoded) and its size, for export."""
        return {**self.counters, "entries": len(self._cache), "bytes": self._cache.bytes, "max_bytes": self.cache_bytes}

    def _special_wrap(self) -> tuple[list[int] | None, list[int] | None]:
        """The ids the post-processor adds around a prompt, when it adds the same ones around any text."""
        wraps: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for sample in ("a", "hello world"):
            full = self.tokenizer.encode(sample, add_special_tokens=True).ids
            raw = self.tokenizer.encode(sample, add_special_tokens=False).ids
            for i in range(len(full) - len(raw) + 1):
                if full[i : i + len(raw)] == raw:
                    wraps.add((tuple(full[:i]), tuple(full[i + len(raw) :])))
                    break
            else:
                return None, None
        if len(wraps) != 1:
            return None, None
        pre, post = wraps.pop()
        return list(pre), list(post)

    # -- running the steps: every encode here, or the long ones off the event loop -----------------------

    def _run(self, steps: Steps[T]) -> T:
        """``steps`` with every encode on this thread (the synchronous API)."""
        try:
            text = next(steps)
            while True:
                text = steps.send(self._encode(text))
        except StopIteration as done:
            return cast(T, done.value)

    async def _run_async(self, steps: Steps[T]) -> T:
        """``steps`` with each text of ``OFFLOOP_CHARS`` or more encoded in a worker thread, where the
        tokenizer runs without the GIL: the event loop relays other streams and routes other requests
        meanwhile (``encode`` holds the GIL for its whole run: ~1.5 µs a token, 50 ms for a new 32k-token
        prompt). Shorter ones are encoded here (a thread hop costs more than they do)."""
        try:
            text = next(steps)
            while True:
                if len(text) >= self.OFFLOOP_CHARS:
                    self.counters["encoded_off_loop"] += 1
                    encoded = await asyncio.to_thread(self._encode_released, text)
                else:
                    encoded = self._encode(text)
                text = steps.send(encoded)
        except StopIteration as done:
            return cast(T, done.value)

    def _encode(self, text: str) -> Encoded:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return enc.ids, [o[0] for o in enc.offsets]

    def _encode_released(self, text: str) -> Encoded:
        """:meth:`_encode` for a worker thread: ``encode_batch`` releases the GIL (``encode`` does not) and
        encodes the pieces of ``text`` between special tokens (a chat's messages) on every core."""
        pieces = self._pieces(text)
        encodings = self.tokenizer.encode_batch(pieces, add_special_tokens=False)
        ids: list[int] = []
        starts: list[int] = []
        at = 0
        for piece, enc in zip(pieces, encodings, strict=True):
            ids += enc.ids
            starts += [at + o[0] for o in enc.offsets]
            at += len(piece)
        return ids, starts

    def _pieces(self, text: str) -> list[str]:
        """``text`` cut just before special tokens into pieces of at least ``OFFLOOP_CHARS`` characters and
        half a core's share (two pieces a core at most). Encoded apart, they give the whole text's ids: added
        tokens are split off before normalisation and pre-tokenization, and a cut is only made before one
        that takes no space around it nor matches after normalisation (:func:`_split_points`)."""
        if self._splits is None:
            return [text]
        pattern, safe = self._splits
        size = max(self.OFFLOOP_CHARS, len(text) // (2 * CORES))
        pieces = []
        start = 0
        for match in pattern.finditer(text):
            cut = match.start()
            if cut - start >= size and match.group() in safe:
                pieces.append(text[start:cut])
                start = cut
        pieces.append(text[start:])
        return pieces

    # -- the steps: what to encode is yielded, its (ids, starts) sent back ---------------------------------

    def _raw(self, text: str) -> Steps[Sequence[int]]:
        """Tokens of ``text`` without added special tokens, reusing a cached prefix when possible."""
        entry = yield from self._entry(text)
        if entry.raw is None:
            raw_base, _, shared = entry.bases
            entry.raw = TokenIds.cached(entry.ids)
            entry.raw.base, entry.raw.shared = raw_base, shared
        return entry.raw

    def _entry(self, text: str) -> Steps[_Entry]:
        """The cache's entry for ``text``: found, extended from a cached prefix, or encoded whole. Between a
        yield and its answer other requests may use the cache (the async driver awaits there): nothing read
        before a yield is assumed unchanged after it but the entries held (dropping one twice is harmless)."""
        cache = self._cache
        if cache.max_bytes <= 0:
            return (yield from self._full(text))
        probe = cache.probe(text)
        entry = cache.get(text, probe)
        if entry is not None:
            self.counters["hits"] += 1
            self.counters["tokens_reused"] += len(entry.ids)
            return entry
        found = cache.longest(text, probe)
        entry = (yield from self._extend(text, *found[:3])) if found is not None else None
        if entry is None:
            entry = yield from self._full(text)
        elif found is not None and found[2] == len(found[0]):
            cache.drop(found[3])  # superseded: the new text extends it
        cache.put(text, entry, entry.nbytes(text), probe)
        return entry

    def _encoded(self, text: str) -> Steps[Encoded]:
        """Asks the driver to encode ``text`` (without special tokens) and counts the tokens."""
        ids, starts = yield text
        self.counters["tokens_encoded"] += len(ids)
        return ids, starts

    def _full(self, text: str) -> Steps[_Entry]:
        self.counters["misses"] += 1
        ids, starts = yield from self._encoded(text)
        return _Entry(array("I", ids), array("I", starts), NO_BASE)

    def _special_cut(self, base_text: str, base: _Entry, shared: int, start: int = 0) -> int | None:
        """Index of the last special token the cached text holds wholly inside ``[start, shared)``."""
        cut = max((base_text.rfind(s, start, shared) for s in self.boundaries), default=-1)
        if cut <= 0:
            return None
        i = bisect.bisect_left(base.starts, cut)
        if i < len(base.starts) and base.starts[i] == cut and base.ids[i] in self._special_ids:
            return i
        return None

    def _overlap_cut(self, base_text: str, base: _Entry, shared: int) -> tuple[int, int] | None:
        """``(j, i)``: the cut at token ``i``, starting at least GUARD_CHARS before the end of the shared
        part, and the overlap to re-encode from token ``j``; None when that would be the text's start.

        The cut prefers a token starting with a space after a non-space: no pre-tokenizer in use (GPT-2,
        Llama 3, Qwen, o200k regexes; Metaspace; whitespace splitting) puts a non-space and the space
        after it into one piece, so the pieces before such a cut are closed whatever follows."""
        starts = base.starts
        last = bisect.bisect_right(starts, shared - self.GUARD_CHARS) - 1
        if last <= 0:
            return None
        i = last
        for k in range(last, max(0, last - 64), -1):
            c = starts[k]
            if base_text[c] == " " and not base_text[c - 1].isspace() and starts[k - 1] < c:
                i = k
                break
        else:
            i = bisect.bisect_left(starts, starts[last])  # the first of the tokens of one character
        j = min(i - self.OVERLAP_TOKENS, bisect.bisect_right(starts, starts[i] - self.OVERLAP_CHARS) - 1)
        if j <= 0:
            return None
        return bisect.bisect_left(starts, starts[j]), i

    def _extend(self, text: str, base_text: str, base: _Entry, shared: int) -> Steps[_Entry | None]:
        """The tokens of ``text`` from a cached entry whose first ``shared`` characters it shares."""
        starts = base.starts
        overlap = self._overlap_cut(base_text, base, shared)
        # A special token after the overlap's start is the better cut (nothing to check); before it, it
        # is only the fallback when the overlap check fails.
        special = self._special_cut(base_text, base, shared, starts[overlap[0]] if overlap else 0)
        if overlap is not None and special is None:
            j, i = overlap
            c0 = starts[j]
            ids, tail_starts = yield from self._encoded(text[c0:])
            n = i - j
            if (
                len(ids) > n
                and tail_starts[n] == starts[i] - c0
                and ids[:n] == base.ids[j:i].tolist()
                and all(tail_starts[k] == starts[j + k] - c0 for k in range(n))
            ):
                return self._splice(base, i, ids[n:], tail_starts[n:], c0)
            self.counters["fallbacks"] += 1
            special = self._special_cut(base_text, base, shared)
        if special is None:
            return None
        cut = starts[special]
        ids, tail_starts = yield from self._encoded(text[cut:])
        return self._splice(base, special, ids, tail_starts, cut)

    def _head(self, text: str) -> Steps[tuple[array[int], int] | None]:
        """The ids of ``text``'s head that no continuation changes and the characters they cover
        (:mod:`~kvroute.router.prompt_head`); None when the cache holds all but a little of the text."""
        cut = uncached_head_cut(self._cache, text)
        if cut is None:
            return None
        entry = yield from self._entry(text[:cut])
        keep = bisect.bisect_left(entry.starts, cut - self.GUARD_CHARS)
        return entry.ids[:keep], entry.starts[keep] if keep < len(entry.starts) else cut

    def _splice(self, base: _Entry, keep: int, ids: list[int], starts: list[int], offset: int) -> _Entry:
        """The first ``keep`` of ``base``'s ids, then ``ids``."""
        self.counters["prefix_hits"] += 1
        self.counters["tokens_reused"] += keep
        out = base.ids[:keep]
        out.extend(ids)
        out_starts = base.starts[:keep]
        out_starts.extend(s + offset for s in starts)
        return _Entry(out, out_starts, (*base.memos(), keep))

    # -- the API: each request kind's steps, run here (sync) or with long encodes off the loop (async) -------

    def encode_raw(self, text: str) -> Sequence[int]:
        """Tokens of ``text`` without added special tokens, reusing a cached prefix when possible."""
        return self._run(self._raw(text))

    def encode_prompt(self, prompt: str) -> Sequence[int]:
        """A completion prompt as vLLM encodes it (with the post-processor's special tokens)."""
        return self._run(self._prompt(prompt))

    def _prompt(self, prompt: str) -> Steps[Sequence[int]]:
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string")
        if self._pre is None or self._post is None:  # a post-processor that depends on the text: no cache
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        if not self._pre and not self._post:
            return (yield from self._raw(prompt))
        entry = yield from self._entry(prompt)
        if entry.wrapped is None:
            pre = self._pre
            wrapped = TokenIds(pre)
            wrapped.extend(entry.ids)  # memcpy: an array of the same type
            wrapped.extend(self._post)
            wrapped.memo = KeyMemo(memo_budget(len(wrapped)))
            _, wrapped_base, shared = entry.bases
            if wrapped_base is not None:  # the entry it extends, wrapped alike: the same tokens ahead
                wrapped.base, wrapped.shared = wrapped_base, len(pre) + shared
            entry.wrapped = wrapped
        return entry.wrapped

    @property
    def merges_inline_system(self) -> bool | None:
        return self.template.merges_inline_system if self.template is not None else None

    def encode_chat_prompt(self, prompt: ChatPrompt) -> Sequence[int]:
        """A chat request's tokens: rendered as vLLM renders it, encoded without special tokens (unless
        the request asks for them, ``add_special_tokens``)."""
        return self._run(self._chat(prompt))

    def _chat_text(self, prompt: ChatPrompt) -> str:
        if self.template is None:
            raise TokenizeError("this model folder has no chat template")
        if self.harmony:
            raise Unrenderable("harmony", "gpt-oss models render chat as Harmony messages")
        return self.template.render_prompt(prompt)

    def _chat(self, prompt: ChatPrompt, text: str | None = None) -> Steps[Sequence[int]]:
        """A chat request's tokens (``text``: its rendering, when already made)."""
        text = self._chat_text(prompt) if text is None else text
        if not prompt.add_special_tokens:
            return (yield from self._raw(text))
        if self._pre is None or self._post is None:
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        out = TokenIds(self._pre)
        out.extend((yield from self._raw(text)))
        out.extend(self._post)
        return out

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Sequence[int]:
        """A chat request with these fields (``tools`` as a client sends them)."""
        return self.encode_chat_prompt(prompt_of_fields(messages, add_generation_prompt, tools, chat_template_kwargs))

    async def prompt_tokens(self, prompt: str) -> Sequence[int]:
        return await self._run_async(self._prompt(prompt))

    async def chat_prompt_tokens(self, prompt: ChatPrompt) -> Sequence[int]:
        return await self._run_async(self._chat(prompt))

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Sequence[int]:
        return await self._run_async(
            self._chat(prompt_of_fields(messages, add_generation_prompt, tools, chat_template_kwargs))
        )

    # -- heads: a long new prompt's first tokens, to decide on before the rest is encoded -------------------

    async def prompt_head(self, prompt: str) -> PromptHead | Sequence[int]:
        """A completion prompt's :class:`~kvroute.router.prompt_head.PromptHead` when the cache covers little
        of it, else its tokens (:meth:`prompt_tokens`)."""
        if isinstance(prompt, str) and self._pre is not None and self._post is not None:
            head = await self._head_of(prompt, self._pre, len(self._pre) + len(self._post), self._prompt(prompt))
            if head is not None:
                return head
        return await self.prompt_tokens(prompt)

    async def chat_prompt_head(self, prompt: ChatPrompt) -> PromptHead | Sequence[int]:
        """:meth:`prompt_head` for a chat request (:meth:`chat_prompt_tokens`)."""
        text = self._chat_text(prompt)
        wraps = prompt.add_special_tokens
        if not wraps or (self._pre is not None and self._post is not None):
            pre = (self._pre or []) if wraps else []
            added = len(pre) + len(self._post or []) if wraps else 0
            head = await self._head_of(text, pre, added, self._chat(prompt, text))
            if head is not None:
                return head
        return await self._run_async(self._chat(prompt, text))

    async def _head_of(self, text: str, pre: list[int], added: int, whole: Steps[Sequence[int]]) -> PromptHead | None:
        """The head of ``text`` (encoded as ``pre`` + its ids + ``added - len(pre)`` more), its rest ``whole``."""
        got = await self._run_async(self._head(text))
        if got is None:
            whole.close()
            return None
        ids, covered = got
        tokens = TokenIds(pre)
        tokens.extend(ids)
        self.counters["heads"] += 1
        total = estimated_tokens(len(text), len(ids), covered) + added
        return PromptHead(tokens, total, lambda: self._run_async(whole))
