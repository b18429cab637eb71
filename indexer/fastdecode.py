"""The fast path of KV-event decoding: msgspec validates the common shapes in C.

:func:`kvroute.indexer.events.decode_batch` is the reference decoder: generic msgpack, then every
field checked in Python (per block hash, too). That is most of the ingestion cost, so this module
first decodes with typed msgspec schemas of vLLM's two event forms (tagged maps, tagged arrays) and
only falls back to the reference decoder when the typed one refuses the payload (unknown event
types, odd values, hostile input): same results, same errors, a fraction of the time.

A ``BlockStored``'s ``token_ids`` (16 per block: most of a fresh prompt's payload) stay undecoded
(``msgspec.Raw``) and are read straight into packed uint32s by the compiled reader
(``indexer/_decode.pyx``), as :class:`~kvroute.indexer.keys.TokenIds`: the bytes the block keys hash,
no Python int per token. What it does not read (nil, odd values) msgspec decodes as ``list[int]``, as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from kvroute.indexer.events import (
    MAX_BLOCKS_PER_EVENT,
    MAX_EVENTS_PER_BATCH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    KVEvent,
    decode_batch,
    extra_keys_too_deep,
    same_removal_tier,
)
from kvroute.indexer.keys import TokenIds

#: The compiled reader of packed token ids (None where it was not built, or on a big-endian machine, where
#: the packed little-endian bytes are not an ``array("I")``'s) and the compiled fold of removals.
#: ``DECODER`` says whether the compiled loops are used (``compiled``) or the Python ones (``python``).
_read_uint32s: Callable[[Any], bytes | None] | None
try:
    from kvroute.indexer._decode import fold as _compiled_fold
    from kvroute.indexer._decode import read_uint32s as _compiled_reader
except ImportError:  # pragma: no cover - only where the extension could not be built
    _read_uint32s, _compiled_fold, DECODER = None, None, "python"  # type: ignore[assignment]
else:
    _read_uint32s, DECODER = (_compiled_reader if sys.byteorder == "little" else None), "compiled"

_Hash = int | bytes


class _StoredMap(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: msgspec.Raw = msgspec.Raw()
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _StoredArray(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: msgspec.Raw = msgspec.Raw()
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: Any = None
    lookahead_token_ids: list[list[int]] | None = None


class _RemovedArray(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


_map_decoder = msgspec.msgpack.Decoder(tuple[float, list[_StoredMap | _RemovedMap | _ClearedMap], int | None])
_array_decoder = msgspec.msgpack.Decoder(tuple[float, list[_StoredArray | _RemovedArray | _ClearedArray], int | None])


_TypedEvent = _StoredMap | _RemovedMap | _ClearedMap | _StoredArray | _RemovedArray | _ClearedArray
_ids_decoder = msgspec.msgpack.Decoder(list[int] | None)


def _token_ids(raw: msgspec.Raw) -> Sequence[int] | None:
    """The ids of an undecoded ``token_ids`` field (empty when missing or nil); None when they are not a
    list of integers (the reference decoder then judges the payload)."""
    if not len(raw):
        return []
    if _read_uint32s is not None:
        packed = _read_uint32s(raw)
        if packed is not None:
            return TokenIds(packed)
    try:
        return _ids_decoder.decode(raw) or []
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _convert(raw: _TypedEvent) -> KVEvent | None:
    """The contract struct for one typed event; None when it needs the reference decoder's verdict."""
    if isinstance(raw, _StoredMap | _StoredArray):
        hashes = raw.block_hashes
        tokens = _token_ids(raw.token_ids)
        if tokens is None:
            return None
        size = raw.block_size or 0
        if len(hashes) > MAX_BLOCKS_PER_EVENT or not 0 <= size <= 1 << 20:
            return None
        if size and tokens and len(tokens) > len(hashes) * size:
            return None
        if raw.extra_keys is not None and extra_keys_too_deep(raw.extra_keys):
            return None
        lookahead = raw.lookahead_token_ids
        if lookahead is not None and len(lookahead) > MAX_BLOCKS_PER_EVENT:
            return None
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=raw.parent_block_hash,
            token_ids=tokens,
            block_size=size,
            lora_id=raw.lora_id,
            medium=(raw.medium or "GPU").upper(),
            lora_name=raw.lora_name,
            extra_keys=raw.extra_keys,
            group_idx=raw.group_idx or 0,
            kv_cache_spec_kind=raw.kv_cache_spec_kind or None,
            kv_cache_spec_sliding_window=raw.kv_cache_spec_sliding_window,
            locality=(raw.locality or "LOCAL").upper(),
            ownership=raw.ownership,
            lookahead_token_ids=lookahead,
        )
    if isinstance(raw, _RemovedMap | _RemovedArray):
        if len(raw.block_hashes) > MAX_BLOCKS_PER_EVENT:
            return None
        return BlockRemoved(
            block_hashes=raw.block_hashes,
            medium=(raw.medium or "GPU").upper(),
            group_idx=raw.group_idx or 0,
            locality=(raw.locality or "LOCAL").upper(),
            ownership=raw.ownership,
        )
    return AllBlocksCleared()


