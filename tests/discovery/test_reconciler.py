"""The reconciler's rules: union of sources, static workers untouched, grace period, failures keep sets."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
from kvroute.config import WorkerConfig
from kvroute.router.discovery import Discovery, DiscoverySource, ReportError, ReportWorkers
from prometheus_client import CollectorRegistry

from tests.discovery.conftest import RecordingSink, sample
from tests.polling import eventually


def w(worker_id: str, port: int = 8000) -> WorkerConfig:
    return WorkerConfig(url=f"http://10.0.0.{len(worker_id)}:{port}", id=worker_id)


class PushSource:
    """A discovery source driven by the test: :meth:`push` a set, :meth:`fail` an attempt, or crash."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._items: asyncio.Queue[Mapping[str, WorkerConfig] | str] = asyncio.Queue()
        self.runs = 0

    def push(self, *workers: WorkerConfig) -> None:
        self._items.put_nowait({cfg.worker_id: cfg for cfg in workers})

    def fail(self, message: str = "API unreachable") -> None:
        self._items.put_nowait(message)

    def crash(self) -> None:
        self._items.put_nowait("!crash")

    async def run(self, report: ReportWorkers, error: ReportError) -> None:
        self.runs += 1
        while True:
            item = await self._items.get()
            if item == "!crash":
                raise RuntimeError("source bug")
            if isinstance(item, str):
                error(item)
            else:
                report(item)


def test_push_source_is_a_discovery_source() -> None:
    assert isinstance(PushSource("x"), DiscoverySource)


async def started(discovery: Discovery) -> Discovery:
    await discovery.start()
    return discovery


async def test_union_of_sources_adds_a_worker_once(sink: RecordingSink) -> None:
    reg = CollectorRegistry()
    k8s, dns = PushSource("kubernetes"), PushSource("dns")
    discovery = await started(Discovery([k8s, dns], sink, grace_s=0, registry=reg))
    try:
        k8s.push(w("a"), w("b"))
        dns.push(w("b"), w("c"))
        await eventually(lambda: set(sink.workers) == {"a", "b", "c"}, what="union applied")
        assert sorted(sink.log) == [("add", "a"), ("add", "b"), ("add", "c")]
        # "b" belongs to the first source given: its removal there is not a removal while dns sees it.
        assert discovery.snapshot()["applied"] == {"a": "kubernetes", "b": "kubernetes", "c": "dns"}
        assert sample(reg, "kvroute_discovery_workers", {"source": "dns"}) == 2
        assert sample(reg, "kvroute_discovery_changes_total", {"source": "kubernetes", "change": "added"}) == 2
        k8s.push(w("a"))
        await asyncio.sleep(0.1)
        await discovery.reconcile()
        assert set(sink.workers) == {"a", "b", "c"}
    finally:
        await discovery.stop()


async def test_static_workers_are_never_touched(sink: RecordingSink) -> None:
    src = PushSource("dns")
    discovery = await started(Discovery([src], sink, static_ids=["static-1"], grace_s=0))
    try:
        src.push(w("static-1"), w("x"))
        await eventually(lambda: "x" in sink.workers)
        src.push()
        await eventually(lambda: "x" not in sink.workers)
        assert ("add", "static-1") not in sink.log and ("remove", "static-1") not in sink.log
    finally:
        await discovery.stop()


async def test_flapping_within_grace_does_not_churn_and_a_real_departure_is_removed(sink: RecordingSink) -> None:
    reg = CollectorRegistry()
    src = PushSource("kubernetes")
    discovery = await started(Discovery([src], sink, grace_s=0.6, registry=reg))
    try:
        src.push(w("a"), w("b"))
        await eventually(lambda: set(sink.workers) == {"a", "b"})
        for _ in range(3):  # "b" flaps: unready, ready again, faster than the grace period
            src.push(w("a"))
            await asyncio.sleep(0.1)
            src.push(w("a"), w("b"))
            await asyncio.sleep(0.1)
        assert sink.log == [("add", "a"), ("add", "b")], "flapping churned the pool"
        src.push(w("a"))
        await asyncio.sleep(0.2)
        assert "b" in sink.workers, "removed before the grace period ended"
        assert discovery.snapshot()["pending_removal_in_s"]["b"] > 0
        await eventually(lambda: "b" not in sink.workers, what="removal after the grace period")
        assert sink.log[-1] == ("remove", "b")
        assert sample(reg, "kvroute_discovery_changes_total", {"source": "kubernetes", "change": "removed"}) == 1
    finally:
        await discovery.stop()


