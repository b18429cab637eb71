"""``pip install .`` on a fresh machine gets every module: the wheel holds each library file under the
``kvroute`` namespace (a package missing from pyproject's explicit list would only show once installed)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"kvroute_pkg": "kvroute", "router": "kvroute/router", "indexer": "kvroute/indexer",
           "policies": "kvroute/policies", "sim": "kvroute/sim"}  # fmt: skip


@pytest.mark.timeout(600)
def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("kvroute-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{target}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, target in FOLDERS.items()
        for path in (ROOT / folder).rglob("*.py")
    }
    assert expected - names == set()
    assert any(n.endswith("entry_points.txt") for n in names)
    # Every compiled module is built by the wheel build itself (each is optional: a missing one would only
    # show as a slower router).
    for module in ("indexer/_walk", "indexer/_keychain", "indexer/_decode", "indexer/_apply", "sim/_pieces"):
        assert any(n.startswith(f"kvroute/{module}.") and n.endswith(".so") for n in names), module
