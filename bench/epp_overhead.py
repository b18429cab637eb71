"""How long Envoy waits for the Endpoint Picker's pick: ``kvroute epp`` against a bare ext_proc servicer.

Per request the load generator (a grpc.aio client in this process, playing Envoy as tests/epp do) opens one
``ExternalProcessor/Process`` stream, writes ``request_headers`` (FULL_DUPLEX_STREAMED) and the whole
``request_body`` with ``end_of_stream``, and times until the picker's ``request_body`` answer arrives (the
moment Envoy could forward); then it closes the stream. Targets, each a separate process started in turn:

1. ``bare-picker``: a minimal grpc.aio ExternalProcessor (in this file) that answers with a fixed
   ``x-gateway-destination-endpoint`` header and ``envoy.lb`` metadata and echoes the body: the floor of
   Python gRPC on this machine (what the Inference Extension's LWEPP reference does, in Python);
2. ``epp round_robin``: ``kvroute epp --config`` with ``policy: round_robin``;
3. ``epp kvaware``: ``kvroute epp --config`` with ``policy: kvaware``; the decision tokenizes the prompt,
   hashes block keys and looks them up in the index.

Both ``kvroute epp`` runs route to a simulated fleet (``kvroute sim``, 4 workers, preset llama-8b-h100,
time scale 0.01, its config from ``--config-out``); no request reaches a worker (Envoy would forward it).
The prompt has ``--prompt-tokens`` (default 2000) tokens; before the kvaware run it is sent to worker 0
directly and the bench waits until the picker's index holds its prefix there, so kvaware picks a cached
worker. Each target gets ``--requests`` sequential streams (p50/p99) and ``--requests`` streams at
``--concurrency`` (throughput), after 200 warm-up streams. Prints p50/p99 ms, streams/s and ratios to the
bare picker. All numbers come from one run on one machine: compare ratios, not absolute values.

    .venv/bin/python bench/epp_overhead.py [--requests 2000] [--concurrency 16] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from kvroute.experiment import answers_ok, free_port, stop_process, wait_until_ready

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
DESTINATION = "x-gateway-destination-endpoint"
WARMUP = 200

#: The floor: a grpc.aio ExternalProcessor that makes no decision. Like kvroute epp in FULL_DUPLEX_STREAMED
#: mode it collects the body, then answers the headers (destination header + envoy.lb metadata) and sends
#: the body back whole.
BARE = r"""
import asyncio, sys
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

ENDPOINT = sys.argv[2]
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

class Bare(pb_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator, context):
        chunks = []
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if kind == "request_body":
                chunks.append(msg.request_body.body)
                if not msg.request_body.end_of_stream:
                    continue
                body = b"".join(chunks)
                meta = struct_pb2.Struct()
                meta.update({"envoy.lb": {"x-gateway-destination-endpoint": ENDPOINT}})
                headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                                      append_action=OVERWRITE)
                           for k, v in (("x-gateway-destination-endpoint", ENDPOINT),
                                        ("content-length", str(len(body))))]
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                    header_mutation=pb.HeaderMutation(set_headers=headers))), dynamic_metadata=meta)
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=body, end_of_stream=True)))))

async def main():
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Bare(), server)
    server.add_insecure_port(f"127.0.0.1:{sys.argv[1]}")
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        stop_process(proc)


def request_headers() -> pb.ProcessingRequest:
    pairs = [
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":authority", "gw"),
        ("content-type", "application/json"),
    ]
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
        )
    )
    msg.protocol_config.request_body_mode = FULL_DUPLEX
    msg.protocol_config.response_body_mode = FULL_DUPLEX
    return msg


@dataclass
class Stats:
    p50_ms: float
    p99_ms: float
    rps: float
    picks: dict[str, int]


