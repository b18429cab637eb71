"""kvroute's own block keys: one 64-bit chain over token ids, for events and requests alike.

``key[i] = xxh3_64(tokens of block i || extra keys of block i, seed=key[i-1])`` with ``key[-1]`` the
model's root key (the previous key as the seed keeps the chain and saves a byte concatenation per
block: keys of a 32k-token prompt are the hot part of a routing decision).

vLLM's own block hashes are random per process unless every engine shares ``PYTHONHASHSEED``, so the
index never depends on them: it recomputes this chain from the tokens the events carry and keeps, per
worker, an alias map from vLLM's hash to ours.

Extra keys follow vLLM's placement: the LoRA name on every block, the tenant's ``cache_salt`` on the
first block only, so two tenants' identical prompts never share a key.

Lookahead hashing (vLLM 0.33 with EAGLE, ``lookahead_token_ids`` in the events): a block's hash also
covers the L tokens after it, so two prompts that share a block but not the token after it hold two
different blocks. :func:`lookahead_keys` folds those L tokens into the block's key (``xxh3_64(tag ||
L tokens, seed=chain key)``) while the chain itself stays the plain one: a block's lookahead tokens are
the next block's first tokens, so the chain already covers them and the key-chain cache below serves
both. A prompt of N tokens has keys for its first ``(N - L) // block_size`` blocks only, as vLLM hashes
only blocks followed by L tokens: its own last blocks can never be matched by its keys.

Agentic and chat prompts repeat the previous prompt and append to it. :class:`KeyChainCache` keeps the
key chains of recent prompts (per model, block size, LoRA and salt; bounded in bytes) so a prompt that
shares a prefix with a recent one hashes only the blocks after it: the chain is a function of the
tokens, so a chain continued from the cached prefix's last key is the from-scratch chain. Tokenizers
hand ids over as :class:`TokenIds`, an ``array("I")`` that is already the bytes the chain hashes, so
the key step does not pack 32k ints either. :class:`PrefixIndex` (the longest cached prefix of a
``str`` or ``bytes`` in a few dict reads) serves this cache and the router's tokenizer cache alike.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import msgspec
import xxhash

_hash = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"
_MASK = (1 << 64) - 1


def root_key(model: str) -> int:
    """The chain's starting point; folding in the model keeps two models' prefixes apart."""
    return _hash(b"kvroute/v1\x00" + model.encode())


#: A key chain's context: model, block size, LoRA, salt (the extra keys depend on nothing else).
ChainContext = tuple[str, int, str | None, str | None]

#: Estimated bytes per cached key: a list slot and a 64-bit int object.
KEY_BYTES = 8 + 36


class KeyMemo:
    """The key chains computed for one token sequence, kept with the tokenizer's cache entry for it.

    A tokenizer that builds a prompt's ids from a cached prefix knows which cached sequence the prompt
    extends and by how many tokens; with the chains kept here, the key step continues the chain from the
    shared blocks directly (no probe of :class:`KeyChainCache`, no comparison of 128 KB of token bytes).
    At most ``budget`` bytes of keys: the tokenizer counts them in its own bound when it caches the entry.
    """

    __slots__ = ("budget", "chains")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.chains: dict[ChainContext, list[int]] = {}

    def put(self, ctx: ChainContext, keys: list[int]) -> None:
        need = KEY_BYTES * len(keys)
        if need > self.budget:
            return
        if need + sum(KEY_BYTES * len(c) for c in self.chains.values()) > self.budget:
            self.chains.clear()  # another context's chain gives way (a rare case: one model per prompt)
        self.chains[ctx] = keys


def memo_budget(tokens: int) -> int:
    """Bytes a tokenizer reserves per cached sequence of ``tokens`` tokens for its :class:`KeyMemo`: two
    chains of 16-token blocks."""
    return 2 * KEY_BYTES * (tokens // 16 + 1)


if TYPE_CHECKING:
    _IdArray = array[int]
else:
    _IdArray = array  # array is generic for type checkers only (subscriptable at run time from 3.12)


class TokenIds(_IdArray):
    """Token ids as one unsigned 32-bit array: the tokenizers' output on the request path.

    Stored this way rather than as a list of Python ints because a long prompt's ids are the router's
    largest per-request object: a list of 32k ints is walked by every garbage collection of its
    generation (a pointer per id, while a tokenizer cache holds hundreds of them), copied with a
    reference count per id, and packed again for hashing. An array is invisible to the collector, is copied and sliced
    with ``memcpy``, and on a little-endian machine is already the bytes the keys hash
    (:func:`token_view`). It compares equal to a list or tuple of the same ids; for JSON, ``list(ids)``
    (neither ``json`` nor ``orjson`` serialises an array).

    ``memo`` holds the key chains of exactly these ids (shared with the tokenizer's cache entry);
    ``base`` those of a cached sequence whose first ``shared`` ids are these ids' first ``shared``.
    Treat it as read-only once handed out (the memo describes these ids)."""

    __slots__ = ("base", "memo", "shared")

    memo: KeyMemo | None
    base: KeyMemo | None
    shared: int

    def __new__(
        cls, ids: Iterable[int] = (), memo: KeyMemo | None = None, base: KeyMemo | None = None, shared: int = 0
    ) -> TokenIds:
        out = cast(TokenIds, super().__new__(cls, "I", ids))  # an array("I") initializer: memcpy
        out.memo = memo
        out.base = base
        out.shared = shared
        return out

    @classmethod
    def cached(cls, ids: Iterable[int], base: TokenIds | None = None, shared: int = 0) -> TokenIds:
        """Ids a tokenizer caches and hands out as they are: an empty key memo of their own, and ``base``'s
        (the cached ids whose first ``shared`` they share) for the key step to continue."""
        out = cls(ids, None, base.memo if base is not None else None, shared)
        out.memo = KeyMemo(memo_budget(len(out)))
        return out

    @classmethod
    def extended(cls, base: TokenIds, keep: int, tail: Iterable[int]) -> TokenIds:
        """The first ``keep`` of ``base``'s ids, then ``tail``: cached, continuing ``base``'s key memo."""
        out = cls.cached(base[:keep], base, keep)
        out.extend(tail)
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list | tuple):
            return len(self) == len(other) and self.tolist() == list(other)
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # mutable, like list and array


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Little-endian uint32 bytes of ``tokens``."""
    packed = array("I", tokens)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def token_view(tokens: Sequence[int]) -> bytes | memoryview:
    """Little-endian uint32 bytes of ``tokens`` for hashing: an ``array("I")`` (so every :class:`TokenIds`)
    is read in place on a little-endian machine; anything else is packed (once per event or request)."""
    if _LITTLE and isinstance(tokens, array) and tokens.typecode == "I":
        return memoryview(tokens).cast("B")
    return pack_tokens(tokens)


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian uint32 bytes of ``tokens`` as ``bytes`` (a copy of :func:`token_view`'s)."""
    view = token_view(tokens)
    return view if isinstance(view, bytes) else view.tobytes()


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
    return _chain(memoryview(token_view(tokens))[: size * 4], block_size, parent, extra_keys)


def chain_python(data: bytes | memoryview, block_bytes: int, parent: int) -> list[int]:
    """Keys of the whole ``block_bytes``-byte blocks of packed token bytes ``data`` from ``parent``: the
    reference of the compiled :func:`chain` (``indexer/_keychain.pyx``) and its fallback."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    view = memoryview(data)
    keys: list[int] = []
    append = keys.append
    key = parent & _MASK
    # The previous key is the seed of the next block's hash: no per-block byte concatenation.
    for offset in range(0, len(view) // block_bytes * block_bytes, block_bytes):
        key = _hash(view[offset : offset + block_bytes], key)
        append(key)
    return keys


#: The key chain the index uses: compiled against the xxHash library (setup.py builds it) or, where it
#: was not built, :func:`chain_python`. ``CHAIN`` says which (logged at start-up).
chain: Callable[[bytes | memoryview, int, int], list[int]]
try:
    from kvroute.indexer._keychain import chain as _compiled_chain

    chain, CHAIN = _compiled_chain, "compiled"
except ImportError:  # pragma: no cover - only where the extension could not be built
    chain, CHAIN = chain_python, "python"


def _chain(
    data: memoryview, block_size: int, parent: int, extra_keys: Sequence[Sequence[object] | None] | None
) -> list[int]:
    """Keys of the whole blocks of packed token bytes ``data`` (a multiple of the block) from ``parent``."""
    step = block_size * 4
    if extra_keys is None:
        return chain(data, step, parent & _MASK)
    keys: list[int] = []
    append = keys.append
    key = parent & _MASK
    for i, offset in enumerate(range(0, len(data) // step * step, step)):
        extra = extra_bytes(extra_keys[i]) if i < len(extra_keys) else b""
        block = data[offset : offset + step]
        key = _hash(bytes(block) + extra if extra else block, key)
        append(key)
    return keys


def request_keys(
    tokens: Sequence[int],
    block_size: int,
    model: str,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    lookahead: int = 0,
) -> list[int]:
    """Keys of a request's prompt: what the index is asked about (``lookahead``: the model's L)."""
    extras = request_extra_keys(len(tokens) // block_size, lora_name=lora_name, cache_salt=cache_salt)
    keys = chain_keys(tokens, block_size, root_key(model), extras)
    return lookahead_keys(keys, tokens, block_size, lookahead) if lookahead else keys


#: Starts the bytes a block's lookahead tokens are hashed with (a block's own bytes are never this short).
LOOKAHEAD_TAG = b"\x00la"


def lookahead_key(chain_key: int, lookahead_tokens: Sequence[int]) -> int:
    """The key of one block whose hash covers ``lookahead_tokens`` (its ``lookahead_token_ids`` entry)."""
    return _hash(LOOKAHEAD_TAG + pack_tokens(lookahead_tokens), chain_key & _MASK)


def lookahead_keys(chain: Sequence[int], tokens: Sequence[int], block_size: int, lookahead: int) -> list[int]:
    """Keys of a prompt's blocks under lookahead hashing, from its plain ``chain`` (block i of ``tokens``
    first, from the root): only the blocks followed by ``lookahead`` tokens have one, as in vLLM."""
    if lookahead <= 0:
        return list(chain)
    count = min(len(chain), max(0, len(tokens) - lookahead) // block_size)
    if count == 0:
        return []
    data = token_view(tokens)
    step, width = block_size * 4, lookahead * 4
    tag = LOOKAHEAD_TAG
    return [_hash(tag + data[(i + 1) * step : (i + 1) * step + width], chain[i] & _MASK) for i in range(count)]


# -- the longest cached prefix -------------------------------------------------------------------------

S = TypeVar("S", str, bytes)
V = TypeVar("V")


def _seg_hash(segment: str | bytes | memoryview, seed: int) -> int:
    if isinstance(segment, str):
        return _hash(segment.encode("utf-8", "surrogatepass"), seed)
    return _hash(segment, seed)


class Probe:
    """A sequence's marks ``(position in units, chain hash)`` and its identity hash (length folded in)."""

    __slots__ = ("ident", "marks")

    def __init__(self, ident: int, marks: list[tuple[int, int]]) -> None:
        self.ident = ident
        self.marks = marks


