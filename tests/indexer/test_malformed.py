"""Hostile input: counted by reason, dropped, and never the end of the subscriber."""

from __future__ import annotations

import logging

import msgspec
import pytest
import zmq.asyncio
from kvroute.indexer.events import encode_seq
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec
from prometheus_client import REGISTRY

from .fakevllm import Chain, Publisher, eventually

PROMPT = list(range(64))
enc = msgspec.msgpack.encode

HOSTILE: list[tuple[str, list[bytes]]] = [
    ("not_msgpack", [b"", encode_seq(0), b"\xc1\xc1garbage"]),
    ("bad_batch", [b"", encode_seq(0), enc({"ts": 1})]),
    ("bad_batch", [b"", encode_seq(0), enc([1.0, "events", 0])]),
    ("bad_batch", [b"", encode_seq(0), enc([1.0, [], -5])]),
    ("bad_batch", [b"", encode_seq(0), enc(["yesterday", [], 0])]),
    ("bad_event", [b"", encode_seq(0), enc([1.0, [42], 0])]),
    ("bad_field", [b"", encode_seq(0), enc([1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0])]),
    ("bad_field", [b"", encode_seq(0), enc([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}], 0])]),
    (
        "bad_field",
        [
            b"",
            encode_seq(0),
            enc(
                [
                    1.0,
                    [{"type": "BlockStored", "block_hashes": [1], "token_ids": list(range(100)), "block_size": 16}],
                    0,
                ]
            ),
        ],
    ),
    ("bad_field", [b"", encode_seq(0), enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 7}], 0])]),
    ("too_large", [b"", encode_seq(0), enc([1.0, [["AllBlocksCleared"]] * 100_001, 0])]),
    ("bad_seq", [b"", b"\x00\x01", enc([1.0, [], 0])]),
    ("bad_frames", [b"", encode_seq(0)]),
    ("bad_frames", [b"", encode_seq(0), b"", b"extra"]),
    # A msgpack header announcing a 4 GiB array with nothing behind it.
    ("not_msgpack", [b"", encode_seq(0), b"\xdd\xff\xff\xff\xff"]),
]


def dropped(worker: str, reason: str) -> float:
    labels = {"worker": worker, "reason": reason}
    return REGISTRY.get_sample_value("kvroute_index_dropped_total", labels) or 0.0


@pytest.mark.parametrize(("reason", "message"), HOSTILE, ids=[f"{r}-{i}" for i, (r, _) in enumerate(HOSTILE)])
async def test_hostile_message_is_counted_and_dropped(reason: str, message: list[bytes]) -> None:
    indexer = KVIndexer(MemoryIndex())
    worker = f"hostile-{reason}"
    indexer.register_worker(worker, "m")
    before = dropped(worker, reason)
    handled = await indexer.handle_message(worker, message)
    assert handled.outcome == "dropped"
    assert dropped(worker, reason) == before + 1


async def test_bad_tokens_and_unknown_types_inside_a_good_batch() -> None:
    indexer = KVIndexer(MemoryIndex())
    indexer.register_worker("w", "m")
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [-1] * 16,
            "block_size": 16,
        },
        {
            "type": "BlockStored",
            "block_hashes": [2],
            "parent_block_hash": None,
            "token_ids": ["x"] * 16,
            "block_size": 16,
        },
        {"type": "SomethingNew", "whatever": 1},
        ["FutureEvent", 1, 2, 3],
        {
            "type": "BlockStored",
            "block_hashes": [3],
            "parent_block_hash": None,
            "token_ids": PROMPT[:16],
            "block_size": 16,
            "brand_new_field": {"nested": True},
            "group_idx": 0,
        },
    ]
    handled = await indexer.handle_message("w", [b"", encode_seq(0), enc([1.0, events, 0])])
    assert handled.outcome == "applied"
    assert dropped("w", "bad_tokens") >= 2
    assert dropped("w", "unknown_event_type") >= 2
    result = await indexer.lookup_tokens("m", PROMPT)
    assert result.matches["w"].blocks == 1


async def test_subscriber_survives_garbage(zctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture) -> None:
    indexer = KVIndexer(MemoryIndex())
    sub = EventSubscriber(indexer, ctx=zctx)
    pub = Publisher(zctx)
    sub.add_worker(WorkerSpec("g", "m", endpoint=pub.endpoint))
    await sub.start()
    try:
        await pub.wait_subscribed()
        caplog.set_level(logging.WARNING, logger="kvroute.indexer")
        for _, message in HOSTILE:
            await pub.send_raw(message)
        await pub.send_raw([b"", encode_seq(0), b"\xc1"] * 3)
        chain = Chain()
        pub.seq = 1
        await pub.publish([chain.store(PROMPT)])

        async def indexed() -> bool:
            return "g" in (await indexer.lookup_tokens("m", PROMPT)).matches

        await eventually(indexed)
        # Logged once per worker and reason per minute, not once per message.
        not_msgpack_logs = [r for r in caplog.records if "not_msgpack" in r.getMessage()]
        assert len(not_msgpack_logs) == 1
    finally:
        await sub.stop()
        await pub.close()
