"""A bounded soak: kvroute under a steady open-loop load for minutes, watched for growth and errors.

    .venv/bin/python bench/soak.py --duration 600              # 10 minutes at the default rate
    .venv/bin/python bench/soak.py --duration 600 --docs-img   # and write the chart to docs/img/soak.png
    .venv/bin/python bench/soak.py --duration 240 --rate 15 --tracemalloc  # what grew in the router (slow)

A simulated fleet (``kvroute sim``: small GPU caches and a CPU tier, so blocks are stored and evicted
all the time and every change is a real KV event over ZMQ) and the router (``kvroute serve``, memory
index bounded by ``index.max_blocks`` below what the fleet holds, so its own bound is reached and it
evicts) run as processes. This process sends ``--rate`` requests/s, open loop (``soak_load``):
multi-turn conversations that grow and end, chat and completions, streaming and not.

Every ``--window`` seconds it samples the router process (``/proc/<pid>``: VmRSS, open fds, threads),
the window's client-side TTFT and end-to-end p50/p99 and errors, the router's ``/metrics`` (blocks
evicted by the index's bound, its prefix caches' bytes, non-200 answers, upstream errors, retries) and
``/admin/index/stats`` (blocks per worker, summed), and prints one line. At the end: ``soak.json``
(the series and the verdict) and ``soak.png`` under ``--out``, and the verdict: RSS slope over the
second half (MB/min, least squares), fd growth and the fds left after ``--settle`` idle seconds, total
errors by kind and how many fell in backlogged windows (more than a second's arrivals in flight).
Latencies are real milliseconds on this machine (the simulated hardware runs ``--time-scale`` times
faster). ``--replot soak.json`` redraws an earlier run's chart.

``--tracemalloc`` starts the router with :mod:`tracemalloc` and a snapshot on request (a trigger file),
takes one at half time and one at the end, and writes their difference (``tracemalloc.txt``): what
grew. It slows the router several times over: give it a lower ``--rate`` (15), and read no latency from it.

Exit status: 0 when the soak ran to its end (errors and growth are findings, reported), 1 when the run
itself broke (a process died, nothing succeeded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kvroute.experiment import FleetSpec, answers_ok, fleet_process, free_port, process, wait_until_ready
from kvroute.report import pyplot, save_figure
from kvroute.sim.replay import percentile
from procstat import process_tree
from prometheus_client.parser import text_string_to_metric_families
from soak_load import Load, Mix, Outcome, Workload

ROOT = Path(__file__).resolve().parents[1]

#: Starts the router with tracemalloc; a file ``<label>.want`` in the folder asks for ``<label>.snap``.
TRACEMALLOC_BOOT = r"""
import os, sys, threading, time, tracemalloc
folder = sys.argv.pop(1)
tracemalloc.start(int(os.environ.get("SOAK_TRACEMALLOC_FRAMES", "6")))

def watch():
    while True:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".want"):
                label = name[: -len(".want")]
                tmp = os.path.join(folder, label + ".tmp")
                tracemalloc.take_snapshot().dump(tmp)
                os.replace(tmp, os.path.join(folder, label + ".snap"))
                os.unlink(os.path.join(folder, name))
        time.sleep(0.2)

threading.Thread(target=watch, name="soak-tracemalloc", daemon=True).start()
from kvroute.apps.cli import main
sys.exit(main(sys.argv[1:]))
"""


# -- one process's figures --------------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (MB), threads and open fds of ``pid`` and its descendants, summed, from /proc."""
    totals = dict.fromkeys(("rss_mb", "hwm_mb", "threads", "fds"), 0.0)
    tree = process_tree(pid)
    for member in tree:
        try:
            status = Path(f"/proc/{member}/status").read_text()
            fds = len(os.listdir(f"/proc/{member}/fd"))
        except OSError:  # gone between the listing and the read
            continue
        totals["fds"] += fds
        for line in status.splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                totals["rss_mb" if name == "VmRSS" else "hwm_mb"] += int(value.split()[0]) / 1024
            elif name == "Threads":
                totals["threads"] += int(value)
    totals["processes"] = float(len(tree))
    return totals


def router_figures(text: str) -> dict[str, float]:
    """What the soak reads from the router's ``/metrics``."""
    names = ("index_evicted", "non_200", "upstream_errors", "retries", "token_cache_mb", "key_cache_mb")
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvroute_prefix_cache_bytes":  # the decision path's bounded caches
                cache = "token_cache_mb" if s.labels.get("cache") == "tokens" else "key_cache_mb"
                out[cache] += s.value / (1 << 20)
            elif s.name == "kvroute_index_evicted_blocks_total":
                out["index_evicted"] += s.value
            elif s.name == "kvroute_requests_total" and s.labels.get("status") != "200":
                out["non_200"] += s.value
            elif s.name == "kvroute_upstream_errors_total":
                out["upstream_errors"] += s.value
            elif s.name == "kvroute_retries_total":
                out["retries"] += s.value
    return out


