"""Requests/s one `kvroute sim` process sustains (so it is never the bottleneck of router benchmarks).

Runs the fleet in a subprocess (`kvroute sim`, as in real use), drives it from this process with a
closed loop of concurrent aiohttp clients spread over the workers, and compares with a baseline
measured in the same run: a bare Starlette app on uvicorn answering a fixed completion (the floor
cost of Python HTTP on this machine). Prints requests/s and the sim/baseline ratio.

    .venv/bin/python bench/sim_capacity.py --workers 8 16 --concurrency 64 --seconds 8

``--prefill-check`` instead measures, at time scale 1, the TTFT of uncached 2k-token prompts on one
worker per preset and prints the effective prefill rate against the preset's nominal rate (issue 3:
within 5 %).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

PROMPT_WORDS = 1000


def _prompt(i: int, shared: int) -> str:
    system = " ".join(f"sys{k}" for k in range(shared))
    return system + " " + " ".join(f"u{i}-{k}" for k in range(PROMPT_WORDS - shared))


BASELINE_APP = r"""
import orjson, sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
BODY = orjson.dumps({"id": "cmpl-x", "object": "text_completion",
    "choices": [{"index": 0, "text": "x " * 16, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1000, "completion_tokens": 16, "total_tokens": 1016,
              "prompt_tokens_details": {"cached_tokens": 0}}})
async def completions(request):
    await request.body()
    return Response(BODY, media_type="application/json")
app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
ports = [int(p) for p in sys.argv[1:]]
import asyncio
async def main():
    servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=p, log_level="warning",
                                             access_log=False, lifespan="off")) for p in ports]
    await asyncio.gather(*(s.serve() for s in servers))
