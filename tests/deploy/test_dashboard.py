"""The Grafana dashboard deploy/grafana/kvroute.json queries only series kvroute really exports.

A router (policy kvaware) runs in front of a simulated fleet, answers a few completions (one prompt
repeated, so the engines report cached tokens; one stream, for the time to first byte; one unknown model),
and every metric name of every panel's PromQL must be in its ``/metrics``, with the right type for the way
it is used: ``_bucket``/``_sum``/``_count`` of a histogram, ``_total`` of a counter, a gauge by its name.
So a renamed metric breaks this test instead of silently emptying a panel.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.chart import DASHBOARD
from tests.end_to_end.conftest import eventually, routed_fleet, words

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_DURATION = re.compile(r"\b(?:\d+(?:ms|s|m|h|d|w|y))+\b")  # offset 5m, @ ... (ranges go with [])
_NUMBER = re.compile(r"\b\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\b")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
_SUFFIXES = {"_bucket": "histogram", "_sum": "histogram", "_count": "histogram", "_total": "counter"}
#: Series that must carry samples after the traffic above, not only be declared.
MUST_HAVE_DATA = {
    "kvroute_requests_total",
    "kvroute_time_to_first_byte_seconds_bucket",
    "kvroute_request_duration_seconds_bucket",
    "kvroute_routing_decision_seconds_bucket",
    "kvroute_predicted_cached_tokens_total",
    "kvroute_reported_cached_tokens_total",
    "kvroute_cached_prompt_tokens_total",
    "kvroute_prompt_tokens_total",
    "kvroute_checked_decisions_total",
    "kvroute_predicted_hit_tokens_total",
    "kvroute_route_plans_total",
    "kvroute_index_blocks",
    "kvroute_index_events_applied_total",
    "kvroute_worker_healthy",
    "kvroute_worker_kv_cache_usage",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels, numbers left out)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _GROUPING.sub("", text)
    text = _DURATION.sub("0", text)
    text = _NUMBER.sub("0", text)
    names = set()
    for match in _IDENT.finditer(text):
        if text[match.end() :].lstrip().startswith("("):  # a function call
            continue
        if match.group(0) not in _KEYWORDS:
            names.add(match.group(0))
    return names


def test_metric_names_parser() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, route) (rate(a_seconds_bucket{job=~"$job", x="y{z}"}[$__rate_interval])))'
        " / clamp_min(sum without (worker) (b_total offset 1h30m), 1e-9) + on (model) group_left (c) min by (w) (g)"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "g"}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


def dashboard_queries() -> dict[str, list[str]]:
    """Panel title -> its PromQL expressions, plus the template variables' label_values() queries."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries: dict[str, list[str]] = {}
    for panel in panels(dashboard):
        exprs = [t["expr"] for t in panel.get("targets", [])]
        if exprs:
            queries[panel["title"]] = exprs
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            found = re.match(r"label_values\((.*),\s*\w+\)$", var["definition"])
            assert found, var["definition"]
            queries[f"variable ${var['name']}"] = [found.group(1)]
    return queries


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvroute" and dashboard["title"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert "datasource" in variables
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval", "__interval", "__range"}
            assert used <= variables, f"{panel['title']}: unknown variables {used - variables}"
    titles = " ".join(p["title"].lower() for p in panels(dashboard))
    for topic in (
        "request rate",
        "errors",
        "time to first token",
        "decision",
        "predicted",
        "stale",
        "blocks",
        "lag",
        "gaps",
        "health",
        "in flight",
        "conversation",
        "fallbacks",
    ):
        assert topic in titles, f"no panel about {topic}"


class Exposition:
    """What one /metrics answer declares: family name -> type, and the sample names with data."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: set[str] = set()
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            self.samples.update(s.name for s in family.samples)

    def problem(self, name: str) -> str | None:
        """Why ``name`` is not a series kvroute exports (None when it is)."""
        for suffix, kind in _SUFFIXES.items():
            base = name.removesuffix(suffix)
            if base != name and self.types.get(base) == kind:
                return None
        kind = self.types.get(name)
        if kind in ("gauge", "untyped", "unknown"):
            return None
        if kind == "histogram":
            return "a histogram: query its _bucket, _sum or _count"
        if kind == "counter":
            return "a counter: query it as _total"
        return "not exported"


def test_exposition_checks_how_a_metric_is_used() -> None:
    exp = Exposition(
        "# TYPE h_seconds histogram\n"
        'h_seconds_bucket{le="+Inf"} 1\nh_seconds_count 1\nh_seconds_sum 0.5\n'
        "# TYPE c_total counter\nc_total 3\n"
        "# TYPE g gauge\ng 1\n"
    )
    assert [exp.problem(n) for n in ("h_seconds_bucket", "h_seconds_sum", "c_total", "g")] == [None] * 4
    assert "histogram" in (exp.problem("h_seconds") or "")
    assert "counter" in (exp.problem("c") or "")
    assert exp.problem("g_total") == exp.problem("missing") == "not exported"
    assert exp.problem("c_bucket") == "not exported"  # a suffix only counts on the right type


async def test_every_dashboard_metric_is_exported() -> None:
    async with routed_fleet(2, policy="kvaware") as (fleet, url, _), httpx.AsyncClient(timeout=30) as client:
        prompt = words(120, "dash")
        body = {"model": fleet.model, "prompt": prompt, "max_tokens": 4}
        for _ in range(3):  # the same prompt again: the engine reports cached tokens the plan predicted
            assert (await client.post(f"{url}/v1/completions", json=body)).status_code == 200
            await eventually(lambda: _blocks(client, url), what="the first prompt's blocks in the index")
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        assert (await client.post(f"{url}/v1/completions", json=stream)).status_code == 200
        assert (await client.post(f"{url}/v1/completions", json={**body, "model": "nope"})).status_code == 404

        async def exposition() -> Exposition | None:
            text = (await client.get(f"{url}/metrics")).text
            exp = Exposition(text)
            return exp if exp.samples >= MUST_HAVE_DATA else None

        exp = await eventually(exposition, what="samples for every series in MUST_HAVE_DATA")

    problems = []
    queried: set[str] = set()
    for title, exprs in dashboard_queries().items():
        for expr in exprs:
            names = metric_names(expr)
            assert names, f"{title}: no metric in {expr}"
            queried |= names
            problems += [f"{title}: {n} is {why}" for n in sorted(names) if (why := exp.problem(n))]
    assert not problems, "\n".join(problems)
    assert queried >= MUST_HAVE_DATA, f"MUST_HAVE_DATA names series no panel shows: {MUST_HAVE_DATA - queried}"


async def _blocks(client: httpx.AsyncClient, url: str) -> int:
    stats = (await client.get(f"{url}/admin/index/stats")).json()
    return sum(w["blocks"] for w in stats["workers"])
