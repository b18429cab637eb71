"""Exactly the tokens the engine will see, per model: a local tokenizer or the worker's ``POST /tokenize``.

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

Results are :class:`~kvroute.indexer.keys.TokenIds` carrying their packed bytes, so the key step does
not repack them. The remote path caches exact request bodies only (the server renders templates itself);
a plugin tokenizer that says how its text extends (``extend``, like the simulated workers' built-in
one) gets the same prefix cache.
"""

from __future__ import annotations

import bisect
import json
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson
from kvroute.indexer.keys import PrefixIndex, TokenIds, pack_tokens


class TokenizeError(RuntimeError):
    """Tokens could not be obtained (bad input, missing files, worker error); the message says which."""


class TokenSource(Protocol):
    async def prompt_tokens(self, prompt: str) -> list[int]: ...

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...


# -- chat template -------------------------------------------------------------------------------------


def _raise(message: str) -> None:
    raise TokenizeError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    """A chat template rendered the way transformers / vLLM render it (sandboxed jinja2)."""

    def __init__(self, source: str, special: Mapping[str, str] | None = None) -> None:
        try:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:  # pragma: no cover - jinja2 is installed with the router
            raise TokenizeError("local chat templates need jinja2 (pip install jinja2)") from exc
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except Exception as exc:
            raise TokenizeError(f"chat template does not compile: {exc}") from None
        self.source = source
        self.special = dict(special or {})

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
            raise TokenizeError("messages must be a list of objects")
        if any(not isinstance(m, Mapping) for m in messages):
            raise TokenizeError("every message must be an object")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self.special,
                **kwargs,
            )
        except TokenizeError:
            raise
        except Exception as exc:
            raise TokenizeError(f"chat template failed: {exc}") from None


def load_chat_template(folder: Path, explicit: str | Path | None, config: Mapping[str, Any]) -> str | None:
    """The template source: an explicit file, else tokenizer_config.json's, else chat_template.jinja."""
    if explicit:
        try:
            return Path(explicit).read_text()
        except OSError as exc:
            raise TokenizeError(f"cannot read chat template {explicit}: {exc.strerror}") from None
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: take "default"
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(value, str):
        return value
    jinja = folder / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


# -- local tokenizer with a prefix cache ----------------------------------------------------------------


#: Default bound of a tokenizer's prefix cache (text + ids + offsets of every entry).
DEFAULT_CACHE_BYTES = 64 << 20


class _Entry:
    """One cached text's tokens: ids, their character starts and their packed bytes."""

    __slots__ = ("ids", "packed", "starts")

    def __init__(self, ids: list[int], starts: array[int], packed: bytes) -> None:
        self.ids = ids
        self.starts = starts
        self.packed = packed

    def nbytes(self, text: str) -> int:
        """Memory held, counted high: every id as its own int object (spliced lists share them)."""
        n = len(self.ids)
        return sys.getsizeof(text) + (56 + 40 * n) + (64 + 4 * n) + (33 + len(self.packed)) + 80


def _counters() -> dict[str, int]:
    return {"hits": 0, "prefix_hits": 0, "misses": 0, "fallbacks": 0, "tokens_reused": 0, "tokens_encoded": 0}


