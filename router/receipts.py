"""Per-request receipts: what the policy chose and predicted, what the engine then did, and the runner-up.

A routing loss is only explainable request by request: was the prediction wrong (the hit was not there, the
queue was longer), or was it right and the runner-up would have been better anyway? A receipt holds the
chosen plan (workers, kind, predicted TTFT by term, predicted hit by tier), the best alternative the policy
weighed (its predicted TTFT), and what was observed (time to first byte, cached tokens reported by the
engine, status). The last ``capacity`` receipts are kept in memory for ``GET /admin/receipts``; with a path
configured, every receipt is also appended to a JSON-lines file (for benchmarks and offline analysis).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

import orjson
from kvroute.policies.base import CandidatePlan, RoutePlan

log = logging.getLogger("kvroute.receipts")

#: Terms of a plan's breakdown worth keeping (seconds), in the order the cost model adds them.
_TERMS = ("queue_s", "lookup_s", "transfer_s", "promotion_s", "prefill_s", "handoff_s", "decode_queue_s")
#: Candidates kept after the chosen plan (the runner-up first): enough to show the best plan on each
#: other worker of a small pool; each costs a little on the request path when receipts are written.
ALTERNATIVES = 4
#: Parts of the ranking beside the sum: the KV-space share of ``queue_s``, the affinity penalty, and what a
#: decoder's own prefill makes the handoffs due there wait.
_PARTS = ("kv_space_wait_s", "affinity_penalty_s", "handoffs_held_s")


def receipt_of(
    request_id: str,
    model: str,
    plan: RoutePlan,
    *,
    at: float,
    prompt_tokens: int | None,
    cached_tokens: int | None,
    ttfb_s: float | None,
    stream: bool,
    status: int,
    ok: bool,
    prefill_leg_s: float | None = None,
    prefill_leg_cached_tokens: int | None = None,
) -> dict[str, Any]:
    """One receipt as plain JSON-able data (``prefill_leg_s``, ``prefill_leg_cached_tokens``: a split plan's
    prefill leg, see :class:`~kvroute.policies.base.RouteOutcome`)."""
    breakdown = plan.breakdown or {}
    alternatives = [_alternative(c) for c in plan.candidates[1 : 1 + ALTERNATIVES]]
    chosen_note = plan.candidates[0].note if plan.candidates else ""
    return {
        "at": at,
        "request_id": request_id,
        "model": model,
        "policy": plan.policy,
        "prefill": plan.prefill,
        "decode": plan.decode,
        "kv_source": plan.kv_source,
        "kind": chosen_note,
        "predicted": {
            "ttft_s": plan.predicted_ttft_s,
            "cached_tokens": plan.predicted_cached_tokens,
            "by_tier": dict(plan.predicted_by_tier or {}),
            "terms": _terms(breakdown),
        },
        "runner_up": alternatives[0] if alternatives else None,
        # The next candidates, best first: whether the plan that would have been right was weighed, and
        # which term put it behind.
        "alternatives": alternatives,
        "observed": {
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            # A stream's first chunk is its time to first token; a whole JSON answer includes decoding.
            "ttft_s": ttfb_s if stream else None,
            "prefill_leg_s": prefill_leg_s,
            "prefill_leg_cached_tokens": prefill_leg_cached_tokens,
            "status": status,
            "ok": ok,
        },
    }


def _alternative(candidate: CandidatePlan) -> dict[str, Any]:
    return {
        "prefill": candidate.prefill,
        "decode": candidate.decode,
        "kv_source": candidate.kv_source,
        "kind": candidate.note,
        "ttft_s": candidate.breakdown.get("total_s"),
        "rank_s": candidate.score,
        "cached_tokens": candidate.predicted_cached_tokens,
        "terms": _terms(candidate.breakdown),
    }


def _terms(breakdown: dict[str, float]) -> dict[str, float]:
    return {t: breakdown[t] for t in (*_TERMS, *_PARTS) if t in breakdown}


class Receipts:
    """The last ``capacity`` receipts, and optionally every one appended to ``path`` (JSON lines).

    Kept in memory as the plan and the observed figures; the JSON shape is made when a receipt is read (or
    written to the file), not on the request path of every answer."""

    def __init__(self, capacity: int = 1000, path: str | Path | None = None, flush_every: int = 64) -> None:
        self._recent: deque[tuple[float, str, str, RoutePlan, dict[str, Any]]] = deque(maxlen=max(1, capacity))
        self._file: IO[bytes] | None = open(path, "ab") if path else None  # noqa: SIM115 (closed in close())
        self._flush_every = max(1, flush_every)
        self._unflushed = 0

    def add(self, request_id: str, model: str, plan: RoutePlan, **observed: Any) -> None:
        """One answered request: ``observed`` are :func:`receipt_of`'s keyword arguments but ``at``."""
        entry = (time.time(), request_id, model, plan, observed)
        self._recent.append(entry)
        if self._file is None:
            return
        try:
            self._file.write(orjson.dumps(_receipt(entry)) + b"\n")
            self._unflushed += 1
            if self._unflushed >= self._flush_every:
                self._file.flush()
                self._unflushed = 0
        except OSError as exc:  # a full disk costs receipts, never requests
            log.warning("receipts file not written (%s); keeping them in memory only", exc)
            self._file = None

    def recent(self, limit: int) -> list[dict[str, Any]]:
        items = list(self._recent)
        return [_receipt(entry) for entry in items[-limit:]] if limit else []

    async def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _receipt(entry: tuple[float, str, str, RoutePlan, dict[str, Any]]) -> dict[str, Any]:
    at, request_id, model, plan, observed = entry
    return receipt_of(request_id, model, plan, at=at, **observed)
