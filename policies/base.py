"""The policy contract: what a policy is told, and the plan it must answer with.

Policies never do I/O. The router gathers the facts (healthy workers and their load, the index's
prefix matches when the policy asks for them) into a :class:`RouteRequest`, calls
:meth:`Policy.choose`, and carries the :class:`RoutePlan` out. After the answer it reports a
:class:`RouteOutcome` so policies that learn (the cost model) can calibrate. :meth:`Policy.explain`
is the same decision as a dry run (``/admin/route/explain``): it must leave the policy as it found it.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from kvroute.indexer.backend import WorkerMatch
from kvroute.policies.options import as_float, as_int, refuse_unknown
from kvroute.vocabulary import KVProtocol, Role


@dataclass(slots=True, frozen=True)
class WorkerView:
    """A worker as the policy sees it: identity, role and load (never a connection)."""

    id: str
    role: Role = "both"
    healthy: bool = True
    #: Requests the router has in flight to this worker (fresher than scraped metrics).
    inflight: int = 0
    #: Scraped from the worker's /metrics (vllm:num_requests_running / _waiting / kv_cache_usage_perc).
    running: int = 0
    waiting: int = 0
    #: ``inflight`` when that scrape was taken (None: not known, then ``inflight`` stands for it). What the
    #: engine counted beyond it are other clients' requests; measured against ``inflight`` now instead, our
    #: own requests that finished since the scrape would count as foreign work that is not there.
    scraped_inflight: int | None = None
    kv_usage: float = 0.0
    #: GPU KV-cache size in blocks (vllm:cache_config_info num_gpu_blocks), when the worker reports it.
    kv_blocks: int | None = None
    #: P2P control endpoint (vLLM >= 0.27 TieringOffloadingSpec): host and port peers are told to call.
    p2p_host: str | None = None
    p2p_port: int | None = None
    #: vLLM >= 0.32's scraped ``prompt_tokens_cached_by_source`` (cumulative tokens per source: device, host,
    #: disk, p2p): the engines' ground truth per tier, which calibration compares with the plans' predictions.
    served_by_source: Mapping[str, float] = field(default_factory=dict)

    @property
    def can_prefill(self) -> bool:
        return self.role in ("both", "prefill")

    @property
    def can_decode(self) -> bool:
        return self.role in ("both", "decode")

    @property
    def foreign(self) -> int:
        """Requests the engine held at its last scrape beyond ours then: other clients', other router
        processes' or replicas'. Never our own, counted in ``inflight`` already."""
        ours = self.inflight if self.scraped_inflight is None else self.scraped_inflight
        return max(0, self.running + self.waiting - ours)

    @property
    def load(self) -> int:
        """Outstanding work: what we have in flight plus what the engine holds for others."""
        return self.inflight + self.foreign


@dataclass(slots=True)
class RouteRequest:
    """Facts about one request, gathered by the router before the decision."""

    request_id: str
    model: str
    #: Prompt length in tokens, when the router tokenized it (policies that need the index ask for it).
    prompt_tokens: int | None = None
    block_size: int = 16
    #: Index view: per worker, how much of the prompt's prefix it holds (empty when not looked up).
    matches: dict[str, WorkerMatch] = field(default_factory=dict)
    #: Prompt text (for text-approximate policies); None when the policy did not ask for it.
    prompt_text: str | None = None
    #: Latency class from the X-KVRoute-Latency-Class header or config ("interactive" | "batch" | ...).
    latency_class: str = "interactive"
    #: Tokens of the prompt the conversation store can offer from a previous turn's decoder.
    conversation_reusable_tokens: int = 0
    conversation_worker: str | None = None
    #: The prompt's block keys (chained: key i names blocks 0..i), when the index was consulted.
    block_keys: Sequence[int] | None = None
    #: Length of the prompt that is shared with other requests (system prompt, tools), when known.
    shared_prefix_tokens: int | None = None
    max_tokens: int | None = None


@dataclass(slots=True)
class CandidatePlan:
    """One option the policy weighed, with its estimated cost breakdown (for /admin/route/explain)."""

    prefill: str
    decode: str
    kv_source: str | None = None
    score: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    predicted_cached_tokens: int = 0
    note: str = ""


@dataclass(slots=True)
class RoutePlan:
    """The decision: who prefills, who decodes, whether a peer serves cached blocks, and why."""

    prefill: str
    decode: str
    kv_source: str | None = None
    #: Per-request tier policy (vLLM offloading connector): None = do not send the key.
    kv_load_tiers: list[dict[str, str]] | None = None
    max_offload_tokens: int | None = None
    #: Cap on the tokens the engine may load from secondary tiers (vLLM's ``max_load_tokens``); None = no cap.
    max_load_tokens: int | None = None
    predicted_cached_tokens: int = 0
    predicted_ttft_s: float | None = None
    #: Predicted cached tokens per source tier ("GPU", "CPU", "STORAGE", "REMOTE").
    predicted_by_tier: dict[str, int] = field(default_factory=dict)
    #: Use the conversation store's kv_transfer_params from the previous turn.
    reuse_conversation: bool = False
    #: Why this plan won: the text, or a function that writes it (the cost model's reason is formatted only
    #: when somebody reads it: the debug log, explain, a debug header). Read it with :meth:`why`.
    reason: str | Callable[[], str] = ""
    breakdown: dict[str, float] = field(default_factory=dict)
    #: The best candidates, best first (a lazily shown sequence from the cost model).
    candidates: Sequence[CandidatePlan] = field(default_factory=list)
    policy: str = ""

    @property
    def disaggregated(self) -> bool:
        return self.prefill != self.decode

    def why(self) -> str:
        """The reason as text (written once, on the first read)."""
        if callable(self.reason):
            self.reason = self.reason()
        return self.reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "prefill": self.prefill,
            "decode": self.decode,
            "kv_source": self.kv_source,
            "kv_load_tiers": self.kv_load_tiers,
            "max_offload_tokens": self.max_offload_tokens,
            "max_load_tokens": self.max_load_tokens,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "predicted_ttft_s": self.predicted_ttft_s,
            "predicted_by_tier": self.predicted_by_tier,
            "reuse_conversation": self.reuse_conversation,
            "reason": self.why(),
            "breakdown": self.breakdown,
            "candidates": [
                {
                    "prefill": c.prefill,
                    "decode": c.decode,
                    "kv_source": c.kv_source,
                    "score": c.score,
                    "breakdown": c.breakdown,
                    "predicted_cached_tokens": c.predicted_cached_tokens,
                    "note": c.note,
                }
                for c in self.candidates
            ],
        }


@dataclass(slots=True)
class RouteOutcome:
    """What happened: reported back to the policy after the answer (for online calibration)."""

    request_id: str
    model: str
    plan: RoutePlan
    prompt_tokens: int
    #: usage.prompt_tokens_details.cached_tokens reported by the engine (None when absent).
    cached_tokens: int | None
    ttft_s: float | None
    ok: bool = True
    #: A split plan's prefill leg: seconds from the request's arrival to the prefiller's answer (None when
    #: the plan had no separate prefill leg). The rest of ``ttft_s`` is the handoff and the decoder's work.
    prefill_leg_s: float | None = None
    #: The prefill leg's own ``cached_tokens`` (its worker's cache hit; None when not split or not reported).
    #: A split answer's ``cached_tokens`` also counts the KV its decoder pulled from the prefiller.
    prefill_leg_cached_tokens: int | None = None

    @property
    def prefill_cached_tokens(self) -> int | None:
        """What the engine that ran the prefill had cached: the prefill leg's figure on a split plan."""
        if self.plan.prefill != self.plan.decode:
            return self.prefill_leg_cached_tokens
        return self.cached_tokens


