"""The YAML examples of docs/deploy.md are valid: manifests against the Kubernetes schemas, values files
by rendering the chart with them (and the ones quoting a ci/ file agree with it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import chart
from tests.deploy.validation import check_object

DOC = chart.ROOT / "docs" / "deploy.md"
_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)


def yaml_blocks() -> list[str]:
    return _BLOCK.findall(DOC.read_text())


def contained(small: Any, big: Any) -> bool:
    """``small`` says nothing ``big`` does not (mappings: a subset, recursively; the rest: equal)."""
    if isinstance(small, dict) and isinstance(big, dict):
        return all(k in big and contained(v, big[k]) for k, v in small.items())
    return bool(small == big)


def test_the_page_has_examples() -> None:
    blocks = yaml_blocks()
    assert sum(b.startswith("# values:") for b in blocks) >= 4
    assert any("kind: StatefulSet" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(yaml_blocks())))
def test_yaml_example(helm: str, index: int, tmp_path: Path) -> None:
    block = yaml_blocks()[index]
    if block.startswith("# values:"):
        values = tmp_path / "values.yaml"
        values.write_text(block)
        rendered = chart.Rendered(chart.helm("template", chart.RELEASE, str(chart.CHART), "-f", str(values)).stdout)
        for obj in rendered.objects:
            check_object(obj)
        quoted = re.search(r"\((deploy/helm/kvroute/ci/[\w-]+\.yaml)", block.splitlines()[0])
        if quoted:
            ci = yaml.safe_load((chart.ROOT / quoted.group(1)).read_text())
            assert contained(yaml.safe_load(block), ci), f"the example differs from {quoted.group(1)}"
    else:
        docs = [d for d in yaml.safe_load_all(block) if d]
        assert docs and all("apiVersion" in d for d in docs), "a YAML example that is neither values nor manifests"
        for obj in docs:
            check_object(obj)
