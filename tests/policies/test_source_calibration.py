"""Per-source ground truth (vLLM's prompt_tokens_cached_by_source) calibrates the per-tier hit probability."""

from __future__ import annotations

import dataclasses

from kvroute.indexer.backend import WorkerMatch
from kvroute.policies.calibration import Calibrator

from tests.policies.test_cost import kvaware
from tests.policies.util import request, workers


def test_a_tier_whose_hits_the_engines_do_not_serve_weighs_less() -> None:
    cal = Calibrator(alpha=0.5)
    cal.observe_sources({"device": 0.0, "host": 0.0})  # first view: the baseline
    for step in range(1, 6):
        cal.record_plan({"GPU": 1000, "CPU": 1000}, 0)
        # The engines served every predicted GPU token but only a quarter of the CPU-tier ones.
        cal.observe_sources({"device": 1000.0 * step, "host": 250.0 * step})
    assert cal.source_factor("CPU") < 0.6
    assert cal.source_factor("GPU") == 1.0  # relative to all tiers, capped at 1: the level is the hit ratio's
    assert cal.source_factor("STORAGE") == 1.0  # no evidence, no change


def test_little_evidence_and_restarts_change_nothing() -> None:
    cal = Calibrator(alpha=0.5)
    cal.observe_sources({"device": 500.0, "host": 500.0})
    cal.record_plan({"CPU": 100}, 0)  # below the evidence threshold
    cal.observe_sources({"device": 500.0, "host": 500.0})
    cal.record_plan({"CPU": 5000}, 0)
    cal.observe_sources({"device": 10.0, "host": 0.0})  # an engine restarted: counters went down
    assert cal.source_factor("CPU") == 1.0


def test_the_policy_reads_the_pool_counters_and_discounts_that_tier() -> None:
    policy = kvaware(kv_protocol="p2p", calibration={"alpha": 0.5})
    clock = [0.0]
    policy.calibrator.now = lambda: clock[0]
    cpu_hit = WorkerMatch("w0", blocks=60, gpu=0, cpu=60)
    served = {"device": 0.0, "host": 0.0}
    ws = workers(2)
    before = policy.explain(request(1000, cpu_hit), ws).predicted_ttft_s
    for _ in range(6):
        views = [dataclasses.replace(w, served_by_source=dict(served)) for w in ws]
        policy.choose(request(1000, cpu_hit, request_id=f"r{clock[0]}"), views)
        policy.calibrator.record_plan({"GPU": 960, "CPU": 960}, 0)
        served["device"] += 960.0
        served["host"] += 96.0  # the CPU tier served a tenth of what was predicted, the GPU all of it
        clock[0] += 2.0
    assert policy.calibrator.source_factor("CPU") < 0.5
    after = policy.explain(request(1000, cpu_hit), ws).predicted_ttft_s
    assert before is not None and after is not None and after > before  # fewer expected hits: more prefill
