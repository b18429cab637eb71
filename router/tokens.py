"""Exactly the tokens the engine will see, per model: a local tokenizer or the worker's ``POST /tokenize``.

A token mismatch silently destroys every cache hit, so the local path reproduces vLLM's own steps:
chat requests render the model's chat template (jinja2, sandboxed, HF's globals) and encode the text
without adding special tokens; completion prompts are encoded with them (the post-processor's BOS).

Growing conversations are not re-tokenized from scratch: each result is cached with its character
offsets, and a new text that extends a cached one reuses the cached tokens up to the last *special
token* inside the shared part. Added special tokens are split off before any normalisation or
pre-tokenization, so the tokens before such a boundary are exactly what a full encode would give.
The remote path caches exact request bodies only (the server renders templates itself).
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson


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


class _Entry:
    __slots__ = ("ids", "starts")

    def __init__(self, ids: list[int], starts: list[int]) -> None:
        self.ids = ids
        self.starts = starts


class LocalTokenizer:
    """``tokenizers`` + chat template from a model folder (or a tokenizer.json path)."""

    def __init__(self, path: str | Path, chat_template: str | Path | None = None, cache_entries: int = 64) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = folder / "tokenizer.json" if path.is_dir() else path
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:
            raise TokenizeError(f"cannot load tokenizer {file}: {exc}") from None
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
        added = self.tokenizer.get_added_tokens_decoder().values()
        specials = [t.content for t in added if t.special and t.content]
        in_template = [s for s in specials if self.template and s in self.template.source]
        #: Boundaries used for prefix reuse: special tokens the template emits (else a few of them).
        self.boundaries = in_template or specials[:32]
        self.cache_entries = cache_entries
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._pre, self._post = self._special_wrap()
        self.stats = {"hits": 0, "prefix_hits": 0, "misses": 0}

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
        entry = self._cache.get(text)
        if entry is not None:
            self._cache.move_to_end(text)
            self.stats["hits"] += 1
            return list(entry.ids)
        entry = self._extend(text) or self._full(text)
        self._cache[text] = entry
        if len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)
        return list(entry.ids)

    def _full(self, text: str) -> _Entry:
        self.stats["misses"] += 1
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return _Entry(enc.ids, [o[0] for o in enc.offsets])

    def _extend(self, text: str) -> _Entry | None:
        bases = (t for t in self._cache if len(t) < len(text) and text.startswith(t))
        base_text = max(bases, key=len, default=None)
        if base_text is None:
            return None
        base = self._cache[base_text]
        cut = max((base_text.rfind(s) for s in self.boundaries), default=-1)
        if cut <= 0:
            return None
        i = bisect.bisect_left(base.starts, cut)
        if i >= len(base.starts) or base.starts[i] != cut:
            return None
        tail = self.tokenizer.encode(text[cut:], add_special_tokens=False)
        self.stats["prefix_hits"] += 1
        return _Entry(base.ids[:i] + tail.ids, base.starts[:i] + [o[0] + cut for o in tail.offsets])

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completion prompt as vLLM encodes it (with the post-processor's special tokens)."""
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string")
        if self._pre is None or self._post is None:
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        return self._pre + self.encode_raw(prompt) + self._post

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
    object with ``encode(text)`` and ``encode_chat(messages, add_generation_prompt=True)``."""

    PREFIX = "python:"

    def __init__(self, spec: str) -> None:
        import importlib

        target = spec[len(self.PREFIX) :]
        module_name, _, attr = target.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise TokenizeError(f"cannot load tokenizer {spec!r}: {exc}") from None
        self.impl = factory()

    async def prompt_tokens(self, prompt: str) -> list[int]:
        return list(self.impl.encode(prompt))

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
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
