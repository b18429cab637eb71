"""The router config's cost figures (pool link, per-model transfer cost) reach the kvaware policy."""

from __future__ import annotations

import pytest
from kvroute.apps.build import pool_context
from kvroute.config import RouterConfig
from kvroute.policies.base import ModelFigures, PoolContext
from kvroute.policies.cost import KvAwarePolicy


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


def test_model_figures_keep_one_shape_from_the_config_to_the_cost_model() -> None:
    figures = ModelFigures(prefill_tokens_per_s=20_000.0, attention_coeff_s=4e-7, bytes_per_token=262_144)
    policy = KvAwarePolicy.for_pool(PoolContext(models={"m": figures}))
    assert policy.params.model("m") == figures
    assert policy.params.model("other") == ModelFigures()  # the policy's defaults


def test_option_figures_override_the_pool_figures_one_by_one() -> None:
    pool = PoolContext(models={"m": ModelFigures(prefill_tokens_per_s=20_000.0, transfer_per_block_s=0.0003)})
    policy = KvAwarePolicy.for_pool(pool, models={"m": {"prefill_tokens_per_s": 5000}, "n": {"bytes_per_token": 8}})
    assert policy.params.model("m") == ModelFigures(prefill_tokens_per_s=5000.0, transfer_per_block_s=0.0003)
    assert policy.params.model("n") == ModelFigures(bytes_per_token=8)
    with pytest.raises(ValueError, match="speed"):
        KvAwarePolicy.for_pool(pool, models={"m": {"speed": 1}})


def test_pool_context_still_takes_plain_mappings_of_figures() -> None:
    pool = PoolContext(models={"m": {"prefill_tokens_per_s": 20_000.0, "bytes_per_token": 262_144.0}})
    assert pool.models["m"] == ModelFigures(prefill_tokens_per_s=20_000.0, bytes_per_token=262_144)
    with pytest.raises(ValueError):
        PoolContext(models={"m": {"prefill_tokens_per_s": 0.0}})
    with pytest.raises(ValueError):
        ModelFigures.from_mapping({"bytes_per_token": "many"})
