from collections.abc import Iterable

def remove(
    alias: dict[int | bytes, int],
    bits: dict[int, int],
    holders: dict[tuple[int, int], dict[str | None, int]],
    counts: dict[int, int],
    chain: dict[int | bytes, int],
    bit: int,
    hashes: list[int | bytes],
    owner: str | None,
) -> list[int]: ...
def unhold(held: dict[int, int], blocks: dict[int, int], keys: Iterable[int], bit: int, shifted: int) -> int: ...
