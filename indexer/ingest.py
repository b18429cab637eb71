"""Turning one decoded event batch into index operations for one worker entity.

This is the hot path of ingestion, kept free of I/O: per stored block one xxh3 call (our key chain)
and a few dict operations (the alias map vLLM-hash -> our key and the entity's tier bits). The
entity's local view (``alias`` + ``bits``) is the truth the index mirrors: it lets removals and
offloading placeholders resolve vLLM hashes, and lets a backend that lost its data be rewritten.

vLLM 0.33's fields, each where it changes what a lookup may count:

- ``kv_cache_spec_kind`` / ``group_idx`` (hybrid models): the first full-attention group is the
  *primary* group, indexed in the model's own table; every other group whose prefix-hit rule is known
  (more full-attention groups, sliding-window groups, Mamba state groups) gets a view and a table of
  its own (:func:`group_table`), so a lookup can cut the primary run down to what every group serves
  (:mod:`kvroute.indexer.hybrid`). Groups of other kinds are not indexed (``other_group``).
- ``lookahead_token_ids`` (EAGLE lookahead hashing): block keys fold in those tokens
  (:func:`kvroute.indexer.keys.lookahead_key`), so a block is only matched by prompts that continue
  with the same tokens, exactly like vLLM's hashes; the model's L is learnt like its block size.
- ``ownership`` (a secondary offloading tier): copies are counted per owner, so a removal by one tier
  never drops another tier's copy of the block in the same medium.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from kvroute.indexer.backend import IndexOp, OpKind
from kvroute.indexer.bitsets import add_bits, having
from kvroute.indexer.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch
from kvroute.indexer.keys import chain_keys, lookahead_key, root_key
from kvroute.vocabulary import Tier, tier_bit

#: vLLM's ``KVCacheSpecKind`` values by prefix-hit rule (``vllm/v1/kv_cache_interface.py``): full attention
#: serves any prefix it holds from the start; a sliding window needs the blocks of its window right before
#: the hit boundary; a Mamba group needs the state block at the boundary.
FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
STATE_KINDS = frozenset({"mamba"})
MODELLED_KINDS = FULL_KINDS | WINDOW_KINDS | STATE_KINDS


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group of a model, as its ``BlockStored`` events describe it."""

    kind: str
    window: int | None = None

    def need(self, block_size: int) -> int:
        """Blocks right before a hit boundary this group must hold; 0: every block from the start."""
        if self.kind in WINDOW_KINDS:
            window = self.window or 1
            return max(1, -(-(window - 1) // block_size))  # vLLM: cdiv(sliding_window - 1, block_size)
        if self.kind in STATE_KINDS:
            return 1
        return 0


def group_table(model: str, group_idx: int) -> str:
    """The backend table of a model's non-primary KV-cache group."""
    return f"{model}@group{group_idx}"


@dataclass(slots=True)
class GroupView:
    """What one KV-cache group of a worker entity holds, as we know it."""

    alias: dict[BlockHash, int] = field(default_factory=dict)
    bits: dict[int, int] = field(default_factory=dict)
    #: Blocks per tier bit, maintained on every change (stats are O(tiers), never a scan of ``bits``).
    counts: dict[int, int] = field(default_factory=dict)
    #: Copies of a block in one tier bit, per owner (``ownership``, None for the primary tier), wherever
    #: that is not the one copy of the primary tier. vLLM recomputes the last block of a fully cached
    #: prompt whose length is a multiple of the block size, stores a second copy under the same hash and
    #: sends one BlockRemoved per copy; a secondary offloading tier holds copies of its own in the same
    #: medium. A removal takes one copy of its owner; the block goes when no copy is left.
    holders: dict[tuple[int, int], dict[str | None, int]] = field(default_factory=dict)
    #: With lookahead hashing: vLLM hash -> the plain chain key the next block chains from (``alias``
    #: holds the block's own key, which folds in its lookahead tokens).
    chain: dict[BlockHash, int] = field(default_factory=dict)

    def clear(self) -> None:
        self.alias.clear()
        self.bits.clear()
        self.counts.clear()
        self.holders.clear()
        self.chain.clear()

    def store_ops(self) -> list[IndexOp]:
        """Operations that store this view's blocks, per tier."""
        by_tier: dict[int, list[int]] = {}
        for key, bits in self.bits.items():
            for tier in Tier:
                if bits & tier:
                    by_tier.setdefault(int(tier), []).append(key)
        return [IndexOp("store", keys, tier) for tier, keys in sorted(by_tier.items())]


@dataclass(slots=True)
class EntityState(GroupView):
    """What one worker entity (a worker's data-parallel rank) holds: its primary group (the fields of
    :class:`GroupView`) and its other indexed KV-cache groups (``groups``, by ``group_idx``)."""

    groups: dict[int, GroupView] = field(default_factory=dict)

    def clear(self) -> None:
        GroupView.clear(self)
        for view in self.groups.values():
            view.clear()

    def snapshot_ops(self) -> list[IndexOp]:
        """Operations that rewrite the primary group's table from scratch (clear, then its blocks per tier)."""
        return [IndexOp("clear"), *self.store_ops()]

    def group_snapshots(self, side_groups: tuple[int, ...]) -> dict[int, list[IndexOp]]:
        """The same for every other indexed group of the model (an empty view is cleared all the same)."""
        out: dict[int, list[IndexOp]] = {}
        for idx in side_groups:
            view = self.groups.get(idx)
            out[idx] = [IndexOp("clear"), *(view.store_ops() if view is not None else [])]
        return out


@dataclass(slots=True)
class OpList:
    """Index operations for one table; consecutive ones of the same kind and tier share one op."""

    ops: list[IndexOp] = field(default_factory=list)
    #: The keys of the last op (our own list, so the next op of its kind and tier extends it).
    tail: list[int] | None = None

    def add(self, kind: OpKind, keys: list[int], tier: int) -> None:
        if not keys:
            return
        ops = self.ops
        tail = self.tail
        if tail is not None and ops[-1].kind == kind and ops[-1].tier == tier:
            tail.extend(keys)
        else:
            tail = self.tail = list(keys)
            ops.append(IndexOp(kind, tail, tier))

    def clear(self) -> None:
        self.ops.append(IndexOp("clear"))
        self.tail = None


@dataclass(slots=True)
class BatchResult:
    primary: OpList = field(default_factory=OpList)
    #: Operations on the model's other indexed groups' tables, by ``group_idx``.
    groups: dict[int, OpList] = field(default_factory=dict)
    #: event type -> count received / applied; reason -> count dropped
    received: dict[str, int] = field(default_factory=dict)
    applied: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    cleared: bool = False

    @property
    def ops(self) -> list[IndexOp]:
        """The primary group's operations (the model's own table)."""
        return self.primary.ops

    def group_ops(self, idx: int) -> OpList:
        ops = self.groups.get(idx)
        if ops is None:
            ops = self.groups[idx] = OpList()
        return ops


class ModelInfo:
    """Per-model facts the key chain needs: its root key, its block size and lookahead (learnt or
    configured), and its KV-cache groups (learnt from the events, or read from a shared index's writer)."""

    __slots__ = (
        "block_size",
        "from_events",
        "groups",
        "lookahead",
        "name",
        "next_ask",
        "on_learn",
        "primary",
        "published",
        "root",
        "side_groups",
    )

    def __init__(
        self, name: str, block_size: int | None = None, on_learn: Callable[[str, int], None] | None = None
    ) -> None:
        self.name = name
        self.root = root_key(name)
        self.block_size = block_size
        self.on_learn = on_learn
        #: Tokens after each block its hash covers (vLLM's ``num_hash_lookahead_tokens``); None: not known.
        self.lookahead: int | None = None
        #: Every KV-cache group seen, by ``group_idx``; the primary one is indexed in the model's own table.
        self.groups: dict[int, GroupSpec] = {}
        self.primary: int | None = None
        #: The other indexed groups (modelled kinds), by index: what a lookup must also ask.
        self.side_groups: tuple[int, ...] = ()
        #: True once events of this model were applied here (a reader of a shared index has none).
        self.from_events = False
        #: Whether these facts were written to the backend for readers; when to ask the backend again.
        self.published = False
        self.next_ask = 0.0

    def learn_group(self, idx: int, spec: GroupSpec) -> None:
        self.groups[idx] = spec
        if self.primary is None and spec.kind in FULL_KINDS:
            self.primary = idx
        self.side_groups = tuple(
            sorted(i for i, s in self.groups.items() if i != self.primary and s.kind in MODELLED_KINDS)
        )
        self.published = False

    def meta(self) -> dict[str, str]:
        """What a reader of a shared index needs to key and judge requests (strings, for a Redis hash)."""
        out = {"block_size": str(self.block_size or 0)}
        if self.lookahead is not None:
            out["lookahead"] = str(self.lookahead)
        if self.groups:
            out["primary"] = str(-1 if self.primary is None else self.primary)
            out["groups"] = orjson.dumps({str(i): [s.kind, s.window] for i, s in self.groups.items()}).decode()
        return out

    def adopt(self, meta: dict[str, str]) -> None:
        """A writer's :meth:`meta` (a reader's view of a shared index); unreadable fields are ignored."""
        try:
            size = int(meta.get("block_size") or 0)
            if size > 0 and self.block_size is None:
                self.block_size = size
            if meta.get("lookahead", "").isdigit():
                self.lookahead = int(meta["lookahead"])
            raw = orjson.loads(meta["groups"]) if meta.get("groups") else {}
            primary = int(meta.get("primary", "-1"))
        except (ValueError, TypeError, orjson.JSONDecodeError):
            return
        if not isinstance(raw, dict):
            return
        groups: dict[int, GroupSpec] = {}
        for idx, spec in raw.items():
            if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) and str(idx).isdigit()):
                return
            window = spec[1] if isinstance(spec[1], int) and not isinstance(spec[1], bool) else None
            groups[int(idx)] = GroupSpec(spec[0], window)
        if groups:
            self.groups = groups
            self.primary = primary if primary in groups else None
            self.side_groups = tuple(
                sorted(i for i, s in groups.items() if i != self.primary and s.kind in MODELLED_KINDS)
            )
        self.published = True


