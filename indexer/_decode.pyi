from collections.abc import Callable
from typing import Any

def read_uint32s(raw: Any) -> bytes | None: ...
def fold(
    typed: list[Any],
    convert: Callable[[Any], Any],
    removed_type: type,
    same_tier: Callable[[Any, Any], bool],
    max_blocks: int,
) -> tuple[list[Any], dict[int, int] | None] | None: ...
