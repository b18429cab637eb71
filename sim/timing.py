"""The timing model, in real (unscaled) seconds: pure functions of a preset, testable without servers."""

from __future__ import annotations

from kvroute.sim.presets import Preset


def prefill_seconds(preset: Preset, new_tokens: int, context_tokens: int = 0) -> float:
    """Compute ``new_tokens`` after ``context_tokens`` already in cache.

    Linear layers cost the same per token; attention grows with the position, so the sum over
    positions ``c .. c+n`` gives ``n/rate + coeff * n * (c + n/2) / 1000``.
    """
    if new_tokens <= 0:
        return 0.0
    linear = new_tokens / preset.prefill_tokens_per_s
    attention = preset.attention_coeff_s * new_tokens * (context_tokens + new_tokens / 2) / 1000.0
    return linear + attention


def decode_step_seconds(preset: Preset, running: int) -> float:
    """One decode step for a batch of ``running`` sequences (memory-bound: grows slowly with the batch)."""
    return preset.decode_base_s + preset.decode_per_seq_s * max(running, 1)


def promote_seconds(preset: Preset, blocks: int) -> float:
    """CPU tier -> GPU copy of ``blocks`` blocks."""
    if blocks <= 0:
        return 0.0
    return blocks * preset.bytes_per_block / preset.promote_bytes_per_s


def transfer_seconds(preset: Preset, blocks: int, link_bytes_per_s: float | None = None) -> float:
    """Worker-to-worker copy of ``blocks`` blocks over the link: setup + a per-block cost (descriptor
    posting; 0 on most presets) + bytes / bandwidth."""
    if blocks <= 0:
        return 0.0
    bandwidth = link_bytes_per_s or preset.link_bytes_per_s
    return preset.transfer_setup_s + blocks * preset.transfer_per_block_s + blocks * preset.bytes_per_block / bandwidth
