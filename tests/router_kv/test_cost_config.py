"""The router config's cost figures (pool link, per-model transfer cost) reach the kvaware policy."""

from __future__ import annotations

from kvroute.config import RouterConfig
from kvroute.policies.cost import KvAwarePolicy
from kvroute.router.server import pool_context


def test_router_config_carries_link_and_model_transfer_figures() -> None:
    config = RouterConfig.model_validate(
        {
            "pool": {"kv_protocol": "nixl", "link_bytes_per_s": 76.8e9, "transfer_setup_s": 0.0125},
            "models": [{"name": "m", "transfer_per_block_s": 0.0003}],
        }
    )
    policy = KvAwarePolicy.for_pool(pool_context(config))
    assert policy.params.default_bandwidth_bytes_per_s == 76.8e9
    assert policy.params.transfer_setup_s == 0.0125
    assert policy.params.model("m").transfer_per_block_s == 0.0003


def test_defaults_leave_the_policy_defaults() -> None:
    policy = KvAwarePolicy.for_pool(pool_context(RouterConfig()))
    assert policy.params.default_bandwidth_bytes_per_s == 12.5e9
    assert policy.params.transfer_setup_s == 0.0
