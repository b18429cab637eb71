"""Ask a vLLM worker where it publishes its KV events: ``GET /kv_event_sources`` (vLLM >= 0.32).

The answer lists, per data-parallel rank, the publisher's endpoint as bound (``tcp://*:0`` gets one
ephemeral port per rank, read back after the bind), the replay endpoint (or null) and the topic::

    {"sources": [{"data_parallel_rank": 0, "endpoint": "tcp://10.0.0.5:41001",
                  "replay_endpoint": "tcp://10.0.0.5:41003", "topic": "kv-events"}, ...]}

Released vLLM (0.32, 0.33, the CPU build this project tests against) answers a map of rank to its publisher
config instead, ``{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ..., ...}}``;
vLLM's history also has the ``sources`` envelope above and a bare JSON array of the same entries. All
three are accepted.
Entries come sorted by rank; unknown keys are ignored. A wildcard host (``*``, ``0.0.0.0``, ``::``) means
"the worker's own address" and is replaced by the host of the worker's URL.

The answer comes from the network, so it is treated as hostile: a bounded body, strict types, bounded
counts and lengths, ``tcp://`` only (``ipc://`` only from a worker on this machine), and hosts that must
be the worker's own (its URL host or an address that name resolves to): a worker must not be able to
send the router's subscribers to some other machine. Anything else is rejected with one log line; no
exception escapes :func:`lookup_event_sources` (except cancellation).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import orjson
from kvroute.config import WorkerConfig
from kvroute.router.discovery.base import describe
from kvroute.router.transport import Transport
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("kvroute.discovery")

PATH = "/kv_event_sources"
#: A real answer is ~150 bytes per rank; 64 KiB leaves room for hundreds of ranks and no more.
MAX_BYTES = 64 * 1024
MAX_RANKS = 1024  # WorkerConfig.dp_size's bound
MAX_ENDPOINT_CHARS = 512
MAX_TOPIC_CHARS = 256
_WILDCARDS = {"*", "0.0.0.0", "::"}

Outcome = Literal["found", "disabled", "absent", "rejected", "failed", "unusable"]
OUTCOMES: tuple[Outcome, ...] = ("found", "disabled", "absent", "rejected", "failed", "unusable")


@dataclass(frozen=True, slots=True)
class EventSource:
    """One data-parallel rank's publisher, with its host already resolved to a routable one."""

    rank: int
    endpoint: str
    replay: str | None
    topic: str


@dataclass(frozen=True, slots=True)
class EventSourceLookup:
    """What one lookup found. ``sources`` is sorted by rank and non-empty only when ``outcome == "found"``.

    Outcomes: ``found``; ``disabled`` (the worker answered an empty list: KV events are off);
    ``absent`` (404/405: vLLM older than 0.32, or not vLLM); ``rejected`` (malformed or hostile answer);
    ``failed`` (network error, timeout, 5xx); ``unusable`` is left to callers that cannot use a valid answer.
    """

    outcome: Outcome
    sources: tuple[EventSource, ...] = ()
    reason: str = ""


class _Rejected(ValueError):
    pass


def _host_of(url: str) -> str:
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"worker URL without a host: {url!r}")
    return host.lower()


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def worker_addresses(host: str, timeout_s: float = 2.0) -> set[str]:
    """The host itself and, for a name, the addresses it resolves to (what a published IP may be)."""
    names = {host.lower()}
    try:
        ipaddress.ip_address(host)
        return names
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError) as exc:
        log.debug("cannot resolve %s to check its event endpoints: %s", host, describe(exc))
        return names
    for info in infos:
        names.add(str(info[4][0]).lower())
    return names


def _endpoint(raw: object, what: str, worker_host: str, allowed: Collection[str]) -> str:
    if not isinstance(raw, str):
        raise _Rejected(f"{what} is not a string: {type(raw).__name__}")
    if len(raw) > MAX_ENDPOINT_CHARS:
        raise _Rejected(f"{what} is {len(raw)} characters long")
    parts = urlsplit(raw)
    if parts.scheme == "ipc" and _is_loopback(worker_host) and raw.isprintable():
        return raw  # a worker on this machine: its ipc:// socket file is reachable from here
    if parts.scheme != "tcp":
        raise _Rejected(f"{what} {raw!r}: only tcp:// is reachable from the router (ipc:// only on this machine)")
    if parts.username is not None or parts.path or parts.query or parts.fragment:
        raise _Rejected(f"{what} {raw!r} is not tcp://host:port")
    try:
        port = parts.port
    except ValueError:
        raise _Rejected(f"{what} {raw!r} has an invalid port") from None
    host = (parts.hostname or "").lower()
    if not host or port is None or port == 0:
        raise _Rejected(f"{what} {raw!r} has no host or no bound port")
    if host in _WILDCARDS:
        host = worker_host
    elif host not in allowed:
        raise _Rejected(f"{what} {raw!r} points at {host}, not at the worker ({worker_host})")
    return f"tcp://{_netloc(host, port)}"


