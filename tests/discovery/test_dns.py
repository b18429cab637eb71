"""The DNS source against a real DNS server on loopback (dnslib): records added and removed are picked up,
failures keep the last set."""

from __future__ import annotations

from kvroute.config import DnsDiscoveryConfig
from kvroute.router.discovery import Discovery, DnsSource
from prometheus_client import CollectorRegistry

from tests.discovery.conftest import RecordingSink, sample
from tests.discovery.dns_server import LoopbackDns
from tests.polling import eventually

NAME = "vllm.inference.svc.cluster.local"
SRV_NAME = "_http._tcp.vllm.inference.svc.cluster.local"


def source(dns: LoopbackDns, **options: object) -> DnsSource:
    config = DnsDiscoveryConfig.model_validate(
        {"name": NAME, "port": 8000, "interval_s": 0.1, "nameserver": "127.0.0.1", "nameserver_port": dns.port}
        | options
    )
    return DnsSource(config, timeout_s=0.5)


async def test_a_and_aaaa_records_become_workers(loopback_dns: LoopbackDns) -> None:
    loopback_dns.zone.set(NAME, [("A", "10.0.0.2"), ("A", "10.0.0.1"), ("AAAA", "fd00::5")])
    workers = await source(loopback_dns).resolve()
    assert {k: v.url for k, v in workers.items()} == {
        "10.0.0.1:8000": "http://10.0.0.1:8000",
        "10.0.0.2:8000": "http://10.0.0.2:8000",
        "fd00::5:8000": "http://[fd00::5]:8000",
    }
    assert workers["10.0.0.1:8000"].kv_events is None  # left to /kv_event_sources


async def test_srv_records_give_host_and_port(loopback_dns: LoopbackDns) -> None:
    zone = loopback_dns.zone
    zone.set(
        SRV_NAME,
        [
            ("SRV", ("vllm-0.vllm.inference.svc.cluster.local.", 8001)),
            ("SRV", ("vllm-1.vllm.inference.svc.cluster.local.", 8002)),
        ],
    )
    zone.set("vllm-0.vllm.inference.svc.cluster.local", [("A", "10.0.1.10")])
    zone.set("vllm-1.vllm.inference.svc.cluster.local", [("A", "10.0.1.11")])
    src = source(loopback_dns, name=SRV_NAME, srv=True, port=None)
    workers = await src.resolve()
    assert {k: v.url for k, v in workers.items()} == {
        "vllm-0.vllm.inference.svc.cluster.local:8001": "http://10.0.1.10:8001",
        "vllm-1.vllm.inference.svc.cluster.local:8002": "http://10.0.1.11:8002",
    }
    # Without glue in the additional section, the targets are resolved one by one.
    zone.glue = False
    zone.queries.clear()
    assert (await src.resolve()).keys() == workers.keys()
    assert ("vllm-0.vllm.inference.svc.cluster.local.", "A") in zone.queries


async def test_unknown_name_is_an_empty_pool_not_an_error(loopback_dns: LoopbackDns) -> None:
    assert await source(loopback_dns, name="nothing.here.local").resolve() == {}


async def test_records_added_and_removed_are_picked_up(loopback_dns: LoopbackDns, sink: RecordingSink) -> None:
    zone = loopback_dns.zone
    zone.set(NAME, [("A", "10.0.0.1")])
    reg = CollectorRegistry()
    discovery = Discovery([source(loopback_dns)], sink, grace_s=0.3, registry=reg)
    await discovery.start()
    try:
        await eventually(lambda: set(sink.workers) == {"10.0.0.1:8000"}, what="first record")
        zone.set(NAME, [("A", "10.0.0.1"), ("A", "10.0.0.2")])
        await eventually(lambda: set(sink.workers) == {"10.0.0.1:8000", "10.0.0.2:8000"}, what="record added")
        zone.set(NAME, [("A", "10.0.0.2")])
        await eventually(lambda: set(sink.workers) == {"10.0.0.2:8000"}, what="record removed")
        assert sample(reg, "kvroute_discovery_changes_total", {"source": "dns", "change": "removed"}) == 1
        assert sample(reg, "kvroute_discovery_workers", {"source": "dns"}) == 1
    finally:
        await discovery.stop()


async def test_servfail_and_timeouts_keep_the_last_set(loopback_dns: LoopbackDns) -> None:
    zone = loopback_dns.zone
    zone.set(NAME, [("A", "10.0.0.1"), ("A", "10.0.0.2")])
    sink = RecordingSink()
    reg = CollectorRegistry()
    src = source(loopback_dns)
    discovery = Discovery([src], sink, grace_s=0, registry=reg)
    await discovery.start()
    try:
        await eventually(lambda: len(sink.workers) == 2)
        zone.mode = "servfail"
        await eventually(lambda: sample(reg, "kvroute_discovery_errors_total", {"source": "dns"}) >= 2, what="errors")
        zone.mode = "drop"
        before = sample(reg, "kvroute_discovery_errors_total", {"source": "dns"})
        await eventually(lambda: sample(reg, "kvroute_discovery_errors_total", {"source": "dns"}) > before, timeout=10)
        await discovery.reconcile()
        assert len(sink.workers) == 2, "a DNS outage emptied the pool"
        zone.mode = "ok"
        zone.set(NAME, [("A", "10.0.0.3")])
        await eventually(lambda: set(sink.workers) == {"10.0.0.3:8000"}, what="recovery")
    finally:
        await discovery.stop()


def test_config_requires_a_port_without_srv() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="port is required"):
        DnsDiscoveryConfig(name=NAME)
    assert DnsDiscoveryConfig(name=SRV_NAME, srv=True).port is None
