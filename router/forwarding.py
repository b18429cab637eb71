"""Forwarding one request to one worker and passing the answer back byte for byte.

The forwarder waits until the worker's status and first body bytes are in before anything is sent to
the client: up to that point a failure (connection refused, the worker hung up) can still be retried on
another worker. A stream opened with ``early_head`` is the exception: its head goes out as soon as the
worker's arrives, so the client reads it while the engine computes the first token (a Python client
such as the OpenAI SDK spends 0.3-0.5 ms on a response head; read with the first token, that time was
on every TTFT), and a failure before the first token ends the stream with an error event. Non-SSE
answers are read whole (they are small and it makes usage easy to read); SSE answers are streamed chunk
by chunk, and a cheap sniffer picks ``usage`` out of the data lines without touching the bytes. Closing
the upstream response early aborts the worker's request, which is how a client disconnect cancels
generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
from kvroute.logs import RateLimitedLog
from kvroute.router.errors import error_body
from kvroute.router.http_body import ClientGone, until_disconnect
from kvroute.router.metrics import RouterMetrics
from kvroute.router.registry import WorkerRegistry
from kvroute.router.requests import HOP_BY_HOP
from kvroute.router.transport import Transport, UpstreamError, UpstreamResponse
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

#: Never passed back to the client: hop-by-hop, plus what our server writes itself.
_HOP_RESPONSE = HOP_BY_HOP | {"date", "server"}
_MAX_PENDING = 1 << 20

log = logging.getLogger("kvroute.forwarding")
limited = RateLimitedLog(log)


def response_headers(
    headers: list[tuple[str, str]], request_id: str, worker_url: str | None = None
) -> list[tuple[bytes, bytes]]:
    """The worker's answer headers for the client: hop-by-hop removed, our X-Request-Id, and a redirect to
    the worker itself made relative (a client must not learn the workers' internal addresses)."""
    out = [(b"x-request-id", request_id.encode("latin-1"))]
    for key, value in headers:
        name = key.lower()
        if name in _HOP_RESPONSE or name == "x-request-id":
            continue
        if name in ("location", "content-location") and worker_url and value.startswith(worker_url):
            value = value[len(worker_url) :] or "/"
        out.append((name.encode("latin-1"), value.encode("latin-1")))
    return out


@dataclass(slots=True)
class Result:
    """What the pipeline needs to know once the answer is complete (for metrics and policy.observe)."""

    worker_id: str
    status: int
    ttfb_s: float | None = None
    usage: dict[str, Any] | None = None
    ok: bool = True


Done = Callable[[Result], None]


def _run_after(response: RawResponse | RawStreamingResponse) -> None:
    """A response's ``after``, once; a failure there is logged, never the client's problem (its answer is out)."""
    after, response.after = response.after, None
    if after is not None:
        try:
            after()
        except Exception:
            log.exception("the bookkeeping after an answer failed")


class RawResponse(Response):
    """A complete body with headers already encoded (skips Starlette's header handling). ``after`` runs
    once the body went out (or the send failed): what the client does not wait for comes after its answer."""

    def __init__(
        self,
        body: bytes,
        status: int,
        raw_headers: list[tuple[bytes, bytes]],
        after: Callable[[], None] | None = None,
    ) -> None:
        self.body = body
        self.status_code = status
        self.background = None
        self.raw_headers = [*raw_headers, (b"content-length", str(len(body)).encode())]
        self.after = after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body})
        finally:
            _run_after(self)


class RawStreamingResponse(StreamingResponse):
    """Streams an async iterator with pre-encoded headers (chunked transfer); ``after`` runs once the
    stream's end went out (or the client left)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        status: int,
        raw_headers: list[tuple[bytes, bytes]],
        after: Callable[[], None] | None = None,
    ) -> None:
        self.body_iterator = content
        self.status_code = status
        self.background = None
        self.raw_headers = raw_headers
        self.after = after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream until the end or until the client hangs up; then the iterator's own ``finally`` closes
        the upstream (which aborts the worker's generation). Under ASGI 2.3 (uvicorn) Starlette would run
        an anyio task group per response for the same watch; one plain watcher task costs less on the
        path to the first token."""
        try:
            await until_disconnect(receive, self.stream_response(send), scope)
        except ClientGone:
            log.debug("client left during a stream; upstream closed")
        finally:
            _run_after(self)


