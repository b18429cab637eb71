"""RoutedPrefixes: a prefix just routed counts as held there until it expires or is forgotten."""

from __future__ import annotations

import random

import pytest
from kvroute.router.routed_prefixes import RoutedPrefixes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def chain(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def test_a_routed_prefix_is_held_by_its_worker_only() -> None:
    routed = RoutedPrefixes(ttl_s=5, stride=4, now=Clock())
    keys = chain(40)
    routed.note("r1", "m", "w0", keys)
    assert routed.held("m", keys) == {"w0": 40}
    assert routed.held("other-model", keys) == {}
    # A longer prompt sharing the prefix: the routed part, to the block where the prompts part.
    assert routed.held("m", keys + chain(10, seed=1)) == {"w0": 40}
    assert routed.held("m", keys[:30] + chain(10, seed=2)) == {"w0": 30}
    assert routed.held("m", chain(40, seed=3)) == {}


def test_what_a_routed_request_is_computing_is_not_ready_until_it_answers() -> None:
    routed = RoutedPrefixes(ttl_s=5, stride=4, now=Clock())
    keys = chain(40)
    routed.note("r1", "m", "w0", keys, ready=10)  # w0 held 10 blocks; r1 computes the other 30
    assert routed.held_ready("m", keys) == {"w0": (40, 8)}  # to the last checkpoint before block 10
    routed.note("r2", "m", "w0", keys[:20], ready=20)  # queued behind r1: computing wins while r1 runs
    assert routed.held_ready("m", keys) == {"w0": (40, 8)}
    routed.forget("r1")
    assert routed.held_ready("m", keys) == {"w0": (20, 20)}
    routed.note("r3", "m", "w1", keys, ready=40)  # a whole hit: nothing computing
    assert routed.held_ready("m", keys)["w1"] == (40, 40)
    routed.note("r4", "m", "w2", keys[:6] + chain(3, seed=9))  # ready=0: all of it computing
    assert routed.held_ready("m", keys)["w2"] == (6, 0)


def test_a_note_made_from_a_prompts_head_grows_to_the_whole_prompt() -> None:
    """A prompt decided on its head (router/prompt_head.py) is noted with the head's keys; once the rest is
    encoded, its note covers the whole prompt, on the worker it went to, unless it answered meanwhile."""
    routed = RoutedPrefixes(ttl_s=5, stride=16, now=Clock())
    keys = chain(100)
    routed.note("r1", "m", "w1", keys[:10], ready=3)
    assert routed.held_ready("m", keys) == {}  # a head shorter than a stride: no checkpoint in common
    routed.grow("r1", keys)
    assert routed.held_ready("m", keys) == {"w1": (100, 0)}  # ready=3 rounds down to no checkpoint
    routed.forget("r1")
    routed.grow("r1", keys)  # answered before its rest was encoded: nothing to grow
    assert routed.held("m", keys) == {} and len(routed) == 0


def test_notes_expire_and_failed_requests_are_forgotten() -> None:
    clock = Clock()
    routed = RoutedPrefixes(ttl_s=5, stride=8, now=clock)
    a, b = chain(16, 1), chain(16, 2)
    routed.note("ra", "m", "w0", a)
    clock.t += 3
    routed.note("rb", "m", "w1", b)
    routed.forget("rb")
    assert routed.held("m", b) == {}
    assert routed.held("m", a) == {"w0": 16}
    clock.t += 2.5
    assert routed.held("m", a) == {}
    assert len(routed) == 0


def test_two_notes_of_one_prefix_keep_it_until_both_are_gone() -> None:
    routed = RoutedPrefixes(ttl_s=5, stride=2, now=Clock())
    keys = chain(10)
    routed.note("r1", "m", "w0", keys)
    routed.note("r2", "m", "w0", keys[:6])
    routed.note("r3", "m", "w1", keys[:4])
    assert routed.held("m", keys) == {"w0": 10, "w1": 4}
    routed.forget("r1")
    assert routed.held("m", keys) == {"w0": 6, "w1": 4}


def test_memory_is_bounded_by_max_notes() -> None:
    routed = RoutedPrefixes(ttl_s=60, stride=16, max_notes=10, now=Clock())
    for i in range(100):
        routed.note(f"r{i}", "m", f"w{i % 3}", chain(64, seed=i))
    assert len(routed) == 10
    assert routed.held("m", chain(64, seed=0)) == {}  # the oldest went first
    assert routed.held("m", chain(64, seed=99)) == {"w0": 64}


def test_zero_ttl_disables_and_bad_settings_are_refused() -> None:
    routed = RoutedPrefixes(ttl_s=0)
    routed.note("r", "m", "w0", chain(8))
    assert routed.held("m", chain(8)) == {}
    with pytest.raises(ValueError):
        RoutedPrefixes(stride=0)


def test_notes_counted_by_a_lookup_or_not_yet_are_forgotten_alike() -> None:
    """A note is counted into its worker's keys only by the next lookup: forgetting, re-noting and evicting
    must treat counted and uncounted notes alike."""
    routed = RoutedPrefixes(ttl_s=5, stride=4, max_notes=2, now=Clock())
    keys = chain(12)
    routed.note("r1", "m", "w0", keys)
    assert routed.held("m", keys) == {"w0": 12}  # r1 counted
    routed.note("r1", "m", "w1", keys[:8])  # the same request re-noted elsewhere, not yet counted
    routed.note("r2", "m", "w2", keys)
    assert routed.held("m", keys) == {"w1": 8, "w2": 12}
    routed.forget("r2")
    routed.note("r3", "m", "w2", keys[:4])
    routed.note("r4", "m", "w0", keys)  # evicts r1, counted; r3 and r4 are not yet
    assert len(routed) == 2
    assert routed.held("m", keys) == {"w2": 4, "w0": 12}
    routed.forget("r3")
    routed.forget("r4")
    assert routed.held("m", keys) == {} and len(routed) == 0


def test_a_shared_prefix_counts_to_the_block_not_to_the_checkpoint() -> None:
    """A group's system prompt of 47 blocks with a new question after it, checkpoints every 16 blocks: a
    request queued behind it shares 47 blocks of it, not 32 (the old rounding priced 15 blocks of prefill
    the request never ran). The blocks past the checkpoint are ready as the note says, computing otherwise."""
    routed = RoutedPrefixes(ttl_s=5, stride=16, now=Clock())
    system = chain(47)
    first, second = system + chain(9, seed=1), system + chain(9, seed=2)
    routed.note("r1", "m", "w0", first)  # nothing held: w0 computes all of it
    assert routed.held_ready("m", second) == {"w0": (47, 0)}
    routed.note("r2", "m", "w1", first, ready=56)  # a whole hit on w1: nothing computing
    assert routed.held_ready("m", second)["w1"] == (47, 47)
    routed.note("r3", "m", "w2", first, ready=40)  # w2 held 40 blocks: ready to there, computing after
    assert routed.held_ready("m", second)["w2"] == (47, 40)
    routed.forget("r2")
    assert "w1" not in routed.held_ready("m", second)


def test_chains_are_kept_within_their_key_budget_and_released() -> None:
    """Past ``max_chain_keys`` a note keeps its checkpoints only (the shared prefix is rounded down to one);
    the keys come back to the budget when a note goes, whether it was counted or not."""
    routed = RoutedPrefixes(ttl_s=5, stride=16, now=Clock(), max_chain_keys=100)
    system = chain(47)
    routed.note("r1", "m", "w0", system + chain(9, seed=1))
    assert routed.chain_keys == 56
    routed.note("r2", "m", "w1", system + chain(9, seed=3))  # 112 > 100: checkpoints only
    assert routed.chain_keys == 56
    second = system + chain(9, seed=2)
    assert routed.held("m", second) == {"w0": 47, "w1": 32}
    routed.forget("r1")  # counted by that lookup
    routed.note("r4", "m", "w2", system)  # not counted yet
    assert routed.chain_keys == 47
    routed.forget("r4")
    routed.forget("r2")
    assert routed.chain_keys == 0 and routed.held("m", second) == {}
    with pytest.raises(ValueError):
        RoutedPrefixes(max_chain_keys=-1)
