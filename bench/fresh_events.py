"""The event loop's time for one fresh long prompt's KV events on a full worker, this install against another.

A full GPU cache evicts as many blocks as it stores: a new prompt of N blocks arrives as one message with
N one-block ``BlockRemoved`` (vLLM sends one per evicted block) and one ``BlockStored`` of N blocks with
their N x 16 token ids, the map form vLLM sends. Each message goes through ``KVIndexer.handle_message``
into a memory index (decode, our keys, the entity's view, the table), in this process, timed alone; then
the same in ``--baseline``'s Python (another kvroute install), rounds interleaved. Prints the median time
per message and per block moved (stored or removed), and the ratio to the baseline.

    .venv/bin/python bench/fresh_events.py [--blocks 256 1024 4096] [--rounds 5] \
        [--baseline /tmp/kv-old/.venv/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time


def measure(blocks: int, messages: int, seed: int) -> list[float]:
    """Seconds per message for ``messages`` fresh prompts of ``blocks`` blocks (the first few warm up)."""
    from kvroute.indexer.events import BlockRemoved, BlockStored, encode_batch, encode_seq
    from kvroute.indexer.memory import MemoryIndex
    from kvroute.indexer.service import KVIndexer

    rng = random.Random(seed)
    frames = []
    previous: list[int] = []
    for seq in range(messages):
        hashes = [rng.getrandbits(63) for _ in range(blocks)]
        tokens = [rng.randrange(150_000) for _ in range(16 * blocks)]
        events: list[BlockStored | BlockRemoved] = [BlockRemoved(block_hashes=[h]) for h in previous]
        events.append(BlockStored(block_hashes=hashes, token_ids=tokens, block_size=16))
        frames.append([b"", encode_seq(seq), encode_batch(time.time(), events)])  # type: ignore[arg-type]
        previous = hashes

    async def run() -> list[float]:
        indexer = KVIndexer(MemoryIndex())
        indexer.register_worker("w0", "bench-model")
        out = []
        for frame in frames:
            began = time.perf_counter()
            await indexer.handle_message("w0", frame)
            out.append(time.perf_counter() - began)
        return out[2:]

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[256, 1024, 4096], help="blocks per prompt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--messages", type=int, default=12, help="prompts per round (2 warm up)")
    ap.add_argument("--baseline", help="the python of another kvroute install, measured in the same rounds")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:  # one measurement, as JSON, for the parent
        print(json.dumps(measure(args.child, args.messages, seed=args.rounds)))
        return 0
    targets = {"this": sys.executable, **({"baseline": args.baseline} if args.baseline else {})}
    results: dict[tuple[str, int], list[float]] = {}
    for k in range(args.rounds):
        for blocks in args.blocks:
            for name, python in targets.items() if k % 2 == 0 else reversed(targets.items()):
                cmd = [python, __file__, "--child", str(blocks), "--messages", str(args.messages), "--rounds", str(k)]
                samples = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                results.setdefault((name, blocks), []).append(statistics.median(samples))
        print(f"round {k + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"\n{args.rounds} rounds, medians; a message = N one-block removals + one N-block store (16 tokens/block)\n")
    head = "| blocks | this ms / message | this µs / block moved |"
    if args.baseline:
        head += " baseline ms / message | baseline µs / block moved | this ÷ baseline |"
    print(head)
    print("|" + "---:|" * (head.count("|") - 1))
    for blocks in args.blocks:
        this = statistics.median(results[("this", blocks)])
        row = f"| {blocks} | {this * 1e3:.2f} | {this * 1e6 / (2 * blocks):.2f} |"
        if args.baseline:
            base = statistics.median(results[("baseline", blocks)])
            row += f" {base * 1e3:.2f} | {base * 1e6 / (2 * blocks):.2f} | {this / base:.2f}x |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
