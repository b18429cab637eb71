"""``kvroute sim`` flags for the vLLM 0.32-0.33 features."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from kvroute.apps.sim import _fleet_kwargs, add_parser
from kvroute.config import RouterConfig

from tests.sim.conftest import event_sources


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["sim", *argv])


def test_flags_reach_the_worker_options() -> None:
    args = _parse(
        "--dp-size", "2", "--max-num-queued-reqs", "8", "--max-num-queued-tokens", "4096", "--enable-scale-out",
        "--event-fields", "0.33", "--hash-lookahead-tokens", "1", "--hybrid-sliding-window", "128",
        "--offload-ownership", "kvcr", "--dp-ephemeral-ports",
    )  # fmt: skip
    kwargs = _fleet_kwargs(args)
    assert kwargs["dp_size"] == 2 and kwargs["dp_ephemeral_ports"] is True
    assert kwargs["max_num_queued_reqs"] == 8 and kwargs["max_num_queued_tokens"] == 4096
    assert kwargs["enable_scale_out"] is True and kwargs["event_fields"] == "0.33"
    assert kwargs["hash_lookahead_tokens"] == 1 and kwargs["hybrid_sliding_window"] == 128
    assert kwargs["offload_ownership"] == "kvcr"
    defaults = _fleet_kwargs(_parse())
    assert defaults["dp_size"] == 1 and defaults["max_num_queued_reqs"] is None and not defaults["enable_scale_out"]
    assert defaults["event_fields"] == "legacy" and defaults["hybrid_sliding_window"] is None


@pytest.mark.parametrize(
    "argv",
    [
        ("--dp-size", "0"),
        ("--max-num-queued-reqs", "-1"),
        ("--hash-lookahead-tokens", "-2"),
        ("--hybrid-sliding-window", "0"),
        ("--event-form", "array", "--event-fields", "0.33"),
    ],
)
def test_impossible_values_are_refused(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(*argv)
    assert args.func(args) == 2
    assert "kvroute sim:" in capsys.readouterr().err


def test_a_dp_fleet_with_admission_and_render(tmp_path: Path) -> None:
    out = tmp_path / "sim.yaml"
    argv = [
        sys.executable, "-m", "kvroute.apps.cli", "sim", "--workers", "1", "--preset", "tiny", "--time-scale", "0.01",
        "--dp-size", "2", "--max-num-queued-reqs", "0", "--enable-scale-out", "--config-out", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        config = RouterConfig.model_validate(yaml.safe_load(out.read_text()))
        worker = config.workers[0]
        assert worker.dp_size == 2
        sources = event_sources(httpx.get(f"{worker.url}/kv_event_sources", timeout=10).json())
        assert [s["data_parallel_rank"] for s in sources] == [0, 1] and sources[0]["endpoint"] == worker.kv_events
        assert httpx.post(f"{worker.url}/v1/completions", json={"prompt": "a"}, timeout=10).status_code == 503
        r = httpx.post(f"{worker.url}/v1/completions/render", json={"prompt": "a b"}, timeout=10)
        assert r.status_code == 200 and len(r.json()[0]["token_ids"]) == 2
    finally:
        proc.terminate()
        proc.communicate(timeout=15)
    assert proc.returncode == 0
