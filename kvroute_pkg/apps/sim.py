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
        help="worker i uses base+4i (HTTP), +1 (KV events), +2 (replay), +3 (P2P); 0 = free ports",
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
    )


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
        _fleet_kwargs(args)
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
