"""Rendering the Helm chart for the tests, and the files generated from it.

``deploy/k8s.yaml`` and ``deploy/epp.yaml`` are ``helm template`` of the chart with one of its ``ci/`` values
files under a header; the chart's copy of the Grafana dashboard is ``deploy/grafana/kvroute.json``. The tests
check both stay so; ``python -m tests.deploy.regenerate`` rewrites them after a change to the chart.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.helm_tool import ROOT, helm_binary

CHART = ROOT / "deploy" / "helm" / "kvroute"
CI = CHART / "ci"
#: One values file per mode the chart supports.
MODES = ("default", "discovery", "replicas-redis", "epp")
#: Not a ci file: every optional part switched on at once (both workloads, Redis, discovery, monitoring).
EVERYTHING = "everything"
EVERYTHING_FLAGS = (
    "--set",
    "epp.enabled=true,epp.replicas=2,router.replicas=2,redis.enabled=true,"
    "inferencePool.selector.app=vllm-llama,inferencePool.appProtocol=http,"
    "inferencePool.httpRoute.enabled=true,inferencePool.httpRoute.parentRefs[0].name=inference-gateway,"
    "discovery.kubernetes.enabled=true,discovery.kubernetes.port=8000,"
    "discovery.dns.enabled=true,discovery.dns.name=vllm.default.svc.cluster.local,"
    "serviceMonitor.enabled=true,grafanaDashboard.enabled=true,podDisruptionBudget.maxUnavailable=50%",
)
RELEASE = "kvroute"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute.json"
CHART_DASHBOARD = CHART / "dashboards" / "kvroute.json"


@dataclass(frozen=True)
class StaticManifest:
    path: Path
    mode: str
    header: str


_COMMON = (
    "# GENERATED from the Helm chart deploy/helm/kvroute: do not edit by hand.\n"
    "#   helm template kvroute deploy/helm/kvroute -f deploy/helm/kvroute/ci/{mode}.yaml\n"
    "# After a chart change: python -m tests.deploy.regenerate (tests/deploy fails while this file is stale).\n"
    "# Prefer the chart itself (docs/deploy.md); this file is for kubectl-only clusters.\n"
    "#\n"
)
STATIC = (
    StaticManifest(
        ROOT / "deploy" / "k8s.yaml",
        "default",
        _COMMON.format(mode="default")
        + '# kvroute serve (policy kvaware) in front of a vLLM StatefulSet "vllm" behind the headless Service\n'
        '# "vllm" (vllm-0.vllm, vllm-1.vllm; OpenAI API on 8000, KV events on 5557, replay on 5567).\n'
        "# The admin token is read from the Secret kvroute-admin, which you create first:\n"
        '#   kubectl create secret generic kvroute-admin --from-literal=token="$(openssl rand -hex 24)"\n'
        "#   kubectl apply -f deploy/k8s.yaml\n",
    ),
    StaticManifest(
        ROOT / "deploy" / "epp.yaml",
        "epp",
        _COMMON.format(mode="epp")
        + '# kvroute as the Endpoint Picker (policy kvaware) of the InferencePool "vllm-llama" (docs/epp.md).\n'
        '# Assumes the Inference Extension CRDs, a Gateway "inference-gateway" whose implementation supports\n'
        '# InferencePool, and vLLM pods labelled app=vllm-llama from a StatefulSet "vllm" behind the headless\n'
        '# Service "vllm" (vllm-0.vllm, vllm-1.vllm; KV events on 5557, replay on 5567).\n'
        "# The admin token is read from the Secret kvroute-admin, which you create first:\n"
        '#   kubectl create secret generic kvroute-admin --from-literal=token="$(openssl rand -hex 24)"\n'
        "#   kubectl apply -f deploy/epp.yaml\n",
    ),
)


class HelmError(RuntimeError):
    pass


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=120, check=False)
    if check and done.returncode != 0:
        raise HelmError(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr}{done.stdout}")
    return done


def values_args(mode: str | None) -> list[str]:
    """None: the chart's defaults; a ci file's name; or EVERYTHING."""
    if mode is None:
        return []
    if mode == EVERYTHING:
        return list(EVERYTHING_FLAGS)
    return ["-f", str(CI / f"{mode}.yaml")]


def template_text(mode: str | None, *extra: str) -> str:
    """``helm template`` output for a ci values file (None: the chart's defaults) plus extra flags."""
    return helm("template", RELEASE, str(CHART), *values_args(mode), *extra).stdout


def objects(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


class Rendered:
    """One ``helm template`` output: its text and objects, with small lookups."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.objects = objects(text)

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.all(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
        return found[0]

    def kinds(self) -> set[str]:
        return {o["kind"] for o in self.objects}

    def config(self) -> dict[str, Any]:
        """The kvroute.yaml the ConfigMap carries."""
        loaded: dict[str, Any] = yaml.safe_load(self.one("ConfigMap", RELEASE)["data"]["kvroute.yaml"])
        return loaded


def static_text(manifest: StaticManifest) -> str:
    return manifest.header + template_text(manifest.mode)
