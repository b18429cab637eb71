"""What each router adds over a direct connection, in one run: kvroute, smg and vllm-router on the same workers.

    .venv/bin/python bench/peers_overhead.py --repeats 3       # every router, 3 interleaved rounds
    .venv/bin/python bench/peers_overhead.py --quick --routers kvaware,round_robin   # smoke test, no peers
    .venv/bin/python bench/peers_overhead.py --profile         # + py-spy of kvaware on the largest growing case
    .venv/bin/python bench/peers_overhead.py --profile "small c32" "grow 32k"   # ... on the cases named

One simulated fleet (``kvroute sim``, 2 workers, time scale 0.001: engine time ~0, so what is left is HTTP,
parsing, tokenizing and routing) serves every target: ``direct`` (the client straight to worker 0),
``kvroute serve`` with ``round_robin`` and ``kvaware`` (the fleet's own config, so the router tokenizes
with the tokenizer the workers use, as a user's config would), smg 1.13.0 ``cache_aware`` and
vllm-router 0.1.17 ``cache_aware``, installed from PyPI into throwaway venvs under ``--work`` when missing
(never into ``.venv``). Every router is started once, in front of the same workers; each round runs each
scenario against every target in turn, in an order rotated by round, so the targets a scenario compares
are measured seconds apart and drift on a shared machine hits all of them alike (idle routers only see
health checks, and kvroute's the KV events of the others' traffic).

Scenarios, from an aiohttp client in this process (``loadgen.py``):

- ``small cN``: ``--requests`` tiny non-streaming ``/v1/completions`` (``max_tokens`` 1) from N closed-loop
  clients (after 200 sequential warm-up requests): latency of the whole request, requests/s.
- ``cached Nk``: one streaming chat request of N tokens sent ``--steps`` times in a row after one untimed
  cold request: every one a full prefix hit (a shared system prompt, a retried turn); latency = TTFT.
- ``grow Nk``: an agent's loop: a system prompt of N tokens of deterministic words, then ``--steps``
  sequential streaming chat requests (``stream_options.include_usage``), each the previous prompt plus
  an answer and a new tool output of ``--step-tokens``: latency = time to the first token (TTFT). Each
  target's sequence starts cold with one untimed request; the text is seeded by (round, target), same
  sizes for all: an agent's prompts are new to the cache, and replaying another router's exact
  prompts would hand the later routers answers already cached whole.

"Added" = the target's p50 (p99) minus direct's in the same round; a cell is the median over rounds
(min-max spread in the JSON). Ratios: to direct, and to the best peer (the lowest added latency, the
highest requests/s). "CPU ms/req": the router process's CPU time (all its threads and children) over the
timed requests, per request: its own work, KV events included, steadier than latency on a shared machine
(the other routers are idle meanwhile, so theirs is not counted). Output under ``--work``:
``peers_overhead.json``, ``peers_overhead.md``, ``peers_overhead.png`` (and ``--chart`` for a copy); with
``--profile``, ``profile-<router>-<scenario>.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import workloads
from kvroute.experiment import FleetSpec, fleet_process
from kvroute.report import pyplot, save_figure
from loadgen import Stats, closed_loop, latency_stats, stream_once
from peers import (
    BASELINE,
    PEERS,
    ROUTERS,
    Router,
    ensure_peer,
    kvroute_process,
    router_names,
    router_of,
    router_process,
)
from procstat import tree_cpu_s

DEFAULT_ROUTERS = ("kvaware", "round_robin", "smg:cache_aware", "vllm-router:cache_aware")
DIRECT = "direct"


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    #: "small" (closed-loop completions), "grow" (an agent's growing prompt, sequential, streamed) or
    #: "cached" (one prompt again and again, sequential, streamed: a fully cached prefix) or "fresh" (a new
    #: prompt every time, sequential, streamed: nothing cached, nothing to extend, as a new RAG context).
    kind: str
    concurrency: int = 1
    prefix_tokens: int = 0


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    out = [Scenario(f"small c{c}", "small", concurrency=c) for c in args.concurrency]
    for n in args.prefix_tokens:
        out.append(Scenario(f"grow {n // 1024}k" if n % 1024 == 0 else f"grow {n}", "grow", prefix_tokens=n))
    for n in args.cached_tokens:
        out.append(Scenario(f"cached {n // 1024}k" if n % 1024 == 0 else f"cached {n}", "cached", prefix_tokens=n))
    for n in args.fresh_tokens:
        out.append(Scenario(f"fresh {n // 1024}k" if n % 1024 == 0 else f"fresh {n}", "fresh", prefix_tokens=n))
    return out


# -- the load -------------------------------------------------------------------------------------------------------


def small_body(model: str) -> bytes:
    return orjson.dumps({"model": model, "prompt": "hello", "max_tokens": 1})


def growing_bodies(model: str, key: str, prefix_tokens: int, steps: int, step_tokens: int, answer: int) -> list[bytes]:
    """``steps + 1`` chat requests (the first one the cold warm-up), each the previous prompt plus an
    answer and a new tool output; the words depend on ``key`` alone."""
    messages = [{"role": "system", "content": workloads.words(f"{key}/prefix", prefix_tokens)}]
    bodies = []
    for k in range(steps + 1):
        messages.append({"role": "user", "content": workloads.words(f"{key}/tool{k}", step_tokens)})
        body = {"model": model, "messages": messages, "max_tokens": answer, "stream": True}
        bodies.append(orjson.dumps({**body, "stream_options": {"include_usage": True}}))
        messages.append({"role": "assistant", "content": workloads.words(f"{key}/answer{k}", answer)})
    return bodies


def repeated_bodies(model: str, key: str, tokens: int, steps: int, answer: int) -> list[bytes]:
    """``steps + 1`` times the same chat request of ``tokens`` words (the first one the cold warm-up)."""
    messages = [
        {"role": "system", "content": workloads.words(f"{key}/system", max(1, tokens - 32))},
        {"role": "user", "content": workloads.words(f"{key}/question", 32)},
    ]
    body = {"model": model, "messages": messages, "max_tokens": answer, "stream": True}
    return [orjson.dumps({**body, "stream_options": {"include_usage": True}})] * (steps + 1)


def fresh_bodies(model: str, key: str, tokens: int, steps: int, answer: int) -> list[bytes]:
    """``steps + 1`` chat requests of ``tokens`` words that share nothing (the first one the warm-up)."""
    bodies = []
    for k in range(steps + 1):
        messages = [{"role": "user", "content": workloads.words(f"{key}/fresh{k}", tokens)}]
        body = {"model": model, "messages": messages, "max_tokens": answer, "stream": True}
        bodies.append(orjson.dumps({**body, "stream_options": {"include_usage": True}}))
    return bodies


async def grow(
    base: str, bodies: list[bytes], on_timed: Callable[[], None] | None = None
) -> tuple[Stats, dict[str, Any]]:
    """The bodies one after the other; TTFT stats over all but the first (``on_timed()`` after that one),
    with e2e and prompt sizes."""
    url = base + "/v1/chat/completions"
    ttft, e2e, prompt, cached, errors = [], [], [], [], 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        first = await stream_once(session, url, bodies[0])
        errors += not first.ok
        if on_timed is not None:
            on_timed()
        start = time.perf_counter()
        for body in bodies[1:]:
            got = await stream_once(session, url, body)
            if got.ok and got.ttft_s is not None and got.e2e_s is not None:
                ttft.append(got.ttft_s)
                e2e.append(got.e2e_s)
                prompt.append(got.prompt_tokens)
                cached.append(got.cached_tokens)
            else:
                errors += 1
        elapsed = time.perf_counter() - start
    extra = {
        "e2e_p50_ms": statistics.median(e2e) * 1e3 if e2e else float("nan"),
        "prompt_tokens_first": prompt[0] if prompt else 0,
        "prompt_tokens_last": prompt[-1] if prompt else 0,
        # Where the router put each step: a step sent away from its prefix is computed again.
        "cached_share": sum(cached) / sum(prompt) if prompt and sum(prompt) else float("nan"),
        "warmup_error": first.error if not first.ok else None,
    }
    return latency_stats(ttft, elapsed, errors), extra


class ProcessCpu:
    """The CPU time a router process (its threads and children) spends from :meth:`start` on: its work per
    request, which on a shared machine varies far less than its latency does."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.began: float | None = None

    def start(self) -> None:
        if self.pid is not None:
            self.began = tree_cpu_s(self.pid)

    def ms_per(self, requests: int) -> float:
        if self.pid is None or self.began is None or not requests:
            return float("nan")
        return (tree_cpu_s(self.pid) - self.began) * 1e3 / requests


