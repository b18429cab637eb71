"""``kvroute demo``: what kvroute is for, on one machine, with no external service.

Starts a simulated fleet (4 workers, an 8B-class preset) and the router with its embedded in-memory
index, replays the same seeded agentic trace once per policy, then prints a comparison table and
writes a PNG chart. Times are the simulated hardware's (real seconds divided by the time scale).

The fleet is the one kvroute is built for: a GPU cache too small for every session's history, a CPU
tier behind it (vLLM's offloading connector) and P2P between workers (``pool.kv_protocol: p2p``), so
a prefix may sit on GPU, on CPU or on a peer, and a policy has to weigh where to go.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

DEFAULT_POLICIES = ("round_robin", "least_load", "approx_text", "prefix", "kvaware")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="simulated fleet + router + agentic trace, every policy compared"
    )
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--preset", default="llama-8b-h100")
    p.add_argument("--sessions", type=int, default=16, help="agent sessions in the trace")
    p.add_argument("--steps", default="6,12", help="steps per session, min,max")
    p.add_argument("--time-scale", type=float, default=0.25, help="model seconds x scale = real seconds")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--kv-protocol",
        choices=("none", "p2p"),
        default="p2p",
        help="p2p: workers fetch from peers when the router names one",
    )
    p.add_argument("--gpu-blocks", type=int, default=2000, help="GPU KV blocks per worker")
    p.add_argument("--cpu-blocks", type=int, default=30000, help="CPU-tier blocks per worker (0 = none)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated policy names")
    p.add_argument("--out", default="out/demo", help="folder for the chart, the table and the logs")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from kvroute.experiment import FleetSpec, Progress, run_policy
    from kvroute.policies import available_policies
    from kvroute.report import chart, model_time_row, table
    from kvroute.sim.traces import agentic_trace

    known = set(available_policies())
    policies = [p for p in args.policies.split(",") if p]
    missing = [p for p in policies if p not in known]
    if missing:
        print(f"kvroute demo: skipping unknown policies {missing} (available: {sorted(known)})", file=sys.stderr)
        policies = [p for p in policies if p in known]
    lo, hi = (int(v) for v in args.steps.split(","))
    trace = agentic_trace(args.seed, sessions=args.sessions, steps=(lo, hi), arrival_rate=2.0)
    fleet = FleetSpec(
        workers=args.workers,
        preset=args.preset,
        time_scale=args.time_scale,
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
    )
    router_config = {"pool": {"kv_protocol": args.kv_protocol}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="kvroute-demo-"))
    print(
        f"kvroute demo: {args.workers} simulated workers ({args.preset}, {args.gpu_blocks} GPU + "
        f"{args.cpu_blocks} CPU blocks each, pool {args.kv_protocol}), agentic trace of "
        f"{len(trace.sessions)} sessions / {trace.n_requests} requests, {len(policies)} policies"
    )
    rows = []
    for policy in policies:
        progress = Progress(policy, trace.n_requests)
        result = run_policy(policy, trace, fleet, workdir=logs, router_config=router_config, on_result=progress)
        progress.finish()
        rows.append(model_time_row(result.summary(), args.time_scale))
    text = table(rows, baseline="round_robin" if "round_robin" in policies else None)
    print()
    print(text)
    (out / "demo.txt").write_text(text + "\n")
    png = chart(rows, out / "demo.png", f"kvroute demo: agentic trace, {args.workers} workers, {args.preset}")
    print(f"\ntable: {out / 'demo.txt'}" + (f"  chart: {png}" if png else "  (no matplotlib: no chart)"))
    print(f"logs of the fleet and router runs: {logs}")
    return 0
