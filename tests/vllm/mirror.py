"""An oracle for the routing tests: each worker's true prefix cache, rebuilt from its replay buffer.

Independent of kvroute's index on purpose (its own keys: Python tuples of tokens chained by
parent, and per-hash copy counts, since vLLM can hold two copies of one block and announces each
removal). It answers what the best worker could serve for a request, right now.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvroute.indexer.events import BlockRemoved, BlockStored, decode_batch

from .kvwire import replay
from .servers import BLOCK_SIZE, VllmServer
from .workload import engine_cached

Key = int


def block_key(parent: Key | None, tokens: list[int]) -> Key:
    return hash((parent, tuple(tokens)))


@dataclass
class WorkerMirror:
    server: VllmServer
    next_seq: int = 0
    key_of: dict[int | bytes, Key] = field(default_factory=dict)
    copies: dict[Key, int] = field(default_factory=dict)

    async def catch_up(self, settle_s: float = 0.2) -> None:
        """Apply new batches until two polls ``settle_s`` apart bring nothing new."""
        quiet = 0
        while quiet < 2:
            batches = await replay(self.server, self.next_seq)
            if batches and batches[0].seq != self.next_seq:
                # The engine restarted (or the buffer wrapped): start the mirror over.
                self.next_seq, self.key_of, self.copies = 0, {}, {}
                continue
            for raw in batches:
                self.apply(raw.payload)
                self.next_seq = raw.seq + 1
            quiet = 0 if batches else quiet + 1
            await asyncio.sleep(settle_s)

    def apply(self, payload: bytes) -> None:
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored):
                parent = None if event.parent_block_hash is None else self.key_of[event.parent_block_hash]
                for i, h in enumerate(event.block_hashes):
                    parent = block_key(parent, event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
                    self.key_of[h] = parent
                    self.copies[parent] = self.copies.get(parent, 0) + 1
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    key = self.key_of.get(h)
                    if key is not None and self.copies.get(key, 0) > 0:
                        self.copies[key] -= 1
                        if not self.copies[key]:
                            del self.copies[key]

    def cached_blocks(self, tokens: list[int]) -> int:
        parent: Key | None = None
        for n in range(len(tokens) // BLOCK_SIZE):
            parent = block_key(parent, tokens[n * BLOCK_SIZE : (n + 1) * BLOCK_SIZE])
            if parent not in self.copies:
                return n
        return len(tokens) // BLOCK_SIZE


class Oracle:
    """The best cached tokens any worker of the pool could give a request."""

    def __init__(self, servers: list[VllmServer]) -> None:
        self.mirrors = {s.name: WorkerMirror(s) for s in servers}

    async def catch_up(self) -> None:
        await asyncio.gather(*(m.catch_up() for m in self.mirrors.values()))

    def per_worker(self, tokens: list[int]) -> dict[str, int]:
        return {name: engine_cached(len(tokens), m.cached_blocks(tokens)) for name, m in self.mirrors.items()}

    def best(self, tokens: list[int]) -> int:
        return max(self.per_worker(tokens).values())
