"""``kvroute serve``'s HTTP protocol sends a response's head with its first body bytes, in one write, and
never holds a head back when no body follows at once: raw sockets against the real server protocol.

TCP keeps no write boundaries a client could see, so the server's connections are recorded: each one's
real asyncio transport, behind a proxy that notes what every write call carried and passes it on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from kvroute.apps.http_protocol import guarded_protocol
from kvroute.router.http_body import BODY_COMPLETE

from tests.http.upstream import serve

BODY = b'{"ok":true}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/now``: head and body in the same step; ``/later``: the body 0.5 s after the head; ``/stream``:
    chunks; ``/read``: echoes the request body (read after the head, as with ``Expect: 100-continue``);
    ``/complete``: whether the scope said the body was in when the app started, then once it was read."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/complete":
        at_start = scope.get(BODY_COMPLETE, False)
        while (await receive()).get("more_body"):
            pass
        body = b"%d%d" % (at_start, scope.get(BODY_COMPLETE, False))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": body})
        return
    if path == "/read":
        message = await receive()
        body = message.get("body", b"")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
        return
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for part in (b"one,", b"two,", b"three"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(BODY))]})
    if path == "/later":
        await asyncio.sleep(0.5)
    await send({"type": "http.response.body", "body": BODY})


class RecordingTransport:
    """The connection's transport, recording the bytes of each write call (``writelines``: one call)."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._transport = transport
        self.writes = writes

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self._transport.write(data)

    def writelines(self, parts: Any) -> None:
        parts = list(parts)
        self.writes.append(b"".join(parts))
        self._transport.writelines(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def recorded_protocol(writes: list[bytes]) -> type[Any]:
    """``kvroute serve``'s protocol, its connections' writes recorded into ``writes``."""
    base = guarded_protocol(10.0, 0)

    def connection_made(self: Any, transport: asyncio.Transport) -> None:
        base.connection_made(self, RecordingTransport(transport, writes))

    return type("RecordedProtocol", (base,), {"connection_made": connection_made})


@dataclass
class Server:
    host: str
    port: int
    #: What each write call on the server's connections carried, in order.
    writes: list[bytes]


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    writes: list[bytes] = []
    async with serve(app, http=recorded_protocol(writes)) as url:
        host, _, port = url.removeprefix("http://").partition(":")
        yield Server(host, int(port), writes)


@contextlib.asynccontextmanager
async def connected(server: Server) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw connection to ``server``, closed after."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        yield reader, writer
    finally:
        writer.close()


def request(path: str, extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: t\r\n" + extra + b"\r\n"


async def test_head_and_body_leave_in_one_write(server: Server) -> None:
    async with connected(server) as (reader, writer):
        for _ in range(3):  # on a kept-alive connection too: every response's head is held for its body
            writer.write(request("/now"))
            first = await asyncio.wait_for(reader.read(65536), 5)  # waiting in recv when the server writes
            assert first.startswith(b"HTTP/1.1 200 OK\r\n")
            assert first.endswith(b"\r\n\r\n" + BODY), first
        assert len(server.writes) == 3 and all(
            w.startswith(b"HTTP/1.1 200 OK\r\n") and w.endswith(BODY) for w in server.writes
        )


async def test_a_head_without_body_yet_is_not_held(server: Server) -> None:
    async with connected(server) as (reader, writer):
        writer.write(request("/later"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.4)  # long before the body
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 11" in head
        assert await asyncio.wait_for(reader.readexactly(len(BODY)), 5) == BODY
        assert server.writes == [head, BODY]


async def test_streamed_chunks_arrive_whole_and_in_order(server: Server) -> None:
    async with connected(server) as (reader, writer):
        writer.write(request("/stream"))
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            data += await asyncio.wait_for(reader.read(65536), 5)
        head, _, body = data.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head
        assert body == b"4\r\none,\r\n4\r\ntwo,\r\n5\r\nthree\r\n0\r\n\r\n"
        assert (
            server.writes[0] == head + b"\r\n\r\n4\r\none,\r\n" and len(server.writes) == 4
        )  # the head with the first chunk


async def test_continue_goes_out_before_the_body_is_sent(server: Server) -> None:
    async with connected(server) as (reader, writer):
        writer.write(
            b"POST /read HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )  # no body until the server says so
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hello")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"hello"


async def test_the_scope_says_when_the_whole_body_is_in(server: Server) -> None:
    """What lets the app read a body that arrived with its head without a deadline, and keep one for a body
    still on its way."""
    async with connected(server) as (reader, writer):
        writer.write(b"POST /complete HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"11"  # in at the start
        writer.write(b"POST /complete HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nhello")
        await writer.drain()
        await asyncio.sleep(0.2)  # the app started and waits for the rest
        writer.write(b"world")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"01"  # on its way, then in


async def test_connection_close_sends_the_held_head_first(server: Server) -> None:
    async with connected(server) as (reader, writer):
        writer.write(request("/now", b"Connection: close\r\n"))
        data = await asyncio.wait_for(reader.read(), 5)  # to the server's close
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"connection: close" in data
        assert data.endswith(b"\r\n\r\n" + BODY)
        assert server.writes == [data]
