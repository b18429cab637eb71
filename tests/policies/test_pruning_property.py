"""Property: pruning in choose() never changes the decision nor the best candidates explain() lists."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.indexer.backend import WorkerMatch
from kvroute.policies import create_policy
from kvroute.policies.base import NoWorkerError, RouteRequest, WorkerView


@settings(max_examples=150, deadline=None)
@given(data=st.data(), protocol=st.sampled_from(["none", "p2p", "nixl"]), n=st.integers(1, 12))
def test_choose_equals_the_head_of_explain(data: st.DataObject, protocol: str, n: int) -> None:
    ws = [
        WorkerView(
            id=f"w{i}",
            role=data.draw(st.sampled_from(["both", "both", "prefill", "decode"])),
            inflight=data.draw(st.integers(0, 20)),
            kv_usage=data.draw(st.floats(0, 1)),
            p2p_host=f"h{i}",
            p2p_port=5710,
        )
        for i in range(n)
    ]
    matches = {}
    for w in ws:
        gpu, cpu = data.draw(st.integers(0, 300)), data.draw(st.integers(0, 300))
        if gpu + cpu:
            matches[w.id] = WorkerMatch(w.id, blocks=gpu + cpu, gpu=gpu, cpu=cpu)
    req = RouteRequest(
        request_id="r",
        model="m",
        prompt_tokens=data.draw(st.integers(1, 12000)),
        block_size=16,
        matches=matches,
        conversation_reusable_tokens=data.draw(st.integers(0, 12000)),
        conversation_worker=data.draw(st.sampled_from([w.id for w in ws])),
    )
    policy = create_policy("kvaware", kv_protocol=protocol, explain_limit=3)
    try:
        full = policy.explain(req, ws)
    except NoWorkerError:
        return
    plan = policy.choose(req, ws)
    assert (plan.prefill, plan.decode, plan.kv_source, plan.reuse_conversation) == (
        full.prefill,
        full.decode,
        full.kv_source,
        full.reuse_conversation,
    )
    assert [c.score for c in plan.candidates] == [c.score for c in full.candidates[:3]]
