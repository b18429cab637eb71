"""Per-request kv_load_tiers, max_offload_tokens and max_load_tokens."""

from __future__ import annotations

import pytest
from kvroute.indexer.backend import WorkerMatch
from kvroute.policies.base import RouteRequest
from kvroute.policies.tier_policy import TierPolicy, validate_tiers

from tests.policies.test_cost import kvaware
from tests.policies.util import request, workers


def req(**kw: object) -> RouteRequest:
    return RouteRequest(request_id="r", model="m", block_size=16, **kw)  # type: ignore[arg-type]


def test_latency_classes_choose_tiers() -> None:
    policy = TierPolicy()
    assert policy.load_tiers("interactive") == []
    assert policy.load_tiers("standard") == [{"medium": "STORAGE", "locality": "LOCAL"}]
    assert {"medium": "CPU", "locality": "REMOTE"} in policy.load_tiers("batch")
    assert policy.load_tiers("unknown-class") == []  # default class
    assert policy.allows("interactive", "CPU") and not policy.allows("interactive", "STORAGE")
    assert policy.allows("batch", "STORAGE", "REMOTE")


def test_configured_classes_override_and_validate() -> None:
    classes = {"interactive": [{"medium": "storage", "locality": "local"}]}
    policy = TierPolicy.from_options({"classes": classes, "default_class": "batch"})
    assert policy.load_tiers("interactive") == [{"medium": "STORAGE", "locality": "LOCAL"}]
    assert len(policy.load_tiers("nope")) == 3
    for bad in (
        {"classes": {"x": [{"medium": "GPU", "locality": "LOCAL"}]}},
        {"default_class": "nope"},
        {"offload_rule": "some"},
        {"unknown": 1},
    ):
        with pytest.raises(ValueError):
            TierPolicy.from_options(bad)


def test_offload_rule_shared_prefix_only() -> None:
    policy = TierPolicy()
    assert policy.max_offload_tokens(req(prompt_tokens=9000, shared_prefix_tokens=4100)) == 4096
    assert policy.max_offload_tokens(req(prompt_tokens=100, shared_prefix_tokens=4100)) == 96
    assert policy.max_offload_tokens(req(prompt_tokens=100)) is None
    assert TierPolicy(unknown_offload_tokens=0).max_offload_tokens(req(prompt_tokens=100)) == 0
    assert TierPolicy(offload_rule="all").max_offload_tokens(req(shared_prefix_tokens=10)) is None
    assert TierPolicy(offload_rule="none").max_offload_tokens(req()) == 0
    assert TierPolicy().apply(req(latency_class="batch", shared_prefix_tokens=32))[1] == 32


def test_validate_tiers_rejects_malformed_lists() -> None:
    for bad in ("CPU", [{"medium": "CPU"}], [{"medium": "TAPE", "locality": "LOCAL"}], [1]):
        with pytest.raises(ValueError):
            validate_tiers(bad)


def test_interactive_loads_are_capped_at_what_the_plan_priced() -> None:
    policy = TierPolicy()
    assert policy.max_load_tokens("interactive", 640) == 640
    assert policy.max_load_tokens("unknown-class", 64) == 64  # the default class: interactive
    assert policy.max_load_tokens("batch", 640) is None
    assert TierPolicy(capped_load_classes=[]).max_load_tokens("interactive", 640) is None
    with pytest.raises(ValueError):
        TierPolicy.from_options({"capped_load_classes": "interactive"})


def test_a_plan_loading_from_the_cpu_tier_carries_max_load_tokens() -> None:
    ws = workers(2)
    cpu_hit = WorkerMatch("w0", blocks=40, gpu=10, cpu=30)
    interactive = kvaware(kv_protocol="p2p").choose(request(1000, cpu_hit), ws)
    assert interactive.prefill == "w0"
    assert interactive.max_load_tokens == interactive.predicted_by_tier["CPU"] == 30 * 16
    batch = kvaware(kv_protocol="p2p").choose(request(1000, cpu_hit, latency_class="batch"), ws)
    assert batch.max_load_tokens is None
    assert kvaware().choose(request(1000, cpu_hit), ws).max_load_tokens is None  # no offloading connector
