"""kvroute's own upstream client (``router/native_http.py``) against real servers on 127.0.0.1: uvicorn (what
vLLM serves with) and raw TCP servers writing exact HTTP/1.1 bytes (framings, broken answers, closes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from kvroute.router.native_http import NativeTransport
from kvroute.router.transport import UpstreamError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.http.upstream import free_port, raw_server, serve


def echo_app() -> Starlette:
    async def echo(request: Request) -> Response:
        body = await request.body()
        headers = {"x-method": request.method, "x-host": request.headers.get("host", "")}
        headers["x-seen"] = ",".join(sorted(k for k in request.headers if k.startswith("x-")))
        return Response(body, headers=headers, media_type="application/octet-stream")

    async def stream(request: Request) -> Response:
        n = int(request.query_params.get("n", "3"))

        async def events() -> AsyncIterator[bytes]:
            for i in range(n):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def big(request: Request) -> Response:
        return Response(b"x" * int(request.query_params["size"]))

    routes = [
        Route("/echo", echo, methods=["GET", "POST"]),
        Route("/stream", stream, methods=["POST"]),
        Route("/big", big),
    ]
    return Starlette(routes=routes)


@pytest.fixture
async def app_url() -> AsyncIterator[str]:
    async with serve(echo_app()) as url:
        yield url


@pytest.fixture
async def transport() -> AsyncIterator[NativeTransport]:
    t = NativeTransport(connect_timeout=2.0, read_timeout=5.0)
    yield t
    await t.aclose()


async def test_bodies_headers_and_keep_alive(app_url: str, transport: NativeTransport) -> None:
    body = b'{"prompt": "' + b"w " * 100_000 + b'"}'  # ~200 KB: more than one socket write
    for _ in range(5):
        resp = await transport.request("POST", app_url + "/echo", [("X-Trace", "1"), ("content-type", "x")], body)
        assert resp.status == 200
        assert await resp.read() == body
        headers = dict((k.lower(), v) for k, v in resp.headers)
        assert headers["x-method"] == "POST" and headers["x-host"] == app_url.removeprefix("http://")
        assert headers["x-seen"] == "x-trace"
        await resp.aclose()
    assert transport.opened == 1  # one connection served all five


async def test_a_streamed_body_comes_as_it_is_sent(app_url: str, transport: NativeTransport) -> None:
    resp = await transport.request("POST", app_url + "/stream?n=50", [], b"{}")
    assert dict((k.lower(), v) for k, v in resp.headers)["content-type"].startswith("text/event-stream")
    got = b"".join([chunk async for chunk in resp.chunks()])
    assert got == b"".join(f"data: {i}\n\n".encode() for i in range(50))
    again = await transport.request("GET", app_url + "/echo", [], b"")
    assert again.status == 200 and await again.read() == b""
    assert transport.opened == 1


async def test_closing_a_stream_early_closes_its_connection(app_url: str, transport: NativeTransport) -> None:
    resp = await transport.request("POST", app_url + "/stream?n=1000", [], b"{}")
    chunks = resp.chunks()
    assert (await chunks.__anext__()).startswith(b"data: 0")
    await chunks.aclose()
    await resp.aclose()
    after = await transport.request("GET", app_url + "/echo", [], b"")
    await after.read()
    assert transport.opened == 2  # the aborted one was not reused


async def test_a_large_body_is_read_past_the_pause_threshold(app_url: str) -> None:
    transport = NativeTransport(2.0, 5.0, high_water=64 * 1024)
    try:
        resp = await transport.request("GET", app_url + "/big?size=3000000", [], b"")
        total = 0
        async for chunk in resp.chunks():
            total += len(chunk)
            await asyncio.sleep(0)  # a slow reader: the transport pauses and resumes
        assert total == 3_000_000
    finally:
        await transport.aclose()


async def test_header_values_with_line_breaks_are_never_sent(app_url: str, transport: NativeTransport) -> None:
    resp = await transport.request("POST", app_url + "/echo", [("x-evil", "a\r\nx-injected: 1"), ("x-ok", "1")], b"")
    headers = dict((k.lower(), v) for k, v in resp.headers)
    assert headers["x-seen"] == "x-ok"
    await resp.aclose()


async def test_refused_connection_is_a_connect_error(transport: NativeTransport) -> None:
    with pytest.raises(UpstreamError) as info:
        await transport.request("GET", f"http://127.0.0.1:{free_port()}/x", [], b"")
    assert info.value.kind == "connect"


async def test_no_answer_is_a_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(2)
        writer.close()

    transport = NativeTransport(1.0, 0.2)
    async with raw_server(silent) as url:
        with pytest.raises(UpstreamError) as info:
            await transport.request("GET", url + "/", [], b"")
    assert info.value.kind == "timeout"
    await transport.aclose()


@contextlib.asynccontextmanager
async def answering(*answers: bytes) -> AsyncIterator[str]:
    """A server writing ``answers`` in turn, one per request read, on the same connection; then closing."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            for answer in answers:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
        writer.close()

    async with raw_server(handle) as url:
        yield url


