"""A paged KV cache with vLLM's prefix-caching semantics and an optional CPU tier.

Full blocks only, a chain hash per block (seeded per process unless a seed is given, like vLLM without
``PYTHONHASHSEED``), reference counts for running requests, LRU eviction of free blocks (a request's
blocks are freed tail first, so tails go before shared prefixes). GPU evictions are offloaded to the
CPU tier when there is one; a CPU hit is promoted back by the engine (which pays the copy time).
Every change is reported through ``emit`` as a vLLM KV event.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash
from kvroute.indexer.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from kvroute.indexer.keys import extra_bytes, token_bytes

#: One block's extra keys (LoRA name, ``cache_salt`` on block 0), as ``BlockStored.extra_keys`` carries them.
BlockExtra = list[Any] | None


class Block:
    __slots__ = ("bid", "extra", "hash", "offload", "parent", "ref", "tokens")

    def __init__(
        self,
        bid: int,
        block_hash: BlockHash,
        parent: BlockHash | None,
        tokens: Sequence[int],
        extra: BlockExtra,
        offload: bool,
    ) -> None:
        self.bid = bid
        self.hash = block_hash
        self.parent = parent
        self.tokens = tokens
        self.extra = extra
        self.ref = 0
        self.offload = offload


@dataclass(slots=True)
class Allocation:
    """The blocks one request holds: cached blocks it references plus anonymous reserved slots."""

    held: list[BlockHash] = field(default_factory=list)
    reserved: int = 0


class PagedCache:
    def __init__(
        self,
        gpu_blocks: int,
        block_size: int,
        emit: Callable[[KVEvent], None],
        *,
        cpu_blocks: int = 0,
        seed: int | None = None,
        hash_bytes: bool = False,
        self_describing: bool = True,
    ) -> None:
        if gpu_blocks <= 0 or block_size <= 0 or cpu_blocks < 0:
            raise ValueError("gpu_blocks and block_size must be positive, cpu_blocks non-negative")
        self.gpu_blocks = gpu_blocks
        self.cpu_blocks = cpu_blocks
        self.block_size = block_size
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        self.hash_bytes = hash_bytes
        self.self_describing = self_describing
        self._emit = emit
        self.gpu: dict[BlockHash, Block] = {}
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()
        self.cpu: OrderedDict[BlockHash, Block] = OrderedDict()
        self.reserved = 0
        self._next_bid = 0
        self._seed_bytes = self.seed.to_bytes(8, "little")

    # -- hashing -------------------------------------------------------------------------------------

    def block_hashes(
        self, tokens: Sequence[int], extra_keys: Sequence[BlockExtra] | None = None, parent: BlockHash | None = None
    ) -> list[BlockHash]:
        """Chain hashes of the full blocks of ``tokens`` (``extra_keys``: one entry per block or None),
        continuing the chain after ``parent`` when given."""
        count = len(tokens) // self.block_size
        data = token_bytes(tokens[: count * self.block_size])
        step = self.block_size * 4
        out: list[BlockHash] = []
        prev = b"" if parent is None else parent if isinstance(parent, bytes) else parent.to_bytes(8, "little")
        for i in range(count):
            extra = extra_bytes(extra_keys[i]) if extra_keys and i < len(extra_keys) else b""
            chunk = prev + data[i * step : (i + 1) * step] + extra
            if self.hash_bytes:
                digest = hashlib.sha256(self._seed_bytes + chunk).digest()
                out.append(digest)
                prev = digest
            else:
                value = xxhash.xxh3_64_intdigest(chunk, seed=self.seed)
                out.append(value)
                prev = value.to_bytes(8, "little")
        return out

    # -- queries -------------------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """Longest prefix in GPU, then how many of the following blocks the CPU tier holds."""
        n_gpu = 0
        for h in hashes:
            if h not in self.gpu:
                break
            n_gpu += 1
        n_cpu = 0
        for h in hashes[n_gpu:]:
            if h not in self.cpu:
                break
            n_cpu += 1
        return n_gpu, n_cpu

    def free_capacity(self) -> int:
        """Blocks a new request could get (free + evictable)."""
        return self.gpu_blocks - len(self.gpu) - self.reserved + len(self.lru)

    def usage(self) -> float:
        """Fraction of GPU blocks in use by requests (cached-but-free blocks count as free, as in vLLM)."""
        return (len(self.gpu) - len(self.lru) + self.reserved) / self.gpu_blocks

    def running_blocks(self) -> int:
        return len(self.gpu) - len(self.lru) + self.reserved

    # -- allocation ----------------------------------------------------------------------------------

    def acquire(self, alloc: Allocation, hashes: Sequence[BlockHash]) -> None:
        """Reference cached GPU blocks (a prefix hit) so they cannot be evicted while in use."""
        for h in hashes:
            block = self.gpu[h]
            if block.ref == 0:
                self.lru.pop(h, None)
            block.ref += 1
            alloc.held.append(h)

    def reserve(self, alloc: Allocation, count: int) -> bool:
        """Reserve ``count`` anonymous slots, evicting free blocks as needed; False if they do not fit."""
        if count > self.free_capacity():
            return False
        self._make_room(count)
        self.reserved += count
        alloc.reserved += count
        return True

    def _make_room(self, count: int) -> None:
        while self.gpu_blocks - len(self.gpu) - self.reserved < count and self.lru:
            self._evict_one()

    def store(
        self,
        alloc: Allocation,
        hashes: Sequence[BlockHash],
        tokens: Sequence[int],
        parent: BlockHash | None,
        *,
        extras: Sequence[BlockExtra] | None = None,
        offload_blocks: int | None = None,
        first_index: int = 0,
    ) -> int:
        """Cache computed (or fetched, or promoted) full blocks in the GPU tier; returns how many were new.

        ``tokens`` covers all of ``hashes``; ``parent`` is the hash before the first one. Each new
        block uses one of the allocation's reserved slots. ``offload_blocks`` limits how many blocks of
        the request (counted from its start, ``first_index`` being this call's first) may go to the CPU
        tier (``max_offload_tokens``).
        """
        bs = self.block_size
        run_hashes: list[BlockHash] = []
        run_tokens: list[int] = []
        run_extras: list[BlockExtra] = []
        run_parent = parent
        new = 0

        def flush() -> None:
            if run_hashes:
                self._emit(
                    BlockStored(
                        block_hashes=list(run_hashes),
                        parent_block_hash=run_parent,
                        token_ids=list(run_tokens),
                        block_size=bs,
                        medium="GPU",
                        extra_keys=list(run_extras) if extras else None,
                    )
                )
                run_hashes.clear()
                run_tokens.clear()
                run_extras.clear()

        prev = parent
        for i, h in enumerate(hashes):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            extra = extras[i] if extras and i < len(extras) else None
            existing = self.gpu.get(h)
            if existing is not None:
                flush()
                if existing.ref == 0:
                    self.lru.pop(h, None)
                existing.ref += 1
                alloc.held.append(h)
                run_parent = h
                prev = h
                continue
            if alloc.reserved > 0:
                alloc.reserved -= 1
                self.reserved -= 1
            else:
                self._make_room(1)
                if self.gpu_blocks - len(self.gpu) - self.reserved < 1:
                    break  # no room: the rest is computed but not cached
            offload = offload_blocks is None or first_index + i < offload_blocks
            block = Block(self._next_bid, h, prev, block_tokens, extra, offload)
            self._next_bid += 1
            block.ref = 1
            self.gpu[h] = block
            alloc.held.append(h)
            if not run_hashes:
                run_parent = prev
            run_hashes.append(h)
            run_tokens.extend(block_tokens)
            run_extras.append(extra)
            new += 1
            prev = h
        flush()
        return new

    def release(self, alloc: Allocation) -> None:
        """Drop a request's references (tail first, so the tail is evicted first) and its reserved slots."""
        for h in reversed(alloc.held):
            block = self.gpu.get(h)
            if block is None:
                continue
            block.ref -= 1
            if block.ref <= 0:
                block.ref = 0
                self.lru[h] = None
                self.lru.move_to_end(h)
        alloc.held.clear()
        self.reserved -= alloc.reserved
        alloc.reserved = 0

    def trim(self, alloc: Allocation) -> None:
        """Give back an allocation's unused reserved slots (its cached blocks stay referenced)."""
        self.reserved -= alloc.reserved
        alloc.reserved = 0

    def block_ids(self, hashes: Sequence[BlockHash]) -> list[int]:
        return [self.gpu[h].bid for h in hashes if h in self.gpu]

    def touch_cpu(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            if h in self.cpu:
                self.cpu.move_to_end(h)

    def cpu_block(self, h: BlockHash) -> Block | None:
        return self.cpu.get(h)

    # -- eviction and reset --------------------------------------------------------------------------

    def _evict_one(self) -> None:
        h, _ = self.lru.popitem(last=False)
        block = self.gpu.pop(h)
        self._emit(BlockRemoved(block_hashes=[h], medium="GPU"))
        if self.cpu_blocks and block.offload:
            self._offload(block)

    def _offload(self, block: Block) -> None:
        if block.hash in self.cpu:
            self.cpu.move_to_end(block.hash)
            return
        removed: list[BlockHash] = []
        while len(self.cpu) >= self.cpu_blocks:
            old, _ = self.cpu.popitem(last=False)
            removed.append(old)
        if removed:
            self._emit(BlockRemoved(block_hashes=removed, medium="CPU"))
        self.cpu[block.hash] = block
        if self.self_describing:
            self._emit(
                BlockStored(
                    block_hashes=[block.hash],
                    parent_block_hash=block.parent,
                    token_ids=list(block.tokens),
                    block_size=self.block_size,
                    medium="CPU",
                    extra_keys=[block.extra] if block.extra else None,
                )
            )
        else:
            self._emit(
                BlockStored(
                    block_hashes=[block.hash], parent_block_hash=block.parent, token_ids=[], block_size=0, medium="CPU"
                )
            )

    def reset(self) -> bool:
        """Reset the prefix cache (vLLM refuses while blocks are in use); emits ``AllBlocksCleared``."""
        if self.reserved or len(self.lru) != len(self.gpu):
            return False
        self.gpu.clear()
        self.lru.clear()
        self.cpu.clear()
        self._emit(AllBlocksCleared())
        return True
