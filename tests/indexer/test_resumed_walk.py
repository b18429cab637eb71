"""A lookup continues the walk of a recent chain it extends; the answer is always the fresh walk's.

The memory index remembers where recent walks stopped and continues one when a prompt extends its chain
(an agent's next step) and nothing the walk read has changed since. Random histories of stores (new keys
and keys already held, other tiers), removals, clears and evictions interleaved with lookups of growing,
branching and repeated chains: every lookup equals the walk from scratch over the same table, with the
compiled walk and with the Python reference.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.indexer import memory
from kvroute.indexer.backend import IndexOp, WorkerMatch
from kvroute.indexer.memory import MemoryIndex, walk_from_python, walk_python

TIERS = [1, 2, 4, 8]  # one tier per op, as events carry them


def fresh(index: MemoryIndex, keys: list[int]) -> dict[str, WorkerMatch]:
    """The lookup's answer from a walk that starts at the first key."""
    table = index._models.get("m")
    if table is None or not keys:
        return {}
    out = {}
    for slot, (blocks, gpu, cpu, storage, remote) in walk_python(table.blocks, keys).items():
        worker = table.owners.get(slot)
        if worker is not None and blocks > 0:
            out[worker] = WorkerMatch(worker, blocks, gpu, cpu, storage, remote)
    return out


def history(seed: int, steps: int, max_blocks: int | None) -> None:
    rng = random.Random(seed)
    index = MemoryIndex(max_blocks=max_blocks)
    workers = ["a", "b", "c"]
    chains: list[list[int]] = [[rng.getrandbits(62)]]
    resumed = 0
    for _ in range(steps):
        chain = rng.choice(chains)
        action = rng.random()
        if action < 0.3:  # an agent's next step: the chain grows (a new chain beside the old one)
            grown = chain + [rng.getrandbits(62) for _ in range(rng.randrange(1, 6))]
            chains.append(grown)
        elif action < 0.4:  # a branch from the middle
            cut = rng.randrange(0, len(chain) + 1)
            chains.append(chain[:cut] + [rng.getrandbits(62) for _ in range(rng.randrange(1, 4))])
        worker = rng.choice(workers)
        op = rng.random()
        if op < 0.45:  # a prefill stores (part of) a chain: often new keys, sometimes held ones
            chain = rng.choice(chains)
            lo = rng.randrange(0, len(chain))
            index.apply_sync("m", worker, [IndexOp("store", chain[lo:], rng.choice(TIERS))])
        elif op < 0.55:
            chain = rng.choice(chains)
            index.apply_sync("m", worker, [IndexOp("remove", rng.sample(chain, min(len(chain), 2)), 1)])
        elif op < 0.58:
            index.apply_sync("m", worker, [IndexOp("clear")])
        for _ in range(rng.randrange(1, 3)):
            probe = rng.choice(chains)
            table = index._models.get("m")
            if table is not None and probe and table.resumable(probe) is not None:
                resumed += 1
            assert index.lookup_sync("m", probe) == fresh(index, probe)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 120), bounded=st.booleans())
@pytest.mark.parametrize("walk_impl", ["compiled", "python"])
def test_every_lookup_equals_the_fresh_walk(walk_impl: str, seed: int, steps: int, bounded: bool) -> None:
    saved = memory.walk_from
    if walk_impl == "python":
        memory.walk_from = walk_from_python
    try:
        history(seed, steps, 40 if bounded else None)
    finally:
        memory.walk_from = saved


def test_an_agent_step_continues_the_previous_walk() -> None:
    """The chain grows by new keys only (the agent's own prefill): the next lookup resumes, and answers
    the fresh walk's counts; a store to a key already held stops resumption until a new walk."""
    index = MemoryIndex()
    chain = list(range(1, 101))
    index.apply_sync("m", "a", [IndexOp("store", chain, 1)])
    assert index.lookup_sync("m", chain)["a"].blocks == 100
    grown = chain + list(range(101, 121))
    index.apply_sync("m", "a", [IndexOp("store", grown[100:], 1)])
    table = index._models["m"]
    state = table.resumable(grown)
    assert state is not None and state[0] == 100  # continued at the block where the last walk stopped
    assert index.lookup_sync("m", grown) == fresh(index, grown) == {"a": WorkerMatch("a", 120, 120, 0, 0, 0)}
    index.apply_sync("m", "b", [IndexOp("store", chain[:10], 2)])  # held keys: b holds them too now
    assert table.resumable(grown) is None
    assert index.lookup_sync("m", grown) == fresh(index, grown)
    assert index.lookup_sync("m", grown)["b"].blocks == 10


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_keys=st.integers(1, 200), n_slots=st.integers(1, 12))
def test_compiled_walk_from_equals_the_python_walk_from(seed: int, n_keys: int, n_slots: int) -> None:
    """Resumed at every possible stop, both walks give the same counts and the same states."""
    from kvroute.indexer._walk import walk_from as compiled

    rng = random.Random(seed)
    keys = [rng.getrandbits(62) for _ in range(n_keys)]
    table: dict[int, int] = {}
    for slot in range(n_slots):
        for i in range(rng.randrange(0, n_keys + 1)):
            if rng.random() < 0.03:
                continue
            table[keys[i]] = table.get(keys[i], 0) | (rng.choice(TIERS) << (slot * memory.SLOT_BITS))
    cut = rng.randrange(1, n_keys + 1)
    got_py = walk_from_python(table, keys[:cut], None, True)
    got_c = compiled(table, keys[:cut], None, True)
    assert got_c == got_py
    state = got_py[1]
    assert walk_from_python(table, keys, state, True) == compiled(table, keys, state, True)
    assert compiled(table, keys, state, False)[0] == walk_python(table, keys)
