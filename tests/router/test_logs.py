"""Repeated failures are logged once per interval, with the count of what was suppressed."""

from __future__ import annotations

import logging

import pytest
from kvroute.logs import RateLimitedLog


def test_rate_limited_log(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("kvroute.test"), interval_s=3600)
    with caplog.at_level(logging.WARNING, "kvroute.test"):
        written = [log.warning("redis", "index down: %s", i) for i in range(1000)]
        log.warning("tokenizer", "no tokens")
    assert written.count(True) == 1
    assert [r.getMessage() for r in caplog.records] == ["index down: 0", "no tokens"]
    log.interval_s = 0.0
    with caplog.at_level(logging.WARNING, "kvroute.test"):
        caplog.clear()
        log.warning("redis", "index down again")
    assert caplog.records[0].getMessage() == "index down again (999 similar suppressed in the last 0 s)"


def test_distinct_keys_are_bounded() -> None:
    log = RateLimitedLog(logging.getLogger("kvroute.test"), max_keys=10)
    for i in range(100):
        log.warning(f"k{i}", "x")
    assert len(log._last) <= 10
