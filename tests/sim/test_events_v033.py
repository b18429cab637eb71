"""vLLM 0.33's event fields on the wire (behind sim options): msgspec's omit-defaults maps, ``session_id``,
``ownership``, lookahead hashing (``lookahead_token_ids``) and a hybrid model's sliding-window group."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from kvroute.indexer.events import BlockRemoved, BlockStored, decode_batch
from kvroute.sim.events import SimBlockStored
from kvroute.sim.kvcache import Allocation, PagedCache, contiguous_window_blocks

from tests.sim.conftest import words
from tests.sim.test_data_parallel import replay_all
from tests.sim.test_transfers import cached, complete

STORED_REQUIRED = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}


async def raw_events(worker: Any) -> list[dict[str, Any]]:
    """Every event the worker published, as the raw msgpack maps (decoded by the indexer as well)."""
    out: list[dict[str, Any]] = []
    endpoint = worker.replay_endpoint
    assert endpoint is not None
    for _, _, payload in await replay_all(endpoint):
        decode_batch(payload)  # the project's own decoder accepts every 0.33 payload
        out.extend(msgspec.msgpack.decode(payload)[1])
    return out


def stored(events: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "BlockStored" and all(e.get(k) == v for k, v in match.items())]


async def test_legacy_encoding_is_the_default(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    w = fleet[0]
    await complete(client, w.url, words(40), session_id="s1")
    [event] = stored(await raw_events(w))
    assert "session_id" not in event and event["locality"] == "LOCAL" and event["extra_keys"] is None


async def test_v033_maps_omit_unset_fields(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, event_fields="0.33", preset_overrides={"gpu_blocks": 8})
    w = fleet[0]
    await complete(client, w.url, words(40))
    await complete(client, w.url, words(100, "evict-"), max_tokens=1)
    await complete(client, w.url, words(20), cache_salt="tenant-a")
    events = await raw_events(w)
    first = stored(events)[0]
    assert set(first) == STORED_REQUIRED | {"lora_name", "group_idx", "kv_cache_spec_kind"}
    assert first["group_idx"] == 0 and first["kv_cache_spec_kind"] == "full_attention"
    assert first["lora_id"] is None and first["lora_name"] is None and first["parent_block_hash"] is None
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert removed and all(set(e) == {"type", "block_hashes", "medium", "group_idx"} for e in removed)
    salted = stored(events)[-1]
    assert salted["extra_keys"][0] == ["tenant-a"]  # only set fields, and this one is set


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        ({"session_id": "from-body"}, {"X-Session-ID": "from-header"}, "from-body"),
        ({}, {"X-Session-ID": "from-header"}, "from-header"),
        ({"vllm_xargs": {"session_id": "from-xargs"}}, {}, "from-xargs"),
        ({"session_id": ""}, {}, None),
    ],
)
async def test_session_id_reaches_the_events(
    make_fleet: Any, client: Any, body: dict[str, Any], headers: dict[str, str], expected: str | None
) -> None:
    fleet = await make_fleet(1, event_fields="0.33")
    w = fleet[0]
    r = await client.post(
        f"{w.url}/v1/completions", json={"prompt": words(40), "max_tokens": 1, **body}, headers=headers
    )
    assert r.status_code == 200
    [event] = stored(await raw_events(w))
    assert event.get("session_id") == expected


async def test_session_id_on_every_surface(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, event_fields="0.33")
    w = fleet[0]
    chat = {"messages": [{"role": "user", "content": words(40, "c-")}], "max_tokens": 1, "session_id": "chat"}
    assert (await client.post(f"{w.url}/v1/chat/completions", json=chat)).status_code == 200
    resp = {"input": words(40, "r-"), "max_output_tokens": 1, "session_id": "resp"}
    assert (await client.post(f"{w.url}/v1/responses", json=resp)).status_code == 200
    msg = {"model": w.model, "max_tokens": 1, "messages": [{"role": "user", "content": words(40, "m-")}]}
    assert (await client.post(f"{w.url}/v1/messages", json=msg, headers={"X-Session-ID": "msg"})).status_code == 200
    assert [e.get("session_id") for e in stored(await raw_events(w))] == ["chat", "resp", "msg"]
    bad = await client.post(f"{w.url}/v1/completions", json={"prompt": "a", "session_id": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"


async def test_offload_ownership_marks_the_cpu_tier_events(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, offload_ownership="kvcr", preset_overrides={"gpu_blocks": 8, "cpu_blocks": 4})
    w = fleet[0]
    for tag in ("a-", "b-", "c-", "d-"):
        await complete(client, w.url, words(65, tag), max_tokens=1)
    events = await raw_events(w)
    cpu = [e for e in events if e["medium"] == "CPU"]
    assert cpu and all(e["ownership"] == "kvcr" for e in cpu)
    assert {e["type"] for e in cpu} == {"BlockStored", "BlockRemoved"}
    assert all("ownership" not in e for e in events if e["medium"] == "GPU")


async def test_kv_cache_report_mode_full_reannounces_the_reused_prefix(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, event_fields="0.33")
    w = fleet[0]
    prompt = words(100)
    await complete(client, w.url, prompt, session_id="s1")
    xargs = {"kv_cache_report_mode": "full"}
    assert cached(await complete(client, w.url, prompt + " more", session_id="s2", vllm_xargs=xargs)) == 96
    events = stored(await raw_events(w))
    first, report = events[0], events[1]
    assert report["session_id"] == "s2" and report["parent_block_hash"] is None
    assert report["block_hashes"] == first["block_hashes"] and report["token_ids"] == first["token_ids"]
    assert w.engine.cache.gpu  # nothing else changed: the report only re-announces


# -- lookahead hashing (EAGLE) ---------------------------------------------------------------------------


async def test_lookahead_blocks_wait_for_their_lookahead_tokens(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, hash_lookahead_tokens=1)
    w = fleet[0]
    prompt = words(64)  # 4 full blocks; block 3's lookahead token is the first generated one
    tokens = w.tokenizer.encode(prompt)
    await complete(client, w.url, prompt, max_tokens=3)
    events = stored(await raw_events(w))
    assert [len(e["block_hashes"]) for e in events] == [3, 1]  # prompt blocks 0-2, then block 3 after decode
    assert events[0]["lookahead_token_ids"] == [[tokens[16]], [tokens[32]], [tokens[48]]]
    assert events[0]["token_ids"] == tokens[:48]
    assert events[1]["token_ids"] == tokens[48:64] and len(events[1]["lookahead_token_ids"][0]) == 1
    assert all(len(x) == 1 for e in events for x in e["lookahead_token_ids"])


async def test_lookahead_hash_covers_the_next_tokens(make_fleet: Any, client: Any) -> None:
    plain = (await make_fleet(1))[0]
    eagle = (await make_fleet(1, hash_lookahead_tokens=1))[0]
    base = words(100)
    other = " ".join(base.split()[:48] + words(52, "x").split())  # same first 48 tokens, token 48 differs
    for w, expected in ((plain, 48), (eagle, 32)):  # with lookahead block 2's hash covers token 48
        await complete(client, w.url, base)
        assert cached(await complete(client, w.url, other)) == expected
        assert cached(await complete(client, w.url, base)) == 96


async def test_lookahead_is_off_with_a_cpu_tier_as_with_any_kv_connector(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, hash_lookahead_tokens=1, preset_overrides={"cpu_blocks": 16})
    w = fleet[0]
    await complete(client, w.url, words(64))
    [event] = stored(await raw_events(w))
    assert "lookahead_token_ids" not in event and len(event["block_hashes"]) == 4


def test_lookahead_hashes_in_the_cache() -> None:
    events: list[Any] = []
    cache = PagedCache(16, 4, events.append, seed=1, lookahead=2)
    assert len(cache.block_hashes(list(range(9)))) == 1  # block 1 needs tokens 8 and 9
    assert len(cache.block_hashes(list(range(10)))) == 2
    a, b = cache.block_hashes([1, 2, 3, 4, 5, 6]), cache.block_hashes([1, 2, 3, 4, 5, 7])
    assert a != b  # the second lookahead token changes block 0's hash
    assert cache.lookahead_ids(list(range(12)), 2) == [[4, 5], [8, 9]]


# -- hybrid model: a sliding-window group --------------------------------------------------------------


async def test_hybrid_model_publishes_both_groups(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, hybrid_sliding_window=32)
    w = fleet[0]
    prompt = words(100)
    await complete(client, w.url, prompt)
    events = await raw_events(w)
    full, window = stored(events, group_idx=0), stored(events, group_idx=1)
    assert len(full) == 1 and len(window) == 1
    assert full[0]["kv_cache_spec_kind"] == "full_attention" and "kv_cache_spec_sliding_window" not in full[0]
    assert window[0]["kv_cache_spec_kind"] == "sliding_window" and window[0]["kv_cache_spec_sliding_window"] == 32
    assert window[0]["block_hashes"] == full[0]["block_hashes"]  # one hash per block, told apart by group
    assert cached(await complete(client, w.url, prompt)) == 96
    assert cached(await complete(client, w.url, " ".join(prompt.split()[:64]) + " tail")) == 64


async def test_hybrid_hit_needs_the_window_in_the_sliding_group(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, hybrid_sliding_window=32)
    w = fleet[0]
    swa = w.engine.cache.swa
    assert swa is not None and swa.need == contiguous_window_blocks(32, 16) == 2
    swa.capacity = 8  # a small sliding-window pool: its out-of-window blocks go first
    first = words(100)
    await complete(client, w.url, first)
    await complete(client, w.url, words(100, "other-"))  # 12 blocks > 8: first's out-of-window blocks go
    events = await raw_events(w)
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert len(removed) == 4 and all(e["group_idx"] == 1 for e in removed)
    assert {e["block_hashes"][0] for e in removed} == set(stored(events, group_idx=0)[0]["block_hashes"][:4])
    # Full attention still holds the first 4 blocks, but a hit at block 4 needs blocks 2-3 of the window.
    shared = " ".join(first.split()[:64]) + " tail"
    assert cached(await complete(client, w.url, shared)) == 0
    # The whole prompt still hits: its window tail (blocks 4-5) is there.
    assert cached(await complete(client, w.url, first)) == 96


def test_sliding_window_group_unit() -> None:
    events: list[Any] = []
    cache = PagedCache(32, 4, events.append, seed=3, sliding_window=5)  # needs ceil(4/4) = 1 block
    tokens = list(range(24))
    hashes = cache.block_hashes(tokens)
    alloc = Allocation()
    assert cache.reserve(alloc, 6)
    cache.store(alloc, hashes, tokens, None)
    assert cache.swa is not None and len(cache.swa) == 6 and list(cache.swa.tail) == hashes[5:]
    window = [e for e in events if isinstance(e, SimBlockStored) and e.group_idx == 1]
    assert len(window) == 1 and window[0].kv_cache_spec_sliding_window == 5
    assert cache.hybrid_hit(hashes, 6) == 6
    del cache.swa.freed[hashes[2]]
    assert cache.hybrid_hit(hashes, 3) == 2 and cache.hybrid_hit(hashes, 6) == 6
    assert isinstance(window[0], BlockStored) and not isinstance(window[0], BlockRemoved)


async def test_hybrid_reuse_report_covers_every_group_as_vllm_does(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, hybrid_sliding_window=32)
    w = fleet[0]
    prompt = words(100)
    await complete(client, w.url, prompt)
    xargs = {"kv_cache_report_mode": "full"}
    assert cached(await complete(client, w.url, prompt + " more", vllm_xargs=xargs)) == 96
    reports = [e for e in stored(await raw_events(w)) if e["parent_block_hash"] is None][-2:]
    assert [e["group_idx"] for e in reports] == [0, 1]
    # The window group's report names all 6 blocks of the hit, also the 4 out of its window.
    assert reports[1]["block_hashes"] == reports[0]["block_hashes"] and len(reports[1]["block_hashes"]) == 6
    assert reports[1]["kv_cache_spec_kind"] == "sliding_window"
