"""Exactly the tokens the engine will see, per model: the source its ``tokenizer`` setting names.

* a model folder or ``tokenizer.json``: :class:`~kvroute.router.local_tokens.LocalTokenizer` renders chat
  templates as vLLM does and keeps a prefix cache for growing prompts;
* ``python:module:Factory``: :class:`~kvroute.router.plugin_tokens.PluginTokenizer` (custom engines, the
  simulated workers);
* ``render`` or ``render:URL,...``: :class:`~kvroute.router.render_tokens.RenderTokenizer` asks the
  engine's render routes (every surface exact, media included);
* nothing: :class:`RemoteTokenizer`, the workers' ``POST /tokenize`` (exact bodies cached).

:meth:`Tokenizers.tokens_for_request` takes any generation surface (completions, chat, Messages,
Responses); a prompt a source cannot render exactly raises
:class:`~kvroute.router.chat_prompt.Unrenderable`, and the request is routed by load.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import httpx
import orjson
from kvroute.router.chat_prompt import (
    ChatPrompt,
    TokenizeError,
    Unrenderable,
    chat_schema_messages,
    prompt_of_fields,
)
from kvroute.router.chat_template import ChatTemplate
from kvroute.router.errors import ApiError
from kvroute.router.local_tokens import LocalTokenizer
from kvroute.router.plugin_tokens import PluginTokenizer
from kvroute.router.prompt_head import PromptHead
from kvroute.router.render_tokens import RenderTokenizer
from kvroute.router.surfaces import CHAT, COMPLETIONS, SurfacePrompt, merged_prompt, read_prompt

__all__ = [
    "ChatPrompt",
    "ChatTemplate",
    "LocalTokenizer",
    "PluginTokenizer",
    "PromptHead",
    "RemoteTokenizer",
    "RenderTokenizer",
    "TokenSource",
    "TokenizeError",
    "Tokenizers",
    "Unrenderable",
]


class TokenSource(Protocol):
    """Where one model's prompt tokens come from. ``merges_inline_system``: whether the engine moves
    /v1/messages' inline system messages into the leading one (None: not known here)."""

    @property
    def merges_inline_system(self) -> bool | None: ...

    async def prompt_tokens(self, prompt: str) -> Sequence[int]: ...

    async def chat_prompt_tokens(self, prompt: ChatPrompt) -> Sequence[int]: ...

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Sequence[int]: ...


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
        # Key order is part of the request: a template's ``tojson`` of tools or messages renders it.
        key = orjson.dumps(payload)
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

    async def prompt_tokens(self, prompt: str) -> Sequence[int]:
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string")
        return await self._tokenize({"model": self.model, "prompt": prompt})

    #: The worker's template is not known here.
    merges_inline_system: bool | None = None

    async def chat_prompt_tokens(self, prompt: ChatPrompt) -> Sequence[int]:
        """``/tokenize`` renders chat like a chat completion; what it has no field for (``documents``,
        ``reasoning_effort``) reaches the template through ``chat_template_kwargs``, merged as vLLM would."""
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": chat_schema_messages(prompt.messages),
            "add_generation_prompt": prompt.add_generation_prompt,
        }
        if prompt.continue_final_message:
            payload["continue_final_message"] = True
        if prompt.tools is not None:
            payload["tools"] = prompt.tools
        kwargs = prompt.option_kwargs()
        kwargs.pop("add_generation_prompt", None)
        kwargs.pop("continue_final_message", None)
        if kwargs:
            payload["chat_template_kwargs"] = kwargs
        if prompt.chat_template is not None:
            payload["chat_template"] = prompt.chat_template
        if prompt.add_special_tokens:
            payload["add_special_tokens"] = True
        return await self._tokenize(payload)

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Sequence[int]:
        return await self.chat_prompt_tokens(
            prompt_of_fields(messages, add_generation_prompt, tools, chat_template_kwargs)
        )


#: ``tokenizer: render`` asks the workers' render routes; ``render:URL[,URL...]`` dedicated render servers.
RENDER = "render"


def _render_urls(spec: str) -> list[str] | None:
    """The render servers a ``render:`` spec names (None: the workers serving the model)."""
    urls = [u.strip().rstrip("/") for u in spec[len(RENDER) + 1 :].split(",") if u.strip()]
    return urls or None


