"""vLLM KV-event wire format: decoding (for the indexer) and encoding (for the simulated workers).

vLLM publishes 3-frame ZMQ messages ``[topic, seq (8 bytes big-endian), payload]`` where the payload is
a msgpack array ``[ts, events, data_parallel_rank]``. Since mid-2026 each event is a map with a
``"type"`` key; older engines send positional arrays ``["BlockStored", f1, f2, ...]`` with trailing
defaults omitted. Both are accepted; unknown keys and unknown event types are ignored.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

BlockHash = int | bytes

#: Positional field order of the array form, as vLLM's msgspec structs declare them.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")

#: Sequence number vLLM's replay socket sends to mark the end of a replay.
REPLAY_END_SEQ = b"\xff" * 8

#: Hostile-input bounds: a batch or block list larger than this is refused as malformed.
MAX_EVENTS_PER_BATCH = 100_000
MAX_BLOCKS_PER_EVENT = 1_000_000
#: Deepest nesting accepted inside ``extra_keys`` (vLLM's are a list per block of names or tuples of hashes).
MAX_EXTRA_KEYS_DEPTH = 6


class EventDecodeError(ValueError):
    """The payload is not a valid KV-event batch. ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class BlockStored(msgspec.Struct, kw_only=True, gc=False):
    """Blocks newly cached on a worker, in chain order; ``token_ids`` covers all of them.

    vLLM 0.33's fields the index uses: ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window`` (which
    KV-cache group of a hybrid model ``group_idx`` is; None from older engines), ``ownership`` (the
    secondary offloading tier that holds the copy; None for the primary one) and ``lookahead_token_ids``
    (EAGLE lookahead hashing: per block, the tokens after it that its hash covers). ``session_id`` is
    not decoded: it names the request that stored the blocks, not who may reuse them."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    #: A list, or packed ids (:class:`~kvroute.indexer.keys.TokenIds`) from the fast decoder.
    token_ids: Sequence[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str = "LOCAL"
    ownership: str | None = None
    lookahead_token_ids: list[list[int]] | None = None

    @property
    def is_placeholder(self) -> bool:
        """Offloading connectors announce CPU/STORAGE copies without tokens (``block_size`` 0)."""
        return self.block_size <= 0 or not self.token_ids


class BlockRemoved(msgspec.Struct, kw_only=True, gc=False):
    """Blocks evicted from one medium of a worker."""

    block_hashes: list[BlockHash]
    medium: str = "GPU"
    group_idx: int = 0
    locality: str = "LOCAL"
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, kw_only=True, gc=False):
    """The worker's prefix cache was reset: forget everything it had."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, gc=False):
    """One scheduler step's events from one data-parallel rank."""

    ts: float
    events: list[KVEvent]
    dp_rank: int = 0
    #: Events of unknown type that were skipped (counted by the indexer, never an error).
    skipped: int = 0
    #: Index in ``events`` -> how many of the engine's events that one stands for, where the decoder folded a
    #: run of consecutive ``BlockRemoved`` of one tier into one (vLLM sends one per evicted block); None: none.
    folds: dict[int, int] | None = None


_decoder = msgspec.msgpack.Decoder()


def _check_hash(value: object, what: str) -> BlockHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise EventDecodeError("bad_field", f"{what} must be int or bytes, got {type(value).__name__}")
    return value


def _check_hashes(value: object) -> list[BlockHash]:
    if not isinstance(value, list):
        raise EventDecodeError("bad_field", "block_hashes must be a list")
    if len(value) > MAX_BLOCKS_PER_EVENT:
        raise EventDecodeError("too_large", f"{len(value)} block hashes")
    for item in value:
        _check_hash(item, "block hash")
    return value


def _str_or(value: object, default: str, what: str) -> str:
    if value is None or value == "":
        return default
    if not isinstance(value, str):
        raise EventDecodeError("bad_field", f"{what} must be a string")
    return value


def _int_or(value: object, default: int, what: str) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventDecodeError("bad_field", f"{what} must be an integer")
    return value


