"""``prefix``: llm-d's inference-scheduler scheme, implemented as published, as a baseline.

llm-d's Endpoint Picker filters, then sums weighted scorers in [0, 1] and takes the maximum
(``max-score-picker``, random among ties). The weights of its "inference scheduling" well-lit path
(and the Red Hat OpenShift AI default profile) are:

* ``prefix-cache-scorer`` (precise variant: fed by KV events) — weight **3**: matched blocks ÷ the
  request's blocks;
* ``queue-scorer`` — weight **2**: min-max normalised waiting-queue length, ``(max - q) / (max - min)``
  (1.0 for every endpoint when all queues are equal);
* ``kv-cache-utilization-scorer`` — weight **2**: ``1 - kv_cache_usage``.

P/D (``pd-profile-handler``): the decode endpoint is picked first; when the request's tokens not cached
on it exceed ``threshold``, a prefill endpoint is picked by the same scorers among prefill workers,
else the decode endpoint does everything. llm-d's handler takes the threshold from its config
(deployments set hundreds of tokens); ours defaults to 512. It neither weighs tiers nor transfer costs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvroute.policies.base import NoWorkerError, Policy, RoutePlan, RouteRequest, WorkerView
from kvroute.policies.options import as_float, as_int, refuse_unknown
from kvroute.policies.registry import register_policy


def queue_scores(workers: Sequence[WorkerView], signal: str) -> dict[str, float]:
    queues = {w.id: float(w.waiting if signal == "waiting" else w.load) for w in workers}
    lo, hi = min(queues.values()), max(queues.values())
    if hi == lo:
        return dict.fromkeys(queues, 1.0)
    return {wid: (hi - q) / (hi - lo) for wid, q in queues.items()}


@register_policy
class PrefixPolicy(Policy):
    """Options: ``prefix_weight`` (3), ``queue_weight`` (2), ``kv_weight`` (2), ``pd_threshold_tokens``
    (512), ``queue_signal`` (``waiting`` as llm-d scrapes it, or ``load`` to add the router's in-flight
    counts), ``seed`` (tie-breaking RNG)."""

    name = "prefix"
    needs_index = True

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        known = ("prefix_weight", "queue_weight", "kv_weight", "pd_threshold_tokens", "queue_signal", "seed")
        refuse_unknown(self.name, options, known)
        self.prefix_weight = as_float(options.get("prefix_weight", 3.0), "prefix_weight")
        self.queue_weight = as_float(options.get("queue_weight", 2.0), "queue_weight")
        self.kv_weight = as_float(options.get("kv_weight", 2.0), "kv_weight")
        self.pd_threshold = as_int(options.get("pd_threshold_tokens", 512), "pd_threshold_tokens")
        self.queue_signal = str(options.get("queue_signal", "waiting"))
        if self.queue_signal not in ("waiting", "load"):
            raise ValueError("queue_signal must be 'waiting' or 'load'")
        seed = options.get("seed", 0)
        if seed is not None and not isinstance(seed, int | float | str | bytes | bytearray):
            raise ValueError(f"seed must be a number or a string, got {seed!r}")
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        return self._decide(request, workers, self._rng)

    def explain(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """The plan :meth:`choose` would return: ties are broken by a copy of the tie-breaking RNG."""
        rng = random.Random()
        rng.setstate(self._rng.getstate())
        return self._decide(request, workers, rng)

    def _pick(
        self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random
    ) -> tuple[WorkerView, float]:
        total_blocks = max(1, (request.prompt_tokens or 0) // max(1, request.block_size))
        queue = queue_scores(workers, self.queue_signal)
        scored = []
        for w in workers:
            match = request.matches.get(w.id)
            prefix = min(1.0, (match.blocks if match else 0) / total_blocks) if request.prompt_tokens else 0.0
            kv = 1.0 - max(0.0, min(1.0, w.kv_usage))
            total = self.prefix_weight * prefix + self.queue_weight * queue[w.id] + self.kv_weight * kv
            scored.append((total, w))
        top = max(s for s, _ in scored)
        ties = [w for s, w in scored if s >= top - 1e-12]
        return rng.choice(sorted(ties, key=lambda w: w.id)), top

    def _decide(self, request: RouteRequest, workers: Sequence[WorkerView], rng: random.Random) -> RoutePlan:
        healthy = [w for w in workers if w.healthy]
        decoders = [w for w in healthy if w.can_decode]
        prefillers = [w for w in healthy if w.role == "prefill"]
        if not decoders:
            raise NoWorkerError("no healthy worker for this model" if not healthy else "no decode-capable worker")
        d, score = self._pick(request, decoders, rng)
        if not prefillers:
            return self._plan(request, d, d, f"max score {score:.2f}")
        match = request.matches.get(d.id)
        cached = min(request.prompt_tokens or 0, (match.blocks if match else 0) * request.block_size)
        uncached = (request.prompt_tokens or 0) - cached
        if uncached <= self.pd_threshold:
            return self._plan(request, d, d, f"{uncached} uncached tokens <= threshold: decode only")
        p, pscore = self._pick(request, prefillers, rng)
        reason = f"P/D split: {uncached} uncached tokens; scores {pscore:.2f}/{score:.2f}"
        return self._plan(request, p, d, reason)

    def _plan(self, request: RouteRequest, p: WorkerView, d: WorkerView, reason: str) -> RoutePlan:
        match = request.matches.get(p.id)
        held = (match.blocks if match else 0) * request.block_size
        block = max(1, request.block_size)
        cached = min(max(0, (request.prompt_tokens or 0) - 1) // block * block, held)  # vLLM: whole blocks only
        return RoutePlan(prefill=p.id, decode=d.id, predicted_cached_tokens=cached, reason=reason, policy=self.name)
