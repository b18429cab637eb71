"""Our key chain: the same keys whichever way a prefix is cut into events, and tenants kept apart."""

from __future__ import annotations

import pytest
from kvroute.indexer.keys import chain_keys, request_extra_keys, request_keys, root_key

TOKENS = list(range(70_000, 70_000 + 16 * 5 + 7))  # 5 full blocks and a partial one


def test_chain_is_the_same_however_it_is_split() -> None:
    whole = request_keys(TOKENS, 16, "m")
    assert len(whole) == 5
    first = chain_keys(TOKENS[:32], 16, root_key("m"))
    rest = chain_keys(TOKENS[32:], 16, first[-1])
    assert first + rest == whole
    assert chain_keys(tuple(TOKENS), 16, root_key("m"), max_blocks=2) == whole[:2]
    assert request_keys(TOKENS, 16, "other") != whole
    assert request_keys(TOKENS, 32, "m") != whole[:2]


def test_extras_follow_vllm_placement() -> None:
    salted = request_keys(TOKENS, 16, "m", cache_salt="t1")
    assert salted != request_keys(TOKENS, 16, "m", cache_salt="t2")
    assert salted != request_keys(TOKENS, 16, "m")
    extras = request_extra_keys(5, lora_name="l", cache_salt="t1")
    assert extras is not None and extras[0] == ["l", "t1"] and extras[1] == ["l"]
    assert chain_keys(TOKENS, 16, root_key("m"), extras) == request_keys(
        TOKENS, 16, "m", lora_name="l", cache_salt="t1"
    )
    # Short extras: blocks past their end have none.
    short = chain_keys(TOKENS, 16, root_key("m"), [["x"]])
    assert short[1:] != request_keys(TOKENS, 16, "m")[1:] and len(short) == 5


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16])
def test_tokens_out_of_range_raise(bad: list[int]) -> None:
    with pytest.raises(OverflowError):
        chain_keys(bad, 16, 1)
    with pytest.raises(ValueError):
        chain_keys([1] * 16, 0, 1)
