"""Replay jobs: a worker's missed batches fetched from its replay buffer (DEALER), without blocking anyone.

A sequence gap triggers a replay through a DEALER on the worker's replay endpoint; the indexer decides
what the replayed batches mean (catch-up, or a buffer too short and a fresh start). A sequence going
backwards is checked against the replay buffer first: a real engine restart (the buffer holds that batch,
byte for byte) is purged and re-learnt by a replay from 0; a forged one is dropped.

Each replay runs as a *job* of its own task per worker (DESIGN §4, docs/indexer.md), bounded in time
(``replay_max_s`` in all, ``replay_timeout_s`` per reply) and in concurrency (``max_concurrent_replays``);
meanwhile that worker's live messages wait in a bounded backlog (:class:`Feed`) and are handled in order
once the job is done, while every other worker's events keep flowing.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import zmq
import zmq.asyncio
from kvroute.indexer.entities import entity_id
from kvroute.indexer.events import REPLAY_END_SEQ, EventDecodeError, decode_seq, encode_seq
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.sequencing import GapPolicy, Handled
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.sockets import MAX_FRAME_BYTES, WorkerSpec, dealer_socket, rank_endpoint
from kvroute.logs import RateLimitedLog
from kvroute.tasks import raise_if_cancel_swallowed

#: A whole replay (or restart check) never takes longer than this, however slowly the worker trickles.
REPLAY_MAX_S = 30.0
#: Replays running at once (others wait for a slot; live events never wait for any).
MAX_CONCURRENT_REPLAYS = 4
#: A worker's live messages kept while its replay job runs (beyond: dropped, counted, then replayed).
BACKLOG_MAX_MESSAGES = 100_000
BACKLOG_MAX_BYTES = 64 << 20

ReplayOutcome = Literal["ok", "timeout", "error"]


@dataclass(slots=True)
class Feed:
    """One worker's message flow: its replay job (if one runs) and the live messages waiting for it."""

    spec: WorkerSpec
    backlog: deque[list[bytes]] | None = None
    backlog_bytes: int = 0
    job: asyncio.Task[None] | None = None
    #: rank -> consecutive reconciliation checks that found the index diverged from the engine.
    diverged: dict[int, int] = field(default_factory=dict)
    #: The catch-up replay at subscribe time has not ended yet: the index does not know this worker's cache.
    catching_up: bool = False

    def clear_job(self) -> None:
        self.job, self.backlog, self.backlog_bytes = None, None, 0