def _ms(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p * 1000, 2)


def _kind(error: str) -> str:
    """An error's class: ``HTTP 504``, ``TimeoutError``, ``ClientOSError``, ``stream ended without [DONE]``..."""
    return error.split(":", 1)[0]


def window_stats(outcomes: list[Outcome]) -> dict[str, Any]:
    """Client-side figures of the requests that ended in one window."""
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    errors = [o for o in outcomes if not o.ok]
    return {
        "done": len(outcomes),
        "errors": len(errors),
        "error_kinds": dict(Counter(_kind(o.error) for o in errors if o.error).most_common()),
        "error_samples": sorted({f"{o.surface}: {o.error}" for o in errors})[:3],
        "ttft_p50_ms": _ms(ttft, 50),
        "ttft_p99_ms": _ms(ttft, 99),
        "e2e_p50_ms": _ms(e2e, 50),
        "e2e_p99_ms": _ms(e2e, 99),
    }


# -- the run ----------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Soak:
    """The sampling loop around one :class:`Load`."""

    base: str
    router: subprocess.Popen[bytes]
    load: Load
    window_s: float
    snapshots: Path | None
    settle_s: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    ended: list[Outcome] = field(default_factory=list)
    broke: str | None = None

    async def sample(self, http: aiohttp.ClientSession, t0: float) -> dict[str, Any]:
        batch, self.ended = self.ended, []
        metrics: dict[str, float] = {}
        timeout = aiohttp.ClientTimeout(total=10)
        try:
            async with http.get(self.base + "/metrics", timeout=timeout) as resp:
                metrics = router_figures(await resp.text())
            # Blocks per worker as the index's entities hold them (read-only admin: loopback needs no token).
            async with http.get(self.base + "/admin/index/stats", timeout=timeout) as resp:
                metrics["index_blocks"] = float((await resp.json())["blocks"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            pass
        row: dict[str, Any] = {
            "t_s": round(time.monotonic() - t0, 1),
            **proc_status(self.router.pid),
            "sent": self.load.sent,
            "in_flight": len(self.load.in_flight),
            "in_flight_peak": self.load.peak_in_flight,
            **window_stats(batch),
            **metrics,
            "conversations_idle": len(self.load.workload.idle),
        }
        self.load.peak_in_flight = len(self.load.in_flight)
        self.samples.append(row)
        return row

    def record(self, outcome: Outcome) -> None:
        self.ended.append(outcome)

    async def snapshot(self, label: str) -> None:
        """Ask the router for a tracemalloc snapshot and wait until it is written."""
        if self.snapshots is None:
            return
        (self.snapshots / f"{label}.want").touch()
        for _ in range(600):
            if (self.snapshots / f"{label}.snap").exists():
                return
            await asyncio.sleep(0.2)

    async def run(self) -> None:
        stop = asyncio.Event()
        async with aiohttp.ClientSession() as http:
            t0 = time.monotonic()
            print(line(await self.sample(http, t0)), flush=True)  # before the load: the idle baseline
            self.load.on_outcome = self.record
            task = asyncio.create_task(self.load.run(stop))
            tick, half_taken = t0 + self.window_s, False
            while not task.done():
                await asyncio.wait({task}, timeout=max(0.0, tick - time.monotonic()))
                if self.router.poll() is not None:
                    self.broke = f"the router exited with {self.router.returncode}"
                    stop.set()
                    break
                if time.monotonic() < tick and not task.done():
                    continue
                row = await self.sample(http, t0)
                print(line(row), flush=True)
                tick += self.window_s
                if not half_taken and row["t_s"] >= self.load.duration_s / 2:
                    half_taken = True
                    await self.snapshot("half")
            await task
            if self.broke is None:
                await self.snapshot("end")
            if self.broke is None and self.settle_s > 0:  # idle again: what the load leaves behind
                await asyncio.sleep(self.settle_s)
                row = await self.sample(http, t0)
                row["settled"] = True
                print(line(row) + "  (settled)", flush=True)


def line(s: dict[str, Any]) -> str:
    """One progress line per window."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    minutes, seconds = divmod(int(s["t_s"]), 60)
    return (
        f"[{minutes:2d}:{seconds:02d}] rss {s['rss_mb']:6.1f} MB  fds {s['fds']:4.0f}  threads {s['threads']:3.0f}  "
        f"sent {s['sent']:6d}  done {s['done']:4d}  errors {s['errors']:3d}  in flight {s['in_flight']:3d}  "
        f"ttft p50/p99 {ms(s['ttft_p50_ms'])}/{ms(s['ttft_p99_ms'])} ms  e2e p99 {ms(s['e2e_p99_ms'])} ms  "
        + (
            f"index {s['index_blocks']:,.0f} blocks (evicted {s['index_evicted']:,.0f})"
            if "index_blocks" in s and "index_evicted" in s
            else "/metrics did not answer"
        )
    )


# -- verdict and chart ------------------------------------------------------------------------------------------------


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute; 0 with fewer than two points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mx) * (v - my) for t, v in points) / var


def _backlogged(sample: dict[str, Any], rate: float) -> bool:
    """More than a second's arrivals in flight at once in this window (at the sample, for older runs)."""
    return bool(sample.get("in_flight_peak", sample["in_flight"]) > rate)


def verdict(samples: list[dict[str, Any]], duration_s: float, rate: float, flat_mb_per_min: float) -> dict[str, Any]:
    """RSS slope and fd growth over the second half of the load, total errors, where the index stood.

    A window is *backlogged* when more than a second's arrivals were in flight at once (the router, or
    the machine under it, fell behind the open-loop load); errors there are counted apart."""
    loaded = [s for s in samples[1:] if not s.get("settled")]
    settled = samples[-1] if samples[-1].get("settled") else None
    second = [s for s in loaded if s["t_s"] >= duration_s / 2] or loaded[-2:]
    slope = slope_per_min([(s["t_s"], s["rss_mb"]) for s in second])
    first, last = (second[0], second[-1]) if second else (samples[0], samples[-1])
    errors = sum(s["errors"] for s in samples)
    kinds: Counter[str] = Counter()
    for s in samples:
        kinds.update(s.get("error_kinds", {}))
    done = sum(s["done"] for s in samples)
    return {
        "rss_slope_mb_per_min_second_half": round(slope, 3),
        "rss_mb": {"idle": samples[0]["rss_mb"], "start": first["rss_mb"], "end": last["rss_mb"]},
        "rss_peak_mb": max(s["hwm_mb"] for s in samples),
        "fds_growth_second_half": int(last["fds"] - first["fds"]),
        "fds_max_second_half": int(max(s["fds"] for s in second)) if second else int(last["fds"]),
        "fds_idle": int(samples[0]["fds"]),
        "fds_settled": None if settled is None else int(settled["fds"]),
        "rss_settled_mb": None if settled is None else settled["rss_mb"],
        "threads_growth_second_half": int(last["threads"] - first["threads"]),
        "requests": done,
        "errors": errors,
        "error_kinds": dict(kinds.most_common()),
        "errors_while_backlogged": sum(s["errors"] for s in samples if _backlogged(s, rate)),
        "backlogged_windows": sum(1 for s in samples if _backlogged(s, rate)),
        "index_blocks_end": last.get("index_blocks"),
        "index_evicted_total": last.get("index_evicted"),
        "memory_flat": slope <= flat_mb_per_min,
        "flat_threshold_mb_per_min": flat_mb_per_min,
    }


def _series(samples: list[dict[str, Any]], key: str) -> list[float]:
    """One figure per sample; NaN where it is missing (a /metrics that did not answer leaves a gap, not 0)."""
    return [float("nan") if s.get(key) is None else float(s[key]) for s in samples]


def chart(samples: list[dict[str, Any]], path: Path, title: str, rate: float) -> Path | None:
    """Four stacked panels over time: RSS, fds and threads, latencies (log), errors and index blocks.
    Windows where more than a second's arrivals were in flight (backlogged) are shaded."""
    plt = pyplot()
    if plt is None:
        return None
    t = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10.5), sharex=True)
    rss, fds, lat, err = axes
    step = (t[1] - t[0]) if len(t) > 1 else 0.1
    for i, s in enumerate(samples):
        if _backlogged(s, rate):
            for ax in axes:
                ax.axvspan(t[i] - step, t[i], color="#dddddd", lw=0)
    rss.plot(t, _series(samples, "rss_mb"), color="#4C72B0", marker=".", label="router RSS")
    caches = [a + b for a, b in zip(_series(samples, "token_cache_mb"), _series(samples, "key_cache_mb"), strict=True)]
    rss.plot(t, caches, "--", color="#937860", label="its prefix caches (bounded: 64 + 16 MB)")
    rss.set_ylabel("MB")
    rss.set_ylim(bottom=0)
    rss.legend(loc="lower right")
    fds.plot(t, _series(samples, "fds"), color="#55A868", marker=".", label="open fds")
    fds.plot(t, _series(samples, "threads"), color="#8172B2", marker=".", label="threads")
    fds.plot(t, _series(samples, "in_flight"), ":", color="#999999", label="requests in flight (client)")
    fds.set_ylabel("count")
    fds.set_ylim(bottom=0)
    fds.legend(loc="upper left")
    for key, label, style in (
        ("ttft_p99_ms", "TTFT p99", "-"),
        ("e2e_p99_ms", "e2e p99", "-"),
        ("ttft_p50_ms", "TTFT p50", ":"),
    ):
        lat.plot(t, _series(samples, key), style, marker=".", label=label)
    lat.set_yscale("log")
    lat.set_ylabel("per window (ms, real, log)")
    lat.legend(loc="upper left")
    err.bar(t, _series(samples, "errors"), width=0.6 * step, color="#C44E52")
    err.set_ylabel("errors per window", color="#C44E52")
    err.set_ylim(bottom=0, top=max(1, *(s["errors"] for s in samples)) * 1.2)
    blocks = err.twinx()
    blocks.plot(t, _series(samples, "index_blocks"), color="#DD8452", marker=".")
    blocks.set_ylabel("index blocks (per worker, summed)", color="#DD8452")
    blocks.set_ylim(bottom=0)
    err.set_xlabel("minutes (shaded: backlogged, more than 1 s of arrivals in flight)")
    return save_figure(plt, fig, path, title, dpi=100)


