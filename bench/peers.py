"""Time to first token against the real peer routers, on traces nobody here wrote, in every regime.

    .venv/bin/python bench/peers.py --quick        # Mooncake + shared prefix, 40 requests, 1 seed: ~8 min
    .venv/bin/python bench/peers.py                # every trace x regime x router, 200 requests, 3 seeds
    .venv/bin/python bench/peers.py --routers kvaware,round_robin --traces chat --regimes light
    .venv/bin/python bench/peers.py --routers kvaware,smg:cache_aware --baseline ../base/.venv/bin/python  # A/B

For each (trace, regime, seed) and each router, a **fresh** simulated fleet (``kvroute sim``) is started,
so no cache or index carries over from one router to the next, then the router in front of it, and the
same trace is replayed through it (``kvroute.sim.replay``: streaming, ``stream_options.include_usage``).
Routers: ``kvroute serve --policy kvaware`` and kvroute's ``round_robin`` (the floor), and the peers,
installed from PyPI into throwaway venvs under the work folder (never into ``.venv``): smg 1.13.0
(SGLang's gateway; ``cache_aware``, ``prefix_hash``) and vllm-router 0.1.17 (``cache_aware``), each
with its maintainers' defaults and its own prometheus port. Routers run interleaved per seed, in an
order rotated by seed, so machine noise spreads over all of them.

Traces (``bench/workloads.py``): the public Mooncake FAST'25 synthetic trace, llm-d's shared-prefix
benchmark shape (a rate sweep with ``--shared-prefix-rates``), agentic sessions, short chat. Regimes
(fleet options of ``kvroute sim``): light load; cache pressure (a GPU cache that holds the requests in
flight plus a quarter of the trace's working set); a tiered P2P fleet (that cache, a CPU tier 4x its size,
and ``pool.kv_protocol: p2p``: kvroute may fetch blocks from a peer worker, the peers cannot); a P/D fleet
(prefill/decode roles, NIXL): vllm-router runs its own vLLM P/D mode there; smg's P/D mode speaks
SGLang's bootstrap protocol (against vLLM workers both legs prefill and no KV moves), so smg gets the
same workers as plain workers (``--no-peer-pd``: vllm-router too), and the table says so.

Figures per run, in the simulated hardware's milliseconds (real seconds / time scale): TTFT p50/p90/p99,
e2e p50/p99, goodput (share of requests with TTFT within ``--slo-ms``; failed requests count as missed),
cached tokens as the clients were told (usage), the prefill the engines were spared (prompt tokens minus
what they computed, from their ``/metrics``; in P/D the client's "cached" includes the prefill->decode
handoff, this does not), that prefill as a share of ``bench/routing.py``'s oracle (a request reuses any
prefix whose first token came before it was sent; a request that queues can beat it, so it may pass
100 %; the JSON's ``bound_share`` is against every prefix sent before, a bound for any router), the
busiest worker's share of the prompt tokens, errors. Per cell: the median over seeds and the spread
(min-max); ratios against the best peer of that cell, per metric.
``--hops``: each request's time to first token is also split where it is spent, in real ms: client to
engine (the router's way in, its decision included), engine, engine to client (the router's way back),
from the simulated workers' hop log (``kvroute.sim.hop_log``) and the client's own clock; it is how a
router's share of TTFT is compared with a peer that keeps no clock of its own.
Output under ``--work``: ``peers.json`` (every run and every cell), ``peers.md``, ``peers-<regime>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import workloads
import yaml
from kvroute.experiment import (
    FleetSpec,
    PolicyRun,
    Progress,
    answers_ok,
    fleet_process,
    free_port,
    process,
    run_policy,
    scrape,
    wait_until_ready,
)
from kvroute.report import pyplot, save_figure
from kvroute.sim.hop_log import HOP_LOG_ENV
from kvroute.sim.presets import Preset, get_preset
from kvroute.sim.replay import RequestResult, percentile, replay
from kvroute.sim.timing import prefill_seconds
from kvroute.sim.traces import Trace
from receipts import load as load_receipts
from receipts import render as render_receipts
from receipts import summarize as receipt_summary
from routing import figures, metric_samples, metric_total, oracle_cached, oracle_per_request

# -- routers ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer router from PyPI, installed into ``<work>/venv-<name>``."""

    name: str
    requirement: str
    binary: str


PEERS = {
    "smg": Peer("smg", "smg==1.13.0", "smg"),
    "vllm-router": Peer("vllm-router", "vllm-router==0.1.17", "vllm-router"),
}


@dataclass(frozen=True, slots=True)
class Router:
    name: str
    #: "kvroute" or a key of PEERS.
    kind: str
    policy: str
    #: kvroute's ``policy_options`` (a variant named ``kvaware[key=value;...]``, for A/B runs).
    options: tuple[tuple[str, Any], ...] = ()
    #: The interpreter of another kvroute install serving it (``--baseline``); empty: this install.
    python: str = ""

    @property
    def tag(self) -> str:
        """The name as it appears in file names."""
        return re.sub(r"[^A-Za-z0-9_.=-]+", "-", self.name).strip("-")


ROUTERS = {
    r.name: r
    for r in (
        Router("kvaware", "kvroute", "kvaware"),
        Router("round_robin", "kvroute", "round_robin"),
        Router("smg:cache_aware", "smg", "cache_aware"),
        Router("smg:prefix_hash", "smg", "prefix_hash"),
        Router("vllm-router:cache_aware", "vllm-router", "cache_aware"),
    )
}


