"""Parameters of the KV-aware cost model (DESIGN §7), validated from ``create_policy("kvaware", **options)``.

Defaults describe a mid-size model on one modern GPU with a 100 Gb/s network; every figure is an option and
the prefill speed and service time are calibrated online anyway. Units are in the names (``_s``, ``_bytes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_args

from kvroute.policies.base import ModelFigures
from kvroute.vocabulary import KVProtocol

_PROTOCOLS: tuple[str, ...] = get_args(KVProtocol)


def _default_still_there() -> dict[str, float]:
    return {"GPU": 0.95, "CPU": 0.98, "STORAGE": 0.99, "REMOTE": 0.9}


@dataclass(slots=True)
class CostParams:
    """All options of the ``kvaware`` policy. See docs/routing.md for the model they feed."""

    #: Defaults for every model; ``models`` overrides them per model name: complete
    #: :class:`~kvroute.policies.base.ModelFigures` (the pool's config), or a mapping naming some figures
    #: (policy options), the others from these defaults (``transfer_per_block_s``: 0).
    prefill_tokens_per_s: float = 10_000.0
    attention_coeff_s: float = 0.0
    bytes_per_token: int = 131_072
    models: Mapping[str, ModelFigures | Mapping[str, object]] = field(default_factory=dict)
    #: Network bandwidth between workers, bytes/s: per directed link "src->dst", else the default.
    default_bandwidth_bytes_per_s: float = 12.5e9
    link_bandwidth_bytes_per_s: dict[str, float] = field(default_factory=dict)
    #: Fixed cost of one KV transfer between workers (connection and memory registration, the
    #: transfer's handshake), added to every fetch from a peer and every prefill -> decode handoff.
    transfer_setup_s: float = 0.0
    #: Control round trip of a P2P lookup at a peer (HIT/MISS answer) before any byte moves.
    lookup_rtt_s: float = 0.001
    #: Loading offloaded blocks back into GPU memory (PCIe for CPU, NVMe/FS for STORAGE).
    promotion_cpu_bytes_per_s: float = 25e9
    promotion_storage_bytes_per_s: float = 3e9
    #: Fixed cost of a prefill -> decode handoff (request setup, NIXL metadata), plus bytes/bandwidth.
    handoff_s: float = 0.002
    #: Pools with separate roles: a decode worker prefills locally when at most this many tokens are
    #: uncached there (Dynamo's and vllm-router's "skip the prefill worker" rule).
    pd_split_threshold_tokens: int = 512
    #: Conditional disaggregation: above that threshold a decode worker may still prefill locally when the
    #: cost model finds it faster than the prefill workers' queues (they are busy). Its running decodes stall
    #: while it prefills: the plan is ranked with ``decode_stall_weight`` x prefill seconds per decode
    #: stream running there (0 = pure TTFT, ITL ignored; ``pd_local_prefill: false`` = strict roles).
    pd_local_prefill: bool = True
    decode_stall_weight: float = 0.25
    #: Also let a prefill worker serve a whole request (decode there) when that ranks best: the lowest TTFT
    #: of the pool, at the cost of that request's inter-token latency (its decode shares steps with long
    #: prefills) — off by default, the operator's roles say the prefill workers are not for decoding.
    pd_prefill_decodes: bool = False
    #: Probability that a block the index reports is still there when the request arrives, per tier.
    still_there: dict[str, float] = field(default_factory=_default_still_there)
    #: GPU hits on a worker whose KV usage nears 100% are likely evicted first: p *= 1 - decay x pressure.
    kv_pressure_decay: float = 0.5
    #: Queue wait = load x service time / parallelism (service time is calibrated per worker).
    default_service_time_s: float = 0.1
    #: How long a request holds its KV blocks (send to outcome, i.e. prefill + decode) before it has been
    #: measured on a worker; then an EWMA of the observed times. Feeds the wait for KV space.
    default_hold_s: float = 2.0
    queue_parallelism: float = 1.0
    #: Share of a service time counted per request the engine reports running that the router did not
    #: send (or that a stale scrape still shows): most running requests are decoding, not prefilling.
    unknown_running_weight: float = 0.2
    #: Plans are ranked by TTFT + affinity_weight x the recompute time of the cached tokens they leave
    #: behind on the worker holding the most (0 = pure TTFT). Leaving is certain to cost that recompute,
    #: while the queue it avoids is estimated from load signals that lag and calibrated service times
    #: that carry noise; a session should move only for a clear gain (and then keeps moving freely
    #: under real load: the penalty is bounded, the queue term is not).
    affinity_weight: float = 1.0
    #: The recompute left behind costs the fleet that much GPU time, which delays other requests only where
    #: the workers that would take it are busy: the penalty is scaled by the share of the other
    #: prefill-capable workers with work ahead at the moment, but never below the calibrated TTFT error
    #: (a move must gain more than the model's own error; ``calibration.ttft_error_prior_s`` until
    #: measured). False: the whole penalty.
    affinity_by_load: bool = True
    #: Ties between equally ranked plans (above all a prefix nobody holds, on workers with no queue) go to
    #: the worker sent the least traffic lately: a count of the requests routed there, decayed with this
    #: time constant. Where a new prefix lands, its repeats follow; spreading new prefixes by the traffic
    #: the workers already draw keeps one worker from collecting the popular ones (its hits then queue
    #: behind its prefills), which the in-flight count of the moment, the tie-break before, did not.
    traffic_window_s: float = 30.0
    #: How much of that traffic is counted by the KV blocks each request adds (beyond its GPU hits, relative
    #: to the mean request's) rather than one per request: 0 counts requests (where the hits of popular
    #: prefixes go), 1 counts cache space taken (as a text tree's "smallest tree" does, so that no worker
    #: evicts its prefixes for the others' long ones), between blends the two.
    traffic_blocks_share: float = 0.0
    #: TTFT added per request already outstanding on a separate decode worker.
    decode_queue_s_per_request: float = 0.001
    #: The pool's protocol (router config pool.kv_protocol): P2P sources need "p2p",
    #: conversation reuse "nixl".
    kv_protocol: KVProtocol = "none"
    #: Conversation reuse only pays when at least this many tokens are reusable (vLLM's default: 64).
    kv_recompute_threshold: int = 64
    #: How many peers (those holding the most of the prefix) are weighed as kv sources per prefill worker.
    max_sources: int = 3
    #: Requests remembered per worker for the queue estimate (a bound against lost outcomes; 0 turns the
    #: replay off and the queue term becomes load x calibrated service time).
    max_pending: int = 4096
    #: Candidates kept in the plan for /admin/route/explain (best first).
    explain_limit: int = 8
    #: Online calibration (EWMA weight, stale tolerance, window) and the tier policy (tier_policy.TierPolicy).
    calibrate: bool = True
    calibration: dict[str, object] = field(default_factory=dict)
    tier_policy: dict[str, object] = field(default_factory=dict)
    #: ``models`` resolved, and the figures of any other model (built in ``__post_init__``).
    _figures: dict[str, ModelFigures] = field(init=False, repr=False, default_factory=dict)
    _default_figures: ModelFigures = field(init=False, repr=False, default_factory=ModelFigures)

    def __post_init__(self) -> None:
        for name in (
            "prefill_tokens_per_s",
            "default_bandwidth_bytes_per_s",
            "promotion_cpu_bytes_per_s",
            "promotion_storage_bytes_per_s",
            "queue_parallelism",
            "traffic_window_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in (
            "attention_coeff_s",
            "lookup_rtt_s",
            "handoff_s",
            "transfer_setup_s",
            "kv_pressure_decay",
            "default_service_time_s",
            "default_hold_s",
            "decode_queue_s_per_request",
            "unknown_running_weight",
            "affinity_weight",
            "pd_split_threshold_tokens",
            "decode_stall_weight",
            "kv_recompute_threshold",
            "traffic_blocks_share",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for flag in ("pd_local_prefill", "pd_prefill_decodes", "affinity_by_load"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.bytes_per_token <= 0:
            raise ValueError("bytes_per_token must be > 0")
        if self.traffic_blocks_share > 1:
            raise ValueError(f"traffic_blocks_share must be within [0, 1], got {self.traffic_blocks_share!r}")
        if self.kv_protocol not in _PROTOCOLS:
            raise ValueError(f"kv_protocol must be {'|'.join(_PROTOCOLS)}, got {self.kv_protocol!r}")
        if self.max_sources < 0 or self.explain_limit < 1 or self.max_pending < 0:
            raise ValueError("max_sources and max_pending must be >= 0 and explain_limit >= 1")
        merged = _default_still_there()
        merged.update({k.upper(): float(v) for k, v in self.still_there.items()})
        if any(not 0 <= v <= 1 for v in merged.values()):
            raise ValueError("still_there probabilities must be within [0, 1]")
        self.still_there = merged
        for link, bw in self.link_bandwidth_bytes_per_s.items():
            if "->" not in link or not bw > 0:
                raise ValueError(f"link_bandwidth_bytes_per_s[{link!r}] must be keyed 'src->dst' and > 0")
        self._default_figures = ModelFigures(
            prefill_tokens_per_s=float(self.prefill_tokens_per_s),
            attention_coeff_s=float(self.attention_coeff_s),
            bytes_per_token=int(self.bytes_per_token),
        )
        self._figures = {name: self._resolve(name, figures) for name, figures in self.models.items()}

    def _resolve(self, name: str, figures: object) -> ModelFigures:
        if isinstance(figures, ModelFigures):
            return figures
        if not isinstance(figures, Mapping):
            raise ValueError(f"models[{name!r}] must be a mapping of figures, got {figures!r}")
        try:
            return ModelFigures.from_mapping(figures, self._default_figures)
        except ValueError as exc:
            raise ValueError(f"models[{name!r}]: {exc}") from None

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> CostParams:
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown kvaware options {sorted(unknown)}; known: {sorted(known)}")
        # Config values meet typed fields here; __post_init__ checks every one it relies on.
        untyped: dict[str, Any] = dict(options)
        return cls(**untyped)

    def model(self, name: str) -> ModelFigures:
        """The figures of model ``name`` (the defaults for a model without its own)."""
        return self._figures.get(name, self._default_figures)

    def bandwidth(self, src: str, dst: str) -> float:
        if not self.link_bandwidth_bytes_per_s:  # the common case: skip building the key
            return self.default_bandwidth_bytes_per_s
        return self.link_bandwidth_bytes_per_s.get(f"{src}->{dst}", self.default_bandwidth_bytes_per_s)
