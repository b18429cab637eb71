"""bench/busy_ttft.py: the probes are timed while answers really stream, and the cells compare like with like."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import busy_ttft  # noqa: E402


def _run(rnd: int, target: str, p50: float) -> dict[str, object]:
    row = {"round": rnd, "target": target, "p50_ms": p50, "p90_ms": 2 * p50, "probes": 5, "errors": 0}
    return row | {"cpu_us_per_chunk": 20.0, "stall_p99_ms": p50 / 2, "stall_max_ms": p50}


def test_added_and_paired_figures_are_taken_round_by_round() -> None:
    runs = [
        _run(0, "direct", 1.0),
        _run(0, "kvaware", 3.0),
        _run(0, "smg:cache_aware", 2.5),
        _run(0, "vllm-router:cache_aware", 4.0),
        _run(1, "direct", 2.0),  # a slower round: everything moved up together
        _run(1, "kvaware", 3.5),
        _run(1, "smg:cache_aware", 4.0),
        _run(1, "vllm-router:cache_aware", 5.0),
        _run(2, "direct", 1.0),
        _run(2, "kvaware", 2.0),
        _run(2, "smg:cache_aware", 2.6),
        _run(2, "vllm-router:cache_aware", 2.2),
    ]
    names = ["direct", "kvaware", "smg:cache_aware", "vllm-router:cache_aware"]
    cells = {c["target"]: c for c in busy_ttft.cells_of(runs, names)}
    assert cells["kvaware"]["added_p50_ms"] == pytest.approx(1.5)  # median of 2.0, 1.5, 1.0
    assert cells["kvaware"]["paired_vs_best_peer_ms"] == pytest.approx(-0.2)  # median of +0.5, -0.5, -0.2
    assert cells["kvaware"]["rounds_at_or_below_best_peer"] == 2
    assert "paired_vs_best_peer_ms" not in cells["smg:cache_aware"] and "added_p50_ms" not in cells["direct"]
    assert cells["kvaware"]["stall_max_ms"] == pytest.approx(3.0)  # the streams' longest gap: median over rounds


def test_quick_run_times_every_probe_while_answers_stream(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "busy_ttft.py"),
            "--quick",
            "--routers=kvaware,round_robin",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((tmp_path / "busy_ttft.json").read_text())
    assert {r["target"] for r in data["runs"]} == {"direct", "kvaware", "round_robin"}
    for run in data["runs"]:
        assert run["probes"] == 5 and run["errors"] == 0 and run["p50_ms"] > 0
        assert run["stream_chunks"] > 4 * 10  # the streams were really under way during the probes
        assert (run["cpu_us_per_chunk"] > 0) is (run["target"] != "direct")  # no router process: no figure
        assert 0 < run["stall_p99_ms"] <= run["stall_max_ms"]  # gaps between two reads of one answer
    assert "| kvaware |" in (tmp_path / "busy_ttft.md").read_text()
    assert (tmp_path / "busy_ttft.png").stat().st_size > 5_000


def test_fresh_probes_with_a_router_tokenizer_and_a_baseline(tmp_path: Path) -> None:
    """--fresh, --router-tokenizer (a model folder) and --baseline (here this interpreter) run end to end."""
    from tests.router.test_tokens import build_model_folder

    folder = build_model_folder(tmp_path / "model")
    work = tmp_path / "work"
    argv = ["--quick", "--routers=kvaware", "--fresh", "--prompt-tokens=2000", "--baseline", sys.executable]
    argv += ["--router-tokenizer", str(folder), "--work", str(work)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "busy_ttft.py"), *argv],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = json.loads((work / "busy_ttft.json").read_text())["runs"]
    assert {r["target"] for r in runs} == {"direct", "kvaware", "kvaware@baseline"}
    assert all(r["probes"] == 5 and r["errors"] == 0 for r in runs)
    # The routers were given the folder's tokenizer for the fleet's model.
    router_yaml = next(work.glob("runs-*/router-kvaware.yaml")).read_text()
    assert str(folder) in router_yaml