class LocalTokenizer:
    """``tokenizers`` + chat template from a model folder (or a tokenizer.json path), with a prefix cache
    of at most ``cache_bytes`` (0: every text is encoded from scratch)."""

    #: A cut is at least this many characters before the end of the shared part (the pre-tokenizer's
    #: lookahead and greedy pieces near the end may change once the text goes on differently).
    GUARD_CHARS = 16
    #: Re-encoded before a cut and required to agree with the cached ids and offsets.
    OVERLAP_TOKENS = 8
    OVERLAP_CHARS = 32

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
        source = load_chat_template(folder, chat_template, config)
        self.template = ChatTemplate(source, special) if source else None
        added = self.tokenizer.get_added_tokens_decoder()
        specials = [t.content for t in added.values() if t.special and t.content]
        self._special_ids = frozenset(i for i, t in added.items() if t.special and t.content)
        in_template = [s for s in specials if self.template and s in self.template.source]
        #: Boundaries used for prefix reuse: special tokens the template emits (else a few of them).
        self.boundaries = in_template or specials[:32]
        self._cache: PrefixIndex[str, _Entry] = PrefixIndex(cache_bytes, unit=1, first=64, step=16384)
        self._pre, self._post = self._special_wrap()
        self._pre_packed = pack_tokens(self._pre or [])
        self._post_packed = pack_tokens(self._post or [])
        self.counters = _counters()

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

    def encode_raw(self, text: str) -> list[int]:
        """Tokens of ``text`` without added special tokens, reusing a cached prefix when possible."""
        entry = self._entry(text)
        return TokenIds(entry.ids, entry.packed)

    def _entry(self, text: str) -> _Entry:
        cache = self._cache
        if cache.max_bytes <= 0:
            return self._full(text)
        probe = cache.probe(text)
        entry = cache.get(text, probe)
        if entry is not None:
            self.counters["hits"] += 1
            self.counters["tokens_reused"] += len(entry.ids)
            return entry
        found = cache.longest(text, probe)
        entry = self._extend(text, *found[:3]) if found is not None else None
        if entry is None:
            entry = self._full(text)
        elif found is not None and found[2] == len(found[0]):
            cache.drop(found[3])  # superseded: the new text extends it
        cache.put(text, entry, entry.nbytes(text), probe)
        return entry

    def _encode(self, text: str) -> tuple[list[int], list[int]]:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        self.counters["tokens_encoded"] += len(enc.ids)
        return enc.ids, [o[0] for o in enc.offsets]

    def _full(self, text: str) -> _Entry:
        self.counters["misses"] += 1
        ids, starts = self._encode(text)
        return _Entry(ids, array("I", starts), pack_tokens(ids))

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

    def _extend(self, text: str, base_text: str, base: _Entry, shared: int) -> _Entry | None:
        """The tokens of ``text`` from a cached entry whose first ``shared`` characters it shares."""
        starts = base.starts
        overlap = self._overlap_cut(base_text, base, shared)
        # A special token after the overlap's start is the better cut (nothing to check); before it, it
        # is only the fallback when the overlap check fails.
        special = self._special_cut(base_text, base, shared, starts[overlap[0]] if overlap else 0)
        if overlap is not None and special is None:
            j, i = overlap
            c0 = starts[j]
            ids, tail_starts = self._encode(text[c0:])
            n = i - j
            if (
                len(ids) > n
                and tail_starts[n] == starts[i] - c0
                and ids[:n] == base.ids[j:i]
                and all(tail_starts[k] == starts[j + k] - c0 for k in range(n))
            ):
                return self._splice(base, i, ids[n:], tail_starts[n:], c0)
            self.counters["fallbacks"] += 1
            special = self._special_cut(base_text, base, shared)
        if special is None:
            return None
        cut = starts[special]
        ids, tail_starts = self._encode(text[cut:])
        return self._splice(base, special, ids, tail_starts, cut)

    def _splice(self, base: _Entry, keep: int, ids: list[int], starts: list[int], offset: int) -> _Entry:
        self.counters["prefix_hits"] += 1
        self.counters["tokens_reused"] += keep
        out = base.ids[:keep]
        out += ids
        out_starts = base.starts[:keep]
        out_starts.extend(s + offset for s in starts)
        return _Entry(out, out_starts, base.packed[: 4 * keep] + pack_tokens(ids))

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completion prompt as vLLM encodes it (with the post-processor's special tokens)."""
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string")
        if self._pre is None or self._post is None:
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        entry = self._entry(prompt)
        if not self._pre and not self._post:
            return TokenIds(entry.ids, entry.packed)
        out = TokenIds(self._pre, self._pre_packed + entry.packed + self._post_packed)
        out += entry.ids
        out += self._post
        return out

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if self.template is None:
            raise TokenizeError("this model folder has no chat template")
        text = self.template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **dict(chat_template_kwargs or {})
        )
        return self.encode_raw(text)

    async def prompt_tokens(self, prompt: str) -> list[int]:
        return self.encode_prompt(prompt)

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )


# -- remote tokenizer -----------------------------------------------------------------------------------


