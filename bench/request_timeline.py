"""Where a request's time goes inside the running router: a timeline of its stages, in microseconds.

    .venv/bin/python bench/request_timeline.py                          # kvaware, growing 8k-token chats
    .venv/bin/python bench/request_timeline.py --policy round_robin --prefix-tokens 0   # small completions
    .venv/bin/python bench/request_timeline.py --prefix-tokens 32768 --rounds 6
    .venv/bin/python bench/request_timeline.py --prefix-tokens 1024 --cached   # one prompt, fully cached
    .venv/bin/python bench/request_timeline.py --prefix-tokens 16384 --fresh   # a new long prompt every time

One simulated fleet (``kvroute sim``, 2 workers, time scale 0.001) and ``kvroute serve`` in front of it,
started through this script (``--serve``), which wraps the request path's stages with timestamps before
handing over to the CLI: body read, parse, the decision (tokens, lookup, the policy's choice), the write
to the worker, the worker's headers and first body bytes, the way back to the client (response object,
head write, first chunk), and the report after the answer; and, apart, how long each KV event message and
each burst's index write held the event loop. The load is ``bench/peers_overhead.py``'s:
``--prefix-tokens 0`` for its small completions, ``--cached`` for one prompt sent again and again, ``--fresh``
for a new prompt every time, else its
growing agent chats (TTFT). Each round also measures the workers directly, so the router's added p50 is
printed beside the stages. A diagnostic: the wrappers cost a microsecond or two per stage, and stage p50s
do not add up to the total's p50.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import yaml

#: (stage, from mark, to mark), in the order a request meets them.
STAGES = [
    ("read body", "recv", "body"),
    ("parse", "body", "decide+"),
    ("decide", "decide+", "decide-"),
    ("  tokens", "tokens+", "tokens-"),
    ("  keys + lookup", "lookup+", "lookup-"),
    ("  policy choose", "choose+", "choose-"),
    ("to the upstream write", "decide-", "upstream+"),
    ("upstream: worker's headers", "upstream+", "upstream-"),
    ("upstream: first body bytes", "upstream-", "first-"),
    ("first bytes -> response object", "first-", "handled"),
    ("response object -> head written", "handled", "head-"),
    ("head -> first chunk written", "head-", "chunk0-"),
    ("received -> first chunk written", "recv", "chunk0-"),
    ("report (after the answer)", "report+", "report-"),
]


# -- the instrumented router (``--serve``) ----------------------------------------------------------------------------


def serve_instrumented(out: str, argv: list[str]) -> int:
    """``kvroute <argv>`` with the stages timestamped; SIGUSR1 writes the marks to ``out`` (JSON)."""
    marks: list[tuple[str, float]] = []
    spans: list[tuple[str, float]] = []
    now = time.perf_counter
    signal.signal(signal.SIGUSR1, lambda *_: Path(out).write_bytes(orjson.dumps({"marks": marks, "spans": spans})))

    import kvroute.router.app as app
    import kvroute.router.flow as flow
    import kvroute.router.forwarding as forwarding
    import kvroute.router.native_http as native_http
    import kvroute.router.tokens as tokens
    from kvroute.indexer.service import KVIndexer
    from kvroute.policies.approx_text import ApproxTextPolicy
    from kvroute.policies.cost import KvAwarePolicy
    from kvroute.policies.least_load import LeastLoad
    from kvroute.policies.prefix import PrefixPolicy
    from kvroute.policies.round_robin import RoundRobin

    def around(owner: Any, name: str, tag: str, is_async: bool) -> None:
        inner = getattr(owner, name)
        if is_async:

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                marks.append((tag + "+", now()))
                try:
                    return await inner(*args, **kwargs)
                finally:
                    marks.append((tag + "-", now()))

            setattr(owner, name, functools.wraps(inner)(timed_async))
        else:

            def timed(*args: Any, **kwargs: Any) -> Any:
                marks.append((tag + "+", now()))
                try:
                    return inner(*args, **kwargs)
                finally:
                    marks.append((tag + "-", now()))

            setattr(owner, name, functools.wraps(inner)(timed))

    read_body = app.read_body

    async def timed_read_body(*args: Any, **kwargs: Any) -> bytes:
        marks.append(("recv", now()))
        body = await read_body(*args, **kwargs)
        marks.append(("body", now()))
        return body

    app.read_body = timed_read_body
    around(flow.RequestFlow, "decide", "decide", True)
    around(flow.RequestFlow, "report", "report", False)
    around(tokens.Tokenizers, "tokens_for_request", "tokens", True)
    around(tokens.Tokenizers, "head_for_request", "tokens", True)  # a long new prompt's head, or its tokens
    around(KVIndexer, "lookup_tokens", "lookup", True)
    around(forwarding.Forwarder, "_first_bytes", "first", True)
    from kvroute.indexer.mirror import BackendMirror
    from kvroute.indexer.replays import Replays

    def span(owner: Any, name: str, tag: str) -> None:
        """Each call's duration, apart from the requests' marks: the loop's work between them."""
        inner = getattr(owner, name)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = now()
            try:
                return await inner(*args, **kwargs)
            finally:
                spans.append((tag, (now() - t0) * 1e6))

        setattr(owner, name, functools.wraps(inner)(timed))

    span(Replays, "handle", "KV events: one message decoded and translated")
    span(BackendMirror, "flush", "KV events: a burst's ops applied to the index")
    around(native_http.NativeTransport, "request", "upstream", True)
    handle = flow.RequestFlow.handle

    async def timed_handle(self: Any, request: Any) -> Any:
        response = await handle(self, request)
        marks.append(("handled", now()))
        return response

    flow.RequestFlow.handle = timed_handle  # type: ignore[method-assign]
    for cls in (KvAwarePolicy, RoundRobin, LeastLoad, PrefixPolicy, ApproxTextPolicy):
        around(cls, "choose", "choose", False)
    _mark_sends(forwarding, marks, now)
    from kvroute.apps.cli import main

    return main(argv)


