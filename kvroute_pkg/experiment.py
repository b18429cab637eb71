"""Run one routing policy against a fresh simulated fleet and replay a trace through it.

Shared by ``kvroute demo`` and ``bench/routing.py``. Each run starts its own fleet (``kvroute sim``)
and router (``kvroute serve``) as subprocesses — three processes for two cores is the honest layout:
the replayer, the router and the workers never share one event loop — so every policy starts from
cold caches and an empty index, with the same arrivals.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from kvroute.sim.fleet import merge_sections
from kvroute.sim.replay import ReplayReport, RequestResult, replay
from kvroute.sim.traces import Trace


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(slots=True)
class FleetSpec:
    """What ``kvroute sim`` is started with."""

    workers: int = 4
    preset: str = "llama-8b-h100"
    time_scale: float = 0.25
    roles: str = "both"
    gpu_blocks: int | None = None
    cpu_blocks: int | None = None
    extra_args: list[str] = field(default_factory=list)

    def argv(self, config_out: Path) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "kvroute.apps.cli",
            "sim",
            "--workers",
            str(self.workers),
            "--preset",
            self.preset,
            "--time-scale",
            str(self.time_scale),
            "--roles",
            self.roles,
            "--config-out",
            str(config_out),
        ]
        if self.gpu_blocks is not None:
            argv += ["--gpu-blocks", str(self.gpu_blocks)]
        if self.cpu_blocks is not None:
            argv += ["--cpu-blocks", str(self.cpu_blocks)]
        return argv + self.extra_args


@dataclass(slots=True)
class PolicyRun:
    policy: str
    report: ReplayReport
    router_metrics: str = ""
    #: Each worker's ``/metrics`` text after the replay (what the engines say they hit and moved).
    worker_metrics: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, **self.report.summary()}


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if the process is still there after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            yield proc
        finally:
            stop_process(proc)


def wait_until_ready(
    predicate: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path, timeout_s: float = 60.0
) -> None:
    """Poll ``predicate`` until true; fail with the log's tail if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
        if predicate():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f}s; log:\n{log.read_text()[-3000:]}")


def answers_ok(url: str) -> bool:
    """True when ``GET url`` answers 200 (a readiness probe for a process just started)."""
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def fleet_process(fleet: FleetSpec, workdir: Path, name: str) -> Iterator[dict[str, Any]]:
    """A ``kvroute sim`` fleet as a subprocess; yields the ``kvroute serve`` config it wrote for itself."""
    fleet_yaml, fleet_log = workdir / f"fleet-{name}.yaml", workdir / f"fleet-{name}.log"
    fleet_yaml.unlink(missing_ok=True)  # its appearance is the fleet's "ready" signal
    with process(fleet.argv(fleet_yaml), fleet_log) as sim:
        wait_until_ready(lambda: fleet_yaml.exists() and fleet_yaml.stat().st_size > 0, sim, "kvroute sim", fleet_log)
        time.sleep(0.2)  # the file is written in one call; give the workers' sockets a moment
        yield yaml.safe_load(fleet_yaml.read_text())


def run_policy(
    policy: str,
    trace: Trace,
    fleet: FleetSpec,
    *,
    workdir: Path | None = None,
    router_config: dict[str, Any] | None = None,
    policy_options: dict[str, Any] | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
    router_log_level: str = "warning",
    python: str | None = None,
) -> PolicyRun:
    """Start a fleet and a router with ``policy``, replay ``trace`` through the router, stop both.

    ``router_log_level="debug"`` writes every routing decision to the router's log in ``workdir``;
    ``python``: another kvroute install's interpreter serves the router (a before/after in one run)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvroute-run-"))
    workdir.mkdir(parents=True, exist_ok=True)
    router_log = workdir / f"router-{policy}.log"
    with fleet_process(fleet, workdir, policy) as config:
        merge_sections(config, router_config or {})
        config["policy"] = policy
        if policy_options:
            config["policy_options"] = policy_options
        port = free_port()
        config["port"] = port
        router_yaml = workdir / f"router-{policy}.yaml"
        router_yaml.write_text(yaml.safe_dump(config, sort_keys=False))
        serve = [
            python or sys.executable,
            "-m",
            "kvroute.apps.cli",
            "serve",
            "--config",
            str(router_yaml),
            "--log-level",
            router_log_level,
        ]
        base = f"http://127.0.0.1:{port}"
        with process(serve, router_log) as router:
            wait_until_ready(lambda: answers_ok(base + "/ready"), router, "kvroute serve", router_log)
            model = config["models"][0]["name"] if config.get("models") else None
            report = asyncio.run(replay(trace, base, model=model, time_scale=fleet.time_scale, on_result=on_result))
            time.sleep(0.5)  # the router records a request's outcome just after its client saw the end
            metrics = scrape(base + "/metrics")
        workers = {
            w.get("id") or w["url"]: scrape(w["url"].rstrip("/") + "/metrics") for w in config.get("workers", [])
        }
    return PolicyRun(policy, report, metrics, workers)


def scrape(url: str) -> str:
    """A ``/metrics`` page, or "" when it cannot be read (a run's figures then show zeros, not a crash)."""
    try:
        return httpx.get(url, timeout=5.0).text
    except httpx.HTTPError:
        return ""


class Progress:
    """One status line per run, rewritten in place: requests done, errors, running TTFT p50."""

    def __init__(self, label: str, total: int, stream: Any = sys.stderr) -> None:
        self.label, self.total, self.stream = label, total, stream
        self.done = 0
        self.errors = 0
        self.ttfts: list[float] = []
        self._last = 0.0

    def __call__(self, result: RequestResult) -> None:
        self.done += 1
        if not result.ok:
            self.errors += 1
        elif result.ttft_s is not None:
            self.ttfts.append(result.ttft_s)
        now = time.monotonic()
        if now - self._last > 0.2 or self.done >= self.total:
            self._last = now
            width = 28
            filled = int(width * min(self.done, self.total) / max(self.total, 1))
            p50 = sorted(self.ttfts)[len(self.ttfts) // 2] * 1000 if self.ttfts else 0.0
            self.stream.write(
                f"\r  {self.label:<12} [{'#' * filled}{'.' * (width - filled)}] "
                f"{self.done}/{self.total} requests, {self.errors} errors, "
                f"TTFT p50 {p50:7.1f} ms"
            )
            self.stream.flush()

    def finish(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