class Tokenizers:
    """Token sources per model, chosen by its ``tokenizer`` setting: a folder or tokenizer.json (local),
    ``python:module:Factory`` (a plugin), ``render`` / ``render:URL,...`` (the engine's render routes), or
    nothing (the workers' ``/tokenize``). ``on_render_failure(reason)`` counts benched render answers."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        worker_urls_for: Callable[[str], Sequence[str]],
        local: Mapping[str, tuple[str, str | None]] | None = None,
        on_render_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        #: The healthy workers serving a model, asked on every remote tokenization (they come and go).
        self.worker_urls_for = worker_urls_for
        self._local_specs = dict(local or {})
        self._sources: dict[str, TokenSource] = {}
        self.on_render_failure = on_render_failure

    @classmethod
    def from_models(
        cls,
        models: Sequence[Any],
        client: httpx.AsyncClient,
        worker_urls_for: Callable[[str], Sequence[str]],
        on_render_failure: Callable[[str], None] | None = None,
    ) -> Tokenizers:
        """From the router config's ``models`` (each with ``name``, ``tokenizer``, ``chat_template``)."""
        local = {m.name: (m.tokenizer, m.chat_template) for m in models if getattr(m, "tokenizer", None)}
        return cls(client, worker_urls_for, local, on_render_failure)

    def update_models(self, models: Sequence[Any]) -> list[str]:
        """Take a reloaded config's models: sources whose tokenizer changed are rebuilt on next use."""
        local = {m.name: (m.tokenizer, m.chat_template) for m in models if getattr(m, "tokenizer", None)}
        changed = [n for n in set(local) | set(self._local_specs) if local.get(n) != self._local_specs.get(n)]
        self._local_specs = local
        for name in changed:
            self._sources.pop(name, None)
        return sorted(changed)

    def _render_source(self, model: str, spec: str) -> RenderTokenizer:
        fixed = _render_urls(spec)
        urls: Callable[[], Sequence[str]] = (lambda: fixed) if fixed else (lambda: self.worker_urls_for(model))
        return RenderTokenizer(self.client, urls, model, on_failure=self.on_render_failure)

    def source(self, model: str) -> TokenSource:
        src = self._sources.get(model)
        if src is None:
            src = self._sources[model] = self._build(model)
        return src

    async def preload(self, models: Sequence[str] | None = None) -> dict[str, str]:
        """Load the configured tokenizers of ``models`` (default: every one) now, in a thread, so no request
        waits for a tokenizer.json to load or a plugin to import. Returns the ones that failed, with why
        (their requests route without the index, as they would have on first use)."""
        failed: dict[str, str] = {}
        wanted = models if models is not None else sorted(self._local_specs)
        todo = [m for m in wanted if m in self._local_specs and m not in self._sources]
        if not todo:
            return failed
        loop = asyncio.get_running_loop()
        # A thread of its own, gone once loaded (the loop's default executor would keep an idle one for good).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-tokenizers") as pool:
            for model in todo:
                try:
                    built = await loop.run_in_executor(pool, self._build, model)
                except TokenizeError as exc:
                    failed[model] = str(exc)
                    continue
                self._sources.setdefault(model, built)  # a request may have built it meanwhile
        return failed

    def _build(self, model: str) -> TokenSource:
        if model in self._local_specs:
            path, template = self._local_specs[model]
            if path == RENDER or path.startswith(RENDER + ":"):
                return self._render_source(model, path)
            if path.startswith(PluginTokenizer.PREFIX):
                return PluginTokenizer(path)
            return LocalTokenizer(path, template)
        if not self.worker_urls_for(model):
            raise TokenizeError(f"no tokenizer configured and no worker serving model {model!r}")
        return RemoteTokenizer(self.client, lambda: self.worker_urls_for(model), model)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per model whose token source has a prefix cache, its counters and size (for export)."""
        out = {}
        for model, src in self._sources.items():
            stats = getattr(src, "stats", None)
            if callable(stats):
                out[model] = stats()
        return out

    async def tokens_for_request(
        self, model: str, route: str, body: Mapping[str, Any], prompt: SurfacePrompt | None = None
    ) -> Sequence[int]:
        """The prompt tokens of a generation request on ``route`` (its body, as forwarded, and what
        :func:`~kvroute.router.surfaces.read_prompt` read from it). Raises :class:`TokenizeError` (an
        :class:`Unrenderable` when this source cannot be exact)."""
        tokens = await self._for_request(model, route, body, prompt, head=False)
        assert not isinstance(tokens, PromptHead)
        return tokens

    async def head_for_request(
        self, model: str, route: str, body: Mapping[str, Any], prompt: SurfacePrompt | None = None
    ) -> Sequence[int] | PromptHead:
        """:meth:`tokens_for_request`, except that a long prompt the source's cache covers little of may come
        as its :class:`PromptHead` (:mod:`~kvroute.router.prompt_head`)."""
        return await self._for_request(model, route, body, prompt, head=True)

    async def _for_request(
        self, model: str, route: str, body: Mapping[str, Any], prompt: SurfacePrompt | None, head: bool
    ) -> Sequence[int] | PromptHead:
        src = self.source(model)
        # The sources that can hand out a long new prompt's head first (their prefix caches know what is new).
        heads = src if head and isinstance(src, (LocalTokenizer, PluginTokenizer)) else None
        prompt_field = body.get("prompt")
        if route == COMPLETIONS and isinstance(prompt_field, list) and all(type(t) is int for t in prompt_field):
            return list(prompt_field)  # already token ids
        if isinstance(src, RenderTokenizer):
            return await src.render_tokens(route, body)
        prompt = prompt if prompt is not None else read_prompt(route, body)
        if prompt.unrenderable is not None:
            raise prompt.unrenderable
        if prompt.chat is None:
            if not isinstance(prompt_field, str):
                raise TokenizeError("request needs 'messages' or a string 'prompt'")
            if heads is not None:
                return await heads.prompt_head(prompt_field)
            return await src.prompt_tokens(prompt_field)
        chat = prompt.chat
        if prompt.inline_system:
            merges = src.merges_inline_system
            if merges is None:
                raise Unrenderable("inline_system", "where inline system messages go depends on the worker's template")
            if merges:
                chat = merged_prompt(body)
        if heads is not None:
            return await heads.chat_prompt_head(chat)
        return await src.chat_prompt_tokens(chat)

    async def tokens_for_body(self, model: str, body: Mapping[str, Any]) -> Sequence[int]:
        """The prompt tokens of an OpenAI request body (``messages`` for chat, ``prompt`` for completions)."""
        try:
            return await self.tokens_for_request(model, CHAT if "messages" in body else COMPLETIONS, body)
        except ApiError as exc:
            raise TokenizeError(exc.message) from None

    async def tokenize(self, model: str, prompt: str | None, messages: list[dict[str, Any]] | None) -> Sequence[int]:
        """The admin lookup's form: a prompt or messages, tokenized as a request with them would be."""
        body: dict[str, Any] = {"messages": messages} if messages is not None else {"prompt": prompt}
        return await self.tokens_for_body(model, body)
