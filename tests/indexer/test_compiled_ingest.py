"""The compiled ingest loops answer exactly what their Python references answer.

- the block-key chain (``indexer/_keychain.pyx``, against the xxHash library) and :func:`chain_python`;
- the token-id reader (``indexer/_decode.pyx``) and msgspec's ``list[int]`` decoding of the same bytes,
  over every msgpack integer form, odd values and truncated input;
- the removal fold and :func:`fold_python` over decoded batches of random events;
- the removal loops of a worker's view (:func:`remove_python`) and of the memory table
  (:func:`unhold_python`), on random views with copies per owner, lookahead chains and wide slot bits.

And the dev install must have built them all (the wheel build compiles them, so a fresh machine does too).
"""

from __future__ import annotations

import copy
import os
import random
import struct
from array import array

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.indexer import fastdecode, ingest, keys, memory
from kvroute.indexer.events import MAX_BLOCKS_PER_EVENT, BlockRemoved, BlockStored, encode_batch, same_removal_tier
from kvroute.indexer.memory import SLOT_BITS

MASK = (1 << 64) - 1


def test_the_installed_package_uses_the_compiled_loops() -> None:
    assert keys.CHAIN == "compiled"
    assert fastdecode.DECODER == "compiled"
    assert ingest.APPLY == "compiled"
    from kvroute.indexer import _apply, _decode, _keychain

    assert keys.chain is _keychain.chain
    assert fastdecode.fold is _decode.fold
    assert ingest.remove is _apply.remove
    assert memory.unhold is _apply.unhold


