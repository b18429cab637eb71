"""Synthetic worker views and requests for policy tests."""

from __future__ import annotations

from kvroute.indexer.backend import WorkerMatch
from kvroute.policies.base import RouteRequest, WorkerView


def workers(n: int, role: str = "both", prefix: str = "w", **kw: object) -> list[WorkerView]:
    return [
        WorkerView(id=f"{prefix}{i}", role=role, p2p_host=f"10.0.0.{i + 1}", p2p_port=5710, **kw)  # type: ignore[arg-type]
        for i in range(n)
    ]


def gpu(worker_id: str, blocks: int) -> WorkerMatch:
    return WorkerMatch(worker_id, blocks=blocks, gpu=blocks)


def request(prompt_tokens: int, *matches: WorkerMatch, request_id: str = "r1", **kw: object) -> RouteRequest:
    return RouteRequest(
        request_id=request_id,
        model="m",
        prompt_tokens=prompt_tokens,
        block_size=16,
        matches={m.worker_id: m for m in matches},
        **kw,
    )  # type: ignore[arg-type]
