"""The P2P control channel between simulated workers (ZMQ ROUTER server, DEALER clients).

Messages are msgpack maps. Lookups answer HIT / MISS / HIT_PENDING / RETRY with a block count; a
fetch makes the *provider* pay the transfer time (bytes / link bandwidth) before it answers, so the
provider's metrics show the bytes it really sent. The same port serves NIXL-style reads by block id
(the side channel vLLM's NixlConnector uses for the handshake).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

HIT, MISS, HIT_PENDING, RETRY = "HIT", "MISS", "HIT_PENDING", "RETRY"

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class P2PServer:
    """Answers peers on ``tcp://host:port``; each message is handled in its own task."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self.port = 0
        self.bad_messages = 0

    def start(self, actx: zmq.asyncio.Context, host: str, port: int) -> int:
        sock = actx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if port:
            sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = sock.bind_to_random_port(f"tcp://{host}")
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._serve())
        return self.port

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as exc:
                log.warning("p2p socket error: %s", exc)
                return
            if len(frames) != 3:
                self.bad_messages += 1
                continue
            task = asyncio.get_running_loop().create_task(self._answer(frames[0], frames[2]))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _answer(self, identity: bytes, body: bytes) -> None:
        try:
            msg = _decoder.decode(body)
            if not isinstance(msg, dict):
                raise ValueError("message must be a map")
            nonce = msg.get("nonce")
            reply = await self._handler(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a peer's bad message must never kill the worker
            self.bad_messages += 1
            nonce = None
            reply = {"status": "ERROR", "error": str(exc)[:200]}
            with contextlib.suppress(Exception):
                nonce = _decoder.decode(body).get("nonce")
        reply["nonce"] = nonce
        sock = self._sock
        if sock is None:  # closed while the handler ran
            return
        with contextlib.suppress(zmq.ZMQError):
            await sock.send_multipart([identity, b"", _encoder.encode(reply)])

    async def close(self) -> None:
        for task in [self._task, *self._inflight]:
            if task is not None:
                task.cancel()
        for task in [self._task, *self._inflight]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._sock is not None:
            self._sock.close(0)


class P2PClient:
    """One DEALER per peer endpoint, replies matched to calls by nonce."""

    def __init__(self, actx: zmq.asyncio.Context) -> None:
        self._actx = actx
        self._peers: dict[str, zmq.asyncio.Socket] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._nonces = itertools.count(1)

    def _socket(self, host: str, port: int) -> zmq.asyncio.Socket:
        endpoint = f"tcp://{host}:{port}"
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self._actx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._peers[endpoint] = sock
            self._readers[endpoint] = asyncio.get_running_loop().create_task(self._read(sock))
        return sock

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
                reply = _decoder.decode(frames[-1])
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except (zmq.ZMQError, msgspec.DecodeError):
                continue
            nonce = reply.get("nonce") if isinstance(reply, dict) else None
            if isinstance(nonce, int):
                future = self._waiting.pop(nonce, None)
                if future is not None and not future.done():
                    future.set_result(reply)

    async def call(self, host: str, port: int, msg: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """Send one message and wait for its reply; None on timeout (the caller recomputes)."""
        nonce = next(self._nonces)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[nonce] = future
        try:
            await self._socket(host, port).send_multipart([b"", _encoder.encode({**msg, "nonce": nonce})])
            return await asyncio.wait_for(future, timeout)
        except (TimeoutError, zmq.ZMQError):
            return None
        finally:
            self._waiting.pop(nonce, None)

    async def close(self) -> None:
        for task in self._readers.values():
            task.cancel()
        for task in self._readers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in self._peers.values():
            sock.close(0)
        self._peers.clear()
        self._readers.clear()
