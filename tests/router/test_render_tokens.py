"""The render token source against real HTTP servers on 127.0.0.1 that answer the render routes well,
badly or hostilely: spread over workers, cached by exact body, a bad worker benched (a metric, one log
line) while the others are asked, and nothing worse than "no tokens" (then: routed by load)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from kvroute.router.chat_prompt import TokenizeError
from kvroute.router.render_tokens import RenderTokenizer
from kvroute.router.surfaces import CHAT, COMPLETIONS, MESSAGES
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.http.upstream import serve


def ids_of(body: dict[str, Any]) -> list[int]:
    """A deterministic stand-in for the engine's ids: one per character of the body's text."""
    text = orjson.dumps(body.get("messages") or body.get("prompt") or body.get("input"))
    return [b + 1 for b in text]


@dataclass
class Renderer:
    """One worker's render routes; ``mode`` says how it answers."""

    mode: str = "ok"
    seen: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def render(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.seen.append((request.url.path, body))
        ids = ids_of(body)
        answer: Any = {"request_id": "x", "token_ids": ids, "sampling_params": {}}
        if request.url.path == "/v1/completions/render":
            answer = [answer]
        raw = orjson.dumps(answer)
        status = 200
        match self.mode:
            case "garbage":
                raw = b"<html>not json</html>"
            case "bools":
                raw = orjson.dumps({"token_ids": [True, False]})
            case "negative":
                raw = orjson.dumps({"token_ids": [5, -1]})
            case "too_big_id":
                raw = orjson.dumps({"token_ids": [1 << 40]})
            case "nested":
                raw = b"[" * 5000 + b"]" * 5000
            case "huge":
                raw = orjson.dumps({"token_ids": list(range(1, 400_000))})
            case "wrong_shape":
                raw = orjson.dumps([answer, answer])
            case "disabled":
                raw, status = b'{"error": {"message": "Scale-out endpoints are disabled."}}', 403
            case "refuse":
                raw, status = b'{"error": {"message": "bad request"}}', 400
            case "error":
                raw, status = b"boom", 500
        return Response(raw, status, media_type="application/json")


@contextlib.asynccontextmanager
async def renderers(*modes: str) -> AsyncIterator[tuple[list[Renderer], list[str]]]:
    workers = [Renderer(mode) for mode in modes]
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for w in workers:
            app = Starlette(routes=[Route("/{path:path}", w.render, methods=["POST"])])
            urls.append(await stack.enter_async_context(serve(app)))
        yield workers, urls


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


async def test_spread_over_workers_and_cached_by_exact_body() -> None:
    async with renderers("ok", "ok") as (workers, urls), httpx.AsyncClient() as client:
        render = RenderTokenizer(client, lambda: urls, "m")
        for i in range(4):
            body = {**CHAT_BODY, "messages": [{"role": "user", "content": f"hello {i}"}]}
            assert await render.render_tokens(CHAT, body) == ids_of(body)
        assert [len(w.seen) for w in workers] == [2, 2]
        path, sent = workers[0].seen[0]
        assert path == "/v1/chat/completions/render" and sent["mm_payload"] == "none" and sent["max_tokens"] == 3
        assert await render.render_tokens(CHAT, {**CHAT_BODY, "messages": [{"role": "user", "content": "hello 0"}]})
        assert sum(len(w.seen) for w in workers) == 4  # from the cache
        reordered = {"messages": CHAT_BODY["messages"], "max_tokens": 3, "model": "m"}
        await render.render_tokens(CHAT, CHAT_BODY)
        await render.render_tokens(CHAT, reordered)  # key order reaches templates: another body
        assert sum(len(w.seen) for w in workers) == 6
        assert await render.prompt_tokens("abc") == ids_of({"prompt": "abc"})
        assert workers[0].seen[-1][0] == "/v1/completions/render" or workers[1].seen[-1][0] == "/v1/completions/render"
        stats = render.stats()
        assert stats["hits"] == 1 and stats["misses"] == 7 and 0 < stats["bytes"] <= stats["max_bytes"]


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("garbage", "malformed"),
        ("bools", "malformed"),
        ("negative", "malformed"),
        ("too_big_id", "malformed"),
        ("nested", "malformed"),
        ("wrong_shape", "malformed"),
        ("huge", "oversized"),
        ("disabled", "disabled"),
    ],
)
async def test_a_bad_answer_benches_its_worker_and_the_next_one_is_asked(
    mode: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    failures: list[str] = []
    async with renderers(mode, "ok") as (workers, urls), httpx.AsyncClient() as client:
        render = RenderTokenizer(client, lambda: urls, "m", max_answer_bytes=1 << 20, on_failure=failures.append)
        caplog.set_level(logging.WARNING, "kvroute.render")
        for i in range(6):
            route = COMPLETIONS if mode == "wrong_shape" else MESSAGES
            body = {"model": "m", "prompt": f"p{i}"} if route == COMPLETIONS else {**CHAT_BODY, "max_tokens": i + 1}
            assert await render.render_tokens(route, body) == ids_of(body)
        assert failures == [reason]  # benched after the first bad answer: asked once, counted once
        assert len(workers[0].seen) == 1 and len(workers[1].seen) == 6
        lines = [r for r in caplog.records if r.name == "kvroute.render"]
        assert len(lines) == 1 and urls[0] in lines[0].getMessage()


async def test_with_every_worker_bad_there_are_no_tokens_never_a_crash() -> None:
    failures: list[str] = []
    async with renderers("garbage", "huge") as (_, urls), httpx.AsyncClient() as client:
        render = RenderTokenizer(client, lambda: urls, "m", max_answer_bytes=1 << 16, on_failure=failures.append)
        with pytest.raises(TokenizeError, match="render answer"):
            await render.render_tokens(CHAT, CHAT_BODY)
        with pytest.raises(TokenizeError, match="benched"):
            await render.render_tokens(CHAT, CHAT_BODY)
        assert sorted(failures) == ["malformed", "oversized"]


async def test_a_refused_request_is_not_retried_and_benches_nobody() -> None:
    failures: list[str] = []
    async with renderers("refuse", "ok") as (workers, urls), httpx.AsyncClient() as client:
        # Turns start at the second worker of the list: the refusing one is asked first.
        render = RenderTokenizer(client, lambda: [urls[1], urls[0]], "m", on_failure=failures.append)
        with pytest.raises(TokenizeError, match="refused the request"):
            await render.render_tokens(CHAT, CHAT_BODY)
        assert len(workers[0].seen) == 1 and not workers[1].seen and not failures


async def test_errors_and_dead_workers_fall_through_to_the_next() -> None:
    async with renderers("error", "ok") as (workers, urls), httpx.AsyncClient() as client:
        dead = "http://127.0.0.1:9"
        render = RenderTokenizer(client, lambda: [dead, *urls], "m", timeout_s=2.0)
        for i in range(3):
            body = {**CHAT_BODY, "max_tokens": i + 1}
            assert await render.render_tokens(CHAT, body) == ids_of(body)
        assert len(workers[1].seen) == 3
        assert render.stats()["failures"] == 0  # errors are not hostile answers: nobody benched


async def test_the_cache_stays_within_its_bytes() -> None:
    async with renderers("ok") as (_, urls), httpx.AsyncClient() as client:
        render = RenderTokenizer(client, lambda: urls, "m", cache_bytes=20_000)
        for i in range(40):
            await render.render_tokens(
                CHAT, {**CHAT_BODY, "messages": [{"role": "user", "content": "x" * 50 + str(i)}]}
            )
        stats = render.stats()
        assert 0 < stats["entries"] < 40 and stats["bytes"] <= 20_000
