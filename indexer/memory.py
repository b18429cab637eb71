"""The embedded index: plain dicts, one big-int bit set per block.

Each (model, worker) gets a *slot*; a block's value is an int holding 8 bits per slot (the tier bits
of :mod:`kvroute.vocabulary`). A lookup then walks the chain with a handful of C-level int
operations per block (mask by the still-matching workers, compare with the previous block) and only
decodes per-worker tier counts where the set of holders or their tiers change, so a 2,048-block
prompt over 64 workers stays well under a millisecond. A per-worker reverse map makes purges cost
the worker's own blocks, never a scan of the whole index.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvroute.indexer.backend import IndexBackend, IndexOp, WorkerIndexStats, WorkerMatch
from kvroute.indexer.bitsets import add_bits, add_bits_counted, classify, named_counts

SLOT_BITS = 8
_BYTE = 0xFF
#: Walks remembered to be continued: chains (by first key), and walks per chain (conversations sharing
#: a system prompt share a first key).
MAX_REMEMBERED_CHAINS = 1024
WALKS_PER_CHAIN = 8


@dataclass(slots=True)
class _Model:
    """One model's table: block key -> slot bit set, and the slot bookkeeping."""

    blocks: dict[int, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    owners: dict[int, str] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    #: Per worker: key -> its tier bits (the reverse index used by purges and stats).
    held: dict[str, dict[int, int]] = field(default_factory=dict)
    #: Per worker: tier bit -> blocks (maintained on every write: stats never walk ``held``).
    counts: dict[str, dict[int, int]] = field(default_factory=dict)
    #: Bumped by every write that may change what a walk read: a removal, a drop, an eviction, or a store
    #: to a key already present. A store of new keys only extends chains past where a walk stopped.
    epoch: int = 0
    #: Recent walks to continue, by a chain's first key: ``(epoch, len(keys), keys[-1], state)`` each.
    walks: dict[int, list[tuple[int, int, int, WalkState]]] = field(default_factory=dict)

    def resumable(self, keys: Sequence[int]) -> WalkState | None:
        """The state of the longest recent walk over a prefix of ``keys`` (block keys chain their parents,
        so equal last keys mean equal chains), if nothing it read has changed since."""
        best: WalkState | None = None
        depth = 0
        n = len(keys)
        for epoch, length, last, state in self.walks.get(keys[0], ()):
            if epoch == self.epoch and depth < length <= n and keys[length - 1] == last:
                best, depth = state, length
        return best

    def remember(self, keys: Sequence[int], state: WalkState) -> None:
        entries = self.walks.get(keys[0])
        if entries is None:
            if len(self.walks) >= MAX_REMEMBERED_CHAINS:
                del self.walks[next(iter(self.walks))]
            entries = self.walks[keys[0]] = []
        entry = (self.epoch, len(keys), keys[-1], state)
        for k, (_, length, last, _) in enumerate(entries):  # the chain it extends (or repeats) gives way
            if length <= len(keys) and keys[length - 1] == last:
                entries[k] = entry
                return
        if len(entries) >= WALKS_PER_CHAIN:
            entries.pop(0)
        entries.append(entry)

    def slot_of(self, worker_id: str) -> int:
        slot = self.slots.get(worker_id)
        if slot is None:
            slot = self.free.pop() if self.free else len(self.slots)
            self.slots[worker_id] = slot
            self.owners[slot] = worker_id
            self.held[worker_id] = {}
            self.counts[worker_id] = {}
        return slot

    def drop(self, worker_id: str) -> None:
        slot = self.slots.pop(worker_id, None)
        if slot is None:
            return
        self.epoch += 1
        del self.owners[slot]
        self.counts.pop(worker_id, None)
        keep = ~(_BYTE << (slot * SLOT_BITS))
        blocks = self.blocks
        for key in self.held.pop(worker_id):
            value = blocks[key] & keep
            if value:
                blocks[key] = value
            else:
                del blocks[key]
        self.free.append(slot)

    def evict(self, n: int) -> int:
        """Forget the ``n`` oldest blocks (insertion order; a store of a held block refreshes it)."""
        blocks, owners, held, counts = self.blocks, self.owners, self.held, self.counts
        victims = list(itertools.islice(blocks, n))
        self.epoch += 1
        for key in victims:
            value = blocks.pop(key)
            for slot in _slots_of(_lanes(value)):
                worker = owners.get(slot)
                if worker is None:
                    continue
                bits = held[worker].pop(key, 0)
                tiers = counts[worker]
                while bits:
                    low = bits & -bits
                    tiers[low] -= 1
                    bits ^= low
        return len(victims)


def _lanes(value: int) -> int:
    """One bit per slot whose byte is non-zero (at the slot's lowest bit position)."""
    folded = value | (value >> 1)
    folded |= folded >> 2
    folded |= folded >> 4
    return folded & _lane_mask(value.bit_length())


_LANE_CACHE: dict[int, int] = {}


def _lane_mask(nbits: int) -> int:
    slots = (nbits + SLOT_BITS - 1) // SLOT_BITS
    mask = _LANE_CACHE.get(slots)
    if mask is None:
        mask = int.from_bytes(b"\x01" * slots, "little")
        _LANE_CACHE[slots] = mask
    return mask


def _slots_of(lanes: int) -> list[int]:
    out = []
    while lanes:
        low = lanes & -lanes
        out.append((low.bit_length() - 1) // SLOT_BITS)
        lanes ^= low
    return out


#: Where a walk stopped, to continue it over a longer chain that shares its keys so far:
#: ``(depth, done, per-slot counts, run starts, held bits, alive mask, last raw value, last masked value)``.
#: ``done``: no slot holds the chain past ``depth`` (the counts are final). The counts are those before
#: the open runs were credited.
WalkState = tuple[int, bool, dict[int, list[int]], dict[int, int], dict[int, int], int, int, int]


def walk_python(blocks: dict[int, int], keys: Sequence[int]) -> dict[int, list[int]]:
    """Per slot ``[blocks, gpu, cpu, storage, remote]`` for the longest runs from the start of ``keys``."""
    return walk_from_python(blocks, keys)[0]


def walk_from_python(
    blocks: dict[int, int], keys: Sequence[int], resume: WalkState | None = None, keep: bool = False
) -> tuple[dict[int, list[int]], WalkState | None]:
    """:func:`walk_python`, continued from ``resume`` (a state this function returned for a chain whose
    keys ``keys`` starts with, over a table that has not changed there since); with ``keep``, also the
    state where this walk stopped (None: nobody holds the first key).

    Per block: one dict get and one int comparison while nothing changes. Where the value changes,
    only the slots whose byte changed are settled (``diff``), so the work is O(blocks + changes).
    """
    get = blocks.get
    n = len(keys)
    if resume is None:
        first = get(keys[0]) if keys else None
        if not first:
            return {}, None
        result: dict[int, list[int]] = {}
        start: dict[int, int] = {}
        held: dict[int, int] = {}
        for slot in _slots_of(_lanes(first)):
            result[slot] = [0, 0, 0, 0, 0]
            start[slot] = 0
            held[slot] = (first >> (slot * SLOT_BITS)) & _BYTE
        alive_full = _lanes(first) * _BYTE
        prev_raw = prev = first
        i = 0
    else:
        i, done, counts, starts, holding, alive_full, prev_raw, prev = resume
        result = {slot: list(entry) for slot, entry in counts.items()}
        if done:
            return result, resume
        start, held = dict(starts), dict(holding)
    while i < n:
        value = get(keys[i])
        if value == prev_raw:
            i += 1
            continue
        if value is None:
            break
        prev_raw = value
        value &= alive_full
        if value != prev:
            for slot in _slots_of(_lanes(value ^ prev)):
                _credit(result[slot], i - start[slot], held[slot])
                bits = (value >> (slot * SLOT_BITS)) & _BYTE
                if bits:
                    start[slot] = i
                    held[slot] = bits
                else:
                    result[slot][0] = i
                    del held[slot]
                    alive_full &= ~(_BYTE << (slot * SLOT_BITS))
            prev = value
            if not value:
                finished: WalkState | None = None
                if keep:
                    finished = (i, True, {s: list(e) for s, e in result.items()}, {}, {}, 0, 0, 0)
                return result, finished
        i += 1
    kept: WalkState | None = None
    if keep:
        kept = (i, False, {s: list(e) for s, e in result.items()}, dict(start), dict(held), alive_full, prev_raw, prev)
    for slot, bits in held.items():
        _credit(result[slot], i - start[slot], bits)
        result[slot][0] = i
    return result, kept


def _credit(entry: list[int], run: int, bits: int) -> None:
    """Count ``run`` blocks held with ``bits`` in the tier they load from fastest."""
    if run <= 0:
        return
    tier, remote = classify(bits)
    entry[tier + 1] += run
    if remote:
        entry[4] += run


_Walk = Callable[[dict[int, int], Sequence[int]], dict[int, list[int]]]
_WalkFrom = Callable[
    [dict[int, int], Sequence[int], WalkState | None, bool], tuple[dict[int, list[int]], WalkState | None]
]

#: The walk lookups use: the compiled one (setup.py builds it) or, where it was not built, the Python one
#: above, its reference. ``WALK`` says which (logged at start-up).
walk: _Walk
walk_from: _WalkFrom
try:
    from kvroute.indexer._walk import walk as _compiled_walk
    from kvroute.indexer._walk import walk_from as _compiled_walk_from

    walk, walk_from, WALK = _compiled_walk, _compiled_walk_from, "compiled"
except ImportError:  # pragma: no cover - only where the extension could not be built
    walk, walk_from, WALK = walk_python, walk_from_python, "python"


def unhold_python(held: dict[int, int], blocks: dict[int, int], keys: Iterable[int], bit: int, shifted: int) -> int:
    """Take tier ``bit`` (``shifted`` to the worker's slot in ``blocks``' bit sets) from ``keys`` in the
    worker's reverse map ``held`` and the model's table ``blocks``; returns how many keys had it. The
    reference of the compiled :func:`unhold` (``indexer/_apply.pyx``) and its fallback."""
    n = 0
    for key in keys:
        old = held.get(key)
        if old is None or not old & bit:
            continue
        if old == bit:
            del held[key]
        else:
            held[key] = old & ~bit
        n += 1
        value = blocks[key] & ~shifted
        if value:
            blocks[key] = value
        else:
            del blocks[key]
    return n


unhold: Callable[[dict[int, int], dict[int, int], Iterable[int], int, int], int]
try:
    from kvroute.indexer._apply import unhold as _compiled_unhold

    unhold = _compiled_unhold
except ImportError:  # pragma: no cover - only where the extension could not be built
    unhold = unhold_python


class MemoryIndex(IndexBackend):
    """In-process index for one router (the embedded default).

    ``max_blocks`` bounds the blocks held (all models together; None = unbounded): past it, the oldest
    blocks (by insertion, refreshed when stored again) of the largest model table are forgotten, a
    hundredth of the capacity at a time, and counted by :attr:`on_evict` (``kvroute_index_evicted_blocks_total``).
    """

    name = "memory"

    def __init__(self, max_blocks: int | None = None) -> None:
        if max_blocks is not None and max_blocks < 1:
            raise ValueError("max_blocks must be positive (or None: unbounded)")
        self._models: dict[str, _Model] = {}
        self.max_blocks = max_blocks
        self.evicted_blocks = 0

    def _model(self, model: str) -> _Model:
        table = self._models.get(model)
        if table is None:
            table = self._models[model] = _Model()
        return table

    async def apply(self, model: str, worker_id: str, ops: Sequence[IndexOp]) -> None:
        self.apply_sync(model, worker_id, ops)

    def apply_sync(self, model: str, worker_id: str, ops: Sequence[IndexOp]) -> None:
        """The work of :meth:`apply` without the coroutine (used by benchmarks and the service)."""
        table = self._model(model)
        for op in ops:
            if op.kind == "clear":
                table.drop(worker_id)
                continue
            slot = table.slot_of(worker_id)
            held = table.held[worker_id]
            tiers = table.counts[worker_id]
            blocks = table.blocks
            bit = int(op.tier) & _BYTE
            if not bit:
                continue
            shifted = bit << (slot * SLOT_BITS)
            if op.kind == "store":
                keys = op.keys if isinstance(op.keys, list) else list(op.keys)
                tiers[bit] = tiers.get(bit, 0) + add_bits_counted(held, keys, bit)
                present = add_bits(blocks, keys, shifted)
                if present:
                    table.epoch += 1
                    if self.max_blocks is not None:
                        for key in present:  # stored again: the newest, evicted last
                            blocks[key] = blocks.pop(key)
            else:
                gone = unhold(held, blocks, op.keys, bit, shifted)
                if gone:
                    tiers[bit] -= gone
                    table.epoch += gone

        if self.max_blocks is not None:
            self._bound()

    def _bound(self) -> None:
        """Evict past :attr:`max_blocks`, from the largest table, a hundredth of the capacity at a time (one
        pass over the dict's head per round, not per block)."""
        limit = self.max_blocks
        assert limit is not None
        total = sum(len(t.blocks) for t in self._models.values())
        if total <= limit:
            return
        chunk = max(1, limit // 100)
        evicted = 0
        while total > limit:
            table = max(self._models.values(), key=lambda t: len(t.blocks))
            n = table.evict(max(chunk, total - limit))
            if not n:
                break
            evicted += n
            total -= n
        self.evicted_blocks += evicted
        if self.on_evict is not None:
            self.on_evict(evicted)

    def total_blocks(self) -> int:
        return sum(len(t.blocks) for t in self._models.values())

    async def lookup(self, model: str, keys: Sequence[int]) -> dict[str, WorkerMatch]:
        return self.lookup_sync(model, keys)

    def lookup_sync(self, model: str, keys: Sequence[int]) -> dict[str, WorkerMatch]:
        table = self._models.get(model)
        if table is None or not keys:
            return {}
        owners = table.owners
        out: dict[str, WorkerMatch] = {}
        counts, state = walk_from(table.blocks, keys, table.resumable(keys), True)
        if state is not None:
            table.remember(keys, state)
        for slot, (blocks, gpu, cpu, storage, remote) in counts.items():
            worker = owners.get(slot)
            if worker is not None and blocks > 0:
                out[worker] = WorkerMatch(worker, blocks, gpu, cpu, storage, remote)
        return out

    async def purge_worker(self, worker_id: str) -> None:
        for table in self._models.values():
            table.drop(worker_id)

    async def block_workers(self, model: str, key: int) -> dict[str, int]:
        table = self._models.get(model)
        if table is None:
            return {}
        value = table.blocks.get(key, 0)
        out = {}
        for slot in _slots_of(_lanes(value)):
            worker = table.owners.get(slot)
            if worker is not None:
                out[worker] = (value >> (slot * SLOT_BITS)) & _BYTE
        return out

    async def presence(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        table = self._models.get(model)
        if table is None:
            return {}
        get = table.blocks.get
        by_slot: dict[int, int] = {}
        for i, key in enumerate(keys):
            value = get(key)
            if value:
                for slot in _slots_of(_lanes(value)):
                    by_slot[slot] = by_slot.get(slot, 0) | (1 << i)
        owners = table.owners
        return {owners[slot]: mask for slot, mask in by_slot.items() if slot in owners}

    async def worker_stats(self) -> list[WorkerIndexStats]:
        out = []
        for model, table in self._models.items():
            for worker, held in table.held.items():
                out.append(WorkerIndexStats(worker, model, len(held), named_counts(table.counts[worker])))
        return out
