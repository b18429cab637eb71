"""Seeded workload traces: agentic sessions, plain chat, and a mix, with arrival times.

A trace describes *sessions*, not frozen requests: an agent's next step contains the answer it actually
received, so the replayer builds each step's messages from the live conversation (that is what makes
multi-turn prefix reuse real). Text is drawn from a synthetic vocabulary; with the built-in tokenizer
one word is one token, so sizes below are in tokens. Times are model seconds (the replayer scales them).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypedDict, Unpack

Kind = Literal["agentic", "chat"]

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "de", "pa", "zu", "gre", "bli", "tor", "fen", "qua")


def _vocabulary(rng: random.Random, size: int = 4096) -> list[str]:
    return ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) + str(i % 97) for i in range(size)]


@dataclass(frozen=True, slots=True)
class Step:
    """One request of a session: the new user/tool content, the answer length, the pause before it."""

    content: str
    max_tokens: int
    #: Model seconds between the previous answer and this request (tool run time, user think time).
    delay_s: float
    role: str = "user"


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    kind: Kind
    #: Arrival of the first request, model seconds from the trace start.
    start_s: float
    system: str
    steps: tuple[Step, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    seed: int
    sessions: tuple[Session, ...]

    @property
    def n_requests(self) -> int:
        return sum(len(s.steps) for s in self.sessions)

    @property
    def duration_hint_s(self) -> float:
        """Model seconds until the last session starts (a lower bound of the replay time)."""
        return max((s.start_s for s in self.sessions), default=0.0)


def _text(rng: random.Random, vocab: list[str], n: int) -> str:
    return " ".join(rng.choices(vocab, k=max(n, 1)))


def agentic_trace(
    seed: int = 0,
    *,
    sessions: int = 16,
    steps: tuple[int, int] = (8, 24),
    system_tokens: int = 1500,
    task_tokens: tuple[int, int] = (50, 300),
    tool_tokens: tuple[int, int] = (100, 1500),
    answer_tokens: tuple[int, int] = (20, 120),
    arrival_rate: float = 1.0,
    tool_time_s: tuple[float, float] = (0.2, 2.0),
    name: str = "agentic",
) -> Trace:
    """Agent sessions: one shared system prompt (tools, instructions), a task, then many steps where a
    tool's output is appended to a growing history (tens of thousands of tokens by the end)."""
    rng = random.Random(seed)
    vocab = _vocabulary(rng)
    system = "you are a coding agent with tools " + _text(rng, vocab, system_tokens)
    out = []
    t = 0.0
    for i in range(sessions):
        t += rng.expovariate(arrival_rate) if arrival_rate > 0 else 0.0
        n_steps = rng.randint(*steps)
        task = _text(rng, vocab, rng.randint(*task_tokens))
        first = Step("task: " + task, rng.randint(*answer_tokens), 0.0)
        rest = [
            Step(
                "tool output: " + _text(rng, vocab, rng.randint(*tool_tokens)),
                rng.randint(*answer_tokens),
                rng.uniform(*tool_time_s),
            )
            for _ in range(n_steps - 1)
        ]
        out.append(Session(f"{name}-{seed}-{i}", "agentic", t, system, (first, *rest)))
    return Trace(name, seed, tuple(out))


def chat_trace(
    seed: int = 0,
    *,
    sessions: int = 32,
    turns: tuple[int, int] = (1, 3),
    system_tokens: tuple[int, int] = (20, 200),
    user_tokens: tuple[int, int] = (50, 600),
    answer_tokens: tuple[int, int] = (50, 300),
    arrival_rate: float = 4.0,
    think_time_s: tuple[float, float] = (2.0, 10.0),
    name: str = "chat",
) -> Trace:
    """Plain chat: short conversations, each with its own system prompt (little sharing)."""
    rng = random.Random(seed + 1_000_003)
    vocab = _vocabulary(rng)
    out = []
    t = 0.0
    for i in range(sessions):
        t += rng.expovariate(arrival_rate) if arrival_rate > 0 else 0.0
        steps = tuple(
            Step(
                _text(rng, vocab, rng.randint(*user_tokens)),
                rng.randint(*answer_tokens),
                0.0 if k == 0 else rng.uniform(*think_time_s),
            )
            for k in range(rng.randint(*turns))
        )
        system = _text(rng, vocab, rng.randint(*system_tokens))
        out.append(Session(f"{name}-{seed}-{i}", "chat", t, system, steps))
    return Trace(name, seed, tuple(out))


class AgenticOptions(TypedDict, total=False):
    """:func:`agentic_trace`'s keyword options, so :func:`mixed_trace` can pass them on type-checked."""

    steps: tuple[int, int]
    system_tokens: int
    task_tokens: tuple[int, int]
    tool_tokens: tuple[int, int]
    answer_tokens: tuple[int, int]
    arrival_rate: float
    tool_time_s: tuple[float, float]
    name: str


def mixed_trace(
    seed: int = 0, *, agentic_sessions: int = 8, chat_sessions: int = 24, **agentic_kwargs: Unpack[AgenticOptions]
) -> Trace:
    """Agents and chat users sharing one pool, arrivals interleaved."""
    agents = agentic_trace(seed, sessions=agentic_sessions, **agentic_kwargs)
    chats = chat_trace(seed, sessions=chat_sessions)
    merged = sorted(agents.sessions + chats.sessions, key=lambda s: s.start_s)
    return Trace("mixed", seed, tuple(merged))


#: Generators by name; each takes the seed and its own keyword options.
TRACES: dict[str, Callable[..., Trace]] = {"agentic": agentic_trace, "chat": chat_trace, "mixed": mixed_trace}


def make_trace(kind: str, seed: int = 0, **kwargs: object) -> Trace:
    try:
        factory = TRACES[kind]
    except KeyError:
        raise ValueError(f"unknown trace kind {kind!r}; known: {', '.join(TRACES)}") from None
    return factory(seed, **kwargs)
