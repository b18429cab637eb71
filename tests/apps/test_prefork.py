"""``kvroute serve --processes N``: real processes on one port in front of simulated workers publishing
KV events; a shared (Redis) or per-process (memory) index, aggregated metrics, supervision."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kvroute.apps.cli import main
from kvroute.apps.prefork import ChildSpec, child_overrides
from kvroute.config import RouterConfig
from kvroute.sim.fleet import SimFleet
from prometheus_client.parser import text_string_to_metric_families

from tests.end_to_end.conftest import FAST, words
from tests.http.upstream import free_port
from tests.polling import eventually

KVROUTE = [sys.executable, "-m", "kvroute.apps.cli"]
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: Child processes import the whole router on shared cores: generous bounds (never timing assertions).
START_S = 90.0


class Router:
    """A ``kvroute serve --processes N`` process (the parent) and ways to reach one of its children."""

    def __init__(self, proc: asyncio.subprocess.Process, base: str, log: Path) -> None:
        self.proc = proc
        self.base = base
        self.log = log

    @asynccontextmanager
    async def pinned(self, pid: int | None = None) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, Any]]]:
        """A client on one kept-alive connection, so every request reaches the same child (``pid``, or
        whichever accepted it); yields it with that child's ``/admin/process``."""
        while True:
            client = httpx.AsyncClient(
                base_url=self.base, headers=AUTH, timeout=30, trust_env=False, limits=httpx.Limits(max_connections=1)
            )
            info = (await client.get("/admin/process")).json()
            if pid is None or info["pid"] == pid:
                break
            await client.aclose()
        try:
            yield client, info
        finally:
            await client.aclose()

    async def processes(self) -> dict[int, dict[str, Any]]:
        """Every child seen answering over fresh connections (the kernel spreads them over the sockets)."""
        seen: dict[int, dict[str, Any]] = {}
        for _ in range(40):
            try:
                async with self.pinned() as (_, info):
                    seen[info["pid"]] = info
            except httpx.TransportError:
                pass  # a child starting or stopping
        return seen

    def log_count(self, needle: str) -> int:
        return self.log.read_text(errors="replace").count(needle)


@asynccontextmanager
async def serve_processes(tmp_path: Path, config: dict[str, Any], processes: int = 2) -> AsyncIterator[Router]:
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *KVROUTE,
            "serve",
            "--config",
            str(path),
            "--processes",
            str(processes),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "info",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=stderr,
        )
    router = Router(proc, f"http://127.0.0.1:{port}", log)
    try:

        async def all_up() -> bool:
            assert proc.returncode is None, log.read_text()
            return len(await router.processes()) == processes

        await eventually(all_up, timeout=START_S, interval=0.2, what=f"{processes} serving processes answering")
        yield router
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def fleet_config(fleet: SimFleet, **extra: Any) -> dict[str, Any]:
    return fleet.serve_config(
        policy="kvaware",
        debug_headers=True,
        health_interval_s=0.2,
        metrics_interval_s=0.2,
        admin_token=TOKEN,
        **extra,
    )


