"""A real DNS server on a free loopback UDP port (dnslib, in a thread), whose zone the tests edit live.

It answers like a cluster DNS for a headless Service: one A/AAAA record per ready pod, SRV records with
the targets' addresses in the additional section (``glue``), NXDOMAIN for unknown names. Faults:
``mode = "servfail"`` (SERVFAIL to everything) and ``"drop"`` (no answer at all: the client times out).
"""

from __future__ import annotations

import threading
from typing import Literal

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSRecord
from dnslib.server import BaseResolver, DNSError, DNSLogger, DNSServer


class Zone(BaseResolver):  # type: ignore[misc]
    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: name (absolute, with the trailing dot) -> list of (type, value): ("A", "10.0.0.1"),
        #: ("SRV", (target, port)).
        self.records: dict[str, list[tuple[str, object]]] = {}
        self.mode: Literal["ok", "servfail", "drop"] = "ok"
        self.glue = True
        self.queries: list[tuple[str, str]] = []

    def set(self, name: str, records: list[tuple[str, object]]) -> None:
        with self.lock:
            self.records[name if name.endswith(".") else name + "."] = list(records)

    def remove(self, name: str) -> None:
        with self.lock:
            self.records.pop(name if name.endswith(".") else name + ".", None)

    def _rr(self, name: str, kind: str, value: object) -> RR:
        if kind == "A":
            return RR(name, QTYPE.A, rdata=A(str(value)), ttl=5)
        if kind == "AAAA":
            return RR(name, QTYPE.AAAA, rdata=AAAA(str(value)), ttl=5)
        target, port = value  # type: ignore[misc]
        return RR(name, QTYPE.SRV, rdata=SRV(priority=0, weight=100, port=port, target=target), ttl=5)

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        qname, qtype = str(request.q.qname), QTYPE[request.q.qtype]
        with self.lock:
            self.queries.append((qname, qtype))
            mode = self.mode
            records = {name: list(rrs) for name, rrs in self.records.items()}
        if mode == "drop":
            raise DNSError("dropped on purpose")  # dnslib then sends nothing: the client times out
        reply = request.reply()
        if mode == "servfail":
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        if qname not in records:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for kind, value in records[qname]:
            if kind == qtype:
                reply.add_answer(self._rr(qname, kind, value))
                if kind == "SRV" and self.glue:
                    target = str(value[0])  # type: ignore[index]
                    for gkind, gvalue in records.get(target, []):
                        if gkind in ("A", "AAAA"):
                            reply.add_ar(self._rr(target, gkind, gvalue))
        return reply


class LoopbackDns:
    """``with LoopbackDns() as dns: dns.zone.set(...); dns.port``."""

    def __init__(self) -> None:
        self.zone = Zone()
        self.server = DNSServer(self.zone, address="127.0.0.1", port=0, logger=DNSLogger(logf=lambda _s: None))
        self.port: int = self.server.server.server_address[1]

    def __enter__(self) -> LoopbackDns:
        self.server.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self.server.server.server_close()
