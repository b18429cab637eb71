"""What relaying a stream costs each router: its CPU per streamed token, and the gaps it adds between tokens.

    .venv/bin/python bench/relay_cost.py --repeats 3          # kvroute, smg and vllm-router, 3 rounds
    .venv/bin/python bench/relay_cost.py --quick --routers kvaware   # smoke test, no peers

Decode streams are most of what a router carries: a pool answering a few thousand tokens a second per
worker sends the router one SSE event per token per stream, and each costs the router a read, a parse and
a write. ``bench/peers_overhead.py`` runs its fleet at time scale 0.001, where a whole answer arrives at
once; here the fleet (``kvroute sim``, one ``--preset`` worker, so every target's streams share the same
batch and the gaps compare) runs at ``--time-scale`` 0.2 so tokens come one decode step apart, as from an
engine. Targets: ``direct`` (the client straight to the worker: the fleet's own gaps), kvroute ``kvaware``
and ``round_robin``, smg 1.13.0 and vllm-router 0.1.17 ``cache_aware`` (PyPI, throwaway venvs under
``--work``), each started once in front of the same workers; each round runs every target in turn, the
order rotated by round.

A round for one target: ``--streams`` streaming chat requests of ``--tokens`` answer tokens
(``ignore_eos``), ``--concurrency`` at a time, from an aiohttp client in this process. Reported per target,
medians over rounds: the router process's CPU time (threads and children) per streamed token, tokens/s,
and the client-side gap between consecutive content events (p50 / p99) against direct's in the same
round. Output under ``--work``: ``relay_cost.json`` and ``relay_cost.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from kvroute.experiment import FleetSpec, fleet_process
from peers import PEERS, ROUTERS, ensure_peer, router_names, router_process
from procstat import tree_cpu_s

DEFAULT_ROUTERS = ("kvaware", "round_robin", "smg:cache_aware", "vllm-router:cache_aware")
DIRECT = "direct"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _has_content(payload: bytes) -> bool:
    """An SSE event carrying answer text (not the role, the usage or an empty delta)."""
    choices = orjson.loads(payload).get("choices") or ()
    return any((c.get("delta") or {}).get("content") for c in choices)


async def streams(base: str, model: str, n: int, tokens: int, concurrency: int, tag: str) -> dict[str, Any]:
    """``n`` streams through ``base``: tokens received, errors, gaps between content events (ms), wall time."""
    gate = asyncio.Semaphore(concurrency)
    gaps: list[float] = []
    got = errors = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal got, errors
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"relay {tag} {i}: " + "words to answer " * 40}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
        }
        async with gate:
            try:
                async with session.post(base + "/v1/chat/completions", data=orjson.dumps(body)) as resp:
                    if resp.status != 200:
                        errors += 1
                        return
                    last = None
                    async for line in resp.content:
                        if not line.startswith(b"data: {") or not _has_content(line[6:]):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append((now - last) * 1e3)
                        last = now
                        got += 1
            except aiohttp.ClientError:
                errors += 1

    began = time.perf_counter()
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(n)))
    wall = time.perf_counter() - began
    return {
        "tokens": got,
        "errors": errors,
        "wall_s": wall,
        "gap_p50_ms": _pct(gaps, 0.5),
        "gap_p99_ms": _pct(gaps, 0.99),
    }


def measure(base: str, model: str, pid: int | None, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    before = tree_cpu_s(pid) if pid is not None else None
    row = asyncio.run(streams(base, model, args.streams, args.tokens, args.concurrency, tag))
    cpu = (tree_cpu_s(pid) - before) if pid is not None and before is not None else float("nan")
    row["cpu_us_per_token"] = cpu * 1e6 / row["tokens"] if row["tokens"] else float("nan")
    row["tokens_per_s"] = row["tokens"] / row["wall_s"] if row["wall_s"] else float("nan")
    return row


def cells_of(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per target, medians over rounds; gaps also as the difference to direct's in the same round."""
    direct = {r["round"]: r for r in runs if r["target"] == DIRECT}
    cells = []
    for name in names:
        rows = [r for r in runs if r["target"] == name]
        if not rows:
            continue
        cell: dict[str, Any] = {"target": name, "rounds": len(rows), "errors": sum(r["errors"] for r in rows)}
        for key in ("cpu_us_per_token", "tokens_per_s", "gap_p50_ms", "gap_p99_ms"):
            cell[key] = statistics.median(r[key] for r in rows)
        for key in ("gap_p50_ms", "gap_p99_ms"):
            deltas = [r[key] - direct[r["round"]][key] for r in rows if r["round"] in direct]
            cell["added_" + key] = statistics.median(deltas) if deltas else float("nan")
        cells.append(cell)
    peers = [c for c in cells if c["target"] in ROUTERS and ROUTERS[c["target"]].kind in PEERS]
    best = min((c["cpu_us_per_token"] for c in peers), default=None)
    for c in cells:
        c["cpu_vs_best_peer"] = c["cpu_us_per_token"] / best if best else float("nan")
    return cells


