"""``kvaware``: the plan with the lowest expected time to first token (DESIGN §7).

For every candidate plan (prefill worker x optional kv-source peer or conversation reuse x decode worker)::

    TTFT = queue(prefill worker) + lookup(source) + bytes / bandwidth(source -> prefill)
         + promotion(CPU/STORAGE -> GPU) + prefill(uncached tokens, context) + handoff(prefill -> decode)

Each predicted hit counts with the probability that it is still there (per tier, lower on a worker
whose KV cache is nearly full, scaled by the calibrated hit ratio), so a lagging index costs a little
expected time instead of a bad bet. Queue wait replays the requests this policy sent to the worker as
a FIFO queue of their predicted service times (work it cannot replay counts by calibrated service time,
engine-reported running requests only in part: they are mostly decoding). Plans are ranked by that TTFT
plus a bounded penalty for the cached tokens they leave behind on the worker holding the most, so a
session moves only for a clear gain, while a worker holding a popular prefix still stops winning once
its queue grows (the queue is unbounded, the penalty is not). The penalty is shared among the recent
requests whose cached prefix ended on the same block: a session's history pays it whole, a prefix many
requests use gets a second holder sooner.

Tiers along a cached run are assumed ordered GPU, then CPU, then STORAGE, as eviction takes a
sequence's tail first; tiers the request may not read (tier policy) cut the usable run there.

This module holds the cost terms and the ranking. The queue and KV-space terms, with the per-worker state
behind them, live in :class:`~kvroute.policies.load_model.QueueModel`; which plans exist at all, in
:mod:`kvroute.policies.candidates`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvroute.indexer.backend import WorkerMatch
from kvroute.policies.base import (
    CandidatePlan,
    ModelFigures,
    NoWorkerError,
    Policy,
    PoolContext,
    RouteOutcome,
    RoutePlan,
    RouteRequest,
    WorkerView,
)
from kvroute.policies.calibration import Calibrator, Feedback
from kvroute.policies.candidates import (
    TERM_NAMES,
    Context,
    LocalRun,
    Option,
    ShownCandidates,
    WorkerTerms,
    candidates,
    usable_blocks,
    usable_run,
)
from kvroute.policies.cost_params import CostParams
from kvroute.policies.load_model import QueueModel
from kvroute.policies.registry import register_policy
from kvroute.policies.tier_policy import TierPolicy

__all__ = ["KvAwarePolicy", "LocalRun", "usable_run"]

#: How often ``choose`` hands the engines' per-source counters (scraped, so no fresher than that) to calibration.
SOURCE_CHECK_INTERVAL_S = 1.0
#: The tiers of a worker's own cached run, in the order a sequence's blocks sit in them (eviction takes the tail).
_LOCAL_TIERS = ("GPU", "CPU", "STORAGE")
#: Where an option's terms hold the tokens a peer serves.
_REMOTE_TOKENS = TERM_NAMES.index("tokens_REMOTE")


@register_policy
class KvAwarePolicy(Policy):
    """Cost-model routing; options are the fields of :class:`~kvroute.policies.cost_params.CostParams`
    (and ``now``, the clock, for tests)."""

    name = "kvaware"
    needs_index = True

    def __init__(self, **options: object) -> None:
        now = options.pop("now", None)
        if now is not None and not callable(now):
            raise ValueError(f"now must be a clock (a callable returning seconds), got {now!r}")
        super().__init__(**options)
        self.params = CostParams.from_options(options)
        calib_opts = dict(self.params.calibration)
        calib_opts.setdefault("default_service_time_s", self.params.default_service_time_s)
        if now is not None:
            calib_opts["now"] = now
        self.calibrator = Calibrator.from_options(calib_opts)
        self.tiers = TierPolicy.from_options(self.params.tier_policy)
        self.queue = QueueModel(self.params, self.calibrator)
        self._next_source_check = float("-inf")

    @classmethod
    def for_pool(cls, pool: PoolContext, **options: object) -> KvAwarePolicy:
        """Config-file model figures and the pool's protocol, unless the options set them explicitly
        (per-model option figures override the pool's one by one)."""
        models: dict[str, ModelFigures | Mapping[str, object]] = dict(pool.models)
        overrides = options.pop("models", None) or {}
        if not isinstance(overrides, Mapping):
            raise ValueError(f"models must map model names to figures, got {overrides!r}")
        for name, figures in overrides.items():
            base = models.get(name)
            if isinstance(base, ModelFigures) and isinstance(figures, Mapping):
                try:
                    models[name] = ModelFigures.from_mapping(figures, base)
                except ValueError as exc:
                    raise ValueError(f"models[{name!r}]: {exc}") from None
            else:
                models[name] = figures
        options.setdefault("kv_protocol", pool.kv_protocol)
        options.setdefault("kv_recompute_threshold", pool.kv_recompute_threshold)
        if pool.link_bytes_per_s is not None:
            options.setdefault("default_bandwidth_bytes_per_s", pool.link_bytes_per_s)
        if pool.transfer_setup_s is not None:
            options.setdefault("transfer_setup_s", pool.transfer_setup_s)
        return cls(models=models, **options)

    # -- public API ----------------------------------------------------------------------------------

    @property
    def feedback(self) -> Feedback:
        """Predicted vs reported hits, stale decisions, per-tier hits, bytes moved (for /metrics)."""
        return self.calibrator.feedback

    def stale_rate(self) -> float:
        return self.calibrator.stale_rate()

    def observe(self, outcome: RouteOutcome) -> None:
        self.queue.finished(outcome)
        self.calibrator.record_plan(outcome.plan.predicted_by_tier, int(outcome.plan.breakdown.get("bytes_moved", 0)))
        if self.params.calibrate:
            self.calibrator.observe(outcome)

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """The best plan, with the best ``explain_limit`` candidates attached; the prefill worker's
        queue model learns that the request was sent."""
        self._check_sources(workers)
        plan = self._decide(request, workers, self.params.explain_limit, dry_run=False)
        bd = plan.breakdown  # the prefill worker is busy for all but the queue and the handoff
        service = bd["total_s"] - bd["queue_s"] - bd["handoff_s"] - bd["decode_queue_s"]
        blocks = QueueModel.blocks_needed(request, int(bd.get("tokens_GPU", 0)))
        self.queue.sent(plan.prefill, request.request_id, service, blocks)
        if plan.decode != plan.prefill:  # its KV reaches the decoder once the prefill side is done
            self.queue.handing_off(plan.decode, request.request_id, bd["total_s"] - bd["decode_queue_s"])
        return plan

    def _check_sources(self, workers: Sequence[WorkerView]) -> None:
        """Once a second, the engines' per-source ground truth (summed over the pool) to the calibrator."""
        now = self.calibrator.now()
        if now < self._next_source_check or not self.params.calibrate:
            return
        self._next_source_check = now + SOURCE_CHECK_INTERVAL_S
        totals: dict[str, float] = {}
        for w in workers:
            for source, tokens in w.served_by_source.items():
                totals[source] = totals.get(source, 0.0) + tokens
        if totals:
            self.calibrator.observe_sources(totals)

    def explain(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """The plan :meth:`choose` would return, with every candidate's breakdown; nothing is learnt
        or forgotten (the queue replay is read, not trimmed)."""
        return self._decide(request, workers, None, dry_run=True)

    def _decide(
        self, request: RouteRequest, workers: Sequence[WorkerView], limit: int | None, dry_run: bool
    ) -> RoutePlan:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            raise NoWorkerError("no healthy worker for this model")
        ctx = self._context(request, healthy, dry_run)
        options = candidates(ctx, healthy, limit, self.params, self._score)
        if not options:
            raise NoWorkerError("no worker with the needed role")
        options.sort(key=Option.key)
        shown = ShownCandidates(options if limit is None else options[:limit])
        return self._plan(ctx, options, shown)

    # -- per-worker terms ----------------------------------------------------------------------------

    def _context(self, request: RouteRequest, healthy: list[WorkerView], dry_run: bool) -> Context:
        """Every worker's terms for this request: usable cached tokens by tier, the expected share of them
        still there, promotion, queue and KV-space wait (``dry_run``: read the queue model, change nothing)."""
        prm = self.params
        p2p = prm.kv_protocol == "p2p"
        cls = request.latency_class
        allow_storage = self.tiers.allows(cls, "STORAGE") if p2p else True
        allow_remote = p2p and (self.tiers.allows(cls, "CPU", "REMOTE") or self.tiers.allows(cls, "STORAGE", "REMOTE"))
        model = prm.model(request.model)
        prompt = max(0, request.prompt_tokens or 0)
        block = max(1, request.block_size)
        # vLLM reuses whole blocks only, and never the one holding the last prompt token (it must compute
        # at least that one): (len - 1) // block_size blocks. A 256-token prompt in 32-token blocks: 224.
        cap = max(0, prompt - 1) // block * block
        odds = self.queue.tier_odds(self.calibrator.hit_ratio)  # the same for every worker
        p_remote = self.queue.still_there_on(None, "REMOTE", odds["REMOTE"])
        waits = self.queue.waits
        traffic = self.queue.traffic_order
        handoffs_due = self.queue.handoffs_due
        locals_: dict[str, WorkerTerms] = {}
        for w in healthy:
            match = request.matches.get(w.id)
            if match is None or match.blocks <= 0:  # the common case on a large pool: nothing cached
                queue, kv_wait = waits(w, request, 0, dry_run)
                locals_[w.id] = WorkerTerms(
                    worker=w,
                    tokens={},
                    cached=0,
                    expected=0.0,
                    promotion_s=0.0,
                    queue_s=queue,
                    peer_tokens=0,
                    peer_prob=p_remote,
                    kv_wait_s=kv_wait,
                    traffic=traffic(w.id),
                )
            else:
                locals_[w.id] = terms = self._cached_terms(
                    request, w, match, cap, odds, p_remote, usable_blocks(match, allow_storage, allow_remote), dry_run
                )
                terms.traffic = traffic(w.id)
            if w.role == "decode":
                locals_[w.id].handoffs_due = handoffs_due(w.id)
        holder = max(locals_.values(), key=lambda lw: lw.expected, default=None)
        return Context(
            request=request,
            model=model,
            prompt=prompt,
            cap=cap,
            scale=self.calibrator.prefill_scale(request.model),
            locals=locals_,
            best_local=holder.expected if holder is not None else 0.0,
            affinity_share=self._affinity_share(request, holder, dry_run),
            affinity_load=_busy_share(locals_.values(), holder) if prm.affinity_by_load else 1.0,
            affinity_floor_s=self.calibrator.ttft_error_s,
            allow_sources=p2p and self.tiers.allows_source(cls),
            handoff_extra=self.calibrator.handoff_extra_s(request.model),
        )

    def _affinity_share(self, request: RouteRequest, holder: WorkerTerms | None, dry_run: bool) -> float:
        """How much of the affinity penalty leaving ``holder`` carries. A second copy of a session's own
        history is waste; a second holder of a prefix many requests use lately (a group's system prompt)
        takes part of their load and their queue. So the recompute left behind is shared among the recent
        requests whose longest cached prefix ended on the same block (``traffic_window_s`` decay); this
        request counts itself once it is routed (not for ``dry_run``)."""
        keys = request.block_keys
        match = request.matches.get(holder.worker.id) if holder is not None and holder.expected > 0 else None
        if not keys or match is None or match.blocks <= 0:
            return 1.0
        key = keys[min(match.blocks, len(keys)) - 1]
        share = 1.0 / (1.0 + self.queue.prefix_users(key))
        if not dry_run:
            self.queue.used_prefix(key)
        return share

    def _cached_terms(
        self,
        request: RouteRequest,
        w: WorkerView,
        match: WorkerMatch,
        cap: int,
        odds: dict[str, float],
        p_remote: float,
        run: tuple[int, int, int],
        dry_run: bool,
    ) -> WorkerTerms:
        """The terms of a worker holding part of the prompt: its usable ``run`` of (GPU, CPU, STORAGE) blocks
        filled in that order up to ``cap`` tokens, each tier weighed by the chance its hits are still there."""
        prm = self.params
        block = max(1, request.block_size)
        still_there_on = self.queue.still_there_on
        tokens: dict[str, int] = {}
        exp: dict[str, float] = {}
        left = cap
        for tier, blocks in zip(_LOCAL_TIERS, run, strict=True):
            take = min(left, blocks * block)
            if take:
                tokens[tier] = take
                exp[tier] = take * still_there_on(w, tier, odds[tier])
                left -= take
        bpt = prm.model(request.model).bytes_per_token
        promotion = (
            exp.get("CPU", 0.0) * bpt / prm.promotion_cpu_bytes_per_s
            + exp.get("STORAGE", 0.0) * bpt / prm.promotion_storage_bytes_per_s
        )
        # What a peer can fetch: not the blocks held only remotely, nor those the worker is still computing.
        served = max(0, match.blocks - max(0, match.remote, match.pending)) * block
        queue, kv_wait = self.queue.waits(w, request, tokens.get("GPU", 0), dry_run)
        return WorkerTerms(
            worker=w,
            tokens=tokens,
            cached=cap - left,
            expected=sum(exp.values()),
            promotion_s=promotion,
            queue_s=queue,
            peer_tokens=min(cap, served),
            peer_prob=p_remote,
            kv_wait_s=kv_wait,
        )

    # -- the cost of one candidate ------------------------------------------------------------------

    def _score(
        self,
        ctx: Context,
        lp: WorkerTerms,
        d: WorkerView,
        *,
        source: WorkerTerms | None = None,
        reuse: bool = False,
        note: str = "",
        stalls: bool = False,
    ) -> Option:
        """The predicted TTFT of one plan, term by term, and the rank it is sorted by (``stalls``: a decode
        worker prefilling a long prompt itself, stalling the decodes it runs meanwhile)."""
        prm, mdl = self.params, ctx.model
        bpt = mdl.bytes_per_token
        p = lp.worker
        remote = max(0, source.peer_tokens - lp.cached) if source is not None else 0
        exp_remote = remote * source.peer_prob if source is not None else 0.0
        cached_exp = lp.expected + exp_remote
        uncached = ctx.prompt - cached_exp
        lookup = transfer = 0.0
        if source is not None:
            lookup = prm.lookup_rtt_s
            transfer = self._transfer_s(ctx, exp_remote, source.worker.id, p.id)
        per_token = (
            1.0 / mdl.prefill_tokens_per_s + mdl.attention_coeff_s * (cached_exp + uncached / 2) / 1000.0
        ) * ctx.scale
        prefill = uncached * per_token
        handoff = decode_queue = 0.0
        moved = exp_remote * bpt
        if d.id != p.id:
            handoff = max(0.0, prm.handoff_s + self._transfer_s(ctx, ctx.prompt, p.id, d.id) + ctx.handoff_extra)
            # The decoder takes the request once the KV has arrived, in its next step; prefills it runs
            # itself (short uncached tails, conditional disaggregation) hold its steps meanwhile: what of
            # its own queue outlasts this plan's prefill side is waited for too.
            ready_in = lp.queue_s + lookup + transfer + lp.promotion_s + prefill + handoff
            busy = ctx.locals[d.id].queue_s - ready_in  # every candidate decoder is a healthy worker
            decode_queue = max(d.load * prm.decode_queue_s_per_request, busy)
            moved += ctx.prompt * bpt
        held = 0.0
        if lp.handoffs_due:  # a decoder prefilling itself: handoffs due before it ends wait for the end
            starts = lp.queue_s  # those due earlier queue behind this request too (vLLM admits FIFO)
            ends = starts + lookup + transfer + lp.promotion_s + prefill
            waits = [ends - max(due, starts) for due in lp.handoffs_due if due < ends]
            if waits:
                held = sum(waits)
                note = f"{note}; holds {len(waits)} handoff(s) {held * 1000:.1f} ms in all"
        terms = (
            lp.queue_s,
            lookup,
            transfer,
            lp.promotion_s,
            prefill,
            handoff,
            decode_queue,
            per_token,
            cached_exp,
            float(remote),
            moved,
            held,
        )
        score = sum(terms[:7])
        # Cached tokens this plan leaves behind on the worker holding the most: their recompute is
        # certain, the queue it avoids is an estimate from lagging load signals.
        left_behind = max(0.0, ctx.best_local - cached_exp)
        penalty = left_behind * per_token * prm.affinity_weight * ctx.affinity_share
        if penalty > 0 and ctx.affinity_load < 1:
            penalty = max(penalty * ctx.affinity_load, min(penalty, ctx.affinity_floor_s))
        rank = score + penalty
        if stalls:  # every decode stream running there waits out this prefill (inter-token latency)
            rank += prefill * prm.decode_stall_weight * max(p.load, 1)
        rank += held
        return Option(
            score=score,
            rank=rank,
            p=lp,
            d=d,
            source=source,
            reuse=reuse,
            cached=lp.cached + remote,
            terms=terms,
            note=note,
        )

    def _transfer_s(self, ctx: Context, tokens: float, src: str, dst: str) -> float:
        """Moving ``tokens`` of KV from ``src`` to ``dst``: setup + per-block descriptors + bytes / bandwidth."""
        if tokens <= 0:
            return 0.0
        prm, mdl = self.params, ctx.model
        blocks = tokens / max(1, ctx.request.block_size)
        return (
            prm.transfer_setup_s
            + blocks * mdl.transfer_per_block_s
            + tokens * mdl.bytes_per_token / prm.bandwidth(src, dst)
        )

    # -- the plan ------------------------------------------------------------------------------------

    def _plan(self, ctx: Context, ranked: list[Option], shown: ShownCandidates) -> RoutePlan:
        best = shown[0]
        load_tiers: list[dict[str, str]] | None = None
        max_offload: int | None = None
        max_load: int | None = None
        by_tier = _tier_tokens(ranked[0])
        runner = ranked[1] if len(ranked) > 1 else None
        holder = max(ctx.locals.values(), key=_holding, default=None)
        prompt = ctx.prompt
        if self.params.kv_protocol == "p2p":
            load_tiers, max_offload = self.tiers.apply(ctx.request, with_source=best.kv_source is not None)
            planned_loads = sum(n for tier, n in by_tier.items() if tier != "GPU")
            max_load = self.tiers.max_load_tokens(ctx.request.latency_class, planned_loads)
        return RoutePlan(
            prefill=best.prefill,
            decode=best.decode,
            kv_source=best.kv_source,
            kv_load_tiers=load_tiers,
            max_offload_tokens=max_offload,
            max_load_tokens=max_load,
            predicted_cached_tokens=best.predicted_cached_tokens,
            predicted_ttft_s=best.breakdown["total_s"],
            predicted_by_tier=by_tier,
            reuse_conversation=ranked[0].reuse,
            reason=lambda: _reason(prompt, best, runner, holder),
            # The hit ratio the expectations were weighed with: what calibration divides out again.
            breakdown={**best.breakdown, "hit_ratio": self.calibrator.hit_ratio},
            candidates=shown,
            policy=self.name,
        )


#: Predicted work ahead above which a worker counts as busy for the affinity penalty's load scale.
_BUSY_S = 0.001


def _busy_share(terms: Iterable[WorkerTerms], holder: WorkerTerms | None) -> float:
    """The share of the prefill-capable workers other than ``holder`` with work ahead now: how much the
    recompute a plan leaves behind would delay other requests (1.0 when there are no such workers)."""
    others = busy = 0
    for lw in terms:
        if lw is holder or lw.worker.role == "decode":
            continue
        others += 1
        busy += lw.queue_s > _BUSY_S
    return busy / others if others else 1.0


def _holding(terms: WorkerTerms) -> tuple[int, float]:
    return terms.cached, -terms.queue_s


def _tier_tokens(best: Option) -> dict[str, int]:
    """The plan's predicted cached tokens per tier: the ``tokens_*`` entries of its breakdown, in their order
    (a peer's REMOTE tokens, then the prefill worker's own tiers), read off the option rather than parsed
    back out of the shown breakdown."""
    remote = int(best.terms[_REMOTE_TOKENS])
    by_tier = {"REMOTE": remote} if remote else {}
    by_tier.update(best.p.tokens)
    return by_tier


def _reason(prompt: int, best: CandidatePlan, runner: Option | None, holder: WorkerTerms | None) -> str:
    """Why the winner won: its terms, the ``runner``-up's gap, and when load overrode the affinity to the
    ``holder`` of the most cached tokens. Formatted only when read: it holds no more of the decision."""
    bd = best.breakdown
    text = (
        f"best plan, predicted TTFT {bd['total_s'] * 1000:.1f} ms ({best.note}): "
        f"{best.predicted_cached_tokens}/{prompt} tokens cached, "
        f"queue {bd['queue_s'] * 1000:.1f} ms"
        + (f" (KV space {bd['kv_space_wait_s'] * 1000:.1f} ms)" if bd.get("kv_space_wait_s") else "")
        + ", "
        f"prefill {bd['prefill_s'] * 1000:.1f} ms"
    )
    if runner is not None:
        gap_ms = (runner.rank - best.score) * 1000
        text += f"; next {runner.p.worker.id}->{runner.d.id} ranked +{gap_ms:.1f} ms behind"
    if holder is not None and holder.cached > best.predicted_cached_tokens:
        text += (
            f"; load overrides affinity: {holder.worker.id} holds {holder.cached} tokens "
            f"but waits {holder.queue_s * 1000:.1f} ms"
        )
    return text
