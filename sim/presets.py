"""Model x hardware presets for the timing model.

Figures are derived from public model shapes and H100 datasheet numbers (989 TFLOP/s dense BF16,
3.35 TB/s HBM3, PCIe Gen5 x16 ~ 50 GB/s, 200-400 Gb/s RDMA NICs) at realistic utilisation; they are
estimates, chosen so that relative costs (prefill vs transfer vs queueing) are right, not exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class Preset:
    """A model served on some hardware: shape, cache size and speeds (all in real seconds)."""

    name: str
    model: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    block_size: int = 16
    max_model_len: int = 131_072
    max_num_seqs: int = 256
    #: KV-cache capacity of the GPU tier, in blocks.
    gpu_blocks: int = 20_000
    #: Optional CPU tier (offloading), in blocks; 0 = none.
    cpu_blocks: int = 0
    #: Prefill speed on short contexts (linear layers dominate), tokens/s.
    prefill_tokens_per_s: float = 20_000.0
    #: Attention term: extra seconds per prefilled token per 1k tokens of context before it.
    attention_coeff_s: float = 1.6e-6
    #: Decode step time = base + per_seq x running sequences.
    decode_base_s: float = 0.007
    decode_per_seq_s: float = 0.00012
    #: CPU tier -> GPU promotion bandwidth (bytes/s) and worker-to-worker link bandwidth (bytes/s).
    promote_bytes_per_s: float = 25e9
    link_bytes_per_s: float = 25e9
    #: Fixed cost of one remote transfer (setup, registration), seconds.
    transfer_setup_s: float = 0.0005

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def with_overrides(self, **overrides: Any) -> Preset:
        unknown = set(overrides) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown preset fields: {sorted(unknown)}")
        return replace(self, **overrides)


PRESETS: dict[str, Preset] = {
    # Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, BF16 -> 128 KiB/token) on one H100 80GB:
    # ~16 GFLOP/token at ~40 % MFU -> ~20k tokens/s prefill; ~55 GB for KV -> ~26k blocks of 16.
    "llama-8b-h100": Preset(
        name="llama-8b-h100", model="meta-llama/Llama-3.1-8B-Instruct", layers=32, kv_heads=8, head_dim=128,
        gpu_blocks=26_000, prefill_tokens_per_s=20_000.0, attention_coeff_s=1.6e-6,
        decode_base_s=0.0065, decode_per_seq_s=0.0001,
    ),
    # Qwen2.5-32B (64 layers, 8 KV heads, head_dim 128, BF16 -> 256 KiB/token) on 2 x H100 (TP 2):
    # ~64 GFLOP/token -> ~9k tokens/s prefill; ~70 GB for KV over both GPUs -> ~16k blocks.
    "qwen-32b-h100x2": Preset(
        name="qwen-32b-h100x2", model="Qwen/Qwen2.5-32B-Instruct", layers=64, kv_heads=8, head_dim=128,
        gpu_blocks=16_000, prefill_tokens_per_s=9_000.0, attention_coeff_s=2.4e-6,
        decode_base_s=0.016, decode_per_seq_s=0.0002, link_bytes_per_s=50e9,
    ),
    # A tiny preset for tests: small cache so evictions happen, fast everything.
    "tiny": Preset(
        name="tiny", model="sim-tiny", layers=4, kv_heads=2, head_dim=64, max_model_len=8192,
        max_num_seqs=8, gpu_blocks=64, cpu_blocks=0, prefill_tokens_per_s=50_000.0, attention_coeff_s=0.0,
        decode_base_s=0.001, decode_per_seq_s=0.0, link_bytes_per_s=1e9, promote_bytes_per_s=2e9,
    ),
}


def get_preset(name: str, **overrides: Any) -> Preset:
    """A preset by name, with optional field overrides (``gpu_blocks=...``)."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    return preset.with_overrides(**overrides) if overrides else preset
