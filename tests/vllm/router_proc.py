"""``kvroute serve`` as a real subprocess in front of the real vLLM pool (what a user runs).

The router binds the SUB that the connect-mode server (``a``) publishes to, connects to the
bind-mode one (``b``), and tokenizes locally from the tiny model's folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kvroute.experiment import answers_ok, stop_process, wait_until_ready

from .servers import BLOCK_SIZE, MODEL_NAME, VllmServer, free_port

START_TIMEOUT_S = 120.0


def router_config(servers: list[VllmServer], model_dir: Path, port: int, policy: str) -> dict[str, Any]:
    workers = []
    bind = None
    for s in servers:
        worker: dict[str, Any] = {
            "url": s.url,
            "id": s.name,
            "models": [MODEL_NAME],
            "kv_events_topic": s.topic,
            "replay": s.replay,
        }
        if s.vllm_binds_events:
            worker["kv_events"] = s.events
        else:
            bind = s.events
        workers.append(worker)
    return {
        "host": "127.0.0.1",
        "port": port,
        "policy": policy,
        "debug_headers": True,
        "health_interval_s": 0.5,
        "metrics_interval_s": 0.5,
        "workers": workers,
        "models": [{"name": MODEL_NAME, "tokenizer": str(model_dir), "block_size": BLOCK_SIZE}],
        "index": {"backend": "memory", "events_bind": bind},
    }


@dataclass
class RouterProcess:
    config_path: Path
    log_path: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute.apps.cli", "serve", "--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        wait_until_ready(
            lambda: answers_ok(f"{self.url}/ready"), self.proc, "kvroute serve", self.log_path, START_TIMEOUT_S
        )

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc)


def make_router(
    servers: list[VllmServer],
    model_dir: Path,
    workdir: Path,
    policy: str = "kvaware",
    index: dict[str, Any] | None = None,
) -> RouterProcess:
    """A router config file for the pool (``index`` overrides keys of its ``index`` section)."""
    port = free_port()
    config = router_config(servers, model_dir, port, policy)
    config["index"].update(index or {})
    config_path = workdir / f"router-{policy}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return RouterProcess(config_path, workdir / f"router-{policy}.log", port)
