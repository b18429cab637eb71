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
    *,
    split: bool = False,
    leg_s: float | None = None,
    leg_cached: int | None = None,
    terms: dict[str, float] | None = None,
) -> dict[str, object]:
    return {
        "kind": kind,
        "prefill": "w0",
        "decode": "w1" if split else "w0",
        "predicted": {"ttft_s": predicted_ttft, "cached_tokens": predicted, "terms": terms or {}},
        "observed": {
            "ttft_s": observed_ttft,
            "cached_tokens": cached,
            "prefill_leg_s": leg_s,
            "prefill_leg_cached_tokens": leg_cached,
        },
        "runner_up": None if runner_ttft is None else {"ttft_s": runner_ttft},
    }


def test_summary_counts_kinds_hits_errors_and_regret(tmp_path: Path) -> None:
    rows = [
        receipt("aggregated", 0.10, 0.12, 64, 64, runner_ttft=0.2),
        # far worse than the runner-up said; its prefill leg had 96 of the 128 tokens predicted (the answer
        # counts the KV its decoder pulled too)
        receipt("P/D + kv from w1", 0.30, 0.90, 128, 1000, runner_ttft=0.35, split=True, leg_s=0.5, leg_cached=96),
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


def test_split_prefill_legs_are_read_against_their_prediction(tmp_path: Path) -> None:
    """A split plan's leg, observed ÷ predicted, where no queue was predicted; --together pools the files."""
    legs = {"prefill_s": 0.2, "handoff_s": 0.01}
    first = [
        receipt("P/D", 0.21, 0.26, 0, 900, split=True, leg_s=0.25, leg_cached=0, terms=legs),  # 1.25x
        receipt("P/D", 0.21, 0.22, 0, 900, split=True, leg_s=0.20, leg_cached=0, terms=legs),  # 1.00x
        # queued: the queue model's error, not the prefill speed's
        receipt("P/D", 0.5, 0.9, 0, 900, split=True, leg_s=0.8, terms={**legs, "queue_s": 0.3}),
    ]
    second = [receipt("P/D", 0.21, 0.25, 0, 900, split=True, leg_s=0.24, leg_cached=0, terms=legs)]  # 1.20x
    paths = []
    for i, rows in enumerate((first, second)):
        paths.append(tmp_path / f"r{i}.jsonl")
        paths[-1].write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    one = receipts.summarize(receipts.load(paths[:1]))
    assert one["split_leg_ratio"]["n"] == 2 and round(one["split_leg_ratio"]["median"], 3) == 1.125
    assert one["hit_prediction"] == {"exact": 2}  # the third leg did not report its hit
    pooled = receipts.summarize(receipts.load(paths))
    assert pooled["split_leg_ratio"]["n"] == 3 and round(pooled["split_leg_ratio"]["median"], 2) == 1.2
    assert "observed ÷ predicted (no queue predicted): 1.20" in receipts.render("all", pooled)
    assert receipts.main(["--together", *map(str, paths)]) == 0
