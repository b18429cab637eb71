"""A hybrid model's prefix hit: what every KV-cache group can serve, as vLLM's hybrid coordinator finds it.

vLLM 0.33 (``HybridKVCacheCoordinator.find_longest_cache_hit``) takes the full-attention groups' hit (a
run of blocks from the start) and lets every other group cut it down until they all agree: a
sliding-window group serves a hit of ``n`` blocks only when it holds the ``cdiv(window - 1, block_size)``
blocks right before ``n`` (searched from the right, ``SlidingWindowManager``; or, failing that, a run
from the start shorter than that), a Mamba group only when it holds the state block ``n - 1``. Hits are
capped at the prompt's length minus one token. The primary group's run comes from the model's own
table; each other indexed group is asked which of those blocks it holds (:meth:`IndexBackend.presence`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.indexer.backend import IndexBackend, WorkerMatch
from kvroute.indexer.ingest import ModelInfo, group_table


def run_from_start(mask: int, limit: int) -> int:
    """How many blocks from block 0 on ``mask`` holds, at most ``limit``."""
    run = (~mask & (mask + 1)).bit_length() - 1
    return min(run, limit)


def window_hit(mask: int, limit: int, need: int) -> int:
    """vLLM's sliding-window hit: the largest ``n <= limit`` with blocks ``n - need .. n - 1`` held, else
    the run from block 0 when it is shorter than ``need`` (a short prefix needs no full window)."""
    run = 0
    for i in range(limit - 1, -1, -1):
        if mask >> i & 1:
            run += 1
            if run >= need:
                return i + need
        else:
            run = 0
    return run


def group_hit(masks: Sequence[tuple[int, int]], blocks: int) -> int:
    """The hit every group serves, starting from the primary run ``blocks``: ``masks`` holds ``(need,
    mask)`` per other group (need 0: full attention). Repeated until no group cuts it any more."""
    hit = blocks
    while True:
        before = hit
        for need, mask in masks:
            hit = run_from_start(mask, hit) if need == 0 else window_hit(mask, hit, need)
            if hit == 0:
                return 0
        if hit == before:
            return hit


async def hybrid_matches(
    backend: IndexBackend,
    info: ModelInfo,
    keys: Sequence[int],
    matches: dict[str, WorkerMatch],
    max_blocks: int,
) -> dict[str, WorkerMatch]:
    """``matches`` of the primary group cut down to what the model's other groups serve. ``max_blocks``:
    the most a hit can be (vLLM computes the prompt's last token, whatever it holds)."""
    size = info.block_size
    if not matches or not info.side_groups or not size:
        return matches
    longest = min(max(m.blocks for m in matches.values()), max_blocks)
    if longest <= 0:
        return {}
    head = keys[:longest]
    groups = []
    for idx in info.side_groups:
        groups.append((info.groups[idx].need(size), await backend.presence(group_table(info.name, idx), head)))
    out: dict[str, WorkerMatch] = {}
    cut: dict[int, list[str]] = {}
    for worker, match in matches.items():
        start = min(match.blocks, max_blocks)
        hit = group_hit([(need, masks.get(worker, 0)) for need, masks in groups], start)
        if hit == match.blocks:
            out[worker] = match
        elif hit > 0:
            cut.setdefault(hit, []).append(worker)
    for hit, workers in cut.items():
        # The tier split of the shorter run: the primary table asked again for exactly those blocks.
        shorter = await backend.lookup(info.name, keys[:hit])
        for worker in workers:
            if worker in shorter:
                out[worker] = shorter[worker]
    return out
