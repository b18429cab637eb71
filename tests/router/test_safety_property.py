"""Property: whatever the plan, workers or client body, no forbidden kv_transfer_params leaves the router."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvroute.indexer.backend import WorkerMatch
from kvroute.policies import create_policy
from kvroute.policies.base import NoWorkerError, RoutePlan, RouteRequest, WorkerView
from kvroute.router.kv_params import (
    ALLOWED_P2P_SETS,
    P2P_KEYS,
    KVParamsError,
    build_legs,
    check_kv_transfer_params,
    sanitize_client_body,
)

ROLES = st.sampled_from(["both", "prefill", "decode"])
PROTOCOLS = st.sampled_from(["none", "p2p", "nixl"])
CLIENT_PARAMS = st.dictionaries(
    st.sampled_from([*P2P_KEYS, "remote_host", "remote_port", "do_remote_decode", "kv_load_tiers", "other"]),
    st.one_of(st.none(), st.integers(), st.text(max_size=5), st.just({"remote_host": "evil", "remote_port": 1})),
    max_size=4,
)


@st.composite
def worker_sets(draw: st.DrawFn) -> list[WorkerView]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        has_p2p = draw(st.booleans())
        out.append(
            WorkerView(
                id=f"w{i}",
                role=draw(ROLES),
                healthy=draw(st.booleans()) or i == 0,
                inflight=draw(st.integers(0, 50)),
                kv_usage=draw(st.floats(0, 1)),
                p2p_host=f"10.0.0.{i}" if has_p2p else None,
                p2p_port=5710 + i if has_p2p else None,
            )
        )
    return out


@st.composite
def matches(draw: st.DrawFn, ids: list[str]) -> dict[str, WorkerMatch]:
    out = {}
    for wid in draw(st.lists(st.sampled_from(ids), unique=True)):
        gpu, cpu, storage = draw(st.integers(0, 500)), draw(st.integers(0, 500)), draw(st.integers(0, 500))
        blocks = gpu + cpu + storage
        out[wid] = WorkerMatch(
            wid, blocks=blocks, gpu=gpu, cpu=cpu, storage=storage, remote=draw(st.integers(0, blocks))
        )
    return out


def assert_legal(flow_legs: list[dict[str, object]]) -> None:
    for body in flow_legs:
        params = body.get("kv_transfer_params")
        if params is None:
            continue
        assert isinstance(params, dict)
        check_kv_transfer_params(params)
        assert frozenset(k for k in P2P_KEYS if k in params) in ALLOWED_P2P_SETS
        for key in ("remote_prefiller", "remote_kv_source"):
            if key in params:
                assert params[key]["remote_host"] != "evil"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), protocol=PROTOCOLS, client=CLIENT_PARAMS)
def test_kvaware_plans_never_produce_forbidden_params(
    data: st.DataObject, protocol: str, client: dict[str, object]
) -> None:
    ws = data.draw(worker_sets())
    req = RouteRequest(
        request_id="r",
        model="m",
        prompt_tokens=data.draw(st.integers(0, 40000)),
        block_size=16,
        matches=data.draw(matches([w.id for w in ws])),
        latency_class=data.draw(st.sampled_from(["interactive", "batch", "standard", "odd"])),
        conversation_reusable_tokens=data.draw(st.integers(0, 30000)),
        conversation_worker=data.draw(st.one_of(st.none(), st.sampled_from([w.id for w in ws]))),
        shared_prefix_tokens=data.draw(st.one_of(st.none(), st.integers(0, 40000))),
    )
    policy = create_policy("kvaware", kv_protocol=protocol)
    try:
        plan = policy.choose(req, ws)
    except NoWorkerError:
        return
    raw = {"model": "m", "prompt": "x", "stream": True, "kv_transfer_params": client}
    body, _ = sanitize_client_body(raw)
    by_id = {w.id: w for w in ws}
    stored = {"remote_host": "10.9.9.9", "remote_block_ids": [1], "remote_kv_source": {"x": 1}}
    # A plan from the policy is always one the pool's protocol can carry.
    legs = build_legs(
        body,
        plan,
        by_id,
        protocol=protocol,
        request_id="r",  # type: ignore[arg-type]
        conversation_params=stored,
    )
    bodies = [leg.body for leg in (legs.prefill, legs.final) if leg is not None]
    if legs.final is None:
        answer = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h"}}
        bodies.append(legs.decode_leg(answer).body)
    bodies.append(legs.fallback_leg().body)
    assert_legal(bodies)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), protocol=PROTOCOLS)
def test_random_plans_never_produce_forbidden_params(data: st.DataObject, protocol: str) -> None:
    ws = data.draw(worker_sets())
    ids = [w.id for w in ws] + ["ghost"]
    plan = RoutePlan(
        prefill=data.draw(st.sampled_from(ids)),
        decode=data.draw(st.sampled_from(ids)),
        kv_source=data.draw(st.one_of(st.none(), st.sampled_from(ids))),
        reuse_conversation=data.draw(st.booleans()),
        max_offload_tokens=data.draw(st.one_of(st.none(), st.integers(0, 10000))),
    )
    try:
        legs = build_legs(
            {"model": "m", "prompt": "x"},
            plan,
            {w.id: w for w in ws},
            protocol=protocol,
            request_id="r",  # type: ignore[arg-type]
            conversation_params={"remote_host": "h"},
        )
    except KVParamsError:
        return
    bodies = [leg.body for leg in (legs.prefill, legs.final) if leg is not None]
    assert_legal(bodies)
