"""`kvroute demo` end to end, small: a fleet and a router per policy, a table and a chart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_compares_policies_and_draws_a_chart(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvroute.apps.cli",
            "demo",
            "--policies",
            "round_robin,kvaware",
            "--sessions",
            "2",
            "--steps",
            "2,3",
            "--time-scale",
            "0.1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    table = (out / "demo.txt").read_text().splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:]}
    assert set(rows) == {"round_robin", "kvaware"}
    assert all(row[6] == "0" for row in rows.values())  # no errors
    assert (out / "demo.png").stat().st_size > 10_000
