"""Data-parallel workers as vLLM serves them: one HTTP port, N ranks with their own KV caches and
publishers (port + rank, own sequence numbers, ``data_parallel_rank`` in the payload, replay per rank),
``X-data-parallel-rank`` to choose, vLLM's balancing otherwise."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from kvroute.config import RouterConfig
from kvroute.indexer.events import REPLAY_END_SEQ, AllBlocksCleared, BlockStored, decode_batch
from kvroute.sim.fleet import SimFleet, worker_ports

from tests.conftest import free_port_runs
from tests.sim.conftest import event_sources, words
from tests.sim.test_transfers import cached, complete, metric, sent_bytes

RANK = "X-data-parallel-rank"


async def replay_all(endpoint: str) -> list[tuple[int, bytes, bytes]]:
    """Every buffered batch of one rank: (seq, topic, payload), through a DEALER as vLLM documents."""
    await asyncio.sleep(0)  # the last step's batch is flushed at the end of the loop iteration
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    await dealer.send_multipart([b"", struct.pack(">Q", 0)])
    out = []
    try:
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 10)
            if frames[2] == REPLAY_END_SEQ:
                assert frames[1] == b"" and frames[3] == b""  # vLLM's end marker: empty topic and payload
                return out
            out.append((struct.unpack(">Q", frames[2])[0], frames[1], frames[3]))
    finally:
        dealer.close()


async def post(client: Any, url: str, body: dict[str, Any], rank: int | str | None = None) -> Any:
    headers = {RANK: str(rank)} if rank is not None else {}
    return await client.post(f"{url}/v1/completions", json={"max_tokens": 2, **body}, headers=headers)


async def test_each_rank_has_its_own_cache_publisher_and_sequence(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, dp_size=2, topic="kv")
    w = fleet[0]
    sources = event_sources((await client.get(f"{w.url}/kv_event_sources")).json())
    assert [s["data_parallel_rank"] for s in sources] == [0, 1]
    ports = [int(s["endpoint"].rsplit(":", 1)[1]) for s in sources]
    replays = [int(s["replay_endpoint"].rsplit(":", 1)[1]) for s in sources]
    assert ports[1] == ports[0] + 1 and replays[1] == replays[0] + 1  # rank n at port + n
    assert all(s["topic"] == "kv" for s in sources)
    prompt = {"prompt": words(100)}
    assert cached((await post(client, w.url, prompt, rank=1)).json()) == 0
    assert cached((await post(client, w.url, prompt, rank=1)).json()) == 96  # rank 1 holds it
    assert cached((await post(client, w.url, prompt, rank=0)).json()) == 0  # rank 0 has its own cache
    for rank, source in enumerate(sources):
        batches = await replay_all(source["replay_endpoint"])
        assert [seq for seq, _, _ in batches] == list(range(len(batches))) and batches  # own counter from 0
        for _, topic, payload in batches:
            assert topic == b"kv" and msgspec.msgpack.decode(payload)[2] == rank
            assert decode_batch(payload).dp_rank == rank
        stored = [e for _, _, p in batches for e in decode_batch(p).events if isinstance(e, BlockStored)]
        assert len(stored) == 1 and len(stored[0].block_hashes) == 6  # the prompt once per rank


async def test_rank_header_semantics(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, dp_size=2)
    w = fleet[0]
    r = await post(client, w.url, {"prompt": "a b"}, rank=2)
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "data_parallel_rank 2 is out of range [0, 2).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert (await post(client, w.url, {"prompt": "a b"}, rank=-1)).status_code == 400
    assert (await post(client, w.url, {"prompt": "a b"}, rank="one")).status_code == 200  # not an int: ignored
    # One rank: rank 0 is fine, anything else is out of range, as in vLLM.
    single = (await make_fleet(1))[0]
    assert (await post(client, single.url, {"prompt": "a b"}, rank=0)).status_code == 200
    assert (await post(client, single.url, {"prompt": "a b"}, rank=1)).status_code == 400
    # Every generation surface reads the header.
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert (await client.post(f"{w.url}/v1/chat/completions", json=chat, headers={RANK: "5"})).status_code == 400
    r = await client.post(f"{w.url}/v1/responses", json={"input": "x", "max_output_tokens": 1}, headers={RANK: "5"})
    assert r.status_code == 400
    msg = {"model": w.model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    r = await client.post(f"{w.url}/v1/messages", json=msg, headers={RANK: "5"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_balancing_round_robins_idle_ranks_and_avoids_busy_ones(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, dp_size=3)
    w = fleet[0]
    for i in range(6):
        assert (await post(client, w.url, {"prompt": words(20, f"b{i}-")})).status_code == 200
    text = (await client.get(f"{w.url}/metrics")).text
    per_rank = [metric(text, "vllm:prompt_tokens_total", engine=str(r)) for r in range(3)]
    assert per_rank == [40.0, 40.0, 40.0]  # idle ranks tie: the rotating start spreads them
    # A busy rank is avoided: with rank 0 decoding, the next two requests go elsewhere.
    slow = (await make_fleet(1, dp_size=2, time_scale=1.0, preset_overrides={"decode_base_s": 0.05}))[0]
    busy = asyncio.create_task(post(client, slow.url, {"prompt": words(20), "max_tokens": 30}, rank=0))
    while slow.ranks[0].inflight == 0:
        await asyncio.sleep(0.01)
    assert slow.balance() == 1 and slow.balance() == 1
    assert (await busy).status_code == 200


async def test_metrics_are_labelled_per_engine(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, dp_size=2)
    w = fleet[0]
    await post(client, w.url, {"prompt": words(40)}, rank=1)
    text = (await client.get(f"{w.url}/metrics")).text
    for rank in ("0", "1"):
        assert f'vllm:num_requests_running{{engine="{rank}",model_name="{w.model}"}}' in text
        assert f'engine="{rank}",num_cpu_blocks=' in text  # vllm:cache_config_info, per engine as vLLM's
    assert metric(text, "vllm:prefix_cache_queries_total", engine="1") == 40
    assert metric(text, "vllm:prefix_cache_queries_total", engine="0") == 0
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1  # one family, one series per rank
    state = (await client.get(f"{w.url}/sim/state")).json()
    assert state["dp_size"] == 2 and [r["dp_rank"] for r in state["ranks"]] == [0, 1]


async def test_explicit_ports_are_offset_by_rank_and_serve_config_says_dp_size(make_fleet: Any, client: Any) -> None:
    events, replay, p2p = free_port_runs(3, 2)
    fleet = await make_fleet(1, dp_size=2, events_port=events, replay_port=replay, p2p_port=p2p)
    w = fleet[0]
    sources = w.kv_event_sources()
    assert [s["endpoint"] for s in sources] == [f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{events + 1}"]
    assert [s["replay_endpoint"] for s in sources] == [f"tcp://127.0.0.1:{replay}", f"tcp://127.0.0.1:{replay + 1}"]
    assert [r.p2p.port for r in w.ranks] == [p2p, p2p + 1]
    config = RouterConfig.model_validate(fleet.serve_config())
    assert config.workers[0].dp_size == 2 and config.workers[0].kv_events == f"tcp://127.0.0.1:{events}"
    assert config.workers[0].p2p_port == p2p


async def test_ephemeral_ports_per_rank_like_tcp_star_zero(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, dp_size=3, dp_ephemeral_ports=True)
    sources = fleet[0].kv_event_sources()
    ports = {int(s["endpoint"].rsplit(":", 1)[1]) for s in sources}
    assert len(ports) == 3 and 0 not in ports  # each rank bound its own, resolved


async def test_connect_mode_ranks_connect_to_port_plus_rank(make_fleet: Any, client: Any) -> None:
    (base,) = free_port_runs(1, 2)
    endpoint = f"tcp://127.0.0.1:{base}"
    fleet = await make_fleet(1, dp_size=2, events_connect=endpoint)
    sources = fleet[0].kv_event_sources()
    assert [s["endpoint"] for s in sources] == [endpoint, f"tcp://127.0.0.1:{base + 1}"]
    assert sources[0]["topic"] == sources[1]["topic"] == f"kv@{fleet[0].worker_id}"


async def test_p2p_reaches_the_rank_at_port_plus_rank(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(2, dp_size=2)
    a, b = fleet.workers
    prompt = words(200)
    await post(client, a.url, {"prompt": prompt}, rank=1)
    at_rank = {"kv_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": a.p2p_port + 1}
    answer = await complete(client, b.url, prompt, {"remote_kv_source": at_rank})
    assert cached(answer) == 192
    assert await sent_bytes(client, a.url, "p2p") == 12 * a.opts.preset.bytes_per_block
    at_rank0 = {**at_rank, "kv_request_id": "r2", "remote_port": a.p2p_port}
    assert cached(await complete(client, (await make_fleet(1))[0].url, prompt, {"remote_kv_source": at_rank0})) == 0


async def test_reset_clears_every_rank(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, dp_size=2)
    w = fleet[0]
    for rank in (0, 1):
        await post(client, w.url, {"prompt": words(40)}, rank=rank)
    assert (await client.post(f"{w.url}/reset_prefix_cache")).status_code == 200
    assert all(not r.engine.cache.gpu for r in w.ranks)
    for rank in (0, 1):  # each rank publishes its reset at its own next step
        await post(client, w.url, {"prompt": words(40, "next-")}, rank=rank)
    for source in w.kv_event_sources():
        assert source["replay_endpoint"] is not None
        batches = await replay_all(source["replay_endpoint"])
        events = [e for _, _, payload in batches for e in decode_batch(payload).events]
        cleared = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
        assert len(cleared) == 1 and isinstance(events[cleared[0] + 1], BlockStored)


def test_fleet_base_port_layout_leaves_room_for_ranks() -> None:
    one = worker_ports(9000, 1)
    assert one == {"http_port": 9004, "events_port": 9005, "replay_port": 9006, "p2p_port": 9007}
    two = [worker_ports(9000, i, dp_size=2) for i in range(2)]
    used = [p + r for ports in two for key, p in ports.items() for r in range(1 if key == "http_port" else 2)]
    assert len(used) == len(set(used)) == 14


async def test_a_rank_port_in_use_fails_the_start_at_once_and_leaks_nothing() -> None:
    """Rank 1 cannot bind (port + 1 is taken): the fleet's start raises instead of hanging on its ZMQ context,
    and what rank 0 had opened is closed (its ports can be bound again)."""
    (events,) = free_port_runs(1, 2)
    squatter = zmq.Context.instance().socket(zmq.PUB)
    squatter.bind(f"tcp://127.0.0.1:{events + 1}")
    try:
        fleet = SimFleet(1, "tiny", time_scale=0.01, dp_size=2, events_port=events)
        with pytest.raises(zmq.ZMQError):
            await asyncio.wait_for(fleet.start(), 20)
    finally:
        squatter.close(0)
    probe = zmq.Context.instance().socket(zmq.PUB)
    try:
        probe.bind(f"tcp://127.0.0.1:{events}")  # rank 0's port was released
    finally:
        probe.close(0)
