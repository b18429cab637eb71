"""Time to first token of a cached prompt while many answers stream through the same router, in one run.

    .venv/bin/python bench/busy_ttft.py --rounds 3                  # kvroute and the real peers, 32 streams
    .venv/bin/python bench/busy_ttft.py --quick --routers kvaware,round_robin   # smoke test, no peers

``bench/peers_overhead.py`` times a request on an otherwise idle router. In production a router is never
idle: dozens of answers stream through it, a chunk per token, while new requests arrive. Here one simulated
fleet (``kvroute sim``, 2 workers, time scale 0.2 so answers last seconds) serves every target: ``direct``
(worker 0), ``kvroute serve`` (``kvaware``, ``round_robin``), smg 1.13.0 and vllm-router 0.1.17
(``cache_aware``, installed from PyPI into throwaway venvs under ``--work`` when missing). For each target
in turn, in an order rotated by round, ``--streams`` clients keep long streaming completions going through
it (``--answer-tokens`` each, a new one as soon as one ends), and meanwhile one client sends the same
streaming chat prompt of ``--prompt-tokens`` (a full prefix hit after the first) ``--probes`` times, one
after the other: its time to the first content token is the figure. "Added" = the target's probe p50 minus
direct's in the same round; cells are medians over rounds; "paired" = the median over rounds of the target
minus the best peer in that round. "Router CPU per chunk": the router process's CPU time (its threads and
children) during the round over the chunks the streams read, the probes' work included. Output under
``--work``: ``busy_ttft.json``, ``busy_ttft.md``, ``busy_ttft.png``.

"Streams' stall": the streams' gaps between two reads of one answer (p99 and the longest): what the
router's other work (the probes' decisions) costs the answers it relays. ``--fresh`` makes every probe a new
prompt (nothing cached: the router tokenizes all of it), ``--router-tokenizer`` gives kvroute's targets a
real model's tokenizer folder for the fleet's model (the workers keep theirs: no cache hit is expected,
the router's own time is what is measured), ``--baseline`` adds another install's kvaware:

    .venv/bin/python bench/busy_ttft.py --routers kvaware --baseline ../base/.venv/bin/python --fresh \
        --prompt-tokens 16384 --router-tokenizer <model folder> --streams 16 --probes 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import workloads
from kvroute.experiment import FleetSpec, fleet_process
from kvroute.report import pyplot, save_figure
from loadgen import stream_once
from peers import BASELINE, PEERS, ROUTERS, ensure_peer, router_names, router_process, routers_of, with_baseline
from peers_overhead import is_peer
from procstat import tree_cpu_s

DIRECT = "direct"
DEFAULT_ROUTERS = ("kvaware", "round_robin", "smg:cache_aware", "vllm-router:cache_aware")


async def keep_streaming(
    url: str, model: str, key: str, answer_tokens: int, stop: asyncio.Event, gaps: list[float]
) -> int:
    """One client's long answers, back to back, until ``stop``; returns the chunks it read and adds the
    seconds between two reads of one answer to ``gaps``."""
    chunks = 0
    n = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        while not stop.is_set():
            body = {"model": model, "prompt": f"{key} {n} tell a long story", "max_tokens": answer_tokens}
            n += 1
            async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
                last = None
                async for _ in resp.content.iter_any():
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
                    if stop.is_set():
                        break
    return chunks


async def probe(base: str, model: str, key: str, args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    """The probes' TTFTs with ``--streams`` answers streaming meanwhile; with the router's ``pid``, its CPU
    time per chunk the streams read (all its work meanwhile, the probes' too, over the chunks)."""
    stop = asyncio.Event()
    cpu0 = tree_cpu_s(pid) if pid is not None else None
    gaps: list[float] = []
    streams = [
        asyncio.create_task(keep_streaming(base, model, f"{key}/s{i}", args.answer_tokens, stop, gaps))
        for i in range(args.streams)
    ]

    def body(k: int) -> bytes:
        """The probe request (``--fresh``: the ``k``-th new prompt, else always the same one)."""
        n = args.probe_messages
        texts = [
            workloads.words(f"{key}/probe{k if args.fresh else ''}/{i}", args.prompt_tokens // n) for i in range(n)
        ]
        return orjson.dumps(
            {
                "model": model,
                "messages": [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )

    ttft: list[float] = []
    errors = 0
    try:
        await asyncio.sleep(args.settle_s)  # the streams under way
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            if not args.fresh:
                await stream_once(session, base + "/v1/chat/completions", body(0))  # cold: the prompt gets cached
            for k in range(args.probes):
                got = await stream_once(session, base + "/v1/chat/completions", body(k + 1))
                if got.ok and got.ttft_s is not None:
                    ttft.append(got.ttft_s * 1e3)
                else:
                    errors += 1
                await asyncio.sleep(args.gap_s)
    finally:
        stop.set()
        chunks = sum(await asyncio.gather(*streams))
    cpu = tree_cpu_s(pid) - cpu0 if pid is not None and cpu0 is not None else None
    ttft.sort()
    gaps.sort()
    return {
        "stall_p99_ms": gaps[int(0.99 * (len(gaps) - 1))] * 1e3 if gaps else float("nan"),
        "stall_max_ms": gaps[-1] * 1e3 if gaps else float("nan"),
        "p50_ms": statistics.median(ttft) if ttft else float("nan"),
        "p90_ms": ttft[int(0.9 * (len(ttft) - 1))] if ttft else float("nan"),
        "probes": len(ttft),
        "errors": errors,
        "stream_chunks": chunks,
        "cpu_us_per_chunk": cpu * 1e6 / chunks if cpu is not None and chunks else float("nan"),
    }


def cells_of(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per target: medians over rounds, the added p50 over direct in the same round, paired with the best peer."""
    by = {(r["round"], r["target"]): r for r in runs if "failed" not in r}
    rounds = sorted({r["round"] for r in runs})
    peers = [n for n in names if is_peer(n)]
    cells = []
    for name in names:
        mine = [by[(k, name)] for k in rounds if (k, name) in by]
        if not mine:
            continue
        cell: dict[str, Any] = {"target": name, "rounds": len(mine)}
        for key in ("p50_ms", "p90_ms", "cpu_us_per_chunk", "stall_p99_ms", "stall_max_ms"):
            cell[key] = statistics.median(r[key] for r in mine)
        cell["errors"] = sum(r["errors"] for r in mine)
        added = [
            by[(k, name)]["p50_ms"] - by[(k, DIRECT)]["p50_ms"] for k in rounds if (k, name) in by and (k, DIRECT) in by
        ]
        if name != DIRECT and added:
            cell["added_p50_ms"] = statistics.median(added)
        if name != DIRECT and not is_peer(name) and peers:
            diffs = []
            for k in rounds:
                theirs = [by[(k, p)]["p50_ms"] for p in peers if (k, p) in by]
                if (k, name) in by and theirs:
                    diffs.append(by[(k, name)]["p50_ms"] - min(theirs))
            if diffs:
                cell["paired_vs_best_peer_ms"] = statistics.median(diffs)
                cell["rounds_at_or_below_best_peer"] = sum(d <= 0 for d in diffs)
        cells.append(cell)
    return cells


def markdown(cells: list[dict[str, Any]]) -> str:
    def num(cell: dict[str, Any], key: str, fmt: str) -> str:
        return format(cell[key], fmt) if key in cell else "-"

    lines = [
        "| target | probe TTFT p50 ms | p90 ms | added p50 ms | minus best peer, paired ms | rounds <= best peer "
        "| router CPU µs per chunk | streams' stall p99 / longest ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {c['target']} | {c['p50_ms']:.2f} | {c['p90_ms']:.2f} | {num(c, 'added_p50_ms', '+.2f')} | "
            f"{num(c, 'paired_vs_best_peer_ms', '+.2f')} | {c.get('rounds_at_or_below_best_peer', '-')} of "
            f"{c['rounds']} | {'-' if math.isnan(c['cpu_us_per_chunk']) else format(c['cpu_us_per_chunk'], '.1f')} | "
            f"{c.get('stall_p99_ms', math.nan):.1f} / {c.get('stall_max_ms', math.nan):.1f} | {c['errors']} |"
        )
    return "\n".join(lines)


def chart(cells: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    plt = pyplot()
    shown = [c for c in cells if "added_p50_ms" in c]
    if plt is None or not shown:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh([c["target"] for c in shown], [c["added_p50_ms"] for c in shown], color="#4c72b0")
    ax.set_xlabel("added probe TTFT p50 over direct (ms)")
    ax.invert_yaxis()
    return save_figure(plt, fig, path, title)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", help=f"comma-separated, of {', '.join(ROUTERS)} (default {','.join(DEFAULT_ROUTERS)})")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 3; --quick 1)")
    ap.add_argument("--streams", type=int, help="answers streaming meanwhile (default 32; --quick 4)")
    ap.add_argument("--answer-tokens", type=int, help="tokens of each streamed answer (default 2000; --quick 200)")
    ap.add_argument("--probes", type=int, help="timed probe requests per target and round (default 60; --quick 5)")
    ap.add_argument("--prompt-tokens", type=int, default=900, help="the probe's prompt")
    ap.add_argument("--settle-s", type=float, default=1.0, help="streaming before the first probe")
    ap.add_argument("--gap-s", type=float, default=0.02, help="pause between probes")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--preset", default="llama-8b-h100")
    ap.add_argument("--time-scale", type=float, default=0.2, help="the fleet's: answers last seconds")
    ap.add_argument("--work", default="out/busy_ttft", help="work folder: peer venvs, logs, results")
    ap.add_argument("--chart", type=Path, help="also write the chart here")
    ap.add_argument("--fresh", action="store_true", help="every probe a new prompt (nothing cached)")
    ap.add_argument("--probe-messages", type=int, default=1, help="the probe's prompt split into this many messages")
    ap.add_argument("--router-tokenizer", help="kvroute's tokenizer for the fleet's model (a model folder)")
    ap.add_argument("--baseline", metavar="PYTHON", help=f"another install's kvaware too, as {BASELINE}")
    ap.add_argument("--quick", action="store_true", help="a smoke test (under a minute)")
    args = ap.parse_args(argv)
    args.routers = router_names(args.routers, DEFAULT_ROUTERS)
    args.routers = with_baseline(args.routers, args.baseline)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.streams = args.streams or (4 if args.quick else 32)
    args.answer_tokens = args.answer_tokens or (200 if args.quick else 2000)
    args.probes = args.probes or (5 if args.quick else 60)
    if args.quick:
        args.settle_s = min(args.settle_s, 0.3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    routers = routers_of(args.routers, args.baseline)
    exes = {r.kind: ensure_peer(PEERS[r.kind], work) for r in routers if r.kind in PEERS}
    logs = work / f"runs-{time.strftime('%Y%m%d-%H%M%S')}"
    logs.mkdir()
    fleet = FleetSpec(workers=args.workers, preset=args.preset, time_scale=args.time_scale)
    setting = f"{args.workers} x {args.preset} (kvroute sim, time scale {args.time_scale:g}), {args.streams} streams"
    names = [DIRECT, *args.routers]
    meta = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "setting": setting}
    runs: list[dict[str, Any]] = []
    began = time.monotonic()
    print(f"{len(names)} targets x {args.rounds} rounds; {setting}; logs in {logs}", flush=True)
    with fleet_process(fleet, logs, "busy-ttft") as config:
        model = config["models"][0]["name"]
        with contextlib.ExitStack() as stack:
            bases = {DIRECT: config["workers"][0]["url"].rstrip("/")}
            pids: dict[str, int] = {}
            for router in routers:
                served = config
                if router.kind == "kvroute" and args.router_tokenizer:
                    models = [{**m, "tokenizer": args.router_tokenizer} for m in config["models"]]
                    served = {**config, "models": models}
                try:
                    running = stack.enter_context(router_process(router, served, logs, exes))
                    bases[router.name], pids[router.name] = running.base, running.pid
                except Exception as exc:  # a router that does not start must not lose the others
                    runs.append({"round": 0, "target": router.name, "failed": f"{type(exc).__name__}: {exc}"[:2000]})
                    print(f"  {router.name} did not start: {exc}"[:300], file=sys.stderr, flush=True)
            for rnd in range(args.rounds):
                live = [n for n in names if n in bases]
                for name in live[rnd % len(live) :] + live[: rnd % len(live)]:
                    row = asyncio.run(probe(bases[name], model, f"r{rnd}/{name}", args, pids.get(name)))
                    runs.append({"round": rnd, "target": name, **row})
                    print(
                        f"[{time.monotonic() - began:5.0f} s] round {rnd + 1}/{args.rounds} {name:<24} probe TTFT "
                        f"p50 {row['p50_ms']:7.2f} ms  p90 {row['p90_ms']:7.2f} ms  {row['stream_chunks']} chunks "
                        f"streamed ({row['cpu_us_per_chunk']:.1f} µs of router CPU each, longest gap "
                        f"{row['stall_max_ms']:.1f} ms)  {row['errors']} errors",
                        flush=True,
                    )
    cells = cells_of(runs, names)
    (work / "busy_ttft.json").write_text(json.dumps({**meta, "runs": runs, "cells": cells}, indent=1))
    text = "\n".join([f"# Probe TTFT while answers stream: {setting}", "", markdown(cells), ""])
    (work / "busy_ttft.md").write_text(text)
    print("\n" + text)
    png = chart(cells, work / "busy_ttft.png", f"cached-prompt TTFT added over direct: {setting}")
    if png is not None and args.chart is not None:
        args.chart.parent.mkdir(parents=True, exist_ok=True)
        args.chart.write_bytes(png.read_bytes())
    print(f"results: {work / 'busy_ttft.json'}, {work / 'busy_ttft.md'}; total {time.monotonic() - began:.0f} s")
    return 1 if any("failed" in r for r in runs) or any(c["errors"] for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
