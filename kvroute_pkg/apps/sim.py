"""``kvroute sim``: start a fleet of simulated vLLM workers and print the ``kvroute serve`` config for it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

import zmq
from kvroute.sim.presets import PRESETS

ROLES = ("both", "prefill", "decode")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="simulated vLLM workers (digital twin) for tests and benchmarks",
        description="Start N simulated vLLM workers in one process and print the "
        "kvroute serve configuration that routes to them.",
    )
    p.add_argument("--workers", type=int, default=4, help="number of workers (default 4)")
    p.add_argument("--preset", default="llama-8b-h100", choices=sorted(PRESETS), help="model x hardware preset")
    p.add_argument(
        "--roles",
        default="both",
        help="comma-separated roles, cycled over workers (both, prefill, decode), e.g. prefill,decode",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--base-port",
        type=int,
        default=0,
        help="worker i uses base+4i (HTTP), +1 (KV events), +2 (replay), +3 (P2P); with --dp-size D, "
        "base+(1+3D)i (HTTP) then D event, D replay and D P2P ports; 0 = free ports",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="model seconds x scale = real seconds")
    p.add_argument("--gpu-blocks", type=int, help="override the preset's GPU KV blocks")
    p.add_argument("--cpu-blocks", type=int, help="CPU tier size in blocks (0 = none)")
    p.add_argument("--block-size", type=int, help="override the preset's block size")
    p.add_argument("--hash-seed", type=int, help="block-hash seed shared by the fleet (default: random)")
    p.add_argument("--event-form", choices=("map", "array"), default="map")
    p.add_argument("--hash-bytes", action="store_true", help="publish block hashes as bytes, not ints")
    p.add_argument(
        "--events-connect",
        metavar="ENDPOINT",
        help="CONNECT each worker's PUB to this router-bound SUB endpoint (topics tell them apart)",
    )
    p.add_argument("--no-replay", action="store_true", help="no replay ROUTER sockets")
    vllm = p.add_argument_group("vLLM 0.32-0.33 features (default off, as in vLLM)")
    vllm.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="data-parallel ranks per worker: one HTTP port, per-rank caches and publishers (port + rank)",
    )
    vllm.add_argument(
        "--dp-ephemeral-ports",
        action="store_true",
        help="with free ports, give each rank its own ephemeral port (vLLM's tcp://*:0) instead of a range",
    )
    vllm.add_argument("--max-num-queued-reqs", type=int, help="admission: unfinished requests before a 503")
    vllm.add_argument("--max-num-queued-tokens", type=int, help="admission: prompt tokens in prefill before a 503")
    vllm.add_argument("--enable-scale-out", action="store_true", help="serve the /v1/*/render routes (else 403)")
    vllm.add_argument(
        "--event-fields",
        choices=("legacy", "0.33"),
        default="legacy",
        help="KV-event encoding: legacy (every field) or vLLM 0.33's (omit unset, session_id, ownership, ...)",
    )
    vllm.add_argument(
        "--hash-lookahead-tokens", type=int, default=0, help="EAGLE-style lookahead block hashes (vLLM: 1)"
    )
    vllm.add_argument(
        "--hybrid-sliding-window",
        type=int,
        metavar="TOKENS",
        help="hybrid model: a sliding-window KV-cache group (group_idx 1) of this window",
    )
    vllm.add_argument("--offload-ownership", help="ownership stamped on the CPU tier's events, e.g. kvcr")
    p.add_argument("--tokenizer", help="tokenizer.json or folder (default: the built-in tokenizer)")
    p.add_argument("--chat-template", help="Jinja chat template file for --tokenizer")
    p.add_argument("--config-out", help="also write the kvroute serve config (YAML) to this file")
    p.set_defaults(func=run)
    return p


def _fleet_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
        raise ValueError(f"--roles: unknown role(s) {bad}; use {', '.join(ROLES)}")
    overrides = {
        k: v
        for k, v in (("gpu_blocks", args.gpu_blocks), ("cpu_blocks", args.cpu_blocks), ("block_size", args.block_size))
        if v is not None
    }
    return dict(
        n_workers=args.workers,
        preset=args.preset,
        roles=roles,
        host=args.host,
        base_port=args.base_port,
        time_scale=args.time_scale,
        hash_seed=args.hash_seed,
        events_connect=args.events_connect,
        preset_overrides=overrides,
        event_form=args.event_form,
        hash_bytes=args.hash_bytes,
        replay=not args.no_replay,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        dp_size=args.dp_size,
        dp_ephemeral_ports=args.dp_ephemeral_ports,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        enable_scale_out=args.enable_scale_out,
        event_fields=args.event_fields,
        hash_lookahead_tokens=args.hash_lookahead_tokens,
        hybrid_sliding_window=args.hybrid_sliding_window,
        offload_ownership=args.offload_ownership,
    )


_WORKER_FIELDS = (
    "dp_size",
    "dp_ephemeral_ports",
    "max_num_queued_reqs",
    "max_num_queued_tokens",
    "enable_scale_out",
    "event_fields",
    "hash_lookahead_tokens",
    "hybrid_sliding_window",
    "offload_ownership",
    "event_form",
)


def _check_worker_options(kwargs: dict[str, Any]) -> None:
    """The worker options no vLLM would start with, refused before anything starts."""
    from kvroute.sim.options import WorkerOptions

    WorkerOptions(**{k: kwargs[k] for k in _WORKER_FIELDS}).check()


async def _serve(args: argparse.Namespace) -> int:
    import yaml
    from kvroute.sim.fleet import SimFleet

    fleet = SimFleet(**_fleet_kwargs(args))
    async with fleet:
        text = yaml.safe_dump(fleet.serve_config(), sort_keys=False)
        if args.config_out:
            Path(args.config_out).write_text(text)
        print(f"# kvroute sim: {len(fleet)} workers, preset {args.preset}, time scale {args.time_scale}")
        print(text, end="")
        target = args.config_out or "<this YAML saved to a file>"
        print(f"# route to it with: kvroute serve --config {target}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    return 0


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        print("kvroute sim: --workers must be >= 1", file=sys.stderr)
        return 2
    try:
        _check_worker_options(_fleet_kwargs(args))
    except ValueError as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return int(runner(_serve(args)))
    except (OSError, ValueError, zmq.ZMQError) as exc:
        print(f"kvroute sim: cannot start the fleet: {exc}", file=sys.stderr)
        return 1
