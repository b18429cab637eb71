"""The reconciler: merges what every discovery source sees and applies the difference to the pool.

Rules, in the order they matter in production:

- Static workers (the config's ``workers``) are never added, replaced or removed by discovery.
- A worker seen by several sources is added once; the first source (in the order given) owns it.
- A worker that disappears is removed only after staying away ``grace_s``: a pod that flaps between
  ready and unready, or a DNS answer that misses one address once, must not purge its KV index entries
  and re-subscribe its events each time.
- A worker whose configuration changed (same id, new address) is replaced at once: the address it had
  is no longer the worker.
- A source that fails keeps its last set (the source does not report, the reconciler keeps it): an API
  outage never empties the pool. A source whose ``run`` crashes is restarted with a bounded backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.config import WorkerConfig
from kvroute.router.discovery.base import Backoff, DiscoverySource, WorkerSink, describe
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("kvroute.discovery")

#: Fills in what a source could not know (e.g. KV-event endpoints from ``/kv_event_sources``) before an add.
Enrich = Callable[[WorkerConfig], Awaitable[WorkerConfig]]

#: How long a failed add waits before it is tried again.
RETRY_ADD_S = 5.0


class DiscoveryMetrics:
    """The discovery series, created on the registry given (the router's per-app one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry(auto_describe=True)
        self.workers = Gauge(
            "kvroute_discovery_workers",
            "Workers each discovery source currently sees",
            ["source"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.changes = Counter(
            "kvroute_discovery_changes_total",
            "Workers added, removed or updated by discovery",
            ["source", "change"],
            registry=r,
        )
        self.errors = Counter(
            "kvroute_discovery_errors_total",
            "Failed discovery attempts (source unreachable, bad answer, add refused)",
            ["source"],
            registry=r,
        )
        self.pending = Gauge(
            "kvroute_discovery_pending_removals",
            "Discovered workers gone but still inside the grace period",
            registry=r,
            multiprocess_mode="livemax",
        )


@dataclass(slots=True)
class _Applied:
    source: str
    #: As the source reported it (before enrichment): what a later report is compared with.
    wanted: WorkerConfig


class Discovery:
    """Runs the sources and keeps ``sink`` equal to the union of their sets (plus the static workers)."""

    def __init__(
        self,
        sources: Sequence[DiscoverySource],
        sink: WorkerSink,
        *,
        static_ids: Iterable[str] = (),
        grace_s: float = 30.0,
        registry: CollectorRegistry | None = None,
        enrich: Enrich | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        names = [source.name for source in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"discovery source names must be unique, got {names}")
        self.sources = list(sources)
        self.sink = sink
        self.static_ids = frozenset(static_ids)
        self.grace_s = grace_s
        self.metrics = DiscoveryMetrics(registry)
        self._enrich = enrich
        self._clock = clock
        #: The last complete set each source reported (kept through its failures).
        self._seen: dict[str, dict[str, WorkerConfig]] = {name: {} for name in names}
        self._reported: set[str] = set()
        self._applied: dict[str, _Applied] = {}
        #: worker id -> when it is removed unless it comes back first.
        self._pending: dict[str, float] = {}
        self._failed_adds: dict[str, int] = {}
        self._noted_static: set[str] = set()
        self._lock = asyncio.Lock()
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ what the sources say

    def _on_report(self, source: str, workers: Mapping[str, WorkerConfig]) -> None:
        current: dict[str, WorkerConfig] = {}
        for worker_id, cfg in workers.items():
            current[worker_id] = cfg if cfg.worker_id == worker_id else cfg.model_copy(update={"id": worker_id})
        self._seen[source] = current
        self._reported.add(source)
        self.metrics.workers.labels(source).set(len(current))
        self._dirty.set()

    def _on_error(self, source: str, message: str) -> None:
        self.metrics.errors.labels(source).inc()
        log.warning(
            "discovery source %s failed (keeping its last %d workers): %s", source, len(self._seen[source]), message
        )

    def _merged(self) -> dict[str, tuple[str, WorkerConfig]]:
        merged: dict[str, tuple[str, WorkerConfig]] = {}
        for source in self.sources:
            for worker_id, cfg in self._seen[source.name].items():
                if worker_id in self.static_ids:
                    if worker_id not in self._noted_static:
                        self._noted_static.add(worker_id)
                        log.info(
                            "worker %s seen by %s is also configured statically: the static entry wins",
                            worker_id,
                            source.name,
                        )
                    continue
                merged.setdefault(worker_id, (source.name, cfg))
        return merged

    # ------------------------------------------------------------------ applying the difference

    async def reconcile(self) -> None:
        """One pass: add what is new, replace what changed, remove what stayed away past the grace period."""
        async with self._lock:
            now = self._clock()
            merged = self._merged()
            for worker_id in list(self._applied):
                if worker_id in merged:
                    if self._pending.pop(worker_id, None) is not None:
                        log.info("worker %s is back before its grace period ended: kept", worker_id)
                    continue
                deadline = self._pending.get(worker_id)
                if deadline is None:
                    deadline = self._pending[worker_id] = now + self.grace_s
                    if self.grace_s > 0:
                        log.info(
                            "worker %s is no longer seen: removed in %.0f s unless it comes back",
                            worker_id,
                            self.grace_s,
                        )
                if now >= deadline:
                    await self._remove(worker_id)
            adds: list[tuple[str, WorkerConfig, str]] = []
            for worker_id, (source, cfg) in merged.items():
                applied = self._applied.get(worker_id)
                if applied is None:
                    adds.append((source, cfg, "added"))
                elif applied.wanted != cfg:
                    log.info("worker %s changed (%s -> %s): replacing it", worker_id, applied.wanted.url, cfg.url)
                    await self._drop(worker_id)
                    adds.append((source, cfg, "updated"))
            for worker_id in list(self._failed_adds):
                if worker_id not in merged:
                    del self._failed_adds[worker_id]
            # Adds probe the worker once each: in parallel, so one slow pod does not hold up the others.
            await asyncio.gather(*(self._add(source, cfg, change) for source, cfg, change in adds))
            self.metrics.pending.set(len(self._pending))

    async def _add(self, source: str, cfg: WorkerConfig, change: str) -> None:
        worker = cfg
        if self._enrich is not None:
            try:
                worker = await self._enrich(cfg)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # enrichment is best effort: the worker is still routable by load
                log.warning("could not complete worker %s's configuration: %s", cfg.worker_id, describe(exc))
        try:
            await self.sink.add(worker)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            count = self._failed_adds[cfg.worker_id] = self._failed_adds.get(cfg.worker_id, 0) + 1
            self.metrics.errors.labels(source).inc()
            level = logging.WARNING if count == 1 else logging.DEBUG
            log.log(
                level,
                "cannot add worker %s from %s (retrying every %.0f s): %s",
                cfg.worker_id,
                source,
                RETRY_ADD_S,
                describe(exc),
            )
            return
        self._failed_adds.pop(cfg.worker_id, None)
        self._applied[cfg.worker_id] = _Applied(source, cfg)
        self.metrics.changes.labels(source, change).inc()
        log.info("worker %s %s by %s: %s", cfg.worker_id, change, source, worker.url)

    async def _drop(self, worker_id: str) -> _Applied:
        applied = self._applied.pop(worker_id)
        self._pending.pop(worker_id, None)
        try:
            await self.sink.remove(worker_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.errors.labels(applied.source).inc()
            log.error("removing worker %s failed: %s", worker_id, describe(exc))
        return applied

    async def _remove(self, worker_id: str) -> None:
        applied = await self._drop(worker_id)
        self.metrics.changes.labels(applied.source, "removed").inc()
        log.warning("worker %s removed by discovery (%s no longer sees it)", worker_id, applied.source)

    # ------------------------------------------------------------------ views

    @property
    def workers(self) -> dict[str, WorkerConfig]:
        """The discovered workers currently applied to the sink (static ones excluded)."""
        return {worker_id: applied.wanted for worker_id, applied in self._applied.items()}

    def synced(self) -> bool:
        """True once every source has reported at least once."""
        return len(self._reported) == len(self.sources)

    def snapshot(self) -> dict[str, Any]:
        """For the admin API and logs: who sees what, and what is about to leave."""
        now = self._clock()
        return {
            "grace_s": self.grace_s,
            "sources": {name: sorted(seen) for name, seen in self._seen.items()},
            "applied": {worker_id: a.source for worker_id, a in sorted(self._applied.items())},
            "pending_removal_in_s": {w: max(0.0, d - now) for w, d in sorted(self._pending.items())},
            "failed_adds": dict(self._failed_adds),
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start every source and the reconciling loop (returns at once; see :meth:`wait_synced`)."""
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(self._run_source(source), name=f"discovery-{source.name}") for source in self.sources
        ]
        self._tasks.append(asyncio.create_task(self._loop(), name="discovery-reconcile"))

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait (bounded) until every source reported once and that was applied; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.synced() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.synced():
            return False
        await self.reconcile()
        return True

    async def stop(self) -> None:
        """Stop the sources and the loop. Discovered workers stay in the sink (the process is ending)."""
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)

    async def _run_source(self, source: DiscoverySource) -> None:
        backoff = Backoff(initial_s=1.0, max_s=60.0)
        name = source.name

        def report(workers: Mapping[str, WorkerConfig]) -> None:
            self._on_report(name, workers)

        def error(message: str) -> None:
            self._on_error(name, message)

        while True:
            raise_if_cancel_swallowed()
            try:
                await source.run(report, error)
                log.error("discovery source %s stopped by itself: restarting it", name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a source bug must not take discovery down: keep its set, restart it
                self.metrics.errors.labels(name).inc()
                log.exception("discovery source %s crashed (keeping its last set): %s", name, describe(exc))
            await asyncio.sleep(backoff.next())

    def _next_wake(self) -> float | None:
        waits: list[float] = []
        if self._pending:
            waits.append(min(self._pending.values()) - self._clock())
        if self._failed_adds:
            waits.append(RETRY_ADD_S)
        return max(0.0, min(waits)) if waits else None

    async def _loop(self) -> None:
        while True:
            raise_if_cancel_swallowed()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._next_wake()):
                    await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any single bad pass
                log.exception("discovery reconciliation failed")