class UsageSniffer:
    """Finds the last ``usage`` object in an SSE stream (top level, or a Responses event's ``response``),
    parsing only the lines that mention it."""

    __slots__ = ("_pending", "usage")

    def __init__(self) -> None:
        self._pending = b""
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._pending = data if len(data) < _MAX_PENDING else b""
            return
        self._pending = data[cut + 1 :]
        if len(self._pending) >= _MAX_PENDING:
            self._pending = b""
        complete = data[:cut]
        if b'"usage"' not in complete:
            return
        for line in complete.split(b"\n"):
            if line.startswith(b"data:") and b'"usage"' in line:
                self._take(line[5:])

    def _take(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        usage = obj.get("usage")
        if usage is None and isinstance(obj.get("response"), dict):  # Responses: the final response event
            usage = obj["response"].get("usage")
        if isinstance(usage, dict):
            self.usage = usage


def usage_of(body: bytes) -> dict[str, Any] | None:
    """``usage`` of a non-streaming JSON answer, or None (not JSON, no usage, compressed...)."""
    if b'"usage"' not in body:
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


@dataclass(slots=True)
class Opened:
    """A worker's answer whose status and first bytes are in (only its head, for an ``early_head`` stream:
    ``first`` is empty then); nothing has been sent to the client yet."""

    worker_id: str
    upstream: UpstreamResponse
    first: bytes
    #: The rest of an SSE body; None when ``first`` is the whole body.
    rest: AsyncGenerator[bytes, None] | None
    ttfb_s: float
    #: ``time.perf_counter()`` when the request arrived (a stream times its first body bytes from it).
    started: float = 0.0

    @property
    def awaits_first_bytes(self) -> bool:
        """An ``early_head`` stream whose first body bytes are still to come."""
        return self.rest is not None and not self.first


class Forwarder:
    """Sends requests to workers through the shared transport, keeping in-flight counts and metrics."""

    def __init__(
        self,
        transport: Transport,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        *,
        first_byte_timeout_s: float | None = None,
    ) -> None:
        self.transport = transport
        self.registry = registry
        self.metrics = metrics
        #: A stream whose first bytes take longer is given up (and retried elsewhere): the worker is stuck.
        self.first_byte_timeout_s = first_byte_timeout_s
        #: Requests waiting for a worker's first bytes, by worker: cut short when it goes down.
        self._waiting: dict[str, set[asyncio.Timeout]] = {}
        registry.listeners.append(self._on_health)

    def _on_health(self, worker_id: str, healthy: bool) -> None:
        """A worker went down: whoever still waits for its first bytes stops waiting now (and is retried)."""
        if healthy:
            return
        now = asyncio.get_running_loop().time()
        for waiting in self._waiting.get(worker_id, ()):
            waiting.reschedule(now)

    async def open(
        self,
        worker_id: str,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        started: float,
        *,
        stream: bool = False,
        early_head: bool = False,
    ) -> Opened:
        """Send and wait for the first bytes; UpstreamError only happens before any byte left for us.

        The wait ends early (kind ``stalled``, retryable) when the worker goes down meanwhile, and for a
        stream after ``first_byte_timeout_s``; a non-streamed answer comes whole, so only its read timeout
        bounds it. ``early_head``: an SSE answer returns with its head alone (see the module docstring)."""
        state = self.registry.get(worker_id)
        if state is None:
            raise UpstreamError("connect", f"worker {worker_id} was removed")
        self.registry.acquire(worker_id)
        waiting = asyncio.timeout(self.first_byte_timeout_s if stream else None)
        waiters = self._waiting.setdefault(worker_id, set())
        waiters.add(waiting)
        try:
            try:
                async with waiting:
                    upstream, first, rest = await self._first_bytes(state.url + path, method, headers, body, early_head)
            except TimeoutError:
                self.registry.probe_soon(worker_id)
                raise UpstreamError("stalled", f"worker {worker_id} sent no first byte in time") from None
        except UpstreamError as exc:
            self.registry.release(worker_id)
            self.metrics.upstream_errors.labels(worker_id, exc.kind).inc()
            if exc.kind == "connect":
                self.registry.record(worker_id, False, str(exc))  # passive health: count it like a probe
            raise
        except BaseException:
            self.registry.release(worker_id)
            raise
        finally:
            waiters.discard(waiting)
        return Opened(worker_id, upstream, first, rest, time.perf_counter() - started, started)

    async def _first_bytes(
        self, url: str, method: str, headers: list[tuple[str, str]], body: bytes, early_head: bool = False
    ) -> tuple[UpstreamResponse, bytes, AsyncGenerator[bytes, None] | None]:
        upstream = await self.transport.request(method, url, headers, body)
        try:
            ctype = next((v for k, v in upstream.headers if k.lower() == "content-type"), "")
            if ctype.startswith("text/event-stream"):
                # The client's status line is committed only after a real body byte: a worker that dies
                # after its headers (killed at that instant) is still retried elsewhere.
                chunks = upstream.chunks()
                first = b""
                if early_head:
                    return upstream, first, chunks
                async for chunk in chunks:  # skip empty reads; an exhausted body stays b""
                    if chunk:
                        first = chunk
                        break
                return upstream, first, chunks
            first = await upstream.read()
            await upstream.aclose()
            return upstream, first, None
        except BaseException:
            await upstream.aclose()
            raise

    def respond(
        self,
        opened: Opened,
        request_id: str,
        done: Done,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
        first_bytes: Callable[[], None] | None = None,
    ) -> Response:
        """The client's response; ``done`` runs once, when the last byte went out (or the client left).
        ``first_bytes`` runs once when an ``early_head`` stream's first body bytes came (or it ended without)."""
        worker = self.registry.get(opened.worker_id)
        headers = response_headers(opened.upstream.headers, request_id, worker.url if worker else None)
        if extra_headers:
            headers.extend(extra_headers)
        status = opened.upstream.status
        if opened.rest is None:
            self.registry.release(opened.worker_id)
            result = Result(opened.worker_id, status, opened.ttfb_s, None, status < 400)

            def report() -> None:  # after the answer went out: the client does not wait for the bookkeeping
                result.usage = usage_of(opened.first)
                done(result)

            return RawResponse(opened.first, status, headers, report)
        waiting = opened.awaits_first_bytes
        result = Result(opened.worker_id, status, None if waiting else opened.ttfb_s, ok=False)
        # The report comes after the stream's last chunk went out, so the client's answer ends first.
        content = self._stream(opened, result, first_bytes if waiting else None)
        return RawStreamingResponse(content, status, headers, lambda: done(result))

    async def _first_chunk(self, opened: Opened) -> bytes:
        """A stream's first body bytes (b"" when it ended without any) under :meth:`open`'s bounds: at most
        ``first_byte_timeout_s``, and cut short when the worker goes down. An early head has already gone to
        the client, so a stalled worker's stream ends with an error event rather than a retry."""
        rest = opened.rest
        assert rest is not None
        waiting = asyncio.timeout(self.first_byte_timeout_s)
        waiters = self._waiting.setdefault(opened.worker_id, set())
        waiters.add(waiting)
        try:
            async with waiting:
                async for chunk in rest:  # leaving the loop keeps the generator open for the rest
                    if chunk:
                        return chunk
                return b""
        except TimeoutError:
            self.registry.probe_soon(opened.worker_id)
            raise UpstreamError("stalled", f"worker {opened.worker_id} sent no first token in time") from None
        finally:
            waiters.discard(waiting)

    async def _stream(
        self, opened: Opened, result: Result, first_bytes: Callable[[], None] | None = None
    ) -> AsyncIterator[bytes]:
        """The worker's stream to the client; ``result`` says how it went once it ended."""
        rest = opened.rest
        assert rest is not None
        sniffer = UsageSniffer()
        try:
            if opened.first:
                sniffer.feed(opened.first)
                yield opened.first
            elif first := await self._first_chunk(opened):  # an early head: its first token is still to come
                result.ttfb_s = time.perf_counter() - opened.started
                if first_bytes is not None:
                    settle: Callable[[], None] = first_bytes
                    first_bytes = None  # once: not again when the stream ends
                    settle()
                sniffer.feed(first)
                yield first
            async for chunk in rest:
                sniffer.feed(chunk)
                yield chunk
            result.ok = opened.upstream.status < 400
        except UpstreamError as exc:
            # Bytes already reached the client: end the stream with an error event in the shape vLLM
            # uses for errors inside a stream (no [DONE]), so the client knows it is incomplete.
            self.metrics.upstream_errors.labels(opened.worker_id, exc.kind).inc()
            limited.warning(f"stream:{opened.worker_id}", "worker %s broke a stream: %s", opened.worker_id, exc)
            yield (
                b"data: "
                + error_body(502, f"the worker failed in the middle of the stream ({exc.kind})", "upstream_error")
                + b"\n\n"
            )
        finally:
            # Shielded: on a client disconnect the task is being cancelled, and the close must still happen
            # (it is what aborts the worker's generation).
            with anyio.CancelScope(shield=True):
                await rest.aclose()
                await opened.upstream.aclose()
            self.registry.release(opened.worker_id)
            result.usage = sniffer.usage
            if first_bytes is not None:  # ended (or failed) before its first bytes
                first_bytes()
