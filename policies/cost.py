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
its queue grows (the queue is unbounded, the penalty is not).

Tiers along a cached run are assumed ordered GPU, then CPU, then STORAGE, as eviction takes a
sequence's tail first; tiers the request may not read (tier policy) cut the usable run there.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.indexer.backend import WorkerMatch
from kvroute.policies.base import (
    CandidatePlan,
    NoWorkerError,
    Policy,
    PoolContext,
    RouteOutcome,
    RoutePlan,
    RouteRequest,
    WorkerView,
)
from kvroute.policies.calibration import Calibrator, Feedback
from kvroute.policies.cost_params import CostParams, ModelCost
from kvroute.policies.registry import register_policy
from kvroute.policies.tier_policy import TierPolicy

#: The order of ``_Option.terms``; the first seven add up to the predicted TTFT.
_TERM_NAMES = (
    "queue_s",
    "lookup_s",
    "transfer_s",
    "promotion_s",
    "prefill_s",
    "handoff_s",
    "decode_queue_s",
    "prefill_s_per_uncached_token",
    "expected_cached_tokens",
    "tokens_REMOTE",
    "bytes_moved",
)


@dataclass(slots=True, frozen=True)
class LocalRun:
    """Usable cached blocks of one worker for this request, by the tier they load from."""

    gpu: int = 0
    cpu: int = 0
    storage: int = 0

    @property
    def blocks(self) -> int:
        return self.gpu + self.cpu + self.storage


def usable_run(match: WorkerMatch | None, allow_storage: bool, allow_remote: bool) -> LocalRun:
    """The part of a worker's match this request can load, given the tiers it may read.

    REMOTE-only blocks are attributed to the slowest media first (they sit at the end of the run).
    """
    if match is None:
        return LocalRun()
    gpu, cpu, storage = max(0, match.gpu), max(0, match.cpu), max(0, match.storage)
    if not allow_remote:
        cut = min(max(0, match.remote), gpu + cpu + storage)
        from_storage = min(cut, storage)
        storage -= from_storage
        cpu -= min(cut - from_storage, cpu)
    if not allow_storage:
        storage = 0
    return LocalRun(gpu, cpu, storage)


@dataclass(slots=True)
class _Local:
    """Per-worker terms computed once per request (they do not depend on the rest of the plan)."""

    worker: WorkerView
    tokens: dict[str, int]
    cached: int
    expected: float
    promotion_s: float
    #: Work ahead, including ``kv_wait_s``.
    queue_s: float
    #: Tokens this worker can serve to a peer, and the probability they are still there.
    peer_tokens: int
    peer_prob: float
    #: Expected wait for free KV blocks before the engine can admit the request (part of ``queue_s``).
    kv_wait_s: float = 0.0


@dataclass(slots=True)
class _Option:
    """A candidate scored cheaply; turned into a CandidatePlan only when it is shown."""

    score: float
    #: What plans are ranked by: the score plus the affinity penalty (see ``CostParams.affinity_weight``).
    rank: float
    p: _Local
    d: WorkerView
    source: _Local | None
    reuse: bool
    cached: int
    terms: tuple[float, ...]
    note: str = ""

    def key(self) -> tuple[Any, ...]:
        return (
            self.rank,
            self.p.worker.id != self.d.id,
            self.source is not None,
            self.p.worker.load,
            self.p.worker.id,
            self.d.id,
            self.source.worker.id if self.source else "",
        )


@dataclass(slots=True)
class _Ctx:
    request: RouteRequest
    model: ModelCost
    prompt: int
    cap: int
    scale: float
    locals: dict[str, _Local]
    #: The most expected cached tokens any worker holds locally (what leaving the holder gives up).
    best_local: float = 0.0
    #: Whether a plan may name a ``remote_kv_source`` peer (P2P pool, tier policy allows it).
    allow_sources: bool = False