class Replays:
    """The replay machinery of one subscriber: live messages in (held back while the worker's job runs),
    replay jobs, restart checks against the replay buffer, and resyncs. ``feeds`` is the subscriber's
    own map (worker id -> :class:`Feed`), shared, not copied."""

    def __init__(
        self,
        indexer: KVIndexer,
        feeds: dict[str, Feed],
        *,
        ctx: zmq.asyncio.Context,
        metrics: IndexerMetrics,
        rlog: RateLimitedLog,
        replay_timeout_s: float = 2.0,
        replay_max_s: float = REPLAY_MAX_S,
        max_concurrent_replays: int = MAX_CONCURRENT_REPLAYS,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.indexer = indexer
        self.feeds = feeds
        self.ctx = ctx
        self.metrics = metrics
        self.rlog = rlog
        self.replay_timeout_s = replay_timeout_s
        self.replay_max_s = replay_max_s
        self.max_frame_bytes = max_frame_bytes
        self._slots = asyncio.Semaphore(max(1, max_concurrent_replays))

    # ---- messages ------------------------------------------------------------------------------

    async def handle(self, spec: WorkerSpec, frames: list[bytes]) -> None:
        """One live message: into the worker's backlog while its replay job runs, else handled now."""
        feed = self.feeds.get(spec.worker_id)
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

    async def _handle_now(self, feed: Feed, frames: list[bytes]) -> None:
        """Handle one message; a gap or a backwards sequence starts the worker's replay job. Nothing a
        worker sends may end the loop."""
        spec = feed.spec
        try:
            handled = await self.indexer.handle_message(spec.worker_id, frames, on_gap=self._policy(spec))
            if self._needs_replay(spec, handled):
                self.start_job(feed, lambda: self._resolve(feed, handled, frames))
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

    # ---- jobs ----------------------------------------------------------------------------------

    def start_job(self, feed: Feed, action: Callable[[], Awaitable[None]]) -> bool:
        """Run ``action`` (replays) as the worker's job; its live messages wait in the backlog meanwhile.
        False when a job already runs (``action`` is not run: that job resolves what is queued)."""
        if feed.backlog is None:
            feed.backlog, feed.backlog_bytes = deque(), 0
        if feed.job is not None:
            return False
        feed.job = asyncio.create_task(self._job(feed, action), name=f"kv-replay-{feed.spec.worker_id}")
        return True

    def start_catch_up(self, spec: WorkerSpec) -> None:
        """At subscribe time (see :meth:`catch_up`), as the worker's job; :attr:`Feed.catching_up` until it
        ends (bounded by ``replay_max_s`` per rank), which the router's readiness waits for."""
        feed = self.feeds.get(spec.worker_id)
        if feed is not None and spec.replay is not None:
            feed.catching_up = self.start_job(feed, lambda: self._catch_up_feed(feed))

    async def _catch_up_feed(self, feed: Feed) -> None:
        try:
            await self.catch_up(feed.spec)
        finally:
            feed.catching_up = False

    async def _job(self, feed: Feed, action: Callable[[], Awaitable[None]]) -> None:
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
            feed.clear_job()

    async def catch_up(self, spec: WorkerSpec) -> None:
        """At subscribe time, replay each rank's buffer from its start: vLLM never re-announces blocks it
        cached before we connected, so without this an idle worker's cache stays unknown until it speaks.
        Live messages wait in the backlog meanwhile and are recognised as overlap afterwards."""
        if spec.replay is None:
            return
        for rank in range(spec.dp_size):
            if self.indexer.prime_catch_up(spec.worker_id, rank):
                await self.replay(spec, rank)

    async def full_resync(self, spec: WorkerSpec, rank: int, reason: str) -> None:
        """Purge the rank and re-learn it by a replay from 0."""
        if await self.indexer.resync(spec.worker_id, rank, reason):
            await self.replay(spec, rank)

    # ---- verification and replay ---------------------------------------------------------------

    async def _resolve(self, feed: Feed, handled: Handled, frames: list[bytes]) -> None:
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
        return dealer_socket(self.ctx, rank_endpoint(spec.replay, rank), self.max_frame_bytes)

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
                    asked = start
                    first = True  # the next frame opens an answer: it may start past ``asked`` (buffer rolled)
                    while True:
                        raise_if_cancel_swallowed()
                        try:
                            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can drop a cancellation.
                            async with asyncio.timeout(self.replay_timeout_s):
                                frames = await dealer.recv_multipart()
                        except TimeoutError:
                            asked = await self._ask_again(spec, rank, dealer, asked)
                            first = True
                            continue
                        if frames and frames[0] == b"":
                            frames = frames[1:]
                        if len(frames) == 2:  # older vLLM: no topic frame
                            frames = [spec.topic.encode(), *frames]
                        if len(frames) != 3:
                            self.indexer.count_drop(spec.worker_id, "bad_replay_frames")
                            continue
                        if frames[1] == REPLAY_END_SEQ:
                            break
                        if not first and self._after_hole(spec, rank, frames[1]):
                            # The rest of this answer is on the old socket: closed with it.
                            dealer.close(0)
                            dealer = self._dealer(spec, rank)
                            asked = await self._resume(spec, rank, dealer)
                            first = True
                            continue
                        first = False
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

    def _after_hole(self, spec: WorkerSpec, rank: int, seq_frame: bytes) -> bool:
        """Whether a replayed batch comes after one the answer left out: the engine's ROUTER drops what its
        send queue cannot hold at that moment (a router starved of CPU drains it slowly) and goes on,
        end marker included, so the batches after the hole chain on blocks the index never learnt."""
        expected = self.indexer.expected_seq(spec.worker_id, rank)
        try:
            seq = decode_seq(seq_frame)
        except EventDecodeError:
            return False  # handle_message counts it
        return expected is not None and seq > expected

    async def _resume(self, spec: WorkerSpec, rank: int, dealer: zmq.asyncio.Socket) -> int:
        """Ask ``dealer`` for the worker's batches from where the index got to; returns that start."""
        start = self.indexer.expected_seq(spec.worker_id, rank)
        assert start is not None  # a replay runs only for a known entity
        self.metrics.replay_resumes.labels(entity_id(spec.worker_id, rank)).inc()
        await dealer.send_multipart([b"", encode_seq(start)])
        return start

    async def _ask_again(self, spec: WorkerSpec, rank: int, dealer: zmq.asyncio.Socket, asked: int) -> int:
        """A reply that went silent before its end marker: ask again from where the index now is, if the
        last answer moved it on (else the worker is not answering: ``TimeoutError``, the caller's outcome).

        An engine answers a replay from a ROUTER socket, which drops what its send queue cannot hold
        instead of waiting (vLLM sends the whole buffer in one loop, up to ``buffer_steps`` = 10,000
        batches): a long replay arrives cut, its end marker lost with the rest. Returns the new start."""
        now = self.indexer.expected_seq(spec.worker_id, rank)
        if now is None or now <= asked:
            raise TimeoutError
        return await self._resume(spec, rank, dealer)
