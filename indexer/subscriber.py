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

Its parts, one job a module: ``sockets`` (socket setup, bounded frames, reconnects, ZAP/CURVE admission),
``replays`` (:class:`Replays`: the backlog, replay jobs, restart checks, resyncs) and ``reconciliation``
(:class:`Reconciler`: index counts against the engine's). This module owns the sockets' tasks and
composes them; the names below are re-exported from there for callers of this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import zmq
import zmq.asyncio
from kvroute.indexer.maintenance import IndexMaintenance
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.reconciliation import (
    RECONCILE_ABS_TOLERANCE,
    RECONCILE_CHECKS,
    RECONCILE_REL_TOLERANCE,
    EngineBlockCounts,
    Reconciler,
)
from kvroute.indexer.replays import (
    BACKLOG_MAX_BYTES,
    BACKLOG_MAX_MESSAGES,
    MAX_CONCURRENT_REPLAYS,
    REPLAY_MAX_S,
    Feed,
    ReplayOutcome,
    Replays,
)
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.sockets import (
    MAX_BURST,
    MAX_FRAME_BYTES,
    RECONNECT_IVL_MAX_MS,
    RECONNECT_IVL_MS,
    RECV_HWM,
    ZAP_ENDPOINT,
    Admission,
    Inbox,
    WorkerSpec,
    bind_when_free,
    rank_endpoint,
    reconnect,
    sub_socket,
    zap_for,
)
from kvroute.logs import RateLimitedLog
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "BACKLOG_MAX_BYTES",
    "BACKLOG_MAX_MESSAGES",
    "MAX_BURST",
    "MAX_CONCURRENT_REPLAYS",
    "MAX_FRAME_BYTES",
    "RECONCILE_ABS_TOLERANCE",
    "RECONCILE_CHECKS",
    "RECONCILE_REL_TOLERANCE",
    "RECONNECT_IVL_MAX_MS",
    "RECONNECT_IVL_MS",
    "RECV_HWM",
    "REPLAY_MAX_S",
    "ZAP_ENDPOINT",
    "EngineBlockCounts",
    "EventSubscriber",
    "ReplayOutcome",
    "WorkerSpec",
    "rank_endpoint",
    "subscriber_options",
]

log = logging.getLogger("kvroute.indexer.subscriber")