@register_policy
class KvAwarePolicy(Policy):
    """Cost-model routing; options are the fields of :class:`~kvroute.policies.cost_params.CostParams`."""

    name = "kvaware"
    needs_index = True

    def __init__(self, **options: Any) -> None:
        now = options.pop("now", None)
        super().__init__(**options)
        self.params = CostParams.from_options(options)
        calib_opts = dict(self.params.calibration)
        calib_opts.setdefault("default_service_time_s", self.params.default_service_time_s)
        if now is not None:
            calib_opts["now"] = now
        self.calibrator = Calibrator(**calib_opts)
        self.tiers = TierPolicy.from_options(self.params.tier_policy)
        self._models: dict[str, ModelCost] = {}
        #: Per worker: (sent at, predicted service seconds, KV blocks it holds) of the requests this policy
        #: sent there, oldest first, until their outcome is observed: a virtual FIFO queue for the queue
        #: term, and the blocks they hold for the KV-space term.
        self._pending: dict[str, OrderedDict[str, tuple[float, float, int]]] = {}
        #: Per worker: EWMA of how long a request holds its KV blocks (sent -> outcome observed).
        self._hold_s: dict[str, float] = {}

    @classmethod
    def for_pool(cls, pool: PoolContext, **options: Any) -> KvAwarePolicy:
        """Config-file model figures and the pool's protocol, unless the options set them explicitly."""
        models = {name: dict(figures) for name, figures in pool.models.items()}
        for name, figures in (options.pop("models", None) or {}).items():
            models.setdefault(name, {}).update(figures)
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
        entry = self._pending.get(outcome.plan.prefill, OrderedDict()).pop(outcome.request_id, None)
        if entry is not None and outcome.ok:
            held = max(0.0, self.calibrator.now() - entry[0])
            old = self._hold_s.get(outcome.plan.prefill)
            alpha = self.calibrator.alpha
            self._hold_s[outcome.plan.prefill] = held if old is None else (1 - alpha) * old + alpha * held
        self.calibrator.record_plan(outcome.plan.predicted_by_tier, int(outcome.plan.breakdown.get("bytes_moved", 0)))
        if self.params.calibrate:
            self.calibrator.observe(outcome)

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """The best plan, with the best ``explain_limit`` candidates attached."""
        plan = self._decide(request, workers, self.params.explain_limit)
        pending = self._pending.setdefault(plan.prefill, OrderedDict())
        bd = plan.breakdown  # the prefill worker is busy for all but the queue and the handoff
        service = bd["total_s"] - bd["queue_s"] - bd["handoff_s"] - bd["decode_queue_s"]
        pending[request.request_id] = (
            self.calibrator.now(),
            service,
            self._blocks_needed(request, int(bd.get("tokens_GPU", 0))),
        )
        while len(pending) > self.params.max_pending:
            pending.popitem(last=False)
        return plan

    def explain(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """Like :meth:`choose` (a dry run: nothing is learnt), with every candidate's breakdown."""
        return self._decide(request, workers, None)

    def _decide(self, request: RouteRequest, workers: Sequence[WorkerView], limit: int | None) -> RoutePlan:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            raise NoWorkerError("no healthy worker for this model")
        ctx = self._context(request, healthy)
        options = self._candidates(ctx, healthy, limit)
        if not options:
            raise NoWorkerError("no worker with the needed role")
        options.sort(key=_Option.key)
        shown = [self._materialise(ctx, o) for o in (options if limit is None else options[:limit])]
        return self._plan(ctx, options, shown)

    # -- candidates ----------------------------------------------------------------------------------

    def _context(self, request: RouteRequest, healthy: list[WorkerView]) -> _Ctx:
        prm = self.params
        p2p = prm.kv_protocol == "p2p"
        cls = request.latency_class
        allow_storage = self.tiers.allows(cls, "STORAGE") if p2p else True
        allow_remote = p2p and (self.tiers.allows(cls, "CPU", "REMOTE") or self.tiers.allows(cls, "STORAGE", "REMOTE"))
        model = self._models.get(request.model)
        if model is None:
            model = self._models[request.model] = prm.model(request.model)
        prompt = max(0, request.prompt_tokens or 0)
        cap = max(0, prompt - 1)  # the engine always computes at least the last prompt token
        block = max(1, request.block_size)
        ratio = self.calibrator.hit_ratio
        bpt = model.bytes_per_token
        p_remote = self._still_there(None, "REMOTE", ratio)
        locals_: dict[str, _Local] = {}
        for w in healthy:
            match = request.matches.get(w.id)
            if match is None or match.blocks <= 0:  # the common case on a large pool: nothing cached
                queue, kv_wait = self._waits(w, request, 0)
                locals_[w.id] = _Local(
                    worker=w,
                    tokens={},
                    cached=0,
                    expected=0.0,
                    promotion_s=0.0,
                    queue_s=queue,
                    peer_tokens=0,
                    peer_prob=p_remote,
                    kv_wait_s=kv_wait,
                )
                continue
            run = usable_run(match, allow_storage, allow_remote)
            tokens: dict[str, int] = {}
            left = cap
            for tier, blocks in (("GPU", run.gpu), ("CPU", run.cpu), ("STORAGE", run.storage)):
                take = min(left, blocks * block)
                if take:
                    tokens[tier] = take
                    left -= take
            exp = {t: n * self._still_there(w, t, ratio) for t, n in tokens.items()}
            promotion = (
                exp.get("CPU", 0.0) * bpt / prm.promotion_cpu_bytes_per_s
                + exp.get("STORAGE", 0.0) * bpt / prm.promotion_storage_bytes_per_s
            )
            served = max(0, match.blocks - max(0, match.remote)) * block
            queue, kv_wait = self._waits(w, request, tokens.get("GPU", 0))
            locals_[w.id] = _Local(
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
        return _Ctx(
            request=request,
            model=model,
            prompt=prompt,
            cap=cap,
            scale=self.calibrator.prefill_scale(request.model),
            locals=locals_,
            best_local=max((lw.expected for lw in locals_.values()), default=0.0),
            allow_sources=p2p and self.tiers.allows_source(cls),
        )

    def _candidates(self, ctx: _Ctx, healthy: list[WorkerView], limit: int | None) -> list[_Option]:
        """Every plan worth weighing. With a ``limit``, prefill workers are visited by a lower bound of
        their cost (queue + prefill of what no source could supply) and the visit stops once that bound
        cannot beat the ``limit``-th best plan found: the best ``limit`` plans are still exact."""
        prm = self.params
        protocol = prm.kv_protocol
        # Separate prefill and decode need a transfer protocol; P2P decoders pull from the prefiller's port.
        split_pool = protocol != "none" and any(w.role != "both" for w in healthy)
        decoders = [w for w in healthy if w.role == "decode"]
        peers: list[_Local] = []
        if ctx.allow_sources and prm.max_sources > 0:
            peers = [
                lw for lw in ctx.locals.values() if lw.worker.p2p_host and lw.worker.p2p_port and lw.peer_tokens > 0
            ]
            peers.sort(key=lambda lw: (-lw.peer_tokens, lw.worker.load, lw.worker.id))
        conv = self._conversation_source(ctx)
        reach = max([q.peer_tokens for q in peers[:1]] + [conv.peer_tokens if conv else 0])
        per_token = ctx.scale / ctx.model.prefill_tokens_per_s
        bounds = {
            w.id: lw.queue_s + (ctx.prompt - max(lw.cached, reach)) * per_token
            for w in healthy
            for lw in (ctx.locals[w.id],)
        }
        kth: list[float] = []  # the `limit` best scores so far, negated (a max-heap)
        out: list[_Option] = []
        for p in sorted(healthy, key=lambda w: bounds[w.id]):
            if limit is not None and len(kth) >= limit and bounds[p.id] >= -kth[0]:
                break
            lp = ctx.locals[p.id]
            start = len(out)
            if p.can_prefill:
                can_hand_off = split_pool and (protocol != "p2p" or (p.p2p_host and p.p2p_port))
                targets = ([p] if p.can_decode else []) + (decoders if can_hand_off else [])
                sources = [q for q in peers if q.worker.id != p.id and q.peer_tokens > lp.cached]
                sources = sources[: prm.max_sources]
                for d in targets:
                    out.append(self._score(ctx, lp, d))
                    out.extend(self._score(ctx, lp, d, source=q) for q in sources)
                    if conv is not None and d.id != p.id and conv.worker.id != p.id:
                        out.append(self._score(ctx, lp, d, source=conv, reuse=True))
            # A decode worker prefills itself when few tokens are uncached there (Dynamo / vllm-router rule).
            elif p.role == "decode" and (protocol == "none" or ctx.prompt - lp.cached <= prm.pd_split_threshold_tokens):
                out.append(self._score(ctx, lp, p, note="decode worker prefills locally"))
            if limit is not None:
                for o in out[start:]:  # ranks are >= scores, so the bounds stay lower bounds
                    if len(kth) < limit:
                        heapq.heappush(kth, -o.rank)
                    elif o.rank < -kth[0]:
                        heapq.heapreplace(kth, -o.rank)
        return out

    def _conversation_source(self, ctx: _Ctx) -> _Local | None:
        """The previous turn's decoder as a source of the reusable tokens (nixl bidirectional reuse)."""
        req = ctx.request
        if (
            self.params.kv_protocol != "nixl"
            or req.conversation_worker not in ctx.locals
            or req.conversation_reusable_tokens < max(1, self.params.kv_recompute_threshold)
        ):
            return None
        holder = ctx.locals[req.conversation_worker or ""]
        return dataclasses.replace(holder, peer_tokens=min(ctx.cap, req.conversation_reusable_tokens))

    def _queue_s(self, w: WorkerView) -> float:
        """Work ahead of a new request on ``w``.

        The newest ``inflight`` requests this policy sent there and has not heard back about are what is
        outstanding (older ones finished unreported). Replayed as a FIFO queue from the times they were
        sent, with their predicted service times, they say when the worker will be free. Work it cannot
        replay counts by calibrated service time: in full for requests the router has in flight or the
        engine reports *waiting*, at ``unknown_running_weight`` for the rest of the engine's *running*
        count. Those are other clients' requests or, far more often, a scrape older than our own
        finished requests; either way most running requests are decoding, which delays a new prefill
        little (continuous batching), and counting them as full prefills sent sessions away from the
        worker holding their history for a queue that was not there.
        """
        pending = self._pending.get(w.id)
        known = 0.0
        own = 0
        if pending:
            while len(pending) > w.load:  # finished, outcome not (yet) reported
                pending.popitem(last=False)
            now = self.calibrator.now()
            free_at = float("-inf")
            for sent, service, _ in pending.values():
                free_at = max(free_at, sent) + service
            known = max(0.0, free_at - now)
            own = len(pending)
        sent_unknown = max(0, w.inflight - own)
        scraped = max(0, w.running + w.waiting - max(w.inflight, own))
        waiting = min(scraped, w.waiting)
        unknown = sent_unknown + waiting + (scraped - waiting) * self.params.unknown_running_weight
        return (known + unknown * self.calibrator.service_time(w.id)) / self.params.queue_parallelism

    def _waits(self, w: WorkerView, request: RouteRequest, gpu_cached_tokens: int) -> tuple[float, float]:
        """``(queue including the KV-space wait, the KV-space wait)`` on ``w`` for this request."""
        queue = self._queue_s(w)  # first: it drops finished requests from the replay the KV term reads
        kv_wait = self._kv_wait_s(w, self._blocks_needed(request, gpu_cached_tokens))
        return queue + kv_wait, kv_wait

    @staticmethod
    def _blocks_needed(request: RouteRequest, gpu_cached_tokens: int) -> int:
        """New KV blocks the engine must allocate to admit the request: prompt + output, minus GPU hits."""
        block = max(1, request.block_size)
        total = -(-((request.prompt_tokens or 0) + (request.max_tokens or 0)) // block)
        return max(0, total - gpu_cached_tokens // block)

    def _kv_wait_s(self, w: WorkerView, needed: int) -> float:
        """Expected wait until ``needed`` KV blocks are free on ``w`` (0 when they already are).

        Used blocks are the larger of the scraped usage and what this policy's outstanding requests hold
        (the scrape lags). A request holds its blocks for about ``hold`` seconds, released at spread-out
        times, so freeing a shortfall of ``s`` of ``used`` blocks takes about ``hold x s / used``. vLLM's
        scheduler admits first come, first served once blocks are free: without this term a worker
        holding a session's history looks free while its cache cannot take the next long turn.
        """
        capacity = w.kv_blocks
        if not capacity or needed <= 0 or needed > capacity:  # unknown size, or the engine will refuse
            return 0.0
        pending = self._pending.get(w.id)
        own = sum(blocks for _, _, blocks in pending.values()) if pending else 0
        used = min(float(capacity), max(w.kv_usage * capacity, float(own)))
        free = capacity - used
        if needed <= free or used <= 0:
            return 0.0
        hold = self._hold_s.get(w.id, self.params.default_hold_s)
        return hold * min(needed - free, used) / used

    # -- the cost of one candidate ------------------------------------------------------------------

    def _still_there(self, worker: WorkerView | None, tier: str, ratio: float) -> float:
        prob = self.params.still_there.get(tier, 1.0) * ratio
        if tier == "GPU" and worker is not None:
            pressure = max(0.0, min(1.0, (worker.kv_usage - 0.9) / 0.1))
            prob *= 1.0 - self.params.kv_pressure_decay * pressure
        return max(0.0, min(1.0, prob))

    def _score(
        self, ctx: _Ctx, lp: _Local, d: WorkerView, *, source: _Local | None = None, reuse: bool = False, note: str = ""
    ) -> _Option:
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
            handoff = prm.handoff_s + self._transfer_s(ctx, ctx.prompt, p.id, d.id)
            decode_queue = d.load * prm.decode_queue_s_per_request
            moved += ctx.prompt * bpt
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
        )
        score = sum(terms[:7])
        # Cached tokens this plan leaves behind on the worker holding the most: their recompute is
        # certain, the queue it avoids is an estimate from lagging load signals.
        left_behind = max(0.0, ctx.best_local - cached_exp)
        rank = score + left_behind * per_token * prm.affinity_weight
        return _Option(
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

    def _transfer_s(self, ctx: _Ctx, tokens: float, src: str, dst: str) -> float:
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

    @staticmethod
    def _materialise(ctx: _Ctx, o: _Option) -> CandidatePlan:
        bd = dict(zip(_TERM_NAMES, o.terms, strict=True))
        bd["total_s"] = o.score
        bd["affinity_penalty_s"] = o.rank - o.score
        bd["reuse_conversation"] = 1.0 if o.reuse else 0.0
        bd["kv_space_wait_s"] = o.p.kv_wait_s  # included in queue_s
        if not bd["tokens_REMOTE"]:
            del bd["tokens_REMOTE"]
        for tier, n in o.p.tokens.items():
            bd[f"tokens_{tier}"] = float(n)
        kind = "aggregated" if o.d.id == o.p.worker.id else "P/D"
        if o.reuse and o.source is not None:
            kind += f" + conversation KV from {o.source.worker.id}"
        elif o.source is not None:
            kind += f" + kv from {o.source.worker.id}"
        return CandidatePlan(
            prefill=o.p.worker.id,
            decode=o.d.id,
            kv_source=o.source.worker.id if o.source is not None and not o.reuse else None,
            score=o.rank,
            breakdown=bd,
            predicted_cached_tokens=o.cached,
            note=f"{kind}{'; ' + o.note if o.note else ''}",
        )

    # -- the plan ------------------------------------------------------------------------------------

    def _plan(self, ctx: _Ctx, ranked: list[_Option], shown: list[CandidatePlan]) -> RoutePlan:
        best = shown[0]
        load_tiers: list[dict[str, str]] | None = None
        max_offload: int | None = None
        if self.params.kv_protocol == "p2p":
            load_tiers, max_offload = self.tiers.apply(ctx.request, with_source=best.kv_source is not None)
        return RoutePlan(
            prefill=best.prefill,
            decode=best.decode,
            kv_source=best.kv_source,
            kv_load_tiers=load_tiers,
            max_offload_tokens=max_offload,
            predicted_cached_tokens=best.predicted_cached_tokens,
            predicted_ttft_s=best.breakdown["total_s"],
            predicted_by_tier=self._tier_tokens(best),
            reuse_conversation=ranked[0].reuse,
            reason=self._reason(ctx, best, ranked),
            breakdown=dict(best.breakdown),
            candidates=shown,
            policy=self.name,
        )

    @staticmethod
    def _tier_tokens(best: CandidatePlan) -> dict[str, int]:
        return {k[len("tokens_") :]: int(v) for k, v in best.breakdown.items() if k.startswith("tokens_")}

    @staticmethod
    def _reason(ctx: _Ctx, best: CandidatePlan, ranked: list[_Option]) -> str:
        bd = best.breakdown
        text = (
            f"best plan, predicted TTFT {bd['total_s'] * 1000:.1f} ms ({best.note}): "
            f"{best.predicted_cached_tokens}/{ctx.prompt} tokens cached, "
            f"queue {bd['queue_s'] * 1000:.1f} ms"
            + (f" (KV space {bd['kv_space_wait_s'] * 1000:.1f} ms)" if bd.get("kv_space_wait_s") else "")
            + ", "
            f"prefill {bd['prefill_s'] * 1000:.1f} ms"
        )
        if len(ranked) > 1:
            runner = ranked[1]
            gap_ms = (runner.rank - best.score) * 1000
            text += f"; next {runner.p.worker.id}->{runner.d.id} ranked +{gap_ms:.1f} ms behind"
        holder = max(ctx.locals.values(), key=lambda lw: (lw.cached, -lw.queue_s))
        if holder.cached > best.predicted_cached_tokens:
            text += (
                f"; load overrides affinity: {holder.worker.id} holds {holder.cached} tokens "
                f"but waits {holder.queue_s * 1000:.1f} ms"
            )
        return text
