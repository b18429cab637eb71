"""Small helpers on tier bit sets, shared by the local views and the memory backend."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvroute.vocabulary import Tier

_GPU, _CPU = int(Tier.GPU), int(Tier.CPU)


def add_bits_python(table: dict[int, int], keys: list[int], bit: int) -> set[int]:
    """``table[key] |= bit`` for every key; C-level dict updates for the keys not there yet. Returns the
    keys that were there already. The reference of the compiled :func:`add_bits` and its fallback."""
    get = table.get
    if len(keys) == 1:
        key = keys[0]
        old = get(key)
        table[key] = (old or 0) | bit
        return set() if old is None else {key}
    common = table.keys() & keys
    if not common:
        table.update(dict.fromkeys(keys, bit))
        return common
    olds = {key: get(key, 0) for key in common}
    table.update(dict.fromkeys(keys, bit))
    for key, old in olds.items():
        table[key] = old | bit
    return common


def add_bits_counted_python(table: dict[int, int], keys: list[int], bit: int) -> int:
    """:func:`add_bits`, returning how many keys did not have ``bit`` before (for maintained counters). The
    reference of the compiled :func:`add_bits_counted` and its fallback."""
    get = table.get
    if len(keys) == 1:
        key = keys[0]
        old = get(key, 0)
        table[key] = old | bit
        return 0 if old & bit else 1
    common = table.keys() & keys
    before = len(table)
    if not common:
        table.update(dict.fromkeys(keys, bit))
        return len(table) - before
    olds = {key: get(key, 0) for key in common}
    table.update(dict.fromkeys(keys, bit))
    new = len(table) - before
    for key, old in olds.items():
        table[key] = old | bit
        if not old & bit:
            new += 1
    return new


def having_python(table: dict[int, int], keys: list[int], bit: int) -> list[int]:
    """The keys (in order, repeats kept) whose value in ``table`` has ``bit``. The reference of the compiled
    :func:`having` and its fallback."""
    get = table.get
    return [key for key in keys if get(key, 0) & bit]


#: The compiled versions (``indexer/_apply.pyx``) where they were built (``kvroute.indexer.ingest.APPLY``).
add_bits: Callable[[dict[int, int], list[int], int], set[int]]
add_bits_counted: Callable[[dict[int, int], list[int], int], int]
having: Callable[[dict[int, int], list[int], int], list[int]]
try:
    from kvroute.indexer._apply import add_bits, add_bits_counted, having
except ImportError:  # pragma: no cover - only where the extension could not be built
    add_bits, add_bits_counted, having = add_bits_python, add_bits_counted_python, having_python


def named_counts(counts: dict[int, int]) -> dict[str, int]:
    """Maintained per-tier-bit counters as :func:`tier_counts` names them (zeros left out)."""
    out: dict[str, int] = {}
    for tier in Tier:
        n = counts.get(int(tier), 0)
        if n:
            out[tier.name or str(int(tier))] = n
    return out


def classify(bits: int) -> tuple[int, bool]:
    """(0 GPU / 1 CPU / 2 STORAGE: the fastest medium, remote-only?) for one worker's tier bits."""
    merged = bits | (bits >> 3)
    tier = 0 if merged & _GPU else 1 if merged & _CPU else 2
    return tier, not bits & 7


def tier_counts(values: Iterable[int]) -> dict[str, int]:
    """Blocks per tier name for an iterable of tier bit sets (a block in two tiers counts in both)."""
    counts: dict[str, int] = {}
    for bits in values:
        for tier in Tier:
            if bits & tier:
                name = tier.name or str(int(tier))
                counts[name] = counts.get(name, 0) + 1
    return counts
