"""kvroute's own block keys: one 64-bit chain over token ids, for events and requests alike.

``key[i] = xxh3_64(tokens of block i || extra keys of block i, seed=key[i-1])`` with ``key[-1]`` the
model's root key (the previous key as the seed keeps the chain and saves a byte concatenation per
block: keys of a 32k-token prompt are the hot part of a routing decision).

vLLM's own block hashes are random per process unless every engine shares ``PYTHONHASHSEED``, so the
index never depends on them: it recomputes this chain from the tokens the events carry and keeps, per
worker, an alias map from vLLM's hash to ours.

Extra keys follow vLLM's placement: the LoRA name on every block, the tenant's ``cache_salt`` on the
first block only, so two tenants' identical prompts never share a key.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import msgspec
import xxhash

_hash = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"
_MASK = (1 << 64) - 1


def root_key(model: str) -> int:
    """The chain's starting point; folding in the model keeps two models' prefixes apart."""
    return _hash(b"kvroute/v1\x00" + model.encode())


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian uint32 bytes of ``tokens`` (one conversion per event or request, not per block)."""
    packed = array("I", tokens)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def extra_bytes(extra: Sequence[object] | None) -> bytes:
    """Canonical bytes of one block's extra keys; empty when there are none."""
    if not extra:
        return b""
    return msgspec.msgpack.encode(list(extra))


def request_extra_keys(
    num_blocks: int, *, lora_name: str | None = None, cache_salt: str | None = None
) -> list[list[str] | None] | None:
    """Per-block extra keys of a request, placed exactly as vLLM places them in its events."""
    if not lora_name and not cache_salt:
        return None
    extras: list[list[str] | None] = []
    for i in range(num_blocks):
        item: list[str] = []
        if lora_name:
            item.append(lora_name)
        if cache_salt and i == 0:
            item.append(cache_salt)
        extras.append(item or None)
    return extras


def chain_keys(
    tokens: Sequence[int],
    block_size: int,
    parent: int,
    extra_keys: Sequence[Sequence[object] | None] | None = None,
    *,
    max_blocks: int | None = None,
) -> list[int]:
    """Keys of the full blocks of ``tokens`` chained from ``parent`` (a partial last block is ignored)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    count = len(tokens) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    if count == 0:
        return []
    size = count * block_size
    packed = array("I", tokens if len(tokens) == size else tokens[:size])
    if not _LITTLE:
        packed.byteswap()
    data = memoryview(packed).cast("B")
    step = block_size * 4
    keys: list[int] = []
    append = keys.append
    key = parent & _MASK
    # The previous key is the seed of the next block's hash: no per-block byte concatenation.
    if extra_keys is None:
        for offset in range(0, size * 4, step):
            key = _hash(data[offset : offset + step], key)
            append(key)
    else:
        for i, offset in enumerate(range(0, size * 4, step)):
            extra = extra_bytes(extra_keys[i]) if i < len(extra_keys) else b""
            block = data[offset : offset + step]
            key = _hash(bytes(block) + extra if extra else block, key)
            append(key)
    return keys


def request_keys(
    tokens: Sequence[int], block_size: int, model: str, *, lora_name: str | None = None, cache_salt: str | None = None
) -> list[int]:
    """Keys of a request's prompt: what the index is asked about."""
    extras = request_extra_keys(len(tokens) // block_size, lora_name=lora_name, cache_salt=cache_salt)
    return chain_keys(tokens, block_size, root_key(model), extras)
