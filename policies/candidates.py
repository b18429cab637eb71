"""Candidate plans of the ``kvaware`` policy: which plans are worth weighing, and how one is shown.

A plan is a prefill worker, a decode worker and optionally a source of cached KV (a P2P peer, or the
previous turn's decoder for conversation reuse). :func:`candidates` enumerates them for one request from
the per-worker terms in a :class:`Context` and scores each through the policy's cost function
(:class:`Scorer`); :func:`materialise` turns the few that are shown into
:class:`~kvroute.policies.base.CandidatePlan`. Apart from the cost terms (:mod:`kvroute.policies.cost`)
because which plans exist is a question of roles, protocol and tier policy, not of time.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Protocol, overload

from kvroute.indexer.backend import WorkerMatch
from kvroute.policies.base import CandidatePlan, ModelFigures, RouteRequest, WorkerView
from kvroute.policies.cost_params import CostParams

#: The order of ``Option.terms``; the first seven add up to the predicted TTFT. ``handoffs_held_s`` is part of
#: the rank only: the first-token wait a decoder's own prefill adds to the handoffs due there meanwhile.
TERM_NAMES = (
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
    "handoffs_held_s",
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
    return LocalRun() if match is None else LocalRun(*usable_blocks(match, allow_storage, allow_remote))


def usable_blocks(match: WorkerMatch, allow_storage: bool, allow_remote: bool) -> tuple[int, int, int]:
    """:func:`usable_run` as a plain ``(gpu, cpu, storage)`` tuple: the form the cost model reads once per
    worker and request, spared the frozen dataclass."""
    gpu, cpu, storage = max(0, match.gpu), max(0, match.cpu), max(0, match.storage)
    if not allow_remote:
        cut = min(max(0, match.remote), gpu + cpu + storage)
        from_storage = min(cut, storage)
        storage -= from_storage
        cpu -= min(cut - from_storage, cpu)
    if not allow_storage:
        storage = 0
    return gpu, cpu, storage


@dataclass(slots=True)
class WorkerTerms:
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
    #: Requests sent to this worker lately, as ``QueueModel.traffic_order``: the tie-break between equally
    #: ranked plans.
    traffic: float = -math.inf
    #: A decode worker's split plans still in their prefill leg: seconds until each one's KV arrives.
    handoffs_due: tuple[float, ...] = ()


@dataclass(slots=True)
class Option:
    """A candidate scored cheaply; turned into a CandidatePlan only when it is shown."""

    score: float
    #: What plans are ranked by: the score plus the affinity penalty (see ``CostParams.affinity_weight``).
    rank: float
    p: WorkerTerms
    d: WorkerView
    source: WorkerTerms | None
    reuse: bool
    cached: int
    terms: tuple[float, ...]
    note: str = ""

    def key(self) -> tuple[float, bool, bool, float, int, str, str, str]:
        """Best first; ties go to aggregated, then sourceless plans, then to the worker sent the least traffic
        lately, then the less loaded, then by ids."""
        return (
            self.rank,
            self.p.worker.id != self.d.id,
            self.source is not None,
            self.p.traffic,
            self.p.worker.load,
            self.p.worker.id,
            self.d.id,
            self.source.worker.id if self.source else "",
        )


@dataclass(slots=True)
class Context:
    """One request as the cost model sees it: its size, its model's figures, every worker's terms."""

    request: RouteRequest
    model: ModelFigures
    prompt: int
    cap: int
    scale: float
    locals: dict[str, WorkerTerms]
    #: The most expected cached tokens any worker holds locally (what leaving the holder gives up).
    best_local: float = 0.0
    #: The share of the affinity penalty this request's prefix carries: 1 for a prefix nobody else used
    #: lately (a session's own history), 1 / (1 + n) for one n other recent requests ended on.
    affinity_share: float = 1.0
    #: The share of the other prefill-capable workers with work ahead (``CostParams.affinity_by_load``):
    #: the affinity penalty is scaled by it, but not below ``affinity_floor_s`` (1.0 when not scaled).
    affinity_load: float = 1.0
    #: The calibrated TTFT error: leaving the holder must gain at least that much (when scaled by load).
    affinity_floor_s: float = 0.0
    #: Whether a plan may name a ``remote_kv_source`` peer (P2P pool, tier policy allows it).
    allow_sources: bool = False
    #: Seconds a prefill -> decode handoff takes beyond the configured figures (learnt from split answers).
    handoff_extra: float = 0.0


class Scorer(Protocol):
    """The policy's cost of one plan (``KvAwarePolicy._score``)."""

    def __call__(
        self,
        ctx: Context,
        lp: WorkerTerms,
        d: WorkerView,
        *,
        source: WorkerTerms | None = None,
        reuse: bool = False,
        note: str = "",
        stalls: bool = False,
    ) -> Option: ...


