"""``Policy.explain`` is a dry run for every built-in policy: the plan ``choose`` would return, no state changed."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

import pytest
from kvroute.indexer.backend import WorkerMatch
from kvroute.policies import Policy, RouteOutcome, RoutePlan, RouteRequest, WorkerView, create_policy
from kvroute.policies.approx_text import ApproxTextPolicy
from kvroute.policies.cost import KvAwarePolicy

from tests.policies.util import gpu, request, workers

BUILTINS = ["round_robin", "least_load", "prefix", "approx_text", "kvaware"]


def text_request(prompt_tokens: int, *matches: WorkerMatch, request_id: str = "r1", text: str = "") -> RouteRequest:
    return dataclasses.replace(request(prompt_tokens, *matches, request_id=request_id), prompt_text=text)


def fresh(name: str) -> Policy:
    clock = [0.0]
    return create_policy(name, now=lambda: clock[0]) if name == "kvaware" else create_policy(name)


def same(a: RoutePlan, b: RoutePlan) -> bool:
    return a.to_dict() == b.to_dict()


@pytest.mark.parametrize("name", BUILTINS)
def test_two_explains_then_a_choose_equal_one_choose(name: str) -> None:
    """A history of decisions first (so there is state to disturb), then the same request twice."""
    ws = workers(3)
    history = [
        text_request(3000, gpu("w1", 100), request_id=f"h{i}", text=f"system prompt {i % 2} q{i}") for i in range(5)
    ]
    req = text_request(4000, gpu("w1", 150), request_id="x", text="system prompt 1 and a new question")
    plain, dry = fresh(name), fresh(name)
    for policy in (plain, dry):
        for h in history:
            policy.choose(h, ws)
    explained = [dry.explain(req, ws), dry.explain(req, ws)]
    chosen = dry.choose(req, ws)
    expected = plain.choose(req, ws)
    assert same(chosen, expected)
    assert (explained[0].prefill, explained[0].decode, explained[0].kv_source) == (
        chosen.prefill,
        chosen.decode,
        chosen.kv_source,
    )
    assert same(explained[0], explained[1])
    # and the decision after that one is unaffected too
    after = text_request(2000, request_id="y", text="another prompt")
    assert same(dry.choose(after, ws), plain.choose(after, ws))


def test_round_robin_explain_shows_the_next_turn_without_taking_it() -> None:
    policy = create_policy("round_robin")
    ws = workers(3)
    assert policy.choose(request(10), ws).prefill == "w0"
    assert [policy.explain(request(10), ws).prefill for _ in range(3)] == ["w1"] * 3
    assert [policy.choose(request(10), ws).prefill for _ in range(3)] == ["w1", "w2", "w0"]


def test_approx_text_explain_leaves_the_tree_unwritten() -> None:
    policy = create_policy("approx_text")
    assert isinstance(policy, ApproxTextPolicy)
    ws = workers(2)
    policy.choose(text_request(10, text="shared system prompt, first question"), ws)
    sizes = {w.id: policy.tree.size(w.id) for w in ws}
    plan = policy.explain(text_request(10, text="a prompt nobody has seen yet, long enough"), ws)
    assert {w.id: policy.tree.size(w.id) for w in ws} == sizes
    assert policy.tree.match("a prompt nobody has seen yet, long enough") == {}
    assert same(plan, policy.choose(text_request(10, text="a prompt nobody has seen yet, long enough"), ws))


def test_prefix_explain_does_not_draw_from_the_tie_breaking_rng() -> None:
    ws = workers(4)  # all tied: the RNG picks
    plain, dry = create_policy("prefix", seed=7), create_policy("prefix", seed=7)
    for _ in range(5):
        dry.explain(request(100), ws)
    assert [dry.choose(request(100), ws).prefill for _ in range(8)] == [
        plain.choose(request(100), ws).prefill for _ in range(8)
    ]


def test_kvaware_explain_reads_the_queue_replay_without_trimming_it() -> None:
    """choose() forgets remembered requests beyond the worker's load for good; explain() must not."""
    clock = [0.0]
    plain, dry = kv(clock), kv(clock)
    ws = workers(2)
    for policy in (plain, dry):
        for i in range(3):
            policy.choose(request(8000, gpu("w0", 400), request_id=f"a{i}"), ws)
    idle = [dataclasses.replace(w, inflight=0) for w in ws]  # a scrape that shows nothing outstanding
    probe = request(8000, gpu("w0", 400), request_id="x")
    explained = dry.explain(probe, idle)
    would = copy.deepcopy(plain).choose(probe, idle)
    assert same(dataclasses.replace(explained, candidates=explained.candidates[:8]), would)
    busy = [dataclasses.replace(w, inflight=3) for w in ws]  # the three are outstanding after all
    assert same(dry.choose(request(8000, request_id="y"), busy), plain.choose(request(8000, request_id="y"), busy))


def kv(clock: list[float]) -> KvAwarePolicy:
    policy = create_policy("kvaware", kv_protocol="p2p", now=lambda: clock[0])
    assert isinstance(policy, KvAwarePolicy)
    return policy


def test_kvaware_explain_is_choose_with_every_candidate_and_learns_nothing() -> None:
    clock = [0.0]
    policy = kv(clock)
    ws = workers(6)
    req = request(8000, gpu("w1", 100), gpu("w2", 300))
    first = policy.choose(req, ws)
    policy.observe(RouteOutcome("r1", "m", first, prompt_tokens=8000, cached_tokens=4000, ttft_s=0.5))
    before = (dataclasses.asdict(policy.feedback), policy.calibrator.hit_ratio, policy.calibrator.service_time("w2"))
    full = policy.explain(dataclasses.replace(req, request_id="r2"), ws)
    assert (
        dataclasses.asdict(policy.feedback),
        policy.calibrator.hit_ratio,
        policy.calibrator.service_time("w2"),
    ) == before
    chosen = policy.choose(dataclasses.replace(req, request_id="r2"), ws)
    assert len(full.candidates) > len(chosen.candidates) == 8
    assert [c.score for c in chosen.candidates] == [c.score for c in full.candidates[:8]]
    assert same(dataclasses.replace(full, candidates=chosen.candidates), chosen)


def test_the_default_explain_runs_choose_on_a_copy() -> None:
    """A plug-in policy that only implements choose() still gets a dry run that changes nothing."""

    class Counting(Policy):
        name = "counting"

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
            self.seen.append(request.request_id)
            w = workers[len(self.seen) % len(workers)]
            return RoutePlan(prefill=w.id, decode=w.id, policy=self.name)

    policy = Counting()
    ws = workers(3)
    explained = policy.explain(request(10), ws)
    assert policy.seen == []
    assert same(explained, policy.choose(request(10), ws))


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_overrides_the_copying_default(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-ins have a read-only path: no deep copy of their state per explain."""
    policy = fresh(name)
    copies: list[object] = []
    real: Callable[..., object] = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda x, *a: copies.append(x) or real(x, *a))
    policy.explain(text_request(100, text="hello"), workers(2))
    assert copies == []
