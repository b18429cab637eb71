"""Multi-turn reuse on the simulator: full prefill of a long history vs pulling the decoder's KV.

    .venv/bin/python bench/multiturn_reuse.py --repeats 3 --out /tmp/reuse

The seed article's bidirectional case (Qwen3-32B, one p5en.48xlarge per phase, NixlConnector with
``bidirectional_kv_xfer``, prefix cache off on prefill) reports, for a ~24k-token history, 778 ms for a
full prefill and 460 ms when the prefill node reuses the decoder's KV (ratio 0.59). Here, for each preset
and each repeat, a fresh fleet of two simulated workers (prefill P, decode D) at time scale 1.0 (the
simulator's own CPU time counts as model time and is not magnified):

1. turn 1 (``--history`` tokens) is prefilled on P and decoded on D, which keeps prompt + answer and
   returns its ``kv_transfer_params``;
2. turn 2 (history + ``--new-tokens``) is timed on P with a cold cache, once as a full prefill, once
   pulling D's blocks with D's returned params (``max_tokens: 1``: the prefill leg only).

Reported per preset (medians over the repeats): measured full and reuse times, their ratio, and the timing
model alone (``sim/timing.py``: ``prefill_seconds`` vs ``transfer_seconds`` + the new tokens' prefill),
next to the published figures. Writes ``multiturn_reuse.json`` and ``multiturn_reuse.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvroute.report import pyplot, save_figure
from kvroute.sim.presets import get_preset
from kvroute.sim.timing import prefill_seconds, transfer_seconds

PUBLISHED = {"full_prefill_ms": 778.0, "reuse_ms": 460.0, "ratio": 460.0 / 778.0}
DEFAULT_PRESETS = ("qwen-32b-h100x2", "qwen3-32b-p5en")


async def reuse_case(preset: str, history: int, new_tokens: int, time_scale: float) -> dict[str, Any]:
    """Turn 2 of a conversation with a ``history``-token past: prefill it all vs pull the decoder's KV."""
    import httpx
    from kvroute.sim.fleet import SimFleet

    words = [f"w{i % 997}" for i in range(history)]
    fresh = [f"n{i % 991}" for i in range(new_tokens)]
    async with SimFleet(2, preset=preset, roles=["prefill", "decode"], time_scale=time_scale) as fleet:
        p_url, d_url = (w.url for w in fleet.workers)
        async with httpx.AsyncClient(timeout=300) as client:

            async def call(url: str, prompt: str, kv: dict[str, Any] | None) -> tuple[float, dict[str, Any]]:
                body: dict[str, Any] = {
                    "model": fleet.model_config()["name"],
                    "prompt": prompt,
                    "max_tokens": 1,
                    "stream": False,
                }
                if kv is not None:
                    body["kv_transfer_params"] = kv
                t0 = time.perf_counter()
                resp = await client.post(url + "/v1/completions", json=body)
                resp.raise_for_status()
                return (time.perf_counter() - t0) / time_scale, resp.json()

            turn1 = " ".join(words)
            nixl_out = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            # Turn 1: prefill on P, decode on D (D keeps prompt + answer for the next turn).
            _, first = await call(p_url, turn1, nixl_out)
            _, decoded = await call(d_url, turn1, first["kv_transfer_params"])
            keep = decoded.get("kv_transfer_params")
            turn2 = turn1 + " " + " ".join(fresh)
            # Full prefill of turn 2 on a worker that has nothing cached (the decoder's peer, reset).
            await client.post(p_url + "/reset_prefix_cache")
            full_s, full_body = await call(p_url, turn2, None)
            await client.post(p_url + "/reset_prefix_cache")
            reuse_s, reuse_body = await call(
                p_url, turn2, {**(keep or {}), "do_remote_decode": True, "do_remote_prefill": False}
            )
    return {
        "full_prefill_ms": full_s * 1000,
        "reuse_ms": reuse_s * 1000,
        "kept_params": keep is not None,
        "full_cached_tokens": _cached(full_body),
        "reuse_cached_tokens": _cached(reuse_body),
    }


def _cached(body: dict[str, Any]) -> int:
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def timing_model(preset: str, history: int, new_tokens: int) -> dict[str, float]:
    """The same two paths from ``sim/timing.py`` alone (no servers, no simulator overhead)."""
    p = get_preset(preset)
    blocks = history // p.block_size
    reused = blocks * p.block_size
    total = history + new_tokens
    return {
        "timing_model_full_ms": prefill_seconds(p, total) * 1000,
        "timing_model_reuse_ms": (transfer_seconds(p, blocks) + prefill_seconds(p, total - reused, reused)) * 1000,
        "timing_model_transfer_ms": transfer_seconds(p, blocks) * 1000,
        "kv_gb": blocks * p.bytes_per_block / 1e9,
    }


