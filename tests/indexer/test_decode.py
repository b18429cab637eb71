"""The fast decoder must agree with the reference decoder on everything: valid batches and garbage."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    encode_batch,
)
from kvroute.indexer.fastdecode import decode_batch_fast

hashes = st.lists(st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32)), max_size=5)
media = st.sampled_from(["GPU", "cpu", "CPU", "STORAGE", "disk"])
stored = st.builds(
    BlockStored,
    block_hashes=hashes,
    parent_block_hash=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    token_ids=st.lists(st.integers(0, 2**20), max_size=40),
    block_size=st.sampled_from([0, 4, 16]),
    medium=media,
    lora_name=st.one_of(st.none(), st.text(max_size=5)),
    extra_keys=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.text(max_size=3))), max_size=3)),
    group_idx=st.integers(0, 2),
    locality=st.sampled_from(["LOCAL", "remote"]),
)
removed = st.builds(BlockRemoved, block_hashes=hashes, medium=media, group_idx=st.integers(0, 1))
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=6)


def outcome(decoder, payload: bytes):  # type: ignore[no-untyped-def]
    try:
        return decoder(payload)
    except EventDecodeError as exc:
        return ("error", exc.reason)


@settings(max_examples=150, deadline=None)
@given(events=events, form=st.sampled_from(["map", "array"]), rank=st.integers(0, 3))
def test_same_result_on_valid_batches(events, form, rank) -> None:  # type: ignore[no-untyped-def]
    payload = encode_batch(1.5, events, rank, form=form)
    assert outcome(decode_batch_fast, payload) == outcome(decode_batch, payload)


json_like = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=8),
        st.binary(max_size=8),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(obj=json_like)
def test_same_verdict_on_arbitrary_msgpack(obj) -> None:  # type: ignore[no-untyped-def]
    payload = msgspec.msgpack.encode([1.0, [obj], 0])
    assert outcome(decode_batch_fast, payload) == outcome(decode_batch, payload)
    raw = msgspec.msgpack.encode(obj)
    assert outcome(decode_batch_fast, raw) == outcome(decode_batch, raw)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=64))
def test_same_verdict_on_garbage(data: bytes) -> None:
    assert outcome(decode_batch_fast, data) == outcome(decode_batch, data)


@given(
    kind=st.sampled_from(["BlockStored", "BlockRemoved"]),
    field=st.sampled_from(
        ["block_hashes", "medium", "group_idx", "locality", "token_ids", "block_size", "parent_block_hash"]
    ),
    value=json_like,
)
@settings(max_examples=150, deadline=None)
def test_same_verdict_on_odd_fields(kind: str, field: str, value) -> None:  # type: ignore[no-untyped-def]
    event = {"type": kind, "block_hashes": [1, 2], "token_ids": list(range(8)), "block_size": 4, field: value}
    payload = msgspec.msgpack.encode([1.0, [event], 0])
    assert outcome(decode_batch_fast, payload) == outcome(decode_batch, payload)
