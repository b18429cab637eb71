"""The worker registry: who the workers are, whether they are up, what they serve and how loaded they are.

Workers come from the config and from the admin API at run time. Background tasks probe ``/health``
(with hysteresis so one slow probe does not flap a worker), discover models from ``/v1/models`` when the
config does not list them, and scrape vLLM's ``/metrics`` (DESIGN §9). The router's own in-flight counts
are updated on the hot path and are fresher than any scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import orjson
from kvroute.config import WorkerConfig
from kvroute.policies.base import WorkerView
from kvroute.router.metrics import RouterMetrics
from kvroute.router.transport import Transport
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvroute.registry")

#: vLLM metric names (DESIGN §9, counters without "_total") -> attribute of WorkerLoad.
_SCRAPED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # older vLLM name
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
}


@dataclass(slots=True)
class WorkerLoad:
    """Scraped from the worker's /metrics (summed over data-parallel ranks)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    #: vLLM >= 0.32's ``vllm:prompt_tokens_cached_by_source`` (device, host, disk, p2p, ...): ground truth.
    cached_by_source: dict[str, float] = field(default_factory=dict)
    scraped_at: float | None = None
    #: The router's in-flight count to the worker when the scrape was answered: what of ``running +
    #: waiting`` was ours then (see ``WorkerView.scraped_inflight``).
    inflight: int | None = None


@dataclass(slots=True)
class WorkerState:
    """Everything the router knows about one worker."""

    config: WorkerConfig
    #: None until the first probe answers; then flips only after unhealthy_after/healthy_after results.
    healthy: bool | None = None
    discovered_models: list[str] = field(default_factory=list)
    #: The worker's /v1/models entries by id (served back by the router's /v1/models).
    model_cards: dict[str, dict[str, object]] = field(default_factory=dict)
    inflight: int = 0
    load: WorkerLoad = field(default_factory=WorkerLoad)
    ok_streak: int = 0
    fail_streak: int = 0
    last_error: str | None = None
    changed_at: float = field(default_factory=time.time)
    #: Until when (monotonic) the worker counts as full: it refused a request (admission control).
    full_until: float = 0.0
    #: The last :meth:`view` and what it was made of: a request reads every worker's view, and most
    #: requests find none of it changed since the previous one.
    _view_memo: tuple[tuple[object, ...], WorkerView] | None = field(default=None, repr=False, compare=False)

    @property
    def id(self) -> str:
        return self.config.worker_id

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def models(self) -> list[str]:
        return self.config.models or self.discovered_models

    def serves(self, model: str) -> bool:
        return model in self.models

    def view(self) -> WorkerView:
        cfg, load = self.config, self.load
        made_of = (self.healthy, self.inflight, load, cfg)
        memo = self._view_memo
        if memo is not None and memo[0] == made_of:
            return memo[1]
        view = WorkerView(
            id=cfg.worker_id,
            role=cfg.role,
            healthy=bool(self.healthy),
            inflight=self.inflight,
            running=int(self.load.running),
            waiting=int(self.load.waiting),
            scraped_inflight=load.inflight,
            kv_usage=self.load.kv_usage,
            kv_blocks=self.load.num_gpu_blocks,
            p2p_host=cfg.p2p_host,
            p2p_port=cfg.p2p_port,
            served_by_source=load.cached_by_source,
        )
        self._view_memo = (made_of, view)
        return view

    def to_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.config.role,
            "models": self.models,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "running": self.load.running,
            "waiting": self.load.waiting,
            "kv_usage": self.load.kv_usage,
            "block_size": self.load.block_size,
            "prefix_cache_queries": self.load.prefix_queries,
            "prefix_cache_hits": self.load.prefix_hits,
            "last_error": self.last_error,
            "changed_at": self.changed_at,
        }


#: Every name the scrape reads, as ``# TYPE`` lines and samples spell it (a counter with and without ``_total``).
_READ_FAMILIES = frozenset(
    {*_SCRAPED, "vllm:cache_config_info", "vllm:prompt_tokens_cached_by_source"}
    | {f"{name}_total" for name in (*_SCRAPED, "vllm:prompt_tokens_cached_by_source")}
)


def _metric_name(line: str) -> str:
    """The metric name a sample line begins with (up to its labels or its value)."""
    end = len(line)
    for stop in ("{", " ", "\t"):
        cut = line.find(stop, 0, end)
        if cut >= 0:
            end = cut
    return line[:end]