def _opt_str(value: object, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise EventDecodeError("bad_field", f"{what} must be a string")
    return value


def _opt_int(value: object, what: str) -> int | None:
    return None if value is None else _int_or(value, 0, what)


def _lookahead(value: object) -> list[list[int]] | None:
    """``lookahead_token_ids``: a list of token lists (their count and lengths are checked on ingestion)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, list) for item in value):
        raise EventDecodeError("bad_field", "lookahead_token_ids must be a list of token lists")
    if len(value) > MAX_BLOCKS_PER_EVENT:
        raise EventDecodeError("too_large", f"{len(value)} lookahead entries")
    for item in value:
        if any(isinstance(t, bool) or not isinstance(t, int) for t in item):
            raise EventDecodeError("bad_field", "lookahead_token_ids must hold integers")
    return value


def extra_keys_too_deep(value: object, depth: int = MAX_EXTRA_KEYS_DEPTH) -> bool:
    """True when ``value`` nests lists/tuples/maps deeper than ``depth`` (bounded work: stops there)."""
    if isinstance(value, list | tuple):
        return depth <= 0 or any(extra_keys_too_deep(v, depth - 1) for v in value if isinstance(v, list | tuple | dict))
    if isinstance(value, dict):
        return depth <= 0 or any(
            extra_keys_too_deep(v, depth - 1) for v in value.values() if isinstance(v, list | tuple | dict)
        )
    return False


def _stored(fields: dict[str, object]) -> BlockStored:
    hashes = _check_hashes(fields.get("block_hashes"))
    raw_parent = fields.get("parent_block_hash")
    parent = None if raw_parent is None else _check_hash(raw_parent, "parent_block_hash")
    tokens = fields.get("token_ids") or []
    if not isinstance(tokens, list):
        raise EventDecodeError("bad_field", "token_ids must be a list")
    block_size = _int_or(fields.get("block_size"), 0, "block_size")
    if block_size < 0 or block_size > 1 << 20:
        raise EventDecodeError("bad_field", f"block_size {block_size} out of range")
    if block_size and tokens and len(tokens) > len(hashes) * block_size:
        raise EventDecodeError("bad_field", "more token_ids than blocks can hold")
    extra = fields.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise EventDecodeError("bad_field", "extra_keys must be a list")
    if extra is not None and extra_keys_too_deep(extra):
        raise EventDecodeError("malformed", "extra_keys nested too deep")
    lora_name = fields.get("lora_name")
    if lora_name is not None and not isinstance(lora_name, str):
        raise EventDecodeError("bad_field", "lora_name must be a string")
    lora_id = fields.get("lora_id")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=lora_id if isinstance(lora_id, int) else None,
        medium=_str_or(fields.get("medium"), "GPU", "medium").upper(),
        lora_name=lora_name,
        extra_keys=extra,
        group_idx=_int_or(fields.get("group_idx"), 0, "group_idx"),
        kv_cache_spec_kind=_opt_str(fields.get("kv_cache_spec_kind"), "kv_cache_spec_kind") or None,
        kv_cache_spec_sliding_window=_opt_int(fields.get("kv_cache_spec_sliding_window"), "sliding window"),
        locality=_str_or(fields.get("locality"), "LOCAL", "locality").upper(),
        ownership=_opt_str(fields.get("ownership"), "ownership"),
        lookahead_token_ids=_lookahead(fields.get("lookahead_token_ids")),
    )


def _removed(fields: dict[str, object]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_check_hashes(fields.get("block_hashes")),
        medium=_str_or(fields.get("medium"), "GPU", "medium").upper(),
        group_idx=_int_or(fields.get("group_idx"), 0, "group_idx"),
        locality=_str_or(fields.get("locality"), "LOCAL", "locality").upper(),
        ownership=_opt_str(fields.get("ownership"), "ownership"),
    )


def _event(raw: object) -> KVEvent | None:
    """One event in map or array form; None for an unknown type."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = STORED_FIELDS if kind == "BlockStored" else REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventDecodeError("bad_event", f"event must be a map or a tagged array, got {type(raw).__name__}")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return _removed(fields)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload frame. Raises :class:`EventDecodeError` on anything malformed."""
    try:
        raw = _decoder.decode(payload)
    except RecursionError:
        # msgspec bounds nesting by the interpreter's recursion limit: a hostile payload, not a bug.
        raise EventDecodeError("malformed", "msgpack nested too deep") from None
    except (msgspec.DecodeError, ValueError) as exc:
        raise EventDecodeError("not_msgpack", str(exc)[:200]) from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise EventDecodeError("bad_batch", "payload must be an array [ts, events, dp_rank]")
    ts, raw_events = raw[0], raw[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise EventDecodeError("bad_batch", "ts must be a number")
    if not isinstance(raw_events, list):
        raise EventDecodeError("bad_batch", "events must be an array")
    if len(raw_events) > MAX_EVENTS_PER_BATCH:
        raise EventDecodeError("too_large", f"{len(raw_events)} events in one batch")
    dp_rank = raw[2] if len(raw) > 2 and raw[2] is not None else 0
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < 4096:
        raise EventDecodeError("bad_batch", "data_parallel_rank must be a small non-negative integer")
    events: list[KVEvent] = []
    skipped = 0
    for item in raw_events:
        event = _event(item)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    events, folds = fold_removals(events)
    return EventBatch(ts=float(ts), events=events, dp_rank=dp_rank, skipped=skipped, folds=folds)


def same_removal_tier(a: BlockRemoved, b: BlockRemoved) -> bool:
    """Whether two removals are from the same tier of the same group (one removal, as far as the index goes)."""
    return (
        a.medium == b.medium and a.group_idx == b.group_idx and a.locality == b.locality and a.ownership == b.ownership
    )


def fold_removals(events: list[KVEvent]) -> tuple[list[KVEvent], dict[int, int] | None]:
    """Runs of consecutive ``BlockRemoved`` of one tier as one event (the hashes in order), and
    :attr:`EventBatch.folds` for them: vLLM sends one removal per evicted block, and the index applies a run in
    one pass as it would one by one."""
    out: list[KVEvent] = []
    folds: dict[int, int] | None = None
    last: BlockRemoved | None = None
    for event in events:
        if type(event) is BlockRemoved:
            if last is not None and same_removal_tier(event, last):
                last.block_hashes.extend(event.block_hashes)
                if folds is None:
                    folds = {}
                folds[len(out) - 1] = folds.get(len(out) - 1, 1) + 1
                continue
            last = event
        else:
            last = None
        out.append(event)
    return out, folds


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number of a message."""
    if len(frame) != 8:
        raise EventDecodeError("bad_seq", f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def encode_seq(seq: int) -> bytes:
    return struct.pack(">Q", seq)


EventForm = Literal["map", "array"]


def _event_fields(event: KVEvent) -> tuple[str, list[tuple[str, Any]]]:
    if isinstance(event, BlockStored):
        values = [
            ("block_hashes", event.block_hashes),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", event.token_ids),
            ("block_size", event.block_size),
            ("lora_id", event.lora_id),
            ("medium", event.medium),
            ("lora_name", event.lora_name),
            ("extra_keys", event.extra_keys),
            ("group_idx", event.group_idx),
            ("kv_cache_spec_kind", event.kv_cache_spec_kind or "full_attention"),
            ("kv_cache_spec_sliding_window", event.kv_cache_spec_sliding_window),
            ("locality", event.locality),
        ]
        return "BlockStored", values
    if isinstance(event, BlockRemoved):
        values = [
            ("block_hashes", event.block_hashes),
            ("medium", event.medium),
            ("group_idx", event.group_idx),
            ("locality", event.locality),
        ]
        return "BlockRemoved", values
    return "AllBlocksCleared", []


def encode_batch(ts: float, events: Sequence[KVEvent], dp_rank: int = 0, *, form: EventForm = "map") -> bytes:
    """Encode a batch exactly as vLLM publishes it (map form by default, array form for old engines)."""
    encoded: list[Any] = []
    for event in events:
        kind, values = _event_fields(event)
        if form == "map":
            item: dict[str, Any] = {"type": kind}
            item.update(values)
            encoded.append(item)
        else:
            # Old engines omit trailing defaults (None) in the positional form.
            positional = [value for _, value in values]
            while positional and positional[-1] is None:
                positional.pop()
            encoded.append([kind, *positional])
    return msgspec.msgpack.encode([ts, encoded, dp_rank])
