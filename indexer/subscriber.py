"""ZMQ subscribers: vLLM KV-event streams into a :class:`KVIndexer`, without blocking the loop.

Two ways a worker's events arrive (DESIGN §4):

- *connect* mode: vLLM binds (``tcp://*:5557``); we connect one SUB per worker, to ``port + n`` for
  each data-parallel rank n. ZMQ reconnects by itself with exponential backoff, and a socket monitor
  tells us when the worker is gone (purged after the grace period) or back.
- *bind* mode: vLLM connects; one SUB bound here serves all such workers, the topic names the worker.

A sequence gap triggers a replay through a DEALER on the worker's replay endpoint; the indexer
decides what the replayed batches mean (catch-up, or a buffer too short and a fresh start). A sequence
going backwards is checked against the replay buffer first: a real engine restart (the buffer holds that
batch, byte for byte) is purged and re-learnt by a replay from 0; a forged one is dropped.

Replays never hold up anyone else (DESIGN §4, docs/indexer.md): each runs as a *job* of its own task per
worker, bounded in time (``replay_max_s`` in all, ``replay_timeout_s`` per reply) and in concurrency
(``max_concurrent_replays``); meanwhile that worker's live messages wait in a bounded backlog and are
handled in order once the job is done, while every other worker's events keep flowing.

The subscriber only consumes events. The index's upkeep (purging workers gone past the grace period,
healing a backend that came back, renewing TTLs) is the indexer's :class:`IndexMaintenance`; callers
that predate it and never start it get it started by :meth:`EventSubscriber.start` (see there).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from kvroute.indexer.entities import entity_id
from kvroute.indexer.events import REPLAY_END_SEQ, encode_seq
from kvroute.indexer.maintenance import IndexMaintenance
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.sequencing import GapPolicy, Handled
from kvroute.indexer.service import KVIndexer
from kvroute.logs import RateLimitedLog
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed
from kvroute.vocabulary import Tier
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("kvroute.indexer.subscriber")

RECV_HWM = 100_000
RECONNECT_IVL_MS = 100
#: Reconnection backoff cap: a restarted engine is found again within a second (its first batches are
#: then still in its replay buffer, and a restart is re-learnt from there anyway).
RECONNECT_IVL_MAX_MS = 1_000
#: Largest frame accepted (ZMQ ``MAXMSGSIZE``, checked before anything is allocated): a bigger one makes
#: ZMQ drop that connection. vLLM's batches are kilobytes to a few megabytes.
MAX_FRAME_BYTES = 16 << 20
#: A whole replay (or restart check) never takes longer than this, however slowly the worker trickles.
REPLAY_MAX_S = 30.0
#: Replays running at once (others wait for a slot; live events never wait for any).
MAX_CONCURRENT_REPLAYS = 4
#: A worker's live messages kept while its replay job runs (beyond: dropped, counted, then replayed).
BACKLOG_MAX_MESSAGES = 100_000
BACKLOG_MAX_BYTES = 64 << 20
#: Reconciliation: a rank whose index count differs from the engine's by more than
#: ``max(self.reconcile_tolerance, RECONCILE_REL_TOLERANCE * engine)`` on two checks in a row is resynced.
RECONCILE_ABS_TOLERANCE = 8
RECONCILE_REL_TOLERANCE = 0.1
RECONCILE_CHECKS = 2

ReplayOutcome = Literal["ok", "timeout", "error"]


class EngineBlockCounts(Protocol):
    """The engine's own count of cached (hashed, prefix-cache) GPU blocks of one data-parallel rank, or None
    when it cannot tell now. The router implements it from vLLM's ``/metrics``; the indexer has no HTTP."""

    def __call__(self, worker_id: str, dp_rank: int) -> Awaitable[int | None]: ...


@dataclass(slots=True)
class WorkerSpec:
    """Where one worker's events come from. ``endpoint`` None = it connects to our bound socket."""

    worker_id: str
    model: str
    endpoint: str | None = None
    topic: str = ""
    replay: str | None = None
    dp_size: int = 1


