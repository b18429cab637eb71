"""Request rewriting per protocol (DESIGN §6): P2P keys, NixlConnector legs, client keys, conversations."""

from __future__ import annotations

import itertools

import pytest
from kvroute.policies.base import RoutePlan, WorkerView
from kvroute.router.kv_params import (
    NIXL_PREFILL_PARAMS,
    REQUEST_ID_HEADER,
    KVParamsError,
    build_legs,
    check_kv_transfer_params,
    conversation_params_from_response,
    sanitize_client_body,
)

WORKERS = {
    "a": WorkerView(id="a", p2p_host="10.0.0.1", p2p_port=5710),
    "b": WorkerView(id="b", p2p_host="10.0.0.2", p2p_port=5711),
    "c": WorkerView(id="c", p2p_host="10.0.0.3", p2p_port=5712),
    "nop2p": WorkerView(id="nop2p"),
}
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 50,
    "max_completion_tokens": 50,
    "stream_options": {"include_usage": True},
    "min_tokens": 3,
}


def ids() -> itertools.count[int]:
    return itertools.count(1)


def counter_factory() -> object:
    c = ids()
    return lambda: f"id{next(c)}"


def test_client_routing_keys_are_stripped_or_refused() -> None:
    evil = {**BODY, "kv_transfer_params": {"remote_host": "evil", "remote_port": 1, "remote_kv_source": {}}}
    clean, removed = sanitize_client_body(evil)
    assert "kv_transfer_params" not in clean and removed == ["remote_host", "remote_kv_source", "remote_port"]
    assert evil["kv_transfer_params"]  # the original is untouched
    with pytest.raises(KVParamsError, match="set by the router"):
        sanitize_client_body(evil, mode="refuse")
    assert sanitize_client_body({**BODY, "kv_transfer_params": "x"})[1] == ["kv_transfer_params"]
    kept, _ = sanitize_client_body(
        {**BODY, "kv_transfer_params": {"note": 1, "remote_host": "x"}}, allow=frozenset({"note"})
    )
    assert kept["kv_transfer_params"] == {"note": 1}
    with pytest.raises(KVParamsError):
        sanitize_client_body([1, 2])


def test_none_protocol_local_body_only() -> None:
    legs = build_legs(
        {**BODY, "kv_transfer_params": {"remote_host": "x"}},
        RoutePlan("a", "a"),
        WORKERS,
        protocol="none",
        request_id="req-1",
    )
    assert legs.prefill is None and legs.final is not None
    assert legs.final.worker_id == "a" and "kv_transfer_params" not in legs.final.body
    assert legs.final.headers == {REQUEST_ID_HEADER: "req-1"}
    with pytest.raises(KVParamsError):
        build_legs(BODY, RoutePlan("a", "b"), WORKERS, protocol="none", request_id="r")


def test_p2p_aggregated_with_source_and_tiers() -> None:
    plan = RoutePlan(
        "a", "a", kv_source="b", kv_load_tiers=[{"medium": "STORAGE", "locality": "LOCAL"}], max_offload_tokens=1024
    )
    legs = build_legs(BODY, plan, WORKERS, protocol="p2p", request_id="r", id_factory=counter_factory())
    assert legs.prefill is None and legs.final is not None
    params = legs.final.body["kv_transfer_params"]
    assert params == {
        "kv_load_tiers": [{"medium": "STORAGE", "locality": "LOCAL"}],
        "max_offload_tokens": 1024,
        "remote_kv_source": {"kv_request_id": "id1", "remote_host": "10.0.0.2", "remote_port": 5711},
    }
    assert legs.final.stream


def test_p2p_disaggregated_with_source() -> None:
    plan = RoutePlan("a", "b", kv_source="c")
    legs = build_legs(BODY, plan, WORKERS, protocol="p2p", request_id="r", id_factory=counter_factory())
    assert legs.prefill is not None and legs.final is not None
    pre, dec = legs.prefill.body, legs.final.body
    assert pre["kv_transfer_params"]["remote_decoder"] == {"kv_request_id": "id1"}
    assert pre["kv_transfer_params"]["remote_kv_source"]["remote_host"] == "10.0.0.3"
    assert dec["kv_transfer_params"] == {
        "remote_prefiller": {"kv_request_id": "id1", "remote_host": "10.0.0.1", "remote_port": 5710}
    }
    assert pre["stream"] is False and pre["max_tokens"] == 1 and "stream_options" not in pre
    assert dec["stream"] is True and dec["max_tokens"] == 50
    assert legs.prefill.headers == legs.final.headers


