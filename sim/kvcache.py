"""A paged KV cache with vLLM's prefix-caching semantics and an optional CPU tier.

Full blocks only, a chain hash per block (seeded per process unless a seed is given, like vLLM without
``PYTHONHASHSEED``), reference counts for running requests, LRU eviction of free blocks (a request's
blocks are freed tail first, so tails go before shared prefixes). GPU evictions are offloaded to the
CPU tier when there is one (:class:`~kvroute.sim.offload_tier.OffloadTier`); a CPU hit is promoted back
by the engine (which pays the copy time).
Every change is reported through ``emit`` as a vLLM KV event (:mod:`kvroute.sim.events`).

Two vLLM 0.33 variants, off by default:

- lookahead hashing (``lookahead`` L > 0, vLLM's ``num_hash_lookahead_tokens`` for EAGLE): block i's hash
  also covers the L tokens after it, so a block gets a hash (is cached, published) only once those tokens
  exist; its ``BlockStored`` carries them in ``lookahead_token_ids`` (``vllm/v1/core/kv_cache_utils.py``
  ``request_block_hasher``, ``vllm/v1/core/block_pool.py``).
- a hybrid model (``sliding_window`` W tokens): a second KV-cache group, group 1, of sliding-window
  attention (:class:`SlidingWindowGroup`); its blocks are published with ``group_idx`` 1, and a prefix hit
  needs the group's last ``ceil((W-1)/block_size)`` blocks before the hit boundary, as vLLM's hybrid
  coordinator requires (``vllm/v1/core/single_type_kv_cache_manager.py``).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash
from kvroute.indexer.events import AllBlocksCleared, BlockHash, KVEvent
from kvroute.indexer.keys import extra_bytes, token_bytes
from kvroute.sim.events import FULL_ATTENTION, SLIDING_WINDOW, SimBlockRemoved, SimBlockStored
from kvroute.sim.offload_tier import OffloadTier

#: One block's extra keys (LoRA name, ``cache_salt`` on block 0), as ``BlockStored.extra_keys`` carries them.
BlockExtra = list[Any] | None


class Block:
    __slots__ = ("bid", "extra", "hash", "lookahead", "offload", "parent", "ref", "tokens")

    def __init__(
        self,
        bid: int,
        block_hash: BlockHash,
        parent: BlockHash | None,
        tokens: Sequence[int],
        extra: BlockExtra,
        offload: bool,
        lookahead: list[int] | None = None,
    ) -> None:
        self.bid = bid
        self.hash = block_hash
        self.parent = parent
        self.tokens = tokens
        self.extra = extra
        self.ref = 0
        self.offload = offload
        self.lookahead = lookahead


def contiguous_window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding-window hit needs before its boundary: vLLM's ``cdiv(sliding_window - 1, block_size)``
    (at least one: vLLM's right-to-left search needs a cached block to stop at)."""
    return max(1, -(-(window - 1) // block_size))


class SlidingWindowGroup:
    """Group 1 of a hybrid model: which blocks hold sliding-window KV, in a pool of its own.

    A request's blocks before its last window are useless to it: vLLM frees them right away, so they are
    evicted first, oldest freed first (``freed``); the window's tail blocks (``tail``) go after them, least
    recently used first. A hit needs the tail before its boundary, in either queue."""

    group_idx = 1

    def __init__(self, window: int, block_size: int, capacity: int, emit: Callable[[KVEvent], None]) -> None:
        self.window = window
        self.block_size = block_size
        self.capacity = capacity
        self.need = contiguous_window_blocks(window, block_size)
        self._emit = emit
        self.freed: OrderedDict[BlockHash, None] = OrderedDict()
        self.tail: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, h: BlockHash) -> bool:
        return h in self.tail or h in self.freed

    def __len__(self) -> int:
        return len(self.tail) + len(self.freed)

    def _touch(self, h: BlockHash) -> None:
        self.freed.pop(h, None)
        self.tail[h] = None
        self.tail.move_to_end(h)

    def hit(self, hashes: Sequence[BlockHash], n: int) -> int:
        """The longest hit <= ``n`` blocks whose window tail this group holds (0 always qualifies)."""
        while n > 0:
            window = hashes[max(0, n - self.need) : n]
            if all(h in self for h in window):
                for h in window:
                    self._touch(h)
                return n
            n -= 1
        return 0

    def store(
        self,
        hashes: Sequence[BlockHash],
        tokens: Sequence[int],
        parent: BlockHash | None,
        extras: Sequence[BlockExtra] | None,
        session_id: str | None,
        lookahead: Sequence[list[int]] | None,
        seq_end: int,
    ) -> None:
        """Record a run of blocks (``tokens`` covers them); ``seq_end`` = index past the last block of the
        request's sequence so far, which decides what is still inside its window."""
        bs = self.block_size
        first_tail = seq_end - self.need
        start = seq_end - len(hashes)
        run: list[int] = []

        def flush() -> None:
            if not run:
                return
            lo, hi = run[0], run[-1] + 1
            self._emit(
                SimBlockStored(
                    block_hashes=[hashes[i] for i in run],
                    parent_block_hash=hashes[lo - 1] if lo > 0 else parent,
                    token_ids=list(tokens[lo * bs : hi * bs]),
                    block_size=bs,
                    medium="GPU",
                    extra_keys=[extras[i] if i < len(extras) else None for i in run] if extras else None,
                    group_idx=self.group_idx,
                    kv_cache_spec_kind=SLIDING_WINDOW,
                    kv_cache_spec_sliding_window=self.window,
                    session_id=session_id,
                    lookahead_token_ids=[list(lookahead[i]) for i in run] if lookahead else None,
                )
            )
            run.clear()

        for i, h in enumerate(hashes):
            in_window = start + i >= first_tail
            known = h in self
            if known:
                flush()
            else:
                run.append(i)
            if in_window:
                self._touch(h)
            elif not known:
                self.freed[h] = None
        flush()
        while len(self) > self.capacity:  # one BlockRemoved per block, as vLLM's block pool sends them
            queue = self.freed if self.freed else self.tail
            old, _ = queue.popitem(last=False)
            self._emit(SimBlockRemoved(block_hashes=[old], medium="GPU", group_idx=self.group_idx))

    def clear(self) -> None:
        self.freed.clear()
        self.tail.clear()


@dataclass(slots=True)
class Allocation:
    """The blocks one request holds: cached blocks it references plus anonymous reserved slots."""

    held: list[BlockHash] = field(default_factory=list)
    reserved: int = 0


class PagedCache:
    """The GPU tier's blocks, references and LRU, in front of the CPU tier (``cpu``) it offloads evictions to
    and a hybrid model's sliding-window group (``swa``)."""

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
        lookahead: int = 0,
        sliding_window: int | None = None,
        offload_ownership: str | None = None,
    ) -> None:
        if gpu_blocks <= 0 or block_size <= 0 or cpu_blocks < 0:
            raise ValueError("gpu_blocks and block_size must be positive, cpu_blocks non-negative")
        self.gpu_blocks = gpu_blocks
        self.cpu_blocks = cpu_blocks
        self.block_size = block_size
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        self.hash_bytes = hash_bytes
        self.lookahead = lookahead
        self._sink = emit
        #: A reset's ``AllBlocksCleared`` waits for the engine's next step, as vLLM's does (its block pool
        #: queues the event, the scheduler publishes the queue after a step, an idle engine runs none).
        self.clear_pending = False
        self.swa = (
            SlidingWindowGroup(sliding_window, block_size, gpu_blocks, self._emit)
            if sliding_window is not None
            else None
        )
        self.gpu: dict[BlockHash, Block] = {}
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()
        self.cpu = OffloadTier(
            cpu_blocks, block_size, self._emit, self_describing=self_describing, ownership=offload_ownership
        )
        self.reserved = 0
        self._next_bid = 0
        self._seed_bytes = self.seed.to_bytes(8, "little")

    def _emit(self, event: KVEvent) -> None:
        """Every event goes out after a pending reset's ``AllBlocksCleared`` (vLLM's queue keeps the order)."""
        if self.clear_pending:
            self.step()
        self._sink(event)

    def step(self) -> None:
        """An engine step: a reset's ``AllBlocksCleared`` is published now, with whatever the step stores."""
        if self.clear_pending:
            self.clear_pending = False
            self._sink(AllBlocksCleared())

    # -- hashing -------------------------------------------------------------------------------------

    def block_hashes(
        self,
        tokens: Sequence[int],
        extra_keys: Sequence[BlockExtra] | None = None,
        parent: BlockHash | None = None,
        *,
        max_blocks: int | None = None,
    ) -> list[BlockHash]:
        """Chain hashes of the full blocks of ``tokens`` (``extra_keys``: one entry per block or None),
        continuing the chain after ``parent`` when given. With lookahead L, only blocks followed by L more
        tokens get a hash, and it covers them; ``max_blocks`` caps the count (blocks whose KV exists)."""
        bs = self.block_size
        count = max(0, len(tokens) - self.lookahead) // bs
        if max_blocks is not None:
            count = min(count, max_blocks)
        data = token_bytes(tokens[: count * bs + (self.lookahead if count else 0)])
        step = bs * 4
        out: list[BlockHash] = []
        prev = b"" if parent is None else parent if isinstance(parent, bytes) else parent.to_bytes(8, "little")
        for i in range(count):
            extra = extra_bytes(extra_keys[i]) if extra_keys and i < len(extra_keys) else b""
            if self.lookahead:
                extra += b"\x00la" + data[(i + 1) * step : (i + 1) * step + self.lookahead * 4]
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

    def lookahead_ids(self, tokens: Sequence[int], count: int, first: int = 0) -> list[list[int]] | None:
        """``lookahead_token_ids`` of blocks ``first .. first+count`` of ``tokens`` (None without lookahead)."""
        if not self.lookahead:
            return None
        bs, la = self.block_size, self.lookahead
        return [list(tokens[(first + i + 1) * bs : (first + i + 1) * bs + la]) for i in range(count)]

    # -- queries -------------------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """Longest prefix in GPU, then how many of the following blocks the CPU tier holds."""
        n_gpu = 0
        for h in hashes:
            if h not in self.gpu:
                break
            n_gpu += 1
        return n_gpu, self.cpu.held_prefix(hashes[n_gpu:])

    def hybrid_hit(self, hashes: Sequence[BlockHash], n: int) -> int:
        """``n`` cut down to what the sliding-window group also serves (``n`` without a hybrid model)."""
        return n if self.swa is None else self.swa.hit(hashes, n)

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
        session_id: str | None = None,
        lookahead: Sequence[list[int]] | None = None,
    ) -> int:
        """Cache computed (or fetched, or promoted) full blocks in the GPU tier; returns how many were new.

        ``tokens`` covers all of ``hashes``; ``parent`` is the hash before the first one. Each new
        block uses one of the allocation's reserved slots. ``offload_blocks`` limits how many blocks of
        the request (counted from its start, ``first_index`` being this call's first) may go to the CPU
        tier (``max_offload_tokens``). ``session_id`` (the request's) and ``lookahead`` (one token list
        per block) go into the events. A hybrid model's sliding-window group records the run too.
        """
        bs = self.block_size
        run_hashes: list[BlockHash] = []
        run_tokens: list[int] = []
        run_extras: list[BlockExtra] = []
        run_lookahead: list[list[int]] = []
        run_parent = parent
        new = 0

        def flush() -> None:
            if run_hashes:
                self._emit(
                    SimBlockStored(
                        block_hashes=list(run_hashes),
                        parent_block_hash=run_parent,
                        token_ids=list(run_tokens),
                        block_size=bs,
                        medium="GPU",
                        extra_keys=list(run_extras) if extras else None,
                        group_idx=0,
                        kv_cache_spec_kind=FULL_ATTENTION,
                        session_id=session_id,
                        lookahead_token_ids=list(run_lookahead) if lookahead is not None else None,
                    )
                )
                run_hashes.clear()
                run_tokens.clear()
                run_extras.clear()
                run_lookahead.clear()

        prev = parent
        stored = 0
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
                stored = i + 1
                continue
            if alloc.reserved > 0:
                alloc.reserved -= 1
                self.reserved -= 1
            else:
                self._make_room(1)
                if self.gpu_blocks - len(self.gpu) - self.reserved < 1:
                    break  # no room: the rest is computed but not cached
            offload = offload_blocks is None or first_index + i < offload_blocks
            block_lookahead = list(lookahead[i]) if lookahead is not None and i < len(lookahead) else None
            block = Block(self._next_bid, h, prev, block_tokens, extra, offload, block_lookahead)
            self._next_bid += 1
            block.ref = 1
            self.gpu[h] = block
            alloc.held.append(h)
            if not run_hashes:
                run_parent = prev
            run_hashes.append(h)
            run_tokens.extend(block_tokens)
            run_extras.append(extra)
            if block_lookahead is not None:
                run_lookahead.append(block_lookahead)
            new += 1
            prev = h
            stored = i + 1
        flush()
        if self.swa is not None and stored:
            self.swa.store(hashes[:stored], tokens, parent, extras, session_id, lookahead, first_index + stored)
        return new

    def report_reuse(
        self,
        hashes: Sequence[BlockHash],
        tokens: Sequence[int],
        *,
        extras: Sequence[BlockExtra] | None = None,
        session_id: str | None = None,
        lookahead: Sequence[list[int]] | None = None,
    ) -> None:
        """``kv_cache_report_mode: "full"``: announce a request's prefix-cache hit (blocks 0..n) again, with
        its session, as vLLM's ``emit_cached_block_events`` does; nothing changes in the cache. vLLM does so
        per KV-cache group with a hit, and for a sliding-window group that is every block of the hit, the
        out-of-window ones it does not hold (null blocks in its hit) included: so does the sim."""
        if not hashes:
            return
        bs = self.block_size
        groups: list[tuple[int, str, int | None]] = [(0, FULL_ATTENTION, None)]
        if self.swa is not None:
            groups.append((self.swa.group_idx, SLIDING_WINDOW, self.swa.window))
        for group_idx, kind, window in groups:
            self._emit(
                SimBlockStored(
                    block_hashes=list(hashes),
                    parent_block_hash=None,
                    token_ids=list(tokens[: len(hashes) * bs]),
                    block_size=bs,
                    medium="GPU",
                    extra_keys=[extras[i] if i < len(extras) else None for i in range(len(hashes))] if extras else None,
                    group_idx=group_idx,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                    session_id=session_id,
                    lookahead_token_ids=[list(x) for x in lookahead[: len(hashes)]] if lookahead is not None else None,
                )
            )

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
        self.cpu.touch(hashes)

    def cpu_block(self, h: BlockHash) -> Block | None:
        return self.cpu.get(h)

    # -- eviction and reset --------------------------------------------------------------------------

    def _evict_one(self) -> None:
        h, _ = self.lru.popitem(last=False)
        block = self.gpu.pop(h)
        self._emit(SimBlockRemoved(block_hashes=[h], medium="GPU", group_idx=0))
        if block.offload:
            self.cpu.offload(block)

    def reset(self) -> bool:
        """Reset the prefix cache (vLLM refuses while blocks are in use). ``AllBlocksCleared`` goes out at
        the next engine step (:meth:`step`), as in vLLM: until then the engine's subscribers still believe
        in the blocks it no longer has."""
        if self.reserved or len(self.lru) != len(self.gpu):
            return False
        self.gpu.clear()
        self.lru.clear()
        self.cpu.clear()
        if self.swa is not None:
            self.swa.clear()
        self.clear_pending = True
        return True
