"""Routing quality of every policy on the simulated fleet (``kvroute sim``), the same arrivals for all.

    .venv/bin/python bench/routing.py [--workers 8] [--preset qwen-32b-h100x2] [--repeats 1]
    .venv/bin/python bench/routing.py --kv-protocol none --gpu-blocks 0 --cpu-blocks 0  # GPU only, no P2P

For each trace (agentic multi-turn, plain chat) and each policy of ``available_policies()``, a fresh
fleet and router are started (``kvroute.experiment.run_policy``: cold caches, empty index) and the same
seeded trace is replayed through the router. Times are the simulated hardware's (real seconds divided
by the time scale). Reported per policy: TTFT p50/p99, goodput (share of requests whose TTFT is within
the SLO), cached tokens as a share of the oracle's, hits per tier and bytes moved both as the router
predicted them (its ``/metrics``) and as the engines report them (each worker's ``/metrics``: prefix-cache
hits, CPU-tier promotions, KV received from peers), stale decisions, recomputed tokens. With
``--repeats N`` every figure is the median over N runs. The default fleet is the deployment kvroute is
built for (vLLM >= 0.27 with the offloading connector and P2P): a GPU cache small enough that sessions
spill to a CPU tier, and peers that can serve each other's blocks (``remote_kv_source``). The
multi-turn reuse case of the seed articles is ``bench/multiturn_reuse.py``.

The oracle: for every request, the most prompt tokens any routing could have served from cache given
what earlier requests computed, assuming caches never evict (GPU plus CPU tier hold the whole trace at
the sizes used here) and whole blocks only, minus the last prompt token the engine always computes.
A session's later turn extends its previous turn, so it can reuse that turn's prompt and answer (whose
tokens re-tokenise identically in the simulator); a session's first turn can reuse the longest prefix it shares with any
request whose prefill had finished (first token received) before it was sent (the shared system
prompt): a prefix still being computed elsewhere is no hit for a request admitted meanwhile. It is
computed from the replayed token counts and the trace's text.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvroute.experiment import FleetSpec, PolicyRun, Progress, run_policy
from kvroute.policies import available_policies
from kvroute.report import chart
from kvroute.sim.presets import get_preset
from kvroute.sim.replay import RequestResult, percentile
from kvroute.sim.tokenizer import encode_chat
from kvroute.sim.traces import Trace, agentic_trace, chat_trace
from prometheus_client.parser import text_string_to_metric_families

BLOCK = 16


# -- the oracle -------------------------------------------------------------------------------------


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def oracle_cached(trace: Trace, results: Sequence[RequestResult], block: int = BLOCK) -> int:
    """Best possible cached tokens over the whole replay (see the module docstring)."""
    return sum(cached for _, cached in oracle_per_request(trace, results, block))


def oracle_per_request(
    trace: Trace, results: Sequence[RequestResult], block: int = BLOCK
) -> list[tuple[RequestResult, int]]:
    """Each answered request with the most of its prompt any cache could have held when it was sent."""
    sessions = {s.id: s for s in trace.sessions}
    first_turns: dict[str, list[int]] = {
        s.id: encode_chat(
            [{"role": "system", "content": s.system}, {"role": s.steps[0].role, "content": s.steps[0].content}]
        )
        for s in trace.sessions
    }
    ok = [r for r in results if r.ok]
    by_turn = {(r.session, r.turn): r for r in ok}
    # When each request's prompt was in some cache: at its first token.
    computed = sorted((r.sent_s + (r.ttft_s or 0.0), r.session) for r in ok)
    out: list[tuple[RequestResult, int]] = []
    for r in ok:
        usable = (r.prompt_tokens - 1) // block * block
        if r.turn == 0:
            tokens = first_turns.get(r.session, [])
            # Every prompt of another session starts with that session's first turn and diverges from
            # ours no later than there, so its first turn's tokens give the shared prefix.
            shared = max(
                (
                    _lcp(tokens, first_turns[s])
                    for t, s in computed
                    if t <= r.sent_s and s != r.session and s in sessions
                ),
                default=0,
            )
            out.append((r, min(usable, shared // block * block)))
            continue
        prev = by_turn.get((r.session, r.turn - 1))
        if prev is None:
            out.append((r, 0))
            continue
        held = (prev.prompt_tokens + prev.completion_tokens - 1) // block * block
        out.append((r, min(usable, held)))
    return out


# -- one run's figures -----------------------------------------------------------------------------


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def metric_total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def _engine_totals(pages: dict[str, str], block: int) -> dict[str, float]:
    """What the engines report they served per tier and moved, summed over the fleet's /metrics pages."""
    gpu = cpu = remote = moved = 0.0
    for text in pages.values():
        m = metric_samples(text)
        gpu += metric_total(m, "vllm:prefix_cache_hits_total")
        cpu += metric_total(m, "kvroute_sim:cpu_promoted_blocks_total") * block
        received = [
            (labels, v)
            for labels, v in m.get("kvroute_sim:kv_transfer_blocks_total", [])
            if labels.get("direction") == "received"
        ]
        remote += sum(v for _, v in received) * block
        moved += sum(
            v for labels, v in m.get("kvroute_sim:kv_transfer_bytes_total", []) if labels.get("direction") == "received"
        )
    return {
        "gpu_hits_engine": gpu,
        "cpu_hits_engine": cpu,
        "remote_hits_engine": remote,
        "gb_moved_engine": moved / 1e9,
    }


