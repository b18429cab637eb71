"""The compiled chain walk (``indexer/_walk.pyx``) answers exactly what the Python reference answers.

Random tables over up to 20 slots (values wider than a machine word), holes, tier changes along the
chain, keys given as lists and as tuples; and the dev install must have built it (the wheel build
compiles it, so a fresh machine gets it too).
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.indexer import memory
from kvroute.indexer.memory import SLOT_BITS, walk_python

TIER_BITS = [1, 2, 4, 8, 16, 32, 3, 5, 9, 17, 33, 6, 40]


def test_the_installed_package_uses_the_compiled_walk() -> None:
    assert memory.WALK == "compiled"
    from kvroute.indexer._walk import walk as compiled

    assert memory.walk is compiled


def _table(rng: random.Random, n_keys: int, n_slots: int) -> tuple[dict[int, int], list[int]]:
    keys = [rng.getrandbits(63) for _ in range(n_keys)]
    table: dict[int, int] = {}
    for slot in range(n_slots):
        depth = rng.randrange(0, n_keys + 1)
        tier = rng.choice(TIER_BITS)
        for i in range(depth):
            if rng.random() < 0.05:
                tier = rng.choice(TIER_BITS)  # the tier changes along the chain
            if rng.random() < 0.02:
                continue  # a hole: the run stops here for this slot
            table[keys[i]] = table.get(keys[i], 0) | (tier << (slot * SLOT_BITS))
    return table, keys


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_keys=st.integers(0, 300), n_slots=st.integers(1, 20))
def test_compiled_walk_equals_the_python_walk(seed: int, n_keys: int, n_slots: int) -> None:
    from kvroute.indexer._walk import walk as compiled

    rng = random.Random(seed)
    table, keys = _table(rng, n_keys, n_slots)
    if keys and rng.random() < 0.2:
        keys.insert(rng.randrange(len(keys)), rng.getrandbits(63))  # a key nobody holds
    expected = walk_python(table, keys)
    assert compiled(table, keys) == expected
    assert compiled(table, tuple(keys)) == expected


def test_shared_value_objects_and_equal_values_are_one_run() -> None:
    """Blocks stored in one batch share one int object; equal values from separate batches are distinct
    objects: both count as the same run."""
    from kvroute.indexer._walk import walk as compiled

    keys = list(range(1000, 1100))
    big = (1 << (9 * SLOT_BITS)) | 2  # slot 9 on GPU, slot 0 on CPU
    table = dict.fromkeys(keys[:50], big)
    for k in keys[50:80]:
        table[k] = int(str(big))  # equal, not identical
    table[keys[80]] = 2  # slot 9 leaves
    assert compiled(table, keys) == walk_python(table, keys) == {0: [81, 0, 81, 0, 0], 9: [80, 80, 0, 0, 0]}
