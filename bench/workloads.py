"""Benchmark workloads for the peer comparison, written apart from ``sim/traces.py``'s generators.

A router tuned on the traces its own authors wrote proves little, so ``bench/peers.py`` replays shapes
that come from elsewhere: the public Mooncake FAST'25 synthetic trace (real arrival times and prefix
structure), llm-d's shared-prefix benchmark shape (inference-perf ``shared_prefix``: 150 groups x 5
prompts, a 6,000-token system prompt and a 1,200-token question, 1,000 output tokens, Poisson
arrivals), an agentic multi-turn shape (sessions that grow by tool outputs, a few system prompts shared
by many sessions) and a short multi-turn chat shape. Each yields a ``kvroute.sim.traces.Trace`` so the
existing replayer (``kvroute.sim.replay``) sends it; only the text and the structure are new here.

Sizes are in tokens of the simulator's built-in tokenizer (one whitespace-delimited word = one token).
``scale`` multiplies every token count (prompt and output) so a run fits a 2-core machine: the simulated
fleet counts tokens as work, and the router and the workers tokenize every word. Times are model
seconds (the replayer multiplies them by the fleet's time scale).
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from kvroute.sim.tokenizer import tokenize
from kvroute.sim.traces import Session, Step, Trace

ROOT = Path(__file__).resolve().parents[1]
#: The public trace (kvcache-ai/Mooncake FAST25-release/traces/synthetic_trace.jsonl, Apache-2.0).
MOONCAKE_PATH = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
#: Tokens per ``hash_ids`` entry in the Mooncake release.
MOONCAKE_BLOCK = 512

_ONSETS = ("b", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "ch", "sh", "th")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ou", "ea")


@functools.cache
def vocabulary(size: int = 8192) -> tuple[str, ...]:
    """A fixed word list (seeded by name, so every process and run draws the same words)."""
    rng = random.Random("kvroute-bench-workloads-vocabulary")
    words = set()
    while len(words) < size:
        words.add("".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(rng.randint(1, 3))))
    return tuple(sorted(words))


def words(key: str, n: int) -> str:
    """``n`` words determined by ``key`` alone: equal keys give equal text, in any process."""
    rng = random.Random(key)
    return " ".join(rng.choices(vocabulary(), k=max(n, 0)))


def scaled(tokens: float, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(tokens * scale))


def with_rate(trace: Trace, factor: float) -> Trace:
    """The same trace with session arrivals ``factor`` times as frequent (intra-session pauses kept)."""
    if factor == 1.0:
        return trace
    sessions = tuple(replace(s, start_s=s.start_s / factor) for s in trace.sessions)
    return replace(trace, sessions=sessions)


# -- (a) Mooncake FAST'25 synthetic trace -------------------------------------------------------------------


class MooncakeRow(NamedTuple):
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@functools.cache
def mooncake_rows(path: str | Path = MOONCAKE_PATH) -> tuple[MooncakeRow, ...]:
    """The trace's requests in file order (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                ids = tuple(int(x) for x in r["hash_ids"])
                rows.append(MooncakeRow(float(r["timestamp"]), int(r["input_length"]), int(r["output_length"]), ids))
    return tuple(rows)


@functools.cache
def _block_text(block_id: int, n_words: int) -> str:
    return words(f"mooncake-block-{block_id}", n_words)


MOONCAKE_SYSTEM = ""


def mooncake_prompt(hash_ids: Sequence[int], input_length: int, scale: float = 1.0) -> str:
    """The user text of one Mooncake request: each 512-token block id becomes ``512 x scale`` words
    fixed by the id, cut to ``input_length x scale`` words (the last block may be partial)."""
    per_block = scaled(MOONCAKE_BLOCK, scale)
    n = min(scaled(input_length, scale), per_block * len(hash_ids))
    text: list[str] = []
    left = n
    for block_id in hash_ids:
        if left <= 0:
            break
        block = _block_text(int(block_id), per_block).split(" ")
        text.extend(block[:left])
        left -= len(block)
    return " ".join(text)