def _bump(counter: dict[str, int], name: str, n: int = 1) -> None:
    counter[name] = counter.get(name, 0) + n


def _extras(event: BlockStored, count: int) -> list[Any] | None:
    if event.extra_keys is not None:
        return event.extra_keys
    if event.lora_name:
        return [[event.lora_name]] * count
    return None


def _spec(event: BlockStored) -> GroupSpec | None:
    """The group spec a real (not placeholder) store announces; legacy engines' group 0 is full attention."""
    kind = event.kv_cache_spec_kind
    if kind is None:
        return GroupSpec("full_attention") if event.group_idx == 0 else None
    return GroupSpec(kind.lower(), event.kv_cache_spec_sliding_window)


def _learn(model: ModelInfo, batch: EventBatch) -> None:
    """Before the first real store: learn the groups this batch announces, the primary one (the lowest
    full-attention group), then the block size and lookahead from the primary group's first store."""
    specs: dict[int, GroupSpec] = {}
    first: dict[int, BlockStored] = {}
    for event in batch.events:
        if type(event) is BlockStored and not event.is_placeholder:
            spec = _spec(event)
            if spec is not None and event.group_idx not in model.groups and event.group_idx not in specs:
                specs[event.group_idx] = spec
                first[event.group_idx] = event
    for idx in sorted(specs, key=lambda i: (specs[i].kind not in FULL_KINDS, i)):
        model.learn_group(idx, specs[idx])
    primary = model.primary
    head = first.get(primary) if primary is not None else None
    if head is None:
        return
    if model.block_size is None:
        model.block_size = head.block_size
        if model.on_learn is not None:
            model.on_learn(model.name, head.block_size)
    if model.lookahead is None:
        lookahead = head.lookahead_token_ids
        model.lookahead = len(lookahead[0]) if lookahead else 0
        model.published = False


