"""Cache semantics of the paged KV cache, on the pure class (events captured in a list)."""

from __future__ import annotations

from kvroute.indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvroute.sim.kvcache import Allocation, PagedCache

BS = 4


def make(gpu: int = 8, cpu: int = 0, **kw: object) -> tuple[PagedCache, list[KVEvent]]:
    events: list[KVEvent] = []
    return PagedCache(gpu, BS, events.append, cpu_blocks=cpu, seed=7, **kw), events  # type: ignore[arg-type]


def run(cache: PagedCache, tokens: list[int]) -> tuple[Allocation, int]:
    """Admit + compute + store like the engine does; returns the allocation and the GPU hit blocks."""
    hashes = cache.block_hashes(tokens)
    n_gpu, _ = cache.match(hashes)
    alloc = Allocation()
    cache.acquire(alloc, hashes[:n_gpu])
    assert cache.reserve(alloc, len(hashes) - n_gpu)
    parent = hashes[n_gpu - 1] if n_gpu else None
    cache.store(alloc, hashes[n_gpu:], tokens[n_gpu * BS : len(hashes) * BS], parent)
    return alloc, n_gpu


def test_chain_hashes_depend_on_prefix_and_seed() -> None:
    cache, _ = make()
    a = cache.block_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = cache.block_hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[1] != b[1]  # same block tokens, different parent
    assert cache.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # partial block ignored
    other = PagedCache(8, BS, lambda e: None, seed=8)
    assert other.block_hashes([1, 2, 3, 4]) != a[:1]
    assert cache.block_hashes([5, 6, 7, 8], parent=a[0]) == a[1:]
    assert len(make(hash_bytes=True)[0].block_hashes([1, 2, 3, 4])[0]) == 32


def test_shared_prefix_hits_and_events_chain() -> None:
    cache, events = make()
    alloc, hits = run(cache, list(range(12)))
    assert hits == 0
    cache.release(alloc)
    stored = events[0]
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.token_ids == list(range(12)) and stored.block_size == BS and stored.medium == "GPU"
    events.clear()
    alloc, hits = run(cache, [*range(8), 100, 101, 102, 103])
    assert hits == 2
    (second,) = events
    assert isinstance(second, BlockStored) and second.parent_block_hash == stored.block_hashes[1]
    assert second.token_ids == [100, 101, 102, 103]


def test_lru_eviction_emits_removals_tail_first_and_respects_references() -> None:
    cache, events = make(gpu=4)
    a, _ = run(cache, list(range(12)))  # 3 blocks, referenced
    cache.release(a)
    first = events[0].block_hashes  # type: ignore[union-attr]
    b, _ = run(cache, list(range(50, 58)))  # 2 new blocks: 1 free slot + 1 eviction
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [r.block_hashes for r in removed] == [[first[2]]]  # the tail goes first
    assert cache.usage() == 0.5
    # Referenced blocks are never evicted: a request needing more than what is free is refused.
    assert not cache.reserve(Allocation(), 3)
    cache.release(b)
    assert cache.usage() == 0


def test_cpu_tier_offload_promotion_and_max_offload() -> None:
    cache, events = make(gpu=2, cpu=4)
    a, _ = run(cache, list(range(8)))
    cache.release(a)
    first = cache.block_hashes(list(range(8)))
    b, _ = run(cache, list(range(100, 108)))  # evicts both -> offloaded to CPU
    cache.release(b)
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert {h for e in cpu_stored for h in e.block_hashes} == set(first)
    assert cpu_stored[0].token_ids  # self-describing by default
    assert cache.match(first) == (0, 2)  # a CPU hit, promoted by the engine
    # max_offload_tokens = 0: blocks stored with offload_blocks=0 never reach the CPU tier.
    cache2, _ = make(gpu=1, cpu=4)
    alloc = Allocation()
    h = cache2.block_hashes([1, 2, 3, 4])
    cache2.reserve(alloc, 1)
    cache2.store(alloc, h, [1, 2, 3, 4], None, offload_blocks=0)
    cache2.release(alloc)
    run(cache2, [9, 9, 9, 9])
    assert not cache2.cpu


def test_placeholder_cpu_events_when_not_self_describing() -> None:
    cache, events = make(gpu=1, cpu=2, self_describing=False)
    a, _ = run(cache, [1, 2, 3, 4])
    cache.release(a)
    run(cache, [5, 6, 7, 8])
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu and cpu[0].is_placeholder


def test_reset_refused_while_in_use_then_clears() -> None:
    cache, events = make(cpu=2)
    a, _ = run(cache, list(range(8)))
    assert not cache.reset()
    cache.release(a)
    before = len(events)
    assert cache.reset()
    assert cache.match(cache.block_hashes(list(range(8)))) == (0, 0)
    assert len(events) == before  # vLLM publishes the reset at its next engine step, not at once
    cache.step()
    assert isinstance(events[-1], AllBlocksCleared) and len(events) == before + 1
    cache.step()
    assert len(events) == before + 1  # once


def test_a_pending_reset_goes_out_before_the_next_steps_events() -> None:
    cache, events = make(cpu=2)
    a, _ = run(cache, list(range(8)))
    cache.release(a)
    assert cache.reset()
    before = len(events)
    run(cache, list(range(100, 108)))  # the next step stores blocks: the clear is published first
    assert isinstance(events[before], AllBlocksCleared)
    assert isinstance(events[before + 1], BlockStored)
