"""Load generators of the overhead benchmarks (``proxy_overhead.py``, ``peers_overhead.py``).

An aiohttp client in the benchmark process, so the same cheap client measures every target: closed-loop
small POSTs at a fixed concurrency (latency and throughput), and single streamed requests timed to the
first content chunk (TTFT) and to the end, with the answer's usage checked so a request that did not
really complete counts as an error instead of as a fast answer.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson
from kvroute.sim.replay import percentile

JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class Stats:
    """One closed-loop cell: latency percentiles over the answered requests, throughput, failures."""

    p50_ms: float
    p99_ms: float
    rps: float
    requests: int = 0
    errors: int = 0


def latency_stats(latencies_s: list[float], elapsed_s: float, errors: int = 0) -> Stats:
    """p50 (median) and p99 (nearest rank) in ms, requests/s over ``elapsed_s``."""
    if not latencies_s:
        return Stats(float("nan"), float("nan"), 0.0, 0, errors)
    return Stats(
        statistics.median(latencies_s) * 1e3,
        (percentile(latencies_s, 99) or 0.0) * 1e3,
        len(latencies_s) / elapsed_s if elapsed_s > 0 else 0.0,
        len(latencies_s) + errors,
        errors,
    )


async def closed_loop(
    url: str,
    body: bytes,
    requests: int,
    concurrency: int,
    warmup: int = 200,
    on_timed: Callable[[], None] | None = None,
) -> Stats:
    """``requests`` POSTs of ``body`` to ``url`` from ``concurrency`` clients, each sending its next request
    when its answer is in; ``warmup`` sequential requests first (connections, caches), then ``on_timed()``.
    A non-200 answer or a broken connection is an error, kept out of the latencies."""
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> float | None:
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            return time.perf_counter() - t0 if ok else None

        for _ in range(min(warmup, requests)):
            await one()
        if on_timed is not None:
            on_timed()
        remaining = requests

        async def client() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                took = await one()
                if took is None:
                    errors += 1
                else:
                    latencies.append(took)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return latency_stats(latencies, elapsed, errors)


@dataclass(slots=True)
class Streamed:
    """One streamed answer: seconds to the first content chunk and to ``[DONE]``, what usage said."""

    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """200, a first token, ``[DONE]`` and a usage chunk: the request really completed."""
        return self.error is None and self.status == 200 and self.ttft_s is not None and self.prompt_tokens > 0


async def stream_once(session: aiohttp.ClientSession, url: str, body: bytes) -> Streamed:
    """POST a streaming request (``stream_options.include_usage`` in ``body``) and time its answer."""
    out = Streamed()
    t0 = time.perf_counter()
    done = False
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = (await resp.read())[:300].decode(errors="replace")
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = orjson.loads(data)
                for choice in chunk.get("choices") or []:
                    if out.ttft_s is None and ((choice.get("delta") or {}).get("content") or choice.get("text")):
                        out.ttft_s = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens") or 0
                    out.completion_tokens = usage.get("completion_tokens") or 0
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
        return out
    out.e2e_s = time.perf_counter() - t0
    if not done:
        out.error = "stream ended without [DONE]"
    elif not out.prompt_tokens:
        out.error = "no usage chunk"
    return out