def subscriber_options(index: Any) -> dict[str, Any]:
    """The :class:`EventSubscriber` keyword arguments an ``index`` config section (``IndexConfig``) sets."""
    return {
        "max_frame_bytes": getattr(index, "max_frame_bytes", MAX_FRAME_BYTES),
        "allow": list(getattr(index, "events_allow", None) or []) or None,
        "curve_secret_key": getattr(index, "events_curve_secret_key", None),
        "curve_client_keys": list(getattr(index, "events_curve_client_keys", None) or []) or None,
    }


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
        self._specs: dict[str, WorkerSpec] = {}
        self._feeds: dict[str, Feed] = {}
        self._topics: dict[bytes, str] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._bound: zmq.Socket[bytes] | None = None
        self._bound_task: asyncio.Task[None] | None = None
        self._reconcile_task: asyncio.Task[None] | None = None
        #: The ZAP domain of the bound socket when it has an admission policy.
        self._auth: bytes | None = None
        #: The indexer's maintenance when this subscriber started it (then it stops it too).
        self._maintenance: IndexMaintenance | None = None
        self._running = False
        self.bound_endpoint: str | None = None
        self.rlog = RateLimitedLog(log, 60.0)
        #: The replay machinery and the reconciliation rounds, both over ``_feeds`` (shared, not copied).
        self.replays = Replays(
            indexer,
            self._feeds,
            ctx=self.ctx,
            metrics=self.metrics,
            rlog=self.rlog,
            replay_timeout_s=replay_timeout_s,
            replay_max_s=replay_max_s,
            max_concurrent_replays=max_concurrent_replays,
            max_frame_bytes=max_frame_bytes,
        )
        self.reconciler = Reconciler(
            indexer,
            self._feeds,
            self.replays,
            engine_blocks=engine_blocks,
            metrics=self.metrics,
            rlog=self.rlog,
            reconcile_s=reconcile_s,
            reconcile_tolerance=reconcile_tolerance,
            replay_timeout_s=replay_timeout_s,
        )

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
        self._feeds[spec.worker_id] = Feed(spec)
        if self._running and spec.endpoint is not None:
            self._start_worker(spec)

    def catching_up(self) -> list[str]:
        """Workers whose catch-up replay (at subscribe time) has not ended: their cache is not known yet."""
        return sorted(worker_id for worker_id, feed in self._feeds.items() if feed.catching_up)

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
            self._bound = sub_socket(self.ctx, self.max_frame_bytes)
            await self._secure_bound(self._bound)
            self._bound.setsockopt(zmq.SUBSCRIBE, b"")
            await bind_when_free(self._bound, self.bind)
            endpoint = self._bound.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(endpoint, bytes)
            self.bound_endpoint = endpoint.decode()
            self._bound_task = asyncio.create_task(self._bound_loop(self._bound), name="kv-events-bound")
        for spec in self._specs.values():
            if spec.endpoint is not None:
                self._start_worker(spec)
        if self.engine_blocks is not None and self.reconcile_s:
            self._reconcile_task = asyncio.create_task(self.reconciler.loop(), name="kv-index-reconcile")
        if self.indexer.maintenance is None:
            self._maintenance = self.indexer.start_maintenance(self.grace_s, self.refresh_s)

    async def _secure_bound(self, sock: zmq.Socket[bytes]) -> None:
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
        await zap_for(self.ctx).add(domain, Admission(frozenset(self.allow) if self.allow else None, keys))
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
                feed.clear_job()
            if self._bound is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._bound.unbind(self.bound_endpoint or self.bind or "")
                self._bound.close(0)
                self._bound = None
            if self._auth is not None:
                await zap_for(self.ctx).remove(self._auth)
                self._auth = None

    def _start_worker(self, spec: WorkerSpec) -> None:
        assert spec.endpoint is not None
        sock = sub_socket(self.ctx, self.max_frame_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        # Made by the socket's context, an asyncio one: the monitor is read with await.
        monitor = cast(zmq.asyncio.Socket, sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED))
        for rank in range(spec.dp_size):
            sock.connect(rank_endpoint(spec.endpoint, rank))
        self._tasks[spec.worker_id] = [
            asyncio.create_task(self._worker_loop(spec, sock), name=f"kv-events-{spec.worker_id}"),
            asyncio.create_task(self._monitor_loop(spec, sock, monitor), name=f"kv-monitor-{spec.worker_id}"),
        ]
        self.replays.start_catch_up(spec)

    # ---- loops ---------------------------------------------------------------------------------

    async def _worker_loop(self, spec: WorkerSpec, sock: zmq.Socket[bytes]) -> None:
        try:
            await self._consume(sock, lambda frames: self.replays.handle(spec, frames))
        finally:
            sock.close(0)

    async def _consume(self, sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], Awaitable[None]]) -> None:
        """Read ``sock`` in bursts for ever, each burst's messages handled in order with one backend write."""
        inbox = Inbox(sock)
        try:
            while True:
                # A cancel dropped by a Redis write (Python 3.11's wait_for) must end the loop here, not
                # leave it waiting for the next message while stop() waits for it.
                raise_if_cancel_swallowed()
                burst = await inbox.drain()
                async with self.indexer.batched():
                    for frames in burst:
                        raise_if_cancel_swallowed()
                        await handle(frames)
        finally:
            inbox.close()

    async def _monitor_loop(self, spec: WorkerSpec, sock: zmq.Socket[bytes], monitor: zmq.asyncio.Socket) -> None:
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
                    reconnect(spec, sock, event.get("endpoint"))
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(0)

    async def _bound_loop(self, sock: zmq.Socket[bytes]) -> None:
        await self._consume(sock, self._handle_bound)  # the socket is stop()'s to close

    async def _handle_bound(self, frames: list[bytes]) -> None:
        """A message on the bound socket: its topic names the worker."""
        worker_id = self._topics.get(frames[0]) if frames else None
        spec = self._specs.get(worker_id) if worker_id else None
        if spec is None:
            self.indexer.count_drop("(bound)", "unknown_topic", repr(frames[0][:64]) if frames else "")
            return
        self.indexer.mark_up(spec.worker_id)
        await self.replays.handle(spec, frames)

    # ---- replays and reconciliation (see Replays, Reconciler) ----------------------------------

    async def replay(self, spec: WorkerSpec, rank: int) -> ReplayOutcome:
        """Ask the worker's replay socket for what we missed (:meth:`Replays.replay`): ok / timeout / error."""
        return await self.replays.replay(spec, rank)

    async def reconcile(self) -> None:
        """One reconciliation round (:meth:`Reconciler.reconcile`): each rank's index count against the
        engine's; one diverged on consecutive rounds is resynced from its replay buffer."""
        await self.reconciler.reconcile()
