"""Turning one decoded event batch into index operations for one worker entity.

This is the hot path of ingestion, kept free of I/O: per stored block one xxh3 call (our key chain)
and a few dict operations (the alias map vLLM-hash -> our key and the entity's tier bits). The
entity's local view (``alias`` + ``bits``) is the truth the index mirrors: it lets removals and
offloading placeholders resolve vLLM hashes, and lets a backend that lost its data be rewritten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvroute.indexer.backend import IndexOp, OpKind
from kvroute.indexer.bitsets import add_bits
from kvroute.indexer.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch
from kvroute.indexer.keys import chain_keys, root_key
from kvroute.vocabulary import Tier, tier_bit


@dataclass(slots=True)
class EntityState:
    """What one worker entity (a worker's data-parallel rank) holds, as we know it."""

    alias: dict[BlockHash, int] = field(default_factory=dict)
    bits: dict[int, int] = field(default_factory=dict)
    #: Extra copies of a block in one tier, beyond the first: vLLM recomputes the last block of a fully
    #: cached prompt whose length is a multiple of the block size, stores a second copy under the same
    #: hash, announces it again, and later sends one BlockRemoved per copy. (key, tier bit) -> extras.
    copies: dict[tuple[int, int], int] = field(default_factory=dict)
    #: Blocks per tier bit, maintained on every change (stats are O(tiers), never a scan of ``bits``).
    counts: dict[int, int] = field(default_factory=dict)

    def clear(self) -> None:
        self.alias.clear()
        self.bits.clear()
        self.copies.clear()
        self.counts.clear()

    def snapshot_ops(self) -> list[IndexOp]:
        """Operations that rewrite this entity from scratch (clear, then its blocks per tier)."""
        by_tier: dict[int, list[int]] = {}
        for key, bits in self.bits.items():
            for tier in Tier:
                if bits & tier:
                    by_tier.setdefault(int(tier), []).append(key)
        return [IndexOp("clear"), *(IndexOp("store", keys, tier) for tier, keys in sorted(by_tier.items()))]


@dataclass(slots=True)
class BatchResult:
    ops: list[IndexOp] = field(default_factory=list)
    #: event type -> count received / applied; reason -> count dropped
    received: dict[str, int] = field(default_factory=dict)
    applied: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    cleared: bool = False
    #: The keys of the last op in ``ops`` (our own list, so the next op of its kind and tier extends it).
    tail: list[int] | None = None


class ModelInfo:
    """Per-model facts the key chain needs: its root key and its block size (learnt or configured)."""

    __slots__ = ("block_size", "name", "next_ask", "on_learn", "published", "root")

    def __init__(
        self, name: str, block_size: int | None = None, on_learn: Callable[[str, int], None] | None = None
    ) -> None:
        self.name = name
        self.root = root_key(name)
        self.block_size = block_size
        self.on_learn = on_learn
        #: Whether the block size was written to the backend for readers; when to ask it again.
        self.published = False
        self.next_ask = 0.0


def _bump(counter: dict[str, int], name: str, n: int = 1) -> None:
    counter[name] = counter.get(name, 0) + n


def _extras(event: BlockStored, count: int) -> list[Any] | None:
    if event.extra_keys is not None:
        return event.extra_keys
    if event.lora_name:
        return [[event.lora_name]] * count
    return None


def _store(state: EntityState, model: ModelInfo, event: BlockStored, out: BatchResult) -> list[int] | None:
    """Keys newly held for a BlockStored event, updating the alias map; None when it must be dropped."""
    hashes = event.block_hashes
    if event.is_placeholder:
        # Offloading connectors announce copies of blocks we already know, by vLLM hash only.
        alias = state.alias
        keys = [alias[h] for h in hashes if h in alias]
        if len(keys) < len(hashes):
            _bump(out.dropped, "unknown_hash", len(hashes) - len(keys))
        if len(keys) > 1:
            keys = list(dict.fromkeys(keys))  # a hash listed twice is one block (keeps the counts exact)
        return keys
    if model.block_size is None:
        model.block_size = event.block_size
        if model.on_learn is not None:
            model.on_learn(model.name, event.block_size)
    elif event.block_size != model.block_size:
        _bump(out.dropped, "block_size_mismatch")
        return None
    if event.parent_block_hash is None:
        parent = model.root
    else:
        found = state.alias.get(event.parent_block_hash)
        if found is None:
            _bump(out.dropped, "unknown_parent")
            return None
        parent = found
    try:
        keys = chain_keys(
            event.token_ids, event.block_size, parent, _extras(event, len(hashes)), max_blocks=len(hashes)
        )
    except (OverflowError, TypeError, ValueError):
        _bump(out.dropped, "bad_tokens")
        return None
    state.alias.update(zip(hashes, keys, strict=False))
    return keys


def _remove(state: EntityState, bit: int, hashes: list[BlockHash]) -> list[int]:
    alias = state.alias
    bits = state.bits
    keys = []
    copies = state.copies
    counts = state.counts
    for h in hashes:
        key = alias.get(h)
        if key is None:
            continue
        old = bits.get(key, 0)
        if not old & bit:
            continue
        if copies and (key, bit) in copies:
            extra = copies[(key, bit)] - 1
            if extra:
                copies[(key, bit)] = extra
            else:
                del copies[(key, bit)]
            continue  # another copy still holds the block
        keys.append(key)
        counts[bit] -= 1
        if old == bit:
            del bits[key]
            del alias[h]
        else:
            bits[key] = old & ~bit
    return keys


def _append(out: BatchResult, kind: OpKind, keys: list[int], tier: int) -> None:
    """Add keys to the last op when it has the same kind and tier (fewer backend round trips)."""
    if not keys:
        return
    ops = out.ops
    tail = out.tail
    if tail is not None and ops[-1].kind == kind and ops[-1].tier == tier:
        tail.extend(keys)
    else:
        tail = out.tail = list(keys)
        ops.append(IndexOp(kind, tail, tier))


_TIERS: dict[tuple[str, str], int] = {}


def _tier(medium: str, locality: str) -> int:
    """``tier_bit`` as a plain int, memoised (enum arithmetic is slow on the hot path)."""
    bit = _TIERS.get((medium, locality))
    if bit is None:
        bit = _TIERS[(medium, locality)] = int(tier_bit(medium, locality))
    return bit


def translate(state: EntityState, model: ModelInfo, batch: EventBatch) -> BatchResult:
    """Apply ``batch`` to the entity's local view and return the index operations that mirror it."""
    out = BatchResult()
    stored = removed = cleared = applied_stored = applied_removed = 0
    bits_table = state.bits
    for event in batch.events:
        if type(event) is BlockStored:
            stored += 1
            if event.group_idx != 0:
                # Hybrid models: only the first KV-cache group is indexed (same tokens, same keys).
                _bump(out.dropped, "other_group")
                continue
            keys = _store(state, model, event, out)
            if keys is None:
                continue
            bit = _tier(event.medium, event.locality)
            had = 0
            for key in keys:
                if bits_table.get(key, 0) & bit:
                    had += 1
                    state.copies[(key, bit)] = state.copies.get((key, bit), 0) + 1
            counts = state.counts
            counts[bit] = counts.get(bit, 0) + len(keys) - had
            if len(keys) == 1:
                bits_table[keys[0]] = bits_table.get(keys[0], 0) | bit
            else:
                add_bits(bits_table, keys, bit)
            _append(out, "store", keys, bit)
            applied_stored += 1
        elif type(event) is BlockRemoved:
            removed += 1
            if event.group_idx != 0:
                _bump(out.dropped, "other_group")
                continue
            bit = _tier(event.medium, event.locality)
            _append(out, "remove", _remove(state, bit, event.block_hashes), bit)
            applied_removed += 1
        elif type(event) is AllBlocksCleared:
            cleared += 1
            state.clear()
            out.ops.append(IndexOp("clear"))
            out.tail = None
            out.cleared = True
    for name, count in (("BlockStored", stored), ("BlockRemoved", removed), ("AllBlocksCleared", cleared)):
        if count:
            out.received[name] = count
    for name, count in (
        ("BlockStored", applied_stored),
        ("BlockRemoved", applied_removed),
        ("AllBlocksCleared", cleared),
    ):
        if count:
            out.applied[name] = count
    return out
