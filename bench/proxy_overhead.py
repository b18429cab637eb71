"""Added latency and throughput of going through kvroute instead of straight to the worker.

One minimal, fast upstream on loopback (raw ASGI under uvicorn+uvloop+httptools, fixed small JSON
completion); kvroute in front of it with each upstream HTTP client (native, aiohttp, httpx), and the Rust routers
when their binaries are found (``--vllm-router PATH``, ``--smg PATH``). Each target gets the same load:
``--requests`` small non-streaming /v1/completions at concurrency 1 and 32, from an aiohttp client in this
process. Prints p50/p99 latency, requests/s, the added p50/p99 versus direct, and ratios to direct.
All numbers come from one run on one machine: compare ratios, not absolute values.

    .venv/bin/python bench/proxy_overhead.py [--requests 3000] [--concurrency 1 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from loadgen import Stats, closed_loop

BODY = b'{"model":"m1","prompt":"hello","max_tokens":1}'
#: The policy kvroute runs with (``--policy``): round_robin measures the proxy itself.
POLICY = "round_robin"

UPSTREAM = r"""
import sys, uvicorn
ANSWER = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m1","choices":[{"index":0,'
          b'"text":" world","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
          b'"total_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}')
MODELS = b'{"object":"list","data":[{"id":"m1","object":"model","owned_by":"bench"}]}'
JSON = [(b"content-type", b"application/json")]

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    path = scope["path"]
    body = ANSWER if path.endswith("completions") else MODELS if path == "/v1/models" else b"{}"
    await send({"type": "http.response.start", "status": 200,
                "headers": JSON + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools",
            log_level="error", access_log=False, lifespan="off")
"""


#: The floor of any Python proxy on this stack: a raw ASGI callable forwarding with one aiohttp session
#: (no routing, validation, metrics or policy).
BARE = r"""
import sys, uvicorn, aiohttp
UP = sys.argv[2]
HEADERS = {"content-type": "application/json"}
session = None

async def app(scope, receive, send):
    global session
    if scope["type"] != "http":
        return
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024), auto_decompress=False)
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    async with session.request(scope["method"], UP + scope["path"], data=body or None, headers=HEADERS) as r:
        data = await r.read()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": r.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools",
            log_level="error", access_log=False, lifespan="off")
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}: {proc.args}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


@dataclass
class Target:
    name: str
    url: str
    proc: subprocess.Popen[bytes] | None = None


async def load(url: str, requests: int, concurrency: int) -> Stats:
    """``requests`` small completions at ``concurrency`` (``loadgen.closed_loop``); any failure aborts the run."""
    stats = await closed_loop(url + "/v1/completions", BODY, requests, concurrency)
    if stats.errors:
        raise RuntimeError(f"{url}: {stats.errors} of {stats.requests} requests failed")
    return stats


def kvroute_command(python: str) -> list[str]:
    """How to start ``kvroute`` with ``python`` (an older checkout's venv names the CLI ``kvroute.cli``)."""
    probe = subprocess.run([python, "-c", "import kvroute.apps.cli"], capture_output=True)
    return [python, "-m", "kvroute.apps.cli" if probe.returncode == 0 else "kvroute.cli"]


def start_kvroute(client: str, upstream: str, python: str = sys.executable, label: str = "kvroute") -> Target:
    port = free_port()
    cmd = [
        *kvroute_command(python),
        "serve",
        "--policy",
        POLICY,
        "--worker",
        upstream,
        "--port",
        str(port),
        "--http-client",
        client,
        "--log-level",
        "error",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc)
    time.sleep(0.5)  # first health probe and model discovery
    return Target(f"{label}[{client}]", f"http://127.0.0.1:{port}", proc)


def start_bare(upstream: str) -> Target:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", BARE, str(port), upstream])
    wait_port(port, proc)
    return Target("bare-asgi-aiohttp", f"http://127.0.0.1:{port}", proc)


def start_rust_router(name: str, command: list[str], upstream: str) -> Target:
    """vllm-router and SGLang's smg take the same basic flags (--worker-urls, --policy, --host, --port)."""
    port = free_port()
    # Both default their metrics listener to port 29000: give each its own.
    cmd = [
        *command,
        "--worker-urls",
        upstream,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc)
    time.sleep(1.0)
    return Target(name, f"http://127.0.0.1:{port}", proc)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--clients", nargs="+", default=["native", "aiohttp", "httpx"])
    parser.add_argument("--bare", action="store_true", help="also measure a bare ASGI+aiohttp proxy (floor)")
    parser.add_argument("--vllm-router", metavar="PATH", help="vllm-router binary to measure as well")
    parser.add_argument("--smg", metavar="PATH", help="SGLang's smg binary (`smg launch ...`) to measure too")
    parser.add_argument(
        "--baseline",
        metavar="PYTHON",
        help="the python of another kvroute install (e.g. an older checkout's venv), measured in the same run",
    )
    parser.add_argument("--policy", default=POLICY, help=f"kvroute's policy (default {POLICY}: the proxy itself)")
    parser.add_argument("--repeats", type=int, default=1, help="measure every target this many times, interleaved")
    args = parser.parse_args()
    globals()["POLICY"] = args.policy

    up_port = free_port()
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)])
    targets: list[Target] = []
    try:
        wait_port(up_port, upstream)
        up_url = f"http://127.0.0.1:{up_port}"
        targets.append(Target("direct", up_url))
        if args.bare:
            targets.append(start_bare(up_url))
        targets.extend(start_kvroute(c, up_url) for c in args.clients)
        if args.baseline:
            targets.extend(start_kvroute(c, up_url, args.baseline, "baseline") for c in args.clients)
        if args.vllm_router:
            targets.append(start_rust_router("vllm-router", [args.vllm_router], up_url))
        if args.smg:
            targets.append(start_rust_router("smg", [args.smg, "launch"], up_url))
        print(f"# {os.cpu_count()} CPUs, {args.requests} requests per cell, small non-streaming completions")
        print(
            f"{'target':<18}{'conc':>5}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'+p50 ms':>9}{'+p99 ms':>9}"
            f"{'rps/direct':>11}"
        )
        for conc in [c for c in args.concurrency for _ in range(args.repeats)]:
            base: Stats | None = None
            for target in targets:
                s = asyncio.run(load(target.url, args.requests, conc))
                base = base or s
                added = f"{s.p50_ms - base.p50_ms:>9.3f}{s.p99_ms - base.p99_ms:>9.3f}"
                print(
                    f"{target.name:<18}{conc:>5}{s.p50_ms:>9.3f}{s.p99_ms:>9.3f}{s.rps:>9.0f}{added}"
                    f"{s.rps / base.rps:>11.2f}",
                    flush=True,
                )
    finally:
        for target in targets:
            stop(target.proc)
        stop(upstream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
