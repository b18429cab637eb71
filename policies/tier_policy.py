"""Per-request tier policy: which secondary KV tiers a request may load from, and how much it may offload.

vLLM's offloading connector (>= 0.27) takes two per-request keys in ``kv_transfer_params``:

* ``kv_load_tiers``: the secondary tiers to look in (``[]`` = none; the local CPU tier is always used).
  Reading STORAGE or a REMOTE tier costs latency even on a hit (and a bounded wait on HIT_PENDING), so
  latency-sensitive requests stay on local CPU while batch work may read everything.
* ``max_offload_tokens``: how many of the request's tokens may be written to the secondary tiers.
  Offloading a shared prefix (system prompt, tool definitions) pays off for every later request;
  offloading a private conversation tail mostly fills the tier with blocks nobody else will read.

Both are chosen here from the request's latency class and what is known about its shared prefix. A third
key (vLLM >= 0.32, ``max_load_tokens``: how many tokens the connector may load past the GPU prefix) caps, for
the ``capped_load_classes`` (interactive by default), the loads at what the chosen plan priced in: a hit the
index did not know of (it lags) would otherwise be loaded at a latency nobody weighed; batch classes load
whatever helps. Engines that do not know a key ignore it (the connector reads ``kv_transfer_params`` by key).

A class's tiers bound what the *engine* may look up on its own (a speculative lookup in a remote tier
can wait on HIT_PENDING even when it misses). A ``remote_kv_source`` the router names is different: the
cost model has weighed that fetch (lookup, transfer, the chance the blocks are gone) against recomputing,
and vLLM only reads a peer when the REMOTE tier is allowed. So by default (``planned_sources``) a plan
with a source adds ``{"medium": "CPU", "locality": "REMOTE"}`` for that request alone; with
``planned_sources: false`` classes without a REMOTE tier never get a source (the cost model does not
consider peers for them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kvroute.policies.base import RouteRequest

#: One entry of vLLM's ``kv_load_tiers``: ``{"medium": "CPU" | "STORAGE", "locality": "LOCAL" | "REMOTE"}``
#: (the wire form; :class:`kvroute.vocabulary.Tier` is the index's bit set for the same places).
LoadTier = dict[str, str]

STORAGE_LOCAL: LoadTier = {"medium": "STORAGE", "locality": "LOCAL"}
CPU_REMOTE: LoadTier = {"medium": "CPU", "locality": "REMOTE"}
STORAGE_REMOTE: LoadTier = {"medium": "STORAGE", "locality": "REMOTE"}

_MEDIA = ("CPU", "STORAGE")
_LOCALITIES = ("LOCAL", "REMOTE")

OffloadRule = Literal["shared_prefix", "all", "none"]


def default_classes() -> dict[str, list[LoadTier]]:
    """interactive: local CPU only; standard: + local storage; batch: every tier."""
    return {
        "interactive": [],
        "standard": [dict(STORAGE_LOCAL)],
        "batch": [dict(STORAGE_LOCAL), dict(CPU_REMOTE), dict(STORAGE_REMOTE)],
    }


def validate_tiers(tiers: object) -> list[LoadTier]:
    """A clean copy of a tier list, or ValueError naming the bad entry."""
    if not isinstance(tiers, list):
        raise ValueError(f"kv_load_tiers must be a list, got {type(tiers).__name__}")
    out: list[LoadTier] = []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, dict) or set(tier) != {"medium", "locality"}:
            raise ValueError(f"kv_load_tiers[{i}] must be {{'medium': ..., 'locality': ...}}, got {tier!r}")
        medium, locality = str(tier["medium"]).upper(), str(tier["locality"]).upper()
        if medium not in _MEDIA or locality not in _LOCALITIES:
            raise ValueError(f"kv_load_tiers[{i}]: medium must be CPU|STORAGE and locality LOCAL|REMOTE")
        out.append({"medium": medium, "locality": locality})
    return out


@dataclass(slots=True)
class TierPolicy:
    """Maps a request to ``(kv_load_tiers, max_offload_tokens)``.

    ``classes``: latency class -> allowed secondary tiers; unknown classes use ``default_class``.
    ``offload_rule``: ``shared_prefix`` offloads only the shared prefix (rounded down to whole blocks)
    when it is known, else ``unknown_offload_tokens`` (None = omit the key, the engine offloads all);
    ``all`` never limits; ``none`` sends 0 (never offload).
    ``planned_sources``: a plan naming a ``remote_kv_source`` may read the REMOTE CPU tier whatever the
    class (see the module docstring).
    """

    classes: dict[str, list[LoadTier]] = field(default_factory=default_classes)
    default_class: str = "interactive"
    offload_rule: OffloadRule = "shared_prefix"
    unknown_offload_tokens: int | None = None
    planned_sources: bool = True
    #: Latency classes whose secondary-tier loads are capped at what the plan priced (``max_load_tokens``).
    capped_load_classes: list[str] = field(default_factory=lambda: ["interactive"])

    def __post_init__(self) -> None:
        if not isinstance(self.capped_load_classes, list) or not all(
            isinstance(c, str) for c in self.capped_load_classes
        ):
            raise ValueError(f"capped_load_classes must be a list of class names, got {self.capped_load_classes!r}")
        self.classes = {name: validate_tiers(tiers) for name, tiers in self.classes.items()}
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of {sorted(self.classes)}")
        if self.offload_rule not in get_args(OffloadRule):
            raise ValueError(f"offload_rule must be {'|'.join(get_args(OffloadRule))}, got {self.offload_rule!r}")
        if self.unknown_offload_tokens is not None and self.unknown_offload_tokens < 0:
            raise ValueError("unknown_offload_tokens must be >= 0")

    @classmethod
    def from_options(cls, options: Mapping[str, object] | None) -> TierPolicy:
        """Build from the ``tier_policy`` policy option (a mapping with the field names above)."""
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"tier_policy must be a mapping, got {options!r}")
        # Config values meet typed fields here; __post_init__ checks every one.
        untyped: dict[str, Any] = dict(options or {})
        unknown = set(untyped) - {
            "classes",
            "default_class",
            "offload_rule",
            "unknown_offload_tokens",
            "planned_sources",
            "capped_load_classes",
        }
        if unknown:
            raise ValueError(f"unknown tier_policy options: {sorted(unknown)}")
        if "classes" in untyped:
            classes = untyped["classes"]
            if not isinstance(classes, Mapping):
                raise ValueError(f"tier_policy classes must map latency classes to tier lists, got {classes!r}")
            untyped["classes"] = {**default_classes(), **classes}
        return cls(**untyped)

    def load_tiers(self, latency_class: str) -> list[LoadTier]:
        tiers = self.classes.get(latency_class, self.classes[self.default_class])
        return [dict(t) for t in tiers]

    def allows(self, latency_class: str, medium: str, locality: str = "LOCAL") -> bool:
        """Whether a request of this class may load from ``medium``/``locality`` (local CPU: always)."""
        if medium == "GPU" or (medium == "CPU" and locality == "LOCAL"):
            return True
        return {"medium": medium, "locality": locality} in self.load_tiers(latency_class)

    def allows_source(self, latency_class: str) -> bool:
        """Whether a plan for this class may name a ``remote_kv_source`` peer."""
        return self.planned_sources or self.allows(latency_class, "CPU", "REMOTE")

    def max_offload_tokens(self, request: RouteRequest) -> int | None:
        if self.offload_rule == "all":
            return None
        if self.offload_rule == "none":
            return 0
        shared = request.shared_prefix_tokens
        if shared is None:
            return self.unknown_offload_tokens
        block = max(1, request.block_size)
        shared = max(0, shared)
        if request.prompt_tokens is not None:
            shared = min(shared, request.prompt_tokens)
        return shared // block * block

    def max_load_tokens(self, latency_class: str, planned_load_tokens: int) -> int | None:
        """The cap on secondary-tier loads for a plan that priced ``planned_load_tokens`` of them (None: no cap)."""
        cls = latency_class if latency_class in self.classes else self.default_class
        return max(0, planned_load_tokens) if cls in self.capped_load_classes else None

    def apply(self, request: RouteRequest, with_source: bool = False) -> tuple[list[LoadTier], int | None]:
        """``(kv_load_tiers, max_offload_tokens)``; ``with_source``: the plan reads a peer's CPU tier."""
        tiers = self.load_tiers(request.latency_class)
        if with_source and CPU_REMOTE not in tiers:
            tiers.append(dict(CPU_REMOTE))
        return tiers, self.max_offload_tokens(request)
