"""The CPU tier a :class:`~kvroute.sim.kvcache.PagedCache` offloads its GPU evictions to.

Its own LRU (an offloaded block is touched again when a hit promotes it, or when it is evicted from GPU
once more) and its own events, ``medium="CPU"``, marked with the ``ownership`` of the offloading tier
when one is set. Self-describing events carry tokens and spec; otherwise they are vLLM's placeholders
(hash and group only). Apart from that the cache reads it as a mapping of the blocks it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from kvroute.indexer.events import BlockHash, KVEvent
from kvroute.sim.events import FULL_ATTENTION, SimBlockRemoved, SimBlockStored

if TYPE_CHECKING:  # kvcache imports this module
    from kvroute.sim.kvcache import Block


class OffloadTier(Mapping[BlockHash, "Block"]):
    """``capacity`` blocks (0: no tier, nothing is offloaded), least recently used first."""

    def __init__(
        self,
        capacity: int,
        block_size: int,
        emit: Callable[[KVEvent], None],
        *,
        self_describing: bool = True,
        ownership: str | None = None,
    ) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.self_describing = self_describing
        self.ownership = ownership
        self._emit = emit
        self._blocks: OrderedDict[BlockHash, Block] = OrderedDict()

    def __getitem__(self, h: BlockHash) -> Block:
        return self._blocks[h]

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def held_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, the tier holds (the CPU part of a prefix hit)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Mark blocks as just used (a hit promoted them), so they are evicted last."""
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def offload(self, block: Block) -> None:
        """Take a block the GPU tier evicted, evicting the least recently used ones to make room: their
        ``BlockRemoved`` (one event) goes out before the new block's ``BlockStored``."""
        if not self.capacity:
            return
        if block.hash in self._blocks:
            self._blocks.move_to_end(block.hash)
            return
        removed: list[BlockHash] = []
        while len(self._blocks) >= self.capacity:
            old, _ = self._blocks.popitem(last=False)
            removed.append(old)
        owner = self.ownership
        if removed:
            self._emit(SimBlockRemoved(block_hashes=removed, medium="CPU", group_idx=0, ownership=owner))
        self._blocks[block.hash] = block
        if self.self_describing:
            self._emit(
                SimBlockStored(
                    block_hashes=[block.hash],
                    parent_block_hash=block.parent,
                    token_ids=list(block.tokens),
                    block_size=self.block_size,
                    medium="CPU",
                    extra_keys=[block.extra] if block.extra else None,
                    group_idx=0,
                    kv_cache_spec_kind=FULL_ATTENTION,
                    ownership=owner,
                )
            )
        else:  # placeholders: no tokens, no spec (vLLM's carry only the hash and group_idx)
            self._emit(
                SimBlockStored(
                    block_hashes=[block.hash],
                    parent_block_hash=block.parent,
                    token_ids=[],
                    block_size=0,
                    medium="CPU",
                    group_idx=0,
                    kv_cache_spec_kind=None,
                    ownership=owner,
                )
            )

    def clear(self) -> None:
        """Forget every block without events (a prefix-cache reset's ``AllBlocksCleared`` covers them)."""
        self._blocks.clear()