def test_p2p_peer_without_endpoint_is_refused() -> None:
    with pytest.raises(KVParamsError, match="no P2P endpoint"):
        build_legs(BODY, RoutePlan("a", "a", kv_source="nop2p"), WORKERS, protocol="p2p", request_id="r")
    with pytest.raises(KVParamsError, match="unknown worker"):
        build_legs(BODY, RoutePlan("a", "a", kv_source="evil"), WORKERS, protocol="p2p", request_id="r")


def test_nixl_two_leg_flow() -> None:
    legs = build_legs(BODY, RoutePlan("a", "b"), WORKERS, protocol="nixl", request_id="req-9")
    assert legs.prefill is not None and legs.final is None
    pre = legs.prefill.body
    assert pre["stream"] is False and pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert "stream_options" not in pre and "min_tokens" not in pre
    assert pre["kv_transfer_params"] == NIXL_PREFILL_PARAMS
    answer = {
        "choices": [],
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "remote_block_ids": [1, 2],
            "remote_engine_id": "e",
            "remote_host": "10.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        },
    }
    dec = legs.decode_leg(answer)
    assert dec.worker_id == "b" and dec.stream and dec.body["max_tokens"] == 50
    assert dec.body["kv_transfer_params"] == answer["kv_transfer_params"]
    assert dec.headers == {REQUEST_ID_HEADER: "req-9"} == legs.prefill.headers
    with pytest.raises(KVParamsError, match="no kv_transfer_params"):
        legs.decode_leg({"choices": []})
    fallback = legs.fallback_leg()
    assert fallback.worker_id == "b" and "kv_transfer_params" not in fallback.body


def test_nixl_conversation_reuse_on_the_prefill_leg() -> None:
    stored = {
        "do_remote_prefill": True,
        "remote_block_ids": [7],
        "remote_engine_id": "dec",
        "remote_host": "10.0.0.2",
        "remote_port": 5601,
    }
    plan = RoutePlan("a", "b", reuse_conversation=True)
    legs = build_legs(BODY, plan, WORKERS, protocol="nixl", request_id="r", conversation_params=stored)
    assert legs.prefill is not None
    params = legs.prefill.body["kv_transfer_params"]
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_host"] == "10.0.0.2" and params["remote_block_ids"] == [7]
    plain = build_legs(BODY, RoutePlan("a", "b"), WORKERS, protocol="nixl", request_id="r", conversation_params=stored)
    assert plain.prefill is not None and plain.prefill.body["kv_transfer_params"] == NIXL_PREFILL_PARAMS


def test_conversation_params_only_from_non_streamed_answers() -> None:
    params = {"remote_block_ids": [1], "remote_host": "h"}
    assert conversation_params_from_response({"kv_transfer_params": params}) == params
    assert conversation_params_from_response({"choices": []}) is None
    assert conversation_params_from_response(b"data: {...}") is None
    assert conversation_params_from_response({"kv_transfer_params": {"remote_kv_source": {}}}) is None


@pytest.mark.parametrize(
    "params",
    [
        {
            "remote_decoder": {"kv_request_id": "x"},
            "remote_prefiller": {"kv_request_id": "x", "remote_host": "h", "remote_port": 1},
        },
        {
            "remote_prefiller": {"kv_request_id": "x", "remote_host": "h", "remote_port": 1},
            "remote_kv_source": {"kv_request_id": "y", "remote_host": "h", "remote_port": 1},
        },
        {"remote_kv_source": {"kv_request_id": "y", "remote_host": "h", "remote_port": 70000}},
        {"remote_decoder": {}},
        {"remote_decoder": {"kv_request_id": "x"}, "do_remote_decode": True},
        {"do_remote_decode": True, "do_remote_prefill": True},
        {"max_offload_tokens": -1},
        {"kv_load_tiers": [{"medium": "GPU", "locality": "LOCAL"}]},
    ],
)
def test_forbidden_combinations_are_refused(params: dict[str, object]) -> None:
    with pytest.raises(KVParamsError):
        check_kv_transfer_params(params)


def test_the_one_allowed_pair() -> None:
    source = {"kv_request_id": "y", "remote_host": "h", "remote_port": 1}
    check_kv_transfer_params({"remote_decoder": {"kv_request_id": "x"}, "remote_kv_source": source})
