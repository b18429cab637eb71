"""One simulated vLLM worker running inside the current asyncio loop: HTTP API (uvicorn started
programmatically on a pre-bound socket), KV-event publisher, replay socket and P2P control port.

A worker with ``dp_size`` N is what ``vllm serve --data-parallel-size N`` serves: one HTTP port in front
of N ranks (:class:`SimRank`), each with its own engine and KV cache, its own KV-event publisher on the
events/replay port + rank (own sequence numbers, ``data_parallel_rank`` in every payload) and its own
P2P port (+ rank). The API picks the rank from ``X-data-parallel-rank`` or balances like vLLM's
``DPLBAsyncMPClient`` (``vllm/v1/engine/core_client.py``); admission control counts over all ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from typing import Any

import anyio
import uvicorn
import zmq
import zmq.asyncio
from kvroute.indexer.events import KVEvent
from kvroute.sim.admission import AdmissionControl
from kvroute.sim.api import build_app
from kvroute.sim.engine import Engine
from kvroute.sim.metrics import MetricFamilies
from kvroute.sim.options import WorkerOptions
from kvroute.sim.p2p import P2PClient, P2PServer
from kvroute.sim.publisher import BindMode, EventPublisher, KVEventSource
from kvroute.sim.tokenizer import Tokenizer, load_tokenizer
from kvroute.sim.transfers import close_client

log = logging.getLogger(__name__)


def _listen(host: str, port: int) -> socket.socket:
    """The worker's listening socket. Made as a TCP socket explicitly (``IPPROTO_TCP``, not 0): asyncio's
    loop disables Nagle only on connections it knows to be TCP, and without that a stream's first chunk
    waited up to 40 ms behind its headers for the client's delayed ACK on a reused connection (uvloop
    disables it either way; real vLLM, bound by host and port, has it disabled)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def consecutive_free_ports(host: str, count: int, attempts: int = 50) -> int:
    """The first of ``count`` consecutive TCP ports free right now (for rank n at port + n)."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            first = int(sock.getsockname()[1])
        if first + count <= 65535 and all(_port_free(host, first + i) for i in range(count)):
            return first
    raise OSError(f"no {count} consecutive free ports on {host}")


def rank_ports(host: str, base: int, count: int, ephemeral: bool) -> list[int]:
    """Each rank's port: base + rank (vLLM's layout for an explicit port); with base 0, one ephemeral port
    each (``ephemeral``, vLLM's ``tcp://*:0``) or a free consecutive range."""
    if base:
        return [base + r for r in range(count)]
    if count == 1 or ephemeral:
        return [0] * count
    first = consecutive_free_ports(host, count)
    return [first + r for r in range(count)]


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """vLLM's ``ZmqEventPublisher.offset_endpoint_port``: rank n uses the endpoint's port + n (port 0 stays 0)."""
    if rank == 0 or "tcp" not in endpoint or ":" not in endpoint:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


class SimRank:
    """One data-parallel rank: engine (scheduler, cache), KV-event publisher, replay socket, P2P server."""

    def __init__(self, worker: SimWorker, rank: int, families: MetricFamilies) -> None:
        opts = worker.opts
        self.rank = rank
        self.publisher: EventPublisher | None = None
        self.p2p = P2PServer(self._p2p_handle)
        self.engine_id = worker.engine_id if rank == 0 else f"{worker.engine_id}_dp{rank}"
        #: Requests the API sent here that have not finished (vLLM's per-engine in-flight count).
        self.inflight = 0
        self.engine = Engine(
            opts,
            self._emit,
            worker.client,
            engine_id=self.engine_id,
            p2p_host=opts.host,
            p2p_port=lambda: self.p2p.port,
            rank=rank,
            families=families,
        )

    def _emit(self, event: KVEvent) -> None:
        if self.publisher is not None:
            self.publisher.add(event)

    async def _p2p_handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.engine.transfers.handle(msg)

    def load_score(self) -> float:
        """vLLM's balancing score: max(in flight, waiting + running), plus a waiting penalty that ramps
        from 0 at 50 % KV-cache usage to 3 x waiting at 100 %."""
        engine = self.engine
        waiting = engine.waiting
        score = float(max(self.inflight, waiting + engine.running))
        if waiting:
            score += waiting * 6.0 * max(0.0, engine.cache.usage() - 0.5)
        return score

    async def close(self) -> None:
        self.engine.transfers.close()
        await self.p2p.close()
        if self.publisher is not None:
            await self.publisher.close()


class SimWorker:
    """``async with SimWorker(WorkerOptions(...)) as w: w.url, w.events_endpoint, w.p2p_port``."""

    def __init__(
        self,
        opts: WorkerOptions | None = None,
        *,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        actx: zmq.asyncio.Context | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.opts = opts or WorkerOptions()
        self.opts.check()
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._actx = actx or zmq.asyncio.Context(self._ctx)
        self.tokenizer = tokenizer or load_tokenizer(self.opts.tokenizer, self.opts.chat_template)
        self.model = self.opts.model_name
        self.created = int(time.time())
        self.healthy = True
        self.client = P2PClient(self._actx)
        self.engine_id = f"sim-{uuid.uuid4().hex[:12]}"
        self.families = MetricFamilies(self.model)
        self.ranks = [SimRank(self, r, self.families) for r in range(self.opts.dp_size)]
        self.admission = AdmissionControl(self.opts.max_num_queued_reqs, self.opts.max_num_queued_tokens, self.families)
        self._lb_start = 0
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self.http_port = 0

    # -- wiring --------------------------------------------------------------------------------------

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def engine(self) -> Engine:
        """Rank 0's engine (the only one without data parallelism)."""
        return self.ranks[0].engine

    @property
    def publisher(self) -> EventPublisher | None:
        return self.ranks[0].publisher

    @property
    def p2p(self) -> P2PServer:
        return self.ranks[0].p2p

    def balance(self) -> int:
        """The rank vLLM's load balancer would pick: the lowest score, scanning from a start index that
        rotates each time, so ties (idle ranks) go round-robin."""
        n = len(self.ranks)
        best, best_score = 0, float("inf")
        for i in range(n):
            idx = (self._lb_start + i) % n
            score = self.ranks[idx].load_score()
            if score < best_score:
                best, best_score = idx, score
        self._lb_start = (self._lb_start + 1) % n
        return best

    @property
    def worker_id(self) -> str:
        return self.opts.worker_id or f"{self.opts.host}:{self.http_port}"

    @property
    def url(self) -> str:
        host = f"[{self.opts.host}]" if ":" in self.opts.host else self.opts.host
        return f"http://{host}:{self.http_port}"

    @property
    def events_endpoint(self) -> str | None:
        """Where a subscriber connects (bind mode), None when this worker connects to the router."""
        if self.publisher is None or not self.publisher.bind:
            return None
        return self.publisher.endpoint.replace("0.0.0.0", "127.0.0.1")

    @property
    def replay_endpoint(self) -> str | None:
        if self.publisher is None or self.publisher.replay_endpoint is None:
            return None
        return self.publisher.replay_endpoint.replace("0.0.0.0", "127.0.0.1")

    @property
    def p2p_port(self) -> int:
        return self.p2p.port

    @property
    def topic(self) -> str:
        return self.publisher.topic if self.publisher else self.opts.topic

    def kv_event_sources(self) -> list[KVEventSource]:
        """``GET /kv_event_sources``: one entry per DP rank, in rank order; empty before start."""
        return [r.publisher.source() for r in self.ranks if r.publisher is not None]

    def worker_config(self) -> dict[str, Any]:
        """This worker as a ``kvroute serve`` ``workers:`` entry (router/config.py WorkerConfig)."""
        entry: dict[str, Any] = {
            "url": self.url,
            "id": self.worker_id,
            "role": self.opts.role,
            "models": [self.model],
            "kv_events": self.events_endpoint,
            "replay": self.replay_endpoint,
            "p2p_host": self.opts.host,
            "p2p_port": self.p2p_port,
        }
        if self.topic:
            entry["kv_events_topic"] = self.topic
        if self.dp_size > 1:
            entry["dp_size"] = self.dp_size
        return entry

    def describe(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "engine_id": self.engine_id,
            "role": self.opts.role,
            "url": self.url,
            "kv_events": self.events_endpoint,
            "replay": self.replay_endpoint,
            "p2p_port": self.p2p_port,
            "topic": self.topic,
            "dp_size": self.dp_size,
        }

    def stats(self) -> dict[str, Any]:
        """Counters a demo or a benchmark reports per worker (the same numbers /metrics exposes)."""
        m = self.families
        engines = [r.engine for r in self.ranks]
        return {
            "worker_id": self.worker_id,
            "role": self.opts.role,
            "running": sum(e.running for e in engines),
            "waiting": sum(e.waiting for e in engines),
            "kv_cache_usage": sum(e.cache.usage() for e in engines) / len(engines),
            "prefix_cache_queries": m.sample("vllm:prefix_cache_queries_total"),
            "prefix_cache_hits": m.sample("vllm:prefix_cache_hits_total"),
            "prompt_tokens": m.sample("vllm:prompt_tokens_total"),
            "requests": m.sample("vllm:request_success_total"),
            "kv_bytes_sent": m.sample("kvroute_sim:kv_transfer_bytes_total", direction="sent"),
            "kv_bytes_received": m.sample("kvroute_sim:kv_transfer_bytes_total", direction="received"),
        }

    def reset(self) -> bool:
        """Drop every hold and reset the prefix cache (between benchmark runs); False while requests run.
        Unlike vLLM's ``POST /reset_prefix_cache`` (whose ``AllBlocksCleared`` waits for the next engine step),
        this control of the sim's own publishes it at once, so a run starts from an index that knows it."""
        if any(r.engine.running for r in self.ranks):
            return False
        for r in self.ranks:
            r.engine.transfers.close()
        done = all([r.engine.reset_prefix_cache() for r in self.ranks])
        for r in self.ranks:
            r.engine.cache.step()
        return done

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> SimWorker:
        """Bind every socket and serve; a port that cannot be bound fails the start at once, with whatever
        was opened so far closed again (a half-started worker would hold sockets its context waits on)."""
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> SimWorker:
        opts = self.opts
        # Starlette's first streamed answer opens an anyio task group, which imports anyio's asyncio backend:
        # ~20 ms on the first request of a fresh worker that real vLLM, warmed up before it serves, never pays.
        async with anyio.create_task_group():
            pass
        self._sock = _listen(opts.host, opts.http_port)
        self.http_port = self._sock.getsockname()[1]
        zhost = f"[{opts.host}]" if ":" in opts.host else opts.host
        mode: BindMode
        n, ephemeral = self.dp_size, opts.dp_ephemeral_ports
        if opts.events_mode == "connect" or (opts.events_mode == "auto" and opts.events_endpoint):
            if not opts.events_endpoint:
                raise ValueError("events_mode 'connect' needs events_endpoint (the router's SUB address)")
            mode = opts.events_mode
            # vLLM's rule for a configured endpoint, bound or connected: rank n at its port + n.
            endpoints = [offset_endpoint_port(opts.events_endpoint, r) for r in range(n)]
        else:
            mode = "bind"
            endpoints = [f"tcp://{zhost}:{p}" for p in rank_ports(opts.host, opts.events_port, n, ephemeral)]
        topic = opts.topic
        if mode == "connect" and not topic:
            topic = f"kv@{self.worker_id}"  # workers sharing one SUB socket are told apart by topic
        replay_ports = rank_ports(opts.host, opts.replay_port, n, ephemeral)
        p2p_ports = rank_ports(opts.host, opts.p2p_port, n, ephemeral)
        for r, rank in enumerate(self.ranks):
            rank.publisher = EventPublisher(
                endpoints[r],
                mode=mode,
                topic=topic,
                replay_endpoint=f"tcp://{zhost}:{replay_ports[r]}" if opts.replay else None,
                buffer_steps=opts.buffer_steps,
                hwm=opts.hwm,
                form=opts.event_form,
                dp_rank=r,
                replay_with_topic=opts.replay_with_topic,
                v033=opts.events_v033,
            )
            rank.publisher.start(self._ctx, self._actx)
            rank.p2p.start(self._actx, opts.host, p2p_ports[r])
        config = uvicorn.Config(
            build_app(self),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        config.load()
        self._server.lifespan = config.lifespan_class(config)
        await self._server.startup(sockets=[self._sock])
        return self

    async def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.shutdown(sockets=[self._sock] if self._sock else None), 5)
        for rank in self.ranks:
            await rank.close()
        await close_client(self.client)
        if self._sock is not None:
            self._sock.close()
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    async def __aenter__(self) -> SimWorker:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