def measure(
    base: str, scenario: Scenario, model: str, key: str, args: argparse.Namespace, pid: int | None = None
) -> dict[str, Any]:
    """One cell; with ``pid`` (the router's), also its CPU milliseconds per timed request."""
    cpu = ProcessCpu(pid)
    if scenario.kind == "small":
        url = base + "/v1/completions"
        body = small_body(model)
        stats = asyncio.run(closed_loop(url, body, args.requests, scenario.concurrency, on_timed=cpu.start))
        return {**asdict(stats), "cpu_ms_per_req": cpu.ms_per(stats.requests + stats.errors)}
    if scenario.kind == "cached":
        bodies = repeated_bodies(model, key, scenario.prefix_tokens, args.steps, args.max_tokens)
    elif scenario.kind == "fresh":
        bodies = fresh_bodies(model, key, scenario.prefix_tokens, args.steps, args.max_tokens)
    else:
        bodies = growing_bodies(model, key, scenario.prefix_tokens, args.steps, args.step_tokens, args.max_tokens)
    got, extra = asyncio.run(grow(base, bodies, on_timed=cpu.start))
    return {**asdict(got), **extra, "cpu_ms_per_req": cpu.ms_per(got.requests + got.errors)}


# -- the profile ----------------------------------------------------------------------------------------------------