async def test_grace_is_measured_on_the_clock() -> None:
    """The same rule, stepped with a manual clock and explicit passes (no waiting)."""
    sink = RecordingSink()
    now = [1000.0]
    src = PushSource("dns")
    discovery = Discovery([src], sink, grace_s=30.0, clock=lambda: now[0])
    discovery._on_report("dns", {"a": w("a")})
    await discovery.reconcile()
    discovery._on_report("dns", {})
    await discovery.reconcile()
    now[0] += 29.9
    await discovery.reconcile()
    assert "a" in sink.workers
    now[0] += 0.2
    await discovery.reconcile()
    assert "a" not in sink.workers


async def test_changed_address_replaces_the_worker(sink: RecordingSink) -> None:
    reg = CollectorRegistry()
    src = PushSource("kubernetes")
    discovery = await started(Discovery([src], sink, grace_s=60, registry=reg))
    try:
        src.push(w("pod-0", 8000))
        await eventually(lambda: "pod-0" in sink.workers)
        src.push(w("pod-0", 9000))  # recreated StatefulSet pod: same name, new address
        await eventually(lambda: sink.workers.get("pod-0") is not None and sink.workers["pod-0"].url.endswith(":9000"))
        assert sink.log == [("add", "pod-0"), ("remove", "pod-0"), ("add", "pod-0")]
        assert sample(reg, "kvroute_discovery_changes_total", {"source": "kubernetes", "change": "updated"}) == 1
    finally:
        await discovery.stop()


async def test_a_failing_source_keeps_its_last_set(sink: RecordingSink, caplog: pytest.LogCaptureFixture) -> None:
    reg = CollectorRegistry()
    src = PushSource("kubernetes")
    discovery = await started(Discovery([src], sink, grace_s=0, registry=reg))
    try:
        src.push(w("a"), w("b"))
        await eventually(lambda: set(sink.workers) == {"a", "b"})
        src.fail("connection refused")
        src.fail("connection refused")
        await eventually(lambda: sample(reg, "kvroute_discovery_errors_total", {"source": "kubernetes"}) == 2)
        await discovery.reconcile()
        assert set(sink.workers) == {"a", "b"}, "an outage emptied the pool"
        assert "keeping its last 2 workers" in caplog.text
    finally:
        await discovery.stop()


async def test_a_crashing_source_is_restarted_and_keeps_its_set(sink: RecordingSink) -> None:
    reg = CollectorRegistry()
    src = PushSource("dns")
    discovery = await started(Discovery([src], sink, grace_s=0, registry=reg))
    try:
        src.push(w("a"))
        await eventually(lambda: "a" in sink.workers)
        src.crash()
        await eventually(lambda: src.runs == 2, timeout=5, what="restart after a crash")
        assert "a" in sink.workers
        assert sample(reg, "kvroute_discovery_errors_total", {"source": "dns"}) == 1
        src.push(w("a"), w("b"))
        await eventually(lambda: "b" in sink.workers)
    finally:
        await discovery.stop()


async def test_a_refused_add_is_retried(sink: RecordingSink, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvroute.router.discovery import reconciler

    monkeypatch.setattr(reconciler, "RETRY_ADD_S", 0.1)
    src = PushSource("dns")
    sink.refuse.add("a")
    discovery = await started(Discovery([src], sink, grace_s=0))
    try:
        src.push(w("a"))
        await eventually(lambda: discovery.snapshot()["failed_adds"].get("a", 0) >= 2, what="retries")
        sink.refuse.clear()
        await eventually(lambda: "a" in sink.workers, what="added once accepted")
        assert discovery.snapshot()["failed_adds"] == {}
    finally:
        await discovery.stop()


async def test_enrich_fills_before_the_add_and_failures_do_not_block(sink: RecordingSink) -> None:
    async def enrich(cfg: WorkerConfig) -> WorkerConfig:
        if cfg.worker_id == "broken":
            raise RuntimeError("lookup exploded")
        return cfg.model_copy(update={"kv_events": "tcp://10.0.0.1:5557"})

    src = PushSource("dns")
    discovery = await started(Discovery([src], sink, grace_s=0, enrich=enrich))
    try:
        src.push(w("a"), w("broken"))
        await eventually(lambda: set(sink.workers) == {"a", "broken"})
        assert sink.workers["a"].kv_events == "tcp://10.0.0.1:5557"
        assert sink.workers["broken"].kv_events is None
    finally:
        await discovery.stop()


async def test_wait_synced_and_names() -> None:
    sink = RecordingSink()
    with pytest.raises(ValueError, match="unique"):
        Discovery([PushSource("x"), PushSource("x")], sink)
    a, b = PushSource("a"), PushSource("b")
    discovery = await started(Discovery([a, b], sink, grace_s=0))
    try:
        a.push(w("one"))
        assert not await discovery.wait_synced(0.2)
        b.push()
        assert await discovery.wait_synced(5)
        assert set(sink.workers) == {"one"}
        assert discovery.workers.keys() == {"one"}
    finally:
        await discovery.stop()