def fold_python(
    typed: list[Any],
    convert: Callable[[Any], KVEvent | None],
    removed_type: type[BlockRemoved],
    same_tier: Callable[[BlockRemoved, BlockRemoved], bool],
    max_blocks: int,
) -> tuple[list[KVEvent], dict[int, int] | None] | None:
    """``(events, folds)`` of msgspec's typed events: each converted by ``convert``, and a removal from the
    same tier (equal raw fields) as the removal before it joined to it, its hashes in order (vLLM sends one
    per evicted block: the ingest then makes one pass, not one per block). None when the reference decoder
    must judge the payload: ``convert`` refused an event, or two removals are of one tier only once
    normalised ("cpu", "CPU": the reference folds those). The reference of the compiled :func:`fold`."""
    events: list[KVEvent] = []
    folds: dict[int, int] | None = None
    last: Any = None  # the raw removal the last event came from (a _RemovedMap or _RemovedArray)
    hashes: list[Any] = []  # that event's hashes, which a folded removal extends
    for raw in typed:
        if (
            last is not None
            and type(raw) is type(last)
            and raw.medium == last.medium
            and raw.group_idx == last.group_idx
            and raw.locality == last.locality
            and raw.ownership == last.ownership
            and len(raw.block_hashes) <= max_blocks
        ):
            hashes.extend(raw.block_hashes)
            if folds is None:
                folds = {}
            at = len(events) - 1
            folds[at] = folds.get(at, 1) + 1
            continue
        event = convert(raw)
        if event is None:
            return None
        if type(event) is removed_type:
            before = events[-1] if last is not None else None
            if type(before) is removed_type and same_tier(event, before):
                return None
            last, hashes = raw, event.block_hashes
        else:
            last = None
        events.append(event)
    return events, folds


#: The fold the decoder uses: compiled (``indexer/_decode.pyx``) or, where it was not built, :func:`fold_python`.
fold: Callable[
    [list[Any], Callable[[Any], KVEvent | None], type[BlockRemoved], Callable[[BlockRemoved, BlockRemoved], bool], int],
    tuple[list[KVEvent], dict[int, int] | None] | None,
]
fold = _compiled_fold if _compiled_fold is not None else fold_python


def decode_batch_fast(payload: bytes) -> EventBatch:
    """Same contract as :func:`kvroute.indexer.events.decode_batch` (and its errors), faster."""
    for decoder in (_map_decoder, _array_decoder):
        try:
            ts, raw_events, dp_rank = decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            continue
        except RecursionError:  # nested past the interpreter's limit: hostile, never an internal error
            raise EventDecodeError("malformed", "msgpack nested too deep") from None
        if len(raw_events) > MAX_EVENTS_PER_BATCH or (dp_rank is not None and not 0 <= dp_rank < 4096):
            break
        folded = fold(raw_events, _convert, BlockRemoved, same_removal_tier, MAX_BLOCKS_PER_EVENT)
        if folded is None:
            return decode_batch(payload)
        events, folds = folded
        return EventBatch(ts=float(ts), events=events, dp_rank=dp_rank or 0, folds=folds)
    return decode_batch(payload)