def markdown(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| target | router CPU µs / token | ÷ best peer | tokens/s | gap p50 ms | gap p99 ms | + gap p50 | + gap p99 "
        "| errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {c['target']} | {c['cpu_us_per_token']:.1f} | {c['cpu_vs_best_peer']:.2f}x | {c['tokens_per_s']:.0f} | "
            f"{c['gap_p50_ms']:.2f} | {c['gap_p99_ms']:.2f} | {c['added_gap_p50_ms']:+.2f} | "
            f"{c['added_gap_p99_ms']:+.2f} | {c['errors']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--routers", help="comma-separated, of " + ", ".join(ROUTERS) + f" (default {','.join(DEFAULT_ROUTERS)})"
    )
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3; --quick 1)")
    ap.add_argument("--streams", type=int, default=64, help="streams per round and target (default 64)")
    ap.add_argument("--tokens", type=int, default=256, help="answer tokens per stream (default 256)")
    ap.add_argument("--concurrency", type=int, default=16, help="streams at once (default 16)")
    ap.add_argument("--workers", type=int, default=1, help="more spread the streams (direct uses the first)")
    ap.add_argument("--preset", default="llama-8b-h100")
    ap.add_argument("--time-scale", type=float, default=0.2, help="the fleet's (tokens a decode step apart)")
    ap.add_argument("--work", default="out/relay_cost", help="work folder: peer venvs, logs, results")
    ap.add_argument("--quick", action="store_true", help="1 round, 8 streams of 32 tokens (seconds)")
    args = ap.parse_args(argv)
    args.routers = router_names(args.routers, DEFAULT_ROUTERS)
    if args.quick:
        args.repeats, args.streams, args.tokens, args.concurrency = 1, 8, 32, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="runs-", dir=work))
    exes = {
        ROUTERS[n].kind: ensure_peer(PEERS[ROUTERS[n].kind], work) for n in args.routers if ROUTERS[n].kind in PEERS
    }
    names = [DIRECT, *args.routers]
    fleet = FleetSpec(workers=args.workers, preset=args.preset, time_scale=args.time_scale)
    meta = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "logs": str(logs)}
    print(
        f"{len(names)} targets x {args.repeats} rounds of {args.streams} streams x {args.tokens} tokens; logs in {logs}"
    )
    runs: list[dict[str, Any]] = []
    began = time.monotonic()
    with fleet_process(fleet, logs, "relay-cost") as config:
        model = config["models"][0]["name"]
        bases: dict[str, str] = {DIRECT: config["workers"][0]["url"].rstrip("/")}
        pids: dict[str, int] = {}
        with contextlib.ExitStack() as stack:
            for name in args.routers:
                started = stack.enter_context(router_process(ROUTERS[name], config, logs, exes))
                bases[name], pids[name] = started.base, started.pid
            for name in names:  # first-use costs (connections, caches), untimed
                asyncio.run(streams(bases[name], model, 4, 8, 4, f"warm-{name}"))
            for rnd in range(args.repeats):
                for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                    row = measure(bases[name], model, pids.get(name), args, f"r{rnd}-{name}")
                    runs.append({"round": rnd, "target": name, **row})
                    print(
                        f"[{time.monotonic() - began:5.0f} s] round {rnd + 1}/{args.repeats} {name:<24} "
                        f"CPU {row['cpu_us_per_token']:6.1f} µs/token  {row['tokens_per_s']:7.0f} tokens/s  "
                        f"gap p50 {row['gap_p50_ms']:.2f} p99 {row['gap_p99_ms']:.2f} ms  {row['errors']} errors",
                        flush=True,
                    )
    cells = cells_of(runs, names)
    (work / "relay_cost.json").write_text(json.dumps({**meta, "runs": runs, "cells": cells}, indent=1, default=str))
    text = f"# Relaying streams: {args.workers} x {args.preset}, time scale {args.time_scale:g}\n\n{markdown(cells)}\n"
    (work / "relay_cost.md").write_text(text)
    print("\n" + text)
    return 1 if any(c["errors"] for c in cells) else 0


if __name__ == "__main__":
    raise SystemExit(main())
