"""Online calibration of the cost model from what the engines report back.

The configured parameters (prefill speed, service time) are only a starting point: real speed depends on
the GPU, batch mix and context length, and the index's view of caches lags the engines. Every
:class:`~kvroute.policies.base.RouteOutcome` feeds these estimates:

* a per-model **prefill scale**: observed prefill time ÷ predicted prefill time (EWMA of the log ratio,
  so one outlier cannot swing it far), which corrects the tokens/s rate and attention term together;
* a per-model **fixed overhead** (HTTP, tokenization, scheduling: time a request costs whatever its
  size), the intercept of a least-squares fit of observed against predicted prefill time with
  exponential forgetting; once it holds, the scale follows the fitted rate. Folded into the scale, a
  constant 10 ms on requests whose prefill is predicted at 3 ms made every prefill (and so every
  queue replayed from predicted service times) look several times longer than it was, and the policy
  sent sessions away from their history for queues that were not there;
* a per-worker **service time**: the recent time one request keeps a worker busy before the next queued
  one starts, used for the queue-wait term (``load x service time``);
* a per-model **handoff extra**: what split plans' first tokens took after the prefiller answered (the
  router times that leg) beyond the plans' handoff and decoder-queue terms; the configured handoff counts
  the KV transfer, not the decoder's step before its first token. Split plans' prefill speed and service
  time are read from the prefill leg, so a slow decoder is not taken for a slow prefill;
* a **hit ratio**: the multiplier that makes the per-tier ``still_there`` priors match what the engines
  report: each outcome's share of its predicted hit that was there, divided by the probability the plan
  weighed that hit by before this ratio. The priors alone are constants: on a fleet whose engines
  confirmed every hit, a GPU hit still counted at 0.95, so a 896-token hit of a 905-token prompt was
  priced as 54 tokens of prefill instead of 9 (every receipt's TTFT 3 ms over what was observed), and
  the ratio, capped at 1, could never correct it. Now it converges to 1 ÷ the prior there (the clamp at
  probability 1 stays) and to the observed share where hits go missing. The same numbers give the
  stale-decision counter and rate;
* the **TTFT error**: the mean absolute difference between the predicted and the observed first token of
  whole (not split) plans (EWMA from the prior ``ttft_error_prior_s``). A plan that leaves the worker
  holding the most of a prompt must gain at least that much (see ``CostParams.affinity_by_load``): a
  smaller gain is within what the model gets wrong anyway;
* a per-tier **source factor**: the engines' per-source ground truth (vLLM's
  ``prompt_tokens_cached_by_source``, scraped) against the plans' predicted tokens per tier, relative to all
  tiers together — the hit ratio sets the level, this says which tier the misses come from (a CPU tier
  that evicts faster than the index learns, a peer that drops blocks) so those hits weigh less.

Everything is pure bookkeeping; the only clock is the injectable ``now`` used for the stale-rate window.
"""

from __future__ import annotations

import inspect
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.policies.base import RouteOutcome
from kvroute.vocabulary import SOURCE_OF_TIER

_NON_PREFILL_TERMS = ("lookup_s", "transfer_s", "promotion_s", "handoff_s", "decode_queue_s")
_NO_TERMS = (0.0,) * len(_NON_PREFILL_TERMS)
#: Bound on the hit ratio: it may lift the still-there priors to certainty (1 ÷ the lowest default prior,
#: 0.9, is 1.11) and somewhat past it, but one odd outcome cannot make a plan count a hit several times.
MAX_HIT_RATIO = 1.25
#: Predicted tokens of a tier (since the last update) below which its source factor is not updated.
_MIN_SOURCE_TOKENS = 512


@dataclass(slots=True)
class Feedback:
    """Counters for /metrics: predicted vs reported cache hits, stale decisions, bytes moved."""

    decisions: int = 0
    #: Decisions that predicted cached tokens the engine did not report (beyond the tolerance).
    stale_decisions: int = 0
    predicted_cached_tokens: int = 0
    reported_cached_tokens: int = 0
    predicted_by_tier: dict[str, int] = field(default_factory=dict)
    estimated_bytes_moved: int = 0