asyncio.run(main())
"""


async def _wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                body = {"prompt": "warm up", "max_tokens": 1}
                async with session.post(url + "/v1/completions", json=body) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def _load(urls: list[str], concurrency: int, seconds: float, shared: int, max_tokens: int) -> tuple[float, int]:
    """Closed loop: ``concurrency`` clients, round-robin over workers; returns (requests/s, errors)."""
    done = 0
    errors = 0
    stop = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(c: int) -> None:
            nonlocal done, errors
            i = c
            while time.perf_counter() < stop:
                body = {"prompt": _prompt(i % 64, shared), "max_tokens": max_tokens}
                async with session.post(urls[i % len(urls)] + "/v1/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1
                    else:
                        errors += 1
                i += concurrency

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return done / elapsed, errors


def _free_base() -> int:
    return 20000 + (os.getpid() % 200) * 100


def _run_sim(workers: int, base: int, preset: str, time_scale: float) -> tuple[subprocess.Popen[bytes], list[str]]:
    cfg = Path(tempfile.mkdtemp()) / "sim.yaml"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvroute.apps.cli",
            "sim",
            "--workers",
            str(workers),
            "--preset",
            preset,
            "--time-scale",
            str(time_scale),
            "--base-port",
            str(base),
            "--config-out",
            str(cfg),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not cfg.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    urls = [w["url"] for w in yaml.safe_load(cfg.read_text())["workers"]]
    return proc, urls


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _prefill_check(preset_name: str, tokens: int, repeats: int) -> tuple[float, float, float]:
    """Returns (measured tokens/s, model tokens/s, nominal tokens/s) for uncached prompts at scale 1."""
    from kvroute.sim.fleet import SimFleet
    from kvroute.sim.presets import get_preset
    from kvroute.sim.timing import prefill_seconds

    preset = get_preset(preset_name)
    ttfts = []
    async with SimFleet(1, preset, time_scale=1.0) as fleet, aiohttp.ClientSession() as session:
        for r in range(repeats + 1):  # the first one warms the connection and the caches up
            body = {"prompt": " ".join(f"r{r}-{k}" for k in range(tokens)), "max_tokens": 2, "stream": True}
            t0 = time.perf_counter()
            async with session.post(fleet.urls[0] + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        if r:
                            ttfts.append(time.perf_counter() - t0)
                        break
                await resp.read()
    ttfts.sort()
    median = ttfts[len(ttfts) // 2]
    return tokens / median, tokens / prefill_seconds(preset, tokens, 0), preset.prefill_tokens_per_s


async def _affinity_check(workers: int, time_scale: float, seed: int) -> list[tuple[str, dict[str, object]]]:
    """Same agentic trace, dispatched client-side two ways: sticky sessions vs round-robin requests."""
    import itertools

    from kvroute.sim.fleet import SimFleet
    from kvroute.sim.replay import replay
    from kvroute.sim.traces import agentic_trace

    trace = agentic_trace(seed, sessions=12, steps=(8, 16), arrival_rate=2.0)
    out = []
    async with SimFleet(workers, "llama-8b-h100", time_scale=time_scale) as fleet:
        urls = fleet.urls
        counter = itertools.count()
        index = {s.id: i for i, s in enumerate(trace.sessions)}
        targets = {
            "round-robin": lambda session, turn: urls[next(counter) % len(urls)],
            "sticky": lambda session, turn: urls[index[session.id] % len(urls)],
        }
        for name, target in targets.items():
            fleet.reset()
            report = await replay(trace, target, time_scale=time_scale)
            out.append((name, report.summary()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--preset", default="llama-8b-h100")
    ap.add_argument("--time-scale", type=float, default=0.01)
    ap.add_argument("--shared-prefix", type=int, default=800, help="prompt words shared by all requests")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefill-check", action="store_true", help="measure prefill rates at time scale 1")
    ap.add_argument(
        "--affinity-check",
        action="store_true",
        help="agentic trace, sticky vs round-robin dispatch: does the twin reward affinity?",
    )
    args = ap.parse_args()
    if args.affinity_check:
        n = args.workers[0]
        print(
            f"# affinity check: agentic trace (12 sessions, 8-16 steps), {n} workers, llama-8b-h100, "
            f"time scale {args.time_scale}; TTFT in model seconds (real / scale)"
        )
        results = asyncio.run(_affinity_check(n, args.time_scale, 0))
        print(f"{'dispatch':>12} {'requests':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'cached ratio':>13}")
        s = args.time_scale
        for name, summary in results:
            print(
                f"{name:>12} {summary['requests']:>9} {summary['ttft_p50_s'] / s:>9.3f} "  # type: ignore[operator]
                f"{summary['ttft_p99_s'] / s:>9.3f} {summary['cached_token_ratio']:>13.3f}"
            )  # type: ignore[operator]
        rr, sticky = results[0][1], results[1][1]
        print(
            f"# sticky / round-robin TTFT p50: {sticky['ttft_p50_s'] / rr['ttft_p50_s']:.2f}, "  # type: ignore[operator]
            f"p99: {sticky['ttft_p99_s'] / rr['ttft_p99_s']:.2f}"
        )  # type: ignore[operator]
        return
    if args.prefill_check:
        print("# prefill check: uncached 2048-token prompts, time scale 1, median of 7 TTFTs")
        print(
            f"{'preset':>16} {'nominal tok/s':>14} {'model tok/s':>12} {'measured tok/s':>15} "
            f"{'measured/model':>15} {'measured/nominal':>17}"
        )
        for name in ("llama-8b-h100", "qwen-32b-h100x2"):
            measured, model, nominal = asyncio.run(_prefill_check(name, 2048, 7))
            print(
                f"{name:>16} {nominal:>14.0f} {model:>12.0f} {measured:>15.0f} {measured / model:>15.3f} "
                f"{measured / nominal:>17.3f}"
            )
        return
    print(
        f"# sim capacity: {PROMPT_WORDS}-token prompts ({args.shared_prefix} shared), max_tokens "
        f"{args.max_tokens}, concurrency {args.concurrency}, {args.seconds}s, preset {args.preset}, "
        f"time scale {args.time_scale}, {os.cpu_count()} CPUs"
    )
    print(f"{'workers':>8} {'baseline rps':>13} {'sim rps':>9} {'sim/baseline':>13} {'errors':>7}")
    for n in args.workers:
        base = _free_base()
        ports = [base + 4 * i for i in range(n)]
        bproc = subprocess.Popen([sys.executable, "-c", BASELINE_APP, *map(str, ports)])
        try:
            burls = [f"http://127.0.0.1:{p}" for p in ports]
            asyncio.run(_wait_http(burls[-1]))
            baseline, _ = asyncio.run(_load(burls, args.concurrency, args.seconds, args.shared_prefix, args.max_tokens))
        finally:
            _stop(bproc)
        proc, urls = _run_sim(n, base + 1, args.preset, args.time_scale)
        try:
            asyncio.run(_wait_http(urls[-1]))
            sim, errors = asyncio.run(_load(urls, args.concurrency, args.seconds, args.shared_prefix, args.max_tokens))
        finally:
            _stop(proc)
        print(f"{n:>8} {baseline:>13.0f} {sim:>9.0f} {sim / baseline:>13.2f} {errors:>7}", flush=True)


if __name__ == "__main__":
    main()