async def test_framings(transport: NativeTransport) -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    sized = b"HTTP/1.1 201 Created\r\ncontent-length: 3\r\n\r\nabc"
    async with answering(chunked, sized) as url:
        first = await transport.request("GET", url + "/", [], b"")
        assert (first.status, await first.read()) == (200, b"hello world")
        second = await transport.request("GET", url + "/", [], b"")
        assert (second.status, await second.read()) == (201, b"abc")
    assert transport.opened == 1
    to_close = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end"
    async with answering(to_close) as url:
        resp = await transport.request("GET", url + "/", [], b"")
        assert await resp.read() == b"until the end"


async def test_chunks_that_arrive_together_are_read_as_one_piece(transport: NativeTransport) -> None:
    """Events a worker wrote in a burst reach the client in one write, not one write and one loop turn each."""
    burst = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n1\r\n!\r\n0\r\n\r\n"
    async with answering(burst) as url:
        resp = await transport.request("GET", url + "/", [], b"")
        assert [piece async for piece in resp.chunks()] == [b"hello world!"]


async def test_a_truncated_body_is_a_protocol_error(transport: NativeTransport) -> None:
    async with answering(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this") as url:
        resp = await transport.request("GET", url + "/", [], b"")
        with pytest.raises(UpstreamError) as info:
            await resp.read()
    assert info.value.kind == "protocol"


async def test_a_malformed_answer_is_a_protocol_error(transport: NativeTransport) -> None:
    async with answering(b"SMTP ready\r\n\r\n") as url:
        with pytest.raises(UpstreamError) as info:
            await transport.request("GET", url + "/", [], b"")
    assert info.value.kind == "protocol"


async def test_a_pooled_connection_closed_by_the_server_is_retried_on_a_new_one(transport: NativeTransport) -> None:
    """The server answers once and closes the kept-alive connection (as uvicorn does after its keep-alive
    timeout): the next request must not fail for it."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    served = 0

    async def once_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            served += 1
            await asyncio.sleep(0.05)  # keep-alive is announced, then the server closes anyway
        writer.close()

    async with raw_server(once_per_connection) as url:
        for _ in range(3):
            resp = await transport.request("POST", url + "/", [], b"{}")
            assert await resp.read() == b"ok"
            await asyncio.sleep(0.1)  # the close has happened by now, or happens as the request goes out
    assert served == 3


async def test_at_most_max_connections_are_open(app_url: str) -> None:
    transport = NativeTransport(2.0, 5.0, max_connections=2)
    try:
        held = [await transport.request("POST", app_url + "/stream?n=3", [], b"{}") for _ in range(2)]
        third = asyncio.create_task(transport.request("GET", app_url + "/echo", [], b""))
        await asyncio.sleep(0.2)
        assert not third.done()  # waits for a free slot
        await held[0].read()
        resp = await asyncio.wait_for(third, 5)
        assert resp.status == 200
        await resp.aclose()
        await held[1].aclose()
    finally:
        await transport.aclose()


async def test_a_reused_connection_hung_up_before_any_answer_byte_is_retried_once(transport: NativeTransport) -> None:
    """The race the pool cannot see: the server takes the next request on a kept-alive connection and
    hangs up without a byte. The request goes again, once, on a new connection."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    connections = 0

    async def answers_once_then_hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")  # the next request on this connection: no answer
        writer.transport.abort()

    async with raw_server(answers_once_then_hangs_up) as url:
        for _ in range(3):
            resp = await transport.request("POST", url + "/", [], b"{}")
            assert await resp.read() == b"ok"
    assert connections == 3 and transport.opened == 3


async def test_a_fresh_connection_hung_up_is_not_retried(transport: NativeTransport) -> None:
    async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
        writer.transport.abort()

    async with raw_server(hangs_up) as url:
        with pytest.raises(UpstreamError) as info:
            await transport.request("POST", url + "/", [], b"{}")
    assert info.value.kind == "protocol" and transport.opened == 1


def test_under_uvloop() -> None:
    """``kvroute serve`` runs on uvloop, whose transports are its own classes: the same exchanges there."""
    import uvloop

    async def scenario() -> None:
        async with serve(echo_app()) as url:
            transport = NativeTransport(2.0, 5.0)
            try:
                for _ in range(3):
                    resp = await transport.request("POST", url + "/echo", [], b"abc")
                    assert await resp.read() == b"abc"
                resp = await transport.request("POST", url + "/stream?n=20", [], b"{}")
                assert b"".join([c async for c in resp.chunks()]).count(b"data: ") == 20
                assert transport.opened == 1
                big = await transport.request("GET", url + "/big?size=2000000", [], b"")
                assert len(await big.read()) == 2_000_000
            finally:
                await transport.aclose()

    uvloop.run(scenario())