# -- the key chain ------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    n_bytes=st.integers(0, 4096),
    block=st.sampled_from([4, 16, 64, 128, 4 * 33]),
    parent=st.integers(0, MASK),
    as_view=st.booleans(),
)
def test_compiled_chain_equals_the_python_chain(n_bytes: int, block: int, parent: int, as_view: bool) -> None:
    from kvroute.indexer._keychain import chain

    data: bytes | memoryview = os.urandom(n_bytes)
    if as_view:
        data = memoryview(array("I", data[: n_bytes // 4 * 4])).cast("B")
    expected = keys.chain_python(data, block, parent)
    assert chain(data, block, parent) == expected
    assert len(expected) == len(data) // block


def test_the_chain_refuses_an_empty_block() -> None:
    from kvroute.indexer._keychain import chain

    with pytest.raises(ValueError):
        chain(b"abcd", 0, 1)
    with pytest.raises(ValueError):
        keys.chain_python(b"abcd", 0, 1)


# -- the token-id reader ------------------------------------------------------------------------------------

#: Every msgpack integer form by its tag, and how many big-endian bytes follow it.
INT_FORMS = {"uint8": (0xCC, 1), "uint16": (0xCD, 2), "uint32": (0xCE, 4), "uint64": (0xCF, 8)}
INT_FORMS |= {"int8": (0xD0, 1), "int16": (0xD1, 2), "int32": (0xD2, 4), "int64": (0xD3, 8)}


def _int(value: int, form: str) -> bytes:
    """``value`` in msgpack's ``form`` (a writer may pick a wider form than needed)."""
    if form == "fixint":
        return bytes([value & 0xFF])
    tag, width = INT_FORMS[form]
    signed = form.startswith("int")
    return bytes([tag]) + value.to_bytes(width, "big", signed=signed)


def _array(items: list[bytes], header: str) -> bytes:
    n = len(items)
    head = {"fix": bytes([0x90 | n]) if n < 16 else b"", "16": b"\xdc" + struct.pack(">H", n)}
    head["32"] = b"\xdd" + struct.pack(">I", n)
    return (head[header] or head["16"]) + b"".join(items)


def _reference(raw: bytes) -> bytes | None:
    """What msgspec makes of the bytes, packed; None where they are not all ids in 0..2**32-1."""
    try:
        values = msgspec.msgpack.decode(raw, type=list[int])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if any(not 0 <= v <= 0xFFFFFFFF for v in values):
        return None
    return array("I", values).tobytes()


@st.composite
def encoded_ids(draw: st.DrawFn) -> bytes:
    items = []
    for _ in range(draw(st.integers(0, 40))):
        form = draw(st.sampled_from(["fixint", *INT_FORMS]))
        signed = form.startswith("int")
        tag_width = 1 if form == "fixint" else INT_FORMS[form][1]
        bits = 7 if form == "fixint" else 8 * tag_width - (1 if signed else 0)
        low = -(1 << bits) if signed else 0
        value = draw(st.integers(low, (1 << bits) - 1))
        if form == "fixint" and draw(st.booleans()):
            value = draw(st.integers(-32, -1))  # a negative fixint
        items.append(_int(value, form))
        if draw(st.integers(0, 30)) == 0:
            items.append(draw(st.sampled_from([b"\xc0", b"\xc3", b"\xca\x00\x00\x00\x00", b"\xa1a"])))
    raw = _array(items, draw(st.sampled_from(["fix", "16", "32"])))
    cut = draw(st.integers(0, 3))
    if cut == 1 and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]  # truncated
    elif cut == 2:
        raw += b"\x01"  # one value too many
    return raw


@settings(max_examples=500, deadline=None)
@given(raw=encoded_ids())
def test_the_token_reader_equals_msgspec(raw: bytes) -> None:
    from kvroute.indexer._decode import read_uint32s

    assert read_uint32s(raw) == _reference(raw)


def test_the_token_reader_on_the_edges() -> None:
    from kvroute.indexer._decode import read_uint32s

    top = 0xFFFFFFFF
    assert (
        read_uint32s(msgspec.msgpack.encode([0, 127, 128, 255, 256, 65535, 65536, top]))
        == array("I", [0, 127, 128, 255, 256, 65535, 65536, top]).tobytes()
    )
    assert read_uint32s(_array([_int(top + 1, "uint64")], "fix")) is None
    assert read_uint32s(_array([_int(top, "int64")], "fix")) == array("I", [top]).tobytes()
    assert read_uint32s(b"") is None
    assert read_uint32s(b"\xc0") is None  # nil: the caller's msgspec decoding says []
    assert read_uint32s(b"\x90") == b""
    assert read_uint32s(b"\xdd\xff\xff\xff\xff\x01") is None  # a count the bytes cannot hold


def test_token_ids_in_a_batch_are_read_packed_and_equal_the_reference() -> None:
    tokens = [random.Random(3).randrange(200_000) for _ in range(64)]
    payload = encode_batch(1.0, [BlockStored(block_hashes=[1, 2, 3, 4], token_ids=tokens, block_size=16)])
    fast = fastdecode.decode_batch_fast(payload)
    event = fast.events[0]
    assert isinstance(event, BlockStored)
    assert isinstance(event.token_ids, keys.TokenIds)
    assert event.token_ids == tokens
    assert fast == fastdecode.decode_batch(payload)


# -- the removal fold ---------------------------------------------------------------------------------------

MEDIA = ["GPU", "CPU", "cpu", "STORAGE"]


@st.composite
def event_batches(draw: st.DrawFn) -> list[BlockStored | BlockRemoved]:
    events: list[BlockStored | BlockRemoved] = []
    for _ in range(draw(st.integers(0, 30))):
        n = draw(st.integers(1, 3))
        hashes = [draw(st.integers(0, 50)) for _ in range(n)]
        if draw(st.integers(0, 5)) == 0:
            events.append(BlockStored(block_hashes=hashes, token_ids=list(range(16 * n)), block_size=16))
        else:
            events.append(
                BlockRemoved(
                    block_hashes=hashes,
                    medium=draw(st.sampled_from(MEDIA)),
                    group_idx=draw(st.integers(0, 1)),
                    ownership=draw(st.sampled_from([None, None, "tier2"])),
                )
            )
    return events


@settings(max_examples=300, deadline=None)
@given(events=event_batches(), form=st.sampled_from(["map", "array"]), max_blocks=st.sampled_from([2, 1000]))
def test_compiled_fold_equals_the_python_fold(
    events: list[BlockStored | BlockRemoved], form: str, max_blocks: int
) -> None:
    from kvroute.indexer._decode import fold

    payload = encode_batch(1.0, list(events), form=form)  # type: ignore[arg-type]
    decoder = fastdecode._map_decoder if form == "map" else fastdecode._array_decoder
    args = (fastdecode._convert, BlockRemoved, same_removal_tier, max_blocks)
    expected = fastdecode.fold_python(decoder.decode(payload)[1], *args)
    assert fold(decoder.decode(payload)[1], *args) == expected
    if expected is not None:
        removals = sum(1 for e in events if isinstance(e, BlockRemoved))
        folded = sum(1 for e in expected[0] if isinstance(e, BlockRemoved))
        assert folded + sum(n - 1 for n in (expected[1] or {}).values()) == removals


def test_the_fold_leaves_a_batch_to_the_reference_where_tiers_match_only_once_normalised() -> None:
    from kvroute.indexer._decode import fold

    payload = encode_batch(
        1.0, [BlockRemoved(block_hashes=[1], medium="cpu"), BlockRemoved(block_hashes=[2], medium="CPU")]
    )
    typed = fastdecode._map_decoder.decode(payload)[1]
    assert fold(typed, fastdecode._convert, BlockRemoved, same_removal_tier, MAX_BLOCKS_PER_EVENT) is None
    assert fastdecode.decode_batch_fast(payload) == fastdecode.decode_batch(payload)


# -- the removal loops --------------------------------------------------------------------------------------

BITS = [1, 2, 4, 8, 16, 32]
OWNERS = [None, None, "tier2", "tier3"]


def _view(rng: random.Random) -> tuple[dict, dict, dict, dict, dict]:
    alias: dict[int | bytes, int] = {}
    bits: dict[int, int] = {}
    holders: dict[tuple[int, int], dict[str | None, int]] = {}
    counts: dict[int, int] = {}
    chain: dict[int | bytes, int] = {}
    for i in range(rng.randrange(0, 60)):
        h: int | bytes = i if rng.random() < 0.8 else bytes([i, 7])
        key = rng.getrandbits(63)
        alias[h] = key
        value = 0
        for bit in rng.sample(BITS, rng.randrange(1, 3)):
            value |= bit
            counts[bit] = counts.get(bit, 0) + 1
            if rng.random() < 0.3:
                holders[(key, bit)] = {o: rng.randrange(1, 3) for o in rng.sample(OWNERS, rng.randrange(1, 3))}
        bits[key] = value
        if rng.random() < 0.2:
            chain[h] = rng.getrandbits(63)
    return alias, bits, holders, counts, chain


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_compiled_view_removal_equals_the_python_one(seed: int) -> None:
    from kvroute.indexer._apply import remove

    rng = random.Random(seed)
    view = _view(rng)
    python_view = copy.deepcopy(view)
    for _ in range(rng.randrange(1, 6)):
        hashes = [rng.choice([*view[0], 999, b"\x00"]) for _ in range(rng.randrange(0, 20))] if view[0] else [5]
        bit, owner = rng.choice(BITS), rng.choice(OWNERS)
        assert remove(*view, bit, hashes, owner) == ingest.remove_python(*python_view, bit, hashes, owner)
        assert view == python_view


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), slot=st.integers(0, 20))
def test_compiled_table_removal_equals_the_python_one(seed: int, slot: int) -> None:
    from kvroute.indexer._apply import unhold

    rng = random.Random(seed)
    held: dict[int, int] = {}
    blocks: dict[int, int] = {}
    for _ in range(rng.randrange(0, 80)):
        key = rng.getrandbits(63)
        value = rng.choice(BITS) | (rng.choice(BITS) if rng.random() < 0.3 else 0)
        held[key] = value
        others = rng.getrandbits(8 * 20) & ~(0xFF << (slot * SLOT_BITS)) if rng.random() < 0.5 else 0
        blocks[key] = others | (value << (slot * SLOT_BITS))
    python_held, python_blocks = dict(held), dict(blocks)
    bit = rng.choice(BITS)
    wanted = [rng.choice([*held, 12345]) for _ in range(rng.randrange(0, 40))] if held else [1]
    shifted = bit << (slot * SLOT_BITS)
    assert unhold(held, blocks, wanted, bit, shifted) == memory.unhold_python(
        python_held, python_blocks, wanted, bit, shifted
    )
    assert (held, blocks) == (python_held, python_blocks)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), wide=st.booleans())