@dataclass(slots=True, frozen=True)
class ModelFigures:
    """One model's compute and size figures, in the one shape they keep from the config
    (``ModelConfig``) through :class:`PoolContext` to the cost model (``CostParams.model``)."""

    #: Uncached prompt tokens one worker prefills per second (short context).
    prefill_tokens_per_s: float = 10_000.0
    #: Extra seconds per uncached token per 1k tokens of context it attends to (the quadratic part).
    attention_coeff_s: float = 0.0
    #: KV bytes per token: 2 x layers x kv_heads x head_dim x dtype bytes (Qwen3-32B bf16: 262144).
    bytes_per_token: int = 131_072
    #: Seconds per KV block moved between workers on top of bytes / bandwidth: NIXL posts one descriptor
    #: per layer x (K, V) x block when blocks are not contiguous (~2.4 us each measured on EFA, so
    #: ~0.3 ms per block for a 64-layer model). 0 = transfers cost bytes / bandwidth only.
    transfer_per_block_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0 or not self.bytes_per_token > 0:
            raise ValueError("prefill_tokens_per_s and bytes_per_token must be > 0")
        if self.attention_coeff_s < 0 or self.transfer_per_block_s < 0:
            raise ValueError("attention_coeff_s and transfer_per_block_s must be >= 0")

    @classmethod
    def from_mapping(cls, figures: Mapping[str, object], base: ModelFigures | None = None) -> ModelFigures:
        """``base`` (else the defaults) with the figures a config mapping names; unknown keys are refused.

        Policy options name per-model figures as partial mappings (``{"m": {"prefill_tokens_per_s": ...}}``).
        """
        base = base if base is not None else cls()
        refuse_unknown("model figure", figures, _FIGURE_NAMES)
        get = figures.get
        return cls(
            prefill_tokens_per_s=as_float(
                get("prefill_tokens_per_s", base.prefill_tokens_per_s), "prefill_tokens_per_s"
            ),
            attention_coeff_s=as_float(get("attention_coeff_s", base.attention_coeff_s), "attention_coeff_s"),
            bytes_per_token=as_int(get("bytes_per_token", base.bytes_per_token), "bytes_per_token"),
            transfer_per_block_s=as_float(
                get("transfer_per_block_s", base.transfer_per_block_s), "transfer_per_block_s"
            ),
        )


