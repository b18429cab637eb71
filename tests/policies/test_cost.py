"""The kvaware cost model on synthetic views: affinity, load, P2P, tiers, P/D, conversation reuse."""

from __future__ import annotations

import dataclasses
import math

import pytest
from kvroute.indexer.backend import WorkerMatch
from kvroute.policies import create_policy
from kvroute.policies.base import NoWorkerError, PoolContext, RouteOutcome, RoutePlan, WorkerView
from kvroute.policies.cost import KvAwarePolicy, usable_run

from tests.policies.util import gpu, request, workers


def kvaware(**options: object) -> KvAwarePolicy:
    policy = create_policy("kvaware", **options)
    assert isinstance(policy, KvAwarePolicy)
    return policy


def test_prefers_the_worker_holding_the_prefix_when_loads_are_equal() -> None:
    plan = kvaware().choose(request(8000, gpu("w2", 400)), workers(4))
    assert (plan.prefill, plan.decode, plan.kv_source) == ("w2", "w2", None)
    assert plan.predicted_cached_tokens == 6400
    assert plan.predicted_by_tier == {"GPU": 6400}
    assert plan.predicted_ttft_s == pytest.approx(plan.breakdown["total_s"])
    assert plan.policy == "kvaware"


def test_load_overrides_affinity() -> None:
    ws = workers(4)
    ws[2] = dataclasses.replace(ws[2], inflight=40)
    plan = kvaware().choose(request(8000, gpu("w2", 400)), ws)
    assert plan.prefill != "w2"
    assert "load overrides affinity" in plan.why()


def test_no_hot_spot_on_a_popular_prefix() -> None:
    """Every request shares one prefix held by w0; the queue there soon costs more than recomputing."""
    policy = kvaware()
    ws = {w.id: w for w in workers(4)}
    counts = {wid: 0 for wid in ws}
    for _ in range(40):
        plan = policy.choose(request(4000, gpu("w0", 200)), list(ws.values()))
        counts[plan.prefill] += 1
        w = ws[plan.prefill]
        ws[plan.prefill] = dataclasses.replace(w, inflight=w.inflight + 1)
    assert counts["w0"] < 40
    assert sum(1 for n in counts.values() if n > 0) >= 3


def test_a_new_prefix_goes_to_the_worker_that_drew_the_least_traffic_lately() -> None:
    """Idle workers tie on a prefix nobody holds; the one the last requests went to is not where the next
    popular prefix should land, whatever the in-flight count of the moment says."""
    clock = [0.0]
    policy = kvaware(now=lambda: clock[0], traffic_window_s=30.0)
    ws = workers(2)
    for i in range(3):  # w0's prefix draws three requests, answered by the time the next prefix arrives
        clock[0] += 1.0
        plan = policy.choose(request(4000, gpu("w0", 200), request_id=f"a{i}"), ws)
        assert plan.prefill == "w0"
        policy.observe(RouteOutcome(f"a{i}", "m", plan, prompt_tokens=4000, cached_tokens=3200, ttft_s=0.1))
    clock[0] += 10.0
    fresh = policy.choose(request(4000, request_id="b"), ws)
    assert fresh.prefill == "w1"  # before, the tie went by in-flight count (equal), then by id: w0
    assert policy.queue.traffic("w0", clock[0]) == pytest.approx(3 * math.exp(-11 / 30), rel=0.05)
    assert policy.queue.traffic("w1", clock[0]) == 1.0
    assert policy.queue.traffic("w0", clock[0] + 600) < 1e-8  # twenty windows later: forgotten


def test_traffic_counted_by_blocks_spreads_new_prefixes_by_the_cache_space_they_take() -> None:
    """One long prompt on w0 against three short ones on w1: by requests w1 drew more, by the KV blocks
    they added w0 did, and the next new prefix goes where it evicts the least."""
    for share, expected in ((0.0, "w0"), (1.0, "w1")):
        clock = [0.0]
        policy = kvaware(now=lambda c=clock: c[0], traffic_blocks_share=share)
        ws = workers(2)
        sent = [("long", 8000, "w0")] + [(f"short{i}", 64, "w1") for i in range(3)]
        for rid, tokens, holder in sent:  # each lands where its prefix is, answered before the next
            clock[0] += 1.0
            plan = policy.choose(request(tokens, gpu(holder, 1), request_id=rid), ws)
            assert plan.prefill == holder
            policy.observe(RouteOutcome(rid, "m", plan, prompt_tokens=tokens, cached_tokens=16, ttft_s=0.01))
        clock[0] += 1.0
        assert policy.choose(request(2000, request_id="fresh"), ws).prefill == expected
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="traffic_blocks_share"):
            kvaware(traffic_blocks_share=bad)


def test_p2p_source_when_fetching_beats_recomputing() -> None:
    ws = workers(2)
    ws[1] = dataclasses.replace(ws[1], inflight=20)  # the holder is busy
    plan = kvaware(kv_protocol="p2p").choose(request(32000, gpu("w1", 1900)), ws)
    assert (plan.prefill, plan.kv_source) == ("w0", "w1")
    assert plan.predicted_by_tier == {"REMOTE": 30400}
    assert plan.breakdown["lookup_s"] > 0 and plan.breakdown["transfer_s"] > 0
    # An interactive request reads no secondary tier on its own, but vLLM reads a named peer only when
    # the REMOTE tier is allowed: the plan allows it for this request.
    assert plan.kv_load_tiers == [{"medium": "CPU", "locality": "REMOTE"}] and plan.max_offload_tokens is None


