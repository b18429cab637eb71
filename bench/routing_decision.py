"""Decision cost of each policy and the tokenizer prefix cache, against baselines in the same run.

    PYTHONPATH=. .venv/bin/python bench/routing_decision.py [--workers 8 32] [--prompt-tokens 32768] [--iters 300]
        [--incremental-only] [--profile]

Prints p50/p99 microseconds per ``choose()`` with the ratio to ``round_robin`` (the cheapest possible
policy), the time to tokenize each turn of a growing chat with the prefix cache vs a full encode, and the
whole decision (tokens -> keys -> lookup -> plan) for an "incremental 32k" prompt: sessions whose prompt
is ~32k tokens and extends the session's previous prompt by ~200 tokens (completions with the local BPE,
chat with its ChatML template, completions and agent-turn chats with the simulated workers' built-in
tokenizer and template), with a cProfile of the decision (``--profile``).

``--loop-stall``: what a new long prompt costs every *other* request of the process. A ticker coroutine
wakes every millisecond while the async API (what the router calls) encodes fresh prompts of 4k-32k
tokens (completions, and chats of 16 messages whose pieces between special tokens are encoded in parallel);
the table gives the encode's wall time and the ticker's longest late wake-up, with long encodes in a worker
thread (the default) and on the loop (``OFFLOOP_CHARS`` out of reach: the behaviour before it).
``--model-folder`` takes a real model's tokenizer folder (``tokenizer.json``, optional
``tokenizer_config.json``) instead of the tests' small BPE.
Not a test: numbers depend on the machine; ratios are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import ctypes
import ctypes.util
import io
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvroute.indexer.backend import WorkerMatch
from kvroute.indexer.events import BlockStored, encode_batch, encode_seq
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.service import KVIndexer
from kvroute.policies import Policy, RouteRequest, WorkerView, create_policy


def tune_allocator(trim_mb: int) -> None:
    """The allocator thresholds the router process runs with (``kvroute.router.heap``), set here directly so
    an older package measured with this script gets the same ones."""
    if trim_mb > 0:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, trim_mb << 20)  # M_TRIM_THRESHOLD


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


async def _longest_lag(work: Any) -> tuple[float, float]:
    """(seconds ``work`` took, the longest a 1 ms ticker on the same loop woke late meanwhile)."""
    lag = 0.0
    running = True

    async def ticker() -> None:
        nonlocal lag
        while running:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lag = max(lag, time.perf_counter() - t0 - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    lag = 0.0
    t0 = time.perf_counter()
    await work
    took = time.perf_counter() - t0
    running = False
    await tick
    return took, lag


def bench_loop_stall(folder: Path | None, sizes: list[int], rounds: int) -> None:
    """The event loop's longest stall while fresh prompts of ``sizes`` tokens are encoded (see the docstring)."""
    from kvroute.router.tokens import LocalTokenizer

    from tests.router.test_tokens import build_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = folder or build_model_folder(Path(tmp) / "model")
        probe = LocalTokenizer(folder)
        per_word = len(probe.tokenizer.encode(_text(random.Random(9), 2000), add_special_tokens=False).ids) / 2000
        print(f"\n## Event-loop stall while a new prompt is encoded ({folder.name}, {per_word:.2f} tokens a word)")
        print("median of", rounds, "prompts each; ms")
        print("| prompt | tokens | encode, on the loop | longest stall | encode, off the loop | longest stall |")
        print("|---|---|---|---|---|---|")
        for shape in ("completion", "chat, 16 messages"):
            for size in sizes:
                cells: list[str] = []
                for off_loop in (False, True):
                    tok = LocalTokenizer(folder)
                    if not off_loop:
                        tok.OFFLOOP_CHARS = 1 << 62
                    took, lags = [], []
                    for r in range(rounds):
                        rng = random.Random(size * 100 + r)
                        if shape == "completion":
                            work = tok.prompt_tokens(_text(rng, int(size / per_word)))
                        else:
                            turn = int(size / per_word / 16)
                            roles = ("user", "assistant")
                            messages = [{"role": roles[k % 2], "content": _text(rng, turn)} for k in range(16)]
                            work = tok.chat_tokens(messages)
                        t, lag = asyncio.run(_longest_lag(work))
                        took.append(t)
                        lags.append(lag)
                    cells += [f"{statistics.median(took) * 1e3:.1f}", f"{statistics.median(lags) * 1e3:.1f}"]
                print(f"| {shape} | {size} | {' | '.join(cells)} |")


def bench_tokenizer(turns: int) -> None:
    from kvroute.router.tokens import LocalTokenizer

    from tests.router.test_tokens import build_model_folder  # the same locally built BPE as the tests

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model_folder(Path(tmp) / "model")
        cached = LocalTokenizer(folder)
        plain = LocalTokenizer(folder, cache_bytes=0)
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


