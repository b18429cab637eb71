"""KV-event publishing exactly as vLLM does it: ZMQ PUB with the bind-or-connect rule, 3-frame messages,
one batch per scheduler step, and a replay ROUTER socket serving the last ``buffer_steps`` batches.

:meth:`EventPublisher.source` is what ``GET /kv_event_sources`` reports for the rank: the endpoints as
really bound (port 0 resolved), so a router given only the worker's URL can subscribe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Literal, TypedDict

import zmq
import zmq.asyncio
from kvroute.indexer.events import REPLAY_END_SEQ, EventForm, KVEvent, decode_seq, encode_batch, encode_seq
from kvroute.sim.events import encode_batch_v033

log = logging.getLogger(__name__)

BindMode = Literal["auto", "bind", "connect"]


class KVEventSource(TypedDict):
    """One DP rank's entry of vLLM's ``GET /kv_event_sources`` (>= 0.32), field for field."""

    data_parallel_rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule: bind when the endpoint is a wildcard (``*``, ``::``) or ipc/inproc, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(sock: zmq.Socket[object], endpoint: str) -> str:
    """Bind, accepting port 0 for "any free port"; returns the endpoint actually bound."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class EventPublisher:
    """Publishes a worker's KV events; events added in one loop iteration form one batch (one step)."""

    def __init__(
        self,
        endpoint: str,
        *,
        mode: BindMode = "auto",
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        form: EventForm = "map",
        dp_rank: int = 0,
        replay_with_topic: bool = True,
        v033: bool = False,
    ) -> None:
        self.requested_endpoint = endpoint
        self.bind = vllm_binds(endpoint) if mode == "auto" else mode == "bind"
        self.topic = topic
        self.topic_bytes = topic.encode()
        self.requested_replay = replay_endpoint
        self.form: EventForm = form
        self.dp_rank = dp_rank
        self.hwm = hwm
        self.replay_with_topic = replay_with_topic
        self.v033 = v033
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(buffer_steps, 1))
        self.seq = 0
        self.endpoint = endpoint
        self.replay_endpoint: str | None = None
        self.batches_sent = 0
        self.batches_dropped = 0
        self._pending: list[KVEvent] = []
        self._flush_scheduled = False
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    def start(self, ctx: zmq.Context[zmq.Socket[bytes]], actx: zmq.asyncio.Context) -> None:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        self._pub = pub  # owned from here: close() releases it even if the bind below fails
        if self.bind:
            self.endpoint = _bind(pub, self.requested_endpoint)
        else:
            pub.connect(self.requested_endpoint)
        if self.requested_replay:
            replay = actx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            self._replay = replay
            self.replay_endpoint = _bind(replay, self.requested_replay)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def source(self) -> KVEventSource:
        """This rank's discovery entry: bound endpoints as ZMQ resolved them, the configured one when the
        PUB connects (the router's SUB is bound there), the replay ROUTER's bound address or None."""
        return {
            "data_parallel_rank": self.dp_rank,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
        }

    # -- publishing ----------------------------------------------------------------------------------

    def add(self, event: KVEvent) -> None:
        """Queue an event for the current step's batch (flushed at the end of this loop iteration)."""
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (sync use): publish at once
                self.flush()

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        events, self._pending = self._pending, []
        if self.v033:
            payload = encode_batch_v033(time.time(), events, self.dp_rank)
        else:
            payload = encode_batch(time.time(), events, self.dp_rank, form=self.form)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self._pub is None:
            return
        try:
            self._pub.send_multipart([self.topic_bytes, encode_seq(seq), payload], flags=zmq.NOBLOCK)
            self.batches_sent += 1
        except zmq.Again:
            self.batches_dropped += 1  # past the high-water mark: vLLM drops too

    # -- replay --------------------------------------------------------------------------------------

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as exc:
                log.warning("replay socket error: %s", exc)
                return
            if len(frames) < 3:
                continue  # not [identity, "", start_seq]: ignore, never crash
            identity, start_frame = frames[0], frames[-1]
            try:
                start = decode_seq(start_frame)
            except ValueError:
                continue
            try:
                for seq, payload in list(self.buffer):
                    if seq >= start:
                        await sock.send_multipart(self._replay_frames(identity, encode_seq(seq), payload))
                await sock.send_multipart(self._replay_frames(identity, REPLAY_END_SEQ, b"", end=True))
            except zmq.ZMQError as exc:
                log.warning("replay send failed: %s", exc)

    def _replay_frames(self, identity: bytes, seq: bytes, payload: bytes, *, end: bool = False) -> list[bytes]:
        """``["", topic, seq, payload]``; the end marker's topic frame is empty, as vLLM 0.32-0.33 send it
        (``_service_replay`` in ``vllm/distributed/kv_events.py``)."""
        if self.replay_with_topic:
            return [identity, b"", b"" if end else self.topic_bytes, seq, payload]
        return [identity, b"", seq, payload]

    async def close(self) -> None:
        self.flush()
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._replay is not None:
            self._replay.close(0)
        if self._pub is not None:
            self._pub.close(0)
