"""kvroute's own upstream HTTP/1.1 client: asyncio protocols, httptools' parser, a keep-alive pool per worker.

Why not aiohttp on the hot path: its client builds a request object, a header multidict, a timer and a
tracing context per call; with a 1-token prompt that was 40 % of the router's time per request (py-spy,
docs/benchmarks.md "The upstream client"). The router needs a small part of HTTP to talk to vLLM workers:
one request per connection at a time, a body of bytes, a response with ``Content-Length``, chunked or
read-to-close framing, and the body as it arrives. That part is here; parsing is httptools' (llhttp, the
parser Node.js uses, already what uvicorn parses the clients with).

Behaviour a proxy needs and that is kept:

* connections are reused (most recently used first) and dropped after ``keepalive_s`` idle, below
  uvicorn's 5 s keep-alive (vLLM's server), so a pooled connection is seldom closed under us; when it is
  (no byte of the answer came back on a reused connection), the request goes once more on a new one;
* a response body is read as it arrives and reading pauses past ``high_water`` buffered bytes (a slow
  client never makes the router hold a whole stream); what arrived together is handed on as one piece
  (a burst of SSE events costs one write to the client, not one each);
* closing a response before its end closes the connection: that is what aborts the worker's generation;
* failures map to :class:`~kvroute.router.transport.UpstreamError` like the other transports
  (``connect``, ``timeout``, ``protocol``), header values are never sent with CR or LF in them, and at most
  ``max_connections`` are open at once.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncGenerator, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools
from kvroute.router.transport import Transport, UpstreamError, UpstreamResponse

#: Headers the client writes itself (framing and routing); a caller's are dropped.
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"})


class _Connection(asyncio.Protocol):
    """One upstream connection and the response being read on it."""

    def __init__(self, key: tuple[str, str, int], high_water: int) -> None:
        self.key = key
        self.high_water = high_water
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.busy = False
        self.begin()

    def begin(self) -> None:
        """Ready for the next response."""
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.headers_done = False
        self.until_eof = False
        self.keep_alive = False
        self.complete = False
        self.got_bytes = False
        self.error: UpstreamError | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes nobody asked for: the connection cannot be trusted any more
            self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamError("protocol", f"malformed response from upstream: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport: half-open upstream connections are not kept

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy and not self.complete:
            if self.headers_done and self.until_eof:
                self.complete = True  # a read-to-close body ends here
                self.wake()
            else:
                why = f": {exc!r}" if exc else ""
                self.fail(UpstreamError("protocol", f"upstream closed the connection{why}"))

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        names = {k.lower() for k, _ in self.headers}
        self.until_eof = "content-length" not in names and "transfer-encoding" not in names
        self.headers_done = True
        self.wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > self.high_water and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self.wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.wake()

    # -- the reader's side

    def fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until the parser has news (headers, body, the end, an error); UpstreamError on ``timeout``."""
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        # A timer that fails the future, not asyncio.timeout: that one cancels and un-cancels the task, which
        # cost several times more per wait on the request path (a stream waits once per chunk).
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def take(self) -> bytes:
        """Everything the parser has queued, as one piece: chunks that arrived together leave together (one
        write to the client, one turn of the relay instead of one per chunk)."""
        chunks = self.chunks
        if len(chunks) == 1:
            chunk = chunks.popleft()
            self.buffered -= len(chunk)
        else:
            chunk = b"".join(chunks)
            chunks.clear()
            self.buffered = 0
        if self.paused and self.buffered <= self.high_water // 4 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamError("timeout", "upstream read timed out"))


