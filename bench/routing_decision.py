"""Decision cost of each policy and the tokenizer prefix cache, against baselines in the same run.

    .venv/bin/python bench/routing_decision.py [--workers 8 32] [--prompt-tokens 32768] [--iters 300]

Prints p50/p99 microseconds per ``choose()`` with the ratio to ``round_robin`` (the cheapest possible
policy), and the time to tokenize each turn of a growing chat with the prefix cache vs a full encode.
Not a test: numbers depend on the machine; ratios are what to compare.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from kvroute.indexer.backend import WorkerMatch
from kvroute.policies import RouteRequest, WorkerView, create_policy


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_policies(n_workers: int, prompt_tokens: int, iters: int) -> None:
    rng = random.Random(1)
    block = 16
    blocks = prompt_tokens // block
    workers = [
        WorkerView(id=f"w{i}", inflight=rng.randint(0, 8), kv_usage=rng.random(), p2p_host=f"10.0.0.{i}", p2p_port=5710)
        for i in range(n_workers)
    ]
    matches = {}
    for w in workers[: n_workers // 2]:
        held = rng.randint(1, blocks)
        g = rng.randint(0, held)
        matches[w.id] = WorkerMatch(w.id, blocks=held, gpu=g, cpu=held - g)
    words = [f"tok{i % 997}" for i in range(prompt_tokens)]
    text = " ".join(words)
    results: dict[str, tuple[float, float]] = {}
    for name, options in (
        ("round_robin", {}),
        ("least_load", {}),
        ("prefix", {}),
        ("approx_text", {}),
        ("kvaware", {}),
        ("kvaware", {"kv_protocol": "p2p"}),
    ):
        policy = create_policy(name, **options)
        label = name + ("+p2p" if options else "")
        samples = []
        for i in range(iters):
            req = RouteRequest(
                request_id=str(i),
                model="m",
                prompt_tokens=prompt_tokens,
                block_size=block,
                matches=matches,
                prompt_text=text + str(i % 8),
            )
            t0 = time.perf_counter()
            policy.choose(req, workers)
            samples.append((time.perf_counter() - t0) * 1e6)
        results[label] = (statistics.median(samples), percentile(samples, 0.99))
    base = results["round_robin"][0]
    print(f"\n## choose() on {n_workers} workers, {prompt_tokens}-token prompt, {iters} iterations")
    print("| policy | p50 µs | p99 µs | p50 ÷ round_robin |")
    print("|---|---|---|---|")
    for label, (p50, p99) in results.items():
        print(f"| {label} | {p50:.1f} | {p99:.1f} | {p50 / base:.1f}x |")


def bench_tokenizer(turns: int) -> None:
    from kvroute.router.tokens import LocalTokenizer

    from tests.router.test_tokens import build_model_folder  # the same locally built BPE as the tests

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model_folder(Path(tmp) / "model")
        cached = LocalTokenizer(folder)
        plain = LocalTokenizer(folder, cache_entries=0)
        rng = random.Random(2)
        vocab = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "kv", "cache", "routing"]
        messages = [{"role": "system", "content": " ".join(rng.choices(vocab, k=2000))}]
        t_cached = t_full = 0.0
        for _ in range(turns):
            messages.append({"role": "user", "content": " ".join(rng.choices(vocab, k=300))})
            t0 = time.perf_counter()
            a = cached.encode_chat(messages)
            t1 = time.perf_counter()
            b = plain.encode_chat(messages)
            t2 = time.perf_counter()
            assert a == b
            t_cached += t1 - t0
            t_full += t2 - t1
            messages.append({"role": "assistant", "content": " ".join(rng.choices(vocab, k=300))})
        print(f"\n## Tokenizing a growing chat ({turns} turns, final {len(a)} tokens)")
        print("| path | total ms | ratio |")
        print("|---|---|---|")
        print(f"| full encode every turn (baseline) | {t_full * 1e3:.1f} | 1.0x |")
        print(f"| prefix cache | {t_cached * 1e3:.1f} | {t_full / t_cached:.1f}x faster |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args()
    for n in args.workers:
        bench_policies(n, args.prompt_tokens, args.iters)
    bench_tokenizer(args.turns)


if __name__ == "__main__":
    main()
