"""Everything one simulated worker can be told (defaults mirror vLLM's where vLLM has one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
    # -- cache --
    hash_seed: int | None = None
    hash_bytes: bool = False
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
