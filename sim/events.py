"""The KV events a simulated worker emits, and vLLM 0.33's exact encoding of them.

:class:`SimBlockStored` / :class:`SimBlockRemoved` are the shared wire types
(``kvroute.indexer.events``, which carry the fields vLLM 0.32-0.33 added: the KV-cache group's spec
``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``, ``ownership`` (the secondary offloading tier
that produced the event) and ``lookahead_token_ids`` (the tokens past each block its hash covers,
EAGLE-style lookahead hashing)) plus ``session_id`` (the session of the request that stored the blocks).

Two encodings:

- ``legacy`` (default): the shared :func:`kvroute.indexer.events.encode_batch` — every base field
  written, ``None`` included, the new fields never.
- ``0.33``: :func:`encode_batch_v033`, what vLLM 0.33's msgspec structs produce (``KVCacheEvent`` is
  ``omit_defaults=True, tag=True``): the fields without a default (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name`` for
  ``BlockStored``; ``block_hashes``, ``medium`` for ``BlockRemoved``) always, every optional field only
  when it is not ``None``. Read from ``vllm/distributed/kv_events.py`` of vLLM 0.33.0. ``locality`` is
  never written: vLLM leaves it unset (None) for the GPU pool and the primary CPU tier, the only tiers
  the sim has (the base class's ``"LOCAL"`` is for the legacy encoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from kvroute.indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

EventFields = Literal["legacy", "0.33"]

#: vLLM's ``KVCacheSpecKind`` values the sim emits (``vllm/v1/kv_cache_interface.py``).
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


class SimBlockStored(BlockStored, kw_only=True, gc=False):
    """``BlockStored`` as the sim emits it: the group's spec set (full attention unless told), plus the
    ``session_id`` the index does not decode (the 0.33 fields are ignored by the legacy encoding)."""

    kv_cache_spec_kind: str | None = FULL_ATTENTION
    session_id: str | None = None


class SimBlockRemoved(BlockRemoved, kw_only=True, gc=False):
    """``BlockRemoved`` as the sim emits it (``ownership`` is a shared field)."""


def _optional(item: dict[str, Any], **fields: object) -> None:
    for key, value in fields.items():
        if value is not None:
            item[key] = value


def _stored_v033(event: BlockStored) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": event.block_hashes,
        "parent_block_hash": event.parent_block_hash,
        "token_ids": event.token_ids,
        "block_size": event.block_size,
        "lora_id": event.lora_id,
        "medium": event.medium,
        "lora_name": event.lora_name,
    }
    sim = isinstance(event, SimBlockStored)
    _optional(
        item,
        extra_keys=event.extra_keys,
        group_idx=event.group_idx,
        # A shared-type event from elsewhere is the GPU pool's full-attention group unless it says otherwise.
        kv_cache_spec_kind=event.kv_cache_spec_kind if sim else event.kv_cache_spec_kind or FULL_ATTENTION,
        kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
        ownership=event.ownership,
        session_id=event.session_id if isinstance(event, SimBlockStored) else None,
        lookahead_token_ids=event.lookahead_token_ids,
    )
    return item


def _removed_v033(event: BlockRemoved) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    _optional(item, group_idx=event.group_idx, ownership=event.ownership)
    return item


def event_v033(event: KVEvent) -> dict[str, Any]:
    """One event as vLLM 0.33 serialises it in the map form."""
    if isinstance(event, BlockStored):
        return _stored_v033(event)
    if isinstance(event, BlockRemoved):
        return _removed_v033(event)
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def encode_batch_v033(ts: float, events: Sequence[KVEvent], dp_rank: int) -> bytes:
    """``[ts, events, data_parallel_rank]`` (vLLM's array-like ``EventBatch``) with 0.33's event maps."""
    return msgspec.msgpack.encode([ts, [event_v033(e) for e in events], dp_rank])