def py_spy() -> str | None:
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


#: A sample whose innermost Python frame is the event loop's entry is uvloop's C code: mostly waiting for
#: the next request (the client and the workers run in other processes), some socket I/O.
LOOP_FRAME = "Runner.run (asyncio/runners.py"


#: Where kvroute's own code lives, as py-spy names files.
OWN_CODE = ("router/", "indexer/", "policies/", "sim/", "kvroute/", "apps/")


def top_frames(raw: str, n: int = 25) -> tuple[int, int, list[tuple[str, int, int]], list[tuple[str, int]]]:
    """From py-spy's collapsed stacks: the samples, those in Python code (not in the loop's C code), the top
    frames of those as (frame, self samples, inclusive samples), and kvroute's own frames by inclusive samples."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = busy = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = stack.split(";")
        total += k
        if frames[-1].startswith(LOOP_FRAME):
            continue
        busy += k
        own[frames[-1]] += k
        for frame in set(frames):
            incl[frame] += k
    ours = [(f, k) for f, k in incl.most_common() if f.partition(" (")[2].startswith(OWN_CODE)][:n]
    return total, busy, [(frame, k, incl[frame]) for frame, k in own.most_common(n)], ours


def profile_router(
    config: dict[str, Any], workdir: Path, model: str, scenario: Scenario, args: argparse.Namespace
) -> str:
    """py-spy over the ``--profile-router`` kvroute target (kvaware by default) while it serves ``scenario``
    ``--profile-rounds`` times, after one unrecorded pass (start-up, first-use imports and caches left out)."""
    spy = py_spy()
    if spy is None:
        return "py-spy not found (.venv/bin/pip install py-spy)"
    target = args.profile_router
    slug = scenario.name.replace(" ", "-")
    raw = workdir / f"profile-{target}-{slug}.raw"
    with router_process(router_of(target), config, workdir, {}) as running:
        measure(running.base, scenario, model, f"profile/{slug}/warm-up", args)
        argv = [spy, "record", "--pid", str(running.pid), "--format", "raw", "--function", "--rate", "500"]
        spy_proc = subprocess.Popen([*argv, "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # py-spy attaches
        rows = [measure(running.base, scenario, model, f"profile/{slug}/{k}", args) for k in range(args.profile_rounds)]
        spy_proc.send_signal(signal.SIGINT)
        _, err = spy_proc.communicate(timeout=60)
    if not raw.exists():
        return f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}"
    total, busy, top, ours = top_frames(raw.read_text())
    what = f"{args.steps} {scenario.kind} requests" if scenario.kind != "small" else f"{args.requests} requests"
    lines = [
        f"py-spy (500 Hz) of `kvroute serve --policy {target}`, {scenario.name}: {args.profile_rounds} x {what} "
        f"(p50 {statistics.median(r['p50_ms'] for r in rows):.2f} ms under the profiler); {total} samples, "
        f"{busy} in Python code (the rest in uvloop's C loop: waiting, socket I/O); shares of those",
        "",
        "| self | incl. | function (file:line) |",
        "|---:|---:|---|",
    ]
    lines += [f"| {k / busy:.1%} | {i / busy:.1%} | `{frame}` |" for frame, k, i in top if busy]
    lines += ["", "kvroute's own functions by inclusive share:", "", "| incl. | function (file:line) |", "|---:|---|"]
    lines += [f"| {k / busy:.1%} | `{frame}` |" for frame, k in ours if busy]
    text = "\n".join(lines)
    (workdir.parent / f"profile-{target}-{slug}.md").write_text(text + "\n")
    return text


# -- aggregation and report -----------------------------------------------------------------------------------------


def cells_of(runs: list[dict[str, Any]], names: list[str], scens: list[Scenario]) -> list[dict[str, Any]]:
    """Per (scenario, target): medians over rounds, the added latency against direct's same round."""
    by = {(r["round"], r["scenario"], r["target"]): r for r in runs if "failed" not in r}
    cells: list[dict[str, Any]] = []
    for s in scens:
        for name in names:
            mine = [r for (rd, sc, t), r in by.items() if sc == s.name and t == name]
            if not mine:
                continue
            added: dict[str, list[float]] = {"p50_ms": [], "p99_ms": []}
            for r in mine:
                base = by.get((r["round"], s.name, DIRECT))
                for key in added:
                    if base is not None:
                        added[key].append(r[key] - base[key])
            cell: dict[str, Any] = {"scenario": s.name, "target": name, "rounds": len(mine)}
            for key in ("p50_ms", "p99_ms", "rps"):
                cell[key] = statistics.median(r[key] for r in mine)
            # NaN (never equal to itself): no process measured (direct)
            cpu = [v for r in mine if (v := r.get("cpu_ms_per_req")) is not None and v == v]
            if cpu:
                cell["cpu_ms_per_req"] = statistics.median(cpu)
            for key, values in added.items():
                if values:
                    cell["added_" + key] = statistics.median(values)
                    cell["added_" + key + "_range"] = [min(values), max(values)]
            cell["requests"] = sum(r["requests"] for r in mine)
            cell["errors"] = sum(r["errors"] for r in mine)
            cells.append(cell)
    add_ratios(cells)
    return cells


