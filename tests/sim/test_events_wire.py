"""Wire fidelity: a real ZMQ subscriber decodes the sim's KV events and checks DESIGN §4 field by field."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from kvroute.indexer.events import REPLAY_END_SEQ, AllBlocksCleared, BlockStored, decode_batch
from kvroute.sim.tokenizer import tokenize

from tests.conftest import free_port
from tests.sim.conftest import words


async def _recv(sock: zmq.asyncio.Socket, timeout: float = 10.0) -> list[bytes]:
    return await asyncio.wait_for(sock.recv_multipart(), timeout)


async def _subscribe(endpoint: str, *, bind: bool = False, topic: bytes = b"") -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    await asyncio.sleep(0.3)  # let the subscription propagate (ZMQ slow joiner), not a timing check
    return sock


async def test_bind_mode_map_form_every_field(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    worker = fleet[0]
    sub = await _subscribe(worker.events_endpoint)
    prompt = words(40)
    r = await client.post(f"{worker.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200
    topic, seq, payload = await _recv(sub)
    assert topic == b"" and len(seq) == 8 and struct.unpack(">Q", seq)[0] == 0
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], float) and raw[2] == 0
    event = raw[1][0]
    assert event["type"] == "BlockStored"
    assert {
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
        "locality",
    } <= set(event)
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event["block_hashes"])
    assert len(event["block_hashes"]) == 2 and event["parent_block_hash"] is None
    assert event["token_ids"] == tokenize(prompt)[:32] and event["block_size"] == 16
    assert event["medium"] == "GPU" and event["lora_name"] is None
    batch = decode_batch(payload)
    assert isinstance(batch.events[0], BlockStored)
    # Reset of an idle engine: nothing is published until its next step (vLLM's scheduler publishes the
    # block pool's queued events after a step); then AllBlocksCleared opens the next batch, sequence 1.
    assert (await client.post(f"{worker.url}/reset_prefix_cache")).status_code == 200
    await asyncio.sleep(0)  # a batch would be flushed at the end of this loop iteration
    publisher = worker.ranks[0].publisher
    assert publisher is not None and publisher.seq == 1 and worker.engine.cache.clear_pending
    r = await client.post(f"{worker.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, seq, payload = await _recv(sub)
    assert struct.unpack(">Q", seq)[0] == 1
    assert isinstance(decode_batch(payload).events[0], AllBlocksCleared)
    sub.close()


async def test_evictions_emit_removals_and_replay_returns_buffer(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, preset_overrides={"gpu_blocks": 8})
    worker = fleet[0]
    for i in range(3):  # 3 x 4 blocks through an 8-block cache
        body = {"prompt": words(65, f"p{i}-"), "max_tokens": 1}
        r = await client.post(f"{worker.url}/v1/completions", json=body)
        assert r.status_code == 200
    await asyncio.sleep(0)  # flush the last step's batch
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(worker.replay_endpoint)
    await dealer.send_multipart([b"", struct.pack(">Q", 1)])
    seqs, events = [], []
    while True:
        frames = await _recv(dealer)
        assert frames[0] == b"" and frames[1] == b""  # empty delimiter, then the topic
        if frames[2] == REPLAY_END_SEQ:
            assert frames[3] == b""
            break
        seqs.append(struct.unpack(">Q", frames[2])[0])
        events.extend(msgspec.msgpack.decode(frames[3])[1])  # the wire's events, as vLLM sends them
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 2
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert removed and all(len(e["block_hashes"]) == 1 and e["medium"] == "GPU" for e in removed)  # one per block
    # A malformed replay request is ignored, never fatal.
    await dealer.send_multipart([b"", b"bad"])
    await dealer.send_multipart([b"", struct.pack(">Q", 10_000)])
    frames = await _recv(dealer)
    assert frames[2] == REPLAY_END_SEQ
    dealer.close()


async def test_connect_mode_array_form_bytes_hashes(make_fleet: Any, client: Any) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = await _subscribe(endpoint, bind=True)
    fleet = await make_fleet(2, events_connect=endpoint, event_form="array", hash_bytes=True)
    assert all(w.events_endpoint is None for w in fleet.workers)
    topics = {w.topic.encode() for w in fleet.workers}
    assert len(topics) == 2 and fleet.serve_config()["index"]["events_bind"] == endpoint
    # A connecting PUB learns the subscription late (ZMQ slow joiner): publish until both topics arrive.
    seen: set[bytes] = set()
    for attempt in range(50):
        for w in fleet.workers:
            r = await client.post(
                f"{w.url}/v1/completions", json={"prompt": words(20, f"a{attempt}-"), "max_tokens": 1}
            )
            assert r.status_code == 200
        while await sub.poll(100):
            topic, _seq, payload = await sub.recv_multipart()
            seen.add(topic)
            event = msgspec.msgpack.decode(payload)[1][0]
            assert isinstance(event, list) and event[0] == "BlockStored"
            assert isinstance(event[1][0], bytes) and len(event[1][0]) == 32
            assert isinstance(decode_batch(payload).events[0], BlockStored)
        if seen == topics:
            break
    assert seen == topics
    sub.close()
