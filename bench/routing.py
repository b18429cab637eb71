"""Routing quality of every policy on the simulated fleet (``kvroute sim``), the same arrivals for all.

    .venv/bin/python bench/routing.py [--workers 8] [--preset qwen-32b-h100x2] [--repeats 1]

For each trace (agentic multi-turn, plain chat) and each policy of ``available_policies()``, a fresh
fleet and router are started (``kvroute.experiment.run_policy``: cold caches, empty index) and the same
seeded trace is replayed through the router. Times are the simulated hardware's (real seconds divided
by the time scale). Reported per policy: TTFT p50/p99, goodput (share of requests whose TTFT is within
the SLO), cached tokens as a share of the oracle's, predicted hits per tier, estimated bytes moved,
stale decisions (router ``/metrics``), recomputed tokens. With ``--repeats N`` every figure is the
median over N runs. Then the multi-turn reuse case (``--reuse``): full prefill of a ~24k-token history
vs pulling the previous turn's decoder KV (NIXL bidirectional reuse) on two simulated workers.

The oracle: for every request, the most prompt tokens any routing could have served from cache given
what earlier requests computed, assuming caches never evict (no eviction happens at these sizes) and
whole blocks only, minus the last prompt token the engine always computes. A session's later turn
extends its previous turn, so it can reuse that turn's prompt and answer (whose tokens re-tokenise
identically in the simulator); a session's first turn can reuse the longest prefix it shares with any
request whose prefill had finished (first token received) before it was sent (the shared system
prompt): a prefix still being computed elsewhere is no hit for a request admitted meanwhile. It is
computed from the replayed token counts and the trace's text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvroute.experiment import FleetSpec, PolicyRun, Progress, run_policy
from kvroute.policies import available_policies
from kvroute.report import chart
from kvroute.sim.presets import get_preset
from kvroute.sim.replay import RequestResult, percentile
from kvroute.sim.timing import prefill_seconds, transfer_seconds
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
    sessions = {s.id: s for s in trace.sessions}
    first_turns: dict[str, list[int]] = {
        s.id: encode_chat([{"role": "system", "content": s.system}, {"role": s.steps[0].role,
                                                                      "content": s.steps[0].content}])
        for s in trace.sessions}
    ok = [r for r in results if r.ok]
    by_turn = {(r.session, r.turn): r for r in ok}
    # When each request's prompt was in some cache: at its first token.
    computed = sorted((r.sent_s + (r.ttft_s or 0.0), r.session) for r in ok)
    total = 0
    for r in ok:
        usable = (r.prompt_tokens - 1) // block * block
        if r.turn == 0:
            tokens = first_turns.get(r.session, [])
            # Every prompt of another session starts with that session's first turn and diverges from
            # ours no later than there, so its first turn's tokens give the shared prefix.
            shared = max((_lcp(tokens, first_turns[s]) for t, s in computed
                          if t <= r.sent_s and s != r.session and s in sessions), default=0)
            total += min(usable, shared // block * block)
            continue
        prev = by_turn.get((r.session, r.turn - 1))
        if prev is None:
            continue
        held = (prev.prompt_tokens + prev.completion_tokens - 1) // block * block
        total += min(usable, held)
    return total


# -- one run's figures -----------------------------------------------------------------------------

def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def figures(run: PolicyRun, trace: Trace, time_scale: float, slo_ms: float) -> dict[str, Any]:
    results = run.report.results
    ok = [r for r in results if r.ok]
    ttft_ms = [r.ttft_s * 1000 / time_scale for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    oracle = oracle_cached(trace, results)
    m = _samples(run.router_metrics)
    tiers = {labels.get("tier", "?"): v for labels, v in m.get("kvroute_predicted_hit_tokens_total", [])}
    return {
        "policy": run.policy, "requests": len(results), "errors": len(results) - len(ok),
        "ttft_p50_ms": percentile(ttft_ms, 50) or float("nan"),
        "ttft_p99_ms": percentile(ttft_ms, 99) or float("nan"),
        "goodput": sum(1 for t in ttft_ms if t <= slo_ms) / len(results) if results else 0.0,
        "cached_token_ratio": cached / prompt if prompt else 0.0,
        "oracle_share": cached / oracle if oracle else 1.0,
        "gpu_hits": tiers.get("GPU", 0.0), "cpu_hits": tiers.get("CPU", 0.0),
        "remote_hits": tiers.get("REMOTE", 0.0),
        "gb_moved": _total(m, "kvroute_estimated_kv_bytes_moved_total") / 1e9,
        "stale": _total(m, "kvroute_stale_decisions_total"),
        "checked": _total(m, "kvroute_checked_decisions_total"),
        "recomputed": prompt - cached,
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in rows)
    return out


COLUMNS = (("policy", "{}"), ("ttft_p50_ms", "{:.0f}"), ("ttft_p99_ms", "{:.0f}"), ("goodput", "{:.1%}"),
           ("cached_token_ratio", "{:.1%}"), ("oracle_share", "{:.1%}"), ("gpu_hits", "{:.0f}"),
           ("cpu_hits", "{:.0f}"), ("remote_hits", "{:.0f}"), ("gb_moved", "{:.2f}"), ("stale", "{:.0f}"),
           ("checked", "{:.0f}"), ("recomputed", "{:.0f}"), ("errors", "{:.0f}"))
TITLES = ("policy", "TTFT p50 ms", "TTFT p99 ms", "goodput", "cached", "cached ÷ oracle",
          "GPU hits (pred.)", "CPU hits (pred.)", "REMOTE hits (pred.)", "GB moved (est.)", "stale",
          "checked", "recomputed tokens", "errors")


def markdown(rows: list[dict[str, Any]], baselines: dict[str, str]) -> str:
    """A markdown table, with each policy's TTFT p50 and p99 as a ratio of the named baseline's."""
    lines = ["| " + " | ".join(TITLES) + " | p50 / p99 vs " + " / ".join(baselines.values()) + " |",
             "|" + "---|" * (len(TITLES) + 1)]
    refs = {name: next((r for r in rows if r["policy"] == name), None) for name in baselines.values()}
    for r in rows:
        cells = [fmt.format(r[key]) for key, fmt in COLUMNS]
        ratios = []
        for ref in refs.values():
            if ref is None:
                continue
            p50, p99 = r["ttft_p50_ms"] / ref["ttft_p50_ms"], r["ttft_p99_ms"] / ref["ttft_p99_ms"]
            ratios.append(f"{p50:.2f}x / {p99:.2f}x")
        lines.append("| " + " | ".join(cells) + " | " + "; ".join(ratios) + " |")
    return "\n".join(lines)


# -- the multi-turn reuse case ----------------------------------------------------------------------

async def _reuse_case(preset: str, history: int, new_tokens: int, time_scale: float) -> dict[str, float]:
    """Turn 2 of a conversation with a ``history``-token past: prefill it all vs pull the decoder's KV."""
    import httpx
    from kvroute.sim.fleet import SimFleet

    words = [f"w{i % 997}" for i in range(history)]
    fresh = [f"n{i % 991}" for i in range(new_tokens)]
    async with SimFleet(2, preset=preset, roles=["prefill", "decode"], time_scale=time_scale) as fleet:
        p_url, d_url = (w.url for w in fleet.workers)
        async with httpx.AsyncClient(timeout=120) as client:
            async def call(url: str, prompt: str, kv: dict[str, Any] | None) -> tuple[float, dict[str, Any]]:
                body: dict[str, Any] = {"model": fleet.model_config()["name"], "prompt": prompt,
                                        "max_tokens": 1, "stream": False}
                if kv is not None:
                    body["kv_transfer_params"] = kv
                t0 = time.perf_counter()
                resp = await client.post(url + "/v1/completions", json=body)
                resp.raise_for_status()
                return (time.perf_counter() - t0) / time_scale, resp.json()

            turn1 = " ".join(words)
            nixl_out = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}
            # Turn 1: prefill on P, decode on D (D keeps prompt + answer for the next turn).
            _, first = await call(p_url, turn1, nixl_out)
            _, decoded = await call(d_url, turn1, first["kv_transfer_params"])
            keep = decoded.get("kv_transfer_params")
            turn2 = turn1 + " " + " ".join(fresh)
            # Full prefill of turn 2 on a worker that has nothing cached (the decoder's peer, reset).
            await client.post(p_url + "/reset_prefix_cache")
            full_s, _ = await call(p_url, turn2, None)
            await client.post(p_url + "/reset_prefix_cache")
            reuse_s, _ = await call(p_url, turn2, {**(keep or {}), "do_remote_decode": True,
                                                   "do_remote_prefill": False})
    p = get_preset(preset)
    blocks = history // p.block_size
    model_full = prefill_seconds(p, history + new_tokens)
    model_reuse = transfer_seconds(p, blocks) + prefill_seconds(p, history + new_tokens - blocks * p.block_size,
                                                                 blocks * p.block_size)
    return {"history_tokens": history, "new_tokens": new_tokens, "full_prefill_ms": full_s * 1000,
            "reuse_ms": reuse_s * 1000, "kept_params": float(keep is not None),
            "timing_model_full_ms": model_full * 1000, "timing_model_reuse_ms": model_reuse * 1000}


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
    ap.add_argument("--sessions", type=int, default=16, help="agentic sessions")
    ap.add_argument("--chat-sessions", type=int, default=40)
    ap.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT SLO for goodput (simulated ms)")
    ap.add_argument("--reuse", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the multi-turn reuse case (~24k-token history)")
    ap.add_argument("--reuse-time-scale", type=float, default=1.0,
                    help="time scale of the reuse case (1.0: the simulator's own CPU time, which counts as "
                         "model time, is not magnified)")
    ap.add_argument("--out", default="out/bench-routing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    traces = {
        "agentic": agentic_trace(args.seed, sessions=args.sessions, steps=(4, 8), arrival_rate=2.0),
        "chat": chat_trace(args.seed, sessions=args.chat_sessions, turns=(1, 2), arrival_rate=4.0),
    }
    fleet = FleetSpec(workers=args.workers, preset=args.preset, time_scale=args.time_scale)
    policies = [p for p in args.policies.split(",") if p]
    report: dict[str, Any] = {"command": " ".join(sys.argv), "tables": {}}
    began = time.monotonic()
    for kind in args.traces.split(","):
        trace = traces[kind]
        print(f"\n{kind}: {len(trace.sessions)} sessions, {trace.n_requests} requests, {args.workers} workers "
              f"({args.preset}), time scale {args.time_scale}, {args.repeats} run(s) per policy", flush=True)
        per_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for rep in range(args.repeats):
            for policy in policies:  # interleaved, so machine noise spreads over every policy alike
                progress = Progress(f"{policy}#{rep + 1}", trace.n_requests)
                run = run_policy(policy, trace, fleet, workdir=logs, on_result=progress)
                progress.finish()
                per_policy[policy].append(figures(run, trace, args.time_scale, args.slo_ms))
        rows = [median_row(per_policy[p]) for p in policies]
        baselines = {"least_load": "least_load"} if kind == "chat" else {"prefix": "prefix"}
        text = markdown(rows, baselines if any(r["policy"] in baselines for r in rows) else {})
        print(f"\n## {kind}: medians of {args.repeats} run(s), goodput = TTFT ≤ {args.slo_ms:.0f} ms\n{text}")
        report["tables"][kind] = rows
        report.setdefault("runs", {})[kind] = per_policy
        png = chart(rows, out / f"routing-{kind}.png",
                    f"{kind} trace: {args.workers} x {args.preset}, medians of {args.repeats} run(s)")
        if png:
            print(f"chart: {png}")
        print(f"elapsed {time.monotonic() - began:.0f} s", flush=True)
    if args.reuse:
        case = asyncio.run(_reuse_case(args.preset, 24_000, 200, args.reuse_time_scale))
        case["ratio"] = case["reuse_ms"] / case["full_prefill_ms"]
        report["reuse"] = case
        print(f"\n## multi-turn reuse, {args.preset}, {case['history_tokens']}-token history + "
              f"{case['new_tokens']} new tokens\nfull prefill {case['full_prefill_ms']:.0f} ms, reuse of the "
              f"decoder's KV {case['reuse_ms']:.0f} ms: ratio {case['ratio']:.2f} (published: 778 vs 460 ms, 0.59); "
              f"the timing model alone: {case['timing_model_full_ms']:.0f} vs {case['timing_model_reuse_ms']:.0f} ms")
    (out / "routing.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nresults: {out / 'routing.json'}; logs: {logs}; total {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
