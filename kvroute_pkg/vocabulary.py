"""kvroute's shared vocabulary: the words every layer speaks, defined once, below every layer.

* :data:`Role` — what a worker does in a pool (both, prefill-only, decode-only).
* :data:`KVProtocol` — how KV cache moves between workers (none, vLLM's P2P offloading tier, NixlConnector P/D).
* :class:`Tier` — where a cached block sits: medium (GPU / CPU / STORAGE) and locality (LOCAL / REMOTE) as
  bits. One worker can hold the same block in several places at once, so a block's location is a bit set.
* :data:`SOURCE_OF_TIER` — the same places as vLLM's per-source cached-token metric names them.

Config, indexer, policies, router and sim all import from here; this module imports nothing of kvroute.
"""

from __future__ import annotations

from enum import IntFlag
from typing import Literal

Role = Literal["both", "prefill", "decode"]
KVProtocol = Literal["none", "p2p", "nixl"]


class Tier(IntFlag):
    GPU = 1
    CPU = 2
    STORAGE = 4
    GPU_REMOTE = 8
    CPU_REMOTE = 16
    STORAGE_REMOTE = 32


#: vLLM's ``prompt_tokens_cached_by_source`` label for each tier a plan predicts hits in.
SOURCE_OF_TIER = {"GPU": "device", "CPU": "host", "STORAGE": "disk", "REMOTE": "p2p"}

_MEDIUM_BITS = {"GPU": Tier.GPU, "CPU": Tier.CPU, "STORAGE": Tier.STORAGE, "DISK": Tier.STORAGE}
LOCAL_MASK = Tier.GPU | Tier.CPU | Tier.STORAGE


def tier_bit(medium: str | None, locality: str | None = "LOCAL") -> Tier:
    """The bit for an event's ``medium`` and ``locality`` (unknown media count as STORAGE)."""
    bit = _MEDIUM_BITS.get((medium or "GPU").upper(), Tier.STORAGE)
    if (locality or "LOCAL").upper() == "REMOTE":
        bit = Tier(bit << 3)
    return bit


def best_medium(bits: int) -> str:
    """The fastest medium a block can be loaded from: GPU, then CPU, then STORAGE."""
    bits = bits | (bits >> 3)
    if bits & Tier.GPU:
        return "GPU"
    if bits & Tier.CPU:
        return "CPU"
    return "STORAGE"
