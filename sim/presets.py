"""Model x hardware presets for the timing model.

Figures are derived from public model shapes and H100 datasheet numbers (989 TFLOP/s dense BF16,
3.35 TB/s HBM3, PCIe Gen5 x16 ~ 50 GB/s, 200-400 Gb/s RDMA NICs) at realistic utilisation; they are
estimates, chosen so that relative costs (prefill vs transfer vs queueing) are right, not exact.
``qwen3-32b-p5en`` adds H200 / EFA figures and published NIXL transfer measurements (see its comment).
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
    #: Extra cost per KV block moved by a remote transfer, seconds (NIXL posts one descriptor per layer,
    #: K/V and block; 0 = transfers cost setup + bytes / bandwidth only).
    transfer_per_block_s: float = 0.0

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
        name="llama-8b-h100",
        model="meta-llama/Llama-3.1-8B-Instruct",
        layers=32,
        kv_heads=8,
        head_dim=128,
        gpu_blocks=26_000,
        prefill_tokens_per_s=20_000.0,
        attention_coeff_s=1.6e-6,
        decode_base_s=0.0065,
        decode_per_seq_s=0.0001,
    ),
    # Qwen2.5-32B (64 layers, 8 KV heads, head_dim 128, BF16 -> 256 KiB/token) on 2 x H100 (TP 2):
    # ~64 GFLOP/token -> ~9k tokens/s prefill; ~70 GB for KV over both GPUs -> ~16k blocks.
    "qwen-32b-h100x2": Preset(
        name="qwen-32b-h100x2",
        model="Qwen/Qwen2.5-32B-Instruct",
        layers=64,
        kv_heads=8,
        head_dim=128,
        gpu_blocks=16_000,
        prefill_tokens_per_s=9_000.0,
        attention_coeff_s=2.4e-6,
        decode_base_s=0.016,
        decode_per_seq_s=0.0002,
        link_bytes_per_s=50e9,
    ),
    # Qwen3-32B on one AWS p5en.48xlarge per phase (the seed article's multi-turn reuse case). Shape:
    # 64 layers, 64 query / 8 KV heads, head_dim 128, hidden 5120, intermediate 25600, BF16 (Qwen3
    # config.json; Qwen3 report arXiv:2505.09388 table) -> 256 KiB/token, 4 MiB per 16-token block.
    # Assumption (not stated by the article): one vLLM engine per node, TP 8 (8 KV heads -> 1 per rank).
    # Hardware: 8 x H200 (141 GB HBM3e, 4.8 TB/s; same GH100 compute as H100: 989 TFLOP/s dense BF16);
    # 16 EFAv3 NICs, 3200 Gbps per node = 400 Gbps (50 GB/s) per GPU.
    # - prefill_tokens_per_s: linear layers 31.2e9 params -> 62.4 GFLOP/token; 8 x 989 TFLOP/s at 40 %
    #   MFU (the estimate the other presets use; not measured for TP 8) -> 50.7k tokens/s.
    # - attention_coeff_s: 4 x 64 layers x 64 heads x 128 = 2.1 MFLOP per token per context token, at
    #   FlashAttention-3's ~600 TFLOP/s per H100-class GPU (hdim 128, 16k: 620-648 TFLOP/s measured,
    #   arXiv:2407.08608 and pytorch/benchmark D60117034) x 8 GPUs -> 4.37e-7 s.
    #   24 200 tokens from scratch: 0.48 s linear + 0.13 s attention = 0.60 s (published: 0.78 s).
    # - link_bytes_per_s: NIXL + LIBFABRIC over EFA measured ~9.6 GB/s for one worker on 4 x 100 Gbps
    #   EFA (p5.48xlarge, same 400 Gbps per GPU as p5en; ai-dynamo/dynamo disagg-communication-guide),
    #   i.e. ~19 % of line rate; the 8 TP ranks pull their shards in parallel -> 8 x 9.6 = 76.8 GB/s.
    #   No NIXL-over-EFAv3 (p5en) measurement was found.
    # - transfer_per_block_s: NIXL's LIBFABRIC backend posts one fi_write/fi_read per descriptor; vLLM
    #   issues layers x 2 (K, V) descriptors per block per rank when blocks are not contiguous. Measured:
    #   18 880 descriptors (Llama-70B TP 8) took ~46 ms of posting -> 2.44 us each (ai-dynamo/nixl#1514)
    #   -> 128 x 2.44 us = 0.31 ms per block. Contiguous blocks are merged (~2 x layers descriptors per
    #   transfer), so 0 is the other bound; this preset takes the fragmented case.
    # - transfer_setup_s: one 2 MiB KV transfer over LIBFABRIC/EFA showed agent_xfer_time 12.5 ms (Dynamo
    #   Qwen3-32B aws-efa recipe bring-up, a single sample, first transfer included); no better figure.
    # - gpu_blocks: 8 x 141 GB x 0.9 - 66 GB weights - ~32 GB activations -> ~218k blocks; 200k kept.
    # - decode_*: rough (not used by the reuse case): ~8 GB of weights per GPU at 4.8 TB/s + TP 8
    #   all-reduces; the seed article reports TPOT 7-10 ms under load.
    "qwen3-32b-p5en": Preset(
        name="qwen3-32b-p5en",
        model="Qwen/Qwen3-32B",
        layers=64,
        kv_heads=8,
        head_dim=128,
        max_model_len=40_960,
        gpu_blocks=200_000,
        prefill_tokens_per_s=50_700.0,
        attention_coeff_s=4.37e-7,
        decode_base_s=0.006,
        decode_per_seq_s=0.00005,
        link_bytes_per_s=76.8e9,
        transfer_setup_s=0.0125,
        transfer_per_block_s=128 * 2.44e-6,
    ),
    # A tiny preset for tests: small cache so evictions happen, fast everything.
    "tiny": Preset(
        name="tiny",
        model="sim-tiny",
        layers=4,
        kv_heads=2,
        head_dim=64,
        max_model_len=8192,
        max_num_seqs=8,
        gpu_blocks=64,
        cpu_blocks=0,
        prefill_tokens_per_s=50_000.0,
        attention_coeff_s=0.0,
        decode_base_s=0.001,
        decode_per_seq_s=0.0,
        link_bytes_per_s=1e9,
        promote_bytes_per_s=2e9,
    ),
}


def get_preset(name: str, **overrides: Any) -> Preset:
    """A preset by name, with optional field overrides (``gpu_blocks=...``)."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    return preset.with_overrides(**overrides) if overrides else preset
