"""Exact prompt tokens from the engine's own renderer: ``POST /v1/{completions,chat/completions,messages,
responses}/render``.

Why: vLLM renders a request itself (chat templates, tools, Anthropic and Responses conversions,
multimodal placeholders) and, with ``--enable-scale-out`` (or on a GPU-less ``vllm launch render``
server), answers the render routes with the ``GenerateRequest`` it would run — ``token_ids`` included.
Asking it is exact for every surface, at the price of one HTTP round trip per new body.

The body sent is the client's (already stripped of routing fields) with ``mm_payload: "none"`` (media
items as hashes, not tensors) and the model filled in. Answers are cached by exact body in an LRU bounded
in bytes. Calls are spread over the healthy workers serving the model (or the configured render servers)
in turn; a worker that fails is skipped for the next. A worker whose answer is malformed, oversized or
hostile, or that has render turned off (403) or missing (404), is benched for ``bench_s``: its answers are not used
meanwhile, one rate-limited line is logged and ``on_failure(reason)`` counts it. With nobody left to ask
the request is routed by load (:class:`~kvroute.router.chat_prompt.TokenizeError`), never failed.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import orjson
from kvroute.indexer.keys import TokenIds
from kvroute.logs import RateLimitedLog
from kvroute.router.chat_prompt import ChatPrompt, TokenizeError, chat_schema_messages
from kvroute.router.surfaces import CHAT, COMPLETIONS

log = logging.getLogger("kvroute.render")
limited = RateLimitedLog(log)

MAX_TOKEN_ID = (1 << 32) - 1
DEFAULT_RENDER_CACHE_BYTES = 32 << 20
#: A render answer is a few bytes per token plus sampling params; anything larger is not an answer.
DEFAULT_MAX_ANSWER_BYTES = 16 << 20


class _Refused(TokenizeError):
    """The engine refused the request itself (a 4xx): every engine would, so nobody else is asked."""


class _Benched(TokenizeError):
    """This worker gave an answer that cannot be used; it is skipped for a while."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def render_body(route: str, body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """What the render route gets for a generation ``body`` of ``route``."""
    out = dict(body)
    out["model"] = out.get("model") or model
    out["mm_payload"] = "none"
    out.pop("return_mm_kwargs", None)
    return out


def chat_render_body(prompt: ChatPrompt, model: str) -> dict[str, Any]:
    """A chat completion body that renders as ``prompt``."""
    body: dict[str, Any] = {"model": model, "messages": chat_schema_messages(prompt.messages)}
    options = {
        "add_generation_prompt": prompt.add_generation_prompt,
        "continue_final_message": prompt.continue_final_message,
        "tools": prompt.tools,
        "documents": prompt.documents,
        "reasoning_effort": prompt.reasoning_effort,
        "chat_template_kwargs": prompt.chat_template_kwargs,
        "chat_template": prompt.chat_template,
        "add_special_tokens": prompt.add_special_tokens or None,
    }
    body.update((k, v) for k, v in options.items() if v is not None)
    return body


def token_ids_of(route: str, raw: bytes) -> list[int]:
    """The ``token_ids`` of one render answer; :class:`_Benched` when it is not a well-formed one."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _Benched("malformed", "the render answer is not JSON") from None
    if route == COMPLETIONS:
        if not isinstance(answer, list) or len(answer) != 1:
            raise _Benched("malformed", "a completions render answer must be a list of one request")
        answer = answer[0]
    ids = answer.get("token_ids") if isinstance(answer, dict) else None
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise _Benched("malformed", "the render answer has no list of token ids (0..2**32-1)")
    return ids


