"""bench/receipts.py: a run's receipts summarised (plan kinds, hit prediction, TTFT error, regret)."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import receipts


def receipt(
    kind: str,
    predicted_ttft: float,
    observed_ttft: float | None,
    predicted: int,
    cached: int,
    runner_ttft: float | None = None,
) -> dict[str, object]:
    return {
        "kind": kind,
        "predicted": {"ttft_s": predicted_ttft, "cached_tokens": predicted},
        "observed": {"ttft_s": observed_ttft, "cached_tokens": cached},
        "runner_up": None if runner_ttft is None else {"ttft_s": runner_ttft},
    }


def test_summary_counts_kinds_hits_errors_and_regret(tmp_path: Path) -> None:
    rows = [
        receipt("aggregated", 0.10, 0.12, 64, 64, runner_ttft=0.2),
        receipt("P/D + kv from w1", 0.30, 0.90, 128, 96, runner_ttft=0.35),  # far worse than the runner-up said
        receipt("aggregated; decode worker prefills locally", 0.05, None, 0, 32),
    ]
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    summary = receipts.summarize(receipts.load([path]))
    assert summary["requests"] == 3
    assert summary["kinds"] == {"aggregated": 1, "P/D + source": 1, "decoder prefills locally": 1}
    assert summary["hit_prediction"] == {"exact": 1, "over": 1, "under": 1}
    assert summary["regret_candidates"] == 1
    assert round(summary["ttft_error_ms"]["median"]) == 310  # (20 + 600) / 2
    text = receipts.render("run", summary)
    assert "P/D + source 1" in text and "runner-up would likely have beaten: 1" in text
    assert receipts.main([str(tmp_path / "missing.jsonl")]) == 2
