"""A stand-in for a vLLM engine's KV-event side, speaking the exact wire format (DESIGN §4).

``Chain`` hands out random per-process block hashes the way vLLM does; ``Publisher`` owns a real
ZMQ publisher (XPUB, wire-compatible with vLLM's PUB, so tests can wait for the subscription) and a
ROUTER replay socket with a bounded buffer, like vLLM's ``buffer_steps``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio
from kvroute.indexer.events import (
    REPLAY_END_SEQ,
    BlockRemoved,
    BlockStored,
    KVEvent,
    encode_batch,
    encode_seq,
)
from kvroute.indexer.service import KVIndexer
from kvroute.sim.events import encode_batch_v033

from tests.polling import eventually as eventually


def count(indexer: KVIndexer, name: str, **labels: str) -> float:
    """A sample of the indexer's own metrics registry (0 when the series does not exist yet)."""
    return indexer.metrics.registry.get_sample_value(name, labels) or 0.0


class Chain:
    """Prompts -> BlockStored events with vLLM-like random hashes and parent links."""

    def __init__(self, block_size: int = 16, seed: int = 0, int_hashes: bool = True) -> None:
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.int_hashes = int_hashes
        self.by_prefix: dict[tuple[int, ...], int | bytes] = {}

    def _new_hash(self) -> int | bytes:
        if self.int_hashes:
            return self.rng.getrandbits(64)
        return self.rng.randbytes(32)

    def hashes(self, tokens: Sequence[int]) -> list[int | bytes]:
        """Hashes of the full blocks of ``tokens`` (known ones reused)."""
        out = []
        bs = self.block_size
        for i in range(len(tokens) // bs):
            prefix = tuple(tokens[: (i + 1) * bs])
            h = self.by_prefix.get(prefix)
            if h is None:
                h = self.by_prefix[prefix] = self._new_hash()
            out.append(h)
        return out

    def store(
        self,
        tokens: Sequence[int],
        start_block: int = 0,
        *,
        medium: str = "GPU",
        extra_keys: list | None = None,
        lora_name: str | None = None,
        locality: str = "LOCAL",
        placeholder: bool = False,
    ) -> BlockStored:
        """The event for blocks ``start_block..`` of ``tokens`` (the earlier ones are the parent chain)."""
        bs = self.block_size
        hashes = self.hashes(tokens)
        parent = hashes[start_block - 1] if start_block > 0 else None
        new = hashes[start_block:]
        return BlockStored(
            block_hashes=new,
            parent_block_hash=parent,
            token_ids=[] if placeholder else list(tokens[start_block * bs : len(hashes) * bs]),
            block_size=0 if placeholder else bs,
            medium=medium,
            lora_name=lora_name,
            extra_keys=extra_keys,
            locality=locality,
        )

    def remove(self, tokens: Sequence[int], blocks: Sequence[int], medium: str = "GPU") -> BlockRemoved:
        hashes = self.hashes(tokens)
        return BlockRemoved(block_hashes=[hashes[i] for i in blocks], medium=medium)


def frames(events: Sequence[KVEvent], seq: int, dp_rank: int = 0, topic: bytes = b"", form: str = "map") -> list[bytes]:
    return [topic, encode_seq(seq), encode_batch(time.time(), list(events), dp_rank, form=form)]  # type: ignore[arg-type]


def frames_v033(events: Sequence[KVEvent], seq: int, dp_rank: int = 0, topic: bytes = b"") -> list[bytes]:
    """A message as vLLM 0.33 encodes it: its optional fields (groups, ownership, lookahead) only when set."""
    return [topic, encode_seq(seq), encode_batch_v033(time.time(), list(events), dp_rank)]


class Publisher:
    """One engine rank's KV-event publisher with a replay socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        topic: str = "",
        connect: str | None = None,
        buffer_steps: int = 10_000,
        dp_rank: int = 0,
        port: int | None = None,
        replay_port: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect:
            self.pub.connect(connect)
            self.endpoint = connect
        else:
            if port is None:
                port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            else:
                self.pub.bind(f"tcp://127.0.0.1:{port}")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if replay_port is None:
            replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.replay_requests: list[int] = []
        self.old_style_replay = False
        #: Answer at most this many batches per request and no end marker, as an engine's ROUTER does
        #: when its send queue overflows (it drops the rest instead of waiting).
        self.replay_cut: int | None = None
        #: Leave out the batches at these positions of the next answer, end marker kept: what a ROUTER whose
        #: send queue filled for a moment drops from the middle of a reply (its consumer starved of CPU).
        self.replay_holes: set[int] = set()
        #: Seconds between replayed batches (an engine busy with its own work answers slowly).
        self.replay_pause_s = 0.0
        self._task = asyncio.create_task(self._serve_replay())

    async def wait_subscribed(self, timeout: float = 10.0) -> None:
        """XPUB hands us the subscription message once a subscriber is really listening."""
        msg = await asyncio.wait_for(self.pub.recv(), timeout)
        assert msg[:1] == b"\x01"

    async def publish(self, events: Sequence[KVEvent], *, lose: bool = False, form: str = "map") -> int:
        """Publish one batch (``lose=True``: keep it in the replay buffer but never deliver it)."""
        seq = self.seq
        self.seq += 1
        payload = encode_batch(time.time(), list(events), self.dp_rank, form=form)  # type: ignore[arg-type]
        self.buffer.append((seq, payload))
        if not lose:
            await self.pub.send_multipart([self.topic, encode_seq(seq), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """An engine restart: sequence back to 0, replay buffer empty."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            answer = [(seq, payload) for seq, payload in self.buffer if seq >= first]
            cut = self.replay_cut is not None and len(answer) > self.replay_cut
            holes, self.replay_holes = self.replay_holes, set()
            for at, (seq, payload) in enumerate(answer[: self.replay_cut] if cut else answer):
                if at in holes:
                    continue
                if self.replay_pause_s:
                    await asyncio.sleep(self.replay_pause_s)
                if self.old_style_replay:
                    await self.router.send_multipart([ident, b"", encode_seq(seq), payload])
                else:
                    await self.router.send_multipart([ident, b"", self.topic, encode_seq(seq), payload])
            if not cut:
                await self.router.send_multipart([ident, b"", REPLAY_END_SEQ, b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(0)
        self.router.close(0)