def _view(
    state: EntityState, model: ModelInfo, event: BlockStored | BlockRemoved, out: BatchResult
) -> GroupView | None:
    """The view an event's group is indexed in (learning a new group's spec); None: not indexed."""
    idx = event.group_idx
    if idx == model.primary:
        return state
    spec = model.groups.get(idx)
    if spec is None and type(event) is BlockStored and not event.is_placeholder:
        spec = _spec(event)
        if spec is not None:
            model.learn_group(idx, spec)
            if idx == model.primary:
                return state
    if spec is None or idx not in model.side_groups:
        _bump(out.dropped, "other_group")
        return None
    if type(event) is BlockStored and event.kv_cache_spec_kind and event.kv_cache_spec_kind.lower() != spec.kind:
        _bump(out.dropped, "group_spec_mismatch")
        return None
    view = state.groups.get(idx)
    if view is None:
        view = state.groups[idx] = GroupView()
    return view


def _find(state: EntityState, view: GroupView, h: BlockHash, chained: bool) -> int | None:
    """Our key for vLLM hash ``h`` (``chained``: the plain chain key, with lookahead hashing) from the
    event's own group first, then any group: equal block sizes mean equal hashes in every group."""
    table = view.chain if chained else view.alias
    key = table.get(h)
    if key is not None:
        return key
    for other in (state, *state.groups.values()):
        if other is not view:
            key = (other.chain if chained else other.alias).get(h)
            if key is not None:
                return key
    return None


