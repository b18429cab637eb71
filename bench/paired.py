"""Two routers of one ``bench/peers.py`` run, request by request: which requests one answers later, and by how much.

    .venv/bin/python bench/paired.py out/peers                       # kvaware against smg:cache_aware
    .venv/bin/python bench/paired.py out/peers --a kvaware --b round_robin
    .venv/bin/python bench/paired.py out/peers --classes            # + each router's TTFT by what was cached
    .venv/bin/python bench/paired.py out/peers --classes --runs mooncake-light   # only those runs

A cell's medians hide which requests differ. Every router replays the same trace on a fresh fleet, so
requests pair up by (session, turn). Per run (trace, regime, seed), in the simulated hardware's ms: the
median of ``a``'s TTFT minus ``b``'s over every request; over the requests both served from the same
cache (equal cached tokens: what differs there is the routers' own time and the queues they built);
and how many requests ``a`` answered more than 5 ms later, or earlier, with those differences summed
(where the tails come from).

``--classes``: each router's requests by the share of the prompt the engine had cached (nothing: under
10 %; part; nearly all: 90 % or more), with the count and median TTFT of each class, medians over the
runs. Where both routers put the same number of requests in each class, their cache decisions agree and
the class medians differ by the routers' own time; a cell's p50 is then set by the classes it falls
between (on the shared-prefix trace: the slowest repeat and the fastest new question).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from peers import hop_arrivals, request_hops, router_of

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


#: Cached share of the prompt below which a request counts as uncached, and from which as fully cached.
CLASS_BOUNDS = (0.1, 0.9)
CLASSES = ("nothing", "part", "nearly all")
#: The hops of a request's time to first token (``bench/peers.py --hops``), real ms.
HOPS = ("forward_ms", "engine_ms", "return_ms")


def cache_class(row: dict[str, Any]) -> str:
    """Which of :data:`CLASSES` a request falls in, by the share of its prompt the engine had cached."""
    prompt = row.get("prompt_tokens") or 0
    share = (row.get("cached_tokens") or 0) / prompt if prompt > 0 else 0.0
    low, high = CLASS_BOUNDS
    return CLASSES[0] if share < low else CLASSES[2] if share >= high else CLASSES[1]


def by_class(
    rows: dict[tuple[str, int], dict[str, Any]],
    to_ms: float,
    arrivals: dict[int, list[tuple[float, float]]] | None = None,
) -> dict[str, dict[str, float]]:
    """One run's requests of one router per :func:`cache_class`: ``{class: {"n", "median_ms"}}`` (present
    classes only), with the median hops (``forward_ms``, ``engine_ms``, ``return_ms``, real ms) of the
    requests ``arrivals`` (the run's hop log, ``bench/peers.py --hops``) matches."""
    ttfts: dict[str, list[float]] = {}
    hops: dict[str, list[tuple[float, float, float]]] = {}
    for r in rows.values():
        c = cache_class(r)
        ttfts.setdefault(c, []).append(r["ttft_s"] * to_ms)
        split = request_hops(arrivals or {}, r.get("prompt_key", 0), r.get("sent_at", 0.0), r.get("first_at"))
        if split is not None:
            hops.setdefault(c, []).append(split)
    out: dict[str, dict[str, float]] = {}
    for c, v in ttfts.items():
        out[c] = {"n": len(v), "median_ms": statistics.median(v)}
        if c in hops:
            for k, name in enumerate(HOPS):
                out[c][name] = statistics.median(h[k] for h in hops[c])
    return out


def run_folders(work: Path, match: str = "") -> list[Path]:
    """The run folders under ``work`` (``runs-*/<trace>-<regime>-<seed>``) whose name contains ``match``."""
    return sorted(p for p in work.glob("runs-*/*") if p.is_dir() and match in p.name)


def classes(work: Path, routers: list[str], match: str = "") -> dict[str, dict[str, dict[str, float]]]:
    """Per router and class, over every run folder under ``work`` holding it: the median count, the median
    of the runs' median TTFT (``runs``: in how many runs the class occurred) and of their hops, where logged."""
    scale = _time_scale(work)
    per: dict[str, dict[str, list[dict[str, float]]]] = {}
    for run in run_folders(work, match):
        for router in routers:
            tag = router_of(router).tag
            path = run / f"requests-{tag}.jsonl"
            if path.exists():
                arrivals = hop_arrivals(run / f"hops-{tag}.log")
                for c, fig in by_class(requests_of(path), 1000.0 / scale, arrivals).items():
                    per.setdefault(router, {}).setdefault(c, []).append(fig)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for router, found in per.items():
        for c, figs in found.items():
            fig = {
                "runs": len(figs),
                "n": statistics.median(f["n"] for f in figs),
                "median_ms": statistics.median(f["median_ms"] for f in figs),
            }
            for name in HOPS:
                values = [f[name] for f in figs if name in f]
                if values:
                    fig[name] = statistics.median(values)
            out.setdefault(router, {})[c] = fig
    return out


def _time_scale(work: Path) -> float:
    results = json.loads((work / "peers.json").read_text()) if (work / "peers.json").exists() else {}
    runs = results.get("runs") or [{}]
    return float(runs[0].get("fleet", {}).get("time_scale", 1.0))  # one time scale per bench/peers.py run


def paired(work: Path, a: str, b: str, match: str = "") -> list[dict[str, Any]]:
    """Every run under ``work`` (its ``runs-*/<trace>-<regime>-<seed>`` folders) where both routers answered."""
    scale = _time_scale(work)
    tag_a, tag_b = router_of(a).tag, router_of(b).tag  # the names of their files (variants included)
    rows = []
    for run in run_folders(work, match):
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


def classes_markdown(found: dict[str, dict[str, dict[str, float]]]) -> str:
    low, high = (round(b * 100) for b in CLASS_BOUNDS)
    lines = [
        f"TTFT by what the engine had cached (nothing: < {low} % of the prompt; nearly all: >= {high} %): "
        "requests per run and median TTFT ms, then (with hops logged) the hops client -> engine / engine / "
        "engine -> client in real ms; medians over the runs",
        "",
        "| router | " + " | ".join(CLASSES) + " |",
        "|---|" + "---|" * len(CLASSES),
    ]
    for router, figs in found.items():
        cells = []
        for c in CLASSES:
            fig = figs.get(c)
            if fig is None:
                cells.append("-")
                continue
            cell = f"{fig['n']:g}, {fig['median_ms']:.2f} ({fig['runs']:g} runs)"
            if all(name in fig for name in HOPS):
                cell += "; " + " / ".join(f"{fig[name]:.2f}" for name in HOPS)
            cells.append(cell)
        lines.append(f"| {router} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path, help="a bench/peers.py --work folder")
    ap.add_argument("--a", default="kvaware")
    ap.add_argument("--b", default="smg:cache_aware")
    ap.add_argument("--classes", action="store_true", help="also each router's TTFT by the share cached")
    ap.add_argument("--runs", default="", help="only the run folders whose name contains this (trace-regime)")
    args = ap.parse_args(argv)
    rows = paired(args.work, args.a, args.b, args.runs)
    if not rows:
        print(f"no run under {args.work} has both {args.a} and {args.b}")
        return 1
    print(markdown(rows, args.a, args.b))
    if args.classes:
        print()
        print(classes_markdown(classes(args.work, [args.a, args.b], args.runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