class _NativeResponse(UpstreamResponse):
    __slots__ = ("_conn", "_done", "_owner", "_timeout", "headers", "status")

    def __init__(self, owner: NativeTransport, conn: _Connection, read_timeout: float) -> None:
        self._owner = owner
        self._conn = conn
        self._timeout = read_timeout
        self._done = False
        self.status = conn.status
        self.headers = conn.headers

    async def _next(self) -> bytes | None:
        """The body's next piece (all that is queued, at least one byte); None once it ended."""
        conn = self._conn
        while not self._done:
            if conn.chunks:
                return conn.take()
            if conn.error is not None:
                self._finish(reuse=False)
                raise conn.error
            if conn.complete:
                self._finish(reuse=conn.keep_alive and not conn.until_eof)
            else:
                await conn.wait(self._timeout)
        return None

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        while (piece := await self._next()) is not None:
            yield piece

    async def read(self) -> bytes:
        # Not through chunks(): an async generator per answer registers with the loop's hooks (a weak set).
        parts = []
        while (piece := await self._next()) is not None:
            parts.append(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _finish(self, reuse: bool) -> None:
        if not self._done:
            self._done = True
            self._owner._release(self._conn, reuse)

    async def aclose(self) -> None:
        self._finish(reuse=False)  # before the end: closing is what aborts the upstream request


class NativeTransport(Transport):
    """HTTP/1.1 to the workers over pooled asyncio connections (see the module docstring)."""

    name = "native"

    def __init__(
        self,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int = 1024,
        *,
        keepalive_s: float = 4.0,
        max_idle_per_host: int = 256,
        high_water: int = 1 << 20,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive_s = keepalive_s
        self.max_idle_per_host = max_idle_per_host
        self.high_water = high_water
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._targets: dict[str, tuple[tuple[str, str, int], bytes, bytes]] = {}
        self.opened = 0  #: connections opened (tests and stats: reuse is visible)

    def _target(self, url: str) -> tuple[tuple[str, str, int], bytes, bytes]:
        """(scheme, host, port), the request target and the Host header of ``url`` (memoized: a few URLs)."""
        found = self._targets.get(url)
        if found is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamError("connect", f"not an http(s) URL: {url!r}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            found = ((parts.scheme, parts.hostname, port), target.encode("latin-1"), parts.netloc.encode("latin-1"))
            if len(self._targets) < 4096:
                self._targets[url] = found
        return found

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(key, self.high_water), host, port, ssl=context
                )
        except TimeoutError:
            raise UpstreamError("connect", f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect to {host}:{port}: {exc!r}") from exc
        self.opened += 1
        return conn

    def _protocol(self, key: tuple[str, str, int]) -> Callable[[], _Connection]:
        return lambda: _Connection(key, self.high_water)

    def _pooled(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Connection, reuse: bool) -> None:
        conn.busy = False
        self._slots.release()
        if not reuse or conn.closed or conn.chunks:
            conn.close()
            return
        idle = self._idle.setdefault(conn.key, collections.deque())
        if len(idle) >= self.max_idle_per_host:
            idle.popleft().close()
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def request(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes) -> UpstreamResponse:
        key, target, host = self._target(url)
        lines = [method.encode("latin-1"), b" ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
        for name, value in headers:
            if name.lower() in _OWN_HEADERS or "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                continue
            lines += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
        if body or method in ("POST", "PUT", "PATCH"):
            lines += (b"Content-Length: ", str(len(body)).encode(), b"\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        await self._slots.acquire()
        try:
            conn = self._pooled(key)
            if conn is not None:
                try:
                    return await self._exchange(conn, head, body)
                except UpstreamError as exc:
                    if conn.got_bytes or exc.kind == "timeout":
                        raise
                    # A reused connection closed under us before any byte of the answer: once more, fresh.
            return await self._exchange(await self._connect(key), head, body)
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes) -> _NativeResponse:
        """Write the request on ``conn`` and wait for the response headers (the slot is the caller's)."""
        conn.begin()
        conn.busy = True
        transport = conn.transport
        try:
            if transport is None or conn.closed:
                raise UpstreamError("protocol", "upstream connection already closed")
            transport.writelines((head, body) if body else (head,))
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.read_timeout)
        except BaseException:
            conn.busy = False
            conn.close()
            raise
        return _NativeResponse(self, conn, self.read_timeout)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()