def _store(
    state: EntityState, view: GroupView, model: ModelInfo, event: BlockStored, out: BatchResult
) -> list[int] | None:
    """Keys newly held for a BlockStored event, updating the alias map; None when it must be dropped."""
    hashes = event.block_hashes
    if event.is_placeholder:
        # Offloading connectors announce copies of blocks we already know, by vLLM hash only.
        keys = [k for k in (_find(state, view, h, False) for h in hashes) if k is not None]
        if len(keys) < len(hashes):
            _bump(out.dropped, "unknown_hash", len(hashes) - len(keys))
        if len(keys) > 1:
            keys = list(dict.fromkeys(keys))  # a hash listed twice is one block (keeps the counts exact)
        return keys
    if model.block_size is None:
        _bump(out.dropped, "unknown_block_size")  # a non-primary group's store before any primary one
        return None
    if event.block_size != model.block_size:
        _bump(out.dropped, "block_size_mismatch")
        return None
    lookahead = event.lookahead_token_ids
    width = len(lookahead[0]) if lookahead else 0
    if model.lookahead is None:
        model.lookahead = width
        model.published = False
    if width != model.lookahead:
        _bump(out.dropped, "lookahead_mismatch")
        return None
    if lookahead is not None and (len(lookahead) != len(hashes) or any(len(t) != width for t in lookahead)):
        _bump(out.dropped, "bad_lookahead")
        return None
    if event.parent_block_hash is None:
        parent = model.root
    else:
        found = (view.chain if width else view.alias).get(event.parent_block_hash)
        if found is None:
            found = _find(state, view, event.parent_block_hash, bool(width))
        if found is None:
            _bump(out.dropped, "unknown_parent")
            return None
        parent = found
    try:
        keys = chain_keys(
            event.token_ids, event.block_size, parent, _extras(event, len(hashes)), max_blocks=len(hashes)
        )
        if lookahead:
            view.chain.update(zip(hashes, keys, strict=False))
            keys = [lookahead_key(key, tokens) for key, tokens in zip(keys, lookahead, strict=False)]
    except (OverflowError, TypeError, ValueError):
        _bump(out.dropped, "bad_tokens")
        return None
    view.alias.update(zip(hashes, keys, strict=False))
    return keys


def _hold(view: GroupView, keys: list[int], bit: int, owner: str | None) -> None:
    """Record one more copy of ``keys`` in tier ``bit`` held by ``owner``."""
    bits_table = view.bits
    holders = view.holders
    had = 0
    for key in having(bits_table, keys, bit):  # usually none: a block stored again, or a second copy
        had += 1
        held = holders.get((key, bit))
        if held is None:
            held = holders[(key, bit)] = {None: 1}
        held[owner] = held.get(owner, 0) + 1
    if owner is not None and had < len(keys):  # a secondary tier's first copies: recorded as its own
        for key in keys:
            if (key, bit) not in holders:
                holders[(key, bit)] = {owner: 1}
    counts = view.counts
    counts[bit] = counts.get(bit, 0) + len(keys) - had
    if len(keys) == 1:
        bits_table[keys[0]] = bits_table.get(keys[0], 0) | bit
    else:
        add_bits(bits_table, keys, bit)


