"""Test-side ZMQ clients for a real vLLM's KV events: a live SUB tap and a replay DEALER.

Why here and not in ``kvroute.indexer``: these are the tier's independent witnesses. They read the
raw frames exactly as vLLM sends them, so the indexer's own subscriber can be checked against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq
import zmq.asyncio
from kvroute.indexer.events import REPLAY_END_SEQ, decode_seq

from tests.polling import eventually

from .servers import VllmServer


@dataclass(slots=True, frozen=True)
class RawBatch:
    """One published message: topic, sequence number and the untouched msgpack payload."""

    topic: bytes
    seq: int
    payload: bytes


class EventTap:
    """A SUB socket on one server's event stream, bound or connected the way the server needs.

    vLLM with a ``tcp://host:port`` endpoint connects to us, so we bind; with ``ipc://`` it binds,
    so we connect. Only one tap (or indexer subscriber) may bind a connect-mode endpoint at a time:
    use it as an async context manager so the port is released at the end of each test.
    """

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.ctx = zmq.asyncio.Context.instance()
        self.sock: zmq.asyncio.Socket | None = None
        self.batches: list[RawBatch] = []

    async def __aenter__(self) -> EventTap:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.server.topic.encode())
        if self.server.vllm_binds_events:
            sock.connect(self.server.events)
        else:
            sock.bind(self.server.events)
        self.sock = sock
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    async def receive(self, timeout: float) -> RawBatch | None:
        """The next message, or None when nothing arrives within ``timeout`` seconds."""
        assert self.sock is not None
        if not await self.sock.poll(timeout * 1000):
            return None
        frames = await self.sock.recv_multipart()
        if len(frames) != 3:
            raise AssertionError(f"expected 3 frames, got {len(frames)}")
        batch = RawBatch(frames[0], decode_seq(frames[1]), frames[2])
        self.batches.append(batch)
        return batch

    async def drain(self, quiet: float = 1.0) -> list[RawBatch]:
        """Everything that arrives until the stream stays quiet for ``quiet`` seconds."""
        got: list[RawBatch] = []
        while (batch := await self.receive(quiet)) is not None:
            got.append(batch)
        return got


async def replay(server: VllmServer, start_seq: int = 0, timeout: float = 30.0) -> list[RawBatch]:
    """Every buffered batch with seq >= ``start_seq`` from the server's replay ROUTER, via a DEALER."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.replay)
    got: list[RawBatch] = []
    try:
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            if not await sock.poll(timeout * 1000):
                raise AssertionError(f"replay from {server.name} stalled after {len(got)} batches")
            frames = await sock.recv_multipart()
            # ["", topic, seq, payload]; engines before the topic frame send ["", seq, payload].
            body = frames[1:] if frames and frames[0] == b"" else frames
            if len(body) == 2:
                body = [server.topic.encode(), *body]
            if len(body) != 3:
                raise AssertionError(f"unexpected replay frames: {[len(f) for f in frames]}")
            topic, seq_frame, payload = body
            if seq_frame == REPLAY_END_SEQ:
                return got
            got.append(RawBatch(topic, decode_seq(seq_frame), payload))
    finally:
        sock.close(linger=0)


async def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    """Poll an async or sync predicate until true; a generous wait, never a timing assertion."""
    await eventually(predicate, timeout, interval, what)
