"""bench/relay_cost.py runs end to end in front of a real simulated fleet, and its arithmetic is per round.

The smoke test runs ``--quick`` with kvroute's routers and direct only (no peer is installed in tests); it
checks the harness and that every token arrived, not any timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import relay_cost  # noqa: E402


def test_gaps_are_against_direct_in_the_same_round_and_cells_are_medians() -> None:
    def row(rnd: int, target: str, cpu: float, gap: float) -> dict[str, object]:
        return {
            "round": rnd,
            "target": target,
            "errors": 0,
            "cpu_us_per_token": cpu,
            "tokens_per_s": 100.0,
            "gap_p50_ms": gap,
            "gap_p99_ms": 2 * gap,
        }

    runs = [
        row(0, "direct", float("nan"), 1.0),
        row(0, "kvaware", 30.0, 1.5),
        row(0, "smg:cache_aware", 20.0, 1.2),
        row(1, "direct", float("nan"), 3.0),
        row(1, "kvaware", 10.0, 3.1),
        row(1, "smg:cache_aware", 20.0, 3.3),
        row(2, "direct", float("nan"), 2.0),
        row(2, "kvaware", 20.0, 2.2),
        row(2, "smg:cache_aware", 25.0, 2.0),
    ]
    cells = {c["target"]: c for c in relay_cost.cells_of(runs, ["direct", "kvaware", "smg:cache_aware"])}
    assert cells["kvaware"]["cpu_us_per_token"] == 20.0
    assert abs(cells["kvaware"]["added_gap_p50_ms"] - 0.2) < 1e-9  # +0.5, +0.1, +0.2: the median
    assert abs(cells["smg:cache_aware"]["added_gap_p99_ms"] - 0.4) < 1e-9  # +0.4, +0.6, 0.0
    assert cells["kvaware"]["cpu_vs_best_peer"] == 1.0  # smg's median 20.0 is the only peer
    assert "| kvaware | 20.0 | 1.00x |" in relay_cost.markdown(list(cells.values()))


def test_quick_run_relays_every_token(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "relay_cost.py"),
            "--quick",
            "--routers",
            "kvaware,round_robin",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(tmp_path.glob("venv-*"))  # no peer was installed
    data = json.loads((tmp_path / "relay_cost.json").read_text())
    assert {r["target"] for r in data["runs"]} == {"direct", "kvaware", "round_robin"}
    for run in data["runs"]:
        assert run["errors"] == 0
        assert run["tokens"] == 8 * 32  # --quick: 8 streams of 32 tokens, every one relayed
        if run["target"] != "direct":
            assert run["cpu_us_per_token"] > 0
