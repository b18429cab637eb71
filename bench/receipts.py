"""Read kvroute's per-request receipts (``receipts_path`` in the router config) and explain a run.

    .venv/bin/python bench/receipts.py out/peers/runs-*/mooncake-pd-0/receipts-kvaware.jsonl
    .venv/bin/python bench/receipts.py --together out/peers/runs-*/mooncake-pd-*/receipts-kvaware.jsonl

For each run (``--together``: all of them as one): the plans by kind (aggregated, P/D, local prefill on a
decoder, with a kv source), how far the predicted TTFT was from the observed one (streamed requests), how
often the predicted hit was wrong (over or under the engine's cached tokens; a split plan's against its
prefill leg's), how long split plans' prefill legs took against their prediction (those predicted to start
at once), and the *regret* bound: requests whose observed TTFT exceeded the runner-up's prediction by more
than the chosen plan's own error — the decisions worth reading first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_bytes().splitlines():
            if line.strip():
                out.append(orjson.loads(line))
    return out


def kind_of(receipt: dict[str, Any]) -> str:
    kind = str(receipt.get("kind") or "")
    if "prefills locally" in kind:
        return "decoder prefills locally"
    head = kind.split(";")[0]
    return head.split(" + ")[0] + (" + source" if " + " in head else "") if head else "other"


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(receipts: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures of one run's receipts (see the module docstring)."""
    kinds = Counter(kind_of(r) for r in receipts)
    errors: list[float] = []
    legs: list[float] = []
    hits = Counter[str]()
    regret = 0
    for r in receipts:
        pred, obs = r["predicted"], r["observed"]
        # A split answer's cached tokens count the KV its decoder pulled; its prefill leg's are the hit.
        cached = obs.get("prefill_leg_cached_tokens") if r["prefill"] != r["decode"] else obs.get("cached_tokens")
        if isinstance(cached, int):
            p = pred.get("cached_tokens") or 0
            hits["exact" if p == cached else "over" if p > cached else "under"] += 1
        leg_ratio = _leg_ratio(r)
        if leg_ratio is not None:
            legs.append(leg_ratio)
        ttft, predicted = obs.get("ttft_s"), pred.get("ttft_s")
        if ttft is None or predicted is None:
            continue
        errors.append(ttft - predicted)
        runner = r.get("runner_up") or {}
        alt = runner.get("ttft_s")
        if alt is not None and ttft > alt + abs(ttft - predicted) / 2 and ttft - alt > 0.05:
            regret += 1
    n = len(receipts)
    return {
        "requests": n,
        "kinds": dict(kinds.most_common()),
        "hit_prediction": dict(hits),
        "ttft_error_ms": {
            "median": statistics.median(errors) * 1000 if errors else None,
            "p10": _pct(errors, 0.1) * 1000 if errors else None,
            "p90": _pct(errors, 0.9) * 1000 if errors else None,
        },
        "split_leg_ratio": {
            "n": len(legs),
            "median": statistics.median(legs) if legs else None,
            "p90": _pct(legs, 0.9) if legs else None,
        },
        "regret_candidates": regret,
    }


#: The terms of a split plan's TTFT that its prefill leg covers (the rest: handoff, decoder queue).
_LEG_TERMS = ("queue_s", "lookup_s", "transfer_s", "promotion_s", "prefill_s")


def _leg_ratio(receipt: dict[str, Any]) -> float | None:
    """A split plan's prefill leg, observed ÷ predicted, when no queue was predicted before it (a queue's
    error is the queue model's, not the prefill speed's); None for other receipts (only a split plan has a
    prefill leg)."""
    leg = receipt["observed"].get("prefill_leg_s")
    terms = receipt["predicted"].get("terms") or {}
    if leg is None or terms.get("queue_s", 0.0) > 0:
        return None
    predicted = sum(terms.get(t, 0.0) for t in _LEG_TERMS)
    return leg / predicted if predicted > 0 else None


def render(name: str, s: dict[str, Any]) -> str:
    err = s["ttft_error_ms"]
    lines = [f"{name}: {s['requests']} requests"]
    lines.append("  plans: " + ", ".join(f"{k} {v}" for k, v in s["kinds"].items()))
    lines.append("  predicted hit vs engine: " + ", ".join(f"{k} {v}" for k, v in s["hit_prediction"].items()))
    if err["median"] is not None:
        spread = f"p10 {err['p10']:+.1f}, p90 {err['p90']:+.1f}"
        lines.append(f"  TTFT observed - predicted: median {err['median']:+.1f} ms ({spread})")
    legs = s["split_leg_ratio"]
    if legs["n"]:
        spread = f"p90 {legs['p90']:.2f}, {legs['n']} legs"
        lines.append(
            f"  split prefill legs, observed ÷ predicted (no queue predicted): {legs['median']:.2f} ({spread})"
        )
    lines.append(f"  decisions the runner-up would likely have beaten: {s['regret_candidates']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="receipts JSON-lines files")
    parser.add_argument("--together", action="store_true", help="one summary of all the files (else one each)")
    args = parser.parse_args(argv)
    missing = [p for p in args.paths if not p.exists()]
    if missing:
        print(f"no such file: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    if args.together:
        print(render(f"{len(args.paths)} files", summarize(load(args.paths))))
        return 0
    for path in args.paths:
        print(render(str(path), summarize(load([path]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
