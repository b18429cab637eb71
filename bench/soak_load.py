"""The soak's load: open-loop arrivals over multi-turn conversations on four API surfaces.

Arrivals are a seeded Poisson process at a fixed rate, sent whether or not earlier requests have been
answered, so a router that slows down shows as latency (and requests in flight), never as fewer
requests. Each arrival continues an idle conversation (one whose last answer is in) or starts a new
one: a conversation picks one surface for its life (chat or completions, streaming or not), grows by a
user message and the answer it really received every turn, and ends after its planned turns (or is
abandoned when too many sit idle). New prefixes therefore keep arriving, behind a few shared system
prompts, and old ones stop being extended: the router's index churns and reaches its bound.

Words come from a fixed vocabulary, as a real tokenizer's would, so only the prompts are new, not
the pieces a tokenizer caches.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

#: (api, stream) of each surface and its share of new conversations.
SURFACES: tuple[tuple[str, bool, float], ...] = (
    ("chat", True, 0.45),
    ("chat", False, 0.25),
    ("completions", True, 0.15),
    ("completions", False, 0.15),
)


#: Seconds an idle client connection is kept for reuse: below the router's idle keep-alive timeout.
IDLE_KEEPALIVE_S = 3.0


@dataclass(frozen=True, slots=True)
class Mix:
    """Sizes of the conversations, in words (one word is one token with the simulator's tokenizer)."""

    system_prompts: int = 8
    system_words: int = 300
    user_words: tuple[int, int] = (20, 160)
    answer_tokens: tuple[int, int] = (8, 40)
    turns: tuple[int, int] = (1, 8)
    #: Idle conversations kept waiting for a next turn; beyond, the oldest is abandoned.
    max_idle: int = 400
    vocabulary: int = 8192


@dataclass(slots=True)
class Conversation:
    id: str
    api: str
    stream: bool
    turns_left: int
    #: Chat messages so far (the completions surface sends them joined as one prompt).
    messages: list[dict[str, str]]
    turn: int = 0

    @property
    def surface(self) -> str:
        return f"{self.api}{'-stream' if self.stream else ''}"


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it; times are seconds of ``time.monotonic()``."""

    surface: str
    sent: float
    done: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    status: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Workload:
    """Seeded source of requests: which conversation the next arrival belongs to, and its body."""

    def __init__(self, seed: int, mix: Mix = Mix()) -> None:
        self.mix = mix
        self.rng = random.Random(seed)
        self.vocab = [f"{self._syllables()}{i % 89}" for i in range(mix.vocabulary)]
        self.systems = [self.text(mix.system_words) for _ in range(mix.system_prompts)]
        self.idle: OrderedDict[str, Conversation] = OrderedDict()
        self.started = self.ended = self.abandoned = 0
        self._next_id = 0
        self._seed = seed

    def _syllables(self) -> str:
        return "".join(self.rng.choices(("ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "gre", "tor"), k=3))

    def text(self, words: int) -> str:
        return " ".join(self.rng.choices(self.vocab, k=max(1, words)))

    def _new(self) -> Conversation:
        mix, rng = self.mix, self.rng
        api, stream, _ = rng.choices(SURFACES, weights=[w for *_, w in SURFACES])[0]
        self._next_id += 1
        self.started += 1
        system = rng.choice(self.systems)
        return Conversation(
            f"soak-{self._seed}-{self._next_id}",
            api,
            stream,
            rng.randint(*mix.turns),
            [{"role": "system", "content": system}],
        )

    def next(self) -> Conversation:
        """The conversation of the next arrival, its new user message appended and taken off the idle set.

        A new conversation starts with probability 1 / mean turns (so starts balance ends) or when none
        is idle; otherwise a random idle one continues."""
        lo, hi = self.mix.turns
        if self.idle and self.rng.random() >= 2.0 / (lo + hi):
            key = self.rng.choice(list(self.idle))
            conv = self.idle.pop(key)
        else:
            conv = self._new()
        conv.messages.append({"role": "user", "content": self.text(self.rng.randint(*self.mix.user_words))})
        return conv

    def body(self, conv: Conversation, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.rng.randint(*self.mix.answer_tokens)}
        if conv.api == "chat":
            body["messages"] = conv.messages
        else:
            body["prompt"] = "\n".join(m["content"] for m in conv.messages)
        if conv.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def finish(self, conv: Conversation, answer: str | None) -> None:
        """Back to the idle set with its answer, or ended (last turn, or the request failed)."""
        conv.turn += 1
        conv.turns_left -= 1
        if answer is None or conv.turns_left <= 0:
            self.ended += 1
            return
        conv.messages.append({"role": "assistant", "content": answer})
        self.idle[conv.id] = conv
        while len(self.idle) > self.mix.max_idle:
            self.idle.popitem(last=False)
            self.abandoned += 1


def _answer_text(api: str, choice: dict[str, Any], stream: bool) -> str:
    if api == "chat":
        part = choice.get("delta" if stream else "message") or {}
        return str(part.get("content") or "")
    return str(choice.get("text") or "")


async def send(
    session: aiohttp.ClientSession, url: str, conv: Conversation, body: dict[str, Any], timeout_s: float
) -> tuple[Outcome, str | None]:
    """Send one request; the outcome and the answer text (None when it failed).

    A request fails on any status but 200, a transport error, a body that is not the surface's JSON, an
    empty answer, a stream without usage or without its closing ``[DONE]``."""
    out = Outcome(conv.surface, time.monotonic())
    pieces: list[str] = []
    headers = {"content-type": "application/json", "x-conversation-id": conv.id}
    try:
        async with session.post(
            f"{url}/v1/{'chat/completions' if conv.api == 'chat' else 'completions'}",
            data=orjson.dumps(body),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:200].decode(errors='replace')}"
            elif conv.stream:
                out.error = await _read_stream(resp, conv.api, pieces, out)
            else:
                data = orjson.loads(await resp.read())
                out.ttft_s = time.monotonic() - out.sent
                pieces.append(_answer_text(conv.api, (data.get("choices") or [{}])[0], False))
                if not data.get("usage"):
                    out.error = "no usage in the answer"
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, AttributeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    out.done = time.monotonic()
    answer = "".join(pieces)
    if out.error is None and not answer.strip():
        out.error = "empty answer"
    if out.error is not None:
        return out, None
    out.e2e_s = out.done - out.sent
    return out, answer


async def _read_stream(resp: aiohttp.ClientResponse, api: str, pieces: list[str], out: Outcome) -> str | None:
    """Read an SSE stream into ``pieces``; TTFT at the first content. Returns an error or None."""
    usage = done = False
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                continue
            event = orjson.loads(data)
            if "error" in event:
                return f"stream error: {str(event['error'])[:160]}"
            for choice in event.get("choices") or []:
                text = _answer_text(api, choice, True)
                if text:
                    if out.ttft_s is None:
                        out.ttft_s = time.monotonic() - out.sent
                    pieces.append(text)
            usage = usage or bool(event.get("usage"))
    if not done:
        return "stream ended without [DONE]"
    return None if usage else "stream without usage"


@dataclass(slots=True)
class Load:
    """Open-loop arrivals at ``rate`` per second for ``duration_s``; every outcome goes to ``on_outcome``."""

    url: str
    model: str
    rate: float
    duration_s: float
    workload: Workload
    on_outcome: Callable[[Outcome], None]
    timeout_s: float = 60.0
    in_flight: set[asyncio.Task[None]] = field(default_factory=set)
    sent: int = 0
    #: Most requests in flight at once since the sampler last reset it.
    peak_in_flight: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Send until the duration is over (or ``stop`` is set), then wait for the requests in flight."""
        # Idle connections are dropped before the router's own idle close (uvicorn: 5 s): a request written
        # on a connection the server is closing is reset, an artefact of the client's pool (aiohttp keeps
        # them 15 s by default), not of the router.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_KEEPALIVE_S)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            start = time.monotonic()
            due = start
            rng = self.workload.rng
            while not stop.is_set():
                due += rng.expovariate(self.rate)
                if due - start >= self.duration_s:
                    break
                delay = due - time.monotonic()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                        break
                    except TimeoutError:
                        pass
                task = asyncio.create_task(self._one(session))
                self.in_flight.add(task)
                self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
                task.add_done_callback(self.in_flight.discard)
            if self.in_flight:
                await asyncio.wait(set(self.in_flight), timeout=self.timeout_s + 5)

    async def _one(self, session: aiohttp.ClientSession) -> None:
        conv = self.workload.next()
        body = self.workload.body(conv, self.model)
        self.sent += 1
        outcome, answer = await send(session, self.url, conv, body, self.timeout_s)
        self.workload.finish(conv, answer)
        self.on_outcome(outcome)