def is_peer(name: str) -> bool:
    return name != DIRECT and router_of(name).kind != "kvroute"


def add_ratios(cells: list[dict[str, Any]]) -> None:
    for cell in cells:
        group = [c for c in cells if c["scenario"] == cell["scenario"]]
        direct = next((c for c in group if c["target"] == DIRECT), None)
        if direct is not None:
            cell["p50_x_direct"] = cell["p50_ms"] / direct["p50_ms"]
            cell["rps_x_direct"] = cell["rps"] / direct["rps"] if direct["rps"] else float("nan")
        peers = [c for c in group if is_peer(c["target"]) and "added_p50_ms" in c]
        if peers and "added_p50_ms" in cell and cell["target"] != DIRECT:
            best = min(peers, key=lambda c: c["added_p50_ms"])
            cell["added_p50_vs_best_peer"] = cell["added_p50_ms"] / best["added_p50_ms"]
            cell["best_peer_added"] = best["target"]
            fastest = max(peers, key=lambda c: c["rps"])
            cell["rps_vs_best_peer"] = cell["rps"] / fastest["rps"]
            cell["best_peer_rps"] = fastest["target"]
        frugal = [c for c in group if is_peer(c["target"]) and "cpu_ms_per_req" in c]
        if frugal and "cpu_ms_per_req" in cell:
            least = min(frugal, key=lambda c: c["cpu_ms_per_req"])
            cell["cpu_vs_best_peer"] = cell["cpu_ms_per_req"] / least["cpu_ms_per_req"]


