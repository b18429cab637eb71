"""A fleet of simulated workers in one process and one asyncio loop.

``async with SimFleet(n_workers=4, preset="llama-8b-h100", time_scale=0.05) as fleet:`` then
``fleet.serve_config()`` is the ``kvroute serve`` configuration that routes to it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import zmq
import zmq.asyncio
from kvroute.sim.options import WorkerOptions
from kvroute.sim.presets import Preset, get_preset
from kvroute.sim.worker import SimWorker
from kvroute.vocabulary import Role

#: With a base port P, worker i uses P+4i (HTTP), +1 (KV events), +2 (replay), +3 (P2P control).
PORTS_PER_WORKER = 4


def worker_ports(base_port: int, index: int, dp_size: int = 1) -> dict[str, int]:
    """Ports of worker ``index`` from a base port: HTTP, then ``dp_size`` KV-event ports (rank n at the
    first + n, as vLLM offsets them), as many replay ports, as many P2P ports (1 + 3 x dp_size in all; with
    one rank, PORTS_PER_WORKER)."""
    p = base_port + (1 + 3 * dp_size) * index
    return {"http_port": p, "events_port": p + 1, "replay_port": p + 1 + dp_size, "p2p_port": p + 1 + 2 * dp_size}


def merge_sections(config: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``config`` updated with ``extra`` in place, sections (``pool``, ``index``) merged key by key rather
    than replaced, so ``{"pool": {"kv_protocol": "p2p"}}`` keeps the fleet's link figures."""
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(config.get(key), dict)
        config[key] = {**config[key], **value} if both else value
    return config


class SimFleet:
    def __init__(
        self,
        n_workers: int = 4,
        preset: str | Preset = "llama-8b-h100",
        *,
        time_scale: float = 1.0,
        roles: Sequence[Role] | None = None,
        host: str = "127.0.0.1",
        base_port: int = 0,
        hash_seed: int | None = None,
        events_connect: str | None = None,
        preset_overrides: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """``roles``: one per worker (cycled if shorter); ``hash_seed``: shared by the whole fleet so P2P
        peers agree on block hashes (random per fleet when None, like one PYTHONHASHSEED for all);
        ``events_connect``: workers CONNECT their PUB there (router-bound SUB) instead of binding;
        ``options``: any other :class:`WorkerOptions` field, applied to every worker."""
        if n_workers < 1:
            raise ValueError("n_workers must be >= 1")
        base = get_preset(preset) if isinstance(preset, str) else preset
        if preset_overrides:
            base = base.with_overrides(**preset_overrides)
        self.preset = base
        self.time_scale = time_scale
        self.hash_seed = hash_seed if hash_seed is not None else int.from_bytes(os.urandom(8), "little")
        self.events_connect = events_connect
        roles = list(roles or ["both"])
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context(self._ctx)
        template = WorkerOptions(preset=base, host=host, time_scale=time_scale, hash_seed=self.hash_seed)
        unknown = set(options) - set(WorkerOptions.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown worker options: {sorted(unknown)}")
        template = replace(template, **options)
        self.workers: list[SimWorker] = []
        for i in range(n_workers):
            ports: dict[str, Any] = {}
            if base_port:
                ports = dict(worker_ports(base_port, i, template.dp_size))
            if events_connect:
                ports.update(events_mode="connect", events_endpoint=events_connect)
            opts = replace(template, role=roles[i % len(roles)], **ports)
            self.workers.append(SimWorker(opts, ctx=self._ctx, actx=self._actx))

    @property
    def model(self) -> str:
        return self.workers[0].model

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def __len__(self) -> int:
        return len(self.workers)

    def __getitem__(self, index: int) -> SimWorker:
        return self.workers[index]

    def model_config(self) -> dict[str, Any]:
        """The ``models:`` entry (router/config.py ModelConfig) with the preset's cost-model figures.

        The router measures real seconds, so the figures are the scaled fleet's (a fleet at time scale
        0.25 prefills four times faster than its preset), and the router tokenizes locally with the same
        tokenizer the workers use."""
        p = self.preset
        tokenizer = self.workers[0].opts.tokenizer or "python:kvroute.sim.tokenizer:BuiltinTokenizer"
        return {
            "name": self.model,
            "block_size": p.block_size,
            "tokenizer": tokenizer,
            "prefill_tokens_per_s": p.prefill_tokens_per_s / self.time_scale,
            "attention_coeff_s": p.attention_coeff_s * self.time_scale,
            "bytes_per_token": p.bytes_per_token,
            "transfer_per_block_s": p.transfer_per_block_s * self.time_scale,
        }

    def pool_config(self) -> dict[str, Any]:
        """The ``pool:`` link figures of this fleet, time-scaled like :meth:`model_config`'s."""
        p = self.preset
        return {
            "link_bytes_per_s": p.link_bytes_per_s / self.time_scale,
            "transfer_setup_s": p.transfer_setup_s * self.time_scale,
        }

    def serve_config(self, **extra: Any) -> dict[str, Any]:
        """The ``kvroute serve`` configuration routing to this fleet (``extra`` merged at the top level)."""
        config: dict[str, Any] = {
            "workers": [w.worker_config() for w in self.workers],
            "models": [self.model_config()],
            "pool": self.pool_config(),
        }
        if self.events_connect:
            config["index"] = {"events_bind": self.events_connect}
        return merge_sections(config, extra)

    def stats(self) -> list[dict[str, Any]]:
        """Per-worker counters (prefix-cache queries/hits, KV bytes moved, load)."""
        return [w.stats() for w in self.workers]

    def reset(self) -> bool:
        """Cold caches everywhere (e.g. between two policies of a demo); False if some worker is busy."""
        return all([w.reset() for w in self.workers])

    async def start(self) -> SimFleet:
        started: list[SimWorker] = []
        try:
            for worker in self.workers:
                await worker.start()  # a worker that fails to start closes what it opened
                started.append(worker)
        except BaseException:
            await asyncio.gather(*(w.stop() for w in started), return_exceptions=True)
            self._ctx.destroy(linger=0)
            raise
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> SimFleet:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
