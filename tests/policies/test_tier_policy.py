"""Per-request kv_load_tiers and max_offload_tokens."""

from __future__ import annotations

import pytest
from kvroute.policies.base import RouteRequest
from kvroute.policies.tier_policy import TierPolicy, validate_tiers


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
