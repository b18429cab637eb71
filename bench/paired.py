"""Two routers of one ``bench/peers.py`` run, request by request: which requests one answers later, and by how much.

    .venv/bin/python bench/paired.py out/peers                       # kvaware against smg:cache_aware
    .venv/bin/python bench/paired.py out/peers --a kvaware --b round_robin

A cell's medians hide which requests differ. Every router replays the same trace on a fresh fleet, so
requests pair up by (session, turn). Per run (trace, regime, seed), in the simulated hardware's ms: the
median of ``a``'s TTFT minus ``b``'s over every request; over the requests both served from the same
cache (equal cached tokens: what differs there is the routers' own time and the queues they built);
and how many requests ``a`` answered more than 5 ms later, or earlier, with those differences summed
(where the tails come from).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: A request answered this much later or earlier counts as a real difference, not the routers' own time.
APART_MS = 5.0


def requests_of(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """A run's answered requests by (session, turn)."""
    rows = (json.loads(line) for line in path.read_text().splitlines() if line)
    return {(r["session"], r["turn"]): r for r in rows if r.get("ttft_s") is not None and not r.get("error")}


def pair(
    a: dict[tuple[str, int], dict[str, Any]], b: dict[tuple[str, int], dict[str, Any]], to_ms: float
) -> dict[str, Any]:
    """The figures of one run (see the module docstring); a run without requests in common gives zeros."""
    both = [k for k in a if k in b]
    diffs = [(a[k]["ttft_s"] - b[k]["ttft_s"]) * to_ms for k in both]
    same = [d for d, k in zip(diffs, both, strict=True) if a[k]["cached_tokens"] == b[k]["cached_tokens"]]
    later = [d for d in diffs if d > APART_MS]
    earlier = [d for d in diffs if d < -APART_MS]
    return {
        "requests": len(both),
        "median_ms": statistics.median(diffs) if diffs else 0.0,
        "same_cache": len(same),
        "same_cache_median_ms": statistics.median(same) if same else 0.0,
        "later": len(later),
        "later_sum_ms": sum(later),
        "earlier": len(earlier),
        "earlier_sum_ms": sum(earlier),
    }


def paired(work: Path, a: str, b: str) -> list[dict[str, Any]]:
    """Every run under ``work`` (its ``runs-*/<trace>-<regime>-<seed>`` folders) where both routers answered."""
    results = json.loads((work / "peers.json").read_text()) if (work / "peers.json").exists() else {}
    runs = results.get("runs") or [{}]
    scale = float(runs[0].get("fleet", {}).get("time_scale", 1.0))  # one time scale per bench/peers.py run
    tag_a, tag_b = a.replace(":", "-"), b.replace(":", "-")
    rows = []
    for run in sorted(p for p in work.glob("runs-*/*") if p.is_dir()):
        fa, fb = run / f"requests-{tag_a}.jsonl", run / f"requests-{tag_b}.jsonl"
        if fa.exists() and fb.exists():
            rows.append({"run": run.name, **pair(requests_of(fa), requests_of(fb), 1000.0 / scale)})
    return rows


def markdown(rows: list[dict[str, Any]], a: str, b: str) -> str:
    lines = [
        f"{a} - {b}, paired by request (TTFT, ms): median over all requests, over those served from the same "
        f"cache, and the requests more than {APART_MS:g} ms apart",
        "",
        "| run | requests | median | same cache: n, median | later: n, sum | earlier: n, sum |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['requests']} | {r['median_ms']:+.2f} | {r['same_cache']}, "
            f"{r['same_cache_median_ms']:+.2f} | {r['later']}, {r['later_sum_ms']:+.0f} | "
            f"{r['earlier']}, {r['earlier_sum_ms']:+.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path, help="a bench/peers.py --work folder")
    ap.add_argument("--a", default="kvaware")
    ap.add_argument("--b", default="smg:cache_aware")
    args = ap.parse_args(argv)
    rows = paired(args.work, args.a, args.b)
    if not rows:
        print(f"no run under {args.work} has both {args.a} and {args.b}")
        return 1
    print(markdown(rows, args.a, args.b))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