class RemoteTokenizer:
    """The workers' ``POST /tokenize`` (vLLM accepts ``prompt`` or ``messages``), results cached exactly.

    Spread over the healthy workers serving the model (``urls()``, asked per call) in turn, so no one worker
    carries it; a worker that fails or is slow is skipped at once for the next one, and the call fails only
    when every one of them failed (then the request is routed without the index)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: Callable[[], Sequence[str]],
        model: str,
        cache_entries: int = 256,
        timeout_s: float = 2.0,
    ) -> None:
        self.client = client
        self.urls = urls
        self.model = model
        self.timeout_s = timeout_s
        self.cache_entries = cache_entries
        self._cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self._turn = 0

    async def _tokenize(self, payload: dict[str, Any]) -> list[int]:
        key = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return list(cached)
        urls = list(self.urls())
        if not urls:
            raise TokenizeError(f"no healthy worker serving {self.model!r} to tokenize with")
        self._turn += 1
        problems = []
        for i in range(len(urls)):
            url = urls[(self._turn + i) % len(urls)].rstrip("/") + "/tokenize"
            try:
                tokens = await self._ask(url, key)
            except TokenizeError as exc:
                problems.append(str(exc))
                continue
            self._cache[key] = tokens
            if len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
            return list(tokens)
        raise TokenizeError("; ".join(problems))

    async def _ask(self, url: str, payload: bytes) -> list[int]:
        try:
            resp = await self.client.post(
                url, content=payload, timeout=self.timeout_s, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            raise TokenizeError(f"tokenize at {url} failed: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise TokenizeError(f"tokenize at {url} answered {resp.status_code}: {resp.text[:200]}")
        try:
            tokens = resp.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            raise TokenizeError(f"tokenize at {url} answered without a token list") from None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise TokenizeError(f"tokenize at {url} answered a malformed token list")
        return tokens

    async def prompt_tokens(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string")
        return await self._tokenize({"model": self.model, "prompt": prompt})

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            payload["tools"] = list(tools)
        if chat_template_kwargs:
            payload["chat_template_kwargs"] = dict(chat_template_kwargs)
        return await self._tokenize(payload)


# -- per model -------------------------------------------------------------------------------------------


class PluginTokenizer:
    """A tokenizer object named by import path (``python:package.module:Factory``) for engines whose
    tokenizer is not a ``tokenizer.json`` (a custom engine, the simulated workers). The factory builds an
    object with ``encode(text)`` and ``encode_chat(messages, add_generation_prompt=True)``.

    When the object also says how a text's ids follow from a prefix's (``extend(prefix, prefix_count,
    text) -> (keep, tail_ids) | None``: the first ``keep`` ids of the prefix's, then ``tail_ids``), its
    results are cached by text prefix (bounded in bytes); with ``render_chat(messages,
    add_generation_prompt)`` too, chat requests are rendered and take the same cache (``encode_chat`` must
    then be ``encode(render_chat(...))``). A text that does not extend a cached one whole (an edit in the
    middle, a truncation) is encoded from scratch."""

    PREFIX = "python:"

    def __init__(self, spec: str, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        import importlib

        target = spec[len(self.PREFIX) :]
        module_name, _, attr = target.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise TokenizeError(f"cannot load tokenizer {spec!r}: {exc}") from None
        self.impl = factory()
        self._extend = getattr(self.impl, "extend", None)
        self._render = getattr(self.impl, "render_chat", None) if self._extend is not None else None
        self._cache: PrefixIndex[str, tuple[list[int], bytes]] = PrefixIndex(
            cache_bytes if self._extend is not None else 0, unit=1, first=64, step=16384
        )
        self.counters = _counters()

    def stats(self) -> dict[str, int]:
        """The prefix cache's counters and size (all zero for an object without ``extend``)."""
        cache = self._cache
        return {**self.counters, "entries": len(cache), "bytes": cache.bytes, "max_bytes": cache.max_bytes}

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, from the longest cached text it extends when the object can say how."""
        cache = self._cache
        if cache.max_bytes <= 0 or self._extend is None:
            return list(self.impl.encode(text))
        probe = cache.probe(text)
        hit = cache.get(text, probe)
        if hit is not None:
            self.counters["hits"] += 1
            self.counters["tokens_reused"] += len(hit[0])
            return TokenIds(hit[0], hit[1])
        found = cache.longest(text, probe)
        grown = None
        if found is not None and found[2] == len(found[0]):
            base_text, (base_ids, base_packed), _, ident = found
            grown = self._extend(base_text, len(base_ids), text)
        if grown is not None:
            keep, tail = grown
            ids = base_ids[:keep]
            ids += tail
            packed = base_packed[: 4 * keep] + pack_tokens(tail)
            self.counters["prefix_hits"] += 1
            self.counters["tokens_reused"] += keep
            self.counters["tokens_encoded"] += len(tail)
            cache.drop(ident)  # superseded: the new text extends it
        else:
            ids = list(self.impl.encode(text))
            packed = pack_tokens(ids)
            self.counters["misses"] += 1
            self.counters["tokens_encoded"] += len(ids)
        cache.put(text, (ids, packed), sys.getsizeof(text) + 56 + 40 * len(ids) + 33 + len(packed), probe)
        return TokenIds(ids, packed)

    async def prompt_tokens(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string")
        return self.encode(prompt)

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if self._render is not None:
            try:
                text = self._render(messages, add_generation_prompt)
            except ValueError as exc:
                raise TokenizeError(f"chat template: {exc}") from None
            return self.encode(text)
        return list(self.impl.encode_chat(messages, add_generation_prompt=add_generation_prompt))


class Tokenizers:
    """Token sources per model: local where a tokenizer folder is configured, else remote ``/tokenize``."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        worker_urls_for: Callable[[str], Sequence[str]],
        local: Mapping[str, tuple[str, str | None]] | None = None,
    ) -> None:
        self.client = client
        #: The healthy workers serving a model, asked on every remote tokenization (they come and go).
        self.worker_urls_for = worker_urls_for
        self._local_specs = dict(local or {})
        self._sources: dict[str, TokenSource] = {}

    @classmethod
    def from_models(
        cls, models: Sequence[Any], client: httpx.AsyncClient, worker_urls_for: Callable[[str], Sequence[str]]
    ) -> Tokenizers:
        """From the router config's ``models`` (each with ``name``, ``tokenizer``, ``chat_template``)."""
        local = {m.name: (m.tokenizer, m.chat_template) for m in models if getattr(m, "tokenizer", None)}
        return cls(client, worker_urls_for, local)

    def update_models(self, models: Sequence[Any]) -> list[str]:
        """Take a reloaded config's models: sources whose tokenizer changed are rebuilt on next use."""
        local = {m.name: (m.tokenizer, m.chat_template) for m in models if getattr(m, "tokenizer", None)}
        changed = [n for n in set(local) | set(self._local_specs) if local.get(n) != self._local_specs.get(n)]
        self._local_specs = local
        for name in changed:
            self._sources.pop(name, None)
        return sorted(changed)

    def source(self, model: str) -> TokenSource:
        src = self._sources.get(model)
        if src is not None:
            return src
        if model in self._local_specs:
            path, template = self._local_specs[model]
            src = PluginTokenizer(path) if path.startswith(PluginTokenizer.PREFIX) else LocalTokenizer(path, template)
        else:
            if not self.worker_urls_for(model):
                raise TokenizeError(f"no tokenizer configured and no worker serving model {model!r}")
            src = RemoteTokenizer(self.client, lambda: self.worker_urls_for(model), model)
        self._sources[model] = src
        return src

    def stats(self) -> dict[str, dict[str, int]]:
        """Per model whose token source has a prefix cache, its counters and size (for export)."""
        out = {}
        for model, src in self._sources.items():
            stats = getattr(src, "stats", None)
            if callable(stats):
                out[model] = stats()
        return out

    async def tokens_for_body(self, model: str, body: Mapping[str, Any]) -> list[int]:
        """The prompt tokens of an OpenAI request body (``messages`` for chat, ``prompt`` for completions)."""
        src = self.source(model)
        if "messages" in body:
            return await src.chat_tokens(
                body["messages"],
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                tools=body.get("tools"),
                chat_template_kwargs=body.get("chat_template_kwargs"),
            )
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)  # already token ids
        if not isinstance(prompt, str):
            raise TokenizeError("request needs 'messages' or a string 'prompt'")
        return await src.prompt_tokens(prompt)

    async def tokenize(self, model: str, prompt: str | None, messages: list[dict[str, Any]] | None) -> list[int]:
        """The admin lookup's form: a prompt or messages, tokenized as a request with them would be."""
        body: dict[str, Any] = {"messages": messages} if messages is not None else {"prompt": prompt}
        return await self.tokens_for_body(model, body)