def read_lines(text: str) -> str:
    """The lines of a Prometheus text page that :func:`parse_vllm_metrics` reads: the samples, ``# TYPE``
    and ``# HELP`` lines of the families it knows. An engine's page is mostly histograms it never reads
    (buckets by the dozen per family and label set), and the text parser costs milliseconds per page, in
    the event loop: filtered, it parses a few lines (measured in docs/design-notes.md). A line that does
    not start with a plain metric name (quoted UTF-8 names) is kept: the parser decides."""
    kept = []
    for line in text.splitlines():
        if not line:
            continue
        if line[0] == "#":
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("TYPE", "HELP") and parts[2] in _READ_FAMILIES:
                kept.append(line)
        elif line[0] == "{" or _metric_name(line) in _READ_FAMILIES:
            kept.append(line)
    kept.append("")
    return "\n".join(kept)


def parse_vllm_metrics(text: str, *, whole_page: bool = False) -> WorkerLoad:
    """Pick DESIGN §9's gauges and counters out of a Prometheus text page; unknown names are ignored.
    ``whole_page``: parse every line, not only :func:`read_lines`' (the same result, slower)."""
    load = WorkerLoad(scraped_at=time.time())
    usage: list[float] = []
    for family in text_string_to_metric_families(text if whole_page else read_lines(text)):
        # Match on sample names: the parser names a counter's family with or without "_total"
        # depending on how the TYPE line spells it.
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                raw = sample.labels.get("block_size")
                if raw and raw.isdigit():
                    load.block_size = int(raw)
                raw = sample.labels.get("num_gpu_blocks")
                if raw and raw.isdigit():  # per engine; the smallest rank is what limits admission
                    load.num_gpu_blocks = min(int(raw), load.num_gpu_blocks or int(raw))
                continue
            if name in ("vllm:prompt_tokens_cached_by_source_total", "vllm:prompt_tokens_cached_by_source"):
                source = sample.labels.get("source", "unknown")
                load.cached_by_source[source] = load.cached_by_source.get(source, 0.0) + float(sample.value)
                continue
            attr = _SCRAPED.get(name[:-6] if name.endswith("_total") else name)
            if attr is None:
                continue
            if attr == "kv_usage":
                usage.append(float(sample.value))
            else:
                setattr(load, attr, getattr(load, attr) + float(sample.value))
    if usage:
        load.kv_usage = max(usage)  # the fullest DP rank is what limits admission
    return load


def counters_went_back(before: WorkerLoad, after: WorkerLoad) -> bool:
    """Whether a monotonic engine counter is lower than at the previous scrape: the engine process restarted
    (its prefix cache with it). vLLM exports no prefix-cache reset count nor cached-block gauge, so a reset
    of a live engine shows here not at all; only its ``AllBlocksCleared`` event tells."""
    if after.prefix_queries < before.prefix_queries or after.prefix_hits < before.prefix_hits:
        return True
    now = after.cached_by_source  # a source missing from this page is no evidence (a partial or older page)
    return any(source in now and now[source] < value for source, value in before.cached_by_source.items())