@dataclass(slots=True)
class _Feed:
    """One worker's message flow: its replay job (if one runs) and the live messages waiting for it."""

    spec: WorkerSpec
    backlog: deque[list[bytes]] | None = None
    backlog_bytes: int = 0
    job: asyncio.Task[None] | None = None
    #: rank -> consecutive reconciliation checks that found the index diverged from the engine.
    diverged: dict[int, int] = field(default_factory=dict)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's data-parallel rank n publishes (and replays) on the configured port + n."""
    if rank == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError(f"data-parallel ranks need a tcp://host:port endpoint, got {endpoint!r}")
    host = parts.netloc.rsplit(":", 1)[0]
    return f"tcp://{host}:{parts.port + rank}"


def subscriber_options(index: Any) -> dict[str, Any]:
    """The :class:`EventSubscriber` keyword arguments an ``index`` config section (``IndexConfig``) sets."""
    return {
        "max_frame_bytes": getattr(index, "max_frame_bytes", MAX_FRAME_BYTES),
        "allow": list(getattr(index, "events_allow", None) or []) or None,
        "curve_secret_key": getattr(index, "events_curve_secret_key", None),
        "curve_client_keys": list(getattr(index, "events_curve_client_keys", None) or []) or None,
    }


#: Most messages handled before their index writes go out together.
MAX_BURST = 256


async def _drain(sock: zmq.asyncio.Socket) -> list[list[bytes]]:
    """Wait for one message, then take what is already queued behind it (up to MAX_BURST)."""
    burst = [await sock.recv_multipart()]
    while len(burst) < MAX_BURST:
        try:
            burst.append(await sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    return burst


def _sub_socket(ctx: zmq.asyncio.Context, max_frame_bytes: int = MAX_FRAME_BYTES) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


async def _bind_when_free(sock: zmq.asyncio.Socket, endpoint: str, wait_s: float = 5.0) -> None:
    """Bind, waiting briefly while the address is still held: ZeroMQ releases a closed socket's listener
    in its I/O thread, so a subscriber restarted at once (a router restart) can find it busy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or loop.time() > deadline:
                raise
        await asyncio.sleep(0.05)


ZAP_ENDPOINT = "inproc://zeromq.zap.01"


@dataclass(slots=True)
class _Admission:
    """Who may connect to one bound socket: source addresses (None = any), CURVE client keys (None = any)."""

    addresses: frozenset[str] | None
    curve_keys: frozenset[bytes] | None


class _ZapHandler:
    """ZeroMQ's authentication protocol (ZAP, RFC 27) for one context: each bound socket has its own
    domain and its own :class:`_Admission`; anything not admitted is refused (the peer is disconnected
    before a single message of it is read)."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.domains: dict[bytes, _Admission] = {}
        self.sock: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None

    async def add(self, domain: bytes, admission: _Admission) -> None:
        self.domains[domain] = admission
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.REP)
            self.sock.setsockopt(zmq.LINGER, 0)
            await _bind_when_free(self.sock, ZAP_ENDPOINT)
            self.task = asyncio.create_task(self._serve(self.sock), name="kv-events-zap")

    async def remove(self, domain: bytes) -> None:
        self.domains.pop(domain, None)
        if not self.domains and self.sock is not None:
            task, sock, self.task, self.sock = self.task, self.sock, None, None
            if task is not None:
                await cancel_and_wait([task])
            sock.close(0)

    def verdict(self, domain: bytes, address: bytes, mechanism: bytes, credentials: list[bytes]) -> bool:
        admission = self.domains.get(domain)
        if admission is None:
            return False
        if admission.addresses is not None and address.decode(errors="replace") not in admission.addresses:
            return False
        if mechanism == b"CURVE":
            key = z85.encode(credentials[0]) if credentials else b""
            return admission.curve_keys is None or key in admission.curve_keys
        return mechanism == b"NULL"

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            raise_if_cancel_swallowed()
            msg = await sock.recv_multipart()
            if len(msg) < 6:
                continue  # not a ZAP request; REP needs an answer all the same
            version, request_id, domain, address, _identity, mechanism, *credentials = msg
            ok = self.verdict(domain, address, mechanism, credentials)
            code, text = (b"200", b"OK") if ok else (b"400", b"not admitted")
            if not ok:
                log.warning("kv events: refused a connection from %s", address.decode(errors="replace"))
            await sock.send_multipart([version, request_id, code, text, b"", b""])


