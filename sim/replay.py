"""Replay a trace against a base URL (the router or one worker) and measure each request.

Sessions run concurrently, each step after the previous answer plus the step's delay, so histories
contain the answers really received. Every request streams (``stream_options.include_usage``) so TTFT
is the first content chunk; end-to-end latency and ``cached_tokens`` come from the same response.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# httpx's async backend (anyio's asyncio module) loads on a client's first request: 15 ms that the first
# request of a replay would carry as latency. Loaded with this module instead.
import anyio._backends._asyncio  # noqa: F401
import httpx
import orjson
from kvroute.sim.hop_log import prompt_key
from kvroute.sim.traces import Session, Trace

#: Where to send a request: one base URL, or a function of (session, turn) -> base URL (client-side routing).
Target = str | Callable[[Session, int], str]


@dataclass(slots=True)
class RequestResult:
    session: str
    turn: int
    kind: str
    #: Real seconds from the replay start to sending the request.
    sent_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    status: int = 0
    error: str | None = None
    #: :func:`~kvroute.sim.hop_log.prompt_key` of the request, and ``time.monotonic()`` when it was sent and
    #: when its first content arrived: the client's side of ``bench/hops.py``.
    prompt_key: int = 0
    sent_at: float = 0.0
    first_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


@dataclass(slots=True)
class ReplayReport:
    trace: str
    base_url: str
    duration_s: float
    results: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
        prompt = sum(r.prompt_tokens for r in ok)
        return {
            "trace": self.trace,
            "requests": len(self.results),
            "errors": len(self.results) - len(ok),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "e2e_p50_s": percentile(e2e, 50),
            "e2e_p99_s": percentile(e2e, 99),
            "cached_token_ratio": (sum(r.cached_tokens for r in ok) / prompt) if prompt else 0.0,
            "prompt_tokens": prompt,
            "completion_tokens": sum(r.completion_tokens for r in ok),
            "throughput_rps": len(ok) / self.duration_s if self.duration_s > 0 else 0.0,
            "duration_s": self.duration_s,
        }

    def to_rows(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.results]


async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], result: RequestResult
) -> str:
    """Send one streaming chat request; fill ``result``; return the answer text."""
    result.prompt_key = prompt_key(body)
    result.sent_at = time.monotonic()
    t0 = time.perf_counter()
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, content=orjson.dumps(body), headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                raw = await response.aread()
                result.error = raw[:300].decode(errors="replace")
                return ""
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = orjson.loads(data)
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if text:
                        if result.ttft_s is None:
                            result.ttft_s = time.perf_counter() - t0
                            result.first_at = time.monotonic()
                        pieces.append(text)
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return ""
    result.e2e_s = time.perf_counter() - t0
    return "".join(pieces)


def _chat_url(target: Target, session: Session, turn: int) -> str:
    base = target(session, turn) if callable(target) else target
    return base.rstrip("/") + "/v1/chat/completions"


async def _session(
    client: httpx.AsyncClient,
    target: Target,
    model: str | None,
    session: Session,
    start: float,
    time_scale: float,
    report: ReplayReport,
    on_result: Callable[[RequestResult], None] | None,
    conversation_field: str | None,
) -> None:
    await asyncio.sleep(max(0.0, start + session.start_s * time_scale - time.perf_counter()))
    messages: list[dict[str, str]] = [{"role": "system", "content": session.system}] if session.system else []
    for turn, step in enumerate(session.steps):
        if step.delay_s:
            await asyncio.sleep(step.delay_s * time_scale)
        messages.append({"role": step.role, "content": step.content})
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": step.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        if conversation_field:
            body[conversation_field] = session.id
        result = RequestResult(session.id, turn, session.kind, time.perf_counter() - start)
        headers = {"content-type": "application/json", "x-conversation-id": session.id}
        answer = await _one(client, _chat_url(target, session, turn), body, headers, result)
        report.results.append(result)
        if on_result is not None:
            on_result(result)
        if not result.ok:
            return  # an agent whose call failed stops, as a real one would
        messages.append({"role": "assistant", "content": answer})


async def replay(
    trace: Trace,
    base_url: Target,
    *,
    model: str | None = None,
    time_scale: float = 1.0,
    timeout_s: float = 600.0,
    on_result: Callable[[RequestResult], None] | None = None,
    conversation_field: str | None = None,
    max_connections: int = 512,
) -> ReplayReport:
    """Replay ``trace`` against ``base_url`` (``/v1/chat/completions``); arrival times x ``time_scale``.

    ``base_url`` may be a function of (session, turn) for client-side routing baselines."""
    report = ReplayReport(trace.name, base_url if isinstance(base_url, str) else "client-side", 0.0)
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    # What the caller holds (traces, earlier runs' results) leaves the collector's reach for the replay: a
    # full collection of it mid-replay (34 ms in bench/peers.py's process) is a pause of this client that
    # some request's time to first token would carry, whatever router is measured.
    gc.collect()
    gc.freeze()
    try:
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    _session(client, base_url, model, s, start, time_scale, report, on_result, conversation_field)
                    for s in trace.sessions
                )
            )
            report.duration_s = time.perf_counter() - start
    finally:
        gc.unfreeze()
    return report