class WorkerRegistry:
    """Workers by id, their health and load, and the background tasks that keep that fresh."""

    def __init__(
        self,
        workers: Iterable[WorkerConfig],
        transport: Transport,
        metrics: RouterMetrics,
        *,
        health_interval_s: float = 2.0,
        metrics_interval_s: float = 1.0,
        unhealthy_after: int = 2,
        healthy_after: int = 1,
        probe_timeout_s: float = 2.0,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        self._workers: dict[str, WorkerState] = {}
        #: Configured LoRA adapter -> base model (``models[].base_model``); a reload replaces it.
        self.adapters: dict[str, str] = dict(adapters or {})
        self._transport = transport
        self._metrics = metrics
        self.health_interval_s = health_interval_s
        self.metrics_interval_s = metrics_interval_s
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.probe_timeout_s = probe_timeout_s
        self._tasks: list[asyncio.Task[None]] = []
        self._oneoff: set[asyncio.Task[None]] = set()
        #: The latest end of any worker's refusal cool-down (0: none): views() filters only before it.
        self._full_until_max = 0.0
        #: Called with (worker_id, healthy) on each transition (e.g. the indexer purges a dead worker).
        self.listeners: list[Callable[[str, bool], None]] = []
        #: Called with (worker_id, reason) when a scrape shows the engine lost its prefix cache outside its KV
        #: events (its counters went back: it restarted); the index then doubts the worker's entries.
        self.cache_listeners: list[Callable[[str, str], None]] = []
        for cfg in workers:
            self._insert(cfg)

    # ------------------------------------------------------------------ membership

    def _insert(self, cfg: WorkerConfig) -> WorkerState:
        if cfg.worker_id in self._workers:
            raise ValueError(f"worker {cfg.worker_id!r} already exists")
        state = WorkerState(cfg)
        self._workers[cfg.worker_id] = state
        # Read at scrape time: keeps two locked metric updates per request off the hot path.
        self._metrics.watch_inflight(cfg.worker_id, lambda: state.inflight)
        self._metrics.healthy.labels(cfg.worker_id).set(0)
        return state

    async def add(self, cfg: WorkerConfig) -> WorkerState:
        """Add a worker at run time and probe it at once, so it can take traffic without waiting a period."""
        state = self._insert(cfg)
        await self._probe(state)
        return state

    def remove(self, worker_id: str) -> WorkerState:
        state = self._workers.pop(worker_id, None)
        if state is None:
            raise KeyError(worker_id)
        self._metrics.forget_worker(worker_id)
        log.info("worker %s removed", worker_id)
        return state

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    # ------------------------------------------------------------------ queries

    def models(self) -> list[str]:
        """Every model some worker serves (configured or discovered), deduplicated, in first-seen order."""
        seen: dict[str, None] = {}
        for state in self._workers.values():
            for model in state.models:
                seen.setdefault(model, None)
        return list(seen)

    def views(self, model: str | None) -> list[WorkerView]:
        """Healthy workers serving ``model`` (any model when None), as the policies see them. A worker that
        just refused a request (admission control) is left out until its cool-down ends, unless every
        candidate is in that state (then all are offered: someone has to take the request)."""
        serving = [s for s in self._workers.values() if s.healthy and (model is None or s.serves(model))]
        if self._full_until_max and time.monotonic() < self._full_until_max:  # someone refused recently
            now = time.monotonic()
            room = [s for s in serving if s.full_until <= now]
            serving = room or serving
        return [s.view() for s in serving]

    def reject(self, worker_id: str, status: int, cooldown_s: float) -> None:
        """``worker_id`` refused a request (503/429 before any byte): treat it as full for ``cooldown_s``."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.full_until = time.monotonic() + cooldown_s
            self._full_until_max = max(self._full_until_max, state.full_until)
        self._metrics.rejections.labels(worker_id, str(status)).inc()

    def knows_model(self, model: str) -> bool:
        return any(s.serves(model) for s in self._workers.values())

    def base_of(self, model: str) -> str | None:
        """The base model of LoRA adapter ``model`` (None for a base model). vLLM keys an adapter's blocks
        with the base's tokens plus the adapter's name, and its events come under the base: the configured
        mapping, else the ``parent`` a worker's /v1/models card names, says which base that is."""
        base = self.adapters.get(model)
        if base:
            return base
        for state in self._workers.values():
            card = state.model_cards.get(model)
            parent = card.get("parent") if card else None
            if isinstance(parent, str) and parent and parent != model:
                return parent
        return None

    def ready(self, expected_models: Iterable[str] = ()) -> tuple[bool, list[str]]:
        """Ready when every configured (or else known) model has at least one healthy worker."""
        models = list(expected_models) or self.models()
        missing = [m for m in models if not self.views(m)]
        return bool(models) and not missing, missing

    # ------------------------------------------------------------------ in-flight accounting (hot path)

    def acquire(self, worker_id: str) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.inflight += 1

    def release(self, worker_id: str) -> None:
        state = self._workers.get(worker_id)
        if state is not None and state.inflight > 0:
            state.inflight -= 1

    # ------------------------------------------------------------------ health

    def record(self, worker_id: str, ok: bool, error: str | None = None) -> None:
        """Count one probe (or a failed forward) and flip the state after enough results in a row."""
        state = self._workers.get(worker_id)
        if state is None:
            return
        if ok:
            state.ok_streak += 1
            state.fail_streak = 0
            flip = state.healthy is not True and (state.healthy is None or state.ok_streak >= self.healthy_after)
        else:
            state.fail_streak += 1
            state.ok_streak = 0
            state.last_error = error
            flip = state.healthy is not False and (state.healthy is None or state.fail_streak >= self.unhealthy_after)
        if flip:
            self._transition(state, ok, error)

    def _transition(self, state: WorkerState, healthy: bool, error: str | None) -> None:
        before = state.healthy
        state.healthy = healthy
        state.changed_at = time.time()
        self._metrics.healthy.labels(state.id).set(1 if healthy else 0)
        if healthy:
            log.info("worker %s is up (was %s)", state.id, _word(before))
        else:
            log.warning("worker %s is down (was %s): %s", state.id, _word(before), error)
        for listener in list(self.listeners):
            try:
                listener(state.id, healthy)
            except Exception:
                log.exception("health listener failed for %s", state.id)

    def stalled(self, worker_id: str, error: str) -> None:
        """The worker accepts connections but does not answer (a hung process, SIGSTOP): down at once,
        without waiting for ``unhealthy_after`` probes; a good probe brings it back as usual."""
        state = self._workers.get(worker_id)
        if state is None:
            return
        state.fail_streak = max(state.fail_streak, self.unhealthy_after)
        state.ok_streak = 0
        state.last_error = error
        if state.healthy is not False:
            self._transition(state, False, error)

    def probe_soon(self, worker_id: str) -> None:
        """Probe one worker now (a request to it stalled): a hang is confirmed in one probe timeout."""
        state = self._workers.get(worker_id)
        if state is not None:
            task = asyncio.create_task(self._probe(state), name=f"probe-{worker_id}")
            self._oneoff.add(task)
            task.add_done_callback(self._oneoff.discard)

    async def _probe(self, state: WorkerState) -> None:
        try:
            status, _ = await self._transport.get(state.url + "/health", self.probe_timeout_s)
            ok, error = status == 200, f"/health answered {status}"
        except TimeoutError:
            # /health is cheap on a live engine (vLLM's API server answers it while the GPU is busy): no
            # answer within the probe timeout means the process is stuck.
            self.stalled(state.id, f"/health did not answer within {self.probe_timeout_s:.1f} s")
            return
        except Exception as exc:  # any failure of a probe is a failed probe, never a crash
            ok, error = False, f"/health failed: {exc!r}"
        if ok and not state.config.models and (not state.discovered_models or state.healthy is not True):
            await self._discover(state)
        self.record(state.id, ok, None if ok else error)

    async def _discover(self, state: WorkerState) -> None:
        try:
            status, body = await self._transport.get(state.url + "/v1/models", self.probe_timeout_s)
            if status != 200:
                raise ValueError(f"status {status}")
            data = orjson.loads(body).get("data", [])
            cards = {m["id"]: m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}
            models = list(cards)
        except Exception as exc:
            log.warning("model discovery on %s failed: %r", state.id, exc)
            return
        if models != state.discovered_models:
            log.info("worker %s serves %s", state.id, ", ".join(models) or "nothing")
            state.discovered_models = models
        state.model_cards = cards

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(s) for s in list(self._workers.values())))

    # ------------------------------------------------------------------ load scraping

    async def _scrape(self, state: WorkerState) -> None:
        if state.healthy is False:
            return
        try:
            status, body = await self._transport.get(state.url + "/metrics", self.probe_timeout_s)
            if status != 200:
                return
            load = parse_vllm_metrics(body.decode("utf-8", "replace"))
            load.inflight = state.inflight
        except Exception as exc:
            log.debug("metrics scrape of %s failed: %r", state.id, exc)
            return
        previous, state.load = state.load, load
        if previous.scraped_at is not None and counters_went_back(previous, load):
            log.info("worker %s: engine counters went back (restarted): its cached blocks are gone", state.id)
            for cache_listener in list(self.cache_listeners):
                try:
                    cache_listener(state.id, "engine_restarted")
                except Exception:
                    log.exception("cache listener failed for %s", state.id)
        m = self._metrics
        m.worker_running.labels(state.id).set(load.running)
        m.worker_waiting.labels(state.id).set(load.waiting)
        m.worker_kv_usage.labels(state.id).set(load.kv_usage)
        for source, tokens in load.cached_by_source.items():
            m.engine_cached_by_source.labels(state.id, source).set(tokens)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(s) for s in list(self._workers.values())))
        self._metrics.publish()  # several serving processes: this one's in-flight counts, for the others

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Probe once (so a fresh router is ready as soon as its workers are), then keep probing."""
        await self.probe_all()
        await self.scrape_all()
        self._tasks = [
            asyncio.create_task(self._loop(self.probe_all, self.health_interval_s), name="health"),
            asyncio.create_task(self._loop(self.scrape_all, self.metrics_interval_s), name="scrape"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    @staticmethod
    async def _loop(step: Callable[[], Awaitable[None]], interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await step()
            except Exception:  # a background task must survive anything a worker sends
                log.exception("background step failed")


def _word(healthy: bool | None) -> str:
    return "unknown" if healthy is None else ("up" if healthy else "down")