def figures(run: PolicyRun, trace: Trace, time_scale: float, slo_ms: float, block: int = BLOCK) -> dict[str, Any]:
    results = run.report.results
    ok = [r for r in results if r.ok]
    ttft_ms = [r.ttft_s * 1000 / time_scale for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    oracle = oracle_cached(trace, results, block)
    m = metric_samples(run.router_metrics)
    tiers = {labels.get("tier", "?"): v for labels, v in m.get("kvroute_predicted_hit_tokens_total", [])}
    return {
        "policy": run.policy,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_ms": percentile(ttft_ms, 50) or float("nan"),
        "ttft_p99_ms": percentile(ttft_ms, 99) or float("nan"),
        "goodput": sum(1 for t in ttft_ms if t <= slo_ms) / len(results) if results else 0.0,
        "cached_token_ratio": cached / prompt if prompt else 0.0,
        "oracle_share": cached / oracle if oracle else 1.0,
        "gpu_hits": tiers.get("GPU", 0.0),
        "cpu_hits": tiers.get("CPU", 0.0),
        "remote_hits": tiers.get("REMOTE", 0.0),
        "gb_moved": metric_total(m, "kvroute_estimated_kv_bytes_moved_total") / 1e9,
        **_engine_totals(run.worker_metrics, block),
        "stale": metric_total(m, "kvroute_stale_decisions_total"),
        "checked": metric_total(m, "kvroute_checked_decisions_total"),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "recomputed": prompt - cached,
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in rows)
    return out


def _pair(a: float, b: float, fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(a)} / {fmt.format(b)}"


#: (title, cell) of each table column; per-tier hits and bytes read "router's prediction / engines' report".
COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("policy", lambda r: r["policy"]),
    ("TTFT p50 ms", lambda r: f"{r['ttft_p50_ms']:.0f}"),
    ("TTFT p99 ms", lambda r: f"{r['ttft_p99_ms']:.0f}"),
    ("goodput", lambda r: f"{r['goodput']:.1%}"),
    ("cached", lambda r: f"{r['cached_token_ratio']:.1%}"),
    ("cached ÷ oracle", lambda r: f"{r['oracle_share']:.1%}"),
    ("GPU hits pred. / engine", lambda r: _pair(r["gpu_hits"], r["gpu_hits_engine"])),
    ("CPU hits pred. / engine", lambda r: _pair(r["cpu_hits"], r["cpu_hits_engine"])),
    ("REMOTE hits pred. / engine", lambda r: _pair(r["remote_hits"], r["remote_hits_engine"])),
    ("GB moved est. / engine", lambda r: _pair(r["gb_moved"], r["gb_moved_engine"], "{:.2f}")),
    ("stale / checked", lambda r: _pair(r["stale"], r["checked"])),
    ("recomputed tokens", lambda r: f"{r['recomputed']:.0f}"),
    ("errors", lambda r: f"{r['errors']:.0f}"),
)