#: ``--baseline``'s router: kvaware served by another install (an older checkout's venv), in the same run.
BASELINE = "kvaware@baseline"


def ensure_peer(peer: Peer, work: Path, log: Callable[[str], None] = print) -> Path:
    """The peer's executable, installed into a throwaway venv under ``work`` when missing."""
    venv = work / f"venv-{peer.name}"
    exe = venv / "bin" / peer.binary
    marker = venv / ".kvroute-installed"
    if exe.exists() and marker.exists() and marker.read_text().strip() == peer.requirement:
        return exe
    log(f"installing {peer.requirement} into {venv} (about a minute) ...")
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    done = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", peer.requirement],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not exe.exists():
        raise RuntimeError(f"pip install {peer.requirement} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    marker.write_text(peer.requirement + "\n")
    log(f"installed {peer.requirement} in {time.monotonic() - began:.0f} s")
    return exe


def peer_argv(router: Router, exe: Path, config: dict[str, Any], port: int, metrics_port: int, pd: bool) -> list[str]:
    """Command line of a peer in front of the fleet; in a P/D fleet vllm-router uses its vLLM P/D mode."""
    common = ["--host", "127.0.0.1", "--port", str(port)]
    common += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    workers = config["workers"]
    urls = [w["url"] for w in workers]
    if router.kind == "smg":
        return [str(exe), "launch", *common, "--worker-urls", *urls, "--policy", router.policy, "--log-level", "warn"]
    if router.kind == "vllm-router":
        argv = [str(exe), *common, "--policy", router.policy, "--log-level", "warning"]
        if pd:
            argv += ["--vllm-pd-disaggregation"]
            for w in workers:
                argv += ["--prefill", w["url"]] if w.get("role") == "prefill" else ["--decode", w["url"]]
            return argv
        return [*argv, "--worker-urls", *urls]
    raise ValueError(f"unknown peer kind {router.kind!r}")


def peer_mode(router: Router, native_pd: bool) -> str:
    """How a router uses a P/D fleet, for the table."""
    if router.kind == "kvroute":
        return "P/D (NIXL)"
    if router.kind == "vllm-router" and native_pd:
        return "P/D (its vLLM mode)"
    return "plain workers"


def peer_ready(router: Router, base: str, n_workers: int) -> bool:
    """The peer answers ``/v1/models`` and (smg) lists every worker as healthy."""
    if not answers_ok(base + "/v1/models"):
        return False
    if router.kind != "smg":
        return True  # vllm-router checks every worker before it listens
    try:
        listed = httpx.get(base + "/workers", timeout=1.0).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return False
    return len(listed) >= n_workers and all(w.get("is_healthy", True) for w in listed)


@dataclass(frozen=True, slots=True)
class Running:
    """A started router: where clients send requests, where its metrics are, its process id."""

    base: str
    metrics_url: str
    pid: int


@contextlib.contextmanager
def peer_process(
    router: Router, exe: Path, config: dict[str, Any], workdir: Path, *, pd: bool = False
) -> Iterator[Running]:
    """The peer in front of the workers of ``config`` (a ``kvroute serve`` config), ready; stopped after."""
    tag = router.tag
    port, metrics_port = free_port(), free_port()
    argv = peer_argv(router, exe, config, port, metrics_port, pd=pd)
    log = workdir / f"router-{tag}.log"
    base = f"http://127.0.0.1:{port}"
    with process(argv, log) as proc:
        n = len(config["workers"])
        wait_until_ready(lambda: peer_ready(router, base, n), proc, router.name, log)
        yield Running(base, f"http://127.0.0.1:{metrics_port}/metrics", proc.pid)


@contextlib.contextmanager
def kvroute_process(
    policy: str, config: dict[str, Any], workdir: Path, python: str = sys.executable, tag: str = ""
) -> Iterator[Running]:
    """``kvroute serve --policy policy`` with ``config`` (the fleet's own, tokenizer included), ready; stopped
    after. ``python``: another install's interpreter (an older checkout's venv, measured in the same run)."""
    config = {**config, "policy": policy, "port": free_port()}
    router_yaml = workdir / f"router-{policy}{tag}.yaml"
    router_yaml.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [python, "-m", "kvroute.apps.cli", "serve", "--config", str(router_yaml), "--log-level", "warning"]
    base = f"http://127.0.0.1:{config['port']}"
    log = workdir / f"router-{policy}{tag}.log"
    with process(argv, log) as proc:
        wait_until_ready(lambda: answers_ok(base + "/ready"), proc, f"kvroute serve --policy {policy}", log)
        yield Running(base, base + "/metrics", proc.pid)


def router_process(
    router: Router, config: dict[str, Any], workdir: Path, exes: dict[str, Path]
) -> contextlib.AbstractContextManager[Running]:
    """Any router of ROUTERS in front of the workers of ``config`` (peers from ``exes``, by kind)."""
    if router.kind == "kvroute":
        if router.options:
            config = {**config, "policy_options": dict(router.options)}
        python = router.python or sys.executable
        return kvroute_process(router.policy, config, workdir, python, tag=router.tag[len(router.policy) :])
    return peer_process(router, exes[router.kind], config, workdir)


def run_peer(
    router: Router,
    exe: Path,
    trace: Trace,
    fleet: FleetSpec,
    *,
    workdir: Path,
    on_result: Callable[[Any], None] | None = None,
    native_pd: bool = True,
) -> PolicyRun:
    """A fresh fleet, the peer in front of it, the trace replayed through the peer; both stopped after.
    ``native_pd``: in a P/D fleet, a peer with a vLLM P/D mode uses it (else every worker is plain)."""
    tag = router.tag
    with fleet_process(fleet, workdir, tag) as config:
        pd = native_pd and fleet.roles != "both"
        with peer_process(router, exe, config, workdir, pd=pd) as running:
            model, scale = config["models"][0]["name"], fleet.time_scale
            report = asyncio.run(replay(trace, running.base, model=model, time_scale=scale, on_result=on_result))
            time.sleep(0.5)
            metrics = scrape(running.metrics_url)
        workers = {w["id"]: scrape(w["url"].rstrip("/") + "/metrics") for w in config["workers"]}
    return PolicyRun(router.name, report, metrics, workers)


# -- regimes --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Regime:
    name: str
    about: str
    roles: str = "both"
    kv_protocol: str = "none"
    #: The fleet's GPU cache as a share of the trace's working set (None: the preset's cache).
    cache_share: float | None = None
    #: CPU-tier blocks per worker, as a multiple of its GPU blocks.
    cpu_tier: float = 0.0
    #: Multiplier of the trace's arrival rate.
    rate: float = 1.0


REGIMES = {
    r.name: r
    for r in (
        Regime("light", "the preset's GPU cache (the working set fits), half the trace's arrival rate", rate=0.5),
        Regime(
            "pressure",
            "GPU cache = the requests in flight + 1/4 of the working set, no CPU tier",
            cache_share=0.25,
        ),
        Regime(
            "tiered",
            "the pressure regime's GPU cache + a CPU tier 4x its size, pool.kv_protocol p2p",
            kv_protocol="p2p",
            cache_share=0.25,
            cpu_tier=4.0,
        ),
        Regime("pd", "prefill/decode roles (half each), NIXL pull, the preset's GPU cache", "prefill,decode", "nixl"),
    )
}


def in_flight_blocks(trace: Trace, workers: int, preset_name: str) -> int:
    """KV blocks the requests in flight hold on one worker, by Little's law: arrival rate x the unloaded
    service time (prefill + decode) x the mean request's blocks, over the workers."""
    preset = get_preset(preset_name)
    sizes = workloads.request_sizes(trace)
    if not sizes:
        return 0
    prompt = statistics.mean(p for p, _ in sizes)
    answer = statistics.mean(a for _, a in sizes)
    service = prompt / preset.prefill_tokens_per_s + answer * (preset.decode_base_s + 8 * preset.decode_per_seq_s)
    # A session's later turns come after its earlier ones: the trace lasts until its last session ends.
    session = statistics.mean(sum(st.delay_s for st in s.steps) + len(s.steps) * service for s in trace.sessions)
    rate = len(sizes) / (trace.duration_hint_s + session)
    return math.ceil(rate * service * (prompt + answer) / preset.block_size / workers)


def fleet_for(regime: Regime, trace: Trace, args: argparse.Namespace) -> FleetSpec:
    """The ``kvroute sim`` options of a regime, sized from the trace.

    Under cache pressure a worker's GPU cache holds its share of the requests in flight (twice the
    Little's-law estimate) plus ``cache_share`` of the trace's working set spread over the workers, so
    the pressure is on what stays cached, not on how many requests can run; and always the largest
    request twice over (the engine refuses a request larger than its cache)."""
    preset = get_preset(args.preset)
    gpu_blocks = cpu_blocks = None
    if regime.cache_share is not None:
        blocks, largest = workloads.working_set(trace, preset.block_size)
        cached = math.ceil(regime.cache_share * blocks / args.workers)
        gpu_blocks = max(2 * in_flight_blocks(trace, args.workers, args.preset) + cached, 2 * largest, 64)
    if regime.cpu_tier:
        cpu_blocks = math.ceil(regime.cpu_tier * (gpu_blocks or preset.gpu_blocks))
    return FleetSpec(
        workers=args.workers,
        preset=args.preset,
        time_scale=args.time_scale,
        roles=regime.roles,
        gpu_blocks=gpu_blocks,
        cpu_blocks=cpu_blocks,
    )


# -- traces ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceSpec:
    name: str
    about: str
    build: Callable[[int, argparse.Namespace], Trace]


def _mooncake(seed: int, args: argparse.Namespace) -> Trace:
    return workloads.mooncake_trace(
        seed, requests=args.requests, speedup=args.mooncake_speedup, scale=0.125 * args.scale, sample="families"
    )


def _shared_prefix(rate: float) -> Callable[[int, argparse.Namespace], Trace]:
    def build(seed: int, args: argparse.Namespace) -> Trace:
        groups = args.groups or max(2, args.requests // 10)
        return workloads.shared_prefix_trace(
            seed,
            requests=args.requests,
            groups=groups,
            rate=rate,
            scale=0.125 * args.scale,
            name=f"shared_prefix@{rate:g}",
        )

    return build


def _agentic(seed: int, args: argparse.Namespace) -> Trace:
    return workloads.agentic_trace(seed, sessions=max(2, round(args.requests / 8)), rate=0.5, scale=0.25 * args.scale)


def _chat(seed: int, args: argparse.Namespace) -> Trace:
    return workloads.chat_trace(seed, sessions=max(2, round(args.requests / 2.5)), rate=4.0, scale=0.5 * args.scale)


def trace_specs(args: argparse.Namespace) -> dict[str, TraceSpec]:
    specs = {
        "mooncake": TraceSpec(
            "mooncake",
            f"Mooncake FAST'25 synthetic trace: whole prefix families sampled, 512-token blocks as "
            f"{workloads.scaled(512, 0.125 * args.scale)} words, arrivals x{args.mooncake_speedup:g} the trace's rate",
            _mooncake,
        ),
        "agentic": TraceSpec(
            "agentic",
            f"agent sessions of 4-12 turns growing by tool outputs (mean {workloads.scaled(1500, 0.25 * args.scale)} "
            f"tokens), 3 shared system prompts of {workloads.scaled(4000, 0.25 * args.scale)} tokens, 0.5 sessions/s",
            _agentic,
        ),
        "chat": TraceSpec(
            "chat",
            f"1-4 turn conversations behind 8 app system prompts of {workloads.scaled(300, 0.5 * args.scale)} "
            f"tokens, answers ~{workloads.scaled(250, 0.5 * args.scale)} tokens, 4 conversations/s",
            _chat,
        ),
    }
    for rate in args.shared_prefix_rates:
        name = f"shared_prefix@{rate:g}"
        specs[name] = TraceSpec(
            name,
            f"llm-d shared-prefix shape: groups x ({workloads.scaled(6000, 0.125 * args.scale)}-token system prompt + "
            f"{workloads.scaled(1200, 0.125 * args.scale)}-token question), Poisson {rate:g} req/s",
            _shared_prefix(rate),
        )
    return specs


def select_traces(names: Sequence[str], specs: dict[str, TraceSpec]) -> list[TraceSpec]:
    """``shared_prefix`` stands for every rate of the sweep."""
    out: list[TraceSpec] = []
    for name in names:
        if name == "shared_prefix":
            out += [s for k, s in specs.items() if k.startswith("shared_prefix@")]
        elif name in specs:
            out.append(specs[name])
        else:
            raise SystemExit(f"unknown trace {name!r}; known: mooncake, shared_prefix, agentic, chat")
    return out


# -- figures --------------------------------------------------------------------------------------------------------


def run_figures(run: PolicyRun, trace: Trace, fleet: FleetSpec, slo_ms: float) -> dict[str, Any]:
    """``bench/routing.py``'s figures of one run, plus p90, e2e and the prefill the engines were spared."""
    block = get_preset(fleet.preset).block_size
    row = figures(run, trace, fleet.time_scale, slo_ms, block)
    ok = [r for r in run.report.results if r.ok]
    to_ms = 1000.0 / fleet.time_scale
    ttft = [r.ttft_s * to_ms for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s * to_ms for r in ok if r.e2e_s is not None]
    # Time per output token after the first: a prefill sharing a decoder's steps shows here (the sim stalls
    # the streams decoding on a worker while it prefills, as vLLM's mixed steps do).
    tpot = [
        (r.e2e_s - r.ttft_s) * to_ms / (r.completion_tokens - 1)
        for r in ok
        if r.e2e_s is not None and r.ttft_s is not None and r.completion_tokens > 1
    ]
    per_worker = [
        metric_total(metric_samples(page), "vllm:prompt_tokens_total") for page in run.worker_metrics.values()
    ]
    computed = sum(per_worker)
    # How the P2P sources answered lookups (HIT, MISS, HIT_PENDING: still computing, RETRY: too many
    # transfers out): a plan that waited at its source shows here, not in the hit counts.
    lookups: dict[str, float] = {}
    for page in run.worker_metrics.values():
        for labels, value in metric_samples(page).get("kvroute_sim:p2p_lookups_total", []):
            status = labels.get("status", "?")
            lookups[status] = lookups.get(status, 0.0) + value
    # kvroute's own account of its decisions (tokens -> keys -> lookup -> plan), mean over the run: what
    # the way in spends deciding under the trace's load. A peer's page has no such family and is not parsed.
    family = "kvroute_routing_decision_seconds"
    router_page = metric_samples(run.router_metrics) if family in run.router_metrics else {}
    decisions = metric_total(router_page, f"{family}_count")
    served = row["gpu_hits_engine"] + row["cpu_hits_engine"] + row["remote_hits_engine"]
    prompt = row["prompt_tokens"]
    saved = prompt - (computed - served)
    # bench/routing.py's oracle lets a request reuse what had its first token before the request was sent
    # (the project's figure, comparable with docs/benchmarks.md); a request that queues is admitted later
    # and can beat it. Every prefix sent before it, caches never evicting, bounds every router (results
    # without TTFTs make oracle_cached use the send times).
    oracle = oracle_cached(trace, run.report.results, block)
    cacheable = oracle_per_request(trace, [replace(r, ttft_s=None) for r in run.report.results], block)
    bound = sum(cached for _, cached in cacheable)
    floors = ttft_floors_ms(cacheable, get_preset(fleet.preset))
    row.update(
        oracle_share=saved / oracle if oracle else 1.0,
        bound_share=saved / bound if bound else 1.0,
        busiest_worker_share=max(per_worker) / computed if computed else 0.0,
        router=run.policy,
        ttft_p90_ms=percentile(ttft, 90) or math.nan,
        floor_p50_ms=percentile(floors, 50) or math.nan,
        floor_p99_ms=percentile(floors, 99) or math.nan,
        e2e_p50_ms=percentile(e2e, 50) or math.nan,
        e2e_p99_ms=percentile(e2e, 99) or math.nan,
        tpot_p50_ms=percentile(tpot, 50) or math.nan,
        tpot_p99_ms=percentile(tpot, 99) or math.nan,
        answered=len(ok),
        prefill_saved_ratio=saved / prompt if prompt else 0.0,
        duration_s=run.report.duration_s,
        p2p_lookups=lookups,
    )
    if decisions:
        row["decision_ms"] = 1000.0 * metric_total(router_page, f"{family}_sum") / decisions
        # The share of decisions taken on a long new prompt's head (router/prompt_head.py).
        heads = [
            v for labels, v in router_page.get("kvroute_prompt_heads_total", []) if labels.get("outcome") == "decided"
        ]
        row["head_share"] = sum(heads) / decisions
    return row


def ttft_floors_ms(cacheable: Sequence[tuple[RequestResult, int]], preset: Preset) -> list[float]:
    """Each request's TTFT on an idle worker holding every block any cache could have held for it (the
    engine's own prefill of the rest, nothing else): no router does better on any request, so no router's
    TTFT percentile is below the same percentile of these (the k-th slowest TTFT is at least the k-th
    slowest floor)."""
    return [1000.0 * prefill_seconds(preset, max(1, r.prompt_tokens - cached), cached) for r, cached in cacheable]


#: Aggregated per cell: median and spread over seeds.
METRICS = (
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "floor_p50_ms",
    "floor_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "goodput",
    "cached_token_ratio",
    "prefill_saved_ratio",
    "oracle_share",
    "bound_share",
    "busiest_worker_share",
    "cached_tokens",
    "prompt_tokens",
    "requests",
    "answered",
    "errors",
    *(f"hop_{name}_ms" for name in ("forward", "engine", "return")),
    "hop_matched",
    "decision_ms",
    "head_share",
)
#: Lower is better for these; higher for the rest of RATIOS.
LOWER = {"ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "tpot_p99_ms"}
RATIOS = ("ttft_p50_ms", "ttft_p99_ms", "goodput", "cached_token_ratio")


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    cell: dict[str, Any] = {"seeds": len(runs), "median": {}, "min": {}, "max": {}}
    for key in METRICS:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        if values:
            cell["median"][key] = statistics.median(values)
            cell["min"][key], cell["max"][key] = min(values), max(values)
    return cell


def add_ratios(cells: list[dict[str, Any]]) -> None:
    """Each router's median against the best peer of the same (trace, regime), per metric; with no peer
    in the run, against the best other router (named ``reference``)."""
    by_case: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        by_case.setdefault((c["trace"], c["regime"]), []).append(c)
    for group in by_case.values():
        peers = [c for c in group if router_of(c["router"]).kind != "kvroute"]
        for c in group:
            pool = peers or [o for o in group if o is not c]
            c["reference"] = "best peer" if peers else "best other router"
            c["ratios"] = {}
            for key in RATIOS:
                values = [o["median"][key] for o in pool if key in o["median"]]
                mine = c["median"].get(key)
                if not values or mine is None:
                    continue
                best = min(values) if key in LOWER else max(values)
                c["ratios"][key] = mine / best if best else math.nan


def _spread(cell: dict[str, Any], key: str, fmt: str) -> str:
    med = cell["median"].get(key)
    if med is None:
        return "-"
    if cell["seeds"] < 2:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(cell['min'][key])}-{fmt.format(cell['max'][key])})"


def hop_markdown(cells: list[dict[str, Any]]) -> str:
    """``--hops``: where each router's time to first token goes, per request (real ms)."""
    lines = [
        "Per request, time to first token in hops (real ms; medians over requests, then over seeds); kvroute's",
        "decision (its `kvroute_routing_decision_seconds`, mean over the run) is part of the first hop:",
        "",
        "| trace | router | client → engine | of it, kvroute's decision | on the head | engine | engine → client |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        if "hop_forward_ms" in c["median"]:
            hops = [_spread(c, f"hop_{name}_ms", "{:.2f}") for name in ("forward", "engine", "return")]
            hops[1:1] = [_spread(c, "decision_ms", "{:.2f}"), _spread(c, "head_share", "{:.0%}")]
            lines.append("| " + " | ".join([c["trace"], c["router"], *hops]) + " |")
    return "\n".join(lines)


def markdown(cells: list[dict[str, Any]], regime: Regime, native_pd: bool = True) -> str:
    pd = regime.roles != "both"
    head = ["trace", "router"] + (["P/D use"] if pd else [])
    head += ["TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "p99 floor ms", "e2e p50 ms", "TPOT p99 ms", "goodput"]
    head += ["cached"]
    head += ["prefill saved"]
    head += ["÷ oracle", "errors", "p50 / p99 vs ref"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        ratios = c.get("ratios", {})
        vs = " / ".join(f"{ratios[k]:.2f}x" if k in ratios else "-" for k in ("ttft_p50_ms", "ttft_p99_ms"))
        row = [c["trace"], c["router"]] + ([peer_mode(router_of(c["router"]), native_pd)] if pd else [])
        row += [
            _spread(c, "ttft_p50_ms", "{:.0f}"),
            _spread(c, "ttft_p90_ms", "{:.0f}"),
            _spread(c, "ttft_p99_ms", "{:.0f}"),
            _spread(c, "floor_p99_ms", "{:.0f}"),
            _spread(c, "e2e_p50_ms", "{:.0f}"),
            _spread(c, "tpot_p99_ms", "{:.1f}"),
            _spread(c, "goodput", "{:.0%}"),
            _spread(c, "cached_token_ratio", "{:.0%}"),
            _spread(c, "prefill_saved_ratio", "{:.0%}"),
            _spread(c, "oracle_share", "{:.0%}"),
            f"{c['median'].get('errors', 0):.0f}",
            vs,
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def chart(cells: list[dict[str, Any]], regime: Regime, path: Path, title: str) -> Path | None:
    """TTFT p50 and p99 per trace and router (medians, min-max bars). None without matplotlib."""
    plt = pyplot()
    if plt is None or not cells:
        return None
    traces = list(dict.fromkeys(c["trace"] for c in cells))
    routers = list(dict.fromkeys(c["router"] for c in cells))
    fig, axes = plt.subplots(1, 2, figsize=(max(9.0, 3.0 * len(traces)), 4.6))
    width = 0.8 / len(routers)
    for ax, key, label in zip(axes, ("ttft_p50_ms", "ttft_p99_ms"), ("TTFT p50", "TTFT p99"), strict=True):
        for j, router in enumerate(routers):
            xs, ys, lo, hi = [], [], [], []
            for i, trace in enumerate(traces):
                c = next((c for c in cells if c["trace"] == trace and c["router"] == router), None)
                if c is None or key not in c["median"]:
                    continue
                xs.append(i + (j - (len(routers) - 1) / 2) * width)
                ys.append(c["median"][key])
                lo.append(c["median"][key] - c["min"][key])
                hi.append(c["max"][key] - c["median"][key])
            ax.bar(xs, ys, width=width, yerr=[lo, hi], capsize=2, label=router)
        ax.set_xticks(range(len(traces)), traces, rotation=15)
        ax.set_ylabel(f"{label} (ms, simulated hardware)")
        ax.set_title(f"{label} (lower is better)")
    axes[0].legend(fontsize=8)
    return save_figure(plt, fig, path, title)


# -- main -----------------------------------------------------------------------------------------------------------


@dataclass
class Results:
    path: Path
    meta: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)
    cells: list[dict[str, Any]] = field(default_factory=list)

    def save(self) -> None:
        data = {**self.meta, "runs": self.runs, "cells": self.cells}
        self.path.write_text(json.dumps(data, indent=1, default=str))


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def router_of(name: str) -> Router:
    """A name of ROUTERS, or a kvroute router with policy options: ``kvaware[decode_stall_weight=0;...]``
    (values read as YAML), to measure a variant beside the default in the same run."""
    if name in ROUTERS:
        return ROUTERS[name]
    if name == BASELINE:  # read back from a run's results; main() names the install that served it
        return Router(BASELINE, "kvroute", "kvaware")
    base, _, rest = name.partition("[")
    known = ROUTERS.get(base)
    if known is None or known.kind != "kvroute" or not rest.endswith("]"):
        raise SystemExit(f"unknown router {name!r}; known: {', '.join(ROUTERS)} (kvroute ones take [key=value;...])")
    options = []
    for pair in filter(None, rest[:-1].split(";")):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"router {name!r}: {pair!r} is not key=value")
        options.append((key.strip(), yaml.safe_load(value)))
    return Router(name, known.kind, known.policy, tuple(options))


def router_names(text: str | None, default: Sequence[str]) -> list[str]:
    """A ``--routers`` option: comma-separated names of ROUTERS or kvroute variants (``default`` when empty);
    exits naming an unknown one."""
    names = _csv(text or ",".join(default))
    for name in names:
        router_of(name)
    return names


def with_baseline(names: list[str], baseline: str | None) -> list[str]:
    """``names`` and, given a ``--baseline`` interpreter (which must exist), :data:`BASELINE` after them."""
    if not baseline:
        return names
    if not Path(baseline).exists():
        raise SystemExit(f"--baseline {baseline}: no such interpreter")
    return [*names, BASELINE]


def routers_of(names: Sequence[str], baseline: str | None) -> list[Router]:
    """The routers named, :data:`BASELINE`'s served by the ``baseline`` interpreter."""
    return [replace(router_of(n), python=baseline or "") if n == BASELINE else router_of(n) for n in names]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--traces", help="mooncake,shared_prefix,agentic,chat (default all; --quick: mooncake,shared_prefix)"
    )
    ap.add_argument("--regimes", help=f"{','.join(REGIMES)} (default all)")
    ap.add_argument("--routers", help=f"{','.join(ROUTERS)} (default all)")
    ap.add_argument("--seeds", help="comma-separated seeds (default 0,1,2; --quick: 0)")
    ap.add_argument("--requests", type=int, help="requests per trace, about (default 200; --quick: 40)")
    ap.add_argument(
        "--time-scale",
        type=float,
        help="real seconds per model second (default 1: the routers' own CPU time counts 1:1)",
    )
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every trace's token counts")
    ap.add_argument("--work", default="out/peers", help="work folder: peer venvs, logs, results")
    ap.add_argument("--quick", action="store_true", help="the smallest meaningful run (a few minutes)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--preset", default="qwen-32b-h100x2")
    ap.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT SLO for goodput (simulated ms)")
    ap.add_argument("--mooncake-speedup", type=float, default=3.0, help="x the Mooncake trace's 3.9 req/s")
    ap.add_argument("--shared-prefix-rates", default="16", help="req/s of the shared-prefix trace; a list sweeps")
    ap.add_argument("--groups", type=int, default=0, help="shared-prefix groups (default requests / 10)")
    ap.add_argument("--retries", type=int, default=1, help="more tries for a run that fails (default 1)")
    ap.add_argument(
        "--hops",
        action="store_true",
        help="split each request's TTFT into client -> engine, engine, engine -> client (the workers log)",
    )
    ap.add_argument(
        "--baseline",
        metavar="PYTHON",
        help=f"the python of another kvroute install: its kvaware runs too, as {BASELINE} (before/after)",
    )
    ap.add_argument(
        "--no-peer-pd",
        dest="peer_pd",
        action="store_false",
        help="in the P/D regime, give vllm-router plain workers too instead of its vLLM P/D mode",
    )
    args = ap.parse_args(argv)
    args.traces = _csv(
        args.traces or ("mooncake,shared_prefix" if args.quick else "mooncake,shared_prefix,agentic,chat")
    )
    args.regimes = _csv(args.regimes or ",".join(REGIMES))
    args.routers = router_names(args.routers, list(ROUTERS))
    args.routers = with_baseline(args.routers, args.baseline)
    args.seeds = [int(s) for s in _csv(args.seeds or ("0" if args.quick else "0,1,2"))]
    args.requests = args.requests or (40 if args.quick else 200)
    args.time_scale = args.time_scale or 1.0
    args.shared_prefix_rates = [float(r) for r in _csv(args.shared_prefix_rates)]
    for value in args.regimes:
        if value not in REGIMES:
            raise SystemExit(f"unknown regime {value!r}; known: {', '.join(REGIMES)}")
    return args


def save_requests(run: PolicyRun, path: Path) -> None:
    """Every request's outcome, one JSON line each, so a tail can be read request by request."""
    path.write_bytes(b"".join(json.dumps(asdict(r)).encode() + b"\n" for r in run.report.results))


def run_one(
    router: Router,
    trace: Trace,
    fleet: FleetSpec,
    regime: Regime,
    args: argparse.Namespace,
    exes: dict[str, Path],
    workdir: Path,
    label: str,
) -> dict[str, Any]:
    """One router on a fresh fleet: its figures, or ``failed`` after ``--retries`` more tries (a router
    that does not start is retried, so one bad start does not leave a hole in a long run)."""
    error = ""
    hop_path = workdir / f"hops-{router.tag}.log"
    for attempt in range(1 + args.retries):
        progress = Progress(label, trace.n_requests)
        hop_path.unlink(missing_ok=True)
        if args.hops:
            os.environ[HOP_LOG_ENV] = str(hop_path)  # read by the fleet's workers, started below
        try:
            if router.kind == "kvroute":
                receipts_path = workdir / f"receipts-{router.tag}.jsonl"
                receipts_path.unlink(missing_ok=True)  # a retried run starts its receipts over
                config = {"pool": {"kv_protocol": regime.kv_protocol}, "receipts_path": str(receipts_path)}
                run = run_policy(
                    router.policy,
                    trace,
                    fleet,
                    workdir=workdir,
                    router_config=config,
                    on_result=progress,
                    policy_options=dict(router.options) or None,
                    python=router.python or None,
                )
                explained = receipt_summary(load_receipts([receipts_path])) if receipts_path.exists() else None
            else:
                exe = exes[router.kind]
                run = run_peer(router, exe, trace, fleet, workdir=workdir, on_result=progress, native_pd=args.peer_pd)
                explained = None
            progress.finish()
            save_requests(run, workdir / f"requests-{router.tag}.jsonl")
            # The router as named (a kvroute variant runs its base policy, under the variant's name).
            figs = {**run_figures(run, trace, fleet, args.slo_ms), "router": router.name, "attempts": attempt + 1}
            if explained is not None:
                figs["receipts"] = explained
            if args.hops:
                figs.update(hop_split(run.report.results, hop_path))
            return figs
        except Exception as exc:  # one router failing must not lose the rest of a long run
            progress.finish()
            error = f"{type(exc).__name__}: {exc}"[:3000]
            print(f"  {router.name} failed (try {attempt + 1}): {error[:300]}", file=sys.stderr)
            time.sleep(3)
        finally:
            os.environ.pop(HOP_LOG_ENV, None)
    return {"failed": error}


def hop_arrivals(hop_path: Path) -> dict[int, list[tuple[float, float]]]:
    """The workers' hop log (``kvroute.sim.hop_log``): per prompt key, each (arrival, first token out)."""
    arrivals: dict[int, list[tuple[float, float]]] = {}
    if hop_path.exists():
        for line in hop_path.read_text().splitlines():
            key, arrival, first = line.split()
            arrivals.setdefault(int(key), []).append((float(arrival), float(first)))
    return arrivals


def request_hops(
    arrivals: dict[int, list[tuple[float, float]]], prompt_key: int, sent_at: float, first_at: float | None
) -> tuple[float, float, float] | None:
    """One request's (client to engine, engine, engine to client) in real ms, or None when unmatched: by its
    prompt key and, where the key was sent more than once, the latest arrival before the engine saw it."""
    if first_at is None:
        return None
    seen = [a for a in arrivals.get(prompt_key, ()) if sent_at <= a[0] <= a[1] <= first_at]
    if not seen:
        return None
    arrival, first = max(seen)
    return (arrival - sent_at) * 1e3, (first - arrival) * 1e3, (first_at - first) * 1e3


def hop_split(results: Sequence[RequestResult], hop_path: Path) -> dict[str, float]:
    """Per request, the client's time to first token in three hops (real ms, medians over the requests):
    client to engine (the router's way in, its decision included), engine (queue, prefill, the first
    token's write), engine to client (the router's way back), matched by :func:`request_hops`. P/D plans:
    the decode leg's arrival counts."""
    arrivals = hop_arrivals(hop_path)
    hops: dict[str, list[float]] = {"forward": [], "engine": [], "return": []}
    for r in results:
        split = request_hops(arrivals, r.prompt_key, r.sent_at, r.first_at)
        if split is not None:
            for name, value in zip(hops, split, strict=True):
                hops[name].append(value)
    if not hops["forward"]:
        return {}
    return {f"hop_{name}_ms": statistics.median(values) for name, values in hops.items()} | {
        "hop_matched": len(hops["forward"])
    }


def summarize(results: Results, specs: list[TraceSpec], regimes: list[Regime], routers: list[Router]) -> None:
    """Cells: every (trace, regime, router) with at least one run that did not fail."""
    results.cells = []
    for s in specs:
        for g in regimes:
            for r in routers:
                key = (s.name, g.name, r.name)
                runs = [x for x in results.runs if (x["trace"], x["regime"], x["router"]) == key and "failed" not in x]
                if runs:
                    results.cells.append({"trace": s.name, "regime": g.name, "router": r.name, **aggregate(runs)})
    add_ratios(results.cells)


def report(results: Results, specs: list[TraceSpec], regimes: list[Regime], args: argparse.Namespace) -> str:
    """The markdown report (one table and one chart per regime); charts are written next to it."""
    setting = results.meta["setting"]
    md = [f"# kvroute vs peers: {setting}, seeds {','.join(map(str, args.seeds))}", ""]
    md += [f"- `{s.name}`: {s.about}" for s in specs]
    md += ["", "Medians over seeds (min-max); ratios against the best peer of each trace, per metric.", ""]
    for regime in regimes:
        cells = [c for c in results.cells if c["regime"] == regime.name]
        md += [f"## {regime.name}: {regime.about}", "", markdown(cells, regime, args.peer_pd), ""]
        png = chart(
            cells, regime, Path(args.work) / f"peers-{regime.name}.png", f"{regime.name}: {regime.about}\n{setting}"
        )
        if png:
            md += [f"![{regime.name}]({png.name})", ""]
        if any("hop_forward_ms" in c["median"] for c in cells):
            md += [hop_markdown(cells), ""]
        explained = [r for r in results.runs if r["regime"] == regime.name and r.get("receipts")]
        if explained:
            md += ["Receipts (kvroute's own account of its decisions, per run):", "", "```"]
            md += [
                render_receipts(f"{r['trace']} / seed {r['seed']} / {r['router']}", r["receipts"]) for r in explained
            ]
            md += ["```", ""]
    failed = [r for r in results.runs if "failed" in r]
    if failed:
        md += ["Failed runs:", ""]
        md += [f"- {r['trace']} / {r['regime']} / {r['seed']} / {r['router']}: {r['failed'][:200]}" for r in failed]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="runs-", dir=work))
    routers = routers_of(args.routers, args.baseline)
    exes = {kind: ensure_peer(PEERS[kind], work) for kind in dict.fromkeys(r.kind for r in routers) if kind in PEERS}
    specs = select_traces(args.traces, trace_specs(args))
    regimes = [REGIMES[name] for name in args.regimes]
    setting = f"{args.workers} x {args.preset}, time scale {args.time_scale}, SLO {args.slo_ms:.0f} ms"
    meta = {
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "setting": setting,
        "traces": {s.name: s.about for s in specs},
        "regimes": {r.name: asdict(r) for r in regimes},
        "routers": [asdict(r) for r in routers],
        "peers": {k: PEERS[k].requirement for k in exes},
        "seeds": args.seeds,
        "logs": str(logs),
    }
    results = Results(work / "peers.json", meta)
    total = len(specs) * len(regimes) * len(args.seeds) * len(routers)
    began = time.monotonic()
    sizes = f"{len(specs)} traces x {len(regimes)} regimes x {len(args.seeds)} seed(s) x {len(routers)} routers"
    print(f"{total} runs: {sizes}\n{setting}; logs in {logs}", flush=True)
    for spec in specs:
        for regime in regimes:
            for k, seed in enumerate(args.seeds):
                trace = workloads.with_rate(spec.build(seed, args), regime.rate)
                fleet = fleet_for(regime, trace, args)
                print(
                    f"\n{spec.name} / {regime.name} / seed {seed}: {len(trace.sessions)} sessions, "
                    f"{trace.n_requests} requests, GPU blocks {fleet.gpu_blocks or 'preset'}, "
                    f"CPU blocks {fleet.cpu_blocks or 0}, roles {fleet.roles}",
                    flush=True,
                )
                workdir = logs / f"{spec.name}-{regime.name}-{seed}"
                workdir.mkdir(parents=True, exist_ok=True)
                for router in routers[k % len(routers) :] + routers[: k % len(routers)]:  # rotated per seed
                    entry: dict[str, Any] = {"trace": spec.name, "regime": regime.name, "seed": seed}
                    entry["router"] = router.name
                    entry.update(fleet=asdict(fleet), elapsed_s=time.monotonic() - began)
                    label = f"{len(results.runs) + 1}/{total} {router.name}"
                    entry.update(run_one(router, trace, fleet, regime, args, exes, workdir, label))
                    results.runs.append(entry)
                    results.save()
    summarize(results, specs, regimes, routers)
    results.save()
    text = report(results, specs, regimes, args)
    (work / "peers.md").write_text(text)
    print("\n" + text)
    print(f"results: {work / 'peers.json'}, {work / 'peers.md'}; total {time.monotonic() - began:.0f} s")
    return 1 if any("failed" in r for r in results.runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
