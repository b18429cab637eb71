"""``GET /kv_event_sources`` (vLLM >= 0.32): what it reports is what a real ZMQ socket can subscribe to."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import zmq
import zmq.asyncio
from kvroute.indexer.events import REPLAY_END_SEQ, BlockStored, decode_batch
from kvroute.sim.tokenizer import tokenize

from tests.conftest import free_port
from tests.sim.conftest import event_sources, words


async def _sources(client: Any, url: str) -> list[dict[str, Any]]:
    r = await client.get(f"{url}/kv_event_sources")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    return event_sources(r.json())  # exactly vLLM's KVEventsConfig fields per DP rank


def _sub(endpoint: str, topic: str, *, bind: bool = False) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


async def _stored_until(sub: zmq.asyncio.Socket, url: str, client: Any, tag: str) -> list[bytes]:
    """Send fresh prompts to ``url`` until the subscriber holds a batch storing one of them: ZMQ delivers
    to a new subscriber only once its subscription has reached the publisher (the first can be lost)."""
    sent: set[tuple[int, ...]] = set()
    for attempt in range(50):
        prompt = words(20, f"{tag}{attempt}-")
        sent.add(tuple(tokenize(prompt)[:16]))
        r = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200
        while await sub.poll(100):
            frames = await sub.recv_multipart()
            for event in decode_batch(frames[2]).events:
                if isinstance(event, BlockStored) and tuple(event.token_ids[:16]) in sent:
                    return frames
    raise AssertionError("no event reached the subscriber at the discovered endpoint")


async def test_ephemeral_ports_are_reported_resolved_and_subscribable(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)  # events_port = replay_port = 0: the OS picks both
    worker = fleet[0]
    [source] = await _sources(client, worker.url)
    assert source["data_parallel_rank"] == 0 and source["topic"] == ""
    assert source["endpoint"].startswith("tcp://127.0.0.1:") and source["replay_endpoint"].startswith("tcp://")
    ports = {int(source[key].rsplit(":", 1)[1]) for key in ("endpoint", "replay_endpoint")}
    assert 0 not in ports and len(ports) == 2  # the bound ports, not the requested 0

    # Live events at the discovered endpoint.
    sub = _sub(source["endpoint"], source["topic"])
    topic, seq, _payload = await _stored_until(sub, worker.url, client, "disc")
    assert topic == b"" and len(seq) == 8
    sub.close()

    # Replay at the discovered replay endpoint: the buffered batches, then the end marker.
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(source["replay_endpoint"])
    await dealer.send_multipart([b"", struct.pack(">Q", 0)])
    seqs = []
    while True:
        frames = await asyncio.wait_for(dealer.recv_multipart(), 10)
        if frames[2] == REPLAY_END_SEQ:
            break
        seqs.append(struct.unpack(">Q", frames[2])[0])
    assert seqs and seqs[0] == 0
    dealer.close()


async def test_explicit_ports_topic_and_no_replay(make_fleet: Any, client: Any) -> None:
    port = free_port()
    fleet = await make_fleet(1, events_port=port, topic="kv-events", replay=False)
    worker = fleet[0]
    (source,) = await _sources(client, worker.url)
    assert source["data_parallel_rank"] == 0 and source["endpoint"] == f"tcp://127.0.0.1:{port}"
    assert source["replay_endpoint"] is None and source["topic"] == "kv-events"
    sub = _sub(f"tcp://127.0.0.1:{port}", "kv-events")
    topic, _seq, _payload = await _stored_until(sub, worker.url, client, "topic")
    assert topic == b"kv-events"
    sub.close()


async def test_connect_mode_reports_the_configured_endpoint(make_fleet: Any, client: Any) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = _sub(endpoint, "", bind=True)  # the router's SUB, which the workers' PUBs connect to
    fleet = await make_fleet(2, events_connect=endpoint)
    for worker in fleet.workers:
        [source] = await _sources(client, worker.url)
        assert source["endpoint"] == endpoint and source["topic"] == worker.topic
        assert source["topic"].startswith("kv@") and source["replay_endpoint"] == worker.replay_endpoint
        topic, _seq, _payload = await _stored_until(sub, worker.url, client, worker.worker_id)
        assert topic == source["topic"].encode()
    sub.close()
