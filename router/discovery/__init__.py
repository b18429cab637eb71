"""Worker discovery: sources that see where workers are, merged and applied to the pool at run time.

``Discovery`` (the reconciler) runs any number of :class:`DiscoverySource` s next to the static workers
of the config, and applies their union to a :class:`WorkerSink` (the worker registry, via
:class:`RegistrySink`). Sources: :class:`KubernetesSource` (pods by label selector, list+watch),
:class:`DnsSource` (a headless Service's A/AAAA or SRV records). :class:`EventSourceProbe` fills a
discovered worker's KV-event endpoints from vLLM's ``GET /kv_event_sources``. See docs/discovery.md.
"""

from kvroute.router.discovery.base import Backoff, DiscoverySource, ReportError, ReportWorkers, WorkerSink
from kvroute.router.discovery.build import build_discovery, build_sources
from kvroute.router.discovery.dns import DnsSource
from kvroute.router.discovery.event_sources import (
    EventSource,
    EventSourceLookup,
    EventSourceProbe,
    apply_event_sources,
    fetch_event_sources,
    lookup_event_sources,
    parse_event_sources,
)
from kvroute.router.discovery.kubernetes import (
    KubeApi,
    KubeConfigError,
    KubernetesSource,
    discover_api,
    in_cluster_api,
    kubeconfig_api,
    worker_from_pod,
)
from kvroute.router.discovery.reconciler import Discovery, DiscoveryMetrics
from kvroute.router.discovery.sink import RegistrySink

__all__ = [
    "Backoff",
    "Discovery",
    "DiscoveryMetrics",
    "DiscoverySource",
    "DnsSource",
    "EventSource",
    "EventSourceLookup",
    "EventSourceProbe",
    "KubeApi",
    "KubeConfigError",
    "KubernetesSource",
    "RegistrySink",
    "ReportError",
    "ReportWorkers",
    "WorkerSink",
    "apply_event_sources",
    "build_discovery",
    "build_sources",
    "discover_api",
    "fetch_event_sources",
    "in_cluster_api",
    "kubeconfig_api",
    "lookup_event_sources",
    "parse_event_sources",
    "worker_from_pod",
]
