"""KV-transfer protocols end to end between simulated workers (DESIGN §6)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from kvroute.sim.p2p import HIT, HIT_PENDING, MISS, P2PClient

from tests.sim.conftest import words


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def sent_bytes(client: Any, url: str, protocol: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    return metric(text, "kvroute_sim:kv_transfer_bytes_total", direction="sent", protocol=protocol)


async def complete(client: Any, url: str, prompt: str, kv: dict[str, Any] | None = None, **body: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"prompt": prompt, "max_tokens": body.pop("max_tokens", 2), **body}
    if kv is not None:
        payload["kv_transfer_params"] = kv
    r = await client.post(f"{url}/v1/completions", json=payload)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def peer(worker: Any, kv_request_id: str = "x1") -> dict[str, Any]:
    return {"kv_request_id": kv_request_id, "remote_host": "127.0.0.1", "remote_port": worker.p2p_port}


# -- P2P tier ----------------------------------------------------------------------------------------


async def test_remote_kv_source_fetches_from_the_named_peer(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(3)
    a, b, c = fleet.workers
    prompt = words(200)
    await complete(client, a.url, prompt)
    answer = await complete(client, b.url, prompt, {"remote_kv_source": peer(a)})
    assert cached(answer) == 192  # 12 full blocks fetched (the last token is always recomputed)
    assert await sent_bytes(client, a.url, "p2p") == 12 * a.opts.preset.bytes_per_block
    assert await sent_bytes(client, c.url, "p2p") == 0
    # The fetched blocks are now local on b: the next request hits locally.
    assert cached(await complete(client, b.url, prompt)) == 192
    # A peer that does not have them: MISS, recompute, correct answer.
    miss = await complete(client, c.url, words(50, "z"), {"remote_kv_source": peer(a)})
    assert cached(miss) == 0


async def test_kv_load_tiers_without_remote_forbids_the_fetch(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(2)
    a, b = fleet.workers
    await complete(client, a.url, words(100))
    kv = {"remote_kv_source": peer(a), "kv_load_tiers": [{"medium": "CPU", "locality": "LOCAL"}]}
    assert cached(await complete(client, b.url, words(100), kv)) == 0
    kv["kv_load_tiers"] = [{"medium": "CPU", "locality": "REMOTE"}]
    assert cached(await complete(client, b.url, words(100), kv)) == 96


async def test_remote_decoder_then_remote_prefiller(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(2, roles=["prefill", "decode"], p2p_pending_timeout_s=1000.0)  # 10 s bound
    p, d = fleet.workers
    prompt = words(120)
    # Both legs at once, as a router may send them: the decoder waits (HIT_PENDING) for the prefill.
    pre = complete(client, p.url, prompt, {"remote_decoder": {"kv_request_id": "req-7"}}, max_tokens=1)
    dec = complete(client, d.url, prompt, {"remote_prefiller": peer(p, "req-7")}, max_tokens=4)
    _, answer = await asyncio.gather(pre, dec)
    assert cached(answer) == 112
    assert await sent_bytes(client, p.url, "p2p") == 7 * p.opts.preset.bytes_per_block
    state = (await client.get(f"{p.url}/sim/state")).json()
    assert state["holds"]["p2p"] == []  # single use: released once the decoder read it


async def test_remote_decoder_combined_with_remote_kv_source(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(3)
    a, p, d = fleet.workers
    base = words(64, "sys")
    await complete(client, a.url, base)
    prompt = base + " " + words(40, "new")
    kv = {"remote_kv_source": peer(a, "k1"), "remote_decoder": {"kv_request_id": "k2"}}
    first = await complete(client, p.url, prompt, kv, max_tokens=1)
    assert cached(first) == 64  # the 4 blocks a holds
    answer = await complete(client, d.url, prompt, {"remote_prefiller": peer(p, "k2")})
    assert cached(answer) == 96


async def test_hit_pending_is_bounded(make_fleet: Any, client: Any) -> None:
    # 30 model s x 0.01 = 300 ms: room for a second lookup even when the first answer comes late (a busy box).
    fleet = await make_fleet(2, p2p_pending_timeout_s=30.0)
    p, d = fleet.workers
    answer = await complete(client, d.url, words(60), {"remote_prefiller": peer(p, "never-comes")})
    assert cached(answer) == 0  # gave up after the bound, recomputed
    text = (await client.get(f"{p.url}/metrics")).text
    assert metric(text, "kvroute_sim:p2p_lookups_total", status=HIT_PENDING) >= 2


async def test_busy_peer_answers_retry_and_the_consumer_recomputes(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(2, p2p_max_concurrent_transfers=0, p2p_max_retries=2)  # always busy
    a, b = fleet.workers
    await complete(client, a.url, words(80))
    answer = await complete(client, b.url, words(80), {"remote_kv_source": peer(a)})
    assert cached(answer) == 0
    text = (await client.get(f"{a.url}/metrics")).text
    assert metric(text, "kvroute_sim:p2p_lookups_total", status="RETRY") == 3  # first try + 2 retries
    assert await sent_bytes(client, a.url, "p2p") == 0


async def test_dead_peer_costs_a_bounded_wait_then_recompute(make_fleet: Any, client: Any) -> None:
    from tests.conftest import free_port

    fleet = await make_fleet(1, control_timeout_s=0.3)
    dead = {"kv_request_id": "x", "remote_host": "127.0.0.1", "remote_port": free_port()}
    answer = await complete(client, fleet[0].url, words(80), {"remote_kv_source": dead})
    assert cached(answer) == 0 and answer["usage"]["completion_tokens"] == 2


async def test_p2p_control_answers_hit_miss_and_survives_garbage(make_fleet: Any, client: Any) -> None:
    import zmq
    import zmq.asyncio

    fleet = await make_fleet(1)
    a = fleet[0]
    await complete(client, a.url, words(64))
    hashes = a.engine.cache.block_hashes(a.tokenizer.encode(words(64)))
    ctx = zmq.asyncio.Context()
    p2p = P2PClient(ctx)
    try:
        hit = await p2p.call("127.0.0.1", a.p2p_port, {"op": "lookup", "mode": "cache", "hashes": hashes}, 5)
        assert hit == {"status": HIT, "num_blocks": 4, "nonce": 1}
        miss = await p2p.call("127.0.0.1", a.p2p_port, {"op": "lookup", "mode": "cache", "hashes": [1, 2]}, 5)
        assert miss is not None and miss["status"] == MISS
        bad = await p2p.call("127.0.0.1", a.p2p_port, {"op": "explode"}, 5)
        assert bad is not None and bad["status"] == "ERROR"
        raw = ctx.socket(zmq.DEALER)
        raw.connect(f"tcp://127.0.0.1:{a.p2p_port}")
        await raw.send_multipart([b"", b"\xc1 not msgpack"])
        await raw.send_multipart([b"only-one-frame-after-identity"])
        raw.close(0)
        lookup = {"op": "lookup", "mode": "cache", "hashes": hashes}
        again = await p2p.call("127.0.0.1", a.p2p_port, lookup, 5)
        assert again is not None and again["status"] == HIT
    finally:
        await p2p.close()
        ctx.term()


@pytest.mark.parametrize(
    "kv",
    [
        {
            "remote_prefiller": {"kv_request_id": "a", "remote_host": "h", "remote_port": 1},
            "remote_kv_source": {"kv_request_id": "b", "remote_host": "h", "remote_port": 1},
        },
        {
            "remote_prefiller": {"kv_request_id": "a", "remote_host": "h", "remote_port": 1},
            "remote_decoder": {"kv_request_id": "b"},
        },
        {"remote_decoder": {"kv_request_id": "a"}, "do_remote_decode": True},
        {"do_remote_decode": True, "do_remote_prefill": True},
        {"do_remote_prefill": True},
        {"remote_kv_source": {"kv_request_id": "a", "remote_host": "h", "remote_port": 70000}},
        {"remote_kv_source": {"remote_host": "h", "remote_port": 1}},
        {"max_offload_tokens": -1},
        {"kv_load_tiers": [{"medium": "GPU"}]},
    ],
)
async def test_forbidden_or_malformed_params_are_rejected(make_fleet: Any, client: Any, kv: dict[str, Any]) -> None:
    fleet = await make_fleet(1)
    r = await client.post(f"{fleet[0].url}/v1/completions", json={"prompt": "a b", "kv_transfer_params": kv})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == 400 and error["param"] == "kv_transfer_params"
    assert "kv_transfer_params" in error["message"]


# -- NixlConnector pull P/D and bidirectional reuse -----------------------------------------------------

NIXL_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def test_nixl_pull_pd_and_bidirectional_reuse(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(2, roles=["prefill", "decode"], decoder_kv_blocks_ttl=480.0, time_scale=0.01)
    p, d = fleet.workers
    turn1 = words(100, "t1-")
    pre = await complete(client, p.url, turn1, dict(NIXL_PREFILL), max_tokens=1)
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == p.engine_id
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == p.p2p_port
    assert params["remote_num_tokens"] == 100 and len(params["remote_block_ids"]) == 6
    assert {"remote_request_id", "tp_size"} <= set(params)
    dec = await complete(client, d.url, turn1, params, max_tokens=80)
    assert cached(dec) == 96
    assert await sent_bytes(client, p.url, "nixl") == 6 * p.opts.preset.bytes_per_block
    assert (await client.get(f"{p.url}/sim/state")).json()["holds"]["nixl"] == []  # read: freed
    # The decoder retains prompt + answer and says so on its non-streaming answer.
    retained = dec["kv_transfer_params"]
    assert retained["remote_engine_id"] == d.engine_id and retained["remote_num_tokens"] == 180
    # Next turn: the prefiller has 6 blocks locally; the decoder has 11 (prompt + answer): 5 blocks = 80
    # tokens are reusable beyond the local prefix, at least the 64-token threshold, so it pulls them.
    turn2 = turn1 + " " + dec["choices"][0]["text"] + " " + words(30, "t2-")
    back = {**retained, "do_remote_decode": True, "do_remote_prefill": False}
    pre2 = await complete(client, p.url, turn2, back, max_tokens=1)
    assert cached(pre2) == 176
    assert await sent_bytes(client, d.url, "nixl") == 5 * p.opts.preset.bytes_per_block


async def test_bidirectional_threshold_recomputes_small_reuse(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(2, roles=["prefill", "decode"])
    p, d = fleet.workers
    turn1 = words(40, "s-")  # 2 full blocks = 32 tokens reusable < 64
    params = (await complete(client, p.url, turn1, dict(NIXL_PREFILL), max_tokens=1))["kv_transfer_params"]
    retained = (await complete(client, d.url, turn1, params, max_tokens=2))["kv_transfer_params"]
    await client.post(f"{p.url}/reset_prefix_cache")
    back = {**retained, "do_remote_decode": True, "do_remote_prefill": False}
    answer = await complete(client, p.url, turn1 + " more", back, max_tokens=1)
    assert cached(answer) == 0
    assert await sent_bytes(client, d.url, "nixl") == 0
    assert (await client.get(f"{p.url}/sim/state")).json()["recompute_decisions"] == 1


async def test_decoder_retention_expires_on_time_and_is_not_renewed(make_fleet: Any, client: Any) -> None:
    scale = 0.005  # 480 s -> 2.4 s real: long enough for the steps below on a busy machine
    fleet = await make_fleet(
        4, roles=["prefill", "decode", "prefill", "prefill"], decoder_kv_blocks_ttl=480.0, time_scale=scale
    )
    p, d, p2, p3 = fleet.workers  # fresh prefillers for the reads: nothing cached locally
    prompt = words(100)
    params = (await complete(client, p.url, prompt, dict(NIXL_PREFILL), max_tokens=1))["kv_transfer_params"]
    retained = (await complete(client, d.url, prompt, params, max_tokens=2))["kv_transfer_params"]
    hold = d.engine.transfers.holds["retain"][retained["remote_request_id"]]
    loop = asyncio.get_running_loop()
    deadline = hold.timer.when()
    assert deadline - loop.time() <= 480 * scale  # fixed TTL, scaled
    back = {**retained, "do_remote_decode": True, "do_remote_prefill": False}
    assert cached(await complete(client, p2.url, prompt + " x", back, max_tokens=1)) == 96  # a read...
    assert hold.timer.when() == deadline  # ...does not renew the lease
    await asyncio.sleep(max(deadline - loop.time(), 0))
    for _ in range(200):  # the expiry callback runs right at the deadline
        if retained["remote_request_id"] not in d.engine.transfers.holds["retain"]:
            break
        await asyncio.sleep(0.01)
    assert retained["remote_request_id"] not in d.engine.transfers.holds["retain"]
    assert loop.time() >= deadline
    expired = await complete(client, p3.url, prompt + " y", back, max_tokens=1)
    assert cached(expired) == 0  # expired: recompute


async def test_max_offload_tokens_zero_keeps_blocks_off_the_cpu_tier(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, preset_overrides={"gpu_blocks": 8, "cpu_blocks": 16})
    w = fleet[0]
    await complete(client, w.url, words(65, "keep-"), {"max_offload_tokens": 0}, max_tokens=1)
    await complete(client, w.url, words(65, "other-"), max_tokens=1)
    await complete(client, w.url, words(65, "third-"), max_tokens=1)
    cpu_tokens = {t for b in w.engine.cache.cpu.values() for t in b.tokens}
    assert not cpu_tokens & set(w.tokenizer.encode(words(65, "keep-")))
    # Blocks without the limit were offloaded and come back as CPU hits (promoted, counted as cached).
    again = await complete(client, w.url, words(65, "other-"), max_tokens=1)
    assert cached(again) == 64
    text = (await client.get(f"{w.url}/metrics")).text
    assert metric(text, "kvroute_sim:cpu_promoted_blocks_total") > 0


async def test_metrics_regex_helper_sanity() -> None:
    assert metric('a_total{x="1"} 2.0\na_total{x="2"} 3.0', "a_total", x="2") == 3.0
    assert re.match(r"\w+", "ok")