class RenderTokenizer:
    """Token source for one model asking the render routes of ``urls()`` (see module doc)."""

    #: Not needed: the engine places /v1/messages' inline system messages itself.
    merges_inline_system: bool | None = None

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: Callable[[], Sequence[str]],
        model: str,
        *,
        cache_bytes: int = DEFAULT_RENDER_CACHE_BYTES,
        timeout_s: float = 5.0,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        bench_s: float = 30.0,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.urls = urls
        self.model = model
        self.cache_bytes = cache_bytes
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
        self.bench_s = bench_s
        self.on_failure = on_failure
        self._cache: OrderedDict[bytes, TokenIds] = OrderedDict()
        self._bytes = 0
        self._benched: dict[str, float] = {}
        self._turn = 0
        self.counters = {"hits": 0, "misses": 0, "failures": 0}

    def stats(self) -> dict[str, int]:
        """Counters of the exact-body cache and its size, for export."""
        return {**self.counters, "entries": len(self._cache), "bytes": self._bytes, "max_bytes": self.cache_bytes}

    def _usable(self) -> list[str]:
        now = time.monotonic()
        return [u for u in self.urls() if self._benched.get(u, 0.0) <= now]

    @staticmethod
    def _size(key: bytes, ids: TokenIds) -> int:
        """Bytes an entry holds (key, the ids' array and its header), counted high."""
        return sys.getsizeof(key) + 136 + 4 * len(ids)

    def _remember(self, key: bytes, ids: TokenIds) -> None:
        size = self._size(key, ids)
        if size > self.cache_bytes:
            return
        self._cache[key] = ids
        self._bytes += size
        while self._bytes > self.cache_bytes:
            old_key, old = self._cache.popitem(last=False)
            self._bytes -= self._size(old_key, old)

    async def render_tokens(self, route: str, body: Mapping[str, Any]) -> Sequence[int]:
        """The engine's token ids for a ``route`` request with ``body`` (a generation route's)."""
        # Exact bytes, key order included: a template's ``tojson`` of tools or messages renders it.
        payload = orjson.dumps(render_body(route, body, self.model))
        key = route.encode() + b"\0" + payload
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.counters["hits"] += 1
            return TokenIds(cached)  # a copy (memcpy): the caller's to keep
        self.counters["misses"] += 1
        urls = self._usable()
        if not urls:
            raise TokenizeError(f"no worker to render {self.model!r} requests with (none healthy, or all benched)")
        self._turn += 1
        problems = []
        for i in range(len(urls)):
            url = urls[(self._turn + i) % len(urls)].rstrip("/")
            try:
                ids = await self._ask(url + route + "/render", route, payload)
            except _Benched as exc:
                self._bench(url, exc.reason, str(exc))
                problems.append(f"{url}: {exc}")
                continue
            except _Refused:
                raise
            except TokenizeError as exc:
                problems.append(str(exc))
                continue
            tokens = TokenIds(ids)
            self._remember(key, tokens)
            return TokenIds(tokens)
        raise TokenizeError("; ".join(problems))

    def _bench(self, url: str, reason: str, detail: str) -> None:
        self._benched[url] = time.monotonic() + self.bench_s
        self.counters["failures"] += 1
        if self.on_failure is not None:
            self.on_failure(reason)
        limited.warning(
            f"render:{url}:{reason}",
            "render at %s unusable (%s: %s); not asked for %.0f s, its requests routed without it",
            url,
            reason,
            detail,
            self.bench_s,
        )

    async def _ask(self, url: str, route: str, payload: bytes) -> list[int]:
        headers = {"content-type": "application/json"}
        try:
            async with self.client.stream(
                "POST", url, content=payload, headers=headers, timeout=self.timeout_s
            ) as resp:
                raw = bytearray()
                async for chunk in resp.aiter_bytes():
                    raw += chunk
                    if len(raw) > self.max_answer_bytes:
                        raise _Benched("oversized", f"the render answer is over {self.max_answer_bytes} bytes")
                status = resp.status_code
        except httpx.HTTPError as exc:
            raise TokenizeError(f"render at {url} failed: {type(exc).__name__}: {exc}") from None
        if status == 403:
            raise _Benched("disabled", "render is turned off (vLLM needs --enable-scale-out)")
        if status in (404, 405):
            raise _Benched("missing", f"no render route here ({status}): an engine older than vLLM 0.32?")
        if 400 <= status < 500 and status not in (408, 429):
            raise _Refused(f"render at {url} refused the request ({status}): {bytes(raw[:200])!r}")
        if status != 200:
            raise TokenizeError(f"render at {url} answered {status}: {bytes(raw[:200])!r}")
        return token_ids_of(route, bytes(raw))

    async def prompt_tokens(self, prompt: str) -> Sequence[int]:
        if not isinstance(prompt, str):
            raise TokenizeError("prompt must be a string")
        return await self.render_tokens(COMPLETIONS, {"prompt": prompt})

    async def chat_prompt_tokens(self, prompt: ChatPrompt) -> Sequence[int]:
        return await self.render_tokens(CHAT, chat_render_body(prompt, self.model))

    async def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Sequence[int]:
        body: dict[str, Any] = {"messages": list(messages), "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            body["tools"] = list(tools)
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        return await self.render_tokens(CHAT, body)
