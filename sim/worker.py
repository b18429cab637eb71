"""One simulated vLLM worker running inside the current asyncio loop: HTTP API (uvicorn started
programmatically on a pre-bound socket), KV-event publisher, replay socket and P2P control port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from typing import Any

import uvicorn
import zmq
import zmq.asyncio
from kvroute.indexer.events import KVEvent
from kvroute.sim.api import build_app
from kvroute.sim.engine import Engine
from kvroute.sim.options import WorkerOptions
from kvroute.sim.p2p import P2PClient, P2PServer
from kvroute.sim.publisher import BindMode, EventPublisher, KVEventSource
from kvroute.sim.tokenizer import Tokenizer, load_tokenizer
from kvroute.sim.transfers import close_client

log = logging.getLogger(__name__)


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


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
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._actx = actx or zmq.asyncio.Context(self._ctx)
        self.tokenizer = tokenizer or load_tokenizer(self.opts.tokenizer, self.opts.chat_template)
        self.model = self.opts.model_name
        self.created = int(time.time())
        self.healthy = True
        self.publisher: EventPublisher | None = None
        self.p2p = P2PServer(self._p2p_handle)
        self.client = P2PClient(self._actx)
        self.engine_id = f"sim-{uuid.uuid4().hex[:12]}"
        self.engine = Engine(
            self.opts,
            self._emit,
            self.client,
            engine_id=self.engine_id,
            p2p_host=self.opts.host,
            p2p_port=lambda: self.p2p.port,
        )
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self.http_port = 0

    # -- wiring --------------------------------------------------------------------------------------

    def _emit(self, event: KVEvent) -> None:
        if self.publisher is not None:
            self.publisher.add(event)

    async def _p2p_handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.engine.transfers.handle(msg)

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
        """``GET /kv_event_sources``: one entry per DP rank (the sim runs rank 0 only); empty before start."""
        return [self.publisher.source()] if self.publisher is not None else []

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
        }

    def stats(self) -> dict[str, Any]:
        """Counters a demo or a benchmark reports per worker (the same numbers /metrics exposes)."""
        m = self.engine.metrics
        return {
            "worker_id": self.worker_id,
            "role": self.opts.role,
            "running": self.engine.running,
            "waiting": self.engine.waiting,
            "kv_cache_usage": self.engine.cache.usage(),
            "prefix_cache_queries": m.sample("vllm:prefix_cache_queries_total"),
            "prefix_cache_hits": m.sample("vllm:prefix_cache_hits_total"),
            "prompt_tokens": m.sample("vllm:prompt_tokens_total"),
            "requests": m.sample("vllm:request_success_total"),
            "kv_bytes_sent": m.sample("kvroute_sim:kv_transfer_bytes_total", direction="sent"),
            "kv_bytes_received": m.sample("kvroute_sim:kv_transfer_bytes_total", direction="received"),
        }

    def reset(self) -> bool:
        """Drop every hold and reset the prefix cache (between benchmark runs); False while requests run."""
        if self.engine.running:
            return False
        self.engine.transfers.close()
        return self.engine.reset_prefix_cache()

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> SimWorker:
        opts = self.opts
        self._sock = _listen(opts.host, opts.http_port)
        self.http_port = self._sock.getsockname()[1]
        zhost = f"[{opts.host}]" if ":" in opts.host else opts.host
        mode: BindMode
        if opts.events_mode == "connect" or (opts.events_mode == "auto" and opts.events_endpoint):
            if not opts.events_endpoint:
                raise ValueError("events_mode 'connect' needs events_endpoint (the router's SUB address)")
            endpoint, mode = opts.events_endpoint, opts.events_mode
        else:
            endpoint, mode = f"tcp://{zhost}:{opts.events_port}", "bind"
        topic = opts.topic
        if mode == "connect" and not topic:
            topic = f"kv@{self.worker_id}"  # workers sharing one SUB socket are told apart by topic
        self.publisher = EventPublisher(
            endpoint,
            mode=mode,
            topic=topic,
            replay_endpoint=f"tcp://{zhost}:{opts.replay_port}" if opts.replay else None,
            buffer_steps=opts.buffer_steps,
            hwm=opts.hwm,
            form=opts.event_form,
            replay_with_topic=opts.replay_with_topic,
        )
        self.publisher.start(self._ctx, self._actx)
        self.p2p.start(self._actx, opts.host, opts.p2p_port)
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
        self.engine.transfers.close()
        await self.p2p.close()
        await close_client(self.client)
        if self.publisher is not None:
            await self.publisher.close()
        if self._sock is not None:
            self._sock.close()
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    async def __aenter__(self) -> SimWorker:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