def tracemalloc_diff(folder: Path, top: int = 25) -> list[str]:
    """The allocation sites that grew most from the half-time snapshot to the end one."""
    half, end = folder / "half.snap", folder / "end.snap"
    if not (half.exists() and end.exists()):
        return []
    before, after = tracemalloc.Snapshot.load(str(half)), tracemalloc.Snapshot.load(str(end))
    stats = after.compare_to(before, "lineno")
    lines = [str(s) for s in stats[:top]]
    lines.append("")
    for s in after.compare_to(before, "traceback")[:5]:
        lines.append(f"{s.size_diff / 1024:+.1f} KiB in {s.count_diff:+d} blocks:")
        lines.extend("    " + frame for frame in s.traceback.format())
    return lines


def summary(v: dict[str, Any]) -> str:
    """The verdict in one line."""
    kinds = ", ".join(f"{kind} x{n}" for kind, n in v["error_kinds"].items())
    return (
        f"verdict: RSS slope over the second half {v['rss_slope_mb_per_min_second_half']:+.2f} MB/min "
        f"({'flat' if v['memory_flat'] else 'GROWING'}; {v['rss_mb']['start']:.1f} -> {v['rss_mb']['end']:.1f} MB), "
        f"fds {v['fds_growth_second_half']:+d} (idle {v['fds_idle']}, settled {v['fds_settled']}), "
        f"threads {v['threads_growth_second_half']:+d}, errors {v['errors']} of {v['requests']} requests "
        f"({v['errors_while_backlogged']} in {v['backlogged_windows']} backlogged windows{': ' if kinds else ''}"
        f"{kinds}); index {v['index_blocks_end'] or 0:,.0f} blocks, {v['index_evicted_total'] or 0:,.0f} evicted "
        "by its bound"
    )


