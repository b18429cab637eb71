"""The published baselines: llm-d's weighted scorers (``prefix``) and SGLang's text tree (``approx_text``)."""

from __future__ import annotations

import dataclasses

import pytest
from kvroute.policies import create_policy
from kvroute.policies.base import NoWorkerError, RouteRequest, WorkerView
from kvroute.policies.prefix import queue_scores
from kvroute.policies.text_tree import TextTree

from tests.policies.util import gpu, request, workers

# -- prefix (llm-d) ---------------------------------------------------------------------------------------


def test_queue_scorer_is_min_max_normalised() -> None:
    ws = [WorkerView(id="a", waiting=0), WorkerView(id="b", waiting=5), WorkerView(id="c", waiting=10)]
    assert queue_scores(ws, "waiting") == {"a": 1.0, "b": 0.5, "c": 0.0}
    assert queue_scores(ws[:1] * 2, "waiting") == {"a": 1.0}


def test_prefix_holder_wins_when_queues_are_equal() -> None:
    plan = create_policy("prefix").choose(request(3200, gpu("w1", 200)), workers(3))
    assert plan.prefill == plan.decode == "w1"
    assert plan.predicted_cached_tokens == 3184  # vLLM: (3200 - 1) // 16 whole blocks


def test_prefix_weights_trade_affinity_against_queue_and_kv_usage() -> None:
    ws = workers(2)
    ws[0] = dataclasses.replace(ws[0], waiting=10, kv_usage=0.9)  # 3*1 + 2*0 + 2*0.1 = 3.2
    ws[1] = dataclasses.replace(ws[1], waiting=0, kv_usage=0.0)  # 3*0 + 2*1 + 2*1.0 = 4.0
    assert create_policy("prefix").choose(request(3200, gpu("w0", 200)), ws).prefill == "w1"
    heavy = create_policy("prefix", prefix_weight=10.0)
    assert heavy.choose(request(3200, gpu("w0", 200)), ws).prefill == "w0"


def test_prefix_queue_signal_load_uses_router_inflight_counts() -> None:
    ws = workers(2)
    ws[0] = dataclasses.replace(ws[0], inflight=50)
    assert create_policy("prefix", queue_signal="load").choose(request(3200), ws).prefill == "w1"


def test_prefix_pd_split_above_the_uncached_threshold() -> None:
    ws = workers(1, role="prefill", prefix="p") + workers(1, role="decode", prefix="d")
    policy = create_policy("prefix", pd_threshold_tokens=500)
    assert policy.choose(request(3200), ws).prefill == "p0"
    short = policy.choose(request(3200, gpu("d0", 190)), ws)  # 160 uncached on the decoder
    assert short.prefill == short.decode == "d0"


def test_prefix_refuses_unknown_options_and_empty_pools() -> None:
    with pytest.raises(ValueError):
        create_policy("prefix", weight=1)
    with pytest.raises(NoWorkerError):
        create_policy("prefix").choose(request(10), [])


# -- approx_text (SGLang) -----------------------------------------------------------------------------------


def text_request(text: str) -> RouteRequest:
    return RouteRequest(request_id="r", model="m", prompt_text=text)


def test_text_tree_match_split_and_sizes() -> None:
    tree = TextTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.match("hello world!") == {"a": 11, "b": 6}
    assert tree.match("help") == {"a": 3, "b": 3}
    assert tree.match("xyz") == {}
    assert tree.size("a") == 11 and tree.size("b") == 11


def test_text_tree_evicts_least_recently_used_leaves_of_one_tenant() -> None:
    tree = TextTree()
    tree.insert("system prompt: old question", "a")
    tree.insert("system prompt: new question", "a")
    tree.insert("system prompt: old question", "b")
    tree.evict("a", max_size=len("system prompt: new question"))
    assert tree.match("system prompt: old question")["a"] == len("system prompt: ")
    assert tree.match("system prompt: new question")["a"] == len("system prompt: new question")
    assert tree.match("system prompt: old question")["b"] == len("system prompt: old question")
    assert tree.size("a") <= len("system prompt: new question")


def test_text_tree_remove_tenant() -> None:
    tree = TextTree()
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "b")
    tree.remove_tenant("a")
    assert tree.match("abcdef") == {"b": 3}
    assert tree.size("a") == 0


def test_approx_text_sticks_to_the_worker_that_saw_the_text() -> None:
    policy = create_policy("approx_text")
    ws = workers(4)
    first = policy.choose(text_request("You are a helpful assistant. Q1"), ws)
    again = policy.choose(text_request("You are a helpful assistant. Q1 A1 Q2"), ws)
    assert again.prefill == first.prefill
    assert "text match" in again.why()


def test_approx_text_spreads_unmatched_text_to_the_smallest_tree() -> None:
    policy = create_policy("approx_text")
    ws = workers(3)
    chosen = {policy.choose(text_request(f"{i}: a fresh prompt with nothing in common"), ws).prefill for i in range(3)}
    assert chosen == {"w0", "w1", "w2"}


def test_approx_text_goes_to_least_load_when_imbalanced() -> None:
    policy = create_policy("approx_text")
    ws = workers(2)
    policy.choose(text_request("shared prefix and more"), ws)
    holder = policy.choose(text_request("shared prefix and more"), ws).prefill
    ws = [dataclasses.replace(w, inflight=200 if w.id == holder else 0) for w in ws]
    plan = policy.choose(text_request("shared prefix and more"), ws)
    assert plan.prefill != holder and "imbalanced" in plan.why()


def test_approx_text_pd_pool_picks_a_decoder_by_load() -> None:
    ws = workers(1, role="prefill", prefix="p") + workers(2, role="decode", prefix="d")
    ws[1] = dataclasses.replace(ws[1], inflight=3)
    plan = create_policy("approx_text").choose(text_request("hi"), ws)
    assert (plan.prefill, plan.decode) == ("p0", "d1")


def test_approx_text_bounded_tree_and_bad_options() -> None:
    policy = create_policy("approx_text", max_tree_size=50)
    for i in range(20):
        policy.choose(text_request(f"prompt number {i} " * 3), workers(1))
    assert policy.tree.size("w0") <= 50  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        create_policy("approx_text", cache_threshold=2)
