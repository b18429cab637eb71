"""DNS discovery: the workers are the addresses a name resolves to, polled every ``interval_s``.

For users without Kubernetes API access: a headless Service's name resolves to one A/AAAA record per
ready pod (``port`` from the config), or with ``srv: true`` its SRV name
(``_http._tcp.vllm.ns.svc.cluster.local``) gives host and port per pod. Uses dnspython's async resolver
without a cache, so each poll sees what the server says now.

What counts as an answer: NXDOMAIN and "no records" are authoritative ("no workers now"; the reconciler's
grace period still protects against a blip). Timeouts, SERVFAIL and refusals are failures: the last set
stays in force and the lookup is retried sooner, with a backoff bounded by the interval.
"""

from __future__ import annotations

import asyncio
import logging

import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdatatype
import dns.resolver
from kvroute.config import DnsDiscoveryConfig, WorkerConfig
from kvroute.router.discovery.base import Backoff, ReportError, ReportWorkers, describe

log = logging.getLogger("kvroute.discovery")

#: More addresses than this in one answer is not a worker pool but a mistake (or an attack).
MAX_WORKERS = 4096


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class DnsSource:
    """A :class:`~kvroute.router.discovery.base.DiscoverySource` over DNS (A/AAAA or SRV)."""

    def __init__(
        self,
        config: DnsDiscoveryConfig,
        *,
        name: str = "dns",
        timeout_s: float = 2.0,
        resolver: dns.asyncresolver.Resolver | None = None,
    ) -> None:
        self.name = name
        self.config = config
        if resolver is None:
            resolver = dns.asyncresolver.Resolver(configure=config.nameserver is None)
            if config.nameserver is not None:
                resolver.nameservers = [config.nameserver]
            resolver.port = config.nameserver_port
            resolver.cache = None
        resolver.timeout = timeout_s
        resolver.lifetime = timeout_s
        self.resolver = resolver
        #: With the system's resolver, a short name gets its search domains (as getaddrinfo would);
        #: a nameserver given in the config is asked exactly the name configured.
        self._search = config.nameserver is None

    async def _records(self, qname: str, rdtype: dns.rdatatype.RdataType) -> list[str]:
        """Addresses (A/AAAA) for ``qname``; empty for NXDOMAIN / no records; raises on failures."""
        try:
            answer = await self.resolver.resolve(qname, rdtype, search=self._search)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        return [rr.to_text() for rr in answer]

    async def _addresses(self, qname: str) -> list[str]:
        a, aaaa = await asyncio.gather(self._records(qname, dns.rdatatype.A), self._records(qname, dns.rdatatype.AAAA))
        return sorted(set(a)) + sorted(set(aaaa))

    async def resolve(self) -> dict[str, WorkerConfig]:
        """One lookup: the complete set of workers the name stands for now."""
        if self.config.srv:
            return await self._resolve_srv()
        port = self.config.port
        assert port is not None  # the config requires it without srv
        workers: dict[str, WorkerConfig] = {}
        for address in (await self._addresses(self.config.name))[:MAX_WORKERS]:
            cfg = WorkerConfig(url=_url(address, port))
            workers[cfg.worker_id] = cfg
        return workers

    async def _resolve_srv(self) -> dict[str, WorkerConfig]:
        try:
            answer = await self.resolver.resolve(self.config.name, dns.rdatatype.SRV, search=self._search)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return {}
        # Servers usually add the targets' addresses (additional section): use them, ask for the rest.
        glue: dict[str, list[str]] = {}
        if answer.response is not None:
            for rrset in answer.response.additional:
                if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    glue.setdefault(rrset.name.to_text(), []).extend(rr.to_text() for rr in rrset)
        targets: dict[tuple[str, int], None] = {}
        for rr in answer:
            target = rr.target.to_text()
            if rr.target == dns.name.root:
                continue  # "." = the service is decidedly not available here (RFC 2782)
            targets[(target, int(rr.port))] = None
        workers: dict[str, WorkerConfig] = {}
        for target, port in list(targets)[:MAX_WORKERS]:
            addresses = sorted(glue.get(target, [])) or await self._addresses(target)
            if not addresses:
                log.debug("SRV target %s has no address: skipped", target)
                continue
            host = target.rstrip(".")
            # The id is the target name, stable across pod restarts for StatefulSets; the URL uses the
            # address, so the router does not depend on the system resolver agreeing with this one.
            address = addresses[0]
            cfg = WorkerConfig(url=_url(address, port), id=f"{host}:{port}", p2p_host=address)
            workers[cfg.worker_id] = cfg
        return workers

    async def run(self, report: ReportWorkers, error: ReportError) -> None:
        backoff = Backoff(initial_s=min(0.5, self.config.interval_s), max_s=self.config.interval_s)
        last: dict[str, WorkerConfig] | None = None
        while True:
            try:
                workers = await self.resolve()
            except asyncio.CancelledError:
                raise
            except (dns.exception.DNSException, OSError, ValueError) as exc:
                error(f"resolving {self.config.name}: {describe(exc)}")
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            if workers != last:
                if not workers:
                    log.warning("%s resolves to no workers", self.config.name)
                report(workers)
                last = workers
            await asyncio.sleep(self.config.interval_s)