WORDS = [
    "The",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog.",
    "KV",
    "cache",
    "aware",
    "routing",
    "for",
    "vLLM",
    "workers",
    "def",
    "tokenize(text):",
    "return",
    "12345",
    "!@#$%",
    "Quelle",
    "heure",
    "est-il",
    "?",
    "\n",
    "\n\n",
    "  ",
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _decision_setup(
    n_workers: int, sessions: list[list[int]], block: int
) -> tuple[KVIndexer, list[WorkerView], Policy]:
    """An in-memory index where each session's previous prompt is held by one worker (GPU) and part of it
    by another, like a fleet that served the previous turns."""
    indexer = KVIndexer(MemoryIndex())
    workers = [WorkerView(id=f"w{i}", inflight=i % 3, kv_usage=0.3) for i in range(n_workers)]
    for w in workers:
        indexer.register_worker(w.id, "m")
    rng = random.Random(5)
    seq = {w.id: 0 for w in workers}
    for s, tokens in enumerate(sessions):
        for wid, depth in ((f"w{s % n_workers}", len(tokens) // block), (f"w{(s + 1) % n_workers}", None)):
            blocks = depth if depth is not None else rng.randrange(1, len(tokens) // block)
            hashes = [rng.getrandbits(63) for _ in range(blocks)]
            event = BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=tokens[: blocks * block], block_size=block
            )
            seq[wid] += 1
            await indexer.handle_message(wid, [b"", encode_seq(seq[wid]), encode_batch(time.time(), [event])])
    return indexer, workers, create_policy("kvaware")


class _Case:
    """One incremental path: sessions whose prompt (or conversation) grows by ~``grow_words`` each turn."""

    def __init__(
        self, path: str, source: Any, rng: random.Random, sessions: int, start_words: int, pairs: bool = False
    ) -> None:
        self.path = path
        self.source = source
        self.chat = path.startswith("chat")
        #: A chat grows as an agent's does: an answer and the next user message per turn (else one message).
        self.pairs = pairs
        self.rng = rng
        self.texts = [_text(rng, start_words) for _ in range(sessions)]
        self.chats: list[list[dict[str, str]]] = [[{"role": "system", "content": t}] for t in self.texts]

    def snapshot(self) -> tuple[list[str], list[list[dict[str, str]]], object]:
        return [*self.texts], [[*c] for c in self.chats], self.rng.getstate()

    def restore(self, state: tuple[list[str], list[list[dict[str, str]]], object]) -> None:
        self.texts, self.chats = [*state[0]], [[*c] for c in state[1]]
        self.rng.setstate(state[2])  # type: ignore[arg-type]

    async def tokens(self, s: int) -> list[int]:
        if self.chat:
            return list(await self.source.chat_tokens(self.chats[s]))
        return list(await self.source.prompt_tokens(self.texts[s]))

    def grow(self, s: int, words: int) -> None:
        if self.chat and self.pairs:
            self.chats[s].append({"role": "assistant", "content": _text(self.rng, words // 2)})
            self.chats[s].append({"role": "user", "content": _text(self.rng, words - words // 2)})
        elif self.chat:
            role = "assistant" if self.chats[s][-1]["role"] == "user" else "user"
            self.chats[s].append({"role": role, "content": _text(self.rng, words)})
        else:
            self.texts[s] += " " + _text(self.rng, words)


async def _run_case(
    case: _Case, rounds: int, n_workers: int, grow_words: int, prof: cProfile.Profile | None
) -> list[tuple[float, float, float]]:
    block = 16
    sessions = len(case.texts)
    firsts = [await case.tokens(s) for s in range(sessions)]  # untimed: the sessions' first turns
    indexer, workers, policy = await _decision_setup(n_workers, firsts, block)
    for s in range(sessions):
        await indexer.lookup_tokens("m", firsts[s])
    samples = []
    for r in range(rounds):
        for s in range(sessions):
            case.grow(s, grow_words)
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            tokens = await case.source.chat_tokens(case.chats[s]) if case.chat else None
            if tokens is None:
                tokens = await case.source.prompt_tokens(case.texts[s])
            t1 = time.perf_counter()
            result = await indexer.lookup_tokens("m", tokens)
            t2 = time.perf_counter()
            req = RouteRequest(
                request_id=f"{r}-{s}",
                model="m",
                prompt_tokens=len(tokens),
                block_size=result.block_size,
                matches=result.matches,
            )
            policy.choose(req, workers)
            t3 = time.perf_counter()
            if prof:
                prof.disable()
            samples.append((t1 - t0, t2 - t1, t3 - t2))
    return samples


def bench_incremental(prompt_tokens: int, iters: int, n_workers: int, profile: bool) -> None:
    """The whole decision when each prompt extends its session's previous one by ~200 tokens."""
    from kvroute.router.tokens import LocalTokenizer, PluginTokenizer

    from tests.router.test_tokens import build_model_folder

    sessions = 8
    rounds = max(2, iters // sessions)
    grow_words = 100  # ~200 tokens of the local BPE, 100 of the built-in tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model_folder(Path(tmp) / "model")
        local = LocalTokenizer(folder)
        sim = PluginTokenizer("python:kvroute.sim.tokenizer:BuiltinTokenizer")
        probe = _text(random.Random(9), 2000)
        per_word = len(local.tokenizer.encode(probe, add_special_tokens=False).ids) / 2000
        print(f"\n## Incremental {prompt_tokens // 1024}k: tokens -> keys -> lookup -> plan ({n_workers} workers)")
        print(
            f"{sessions} sessions, each prompt ~{prompt_tokens} tokens (median) extending the session's previous"
            f" prompt by {grow_words} words (~{grow_words * per_word:.0f} BPE tokens);"
            f" {rounds * sessions} decisions per path"
        )
        print("| path | tokens p50 µs | keys+lookup p50 µs | plan p50 µs | decision p50 µs | decision p99 µs |")
        print("|---|---|---|---|---|---|")
        profiles: list[tuple[str, str]] = []
        for n, (path, source, tokens_per_word, pairs) in enumerate(
            (
                ("completion (local BPE)", local, per_word, False),
                ("chat (local BPE, ChatML)", local, per_word, False),
                ("completion (sim built-in)", sim, 1.0, False),
                ("chat (sim built-in, agent turns)", sim, 1.0, True),
            )
        ):
            # Start so that the median prompt is prompt_tokens long; at least a few blocks' worth, so a small
            # --prompt-tokens with many --iters starts small and its median is larger (said in the table).
            wanted = int((prompt_tokens - rounds * grow_words * tokens_per_word / 2) / tokens_per_word)
            start_words = max(64, wanted)
            if start_words > wanted:
                median = (start_words + rounds * grow_words / 2) * tokens_per_word
                path = f"{path}, median ~{median:.0f} tokens"
            case = _Case(path, source, random.Random(100 + n), sessions, start_words, pairs)
            state = case.snapshot()
            samples = asyncio.run(_run_case(case, rounds, n_workers, grow_words, None))
            if profile:  # a second, profiled pass over the same growth (profiling distorts the timings)
                case.restore(state)
                prof = cProfile.Profile()
                asyncio.run(_run_case(case, rounds, n_workers, grow_words, prof))
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
                profiles.append((path, out.getvalue()))
            tok = statistics.median(x[0] for x in samples) * 1e6
            look = statistics.median(x[1] for x in samples) * 1e6
            plan = statistics.median(x[2] for x in samples) * 1e6
            total = [sum(x) * 1e6 for x in samples]
            print(
                f"| {path} | {tok:.0f} | {look:.0f} | {plan:.0f} | {statistics.median(total):.0f} |"
                f" {percentile(total, 0.99):.0f} |"
            )
        for src in (local, sim):
            stats = getattr(src, "stats", None)
            if callable(stats):
                print(f"{type(src).__name__} cache: {stats()}")
        for path, text in profiles:
            print(f"\n### cProfile, {path} (by tottime)\n```")
            lines = [ln for ln in text.splitlines() if ln.strip()]
            start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
            print("\n".join(lines[start : start + 15]))
            print("```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--incremental-only", action="store_true", help="only the incremental decision case")
    parser.add_argument("--profile", action="store_true", help="cProfile the incremental decision")
    parser.add_argument("--loop-stall", action="store_true", help="only the event-loop stall of new long prompts")
    parser.add_argument("--model-folder", type=Path, help="a real tokenizer folder for --loop-stall")
    parser.add_argument("--stall-sizes", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument(
        "--heap-trim-mb",
        type=int,
        default=128,
        help="glibc thresholds as `kvroute serve` sets them (heap_trim_threshold_mb; 0: glibc's defaults)",
    )
    args = parser.parse_args()
    tune_allocator(args.heap_trim_mb)
    if args.loop_stall:
        bench_loop_stall(args.model_folder, args.stall_sizes, rounds=5)
        return
    bench_incremental(args.prompt_tokens, args.iters, args.workers[0], args.profile)
    if args.incremental_only:
        return
    for n in args.workers:
        bench_policies(n, args.prompt_tokens, args.iters)
    bench_tokenizer(args.turns)


if __name__ == "__main__":
    main()
