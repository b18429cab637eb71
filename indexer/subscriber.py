"""ZMQ subscribers: vLLM KV-event streams into a :class:`KVIndexer`, without blocking the loop.

Two ways a worker's events arrive (DESIGN §4):

- *connect* mode: vLLM binds (``tcp://*:5557``); we connect one SUB per worker, to ``port + n`` for
  each data-parallel rank n. ZMQ reconnects by itself with exponential backoff, and a socket monitor
  tells us when the worker is gone (purged after the grace period) or back.
- *bind* mode: vLLM connects; one SUB bound here serves all such workers, the topic names the worker.

A sequence gap triggers a replay through a DEALER on the worker's replay endpoint; the indexer
decides what the replayed batches mean (catch-up, or a buffer too short and a fresh start).

The subscriber only consumes events. The index's upkeep (purging workers gone past the grace period,
healing a backend that came back, renewing TTLs) is the indexer's :class:`IndexMaintenance`; callers
that predate it and never start it get it started by :meth:`EventSubscriber.start` (see there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from kvroute.indexer.entities import entity_id
from kvroute.indexer.events import REPLAY_END_SEQ, encode_seq
from kvroute.indexer.maintenance import IndexMaintenance
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.sequencing import GapPolicy
from kvroute.indexer.service import KVIndexer
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("kvroute.indexer.subscriber")

RECV_HWM = 100_000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5_000

ReplayOutcome = Literal["ok", "timeout", "error"]


@dataclass(slots=True)
class WorkerSpec:
    """Where one worker's events come from. ``endpoint`` None = it connects to our bound socket."""

    worker_id: str
    model: str
    endpoint: str | None = None
    topic: str = ""
    replay: str | None = None
    dp_size: int = 1


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's data-parallel rank n publishes (and replays) on the configured port + n."""
    if rank == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError(f"data-parallel ranks need a tcp://host:port endpoint, got {endpoint!r}")
    host = parts.netloc.rsplit(":", 1)[0]
    return f"tcp://{host}:{parts.port + rank}"


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


def _sub_socket(ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
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


class EventSubscriber:
    """Owns the sockets and tasks feeding one indexer.

    ``grace_s`` and ``refresh_s`` are only the settings of the indexer's maintenance when this
    subscriber has to start it (see :meth:`start`). ``metrics`` defaults to the indexer's.
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
    ) -> None:
        self.indexer = indexer
        self.bind = bind
        self.grace_s = grace_s
        self.replay_timeout_s = replay_timeout_s
        self.refresh_s = refresh_s
        self.metrics = metrics if metrics is not None else indexer.metrics
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self._specs: dict[str, WorkerSpec] = {}
        self._topics: dict[bytes, str] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._bound: zmq.asyncio.Socket | None = None
        self._bound_task: asyncio.Task[None] | None = None
        #: The indexer's maintenance when this subscriber started it (then it stops it too).
        self._maintenance: IndexMaintenance | None = None
        self._running = False
        self.bound_endpoint: str | None = None

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
        if self._running and spec.endpoint is not None:
            self._start_worker(spec)

    async def remove_worker(self, worker_id: str) -> None:
        """Stop listening and forget the worker's blocks."""
        spec = self._specs.pop(worker_id, None)
        if spec is None:
            return
        self._topics = {t: w for t, w in self._topics.items() if w != worker_id}
        await cancel_and_wait(self._tasks.pop(worker_id, []))
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
            self._bound = _sub_socket(self.ctx)
            self._bound.setsockopt(zmq.SUBSCRIBE, b"")
            await _bind_when_free(self._bound, self.bind)
            endpoint = self._bound.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(endpoint, bytes)
            self.bound_endpoint = endpoint.decode()
            self._bound_task = asyncio.create_task(self._bound_loop(self._bound), name="kv-events-bound")
        for spec in self._specs.values():
            if spec.endpoint is not None:
                self._start_worker(spec)
        if self.indexer.maintenance is None:
            self._maintenance = self.indexer.start_maintenance(self.grace_s, self.refresh_s)

    async def stop(self) -> None:
        """Stop every task (bounded, see :mod:`kvroute.tasks`) and close the bound socket."""
        self._running = False
        tasks = [t for ts in self._tasks.values() for t in ts]
        tasks += [t for t in (self._bound_task,) if t is not None]
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
            if self._bound is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._bound.unbind(self.bound_endpoint or self.bind or "")
                self._bound.close(0)
                self._bound = None

    def _start_worker(self, spec: WorkerSpec) -> None:
        assert spec.endpoint is not None
        sock = _sub_socket(self.ctx)
        sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        for rank in range(spec.dp_size):
            sock.connect(rank_endpoint(spec.endpoint, rank))
        self._tasks[spec.worker_id] = [
            asyncio.create_task(self._worker_loop(spec, sock), name=f"kv-events-{spec.worker_id}"),
            asyncio.create_task(self._monitor_loop(spec, sock, monitor), name=f"kv-monitor-{spec.worker_id}"),
        ]

    # ---- loops ---------------------------------------------------------------------------------

    async def _catch_up(self, spec: WorkerSpec) -> None:
        """At subscribe time, replay each rank's buffer from its start: vLLM never re-announces blocks it
        cached before we connected, so without this an idle worker's cache stays unknown until it speaks.
        Live messages wait in the socket meanwhile and are recognised as overlap afterwards."""
        if spec.replay is None:
            return
        for rank in range(spec.dp_size):
            if self.indexer.prime_catch_up(spec.worker_id, rank):
                await self.replay(spec, rank)

    async def _worker_loop(self, spec: WorkerSpec, sock: zmq.asyncio.Socket) -> None:
        try:
            await self._catch_up(spec)
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
                    log.info("worker %s: event stream disconnected", spec.worker_id)
                    self.indexer.mark_down(spec.worker_id)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(0)

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

    async def _handle(self, spec: WorkerSpec, frames: list[bytes]) -> None:
        """One message; nothing a worker sends may end the loop."""
        try:
            on_gap: GapPolicy = "report" if spec.replay else "purge"
            handled = await self.indexer.handle_message(spec.worker_id, frames, on_gap=on_gap)
            if handled.outcome == "gap" and handled.dp_rank is not None:
                await self.replay(spec, handled.dp_rank)
                # Covered by the replay: a duplicate. Not covered (replay failed): a fresh start here.
                await self.indexer.handle_message(spec.worker_id, frames, on_gap="purge")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must cost one message, never the subscriber
            log.exception("worker %s: failed to handle a message", spec.worker_id)
            self.indexer.count_drop(spec.worker_id, "internal_error", str(exc))

    async def replay(self, spec: WorkerSpec, rank: int) -> ReplayOutcome:
        """Ask the worker's replay socket for what we missed. Returns ok / timeout / error."""
        start = self.indexer.expected_seq(spec.worker_id, rank)
        if spec.replay is None or start is None:
            return "error"
        self.indexer.begin_replay(spec.worker_id, rank, start)
        entity = entity_id(spec.worker_id, rank)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        outcome: ReplayOutcome = "ok"
        try:
            dealer.connect(rank_endpoint(spec.replay, rank))
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
            log.warning("worker %s: replay from %d timed out", entity, start)
        except zmq.ZMQError as exc:
            outcome = "error"
            log.warning("worker %s: replay failed: %s", entity, exc)
        finally:
            dealer.close(0)
        self.metrics.replays.labels(entity, outcome).inc()
        return outcome
