"""kvroute across cores: ``kvroute serve --processes N`` (uvicorn + httptools) and, optionally, the same app
under granian with N workers, against one fast upstream (``proxy_overhead.py``'s), at one concurrency.

Every target gets ``--repeats`` runs of ``--requests`` small non-streaming /v1/completions, interleaved
with the direct baseline, from the same aiohttp client in this process; the medians close the output.
The load generator, the upstream and every router process share the machine's CPUs: on a 2-core box
N = 2 competes with the other two for the same cores. ``cpu ms/req`` is the CPU time the router's
processes (parent and children, every thread) spent per request: on a shared machine it moves less
with the neighbours' load than throughput does.

    .venv/bin/python bench/serving_cores.py [--processes 1 2] [--granian PYTHON] [--repeats 3]

``--granian PYTHON``: a python with granian installed that can import kvroute (granian is not a kvroute
dependency; see docs/benchmarks.md, "Serving across cores", for the throwaway venv).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from procstat import tree_cpu_s
from proxy_overhead import UPSTREAM, Stats, free_port, load, stop, wait_port

HERE = Path(__file__).resolve().parent
POLICY = "round_robin"  # the proxy itself, as in proxy_overhead.py


def granian_app() -> object:
    """The factory granian's workers call: the router app ``kvroute serve`` builds, from KVROUTE_* variables."""
    from kvroute.apps.build import build_app
    from kvroute.config import load_config

    return build_app(load_config())


@dataclass
class Target:
    name: str
    processes: int
    url: str
    proc: subprocess.Popen[bytes] | None = None
    runs: list[Stats] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)


def wait_children(url: str, processes: int, timeout_s: float = 120.0) -> None:
    """Until ``processes`` distinct serving processes answer ``/admin/process`` (fresh connections)."""
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/admin/process", headers={"connection": "close"}, timeout=5, trust_env=False)
            seen.add(int(r.json()["pid"]))
        except (httpx.HTTPError, ValueError, KeyError):
            time.sleep(0.1)
        if len(seen) >= processes:
            return
    raise RuntimeError(f"{url}: {len(seen)} of {processes} serving processes answered")


def start_uvicorn(upstream: str, processes: int) -> Target:
    port = free_port()
    cmd = [
        *[sys.executable, "-m", "kvroute.apps.cli", "serve"],
        *["--policy", POLICY, "--worker", upstream, "--port", str(port)],
        *["--http-client", "aiohttp", "--log-level", "error", "--processes", str(processes)],
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc, timeout=120)
    if processes > 1:
        wait_children(f"http://127.0.0.1:{port}", processes)
    time.sleep(0.5)  # first health probes and model discovery
    return Target("uvicorn", processes, f"http://127.0.0.1:{port}", proc)


def start_granian(python: str, upstream: str, processes: int) -> Target:
    port = free_port()
    cmd = [
        *[python, "-m", "granian", "--interface", "asgi", "--factory", "--working-dir", str(HERE)],
        *["--host", "127.0.0.1", "--port", str(port), "--workers", str(processes)],
        *["--loop", "uvloop", "--http", "1", "--no-ws", "--log-level", "error", "serving_cores:granian_app"],
    ]
    env = {
        **os.environ,
        "KVROUTE_WORKERS": f'[{{"url": "{upstream}"}}]',
        "KVROUTE_POLICY": POLICY,
        "KVROUTE_HTTP_CLIENT": "aiohttp",
        "KVROUTE_LOG_LEVEL": "error",
    }
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc, timeout=120)
    time.sleep(2.0 * processes)  # every worker imports kvroute and probes the upstream once
    return Target("granian", processes, f"http://127.0.0.1:{port}", proc)


def row(name: str, processes: int | str, s: Stats, base: Stats, cpu_ms: float | None = None) -> str:
    return (
        f"{name:<10}{processes:>4}{s.p50_ms:>9.3f}{s.p99_ms:>9.3f}{s.rps:>9.0f}"
        f"{s.p50_ms - base.p50_ms:>9.3f}{s.p99_ms - base.p99_ms:>9.3f}{s.rps / base.rps:>11.2f}"
        + (f"{cpu_ms:>12.3f}" if cpu_ms is not None else f"{'-':>12}")
    )


def median_stats(runs: list[Stats]) -> Stats:
    return Stats(
        statistics.median(s.p50_ms for s in runs),
        statistics.median(s.p99_ms for s in runs),
        statistics.median(s.rps for s in runs),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--granian", metavar="PYTHON", help="also measure granian with this python")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    up_port = free_port()
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)])
    targets: list[Target] = []
    direct: list[Stats] = []
    try:
        wait_port(up_port, upstream)
        up_url = f"http://127.0.0.1:{up_port}"
        for n in args.processes:
            targets.append(start_uvicorn(up_url, n))
            if args.granian:
                targets.append(start_granian(args.granian, up_url, n))
        print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, {args.requests} requests per cell,")
        print(f"# concurrency {args.concurrency}, small non-streaming completions, {args.repeats} interleaved runs")
        header = f"{'server':<10}{'N':>4}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'+p50 ms':>9}{'+p99 ms':>9}"
        print(header + f"{'rps/direct':>11}{'cpu ms/req':>12}")
        for _ in range(args.repeats):
            base = asyncio.run(load(up_url, args.requests, args.concurrency))
            direct.append(base)
            print(row("direct", "-", base, base), flush=True)
            for target in targets:
                assert target.proc is not None
                cpu0 = tree_cpu_s(target.proc.pid)
                s = asyncio.run(load(target.url, args.requests, args.concurrency))
                # The warm-up requests count in the CPU time too.
                cpu_ms = (tree_cpu_s(target.proc.pid) - cpu0) * 1e3 / (args.requests + min(200, args.requests))
                target.runs.append(s)
                target.cpu_ms.append(cpu_ms)
                print(row(target.name, target.processes, s, base, cpu_ms), flush=True)
        base = median_stats(direct)
        print(f"# medians of {args.repeats} runs (load average now {os.getloadavg()[0]:.1f})")
        print(row("direct", "-", base, base))
        for target in targets:
            print(row(target.name, target.processes, median_stats(target.runs), base, statistics.median(target.cpu_ms)))
    finally:
        for target in targets:
            stop(target.proc)
        stop(upstream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
