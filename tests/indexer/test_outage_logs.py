"""A backend outage fails every lookup: it is counted each time and logged once per interval, not per request."""

from __future__ import annotations

import logging

import pytest
from kvroute.indexer.backend import IndexUnavailable
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.redis_index import RedisIndex
from kvroute.indexer.service import KVIndexer

from tests.conftest import free_port


async def test_lookups_during_a_redis_outage_log_one_line(caplog: pytest.LogCaptureFixture) -> None:
    backend = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)  # nothing listens there
    indexer = KVIndexer(backend, block_sizes={"m": 16}, metrics=IndexerMetrics())  # its own counters
    caplog.set_level(logging.WARNING, logger="kvroute.indexer")
    failed = 0
    for _ in range(50):
        with pytest.raises(IndexUnavailable):
            await indexer.lookup_keys("m", [1, 2, 3])
        failed += 1
    lines = [r for r in caplog.records if "index lookup failed" in r.getMessage()]
    assert failed == 50 and len(lines) == 1
    errors = indexer.metrics.backend_errors.labels("redis", "lookup")._value.get()
    assert errors == 50
    await backend.close()
