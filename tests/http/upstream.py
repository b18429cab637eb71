"""Small fake vLLM workers for the router tests: real uvicorn servers on 127.0.0.1 that imitate vLLM's
OpenAI answers (JSON with usage, SSE with ``data: ...`` and ``data: [DONE]``), /health, /metrics and
/v1/models, and record what they received."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class FakeWorker:
    name: str
    models: list[str] = field(default_factory=lambda: ["m1"])
    healthy: bool = True
    #: Seconds to wait before answering a generation request.
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    chunks: int = 3
    running: int = 0
    waiting: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)
    #: Answer generation requests with admission control's 503 (a full engine with queue limits).
    refusing: bool = False
    #: Stop answering anything, /health included (a hung process, SIGSTOP): requests wait until cut off.
    hung: bool = False
    #: Set when a generation was cut short (the client of the worker, i.e. the router, went away).
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    def completion(self, body: dict[str, Any], path: str) -> dict[str, Any]:
        chat = path.endswith("chat/completions")
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"hello from {self.name}"},
                "finish_reason": "stop",
            }
            if chat
            else {"index": 0, "text": f"hello from {self.name}", "finish_reason": "stop"}
        )
        return {
            "id": "cmpl-1",
            "object": "chat.completion" if chat else "text_completion",
            "created": 1,
            "model": body.get("model"),
            "worker": self.name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 3,
                "total_tokens": 13,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        }

    def sse_events(self, body: dict[str, Any]) -> list[bytes]:
        events = [
            b"data: "
            + orjson.dumps({"id": "c", "worker": self.name, "choices": [{"text": f"t{i}"}], "usage": None})
            + b"\n\n"
            for i in range(self.chunks)
        ]
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": 12,
                "completion_tokens": self.chunks,
                "total_tokens": 12 + self.chunks,
                "prompt_tokens_details": {"cached_tokens": 8},
            }
            events.append(b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": usage}) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return events

    @staticmethod
    async def _client_left_during(request: Request, seconds: float) -> bool:
        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        try:
            await asyncio.wait_for(disconnected(), seconds)
        except TimeoutError:
            return False
        return True

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            return Response(status_code=200 if self.healthy else 503)

        async def metrics(request: Request) -> Response:
            text = (
                "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="m1"}} {self.running}.0\n'
                "# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{engine="0",model_name="m1"}} {self.waiting}.0\n'
                "# HELP vllm:kv_cache_usage_perc Usage.\n# TYPE vllm:kv_cache_usage_perc gauge\n"
                'vllm:kv_cache_usage_perc{engine="0",model_name="m1"} 0.25\n'
                "# HELP vllm:cache_config_info Info.\n# TYPE vllm:cache_config_info gauge\n"
                'vllm:cache_config_info{block_size="16",engine="0"} 1.0\n'
            )
            return Response(text, media_type="text/plain; version=0.0.4")

        async def models(request: Request) -> Response:
            data = [
                {"id": m, "object": "model", "created": 1, "owned_by": "vllm", "max_model_len": 4096}
                for m in self.models
            ]
            return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

        async def generate(request: Request) -> Response:
            raw = await request.body()
            body = orjson.loads(raw)
            self.seen.append({"path": request.url.path, "headers": dict(request.headers), "body": body, "raw": raw})
            self.started.set()
            headers = {"x-seen-request-id": request.headers.get("x-request-id", "")}
            if self.refusing:
                error = {
                    "error": {"message": "queue full, retry on another instance", "type": "Unavailable", "code": 503}
                }
                return Response(orjson.dumps(error), status_code=503, media_type="application/json", headers=headers)
            if self.delay_s and await self._client_left_during(request, self.delay_s):
                # Like vLLM: a client that hung up gets its request aborted.
                self.aborted.set()
                return Response(status_code=499)
            if not body.get("stream"):
                return Response(
                    orjson.dumps(self.completion(body, request.url.path)),
                    media_type="application/json",
                    headers=headers,
                )
            events = self.sse_events(body)

            async def stream() -> AsyncIterator[bytes]:
                finished = False
                try:
                    for event in events:
                        yield event
                        if self.chunk_delay_s:
                            await asyncio.sleep(self.chunk_delay_s)
                    finished = True
                finally:
                    if not finished:
                        self.aborted.set()

            return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

        async def tokenize(request: Request) -> Response:
            body = orjson.loads(await request.body())
            self.seen.append({"path": "/tokenize", "headers": dict(request.headers), "body": body})
            return Response(
                orjson.dumps({"tokens": [1, 2, 3], "count": 3, "worker": self.name}), media_type="application/json"
            )

        async def not_found(request: Request) -> Response:
            return Response(b'{"detail":"Not Found"}', status_code=404, media_type="application/json")

        async def elsewhere(request: Request) -> Response:
            raw = await request.body()
            self.seen.append({"path": request.url.path, "headers": dict(request.headers), "body": None, "raw": raw})
            return Response(b'{"detail":"Not Found"}', status_code=404, media_type="application/json")

        return Starlette(
            routes=[
                Route("/health", health),
                Route("/metrics", metrics),
                Route("/v1/models", models),
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/v1/chat/completions", generate, methods=["POST"]),
                Route("/tokenize", tokenize, methods=["POST"]),
                # An older vLLM: no GET /kv_event_sources (the router asks; not recorded, it is no client call).
                Route("/kv_event_sources", not_found),
                # Anything else is recorded (a request that should never have reached a worker shows) and
                # answered as a server without that path would.
                Route("/{path:path}", elsewhere, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
            ]
        )


@contextlib.asynccontextmanager
async def serve(app: Any, lifespan: str = "off", http: Any = "httptools") -> AsyncIterator[str]:
    """Run an ASGI app with uvicorn on a free loopback port in the current loop; yields its base URL.
    ``http``: uvicorn's protocol name or class (``kvroute serve``'s own, say)."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan=lifespan,
        loop="none",
        http=http,
        access_log=False,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        task.cancel()
        raise RuntimeError("server did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        # A graceful exit (not force_exit), so the app's lifespan shutdown runs.
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
        except TimeoutError:
            server.force_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)