_FIGURE_NAMES = frozenset(f.name for f in fields(ModelFigures))


@dataclass(slots=True, frozen=True)
class PoolContext:
    """What the router knows about the pool that a policy may use: per-model cost figures from the
    config, and the pool's KV-transfer protocol (which plans can be carried out at all)."""

    models: Mapping[str, ModelFigures] = field(default_factory=dict)
    kv_protocol: KVProtocol = "none"
    kv_recompute_threshold: int = 64
    #: The KV link between workers, when the config states it (None: the policy's own default).
    link_bytes_per_s: float | None = None
    transfer_setup_s: float | None = None

    def __post_init__(self) -> None:
        # Plain mappings of figures (the shape composition roots used to build) are still taken.
        untyped: Mapping[str, object] = self.models
        if any(not isinstance(f, ModelFigures) for f in untyped.values()):
            typed = {name: _figures(name, f) for name, f in untyped.items()}
            object.__setattr__(self, "models", typed)


def _figures(name: str, figures: object) -> ModelFigures:
    if isinstance(figures, ModelFigures):
        return figures
    if not isinstance(figures, Mapping):
        raise ValueError(f"models[{name!r}] must be ModelFigures or a mapping of figures, got {figures!r}")
    try:
        return ModelFigures.from_mapping(figures)
    except ValueError as exc:
        raise ValueError(f"models[{name!r}]: {exc}") from None


class NoWorkerError(RuntimeError):
    """No worker can take the request (none healthy, or none with the needed role)."""


class Policy(ABC):
    """A routing policy. Subclasses set ``name`` and implement :meth:`choose`; policies with state
    (counters, trees, learnt estimates) also implement :meth:`explain` without touching it.

    ``options`` are config values (``policy_options``: YAML/JSON scalars, lists, mappings); each
    policy checks the ones it knows and refuses the rest with a ``ValueError``.
    """

    name: ClassVar[str] = ""
    #: The router tokenizes the prompt and looks the prefix up in the index only for policies asking.
    needs_index: ClassVar[bool] = False
    #: The router passes the prompt text (for text-approximate policies).
    needs_text: ClassVar[bool] = False

    def __init__(self, **options: object) -> None:
        self.options = options

    @classmethod
    def for_pool(cls, pool: PoolContext, **options: object) -> Policy:
        """Build the policy for a pool. Policies that use the pool's facts override this."""
        return cls(**options)

    @abstractmethod
    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """Pick a plan among ``workers`` (all healthy, serving the model); NoWorkerError if none fits."""

    def explain(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """A dry run: the plan :meth:`choose` would return now, with every candidate the policy weighed,
        changing no policy state (the next ``choose`` is as if this call never happened).

        The default runs ``choose`` on a deep copy, which is right for any policy whose state copies;
        the built-in policies override it with a read-only path.
        """
        return copy.deepcopy(self).choose(request, workers)

    def observe(self, outcome: RouteOutcome) -> None:  # noqa: B027 - optional hook
        """Learn from an outcome. The default ignores it."""


def split_roles(workers: Sequence[WorkerView]) -> tuple[list[WorkerView], list[WorkerView]]:
    """Prefill-capable and decode-capable workers; raises NoWorkerError when either side is empty."""
    prefill = [w for w in workers if w.healthy and w.can_prefill]
    decode = [w for w in workers if w.healthy and w.can_decode]
    if not prefill or not decode:
        raise NoWorkerError("no healthy worker for this model" if not workers else "no worker with the needed role")
    return prefill, decode