_zap_handlers: weakref.WeakKeyDictionary[zmq.asyncio.Context, _ZapHandler] = weakref.WeakKeyDictionary()


def _zap_for(ctx: zmq.asyncio.Context) -> _ZapHandler:
    handler = _zap_handlers.get(ctx)
    if handler is None:
        handler = _zap_handlers[ctx] = _ZapHandler(ctx)
    return handler


class EventSubscriber:
    """Owns the sockets and tasks feeding one indexer.

    ``grace_s`` and ``refresh_s`` are only the settings of the indexer's maintenance when this
    subscriber has to start it (see :meth:`start`). ``metrics`` defaults to the indexer's.

    Hardening (docs/indexer.md, docs/security.md): ``max_frame_bytes`` bounds every frame on the SUB and
    replay sockets; ``replay_max_s``/``max_concurrent_replays`` bound replays; ``engine_blocks`` +
    ``reconcile_s`` compare each rank's index with the engine's own count and resync one that diverged;
    the bound socket can take connections only from ``allow`` (IP addresses, a ZAP handler) and/or only
    CURVE clients (``curve_secret_key``, Z85; ``curve_client_keys`` their allowed public keys, None = any).
    """

    def __init__(
        self,
        indexer: KVIndexer,
        *,
        bind: str | None = None,
        grace_s: float = 30.0,
        replay_timeout_s: float = 2.0,
        refresh_s: float | None = None,
        ctx: zmq.asyncio.Context | None = None,
        metrics: IndexerMetrics | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        replay_max_s: float = REPLAY_MAX_S,
        max_concurrent_replays: int = MAX_CONCURRENT_REPLAYS,
        engine_blocks: EngineBlockCounts | None = None,
        reconcile_s: float | None = None,
        reconcile_tolerance: int = RECONCILE_ABS_TOLERANCE,
        allow: Sequence[str] | None = None,
        curve_secret_key: str | None = None,
        curve_client_keys: Sequence[str] | None = None,
    ) -> None:
        self.indexer = indexer
        self.bind = bind
        self.grace_s = grace_s
        self.replay_timeout_s = replay_timeout_s
        self.refresh_s = refresh_s
        self.metrics = metrics if metrics is not None else indexer.metrics
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.max_frame_bytes = max_frame_bytes
        self.replay_max_s = replay_max_s
        self.engine_blocks = engine_blocks
        self.reconcile_s = reconcile_s
        self.reconcile_tolerance = reconcile_tolerance
        self.allow = list(allow) if allow else None
        self.curve_secret_key = curve_secret_key
        self.curve_client_keys = list(curve_client_keys) if curve_client_keys else None
        self._slots = asyncio.Semaphore(max(1, max_concurrent_replays))
        self._specs: dict[str, WorkerSpec] = {}
        self._feeds: dict[str, _Feed] = {}
        self._topics: dict[bytes, str] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._bound: zmq.asyncio.Socket | None = None
        self._bound_task: asyncio.Task[None] | None = None
        self._reconcile_task: asyncio.Task[None] | None = None
        #: The ZAP domain of the bound socket when it has an admission policy.
        self._auth: bytes | None = None
        #: The indexer's maintenance when this subscriber started it (then it stops it too).
        self._maintenance: IndexMaintenance | None = None
        self._running = False
        self.bound_endpoint: str | None = None
        self.rlog = RateLimitedLog(log, 60.0)

    # ---- configuration -------------------------------------------------------------------------

    def add_worker(self, spec: WorkerSpec) -> None:
        """Register a worker with the indexer and start listening to it (now, or at :meth:`start`)."""
        if spec.worker_id in self._specs:
            raise ValueError(f"worker {spec.worker_id!r} is already subscribed")
        if spec.endpoint is None:
            topic = spec.topic.encode()
            if topic in self._topics:
                raise ValueError(
                    f"topic {spec.topic!r} already names worker {self._topics[topic]!r}: "
                    "workers sharing the bound socket need distinct topics"
                )
            self._topics[topic] = spec.worker_id
        else:
            for rank in range(spec.dp_size):
                rank_endpoint(spec.endpoint, rank)  # validate now, not in a task
        self.indexer.register_worker(spec.worker_id, spec.model, spec.dp_size)
        self._specs[spec.worker_id] = spec
        self._feeds[spec.worker_id] = _Feed(spec)
        if self._running and spec.endpoint is not None:
            self._start_worker(spec)

    async def remove_worker(self, worker_id: str) -> None:
        """Stop listening and forget the worker's blocks."""
        spec = self._specs.pop(worker_id, None)
        if spec is None:
            return
        feed = self._feeds.pop(worker_id, None)
        self._topics = {t: w for t, w in self._topics.items() if w != worker_id}
        tasks = self._tasks.pop(worker_id, [])
        if feed is not None and feed.job is not None:
            tasks.append(feed.job)
        await cancel_and_wait(tasks)
        await self.indexer.unregister_worker(worker_id)

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the sockets and start listening.

        Compatibility: when nobody arranged the indexer's maintenance (callers written before it was the
        indexer's), it is started here with this subscriber's ``grace_s``/``refresh_s`` and stopped by
        :meth:`stop`. One arranged by the composition root (``indexer.make_maintenance()`` or
        ``start_maintenance()``) is left alone, started or not.
        """
        if self._running:
            return
        self._running = True
        if self.bind:
            self._bound = _sub_socket(self.ctx, self.max_frame_bytes)
            await self._secure_bound(self._bound)
            self._bound.setsockopt(zmq.SUBSCRIBE, b"")
            await _bind_when_free(self._bound, self.bind)
            endpoint = self._bound.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(endpoint, bytes)
            self.bound_endpoint = endpoint.decode()
            self._bound_task = asyncio.create_task(self._bound_loop(self._bound), name="kv-events-bound")
        for spec in self._specs.values():
            if spec.endpoint is not None:
                self._start_worker(spec)
        if self.engine_blocks is not None and self.reconcile_s:
            self._reconcile_task = asyncio.create_task(self._reconcile_loop(), name="kv-index-reconcile")
        if self.indexer.maintenance is None:
            self._maintenance = self.indexer.start_maintenance(self.grace_s, self.refresh_s)

    async def _secure_bound(self, sock: zmq.asyncio.Socket) -> None:
        """The bound socket's admission: ``allow``'s addresses only, CURVE only when keyed (ZAP, per socket)."""
        if not self.allow and not self.curve_secret_key:
            return
        if self.curve_secret_key:
            secret = self.curve_secret_key.encode()
            sock.curve_server = True
            sock.curve_secretkey = secret
            sock.curve_publickey = zmq.curve_public(secret)
        domain = f"kvroute-{id(self)}".encode()
        keys = frozenset(k.encode() for k in self.curve_client_keys) if self.curve_client_keys else None
        await _zap_for(self.ctx).add(domain, _Admission(frozenset(self.allow) if self.allow else None, keys))
        sock.zap_domain = domain
        self._auth = domain

    async def stop(self) -> None:
        """Stop every task (bounded, see :mod:`kvroute.tasks`) and close the bound socket."""
        self._running = False
        tasks = [t for ts in self._tasks.values() for t in ts]
        tasks += [t for t in (self._bound_task, self._reconcile_task) if t is not None]
        tasks += [f.job for f in self._feeds.values() if f.job is not None]
        maintenance, self._maintenance = self._maintenance, None
        try:
            if maintenance is None:
                await cancel_and_wait(tasks)
            else:  # the one started here ends together with the loops, in the same bounded wait
                own = self.indexer.stop_maintenance() if maintenance is self.indexer.maintenance else maintenance.stop()
                await asyncio.gather(cancel_and_wait(tasks), own)
        finally:
            self._tasks.clear()
            self._bound_task = None
            self._reconcile_task = None
            for feed in self._feeds.values():
                feed.job, feed.backlog, feed.backlog_bytes = None, None, 0
            if self._bound is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._bound.unbind(self.bound_endpoint or self.bind or "")
                self._bound.close(0)
                self._bound = None
            if self._auth is not None:
                await _zap_for(self.ctx).remove(self._auth)
                self._auth = None

    def _start_worker(self, spec: WorkerSpec) -> None:
        assert spec.endpoint is not None
        sock = _sub_socket(self.ctx, self.max_frame_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        for rank in range(spec.dp_size):
            sock.connect(rank_endpoint(spec.endpoint, rank))
        self._tasks[spec.worker_id] = [
            asyncio.create_task(self._worker_loop(spec, sock), name=f"kv-events-{spec.worker_id}"),
            asyncio.create_task(self._monitor_loop(spec, sock, monitor), name=f"kv-monitor-{spec.worker_id}"),
        ]
        feed = self._feeds.get(spec.worker_id)
        if feed is not None and spec.replay is not None:
            self._start_job(feed, lambda: self._catch_up(spec))

    # ---- loops ---------------------------------------------------------------------------------

    async def _catch_up(self, spec: WorkerSpec) -> None:
        """At subscribe time, replay each rank's buffer from its start: vLLM never re-announces blocks it
        cached before we connected, so without this an idle worker's cache stays unknown until it speaks.
        Live messages wait in the backlog meanwhile and are recognised as overlap afterwards."""
        if spec.replay is None:
            return
        for rank in range(spec.dp_size):
            if self.indexer.prime_catch_up(spec.worker_id, rank):
                await self.replay(spec, rank)

    async def _worker_loop(self, spec: WorkerSpec, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                # A cancel dropped by a Redis write (Python 3.11's wait_for) must end the loop here, not
                # leave it waiting for the next message while stop() waits for it.
                raise_if_cancel_swallowed()
                burst = await _drain(sock)
                async with self.indexer.batched():
                    for frames in burst:
                        raise_if_cancel_swallowed()
                        await self._handle(spec, frames)
        finally:
            sock.close(0)

    async def _monitor_loop(self, spec: WorkerSpec, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                raise_if_cancel_swallowed()
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    self.indexer.mark_up(spec.worker_id)
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self.metrics.disconnects.labels(spec.worker_id).inc()
                    self.rlog.log(
                        logging.INFO, f"{spec.worker_id}\0disc", "worker %s: event stream disconnected", spec.worker_id
                    )
                    self.indexer.mark_down(spec.worker_id)
                    self._reconnect(spec, sock, event.get("endpoint"))
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(0)

    @staticmethod
    def _reconnect(spec: WorkerSpec, sock: zmq.asyncio.Socket, endpoint: object) -> None:
        """Connect again at once. ZeroMQ ends a connection for good after a protocol error (a frame over
        MAXMSGSIZE: a real engine's one oversized batch must not cut it off for ever), and a fresh connect
        starts the backoff from its 100 ms floor (a restarted engine is found at once)."""
        assert spec.endpoint is not None
        ranks = [rank_endpoint(spec.endpoint, r) for r in range(spec.dp_size)]
        ep = endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else str(endpoint)
        for target in [ep] if ep in ranks else ranks:
            with contextlib.suppress(zmq.ZMQError):
                sock.disconnect(target)
            with contextlib.suppress(zmq.ZMQError):
                sock.connect(target)

    async def _bound_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            raise_if_cancel_swallowed()
            burst = await _drain(sock)
            async with self.indexer.batched():
                for frames in burst:
                    raise_if_cancel_swallowed()
                    worker_id = self._topics.get(frames[0]) if frames else None
                    spec = self._specs.get(worker_id) if worker_id else None
                    if spec is None:
                        self.indexer.count_drop("(bound)", "unknown_topic", repr(frames[0][:64]) if frames else "")
                        continue
                    self.indexer.mark_up(spec.worker_id)
                    await self._handle(spec, frames)

    # ---- messages and replay jobs --------------------------------------------------------------

    async def _handle(self, spec: WorkerSpec, frames: list[bytes]) -> None:
        """One live message: into the worker's backlog while its replay job runs, else handled now."""
        feed = self._feeds.get(spec.worker_id)
        if feed is None:
            return
        backlog = feed.backlog
        if backlog is not None:
            size = sum(len(f) for f in frames)
            if len(backlog) >= BACKLOG_MAX_MESSAGES or feed.backlog_bytes + size > BACKLOG_MAX_BYTES:
                # Lost here, found again: the next message handled shows the gap and is replayed.
                self.indexer.count_drop(spec.worker_id, "replay_backlog", f"{len(backlog)} messages waiting")
                return
            backlog.append(frames)
            feed.backlog_bytes += size
            return
        await self._handle_now(feed, frames)

    async def _handle_now(self, feed: _Feed, frames: list[bytes]) -> None:
        """Handle one message; a gap or a backwards sequence starts the worker's replay job. Nothing a
        worker sends may end the loop."""
        spec = feed.spec
        try:
            handled = await self.indexer.handle_message(spec.worker_id, frames, on_gap=self._policy(spec))
            if self._needs_replay(spec, handled):
                self._start_job(feed, lambda: self._resolve(feed, handled, frames))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must cost one message, never the subscriber
            self.rlog.error(
                f"{spec.worker_id}\0internal", "worker %s: failed to handle a message", spec.worker_id, exc_info=True
            )
            self.indexer.count_drop(spec.worker_id, "internal_error", str(exc))

    @staticmethod
    def _policy(spec: WorkerSpec) -> GapPolicy:
        return "verify" if spec.replay else "purge"

    @staticmethod
    def _needs_replay(spec: WorkerSpec, handled: Handled) -> bool:
        """With a replay endpoint, a reported gap and a reported backwards sequence were not applied."""
        return spec.replay is not None and handled.dp_rank is not None and handled.outcome in ("gap", "restart")

    def _start_job(self, feed: _Feed, action: Callable[[], Awaitable[None]]) -> None:
        """Run ``action`` (replays) as the worker's job; its live messages wait in the backlog meanwhile."""
        if feed.backlog is None:
            feed.backlog, feed.backlog_bytes = deque(), 0
        if feed.job is None:
            feed.job = asyncio.create_task(self._job(feed, action), name=f"kv-replay-{feed.spec.worker_id}")

    async def _job(self, feed: _Feed, action: Callable[[], Awaitable[None]]) -> None:
        spec = feed.spec
        try:
            try:
                await action()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.rlog.error(f"{spec.worker_id}\0job", "worker %s: replay job failed", spec.worker_id, exc_info=True)
            # The messages that arrived meanwhile, in order; a gap among them is resolved here as well.
            backlog = feed.backlog
            while backlog:
                raise_if_cancel_swallowed()
                frames = backlog.popleft()
                feed.backlog_bytes -= sum(len(f) for f in frames)
                try:
                    handled = await self.indexer.handle_message(spec.worker_id, frames, on_gap=self._policy(spec))
                    if self._needs_replay(spec, handled):
                        await self._resolve(feed, handled, frames)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.rlog.error(
                        f"{spec.worker_id}\0internal",
                        "worker %s: failed to handle a message",
                        spec.worker_id,
                        exc_info=True,
                    )
                    self.indexer.count_drop(spec.worker_id, "internal_error", str(exc))
        finally:
            # No await between the last look at the backlog and this: the loop hands messages over again.
            feed.job, feed.backlog, feed.backlog_bytes = None, None, 0

    async def _resolve(self, feed: _Feed, handled: Handled, frames: list[bytes]) -> None:
        """A message that did not follow its predecessor, checked against the worker's replay buffer.

        - backwards (``restart``): the buffer holds this very batch -> the engine restarted: purge, replay
          from 0 (the batches we missed while reconnecting are re-learnt too). Not there -> forged: dropped,
          the index is untouched. Replay socket silent -> as without one: purge, new baseline.
        - forwards (``gap``) or first message of a running worker: replay what we missed; a batch the replay
          did not contain although it answered is not the engine's: dropped (``unconfirmed_seq``).
        """
        spec = feed.spec
        rank, seq = handled.dp_rank, handled.seq
        assert rank is not None and seq is not None
        wid = spec.worker_id
        if handled.outcome == "restart":
            confirmed = await self._confirm(spec, rank, seq, frames[2])
            if confirmed is False:
                self.indexer.count_drop(wid, "unconfirmed_seq", f"rank {rank} seq {seq} is not in the replay buffer")
                return
            if confirmed:
                await self.indexer.resync(wid, rank, "engine_restart")
                if await self.replay(spec, rank) == "ok":
                    return  # the replay from 0 held this batch too
            await self.indexer.handle_message(wid, frames, on_gap="purge")
            return
        outcome = await self.replay(spec, rank)
        expected = self.indexer.expected_seq(wid, rank)
        if outcome == "ok" and expected is not None and seq > expected:
            self.indexer.count_drop(wid, "unconfirmed_seq", f"rank {rank} seq {seq} beyond the replay buffer")
            return
        # Covered by the replay: a duplicate. Not covered (replay failed): a fresh start here.
        await self.indexer.handle_message(wid, frames, on_gap="purge")

    async def _confirm(self, spec: WorkerSpec, rank: int, seq: int, payload: bytes) -> bool | None:
        """Whether the worker's replay buffer holds batch ``seq`` with exactly this payload (None: no answer)."""
        assert spec.replay is not None
        async with self._slots:
            dealer = self._dealer(spec, rank)
            try:
                await dealer.send_multipart([b"", encode_seq(seq)])
                async with asyncio.timeout(min(self.replay_timeout_s, self.replay_max_s)):
                    frames = await dealer.recv_multipart()
            except (TimeoutError, zmq.ZMQError) as exc:
                self.rlog.warning(
                    f"{spec.worker_id}\0confirm", "worker %s: restart check failed: %s", spec.worker_id, exc
                )
                return None
            finally:
                dealer.close(0)
        if frames and frames[0] == b"":
            frames = frames[1:]
        return len(frames) >= 2 and frames[-2] == encode_seq(seq) and frames[-1] == payload

    def _dealer(self, spec: WorkerSpec, rank: int) -> zmq.asyncio.Socket:
        assert spec.replay is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        dealer.connect(rank_endpoint(spec.replay, rank))
        return dealer

    async def replay(self, spec: WorkerSpec, rank: int) -> ReplayOutcome:
        """Ask the worker's replay socket for what we missed. Returns ok / timeout / error. Bounded:
        ``replay_timeout_s`` per reply, ``replay_max_s`` in all, ``max_concurrent_replays`` at once."""
        start = self.indexer.expected_seq(spec.worker_id, rank)
        if spec.replay is None or start is None:
            return "error"
        entity = entity_id(spec.worker_id, rank)
        outcome: ReplayOutcome = "ok"
        async with self._slots:
            self.indexer.begin_replay(spec.worker_id, rank, start)
            dealer: zmq.asyncio.Socket | None = None
            try:
                async with asyncio.timeout(self.replay_max_s):
                    dealer = self._dealer(spec, rank)
                    await dealer.send_multipart([b"", encode_seq(start)])
                    while True:
                        raise_if_cancel_swallowed()
                        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can drop a cancellation.
                        async with asyncio.timeout(self.replay_timeout_s):
                            frames = await dealer.recv_multipart()
                        if frames and frames[0] == b"":
                            frames = frames[1:]
                        if len(frames) == 2:  # older vLLM: no topic frame
                            frames = [spec.topic.encode(), *frames]
                        if len(frames) != 3:
                            self.indexer.count_drop(spec.worker_id, "bad_replay_frames")
                            continue
                        if frames[1] == REPLAY_END_SEQ:
                            break
                        await self.indexer.handle_message(spec.worker_id, frames, replay=True)
            except TimeoutError:
                outcome = "timeout"
                self.rlog.warning(f"{entity}\0replay", "worker %s: replay from %d timed out", entity, start)
            except zmq.ZMQError as exc:
                outcome = "error"
                self.rlog.warning(f"{entity}\0replay", "worker %s: replay failed: %s", entity, exc)
            finally:
                if dealer is not None:
                    dealer.close(0)
        self.metrics.replays.labels(entity, outcome).inc()
        return outcome

    # ---- reconciliation ------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        assert self.reconcile_s
        while True:
            raise_if_cancel_swallowed()
            await asyncio.sleep(self.reconcile_s)
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.rlog.error("reconcile", "index reconciliation failed; retrying", exc_info=True)

    async def reconcile(self) -> None:
        """One round: per rank, the index's GPU block count against the engine's (``engine_blocks``). A rank
        off by more than the tolerance on :data:`RECONCILE_CHECKS` rounds in a row is resynced (purge, replay
        from 0) when its worker has a replay endpoint; without one it is counted ``diverged``."""
        counts = self.engine_blocks
        if counts is None:
            return
        gpu = int(Tier.GPU)
        for feed in list(self._feeds.values()):
            spec = feed.spec
            if feed.job is not None:
                continue  # a replay is under way: the counts are in motion
            for rank in range(self.indexer.dp_size(spec.worker_id)):
                entity = entity_id(spec.worker_id, rank)
                try:
                    async with asyncio.timeout(max(self.replay_timeout_s, 1.0)):
                        engine = await counts(spec.worker_id, rank)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    engine = None
                if engine is None:
                    self.metrics.reconciliations.labels(entity, "error").inc()
                    continue
                indexed = self.indexer.indexed_blocks(spec.worker_id, rank, gpu) or 0
                if abs(indexed - engine) <= max(self.reconcile_tolerance, RECONCILE_REL_TOLERANCE * engine):
                    feed.diverged.pop(rank, None)
                    self.metrics.reconciliations.labels(entity, "ok").inc()
                    continue
                seen = feed.diverged[rank] = feed.diverged.get(rank, 0) + 1
                if seen < RECONCILE_CHECKS or spec.replay is None:
                    self.metrics.reconciliations.labels(entity, "diverged").inc()
                    continue
                feed.diverged.pop(rank, None)
                self.metrics.reconciliations.labels(entity, "resynced").inc()
                self.rlog.warning(
                    f"{entity}\0reconcile",
                    "worker %s: index holds %d GPU blocks, the engine %d: resyncing from its replay buffer",
                    entity,
                    indexed,
                    engine,
                )
                self._start_job(feed, functools.partial(self._full_resync, spec, rank, "reconcile"))

    async def _full_resync(self, spec: WorkerSpec, rank: int, reason: str) -> None:
        if await self.indexer.resync(spec.worker_id, rank, reason):
            await self.replay(spec, rank)