def _from_rank_map(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Released vLLM (0.32, 0.33) answers ``{"<rank>": KVEventsConfig}``: each rank's publisher config
    (``enable_kv_cache_events``, ``publisher``, ``endpoint``, ``replay_endpoint``, ``topic``, buffer sizes);
    ``{}`` when no rank publishes. As entries of the list form, ranks whose publisher is off left out."""
    if len(data) > MAX_RANKS:
        raise _Rejected(f"{len(data)} sources, more than {MAX_RANKS} ranks")
    entries = []
    for key, config in data.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 4):
            raise _Rejected(f"the answer is an object whose key {key[:20]!r} is neither 'sources' nor a rank")
        if not isinstance(config, dict):
            raise _Rejected(f"rank {key}'s config is not an object")
        if config.get("enable_kv_cache_events") is False or config.get("publisher", "zmq") != "zmq":
            continue
        entries.append({**config, "data_parallel_rank": int(key)})
    return entries


def parse_event_sources(body: bytes, worker_host: str, allowed_hosts: Collection[str] = ()) -> list[EventSource]:
    """Validate an answer of ``/kv_event_sources``; raises ``ValueError`` with the first problem found.

    ``allowed_hosts``: hosts (besides ``worker_host``) a published endpoint may name, e.g. the addresses
    the worker's name resolves to, or the nodes of a multi-node data-parallel deployment."""
    worker_host = worker_host.lower().strip("[]")
    allowed = {worker_host, *(h.lower() for h in allowed_hosts)}
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _Rejected("the answer is not JSON") from None
    if isinstance(data, dict) and "sources" not in data:
        data = _from_rank_map(data)
    elif isinstance(data, dict):
        data = data["sources"]
    if not isinstance(data, list):
        raise _Rejected(f"'sources' is not a list: {type(data).__name__}")
    if len(data) > MAX_RANKS:
        raise _Rejected(f"{len(data)} sources, more than {MAX_RANKS} ranks")
    sources: dict[int, EventSource] = {}
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise _Rejected(f"source {i} is not an object")
        rank = entry.get("data_parallel_rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < MAX_RANKS:
            raise _Rejected(f"source {i}: data_parallel_rank {rank!r} is not a rank")
        if rank in sources:
            raise _Rejected(f"rank {rank} is listed twice")
        endpoint = _endpoint(entry.get("endpoint"), f"rank {rank} endpoint", worker_host, allowed)
        raw_replay = entry.get("replay_endpoint")
        replay = None if raw_replay is None else _endpoint(raw_replay, f"rank {rank} replay", worker_host, allowed)
        topic = entry.get("topic", "")
        if topic is None:
            topic = ""
        if not isinstance(topic, str) or len(topic) > MAX_TOPIC_CHARS or not topic.isprintable():
            raise _Rejected(f"rank {rank}: topic is not a short printable string")
        sources[rank] = EventSource(rank, endpoint, replay, topic)
    return [sources[rank] for rank in sorted(sources)]


async def _read_bounded(transport: Transport, url: str, max_bytes: int) -> tuple[int, bytes]:
    resp = await transport.request("GET", url, [("accept", "application/json"), ("accept-encoding", "identity")], b"")
    try:
        if resp.status != 200:
            return resp.status, b""
        body = bytearray()
        async for chunk in resp.chunks():
            body += chunk
            if len(body) > max_bytes:
                raise _Rejected(f"the answer is larger than {max_bytes} bytes")
        return resp.status, bytes(body)
    finally:
        await resp.aclose()


async def lookup_event_sources(
    transport: Transport,
    worker_url: str,
    *,
    timeout_s: float = 2.0,
    max_bytes: int = MAX_BYTES,
    allowed_hosts: Collection[str] = (),
    resolve: bool = True,
) -> EventSourceLookup:
    """Ask ``worker_url`` for its KV-event sources. Never raises (but for cancellation): see the outcomes."""
    try:
        worker_host = _host_of(worker_url)
    except ValueError as exc:
        return EventSourceLookup("rejected", reason=str(exc))
    url = worker_url.rstrip("/") + PATH
    try:
        async with asyncio.timeout(timeout_s):
            status, body = await _read_bounded(transport, url, max_bytes)
    except _Rejected as exc:
        return EventSourceLookup("rejected", reason=str(exc))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # connect errors, timeouts, broken bodies: all mean "ask again later"
        return EventSourceLookup("failed", reason=describe(exc))
    if status in (404, 405):
        return EventSourceLookup("absent", reason=f"{PATH} answered {status} (vLLM < 0.32?)")
    if status != 200:
        return EventSourceLookup("failed", reason=f"{PATH} answered {status}")
    allowed = set(allowed_hosts)
    if resolve:
        allowed |= await worker_addresses(worker_host, timeout_s)
    try:
        sources = parse_event_sources(body, worker_host, allowed)
    except ValueError as exc:
        return EventSourceLookup("rejected", reason=str(exc))
    if not sources:
        return EventSourceLookup("disabled", reason="the worker publishes no KV events")
    return EventSourceLookup("found", tuple(sources))


async def fetch_event_sources(transport: Transport, worker_url: str, **options: Any) -> list[EventSource] | None:
    """The worker's sources sorted by rank, or None when it has none to give (see :func:`lookup_event_sources`)."""
    lookup = await lookup_event_sources(transport, worker_url, **options)
    return list(lookup.sources) if lookup.outcome == "found" else None


def apply_event_sources(cfg: WorkerConfig, sources: list[EventSource] | tuple[EventSource, ...]) -> WorkerConfig:
    """``cfg`` with ``kv_events``/``replay``/``kv_events_topic``/``dp_size`` taken from the sources.

    The subscriber reaches rank n at the rank-0 port + n (vLLM's layout for explicit ports); per-rank
    ephemeral ports (``tcp://*:0`` with more than one rank) do not fit it: ``ValueError``."""
    if not sources:
        raise ValueError("no sources")
    ranks = [s.rank for s in sources]
    if ranks != list(range(len(sources))):
        raise ValueError(f"ranks {ranks} are not 0..{len(sources) - 1}")
    first = sources[0]
    if len(sources) > 1:
        for source in sources[1:]:
            if source.topic != first.topic:
                raise ValueError("ranks publish under different topics")
            for mine, base in ((source.endpoint, first.endpoint), (source.replay, first.replay)):
                if (mine is None) != (base is None):
                    raise ValueError("some ranks have a replay endpoint and others not")
                if mine is not None and base is not None and not _is_offset(mine, base, source.rank):
                    raise ValueError(
                        f"rank {source.rank} publishes on {mine}, not at rank 0's port + {source.rank} "
                        "(ephemeral per-rank ports need one subscription per rank)"
                    )
    update = {"kv_events": first.endpoint, "replay": first.replay, "kv_events_topic": first.topic}
    return cfg.model_copy(update={**update, "dp_size": len(sources)})


def _is_offset(endpoint: str, base: str, rank: int) -> bool:
    a, b = urlsplit(endpoint), urlsplit(base)
    if a.scheme != "tcp" or b.scheme != "tcp" or a.hostname != b.hostname:
        return False
    return a.port is not None and b.port is not None and a.port == b.port + rank


class EventSourceProbe:
    """Fills a worker's missing KV-event endpoints from ``/kv_event_sources``, counting every outcome.

    Use it as the reconciler's ``enrich`` (and for static workers without ``kv_events``). Endpoints given in
    the configuration always win: the worker is then not asked. Whatever goes wrong, the worker is returned
    as it came (routed by load only, or through the router's bound ``index.events_bind`` socket) with a warning."""

    def __init__(
        self,
        transport: Transport,
        registry: CollectorRegistry | None = None,
        *,
        timeout_s: float = 2.0,
        allowed_hosts: Collection[str] = (),
    ) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self.allowed_hosts = tuple(allowed_hosts)
        self.outcomes = Counter(
            "kvroute_event_source_discovery_total",
            "Lookups of a worker's KV-event endpoints on its /kv_event_sources, by outcome",
            ["outcome"],
            registry=registry or CollectorRegistry(auto_describe=True),
        )
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome)

    async def lookup(self, cfg: WorkerConfig) -> EventSourceLookup:
        lookup = await lookup_event_sources(
            self.transport, cfg.url, timeout_s=self.timeout_s, allowed_hosts=self.allowed_hosts
        )
        if lookup.outcome == "found":
            try:
                apply_event_sources(cfg, lookup.sources)
            except ValueError as exc:
                lookup = EventSourceLookup("unusable", lookup.sources, str(exc))
        self.outcomes.labels(lookup.outcome).inc()
        return lookup

    async def fill(self, cfg: WorkerConfig) -> WorkerConfig:
        if cfg.kv_events:
            return cfg
        lookup = await self.lookup(cfg)
        if lookup.outcome == "found":
            filled = apply_event_sources(cfg, lookup.sources)
            log.info(
                "worker %s publishes KV events on %s (%d rank(s), replay %s)",
                cfg.worker_id,
                filled.kv_events,
                filled.dp_size,
                filled.replay or "none",
            )
            return filled
        if lookup.outcome == "rejected":
            log.warning(
                "worker %s: rejected its %s answer: %s; routing it by load only", cfg.worker_id, PATH, lookup.reason
            )
        elif lookup.outcome == "disabled":
            log.info("worker %s publishes no KV events: routing it by load only", cfg.worker_id)
        else:
            log.warning(
                "worker %s: no KV-event endpoints from %s (%s): using the configured endpoints or load-only routing",
                cfg.worker_id,
                PATH,
                lookup.reason,
            )
        return cfg
