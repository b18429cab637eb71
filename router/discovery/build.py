"""From the config to a running discovery: what the composition roots call (a few lines each)."""

from __future__ import annotations

from kvroute.config import DiscoveryConfig, RouterConfig
from kvroute.router.discovery.base import DiscoverySource
from kvroute.router.discovery.dns import DnsSource
from kvroute.router.discovery.event_sources import EventSourceProbe
from kvroute.router.discovery.kubernetes import KubernetesSource
from kvroute.router.discovery.reconciler import Discovery
from kvroute.router.discovery.sink import RegistrySink, _Registry
from kvroute.router.transport import Transport
from prometheus_client import CollectorRegistry


def build_sources(config: DiscoveryConfig) -> list[DiscoverySource]:
    """The configured sources, Kubernetes first (it owns a worker both see). Raises ``KubeConfigError``
    when Kubernetes discovery is configured without usable credentials: better not to start at all."""
    sources: list[DiscoverySource] = []
    if config.kubernetes is not None:
        sources.append(KubernetesSource(config.kubernetes))
    if config.dns is not None:
        sources.append(DnsSource(config.dns))
    return sources


def build_discovery(
    config: RouterConfig,
    registry: _Registry,
    transport: Transport,
    metrics_registry: CollectorRegistry | None = None,
    probe: EventSourceProbe | None = None,
) -> Discovery | None:
    """Discovery feeding ``registry`` (a ``WorkerRegistry``), or None when no source is configured.

    Discovered workers without KV-event endpoints get them from ``/kv_event_sources`` unless the workers
    connect to the router's own bound socket (``index.events_bind``), where there is nothing to look up.
    ``probe``: the router's one ``/kv_event_sources`` prober (its metrics exist once per registry)."""
    sources = build_sources(config.discovery)
    if not sources:
        return None
    if probe is None and not config.index.events_bind:
        probe = EventSourceProbe(transport, metrics_registry)
    return Discovery(
        sources,
        RegistrySink(registry),
        static_ids=[w.worker_id for w in config.workers],
        grace_s=config.discovery.grace_s,
        registry=metrics_registry,
        enrich=probe.fill if probe is not None else None,
    )
