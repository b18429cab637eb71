"""CPU per KV-event message in the router's process: what following a busy fleet costs the event loop.

A publisher process sends vLLM-shaped messages (one ``BlockStored`` of 4 blocks each, the shape of a
growing conversation's step) one per millisecond on real ZMQ over TCP. This process receives them and
counts its own CPU per message, per thread (the event loop's, ZeroMQ's I/O thread), three ways in one run:

- ``zmq.asyncio``: receive only, with pyzmq's asyncio sockets (a future per receive; the baseline);
- ``inbox``: receive only, through :class:`kvroute.indexer.sockets.Inbox` (what the subscriber uses);
- ``subscriber``: the whole path, :class:`~kvroute.indexer.subscriber.EventSubscriber` into a memory index;
  with ``--baseline PYTHON``, also another kvroute install's subscriber (before/after).

    .venv/bin/python bench/event_ingest.py [--messages 3000] [--repeats 3] [--baseline /tmp/kv-old/.venv/bin/python]

Medians over the repeats; ratios are to ``zmq.asyncio`` (receive) and to the baseline (whole path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from peers import free_port
from procstat import thread_cpu_s

HERE = Path(__file__).resolve().parent
MODEL = "bench-model"

PUBLISHER = r"""
import sys, time, zmq
sys.path.insert(0, {bench!r})
from indexer import make_stream
n, port = {n}, {port}
msgs, _ = make_stream(1, 4 * (n + 600), 4, 1)
ctx = zmq.Context(); s = ctx.socket(zmq.PUB); s.bind(f"tcp://127.0.0.1:{{port}}")
time.sleep(0.5)
for _, frames in msgs[:500]:  # warm-up (and the subscription's arrival)
    s.send_multipart(frames); time.sleep(0.001)
time.sleep(0.3)
print("go", flush=True)
start = time.perf_counter()
for i, (_, frames) in enumerate(msgs[500:500 + n]):
    s.send_multipart(frames)
    due = start + (i + 1) * 0.001
    while time.perf_counter() < due:
        pass
time.sleep(0.3)
print("end", flush=True)
"""


async def measure(mode: str, n: int) -> dict[str, float]:
    import zmq
    import zmq.asyncio

    port = free_port()
    count = 0
    stop: Any = None
    if mode == "subscriber":
        from kvroute.indexer.memory import MemoryIndex
        from kvroute.indexer.service import KVIndexer
        from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec

        indexer = KVIndexer(MemoryIndex())
        sub = EventSubscriber(indexer)
        sub.add_worker(WorkerSpec("w0", MODEL, f"tcp://127.0.0.1:{port}"))
        await sub.start()

        def received() -> int:
            ent = indexer.registry.entity("w0", 0)
            return ent.batches if ent is not None else 0

        stop = sub.stop
    else:
        ctx = zmq.asyncio.Context()
        if mode == "inbox":
            from kvroute.indexer.sockets import Inbox, sub_socket

            plain = sub_socket(ctx)
            plain.setsockopt(zmq.SUBSCRIBE, b"")
            plain.connect(f"tcp://127.0.0.1:{port}")
            inbox = Inbox(plain)

            async def burst() -> list[list[bytes]]:
                return await inbox.drain()
        else:
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(f"tcp://127.0.0.1:{port}")

            async def burst() -> list[list[bytes]]:
                out = [await sock.recv_multipart()]
                while True:
                    try:
                        out.append(await sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        return out

        async def loop() -> None:
            nonlocal count
            while True:
                count += len(await burst())

        task = asyncio.create_task(loop())

        def received() -> int:
            return count

        async def stop() -> None:
            task.cancel()
            if mode == "inbox":  # a socket made with zmq.Socket(ctx) is not the context's to close
                inbox.close()
                plain.close(0)
            ctx.destroy(0)

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PUBLISHER.format(bench=str(HERE), n=n, port=port), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    if (await proc.stdout.readline()).strip() != b"go":
        raise SystemExit("the publisher did not start")
    before, got0 = thread_cpu_s(os.getpid()), received()
    await proc.stdout.readline()
    after, got = thread_cpu_s(os.getpid()), received() - got0
    await proc.wait()
    await stop()
    if got < n * 0.95:
        raise SystemExit(f"{mode}: {got} of {n} messages arrived")
    us = {name: (after[name] - before.get(name, 0.0)) * 1e6 / got for name in after}
    return {"main": us.get("main", 0.0), "zmq_io": sum(v for k, v in us.items() if k.startswith("ZMQbg/IO"))}


def child(mode: str, n: int) -> None:
    import uvloop

    uvloop.install()
    print(json.dumps(asyncio.run(measure(mode, n))))


def run(python: str, mode: str, n: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    done = subprocess.run(
        [python, str(Path(__file__)), "--child", mode, "--messages", str(n)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{mode} ({python}) failed:\n{done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", help="the python of another kvroute install: its subscriber is one more row")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.messages)
        return
    cells = [("zmq.asyncio", sys.executable, "zmq.asyncio"), ("inbox", sys.executable, "inbox")]
    cells.append(("subscriber", sys.executable, "subscriber"))
    if args.baseline:
        cells.append(("subscriber@baseline", args.baseline, "subscriber"))
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in cells}
    for k in range(args.repeats):  # interleaved: the box's speed drifts
        for label, python, mode in cells:
            got = run(python, mode, args.messages)
            results[label].append(got)
            print(
                f"round {k + 1}/{args.repeats} {label:20} loop {got['main']:6.1f} µs/msg  ZMQ I/O {got['zmq_io']:5.1f}",
                flush=True,
            )
    med = {
        label: {key: statistics.median(r[key] for r in rs) for key in ("main", "zmq_io")}
        for label, rs in results.items()
    }
    print(f"\n{args.messages} messages at 1 per ms, medians of {args.repeats} rounds (CPU µs per message)\n")
    print("| path | event loop | ZMQ I/O thread | loop ÷ reference |\n|---|---:|---:|---:|")
    for label, m in med.items():
        ref = med["subscriber@baseline"] if label == "subscriber" and args.baseline else med["zmq.asyncio"]
        ratio = "-" if label in ("zmq.asyncio", "subscriber@baseline") else f"{m['main'] / ref['main']:.2f}x"
        print(f"| {label} | {m['main']:.1f} | {m['zmq_io']:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