def test_compiled_bit_setting_equals_the_python_one(seed: int, wide: bool) -> None:
    from kvroute.indexer import _apply, bitsets

    rng = random.Random(seed)
    shift = rng.randrange(0, 20) * SLOT_BITS if wide else 0
    table = {rng.getrandbits(63): rng.choice(BITS) << shift for _ in range(rng.randrange(0, 40))}
    pool = [*table, *(rng.getrandbits(63) for _ in range(20))]
    wanted = [rng.choice(pool) for _ in range(rng.randrange(0, 30))]  # repeats, present and new keys
    bit = rng.choice(BITS) << shift
    for compiled, python in (
        (_apply.add_bits, bitsets.add_bits_python),
        (_apply.add_bits_counted, bitsets.add_bits_counted_python),
    ):
        mine, theirs = dict(table), dict(table)
        assert compiled(mine, wanted, bit) == python(theirs, wanted, bit)
        assert mine == theirs and list(mine) == list(theirs)  # same values, same insertion order
    if not wide:
        assert _apply.having(table, wanted, bit) == bitsets.having_python(table, wanted, bit)


def test_keys_stored_together_share_one_value_object() -> None:
    """The chain walk's fast runs rely on it (a pointer comparison per block)."""
    from kvroute.indexer._apply import add_bits

    table: dict[int, int] = {1: 4}
    bit = 1 << 40
    add_bits(table, [1, 2, 3, 4], bit)
    assert table[2] is table[3] is table[4] is bit
    assert table[1] == 4 | bit
