from collections.abc import Sequence

from kvroute.indexer.memory import WalkState

def walk(blocks: dict[int, int], keys: Sequence[int]) -> dict[int, list[int]]: ...
def walk_from(
    blocks: dict[int, int], keys: Sequence[int], resume: WalkState | None = None, keep: bool = False
) -> tuple[dict[int, list[int]], WalkState | None]: ...