def test_no_p2p_source_for_blocks_the_holder_is_still_computing() -> None:
    """Routed there and not answered yet: a local hit for a request queued behind it, no source for a peer."""
    ws = workers(2)
    ws[1] = dataclasses.replace(ws[1], inflight=20)
    computing = dataclasses.replace(gpu("w1", 1900), pending=1900)
    plan = kvaware(kv_protocol="p2p").choose(request(32000, computing), ws)
    assert plan.kv_source is None
    most = dataclasses.replace(gpu("w1", 1900), pending=300)  # the first 1600 blocks are there: fetched
    plan = kvaware(kv_protocol="p2p").choose(request(32000, most), ws)
    assert (plan.prefill, plan.kv_source) == ("w0", "w1")
    assert plan.predicted_by_tier == {"REMOTE": 1600 * 16}


def test_no_p2p_source_when_the_tier_policy_forbids_planned_sources() -> None:
    ws = workers(2)
    ws[1] = dataclasses.replace(ws[1], inflight=20)
    policy = kvaware(kv_protocol="p2p", tier_policy={"planned_sources": False})
    plan = policy.choose(request(32000, gpu("w1", 1900)), ws)
    assert plan.kv_source is None and plan.kv_load_tiers == []
    batch = policy.choose(dataclasses.replace(request(32000, gpu("w1", 1900)), latency_class="batch"), ws)
    assert batch.kv_source == "w1"
    assert {"medium": "CPU", "locality": "REMOTE"} in (batch.kv_load_tiers or [])


def test_no_p2p_source_over_a_slow_link() -> None:
    ws = workers(2)
    # 8 s of queue: recomputing (3.2 s, ranked 6.2 s with the affinity penalty) is cheaper
    ws[1] = dataclasses.replace(ws[1], inflight=80)
    policy = kvaware(kv_protocol="p2p", default_bandwidth_bytes_per_s=1e6)
    plan = policy.choose(request(32000, gpu("w1", 1900)), ws)
    assert plan.prefill == "w0" and plan.kv_source is None


def test_no_p2p_without_the_protocol_or_a_peer_endpoint() -> None:
    ws = workers(2)
    ws[1] = dataclasses.replace(ws[1], inflight=20)
    assert kvaware().choose(request(32000, gpu("w1", 1900)), ws).kv_source is None
    ws[1] = dataclasses.replace(ws[1], p2p_host=None)
    assert kvaware(kv_protocol="p2p").choose(request(32000, gpu("w1", 1900)), ws).kv_source is None


def test_local_cpu_tier_beats_a_remote_peer() -> None:
    ws = workers(2)
    ws[1] = dataclasses.replace(ws[1], inflight=20)
    local = WorkerMatch("w0", blocks=500, cpu=500)
    plan = kvaware(kv_protocol="p2p").choose(request(8100, local, gpu("w1", 500)), ws)
    assert plan.prefill == "w0" and plan.kv_source is None
    assert plan.predicted_by_tier == {"CPU": 8000}
    assert plan.breakdown["promotion_s"] > 0


def test_tier_policy_latency_class_limits_what_counts_as_cached() -> None:
    ws = workers(1)
    storage_only = WorkerMatch("w0", blocks=100, storage=100)
    policy = kvaware(kv_protocol="p2p")
    interactive = policy.choose(request(3200, storage_only), ws)
    batch = policy.choose(request(3200, storage_only, latency_class="batch"), ws)
    assert interactive.predicted_cached_tokens == 0 and interactive.kv_load_tiers == []
    assert batch.predicted_cached_tokens == 1600 and batch.predicted_by_tier == {"STORAGE": 1600}
    assert {"medium": "STORAGE", "locality": "LOCAL"} in (batch.kv_load_tiers or [])


def test_max_offload_tokens_covers_the_shared_prefix_only() -> None:
    plan = kvaware(kv_protocol="p2p").choose(request(5000, shared_prefix_tokens=1000), workers(2))
    assert plan.max_offload_tokens == 992  # whole blocks of 16


def test_remote_only_blocks_need_a_remote_tier() -> None:
    m = WorkerMatch("w0", blocks=10, gpu=4, cpu=6, remote=6)
    assert usable_run(m, allow_storage=True, allow_remote=False).blocks == 4
    assert usable_run(m, allow_storage=True, allow_remote=True).blocks == 10