# -- command line -----------------------------------------------------------------------------------------------------


def router_argv(config: Path, snapshots: Path | None) -> list[str]:
    serve = ["serve", "--config", str(config), "--log-level", "warning"]
    if snapshots is None:
        return [sys.executable, "-m", "kvroute.apps.cli", *serve]
    return [sys.executable, "-c", TRACEMALLOC_BOOT, str(snapshots), *serve]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s, open loop (default 50)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "soak", help="work folder (default out/soak)")
    parser.add_argument("--docs-img", action="store_true", help="also write the chart to docs/img/soak.png")
    parser.add_argument("--policy", default="kvaware")
    parser.add_argument("--preset", default="llama-8b-h100")
    parser.add_argument("--time-scale", type=float, default=0.1, help="simulated seconds x this = real seconds")
    parser.add_argument("--gpu-blocks", type=int, default=2048, help="GPU KV blocks per worker (default 2048)")
    parser.add_argument("--cpu-blocks", type=int, default=4096, help="CPU-tier blocks per worker (default 4096)")
    parser.add_argument(
        "--max-blocks", type=int, default=6000, help="the router's index.max_blocks (default 6000: below the fleet's)"
    )
    parser.add_argument("--max-idle", type=int, default=Mix().max_idle, help="idle conversations kept for a next turn")
    parser.add_argument(
        "--settle",
        type=float,
        default=35.0,
        help="idle seconds after the load before a last sample (default 35: past the router's 30 s upstream "
        "keep-alive, so pooled connections have closed)",
    )
    parser.add_argument("--flat-mb-per-min", type=float, default=1.0, help="RSS slope still called flat")
    parser.add_argument("--tracemalloc", action="store_true", help="diff the router's heap, half time vs end")
    parser.add_argument("--replot", type=Path, metavar="SOAK_JSON", help="only redraw an earlier run's chart")
    return parser.parse_args(argv)


