"""The last step of the request flow: what happened, told to the metrics and to the policy.

Each answered request becomes a :class:`~kvroute.policies.base.RouteOutcome` for ``policy.observe`` (how
the cost model calibrates itself on TTFT and cached tokens), and the prediction check: the plan's predicted
cached tokens against the cached tokens the engine reported (each surface's usage shape); a predicted hit the
engine did not serve is a *stale* decision.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from kvroute.policies.base import Policy, RouteOutcome, RoutePlan
from kvroute.router.facts import Facts
from kvroute.router.forwarding import Result
from kvroute.router.kv_metrics import KVRouteMetrics
from kvroute.router.metrics import RouterMetrics
from kvroute.router.receipts import Receipts
from kvroute.router.requests import ParsedRequest
from kvroute.router.surfaces import SURFACE_NAMES, usage_counts
from kvroute.vocabulary import SOURCE_OF_TIER

log = logging.getLogger("kvroute.outcomes")


def surface_of(request: ParsedRequest, lora: str | None = None) -> str:
    """The API surface a prediction is checked on: a tokenizer, template or adapter-key mismatch shows on one
    of them (``+lora``: the request named an adapter; ``+salted``: it carried a ``cache_salt``)."""
    surface = SURFACE_NAMES.get(request.route, "other")
    if lora is not None:
        surface += "+lora"
    if request.json is not None and request.json.get("cache_salt"):
        surface += "+salted"
    return surface


class PrefillLegAnswer(NamedTuple):
    """A split plan's prefill leg as it answered: seconds after the request arrived, and the cached tokens
    its own usage reported (the prefiller's hit; the final answer's also count the KV the decoder pulled)."""

    answered_s: float
    cached_tokens: int | None


class Outcomes:
    """Records decisions and outcomes; the policy's name labels the decision histogram."""

    def __init__(
        self, metrics: RouterMetrics, kv_metrics: KVRouteMetrics, policy_name: str, receipts: Receipts | None = None
    ) -> None:
        self.metrics = metrics
        self.kv = kv_metrics
        self.receipts = receipts
        self._decision = metrics.decision.labels(policy_name)

    def relabel(self, policy_name: str) -> None:
        """A reloaded config swapped the policy in: decisions are counted under its name from now on."""
        self._decision = self.metrics.decision.labels(policy_name)

    def decided(self, seconds: float) -> None:
        self._decision.observe(seconds)

    def record(
        self,
        request: ParsedRequest,
        facts: Facts,
        plan: RoutePlan,
        result: Result,
        policy: Policy,
        prefill_leg: PrefillLegAnswer | None = None,
    ) -> None:
        """Metrics, the receipt and the policy's feedback for one answered request (``prefill_leg``: its
        prefill leg's answer, when the plan was split and that leg answered)."""
        prompt_tokens, cached, _ = usage_counts(request.route, result.usage)
        leg_s, leg_cached = prefill_leg if prefill_leg is not None else (None, None)
        model = request.model or ""
        m = self.metrics
        if isinstance(prompt_tokens, int):
            m.child(m.prompt_tokens, model).inc(prompt_tokens)
        if isinstance(cached, int):
            m.child(m.cached_tokens, model).inc(cached)
        if result.ttfb_s is not None and request.stream:
            m.child(m.ttft, model).observe(result.ttfb_s)
        outcome = RouteOutcome(
            request_id=request.request_id,
            model=model,
            plan=plan,
            prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else 0,
            cached_tokens=cached if isinstance(cached, int) else None,
            # Only a stream's first chunk is a time to first token; a whole JSON answer includes decoding.
            ttft_s=result.ttfb_s if request.stream else None,
            ok=result.ok,
            prefill_leg_s=leg_s,
            prefill_leg_cached_tokens=leg_cached,
        )
        if self.receipts is not None:
            self.receipts.add(
                request.request_id,
                model,
                plan,
                prompt_tokens=outcome.prompt_tokens or None,
                cached_tokens=outcome.cached_tokens,
                ttfb_s=result.ttfb_s,
                stream=request.stream,
                status=result.status,
                ok=result.ok,
                prefill_leg_s=leg_s,
                prefill_leg_cached_tokens=leg_cached,
            )
        try:
            policy.observe(outcome)
        except Exception:
            log.exception("policy %s failed to observe an outcome", policy.name)
        # A split answer's cached tokens include the KV its decoder pulled: the prefill leg's are the hit.
        self._check_prediction(request, facts, plan, result, outcome.prefill_cached_tokens, policy)

    def _check_prediction(
        self,
        request: ParsedRequest,
        facts: Facts,
        plan: RoutePlan,
        result: Result,
        reported: object,
        policy: Policy,
    ) -> None:
        # Labelled children come from the metrics' cache: ``labels()`` validates and locks on every call,
        # which made these counters most of the cost of recording an outcome.
        child, kv = self.metrics.child, self.kv
        shape = "pd" if plan.disaggregated else "aggregated"
        if plan.kv_source:
            shape += "+p2p"
        if plan.reuse_conversation:
            shape += "+conversation"
        child(kv.decisions, plan.policy or policy.name, shape).inc()
        if facts.keys is None or not result.ok:
            return
        model = request.model or ""
        predicted = plan.predicted_cached_tokens
        child(kv.predicted, model).inc(predicted)
        for tier, tokens in plan.predicted_by_tier.items():
            child(kv.predicted_by_tier, tier).inc(tokens)
            child(kv.predicted_by_source, SOURCE_OF_TIER.get(tier, "external_unspecified")).inc(tokens)
        kv.bytes_moved.inc(int(plan.breakdown.get("bytes_moved", 0)))
        if isinstance(reported, int):
            child(kv.checked, model).inc()
            child(kv.reported, model).inc(reported)
            outcome = "exact" if predicted == reported else "over" if predicted > reported else "under"
            child(kv.fidelity, surface_of(request, facts.lora), outcome).inc()
            if predicted > reported + facts.route.block_size:
                child(kv.stale, model).inc()