class Calibrator:
    """EWMA estimates learnt from outcomes; see the module docstring for what each one corrects."""

    def __init__(
        self,
        *,
        alpha: float = 0.2,
        default_service_time_s: float = 0.1,
        stale_tolerance: float = 0.5,
        window_s: float = 300.0,
        min_prefill_tokens: int = 128,
        overhead_forget: float = 0.05,
        max_overhead_s: float = 0.5,
        ttft_error_prior_s: float = 0.005,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0 < overhead_forget <= 1 or max_overhead_s < 0 or ttft_error_prior_s < 0:
            raise ValueError("overhead_forget must be in (0, 1], max_overhead_s and ttft_error_prior_s >= 0")
        self.alpha = alpha
        self.overhead_forget = overhead_forget
        self.max_overhead_s = max_overhead_s
        #: Per model: exponentially weighted sums (n, x, y, xx, xy) of (predicted prefill at scale 1,
        #: observed prefill) for the overhead fit.
        self._fit: dict[str, list[float]] = {}
        self.default_service_time_s = default_service_time_s
        self.stale_tolerance = stale_tolerance
        self.window_s = window_s
        self.min_prefill_tokens = min_prefill_tokens
        self.now = now
        self._log_prefill_scale: dict[str, float] = {}
        self._service_time: dict[str, float] = {}
        self._hit_ratio = 1.0
        self._recent: deque[tuple[float, bool]] = deque()
        self.feedback = Feedback()
        #: Per tier: served ÷ predicted relative to all tiers (1.0 until per-source ground truth says otherwise).
        self._source_factor: dict[str, float] = {}
        #: Totals at the last source update: served per source, predicted per tier.
        self._served_seen: dict[str, float] | None = None
        self._predicted_seen: dict[str, int] = {}
        #: Per model: seconds a prefill -> decode handoff takes beyond what the plans predicted for it.
        self._handoff_extra: dict[str, float] = {}
        #: EWMA of |observed - predicted| TTFT of whole plans, from the prior.
        self.ttft_error_s = float(ttft_error_prior_s)

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Calibrator:
        """From the ``calibration`` policy option (config values); unknown keys are refused."""
        known = set(inspect.signature(cls).parameters)
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown calibration options {sorted(unknown)}; known: {sorted(known)}")
        untyped: dict[str, Any] = dict(options)  # config values meet typed parameters; __init__ checks them
        return cls(**untyped)

    # -- estimates the cost model reads ------------------------------------------------------------

    def prefill_scale(self, model: str) -> float:
        """Multiplier on the configured prefill time of ``model`` (1.0 until something was observed)."""
        return math.exp(self._log_prefill_scale.get(model, 0.0))

    def overhead_s(self, model: str) -> float:
        """Fixed seconds per request of ``model`` outside prefill (0.0 until the fit has spread)."""
        line = self._line(model)
        return line[0] if line is not None else 0.0

    def _line(self, model: str) -> tuple[float, float] | None:
        """(intercept, slope) of observed vs predicted-at-scale-1 prefill, once sizes have spread."""
        fit = self._fit.get(model)
        if fit is None or fit[0] < 3.0:
            return None
        n, sx, sy, sxx, sxy = fit
        mx, my = sx / n, sy / n
        var = sxx / n - mx * mx
        if var <= (0.2 * mx) ** 2:  # too little spread in sizes to tell a constant from a rate
            return None
        slope = (sxy / n - mx * my) / var
        if slope <= 0:
            return None
        intercept = max(0.0, min(my - slope * mx, 0.9 * my, self.max_overhead_s))
        return intercept, (my - intercept) / mx if mx > 0 else slope

    def handoff_extra_s(self, model: str) -> float:
        """Seconds to add to a prefill -> decode handoff of ``model``: what split answers took beyond the
        plans' handoff and decoder-queue terms (the decoder's own step before the first token, a slower
        link than configured...). 0.0 until a split plan was observed."""
        return self._handoff_extra.get(model, 0.0)

    def service_time(self, worker_id: str) -> float:
        """Seconds one outstanding request keeps ``worker_id`` busy, for the queue-wait term."""
        return self._service_time.get(worker_id, self.default_service_time_s)

    @property
    def hit_ratio(self) -> float:
        """Share of predicted cached tokens the engines really had (1.0 = the index is never stale)."""
        return self._hit_ratio

    def source_factor(self, tier: str) -> float:
        """Multiplier on a ``tier`` hit's probability from per-source ground truth (1.0: no evidence)."""
        return self._source_factor.get(tier, 1.0)

    def observe_sources(self, served: Mapping[str, float]) -> None:
        """Fold the fleet's scraped per-source served tokens (cumulative, summed over workers) into the
        per-tier source factors: deltas since the last call, against the plans' predictions meanwhile."""
        predicted = self.feedback.predicted_by_tier
        if self._served_seen is None or any(served.get(k, 0.0) < v for k, v in self._served_seen.items()):
            self._served_seen, self._predicted_seen = dict(served), dict(predicted)  # first view, or a restart
            return
        d_pred = {t: n - self._predicted_seen.get(t, 0) for t, n in predicted.items()}
        total_pred = sum(d_pred.values())
        if total_pred < _MIN_SOURCE_TOKENS:
            return  # too little new evidence: keep accumulating
        d_served = {src: v - self._served_seen.get(src, 0.0) for src, v in served.items()}
        total_served = sum(d_served.get(SOURCE_OF_TIER[t], 0.0) for t in d_pred if t in SOURCE_OF_TIER)
        self._served_seen, self._predicted_seen = dict(served), dict(predicted)
        if total_served <= 0:
            return
        overall = total_served / total_pred
        for tier, n in d_pred.items():
            if n < _MIN_SOURCE_TOKENS or tier not in SOURCE_OF_TIER:
                continue
            relative = (d_served.get(SOURCE_OF_TIER[tier], 0.0) / n) / overall
            prev = self._source_factor.get(tier, 1.0)
            self._source_factor[tier] = max(0.25, min(1.0, prev + self.alpha * (min(relative, 1.0) - prev)))

    def stale_rate(self) -> float:
        """Stale decisions ÷ decisions that predicted a hit, over the last ``window_s`` seconds."""
        self._trim()
        with_hit = len(self._recent)
        return sum(1 for _, stale in self._recent if stale) / with_hit if with_hit else 0.0

    # -- learning ----------------------------------------------------------------------------------

    def record_plan(self, by_tier: dict[str, int], bytes_moved: int) -> None:
        """Count a decision's predicted hits per tier and the bytes it will move (at decision time)."""
        fb = self.feedback
        for tier, tokens in by_tier.items():
            fb.predicted_by_tier[tier] = fb.predicted_by_tier.get(tier, 0) + tokens
        fb.estimated_bytes_moved += bytes_moved

    def observe(self, outcome: RouteOutcome) -> None:
        """Fold one outcome into the estimates. Failed requests teach nothing about speed."""
        plan = outcome.plan
        fb = self.feedback
        fb.decisions += 1
        predicted = plan.predicted_cached_tokens
        # A split answer's cached tokens count the KV its decoder pulled: the prefill leg's own figure is the
        # prefiller's hit. Read as a hit, the pulled KV made every fresh prefill look ~0 tokens long, and the
        # speed fit took its whole prefill for fixed overhead (split prefills then ran 1.2x the prediction).
        reported = outcome.prefill_cached_tokens
        fb.predicted_cached_tokens += predicted
        if reported is not None:
            fb.reported_cached_tokens += reported
            if predicted > 0:
                stale = reported < predicted * self.stale_tolerance
                fb.stale_decisions += stale
                self._recent.append((self.now(), stale))
                self._trim()
                self._learn_hit_ratio(min(1.0, reported / predicted), predicted, plan.breakdown)
        if not outcome.ok or outcome.ttft_s is None:
            return
        if plan.prefill == plan.decode and "total_s" in plan.breakdown:
            error = abs(outcome.ttft_s - plan.breakdown["total_s"])
            self.ttft_error_s += self.alpha * (error - self.ttft_error_s)
        self._learn_handoff(outcome)
        self._learn_speed(outcome, reported if reported is not None else predicted)

    def _learn_handoff(self, outcome: RouteOutcome) -> None:
        """A split plan's first token came ``ttft_s - prefill_leg_s`` after the prefiller answered; the plan
        had predicted its handoff and decoder-queue terms for that (the learnt extra included). The extra
        moves by ``alpha`` of the difference, within [-handoff predicted, ``max_overhead_s``]."""
        leg, ttft = outcome.prefill_leg_s, outcome.ttft_s
        if leg is None or ttft is None or outcome.plan.prefill == outcome.plan.decode:
            return
        bd = outcome.plan.breakdown
        handoff = bd.get("handoff_s", 0.0)
        predicted = handoff + bd.get("decode_queue_s", 0.0)
        prev = self._handoff_extra.get(outcome.model, 0.0)
        error = (ttft - leg) - predicted
        base = handoff - prev  # the plan's handoff without the extra it was given
        self._handoff_extra[outcome.model] = max(-base, min(self.max_overhead_s, prev + self.alpha * error))

    def _learn_hit_ratio(self, there: float, predicted: int, breakdown: Mapping[str, float]) -> None:
        """``there``: the share of the ``predicted`` hit the engine had. The plan weighed that hit by
        ``expected_cached_tokens`` ÷ ``predicted``: the priors (and the KV-pressure discount) times the
        ratio of the moment (``hit_ratio`` in its breakdown); the ratio's target is what makes that product
        the observed share."""
        expected = breakdown.get("expected_cached_tokens")
        ratio = self._hit_ratio
        used = breakdown.get("hit_ratio", ratio)
        weighed = expected / (predicted * used) if expected and used > 0 else 1.0
        self._hit_ratio = ratio + self.alpha * (min(MAX_HIT_RATIO, there / weighed) - ratio)

    def _learn_speed(self, outcome: RouteOutcome, cached: int) -> None:
        bd = outcome.plan.breakdown
        ttft = outcome.ttft_s
        assert ttft is not None
        queue = bd.get("queue_s", 0.0)
        other = sum(map(bd.get, _NON_PREFILL_TERMS, _NO_TERMS))  # bd.get(term, 0.0) for each, summed in order
        if outcome.prefill_leg_s is not None and outcome.plan.prefill != outcome.plan.decode:
            # The prefiller answered at the end of its prefill: its busy time and the prefill speed are read
            # from that leg, not from a first token that also waited for the handoff and the decoder.
            ttft = outcome.prefill_leg_s
            other -= bd.get("handoff_s", 0.0) + bd.get("decode_queue_s", 0.0)
        # Time the request itself kept the prefill worker busy (its queue wait and the fixed overhead
        # excluded).
        busy = max(ttft - queue - self.overhead_s(outcome.model), 1e-4)
        worker = outcome.plan.prefill
        prev = self._service_time.get(worker, self.default_service_time_s)
        self._service_time[worker] = prev + self.alpha * (busy - prev)
        uncached = outcome.prompt_tokens - cached
        per_token = bd.get("prefill_s_per_uncached_token")
        if uncached <= 0 or not per_token:
            return
        predicted_prefill = per_token * uncached
        if queue > 0.1 * predicted_prefill:
            # A queued request's TTFT mixes our queue error into the speed: learning from it makes the
            # two estimates chase each other. Speed is learnt from requests predicted to start at once.
            return
        observed_prefill = ttft - queue - other
        if observed_prefill <= 0:
            return
        prev_log = self._log_prefill_scale.get(outcome.model, 0.0)
        # Small requests teach the overhead best; the scale is learnt from large enough ones only.
        self._fit_overhead(outcome.model, predicted_prefill / math.exp(prev_log), observed_prefill)
        if uncached < self.min_prefill_tokens:
            return
        line = self._line(outcome.model)
        if line is not None:
            # The fitted rate (what remains of the mean observation once the constant is taken out),
            # not one residual: a noisy intercept subtracted from a small sample made the scale collapse.
            target = math.log(max(line[1], 1e-3))
        else:
            target = prev_log + math.log(observed_prefill / predicted_prefill)
        # One sample moves the scale by at most alpha x 1 in log space, whatever outlier it is.
        error = max(-1.0, min(1.0, target - prev_log))
        self._log_prefill_scale[outcome.model] = max(-3.0, min(3.0, prev_log + self.alpha * error))

    def _fit_overhead(self, model: str, x: float, y: float) -> None:
        keep = 1.0 - self.overhead_forget
        fit = self._fit.setdefault(model, [0.0] * 5)
        n, sx, sy, sxx, sxy = fit
        fit[:] = (n * keep + 1.0, sx * keep + x, sy * keep + y, sxx * keep + x * x, sxy * keep + x * y)

    def _trim(self) -> None:
        horizon = self.now() - self.window_s
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
