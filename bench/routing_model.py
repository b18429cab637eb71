"""Routing quality of every policy on a discrete-event model of a fleet, the same arrivals for all.

    .venv/bin/python bench/routing_model.py [--workers 8] [--sessions 96] [--seed 1]

Not the twin fleet (``kvroute sim``): a small, fast model that calls the real policies. Each worker
serves prefills FIFO; it keeps a GPU and a CPU LRU cache of our block keys (GPU evictions fall to CPU);
a request's time is queue + promotion of CPU hits + P2P transfer + prefill of the rest, with a true
prefill speed 20 % below the policies' configured one (so calibration has work to do). The index
the policies see is fed by events that arrive when a prefill ends, so it lags the caches.

Traces: *agentic* (sessions sharing one of a few long tool prompts, each turn appending tool output and
an answer) and *chat* (independent prompts behind a short shared system prompt). Reported per policy:
TTFT p50/p99, goodput (share within the SLO), cached tokens vs the ``oracle`` policy (greedy, exact
state, exact timing model), hits per tier, bytes moved, stale decisions, recomputed tokens.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvroute.indexer.backend import WorkerMatch
from kvroute.policies import RouteOutcome, RouteRequest, WorkerView, create_policy

BLOCK = 16
BPT = 262_144  # Qwen3-32B-class, bf16
TRUE_RATE = 8_000.0  # uncached tokens/s actually achieved (policies are configured with 10k)
CPU_BW, NET_BW, LOOKUP, OVERHEAD = 25e9, 12.5e9, 0.001, 0.005


@dataclass
class Req:
    arrival: float
    keys: list[int]
    text: str
    answer_keys: list[int]
    session: int


@dataclass
class Worker:
    id: str
    gpu_cap: int
    cpu_cap: int
    gpu: OrderedDict[int, None] = field(default_factory=OrderedDict)
    cpu: OrderedDict[int, None] = field(default_factory=OrderedDict)
    free_at: float = 0.0
    #: (finish time, blocks) of the requests in flight: their blocks are what vLLM reports as KV usage.
    finishes: list[tuple[float, int]] = field(default_factory=list)


def chain(parts: list[tuple[Any, ...]]) -> list[int]:
    keys, prev = [], 0
    for part in parts:
        prev = hash((prev, part)) & ((1 << 63) - 1)
        keys.append(prev)
    return keys


def agentic_trace(rng: random.Random, sessions: int, turns: int) -> list[Req]:
    out = []
    for s in range(sessions):
        group = rng.randrange(4)
        parts: list[tuple[Any, ...]] = [("tools", group, i) for i in range(256)]  # 4k-token tool prompt
        t = rng.uniform(0, 60)
        for turn in range(turns):
            parts += [("user", s, turn, i) for i in range(rng.randint(16, 48))]  # tool output / question
            answer = [("answer", s, turn, i) for i in range(rng.randint(8, 24))]
            keys = chain(parts)
            out.append(Req(t, keys, " ".join(map(str, parts)), chain(parts + answer)[len(keys) :], s))
            parts += answer
            t += rng.expovariate(1 / 6.0)
    return sorted(out, key=lambda r: r.arrival)


def chat_trace(rng: random.Random, n: int, rate: float) -> list[Req]:
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        parts: list[tuple[Any, ...]] = [("sys", j) for j in range(16)]
        parts += [("q", i, j) for j in range(rng.randint(30, 190))]
        out.append(Req(t, chain(parts), " ".join(map(str, parts)), [], i))
    return out


class Fleet:
    def __init__(self, n: int, gpu_cap: int, cpu_cap: int) -> None:
        self.workers = {f"w{i}": Worker(f"w{i}", gpu_cap, cpu_cap) for i in range(n)}
        self.index: dict[str, dict[int, str]] = {w: {} for w in self.workers}
        self.events: list[tuple[float, int, str, str, int]] = []
        self.seq = 0

    def emit(self, when: float, worker: str, op: str, key: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, worker, op, key))

    def advance(self, now: float) -> None:
        while self.events and self.events[0][0] <= now:
            _, _, wid, op, key = heapq.heappop(self.events)
            if op == "drop":
                self.index[wid].pop(key, None)
            else:
                self.index[wid][key] = op

    def matches(self, keys: list[int]) -> dict[str, WorkerMatch]:
        out = {}
        for wid, idx in self.index.items():
            g = c = 0
            for k in keys:
                tier = idx.get(k)
                if tier is None:
                    break
                if tier == "GPU":
                    g += 1
                else:
                    c += 1
            if g + c:
                out[wid] = WorkerMatch(wid, blocks=g + c, gpu=g, cpu=c)
        return out

    def views(self, now: float) -> list[WorkerView]:
        out = []
        for w in self.workers.values():
            w.finishes = [f for f in w.finishes if f[0] > now]
            n = len(w.finishes)
            used = min(1.0, sum(b for _, b in w.finishes) / w.gpu_cap)
            # The router's own in-flight count only (WorkerView.load adds scraped waiting to it).
            out.append(WorkerView(id=w.id, inflight=n, kv_usage=used, p2p_host=f"10.0.0.{w.id[1:]}", p2p_port=5710))
        return out

    @staticmethod
    def held(w: Worker, keys: list[int]) -> tuple[int, int]:
        g = c = 0
        for k in keys:
            if k in w.gpu and c == 0:
                g += 1
            elif k in w.gpu or k in w.cpu:
                c += 1
            else:
                break
        return g, c

    def store(self, w: Worker, keys: list[int], when: float) -> None:
        for k in keys:
            if k in w.cpu:
                del w.cpu[k]
            w.gpu[k] = None
            w.gpu.move_to_end(k)
            self.emit(when, w.id, "GPU", k)
        while len(w.gpu) > w.gpu_cap:
            k, _ = w.gpu.popitem(last=False)
            w.cpu[k] = None
            self.emit(when, w.id, "CPU", k)
        while len(w.cpu) > w.cpu_cap:
            k, _ = w.cpu.popitem(last=False)
            self.emit(when, w.id, "drop", k)

    def service(self, p: Worker, keys: list[int], source: Worker | None) -> tuple[float, dict[str, int]]:
        g, c = self.held(p, keys)
        local = g + c
        remote = 0
        if source is not None:
            sg, sc = self.held(source, keys)
            remote = max(0, min(len(keys), sg + sc) - local)
        total = len(keys) * BLOCK
        hits = {"GPU": g * BLOCK, "CPU": c * BLOCK, "REMOTE": remote * BLOCK}
        cached = min(total - 1, sum(hits.values()))
        t = OVERHEAD + hits["CPU"] * BPT / CPU_BW
        t += LOOKUP + hits["REMOTE"] * BPT / NET_BW if source else 0.0
        t += (total - cached) / TRUE_RATE
        return t, hits


def oracle_choice(fleet: Fleet, req: Req, now: float) -> tuple[str, str | None]:
    best: tuple[float, str, str | None] | None = None
    for p in fleet.workers.values():
        for src in [None, *fleet.workers.values()]:
            if src is p:
                continue
            wait = max(0.0, p.free_at - now)
            t, _ = fleet.service(p, req.keys, src)
            cand = (wait + t, p.id, src.id if src else None)
            if best is None or cand < best:
                best = cand
    assert best is not None
    return best[1], best[2]


def run(
    policy_name: str, options: dict[str, Any], trace: list[Req], n: int, gpu_cap: int, cpu_cap: int, slo: float
) -> dict[str, Any]:
    fleet = Fleet(n, gpu_cap, cpu_cap)
    clock = [0.0]
    if policy_name.startswith("kvaware"):
        options = {**options, "now": lambda: clock[0]}  # the policy's clock is the simulation's
    policy = None if policy_name == "oracle" else create_policy(policy_name, **options)
    ttfts, cached_total, recomputed, moved, stale = [], 0, 0, 0.0, 0
    tiers = {"GPU": 0, "CPU": 0, "REMOTE": 0}
    outcomes: list[tuple[float, int, RouteOutcome]] = []  # reported to the policy when the answer starts
    for i, req in enumerate(trace):
        clock[0] = req.arrival
        fleet.advance(req.arrival)
        while outcomes and outcomes[0][0] <= req.arrival and policy is not None:
            policy.observe(heapq.heappop(outcomes)[2])
        views = fleet.views(req.arrival)
        if policy is None:
            pid, sid = oracle_choice(fleet, req, req.arrival)
            predicted = 0
            plan = None
        else:
            rr = RouteRequest(
                request_id=str(i),
                model="m",
                prompt_tokens=len(req.keys) * BLOCK,
                block_size=BLOCK,
                matches=fleet.matches(req.keys) if policy.needs_index else {},
                prompt_text=req.text if policy.needs_text else None,
            )
            plan = policy.choose(rr, views)
            pid, sid, predicted = plan.prefill, plan.kv_source, plan.predicted_cached_tokens
        p = fleet.workers[pid]
        start = max(req.arrival, p.free_at)
        service, hits = fleet.service(p, req.keys, fleet.workers[sid] if sid else None)
        end = start + service
        p.free_at = end
        p.finishes.append((end, len(req.keys)))
        fleet.store(p, req.keys + req.answer_keys, end)
        ttft = end - req.arrival
        ttfts.append(ttft)
        cached = min(len(req.keys) * BLOCK - 1, sum(hits.values()))
        cached_total += cached
        recomputed += len(req.keys) * BLOCK - cached
        moved += hits["REMOTE"] * BPT + hits["CPU"] * BPT
        for t, v in hits.items():
            tiers[t] += v
        stale += int(predicted > 0 and cached < predicted * 0.5)
        if policy is not None and plan is not None:
            outcome = RouteOutcome(str(i), "m", plan, len(req.keys) * BLOCK, cached, ttft)
            heapq.heappush(outcomes, (end, i, outcome))
    ttfts.sort()
    return {
        "p50": statistics.median(ttfts),
        "p99": ttfts[int(0.99 * (len(ttfts) - 1))],
        "goodput": sum(t <= slo for t in ttfts) / len(ttfts),
        "cached": cached_total,
        "tiers": tiers,
        "moved_gb": moved / 1e9,
        "stale": stale,
        "recomputed": recomputed,
        "n": len(trace),
    }


POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("round_robin", "round_robin", {}),
    ("least_load", "least_load", {}),
    ("prefix", "prefix", {}),
    ("approx_text", "approx_text", {}),
    ("kvaware", "kvaware", {}),
    ("kvaware+p2p", "kvaware", {"kv_protocol": "p2p"}),
    ("oracle", "oracle", {}),
]


def report(title: str, results: dict[str, dict[str, Any]], slo: float) -> None:
    oracle = results["oracle"]["cached"] or 1
    print(f"\n## {title}")
    print(
        f"| policy | TTFT p50 s | TTFT p99 s | goodput (TTFT ≤ {slo:g} s) | cached ÷ oracle "
        "| GPU / CPU / REMOTE hit tokens | GB moved | stale | recomputed tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        t = r["tiers"]
        print(
            f"| {name} | {r['p50']:.3f} | {r['p99']:.3f} | {r['goodput']:.1%} | {r['cached'] / oracle:.1%} "
            f"| {t['GPU']} / {t['CPU']} / {t['REMOTE']} | {r['moved_gb']:.1f} | {r['stale']} "
            f"| {r['recomputed']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=96)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--chat-requests", type=int, default=1500)
    parser.add_argument("--chat-rate", type=float, default=30.0, help="chat arrivals per second")
    parser.add_argument("--gpu-blocks", type=int, default=3000)
    parser.add_argument("--cpu-blocks", type=int, default=12000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    traces = {
        "agentic multi-turn": (agentic_trace(random.Random(args.seed), args.sessions, args.turns), 1.0),
        "plain chat": (chat_trace(random.Random(args.seed), args.chat_requests, args.chat_rate), 0.5),
    }
    for title, (trace, slo) in traces.items():
        results = {
            label: run(name, opts, trace, args.workers, args.gpu_blocks, args.cpu_blocks, slo)
            for label, name, opts in POLICIES
        }
        report(f"{title}: {len(trace)} requests, {args.workers} workers, seed {args.seed}", results, slo)


if __name__ == "__main__":
    main()
