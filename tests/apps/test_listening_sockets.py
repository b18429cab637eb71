"""Sockets kvroute listens on itself: connections accepted on them have Nagle's algorithm off.

asyncio's loop sets ``TCP_NODELAY`` only on sockets made with ``IPPROTO_TCP``; on a socket made with
protocol 0 it leaves Nagle on, and a small write after another (a stream's first chunk after its
headers) then waits for the peer's delayed ACK, up to 40 ms, on a reused connection."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
from kvroute.apps.prefork import bind_shared
from kvroute.sim.worker import _listen


def _sim_socket() -> socket.socket:
    return _listen("127.0.0.1", 0)


def _shared_socket() -> socket.socket:
    sock = bind_shared("127.0.0.1", 0)
    sock.setblocking(False)
    return sock


@pytest.mark.parametrize("make", [_sim_socket, _shared_socket], ids=["sim worker", "serve --processes"])
async def test_accepted_connections_have_nagle_off(make: Callable[[], socket.socket]) -> None:
    loop = asyncio.get_running_loop()
    assert not type(loop).__module__.startswith("uvloop")  # the loop that needs the protocol set
    accepted: asyncio.Future[int] = loop.create_future()

    class Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    listening = make()
    server = await loop.create_server(Accept, sock=listening)
    try:
        _, writer = await asyncio.open_connection(*listening.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 10) == 1
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