def _num(cell: dict[str, Any], key: str, fmt: str) -> str:
    value = cell.get(key)
    return "-" if value is None else fmt.format(value)


def markdown(cells: list[dict[str, Any]]) -> str:
    head = ["scenario", "target", "p50 ms", "p99 ms", "req/s", "+p50 ms", "+p99 ms", "p50 ÷ direct"]
    head += ["req/s ÷ direct", "+p50 ÷ best peer", "req/s ÷ best peer", "CPU ms/req", "CPU ÷ best peer", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for c in cells:
        row = [c["scenario"], c["target"], _num(c, "p50_ms", "{:.2f}"), _num(c, "p99_ms", "{:.2f}")]
        row += [_num(c, "rps", "{:.0f}"), _num(c, "added_p50_ms", "{:+.2f}"), _num(c, "added_p99_ms", "{:+.2f}")]
        row += [_num(c, "p50_x_direct", "{:.2f}x"), _num(c, "rps_x_direct", "{:.2f}x")]
        row += [_num(c, "added_p50_vs_best_peer", "{:.2f}x"), _num(c, "rps_vs_best_peer", "{:.2f}x")]
        row += [_num(c, "cpu_ms_per_req", "{:.3f}"), _num(c, "cpu_vs_best_peer", "{:.2f}x")]
        row.append(str(c["errors"]))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def verdicts(cells: list[dict[str, Any]], runs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The issue's targets, for each kvroute policy measured, where the peer they compare with ran; with the
    ``runs``, also the comparison paired by round (the same minute of the machine): the median over rounds
    of the difference (latency) or the ratio (req/s), and how many rounds it was met in."""
    got = {(c["scenario"], c["target"]): c for c in cells}
    by = {(r["round"], r["scenario"], r["target"]): r for r in runs or [] if "failed" not in r}
    out: list[dict[str, Any]] = []

    def check(target: str, scen: str, mine: str, peer: str, key: str, factor: float, higher: bool) -> None:
        a, b = got.get((scen, mine), {}).get(key), got.get((scen, peer), {}).get(key)
        if a is None or b is None:
            return
        met = a >= factor * b if higher else a <= factor * b
        out.append({"target": target, "scenario": scen, "router": mine, "peer": peer, key: a, "peer_value": b})
        out[-1].update(met=met, margin=a - factor * b, ratio=a / b if b else float("nan"))
        raw = "rps" if higher else "p50_ms"  # per round, direct cancels out of a difference of added p50s
        pairs = [
            (r[raw], by[(rd, sc, peer)][raw])
            for (rd, sc, t), r in by.items()
            if sc == scen and t == mine and (rd, sc, peer) in by
        ]
        if pairs:
            paired = [x / y if higher else x - y for x, y in pairs if not higher or y]
            wins = sum(x >= factor * y if higher else x <= factor * y for x, y in pairs)
            out[-1].update(paired=statistics.median(paired), rounds_met=wins, rounds=len(pairs))

    for scen in dict.fromkeys(c["scenario"] for c in cells):
        for mine in ("kvaware", "round_robin"):
            if scen.startswith("grow") and mine == "kvaware":
                check("added p50 <= smg cache_aware's", scen, mine, "smg:cache_aware", "added_p50_ms", 1.0, False)
            if scen.startswith("small"):
                check("added p50 <= vllm-router's", scen, mine, "vllm-router:cache_aware", "added_p50_ms", 1.0, False)
            if scen == "small c32":
                check("req/s >= 0.9 x smg's", scen, mine, "smg:cache_aware", "rps", 0.9, True)
    return out


def verdict_lines(found: list[dict[str, Any]]) -> list[str]:
    lines = []
    for v in found:
        key = "rps" if "rps" in v else "added_p50_ms"
        unit = "req/s" if key == "rps" else "ms"
        paired = ""
        if "paired" in v:
            what = f"{v['paired']:.2f}x" if key == "rps" else f"{v['paired']:+.2f} ms"
            paired = f"; paired by round: median {what}, met in {v['rounds_met']} of {v['rounds']} rounds"
        lines.append(
            f"- {v['scenario']}, {v['router']}: {v['target']}: {v[key]:.2f} vs {v['peer_value']:.2f} {unit} "
            f"({v['ratio']:.2f}x, margin {v['margin']:+.2f} {unit}): {'met' if v['met'] else 'NOT met'}{paired}"
        )
    return lines


def chart(cells: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Added p50 and p99 per scenario and router (min-max over rounds), and requests/s of the small cases."""
    plt = pyplot()
    if plt is None or not cells:
        return None
    scens = list(dict.fromkeys(c["scenario"] for c in cells))
    names = list(dict.fromkeys(c["target"] for c in cells))
    routers = [n for n in names if n != DIRECT]
    got = {(c["scenario"], c["target"]): c for c in cells}
    color = {name: f"C{i}" for i, name in enumerate(routers)} | {DIRECT: "0.55"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, key, label in zip(axes[:2], ("added_p50_ms", "added_p99_ms"), ("added p50", "added p99"), strict=True):
        width = 0.8 / max(len(routers), 1)
        for j, name in enumerate(routers):
            xs, ys, lo, hi = [], [], [], []
            for i, s in enumerate(scens):
                c = got.get((s, name))
                if c is None or key not in c:
                    continue
                xs.append(i + (j - (len(routers) - 1) / 2) * width)
                ys.append(c[key])
                lo.append(c[key] - c[key + "_range"][0])
                hi.append(c[key + "_range"][1] - c[key])
            ax.bar(xs, ys, width=width, yerr=[lo, hi], capsize=2, label=name, color=color[name])
        ax.set_xticks(range(len(scens)), scens, rotation=15)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_ylabel(f"{label} over direct (ms)")
        ax.set_title(f"{label} (lower is better; grow, cached: TTFT)")
    small = [s for s in scens if s.startswith("small")]
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i, s in enumerate(small) if (s, name) in got]
        ys = [got[(s, name)]["rps"] for s in small if (s, name) in got]
        axes[2].bar(xs, ys, width=width, label=name, color=color[name])
    axes[2].set_xticks(range(len(small)), small)
    axes[2].set_ylabel("requests/s")
    axes[2].set_title("small requests: throughput (higher is better)")
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    return save_figure(plt, fig, path, title)


# -- main -----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--baseline", help="the python of another kvroute install: its kvaware is one more target (before/after)"
    )
    ap.add_argument("--routers", help=f"comma-separated, of {', '.join(ROUTERS)} (default {','.join(DEFAULT_ROUTERS)})")
    ap.add_argument("--repeats", type=int, help="interleaved rounds, medians over them (default 3; --quick 1)")
    ap.add_argument("--requests", type=int, help="small requests per cell (default 3000; --quick 100)")
    ap.add_argument(
        "--concurrency", type=int, nargs="*", default=[1, 32], help="clients of the small cases (none: skip them)"
    )
    ap.add_argument(
        "--prefix-tokens", type=int, nargs="*", help="growing cases' prefixes (default 8192 32768; none: skip them)"
    )
    ap.add_argument(
        "--cached-tokens", type=int, nargs="*", help="cached cases' prompt sizes (default 1024; none: skip them)"
    )
    ap.add_argument(
        "--fresh-tokens", type=int, nargs="*", help="fresh cases' prompt sizes (default 4096; none: skip them)"
    )
    ap.add_argument(
        "--steps", type=int, help="timed requests per growing, cached or fresh case (default 30; --quick 3)"
    )
    ap.add_argument("--step-tokens", type=int, default=256, help="tool output added per step")
    ap.add_argument("--max-tokens", type=int, default=8, help="answer tokens of the growing requests")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--preset", default="llama-8b-h100")
    ap.add_argument("--time-scale", type=float, default=0.001, help="the fleet's: engine time ~0")
    ap.add_argument("--work", default="out/peers_overhead", help="work folder: peer venvs, logs, results")
    ap.add_argument("--chart", type=Path, help="also write the chart here (e.g. docs/img/peers_overhead.png)")
    ap.add_argument(
        "--profile",
        nargs="*",
        metavar="SCENARIO",
        help="after the rounds, py-spy kvaware on these scenarios (no name: the largest growing case)",
    )
    ap.add_argument("--profile-rounds", type=int, default=5, help="passes of each profiled scenario")
    ap.add_argument(
        "--profile-router", default="kvaware", choices=["kvaware", "round_robin"], help="the kvroute target profiled"
    )
    ap.add_argument("--quick", action="store_true", help="a smoke test: 1 round, tiny sizes (under a minute)")
    args = ap.parse_args(argv)
    args.routers = router_names(args.routers, DEFAULT_ROUTERS)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.requests = args.requests or (100 if args.quick else 3000)
    if args.prefix_tokens is None:
        args.prefix_tokens = [1024, 4096] if args.quick else [8192, 32768]
    args.cached_tokens = [1024] if args.cached_tokens is None else args.cached_tokens
    args.fresh_tokens = ([1024] if args.quick else [4096]) if args.fresh_tokens is None else args.fresh_tokens
    args.steps = args.steps or (3 if args.quick else 30)
    if args.quick:
        args.step_tokens = min(args.step_tokens, 64)
    known = [s.name for s in scenarios(args)]
    if args.profile is not None:
        args.profile = args.profile or [[n for n in known if n.startswith("grow")][-1:] or known[-1:]][0]
        for name in args.profile:
            if name not in known:
                raise SystemExit(f"unknown scenario {name!r} to profile; known: {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="runs-", dir=work))
    routers: list[Router] = [router_of(name) for name in args.routers]
    exes = {r.kind: ensure_peer(PEERS[r.kind], work) for r in routers if r.kind in PEERS}
    names = [DIRECT, *args.routers, *([BASELINE] if args.baseline else [])]
    scens = scenarios(args)
    fleet = FleetSpec(workers=args.workers, preset=args.preset, time_scale=args.time_scale)
    setting = f"{args.workers} x {args.preset} (kvroute sim, time scale {args.time_scale:g}), {os.cpu_count()} CPUs"
    meta: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "setting": setting,
        "load_average": os.getloadavg(),
        "peers": {k: PEERS[k].requirement for k in exes},
        "scenarios": [asdict(s) for s in scens],
        "sizes": {k: getattr(args, k) for k in ("repeats", "requests", "steps", "step_tokens", "max_tokens")},
        "logs": str(logs),
    }
    runs: list[dict[str, Any]] = []
    out_json = work / "peers_overhead.json"
    print(f"{len(names)} targets x {len(scens)} scenarios x {args.repeats} rounds; {setting}; logs in {logs}")
    began = time.monotonic()
    profiles: list[str] = []
    with fleet_process(fleet, logs, "peers-overhead") as config:
        model = config["models"][0]["name"]
        direct = config["workers"][0]["url"].rstrip("/")
        warm = argparse.Namespace(**{**vars(args), "requests": 200, "steps": 3})
        for s in scens:  # the workers' and this client's first-use costs, before any round
            measure(direct, s, model, f"warm-up/{s.name}", warm)
        with contextlib.ExitStack() as stack:
            bases = {DIRECT: direct}
            pids: dict[str, int] = {}
            for name in args.routers:
                try:
                    started = stack.enter_context(router_process(router_of(name), config, logs, exes))
                    bases[name], pids[name] = started.base, started.pid
                except Exception as exc:  # a router that does not start must not lose the others
                    error = f"{type(exc).__name__}: {exc}"[:2000]
                    print(f"  {name} did not start: {error[:300]}", file=sys.stderr, flush=True)
                    runs.append({"round": 0, "target": name, "failed": error})
            if args.baseline:
                running = stack.enter_context(kvroute_process("kvaware", config, logs, args.baseline, "-baseline"))
                bases[BASELINE], pids[BASELINE] = running.base, running.pid
            for rnd in range(args.repeats):
                for s in scens:
                    live = [n for n in names if n in bases]
                    for name in live[rnd % len(live) :] + live[: rnd % len(live)]:
                        row = measure(bases[name], s, model, f"r{rnd}/{name}/{s.name}", args, pids.get(name))
                        runs.append({"round": rnd, "target": name, "scenario": s.name, **row})
                        print(
                            f"[{time.monotonic() - began:5.0f} s] round {rnd + 1}/{args.repeats} {s.name:<10} "
                            f"{name:<24} p50 {row['p50_ms']:8.3f} ms  p99 {row['p99_ms']:8.3f} ms  "
                            f"{row['rps']:7.0f} req/s  CPU {row['cpu_ms_per_req']:6.3f} ms/req  {row['errors']} errors",
                            flush=True,
                        )
                    out_json.write_text(json.dumps({**meta, "runs": runs}, indent=1, default=str))
        for name in args.profile or []:  # the other routers stopped
            profiles.append(profile_router(config, logs, model, next(s for s in scens if s.name == name), args))
    cells = cells_of(runs, names, scens)
    found = verdicts(cells, runs)
    failed = [r for r in runs if "failed" in r]
    data = {**meta, "runs": runs, "cells": cells, "targets": found, "profiles": profiles}
    out_json.write_text(json.dumps(data, indent=1, default=str))
    md = [f"# Router overhead vs direct: {setting}", ""]
    md += [f"Medians over {args.repeats} round(s); small: whole request; grow, cached: TTFT of each step.", ""]
    md += [markdown(cells), "", *verdict_lines(found)]
    md += [f"- {r['target']} did not start: {r['failed'][:200]}" for r in failed]
    png = chart(cells, work / "peers_overhead.png", f"what each router adds over direct: {setting}")
    if png is not None:
        md += ["", f"![router overhead]({png.name})"]
        if args.chart:
            args.chart.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, args.chart)
    for text in profiles:
        md += ["", text]
    text = "\n".join(md) + "\n"
    (work / "peers_overhead.md").write_text(text)
    print("\n" + text)
    print(f"results: {out_json}, {work / 'peers_overhead.md'}; total {time.monotonic() - began:.0f} s")
    return 1 if failed or any(c["errors"] for c in cells) else 0


if __name__ == "__main__":
    raise SystemExit(main())