def draw(samples: list[dict[str, Any]], duration: float, rate: float, workers: int, out: Path, docs: bool) -> None:
    """``soak.png`` under ``out`` (and ``docs/img/soak.png`` with ``docs``)."""
    span = f"{duration / 60:.0f} min" if duration >= 120 else f"{duration:.0f} s"
    title = f"kvroute soak: {rate:g} req/s for {span}, {workers} simulated workers"
    png = chart(samples, out / "soak.png", title, rate)
    if png is not None and docs:
        shutil.copyfile(png, ROOT / "docs" / "img" / "soak.png")


def replot(path: Path, out: Path, docs: bool) -> int:
    """Draw the chart of an earlier run's ``soak.json`` again and print its verdict (recomputed)."""
    report = json.loads(path.read_text())
    run = report["args"]
    out.mkdir(parents=True, exist_ok=True)
    draw(report["samples"], float(run["duration"]), float(run["rate"]), int(run["workers"]), out, docs)
    print(summary(verdict(report["samples"], float(run["duration"]), float(run["rate"]), run["flat_mb_per_min"])))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args.out, args.docs_img)
    # SIGTERM unwinds like Ctrl-C, so the fleet and the router are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    snapshots = out / "tracemalloc" if args.tracemalloc else None
    if snapshots is not None:
        shutil.rmtree(snapshots, ignore_errors=True)
        snapshots.mkdir()
    fleet = FleetSpec(
        workers=args.workers,
        preset=args.preset,
        time_scale=args.time_scale,
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
    )
    load_before = os.getloadavg()
    began = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    with fleet_process(fleet, out, "soak") as config:
        config["index"] = {**config.get("index", {}), "backend": "memory", "max_blocks": args.max_blocks}
        config["policy"] = args.policy
        config["port"] = free_port()
        router_yaml = out / "router-soak.yaml"
        router_yaml.write_text(yaml.safe_dump(config, sort_keys=False))
        base = f"http://127.0.0.1:{config['port']}"
        log = out / "router-soak.log"
        with process(router_argv(router_yaml, snapshots), log) as router:
            wait_until_ready(lambda: answers_ok(base + "/ready"), router, "kvroute serve", log)
            model = config["models"][0]["name"]
            workload = Workload(args.seed, Mix(max_idle=args.max_idle))
            load = Load(base, model, args.rate, args.duration, workload, on_outcome=lambda _: None)
            print(
                f"# soak: {args.duration:.0f} s at {args.rate:g} req/s open loop, {args.workers} simulated workers "
                f"(GPU {args.gpu_blocks} + CPU {args.cpu_blocks} blocks each), index.max_blocks {args.max_blocks}, "
                f"policy {args.policy}, router pid {router.pid}, {os.cpu_count()} CPUs, load average "
                f"{load_before[0]:.1f}",
                flush=True,
            )
            soak = Soak(base, router, load, args.window, snapshots, args.settle)
            asyncio.run(soak.run())
    samples = soak.samples
    result = verdict(samples, args.duration, args.rate, args.flat_mb_per_min)
    if soak.broke is None and not result["requests"] - result["errors"]:
        soak.broke = "no request succeeded"
    report: dict[str, Any] = {
        "command": " ".join(["bench/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "began": began,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "load_average": {"before": load_before[0], "after": os.getloadavg()[0]},
        "conversations": {"started": workload.started, "ended": workload.ended, "abandoned": workload.abandoned},
        "broke": soak.broke,
        "verdict": result,
        "samples": samples,
    }
    if snapshots is not None:
        diff = tracemalloc_diff(snapshots)
        report["tracemalloc_top"] = diff
        (out / "tracemalloc.txt").write_text("\n".join(diff) + "\n")
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    draw(samples, args.duration, args.rate, args.workers, out, args.docs_img)
    print(summary(result) + f"; results in {out}")
    if soak.broke:
        print(f"soak broke: {soak.broke}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