def candidates(
    ctx: Context, healthy: list[WorkerView], limit: int | None, prm: CostParams, score: Scorer
) -> list[Option]:
    """Every plan worth weighing. With a ``limit``, prefill workers are visited by a lower bound of
    their cost (queue + prefill of what no source could supply) and the visit stops once that bound
    cannot beat the ``limit``-th best plan found: the best ``limit`` plans are still exact."""
    protocol = prm.kv_protocol
    # Separate prefill and decode need a transfer protocol; P2P decoders pull from the prefiller's port.
    split_pool = protocol != "none" and any(w.role != "both" for w in healthy)
    decoders = [w for w in healthy if w.role == "decode"] if split_pool else []
    peers = _peers(ctx, prm)
    conv = conversation_source(ctx, prm)
    kth: list[float] = []  # the `limit` best scores so far, negated (a max-heap)
    out: list[Option] = []
    for bound, p in _visit_order(ctx, healthy, peers, conv):
        if limit is not None and len(kth) >= limit and bound >= -kth[0]:
            break
        lp = ctx.locals[p.id]
        start = len(out)
        if p.can_prefill:
            can_hand_off = split_pool and (protocol != "p2p" or (p.p2p_host and p.p2p_port))
            whole = p.can_decode or (split_pool and prm.pd_prefill_decodes)
            targets = ([p] if whole else []) + (decoders if can_hand_off else [])
            sources = [q for q in peers if q.worker.id != p.id and q.peer_tokens > lp.cached][: prm.max_sources]
            for d in targets:
                out.append(score(ctx, lp, d))
                out.extend(score(ctx, lp, d, source=q) for q in sources)
                if conv is not None and d.id != p.id and conv.worker.id != p.id:
                    out.append(score(ctx, lp, d, source=conv, reuse=True))
        # A decode worker prefills itself when few tokens are uncached there (Dynamo / vllm-router rule),
        # or, conditional disaggregation, when that beats the prefill workers' queues despite the stall
        # of the decodes it runs (ranked in the score).
        elif p.role == "decode":
            if protocol == "none" or ctx.prompt - lp.cached <= prm.pd_split_threshold_tokens:
                out.append(score(ctx, lp, p, note="decode worker prefills locally"))
            elif prm.pd_local_prefill:
                out.append(score(ctx, lp, p, note="decode worker prefills locally (prefill busy)", stalls=True))
        if limit is not None:
            for o in out[start:]:  # ranks are >= scores, so the bounds stay lower bounds
                if len(kth) < limit:
                    heapq.heappush(kth, -o.rank)
                elif o.rank < -kth[0]:
                    heapq.heapreplace(kth, -o.rank)
    return out


def _peers(ctx: Context, prm: CostParams) -> list[WorkerTerms]:
    """Workers that may serve cached blocks to a peer, holding the most first (none unless the pool and
    the request's tier policy allow sources)."""
    if not (ctx.allow_sources and prm.max_sources > 0):
        return []
    peers = [lw for lw in ctx.locals.values() if lw.worker.p2p_host and lw.worker.p2p_port and lw.peer_tokens > 0]
    peers.sort(key=lambda lw: (-lw.peer_tokens, lw.worker.load, lw.worker.id))
    return peers


def _visit_order(
    ctx: Context, healthy: list[WorkerView], peers: list[WorkerTerms], conv: WorkerTerms | None
) -> list[tuple[float, WorkerView]]:
    """``(lower bound of its plans' cost, worker)`` per worker, lowest bound first (ties: pool order)."""
    reach = max(peers[0].peer_tokens if peers else 0, conv.peer_tokens if conv else 0)
    per_token = ctx.scale / ctx.model.prefill_tokens_per_s
    prompt, locals_ = ctx.prompt, ctx.locals
    bounds = []
    for w in healthy:
        lw = locals_[w.id]
        bounds.append((lw.queue_s + (prompt - max(lw.cached, reach)) * per_token, w))
    bounds.sort(key=itemgetter(0))
    return bounds


def conversation_source(ctx: Context, prm: CostParams) -> WorkerTerms | None:
    """The previous turn's decoder as a source of the reusable tokens (nixl bidirectional reuse)."""
    req = ctx.request
    if (
        prm.kv_protocol != "nixl"
        or req.conversation_worker not in ctx.locals
        or req.conversation_reusable_tokens < max(1, prm.kv_recompute_threshold)
    ):
        return None
    holder = ctx.locals[req.conversation_worker or ""]
    return dataclasses.replace(holder, peer_tokens=min(ctx.cap, req.conversation_reusable_tokens))


class ShownCandidates(Sequence[CandidatePlan]):
    """A plan's best candidates, each turned into its shown form on first read: a decision reads the best
    and perhaps the runner-up (a receipt), ``explain`` reads them all."""

    __slots__ = ("_options", "_shown")

    def __init__(self, options: Sequence[Option]) -> None:
        self._options = options
        self._shown: list[CandidatePlan | None] = [None] * len(options)

    def __len__(self) -> int:
        return len(self._options)

    @overload
    def __getitem__(self, index: int) -> CandidatePlan: ...

    @overload
    def __getitem__(self, index: slice) -> list[CandidatePlan]: ...

    def __getitem__(self, index: int | slice) -> CandidatePlan | list[CandidatePlan]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._options)))]
        shown = self._shown[index]
        if shown is None:
            shown = self._shown[index] = materialise(self._options[index])
        return shown

    def __repr__(self) -> str:
        return repr(list(self))


def materialise(o: Option) -> CandidatePlan:
    """The shown form of a candidate: its breakdown by name, and a note on what kind of plan it is."""
    bd = dict(zip(TERM_NAMES, o.terms, strict=True))
    bd["total_s"] = o.score
    bd["affinity_penalty_s"] = o.rank - o.score - bd["handoffs_held_s"]
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