async def routes_to(client: httpx.AsyncClient, model: str, prompt: str, holder: str) -> None:
    """Once this child's index shows ``holder`` holding the prompt, a real request goes there and is
    served from cache."""

    async def planned() -> bool:
        r = await client.post("/admin/route/explain", json={"model": model, "prompt": prompt})
        plan = r.json().get("plan") or {}
        return plan.get("prefill") == holder and plan.get("predicted_cached_tokens", 0) >= 144

    await eventually(planned, timeout=30, interval=0.1, what=f"the index of this process naming {holder}")
    r = await client.post(
        "/v1/completions", headers={"x-kvroute-debug": "1"}, json={"model": model, "prompt": prompt, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    assert json.loads(r.headers["x-kvroute-plan"])["prefill"] == holder
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 144


def completions_counted(metrics_text: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "kvroute_requests":
            return sum(
                s.value
                for s in family.samples
                if s.name == "kvroute_requests_total" and s.labels.get("route") == "/v1/completions"
            )
    return 0.0


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
async def test_memory_index_per_process_shared_port_metrics_and_supervision(tmp_path: Path) -> None:
    async with SimFleet(2, "tiny", time_scale=FAST) as fleet, serve_processes(tmp_path, fleet_config(fleet)) as router:
        children = await router.processes()
        assert sorted(info["index"] for info in children.values()) == [0, 1]
        assert {info["parent_pid"] for info in children.values()} == {router.proc.pid}
        assert all(info["subscribes"] for info in children.values())  # memory: each keeps its own index
        holder = fleet[1]
        prompt = words(160, "prefork")
        async with httpx.AsyncClient(timeout=30, trust_env=False) as direct:
            r = await direct.post(
                f"{holder.url}/v1/completions", json={"model": fleet.model, "prompt": prompt, "max_tokens": 2}
            )
            assert r.status_code == 200
        # Both children route the prefix to the worker holding it.
        for pid in children:
            async with router.pinned(pid) as (client, _):
                await routes_to(client, fleet.model, prompt, holder.worker_id)
                assert (await client.get("/admin/process")).json()["pid"] == pid  # still the same child

        # /metrics is the aggregate: any child counts the requests every child answered.
        async with httpx.AsyncClient(base_url=router.base, timeout=30, trust_env=False) as client:
            for i in range(10):
                r = await client.post(
                    "/v1/completions",
                    headers={"connection": "close"},  # a new connection each: spread over the children
                    json={"model": fleet.model, "prompt": f"short {i}", "max_tokens": 1},
                )
                assert r.status_code == 200
        for pid in children:
            async with router.pinned(pid) as (client, _):
                assert completions_counted((await client.get("/metrics")).text) == 12

                # Run-time worker changes would reach one process: refused, with the way that works.
                r = await client.post("/admin/workers", json={"url": "http://127.0.0.1:9"})
                assert r.status_code == 409
                assert r.json()["error"]["code"] == "multi_process"

        # SIGHUP reaches every child (each reloads the file).
        router.proc.send_signal(signal.SIGHUP)
        await eventually(lambda: router.log_count("config reloaded (SIGHUP)") == 2, what="two reloads")

        # A killed child is restarted, and its new index is rebuilt from the workers' replay.
        victim = next(pid for pid, info in children.items() if info["index"] == 1)
        os.kill(victim, signal.SIGKILL)

        async def replaced() -> dict[int, dict[str, Any]] | None:
            now = await router.processes()
            return now if len(now) == 2 and victim not in now else None

        now = await eventually(replaced, timeout=START_S, interval=0.2, what="a restarted child")
        assert gone(victim)
        newcomer = next(pid for pid, info in now.items() if info["index"] == 1)
        async with router.pinned(newcomer) as (client, _):
            await routes_to(client, fleet.model, prompt, holder.worker_id)

        # SIGTERM stops every child, then the parent, cleanly.
        router.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(router.proc.wait(), 60) == 0
        assert all(gone(pid) for pid in now)


@pytest.mark.slow
async def test_redis_index_one_writer_every_process_routes_by_it(tmp_path: Path, redis_url: str) -> None:
    async with SimFleet(2, "tiny", time_scale=FAST) as fleet:
        config = fleet_config(fleet, index={"backend": "redis", "redis_url": redis_url})
        async with serve_processes(tmp_path, config) as router:
            children = await router.processes()
            writers = [info["index"] for info in children.values() if info["subscribes"]]
            assert writers == [0]  # one subscriber writes the shared index, the others only read it
            holder = fleet[0]
            prompt = words(160, "shared")
            async with httpx.AsyncClient(timeout=30, trust_env=False) as direct:
                r = await direct.post(
                    f"{holder.url}/v1/completions", json={"model": fleet.model, "prompt": prompt, "max_tokens": 2}
                )
                assert r.status_code == 200
            for pid in children:
                async with router.pinned(pid) as (client, _):
                    await routes_to(client, fleet.model, prompt, holder.worker_id)

            # A supervisor killed outright leaves no orphans: the children notice and stop themselves.
            environ = Path(f"/proc/{next(iter(children))}/environ").read_bytes().split(b"\0")
            metrics_dir = next(
                v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")
            )
            router.proc.kill()
            await router.proc.wait()
            await eventually(lambda: all(gone(pid) for pid in children), timeout=60, what="orphans stopping")
            shutil.rmtree(metrics_dir)  # the parent had no chance to


def test_a_bound_event_socket_cannot_be_shared_by_memory_indexes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(yaml.safe_dump({"index": {"events_bind": "tcp://127.0.0.1:5557"}}))
    assert main(["serve", "--config", str(cfg), "--processes", "2", "--check"]) == 2
    assert "index.events_bind with processes > 1 needs index.backend: redis" in capsys.readouterr().err
    # With Redis one process binds it and writes: accepted.
    cfg.write_text(yaml.safe_dump({"index": {"events_bind": "tcp://127.0.0.1:5557", "backend": "redis"}}))
    assert main(["serve", "--config", str(cfg), "--processes", "2", "--check"]) == 0
    assert '"processes": 2' in capsys.readouterr().out
    monkeypatch.setenv("KVROUTE_PROCESSES", "3")
    assert main(["epp", "--check"]) == 2
    assert "processes > 1 is for kvroute serve" in capsys.readouterr().err


def test_child_specs_make_one_redis_writer_and_keep_the_flags() -> None:
    redis = RouterConfig.model_validate({"processes": 3, "index": {"backend": "redis"}})
    flags = {"policy": "least_load", "port": 0, "host": None}
    specs = [ChildSpec(i, 3, 1, child_overrides(redis, flags, i, 8123)) for i in range(3)]
    again = [ChildSpec.from_env({"_KVROUTE_SERVING_PROCESS": spec.to_env()}) for spec in specs]
    assert again == specs
    assert [s.overrides.get("index", {}).get("subscribe", True) for s in specs] == [True, False, False]
    assert all(s.overrides["port"] == 8123 and s.overrides["policy"] == "least_load" for s in specs)
    assert "host" not in specs[0].overrides  # a flag not given stays the file's
    memory = RouterConfig.model_validate({"processes": 3})
    assert "index" not in child_overrides(memory, flags, 2, 8123)  # memory: every process subscribes
    assert ChildSpec.from_env({}) is None