def test_pd_pool_splits_long_prompts_and_skips_prefill_for_short_ones() -> None:
    ws = workers(2, role="prefill", prefix="p") + workers(2, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl")
    long = policy.choose(request(16000), ws)
    assert long.prefill.startswith("p") and long.decode.startswith("d")
    assert long.breakdown["handoff_s"] > 0
    short = policy.choose(request(200), ws)
    assert short.prefill == short.decode and short.decode.startswith("d")


def test_pd_pool_strict_roles_split_above_the_threshold() -> None:
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl", pd_split_threshold_tokens=256, pd_local_prefill=False)
    plan = policy.choose(request(16000, gpu("d0", 990)), ws)  # 160 uncached at d0
    assert (plan.prefill, plan.decode) == ("d0", "d0")
    plan = policy.choose(request(16000, gpu("d0", 900)), ws)  # 1600 uncached: strict roles split
    assert (plan.prefill, plan.decode) == ("p0", "d0")


def test_pd_pool_decoder_holding_most_of_the_prompt_prefills_the_rest_itself() -> None:
    """Conditional disaggregation: 1,600 uncached tokens on the decoder beat 16,000 on the empty prefiller."""
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl", pd_split_threshold_tokens=256)
    plan = policy.choose(request(16000, gpu("d0", 900)), ws)
    assert (plan.prefill, plan.decode) == ("d0", "d0")
    assert "prefill busy" in plan.why() or "prefills locally" in plan.why()


def test_pd_pool_decoders_take_prefills_only_when_the_prefill_workers_are_backed_up() -> None:
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d", running=4)
    idle = kvaware(kv_protocol="nixl").choose(request(16000), ws)
    assert (idle.prefill, idle.decode) == ("p0", "d0")  # the decodes running on d0 would stall
    backed_up = workers(1, role="prefill", prefix="p", waiting=40) + ws[1:]
    busy = kvaware(kv_protocol="nixl").choose(request(16000), backed_up)
    assert (busy.prefill, busy.decode) == ("d0", "d0")
    strict = kvaware(kv_protocol="nixl", pd_local_prefill=False).choose(request(16000), backed_up)
    assert (strict.prefill, strict.decode) == ("p0", "d0")
    no_stall_cost = kvaware(kv_protocol="nixl", decode_stall_weight=0).choose(request(16000), ws)
    assert no_stall_cost.prefill == "d0"  # pure TTFT: the handoff is saved


def test_pd_decode_legs_in_flight_are_running_decodes_not_prefills_ahead() -> None:
    """A decoder holding all but 150 tokens of a prompt (under the split threshold) with 12 P/D decode legs
    in flight from the router: those are decodes, so its own short prefill beats prefill + handoff on the
    prefill worker. Counted as 12 prefills waiting (as they were), the plan went P/D every time."""
    decoders = workers(1, role="decode", prefix="d", inflight=12, running=12)
    ws = workers(1, role="prefill", prefix="p") + decoders
    plan = kvaware(kv_protocol="nixl").choose(request(900, gpu("p0", 47), gpu("d0", 47)), ws)
    assert (plan.prefill, plan.decode) == ("d0", "d0")
    # The prefill side is not changed by it: a prefill worker's in-flight requests are prefills.
    busy = workers(1, role="prefill", prefix="p", inflight=12) + workers(1, role="decode", prefix="d")
    explained = kvaware(kv_protocol="nixl").explain(request(16000), busy)
    on_p0 = next(c for c in explained.candidates if c.prefill == "p0")
    assert on_p0.breakdown["queue_s"] > 0.1  # twelve prefills ahead


def test_pd_handoff_waits_for_a_decoder_busy_with_its_own_prefill() -> None:
    """A decoder that was just sent a long prefill of its own takes the next handoff only after it: the
    plan goes to the other decoder, and a plan on the busy one shows the wait beyond the prefill side."""
    clock = [0.0]
    ws = workers(1, role="prefill", prefix="p") + workers(2, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl", now=lambda: clock[0], calibrate=False)
    local = policy.choose(request(200, gpu("d0", 12), request_id="short"), ws)  # a short tail: d0 prefills it
    assert (local.prefill, local.decode) == ("d0", "d0")
    policy.queue.sent("d0", "long-local", service_s=3.0, blocks=10)  # then a long one of its own
    ws[1] = dataclasses.replace(ws[1], inflight=2)
    plan = policy.choose(request(16000, request_id="r"), ws)
    assert (plan.prefill, plan.decode) == ("p0", "d1")
    explained = policy.explain(request(16000, request_id="x"), ws)
    on_d0 = next(c for c in explained.candidates if c.prefill == "p0" and c.decode == "d0")
    prefill_side = sum(on_d0.breakdown[t] for t in ("queue_s", "prefill_s", "handoff_s"))
    assert on_d0.breakdown["decode_queue_s"] == pytest.approx(
        3.0 + local.breakdown["prefill_s"] - prefill_side, rel=0.05
    )
    # Before the decoder's own queue counted, it was its in-flight count x a decode step: 2 ms.
    assert on_d0.breakdown["decode_queue_s"] > 100 * 2 * 0.001


def test_a_decoder_prefilling_itself_holds_the_handoffs_due_there() -> None:
    """A split plan's KV reaches its decoder when its prefill leg ends; a long prefill that decoder runs
    itself meanwhile holds that request's first token until it ends. The hold counts against the local
    plan: the next prompt goes to the other decoder holding nearly as much of it, and back once the
    handoff is no longer due (its outcome came, or its time passed)."""
    clock = [0.0]
    ws = workers(1, role="prefill", prefix="p") + workers(2, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl", now=lambda: clock[0], calibrate=False)
    split = policy.choose(request(2000, request_id="split"), ws)
    assert split.prefill == "p0" and split.decode in ("d0", "d1")
    due_in = split.breakdown["total_s"] - split.breakdown["decode_queue_s"]
    holder, other = split.decode, ("d1" if split.decode == "d0" else "d0")
    prompt = request(16000, gpu(holder, 700), gpu(other, 690), request_id="long")  # 4,800 / 4,960 uncached
    plan = policy.explain(prompt, ws)
    assert (plan.prefill, plan.decode) == (other, other)
    on_holder = next(c for c in plan.candidates if c.prefill == holder)
    ends = on_holder.breakdown["queue_s"] + on_holder.breakdown["prefill_s"]
    assert on_holder.breakdown["handoffs_held_s"] == pytest.approx(ends - due_in)
    assert on_holder.score >= on_holder.breakdown["total_s"] + on_holder.breakdown["handoffs_held_s"]
    assert "holds 1 handoff(s)" in on_holder.note
    outcome = RouteOutcome("split", "m", split, prompt_tokens=2000, cached_tokens=0, ttft_s=0.3)
    policy.observe(outcome)
    assert policy.explain(prompt, ws).prefill == holder  # its outcome came: nothing held any more
    second = policy.choose(request(2000, request_id="split2"), ws)
    elsewhere = "d1" if second.decode == "d0" else "d0"
    later = request(16000, gpu(second.decode, 700), gpu(elsewhere, 690), request_id="later")
    assert policy.explain(later, ws).prefill == elsewhere
    clock[0] += 10.0  # past its predicted arrival: at the decoder (its load counts it) or late
    assert policy.explain(later, ws).prefill == second.decode


def test_pd_pool_prefill_workers_serve_whole_requests_only_when_allowed() -> None:
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d", running=8)
    held = request(16000, gpu("p0", 990))  # the prefill worker holds the prompt; the decoder is busy
    plan = kvaware(kv_protocol="nixl").choose(held, ws)
    assert (plan.prefill, plan.decode) == ("p0", "d0")  # roles kept: the prompt is handed off
    whole = kvaware(kv_protocol="nixl", pd_prefill_decodes=True).choose(held, ws)
    assert (whole.prefill, whole.decode) == ("p0", "p0") and whole.breakdown["handoff_s"] == 0
    with pytest.raises(ValueError):
        kvaware(pd_prefill_decodes="yes")


def test_conversation_reuse_needs_enough_reusable_tokens() -> None:
    ws = workers(2, role="prefill", prefix="p") + workers(2, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl")
    plan = policy.choose(request(24000, conversation_reusable_tokens=23000, conversation_worker="d1"), ws)
    assert plan.reuse_conversation and plan.prefill.startswith("p")
    assert plan.predicted_by_tier == {"REMOTE": 23000}
    few = policy.choose(request(24000, conversation_reusable_tokens=32, conversation_worker="d1"), ws)
    assert not few.reuse_conversation
    gone = policy.choose(request(24000, conversation_reusable_tokens=23000, conversation_worker="d9"), ws)
    assert not gone.reuse_conversation


def test_descriptor_cost_can_make_recomputing_beat_reuse() -> None:
    """NIXL posts layers x 2 descriptors per block: on a link where that dominates (0.5 ms per block here),
    pulling 23k tokens (1437 blocks, ~0.8 s) loses to recomputing 24k tokens (~0.6 s)."""
    ws = workers(2, role="prefill", prefix="p") + workers(2, role="decode", prefix="d")
    figures = {"prefill_tokens_per_s": 50_700.0, "attention_coeff_s": 4.37e-7, "bytes_per_token": 262_144}
    conv = {"conversation_reusable_tokens": 23000, "conversation_worker": "d1"}
    cheap = kvaware(
        kv_protocol="nixl",
        default_bandwidth_bytes_per_s=76.8e9,
        transfer_setup_s=0.0125,
        models={"m": {**figures, "transfer_per_block_s": 0.0}},
    )
    plan = cheap.choose(request(24000, **conv), ws)
    assert plan.reuse_conversation
    costly = kvaware(
        kv_protocol="nixl",
        default_bandwidth_bytes_per_s=76.8e9,
        transfer_setup_s=0.0125,
        models={"m": {**figures, "transfer_per_block_s": 0.0005}},
    )
    plan = costly.choose(request(24000, **conv), ws)
    assert not plan.reuse_conversation
    reuse = next(c for c in costly.explain(request(24000, **conv), ws).candidates if c.breakdown["reuse_conversation"])
    assert reuse.breakdown["transfer_s"] == pytest.approx(
        0.0125 + 23000 / 16 * 0.0005 + 23000 * 262_144 / 76.8e9, rel=0.15
    )  # times the still-there probability


def test_pool_link_figures_reach_the_cost_model_unless_set_explicitly() -> None:
    pool = PoolContext(kv_protocol="p2p", link_bytes_per_s=200e9, transfer_setup_s=0.003)
    policy = KvAwarePolicy.for_pool(pool)
    assert (policy.params.default_bandwidth_bytes_per_s, policy.params.transfer_setup_s) == (200e9, 0.003)
    explicit = KvAwarePolicy.for_pool(pool, default_bandwidth_bytes_per_s=5e9)
    assert explicit.params.default_bandwidth_bytes_per_s == 5e9
    assert KvAwarePolicy.for_pool(PoolContext()).params.transfer_setup_s == 0.0


def test_a_full_kv_cache_sends_a_long_turn_elsewhere() -> None:
    """The holder's cache is full of other requests: admitting 800 new blocks means waiting for half its
    requests to finish (hold 2 s x 800/1000 = 1.6 s), more than recomputing the held 3200 tokens."""
    req = request(16000, gpu("w0", 200))
    ws = [dataclasses.replace(w, kv_blocks=1000) for w in workers(2)]
    ws[0] = dataclasses.replace(ws[0], kv_usage=1.0)
    plan = kvaware().choose(req, ws)
    assert plan.prefill == "w1"
    holder = next(c for c in kvaware().explain(req, ws).candidates if c.prefill == "w0")
    assert holder.breakdown["kv_space_wait_s"] == pytest.approx(2.0 * 800 / 1000)
    assert holder.breakdown["queue_s"] >= holder.breakdown["kv_space_wait_s"]
    # Free space, or a worker that does not report its cache size: the holder keeps the session.
    assert kvaware().choose(req, [dataclasses.replace(ws[0], kv_usage=0.1), ws[1]]).prefill == "w0"
    assert kvaware().choose(req, [dataclasses.replace(ws[0], kv_blocks=None), ws[1]]).prefill == "w0"


def test_own_outstanding_requests_count_before_the_scrape_shows_them() -> None:
    clock = [0.0]
    policy = kvaware(now=lambda: clock[0])
    ws = [dataclasses.replace(w, kv_blocks=1000) for w in workers(1)]
    first = policy.choose(request(12000, request_id="a"), ws)  # 750 blocks, scraped usage still 0
    assert first.breakdown["kv_space_wait_s"] == 0.0
    ws = [dataclasses.replace(ws[0], inflight=1)]
    second = policy.explain(request(12000, request_id="b"), ws).candidates[0]
    assert second.breakdown["kv_space_wait_s"] == pytest.approx(2.0 * 500 / 750)
    clock[0] = 4.0  # the first request finishes after 4 s: that is how long requests hold blocks here
    policy.observe(RouteOutcome("a", "m", first, prompt_tokens=12000, cached_tokens=0, ttft_s=1.0))
    ws = [dataclasses.replace(ws[0], inflight=0, kv_usage=0.75)]  # another client's 750 blocks
    third = policy.explain(request(12000, request_id="c"), ws).candidates[0]
    assert third.breakdown["kv_space_wait_s"] == pytest.approx(4.0 * 500 / 750)


def test_nearly_full_kv_cache_makes_gpu_hits_less_likely() -> None:
    ws = workers(2)
    ws[0] = dataclasses.replace(ws[0], kv_usage=1.0)
    plan = kvaware().choose(request(8000, gpu("w0", 400), gpu("w1", 400)), ws)
    assert plan.prefill == "w1"


def test_attention_term_makes_long_contexts_cost_more() -> None:
    flat = kvaware().choose(request(32000), workers(1))
    quadratic = kvaware(attention_coeff_s=1e-5).choose(request(32000), workers(1))
    assert quadratic.breakdown["prefill_s"] > flat.breakdown["prefill_s"]


def test_per_model_parameters() -> None:
    policy = kvaware(models={"m": {"prefill_tokens_per_s": 1000.0}})
    assert policy.choose(request(1000), workers(1)).breakdown["prefill_s"] == pytest.approx(1.0)


def test_explain_lists_every_candidate_with_a_breakdown_best_first() -> None:
    plan = kvaware(kv_protocol="p2p").choose(request(8000, gpu("w1", 100)), workers(3))
    assert plan.candidates and plan.candidates[0].prefill == plan.prefill
    scores = [c.score for c in plan.candidates]
    assert scores == sorted(scores)
    for c in plan.candidates:
        terms = {"queue_s", "lookup_s", "transfer_s", "promotion_s", "prefill_s", "handoff_s", "total_s"}
        assert terms <= set(c.breakdown)
    explained = plan.to_dict()
    assert explained["candidates"][0]["breakdown"]["total_s"] == pytest.approx(plan.predicted_ttft_s)


def test_cached_tokens_never_reach_the_whole_prompt() -> None:
    """vLLM reuses (len - 1) // block_size whole blocks: a fully cached 1600-token prompt (100 blocks of 16)
    is served 99 blocks from cache, the last one recomputed (it holds the last prompt token)."""
    plan = kvaware().choose(request(1600, gpu("w0", 100)), workers(1))
    assert plan.predicted_cached_tokens == 1584
    plan = kvaware().choose(request(1601, gpu("w0", 100)), workers(1))
    assert plan.predicted_cached_tokens == 1600  # one token more: all 100 blocks are reusable


def test_unhealthy_and_missing_workers() -> None:
    with pytest.raises(NoWorkerError):
        kvaware().choose(request(100), [])
    with pytest.raises(NoWorkerError):
        kvaware().choose(request(100), [WorkerView(id="x", healthy=False)])
    with pytest.raises(NoWorkerError):
        kvaware().choose(request(100), workers(2, role="prefill"))


@pytest.mark.parametrize(
    "options",
    [
        {"no_such_option": 1},
        {"prefill_tokens_per_s": 0},
        {"kv_protocol": "tcp"},
        {"still_there": {"GPU": 2}},
        {"link_bandwidth_bytes_per_s": {"ab": 1.0}},
        {"models": {"m": {"speed": 1}}},
        {"tier_policy": {"x": 1}},
        {"traffic_window_s": 0},
    ],
)
def test_bad_options_are_refused_with_a_clear_error(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        create_policy("kvaware", **options)


def test_calibration_learns_prefill_speed_and_counts_stale_decisions() -> None:
    clock = [0.0]
    policy = kvaware(now=lambda: clock[0])
    req = request(10000, gpu("w0", 100))
    plan = policy.choose(req, workers(1))
    predicted = plan.breakdown["prefill_s"]
    for _ in range(30):  # the engine is twice as slow as configured, and had nothing cached
        policy.observe(RouteOutcome("r1", "m", plan, prompt_tokens=10000, cached_tokens=0, ttft_s=2 * 10000 / 10_000.0))
    again = policy.choose(req, workers(1))
    assert again.breakdown["prefill_s"] > 1.5 * predicted
    fb = policy.feedback
    assert fb.decisions == 30 and fb.stale_decisions == 30
    assert fb.predicted_by_tier["GPU"] == 30 * 1600
    assert policy.stale_rate() == 1.0
    clock[0] = 1000.0
    assert policy.stale_rate() == 0.0  # outside the window
    assert policy.calibrator.hit_ratio < 0.1


def test_hits_the_engines_confirm_count_whole_and_missing_ones_at_their_observed_share() -> None:
    """The still-there priors are a start: a fleet that confirms every hit lifts them to certainty, so a
    nearly whole hit is priced as the prefill of its uncached tail, not of 5 % of the prompt more."""
    policy = kvaware()
    req = request(905, gpu("w0", 56))  # 896 of 905 tokens cached
    first = policy.choose(req, workers(2))
    assert first.breakdown["expected_cached_tokens"] == pytest.approx(0.95 * 896)
    for i in range(40):
        plan = policy.choose(dataclasses.replace(req, request_id=f"r{i}"), workers(2))
        policy.observe(RouteOutcome(f"r{i}", "m", plan, prompt_tokens=905, cached_tokens=896, ttft_s=0.002))
    confirmed = policy.choose(req, workers(2))
    assert confirmed.breakdown["expected_cached_tokens"] == pytest.approx(896, rel=0.01)
    assert confirmed.predicted_ttft_s < first.predicted_ttft_s
    for i in range(60):  # now every other hit has gone: GPU hits weigh about half
        plan = policy.choose(dataclasses.replace(req, request_id=f"m{i}"), workers(2))
        policy.observe(RouteOutcome(f"m{i}", "m", plan, prompt_tokens=905, cached_tokens=896 * (i % 2), ttft_s=0.002))
    halved = policy.choose(req, workers(2)).breakdown["expected_cached_tokens"]
    assert 0.35 * 896 < halved < 0.65 * 896


def test_a_split_answer_does_not_vouch_for_the_prefillers_hit() -> None:
    """A P/D answer is the decoder's: its cached tokens are the KV it pulled, whatever the prefiller had."""
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl")
    plan = policy.choose(request(16000, gpu("p0", 500)), ws)
    assert (plan.prefill, plan.decode) == ("p0", "d0") and plan.predicted_cached_tokens == 8000
    for _ in range(10):
        policy.observe(RouteOutcome("r1", "m", plan, prompt_tokens=16000, cached_tokens=16000, ttft_s=0.5))
    assert policy.calibrator.hit_ratio == 1.0


def split_answer(
    request_id: str, plan: RoutePlan, prompt: int, cached: int, after_leg: float, leg_cached: int | None = None
) -> RouteOutcome:
    """A split plan's outcome whose prefiller answered exactly when predicted, its first token
    ``after_leg`` seconds later; ``cached``: the decode answer's cached tokens."""
    leg = plan.breakdown["queue_s"] + plan.breakdown["prefill_s"]
    return RouteOutcome(
        request_id,
        "m",
        plan,
        prompt_tokens=prompt,
        cached_tokens=cached,
        ttft_s=leg + after_leg,
        prefill_leg_s=leg,
        prefill_leg_cached_tokens=leg_cached,
    )


def test_split_answers_teach_the_handoff_its_real_length() -> None:
    """The decoder answered 30 ms later than the plan's handoff term said (its own step before the first
    token, say), every time: the learnt extra closes the gap; aggregated answers leave it alone."""
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl", pd_local_prefill=False)
    first = policy.choose(request(16000), ws)
    assert (first.prefill, first.decode) == ("p0", "d0")
    configured = first.breakdown["handoff_s"]
    for i in range(40):
        plan = policy.choose(request(16000, request_id=f"r{i}"), ws)
        policy.observe(split_answer(f"r{i}", plan, 16000, cached=0, after_leg=configured + 0.03))
    learnt = policy.choose(request(16000, request_id="after"), ws).breakdown["handoff_s"]
    assert learnt == pytest.approx(configured + 0.03, rel=0.02)
    extra = policy.calibrator.handoff_extra_s("m")
    together = kvaware(kv_protocol="nixl", pd_local_prefill=False)
    together.calibrator = policy.calibrator
    for i in range(10):  # answers of the whole plan on one worker: no handoff to learn from
        plan = together.choose(request(300, request_id=f"a{i}"), workers(1))
        together.observe(RouteOutcome(f"a{i}", "m", plan, prompt_tokens=300, cached_tokens=0, ttft_s=0.5))
    assert policy.calibrator.handoff_extra_s("m") == extra


def test_a_fast_handoff_cannot_learn_a_negative_one() -> None:
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl", pd_local_prefill=False)
    for i in range(60):
        plan = policy.choose(request(16000, request_id=f"r{i}"), ws)
        policy.observe(
            RouteOutcome(f"r{i}", "m", plan, prompt_tokens=16000, cached_tokens=0, ttft_s=1.0, prefill_leg_s=1.0)
        )
    assert policy.choose(request(16000, request_id="after"), ws).breakdown["handoff_s"] == pytest.approx(0.0, abs=1e-6)


def test_the_prefill_speed_of_a_split_plan_is_read_from_its_prefill_leg() -> None:
    """A slow decoder must not make the prefill look slow: the prefiller answered when predicted."""
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl", pd_local_prefill=False)
    before = policy.choose(request(16000), ws).breakdown["prefill_s"]
    for i in range(40):
        plan = policy.choose(request(16000, request_id=f"r{i}"), ws)
        policy.observe(split_answer(f"r{i}", plan, 16000, cached=0, after_leg=0.5))
    assert policy.choose(request(16000, request_id="after"), ws).breakdown["prefill_s"] == pytest.approx(
        before, rel=0.05
    )


def test_the_kv_a_decoder_pulled_is_not_taken_for_the_prefillers_hit() -> None:
    """A split answer's cached tokens count the KV its decoder pulled (all but the last few tokens). Read as
    the prefiller's hit, every fresh split prefill looked a few tokens long yet took its full time, and the
    speed fit, fed whole plans' exact answers too, read that as fixed overhead and a faster rate: split
    prefills then ran ~1.2x their prediction. The prefill leg's own cached tokens are the hit; without
    them, the predicted hit stands in."""
    split_pool = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")
    for leg_reports in (True, False):
        split = kvaware(kv_protocol="nixl", pd_local_prefill=False)
        whole = kvaware()
        whole.calibrator = split.calibrator
        before = split.choose(request(16000), split_pool).breakdown["prefill_s"]
        for i in range(80):
            n = (1000, 2000, 4000, 8000)[i % 4]
            plan = whole.choose(request(n, request_id=f"w{i}"), workers(1))
            whole.observe(
                RouteOutcome(f"w{i}", "m", plan, prompt_tokens=n, cached_tokens=0, ttft_s=plan.breakdown["total_s"])
            )
            plan = split.choose(request(n, request_id=f"s{i}"), split_pool)
            leg_cached = 0 if leg_reports else None
            split.observe(split_answer(f"s{i}", plan, n, n - 13, plan.breakdown["handoff_s"], leg_cached=leg_cached))
        after = split.choose(request(16000, request_id="after"), split_pool).breakdown["prefill_s"]
        assert after == pytest.approx(before, rel=0.05)
        assert split.feedback.stale_decisions == 0


def test_the_prefill_leg_teaches_the_hit_ratio() -> None:
    """The prefiller held a quarter of what the plan counted on: the hit ratio learns it from the leg's own
    cached tokens, not from the decoder's count (which includes the pulled KV, so always looked whole)."""
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")
    policy = kvaware(kv_protocol="nixl", pd_local_prefill=False)
    for i in range(20):
        plan = policy.choose(request(16000, gpu("p0", 500), request_id=f"r{i}"), ws)
        assert plan.prefill == "p0" and plan.predicted_cached_tokens == 8000
        policy.observe(split_answer(f"r{i}", plan, 16000, 15987, plan.breakdown["handoff_s"], leg_cached=2000))
    assert policy.calibrator.hit_ratio < 0.6
    assert policy.feedback.stale_decisions == 20


def test_calibration_can_be_turned_off() -> None:
    policy = kvaware(calibrate=False)
    plan = policy.choose(request(10000), workers(1))
    policy.observe(RouteOutcome("r1", "m", plan, prompt_tokens=10000, cached_tokens=0, ttft_s=50.0))
    assert policy.choose(request(10000), workers(1)).breakdown["prefill_s"] == plan.breakdown["prefill_s"]
    assert policy.feedback.decisions == 0


def test_per_link_bandwidth_changes_the_transfer_term() -> None:
    ws = workers(2)
    ws[1] = dataclasses.replace(ws[1], inflight=20)
    fast = kvaware(kv_protocol="p2p").choose(request(32000, gpu("w1", 1900)), ws)
    assert fast.kv_source == "w1"
    slow_policy = kvaware(kv_protocol="p2p", link_bandwidth_bytes_per_s={"w1->w0": 1e9})
    slow = slow_policy.explain(request(32000, gpu("w1", 1900)), ws)
    assert slow.kv_source is None  # 3.5 s over that link: recomputing is cheaper
    fetch = next(c for c in slow.candidates if c.kv_source == "w1")
    assert fetch.breakdown["transfer_s"] > 10 * fast.breakdown["transfer_s"]


def test_explain_keeps_every_candidate_and_learns_nothing() -> None:
    policy = kvaware(kv_protocol="p2p")
    ws = workers(6)
    req = request(8000, gpu("w1", 100), gpu("w2", 300))
    assert len(policy.choose(req, ws).candidates) == 8
    full = policy.explain(req, ws)
    assert len(full.candidates) > 8 and full.prefill == policy.choose(req, ws).prefill
    assert policy.feedback.decisions == 0


def test_queue_term_replays_the_work_this_policy_sent() -> None:
    """Work this policy sent counts by its predicted remaining time; unknown work by load x service time."""
    clock = [0.0]
    policy = kvaware(now=lambda: clock[0], calibrate=False)
    ws = {w.id: w for w in workers(2)}

    def queue_at_w0(request_id: str) -> float:
        plan = policy.explain(request(20000, gpu("w0", 1250), request_id=request_id), list(ws.values()))
        return next(c for c in plan.candidates if c.prefill == "w0").breakdown["queue_s"]

    first = policy.choose(request(20000, gpu("w0", 1250), request_id="a"), list(ws.values()))
    assert first.prefill == "w0"
    service = first.breakdown["total_s"] - first.breakdown["queue_s"]
    ws["w0"] = dataclasses.replace(ws["w0"], inflight=1)
    clock[0] = 0.01
    assert queue_at_w0("x") == pytest.approx(service - 0.01)
    clock[0] = 10.0  # overdue: predicted to be done, still in flight
    assert queue_at_w0("y") == 0.0
    policy.observe(RouteOutcome("a", "m", first, 20000, 19999, 0.1))
    assert queue_at_w0("z") == pytest.approx(0.1)  # one request in flight we know nothing about
    ws["w0"] = dataclasses.replace(ws["w0"], inflight=0)
    assert queue_at_w0("w") == 0.0


def test_engine_running_count_beyond_what_we_sent_weighs_little() -> None:
    """A scrape showing requests the router does not have in flight (other clients, or a scrape older
    than our finished requests) mostly means decoding requests: it must not send a session away from
    the worker holding its history, while waiting requests and our own in-flight ones count in full."""
    ws = workers(2)
    ws[0] = dataclasses.replace(ws[0], running=3)
    policy = kvaware(calibrate=False)
    plan = policy.explain(request(4000, gpu("w0", 200)), ws)
    queue = next(c for c in plan.candidates if c.prefill == "w0").breakdown["queue_s"]
    assert queue == pytest.approx(3 * 0.2 * 0.1)
    assert plan.prefill == "w0"
    ws[0] = dataclasses.replace(ws[0], running=1, waiting=2)
    plan = policy.explain(request(4000, gpu("w0", 200)), ws)
    queue = next(c for c in plan.candidates if c.prefill == "w0").breakdown["queue_s"]
    assert queue == pytest.approx((2 + 0.2) * 0.1)
    with pytest.raises(ValueError, match="unknown_running_weight"):
        kvaware(unknown_running_weight=-1)


def test_our_requests_finished_since_the_scrape_are_not_foreign_work() -> None:
    """The engine's count is compared with what we had in flight when it was scraped, not now: 10 running
    then, all ours, 4 of them finished since. Against ``inflight`` now that read as 6 foreign requests
    (a queue the worker did not have, which sent a cached repeat away from its holder); other clients'
    requests beyond ours at the scrape still count."""
    ws = workers(2)
    ws[0] = dataclasses.replace(ws[0], running=10, inflight=6, scraped_inflight=10)
    assert (ws[0].foreign, ws[0].load) == (0, 6)
    policy = kvaware(calibrate=False)
    plan = policy.explain(request(4000, gpu("w0", 3900)), ws)
    queue = next(c for c in plan.candidates if c.prefill == "w0").breakdown["queue_s"]
    assert queue == pytest.approx(6 * 0.1)  # our own six, in full: nothing foreign
    ws[0] = dataclasses.replace(ws[0], running=10, waiting=2, inflight=6, scraped_inflight=7)
    assert (ws[0].foreign, ws[0].load) == (5, 11)
    plan = policy.explain(request(4000, gpu("w0", 3900)), ws)
    queue = next(c for c in plan.candidates if c.prefill == "w0").breakdown["queue_s"]
    assert queue == pytest.approx((6 + 2 + 3 * 0.2) * 0.1)
    # Not known (a view built without a scrape): our count now stands for it, as before.
    ws[0] = dataclasses.replace(ws[0], running=10, waiting=0, inflight=6, scraped_inflight=None)
    assert (ws[0].foreign, ws[0].load) == (4, 10)


def test_calibration_separates_a_fixed_overhead_from_prefill_speed() -> None:
    """TTFT = 10 ms + the configured prefill time: the scale must stay near 1 (not absorb the constant)."""
    policy = kvaware()
    for i in range(60):
        n = 200 + (i % 6) * 1500
        req = request(n, request_id=f"r{i}")
        plan = policy.choose(req, workers(1))
        policy.observe(RouteOutcome(f"r{i}", "m", plan, prompt_tokens=n, cached_tokens=0, ttft_s=0.01 + n / 10_000.0))
    assert policy.calibrator.overhead_s("m") == pytest.approx(0.01, rel=0.3)
    assert policy.calibrator.prefill_scale("m") == pytest.approx(1.0, rel=0.15)


def test_a_session_moves_only_for_a_clear_gain() -> None:
    """Leaving the worker that holds the history costs its recompute for sure; a small predicted queue
    there must not outweigh that, a long one must (affinity_weight=0 is pure predicted TTFT). The whole
    penalty here (``affinity_by_load`` off; the next test scales it by the fleet's load)."""
    ws = workers(2)
    ws[0] = dataclasses.replace(ws[0], inflight=4)  # 0.4 s of unknown work; recomputing 0.32 s is cheaper
    req = request(4000, gpu("w0", 200))
    assert kvaware(affinity_weight=0.0, calibrate=False).choose(req, ws).prefill == "w1"
    assert kvaware(calibrate=False, affinity_by_load=False).choose(req, ws).prefill == "w0"
    ws[0] = dataclasses.replace(ws[0], inflight=10)
    plan = kvaware(calibrate=False, affinity_by_load=False).choose(req, ws)
    assert plan.prefill == "w1" and "load overrides affinity" in plan.why()


def measured_error(policy: KvAwarePolicy, error_s: float, n: int = 40) -> None:
    """Tell ``policy``'s calibrator of ``n`` whole plans (on a worker the tests do not use) each off by
    ``error_s``: the TTFT error it then knows (an EWMA: within 0.1 % after 40)."""
    for i in range(n):
        plan = RoutePlan(prefill="elsewhere", decode="elsewhere", breakdown={"total_s": 0.05})
        policy.calibrator.observe(RouteOutcome(f"e{i}", "m", plan, 100, 100, 0.05 + error_s))


def test_the_recompute_left_behind_weighs_as_much_as_the_other_workers_are_busy() -> None:
    """The recompute a move leaves behind is GPU time taken from whoever else needs that worker: with the
    others idle, only the model's own TTFT error (a move must gain more than that); with half of them busy,
    half of it, so a 96 ms gain no longer outweighs 160 ms of it."""
    ws = workers(3)
    ws[0] = dataclasses.replace(ws[0], inflight=4)  # the holder: 0.4 s of work ahead
    req = request(4000, gpu("w0", 200))
    policy = kvaware(calibrate=False)
    assert policy.calibrator.ttft_error_s == 0.005  # the prior, until outcomes say otherwise
    measured_error(policy, 0.05)
    assert policy.calibrator.ttft_error_s == pytest.approx(0.05, rel=1e-3)
    plan = policy.choose(req, ws)
    assert plan.prefill in ("w1", "w2") and plan.breakdown["affinity_penalty_s"] == pytest.approx(0.05, rel=1e-3)
    unsure = kvaware(calibrate=False)
    measured_error(unsure, 0.2)  # the 96 ms gain is within the model's error: stay
    assert unsure.choose(req, ws).prefill == "w0"
    ws[2] = dataclasses.replace(ws[2], inflight=4)
    assert policy.choose(req, ws).prefill == "w0"
    whole = kvaware(calibrate=False, affinity_by_load=False).explain(req, ws).candidates
    half = {c.prefill: c.breakdown["affinity_penalty_s"] for c in policy.explain(req, ws).candidates}
    assert half["w1"] == pytest.approx(next(c for c in whole if c.prefill == "w1").breakdown["affinity_penalty_s"] / 2)
    assert half["w1"] > 0.15
    with pytest.raises(ValueError):
        kvaware(affinity_by_load="yes")


def test_the_recompute_left_behind_is_shared_among_the_requests_that_used_the_prefix_lately() -> None:
    """A session's own history sticks behind a queue that a prefix many requests ended on lately (a group's
    system prompt) does not: a second holder takes part of their load. Explaining counts nobody. (The
    whole penalty, not scaled by the fleet's load: the other worker here is idle.)"""
    ws = workers(2)
    ws[0] = dataclasses.replace(ws[0], inflight=4)  # as above: the queue is worth less than the recompute
    keys = list(range(1, 251))  # 4000 tokens in 16-token blocks; w0 holds the first 200
    alone = kvaware(calibrate=False, affinity_by_load=False)
    plan = alone.choose(request(4000, gpu("w0", 200), block_keys=keys), ws)
    assert plan.prefill == "w0"
    assert alone.queue.prefix_users(keys[199]) == pytest.approx(1.0, rel=1e-3)  # this request, once routed

    shared = kvaware(calibrate=False, affinity_by_load=False)
    for _ in range(8):
        shared.queue.used_prefix(keys[199])
    explained = shared.explain(request(4000, gpu("w0", 200), block_keys=keys), ws)
    assert shared.queue.prefix_users(keys[199]) == pytest.approx(8.0, rel=1e-3)
    leaving = next(c for c in explained.candidates if c.prefill == "w1")
    staying_alone = next(
        c for c in alone.explain(request(4000, gpu("w0", 200), block_keys=keys), ws).candidates if c.prefill == "w1"
    )
    assert leaving.breakdown["affinity_penalty_s"] < staying_alone.breakdown["affinity_penalty_s"] / 4
    assert shared.choose(request(4000, gpu("w0", 200), block_keys=keys), ws).prefill == "w1"


def test_one_outlier_moves_the_prefill_scale_a_bounded_step() -> None:
    policy = kvaware()
    plan = policy.choose(request(10000), workers(1))
    policy.observe(RouteOutcome("r1", "m", plan, prompt_tokens=10000, cached_tokens=0, ttft_s=1000.0))
    assert policy.calibrator.prefill_scale("m") == pytest.approx(math.exp(0.2))  # alpha x a capped error