def markdown(rows: list[dict[str, Any]], baselines: dict[str, str]) -> str:
    """A markdown table, with each policy's TTFT p50 and p99 as a ratio of the named baseline's."""
    lines = [
        "| " + " | ".join(t for t, _ in COLUMNS) + " | p50 / p99 vs " + " / ".join(baselines.values()) + " |",
        "|" + "---|" * (len(COLUMNS) + 1),
    ]
    refs = {name: next((r for r in rows if r["policy"] == name), None) for name in baselines.values()}
    for r in rows:
        cells = [cell(r) for _, cell in COLUMNS]
        ratios = []
        for ref in refs.values():
            if ref is None:
                continue
            p50, p99 = r["ttft_p50_ms"] / ref["ttft_p50_ms"], r["ttft_p99_ms"] / ref["ttft_p99_ms"]
            ratios.append(f"{p50:.2f}x / {p99:.2f}x")
        lines.append("| " + " | ".join(cells) + " | " + "; ".join(ratios) + " |")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--preset", default="qwen-32b-h100x2")
    ap.add_argument("--time-scale", type=float, default=0.25)
    ap.add_argument("--traces", default="agentic,chat")
    ap.add_argument("--policies", default=",".join(available_policies()))
    ap.add_argument("--repeats", type=int, default=1, help="runs per (trace, policy); medians are reported")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--sessions", type=int, default=32, help="agentic sessions")
    ap.add_argument("--chat-sessions", type=int, default=40)
    ap.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT SLO for goodput (simulated ms)")
    ap.add_argument("--arrival-rate", type=float, default=2.0, help="agentic sessions started per second")
    ap.add_argument("--steps", default="4,8", help="agentic steps per session: min,max")
    ap.add_argument(
        "--kv-protocol",
        choices=("none", "p2p"),
        default="p2p",
        help="the pool's KV-transfer protocol: p2p lets a policy name a remote_kv_source peer",
    )
    ap.add_argument(
        "--gpu-blocks",
        type=int,
        default=2000,
        help="GPU KV blocks per worker (0: the preset's); the default is small enough that "
        "sessions spill to the CPU tier",
    )
    ap.add_argument("--cpu-blocks", type=int, default=30000, help="CPU-tier blocks per worker (0 = none)")
    ap.add_argument("--out", default="out/bench-routing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    lo, hi = (int(x) for x in args.steps.split(","))
    steps = (lo, hi)
    traces = {
        "agentic": agentic_trace(args.seed, sessions=args.sessions, steps=steps, arrival_rate=args.arrival_rate),
        "chat": chat_trace(args.seed, sessions=args.chat_sessions, turns=(1, 2), arrival_rate=4.0),
    }
    fleet = FleetSpec(
        workers=args.workers,
        preset=args.preset,
        time_scale=args.time_scale,
        gpu_blocks=args.gpu_blocks or None,
        cpu_blocks=args.cpu_blocks,
    )
    router_config = {"pool": {"kv_protocol": args.kv_protocol}}
    block = get_preset(args.preset).block_size
    setting = (
        f"{args.workers} x {args.preset}, pool {args.kv_protocol}, "
        f"GPU blocks {args.gpu_blocks or get_preset(args.preset).gpu_blocks}, "
        f"CPU blocks {args.cpu_blocks or 0}"
    )
    policies = [p for p in args.policies.split(",") if p]
    report: dict[str, Any] = {"command": " ".join(sys.argv), "setting": setting, "tables": {}}
    began = time.monotonic()
    for kind in args.traces.split(","):
        trace = traces[kind]
        print(
            f"\n{kind}: {len(trace.sessions)} sessions, {trace.n_requests} requests, {setting}, "
            f"time scale {args.time_scale}, {args.repeats} run(s) per policy",
            flush=True,
        )
        per_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for rep in range(args.repeats):
            for policy in policies:  # interleaved, so machine noise spreads over every policy alike
                progress = Progress(f"{policy}#{rep + 1}", trace.n_requests)
                run = run_policy(policy, trace, fleet, workdir=logs, router_config=router_config, on_result=progress)
                progress.finish()
                per_policy[policy].append(figures(run, trace, args.time_scale, args.slo_ms, block))
        rows = [median_row(per_policy[p]) for p in policies]
        baselines = {"least_load": "least_load"} if kind == "chat" else {"prefix": "prefix"}
        text = markdown(rows, baselines if any(r["policy"] in baselines for r in rows) else {})
        print(f"\n## {kind}: medians of {args.repeats} run(s), goodput = TTFT ≤ {args.slo_ms:.0f} ms\n{text}")
        report["tables"][kind] = rows
        report.setdefault("runs", {})[kind] = per_policy
        png = chart(rows, out / f"routing-{kind}.png", f"{kind} trace: {setting}, medians of {args.repeats} run(s)")
        if png:
            print(f"chart: {png}")
        print(f"elapsed {time.monotonic() - began:.0f} s", flush=True)
    (out / "routing.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nresults: {out / 'routing.json'}; logs: {logs}; total {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