class Envoy:
    """Plays Envoy's ext_proc filter against one picker: one Process stream per request."""

    def __init__(self, port: int, body: bytes) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.headers = request_headers()
        self.body = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        self.picks: dict[str, int] = {}

    async def one(self) -> float:
        """Seconds from opening the stream to the picker's request_body answer; then the stream is closed."""
        t0 = time.perf_counter()
        call = self.stub.Process()
        await call.write(self.headers)
        await call.write(self.body)
        picked = ""
        while True:
            answer = await call.read()
            if answer is grpc.aio.EOF:
                raise RuntimeError("the picker ended the stream before answering the body")
            if answer.HasField("immediate_response"):
                raise RuntimeError(f"the picker refused the request: {answer.immediate_response}")
            if answer.HasField("dynamic_metadata"):
                picked = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
            if answer.HasField("request_body"):
                break
        elapsed = time.perf_counter() - t0
        self.picks[picked] = self.picks.get(picked, 0) + 1
        await call.done_writing()
        if await call.read() is not grpc.aio.EOF or await call.code() != grpc.StatusCode.OK:
            raise RuntimeError("the picker did not close the stream cleanly")
        return elapsed

    async def close(self) -> None:
        await self.channel.close()


class Progress:
    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self._last = label, total, 0, 0.0

    def tick(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last > 0.5 or self.done == self.total:
            self._last = now
            end = "\n" if self.done == self.total else ""
            print(f"\r  {self.label}: {self.done}/{self.total}", end=end, file=sys.stderr, flush=True)


async def measure(name: str, port: int, body: bytes, requests: int, concurrency: int) -> Stats:
    envoy = Envoy(port, body)
    try:
        for _ in range(WARMUP):
            await envoy.one()
        envoy.picks.clear()
        progress = Progress(f"{name} sequential", requests)
        latencies = []
        for _ in range(requests):
            latencies.append(await envoy.one())
            progress.tick()
        picks = dict(envoy.picks)
        latencies.sort()
        remaining = requests
        progress = Progress(f"{name} concurrency {concurrency}", requests)

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await envoy.one()
                progress.tick()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rps = requests / (time.perf_counter() - t0)
    finally:
        await envoy.close()
    return Stats(statistics.median(latencies) * 1e3, latencies[int(len(latencies) * 0.99) - 1] * 1e3, rps, picks)


def prompt_of(tokens: int) -> str:
    """``tokens`` whitespace-separated pieces (the simulator's tokenizer makes one token of each)."""
    words = ("the", "cache", "router", "block", "prefix", "worker", "token", "envoy", "gateway", "pick")
    return " ".join(f"{words[i % len(words)]}{i % 257}" for i in range(tokens))


def warm(fleet: dict[str, Any], admin: str, model: str, prompt: str, min_tokens: int) -> int:
    """Send the prompt to worker 0 directly, then wait until the picker's index holds its prefix there;
    returns the tokens the index matches on worker 0."""
    worker = fleet["workers"][0]
    answer = httpx.post(
        worker["url"].rstrip("/") + "/v1/completions",
        timeout=30.0,
        json={"model": model, "prompt": prompt, "max_tokens": 1},
    )
    answer.raise_for_status()
    deadline = time.monotonic() + 30.0
    matched = 0
    while time.monotonic() < deadline:
        found = httpx.post(admin + "/admin/index/lookup", json={"model": model, "prompt": prompt}, timeout=5.0)
        found.raise_for_status()
        matched = max(
            (int(m.get("tokens", 0)) for m in found.json().get("matches", []) if m.get("worker") == worker["id"]),
            default=0,
        )
        if matched >= min_tokens:
            return matched
        time.sleep(0.1)
    raise RuntimeError(
        f"the index never held the prompt's prefix on {worker['id']} (matched {matched} tokens): {found.text[:500]}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="streams per measurement (default 2000)")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent streams for throughput")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="prompt length in tokens")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvroute-epp-bench-"))
    fleet_yaml = work / "fleet.yaml"
    sim = start(
        [
            sys.executable,
            "-m",
            "kvroute.apps.cli",
            "sim",
            "--workers",
            "4",
            "--preset",
            "llama-8b-h100",
            "--time-scale",
            "0.01",
            "--config-out",
            str(fleet_yaml),
        ],
        work / "sim.log",
    )
    results: list[tuple[str, Stats]] = []
    notes: list[str] = []
    try:
        wait_until_ready(
            lambda: fleet_yaml.exists() and fleet_yaml.stat().st_size > 0, sim, "kvroute sim", work / "sim.log"
        )
        time.sleep(0.2)
        fleet = yaml.safe_load(fleet_yaml.read_text())
        model = fleet["models"][0]["name"]
        prompt = prompt_of(args.prompt_tokens)
        body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": 16})
        worker0 = fleet["workers"][0]["url"].split("://", 1)[-1].rstrip("/")
        print(
            f"# {os.cpu_count()} CPUs; {args.requests} streams sequential and {args.requests} at concurrency "
            f"{args.concurrency} per target; /v1/completions body {len(body)} bytes, ~{args.prompt_tokens} "
            f"prompt tokens; pickers and the 4-worker sim fleet in their own processes",
            flush=True,
        )

        # 1. bare picker
        port = free_port()
        log = work / "bare.log"
        proc = start([sys.executable, "-c", BARE, str(port), worker0], log)
        try:
            wait_until_ready(lambda: port_open(port), proc, "bare picker", log)
            results.append(
                ("bare-picker", asyncio.run(measure("bare-picker", port, body, args.requests, args.concurrency)))
            )
        finally:
            stop(proc)

        # 2, 3. kvroute epp
        for policy in ("round_robin", "kvaware"):
            http_port, grpc_port = free_port(), free_port()
            config = {**fleet, "policy": policy, "port": http_port, "host": "127.0.0.1"}
            config_yaml = work / f"epp-{policy}.yaml"
            config_yaml.write_text(yaml.safe_dump(config, sort_keys=False))
            log = work / f"epp-{policy}.log"
            proc = start(
                [
                    sys.executable,
                    "-m",
                    "kvroute.apps.cli",
                    "epp",
                    "--config",
                    str(config_yaml),
                    "--grpc-port",
                    str(grpc_port),
                    "--log-level",
                    "warning",
                ],
                log,
            )
            admin = f"http://127.0.0.1:{http_port}"
            try:
                wait_until_ready(
                    lambda a=admin, g=grpc_port: answers_ok(a + "/ready") and port_open(g), proc, "kvroute epp", log
                )
                if policy == "kvaware":
                    block = int(fleet["models"][0].get("block_size", 16))
                    matched = warm(fleet, admin, model, prompt, args.prompt_tokens - 2 * block)
                    notes.append(
                        f"kvaware: before the run the index matched {matched} of the prompt's tokens "
                        f"on worker 0 ({worker0})"
                    )
                name = f"epp {policy}"
                stats = asyncio.run(measure(name, grpc_port, body, args.requests, args.concurrency))
                results.append((name, stats))
                if policy == "kvaware":
                    notes.append(
                        f"kvaware: {stats.picks.get(worker0, 0)}/{args.requests} sequential picks went "
                        f"to the cached worker 0"
                    )
            finally:
                stop(proc)
    except BaseException:
        print(f"# logs and configs kept in {work}", file=sys.stderr)
        raise
    finally:
        stop(sim)
    shutil.rmtree(work, ignore_errors=True)

    base = results[0][1]
    print(f"{'target':<18}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'p50/bare':>10}{'p99/bare':>10}{'rps/bare':>10}")
    for name, s in results:
        print(
            f"{name:<18}{s.p50_ms:>9.3f}{s.p99_ms:>9.3f}{s.rps:>9.0f}{s.p50_ms / base.p50_ms:>10.2f}"
            f"{s.p99_ms / base.p99_ms:>10.2f}{s.rps / base.rps:>10.2f}"
        )
    for note in notes:
        print(f"# {note}")
    print(
        f"# p50/p99: sequential streams, open to the request_body answer; req/s: whole streams at concurrency "
        f"{args.concurrency}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