def mooncake_trace(
    seed: int = 0,
    *,
    requests: int = 200,
    speedup: float = 1.0,
    scale: float = 1.0,
    sample: str = "families",
    max_prompt_tokens: int = 120_000,
    path: str | Path = MOONCAKE_PATH,
    name: str = "mooncake",
) -> Trace:
    """About ``requests`` requests of the Mooncake synthetic trace, one single-turn session each.

    ``sample="families"`` (default) draws whole prefix families at random (seeded): the requests that
    share their first block, hence every block they share, since ids are prefix-chained. Requests of a
    family are spread over the whole 17-minute trace, so a window of a few hundred consecutive requests
    shares almost nothing (2-6 % of blocks) while families keep the trace's reuse. Their arrival times
    are kept and compressed by the sampling ratio, so the request rate stays the trace's (3.9 req/s),
    then divided by ``speedup``. ``sample="window"`` takes the seed-th run of consecutive requests with
    their times as they are (over ``speedup``). Prompts are cut to ``max_prompt_tokens`` after scaling
    (a cut keeps the prefix structure)."""
    rows = mooncake_rows(path)
    n = len(rows) if requests <= 0 else min(requests, len(rows))
    if sample == "window":
        start = (seed % max(1, len(rows) // n)) * n
        chosen = list(rows[start : start + n])
        compress = 1.0
    elif sample == "families":
        families: dict[int, list[MooncakeRow]] = {}
        for row in rows:
            families.setdefault(row.hash_ids[0] if row.hash_ids else -1, []).append(row)
        order = list(families)
        random.Random(f"mooncake-{seed}").shuffle(order)
        chosen = []
        for key in order:
            if len(chosen) >= n:
                break
            chosen.extend(families[key])
        chosen.sort(key=lambda r: r.timestamp_ms)
        compress = len(rows) / len(chosen)
    else:
        raise ValueError(f"sample must be 'families' or 'window', not {sample!r}")
    t0 = chosen[0].timestamp_ms
    cap = math.floor(max_prompt_tokens / scale)
    sessions = []
    for i, row in enumerate(chosen):
        content = mooncake_prompt(row.hash_ids, min(row.input_length, cap), scale)
        step = Step(content, scaled(row.output_length, scale), 0.0)
        at = (row.timestamp_ms - t0) / 1000.0 / compress / speedup
        sessions.append(Session(f"{name}-{seed}-{i}", "chat", at, MOONCAKE_SYSTEM, (step,)))
    return Trace(name, seed, tuple(sessions))


# -- (b) llm-d's shared-prefix benchmark shape -----------------------------------------------------------------


def shared_prefix_trace(
    seed: int = 0,
    *,
    requests: int = 200,
    groups: int = 150,
    prompts_per_group: int = 5,
    system_tokens: int = 6000,
    question_tokens: int = 1200,
    output_tokens: int = 1000,
    rate: float = 10.0,
    scale: float = 1.0,
    name: str = "shared_prefix",
) -> Trace:
    """inference-perf's ``shared_prefix`` data as llm-d benchmarks it: ``groups`` system prompts, each
    with ``prompts_per_group`` questions; requests cycle through the shuffled prompts at Poisson
    arrivals of ``rate`` per second. Two requests share exactly their group's system prompt."""
    rng = random.Random(f"shared-prefix-{seed}")
    system_n, question_n = scaled(system_tokens, scale), scaled(question_tokens, scale)
    systems = [words(f"shared-prefix-{seed}-system-{g}", system_n) for g in range(groups)]
    prompts = [(g, q) for g in range(groups) for q in range(prompts_per_group)]
    rng.shuffle(prompts)
    answer = scaled(output_tokens, scale)
    sessions = []
    t = 0.0
    for i in range(requests):
        g, q = prompts[i % len(prompts)]
        question = words(f"shared-prefix-{seed}-question-{g}-{q}", question_n)
        sessions.append(Session(f"{name}-{seed}-{i}", "chat", t, systems[g], (Step(question, answer, 0.0),)))
        t += rng.expovariate(rate)
    return Trace(name, seed, tuple(sessions))


# -- (c) agentic multi-turn ------------------------------------------------------------------------------------------


def _lognormal(rng: random.Random, mean: float, lo: int, hi: int) -> int:
    """A heavy-tailed size around ``mean`` (sigma 0.8), clipped to [lo, hi]."""
    sigma = 0.8
    return min(hi, max(lo, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))


def agentic_trace(
    seed: int = 0,
    *,
    sessions: int = 24,
    agents: int = 3,
    system_tokens: int = 4000,
    turns: tuple[int, int] = (4, 12),
    task_tokens: int = 400,
    tool_tokens: int = 1500,
    answer_tokens: int = 200,
    tool_time_s: tuple[float, float] = (0.5, 3.0),
    rate: float = 1.0,
    scale: float = 1.0,
    name: str = "agentic",
) -> Trace:
    """Agent sessions: one of ``agents`` system prompts (tool definitions, shared by many sessions), a
    task, then turns that each append a tool output (lognormal, heavy-tailed) to the history; the
    agent waits for its tool between turns. Histories reach tens of thousands of tokens at scale 1."""
    rng = random.Random(f"agentic-{seed}")
    prompts = [
        f"agent {a} tools: " + words(f"agentic-{seed}-system-{a}", scaled(system_tokens, scale)) for a in range(agents)
    ]
    out = []
    t = 0.0
    for i in range(sessions):
        t += rng.expovariate(rate)
        agent = rng.randrange(agents)
        n_turns = rng.randint(*turns)
        steps = [
            Step(
                "task: " + words(f"agentic-{seed}-{i}-task", _size(rng, task_tokens, scale)),
                _ans(rng, answer_tokens, scale),
                0.0,
            )
        ]
        for k in range(1, n_turns):
            content = "tool result: " + words(f"agentic-{seed}-{i}-tool-{k}", _size(rng, tool_tokens, scale))
            steps.append(Step(content, _ans(rng, answer_tokens, scale), rng.uniform(*tool_time_s), role="user"))
        out.append(Session(f"{name}-{seed}-{i}", "agentic", t, prompts[agent], tuple(steps)))
    return Trace(name, seed, tuple(out))


def _size(rng: random.Random, mean: int, scale: float) -> int:
    return scaled(_lognormal(rng, mean, max(1, mean // 10), mean * 6), scale)


def _ans(rng: random.Random, mean: int, scale: float) -> int:
    return scaled(_lognormal(rng, mean, max(1, mean // 5), mean * 3), scale)


# -- (d) chat ---------------------------------------------------------------------------------------------------------


def chat_trace(
    seed: int = 0,
    *,
    sessions: int = 60,
    apps: int = 8,
    system_tokens: int = 300,
    turns: tuple[int, int] = (1, 4),
    user_tokens: int = 150,
    answer_tokens: int = 250,
    think_time_s: tuple[float, float] = (3.0, 15.0),
    rate: float = 4.0,
    scale: float = 1.0,
    name: str = "chat",
) -> Trace:
    """Short conversations (1-4 turns, ShareGPT-like lengths) behind one of ``apps`` system prompts;
    users pause between turns. Little sharing beyond the app prompt and each conversation's history."""
    rng = random.Random(f"chat-{seed}")
    prompts = [words(f"chat-{seed}-app-{a}", scaled(system_tokens, scale)) for a in range(apps)]
    out = []
    t = 0.0
    for i in range(sessions):
        t += rng.expovariate(rate)
        steps = tuple(
            Step(
                words(f"chat-{seed}-{i}-user-{k}", _size(rng, user_tokens, scale)),
                _ans(rng, answer_tokens, scale),
                0.0 if k == 0 else rng.uniform(*think_time_s),
            )
            for k in range(rng.randint(*turns))
        )
        out.append(Session(f"{name}-{seed}-{i}", "chat", t, prompts[rng.randrange(apps)], steps))
    return Trace(name, seed, tuple(out))


# -- sizing ------------------------------------------------------------------------------------------------------


def _chain(tokens: Sequence[int], block: int) -> Iterable[int]:
    parent = 0
    for i in range(0, len(tokens) - block + 1, block):
        parent = hash((parent, tuple(tokens[i : i + block])))
        yield parent


def working_set(trace: Trace, block: int = 16) -> tuple[int, int]:
    """(distinct KV blocks the whole trace computes, blocks of its largest request), answers counted
    as distinct text of their ``max_tokens``: what sizes the caches of the cache-pressure regimes."""
    seen: set[int] = set()
    largest = 0
    for s in trace.sessions:
        tokens = tokenize(s.system)
        for k, step in enumerate(s.steps):
            tokens = tokens + tokenize(step.content)
            largest = max(largest, math.ceil((len(tokens) + step.max_tokens) / block))
            tokens = tokens + [-(hash((s.id, k, j)) & 0xFFFFFFF) - 1 for j in range(step.max_tokens)]
        seen.update(_chain(tokens, block))
    return len(seen), largest


def request_sizes(trace: Trace) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) of every request, histories included, answers at ``max_tokens``."""
    sizes = []
    for s in trace.sessions:
        history = len(tokenize(s.system))
        for step in s.steps:
            history += len(tokenize(step.content))
            sizes.append((history, step.max_tokens))
            history += step.max_tokens
    return sizes


def prompt_tokens(trace: Trace) -> int:
    """Prompt tokens the trace sends in all."""
    return sum(p for p, _ in request_sizes(trace))
