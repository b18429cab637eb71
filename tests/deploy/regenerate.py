"""Rewrite the files generated from the chart: ``python -m tests.deploy.regenerate``.

- ``deploy/k8s.yaml`` and ``deploy/epp.yaml``: ``helm template`` of ``ci/default.yaml`` / ``ci/epp.yaml``;
- ``deploy/helm/kvroute/dashboards/kvroute.json``: a copy of ``deploy/grafana/kvroute.json`` (Helm only
  reads files inside the chart).
"""

from __future__ import annotations

import shutil

from tests.deploy.chart import CHART_DASHBOARD, DASHBOARD, ROOT, STATIC, static_text


def main() -> None:
    shutil.copyfile(DASHBOARD, CHART_DASHBOARD)
    print(f"wrote {CHART_DASHBOARD.relative_to(ROOT)}")
    for manifest in STATIC:
        manifest.path.write_text(static_text(manifest))
        print(f"wrote {manifest.path.relative_to(ROOT)} (ci/{manifest.mode}.yaml)")


if __name__ == "__main__":
    main()