def remove_python(
    alias: dict[BlockHash, int],
    bits: dict[int, int],
    holders: dict[tuple[int, int], dict[str | None, int]],
    counts: dict[int, int],
    chain: dict[BlockHash, int],
    bit: int,
    hashes: list[BlockHash],
    owner: str | None,
) -> list[int]:
    """Keys that left tier ``bit`` (their last copy went), for ``owner``'s removal of ``hashes`` from a view
    (its ``alias``, ``bits``, ``holders``, ``counts`` and ``chain`` maps). The reference of the compiled
    :func:`remove` (``indexer/_apply.pyx``) and its fallback."""
    keys = []
    for h in hashes:
        key = alias.get(h)
        if key is None:
            continue
        old = bits.get(key, 0)
        if not old & bit:
            continue
        held = holders.get((key, bit)) if holders else None
        if held is not None:
            copies = held.get(owner, 0)
            if not copies:
                continue  # that owner holds no copy of this block
            if copies > 1:
                held[owner] = copies - 1
                continue
            del held[owner]
            if held:
                if len(held) == 1 and held.get(None) == 1:
                    del holders[(key, bit)]  # back to the one copy of the primary tier
                continue  # another copy still holds the block
            del holders[(key, bit)]
        elif owner is not None:
            continue  # the one copy is the primary tier's
        keys.append(key)
        counts[bit] -= 1
        if old == bit:
            del bits[key]
            del alias[h]
            if chain:
                chain.pop(h, None)
        else:
            bits[key] = old & ~bit
    return keys


#: The removal loop ingestion uses: compiled (setup.py builds it) or, where it was not built,
#: :func:`remove_python`. ``APPLY`` says which.
remove: Callable[
    [
        dict[BlockHash, int],
        dict[int, int],
        dict[tuple[int, int], dict[str | None, int]],
        dict[int, int],
        dict[BlockHash, int],
        int,
        list[BlockHash],
        str | None,
    ],
    list[int],
]
try:
    from kvroute.indexer._apply import remove as _compiled_remove

    remove, APPLY = _compiled_remove, "compiled"
except ImportError:  # pragma: no cover - only where the extension could not be built
    remove, APPLY = remove_python, "python"


def _remove(view: GroupView, bit: int, hashes: list[BlockHash], owner: str | None) -> list[int]:
    """Keys that left tier ``bit`` (their last copy went), for ``owner``'s removal of ``hashes``."""
    return remove(view.alias, view.bits, view.holders, view.counts, view.chain, bit, hashes, owner)


_TIERS: dict[tuple[str, str], int] = {}


def _tier(medium: str, locality: str) -> int:
    """``tier_bit`` as a plain int, memoised (enum arithmetic is slow on the hot path)."""
    bit = _TIERS.get((medium, locality))
    if bit is None:
        bit = _TIERS[(medium, locality)] = int(tier_bit(medium, locality))
    return bit


def translate(state: EntityState, model: ModelInfo, batch: EventBatch) -> BatchResult:
    """Apply ``batch`` to the entity's local view and return the index operations that mirror it."""
    out = BatchResult()
    stored = removed = cleared = applied_stored = applied_removed = 0
    if model.primary is None or model.block_size is None:
        _learn(model, batch)
    model.from_events = True
    primary = out.primary
    primary_idx = model.primary  # events of other groups ask _view, which also sees a primary learnt meanwhile
    folds = batch.folds
    for at, event in enumerate(batch.events):
        if type(event) is BlockStored:
            stored += 1
            view = state if event.group_idx == primary_idx else _view(state, model, event, out)
            if view is None:
                continue
            keys = _store(state, view, model, event, out)
            if keys is None:
                continue
            bit = _tier(event.medium, event.locality)
            _hold(view, keys, bit, event.ownership)
            (primary if view is state else out.group_ops(event.group_idx)).add("store", keys, bit)
            applied_stored += 1
        elif type(event) is BlockRemoved:
            events = folds.get(at, 1) if folds else 1  # the engine's events this one stands for
            removed += events
            view = state if event.group_idx == primary_idx else _view(state, model, event, out)
            if view is None:
                continue
            bit = _tier(event.medium, event.locality)
            keys = _remove(view, bit, event.block_hashes, event.ownership)
            if keys:
                (primary if view is state else out.group_ops(event.group_idx)).add("remove", keys, bit)
            applied_removed += events
        elif type(event) is AllBlocksCleared:
            cleared += 1
            state.clear()
            primary.clear()
            for idx in model.side_groups:
                out.group_ops(idx).clear()
            out.cleared = True
    for name, count in (("BlockStored", stored), ("BlockRemoved", removed), ("AllBlocksCleared", cleared)):
        if count:
            out.received[name] = count
    for name, count in (
        ("BlockStored", applied_stored),
        ("BlockRemoved", applied_removed),
        ("AllBlocksCleared", cleared),
    ):
        if count:
            out.applied[name] = count
    return out
