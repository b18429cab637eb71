"""``kvroute serve``: flags, config errors that name the field, and a real start as a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
from kvroute.apps.cli import main
from kvroute.apps.serve import overrides_from

from tests.http.upstream import FakeWorker, free_port, serve_worker

KVROUTE = [sys.executable, "-m", "kvroute.apps.cli"]


def test_check_prints_the_merged_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text("policy: least_load\nport: 9000\nworkers:\n  - url: http://10.0.0.1:8000\n")
    monkeypatch.setenv("KVROUTE_PORT", "9100")
    code = main(
        [
            "serve",
            "--config",
            str(cfg),
            "--worker",
            "http://127.0.0.1:8100",
            "--worker",
            "http://127.0.0.1:8101",
            "--policy",
            "round_robin",
            "--check",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert '"policy": "round_robin"' in out  # flag wins over the file
    assert '"port": 9100' in out  # environment wins over the file
    assert "127.0.0.1:8101" in out and "10.0.0.1" not in out  # --worker replaces the file's list


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("workers:\n  - url: not-a-url\n", "workers.0.url"),
        ("workers:\n  - url: http://a:1\n    role: boss\n", "workers.0.role"),
        ("port: -3\n", "port"),
        ("polcy: x\n", "polcy"),
        ("workers: [\n", "not valid YAML"),
        ("- just\n- a list\n", "mapping"),
        ("log_level: chatty\n", "log_level"),
    ],
)
def test_bad_config_fails_naming_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, yaml_text: str, needle: str
) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    assert main(["serve", "--config", str(cfg), "--check"]) == 2
    assert needle in capsys.readouterr().err


def test_unknown_policy_and_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--policy", "nope", "--check"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert main(["serve", "--config", "/nonexistent/kvroute.yaml"]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_overrides_ignore_flags_not_given() -> None:
    import argparse

    args = argparse.Namespace(
        worker=None,
        policy=None,
        host=None,
        port=8001,
        admin_token=None,
        http_client=None,
        max_body_bytes=None,
        log_level=None,
    )
    assert {k: v for k, v in overrides_from(args).items() if v is not None} == {"port": 8001}


async def test_serve_subprocess_end_to_end() -> None:
    w = FakeWorker("w")
    port = free_port()
    async with serve_worker(w):
        proc = await asyncio.create_subprocess_exec(
            *KVROUTE,
            "serve",
            "--worker",
            w.url,
            "--policy",
            "least_load",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
                base = f"http://127.0.0.1:{port}"
                for _ in range(300):
                    try:
                        if (await client.get(base + "/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert proc.returncode is None, (await proc.stderr.read()).decode()
                    await asyncio.sleep(0.05)
                r = await client.post(base + "/v1/completions", json={"model": "m1", "prompt": "x"})
                assert r.status_code == 200 and r.json()["worker"] == "w"
                assert [m["id"] for m in (await client.get(base + "/v1/models")).json()["data"]] == ["m1"]
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 15)


def test_sample_deploy_configs_are_valid() -> None:
    import yaml
    from kvroute.config import RouterConfig, load_config

    root = Path(__file__).resolve().parents[2] / "deploy"
    config = load_config(root / "kvroute.yaml", environ={})
    assert [w.worker_id for w in config.workers] == ["vllm-0", "vllm-1"]
    docs = list(yaml.safe_load_all((root / "k8s.yaml").read_text()))
    embedded = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["kvroute.yaml"]
    assert RouterConfig.model_validate(yaml.safe_load(embedded)).policy == "kvaware"