def _mark_sends(forwarding: Any, marks: list[tuple[str, float]], now: Callable[[], float]) -> None:
    """Marks when a response's head and its first chunk have been handed to the server (written)."""

    def wrap(cls: Any) -> None:
        call = cls.__call__

        async def timed_call(self: Any, scope: Any, receive: Any, send: Any) -> None:
            sent = 0

            async def timed_send(message: dict[str, Any]) -> None:
                nonlocal sent
                await send(message)
                if message["type"] == "http.response.start":
                    marks.append(("head-", now()))
                elif sent == 0:
                    sent = 1
                    marks.append(("chunk0-", now()))

            await call(self, scope, receive, timed_send)

        cls.__call__ = timed_call

    wrap(forwarding.RawResponse)
    wrap(forwarding.RawStreamingResponse)


# -- the run ----------------------------------------------------------------------------------------------------------


def stage_table(marks: list[tuple[str, float]], skip: int) -> list[tuple[str, float, float, int]]:
    """Per stage: (name, p50 µs, mean µs, requests), over the requests after the first ``skip``."""
    requests: list[dict[str, float]] = []
    for tag, at in marks:
        if tag == "recv":
            requests.append({"recv": at})
        elif requests and tag not in requests[-1]:
            requests[-1][tag] = at
    rows = []
    for name, start, end in STAGES:
        spans = [(r[end] - r[start]) * 1e6 for r in requests[skip:] if start in r and end in r and r[end] >= r[start]]
        if spans:
            rows.append((name, statistics.median(spans), statistics.mean(spans), len(spans)))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve_instrumented(argv[1], argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="kvaware")
    ap.add_argument("--prefix-tokens", type=int, default=8192, help="0: small completions instead of chats")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=1000, help="small completions per round")
    ap.add_argument("--steps", type=int, default=30, help="growing (or cached) requests per round")
    shape = ap.add_mutually_exclusive_group()
    shape.add_argument(
        "--cached", action="store_true", help="one prompt of --prefix-tokens again and again (fully cached)"
    )
    shape.add_argument(
        "--fresh", action="store_true", help="a new prompt of --prefix-tokens every time (nothing cached)"
    )
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).parent))
    import peers_overhead as po
    from kvroute.experiment import FleetSpec, fleet_process
    from peers import answers_ok, free_port, wait_until_ready

    load = argparse.Namespace(requests=args.requests, steps=args.steps, step_tokens=256, max_tokens=8)
    if args.prefix_tokens:
        kind = "cached" if args.cached else "fresh" if args.fresh else "grow"
        scenario = po.Scenario(f"{kind} {args.prefix_tokens}", kind, prefix_tokens=args.prefix_tokens)
    else:
        scenario = po.Scenario("small c1", "small", concurrency=1)
    work = Path(tempfile.mkdtemp(prefix="timeline-"))
    out = work / "marks.json"
    added = []
    with fleet_process(FleetSpec(workers=2, preset="llama-8b-h100", time_scale=0.001), work, "timeline") as config:
        model = config["models"][0]["name"]
        direct = config["workers"][0]["url"].rstrip("/")
        router = {**config, "policy": args.policy, "port": free_port()}
        (work / "router.yaml").write_text(yaml.safe_dump(router, sort_keys=False))
        base = f"http://127.0.0.1:{router['port']}"
        cmd = [sys.executable, __file__, "--serve", str(out), "serve", "--config", str(work / "router.yaml")]
        log = (work / "router.log").open("wb")
        proc = subprocess.Popen([*cmd, "--log-level", "warning"], stdout=log, stderr=log, env=os.environ.copy())
        try:
            wait_until_ready(lambda: answers_ok(base + "/ready"), proc, "kvroute serve", work / "router.log")
            po.measure(base, scenario, model, "warm-up", load)
            warm = args.requests + 201 if not args.prefix_tokens else args.steps + 1
            for k in range(args.rounds):
                d = po.measure(direct, scenario, model, f"direct/{k}", load)
                r = po.measure(base, scenario, model, f"router/{k}", load)
                added.append(r["p50_ms"] - d["p50_ms"])
                print(
                    f"round {k + 1}/{args.rounds}: direct p50 {d['p50_ms']:.2f} ms, through the router "
                    f"{r['p50_ms']:.2f} ms (+{added[-1]:.2f})",
                    flush=True,
                )
            proc.send_signal(signal.SIGUSR1)
            for _ in range(100):
                if out.exists():
                    break
                time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(30)
    dump = orjson.loads(out.read_bytes())
    marks = dump["marks"]
    print(
        f"\n{scenario.name}, policy {args.policy}: added p50 over direct {statistics.median(added):+.2f} ms "
        f"(median of {args.rounds} rounds); stages (µs):\n"
    )
    print("| stage | p50 µs | mean µs | requests |\n|---|---:|---:|---:|")
    for name, p50, mean, n in stage_table(marks, warm):
        print(f"| {name} | {p50:.1f} | {mean:.1f} | {n} |")
    print("\nThe loop's other work meanwhile, each call holding it (µs):\n")
    print("| work | calls | p50 µs | p99 µs | longest µs |\n|---|---:|---:|---:|---:|")
    by_tag: dict[str, list[float]] = {}
    for tag, us in dump["spans"]:
        by_tag.setdefault(tag, []).append(us)
    for tag, values in by_tag.items():
        values.sort()
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
        print(f"| {tag} | {len(values)} | {statistics.median(values):.1f} | {p99:.1f} | {values[-1]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
