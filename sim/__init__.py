"""Simulated vLLM workers ("digital twin"): OpenAI API, KV events over ZMQ, a paged KV cache, a timing model.

The fleet API (``SimFleet``) is imported lazily so ``kvroute.sim.tokenizer`` stays importable without
loading the servers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SimFleet", "SimWorker", "WorkerOptions", "get_preset"]


def __getattr__(name: str) -> Any:
    if name in ("SimFleet",):
        from kvroute.sim.fleet import SimFleet

        return SimFleet
    if name in ("SimWorker", "WorkerOptions"):
        from kvroute.sim import worker

        return getattr(worker, name)
    if name == "get_preset":
        from kvroute.sim.presets import get_preset

        return get_preset
    raise AttributeError(name)