class PrefixIndex(Generic[S, V]):
    """An LRU of ``str`` or ``bytes`` sequences -> values, bounded in bytes, that finds the cached
    sequence sharing the longest prefix with a new one without comparing it to every entry (nor hashing
    32k-token sequences with Python's SipHash as dict keys).

    Each sequence is marked at a few positions (in ``unit``\\ s: ``first``, twice that, ... up to
    ``step``, then every ``step``) by a chain of xxh3 hashes of its segments, one call per mark; a new
    sequence computes its own chain and takes the entry of its deepest mark found. The common prefix is
    then established by comparing the sequences themselves, never by the hashes alone."""

    def __init__(self, max_bytes: int, *, unit: int = 1, first: int = 64, step: int = 16384) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.unit = unit
        self.first = max(1, first)
        self.step = max(self.first, step)
        self.bytes = 0
        #: ident -> (sequence, value, bytes, mark hashes)
        self._entries: OrderedDict[int, tuple[S, V, int, list[int]]] = OrderedDict()
        self._marks: dict[int, int] = {}
        #: The last sequence probed, its seed and its probe: a request's text is probed once, whether it is
        #: looked up for its head first or straight away (marks depend on the sequence alone).
        self._last: tuple[S, int, Probe] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def positions(self, length: int) -> Iterator[int]:
        """Mark positions (in units) of a sequence ``length`` units long."""
        pos = self.first
        while pos < self.step and pos <= length:
            yield pos
            pos *= 2
        pos = self.step
        while pos <= length:
            yield pos
            pos += self.step

    def probe(self, seq: S, seed: int = 0) -> Probe:
        last = self._last
        if last is not None and last[0] is seq and last[1] == seed:
            return last[2]
        probe = self._probe(seq, seed)
        self._last = (seq, seed, probe)
        return probe

    def _probe(self, seq: S, seed: int) -> Probe:
        marks = []
        prev = 0
        h = seed & _MASK
        u = self.unit
        # An ASCII text is its own UTF-8 bytes, offsets included: encoded once, its segments are hashed
        # as views (no copy per segment, no encode per segment: 34 -> ~15 µs for a 350 KB prompt).
        data: str | bytes | memoryview = seq
        if isinstance(seq, bytes):
            data = memoryview(seq)
        elif seq.isascii():
            data = memoryview(seq.encode("ascii"))
        for pos in self.positions(len(seq) // u):
            h = _seg_hash(data[prev * u : pos * u], h)
            marks.append((pos, h))
            prev = pos
        ident = _seg_hash(data[prev * u :] if prev else data, h) ^ (len(seq) * 0x9E3779B97F4A7C15 & _MASK)
        return Probe(ident, marks)

    def get(self, seq: S, probe: Probe) -> V | None:
        """The value of exactly ``seq`` (made the most recent), else None."""
        item = self._entries.get(probe.ident)
        if item is None or item[0] != seq:
            return None
        self._entries.move_to_end(probe.ident)
        return item[1]

    def longest(self, seq: S, probe: Probe) -> tuple[S, V, int, int] | None:
        """The cached sequence with the deepest mark in common with ``seq``: ``(sequence, value, length
        of the common prefix in units (exact, compared), its ident)``, or None when no mark is shared."""
        entries = self._entries
        marks = probe.marks
        for k in range(len(marks) - 1, -1, -1):
            ident = self._marks.get(marks[k][1])
            if ident is not None:
                break
        else:
            return None
        item = entries[ident]
        base = item[0]
        u = self.unit
        lo = marks[k][0]
        hi = min(len(base), len(seq)) // u
        if k + 1 < len(marks):
            hi = min(hi, marks[k + 1][0])
        if seq.startswith(base if hi * u == len(base) else base[: hi * u]):
            lcp = hi
        elif not seq.startswith(base[: lo * u]):
            return None  # a hash collision: the sequences differ
        else:
            while lo < hi - 1:  # lo units are common, hi are not
                mid = (lo + hi) // 2
                if seq[lo * u : mid * u] == base[lo * u : mid * u]:
                    lo = mid
                else:
                    hi = mid
            lcp = lo
        entries.move_to_end(ident)
        return base, item[1], lcp, ident

    def put(self, seq: S, value: V, nbytes: int, probe: Probe) -> bool:
        """Cache ``value`` for ``seq`` (``nbytes`` of it; the marks are added here), evicting the least
        recently used entries to stay within ``max_bytes``. False when it is larger than the bound."""
        self.drop(probe.ident)
        hashes = [h for _, h in probe.marks]
        nbytes += 120 * len(hashes) + 160
        if nbytes > self.max_bytes:
            return False
        self._entries[probe.ident] = (seq, value, nbytes, hashes)
        for h in hashes:
            self._marks[h] = probe.ident
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            self.evict()
        return True

    def evict(self) -> None:
        """Drop the least recently used entry."""
        if self._entries:
            self.drop(next(iter(self._entries)))

    def drop(self, ident: int) -> None:
        item = self._entries.pop(ident, None)
        if item is None:
            return
        self.bytes -= item[2]
        marks = self._marks
        for h in item[3]:
            if marks.get(h) == ident:
                del marks[h]

    def clear(self) -> None:
        self._entries.clear()
        self._marks.clear()
        self.bytes = 0


# -- incremental key chains ----------------------------------------------------------------------------


class KeyChainCache:
    """Key chains of recent prompts, so a prompt extending (or sharing a prefix with) a recent one hashes
    only its new blocks. Per (model, block size, LoRA, salt): the extra keys depend on nothing else, so
    the keys of a common prefix are the same and continuing the chain from its last key gives exactly
    the from-scratch keys. Bounded by ``max_bytes`` (token bytes + keys + marks), least recently used
    first out; ``max_bytes=0`` disables it."""

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self.max_bytes = max_bytes
        self._index: dict[ChainContext, PrefixIndex[bytes, list[int]]] = {}
        self.counters = {"hits": 0, "prefix_hits": 0, "misses": 0, "blocks_hashed": 0, "blocks_reused": 0}

    @property
    def size_bytes(self) -> int:
        """Bytes held by every context's entries (never above ``max_bytes``)."""
        return sum(index.bytes for index in self._index.values())

    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            "entries": sum(len(i) for i in self._index.values()),
            "bytes": self.size_bytes,
            "max_bytes": self.max_bytes,
        }

    def keys(
        self,
        tokens: Sequence[int],
        block_size: int,
        model: str,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Equal to :func:`request_keys` with the same arguments, always."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        count = len(tokens) // block_size
        if self.max_bytes <= 0 or count == 0:
            return request_keys(tokens, block_size, model, lora_name=lora_name, cache_salt=cache_salt)
        step = block_size * 4
        packed = token_view(tokens)
        size = count * step
        ctx = (model, block_size, lora_name or None, cache_salt or None)
        memo = None
        if type(tokens) is TokenIds and tokens.memo is not None:
            memo = tokens.memo
            keys = self._from_memo(tokens, memo, ctx, memoryview(packed)[:size])
            if keys is not None:
                return list(keys)
        # The cache compares its sequences, so it keeps bytes: packed ids already are, a view is copied.
        data = packed if isinstance(packed, bytes) and len(packed) == size else bytes(packed[:size])
        index = self._index.get(ctx)
        if index is None:
            # Marks every 1, 2, 4, ... blocks up to ~4k tokens, then every ~4k tokens (one xxh3 call each).
            index = self._index[ctx] = PrefixIndex(self.max_bytes, unit=step, first=1, step=max(1, 4096 // block_size))
        probe = index.probe(data, root_key(model))
        cached = index.get(data, probe)
        if cached is not None:
            self.counters["hits"] += 1
            self.counters["blocks_reused"] += count
            if memo is not None:
                memo.put(ctx, cached)
            return list(cached)
        found = index.longest(data, probe)
        extras = request_extra_keys(count, lora_name=lora_name, cache_salt=cache_salt)
        if found is None or found[2] == 0:
            self.counters["misses"] += 1
            keys = _chain(memoryview(data), block_size, root_key(model), extras)
            reused = 0
        else:
            base, base_keys, reused, ident = found
            self.counters["prefix_hits"] += 1
            keys = self._continue(base_keys, reused, memoryview(data), ctx, extras)
            if reused * step == len(base):
                index.drop(ident)  # superseded: its whole chain is the new entry's prefix
        self.counters["blocks_hashed"] += count - reused
        self.counters["blocks_reused"] += reused
        index.put(data, keys, len(data) + 33 + KEY_BYTES * count + 56, probe)
        self._trim(index)
        if memo is not None:
            memo.put(ctx, keys)
        return list(keys)

    def _from_memo(self, tokens: TokenIds, memo: KeyMemo, ctx: ChainContext, data: memoryview) -> list[int] | None:
        """The chain from the tokenizer's memos: these ids' own, or continued from the cached sequence they
        extend (``tokens.base``, ``tokens.shared`` ids in common); None when neither holds this context.
        ``data``: the packed bytes of the whole blocks."""
        count = len(data) // (4 * ctx[1])
        keys = memo.chains.get(ctx)
        if keys is not None and len(keys) == count:
            self.counters["hits"] += 1
            self.counters["blocks_reused"] += count
            return keys
        base = tokens.base.chains.get(ctx) if tokens.base is not None else None
        if base is None:
            return None
        reused = min(tokens.shared // ctx[1], len(base), count)
        if reused == 0:
            return None
        _, _, lora_name, cache_salt = ctx
        extras = request_extra_keys(count, lora_name=lora_name, cache_salt=cache_salt)
        keys = self._continue(base, reused, data, ctx, extras)
        self.counters["prefix_hits"] += 1
        self.counters["blocks_hashed"] += count - reused
        self.counters["blocks_reused"] += reused
        memo.put(ctx, keys)
        return keys

    @staticmethod
    def _continue(
        base_keys: list[int], reused: int, data: memoryview, ctx: ChainContext, extras: list[list[str] | None] | None
    ) -> list[int]:
        """``base_keys[:reused]`` and the chain of the rest of ``data`` (whole blocks) from the last of them."""
        block_size = ctx[1]
        keys = base_keys[:reused]
        count = len(data) // (4 * block_size)
        if reused < count:
            keys += _chain(
                data[reused * block_size * 4 :],
                block_size,
                base_keys[reused - 1],
                extras[reused:] if extras is not None else None,
            )
        return keys

    def _trim(self, keep: PrefixIndex[bytes, list[int]]) -> None:
        """One bound over every context: the other contexts give way first, least recent entry first."""
        total = self.size_bytes
        for ctx, index in list(self._index.items()):
            if index is keep:
                continue
            while total > self.max_bytes and len(index):
                before = index.bytes
                index.evict()
                total -= before - index.bytes
            if not len(index):
                del self._index[ctx]
        while total > self.max_bytes and len(keep):
            before = keep.bytes
            keep.evict()
            total -= before - keep.bytes

    def clear(self) -> None:
        self._index.clear()