@contextlib.asynccontextmanager
async def serve_worker(worker: FakeWorker) -> AsyncIterator[FakeWorker]:
    app = worker.app()

    async def maybe_hung(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and worker.hung:
            await asyncio.sleep(3600)  # like a stopped process: the connection is accepted, nothing answers
        await app(scope, receive, send)

    async with serve(maybe_hung) as url:
        worker.url = url
        yield worker


@contextlib.asynccontextmanager
async def hangup_server() -> AsyncIterator[str]:
    """Accepts a connection, reads the request and hangs up without answering (fails before any byte)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.read(65536)
        writer.close()

    async with raw_server(handle) as url:
        yield url


@contextlib.asynccontextmanager
async def broken_stream_server() -> AsyncIterator[str]:
    """Answers 200 text/event-stream, sends one event, then drops the connection mid-body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            event = b'data: {"choices":[{"text":"partial"}]}\n\n'
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            writer.write(head + f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.transport.abort()

    async with raw_server(handle) as url:
        yield url


@contextlib.asynccontextmanager
async def dies_after_headers_server(*, empty_chunk: bool = False) -> AsyncIterator[str]:
    """Answers a stream's status line and headers, then dies before any body byte (a worker killed at that
    instant); with ``empty_chunk`` it first sends a zero-length read's worth of nothing but keep-alive."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            writer.write(head)
            await writer.drain()
            if empty_chunk:
                writer.write(b": \n")  # not even a chunk boundary: bytes that are no part of a body
                await writer.drain()
            await asyncio.sleep(0.05)
        writer.transport.abort()

    async with raw_server(handle) as url:
        yield url


Handle = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handle: Handle) -> AsyncIterator[str]:
    """A TCP server on a free loopback port speaking whatever ``handle`` writes; yields its base URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()