def summarise(preset: str, runs: list[dict[str, Any]], model: dict[str, float]) -> dict[str, Any]:
    full = statistics.median(r["full_prefill_ms"] for r in runs)
    reuse = statistics.median(r["reuse_ms"] for r in runs)
    return {
        "preset": preset,
        "repeats": len(runs),
        "full_prefill_ms": full,
        "reuse_ms": reuse,
        "ratio": reuse / full,
        "reuse_cached_tokens": statistics.median(r["reuse_cached_tokens"] for r in runs),
        **model,
        "timing_model_ratio": model["timing_model_reuse_ms"] / model["timing_model_full_ms"],
        "all_kept_params": all(r["kept_params"] for r in runs),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| preset | full prefill ms | reuse ms | ratio | timing model full / reuse ms (ratio) | "
        "published full / reuse ms (ratio) |",
        "|---|---|---|---|---|---|",
    ]
    pub = f"{PUBLISHED['full_prefill_ms']:.0f} / {PUBLISHED['reuse_ms']:.0f} ({PUBLISHED['ratio']:.2f})"
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['full_prefill_ms']:.0f} | {r['reuse_ms']:.0f} | {r['ratio']:.2f} | "
            f"{r['timing_model_full_ms']:.0f} / {r['timing_model_reuse_ms']:.0f} "
            f"({r['timing_model_ratio']:.2f}) | {pub} |"
        )
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Grouped bars: full prefill vs reuse per preset (measured), plus the published pair."""
    plt = pyplot()
    if plt is None:
        return None
    names = [r["preset"] for r in rows] + ["published (article)"]
    full = [r["full_prefill_ms"] for r in rows] + [PUBLISHED["full_prefill_ms"]]
    reuse = [r["reuse_ms"] for r in rows] + [PUBLISHED["reuse_ms"]]
    ratios = [r["ratio"] for r in rows] + [PUBLISHED["ratio"]]
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], full, width=0.4, label="full prefill", color="#4C72B0")
    bars = ax.bar([i + 0.2 for i in x], reuse, width=0.4, label="reuse of the decoder's KV", color="#55A868")
    for bar, ratio in zip(bars, ratios, strict=True):
        ax.annotate(
            f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9
        )
    ax.set_xticks(list(x), names)
    ax.set_ylabel("time of the prefill leg (ms, simulated hardware)")
    ax.set_title(title)
    ax.legend()
    return save_figure(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="comma-separated preset names")
    ap.add_argument("--history", type=int, default=24_000, help="tokens of turn 1 (the history)")
    ap.add_argument("--new-tokens", type=int, default=200, help="tokens added by turn 2")
    ap.add_argument("--repeats", type=int, default=3, help="fresh fleets per preset; medians are reported")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="1.0: the simulator's own CPU time, which counts as model time, is not magnified",
    )
    ap.add_argument("--out", default="out/bench-multiturn-reuse")
    args = ap.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    for name in presets:
        get_preset(name)  # fail early on a typo
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "history_tokens": args.history,
        "new_tokens": args.new_tokens,
        "time_scale": args.time_scale,
        "published": PUBLISHED,
        "runs": {},
        "table": [],
    }
    for name in presets:
        model = timing_model(name, args.history, args.new_tokens)
        print(
            f"{name}: {args.history}-token history + {args.new_tokens} new tokens, {model['kv_gb']:.2f} GB of KV; "
            f"timing model {model['timing_model_full_ms']:.0f} vs {model['timing_model_reuse_ms']:.0f} ms",
            flush=True,
        )
        runs = []
        for rep in range(args.repeats):
            run = asyncio.run(reuse_case(name, args.history, args.new_tokens, args.time_scale))
            runs.append(run)
            print(
                f"  run {rep + 1}/{args.repeats}: full {run['full_prefill_ms']:.0f} ms, "
                f"reuse {run['reuse_ms']:.0f} ms ({run['reuse_cached_tokens']} tokens pulled), "
                f"elapsed {time.monotonic() - began:.0f} s",
                flush=True,
            )
        report["runs"][name] = runs
        report["table"].append(summarise(name, runs, model))
    text = markdown(report["table"])
    print(f"\n## multi-turn reuse: medians of {args.repeats} run(s), time scale {args.time_scale}\n{text}")
    (out / "multiturn_reuse.json").write_text(json.dumps(report, indent=1))
    png = chart(
        report["table"],
        out / "multiturn_reuse.png",
        f"{args.history}-token history + {args.new_tokens}: full prefill vs reuse (medians of {args.repeats})",
    )
    print(
        f"\nresults: {out / 'multiturn_reuse.json'}"
        + (f"; chart: {png}" if png else "")
        + f"; total {time.monotonic() - began:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
