"""Everything one simulated worker can be told (defaults mirror vLLM's where vLLM has one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvroute.sim.events import EventFields
from kvroute.sim.presets import Preset, get_preset
from kvroute.vocabulary import Role


@dataclass(slots=True)
class WorkerOptions:
    preset: Preset = field(default_factory=lambda: get_preset("llama-8b-h100"))
    #: Served model name (default: the preset's model).
    model: str | None = None
    worker_id: str | None = None
    role: Role = "both"
    host: str = "127.0.0.1"
    #: 0 = any free port.
    http_port: int = 0
    #: Model seconds x time_scale = real seconds slept (0.05 makes everything 20x faster).
    time_scale: float = 1.0
    # -- KV events (DESIGN §4) --
    #: "bind" (default: tcp://host:events_port, the router connects), "connect" (to ``events_endpoint``,
    #: a router-bound SUB; the topic tells workers apart) or "auto" (vLLM's rule on ``events_endpoint``).
    events_mode: Literal["bind", "connect", "auto"] = "bind"
    events_endpoint: str | None = None
    events_port: int = 0
    topic: str = ""
    replay: bool = True
    replay_port: int = 0
    replay_with_topic: bool = True
    buffer_steps: int = 10_000
    hwm: int = 100_000
    event_form: Literal["map", "array"] = "map"
    self_describing_events: bool = True
    #: "legacy" (the shared encoder: every base field, None included) or "0.33" (vLLM 0.33's msgspec
    #: encoding: optional fields only when set, plus ``kv_cache_spec_*``, ``ownership``, ``session_id``,
    #: ``lookahead_token_ids``). The three options below need "0.33" and select it when set.
    event_fields: EventFields = "legacy"
    #: vLLM's ``num_hash_lookahead_tokens`` (EAGLE: 1): each block's hash also covers the next L tokens, so
    #: a block is cached and published only once they exist; 0 = plain hashes. vLLM keeps plain hashes
    #: when a KV connector is configured, so a CPU tier (the offloading connector) turns it off here too.
    hash_lookahead_tokens: int = 0
    #: A hybrid model: a second KV-cache group (``group_idx`` 1) of sliding-window attention over this
    #: many tokens beside the full-attention group 0; a prefix hit needs the window's blocks in group 1.
    hybrid_sliding_window: int | None = None
    #: ``ownership`` stamped on the CPU tier's events (a secondary offloading tier, e.g. "kvcr").
    offload_ownership: str | None = None
    # -- cache --
    hash_seed: int | None = None
    hash_bytes: bool = False
    # -- data parallelism --
    #: Data-parallel ranks behind the one HTTP port: each its own engine, cache, KV-event publisher
    #: (events/replay port + rank, own sequence numbers) and P2P port (+ rank).
    dp_size: int = 1
    #: Port 0 with several ranks: False = one free consecutive range (rank n at port + n, what a router
    #: configured with one endpoint and ``dp_size`` expects); True = each rank its own ephemeral port, as
    #: vLLM's ``tcp://*:0`` does.
    dp_ephemeral_ports: bool = False
    # -- admission control (vLLM >= 0.32, enforced by the API server over all ranks) --
    #: ``--max-num-queued-reqs``: unfinished requests (waiting + running) the server holds; None = no limit.
    max_num_queued_reqs: int | None = None
    #: ``--max-num-queued-tokens``: prompt tokens of requests still in prefill; None = no limit.
    max_num_queued_tokens: int | None = None
    # -- tokenizer --
    tokenizer: str | None = None
    chat_template: str | None = None
    # -- KV transfer (DESIGN §6) --
    p2p_port: int = 0
    kv_lease_s: float = 480.0
    decoder_kv_blocks_ttl: float = 480.0
    bidirectional_kv_xfer: bool = True
    kv_recompute_threshold: int = 64
    #: Bounded wait on HIT_PENDING (model seconds), poll interval, RETRY budget, provider concurrency.
    p2p_pending_timeout_s: float = 10.0
    p2p_poll_s: float = 0.02
    p2p_max_retries: int = 3
    p2p_max_concurrent_transfers: int = 16
    control_timeout_s: float = 2.0
    # -- API --
    #: vLLM's ``--enable-scale-out``: the ``/v1/*/render`` routes; without it they answer 403, as vLLM's.
    enable_scale_out: bool = False
    default_max_tokens: int = 16
    default_chat_max_tokens: int = 128
    #: Decode steps shorter than this (real seconds) are slept together: keeps 16 workers on 2 cores cheap.
    stream_chunk_s: float = 0.002
    batch_chunk_s: float = 0.02

    @property
    def model_name(self) -> str:
        return self.model or self.preset.model

    def scaled(self, model_seconds: float) -> float:
        return model_seconds * self.time_scale

    @property
    def events_v033(self) -> bool:
        """Whether events are encoded as vLLM 0.33 does (asked for, or needed by a 0.33-only field)."""
        return (
            self.event_fields == "0.33"
            or self.hash_lookahead_tokens > 0
            or self.hybrid_sliding_window is not None
            or self.offload_ownership is not None
        )

    def check(self) -> None:
        """Refuse values no vLLM would start with (ValueError naming the option)."""
        if self.dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        if self.hash_lookahead_tokens < 0:
            raise ValueError("hash_lookahead_tokens must be >= 0")
        if self.hybrid_sliding_window is not None and self.hybrid_sliding_window < 1:
            raise ValueError("hybrid_sliding_window must be >= 1 (tokens)")
        if self.events_v033 and self.event_form == "array":
            raise ValueError("event_form 'array' (engines before mid-2026) cannot carry vLLM 0.33's event fields")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0")
